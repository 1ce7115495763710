"""The Flax bridge: NNX and Linen modules in, loss_fn(params, batch) and params out."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_loss, reference_sgd
from flax import linen, nnx

import ddl_jax as ddl


def test_nnx_loss_fn_and_apply_match_the_module():
    model = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(model, mlp_loss)
    apply, same_params = ddl.flax.split(model)
    [batch] = make_batches(1, 8)
    chex.assert_trees_all_equal(params, same_params)
    assert isinstance(params, dict)  # a plain pytree, checkpointable as is
    np.testing.assert_allclose(loss_fn(params, batch), mlp_loss(model, batch), rtol=1e-6)
    np.testing.assert_allclose(apply(params, batch["x"]), model(batch["x"]), rtol=1e-6)


def test_update_module_writes_trained_params_back():
    model = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(model, mlp_loss)
    batches = make_batches(3, 16)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.5), ddl.make_mesh(data=4))
    state, _ = ddl.fit(strategy, params, batches, steps=3, progress=False)
    trained = strategy.params(state)
    ddl.flax.update_module(model, trained)
    x = batches[0]["x"]
    apply, _ = ddl.flax.split(model)
    np.testing.assert_allclose(model(x), apply(trained, x), rtol=1e-6)
    assert not np.allclose(model(x), apply(params, x))


def test_cnn_on_digit_images_trains_like_single_device_sgd():
    train, _ = ddl.data.digits(flatten=False)
    model = ddl.models.CNN((8, 8, 1), 10, rngs=nnx.Rngs(0))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    batches = list(ddl.data.batches(train, 64, epochs=1))[:3]
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    state, _ = ddl.fit(strategy, params, batches, steps=3, progress=False)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(5)(linen.relu(linen.Dense(16)(x)))


def test_linen_module_trains_like_single_device_sgd():
    module = LinenMLP()
    variables = module.init(jax.random.key(0), jnp.zeros((1, 12)))
    loss_fn, params = ddl.flax.loss_from_module(module, mlp_loss, variables=variables)
    batches = make_batches(5, 32)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    state, _ = ddl.fit(strategy, params, batches, steps=5, progress=False)

    def direct(params, batch):  # the loss written against Linen directly
        logits = module.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    expected = reference_sgd(direct, optax.sgd(0.1), variables["params"], batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


class WithBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(12, 5, rngs=rngs)
        self.norm = nnx.BatchNorm(5, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


def test_a_batch_norm_module_gives_a_model_loss_and_its_statistics():
    model = WithBatchNorm(nnx.Rngs(0))
    loss_fn, variables = ddl.flax.loss_from_module(model, mlp_loss)
    assert isinstance(loss_fn, ddl.ModelLoss)
    assert set(variables) == {"params", "batch_stats"}
    chex.assert_trees_all_equal(
        variables["batch_stats"], nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    )


def test_bad_arguments():
    model = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="flax.nnx.Module or a flax.linen.Module"):
        ddl.flax.split(lambda x: x)
    with pytest.raises(TypeError, match="needs variables="):
        ddl.flax.split(LinenMLP())
    with pytest.raises(TypeError, match="only for Linen"):
        ddl.flax.split(model, variables={"params": {}})
    with pytest.raises(TypeError, match="loss must be callable"):
        ddl.flax.loss_from_module(model, "cross_entropy")
    with pytest.raises(TypeError, match="for Linen use"):
        ddl.flax.update_module(LinenMLP(), {})


def test_a_linen_dropout_without_its_stream_names_the_fix():
    class Dropped(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dropout(0.5, deterministic=False)(linen.Dense(4)(x))

    module = Dropped()
    variables = module.init(jax.random.key(0), jnp.ones((2, 3)))
    loss_fn, params = ddl.flax.loss_from_module(
        module, lambda model, batch: model(batch["x"]).mean(), variables=variables
    )
    with pytest.raises(ValueError, match=r"for Linen pass rngs=\('dropout', \.\.\.\)"):
        loss_fn(params, {"x": jnp.ones((2, 3))})


def test_update_module_names_what_does_not_match():
    model = ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0))
    _, other = ddl.flax.loss_from_module(ddl.models.MLP(12, [8], 5, rngs=nnx.Rngs(0)), mlp_loss)
    with pytest.raises(ValueError, match=r"update_module: the variables' params do not match") as e:
        ddl.flax.update_module(model, other)
    assert "is (12, 8) in the variables, (12, 16) in the module" in str(e.value)
    _, deeper = ddl.flax.loss_from_module(
        ddl.models.MLP(12, [16, 16], 5, rngs=nnx.Rngs(0)), mlp_loss
    )
    with pytest.raises(ValueError, match=r"not in the module \[\"\['layers'\]\[2\]"):
        ddl.flax.update_module(model, deeper)


class Sowing(nnx.Module):
    """Keeps its hidden layer with ``sow`` (an ``nnx.Intermediate``) on every call."""

    def __init__(self, rngs):
        self.layer = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        h = self.layer(x)
        self.sow(nnx.Intermediate, "hidden", h)
        return h


# sow outside nnx.capture is deprecated in Flax 0.12, and still what models written before do
@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
def test_what_sow_kept_from_an_earlier_call_is_not_state():
    model, x = Sowing(nnx.Rngs(0)), jnp.ones((4, 3))
    expected = model(x)  # a call before splitting sows its hidden layer
    apply, params = ddl.flax.split(model)
    np.testing.assert_allclose(apply(params, x), expected, rtol=1e-6)
    loss_fn, variables = ddl.flax.loss_from_module(model, lambda m, b: jnp.mean(m(b["x"]) ** 2))
    np.testing.assert_allclose(loss_fn(variables, {"x": x}), jnp.mean(expected**2), rtol=1e-6)
    assert "hidden" in nnx.state(model, nnx.Intermediate)  # the user's module keeps it


def test_a_linen_module_that_updates_a_collection_evaluates_through_split():
    class Counter(linen.Module):
        @linen.compact
        def __call__(self, x):
            calls = self.variable("counter", "calls", lambda: jnp.zeros((), jnp.int32))
            calls.value += 1
            return linen.Dense(2)(x)

    module, x = Counter(), jnp.ones((4, 3))
    variables = module.init(jax.random.key(0), x)
    apply, v = ddl.flax.split(module, variables=variables)
    np.testing.assert_allclose(apply(v, x), module.apply(variables, x, mutable=True)[0])
    _, updated = apply(v, x, mutable=["counter"])  # asked for, the update comes back
    assert int(updated["counter"]["calls"]) == 2
