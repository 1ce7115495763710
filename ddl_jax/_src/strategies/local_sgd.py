"""Local SGD: parameter averaging every H steps, post-local SGD, and DiLoCo."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.islands import (
    Exchange,
    Parts,
    check_outer_only,
    island_kit,
    over_islands,
)
from ddl_jax._src.core.kit import Kit, check_agrees, prepare, restack, unstack
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, worker_key
from ddl_jax._src.core.reducer import check_drop_reducer, reduce_arrived, reducer_metrics
from ddl_jax._src.core.strategy import (
    DATA,
    ISLAND,
    Strategy,
    check_int,
    check_transform,
    vary_over,
)
from ddl_jax._src.measure.consistency import CHURN_STREAM, arrivals, check_probability
from ddl_jax._src.reduce import collectives
from ddl_jax._src.reduce.allreduce import (
    allreduce_mean,
    in_buckets,
    reducer_for,
    worker_mean,
)


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
    loss_fn: AnyLoss | None = None,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    *,
    inner: Strategy | None = None,
    period: int | None = None,
    hierarchy: Sequence[tuple[int, int]] | Mapping[int, int] | None = None,
    schedule: str = "ddl",
    outer_optimizer: optax.GradientTransformation | None = None,
    average_optimizer_state: bool = False,
    state_periods: Mapping[str, int] | None = None,
    drop: float = 0.0,
    churn: float = 0.0,
    warmup_sync_steps: int = 0,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str | None = None,
    workers: int | None = None,
) -> Strategy:
    """Local SGD: every worker trains its own replica and they synchronise every H steps.

    Each worker i takes ``period`` (H) steps of ``optimizer`` on its shard of the batches,
    then the workers agree on ``Delta = (1/N) sum_i (anchor - theta_i)`` through
    ``reducer``; ``anchor <- anchor - Delta`` (parameter averaging) or ``anchor <- anchor +
    outer_optimizer(Delta)`` (DiLoCo), and every replica restarts from the new anchor. H = 1
    with SGD is synchronous SGD. Model state is each worker's, averaged at every sync.

    **Schedules.** Steps count t = 0, 1, ... (the counter before the step); the first
    ``warmup_sync_steps`` = W are synchronous (gradients all-reduced: post-local SGD). A
    synchronisation follows step t >= W when (t - W + 1) % H == 0 under ``schedule="ddl"``
    (the default: after every H local steps), or (t - W) % H == 0 under ``"torch"``:
    PyTorch's ``PeriodicModelAverager(period=H, warmup_steps=W)`` called after every
    optimizer step (the post-local SGD hook's ``start_localSGD_iter=W``). For H = 4,
    W = 2: "ddl" after steps 5, 9, 13, ...; "torch" after 2, 6, 10, ...

    **DES-LOC.** ``state_periods={"mu": K_u, "nu": K_v}`` averages each named field of the
    inner optimizer's state (Adam's moments, ``optax.ScaleByAdamState.mu`` / ``.nu``) on
    its own period, counted as ``period`` is; the paper recommends K_u = 3H, K_v = 6H. As
    the authors' code (Iacob-Alexandru-Andrei/torchtitan,
    ``torchtitan/experiments/fl/optimizers/desloc.py``): after each optimizer step, every
    quantity whose own step counter reached its period is replaced by its mean over the
    workers and its counter restarts; there is no other safeguard. (Averaging mu without
    nu spikes the loss where a worker's nu is ~0 and others' mu is not, e.g. inputs always
    0 in its shard: ``ddl-jax compare`` marks ``desloc:16`` diverged on digits, loss 2.3 to
    3e4 just after the first moment average at step 48, recovering to 0.94 accuracy.)

    **Hierarchy.** ``hierarchy=((H_1, G_1), ..., (H_L, N))`` (or a dict, as PyTorch's
    ``HierarchicalModelAverager``) replaces ``period``: after a step, the largest period
    dividing its count (t - W + 1 under "ddl", t under "torch") picks the level, which
    averages replicas (model state, and optimizer states with ``average_optimizer_state``)
    within contiguous blocks of G_l workers by G_l - 1 ``ppermute`` rounds; the top level
    is the synchronisation above.

    **Islands.** ``local_sgd(inner=strategy, period=...)`` makes each worker an *island*:
    ``strategy`` is ``ddl.data_parallel``, ``ddl.fsdp`` (stages 1 to 3) or
    ``ddl.tensor_parallel`` built on a mesh with an ``island`` axis
    (``ddl.make_mesh(island=2, data=4)``), so each island trains it on its own devices and
    its share of the batch, and only the outer exchange crosses islands. The anchor, the
    outer optimizer's state and the reducer's state (error feedback) are laid out like the
    inner parameters: each device keeps those of its own shard, and the exchange runs
    shard by shard over ``island`` (each device with its counterparts in the other islands),
    so a synchronisation sends 1/(island size) of the model per device under FSDP stage 3.
    The reducer must average over ``island`` (the default
    ``ddl.allreduce_mean("island")``; e.g. ``ddl.compression.sparse_loco(0.01,
    axis="island")``); a compressor then works on each device's shard (top-k, tiles and
    error feedback per shard), and the outer optimizer acts shard by shard (element-wise
    ones, as DiLoCo's SGD, act as on the whole model). Everything else above applies, the
    unit being the island: DES-LOC averages the inner optimizer's fields over islands,
    ``drop`` and ``churn`` lose islands, ``hierarchy`` groups islands. Not with
    ``warmup_sync_steps`` (the inner strategy's gradients stay within its island).

    **Unreliable workers** (``ddl.consistency.arrivals`` draws from the run's key). With
    ``drop`` = p a worker misses each synchronisation with probability p: left out of the
    mean, it keeps its replica and states (moments too), and the replicas disagree after
    it (``ddl.consistency.consensus_distance(state.params)`` > 0). With ``churn`` = q it is
    absent from each step after the warm-up with probability q: no step, no sync.

    References:
      Zinkevich et al. 2010; Lin et al., "Don't use large mini-batches, use local SGD",
      arXiv:1808.07217; Douillard et al., "DiLoCo", arXiv:2311.08105 (outer
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``); Iacob et al., "DES-LOC",
      arXiv:2505.22549; Wang et al., arXiv:2010.12998 (hierarchical SGD).

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); not with
        ``inner``.
      optimizer: the inner optax optimizer, one state per worker; not with ``inner``.
      mesh: a mesh with axis ``axis``; not with ``inner`` (whose mesh it is).
      inner: an island's strategy (Islands, above), instead of ``loss_fn``, ``optimizer``
        and ``mesh``.
      period: H, local steps between synchronisations, >= 1; give it or ``hierarchy``.
      hierarchy: ``(period, group_size)`` pairs (or a dict), averaging nested groups of
        workers at nested periods (above); give it or ``period``.
      schedule: ``"ddl"`` (after every H local steps) or ``"torch"`` (PyTorch's averagers'
        steps), above.
      outer_optimizer: applied to the averaged pseudo-gradient at each synchronisation;
        ``None`` is plain averaging.
      average_optimizer_state: also average the workers' inner optimizer states when
        synchronising (otherwise each worker keeps its own).
      state_periods: ``{field: period}`` of inner optimizer-state fields (DES-LOC, above).
      drop, churn: the probabilities that a worker misses a synchronisation, is absent;
        with a stateless mean (the default reducer, ``ddl.allreduce_mean`` with any
        algorithm, ``ddl.compression.cast`` or ``qsgd``: a worker left out sends zeros,
        rescaled away) or ``ddl.compression.sparse_loco`` (told who arrived, it combines
        only their messages and a worker left out keeps its accumulator); another
        reducer would take a left-out worker's zeros as its message.
      warmup_sync_steps: W, synchronous steps before local SGD starts, >= 0.
      reducer: how the pseudo-gradient is averaged (default ``ddl.allreduce_mean(axis)``);
        any reducer works, compressing ones included (with ``drop`` or ``churn``, only
        ``cast``, ``qsgd`` and ``sparse_loco``: above); or a function of the workers' axis
        returning one.
      accumulate: micro-batches per worker per step (with ``inner``: the inner's).
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)`` (with ``inner``: the
        inner's).
      axis: the mesh axis the workers live on: ``"data"`` by default, ``"island"`` (the
        only one) with ``inner``.
      workers: N, a multiple of the devices on ``axis`` (default: one a device): each
        device runs N / devices replicas through ``jax.vmap``, the run of N devices (the
        same keys, batch rows, masks and averages); a ``reducer`` then as a function of
        the axis (``data_parallel``'s ``workers``). Not with ``inner``.

    Returns:
      A ``Strategy`` with ``LocalSGDState``; metrics ``loss`` and aux values (the mean
      over every worker's replica on its rows, an absent one's too), ``synchronised``
      (1.0 after a synchronisation, a group's included), the reducer's metrics, and
      ``sync_group_size`` (hierarchy), ``synchronised_<field>`` (state_periods), ``arrived``
      (drop: the share of workers in this step's synchronisation, 0 without one).
      ``params(state)``: the replicas' mean. With ``inner``, an ``IslandsState`` whose
      ``outer`` is each device's ``(anchor, outer_opt_state, reducer_state)``; metrics the
      inner strategy's (averaged over islands) and the above.

    Example:
      >>> import jax, jax.numpy as jnp, optax, ddl_jax as ddl
      >>> loss_fn = lambda params, b: jnp.mean((b["x"] * params["w"] - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), period=2)
      >>> state = strategy.init({"w": jnp.zeros(())})
      >>> step = jax.jit(strategy.step)
      >>> for _ in range(2):
      ...     state, metrics = step(state, batch)
      >>> float(metrics["synchronised"]), round(float(strategy.params(state)["w"]), 6)
      (1.0, 0.36)
    """
    settings = (
        outer_optimizer,
        period,
        hierarchy,
        schedule,
        warmup_sync_steps,
        average_optimizer_state,
        state_periods,
        (drop, churn),
    )
    if inner is not None:
        if warmup_sync_steps:
            raise ValueError(
                "local_sgd: warmup_sync_steps needs gradients averaged across islands, which "
                "the inner strategy keeps within its island; use warmup_sync_steps=0 with "
                "inner=."
            )
        flat = (loss_fn, optimizer, mesh, accumulate, has_aux, workers, axis)
        return _over_islands(inner, flat, reducer, settings)
    axis = DATA if axis is None else axis
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        axis,
        accumulate,
        has_aux,
        reducer=reducer,
        default_reducer=allreduce_mean,
        workers=workers,
    )
    cfg = _configure(kit, optimizer, *settings)
    specs = LocalSGDState(P(axis), P(axis), P(), P(), P(axis), ModelVars(P(axis), P(), P()))
    return Strategy(
        kit.init(functools.partial(_make_state, cfg), specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


def _configure(
    kit: Any,
    optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation | None,
    period: Any,
    hierarchy: Any,
    schedule: str,
    warmup_sync_steps: Any,
    average_optimizer_state: bool,
    state_periods: Any,
    unreliable: tuple[Any, Any],
) -> _Config:
    """``local_sgd``'s arguments checked, and its schedule as periods and an offset."""
    levels = _levels(period, hierarchy, kit.n, kit.axis)
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}."
        )
    warmup_sync_steps = check_int("warmup_sync_steps", warmup_sync_steps, minimum=0)
    if outer_optimizer is not None:
        check_transform(
            "outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9, nesterov=True)"
        )
    # A level fires after step t >= W when its period divides t + offset: the local steps
    # since the warm-up (ddl), HierarchicalModelAverager's counter t or
    # PeriodicModelAverager's t - W (torch).
    if schedule == "ddl":
        offset = 1 - warmup_sync_steps
    else:
        offset = 0 if hierarchy is not None else -warmup_sync_steps
    return _Config(
        kit,
        optimizer,
        outer_optimizer,
        levels,
        offset,
        hierarchy is not None,
        warmup_sync_steps,
        average_optimizer_state,
        _state_periods(state_periods, average_optimizer_state),
        *_unreliable_settings(kit.reducer, *unreliable),
    )


def _unreliable_settings(reducer: Any, drop: Any, churn: Any) -> tuple[float, float]:
    """``drop`` and ``churn`` checked, and the reducer with them (``check_drop_reducer``)."""
    drop, churn = check_probability("drop", drop), check_probability("churn", churn)
    check_drop_reducer("local_sgd", reducer, drop, churn)
    return drop, churn


def _state_periods(
    state_periods: Any, average_optimizer_state: bool
) -> tuple[tuple[str, int], ...]:
    """``state_periods`` checked, as ``(field, period)`` pairs."""
    if state_periods is None:
        return ()
    if not isinstance(state_periods, Mapping) or not all(isinstance(k, str) for k in state_periods):
        raise TypeError(
            "state_periods must be a dict {field: period} of optimizer-state fields, e.g. "
            f'{{"mu": 48, "nu": 96}} for Adam; got {state_periods!r}.'
        )
    if average_optimizer_state:
        raise ValueError(
            "state_periods and average_optimizer_state=True both say when the optimizer "
            "state is averaged; give one."
        )
    return tuple(
        (k, check_int(f"state_periods[{k!r}]", h, minimum=1)) for k, h in state_periods.items()
    )


#: The valid values of ``local_sgd``'s ``schedule``.
SCHEDULES = ("ddl", "torch")


def _levels(period: Any, hierarchy: Any, n: int | None, axis: str) -> tuple[tuple[int, int], ...]:
    """``(period, group_size)`` per level, periods increasing, the last group all ``n``
    (``None``: not known yet, not checked)."""
    if (period is None) == (hierarchy is None):
        raise ValueError(
            "local_sgd takes period=H or hierarchy=((H_1, G_1), ..., (H_L, N)), exactly one; "
            f"got period={period!r}, hierarchy={hierarchy!r}."
        )
    if period is not None:
        return ((check_int("period", period, minimum=1), n),)
    pairs = list(hierarchy.items()) if isinstance(hierarchy, Mapping) else hierarchy
    if (
        isinstance(pairs, str | bytes)
        or not isinstance(pairs, Sequence)
        or not pairs
        or not all(isinstance(p, Sequence) and len(p) == 2 for p in pairs)
    ):
        raise TypeError(
            "hierarchy must be a non-empty sequence of (period, group_size) pairs or a dict "
            f"{{period: group_size}}, e.g. ((2, 2), (4, {n})); got {hierarchy!r}."
        )
    levels = tuple(
        (
            check_int(f"hierarchy[{i}]'s period", h, minimum=1),
            check_int(f"hierarchy[{i}]'s group size", g, minimum=1),
        )
        for i, (h, g) in enumerate(pairs)
    )
    periods, sizes = [h for h, _ in levels], [g for _, g in levels]
    if any(a >= b for a, b in itertools.pairwise(periods)):
        raise ValueError(
            f"hierarchy's periods must increase (the largest period dividing a step picks its "
            f"group), got {periods}."
        )
    if any(a >= b or b % a for a, b in itertools.pairwise(sizes)):
        raise ValueError(
            f"hierarchy's group sizes must increase, each dividing the next (nested groups), "
            f"got {sizes}."
        )
    if n is not None and sizes[-1] != n:
        raise ValueError(
            f"hierarchy's last group size must be the number of workers on axis {axis!r}, "
            f"{n}, got {sizes[-1]}."
        )
    return levels


class _Config(NamedTuple):
    kit: Kit
    optimizer: optax.GradientTransformation
    outer: optax.GradientTransformation | None
    levels: tuple[tuple[int, int], ...]  # (period, group size), the last all workers
    offset: int  # a level fires after step t >= warmup when (t + offset) % its period == 0
    hierarchical: bool
    warmup: int
    average_optimizer_state: bool
    state_periods: tuple[tuple[str, int], ...]  # DES-LOC: (optimizer-state field, period)
    drop: float  # the probability that a worker misses a synchronisation
    churn: float  # the probability that a worker is absent from a step


class Carry(NamedTuple):
    """One worker's view of the state, as the synchronisation branches take and return it.

    Attributes:
      params: this worker's replica.
      opt_state: this worker's inner optimizer state.
      anchor: the global model at the last synchronisation (equal on every worker).
      outer_opt_state: the outer optimizer's state (DiLoCo; equal on every worker).
      reducer_state: this worker's state of the outer exchange's reducer.
      model_state: this worker's model state (batch statistics).
    """

    params: Any
    opt_state: Any
    anchor: Any
    outer_opt_state: Any
    reducer_state: Any
    model_state: Any


def _check_state_periods(cfg: _Config, opt_state: Any) -> None:
    """Every field ``state_periods`` names is in the inner optimizer's state."""
    for name, _ in cfg.state_periods:
        nodes = jax.tree.leaves(opt_state, is_leaf=functools.partial(_has_field, name=name))
        if not any(_has_field(node, name) for node in nodes):
            raise ValueError(
                f"state_periods names {name!r}, but the inner optimizer's state has no such "
                f"field; its state: {jax.tree.map(jnp.shape, opt_state)}."
            )


def _make_state(cfg: _Config, params: Any, model: ModelVars) -> LocalSGDState:
    kit, outer = cfg.kit, cfg.outer
    opt_state = cfg.optimizer.init(params)
    _check_state_periods(cfg, opt_state)
    return LocalSGDState(
        params=kit.stack(params),
        opt_state=kit.stack(opt_state),
        anchor=params,
        outer_opt_state=optax.EmptyState() if outer is None else outer.init(params),
        reducer_state=kit.stack(kit.reducer.init(params)),
        model=model._replace(state=kit.stack(model.state)),
    )


def _worker_step(
    cfg: _Config, state: LocalSGDState, batch: Any
) -> tuple[LocalSGDState, dict[str, jax.Array]]:
    """One worker's step: a local step, then (on schedule) the warm-up's end or a sync."""
    kit, axis, warmup = cfg.kit, cfg.kit.workers_axis, cfg.warmup
    params, opt_state = unstack(state.params), unstack(state.opt_state)
    step = state.model.step
    key = worker_key(state.model, lax.axis_index(axis))
    (loss, aux), grads, model_state = kit.value_and_grad(
        params, unstack(state.model.state), batch, key
    )
    warm = step < warmup
    if warmup:
        average = functools.partial(worker_mean, axis=axis)
        grads, model_state = lax.cond(warm, average, _keep, (grads, model_state))
    updates, new_opt_state = cfg.optimizer.update(grads, opt_state, params)
    before = (params, opt_state, unstack(state.model.state))
    params, opt_state = optax.apply_updates(params, updates), new_opt_state
    present, arrived = _unreliable(cfg, state.model, warm)
    if present is not None:  # an absent worker takes no step
        here = present[lax.axis_index(axis)]
        params, opt_state, model_state = _select(here, (params, opt_state, model_state), before)
    carry = Carry(
        params=params,
        opt_state=opt_state,
        anchor=state.anchor,
        outer_opt_state=state.outer_opt_state,
        reducer_state=unstack(state.reducer_state),
        model_state=model_state,
    )
    carry, schedule = _exchange(cfg, carry, step, warm, arrived)
    # over every worker's replica and rows, an absent one's too: the global batch's loss
    metrics = lax.pmean({"loss": loss, **aux, **reducer_metrics(carry.reducer_state)}, axis)
    model = ModelVars(restack(carry.model_state), state.model.key, step + 1)
    new = LocalSGDState(
        params=restack(carry.params),
        opt_state=restack(carry.opt_state),
        anchor=carry.anchor,
        outer_opt_state=carry.outer_opt_state,
        reducer_state=restack(carry.reducer_state),
        model=model,
    )
    return new, {**metrics, **schedule}


def _exchange(
    cfg: _Config, carry: Carry, step: jax.Array, warm: jax.Array, arrived: jax.Array | None
) -> tuple[Carry, dict[str, jax.Array]]:
    """What follows a worker's local step ``step``: on schedule, the warm-up's end, a
    synchronisation, a group's average, DES-LOC's state averages. Returns the carry and the
    schedule's metrics."""
    axis = cfg.kit.workers_axis
    # 0: local step; 1: end of warm-up, the anchor catches up with the (equal) replicas;
    # 2: a synchronisation through the outer step; 3 + l: level l's group average. The
    # level with the largest period that fires wins.
    branch = jnp.where(step == cfg.warmup - 1, 1, 0)
    branches = [
        _keep,
        functools.partial(_catch_up, axis=axis),
        functools.partial(_synchronise, cfg=cfg, arrived=arrived),
    ]
    sizes = [0, 0, cfg.kit.n]
    for period, size in cfg.levels:
        fires = ~warm & ((step + cfg.offset) % period == 0)
        branch = jnp.where(fires, 2 if size == cfg.kit.n else len(branches), branch)
        if size != cfg.kit.n:
            branches.append(functools.partial(_group_average, cfg=cfg, size=size, arrived=arrived))
            sizes.append(size)
    carry = lax.switch(branch, branches, carry)
    metrics = {"synchronised": (branch >= 2).astype(jnp.float32)}
    if arrived is not None:
        share = jnp.mean(arrived.astype(jnp.float32))
        metrics["arrived"] = jnp.where(branch >= 2, share, 0.0)  # a group's average too
    # DES-LOC's averages wait for the switch: XLA:CPU may otherwise run their collectives and
    # the switch's in another order on each device, which crashed (islands, cores shared).
    # The anchor's first entry is an output of the switch, and never unequal to itself.
    first = jax.tree.leaves(carry.anchor)[0].reshape(-1)[0]
    for name, period in cfg.state_periods:
        fires = ~warm & ((step + cfg.offset) % period == 0) | (first != first)
        average = functools.partial(_average_field, name=name, axis=axis, arrived=arrived)
        carry = carry._replace(opt_state=lax.cond(fires, average, _keep, carry.opt_state))
        metrics[f"synchronised_{name}"] = fires.astype(jnp.float32)
    if cfg.hierarchical:
        metrics["sync_group_size"] = jnp.asarray(sizes, jnp.float32)[branch]
    return carry, metrics


def _unreliable(cfg: _Config, model: ModelVars, warm: jax.Array) -> tuple[Any, Any]:
    """``bool[N]`` masks of this step: the workers present (all during the warm-up;
    ``None`` without churn), and those present whose synchronisation message would arrive
    (``None`` when every worker is reliable)."""
    present = arrived = None
    if cfg.churn:
        present = arrivals(model.key, model.step, cfg.kit.n, cfg.churn, CHURN_STREAM) | warm
        arrived = present
    if cfg.drop:
        arrived = arrivals(model.key, model.step, cfg.kit.n, cfg.drop)
        arrived = arrived if present is None else arrived & present
    return present, arrived


def _has_field(node: Any, name: str) -> bool:
    return isinstance(node, tuple) and name in getattr(node, "_fields", ())


def _average_field(tree: Any, name: str, axis: str, arrived: jax.Array | None) -> Any:
    """``tree`` with field ``name`` of each named tuple in it averaged over ``axis`` (over
    the workers that ``arrived``, if given)."""

    def one(node: Any) -> Any:
        if not _has_field(node, name):
            return node
        return node._replace(**{name: worker_mean(getattr(node, name), axis, arrived)})

    return jax.tree.map(one, tree, is_leaf=functools.partial(_has_field, name=name))


def _keep(carry: Any) -> Any:
    return carry


def _catch_up(carry: Carry, axis: str) -> Carry:
    # The warm-up kept the replicas equal through exact averages: the anchor takes them as
    # they are, not through the reducer (which may be lossy).
    return carry._replace(anchor=in_buckets(lambda flat: lax.pmean(flat, axis), carry.params))


def _synchronise(carry: Carry, cfg: _Config, arrived: jax.Array | None) -> Carry:
    """The outer step: the reduced pseudo-gradient moves the anchor; replicas restart there.

    With ``arrived`` (``bool[N]``, unreliable workers) the mean is over the workers whose
    message arrived, and the others keep their replica and states.
    """
    params, opt_state, anchor = carry.params, carry.opt_state, carry.anchor
    outer_state = carry.outer_opt_state
    delta = jax.tree.map(jnp.subtract, anchor, params)
    axis, outer = cfg.kit.workers_axis, cfg.outer
    mine = None if arrived is None else arrived[lax.axis_index(axis)]
    if arrived is None:
        delta, reducer_state = cfg.kit.reducer.update(delta, carry.reducer_state, anchor)
    else:  # the mean over those that arrived; none: no outer step (below)
        delta, reducer_state = reduce_arrived(
            cfg.kit.reducer, delta, carry.reducer_state, anchor, arrived, axis
        )
    check_agrees(delta, P(), "the reduced pseudo-gradient")
    before = anchor, outer_state
    if outer is not None:
        updates, outer_state = outer.update(delta, outer_state, anchor)
        anchor = optax.apply_updates(anchor, updates)
    else:
        anchor = jax.tree.map(jnp.subtract, anchor, delta)
    if arrived is not None:
        anchor, outer_state = _select(jnp.any(arrived), (anchor, outer_state), before)
    if cfg.average_optimizer_state:
        opt_state = worker_mean(opt_state, axis, arrived)
    new = vary_over(anchor, axis)
    if arrived is not None:
        new = _select(mine, new, params)
    return carry._replace(
        params=new,
        opt_state=opt_state,
        anchor=anchor,
        outer_opt_state=outer_state,
        reducer_state=reducer_state,
        model_state=worker_mean(carry.model_state, axis, arrived),
    )


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _group_average(carry: Carry, cfg: _Config, size: int, arrived: jax.Array | None) -> Carry:
    """Replicas (and model, optimizer states) averaged within blocks of ``size`` workers
    (over those that ``arrived``; the others keep theirs)."""
    axis, n = cfg.kit.workers_axis, cfg.kit.n
    mean = functools.partial(_block_mean, axis=axis, n=n, size=size, arrived=arrived)
    opt_state = carry.opt_state
    if cfg.average_optimizer_state:
        opt_state = mean(opt_state)
    return carry._replace(
        params=mean(carry.params), opt_state=opt_state, model_state=mean(carry.model_state)
    )


def _block_mean(
    tree: Any, axis: collectives.Axis, n: int, size: int, arrived: jax.Array | None = None
) -> Any:
    """Each floating leaf's mean over the worker's block ``k size, ..., (k+1) size - 1``;
    with ``arrived`` (``bool[N]``), over the block's members that arrived, and a worker
    that did not (or whose block has none that did) keeps its own.

    ``shard_map`` collectives take no ``axis_index_groups``, so the block's members arrive
    by ``size - 1`` ``ppermute`` rounds within the block (round r: from the member r places
    before); each worker sums them in member order, so the block's results are equal.
    Several workers a device (``axis`` a pair): each round is ``collectives.ppermute``'s,
    a send per device shift.
    """
    me = lax.axis_index(axis)
    position = me % size
    rounds = [[(s, s - s % size + (s % size + r) % size) for s in range(n)] for r in range(1, size)]

    def one(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.inexact) or size == 1:
            return x
        sent = jnp.stack([x] + [collectives.ppermute(x, axis, perm) for perm in rounds])
        by_member = sent[(position - jnp.arange(size)) % size]  # member j's value at j
        if arrived is None:
            return jnp.sum(by_member, axis=0) / size
        members = arrived[me - position + jnp.arange(size)]  # in member order
        kept = jnp.where(members.reshape((size,) + (1,) * x.ndim), by_member, 0)
        mean = (jnp.sum(kept, axis=0) / jnp.maximum(members.sum(), 1)).astype(x.dtype)
        return jnp.where(arrived[me], mean, x)  # one that arrived: its block has one

    return jax.tree.map(one, tree)


def _over_islands(
    inner: Strategy, flat: tuple[Any, ...], reducer: Any, settings: tuple[Any, ...]
) -> Strategy:
    """``local_sgd(inner=...)``: the outer method over an island-stacked inner strategy,
    each device running ``_exchange`` on its shard with ``axis="island"``."""
    names = ("loss_fn", "optimizer", "mesh", "accumulate", "has_aux", "workers")
    check_outer_only("local_sgd", dict(zip(names, flat[:6], strict=True)), flat[6], (None, ISLAND))
    reducer = reducer_for(reducer, ISLAND)
    # checked at the call, as without islands (a hierarchy's last group against the
    # island count once the inner state gives it)
    _configure(SimpleNamespace(n=None, axis=ISLAND, reducer=reducer), None, *settings)

    def method(mesh: Any, params: Any) -> Exchange:
        kit = island_kit(mesh, reducer)
        cfg = _configure(kit, None, *settings)

        def start(params: Any) -> tuple[Any, Any, Any]:
            outer = optax.EmptyState() if cfg.outer is None else cfg.outer.init(params)
            return params, outer, reducer.init(params)

        return Exchange(
            start,
            functools.partial(_island_exchange, cfg),
            keeps_before=bool(cfg.churn),
            check=lambda inner_state: _check_state_periods(cfg, inner_state.opt_state),
        )

    return over_islands(inner, method, "local_sgd")


def _island_exchange(
    cfg: _Config, parts: Parts, before: Parts | None, outer: Any, clock: Any
) -> tuple[Parts, Any, dict[str, jax.Array]]:
    """One device's exchange over islands: flat local SGD's ``_exchange`` on its shard."""
    key, step = clock
    present, arrived = _unreliable(cfg, ModelVars(None, key, step), jnp.asarray(False))
    if present is not None:  # an absent island took no step
        parts = _select(present[lax.axis_index(ISLAND)], parts, before)
    params, opt_state, model_state, inner_reducer_state = parts
    anchor, outer_opt_state, reducer_state = outer
    carry = Carry(params, opt_state, anchor, outer_opt_state, reducer_state, model_state)
    carry, metrics = _exchange(cfg, carry, step, jnp.asarray(False), arrived)
    metrics |= lax.pmean(reducer_metrics(carry.reducer_state), ISLAND)
    parts = (carry.params, carry.opt_state, carry.model_state, inner_reducer_state)
    return parts, (carry.anchor, carry.outer_opt_state, carry.reducer_state), metrics
