"""Pipelines (GPipe, 1F1B, DDG) against single-device backprop and the papers' formulas."""

import doctest
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import (
    BNDropoutMLP,
    bn_dropout_pair,
    first_stream_key,
    make_batches,
    nnx_reference,
    replica_groups,
    step_key,
    worker_shards,
)
from flax import linen, nnx
from hypothesis import given, settings
from hypothesis import strategies as hs
from pipeline_models import Block, full_loss, reference, xent
from pipeline_models import make_batches as pipeline_batches

import ddl_jax as ddl
from ddl_jax import pipeline, pipeline_stages
from ddl_jax._src.strategies.pipeline.builder import _setup as pipeline_setup
from ddl_jax._src.strategies.pipeline.schedules import one_kind_ticks
from ddl_jax._src.strategies.pipeline.stages import build_stages, flop_costs
from ddl_jax.schedules import (
    idle_fraction,
    lockstep_time,
    make_schedule,
    peak_stash,
    stash_intervals,
)

# Widths of the MLP split into K stages: stages differ in shapes (heterogeneous).
WIDTHS = {1: [12, 16, 5], 2: [12, 16, 8, 5], 4: [12, 16, 8, 16, 5]}


def split_mlp(k: int, widths=None, seed: int = 0):
    """An MLP cut into K stages: ``(stages, params)``; stage 0 gets the micro-batch dict."""
    widths = widths or WIDTHS[k]
    # Stage i holds layers [cut_i, cut_{i+1}); the first stage takes two layers when there
    # are more layers than stages, so stages differ in parameter count as well.
    cuts = np.linspace(0, len(widths) - 1, k + 1).round().astype(int)
    modules = [
        Block(widths[a : b + 1], last=i == k - 1, rngs=nnx.Rngs(seed + i))
        for i, (a, b) in enumerate(itertools.pairwise(cuts))
    ]
    return pipeline_stages(modules)


def train(strategy, params, batches):
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    return strategy.params(state), metrics


# --- schedules -------------------------------------------------------------------------


def check_valid(s):
    """Each stage runs each micro-batch forward and backward once, after its inputs exist."""
    k_, m_ = s.stages, s.microbatches
    tick = {}
    for (t, k), m in np.ndenumerate(s.forward):
        if m >= 0:
            tick["F", k, m] = t
    for (t, k), m in np.ndenumerate(s.backward):
        if m >= 0:
            tick["B", k, m] = t
    assert len(tick) == 2 * k_ * m_
    for k, m in itertools.product(range(k_), range(m_)):
        if k > 0:
            assert tick["F", k - 1, m] < tick["F", k, m]
        after = tick["B", k + 1, m] if k < k_ - 1 else tick["F", k, m]
        assert after < tick["B", k, m]


@settings(max_examples=12, deadline=None)
@given(k=hs.integers(1, 6), m=hs.integers(1, 12))
def test_gpipe_and_1f1b_bubble_is_k_minus_1_over_m_plus_k_minus_1(k, m):
    for kind in ("gpipe", "1f1b"):
        s = make_schedule(k, m, kind)
        check_valid(s)
        assert len(s.forward) == 2 * (m + k - 1)
        assert idle_fraction(s) == pytest.approx((k - 1) / (m + k - 1))


@settings(max_examples=12, deadline=None)
@given(k=hs.integers(1, 6), m=hs.integers(1, 12))
def test_1f1b_stashes_at_most_k_microbatches_gpipe_all_m(k, m):
    assert peak_stash(make_schedule(k, m, "gpipe")) == m
    s = make_schedule(k, m, "1f1b")
    assert peak_stash(s) <= min(k, m)
    # Stage k holds at most K-k inputs of its own forwards (PipeDream-Flush's bound).
    for stage, intervals in enumerate(stash_intervals(s)):
        own = [(s.forward[:, stage] == mb).argmax() for mb in intervals]
        for t in range(len(s.forward)):
            live = sum(f <= t <= intervals[mb][1] for mb, f in zip(intervals, own, strict=True))
            assert live <= k - stage


@settings(max_examples=12, deadline=None)
@given(k=hs.integers(1, 6), m=hs.integers(1, 12))
def test_folded_schedules_run_the_last_stages_forward_inside_its_backward(k, m):
    """``fold_last``: the last stage's backward of a micro-batch follows the arrival of its
    input (its forward runs in the same tick); every other dependency and each stage's
    order stay; 1F1B still stashes at most K inputs."""
    for kind in ("gpipe", "1f1b"):
        s = make_schedule(k, m, kind, fold_last=True)
        assert (s.forward[:, k - 1] == -1).all()
        assert not ((s.forward >= 0) & (s.backward >= 0)).any()  # one operation a tick
        tick = {}
        for op, table in (("F", s.forward), ("B", s.backward)):
            for (t, stage), mb in np.ndenumerate(table):
                if mb >= 0:
                    tick[op, stage, mb] = t
        assert len(tick) == (2 * k - 1) * m
        for stage, mb in itertools.product(range(k), range(m)):
            if 0 < stage < k - 1:
                assert tick["F", stage - 1, mb] < tick["F", stage, mb]
            if stage < k - 1:
                assert tick["B", stage + 1, mb] < tick["B", stage, mb]
            elif stage > 0:
                assert tick["F", stage - 1, mb] < tick["B", stage, mb]
        unfolded = make_schedule(k, m, kind)
        for stage in range(k - 1):  # the other stages keep their order of operations
            for table, other in ((s.forward, unfolded.forward), (s.backward, unfolded.backward)):
                np.testing.assert_array_equal(
                    table[:, stage][table[:, stage] >= 0], other[:, stage][other[:, stage] >= 0]
                )
        assert len(s.forward) < len(unfolded.forward)
        if kind == "1f1b":
            assert peak_stash(s) <= min(k, m)


def stage_orders(s):
    """Each stage's operations ``(op, micro-batch)`` in the order the schedule runs them."""
    orders = [[] for _ in range(s.stages)]
    for t, k in itertools.product(range(len(s.forward)), range(s.stages)):
        orders[k] += [(op, int(tab[t, k])) for op, tab in (("F", s.forward), ("B", s.backward))]
    return [[o for o in ops if o[1] >= 0] for ops in orders]


@settings(max_examples=25, deadline=None)
@given(
    k=hs.integers(1, 5),
    m=hs.integers(1, 10),
    kind=hs.sampled_from(["gpipe", "1f1b"]),
    costs=hs.lists(hs.tuples(hs.integers(0, 6), hs.integers(1, 12)), min_size=5, max_size=5),
)
def test_schedules_grouped_by_costs_keep_each_stages_order_and_beat_unit_ticks(k, m, kind, costs):
    """``make_schedule(costs=...)``: each stage runs the folded schedule's operations in the
    same order; what an operation needs was sent in an earlier group; the lock-step time is
    at most the unit-cost schedule's and at least the busiest stage's work; 1F1B still
    stashes at most K inputs, GPipe M. The program's layout of the groups
    (``one_kind_ticks``) keeps each group's operations and never runs a forward beside a
    backward in one tick."""
    costs = costs[:k]
    fold = kind == "1f1b"
    s = make_schedule(k, m, kind, fold_last=fold, costs=costs)
    unit = make_schedule(k, m, kind, fold_last=fold)
    folded = make_schedule(k, m, kind, fold_last=True)
    ops = stage_orders(s)
    assert ops[:-1] == stage_orders(folded)[:-1]
    assert [o for o in ops[-1] if o[0] == "B"] == [o for o in stage_orders(folded)[-1]]
    tick = {}
    for op, table in (("F", s.forward), ("B", s.backward)):
        for (t, stage), mb in np.ndenumerate(table):
            if mb >= 0:
                tick[op, stage, mb] = t
    for stage, mb in itertools.product(range(k), range(m)):
        if 0 < stage < k - 1:
            assert s.arrival(tick["F", stage - 1, mb]) < tick["F", stage, mb]
        if stage < k - 1:
            assert s.arrival(tick["B", stage + 1, mb]) < tick["B", stage, mb]
        elif stage > 0:
            assert s.arrival(tick["F", stage - 1, mb]) < tick["B", stage, mb]
    work = [m * (b + (f if stage < k - 1 else 0)) for stage, (f, b) in enumerate(costs)]
    assert max(work) <= lockstep_time(s, costs) <= lockstep_time(unit, costs)
    assert peak_stash(s) <= (min(k, m) if kind == "1f1b" else m)
    # Laid out for the program: the same operations in each group, no tick of both kinds
    # (the last stage's forwards are left out: its backward runs them).
    laid = one_kind_ticks(s)

    def per_group(plan):
        forward = np.where(np.arange(k) == k - 1, -1, plan.forward)
        n = len(forward) // plan.group
        return [
            stage_orders(plan._replace(forward=f, backward=b))
            for f, b in zip(np.split(forward, n), np.split(plan.backward, n), strict=True)
        ]

    assert per_group(s) == per_group(laid)
    assert not ((laid.forward[:, :-1] >= 0).any(axis=1) & (laid.backward >= 0).any(axis=1)).any()


def test_gpipe_grouped_by_unequal_stage_costs_runs_as_long_as_its_busiest_stage():
    """The stage costs ``benchmarks/pipeline.py`` measured (ms): stage 0's forward and
    backward of a micro-batch 5.0 and 10.6, stage 1's backward (its forward inside) 10.3.
    In unit ticks GPipe's last stage idles through the forwards and its first backward
    runs alone; grouped, stage 0 never waits and the step lasts its 4 x 15.6 ms, the least
    any schedule can."""
    costs = [(5.0, 10.6), (3.4, 10.3)]
    s = make_schedule(2, 4, "gpipe", costs=costs)
    assert s.group > 1
    assert lockstep_time(s, costs) == pytest.approx(4 * (5.0 + 10.6))
    assert lockstep_time(make_schedule(2, 4, "gpipe"), costs) == pytest.approx(
        4 * 5.0 + 10.3 + 4 * 10.6
    )
    with pytest.raises(ValueError, match="costs must be 2 pairs"):
        make_schedule(2, 4, "gpipe", costs=[(1.0, 2.0)])
    with pytest.raises(ValueError, match="costs must be 2 pairs"):
        make_schedule(2, 4, "gpipe", costs=[(1.0, -2.0), (1.0, 1.0)])
    with pytest.raises(ValueError, match="'ddg' has none"):
        make_schedule(2, 4, "ddg", costs=costs)
    with pytest.raises(ValueError, match="fold_last folds the last stage of 'gpipe' and"):
        make_schedule(2, 4, "ddg", fold_last=True)
    with pytest.raises(ValueError, match="tick= places a 'ddg' step .*'1f1b' has no ticks"):
        make_schedule(2, 4, "1f1b", tick=3)


def test_flop_costs_count_the_dense_layers_products():
    """``tick_costs="flops"``: XLA's counts for a stage Dense(64 -> 128) + ReLU and a last
    stage Dense(128 -> 32) + loss, on micro-batches of 16 rows, against 2 r a b per
    product: the first stage's backward re-runs its forward and forms the weight gradient
    (2 products), the last stage's runs the forward, the weight and the input gradient (3);
    its forward alone computes nothing (its backward runs it)."""
    stages, _ = split_mlp(2, [64, 128, 32])
    _, cfg = pipeline_setup(
        stages,
        xent,
        optax.sgd(0.1),
        ddl.make_mesh(data=1, stage=2),
        4,
        "gpipe",
        None,
        None,
        "flops",
    )
    micro = {
        "x": jax.ShapeDtypeStruct((16, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((16,), jnp.int32),
    }
    (f0, b0), (f1, b1) = flop_costs(cfg, build_stages(cfg, micro), micro)
    first, last = 2 * 16 * 64 * 128, 2 * 16 * 128 * 32
    assert f0 == pytest.approx(first, rel=0.05)
    assert b0 == pytest.approx(2 * first, rel=0.05)
    assert b1 == pytest.approx(3 * last, rel=0.1)
    assert f1 < 0.01 * last


@settings(max_examples=8, deadline=None)
@given(k=hs.integers(1, 6), m=hs.integers(1, 12), tick=hs.integers(0, 50))
def test_ddg_keeps_every_stage_busy_with_delay_2_k_minus_1_minus_k(k, m, tick):
    s = make_schedule(k, m, "ddg", tick=tick + 2 * k)  # a step with a full pipeline
    assert idle_fraction(s) == 0.0
    stage = np.arange(k)
    np.testing.assert_array_equal(s.forward - s.backward, 2 * (k - 1 - stage)[None, :].repeat(m, 0))


def test_compiled_1f1b_memory_stays_flat_in_m_while_gpipe_grows_by_m_activations():
    """Memory analysis of the compiled step: GPipe stashes M stage inputs, 1F1B at most K.
    (In unit ticks: grouped by costs, GPipe's last stage may backpropagate each input as it
    arrives.)"""
    stages, params = split_mlp(2, [12, 256, 5])
    temp = {}
    for schedule, m in (("1f1b", 4), ("1f1b", 16), ("gpipe", 4), ("gpipe", 16)):
        mesh = ddl.make_mesh(data=1, stage=2)
        strategy = pipeline(
            stages, xent, optax.sgd(0.1), mesh, microbatches=m, schedule=schedule, tick_costs="unit"
        )
        [batch] = make_batches(1, 8 * m)
        compiled = jax.jit(strategy.step).lower(strategy.init(params), batch).compile()
        temp[schedule, m] = compiled.memory_analysis().temp_size_in_bytes
    activation = 8 * 256 * 4  # one micro-batch's input to stage 1, float32
    assert temp["1f1b", 16] - temp["1f1b", 4] < activation
    # GPipe's stash holds M inputs: 12 more at M=16 than at M=4.
    assert temp["gpipe", 16] - temp["gpipe", 4] >= 12 * activation


@pytest.mark.parametrize(("schedule", "k", "m"), [("gpipe", 2, 4), ("gpipe", 3, 4), ("1f1b", 3, 4)])
def test_compiled_step_sends_activations_and_gradients_only_on_ticks_that_carry_them(
    schedule, k, m
):
    """Read from the compiled HLO: every tick sends in at most one direction (GPipe), and
    nothing travels on ticks where no stage works. Ticking both directions every tick sent
    ``2 * 2(M+K-1)`` buffers per stage boundary."""
    stages, params = split_mlp(k, [12, 32, 32, 32, 5])
    mesh = ddl.make_mesh(data=1, stage=k)
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=m, schedule=schedule)
    [batch] = make_batches(1, 8 * m)
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    permutes = [op for op in stats.ops if op.kind == "collective-permute"]
    sent = sum(sum(op.sent) * op.count for op in permutes)
    buffer = 8 * 32 * 4  # one micro-batch's activation (or its gradient) at a boundary
    needed = 2 * m * (k - 1) * buffer  # each micro-batch over each boundary, both ways
    assert needed <= sent
    ticks = 2 * (m + k - 1)
    if schedule == "gpipe":
        assert sent <= ticks * (k - 1) * buffer  # half of ticking both directions
    else:  # 1F1B: only its steady state sends both ways on one tick
        assert sent < 2 * ticks * (k - 1) * buffer


# --- exact schedules against single-device training ------------------------------------


# Stage costs under which the schedules group ticks (make_schedule(costs=...).group > 1).
GROUPING = {2: [(5.0, 10.6), (3.4, 10.3)], 4: [(1, 1), (2, 4), (1, 1), (0, 6)]}


@pytest.mark.parametrize(
    ("schedule", "k", "n", "m", "costs"),
    [
        ("gpipe", 1, 2, 2, "flops"),
        ("1f1b", 1, 1, 4, "flops"),  # folded: one stage, no forward ticks at all
        ("gpipe", 2, 2, 4, GROUPING[2]),
        ("gpipe", 4, 2, 4, "flops"),
        ("1f1b", 2, 2, 2, "flops"),
        ("1f1b", 4, 1, 8, "unit"),
        ("1f1b", 4, 1, 8, GROUPING[4]),
    ],
)
def test_exact_schedules_equal_single_device_training(schedule, k, n, m, costs):
    """Unit ticks, ticks grouped by given costs, and by XLA's flop counts: the same
    training as one device on the global batch."""
    if not isinstance(costs, str):
        assert make_schedule(k, m, schedule, fold_last=schedule == "1f1b", costs=costs).group > 1
    stages, params = split_mlp(k)
    batches = make_batches(3, 16)
    mesh = ddl.make_mesh(data=n, stage=k)
    strategy = pipeline(
        stages, xent, optax.adam(1e-2), mesh, microbatches=m, schedule=schedule, tick_costs=costs
    )
    got, metrics = train(strategy, params, batches)
    expected = reference(full_loss(stages), optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)
    previous = reference(full_loss(stages), optax.adam(1e-2), params, batches[:2])
    np.testing.assert_allclose(metrics["loss"], full_loss(stages)(previous, batches[2]), rtol=1e-5)


# --- DDG ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "m_"), [(2, 2), (3, 2), (4, 1)])
def test_ddg_runs_the_authors_forward_locked_delays(k, m_):
    """The default DDG against Huo et al.'s code, split by split (slowbull/DDG)."""
    stages, params = split_mlp(k, widths=[12, 16, 8, 8, 8, 5][: k + 2] if k > 1 else None)
    batches = make_batches(3, 8, seed=1)
    mesh = ddl.make_mesh(data=1, stage=k)
    ddg = {"schedule": "ddg", "example_batch": batches[0]}
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=m_, **ddg)
    got, metrics = train(strategy, params, batches)
    expected, losses = jax.jit(lambda p, b: ddg_as_its_authors_run_it(stages, 0.1, p, b, m_))(
        params, batches
    )
    chex.assert_trees_all_close(got, expected, atol=1e-5)
    # the last stage takes each micro-batch's loss in the tick it is forwarded
    np.testing.assert_allclose(metrics["loss"], np.mean(losses[-m_:]), rtol=1e-5)


def micro_batches(batches, m_):
    """Each batch's M micro-batches, in order: the order a pipeline runs them."""
    return [
        {key: v[i * len(v) // m_ : (i + 1) * len(v) // m_] for key, v in b.items()}
        for b in batches
        for i in range(m_)
    ]


def ddg_as_its_authors_run_it(stages, lr, params, batches, m_):
    """Huo et al.'s DDG as their code runs it (slowbull/DDG: ``main.py``'s ``train_start``,
    ``train_n`` and ``train_end``, one process a split; ``models/resnet_ddg.py``'s
    ``CifarResNetDDG``), with SGD (``lr``: one learning rate, or one per split), iteration
    by iteration in Python.

    Split k waits ``delay = K-1-k`` iterations before its first backward. In iteration t it
    forwards micro-batch t with its current weights (split 0 from the data, split k from
    split k-1's output of the same iteration) and keeps the input; the last split then
    backpropagates its loss, updates and sends the error at its input back. Split k < K-1,
    once its delay has passed, backpropagates its oldest kept micro-batch, t - delay, along
    the error split k+1 sent in iteration t-1, updates, and sends the error at its input.
    Where the authors' backward runs the graph its forward kept, this re-runs the split from
    the kept input with its current weights (as ``pipeline`` does). Returns the weights and
    the last split's loss of each micro-batch.
    """
    k_ = len(stages)
    lrs = list(lr) if isinstance(lr, list | tuple) else [lr] * k_
    micro, params = micro_batches(batches, m_), [jax.tree.map(jnp.asarray, p) for p in params]
    kept = [{} for _ in stages]  # split k's kept inputs, by micro-batch
    sent = {}  # (split, micro-batch) -> the error at that split's output
    losses = []
    for t in range(len(micro)):
        x = micro[t]
        for k, (apply, _) in enumerate(stages):  # the forward, split by split
            kept[k][t] = x
            if k < k_ - 1:
                x = apply(params[k], x)
        errors = {}
        for k in range(k_):  # then every split's backward, on what it had
            j = t - (k_ - 1 - k)
            if j < 0:
                continue

            def run(p, x, k=k, j=j):
                y = stages[k][0](p, x)
                return xent(y, micro[j]) if k == k_ - 1 else y

            y, vjp = jax.vjp(run, params[k], kept[k].pop(j))
            grad_p, grad_x = vjp(jnp.ones_like(y) if k == k_ - 1 else sent[k, j])
            if k == k_ - 1:
                losses.append(y)
            errors[k - 1, j] = grad_x
            params[k] = jax.tree.map(lambda w, g, k=k: w - lrs[k] * g, params[k], grad_p)
        sent = errors
    return params, jnp.stack(losses)


@pytest.mark.parametrize("k", [2, 3])
def test_ddg_pipelined_follows_its_delayed_gradient_rule(k):
    stages, params = split_mlp(k, widths=[12, 16, 8, 8, 5][: k + 2] if k > 1 else None)
    batches = make_batches(3, 8, seed=1)
    m_ = 2
    mesh = ddl.make_mesh(data=1, stage=k)
    ddg = {"schedule": "ddg", "example_batch": batches[0], "ddg_forward": "pipelined"}
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=m_, **ddg)
    got, _ = train(strategy, params, batches)
    expected = jax.jit(lambda p, b: ddg_step_by_step(stages, 0.1, p, b, m_))(params, batches)
    chex.assert_trees_all_close(got, expected, atol=1e-5)


def ddg_step_by_step(stages, lr, params, batches, m_):
    """DDG with the forward pipelined (``ddg_forward="pipelined"``), tick by tick in Python.

    At global tick t stage k forwards micro-batch t-k with its weights before the tick, and
    updates with the gradient of micro-batch j = t-2(K-1)+k: stage k re-run from its stored
    input h_j with its current weights, pulled back along the error delta_j that stage k+1
    computed on tick t-1 (the last stage differentiates its own loss at once). ``lr``: one
    SGD learning rate, or one per stage.
    """
    k_ = len(stages)
    lrs = list(lr) if isinstance(lr, list | tuple) else [lr] * k_
    micro, params = micro_batches(batches, m_), [jax.tree.map(jnp.asarray, p) for p in params]
    inputs, deltas = {}, {}  # (stage, micro-batch) -> stage input / error at its output
    for t in range(len(micro)):
        outputs, new_deltas = {}, {}
        for k, (apply, _) in enumerate(stages):
            if k == 0:
                inputs[0, t] = micro[t]
            if t - k >= 0 and k < k_ - 1:
                outputs[k + 1, t - k] = apply(params[k], inputs[k, t - k])
            j = t - 2 * (k_ - 1) + k
            if j < 0:
                continue

            def run(p, x, k=k, j=j):
                y = stages[k][0](p, x)
                return xent(y, micro[j]) if k == k_ - 1 else y

            y, vjp = jax.vjp(run, params[k], inputs[k, j])
            grad_p, grad_x = vjp(jnp.ones_like(y) if k == k_ - 1 else deltas[k, j])
            new_deltas[k - 1, j] = grad_x
            params[k] = jax.tree.map(lambda w, g, k=k: w - lrs[k] * g, params[k], grad_p)
        inputs.update(outputs)
        deltas = new_deltas
    return params


@pytest.mark.parametrize(
    ("forward", "delay", "reference"),
    [
        ("locked", 1, lambda *args: ddg_as_its_authors_run_it(*args)[0]),  # the weights
        ("pipelined", 2, ddg_step_by_step),
    ],
)
def test_pipelines_pass_each_stage_its_delay_as_staleness(forward, delay, reference):
    """The optimizer receives each stage's gradient delay as the optax extra argument
    ``staleness``: K-1-k under DDG (2(K-1-k) with the forward pipelined), 0 under GPipe.
    With ``ddl.scale_by_staleness()`` DDG's stage k steps at lr / max(delay, 1); a scale of
    1 is plain training, bit for bit."""
    k_ = 3
    stages, params = split_mlp(k_, widths=[12, 16, 8, 8, 5])
    batches = make_batches(3, 8, seed=1)
    mesh = ddl.make_mesh(data=1, stage=k_)
    sgd = optax.sgd(0.1)

    def run(optimizer, schedule="ddg"):
        ddg = {"schedule": "ddg", "example_batch": batches[0], "ddg_forward": forward}
        strategy = pipeline(
            stages, xent, optimizer, mesh, microbatches=2, **(ddg if schedule == "ddg" else {})
        )
        return train(strategy, params, batches)[0]

    scaled = run(optax.chain(sgd, ddl.scale_by_staleness()))
    lrs = [0.1 / max(delay * (k_ - 1 - k), 1) for k in range(k_)]
    expected = jax.jit(lambda p, b: reference(stages, lrs, p, b, 2))(params, batches)
    chex.assert_trees_all_close(scaled, expected, atol=1e-5)
    one = ddl.scale_by_staleness(lambda tau: jnp.ones_like(tau))
    chex.assert_trees_all_equal(run(optax.chain(sgd, one)), run(sgd))
    # GPipe's gradients are exact (tau = 0): the inverse rule's scale is 1.
    unscaled = run(optax.chain(sgd, ddl.scale_by_staleness()), "gpipe")
    chex.assert_trees_all_equal(unscaled, run(sgd, "gpipe"))


def test_ddg_forward_is_checked():
    stages, _ = split_mlp(2)
    mesh, batch = ddl.make_mesh(data=1, stage=2), make_batches(1, 8)[0]
    ddg = {"schedule": "ddg", "example_batch": batch}
    with pytest.raises(ValueError, match=r"ddg_forward='ahead' is not known; valid: \['locked', "):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, **ddg, ddg_forward="ahead")
    with pytest.raises(ValueError, match="chooses how 'ddg' forwards; schedule='1f1b' has no"):
        pipeline(
            stages, xent, optax.sgd(0.1), mesh, microbatches=2, schedule="1f1b", ddg_forward="ahead"
        )


def test_ddg_on_data_by_stage_mesh_averages_each_tick_over_data_workers():
    """data=2: each tick's gradient is the mean over both workers' micro-batches, i.e. DDG on
    one worker whose micro-batch j is the two workers' micro-batch j side by side."""
    stages, params = split_mlp(2)
    batches = make_batches(3, 16, seed=2)
    # Worker i holds rows [8i, 8i+8); its micro-batch j is rows 8i+4j .. 8i+4j+3.
    order = np.concatenate(
        [np.arange(8 * i + 4 * j, 8 * i + 4 * j + 4) for j in (0, 1) for i in (0, 1)]
    )
    results = []
    for n, data in ((2, batches), (1, [{k: v[order] for k, v in b.items()} for b in batches])):
        mesh = ddl.make_mesh(data=n, stage=2)
        ddg = {"schedule": "ddg", "example_batch": batches[0]}
        strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, **ddg)
        results.append(train(strategy, params, data)[0])
    chex.assert_trees_all_close(*results, atol=1e-6)


def test_ddg_with_one_stage_is_backprop_on_each_microbatch(mlp):
    stages, params = split_mlp(1)
    batches = make_batches(3, 16)
    strategy = pipeline(
        stages, xent, optax.adam(1e-2), ddl.make_mesh(data=2), microbatches=4, schedule="ddg"
    )
    got, _ = train(strategy, params, batches)
    # Each tick updates on one micro-batch per data worker: 4 micro-steps per batch, and
    # data worker i's micro-batch j is rows [i*8 + j*2, i*8 + j*2 + 2) of the global batch.
    micro = []
    for b in batches:
        for j in range(4):
            rows = np.concatenate([np.arange(i * 8 + j * 2, i * 8 + j * 2 + 2) for i in range(2)])
            micro.append({key: v[rows] for key, v in b.items()})
    expected = reference(full_loss(stages), optax.adam(1e-2), params, micro)
    chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)


def test_ddg_converges_on_digits_like_backprop():
    """MLP in 2 and 4 stages: DDG within 1.5 points of backprop on the same micro-batches."""
    train_set, test_set = ddl.data.digits()
    steps, size, m_ = 100, 256, 16
    batches = [
        {"x": b["image"], "y": b["label"]}
        for b, _ in zip(ddl.data.batches(train_set, size), range(steps), strict=False)
    ]
    # Backprop sees the same micro-batches of 16, one SGD step each, in the same order.
    micro = jax.tree.map(lambda *b: np.concatenate(b).reshape(steps * m_, 16, -1), *batches)
    micro["y"] = micro["y"][..., 0]
    sgd = optax.sgd(optax.cosine_decay_schedule(0.1, steps * m_))

    def accuracy(stages, params):
        x = {"x": test_set["image"]}
        for (apply, _), p in zip(stages, params, strict=True):
            x = apply(p, x)
        return float((x.argmax(-1) == test_set["label"]).mean())

    for k in (2, 4):
        stages, params = split_mlp(k, [64, 32, 32, 32, 10])
        mesh = ddl.make_mesh(data=1, stage=k)
        ddg = {"schedule": "ddg", "example_batch": batches[0]}
        strategy = pipeline(stages, xent, sgd, mesh, microbatches=m_, **ddg)
        ddg, _ = train(strategy, params, batches)

        @jax.jit
        def backprop(params, stages=stages):
            def one(carry, batch):
                params, opt_state = carry
                grads = jax.grad(full_loss(stages))(params, batch)
                updates, opt_state = sgd.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), None

            return jax.lax.scan(one, (params, sgd.init(params)), micro)[0][0]

        assert accuracy(stages, ddg) >= accuracy(stages, backprop(params)) - 0.015 > 0.9


# --- 2-D mesh ------------------------------------------------------------------------


def test_data_by_stage_mesh_all_reduces_gradients_over_data_only():
    stages, params = split_mlp(4)
    mesh = ddl.make_mesh(data=2, stage=4)
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, schedule="1f1b")
    [batch] = make_batches(1, 16)
    hlo = jax.jit(strategy.step).lower(strategy.init(params), batch).compile().as_text()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # [data, stage]
    data_groups = {frozenset(column) for column in ids.T.tolist()}
    stage_groups = {frozenset(row) for row in ids.tolist()}
    largest = max(
        len(jax.tree.leaves(p)) and sum(x.size for x in jax.tree.leaves(p)) for p in params
    )
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line]
    grads = [line for line in reduces if f"f32[{largest}]" in line]
    assert grads and all(replica_groups(line) == data_groups for line in grads)
    # The only other all-reduce gathers the loss from the last stage.
    assert all(replica_groups(line) in (data_groups, stage_groups) for line in reduces)
    for line in hlo.splitlines():
        if " collective-permute(" in line:
            pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
            for a, b in pairs:
                (da, sa), (db, sb) = np.argwhere(ids == int(a))[0], np.argwhere(ids == int(b))[0]
                assert da == db and abs(sa - sb) == 1  # neighbours within a data replica


def test_a_hand_built_mesh_with_auto_axes_trains_like_single_device_sgd():
    stages, params = split_mlp(2)
    batches = make_batches(1, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "stage"))
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2)
    got, _ = train(strategy, params, batches)
    expected = reference(full_loss(stages), optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(got, expected, atol=1e-6)


def test_a_ppermute_reducer_over_data_gives_the_same_training():
    stages, params = split_mlp(2)
    batches = make_batches(2, 16)
    results = []
    for reducer in (None, ddl.allreduce_mean(algorithm="ring")):
        mesh = ddl.make_mesh(data=4, stage=2)
        strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, reducer=reducer)
        results.append(train(strategy, params, batches)[0])
    chex.assert_trees_all_close(*results, atol=1e-6)


def test_each_stage_reducer_starts_from_reducer_init_of_its_own_parameters():
    """Every (data, stage) cell holds reducer.init of the stage's flat, zero-padded vector."""
    stages, params = split_mlp(2)
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]) for p in params]
    flat = [np.pad(v, (0, max(map(len, flat)) - len(v))) for v in flat]
    # A reducer whose initial state is neither zero nor the same on every stage.
    shifted = optax.GradientTransformation(
        lambda p: {"seen": p + 1.0, "scale": jnp.full((), 3.0)},
        lambda g, state, params=None: (jax.lax.pmean(g, "data"), state),
    )
    mesh, example = ddl.make_mesh(data=2, stage=2), make_batches(1, 8)[0]
    for reducer in (shifted, ddl.compression.top_k(0.5)):
        for schedule in ("gpipe", "ddg"):
            options = {"schedule": schedule, "example_batch": example, "reducer": reducer}
            strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, **options)
            got = strategy.init(params).reducer_state
            for d, k in itertools.product(range(2), range(2)):
                cell = jax.tree.map(lambda x, d=d, k=k: np.asarray(x)[d, k], got)
                chex.assert_trees_all_close(cell, reducer.init(jnp.asarray(flat[k])))
    assert float(np.asarray(got.compression_ratio).min()) == 1.0


def test_power_sgd_is_refused_since_stages_reach_the_reducer_flattened():
    stages, _ = split_mlp(2)
    mesh = ddl.make_mesh(data=2, stage=2)
    for reducer in (ddl.compression.power_sgd(1), optax.chain(ddl.compression.power_sgd(2))):
        with pytest.raises(ValueError, match="power_sgd.*cannot be used with ddl.pipeline"):
            pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, reducer=reducer)


# --- bad input ---------------------------------------------------------------------------


def test_bad_input_fails_with_clear_errors():
    stages, params = split_mlp(2)
    mesh = ddl.make_mesh(data=2, stage=2)
    with pytest.raises(
        ValueError, match="len\\(stages\\)=2 but the mesh's 'stage' axis has size 4"
    ):
        pipeline(stages, xent, optax.sgd(0.1), ddl.make_mesh(data=2, stage=4), microbatches=2)
    with pytest.raises(ValueError, match="schedule='pipedream' is not known"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, schedule="pipedream")
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 0"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=0)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 2.0"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2.0)
    misspelt = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    with pytest.raises(
        ValueError, match=re.escape("mesh axis 'pipe' (size 2) is not one this strategy uses")
    ):
        pipeline(stages, xent, optax.sgd(0.1), misspelt, microbatches=2)
    with pytest.raises(TypeError, match="reducer must be an optax.GradientTransformation"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, reducer="mean")
    with pytest.raises(ValueError, match="needs example_batch="):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, schedule="ddg")
    with pytest.raises(ValueError, match="tick_costs='fast' is not known"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, tick_costs="fast")
    with pytest.raises(ValueError, match="tick_costs must be 2 pairs"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, tick_costs=[(1, 2)])
    with pytest.raises(ValueError, match="tick_costs= groups the ticks of 'gpipe' and '1f1b'"):
        ddg = {"schedule": "ddg", "example_batch": make_batches(1, 16)[0]}
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, tick_costs="unit", **ddg)
    with pytest.raises(TypeError, match="stages\\[1\\] must be a pair"):
        pipeline([stages[0], stages[1][0]], xent, optax.sgd(0.1), mesh, microbatches=2)
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=3)
    state = strategy.init(params)
    with pytest.raises(ValueError, match="global batch size 16 is not divisible by 6"):
        strategy.step(state, make_batches(1, 16)[0])
    with pytest.raises(ValueError, match="params must be a sequence of 2 stage parameter"):
        strategy.init(params[0])
    with pytest.raises(ValueError, match="params\\[1\\] has shapes"):
        strategy.init([params[0], params[0]])
    # a mask shaped like the stages' trees: the optimizer sees one flat vector a stage
    masked = optax.masked(optax.sgd(0.1), [jax.tree.map(lambda _: True, p) for p in params])
    with pytest.raises(ValueError, match="optimizer.init failed on a stage's parameters, which"):
        pipeline(stages, xent, masked, mesh, microbatches=2).init(params)
    # Stage 0 ends in 16 features, stage 1 starts from 8.
    mismatched, _ = pipeline_stages(
        [Block([12, 16], last=False, rngs=nnx.Rngs(0)), Block([8, 5], last=True, rngs=nnx.Rngs(1))]
    )
    with pytest.raises(ValueError, match="stage 1 does not accept the output of stage 0"):
        ddg = {"schedule": "ddg", "example_batch": make_batches(1, 16)[0]}
        pipeline(mismatched, xent, optax.sgd(0.1), mesh, microbatches=2, **ddg)
    strategy = pipeline(mismatched, xent, optax.sgd(0.1), mesh, microbatches=2)
    with pytest.raises(ValueError, match="stage 1 does not accept the output of stage 0"):
        strategy.step(strategy.init([p for _, p in mismatched]), make_batches(1, 16)[0])

    def squares(logits, batch):  # the last stage ends in 5 features, one-hot of 3 classes
        return jnp.mean((logits - jax.nn.one_hot(batch["y"], 3)) ** 2)

    with pytest.raises(ValueError, match=r"loss_fn does not accept the output of the last stage"):
        ddg = {"schedule": "ddg", "example_batch": make_batches(1, 16)[0]}
        pipeline(stages, squares, optax.sgd(0.1), mesh, microbatches=2, **ddg)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 4, "gpipe"), "stages must be an int >= 1, got 0"),
        ((2, 0, "1f1b"), "microbatches must be an int >= 1, got 0"),
        ((2.0, 4, "gpipe"), "stages must be an int >= 1, got 2.0"),
        ((2, 4, "ddg"), "a 'ddg' schedule keeps the pipeline full across steps"),
    ],
)
def test_schedules_refuse_what_has_no_schedule(args, match):
    with pytest.raises(ValueError, match=match):
        ddl.schedules.stash_intervals(ddl.schedules.make_schedule(*args))


# --- training with ddl.fit and exporting to the modules ----------------------------------


def run_stages(stages, params, x):
    """The stages one after another, on one device (the default one)."""
    # Through the host: jax.device_put(params, device) keeps the mesh in the arrays' types,
    # and eager ops on them then ask for a mesh context.
    params = jax.device_get(params)
    for (apply, _), p in zip(stages, params, strict=True):
        x = apply(p, x)
    return x


def test_a_pipeline_trained_with_fit_evaluates_and_exports_to_its_modules():
    """ddl.fit's eval_fn gets the list of stage params; written back into the NNX modules,
    the stages called in sequence outside any mesh score the same accuracy."""
    train_set, test_set = ddl.data.digits()
    modules = [
        Block([64, 32], last=False, rngs=nnx.Rngs(0)),
        Block([32, 32, 10], last=True, rngs=nnx.Rngs(1)),
    ]
    stages, params = pipeline_stages(modules)
    mesh = ddl.make_mesh(data=2, stage=2)
    strategy = pipeline(stages, xent, optax.adam(1e-2), mesh, microbatches=2, schedule="1f1b")
    batches = (
        {"x": b["image"], "y": b["label"]} for b in ddl.data.batches(train_set, 64, epochs=None)
    )

    def accuracy(logits):
        return jnp.mean(logits.argmax(-1) == test_set["label"])

    def eval_fn(stage_params):
        assert isinstance(stage_params, list) and len(stage_params) == 2
        return accuracy(run_stages(stages, stage_params, test_set["image"]))

    state, history = ddl.fit(strategy, params, batches, steps=100, eval_fn=eval_fn, progress=False)
    evaluated = history[-1]["eval"]
    assert evaluated > 0.9

    for module, p in zip(modules, jax.device_get(strategy.params(state)), strict=True):
        ddl.flax.update_module(module, p)
    x = test_set["image"]
    for module in modules:
        x = module(x)
    assert float(accuracy(x)) == evaluated


def test_pipeline_docstring_example_runs():
    finder = doctest.DocTestFinder()
    [example] = finder.find(pipeline, "pipeline", globs={})
    assert doctest.DocTestRunner().run(example) == (0, 7)  # (failed, attempted)


# --- model state and randomness: BatchNorm and Dropout in the stages ---------------------


class BNBlock(nnx.Module):
    """Linear, BatchNorm, ReLU and Dropout: a stage with model state and randomness."""

    def __init__(self, n_in: int, n_out: int, *, rate: float, rngs: nnx.Rngs):
        self.lin = nnx.Linear(n_in, n_out, rngs=rngs)
        self.norm = nnx.BatchNorm(n_out, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        x = x["x"] if isinstance(x, dict) else x
        return self.drop(nnx.relu(self.norm(self.lin(x))))


def bn_modules(rate: float = 0.3) -> list[BNBlock]:
    """Two stages, 12 -> 16 -> 5, each with BatchNorm and Dropout; the same on every call."""
    return [
        BNBlock(12, 16, rate=rate, rngs=nnx.Rngs(params=0, dropout=1)),
        BNBlock(16, 5, rate=rate, rngs=nnx.Rngs(params=1, dropout=2)),
    ]


def test_pipeline_stages_of_stateful_modules_are_model_losses_with_their_variables():
    modules = [nnx.Linear(12, 12, rngs=nnx.Rngs(0)), *bn_modules()]
    stages, variables = pipeline_stages(modules)
    assert callable(stages[0][0]) and not isinstance(stages[0][0], ddl.ModelLoss)
    assert all(isinstance(apply, ddl.ModelLoss) for apply, _ in stages[1:])
    assert set(variables[0]) == {"kernel", "bias"}
    assert all(set(v) == {"params", "batch_stats"} for v in variables[1:])
    # One seed for the run: the first stream of the first module with one.
    first = first_stream_key(modules[1])
    for apply, _ in stages[1:]:
        np.testing.assert_array_equal(apply.seed, first)
    assert [v for _, v in stages] == variables


def micro_batch_loop(modules, optimizer, batches, n, m):
    """Single-device training of the stages composed: each step runs every worker's M
    micro-batches through the stages in order (each forward updating the running
    statistics, micro-batch j of stage k on worker w at step t drawing the documented key
    ``fold_in(fold_in(fold_in(fold_in(seed, t), w), k), j)``), averages the gradients over
    all micro-batches and the statistics over the workers, and takes one optimizer step."""
    parts = [nnx.split(x, nnx.Param, nnx.BatchStat, nnx.RngKey, nnx.RngCount) for x in modules]
    graphs = [g for g, *_ in parts]
    params, stats, keys, counts = (
        [nnx.to_pure_dict(part[i]) for part in parts] for i in range(1, 5)
    )
    base = first_stream_key(modules[0])

    @jax.jit
    def grad(params, stats, micro, key, j):
        def loss(params):
            x, new = micro, []
            stages = zip(graphs, params, stats, keys, counts, strict=True)
            for k, (g, p, s, r, c) in enumerate(stages):
                leaves, treedef = jax.tree.flatten(r)
                stage = jax.random.fold_in(key, k)
                stage = jax.random.fold_in(stage, j) if m > 1 else stage
                fresh = treedef.unflatten(
                    [jax.random.fold_in(stage, i) for i in range(len(leaves))]
                )
                module = nnx.merge(g, p, s, fresh, c)
                x = module(x)
                new.append(nnx.to_pure_dict(nnx.state(module, nnx.BatchStat)))
            return xent(x, micro), new

        return jax.grad(loss, has_aux=True)(params)

    def mean(trees):
        return jax.tree.map(lambda *x: sum(x) / len(x), *trees)

    opt_state = optimizer.init(params)
    for t, batch in enumerate(batches):
        grads, ends = [], []
        for w, shard in enumerate(worker_shards(batch, n)):
            s = stats
            for j in range(m):
                micro = jax.tree.map(lambda v, j=j: np.split(v, m)[j], shard)
                g, s = grad(params, s, micro, step_key(base, t, w), j)
                grads.append(g)
            ends.append(s)
        stats = mean(ends)
        updates, opt_state = optimizer.update(mean(grads), opt_state, params)
        params = optax.apply_updates(params, updates)
    return [{"params": p, "batch_stats": s} for p, s in zip(params, stats, strict=True)]


@pytest.mark.parametrize(
    ("schedule", "n", "m", "rate", "costs"),
    [
        ("gpipe", 2, 2, 0.0, "flops"),
        ("1f1b", 1, 4, 0.0, "flops"),
        ("gpipe", 1, 4, 0.3, GROUPING[2]),
        ("1f1b", 2, 3, 0.3, "flops"),
    ],
)
def test_exact_schedules_with_batch_norm_and_dropout_equal_a_loop_over_micro_batches(
    schedule, n, m, rate, costs
):
    """Running statistics updated by each micro-batch's forward in order, gradients averaged;
    with dropout, each (stage, micro-batch) draws its documented key in its forward and in
    its backward's recomputation alike, so the gradient is exact for the mask used (in
    grouped ticks too)."""
    stages, variables = pipeline_stages(bn_modules(rate))
    batches = make_batches(2, 12 * n)
    mesh = ddl.make_mesh(data=n, stage=2)
    strategy = pipeline(
        stages, xent, optax.sgd(0.1), mesh, microbatches=m, schedule=schedule, tick_costs=costs
    )
    got, _ = train(strategy, variables, batches)
    expected = micro_batch_loop(bn_modules(rate), optax.sgd(0.1), batches, n, m)
    chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)
    assert not np.allclose(got[1]["batch_stats"]["norm"]["mean"], 0.0)


def test_ddg_with_one_stage_and_batch_norm_is_a_flax_loop_over_micro_batches():
    """K=1: each tick is a step on one micro-batch, drawing the key of its global index."""
    loss_fn, variables = bn_dropout_pair()
    batches = make_batches(2, 16)
    mesh = ddl.make_mesh(data=1)
    options = {"microbatches": 2, "schedule": "ddg"}
    strategy = pipeline(
        [(loss_fn, variables)], lambda loss, b: loss, optax.sgd(0.1), mesh, **options
    )
    [got], _ = train(strategy, [variables], batches)
    micro = [jax.tree.map(lambda v, j=j: v[8 * j : 8 * j + 8], b) for b in batches for j in (0, 1)]
    model = BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1))
    expected = nnx_reference(model, optax.sgd(0.1), micro, first_stream_key(model))
    chex.assert_trees_all_close(got, expected, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ddg"])
def test_two_stages_with_batch_norm_and_dropout_compile_once_and_resume_bitwise(schedule, tmp_path):
    modules = bn_modules()
    stages, variables = pipeline_stages(modules)
    batches = make_batches(6, 16)
    options = {"schedule": schedule, "example_batch": batches[0]}
    mesh = ddl.make_mesh(data=2, stage=2)
    strategy = pipeline(stages, xent, optax.adam(1e-2), mesh, microbatches=2, **options)
    traces = []

    def counted(state, batch):
        traces.append(1)
        return strategy.step(state, batch)

    step = jax.jit(counted)
    state = strategy.init(variables)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(3, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(3, args=ocp.args.StandardRestore(like))
    for batch in batches[3:]:
        state, _ = step(state, batch)
        restored, _ = step(restored, batch)
    chex.assert_trees_all_equal(restored, state)
    assert len(traces) == 1
    trained = strategy.params(state)
    for stage in trained:
        assert set(stage) == {"params", "batch_stats"}
        assert not np.allclose(stage["batch_stats"]["norm"]["mean"], 0.0)
    ddl.flax.update_module(modules, jax.device_get(trained))
    chex.assert_trees_all_equal(pipeline_stages(modules)[1], jax.device_get(trained))


class MaskStage(nnx.Module):
    """Passes a one-hot row selector ``sel`` on and adds ``dropout(1) * (sel @ w)`` to the
    signal: with a loss summing the signal, row r of w's gradient is the mask of example r."""

    def __init__(self, rows: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((rows, 64)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.rows = rows

    def __call__(self, z):
        z = z["z"] if isinstance(z, dict) else z
        sel, h = z[:, : self.rows], z[:, self.rows :]
        return jnp.concatenate([sel, h + self.drop(jnp.ones_like(h)) * (sel @ self.w[...])], 1)


@pytest.mark.parametrize(("schedule", "steps"), [("gpipe", 1), ("1f1b", 1), ("ddg", 2)])
def test_dropout_masks_differ_across_stages_micro_batches_and_workers(schedule, steps):
    """data=2, stage=2, M=2, one example per micro-batch: every (stage, worker, micro-batch)
    draws its own mask, from the documented key (DDG: the micro-batch's global index)."""
    n, m, rows = 2, 2, 4 * steps
    modules = [MaskStage(rows, rngs=nnx.Rngs(dropout=5)), MaskStage(rows, rngs=nnx.Rngs(dropout=6))]
    stages, variables = pipeline_stages(modules)
    eye = np.eye(rows, dtype=np.float32)
    batches = [{"z": np.pad(eye[4 * t : 4 * t + 4], ((0, 0), (0, 64)))} for t in range(steps)]
    options = {"schedule": schedule, "example_batch": batches[0]}
    mesh = ddl.make_mesh(data=n, stage=2)
    loss = lambda y, batch: y[:, rows:].sum()  # noqa: E731
    strategy = pipeline(stages, loss, optax.sgd(1.0), mesh, microbatches=m, **options)
    got, _ = train(strategy, variables, batches)
    base = first_stream_key(modules[0])
    seen, checked = set(), 0
    for k, t, w, j in itertools.product(range(2), range(steps), range(n), range(m)):
        row = 4 * t + m * w + j  # worker w's micro-batch j of step t
        if schedule == "ddg":  # tick 2 * steps - 1 backpropagated up to 2 * steps - 2 + k
            step, stage_key = t * m + j, jax.random.fold_in(step_key(base, t * m + j, w), k)
            if step > 2 * steps - 2 + k:
                assert not np.asarray(got[k]["params"]["w"])[row].any()
                continue
        else:
            stage_key = jax.random.fold_in(jax.random.fold_in(step_key(base, t, w), k), j)
        stream = jax.random.fold_in(stage_key, 0)  # the stage's only stream
        mask = jax.random.bernoulli(jax.random.fold_in(stream, 0), 0.5, (1, 64))[0]
        np.testing.assert_array_equal(np.asarray(got[k]["params"]["w"])[row] != 0, mask)
        seen.add(mask.tobytes())
        checked += 1
    assert len(seen) == checked >= 2 * n * m


def test_what_pipelines_cannot_carry_fails_clearly():
    loss_fn, variables = bn_dropout_pair()
    stages, _ = pipeline_stages([nnx.Linear(12, 5, rngs=nnx.Rngs(0))])
    mesh = ddl.make_mesh(data=1)
    with pytest.raises(ValueError, match="ModelLoss is not supported there.*in a stage"):
        pipeline(stages, loss_fn, optax.sgd(0.1), mesh, microbatches=1)
    with pytest.raises(TypeError, match=r"stages\[0\] is a stateful stage.*'batch_stats'"):
        pipeline([(loss_fn, variables["params"])], xent, optax.sgd(0.1), mesh, microbatches=1)
    strategy = pipeline(
        [(loss_fn, variables)], lambda y, b: y, optax.sgd(0.1), mesh, microbatches=1
    )
    with pytest.raises(TypeError, match=r"params\[0\]: stage 0 is stateful.*'batch_stats'"):
        strategy.init([variables["params"]])

    def wrong_state(params, model_state, batch, key):
        return jnp.sum(params["w"]), {"batch_stats": {"other": jnp.zeros(3)}}

    bad = (
        ddl.ModelLoss(wrong_state),
        {"params": {"w": jnp.ones(3)}, "batch_stats": {"m": jnp.ones(3)}},
    )
    with pytest.raises(ValueError, match="model state stage 0 returned has shapes"):
        pipeline(
            [bad],
            lambda y, b: y,
            optax.sgd(0.1),
            mesh,
            microbatches=1,
            example_batch=make_batches(1, 4)[0],
        )


class _LinenFirst(linen.Module):
    @linen.compact
    def __call__(self, batch):
        return linen.relu(linen.Dense(16)(batch["x"]))


def test_linen_stages_with_their_variables_train_like_one_device():
    modules = [_LinenFirst(), linen.Dense(5)]
    batches = pipeline_batches()
    key = jax.random.key(0)
    variables = [
        modules[0].init(key, batches[0]),
        modules[1].init(key, jnp.zeros((16, 16))),
    ]
    with pytest.raises(TypeError, match=r"modules\[0\] is a Linen module.*variables="):
        ddl.pipeline_stages(modules)
    stages, params = ddl.pipeline_stages(modules, variables)
    mesh = ddl.make_mesh(stage=2)
    strategy = ddl.pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2)
    state, step = strategy.init(params), jax.jit(strategy.step)
    for batch in batches:
        state, _ = step(state, batch)
    expected = reference(full_loss(stages), optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


class _LinenDropoutFirst(linen.Module):
    """Dense, batch norm and dropout: a Linen stage with model state and randomness."""

    @linen.compact
    def __call__(self, batch):
        x = linen.BatchNorm(use_running_average=False, momentum=0.8)(linen.Dense(16)(batch["x"]))
        return linen.Dropout(0.5, deterministic=False)(linen.relu(x))


def test_linen_stages_with_dropout_take_rngs_and_train_as_a_hand_built_stage():
    """pipeline_stages(..., rngs=("dropout",), seed=s) makes the Linen stage that
    loss_from_module(..., rngs=("dropout",), seed=s) makes: the same losses and variables."""
    modules = [_LinenDropoutFirst(), linen.Dense(5)]
    batches = pipeline_batches()
    key = jax.random.key(0)
    variables = [
        modules[0].init({"params": key, "dropout": key}, batches[0]),
        modules[1].init(key, jnp.zeros((16, 16))),
    ]
    mesh = ddl.make_mesh(data=2, stage=2)

    def fit_losses(stages, params):
        strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2)
        step = jax.jit(strategy.step)
        state, losses = strategy.init(params), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.device_get(strategy.params(state))

    stages, params = ddl.pipeline_stages(modules, variables)
    with pytest.raises(ValueError, match=r"rngs=\('dropout', \.\.\.\) to .*ddl\.pipeline_stages"):
        fit_losses(stages, params)
    with pytest.raises(TypeError, match="rngs is only for Linen modules"):
        ddl.pipeline_stages([nnx.Linear(2, 2, rngs=nnx.Rngs(0))], rngs=("dropout",))

    stages, params = ddl.pipeline_stages(modules, variables, rngs=("dropout",), seed=3)
    losses, trained = fit_losses(stages, params)
    first = ddl.flax.loss_from_module(
        modules[0], lambda model, x: model(x), variables=variables[0], rngs=("dropout",), seed=3
    )
    [last], [last_params] = ddl.pipeline_stages(modules[1:], variables[1:])
    by_hand, by_hand_trained = fit_losses([first, last], [first[1], last_params])
    np.testing.assert_allclose(losses, by_hand, rtol=1e-6)
    chex.assert_trees_all_close(trained[0], by_hand_trained[0], atol=1e-6)
    chex.assert_trees_all_close(trained[1]["params"], by_hand_trained[1], atol=1e-6)
    other_seed, _ = fit_losses(*ddl.pipeline_stages(modules, variables, rngs=("dropout",)))
    assert not np.allclose(losses, other_seed)  # the masks follow the seed


def test_a_wrong_shaped_stage_parameter_prints_both_shapes():
    stages, params = split_mlp(2)
    strategy = pipeline(stages, xent, optax.sgd(0.1), ddl.make_mesh(stage=2), microbatches=2)
    wrong = jax.tree.map(lambda x: jnp.zeros((x.shape[0] + 1, *x.shape[1:])), params[1])
    got = jax.tree.map(np.shape, wrong)
    expected = jax.tree.map(np.shape, params[1])
    with pytest.raises(ValueError) as error:
        strategy.init([params[0], wrong])
    assert str(error.value) == (
        f"params[1] has shapes {got} but the stage was built with {expected}."
    )


def test_a_stage_without_parameters_is_refused_by_its_index():
    stages, params = split_mlp(2)
    activation = (lambda p, h: jnp.tanh(h), {})
    mesh = ddl.make_mesh(data=2, stage=3, devices=jax.devices()[:6])
    with pytest.raises(TypeError, match=r"stages\[1\] has no parameters"):
        pipeline([stages[0], activation, stages[1]], xent, optax.sgd(0.1), mesh, microbatches=2)
    strategy = pipeline(stages, xent, optax.sgd(0.1), ddl.make_mesh(stage=2), microbatches=2)
    with pytest.raises(TypeError, match=r"params\[1\]: params must be a non-empty pytree"):
        strategy.init([params[0], {}])
