"""Local SGD: parameter averaging every H steps, post-local SGD, and DiLoCo."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src import strategy as st
from ddl_jax._src.compression_wire import reducer_metrics
from ddl_jax._src.data_parallel import check_builder_args, check_transform, local_value_and_grad
from ddl_jax._src.reducers import allreduce_mean, checks_vma


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``.
      opt_state: each worker's inner optimizer state, ``[N, ...]`` sharded ``P(axis)``.
      anchor: the global model at the last synchronisation, replicated ``P()``.
      outer_opt_state: the outer optimizer's state (DiLoCo), replicated ``P()``.
      reducer_state: each worker's state of the outer exchange's reducer, ``P(axis)``.
      step: steps taken so far, an int32 scalar, ``P()``.
    """

    params: Any
    opt_state: Any
    anchor: Any
    outer_opt_state: Any
    reducer_state: Any
    step: jax.Array


def local_sgd(
    loss_fn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    period: int,
    outer_optimizer: optax.GradientTransformation | None = None,
    average_optimizer_state: bool = False,
    warmup_sync_steps: int = 0,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
) -> st.Strategy:
    """Local SGD: every worker trains its own replica and they synchronise every H steps.

    Each worker i takes ``period`` (H) steps of ``optimizer`` on its own shard of the
    batches, then the workers agree on the pseudo-gradient
    ``Delta = (1/N) sum_i (anchor - theta_i)`` through ``reducer``, and
    ``anchor <- anchor - Delta`` (plain parameter averaging: the mean of the replicas) or,
    with an ``outer_optimizer``, ``anchor <- anchor + outer_optimizer(Delta)`` (DiLoCo).
    Every replica restarts from the new anchor. With H = 1 and SGD this is synchronous
    data-parallel SGD.

    With ``warmup_sync_steps`` = W > 0 the first W steps are synchronous (gradients
    all-reduced every step, so replicas stay equal) and local steps start after them
    (post-local SGD); the anchor is reset to the replicas at the end of the warm-up.

    References:
      Zinkevich et al., "Parallelized stochastic gradient descent", NeurIPS 2010.
      Lin et al., "Don't use large mini-batches, use local SGD", ICLR 2020, arXiv:1808.07217.
      Douillard et al., "DiLoCo: distributed low-communication training of language models",
      2023, arXiv:2311.08105 (inner AdamW; outer ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``).

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      optimizer: the inner optax optimizer, one state per worker.
      mesh: a mesh with axis ``axis``.
      period: H, local steps between synchronisations, >= 1.
      outer_optimizer: applied to the averaged pseudo-gradient at each synchronisation;
        ``None`` is plain averaging.
      average_optimizer_state: also average the workers' inner optimizer states when
        synchronising (otherwise each worker keeps its own).
      warmup_sync_steps: W, synchronous steps before local SGD starts, >= 0.
      reducer: how the pseudo-gradient is averaged (default ``ddl.allreduce_mean(axis)``);
        any reducer works, compressing ones included.
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.

    Returns:
      A ``Strategy`` with ``LocalSGDState``; metrics ``loss``, aux values,
      ``synchronised`` (1.0 on steps that ended with a synchronisation) and the reducer's
      metrics (``compression_ratio`` of the last exchange for a compressing reducer).
      ``params(state)`` is the mean of the replicas.
    """
    check_builder_args(loss_fn, optimizer, accumulate=accumulate, reducer=reducer)
    st.check_positive_int("period", period)
    st.check_positive_int("warmup_sync_steps", warmup_sync_steps, minimum=0)
    if outer_optimizer is not None:
        check_transform(
            "outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9, nesterov=True)"
        )
    st.check_mesh_axis(mesh, axis)
    mesh = st.explicit_mesh(mesh)
    reducer = allreduce_mean(axis) if reducer is None else reducer
    outer = outer_optimizer
    value_and_grad = local_value_and_grad(loss_fn, has_aux=has_aux, accumulate=accumulate)
    specs = LocalSGDState(P(axis), P(axis), P(), P(), P(axis), P())

    def init(params) -> LocalSGDState:
        st.check_params(params)
        return LocalSGDState(
            params=st.stack_for_workers(params, mesh, axis),
            opt_state=st.stack_for_workers(optimizer.init(params), mesh, axis),
            anchor=st.replicate(params, mesh),
            outer_opt_state=st.replicate(
                optax.EmptyState() if outer is None else outer.init(params), mesh
            ),
            reducer_state=st.stack_for_workers(reducer.init(params), mesh, axis),
            step=st.replicate(jnp.zeros((), jnp.int32), mesh),
        )

    def average(tree):
        return jax.tree.map(
            lambda x: (
                lax.pcast(lax.pmean(x, axis), axis, to="varying")
                if jnp.issubdtype(x.dtype, jnp.inexact)
                else x
            ),
            tree,
        )

    def keep(carry):
        return carry

    def catch_up(carry):
        # The warm-up kept the replicas equal through exact averages: the anchor takes
        # them as they are, not through the reducer (which may be lossy).
        params, opt_state, _, outer_state, reducer_state = carry
        anchor = jax.tree.map(lambda x: lax.pmean(x, axis), params)
        return params, opt_state, anchor, outer_state, reducer_state

    def synchronise(carry):
        params, opt_state, anchor, outer_state, reducer_state = carry
        delta = jax.tree.map(jnp.subtract, anchor, params)
        delta, reducer_state = reducer.update(delta, reducer_state, anchor)
        if outer is not None:
            updates, outer_state = outer.update(delta, outer_state, anchor)
            anchor = optax.apply_updates(anchor, updates)
        else:
            anchor = jax.tree.map(jnp.subtract, anchor, delta)
        if average_optimizer_state:
            opt_state = average(opt_state)
        params = lax.pcast(anchor, axis, to="varying")
        return params, opt_state, anchor, outer_state, reducer_state

    def worker_step(state: LocalSGDState, batch):
        params, opt_state = st.unstack(state.params), st.unstack(state.opt_state)
        (loss, aux), grads = value_and_grad(params, batch)
        warm = state.step < warmup_sync_steps
        if warmup_sync_steps:
            grads = lax.cond(warm, average, keep, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # 0: local step; 1: end of warm-up, the anchor catches up with the (equal) replicas;
        # 2: a synchronisation through the outer step.
        outer_sync = ~warm & ((state.step - warmup_sync_steps + 1) % period == 0)
        branch = jnp.where(outer_sync, 2, jnp.where(state.step == warmup_sync_steps - 1, 1, 0))
        carry = (params, opt_state, state.anchor, state.outer_opt_state)
        carry = lax.switch(
            branch,
            [keep, catch_up, synchronise],
            (*carry, st.unstack(state.reducer_state)),
        )
        params, opt_state, anchor, outer_state, reducer_state = carry
        metrics = lax.pmean({"loss": loss, **aux, **reducer_metrics(reducer_state)}, axis)
        metrics["synchronised"] = (branch == 2).astype(jnp.float32)
        new = LocalSGDState(
            st.restack(params), st.restack(opt_state), anchor, outer_state,
            st.restack(reducer_state), state.step + 1,
        )  # fmt: skip
        return new, metrics

    step = st.worker_step_over_batch(
        worker_step, mesh, axis, specs, loss_fn=loss_fn, has_aux=has_aux, accumulate=accumulate,
        worker_params=lambda state: st.one_worker(state.params), check_vma=checks_vma(reducer),
    )  # fmt: skip

    return st.Strategy(init, step, lambda state: st.replica_mean(state.params, mesh))
