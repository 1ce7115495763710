"""The Strategy abstraction and the checks and placements every strategy shares."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Params = Any
State = Any
Batch = Any
Metrics = dict[str, jax.Array]
LossFn = Callable[..., Any]


class Strategy(NamedTuple):
    """A distributed training strategy: three pure functions over pytrees.

    Attributes:
      init: ``params -> state``; places a full training state on the mesh.
      step: ``(state, global_batch) -> (state, metrics)``; one training step, pure and
        jittable (jit it with ``donate_argnums=0``). ``metrics`` is a flat dict of scalars
        holding at least ``loss``.
      params: ``state -> params``; the model to evaluate.
    """

    init: Callable[[Params], State]
    step: Callable[[State, Batch], tuple[State, Metrics]]
    params: Callable[[State], Params]


def check_mesh_axis(mesh: Mesh, axis: str, *, arg: str = "axis") -> int:
    """Returns the size of ``mesh``'s axis ``axis``; raises a clear error if it has none."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see ddl.make_mesh), got {type(mesh).__name__}."
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{arg}={axis!r} is not an axis of the mesh; valid axis names: {list(mesh.axis_names)}."
        )
    return mesh.shape[axis]


def explicit_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type Explicit, as strategies place and check shardings.

    ``jax.make_mesh`` (and ``ddl.make_mesh``) already make Explicit axes; a
    ``jax.sharding.Mesh`` built by hand has Auto ones, which ``jax.sharding.reshard`` refuses.
    """
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * mesh.devices.ndim)


def check_params(params: Params) -> None:
    """Raises ``TypeError`` unless ``params`` is a non-empty pytree of floating arrays."""
    if isinstance(params, nnx.Module):
        raise TypeError(
            f"params is a Flax NNX module ({type(params).__name__}); pass its parameters: "
            "loss_fn, params = ddl.flax.loss_from_module(module, loss)."
        )
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise TypeError(
            "params must be a non-empty pytree of floating-point arrays, got no leaves."
        )
    for path, leaf in leaves:
        if not isinstance(leaf, jax.Array | np.ndarray) or not jnp.issubdtype(
            leaf.dtype, jnp.inexact
        ):
            kind = getattr(leaf, "dtype", type(leaf).__name__)
            raise TypeError(
                f"params must be a pytree of floating-point arrays (jax.Array or np.ndarray); "
                f"params{jax.tree_util.keystr(path)} is {kind}."
            )


def check_loss_output(out: Any, *, has_aux: bool) -> None:
    """Checks the abstract output of ``loss_fn`` (from ``jax.eval_shape``)."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(
                "loss_fn was declared has_aux=True, so it must return (loss, aux_dict); "
                f"it returned {jax.tree.map(lambda s: s.shape, out)}."
            )
        loss, aux = out
        for name, value in aux.items():
            if (
                not isinstance(value, jax.ShapeDtypeStruct)
                or value.shape != ()
                or not jnp.issubdtype(value.dtype, jnp.floating)
            ):
                raise ValueError(
                    f"loss_fn's aux[{name!r}] must be a floating-point scalar metric (workers "
                    f"average it), got {value}."
                )
    else:
        loss = out
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        hint = " (or pass has_aux=True if it returns (loss, aux))" if isinstance(out, tuple) else ""
        raise ValueError(
            f"loss_fn must return a scalar loss{hint}; it returned shape {shape}. "
            "Reduce over the batch, e.g. with .mean()."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a floating-point loss, got dtype {loss.dtype}.")


def check_batch(batch: Batch, divisor: int, *, why: str) -> int:
    """Returns the global batch size; raises unless every leaf shares it and it divides.

    Args:
      batch: pytree whose leaves have a leading batch axis.
      divisor: the batch size must be a multiple of this.
      why: what ``divisor`` is made of, for the error message.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch must be a non-empty pytree of arrays with a leading batch axis.")
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
                "leading batch axis."
            )
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch leaves disagree on the batch size: {sizes}.")
    size = next(iter(sizes.values()))
    if size % divisor:
        raise ValueError(
            f"global batch size {size} is not divisible by {divisor} ({why}); use a multiple "
            f"of {divisor}, e.g. {max(divisor, size // divisor * divisor)}."
        )
    return size


def _place(tree: Any, sharding: NamedSharding, expand=lambda x: x) -> Any:
    # A jitted copy, not device_put: device_put may hand back the caller's own buffer for
    # the shard on its device, and the strategy's step donates the state it is given.
    return jax.jit(
        lambda t: jax.tree.map(lambda x: expand(jnp.copy(x)), t), out_shardings=sharding
    )(tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places a copy of every leaf on every device of ``mesh`` (``PartitionSpec()``)."""
    return _place(tree, NamedSharding(mesh, P()))


def stack_for_workers(tree: Any, mesh: Mesh, axis: str) -> Any:
    """Gives each worker on ``axis`` its own copy of ``tree`` (a leading axis, ``P(axis)``)."""
    n = mesh.shape[axis]
    return _place(tree, NamedSharding(mesh, P(axis)), lambda x: jnp.broadcast_to(x, (n, *x.shape)))


def shard_batch(batch: Batch, mesh: Mesh, axis: str) -> Batch:
    """Splits the leading axis of every batch leaf over ``axis`` (inside or outside jit)."""
    sharding = NamedSharding(mesh, P(axis))
    return jax.tree.map(lambda x: jax.sharding.reshard(jnp.asarray(x), sharding), batch)


def worker_step_over_batch(
    worker_step: Callable[[State, Batch], tuple[State, Metrics]],
    mesh: Mesh,
    axis: str,
    specs: Any,
    *,
    loss_fn: LossFn,
    has_aux: bool,
    accumulate: int,
    worker_params: Callable[[State], Params],
    check_vma: bool = True,
) -> Callable[[State, Batch], tuple[State, Metrics]]:
    """The ``Strategy.step`` of the data-parallel family, around a per-worker step.

    The step checks the global batch (it must divide by workers x ``accumulate``) and
    ``loss_fn`` on one micro-batch's shapes, shards the batch over ``axis``, and runs
    ``worker_step(state, local_batch)`` under ``shard_map``.

    Args:
      worker_step: ``(state, local_batch) -> (state, metrics)``, run on each worker.
      mesh: the strategy's mesh; ``axis``: its worker axis.
      specs: the ``PartitionSpec`` prefix of the state; metrics are replicated.
      loss_fn, has_aux: the user's loss.
      accumulate: micro-batches per worker per step.
      worker_params: ``state -> one worker's params`` (arrays or ``ShapeDtypeStruct``s).
      check_vma: whether ``shard_map`` checks replication types (see ``checks_vma``).
    """
    n = mesh.shape[axis]
    program = jax.shard_map(
        worker_step, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()),
        check_vma=check_vma,
    )  # fmt: skip

    def step(state: State, batch: Batch) -> tuple[State, Metrics]:
        size = check_batch(
            batch, n * accumulate, why=f"{n} workers on axis {axis!r} x accumulate={accumulate}"
        )
        batch = shard_batch(batch, mesh, axis)
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((size // (n * accumulate), *x.shape[1:]), x.dtype),
            batch,
        )
        check_loss_output(jax.eval_shape(loss_fn, worker_params(state), micro), has_aux=has_aux)
        try:
            return program(state, batch)
        except ValueError as e:
            if "can't be statically inferred" not in str(e):
                raise
            raise ValueError(
                "the reducer's output is not provably the same on every worker. A reducer "
                "must average over the workers (e.g. ddl.allreduce_mean()); a ddl.compression "
                "reducer or allreduce_mean(algorithm='ring'|'tree'|'ps') inside optax.chain "
                "loses the mark that lets strategies run it: chain it with ddl.chain instead."
            ) from e

    return step


def unstack(tree: Any) -> Any:
    """Inside ``shard_map``: this worker's entry of leaves stacked over the worker axis."""
    return jax.tree.map(lambda x: x[0], tree)


def restack(tree: Any) -> Any:
    """Inside ``shard_map``: the inverse of ``unstack``, for a ``P(axis)`` out_spec."""
    return jax.tree.map(lambda x: x[None], tree)


def one_worker(stacked: Any) -> Any:
    """Abstract shapes of one worker's entry of a worker-stacked pytree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)


def replica_mean(stacked: Any, mesh: Mesh) -> Any:
    """The average of worker-stacked replicas, replicated on ``mesh`` (for evaluation)."""
    return jax.jit(
        lambda t: jax.tree.map(  # summed in at least float32, so bf16 replicas lose nothing
            lambda x: x.mean(axis=0, dtype=jnp.promote_types(x.dtype, jnp.float32)).astype(x.dtype),
            t,
        ),
        out_shardings=NamedSharding(mesh, P()),
    )(stacked)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> None:
    """Raises ``ValueError`` unless ``value`` is an integer (Python or NumPy) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
