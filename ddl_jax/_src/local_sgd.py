"""Local SGD: parameter averaging every H steps, post-local SGD, and DiLoCo."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.compression_wire import reducer_metrics
from ddl_jax._src.kit import Kit, prepare, restack, unstack
from ddl_jax._src.model_loss import AnyLoss, ModelVars, worker_key
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
    loss_fn: AnyLoss,
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
    data-parallel SGD. Model state (batch statistics) is each worker's own and averaged at
    every synchronisation; dropout keys differ per worker and step.

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

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> mesh = ddl.make_mesh(data=8)
      >>> strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=2)
      >>> state = strategy.init({"w": jnp.zeros(())})
      >>> for _ in range(2):
      ...     state, metrics = strategy.step(state, batch)
      >>> float(metrics["synchronised"]), round(float(strategy.params(state)["w"]), 6)
      (1.0, 0.36)
    """
    kit = prepare(loss_fn, optimizer, mesh, axis, accumulate, has_aux, reducer=reducer)
    period = check_int("period", period, minimum=1)
    warmup_sync_steps = check_int("warmup_sync_steps", warmup_sync_steps, minimum=0)
    if outer_optimizer is not None:
        check_transform(
            "outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9, nesterov=True)"
        )
    cfg = _Config(
        kit, optimizer, outer_optimizer, period, warmup_sync_steps, average_optimizer_state
    )
    specs = LocalSGDState(P(axis), P(axis), P(), P(), P(axis), ModelVars(P(axis), P(), P()))
    return Strategy(
        kit.init(functools.partial(_make_state, cfg), specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


class _Config(NamedTuple):
    kit: Kit
    optimizer: optax.GradientTransformation
    outer: optax.GradientTransformation | None
    period: int
    warmup: int
    average_optimizer_state: bool


def _make_state(cfg: _Config, params: Any, model: ModelVars) -> LocalSGDState:
    kit, outer = cfg.kit, cfg.outer
    return LocalSGDState(
        params=kit.stack(params),
        opt_state=kit.stack(cfg.optimizer.init(params)),
        anchor=params,
        outer_opt_state=optax.EmptyState() if outer is None else outer.init(params),
        reducer_state=kit.stack(kit.reducer.init(params)),
        model=model._replace(state=kit.stack(model.state)),
    )


def _worker_step(
    cfg: _Config, state: LocalSGDState, batch: Any
) -> tuple[LocalSGDState, dict[str, jax.Array]]:
    """One worker's step: a local step, then (on schedule) the warm-up's end or a sync."""
    kit, axis, warmup = cfg.kit, cfg.kit.axis, cfg.warmup
    params, opt_state = unstack(state.params), unstack(state.opt_state)
    step = state.model.step
    key = worker_key(state.model, lax.axis_index(axis))
    (loss, aux), grads, model_state = kit.value_and_grad(
        params, unstack(state.model.state), batch, key
    )
    warm = step < warmup
    if warmup:
        average = functools.partial(_average, axis=axis)
        grads, model_state = lax.cond(warm, average, _keep, (grads, model_state))
    updates, opt_state = cfg.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # 0: local step; 1: end of warm-up, the anchor catches up with the (equal) replicas;
    # 2: a synchronisation through the outer step.
    outer_sync = ~warm & ((step - warmup + 1) % cfg.period == 0)
    branch = jnp.where(outer_sync, 2, jnp.where(step == warmup - 1, 1, 0))
    carry = (params, opt_state, state.anchor, state.outer_opt_state)
    carry = (*carry, unstack(state.reducer_state), model_state)
    catch_up = functools.partial(_catch_up, axis=axis)
    sync = functools.partial(_synchronise, cfg=cfg)
    carry = lax.switch(branch, [_keep, catch_up, sync], carry)
    params, opt_state, anchor, outer_state, reducer_state, model_state = carry
    metrics = lax.pmean({"loss": loss, **aux, **reducer_metrics(reducer_state)}, axis)
    metrics["synchronised"] = (branch == 2).astype(jnp.float32)
    model = ModelVars(restack(model_state), state.model.key, step + 1)
    new = LocalSGDState(
        restack(params), restack(opt_state), anchor, outer_state, restack(reducer_state), model
    )
    return new, metrics


Carry = tuple[Any, Any, Any, Any, Any, Any]  # params, opt, anchor, outer, reducer, model state


def _average(tree: Any, axis: str) -> Any:
    """Every worker's floating leaves replaced by their mean over ``axis`` (still varying)."""

    def one(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        return lax.pcast(lax.pmean(x, axis), axis, to="varying")

    return jax.tree.map(one, tree)


def _keep(carry: Any) -> Any:
    return carry


def _catch_up(carry: Carry, axis: str) -> Carry:
    # The warm-up kept the replicas equal through exact averages: the anchor takes them as
    # they are, not through the reducer (which may be lossy).
    params, opt_state, _, outer_state, reducer_state, model_state = carry
    anchor = jax.tree.map(lambda x: lax.pmean(x, axis), params)
    return params, opt_state, anchor, outer_state, reducer_state, model_state


def _synchronise(carry: Carry, cfg: _Config) -> Carry:
    """The outer step: the reduced pseudo-gradient moves the anchor; replicas restart there."""
    params, opt_state, anchor, outer_state, reducer_state, model_state = carry
    delta = jax.tree.map(jnp.subtract, anchor, params)
    axis, outer = cfg.kit.axis, cfg.outer
    delta, reducer_state = cfg.kit.reducer.update(delta, reducer_state, anchor)
    if outer is not None:
        updates, outer_state = outer.update(delta, outer_state, anchor)
        anchor = optax.apply_updates(anchor, updates)
    else:
        anchor = jax.tree.map(jnp.subtract, anchor, delta)
    if cfg.average_optimizer_state:
        opt_state = _average(opt_state, axis)
    params = lax.pcast(anchor, axis, to="varying")
    return params, opt_state, anchor, outer_state, reducer_state, _average(model_state, axis)
