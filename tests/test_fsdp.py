"""Sharded data parallelism (ZeRO 1-3) against single-device training on the global batch,
its memory from the compiled step and its traffic from the HLO.

The shared contract (one worker, compile once, bitwise resume, batch norm and dropout,
unused mesh axes) is in test_strategies.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_loss, reference_sgd
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_tensor_parallel import Classifier, classifier_loss, reference_loss

import ddl_jax as ddl
from ddl_jax.layers import param_specs

STAGES = (1, 2, 3)
# A tree-wide transform: the global norm must be the norm of the whole gradient, not of a
# worker's shard.
CLIPPED_ADAM = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))


def wide_mlp():
    """12 -> 64 -> 64 -> 16: every kernel and bias divides over 8 workers."""
    model = ddl.models.MLP(12, [64, 64], 16, rngs=nnx.Rngs(0))
    return ddl.flax.loss_from_module(model, mlp_loss)


def batch_of(size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(size, 12)).astype(np.float32),
        "y": rng.integers(0, 16, size).astype(np.int32),
    }


def train(strategy, params, batches):
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_on_8_devices_equals_single_device_training(stage):
    loss_fn, params = wide_mlp()
    batches = [batch_of(32, seed) for seed in range(3)]
    strategy = ddl.fsdp(loss_fn, CLIPPED_ADAM, ddl.make_mesh(data=8), stage=stage)
    state, metrics = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, CLIPPED_ADAM, params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6)
    before = reference_sgd(loss_fn, CLIPPED_ADAM, params, batches[:2])
    np.testing.assert_allclose(metrics["loss"], loss_fn(before, batches[2]), rtol=1e-6)
    # Stage 3 stores 1/8 of each kernel per device; stages 1 and 2 the whole parameters.
    kernel = state.params["layers"][1]["kernel"]
    assert kernel.addressable_shards[0].data.shape == ((8, 64) if stage == 3 else (64, 64))
    mu = state.opt_state[1][0].mu["layers"][1]["kernel"]
    assert mu.addressable_shards[0].data.shape == (8, 64)


@pytest.mark.parametrize("stage", STAGES)
def test_with_tensor_parallel_layers_on_data_2_by_model_4_equals_one_device(stage):
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    batches = make_batches(3, 16)
    mesh = ddl.make_mesh(data=2, model=4)
    strategy = ddl.fsdp(loss_fn, optax.adam(1e-2), mesh, stage=stage, specs=param_specs(module))
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(reference_loss, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)
    # The MLP's up kernel [12, 16]: its 16 columns split over model, its 12 rows over data.
    up = state.opt_state[0].mu["mlp"]["up"]["kernel"]
    assert up.sharding.spec == P("data", "model")
    assert up.addressable_shards[0].data.shape == (6, 4)


def compiled(strategy, params, batch):
    state = strategy.init(params)
    return jax.jit(strategy.step).lower(state, batch).compile(), state


def test_memory_per_device_is_one_nth_at_stage_3_and_optimizer_state_is_at_stage_1():
    """From the compiled step's memory_analysis: arguments are the state and the batch."""
    loss_fn, params = wide_mlp()
    batch = batch_of(64)
    mesh = ddl.make_mesh(data=8)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) / 8

    def state_bytes(strategy):
        program, _ = compiled(strategy, params, batch)
        return program.memory_analysis().argument_size_in_bytes - batch_bytes

    replicated = state_bytes(ddl.data_parallel(loss_fn, optax.adam(1e-3), mesh))
    assert replicated >= 3 * param_bytes  # params, Adam's mu and nu on every device
    stage_3 = state_bytes(ddl.fsdp(loss_fn, optax.adam(1e-3), mesh, stage=3))
    assert stage_3 <= 1.1 * replicated / 8
    stage_1 = state_bytes(ddl.fsdp(loss_fn, optax.adam(1e-3), mesh, stage=1))
    assert stage_1 <= 1.1 * (param_bytes + 2 * param_bytes / 8)


def test_stage_2_and_3_send_what_one_all_reduce_sends_and_stage_3_gathers_each_parameter():
    loss_fn, params = wide_mlp()
    batch = batch_of(64)
    mesh = ddl.make_mesh(data=8)

    def stats(strategy):
        state = strategy.init(params)
        return ddl.comm_stats(jax.jit(strategy.step), state, batch)

    all_reduce = stats(ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh))
    for stage in (2, 3):
        got = stats(ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=stage))
        kinds = got.bytes_by_kind
        assert kinds["reduce-scatter"] == pytest.approx(kinds["all-gather"])
        # The same total as the all-reduce, less the loss's own 4-byte all-reduce.
        assert got.bytes_per_device == pytest.approx(all_reduce.bytes_per_device, rel=1e-4)
    gathers = [op for op in got.ops if op.kind == "all-gather"]
    assert sum(op.count for op in gathers) == len(jax.tree.leaves(params))
    # reduce_dtype=bfloat16 halves the gradient's traffic (an all_to_all of 16-bit chunks).
    half = stats(ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=3, reduce_dtype=jnp.bfloat16))
    assert half.bytes_by_kind["all-to-all"] == pytest.approx(kinds["reduce-scatter"] / 2, 1e-3)


def test_bfloat16_reduction_stays_close_to_float32():
    loss_fn, params = wide_mlp()
    batches = [batch_of(32, seed) for seed in range(3)]
    mesh = ddl.make_mesh(data=8)
    plain = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh)
    exact = plain.params(train(plain, params, batches)[0])
    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reduce_dtype=jnp.bfloat16)
    state, _ = train(strategy, params, batches)
    leaves = jax.tree.leaves(strategy.params(state))
    assert all(x.dtype == jnp.float32 for x in leaves)
    chex.assert_trees_all_close(strategy.params(state), exact, atol=2e-3)
    assert not all(
        np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(exact), strict=True)
    )


def test_bad_arguments_name_what_is_valid():
    loss_fn, params = wide_mlp()
    mesh = ddl.make_mesh(data=8)
    with pytest.raises(ValueError, match=r"stage must be one of \[1, 2, 3\], got 0"):
        ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=0)
    with pytest.raises(ValueError, match="reduce_dtype must be a floating dtype"):
        ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reduce_dtype=jnp.int8)
    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, specs=P("data"))
    with pytest.raises(ValueError, match="shards over 'data'"):
        strategy.init(params)
