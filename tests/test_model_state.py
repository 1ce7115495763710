"""Models with batch norm and dropout: model state and randomness through the strategies.

The references are hand-written single-device Flax training loops that draw the keys the
contract documents: stream i of worker w at step t draws
``fold_in(fold_in(fold_in(seed_key, t), w), i)``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    BNDropoutMLP,
    first_stream_key,
    make_batches,
    nnx_loss,
    nnx_reference,
    step_key,
)
from flax import linen, nnx

import ddl_jax as ddl


def test_nnx_module_with_batch_norm_and_dropout_on_one_device_equals_a_flax_loop():
    model = BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1))
    loss_fn, variables = ddl.flax.loss_from_module(model, nnx_loss)
    assert isinstance(loss_fn, ddl.ModelLoss)
    assert set(variables) == {"params", "batch_stats"}
    batches = make_batches(4, 16)
    # The bias before batch norm has a zero gradient up to float rounding; Adam's default
    # eps (1e-8) would turn that rounding into steps of +-lr.
    adam = optax.adam(1e-2, eps=1e-4)
    strategy = ddl.data_parallel(loss_fn, adam, ddl.make_mesh(data=1))
    state, _ = ddl.fit(strategy, variables, batches, steps=4, progress=False)
    expected = nnx_reference(model, adam, batches, first_stream_key(model))
    got = strategy.params(state)
    chex.assert_trees_all_close(got, expected, atol=1e-6)
    # the statistics moved, and dropout was on (a run without it ends elsewhere)
    assert not np.allclose(got["batch_stats"]["norm"]["mean"], 0.0)
    plain = BNDropoutMLP(rate=0.0, rngs=nnx.Rngs(params=0, dropout=1))
    without = nnx_reference(plain, adam, batches, first_stream_key(model))
    assert not np.allclose(got["params"]["out"]["kernel"], without["params"]["out"]["kernel"])


def test_trained_variables_go_back_into_the_module_for_inference():
    model = BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1))
    loss_fn, variables = ddl.flax.loss_from_module(model, nnx_loss)
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=4))
    state, _ = ddl.fit(strategy, variables, make_batches(3, 16), steps=3, progress=False)
    trained = strategy.params(state)
    ddl.flax.update_module(model, trained)
    model.eval()
    x = make_batches(1, 8, seed=1)[0]["x"]
    apply, exported = ddl.flax.split(model)
    chex.assert_trees_all_close(exported, trained)
    np.testing.assert_allclose(model(x), apply(trained, x), rtol=1e-6)
    np.testing.assert_allclose(model(x), model(x))  # eval mode: no dropout


class LinenBNDropout(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(16)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = linen.Dropout(0.3, deterministic=not train)(linen.relu(x))
        return linen.Dense(5)(x)


def test_linen_module_with_batch_norm_and_dropout_on_one_device_equals_a_flax_loop():
    module = LinenBNDropout()
    variables = module.init(jax.random.key(0), jnp.ones((2, 12)), train=False)

    def loss(model, batch):
        logits = model(batch["x"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss_fn, v = ddl.flax.loss_from_module(
        module, loss, variables=variables, rngs=("dropout",), seed=3
    )
    batches = make_batches(4, 16)
    optimizer = optax.sgd(0.1)
    strategy = ddl.data_parallel(loss_fn, optimizer, ddl.make_mesh(data=1))
    state, _ = ddl.fit(strategy, v, batches, steps=4, progress=False)

    params, stats = variables["params"], variables["batch_stats"]
    opt_state = optimizer.init(params)
    base = jax.random.key_data(jax.random.key(3))
    for t, batch in enumerate(batches):

        def f(p, stats=stats, batch=batch, t=t):
            logits, new = module.apply(
                {"params": p, "batch_stats": stats},
                batch["x"],
                train=True,
                rngs={"dropout": jax.random.fold_in(step_key(base, t), 0)},
                mutable=["batch_stats"],
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return ce, new["batch_stats"]

        grads, stats = jax.grad(f, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(
        strategy.params(state), {"params": params, "batch_stats": stats}, atol=1e-6
    )


def test_sync_batch_norm_on_8_devices_equals_single_device_training_on_the_global_batch():
    """BatchNorm(axis_name="data") normalises with the global batch's statistics."""
    synced = BNDropoutMLP(rate=0.0, axis_name="data", rngs=nnx.Rngs(params=0, dropout=1))
    single = BNDropoutMLP(rate=0.0, rngs=nnx.Rngs(params=0, dropout=1))
    loss_fn, variables = ddl.flax.loss_from_module(synced, nnx_loss)
    batches = make_batches(3, 32)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    state, _ = ddl.fit(strategy, variables, batches, steps=3, progress=False)
    expected = nnx_reference(single, optax.sgd(0.1), batches, first_stream_key(single))
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


def test_local_batch_norm_averages_running_means_to_the_global_batch_mean():
    """Without sync, each worker normalises by its own shard; averaging the running means
    over workers gives the global batch's mean (equal shards), the variance is not."""
    model = BNDropoutMLP(rate=0.0, rngs=nnx.Rngs(params=0, dropout=1))
    loss_fn, variables = ddl.flax.loss_from_module(model, nnx_loss)
    [batch] = make_batches(1, 32)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.0), ddl.make_mesh(data=8))
    state, _ = jax.jit(strategy.step)(strategy.init(variables), batch)
    h = jax.vmap(lambda x: model.up(x))(batch["x"])
    expected = 0.2 * h.mean(0)  # momentum 0.8 from a zero mean
    np.testing.assert_allclose(
        strategy.params(state)["batch_stats"]["norm"]["mean"], expected, atol=1e-6
    )


class Masks(nnx.Module):
    """``loss = mean(dropout(1) * w)``: the gradient is the dropout mask (scaled)."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros(64))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.mean(self.drop(jnp.ones((x.shape[0], 64))) * self.w[...])


def test_dropout_masks_differ_across_workers_and_steps_and_follow_the_documented_keys():
    model = Masks(nnx.Rngs(dropout=5))
    loss_fn, variables = ddl.flax.loss_from_module(model, lambda m, b: m(b["x"]))
    strategy = ddl.local_sgd(loss_fn, optax.sgd(1.0), ddl.make_mesh(data=4), period=1000)
    step = jax.jit(strategy.step)
    state = strategy.init(variables)
    batch = {"x": np.zeros((4, 1), np.float32)}
    masks = []
    for _ in range(2):
        before = np.asarray(state.params["w"])
        state, _ = step(state, batch)
        masks.append(before - np.asarray(state.params["w"]))  # lr 1: minus the gradient
    base = first_stream_key(model)
    for t in range(2):
        for w in range(4):
            stream = jax.random.fold_in(step_key(base, t, w), 0)  # the module's only stream
            # nnx.Dropout draws with fold_in(stream, count 0); the gradient is mask / 0.5 / 64
            mask = jax.random.bernoulli(jax.random.fold_in(stream, 0), 0.5, (1, 64))[0]
            np.testing.assert_allclose(masks[t][w], mask * 2.0 / 64)
        assert len({m.tobytes() for m in masks[t]}) == 4  # every worker its own mask
    assert not np.array_equal(masks[0], masks[1])  # and every step


class Counter(nnx.Variable):
    pass


class WithCache(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(12, 5, rngs=rngs)
        self.seen = Counter(jnp.zeros(()))

    def __call__(self, x):
        return self.lin(x)


def test_state_no_strategy_can_carry_is_a_clear_error():
    with pytest.raises(ValueError, match=r"seen \(Counter\).*nnx.BatchStat"):
        ddl.flax.loss_from_module(WithCache(nnx.Rngs(0)), nnx_loss)


def test_a_loss_returning_state_of_another_structure_is_a_clear_error():
    def fn(params, model_state, batch, key):
        return jnp.sum(params["w"]) * 0.0, {"batch_stats": {"other": jnp.zeros(3)}}

    loss_fn = ddl.ModelLoss(fn)
    variables = {"params": {"w": jnp.ones(3)}, "batch_stats": {"mean": jnp.zeros(3)}}
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(ValueError, match="model state of another structure"):
        strategy.step(strategy.init(variables), {"x": np.zeros((2, 1))})


def test_plain_params_for_a_loss_with_model_state_is_a_clear_error():
    loss_fn, variables = ddl.flax.loss_from_module(
        BNDropoutMLP(rngs=nnx.Rngs(params=0, dropout=1)), nnx_loss
    )
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(TypeError, match="'batch_stats'"):
        strategy.init(variables["params"])


def test_a_missing_dropout_stream_is_a_clear_error():
    module = LinenBNDropout()
    variables = module.init(jax.random.key(0), jnp.ones((2, 12)), train=False)

    def loss(model, batch):
        return model(batch["x"], train=True).mean()

    loss_fn, v = ddl.flax.loss_from_module(module, loss, variables=variables)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(ValueError, match=r"rngs=\('dropout'"):
        strategy.step(strategy.init(v), make_batches(1, 4)[0])


class DropoutWithoutStream(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))
        self.drop = nnx.Dropout(0.5)  # no rngs: nothing to draw masks from

    def __call__(self, x):
        return self.drop(x * self.w[...]).sum()


def test_an_nnx_dropout_without_a_stream_is_a_clear_error():
    loss_fn, v = ddl.flax.loss_from_module(DropoutWithoutStream(), lambda m, b: m(b["x"]))
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=1))
    with pytest.raises(ValueError, match=r"nnx.Rngs\(params=0, dropout=1\)"):
        strategy.step(strategy.init(v), {"x": np.ones((2, 3), np.float32)})


def _counting(params, model_state, batch, key):
    """A loss whose model state counts steps (``calls``) and, per worker, its positive
    inputs (``seen``): integer counters, as a module's step counter."""
    stats = model_state["stats"]
    new = {"calls": stats["calls"] + 1, "seen": stats["seen"] + (batch["x"][:, 0] > 0).sum()}
    return jnp.mean((batch["x"] @ params["w"]) ** 2), {"stats": new}


@pytest.mark.parametrize(
    "build",
    [
        lambda loss, mesh: ddl.data_parallel(loss, optax.sgd(0.1), mesh),
        lambda loss, mesh: ddl.local_sgd(loss, optax.sgd(0.1), mesh, period=2),
        lambda loss, mesh: ddl.gossip(loss, optax.sgd(0.1), mesh, topology="ring"),
        lambda loss, mesh: ddl.gossip(loss, optax.sgd(0.1), mesh, drop=0.5),
        lambda loss, mesh: ddl.noloco(loss, optax.sgd(0.1), mesh, period=2),
        lambda loss, mesh: ddl.streaming_diloco(loss, optax.sgd(0.1), mesh, period=2, fragments=1),
    ],
    ids=["data_parallel", "local_sgd", "gossip", "gossip_drop", "noloco", "streaming"],
)
def test_integer_model_state_counts_on_under_every_strategy(build):
    """Counters are not averaged (a mean of integers would floor): each worker keeps its
    own, and the trained variables take the largest, as data parallelism's do."""
    zero = jnp.zeros((), jnp.int32)
    variables = {"params": {"w": jnp.ones(12)}, "stats": {"calls": zero, "seen": zero}}
    strategy = build(ddl.ModelLoss(_counting), ddl.make_mesh(data=8))
    state, _ = ddl.fit(strategy, variables, make_batches(4, 32), steps=4, progress=False)
    stats = strategy.params(state)["stats"]
    assert stats["calls"].dtype == jnp.int32 and int(stats["calls"]) == 4
    per_worker = np.asarray(state.model.state["stats"]["seen"])
    assert int(stats["seen"]) == per_worker.max()


def _no_state(params, model_state, batch, key):
    return jnp.mean(batch["x"] @ params["w"])  # the loss alone, not (loss, state)


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (ddl.ModelLoss(None), TypeError, "loss_fn.fn must be callable .params, model_state, b"),
        (ddl.ModelLoss(_counting, seed=1.5), TypeError, "loss_fn.seed must be an int >= 0 or"),
        (ddl.ModelLoss(_counting, seed="a"), TypeError, "loss_fn.seed must be an int >= 0 or"),
        (ddl.ModelLoss(_counting, seed=-1), TypeError, "got -1"),
        (ddl.ModelLoss(_counting, seed=np.zeros(3, np.uint32)), TypeError, r"uint32\[2\]"),
    ],
)
def test_a_model_loss_is_checked_when_the_strategy_is_built(loss_fn, error, match):
    with pytest.raises(error, match=match):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))


def test_a_model_loss_returning_the_loss_alone_is_a_clear_error():
    zero = jnp.zeros((), jnp.int32)
    variables = {"params": {"w": jnp.ones(12)}, "stats": {"calls": zero, "seen": zero}}
    strategy = ddl.data_parallel(ddl.ModelLoss(_no_state), optax.sgd(0.1), ddl.make_mesh(data=2))
    with pytest.raises(TypeError, match=r"return \(out, new_model_state\), got an array: a ddl"):
        strategy.step(strategy.init(variables), make_batches(1, 4)[0])
