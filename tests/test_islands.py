"""Islands: an outer method (``local_sgd(inner=...)``) over a sharded inner strategy.

The obviously right reference is the flat method: DiLoCo over islands of any inner
strategy is DiLoCo whose workers each compute the gradient of their island's share of the
batch, which the flat ``local_sgd`` on one device per island does.
"""

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, replica_groups
from flax import nnx

import ddl_jax as ddl
from ddl_jax.layers import ParallelMLP, param_specs

OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


class Classifier(nnx.Module):
    """A tensor-parallel MLP (ddl.layers) under a replicated head."""

    def __init__(self, rngs):
        self.mlp = ParallelMLP(12, 16, rngs=rngs)
        self.head = nnx.Linear(12, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.mlp(x))


def classifier_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.fixture(scope="module")
def model():
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    return loss_fn, params, param_specs(module)


def inner_strategy(name, loss_fn, optimizer, specs, islands=2):
    if name == "tensor_parallel":
        mesh = ddl.make_mesh(island=islands, data=2, model=2)
        return ddl.tensor_parallel(loss_fn, optimizer, mesh, specs=specs)
    if name == "fsdp3_tensor_parallel":  # Megatron over model, each block split over data
        mesh = ddl.make_mesh(island=islands, data=2, model=2)
        return ddl.fsdp(loss_fn, optimizer, mesh, stage=3, specs=specs)
    mesh = ddl.make_mesh(island=islands, data=8 // islands)
    if name == "data_parallel":
        return ddl.data_parallel(loss_fn, optimizer, mesh)
    stage = int(name[-1])
    return ddl.fsdp(loss_fn, optimizer, mesh, stage=stage)


INNER = ("data_parallel", "fsdp1", "fsdp2", "fsdp3", "tensor_parallel", "fsdp3_tensor_parallel")


def train(strategy, params, batches):
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


def flat(loss_fn, optimizer, workers=2, **options):
    return ddl.local_sgd(loss_fn, optimizer, ddl.make_mesh(data=workers), **options)


@pytest.mark.parametrize("name", INNER)
def test_diloco_over_every_inner_strategy_is_flat_diloco_with_one_worker_per_island(model, name):
    loss_fn, params, specs = model
    batches = make_batches(6, 32)
    options = {"period": 2, "outer_optimizer": OUTER}
    inner = inner_strategy(name, loss_fn, optax.adam(1e-2), specs)
    state, history = train(ddl.local_sgd(inner=inner, **options), params, batches)
    ref_state, ref_history = train(flat(loss_fn, optax.adam(1e-2), **options), params, batches)
    chex.assert_trees_all_close(
        jax.device_get(ddl.local_sgd(inner=inner, **options).params(state)),
        jax.device_get(flat(loss_fn, optax.adam(1e-2), **options).params(ref_state)),
        atol=2e-5,
    )
    assert [m["synchronised"] for m in history] == [m["synchronised"] for m in ref_history]
    np.testing.assert_allclose(
        [m["loss"] for m in history], [m["loss"] for m in ref_history], rtol=1e-5
    )


def test_one_island_is_the_inner_strategy_alone(model):
    loss_fn, params, _ = model
    batches = make_batches(5, 32)
    inner = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(island=1, data=8), stage=3)
    state, _ = train(ddl.local_sgd(inner=inner, period=2), params, batches)
    alone = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), stage=3)
    ref, _ = train(alone, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(ddl.local_sgd(inner=inner, period=2).params(state)),
        jax.device_get(alone.params(ref)),
        atol=1e-6,
    )


@pytest.mark.parametrize("name", ("fsdp3", "tensor_parallel"))
def test_period_one_outer_sgd_at_rate_one_is_the_inner_strategy_over_every_device(model, name):
    loss_fn, params, specs = model
    batches = make_batches(4, 32)
    inner = inner_strategy(name, loss_fn, optax.sgd(0.1), specs)
    stacked = ddl.local_sgd(inner=inner, period=1, outer_optimizer=optax.sgd(1.0))
    state, _ = train(stacked, params, batches)
    if name == "tensor_parallel":
        mesh = ddl.make_mesh(data=4, model=2)
        whole = ddl.tensor_parallel(loss_fn, optax.sgd(0.1), mesh, specs=specs)
    else:
        whole = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), stage=3)
    ref, _ = train(whole, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(whole.params(ref)), atol=1e-6
    )


def test_diloco_over_fsdp_equals_diloco_over_replicated_data_parallel(model):
    loss_fn, params, specs = model
    batches = make_batches(6, 32)
    results = []
    for name in ("fsdp3", "data_parallel"):
        inner = inner_strategy(name, loss_fn, optax.adamw(1e-2), specs)
        strategy = ddl.local_sgd(inner=inner, period=3, outer_optimizer=OUTER)
        state, _ = train(strategy, params, batches)
        results.append(jax.device_get(strategy.params(state)))
    chex.assert_trees_all_close(*results, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"reducer": lambda axis: ddl.compression.sparse_loco(0.25, chunk=16, axis=axis)},
        {"state_periods": {"mu": 2, "nu": 4}},
        {"drop": 0.4, "churn": 0.2},
        {
            "reducer": lambda axis: ddl.compression.sparse_loco(0.25, chunk=16, axis=axis),
            "drop": 0.4,
        },
        {"average_optimizer_state": True},
    ],
    ids=[
        "sparse_loco",
        "desloc",
        "unreliable",
        "sparse_loco_unreliable",
        "average_optimizer_state",
    ],
)
def test_outer_options_over_replicated_islands_equal_the_flat_method(model, options):
    """With data parallelism inside, each device's shard is the whole model: compression,
    DES-LOC's moment averages and lost islands then act as on flat workers."""
    loss_fn, params, specs = model
    batches = make_batches(8, 32)
    base = {"period": 2, "outer_optimizer": OUTER}

    def built(axis):
        return {k: v(axis) if callable(v) else v for k, v in options.items()}

    inner = inner_strategy("data_parallel", loss_fn, optax.adam(1e-2), specs)
    stacked = ddl.local_sgd(inner=inner, **base, **built("island"))
    state, history = train(stacked, params, batches)
    reference = flat(loss_fn, optax.adam(1e-2), **base, **built("data"))
    ref, ref_history = train(reference, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    for key in ref_history[0]:
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in ref_history], rtol=1e-5, err_msg=key
        )


def test_hierarchical_averaging_over_islands_is_flat_hierarchical_averaging(model):
    """4 islands: pairs of islands average every 2 steps, all 4 every 4."""
    loss_fn, params, specs = model
    batches = make_batches(8, 32)
    options = {"hierarchy": ((2, 2), (4, 4)), "average_optimizer_state": True}
    inner = inner_strategy("fsdp3", loss_fn, optax.adam(1e-2), specs, islands=4)
    stacked = ddl.local_sgd(inner=inner, **options)
    state, history = train(stacked, params, batches)
    reference = flat(loss_fn, optax.adam(1e-2), workers=4, **options)
    ref, ref_history = train(reference, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    sizes = [float(m["sync_group_size"]) for m in history]
    assert sizes == [float(m["sync_group_size"]) for m in ref_history]
    assert set(sizes) == {0, 2, 4}


@pytest.mark.parametrize("name", ("data_parallel", "fsdp3"))
def test_noloco_over_islands_is_flat_noloco_with_one_worker_per_island(model, name):
    """4 islands of 2 devices: each step's random perfect matching of the islands is the
    one flat NoLoCo draws for its 4 workers (the same key and step)."""
    loss_fn, params, specs = model
    batches = make_batches(8, 32)
    inner = inner_strategy(name, loss_fn, optax.adam(1e-2), specs, islands=4)
    stacked = ddl.noloco(inner=inner, period=2)
    state, history = train(stacked, params, batches)
    mesh = ddl.make_mesh(data=4)
    reference = ddl.noloco(loss_fn, optax.adam(1e-2), mesh, period=2, consensus_every=0)
    ref, ref_history = train(reference, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    assert [m["synchronised"] for m in history] == [m["synchronised"] for m in ref_history]


@pytest.mark.parametrize("name", ("data_parallel", "fsdp3"))
def test_streaming_diloco_over_islands_is_flat_streaming_diloco(model, name):
    """Fragments in turn, overlapped and mixed: each device sends its shard of a fragment
    (FSDP splits every leaf of this model in 4, so the shards' fragments are the model's)."""
    loss_fn, params, specs = model
    batches = make_batches(8, 32)
    options = {"period": 4, "fragments": 2, "overlap": 1, "mix": 0.5, "outer_optimizer": OUTER}
    inner = inner_strategy(name, loss_fn, optax.adam(1e-2), specs)
    stacked = ddl.streaming_diloco(inner=inner, **options)
    state, history = train(stacked, params, batches)
    mesh = ddl.make_mesh(data=2)
    reference = ddl.streaming_diloco(loss_fn, optax.adam(1e-2), mesh, **options)
    ref, ref_history = train(reference, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    assert [m["fragment"] for m in history] == [m["fragment"] for m in ref_history]


def test_streaming_fragments_over_islands_are_cut_from_the_whole_models_leaves():
    """FSDP keeps a leaf that does not divide its 4 devices whole (``w1``, 6 x 10; the
    biases) and splits the others, so a device's shards weigh otherwise than the leaves:
    cut by the shards, the fragments were ((0, 1), (2,), (3, 4)) where the model's are
    ((0, 1, 2), (3,), (4,)), and the run drifted from flat Streaming DiLoCo."""
    key = iter(jax.random.split(jax.random.key(0), 3))
    params = {"w1": 0.3 * jax.random.normal(next(key), (6, 10)), "b1": jnp.zeros(10),
              "w2": 0.3 * jax.random.normal(next(key), (10, 8)),
              "w3": 0.3 * jax.random.normal(next(key), (8, 5)), "b3": jnp.zeros(5)}  # fmt: skip

    def loss_fn(p, batch):
        h = jnp.tanh(jnp.tanh(batch["x"][:, :6] @ p["w1"] + p["b1"]) @ p["w2"])
        logits = h @ p["w3"] + p["b3"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    options = {"period": 6, "fragments": 3, "outer_optimizer": OUTER}
    inner = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(island=2, data=4), stage=3)
    stacked = ddl.streaming_diloco(inner=inner, **options)
    state, history = train(stacked, params, make_batches(6, 32))
    reference = ddl.streaming_diloco(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=2), **options)
    ref, ref_history = train(reference, params, make_batches(6, 32))
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    assert [m["fragment"] for m in history] == [m["fragment"] for m in ref_history]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"order": "adapt_then_combine"},
        {"drop": 0.3, "churn": 0.2},
        {"topology": "one_peer_exponential", "drop": 0.3},
    ],
    ids=["reliable", "adapt_then_combine", "lossy", "one_peer"],
)
def test_gossip_over_islands_is_flat_gossip_with_one_worker_per_island(model, options):
    loss_fn, params, specs = model
    batches = make_batches(6, 32)
    inner = inner_strategy("fsdp3", loss_fn, optax.adam(1e-2), specs, islands=4)
    stacked = ddl.gossip(inner=inner, **{"topology": "ring", **options})
    state, history = train(stacked, params, batches)
    mesh = ddl.make_mesh(data=4)
    reference = ddl.gossip(loss_fn, optax.adam(1e-2), mesh, consensus_every=0, **options)
    ref, ref_history = train(reference, params, batches)
    chex.assert_trees_all_close(
        jax.device_get(stacked.params(state)), jax.device_get(reference.params(ref)), atol=2e-5
    )
    for key in set(ref_history[0]) - {"loss"}:  # with churn, the loss is every island's
        assert [m[key] for m in history] == [m[key] for m in ref_history], key


def test_error_feedback_is_kept_per_shard_under_fsdp(model):
    loss_fn, params, specs = model
    inner = inner_strategy("fsdp3", loss_fn, optax.adam(1e-2), specs)
    reducer = ddl.compression.sparse_loco(0.25, chunk=16, axis="island")
    strategy = ddl.local_sgd(inner=inner, period=2, outer_optimizer=OUTER, reducer=reducer)
    state, history = train(strategy, params, make_batches(8, 32))
    kernel = state.inner.params["mlp"]["up"]["kernel"]  # [island, 12, 16] over data
    assert kernel.sharding.spec[0] == "island"
    _, _, reducer_state = state.outer  # the anchor, the outer momentum, error feedback
    residual = jax.tree.leaves(reducer_state)
    # one entry per device, each its island's residual of its shard
    assert all(leaf.shape[0] == 8 for leaf in residual)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["compression_ratio"] > 1


@pytest.mark.parametrize("method", ["local_sgd", "streaming_diloco"])
def test_a_reducer_given_as_a_function_of_the_axis_is_the_reducer_over_islands(model, method):
    """As the flat methods take it: the strategy calls it with the island axis."""
    loss_fn, params, specs = model
    build = {
        "local_sgd": functools.partial(ddl.local_sgd, period=2),
        "streaming_diloco": functools.partial(ddl.streaming_diloco, period=2, fragments=1),
    }
    runs = []
    for reducer in (ddl.compression.cast(jnp.bfloat16, axis="island"),
                    lambda axis: ddl.compression.cast(jnp.bfloat16, axis=axis)):  # fmt: skip
        inner = inner_strategy("data_parallel", loss_fn, optax.adam(1e-2), specs)
        strategy = build[method](inner=inner, outer_optimizer=OUTER, reducer=reducer)
        state, _ = train(strategy, params, make_batches(4, 32))
        runs.append(strategy.params(state))
    chex.assert_trees_all_equal(*runs)


def per_device_bytes(compiled):
    stats = compiled.memory_analysis()
    return stats.argument_size_in_bytes


def test_diloco_over_fsdp_holds_a_shard_of_everything_per_device(model):
    """Memory from memory_analysis: DiLoCo over FSDP stage 3 keeps FSDP's state plus the
    anchor and outer state of its shard; flat DiLoCo keeps a whole replica per device."""
    loss_fn, params, specs = model
    batch = make_batches(1, 32)[0]
    fsdp_inner = inner_strategy("fsdp3", loss_fn, optax.adam(1e-2), specs)
    stacked = ddl.local_sgd(inner=fsdp_inner, period=2, outer_optimizer=OUTER)
    alone = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=4), stage=3)
    flat_diloco = flat(loss_fn, optax.adam(1e-2), workers=8, period=2, outer_optimizer=OUTER)

    def arguments(strategy):
        state = strategy.init(params)
        return per_device_bytes(jax.jit(strategy.step).lower(state, batch).compile()), state

    stacked_bytes, _ = arguments(stacked)
    alone_bytes, _ = arguments(alone)
    flat_bytes, _ = arguments(flat_diloco)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    outer = 2 * model_bytes / 4  # the anchor and the momentum, a quarter per device
    assert stacked_bytes <= 1.1 * (alone_bytes + outer)
    assert flat_bytes >= 4 * model_bytes  # params, Adam's two moments, anchor, momentum
    assert stacked_bytes < flat_bytes / 2.5


def crosses_islands(op_line):
    """Whether an HLO collective's replica groups join devices of both islands (0-3, 4-7)."""
    return any(len({d // 4 for d in group}) > 1 for group in replica_groups(op_line))


def test_the_outer_exchange_sends_a_shard_over_island_and_inner_collectives_stay_inside(model):
    """Bytes from the HLO: a synchronisation sends each device's quarter of the model to its
    counterpart (flat DiLoCo between 2 workers: the whole model); between
    synchronisations only the step's metrics (a few scalars) cross islands."""
    loss_fn, params, specs = model
    batch = make_batches(1, 32)[0]
    inner = inner_strategy("fsdp3", loss_fn, optax.adam(1e-2), specs)
    stacked = ddl.local_sgd(inner=inner, period=2, outer_optimizer=OUTER)
    flat_diloco = flat(loss_fn, optax.adam(1e-2), workers=2, period=2, outer_optimizer=OUTER)
    stats = {}
    for name, strategy in (("stacked", stacked), ("flat", flat_diloco)):
        stats[name] = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert max(stats["flat"].branches.values()) == pytest.approx(model_bytes, rel=0.01)
    assert max(stats["stacked"].branches.values()) == pytest.approx(model_bytes / 4, rel=0.01)
    # unconditionally, each device sends what FSDP alone on its island sends, and the loss
    alone = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=4), stage=3)
    half = {k: v[:16] for k, v in batch.items()}
    inside = ddl.comm_stats(jax.jit(alone.step), alone.init(params), half).bytes_per_device
    assert inside < stats["stacked"].bytes_per_device <= inside + 8
    within, across = ddl.sim.split_islands(stats["stacked"], 4)
    assert within.bytes_per_device == pytest.approx(inside) and not within.branches
    assert across.bytes_per_device <= 8
    assert max(across.branches.values()) == pytest.approx(model_bytes / 4, rel=0.01)
    slow, fast = ddl.sim.ETHERNET_1G, ddl.sim.TPU_V4_ICI
    two = ddl.sim.estimate_step_time(stats["stacked"], slow, inner_network=fast, island_devices=4)
    assert two == pytest.approx(
        ddl.sim.estimate_step_time(within, fast) + ddl.sim.estimate_step_time(across, slow)
    )
    assert two < ddl.sim.estimate_step_time(stats["stacked"], slow)
    hlo = jax.jit(stacked.step).lower(stacked.init(params), batch).compile().as_text()
    crossing = {
        re.search(r"= .*? ([a-z\-]+)\(", line)[1]
        for line in hlo.splitlines()
        if "replica_groups" in line and crosses_islands(line)
    }
    assert crossing == {"all-reduce"}


def test_wrong_arguments_are_clear_errors(model):
    loss_fn, params, _ = model
    island_mesh = ddl.make_mesh(island=2, data=4)
    inner = ddl.fsdp(loss_fn, optax.sgd(0.1), island_mesh)
    with pytest.raises(ValueError, match=r"communicates over \['data'\].*axis='island'"):
        ddl.local_sgd(inner=inner, period=2, reducer=ddl.compression.top_k(0.5)).init(params)
    with pytest.raises(ValueError, match="loss_fn=.*inner strategy's to set"):
        ddl.local_sgd(loss_fn, inner=inner, period=2)
    with pytest.raises(ValueError, match="warmup_sync_steps"):
        ddl.local_sgd(inner=inner, period=2, warmup_sync_steps=2)
    with pytest.raises(TypeError, match="inner must be a ddl strategy"):
        ddl.local_sgd(inner=optax.sgd(0.1), period=2)
    no_islands = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    with pytest.raises(ValueError, match="mesh with an 'island' axis"):
        ddl.local_sgd(inner=no_islands, period=2).init(params)
    with pytest.raises(ValueError, match=r"'island' axis.*local_sgd\(inner="):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), island_mesh)
    with pytest.raises(ValueError, match="consensus_every measures whole replicas"):
        ddl.noloco(inner=inner, period=2, consensus_every=5)
    with pytest.raises(ValueError, match="optimizer=.*inner strategy's to set"):
        ddl.noloco(optimizer=optax.sgd(0.1), inner=inner, period=2)
    with pytest.raises(ValueError, match="hierarchy's last group size must be the number"):
        ddl.local_sgd(inner=inner, hierarchy=((1, 2), (2, 8))).init(params)
    with pytest.raises(ValueError, match="topology='star' is not known"):
        ddl.gossip(inner=inner, topology="star")  # when built, before init
    # local SGD's own settings, when built too (as without islands)
    with pytest.raises(ValueError, match="local_sgd takes period=H or hierarchy="):
        ddl.local_sgd(inner=inner)
    with pytest.raises(ValueError, match="period must be an int >= 1, got 0"):
        ddl.local_sgd(inner=inner, period=0)
    with pytest.raises(ValueError, match="hierarchy's periods must increase"):
        ddl.local_sgd(inner=inner, hierarchy=((2, 1), (2, 2)))


def test_fit_warns_that_an_inner_strategy_alone_trains_its_islands_apart(model):
    loss_fn, params, _ = model
    alone = inner_strategy("fsdp3", loss_fn, optax.sgd(0.1), None)
    with pytest.warns(UserWarning, match=r"2 islands, which never exchange: pass the strategy as "):
        ddl.fit(alone, params, make_batches(1, 32), steps=1, progress=False)
    stacked = ddl.local_sgd(inner=alone, period=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddl.fit(stacked, params, make_batches(1, 32), steps=1, progress=False)
