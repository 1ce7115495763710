"""FSDP layer by layer: stacked layers run with ``ddl.layers.scan_layers`` are gathered one
at a time, forward and backward, and train as single-device SGD on the global batch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, reference_sgd

import ddl_jax as ddl


def scan_mlp(width: int, depth: int, seed: int = 0) -> dict:
    """A 12-in, 5-out MLP whose ``depth`` hidden layers are one stacked pytree."""
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "inp": {"w": jax.random.normal(k[0], (12, width)) * 0.3},
        "layers": {
            "w": jax.random.normal(k[1], (depth, width, width)) / np.sqrt(width),
            "b": jnp.zeros((depth, width)),
        },
        "out": {"w": jax.random.normal(k[2], (width, 5)) * 0.3},
    }


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["inp"]["w"])
    h = ddl.layers.scan_layers(layer, params["layers"], h)
    logits = h @ params["out"]["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(strategy, params, batches):
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    return jax.device_get(strategy.params(state))


def test_scan_layers_alone_is_a_loop_over_the_layers():
    params = scan_mlp(16, 3)
    x = jnp.ones((4, 16))
    expected = x
    for i in range(3):
        expected = layer(jax.tree.map(lambda a, i=i: a[i], params["layers"]), expected)
    got = ddl.layers.scan_layers(layer, params["layers"], x)
    chex.assert_trees_all_close(got, expected, atol=1e-6)
    policy = jax.checkpoint_policies.dots_saveable
    again = ddl.layers.scan_layers(layer, params["layers"], x, policy=policy)
    chex.assert_trees_all_close(again, expected, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_layer_by_layer_equals_single_device_training_on_the_global_batch(accumulate):
    params = scan_mlp(16, 4)
    batches = make_batches(4, 32)
    mesh = ddl.make_mesh(data=8)
    per_layer = ddl.fsdp(loss_fn, optax.adam(1e-2), mesh, stage=3, accumulate=accumulate)
    once = ddl.fsdp(
        loss_fn, optax.adam(1e-2), mesh, stage=3, reshard_after_forward=False,
        accumulate=accumulate,
    )  # fmt: skip
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(train(per_layer, params, batches), expected, atol=1e-5)
    chex.assert_trees_all_close(train(once, params, batches), expected, atol=1e-5)


def gathers(strategy, params, batch):
    """``(executions per step of all-gathers inside loops, of the others)``, counting
    each buffer of a combined op."""
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    looped = sum(op.count * op.buffers for op in stats.ops
                 if op.kind == "all-gather" and op.count > 1)  # fmt: skip
    once = sum(op.buffers for op in stats.ops if op.kind == "all-gather" and op.count == 1)
    return looped, once


def test_each_layer_is_gathered_in_the_forward_and_again_in_the_backward():
    """From the HLO: the two stacked leaves are gathered once per layer in the forward
    scan and once per layer in the backward's; the other two parameters once per step."""
    depth = 6
    params, batch = scan_mlp(16, depth), make_batches(1, 32)[0]
    mesh = ddl.make_mesh(data=8)
    per_layer = ddl.fsdp(loss_fn, optax.adam(1e-2), mesh, stage=3)
    once = ddl.fsdp(loss_fn, optax.adam(1e-2), mesh, stage=3, reshard_after_forward=False)
    assert gathers(per_layer, params, batch) == (2 * 2 * depth, 2)
    assert gathers(once, params, batch) == (0, 4)


def temporaries(strategy, params, batch):
    compiled = jax.jit(strategy.step).lower(strategy.init(params), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporaries_no_longer_grow_with_depth():
    """From memory_analysis: doubling the layers doubles what gather-once FSDP holds in
    temporaries (every layer whole through the backward), not what layer-by-layer does."""
    batch = make_batches(1, 16)[0]
    mesh = ddl.make_mesh(data=8)
    held = {}
    for reshard in (True, False):
        for depth in (4, 8):
            strategy = ddl.fsdp(
                loss_fn, optax.sgd(0.1), mesh, stage=3, reshard_after_forward=reshard
            )
            held[reshard, depth] = temporaries(strategy, scan_mlp(256, depth), batch)
    assert held[False, 8] > 1.8 * held[False, 4]
    assert held[True, 8] < 1.3 * held[True, 4]
    assert held[True, 8] < held[False, 8] / 3


def test_layer_by_layer_holds_under_mixed_precision():
    """``ddl.mixed_precision`` casts the stacked leaves before ``scan_layers`` gets them:
    FSDP still finds them (each cast stands for its leaf), so temporaries stay about one
    layer (before: everything gathered once, 2.49x the parameters at 8 layers against
    0.32x), and training is that of gathering once but for the layers' gradient, rounded
    to bfloat16 after its reduce-scatter (the loss casts the shard before the gather)."""
    batch = make_batches(1, 16)[0]
    mesh = ddl.make_mesh(data=8)
    loss = ddl.mixed_precision(loss_fn, jnp.bfloat16)
    held, trained = {}, {}
    params = scan_mlp(256, 8)
    for reshard in (True, False):
        strategy = ddl.fsdp(loss, optax.sgd(0.1), mesh, stage=3, reshard_after_forward=reshard)
        held[reshard] = temporaries(strategy, params, batch)
        trained[reshard] = train(strategy, scan_mlp(16, 4), make_batches(2, 32))
    assert held[True] < held[False] / 3
    chex.assert_trees_all_close(trained[True], trained[False], atol=2e-4)


def test_what_layer_by_layer_cannot_do_is_a_clear_error():
    mesh = ddl.make_mesh(data=8)
    batch = make_batches(1, 32)[0]
    reducer = ddl.compression.scatter_cast(jnp.bfloat16)
    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=3, reducer=reducer)
    state = strategy.init(scan_mlp(16, 4))
    with pytest.raises(ValueError, match="reshard_after_forward=False with a reducer"):
        jax.eval_shape(strategy.step, state, batch)
    # 8 layers of 4 x 4: only the layer axis divides over 8 workers
    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=3)
    with pytest.raises(ValueError, match="on its layer axis: fsdp splits each leaf on its lar"):
        jax.eval_shape(strategy.step, strategy.init(scan_mlp(4, 8)), batch)
    with pytest.raises(ValueError, match="reshard_after_forward must be a bool"):
        ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reshard_after_forward="yes")


def test_layer_by_layer_inside_islands_is_flat_diloco():
    """DiLoCo over islands of FSDP gathering layer by layer: flat DiLoCo's update."""
    params, batches = scan_mlp(16, 4), make_batches(6, 32)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    inner = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(island=2, data=4), stage=3)
    stacked = ddl.local_sgd(inner=inner, period=2, outer_optimizer=outer)
    mesh = ddl.make_mesh(data=2)
    reference = ddl.local_sgd(loss_fn, optax.adam(1e-2), mesh, period=2, outer_optimizer=outer)
    chex.assert_trees_all_close(
        train(stacked, params, batches), train(reference, params, batches), atol=2e-5
    )


def gpt_loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_the_scan_layers_gpt_trains_layer_by_layer_as_gathered_once_and_data_parallel():
    """The GPT with scan_layers=True, dropout on: FSDP layer by layer (its blocks gathered
    in the scan, the HLO says), gathered once and data parallelism draw the same keys and
    end equal (with SGD: Adam would blow up the rounding noise of the attention's key
    bias, whose gradient is 0 in exact arithmetic)."""
    from flax import nnx

    model = ddl.models.GPT(
        context=16, features=32, heads=4, layers=3, scan_layers=True,
        rngs=nnx.Rngs(params=0, dropout=1),
    )  # fmt: skip
    loss, variables = ddl.flax.loss_from_module(model, gpt_loss)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 256, (16, 17)).astype(np.int32)} for _ in range(3)]
    mesh = ddl.make_mesh(data=8)
    per_layer = ddl.fsdp(loss, optax.sgd(0.1), mesh, stage=3)
    once = ddl.fsdp(loss, optax.sgd(0.1), mesh, stage=3, reshard_after_forward=False)
    dp = ddl.data_parallel(loss, optax.sgd(0.1), mesh)
    looped, _ = gathers(per_layer, variables, batches[0])
    assert looped >= 2 * 3 * 8  # the blocks' leaves, each layer, forward and backward
    expected = train(dp, variables, batches)
    chex.assert_trees_all_close(train(per_layer, variables, batches), expected, atol=1e-5)
    chex.assert_trees_all_close(train(once, variables, batches), expected, atol=1e-5)
