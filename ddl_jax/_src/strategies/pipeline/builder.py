"""Pipeline model parallelism: GPipe, 1F1B and decoupled delayed gradients (DDG).

K stages live on the ``stage`` mesh axis, one per device; activations travel to the next
stage and error gradients to the previous one by ``ppermute``, inside a ``lax.scan`` over
the ticks of a schedule computed in numpy (``schedules``). Stages may differ in
parameters and in activation shapes: each stage's parameters are one flat vector (padded
to the largest stage, so they stack over the ``stage`` axis) and activations travel as flat
buffers padded to the largest boundary, unpacked by the receiving stage. A stage may carry
model state (batch statistics) and draw dropout keys: its state is one flat vector too,
stacked over ``stage`` like the parameters.

:func:`pipeline` checks its arguments once into a ``PipelineConfig`` (:func:`_setup`) and
hands it to one of two builders on the kit: :func:`_exact_pipeline` (GPipe, 1F1B) and
:func:`_ddg_pipeline`; their per-device programs are in ``programs``. A process
whose devices all belong to one stage runs GPipe and 1F1B as that stage's program alone
(:func:`process_stage`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core import model_loss as ml
from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.kit import Kit, abstract, prepare
from ddl_jax._src.core.model_loss import ModelLoss, ModelVars
from ddl_jax._src.core.strategy import DATA, STAGE
from ddl_jax._src.reduce.allreduce import allreduce_mean
from ddl_jax._src.strategies.pipeline.programs import ddg_step, stage_step, synchronous_step
from ddl_jax._src.strategies.pipeline.schedules import (
    SCHEDULES,
    Costs,
    Schedule,
    check_costs,
    make_schedule,
)
from ddl_jax._src.strategies.pipeline.stages import (
    build_stages,
    check_like,
    check_stages,
    flop_costs,
)
from ddl_jax._src.strategies.pipeline.types import (
    DDG_FORWARDS,
    DDGState,
    Metrics,
    PipelineConfig,
    PipelineState,
    StageFn,
    Stages,
)
from ddl_jax._src.xla_cpu import tunings


def _micro_shapes(batch: Any, count: int) -> Any:
    """Abstract shapes of one of the ``count`` micro-batches ``batch`` is cut into."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // count, *x.shape[1:]), x.dtype), batch
    )


def _setup(
    stages: Any,
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    microbatches: int,
    schedule: str,
    example_batch: Any,
    reducer: optax.GradientTransformation | None,
    tick_costs: str | Costs,
    ddg_forward: str | None = None,
) -> tuple[Kit, PipelineConfig]:
    """What both builders share: the checked arguments, the kit and the config."""
    if isinstance(loss_fn, ModelLoss):
        raise ValueError(
            "ddl.pipeline's loss_fn is (last stage's output, micro-batch) -> loss, without "
            "model state or a key; a ddl.ModelLoss is not supported there. Put the layers "
            "with batch norm or dropout in a stage instead: ddl.pipeline_stages(modules) "
            "makes stateful stages, or pass (ddl.ModelLoss(fn, seed), variables) as a stage."
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, batch) -> loss, got {loss_fn!r}.")
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        axis=DATA,
        add_axes=(DATA, STAGE),
        reducer=reducer,
        default_reducer=allreduce_mean,
    )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known; valid: {list(SCHEDULES)}.")
    m_ = st.check_int("microbatches", microbatches, minimum=1)
    k_ = kit.mesh.shape[STAGE]
    applies, views, state_views = check_stages(stages, k_, tuple(mesh.axis_names))
    param_len = max(v.size for v in views)
    param_dtype = jnp.result_type(*[d for v in views for d in v.dtypes])
    state_dtypes = [d for v in state_views for d in v.dtypes]
    state_dtype = jnp.result_type(*state_dtypes) if state_dtypes else jnp.dtype(jnp.float32)
    # A reducer that needs the stages' trees (power_sgd) refuses their flat vectors itself.
    jax.eval_shape(kit.reducer.init, jax.ShapeDtypeStruct((param_len,), param_dtype))
    if ddg_forward is not None and schedule != "ddg":
        raise ValueError(
            f"ddg_forward= chooses how 'ddg' forwards; schedule={schedule!r} has no delay."
        )
    if ddg_forward is not None and ddg_forward not in DDG_FORWARDS:
        raise ValueError(f"ddg_forward={ddg_forward!r} is not known; valid: {list(DDG_FORWARDS)}.")
    if schedule == "ddg" and tick_costs != "flops":
        raise ValueError("tick_costs= groups the ticks of 'gpipe' and '1f1b'; 'ddg' has none.")
    if isinstance(tick_costs, str):
        if tick_costs not in ("flops", "unit"):
            raise ValueError(
                f"tick_costs={tick_costs!r} is not known; valid: 'flops', 'unit', or "
                f"{k_} pairs (forward, backward), one per stage."
            )
    else:
        check_costs(tick_costs, k_, "tick_costs")
    if schedule == "ddg" and k_ > 1 and example_batch is None:
        raise ValueError(
            "schedule='ddg' with K > 1 stages needs example_batch= (a global batch or its "
            "jax.ShapeDtypeStructs): its state stashes activations of that shape."
        )
    cfg = PipelineConfig(
        applies=tuple(applies),
        views=tuple(views),
        state_views=tuple(state_views),
        loss_fn=loss_fn,
        optimizer=optimizer,
        reducer=kit.reducer,
        param_len=param_len,
        param_dtype=param_dtype,
        state_len=max(v.size for v in state_views),
        state_dtype=state_dtype,
        k=k_,
        n=kit.n,
        m=m_,
        example=None,
        transposes_weight_gradients=kit.transposes_weight_gradients,
        ddg_forward=ddg_forward or DDG_FORWARDS[0],
    )
    if example_batch is not None:
        st.check_batch(example_batch, cfg.divisor, why=cfg.why)
        cfg = cfg._replace(example=abstract(example_batch))
        build_stages(cfg, _micro_shapes(cfg.example, cfg.divisor))
    return kit, cfg


def _stage_vectors(
    kit: Kit, cfg: PipelineConfig, variables: Any
) -> tuple[jax.Array, Any, Any, ModelVars]:
    """Inside ``make_state``: the stages' flat parameters ``[K, P]``, each stage's optimizer
    state, each (data worker, stage)'s reducer state ``[N, K, ...]``, and the model side
    (the stages' flat model states ``[K, S]``, the key from the stateful stages' seed)."""
    if not isinstance(variables, Sequence) or len(variables) != cfg.k:
        raise ValueError(
            f"params must be a sequence of {cfg.k} stage parameter pytrees (one per stage; "
            "{'params': ..., 'batch_stats': ...} for a stateful one), got "
            f"{type(variables).__name__}"
            + (f" of length {len(variables)}." if isinstance(variables, Sequence) else ".")
        )
    flat, states = [], []
    for i, (v, apply, view, sview) in enumerate(
        zip(variables, cfg.applies, cfg.views, cfg.state_views, strict=True)
    ):
        try:
            p, s = ml.split_variables(apply, v)
        except TypeError as e:
            raise TypeError(f"params[{i}]: stage {i} is stateful: {e}") from None
        try:
            st.check_params(p)
        except TypeError as e:
            raise TypeError(f"params[{i}]: {e}") from None
        check_like(f"params[{i}]", p, view)
        check_like(f"params[{i}]'s model state", s, sview)
        flat.append(view.ravel(p, cfg.param_len, cfg.param_dtype))
        states.append(sview.ravel(s, cfg.state_len, cfg.state_dtype))
    stacked = jnp.stack(flat)
    # Each stage's reducer starts from reducer.init of its own (flat) parameters, and each
    # of its data workers from a copy of that state.
    reducer_state = kit.stack(jax.vmap(cfg.reducer.init)(stacked))
    model = ml.init_vars(cfg.seed_stage, jnp.stack(states) if cfg.state_len else {})
    try:
        opt_state = jax.vmap(cfg.optimizer.init)(stacked)
    except (ValueError, TypeError) as e:  # a mask or labels shaped like the stages' trees
        raise ValueError(
            f"pipeline: optimizer.init failed on a stage's parameters, which the optimizer "
            f"sees as one flat vector of {cfg.param_len} entries, not as their tree: a mask "
            "or labels (optax.masked, multi_transform) must be a function of that vector or "
            f"one such array. It raised {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
    return stacked, opt_state, reducer_state, model


def _local_stages(cfg: PipelineConfig, batch: Any) -> Stages:
    """Inside ``shard_map``: the stages for ``batch``, this data worker's share of a global
    batch that must have ``example_batch``'s shapes if one was given."""
    if cfg.example is not None:
        given = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] * cfg.n, *x.shape[1:]), x.dtype), batch
        )
        if given != cfg.example:
            raise ValueError(
                f"batch shapes {given} differ from example_batch {cfg.example}, which "
                "fixed the shapes of the pipeline's stashed activations."
            )
    return build_stages(cfg, _micro_shapes(batch, cfg.m))


def _stage_params(kit: Kit, cfg: PipelineConfig) -> Callable[[Any], list[Any]]:
    """``Strategy.params``: the K stages' variables, as a list in ``init``'s layout."""
    replicated = NamedSharding(kit.mesh, P())

    def stage_params(state: PipelineState | DDGState) -> list[Any]:
        stacked = jax.sharding.reshard(state.params, replicated)
        states = jax.sharding.reshard(state.model.state, replicated) if cfg.state_len else None
        out = []
        for i, (apply, view, sview) in enumerate(
            zip(cfg.applies, cfg.views, cfg.state_views, strict=True)
        ):
            model_state = sview.unravel(states[i]) if cfg.state_len else {}
            out.append(ml.join_variables(apply, view.unravel(stacked[i]), model_state))
        return out

    return kit.replicated(stage_params)


# Each stage's model state lives with its stage; the key and the step count are replicated.
MODEL_SPECS = ModelVars(state=P(STAGE), key=P(), step=P())


def process_stage(mesh: Mesh) -> int | None:
    """The stage of every device of ``mesh`` this process holds, where it holds devices of
    one stage only and other processes hold the other stages (one stage per process or
    host), on CPU devices with the XLA:CPU tunings on (``xla_cpu/tunings.py``): its GPipe
    / 1F1B step is then that stage's program alone (``stage_step``). ``None`` otherwise:
    every stage's work behind a switch.

    Processes that compile different programs meet in their messages in the schedule's
    order; this is checked with gloo's CPU collectives, so other platforms keep the switch.
    """
    if jax.process_count() == 1 or not tunings.active_on(mesh.devices.flat[0].platform):
        return None
    axis = mesh.axis_names.index(STAGE)
    mine = {
        index[axis]
        for index, device in np.ndenumerate(mesh.devices)
        if device.process_index == jax.process_index()
    }
    return mine.pop() if len(mine) == 1 else None


def _plan(
    cfg: PipelineConfig, schedule: str, tick_costs: str | Costs, fns: Stages, batch: Any
) -> Schedule:
    """The ticks of a GPipe or 1F1B step on ``batch`` (a data worker's share), grouped by
    ``tick_costs`` (``make_schedule(costs=...)``)."""
    # 1F1B's last stage backpropagates each micro-batch right after its forward: one tick.
    fold = schedule == "1f1b"
    costs = (
        flop_costs(cfg, fns, _micro_shapes(batch, cfg.m)) if tick_costs == "flops" else tick_costs
    )
    if costs is None or isinstance(costs, str):  # "unit", or a backend without flop counts
        return make_schedule(cfg.k, cfg.m, schedule, fold_last=fold)
    return make_schedule(cfg.k, cfg.m, schedule, fold_last=fold, costs=costs)


def _exact_pipeline(
    kit: Kit, cfg: PipelineConfig, schedule: str, tick_costs: str | Costs
) -> st.Strategy:
    """GPipe or 1F1B: each step runs the schedule's ticks, then updates every stage once
    with the exact gradient of the global batch."""
    specs = PipelineState(
        params=P(STAGE), opt_state=P(STAGE), reducer_state=P(DATA, STAGE), model=MODEL_SPECS
    )

    def make_state(variables: Sequence[Any], _: ModelVars) -> PipelineState:
        return PipelineState(*_stage_vectors(kit, cfg, variables))

    def worker_step(state: PipelineState, batch: Any) -> tuple[PipelineState, Metrics]:
        fns = _local_stages(cfg, batch)
        plan = _plan(cfg, schedule, tick_costs, fns, batch)
        stage = process_stage(kit.mesh)
        if stage is None:
            return synchronous_step(cfg, plan, fns, state, batch)
        return stage_step(cfg, plan, fns, state, batch, stage)

    return st.Strategy(
        init=kit.init(make_state, specs),
        step=kit.step(worker_step, specs, divisor=cfg.divisor, why=cfg.why),
        params=_stage_params(kit, cfg),
    )


def _ddg_pipeline(kit: Kit, cfg: PipelineConfig) -> st.Strategy:
    """DDG: each step runs M ticks, each a forward, a delayed backward and an update on
    every stage; the stashed activations keep the pipeline full between steps."""
    cells = P(DATA, STAGE)
    specs = DDGState(
        params=P(STAGE),
        opt_state=P(STAGE),
        reducer_state=cells,
        inputs=cells,
        inbox=cells,
        history=P(DATA),
        tick=P(),
        model=MODEL_SPECS,
    )
    # The stashed activations' shapes: those of example_batch's micro-batches.
    micro = _micro_shapes(cfg.example, cfg.divisor) if cfg.k > 1 else None
    fns = build_stages(cfg, micro) if cfg.k > 1 else None

    def make_state(variables: Sequence[Any], _: ModelVars) -> DDGState:
        inputs = inbox = history = ()
        if cfg.k > 1:
            n, k_, past = cfg.n, cfg.k, cfg.ddg_depth * cfg.m
            inputs = jnp.zeros((n, k_, cfg.ddg_slots, fns.width), fns.dtype)
            inbox = jnp.zeros((n, k_, fns.width), fns.dtype)
            history = jax.tree.map(lambda s: jnp.zeros((n, past, *s.shape), s.dtype), micro)
        tick = jnp.zeros((), jnp.int32)
        params, opt_state, reducer_state, model = _stage_vectors(kit, cfg, variables)
        return DDGState(params, opt_state, reducer_state, inputs, inbox, history, tick, model)

    def worker_step(state: DDGState, batch: Any) -> tuple[DDGState, Metrics]:
        return ddg_step(cfg, _local_stages(cfg, batch), state, batch)

    return st.Strategy(
        init=kit.init(make_state, specs),
        step=kit.step(worker_step, specs, divisor=cfg.divisor, why=cfg.why),
        params=_stage_params(kit, cfg),
    )


def pipeline(
    stages: Sequence[tuple[StageFn, Any]],
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    example_batch: Any = None,
    reducer: optax.GradientTransformation | None = None,
    tick_costs: str | Costs = "flops",
    ddg_forward: str | None = None,
) -> st.Strategy:
    """Pipeline model parallelism over the ``stage`` mesh axis (and data parallelism over ``data``).

    The model is ``loss_fn(f_{K-1}(... f_1(f_0(batch; w_0); w_1) ...; w_{K-1}), batch)``, stage
    ``f_k`` on the devices at position k of the ``stage`` axis. Each data worker's share of the
    global batch is cut into M micro-batches that flow through the stages; a stage keeps each
    in-flight micro-batch's input and re-runs its forward in its backward (as GPipe).

    * ``"gpipe"`` and ``"1f1b"``: one step runs the schedule's ticks and then ``w_k <- w_k +
      optimizer(reducer(g_k))`` with ``g_k`` the exact gradient of the mean loss over the global
      batch, as in single-device training. GPipe (Huang et al. 2019, arXiv:1811.06965) runs all
      forwards then all backwards, idle fraction ``(K-1)/(M+K-1)``, and each stage keeps M
      micro-batches' inputs; 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503)
      keeps at most K, and runs folded (``ddl.schedules.make_schedule(fold_last=True)``). It
      saves memory, not time: in lock-step a tick of its steady state pairs one stage's
      forward with another's backward and lasts as long as the backward, so with a backward
      costlier than a forward it idles more than GPipe (``docs/figures.md``: 1.26x against
      GPipe's 1.41x a sequential run's samples/s, K = 2, M = 4).
    * ``"ddg"``, decoupled parallel backpropagation with delayed gradients (Huo et al. 2018,
      arXiv:1804.10574), as the authors' code runs it (slowbull/DDG, ``main.py``,
      ``models/resnet_ddg.py``): every tick, every stage runs one forward and one backward and
      updates its weights. On tick t every stage forwards micro-batch t, the activations
      crossing the K stages within the tick (the forward stays locked: K - 1 sends, stage h
      forwarding at the h-th), then every stage at once backpropagates micro-batch ``j =
      t-(K-1-k)`` with the error gradient ``delta_j`` that stage k+1 sent on tick t-1 (the
      last stage its own loss of micro-batch t): ``w_k <- w_k + optimizer(reducer(d f_k(h_j;
      w_k)/d w_k . delta_j))``, so stage k's gradient is ``K-1-k`` ticks old. The backward
      re-runs the stage from its stashed input ``h_j`` with its current weights (the
      authors' code backpropagates through the graph its forward kept). ``ddg_forward=
      "pipelined"`` pipelines the forward as well, stage k forwarding micro-batch ``t-k`` and
      backpropagating ``t-2(K-1)+k``: one stage further a tick, no chain of sends within
      one, but a delay of ``2(K-1-k)`` ticks. Each step runs M ticks, so M updates of
      micro-batch size; the pipeline stays full across steps. A learning-rate schedule counts
      those updates, M a step, and stage k's first comes at the tick of its delay: after T
      ticks its count is ``T`` minus that delay, the earlier stages' behind the last one's.
      The delay narrows the stable learning rates; ``ddl.scale_by_staleness`` (below) widens
      them (``docs/figures.md``).

    Model state and randomness (stateful stages: ``pipeline_stages`` of modules with BatchNorm or
    Dropout; see ``docs/design.md``, section 2): stage k's model state lives with its stage
    (flattened, ``state.model.state[k]``), is updated by the stage's forward of each micro-batch
    in the schedule's order (the last stage's by its backward, which computes its forward) while
    backwards re-run the stage from the current state and drop the update (exact for BatchNorm in
    training mode), and is averaged over ``data`` after each step. Micro-batch j of stage k on
    data worker w at step t draws ``fold_in(fold_in(fold_in(fold_in(key, t), w), k), j)`` in its
    forward and in its backward's recomputation alike (the gradient is exact for the mask used); k
    is folded in only for K > 1, j only for M > 1 (one stage and one micro-batch draw
    ``data_parallel``'s keys). DDG, which updates every tick, uses micro-batch j's global index
    (the tick stage 0 forwards it) as the step: ``fold_in(fold_in(fold_in(key, j), w), k)``.
    ``key`` and ``t`` live in ``state.model``: a resumed run draws the masks an uninterrupted one
    would.

    What ``optimizer`` and ``reducer`` see: not the stages' parameter trees, but for each stage
    one flat vector, its leaves concatenated in tree order, cast to one dtype and zero-padded to
    the largest stage's size; each stage has its own optimizer and reducer state. The dtype is
    the widest of every stage's leaves: a bfloat16 stage beside a float32 one is updated in
    float32 (twice its memory; its training then differs from bfloat16 training on one device
    by that rounding), and a pipeline of bfloat16 stages is updated in bfloat16. Transforms that
    treat every entry on its own are exact (they update each parameter as on the tree):
    ``optax.sgd``, ``momentum``, ``adam``, ``adamw`` without a ``mask``, learning-rate schedules,
    ``ddl.allreduce_mean``, ``ddl.compression.cast``. Anything that looks at the tree changes
    meaning, mostly without an error: norms and scales are taken per stage over its padded vector
    (``optax.clip_by_global_norm`` clips each stage on its own, ``ddl.compression.sign`` has one
    scale per stage, ``top_k``'s and ``threshold``'s entry budgets and ``qsgd``'s buckets are per
    stage; ``optax.apply_if_finite`` skips one stage's update, not the step), and masks and
    ``optax.multi_transform`` labels get one array per stage instead of the tree (a mask by a
    leaf's shape, ``x.ndim > 1``, sees one 1-D vector: ``False`` everywhere; one shaped like
    the stages' trees is refused). ``ddl.compression.power_sgd`` would find no matrices, so it
    is refused (``ValueError``).
    The optimizer also receives optax's extra argument ``staleness``, stage k's gradient delay
    (``K-1-k`` under DDG, ``2(K-1-k)`` pipelined, 0 otherwise), so ``optax.chain(optimizer,
    ddl.scale_by_staleness())`` gives DDG's earlier stages ``lr / max(delay, 1)``.

    ``ddl.comm_stats`` of a step: a tick's activation and error-gradient sends run only where
    some stage sends, inside ``lax.cond``, so they are under ``branches`` (bytes when the
    branch runs), not ``bytes_per_device``, which holds the gradient reduction over ``data``.

    Args:
      stages: K pairs ``(apply, params)``: ``apply(params_k, x) -> y``; stage 0 receives the
        micro-batch pytree, stage k>0 the previous stage's output, which must be one
        floating-point array (any shape, stages may differ). ``params`` is a template (arrays or
        ``jax.ShapeDtypeStruct``) fixing each stage's parameter shapes. A stateful stage is a
        pair ``(ddl.ModelLoss(fn, seed), variables)``, ``fn(params_k, model_state_k, x, key) ->
        (y, new_model_state_k)`` and ``variables`` the template ``{"params": ..., "batch_stats":
        ...}``; the run's key comes from the first stateful stage's seed. NNX modules convert
        with ``pipeline_stages``.
      loss_fn: ``(last stage's output, micro_batch) -> scalar`` mean over the micro-batch (a
        plain function: model state and dropout belong in the stages).
      optimizer: optax transform applied per stage to its flat parameter vector (see above; it
        also receives ``staleness``).
      mesh: a mesh with a ``stage`` axis of size K (none: K = 1) and optionally ``data``.
      microbatches: M, micro-batches per data worker per step; the global batch must divide by
        ``data`` x M.
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"ddg"``.
      example_batch: a global batch (arrays or ``jax.ShapeDtypeStruct``), required by ``"ddg"``
        with K > 1 (its state stashes activations); later batches share its shapes.
      reducer: reduces each stage's flat gradient vector over ``data`` (default
        ``ddl.allreduce_mean("data")``). Not ``ddl.compression.power_sgd``.
      tick_costs: for ``"gpipe"`` and ``"1f1b"``, stage costs that group lock-step ticks (a cheap
        stage runs several operations beside a costly one; the same gradients): ``"flops"`` (XLA's
        counts per micro-batch), ``"unit"`` (one operation a tick), or K ``(forward, backward)``.
      ddg_forward: for ``"ddg"``, ``"locked"`` (the default, the authors') or ``"pipelined"``
        (above).

    Returns:
      A ``Strategy``: ``init(variables)`` takes the K stages' variables (a sequence: a
      parameter pytree per plain stage, ``{"params": ..., "batch_stats": ...}`` per
      stateful one), ``params(state)`` returns them as a list in the same layout. Metrics:
      ``loss``, the mean loss of the micro-batches whose loss was computed in this step
      (under ``"ddg"`` pipelined, 0 on the first steps, while no micro-batch has reached the
      last stage yet: ``floor((K - 1) / M)`` of them, which ``ddl.fit`` logs as 0).

    Example (an autoencoder of two linear stages on a 2 x 2 mesh):

    >>> import jax, numpy as np, optax
    >>> from flax import nnx
    >>> import ddl_jax as ddl
    >>> stages, params = ddl.pipeline_stages(
    ...     [nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1))]
    ... )
    >>> strategy = ddl.pipeline(
    ...     stages, lambda y, x: ((y - x) ** 2).mean(), optax.sgd(0.1),
    ...     ddl.make_mesh(data=2, stage=2), microbatches=2, schedule="1f1b",
    ... )
    >>> state, metrics = jax.jit(strategy.step)(strategy.init(params), np.ones((8, 4), np.float32))
    >>> [p["kernel"].shape for p in strategy.params(state)]
    [(4, 8), (8, 4)]
    """
    kit, cfg = _setup(
        stages,
        loss_fn,
        optimizer,
        mesh,
        microbatches,
        schedule,
        example_batch,
        reducer,
        tick_costs,
        ddg_forward,
    )
    if schedule == "ddg":
        return _ddg_pipeline(kit, cfg)
    return _exact_pipeline(kit, cfg, schedule, tick_costs)
