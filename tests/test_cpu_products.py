"""Weight-gradient products laid out for XLA:CPU: autodiff's gradients, without a product
whose left operand contracts its leading dimension (the one XLA:CPU keeps off YNNPACK)."""

import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_loss, reference_sgd, train
from flax import nnx
from jax import lax

import ddl_jax as ddl
from ddl_jax._src.xla_cpu import products as cpu_products
from ddl_jax._src.xla_cpu import tunings
from ddl_jax._src.xla_cpu.products import transposed_weight_gradients

LEADING = re.compile(r" dot\([^)]*\), lhs_contracting_dims=\{0\}")


def leading_products(fn, *args) -> int:
    """Products in ``fn``'s compiled HLO whose left operand contracts dimension 0."""
    return len(LEADING.findall(jax.jit(fn).lower(*args).compile().as_text()))


def init(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}": {
            "w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.asarray(rng.normal(size=b), jnp.float32),
        }
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    }


def dense_loss(params, batch):
    h = batch["x"]
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        h = h @ layer["w"] + layer["b"]
        h = jax.nn.relu(h) if i < len(params) - 1 else h
    logits = jax.nn.log_softmax(h)  # a jit inside the loss
    return -jnp.mean(jnp.take_along_axis(logits, batch["y"][:, None], axis=1)), {"h": h.sum()}


def test_gradients_equal_autodiff_without_a_leading_contraction():
    params, batch = init([12, 32, 32, 5]), make_batches(1, 16)[0]
    plain = jax.value_and_grad(dense_loss, has_aux=True)
    rewritten = transposed_weight_gradients(plain)
    # The plain gradient has one such product per layer; the rewrite leaves none.
    assert leading_products(plain, params, batch) == 3
    assert leading_products(rewritten, params, batch) == 0
    chex.assert_trees_all_close(
        jax.jit(rewritten)(params, batch), jax.jit(plain)(params, batch), rtol=1e-6, atol=1e-7
    )


def test_other_products_and_higher_order_primitives_run_unchanged():
    """A 3-D activation (its weight gradient contracts two leading dimensions), a
    rematerialised layer and a scan (run unchanged), and a left operand contracting
    dimension 0 against a right operand contracting dimension 1."""
    params = init([12, 16, 16, 5])
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6, 12)), jnp.float32)
    v = jnp.asarray(np.random.default_rng(2).normal(size=(5, 4)), jnp.float32)

    def loss(params, x, v):
        h = jax.nn.tanh(x @ params["layer0"]["w"])  # (4, 6, 16)
        h = jax.checkpoint(lambda h: jnp.sin(h @ params["layer1"]["w"]))(h)
        h, _ = lax.scan(lambda c, _: (jnp.cos(c) @ params["layer1"]["w"], None), h, length=2)
        out = h.mean(axis=1) @ params["layer2"]["w"]  # (4, 5)
        # (4, 5) contracting 0 with (5, 4) contracting 1
        return lax.dot_general(out, v, (((0,), (1,)), ((), ()))).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    chex.assert_trees_all_close(
        jax.jit(transposed_weight_gradients(grad))(params, x, v),
        jax.jit(grad)(params, x, v),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.fixture
def one_core(monkeypatch):
    """This process as if it ran on one core with the XLA:CPU tunings on, where the
    builders rewrite their gradients."""
    monkeypatch.setattr(cpu_products, "one_core", lambda: True)
    monkeypatch.setitem(tunings._state, "switch", True)


def test_one_core_processes_keep_autodiffs_products_without_the_tunings(mlp, monkeypatch):
    monkeypatch.setattr(cpu_products, "one_core", lambda: True)
    monkeypatch.setitem(tunings._state, "switch", False)
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    assert leading_products(strategy.step, strategy.init(params), make_batches(1, 16)[0]) == 2


class Sequence(nnx.Module):
    """Each example's 12 features as 3 steps of 4: the first layer's weight gradient
    contracts the batch and the step dimension."""

    def __init__(self, *, rngs):
        self.step = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(24, 5, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.step(x.reshape(-1, 3, 4)))
        return self.out(h.reshape(-1, 24))


@pytest.mark.parametrize("model", ["mlp", "sequence"])
def test_one_core_processes_train_as_single_device_sgd_without_a_leading_contraction(
    mlp, model, one_core
):
    if model == "mlp":
        loss_fn, params = mlp
    else:
        loss_fn, params = ddl.flax.loss_from_module(Sequence(rngs=nnx.Rngs(0)), mlp_loss)
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=4))
    batches = make_batches(3, 32)
    assert leading_products(strategy.step, strategy.init(params), batches[0]) == 0
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


def test_processes_with_several_cores_keep_autodiffs_products(mlp, monkeypatch):
    monkeypatch.setattr(cpu_products, "one_core", lambda: False)
    monkeypatch.setitem(tunings._state, "switch", True)
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2))
    assert leading_products(strategy.step, strategy.init(params), make_batches(1, 16)[0]) == 2


class Stage(nnx.Module):
    def __init__(self, a, b, *, rngs):
        self.dense = nnx.Linear(a, b, rngs=rngs)

    def __call__(self, x):
        return self.dense(x["x"] if isinstance(x, dict) else x)


def test_pipeline_backward_on_one_core_has_no_leading_contraction(one_core):
    stages, params = ddl.pipeline_stages(
        [Stage(12, 16, rngs=nnx.Rngs(0)), Stage(16, 5, rngs=nnx.Rngs(1))]
    )

    def xent(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    mesh = ddl.make_mesh(stage=2)
    strategy = ddl.pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=2)
    state, batch = strategy.init(params), make_batches(1, 16)[0]
    assert leading_products(strategy.step, state, batch) == 0


def transposed_shapes(fn, *args) -> set[str]:
    """The shapes of the transposes (or fusions rooted in one) in ``fn``'s compiled HLO."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return set(
        re.findall(r"= (f32\[[\d,]+\])\{[\d,]+\} (?:transpose\(|fusion\([^\n]*transpose)", hlo)
    )


def test_the_narrower_operand_is_transposed():
    """A hidden layer (64 -> 256) transposes its input x, [32, 64]; the last layer (256 ->
    4) transposes its error gradient dy, [32, 4], not its input, [32, 256]. (Inside
    ``shard_map`` the same path runs in the one-core training test: 8 rows a worker.)"""
    rng = np.random.default_rng(3)
    params = init([64, 256, 4])
    batch = {
        "x": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 4, size=32), jnp.int32),
    }
    grad = jax.grad(lambda p, b: dense_loss(p, b)[0])
    rewritten = transposed_weight_gradients(grad)
    shapes = transposed_shapes(rewritten, params, batch)
    assert {"f32[64,32]", "f32[4,32]"} <= shapes
    assert "f32[256,32]" not in shapes
    chex.assert_trees_all_close(
        jax.jit(rewritten)(params, batch), jax.jit(grad)(params, batch), rtol=1e-5, atol=1e-6
    )
