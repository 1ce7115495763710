"""Tensor-parallel layers and blocks against the same math on one device."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, reference_sgd, replica_groups
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax import tensor_parallel
from ddl_jax._src.core.kit import explicit_mesh
from ddl_jax.layers import ParallelMLP, ParallelTransformerBlock, param_specs


def layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def dense(p, x):
    return x @ p["kernel"] + p["bias"]


def reference_mlp(p, x):
    return dense(p["down"], jax.nn.gelu(dense(p["up"], x)))


def reference_block(p, x, heads):
    """The Transformer block written plainly on full (unsharded) parameters."""
    a = p["attention"]
    h = layer_norm(p["norm1"], x)
    b, s, d = h.shape

    def split(y):
        return y.reshape(b, s, heads, d // heads)

    q, k, v = (split(dense(a[name], h)) for name in ("query", "key", "value"))
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5)
    x = x + dense(a["out"], jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d))
    return x + reference_mlp(p["mlp"], layer_norm(p["norm2"], x))


def sharded_apply(module, mesh):
    """``apply(params, x)`` running ``module`` on its parameter shards over ``model``."""
    apply, _ = ddl.flax.split(module)
    specs = param_specs(module)
    mesh = explicit_mesh(mesh, ("model",))
    program = jax.shard_map(apply, mesh=mesh, in_specs=(specs, P()), out_specs=P())

    def run(params, x):
        placed = jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), params, specs)
        return program(placed, jax.reshard(x, NamedSharding(mesh, P())))

    return jax.jit(run)


def all_reduces(hlo):
    return [line for line in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", line)]


def test_transformer_block_on_model_4_equals_the_unsharded_block():
    block = ParallelTransformerBlock(16, heads=4, hidden=32, rngs=nnx.Rngs(0))
    _, params = ddl.flax.split(block)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    mesh = ddl.make_mesh(data=1, model=4)
    apply = sharded_apply(block, mesh)
    chex.assert_trees_all_close(apply(params, x), reference_block(params, x, 4), atol=1e-5)
    # One all-reduce per column/row pair: attention and MLP, each of the block's output.
    hlo = apply.lower(params, x).compile().as_text()
    reduces = all_reduces(hlo)
    assert len(reduces) == 2
    assert all("f32[2,5,16]" in line for line in reduces)


def test_mlp_equals_the_unsharded_mlp_for_every_model_size():
    mlp = ParallelMLP(8, 16, rngs=nnx.Rngs(0))
    _, params = ddl.flax.split(mlp)
    x = jax.random.normal(jax.random.key(1), (3, 8))
    for m in (1, 2, 8):
        got = sharded_apply(mlp, ddl.make_mesh(data=1, model=m))(params, x)
        chex.assert_trees_all_close(got, reference_mlp(params, x), atol=1e-5)


class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.mlp = ParallelMLP(12, 16, rngs=rngs)
        self.head = nnx.Linear(12, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.mlp(x))


def classifier_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def reference_loss(params, batch):
    x = batch["x"]
    logits = dense(params["head"], x + reference_mlp(params["mlp"], x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize(("data", "model"), [(1, 1), (2, 4), (4, 2)])
def test_data_by_model_training_equals_single_device_sgd(data, model):
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    batches = make_batches(3, 16)
    mesh = ddl.make_mesh(data=data, model=model)
    strategy = tensor_parallel(loss_fn, optax.adam(1e-2), mesh, specs=param_specs(module))
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    expected = reference_sgd(reference_loss, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)
    before = reference_sgd(reference_loss, optax.adam(1e-2), params, batches[:2])
    np.testing.assert_allclose(metrics["loss"], reference_loss(before, batches[2]), rtol=1e-5)


def test_gradients_are_all_reduced_over_data_groups_only():
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    mesh = ddl.make_mesh(data=2, model=4)
    # Leaf by leaf (no buckets), so each gradient's shape names its all-reduce.
    reducer = ddl.allreduce_mean("data", bucket_mb=None)
    strategy = tensor_parallel(
        loss_fn, optax.sgd(0.1), mesh, specs=param_specs(module), reducer=reducer
    )
    [batch] = make_batches(1, 16)
    hlo = jax.jit(strategy.step).lower(strategy.init(params), batch).compile().as_text()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # [data, model]
    data_groups = {frozenset(c) for c in ids.T.tolist()}
    model_groups = {frozenset(r) for r in ids.tolist()}
    reduces = all_reduces(hlo)
    groups = [replica_groups(line) for line in reduces]
    assert all(g in (data_groups, model_groups) for g in groups)
    # The up-projection's kernel shard [12, 16/4] travels only within its data group.
    data_lines = [line for line, g in zip(reduces, groups, strict=True) if g == data_groups]
    assert any("f32[12,4]" in line for line in data_lines)
    assert not any(
        "f32[12,4]" in line for line, g in zip(reduces, groups, strict=True) if g != data_groups
    )


def test_bad_input_fails_with_clear_errors():
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    specs = param_specs(module)
    with pytest.raises(ValueError, match="ppermute-based"):
        tensor_parallel(
            loss_fn,
            optax.sgd(0.1),
            ddl.make_mesh(data=2, model=4),
            specs=specs,
            reducer=ddl.allreduce_mean(algorithm="ring"),
        )
    for compressor in (ddl.compression.top_k(0.1), ddl.compression.cast("bfloat16")):
        with pytest.raises(ValueError, match="a compressing one"):
            tensor_parallel(
                loss_fn,
                optax.sgd(0.1),
                ddl.make_mesh(data=2, model=4),
                specs=specs,
                reducer=optax.chain(optax.clip(1.0), compressor),
            )
    # 12 output features do not split 8 ways.
    odd = Classifier(nnx.Rngs(0))
    odd.mlp = ParallelMLP(12, 12, rngs=nnx.Rngs(1))
    odd_loss, odd_params = ddl.flax.loss_from_module(odd, classifier_loss)
    strategy = tensor_parallel(
        odd_loss, optax.sgd(0.1), ddl.make_mesh(data=1, model=8), specs=param_specs(odd)
    )
    with pytest.raises(ValueError, match="splits a dimension of 12 into 8 parts"):
        strategy.init(odd_params)
    strategy = tensor_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2, model=4), specs={"head": specs["head"]}
    )
    with pytest.raises(ValueError, match="specs must have the structure of params"):
        strategy.init(params)


class DigitsTP(nnx.Module):
    def __init__(self, rngs):
        self.up = ddl.layers.ColumnParallelLinear(64, 64, rngs=rngs)
        self.down = ddl.layers.RowParallelLinear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_a_trained_tensor_parallel_model_evaluates_in_fit_and_on_one_device_after_export():
    train, test = ddl.data.digits()
    model = DigitsTP(nnx.Rngs(0))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    apply, _ = ddl.flax.split(model)

    def accuracy(params):
        return jnp.mean(jnp.argmax(apply(params, test["image"]), -1) == test["label"])

    strategy = ddl.tensor_parallel(
        loss_fn, optax.adam(3e-3), ddl.make_mesh(data=2, model=4), specs=param_specs(model)
    )
    batches = ddl.data.batches(train, 64)
    state, history = ddl.fit(
        strategy, params, batches, steps=60, eval_fn=accuracy, eval_every=30, progress=False
    )
    assert history[-1]["eval"] > 0.85
    trained = jax.device_get(strategy.params(state))  # gathered: whole arrays on the host
    chex.assert_trees_all_equal_shapes(trained, params)
    ddl.flax.update_module(model, trained)
    exported = jnp.mean(jnp.argmax(model(test["image"]), -1) == test["label"])
    np.testing.assert_allclose(exported, history[-1]["eval"], rtol=1e-6)


class EndsColumnParallel(nnx.Module):
    """A model whose output is split over ``model``: a mistake tensor_parallel names."""

    def __init__(self, rngs):
        self.out = ddl.layers.ColumnParallelLinear(12, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def test_a_model_whose_loss_varies_over_model_gets_a_clear_error():
    module = EndsColumnParallel(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(
        module, lambda m, b: ((m(b["x"]) - 1.0) ** 2).mean()
    )
    mesh = ddl.make_mesh(data=2, model=4)
    strategy = tensor_parallel(loss_fn, optax.sgd(0.1), mesh, specs=param_specs(module))
    with pytest.raises(ValueError, match="RowParallelLinear") as error:
        strategy.step(strategy.init(params), make_batches(1, 8)[0])
    assert "loss differs across the 'model' axis" in str(error.value)


def test_sharded_dropout_draws_each_model_shards_mask_apart():
    """Split over model, nnx.Dropout drops the same local positions on every shard (one key
    per data worker); ShardedDropout folds in the shard's index (Megatron's tensor-parallel
    seed), and where model is not bound it is nnx.Dropout draw for draw."""
    mesh = ddl.make_mesh(data=1, model=4)
    x = jnp.ones((8, 64))

    def masks(layer):
        def drop(local):
            return layer(0.5, rngs=nnx.Rngs(dropout=3))(local, deterministic=False) != 0

        placed = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
        split = jax.shard_map(drop, mesh=mesh, in_specs=P(None, "model"),
                              out_specs=P(None, "model"))(placed)  # fmt: skip
        return np.asarray(split).reshape(8, 4, 16).transpose(1, 0, 2)  # [shard, 8, 16]

    same = masks(nnx.Dropout)
    assert all((same[k] == same[0]).all() for k in range(4))
    apart = masks(ddl.layers.ShardedDropout)
    agree = np.mean([(apart[k] == apart[0]).mean() for k in range(1, 4)])
    assert 0.35 < agree < 0.65, agree  # independent masks at rate 0.5 agree half the time
    assert 0.35 < apart.mean() < 0.65
    plain = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))(x, deterministic=False)
    sharded = ddl.layers.ShardedDropout(0.5, rngs=nnx.Rngs(dropout=3))(x, deterministic=False)
    np.testing.assert_array_equal(sharded, plain)
    np.testing.assert_array_equal(ddl.layers.ShardedDropout(0.5)(x, deterministic=True), x)
