"""Local SGD: parameter averaging every H steps, post-local SGD, and DiLoCo."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.compression_wire import reducer_metrics
from ddl_jax._src.kit import prepare, replica_mean, restack, unstack
from ddl_jax._src.model_loss import ModelVars, worker_key
from ddl_jax._src.strategy import Strategy, check_int, check_transform


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``.
      opt_state: each worker's inner optimizer state, ``[N, ...]`` sharded ``P(axis)``.
      anchor: the global model at the last synchronisation, replicated ``P()``.
      outer_opt_state: the outer optimizer's state (DiLoCo), replicated ``P()``.
      reducer_state: each worker's state of the outer exchange's reducer, ``P(axis)``.
      model: each worker's model state (batch statistics), ``P(axis)``, averaged at every
        synchronisation (and every warm-up step); the run's key and the step count, ``P()``.
    """

    params: Any
    opt_state: Any
    anchor: Any
    outer_opt_state: Any
    reducer_state: Any
    model: ModelVars


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
) -> Strategy:
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
    kit = prepare(
        loss_fn, optimizer, mesh, axis=axis, reducer=reducer, accumulate=accumulate, has_aux=has_aux
    )
    period = check_int("period", period, minimum=1)
    warmup_sync_steps = check_int("warmup_sync_steps", warmup_sync_steps, minimum=0)
    if outer_optimizer is not None:
        check_transform(
            "outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9, nesterov=True)"
        )
    reducer, outer = kit.reducer, outer_optimizer
    specs = LocalSGDState(P(axis), P(axis), P(), P(), P(axis), ModelVars(P(axis), P(), P()))

    def make_state(params, model: ModelVars) -> LocalSGDState:
        return LocalSGDState(
            params=kit.stack(params),
            opt_state=kit.stack(optimizer.init(params)),
            anchor=params,
            outer_opt_state=optax.EmptyState() if outer is None else outer.init(params),
            reducer_state=kit.stack(reducer.init(params)),
            model=model._replace(state=kit.stack(model.state)),
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
        params, opt_state, _, outer_state, reducer_state, model_state = carry
        anchor = jax.tree.map(lambda x: lax.pmean(x, axis), params)
        return params, opt_state, anchor, outer_state, reducer_state, model_state

    def synchronise(carry):
        params, opt_state, anchor, outer_state, reducer_state, model_state = carry
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
        return params, opt_state, anchor, outer_state, reducer_state, average(model_state)

    def worker_step(state: LocalSGDState, batch):
        params, opt_state = unstack(state.params), unstack(state.opt_state)
        step = state.model.step
        key = worker_key(state.model, lax.axis_index(axis))
        (loss, aux), grads, model_state = kit.value_and_grad(
            params, unstack(state.model.state), batch, key
        )
        warm = step < warmup_sync_steps
        if warmup_sync_steps:
            grads, model_state = lax.cond(warm, average, keep, (grads, model_state))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # 0: local step; 1: end of warm-up, the anchor catches up with the (equal) replicas;
        # 2: a synchronisation through the outer step.
        outer_sync = ~warm & ((step - warmup_sync_steps + 1) % period == 0)
        branch = jnp.where(outer_sync, 2, jnp.where(step == warmup_sync_steps - 1, 1, 0))
        carry = (params, opt_state, state.anchor, state.outer_opt_state)
        carry = (*carry, unstack(state.reducer_state), model_state)
        carry = lax.switch(branch, [keep, catch_up, synchronise], carry)
        params, opt_state, anchor, outer_state, reducer_state, model_state = carry
        metrics = lax.pmean({"loss": loss, **aux, **reducer_metrics(reducer_state)}, axis)
        metrics["synchronised"] = (branch == 2).astype(jnp.float32)
        model = ModelVars(restack(model_state), state.model.key, step + 1)
        new = LocalSGDState(
            restack(params), restack(opt_state), anchor, outer_state, restack(reducer_state), model
        )
        return new, metrics

    def variables(state: LocalSGDState):
        model_state = replica_mean(state.model.state)
        return kit.variables(replica_mean(state.params), state.model._replace(state=model_state))

    return Strategy(
        kit.init(make_state, specs), kit.step(worker_step, specs), kit.replicated(variables)
    )
