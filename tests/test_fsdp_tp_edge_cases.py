"""FSDP and tensor parallelism: a stacked leaf too small to split trains layer by layer,
tree-wide and masked optimizers train as on one device, and ``Strategy.params`` comes back
on the user's mesh."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, reference_sgd, train
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_tensor_parallel import Classifier, classifier_loss

import ddl_jax as ddl
from ddl_jax.layers import param_specs


def gated_layers(depth: int = 6, width: int = 16) -> dict:
    """Stacked layers with a per-layer gate ``(depth,)`` and a bias ``(depth, 7)``: no
    dimension of either divides over 8 workers, so they stay whole."""
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "inp": {"w": jax.random.normal(k[0], (12, width)) * 0.3},
        "layers": {
            "w": jax.random.normal(k[1], (depth, width, width)) / np.sqrt(width),
            "alpha": jnp.linspace(0.5, 1.0, depth),
            "b": jax.random.normal(k[2], (depth, 7)) * 0.1,
        },
        "out": {"w": jax.random.normal(k[3], (width, 5)) * 0.3},
    }


def gated_loss(params, batch):
    def layer(p, h):
        h = h + p["alpha"] * jnp.tanh(h @ p["w"])
        return h.at[:, :7].add(p["b"])

    h = jnp.tanh(batch["x"] @ params["inp"]["w"])
    h = ddl.layers.scan_layers(layer, params["layers"], h)
    logits = h @ params["out"]["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_layer_by_layer_with_whole_stacked_leaves_equals_single_device_training():
    params, batches = gated_layers(), make_batches(4, 32)
    strategy = ddl.fsdp(gated_loss, optax.adam(1e-2), ddl.make_mesh(data=8))
    state, _ = train(strategy, params, batches)
    assert state.params["layers"]["alpha"].addressable_shards[0].data.shape == (6,)
    expected = reference_sgd(gated_loss, optax.adam(1e-2), params, batches)
    got = jax.device_get(strategy.params(state))
    chex.assert_trees_all_close(got, expected, atol=1e-6, rtol=1e-6)
    assert not np.allclose(got["layers"]["alpha"], params["layers"]["alpha"])  # it trained


def split_params() -> dict:
    k = jax.random.split(jax.random.key(3), 2)
    return {
        "w1": jax.random.normal(k[0], (12, 16)) * 0.5,
        "w2": jax.random.normal(k[1], (16, 5)) * 0.5,
    }


#: Every parameter split over ``model``: no replicated leaf to compare over it.
SPLIT = {"w1": P(None, "model"), "w2": P("model", None)}


def split_loss(params, batch, total=lax.psum):
    """On the shards (``total`` sums the hidden units' parts over ``model``)."""
    hidden = jax.nn.relu(batch["x"] @ params["w1"])
    logits = total(hidden @ params["w2"], "model")
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


whole_loss = functools.partial(split_loss, total=lambda x, _: x)

TREE_WIDE = {
    "clip_by_global_norm": optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1)),
    "apply_if_finite": optax.apply_if_finite(optax.sgd(0.1), 2),
}


@pytest.mark.parametrize("name", list(TREE_WIDE))
@pytest.mark.parametrize(("data", "model"), [(2, 4), (1, 8)])
def test_tree_wide_optimizers_under_tensor_parallel_read_the_whole_gradient(name, data, model):
    """As on one device: a norm of one device's shards clipped less (silently), and
    ``apply_if_finite``'s count was refused as differing over ``model``."""
    params, batches, optimizer = split_params(), make_batches(3, 16), TREE_WIDE[name]
    assert optax.tree.norm(jax.grad(whole_loss)(params, batches[0])) > 1  # it clips
    mesh = ddl.make_mesh(data=data, model=model)
    strategy = ddl.tensor_parallel(split_loss, optimizer, mesh, specs=SPLIT)
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(whole_loss, optimizer, params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6, rtol=1e-6)


def test_a_reducer_that_does_not_average_is_named():
    module = Classifier(nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(module, classifier_loss)
    batch = make_batches(1, 16)[0]
    mesh = ddl.make_mesh(data=2, model=4)
    bad = ddl.tensor_parallel(
        loss_fn, optax.sgd(0.1), mesh, specs=param_specs(module), reducer=optax.identity()
    )
    with pytest.raises(ValueError, match="A reducer must average") as e:
        jax.jit(bad.step)(bad.init(params), batch)
    assert "['data']" in str(e.value) and "optimizer" not in str(e.value)


#: Freezing ``w1``: labels from a function that reads the params, and a mask tree.
FROZEN = optax.chain(
    optax.multi_transform(
        {"frozen": optax.set_to_zero(), "trained": optax.identity()},
        lambda p: {k: "frozen" if k == "w1" else "trained" for k in p},
    ),
    optax.masked(optax.adam(1e-2), {"w1": False, "w2": True}),
    optax.masked(optax.sgd(1e-2), {"w1": True, "w2": False}),
)


@pytest.mark.parametrize("build", ["fsdp_1", "fsdp_2", "fsdp_3", "tensor_parallel"])
def test_frozen_and_masked_parameters_train_as_on_one_device(build):
    """``optax.multi_transform`` and ``optax.masked``, the way to freeze parameters,
    under the builders that shard the optimizer state (they failed in
    ``optax.tree_map_params``): the state keeps its masked nodes, each moment lives where
    its parameter does."""
    mesh = ddl.make_mesh(data=2, model=4)
    if build == "tensor_parallel":
        strategy = ddl.tensor_parallel(split_loss, FROZEN, mesh, specs=SPLIT)
    else:
        stage = int(build[-1])
        strategy = ddl.fsdp(split_loss, FROZEN, mesh, stage=stage, specs=SPLIT)
    params, batches = split_params(), make_batches(3, 16)
    state, _ = train(strategy, params, batches)
    got = jax.device_get(strategy.params(state))
    chex.assert_trees_all_close(got, reference_sgd(whole_loss, FROZEN, params, batches), atol=1e-6)
    np.testing.assert_array_equal(got["w1"], params["w1"])
    assert not np.allclose(got["w2"], params["w2"])
    moments = [
        (path, x) for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state) if x.ndim == 2
    ]
    assert len(moments) == 2  # adam's mu and nu of w2; w1's are masked nodes
    for path, x in moments:
        assert jax.tree_util.keystr(path).endswith("['w2']")
        assert x.sharding.spec == state.params["w2"].sharding.spec


def odd_params() -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    return {"w": jax.random.normal(k[0], (12, 5)) * 0.3, "b": jnp.zeros((5,))}


def odd_loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("built", ["make_mesh", "by_hand"])
@pytest.mark.parametrize("name", ["fsdp", "tensor_parallel", "data_parallel", "local_sgd", "async"])
def test_params_come_back_on_the_users_mesh(name, built):
    """On the mesh as given: one built by hand has Auto axes, and arrays on a copy of it
    with Explicit ones would not meet the user's arrays."""
    mesh = ddl.make_mesh(data=8)
    if built == "by_hand":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    batches = make_batches(2, 32)
    build = {
        "fsdp": lambda: ddl.fsdp(odd_loss, optax.sgd(0.1), mesh),
        "tensor_parallel": lambda: ddl.tensor_parallel(odd_loss, optax.sgd(0.1), mesh, specs=P()),
        "data_parallel": lambda: ddl.data_parallel(odd_loss, optax.sgd(0.1), mesh),
        "local_sgd": lambda: ddl.local_sgd(odd_loss, optax.sgd(0.1), mesh, period=1),
        "async": lambda: ddl.async_sgd(odd_loss, optax.sgd(0.1), mesh, protocol=ddl.softsync(8)),
    }[name]
    strategy, dp = build(), ddl.data_parallel(odd_loss, optax.sgd(0.1), mesh)
    got = strategy.params(train(strategy, odd_params(), batches)[0])
    expected = dp.params(train(dp, odd_params(), batches)[0])
    assert got["w"].sharding.mesh == mesh  # replicated on it
    assert got["w"].sharding.is_equivalent_to(NamedSharding(mesh, P()), got["w"].ndim)
    diff = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), got, expected)  # same mesh: no error
    assert max(float(d) for d in jax.tree.leaves(diff)) < 1e-6
    # An eval_fn on a test set sharded over the user's mesh.
    test = jax.device_put(make_batches(1, 64, seed=1)[0], NamedSharding(mesh, P("data")))
    _, history = ddl.fit(
        strategy, odd_params(), batches, steps=2, eval_fn=lambda p: odd_loss(p, test),
        eval_every=2, progress=False,
    )  # fmt: skip
    np.testing.assert_allclose(history[-1]["eval"], odd_loss(expected, test), rtol=1e-5)
