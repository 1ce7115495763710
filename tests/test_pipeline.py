"""Pipelines (GPipe, 1F1B, DDG) against single-device backprop and the papers' formulas."""

import doctest
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, replica_groups
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as hs

import ddl_jax as ddl
from ddl_jax import pipeline, pipeline_stages
from ddl_jax.schedules import idle_fraction, make_schedule, peak_stash, stash_intervals

# Widths of the MLP split into K stages: stages differ in shapes (heterogeneous).
WIDTHS = {1: [12, 16, 5], 2: [12, 16, 8, 5], 4: [12, 16, 8, 16, 5]}


class Block(nnx.Module):
    """Dense layers; ReLU after each but the model's last."""

    def __init__(self, sizes, *, last: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.last = last

    def __call__(self, x):
        x = x["x"] if isinstance(x, dict) else x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.last and i == len(self.layers) - 1):
                x = nnx.relu(x)
        return x


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


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def full_loss(stages):
    """The unsplit model's loss: the stages composed on one device."""

    def loss(params, batch):
        x = batch
        for (apply, _), p in zip(stages, params, strict=True):
            x = apply(p, x)
        return xent(x, batch)

    return loss


def reference(loss_fn, optimizer, params, batches):
    params = jax.tree.map(jnp.asarray, params)
    opt_state = optimizer.init(params)
    for batch in batches:
        updates, opt_state = optimizer.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


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


@settings(max_examples=8, deadline=None)
@given(k=hs.integers(1, 6), m=hs.integers(1, 12), tick=hs.integers(0, 50))
def test_ddg_keeps_every_stage_busy_with_delay_2_k_minus_1_minus_k(k, m, tick):
    s = make_schedule(k, m, "ddg", tick=tick + 2 * k)  # a step with a full pipeline
    assert idle_fraction(s) == 0.0
    stage = np.arange(k)
    np.testing.assert_array_equal(s.forward - s.backward, 2 * (k - 1 - stage)[None, :].repeat(m, 0))


def test_compiled_1f1b_memory_stays_flat_in_m_while_gpipe_grows_by_m_activations():
    """Memory analysis of the compiled step: GPipe stashes M stage inputs, 1F1B at most K."""
    stages, params = split_mlp(2, [12, 256, 5])
    temp = {}
    for schedule, m in (("1f1b", 4), ("1f1b", 16), ("gpipe", 16)):
        mesh = ddl.make_mesh(data=1, stage=2)
        strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=m, schedule=schedule)
        [batch] = make_batches(1, 8 * m)
        compiled = jax.jit(strategy.step).lower(strategy.init(params), batch).compile()
        temp[schedule, m] = compiled.memory_analysis().temp_size_in_bytes
    activation = 8 * 256 * 4  # one micro-batch's input to stage 1, float32
    assert temp["1f1b", 16] - temp["1f1b", 4] < activation
    # GPipe's stash holds 16 inputs where 1F1B's holds 2 (K).
    assert temp["gpipe", 16] - temp["1f1b", 16] >= 14 * activation


# --- exact schedules against single-device training ------------------------------------


@pytest.mark.parametrize(
    ("schedule", "k", "n", "m"),
    [
        ("gpipe", 1, 2, 2),
        ("gpipe", 2, 1, 4),
        ("gpipe", 4, 2, 4),
        ("1f1b", 2, 2, 2),
        ("1f1b", 4, 1, 8),
    ],
)
def test_exact_schedules_equal_single_device_training(schedule, k, n, m):
    stages, params = split_mlp(k)
    batches = make_batches(3, 16)
    mesh = ddl.make_mesh(data=n, stage=k)
    strategy = pipeline(stages, xent, optax.adam(1e-2), mesh, microbatches=m, schedule=schedule)
    got, metrics = train(strategy, params, batches)
    expected = reference(full_loss(stages), optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=0)
    previous = reference(full_loss(stages), optax.adam(1e-2), params, batches[:2])
    np.testing.assert_allclose(metrics["loss"], full_loss(stages)(previous, batches[2]), rtol=1e-5)


# --- DDG ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_ddg_follows_the_delayed_gradient_rule(k):
    stages, params = split_mlp(k, widths=[12, 16, 8, 8, 5][: k + 2] if k > 1 else None)
    batches = make_batches(3, 8, seed=1)
    m_ = 2
    mesh = ddl.make_mesh(data=1, stage=k)
    ddg = {"schedule": "ddg", "example_batch": batches[0]}
    strategy = pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=m_, **ddg)
    got, _ = train(strategy, params, batches)
    expected = jax.jit(lambda p, b: ddg_step_by_step(stages, 0.1, p, b, m_))(params, batches)
    chex.assert_trees_all_close(got, expected, atol=1e-5)


def ddg_step_by_step(stages, lr, params, batches, m_):
    """Huo et al.'s rule as written in ``pipeline``'s docstring, tick by tick in Python.

    At global tick t stage k forwards micro-batch t-k with its weights before the tick, and
    updates with the gradient of micro-batch j = t-2(K-1)+k: stage k re-run from its stored
    input h_j with its current weights, pulled back along the error delta_j that stage k+1
    computed on tick t-1 (the last stage differentiates its own loss at once).
    """
    k_ = len(stages)
    micro = [
        {key: v[i * len(v) // m_ : (i + 1) * len(v) // m_] for key, v in b.items()}
        for b in batches
        for i in range(m_)
    ]
    params = [jax.tree.map(jnp.asarray, p) for p in params]
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
            params[k] = jax.tree.map(lambda w, g: w - lr * g, params[k], grad_p)
        inputs.update(outputs)
        deltas = new_deltas
    return params


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
        ValueError, match=re.escape("the mesh has no 'stage' axis (its axes: ['data', 'pipe'])")
    ):
        pipeline(stages, xent, optax.sgd(0.1), misspelt, microbatches=2)
    with pytest.raises(TypeError, match="reducer must be an optax.GradientTransformation"):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, reducer="mean")
    with pytest.raises(ValueError, match="needs example_batch="):
        pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2, schedule="ddg")
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


def test_stages_with_batch_norm_or_dropout_are_refused_clearly():
    from conftest import BNDropoutMLP

    with pytest.raises(ValueError, match=r"modules\[1\] \(BNDropoutMLP\).*BatchNorm/Dropout"):
        ddl.pipeline_stages([nnx.Linear(12, 12, rngs=nnx.Rngs(0)), BNDropoutMLP(rngs=nnx.Rngs(0))])
    loss_fn, _ = ddl.flax.loss_from_module(BNDropoutMLP(rngs=nnx.Rngs(0)), lambda m, b: 0.0)
    stages, _ = ddl.pipeline_stages([nnx.Linear(12, 5, rngs=nnx.Rngs(0))])
    with pytest.raises(ValueError, match="cannot be pipelined yet"):
        ddl.pipeline(stages, loss_fn, optax.sgd(0.1), ddl.make_mesh(data=1), microbatches=1)
