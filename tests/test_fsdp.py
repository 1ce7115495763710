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
from conftest import make_batches, mlp_loss, reference_sgd, train
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_tensor_parallel import Classifier, classifier_loss, reference_loss

import ddl_jax as ddl
from ddl_jax._src.reduce import quantise as quantise_module
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
def test_empty_leaves_stay_whole(stage):
    """A leaf of size 0 (a dimension of 0 divides by any worker count) is not split: its
    scatter or gather of a 0-long dimension failed to compile at stages 2 and 3."""
    model_loss, model_params = wide_mlp()
    params = {"model": model_params, "empty": {"a": jnp.zeros((0,)), "b": jnp.zeros((4, 0))}}

    def loss_fn(params, batch):
        empty = sum(x.sum() for x in jax.tree.leaves(params["empty"]))
        return model_loss(params["model"], batch) + empty

    batches = [batch_of(32, seed) for seed in range(2)]
    strategy = ddl.fsdp(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), stage=stage)
    state, _ = train(strategy, params, batches)
    assert all(entry is None for entry in state.params["empty"]["b"].sharding.spec)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6)


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
    # scatter_cast(bfloat16) halves the gradient's traffic (an all_to_all of 16-bit chunks),
    # scatter_top_k(1/8) sends 8 bytes (value, index) for each of 1/8 of the entries.
    half = ddl.compression.scatter_cast(jnp.bfloat16)
    for reducer, ratio in [(half, 0.5), (ddl.compression.scatter_top_k(1 / 8), 0.25)]:
        got = stats(ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reducer=reducer))
        assert got.bytes_by_kind["all-to-all"] == pytest.approx(
            ratio * kinds["reduce-scatter"], rel=1e-2
        )
    # scatter_qsgd(4) sends a level in 4 bits, and a 4-byte norm a bucket (here one a chunk:
    # every owner's chunk is under 512 entries), where the reduce-scatter sends 4 bytes.
    got = stats(ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reducer=ddl.compression.scatter_qsgd(4)))
    chunks = [x.size // 8 for x in jax.tree.leaves(params)]
    ratio = sum(-(-c // 2) + 4 for c in chunks) / sum(4 * c for c in chunks)
    assert got.bytes_by_kind["all-to-all"] / kinds["reduce-scatter"] == pytest.approx(ratio)


def in_shard_map(reducer, chunks, flush=0, repeat=0):
    """Runs ``reducer`` on 8 workers' chunks ``[8 workers, 8 owners, m]``, then ``flush``
    more times on zeros and ``repeat`` more on the same chunks; returns the sum of each
    worker's shards ``[8, m]``."""
    mesh = ddl.make_mesh(data=8)

    def worker(c):
        c = {"w": c[0]}
        state = reducer.init(c)
        total, state = reducer.update(c, state)
        # The later calls in a loop, not unrolled: one compiled update, not up to 16.
        for again, times in ((jax.tree.map(jnp.zeros_like, c), flush), (c, repeat)):

            def call(_, carry, again=again):
                out, state = reducer.update(again, carry[1])
                return jax.tree.map(jnp.add, carry[0], out), state

            total, state = jax.lax.fori_loop(0, times, call, (total, state))
        return total["w"][None]

    program = jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return np.asarray(jax.jit(program)(jax.device_put(chunks, NamedSharding(mesh, P("data")))))


def random_chunks(m=40, seed=0):
    return np.random.default_rng(seed).normal(size=(8, 8, m)).astype(np.float32)


def test_scatter_reducers_against_their_rules_written_in_numpy():
    chunks = random_chunks()
    exact = chunks.mean(axis=0)  # owner j's shard: the mean over workers of chunk j
    np.testing.assert_allclose(
        in_shard_map(ddl.compression.scatter_cast(jnp.float32), chunks), exact, rtol=1e-6
    )
    bf16 = chunks.astype(jnp.bfloat16).astype(np.float32).mean(axis=0)
    np.testing.assert_allclose(
        in_shard_map(ddl.compression.scatter_cast(jnp.bfloat16), chunks), bf16, rtol=1e-6
    )
    # top-k: each worker sends each owner the k entries of its chunk largest in magnitude.
    k = 10
    kept = np.zeros_like(chunks)
    index = np.argsort(-np.abs(chunks), axis=-1)[..., :k]
    np.put_along_axis(kept, index, np.take_along_axis(chunks, index, -1), -1)
    top = ddl.compression.scatter_top_k(k / 40)
    np.testing.assert_allclose(in_shard_map(top, chunks), kept.mean(axis=0), rtol=1e-6)
    # Error feedback: what was not sent goes out later; three more calls send the rest.
    np.testing.assert_allclose(in_shard_map(top, chunks, flush=3), exact, rtol=1e-5, atol=1e-6)
    # QSGD: each entry within norm / s of the truth (one bucket per chunk here), and
    # unbiased: over 16 steps (fresh noise each) the error of the mean shrinks as 1/4.
    qsgd = ddl.compression.scatter_qsgd(4)
    once = in_shard_map(qsgd, chunks)
    bound = np.linalg.norm(chunks, axis=-1, keepdims=True).max(axis=0) / 4
    assert np.all(np.abs(once - exact) <= bound)
    mean = in_shard_map(qsgd, chunks, repeat=15) / 16
    rms = [np.sqrt(np.mean((x - exact) ** 2)) for x in (once, mean)]
    assert rms[1] < 0.4 * rms[0]
    # QSGDinf (scale="max"): within the largest magnitude / s, closer than the 2-norm's.
    inf = in_shard_map(ddl.compression.scatter_qsgd(4, scale="max"), chunks)
    assert np.all(np.abs(inf - exact) <= np.abs(chunks).max(axis=-1, keepdims=True).max(axis=0) / 4)
    assert np.sqrt(np.mean((inf - exact) ** 2)) < 0.5 * rms[0]


@pytest.mark.parametrize("levels", [1, 5])
def test_scatter_qsgd_packs_its_levels_losslessly(monkeypatch, levels):
    """2 or 4 bits a level give the very shards that int8 levels give."""
    chunks = random_chunks(m=45)  # 45 entries: odd, so the packing pads the last byte
    packed = in_shard_map(ddl.compression.scatter_qsgd(levels, bucket_size=9), chunks)
    monkeypatch.setattr(quantise_module, "code_bits", lambda levels: 8)
    np.testing.assert_array_equal(
        in_shard_map(ddl.compression.scatter_qsgd(levels, bucket_size=9), chunks), packed
    )


def test_compressed_reduce_scatter_trains():
    loss_fn, params = wide_mlp()
    batches = [batch_of(64)] * 20  # one batch learnt by heart: the loss must fall far
    mesh = ddl.make_mesh(data=8)
    for reducer in (
        ddl.compression.scatter_top_k(0.1),
        ddl.compression.scatter_qsgd(8, bucket_size=64),
    ):
        strategy = ddl.fsdp(loss_fn, optax.adam(1e-2), mesh, reducer=reducer)
        state, metrics = train(strategy, params, batches)
        assert metrics["compression_ratio"] > 3
        assert float(loss_fn(strategy.params(state), batches[0])) < 0.5 * float(
            loss_fn(params, batches[0])
        )


@pytest.mark.parametrize(
    "reducer",
    [
        lambda: ddl.compression.scatter_cast(jnp.bfloat16),
        lambda: ddl.compression.scatter_qsgd(8),
        lambda: ddl.compression.scatter_top_k(0.5),
    ],
    ids=["cast", "qsgd", "top_k"],
)
def test_a_compressed_reduce_scatter_with_no_leaf_to_split_trains_as_the_default(reducer):
    """No leaf divides by the 4 workers: every one stays whole and is averaged as the
    default reducer averages it, nothing is compressed (ratio 1)."""
    loss = lambda p, b: jnp.mean((b["x"][:, :6] @ p["w"] - b["y"][:, :3]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": np.ones((16, 4), np.float32)}
    params, mesh, trained = {"w": jnp.zeros((6, 3))}, ddl.make_mesh(data=4), []
    for chosen in (None, reducer()):
        strategy = ddl.fsdp(loss, optax.sgd(0.1), mesh, stage=2, reducer=chosen)
        state, metrics = train(strategy, params, [batch] * 3)
        trained.append(strategy.params(state))
    assert metrics["compression_ratio"] == 1.0
    chex.assert_trees_all_close(trained[1], trained[0], atol=1e-6, rtol=0)


def test_bad_arguments_name_what_is_valid():
    loss_fn, params = wide_mlp()
    mesh = ddl.make_mesh(data=8)
    for stage in (0, True):
        with pytest.raises(ValueError, match=rf"stage must be one of \[1, 2, 3\], got {stage}"):
            ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=stage)
    for reducer in (ddl.compression.top_k(0.1), ddl.compression.sign(), ddl.allreduce_mean()):
        with pytest.raises(TypeError, match="must be a scatter reducer.*sign and power_sgd"):
            ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
    top = ddl.compression.scatter_top_k(0.1)
    with pytest.raises(ValueError, match="stage 1 all-reduces"):
        ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, stage=1, reducer=top)
    with pytest.raises(ValueError, match="data-only mesh"):
        ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2, model=4), reducer=top)
    with pytest.raises(ValueError, match=r"ratio must be a finite real number > 0"):
        ddl.compression.scatter_top_k(0.0)
    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, specs=P("data"))
    with pytest.raises(ValueError, match="shards over 'data'"):
        strategy.init(params)


def test_a_loss_asking_for_a_missing_key_is_named_layer_by_layer_too():
    """Stage 3 traces the loss once to find its scanned layers: the same message as every
    builder's, not a bare ``KeyError``."""
    params = {"w": jnp.zeros((12, 16)), "layers": {"w": jnp.zeros((3, 16, 16))}}

    def loss_fn(p, batch):
        h = batch["image"] @ p["w"]  # the batch holds "x"
        return jnp.mean(ddl.layers.scan_layers(lambda q, h: h @ q["w"], p["layers"], h))

    strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), stage=3)
    with pytest.raises(KeyError, match="loss_fn asked for 'image': a key neither the batch"):
        jax.jit(strategy.step)(strategy.init(params), batch_of(16))
