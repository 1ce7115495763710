"""The tensor-parallel layers: their partitioning metadata, one-device runs, clear errors."""

import doctest

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.models import layers
from ddl_jax.layers import (
    ColumnParallelLinear,
    ParallelSelfAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
    param_specs,
)


class TinyTransformer(nnx.Module):
    """A Transformer block, then a column-parallel layer and a row-parallel head."""

    def __init__(self, rngs):
        self.block = ParallelTransformerBlock(16, heads=4, hidden=32, rngs=rngs)
        self.up = ColumnParallelLinear(16, 24, rngs=rngs)
        self.head = RowParallelLinear(24, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.up(self.block(x))))


def randomized(params, seed=1):
    """The params with every leaf random (zero biases and unit scales would hide errors)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return tree.unflatten(
        [0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )


def test_param_specs_read_flax_partitioning_metadata():
    model = TinyTransformer(nnx.Rngs(0))
    specs = param_specs(model)
    _, params = ddl.flax.split(model)
    assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)) == jax.tree.structure(
        params
    )
    assert specs["up"] == {"kernel": P(None, "model"), "bias": P("model")}
    assert specs["head"] == {"kernel": P("model", None), "bias": P()}
    assert specs["block"]["norm1"] == {"scale": P(), "bias": P()}
    assert specs["block"]["attention"]["query"]["kernel"] == P(None, "model")
    assert specs["block"]["mlp"]["down"]["kernel"] == P("model", None)
    # The specs are Flax's own metadata, the same that nnx.get_partition_spec reads.
    assert model.up.kernel.out_sharding == (None, "model")
    flax_specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    assert flax_specs == specs


def test_creating_layers_places_nothing_with_or_without_a_mesh():
    with nnx.use_eager_sharding(True):  # Flax's default: shard annotated Variables
        model = TinyTransformer(nnx.Rngs(0))  # no mesh set: nothing to shard over
        assert model.up.kernel[...].sharding.is_fully_replicated
        # A mesh without a "model" axis (data only) must not make creation fail either.
        with jax.set_mesh(ddl.make_mesh(data=8)):
            model = TinyTransformer(nnx.Rngs(0))
        assert model.up.kernel[...].sharding.is_fully_replicated
    assert param_specs(model)["up"]["kernel"] == P(None, "model")


def test_a_model_on_one_device_equals_the_model_sharded_over_data_and_model():
    model = TinyTransformer(nnx.Rngs(0))
    apply, params = ddl.flax.split(model)
    params = randomized(params)
    x = jax.random.normal(jax.random.key(2), (4, 6, 16))

    # One device, full (gathered) parameters, "model" unbound: no all-reduce.
    device = jax.devices()[0]
    one = jax.jit(apply).lower(jax.device_put(params, device), jax.device_put(x, device))
    assert "all-reduce" not in one.compile().as_text()
    expected = jax.jit(apply)(jax.device_put(params, device), jax.device_put(x, device))
    assert expected.shape == (4, 6, 5)

    mesh = ddl.make_mesh(data=2, model=4)
    specs = param_specs(model)
    program = jax.shard_map(apply, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data"))
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    assert placed["up"]["kernel"].addressable_shards[0].data.shape == (16, 24 // 4)
    got = jax.jit(program)(placed, jax.device_put(x, NamedSharding(mesh, P("data"))))
    chex.assert_trees_all_close(got, expected, atol=1e-5)


@pytest.mark.parametrize("builder", ["tensor_parallel", "fsdp"])
def test_layers_whose_parameters_are_replicated_over_model_compute_the_same_function(builder):
    """``specs=P()`` (every parameter whole on every ``model`` device): the row-parallel
    layers hold whole kernels and have no partial products to sum."""
    model = TinyTransformer(nnx.Rngs(0))
    apply, params = ddl.flax.split(model)
    params = randomized(params)
    x = jax.random.normal(jax.random.key(2), (8, 6, 16))
    y = jax.random.normal(jax.random.key(3), (8, 6, 5))
    loss_fn = lambda p, batch: jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2)  # noqa: E731
    expected = loss_fn(params, {"x": x, "y": y})
    build = getattr(ddl, builder)
    strategy = build(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2, model=4), specs=P())
    plain = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    state, reference = strategy.init(params), plain.init(params)
    for _ in range(3):
        state, metrics = jax.jit(strategy.step)(state, {"x": x, "y": y})
        reference, _ = jax.jit(plain.step)(reference, {"x": x, "y": y})
        chex.assert_trees_all_close(metrics["loss"], expected, rtol=1e-5)
        expected = loss_fn(jax.device_get(plain.params(reference)), {"x": x, "y": y})
    chex.assert_trees_all_close(
        jax.device_get(strategy.params(state)), jax.device_get(plain.params(reference)), atol=1e-5
    )


def test_row_parallel_dense_sums_only_where_model_is_bound():
    x = jnp.arange(8.0).reshape(1, 8)
    kernel = jnp.ones((8, 3))
    full = layers.row_parallel_dense(x, kernel, jnp.ones(3))  # unbound: x @ kernel + bias
    chex.assert_trees_all_close(full, x @ kernel + 1)
    mesh = ddl.make_mesh(data=2, model=4)
    sharded = jax.shard_map(
        lambda x, k: layers.row_parallel_dense(x, k, jnp.ones(3)),
        mesh=mesh,
        in_specs=(P(None, "model"), P("model", None)),
        out_specs=P(),
    )
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    chex.assert_trees_all_close(
        sharded(put(x, P(None, "model")), put(kernel, P("model", None))), full
    )


def test_heads_that_the_model_axis_does_not_divide_fail_with_a_clear_error():
    # 12 features split 4 ways, but 3 heads do not: this once failed inside jnp.reshape
    # with a JAX-internal TypeError.
    attention = ParallelSelfAttention(12, heads=3, rngs=nnx.Rngs(0))
    apply, params = ddl.flax.split(attention)
    specs = param_specs(attention)
    mesh = ddl.make_mesh(data=2, model=4)
    program = jax.shard_map(apply, mesh=mesh, in_specs=(specs, P()), out_specs=P())
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x = jax.device_put(jnp.ones((2, 5, 12)), NamedSharding(mesh, P()))
    message = (
        "ParallelSelfAttention(features=12, heads=3) runs on a 'model' axis of size 4, which "
        "does not divide heads=3: each device must hold whole heads. Use heads in [4, 12] "
        "(for features=12) or a 'model' axis size in [1, 3]."
    )
    with pytest.raises(ValueError) as raised:
        program(placed, x)
    assert str(raised.value) == message
    # Outside shard_map (one device, full parameters) 3 heads are fine.
    assert apply(params, jnp.ones((2, 5, 12))).shape == (2, 5, 12)
    with pytest.raises(ValueError, match="features=12 must be a multiple of heads=5"):
        ParallelSelfAttention(12, heads=5, rngs=nnx.Rngs(0))


def test_docstring_examples_run():
    result = doctest.testmod(layers, raise_on_error=False)
    assert result.attempted >= 2
    assert result.failed == 0
