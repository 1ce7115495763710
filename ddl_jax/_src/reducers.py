"""Reducers: optax transforms that turn per-worker gradients into one agreed gradient.

A reducer is an ``optax.GradientTransformation`` whose ``update`` runs inside a
strategy's ``shard_map``: it receives this worker's gradient (varying over the data
axis) and returns an update that every worker agrees on. Its ``init`` builds the state of
*one* worker; strategies give each worker its own copy (a leading axis sharded over the
data axis), so error-feedback residuals and similar per-worker memories stay local.
"""

from __future__ import annotations

import jax
import optax
from jax import lax

from ddl_jax._src.collectives import (
    check_axis_in_scope,
    ps_allreduce,
    ring_allreduce,
    tree_allreduce,
)

ALGORITHMS = {
    "psum": lax.psum,
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "ps": ps_allreduce,
}


class PermuteReducer(optax.GradientTransformation):
    """A reducer whose output JAX types as varying over the axis (built from ``ppermute``,
    ``all_gather`` or ``all_to_all``).

    Its output agrees across workers, but there is no cast from varying to invariant, so a
    strategy runs it in a ``shard_map`` with ``check_vma=False`` (see ``checks_vma``). Pass
    such a reducer to a strategy as it is, or chained with ``ddl.chain``: ``optax.chain``
    would hide the mark.
    """


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optax.chain`` for reducers: keeps the mark of a ``ddl.compression`` or explicit
    ring / tree / ps reducer among ``transforms``, so a strategy can run the chain.

    Example: ``ddl.chain(optax.clip_by_global_norm(1.0), ddl.compression.top_k(0.01))``
    clips each worker's gradient before it is compressed and averaged.
    """
    chained = optax.chain(*transforms)
    if all(checks_vma(t) for t in transforms):
        return chained
    return PermuteReducer(chained.init, chained.update)


def checks_vma(reducer: optax.GradientTransformation) -> bool:
    """Whether a strategy using ``reducer`` can let ``shard_map`` check replication types."""
    return not isinstance(reducer, PermuteReducer)


def allreduce_mean(axis: str = "data", algorithm: str = "psum") -> optax.GradientTransformation:
    """Averages updates over the workers of mesh axis ``axis``: ``g <- (1/N) sum_i g_i``.

    Args:
      axis: mesh axis the workers live on.
      algorithm: how the sum travels. ``"psum"``: XLA's all-reduce (the backend picks the
        implementation, NCCL/ICI/gloo). ``"ring"``, ``"tree"``, ``"ps"``: the explicit
        algorithms of ``ddl.collectives`` (ring, binomial tree, central parameter server),
        whose rounds and bytes show up in ``ddl.comm_stats``.

    Returns:
      A stateless ``optax.GradientTransformation`` to run inside ``shard_map``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"allreduce_mean: algorithm={algorithm!r} is not known; valid: {list(ALGORITHMS)}."
        )
    total = ALGORITHMS[algorithm]

    def update(updates, state, params=None):
        del params
        n = check_axis_in_scope(axis)
        return jax.tree.map(lambda s: s / n, total(updates, axis)), state

    kind = optax.GradientTransformation if algorithm == "psum" else PermuteReducer
    return kind(lambda params: optax.EmptyState(), update)
