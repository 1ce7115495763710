"""Synchronous data parallelism: per-worker gradients, one all-reduce, one optimizer step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src import strategy as st
from ddl_jax._src.compression_wire import reducer_metrics
from ddl_jax._src.reducers import allreduce_mean, checks_vma


class DataParallelState(NamedTuple):
    """State of :func:`data_parallel`.

    Attributes:
      params: model parameters, replicated (``P()``).
      opt_state: optimizer state, replicated (``P()``).
      reducer_state: each worker's reducer state (error-feedback residuals and the like),
        with a leading worker axis sharded ``P(axis)``.
    """

    params: Any
    opt_state: Any
    reducer_state: Any


def check_transform(name: str, value, example: str) -> None:
    """Raises ``TypeError`` unless ``value`` is an optax ``GradientTransformation``."""
    if not all(callable(getattr(value, f, None)) for f in ("init", "update")):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (e.g. {example}), "
            f"got {type(value).__name__}."
        )


def check_builder_args(loss_fn, optimizer, *, accumulate: int, reducer=None) -> None:
    """Validates the arguments every gradient-based strategy builder shares."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (params, batch) -> loss, got {loss_fn!r}.")
    check_transform("optimizer", optimizer, "optax.adam(1e-3)")
    if reducer is not None:
        check_transform("reducer", reducer, "ddl.allreduce_mean() or ddl.compression.top_k(0.01)")
    st.check_positive_int("accumulate", accumulate)


def local_value_and_grad(loss_fn, *, has_aux: bool, accumulate: int):
    """Returns ``(params, batch) -> ((loss, aux), grads)``, averaged over micro-batches.

    The micro-batches are visited by ``lax.scan`` with a running sum, so memory holds one
    micro-batch's activations and one gradient, whatever ``accumulate`` is.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def one(params, batch):
        out, grads = grad_fn(params, batch)
        return (out if has_aux else (out, {})), grads

    if accumulate == 1:
        return one

    def accumulated(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(accumulate, -1, *x.shape[1:]), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(one, params, first))

        def add(total, mb):
            return jax.tree.map(jnp.add, total, one(params, mb)), None

        total, _ = jax.lax.scan(add, zeros, micro)
        return jax.tree.map(lambda x: x / accumulate, total)

    return accumulated


def data_parallel(
    loss_fn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
) -> st.Strategy:
    """Synchronous data-parallel SGD (the DDP / Horovod pattern) as a ``shard_map`` program.

    Each of the N workers on ``axis`` takes ``B/N`` examples of the global batch ``B``,
    computes its gradient ``g_i`` (averaged over ``accumulate`` micro-batches), the
    reducer agrees on ``g = (1/N) sum_i g_i`` (one all-reduce per step), and every worker
    applies the same optimizer update, so parameters stay replicated:
    ``theta <- theta + optimizer(reducer(g_1..g_N))``.

    Args:
      loss_fn: ``(params, batch) -> loss`` (a scalar mean over the batch), or
        ``(loss, aux_dict)`` with ``has_aux=True``; aux values must be scalars and are
        averaged over workers into the metrics.
      optimizer: an optax transform, applied after the reduction on every worker.
      mesh: a mesh with axis ``axis`` (see ``ddl.make_mesh``).
      reducer: optax transform that turns per-worker gradients into one agreed update,
        run inside ``shard_map``; default ``ddl.allreduce_mean(axis)``.
      accumulate: micro-batches per worker per step (gradient accumulation); the global
        batch must divide by ``N * accumulate``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.

    Returns:
      A ``Strategy`` whose state is a ``DataParallelState`` and whose metrics hold
      ``loss`` (mean over the global batch), the aux values, and the reducer's metrics
      (``compression_ratio`` for a ``ddl.compression`` reducer; see ``reducer_metrics``).
    """
    check_builder_args(loss_fn, optimizer, accumulate=accumulate, reducer=reducer)
    st.check_mesh_axis(mesh, axis)
    mesh = st.explicit_mesh(mesh)
    reducer = allreduce_mean(axis) if reducer is None else reducer
    value_and_grad = local_value_and_grad(loss_fn, has_aux=has_aux, accumulate=accumulate)
    specs = DataParallelState(params=P(), opt_state=P(), reducer_state=P(axis))

    def init(params) -> DataParallelState:
        st.check_params(params)
        params = st.replicate(params, mesh)
        return DataParallelState(
            params=params,
            opt_state=st.replicate(optimizer.init(params), mesh),
            reducer_state=st.stack_for_workers(reducer.init(params), mesh, axis),
        )

    def worker_step(state: DataParallelState, batch):
        # Differentiate a worker-varying view of the replicated params: under check_vma the
        # gradient of an invariant input is already psum'd, and the reducer must see g_i.
        local_params = jax.lax.pcast(state.params, axis, to="varying")
        (loss, aux), grads = value_and_grad(local_params, batch)
        reducer_state = st.unstack(state.reducer_state)
        updates, reducer_state = reducer.update(grads, reducer_state, state.params)
        updates, opt_state = optimizer.update(updates, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # One all-reduce carries the loss, the aux values and the reducer's own metrics.
        metrics = jax.lax.pmean({"loss": loss, **aux, **reducer_metrics(reducer_state)}, axis)
        return DataParallelState(params, opt_state, st.restack(reducer_state)), metrics

    step = st.worker_step_over_batch(
        worker_step, mesh, axis, specs, loss_fn=loss_fn, has_aux=has_aux, accumulate=accumulate,
        worker_params=lambda state: state.params, check_vma=checks_vma(reducer),
    )  # fmt: skip

    return st.Strategy(init=init, step=step, params=lambda state: state.params)
