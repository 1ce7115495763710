"""Reducers: optax transforms that turn per-worker gradients into one agreed gradient.

A reducer is an ``optax.GradientTransformation`` whose ``update`` runs inside a
strategy's ``shard_map``: it receives this worker's gradient (varying over the data
axis) and returns an update that every worker agrees on. Its ``init`` builds the state of
*one* worker; strategies give each worker its own copy (a leading axis sharded over the
data axis), so error-feedback residuals and similar per-worker memories stay local.

A reducer built from ``psum`` or from ``all_gather(..., to="invarying")`` (every
``ddl.compression`` reducer) returns an update JAX types as invariant over the axis: it is
a plain optax transform, and ``optax.chain`` composes it with any other. Only the explicit
``ppermute`` algorithms (``allreduce_mean(algorithm="ring" | "tree" | "ps")``) return
values typed as varying; they carry the ``PermuteReducer`` mark, which ``ddl.chain`` keeps.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ddl_jax._src.core.flat import map_fused
from ddl_jax._src.core.reducer import (
    PermuteReducer,
    ScatterReducer,
    checks_vma,
    mark_leaves_zeros_out,
)
from ddl_jax._src.core.strategy import check_real, check_transform, vary_over
from ddl_jax._src.reduce.collectives import (
    check_axis_in_scope,
    ps_allreduce,
    ring_allreduce,
    tree_allreduce,
)
from ddl_jax._src.xla_cpu import tunings

#: The bucket size in MiB where buckets are used (DDP's default).
BUCKET_MB = 25.0


def default_bucket_bytes() -> int | None:
    """``bucket_mb="auto"``: leaf by leaf (``None``), or 25 MiB buckets with the XLA:CPU
    tunings on where collectives cross processes over gloo (``xla_cpu/tunings.py``).

    XLA combines per-leaf all-reduces into one op, but XLA:CPU's gloo makes one call per
    buffer: one bucket pays off where a process has one core and loses where processes
    share cores, and within one process XLA:CPU reduces separate buffers concurrently
    and one large buffer slowly (``docs/figures.md``). On GPUs and TPUs XLA combines
    per-leaf collectives itself.
    """
    if tunings.cluster():
        return int(BUCKET_MB * 2**20)
    return None


def in_buckets(collective: Any, tree: Any, bucket_bytes: int | str | None = "auto") -> Any:
    """``collective`` (a function of one array) applied to ``tree``'s leaves, packed in
    buckets of ``bucket_bytes`` (``"auto"``: ``default_bucket_bytes()``; ``None``: leaf by
    leaf)."""
    if bucket_bytes == "auto":
        bucket_bytes = default_bucket_bytes()
    if bucket_bytes is None:
        return jax.tree.map(collective, tree)
    return map_fused(collective, tree, bucket_bytes)


def worker_mean(tree: Any, axis: str, arrived: jax.Array | None = None) -> Any:
    """Every worker's floating leaves replaced by the workers' mean over ``axis``.

    Called inside ``shard_map`` on one worker's pytree; the result still varies over
    ``axis``, and non-floating leaves (counters, keys) are kept as they are. The leaves
    travel in buckets, as ``allreduce_mean``'s.

    Args:
      tree: this worker's pytree (a replica, an optimizer or model state).
      axis: the mesh axis the workers live on.
      arrived: ``bool[N]``, the workers whose message arrives (``None``: all). Only they
        enter the mean and only they take it; the others (dropped workers) keep their
        leaves. If none arrived, every worker keeps its own.

    Returns:
      ``tree`` with every floating leaf averaged, its structure and dtypes unchanged.
    """
    if lax.axis_size(axis) == 1:  # one worker: its own mean, whether it arrived or not
        return tree
    mine = None if arrived is None else arrived[lax.axis_index(axis)]
    count = None if arrived is None else jnp.maximum(jnp.sum(arrived), 1)

    def mean(flat: jax.Array) -> jax.Array:
        if arrived is None:
            return vary_over(lax.pmean(flat, axis), axis)
        average = (lax.psum(jnp.where(mine, flat, 0), axis) / count).astype(flat.dtype)
        return jnp.where(mine, average, flat)

    return on_floating(lambda leaves: in_buckets(mean, leaves), tree)


def on_floating(fn: Any, tree: Any) -> Any:
    """``tree`` with its floating leaves replaced by ``fn(list of them)``; the others
    (counters, keys) kept as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    floating = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    for i, x in zip(floating, fn([leaves[i] for i in floating]), strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


ALGORITHMS = {
    "psum": lax.psum,
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "ps": ps_allreduce,
}


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optax.chain`` that keeps the mark of an explicit ring / tree / ps all-reduce among
    ``transforms``, so a strategy can run the chain.

    Without such a reducer it is ``optax.chain`` itself: ``psum``-based and
    ``ddl.compression`` reducers compose with plain ``optax.chain`` too.

    Example:
      Clip each worker's gradient, then average with the ring algorithm:

      >>> import optax, ddl_jax as ddl
      >>> ring = ddl.allreduce_mean(algorithm="ring")
      >>> reducer = ddl.chain(optax.clip_by_global_norm(1.0), ring)
      >>> type(reducer).__name__  # the mark: strategies run it without the replication check
      'PermuteReducer'
    """
    if any(isinstance(t, ScatterReducer) for t in transforms):
        raise ValueError(
            "chain: a scatter reducer (ddl.compression.scatter_*) is ddl.fsdp's reducer on "
            "its own; it does not chain with others."
        )
    chained = optax.chain(*transforms)
    if all(checks_vma(t) for t in transforms):
        return chained
    return PermuteReducer(chained.init, chained.update)


def _bucketed_psum(tree: Any, axis: str, bucket_bytes: int | str | None) -> Any:
    if lax.axis_size(axis) == 1:  # one worker: nothing travels, no buffers to pack
        return lax.psum(tree, axis)
    return in_buckets(lambda x: lax.psum(x, axis), tree, bucket_bytes)


def allreduce_mean(
    axis: str = "data", algorithm: str = "psum", bucket_mb: float | str | None = "auto"
) -> optax.GradientTransformation:
    """Averages updates over the workers of mesh axis ``axis``: ``g <- (1/N) sum_i g_i``.

    Args:
      axis: mesh axis the workers live on; with a strategy's ``workers=`` (several
        workers a device), the strategy's ``(axis, VIRTUAL)``: give the reducer as a
        function of it, ``reducer=lambda axis: ddl.allreduce_mean(axis, algorithm="ring")``.
      algorithm: how the sum travels. ``"psum"``: XLA's all-reduce (the backend picks the
        implementation, NCCL/ICI/gloo). ``"ring"``, ``"tree"``, ``"ps"``: the explicit
        algorithms of ``ddl.collectives`` (ring, binomial tree, central parameter server),
        whose rounds and bytes show up in ``ddl.comm_stats`` (with ``workers=``,
        ``ddl.sim.per_worker`` gives a worker's exactly for the ring; the tree's moves
        within a device and the parameter server's gather are the simulation's).
      bucket_mb: with ``"psum"``, the leaves of a dtype travel packed in flat buckets of
        at most this many MiB (a larger leaf alone), one all-reduce each, as DDP's
        gradient buckets. ``None``: one all-reduce per leaf, which XLA may combine into
        one op (XLA:CPU's gloo still runs it leaf by leaf). ``"auto"``: ``None``, or
        25 MiB with the XLA:CPU tunings on and more than one CPU process (see
        ``default_bucket_bytes``; ``benchmarks/peers.py`` measures both). The explicit
        algorithms always fuse each dtype into one buffer.

    Returns:
      A stateless ``optax.GradientTransformation`` to run inside ``shard_map``.

    Example:
      Inside ``shard_map`` each worker passes its own gradient and gets the mean:

      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = ddl.make_mesh(data=4)
      >>> reducer = ddl.allreduce_mean()
      >>> def worker(g):  # g: this worker's row of the [4, 2] gradients
      ...     mean, _ = reducer.update(g[0], reducer.init(g[0]))
      ...     return mean
      >>> grads = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("data")))
      >>> print(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P())(grads))
      [3. 4.]

      A strategy takes it as ``reducer=`` (it is the default):
      ``ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=ddl.allreduce_mean())``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"allreduce_mean: algorithm={algorithm!r} is not known; valid: {list(ALGORITHMS)}."
        )
    total = ALGORITHMS[algorithm]
    if bucket_mb is None or bucket_mb == "auto":
        bucket_bytes = bucket_mb
    elif isinstance(bucket_mb, str):
        raise ValueError(f"bucket_mb must be 'auto', None or a size in MiB > 0, got {bucket_mb!r}.")
    else:
        bucket_bytes = int(check_real("bucket_mb", bucket_mb, minimum=0, exclusive=True) * 2**20)
    if algorithm == "psum":
        total = partial(_bucketed_psum, bucket_bytes=bucket_bytes)

    def update(updates, state, params=None):
        del params
        n = check_axis_in_scope(axis)
        return jax.tree.map(lambda s: s / n, total(updates, axis)), state

    kind = optax.GradientTransformation if algorithm == "psum" else PermuteReducer
    return kind(lambda params: optax.EmptyState(), mark_leaves_zeros_out(update))


def reducer_for(reducer: Any, axis: str) -> optax.GradientTransformation:
    """A strategy's ``reducer=`` for the workers of ``axis``: ``None`` is the plain mean, a
    function of the axis is called with it, and what results is checked."""
    if reducer is None:
        return allreduce_mean(axis)
    if not hasattr(reducer, "update") and callable(reducer):
        reducer = reducer(axis)
    check_transform("reducer", reducer, f"ddl.allreduce_mean({axis!r})")
    return reducer
