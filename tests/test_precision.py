"""Mixed precision: a bfloat16 forward pass over float32 master parameters, any strategy.

The references are the plain loss (float32 compute must be it exactly) and the same loss
called on hand-cast bfloat16 parameters and inputs.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import bn_dropout_pair, make_batches, mlp_pair

import ddl_jax as ddl
from ddl_jax._src.train.precision import mixed_precision

KEY = jax.random.key(3)


def bf16(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def floating_dtypes(tree) -> set:
    return {
        jnp.dtype(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
    }


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def assert_close_gradients(got, want):
    """bfloat16 gradients near the float32 ones: relative to each entry (rtol 2e-2), or to
    the largest gradient entry for those exact arithmetic makes ~0 (a bias before batch
    norm), where rounding noise is all there is."""
    scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * scale)
    # and not merely equal: the backward pass did run in bfloat16
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    assert any(not np.array_equal(g, w) for g, w in pairs)


def dot_operand_dtypes(fn, *args) -> set:
    """The dtypes of every dot_general operand in ``fn``'s jaxpr, sub-jaxprs included."""
    found = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.update(jnp.dtype(v.aval.dtype) for v in eqn.invars)
        for sub in jax.extend.core.subjaxprs(jaxpr):
            visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_float32_compute_is_the_plain_loss_exactly():
    loss_fn, params = mlp_pair()
    batch = make_batches(1, 16)[0]
    wrapped = mixed_precision(loss_fn, jnp.float32)
    value, grads = jax.value_and_grad(wrapped)(params, batch)
    expected_value, expected_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert_trees_equal((value, grads), (expected_value, expected_grads))


def test_float32_compute_is_the_plain_model_loss_exactly():
    loss_fn, variables = bn_dropout_pair()
    wrapped = mixed_precision(loss_fn, jnp.float32)
    assert isinstance(wrapped, ddl.ModelLoss)
    np.testing.assert_array_equal(wrapped.seed, loss_fn.seed)
    params = variables["params"]
    state = {"batch_stats": variables["batch_stats"]}
    batch = make_batches(1, 16)[0]

    def run(fn):
        return jax.value_and_grad(lambda p: fn(p, state, batch, KEY), has_aux=True)(params)

    assert_trees_equal(run(wrapped.fn), run(loss_fn.fn))


def test_bfloat16_forward_with_float32_gradients():
    loss_fn, params = mlp_pair()
    batch = make_batches(1, 16)[0]
    wrapped = mixed_precision(loss_fn)
    # the matmuls run in bfloat16, forward and backward
    assert dot_operand_dtypes(wrapped, params, batch) == {jnp.dtype(jnp.bfloat16)}
    assert dot_operand_dtypes(jax.grad(wrapped), params, batch) == {jnp.dtype(jnp.bfloat16)}
    # the value is the hand-cast loss, returned as float32
    value, grads = jax.value_and_grad(wrapped)(params, batch)
    assert value.dtype == jnp.float32
    np.testing.assert_array_equal(value, loss_fn(bf16(params), bf16(batch)).astype(jnp.float32))
    # the gradient of the float32 master params is float32 and near the float32 gradient
    assert floating_dtypes(grads) == {jnp.dtype(jnp.float32)}
    assert_close_gradients(grads, jax.grad(loss_fn)(params, batch))


def test_bfloat16_model_loss_keeps_its_state_dtype_and_seed():
    loss_fn, variables = bn_dropout_pair()
    wrapped = mixed_precision(loss_fn)
    np.testing.assert_array_equal(wrapped.seed, loss_fn.seed)
    params = variables["params"]
    state = {"batch_stats": variables["batch_stats"]}
    batch = make_batches(1, 16)[0]
    (value, new_state), grads = jax.value_and_grad(
        lambda p: wrapped.fn(p, state, batch, KEY), has_aux=True
    )(params)
    assert value.dtype == jnp.float32
    assert floating_dtypes(grads) == {jnp.dtype(jnp.float32)}
    assert floating_dtypes(new_state) == {jnp.dtype(jnp.float32)}
    expected, expected_state = loss_fn.fn(bf16(params), state, bf16(batch), KEY)
    np.testing.assert_array_equal(value, expected.astype(jnp.float32))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b.astype(jnp.float32)),
        new_state,
        expected_state,
    )
    assert_close_gradients(grads, jax.grad(lambda p: loss_fn.fn(p, state, batch, KEY)[0])(params))


def test_only_floating_leaves_are_cast_and_aux_comes_back_float32():
    seen = {}

    def loss_fn(params, batch):
        seen.update(w=params["w"].dtype, n=params["n"].dtype, x=batch["x"].dtype)
        seen.update(y=batch["y"].dtype)
        value = jnp.mean(batch["x"] @ params["w"])
        return value, {"twice": 2 * value, "count": params["n"]}

    params = {"w": jnp.ones((3, 2)), "n": jnp.int32(4)}
    batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4, jnp.int32)}
    value, aux = mixed_precision(loss_fn)(params, batch)
    assert seen == {"w": jnp.bfloat16, "n": jnp.int32, "x": jnp.bfloat16, "y": jnp.int32}
    assert (value.dtype, aux["twice"].dtype, aux["count"].dtype) == (
        jnp.float32,
        jnp.float32,
        jnp.int32,
    )
    mixed_precision(loss_fn, cast_batch=False)(params, batch)
    assert (seen["w"], seen["x"]) == (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("reducer", [None, "cast"], ids=["float32-reduce", "bfloat16-reduce"])
def test_data_parallel_trains_with_float32_master_state(reducer):
    loss_fn, params = mlp_pair()
    strategy = ddl.data_parallel(
        mixed_precision(loss_fn),
        optax.sgd(0.1, momentum=0.9),
        ddl.make_mesh(data=8),
        reducer=ddl.compression.cast(jnp.bfloat16) if reducer else None,
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    batch = make_batches(1, 64)[0]
    losses = []
    for _ in range(10):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert floating_dtypes(strategy.params(state)) == {jnp.dtype(jnp.float32)}
    assert floating_dtypes(state.opt_state) == {jnp.dtype(jnp.float32)}
    assert losses[-1] < 0.8 * losses[0], losses


def test_data_parallel_model_loss_keeps_float32_batch_statistics():
    loss_fn, variables = bn_dropout_pair()
    strategy = ddl.data_parallel(mixed_precision(loss_fn), optax.adam(1e-2), ddl.make_mesh(data=8))
    state, _ = ddl.fit(strategy, variables, make_batches(3, 64), steps=3, progress=False)
    trained = strategy.params(state)
    assert floating_dtypes(trained) == {jnp.dtype(jnp.float32)}
    assert floating_dtypes(state.opt_state) == {jnp.dtype(jnp.float32)}
    assert not np.allclose(trained["batch_stats"]["norm"]["mean"], 0.0)


def test_local_sgd_with_a_bfloat16_reducer_trains():
    loss_fn, params = mlp_pair()
    strategy = ddl.local_sgd(
        mixed_precision(loss_fn),
        optax.sgd(0.1),
        ddl.make_mesh(data=8),
        period=2,
        reducer=ddl.compression.cast(jnp.bfloat16),
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    batch = make_batches(1, 64)[0]
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert floating_dtypes(strategy.params(state)) == {jnp.dtype(jnp.float32)}
    assert losses[-1] < losses[0], losses


def tiny_gradient_loss(params, batch):
    """A loss whose gradient (entries of 1e-9 times a sum of x, at most 5e-9) lies below
    float16's smallest subnormal 2**-24 (6e-8), from factors float16 holds (1e-4, 1e-5):
    in float16 it flushes to zero unless scaled."""
    return jnp.sum((batch["x"] * 1e-4) @ params["w"] * 1e-5) + 0.0 * jnp.sum(params["b"])


def test_a_loss_scale_keeps_float16_gradients_that_flush_to_zero_without_it():
    params = {"w": jnp.ones((4, 3), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    batch = {"x": jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32).reshape(2, 4)}
    want = jax.grad(tiny_gradient_loss)(params, batch)  # float32: 1e-8 * column sums of x
    plain = jax.grad(mixed_precision(tiny_gradient_loss, jnp.float16))(params, batch)
    assert not np.asarray(plain["w"]).any()  # flushed to zero
    scaled_loss = mixed_precision(tiny_gradient_loss, jnp.float16, loss_scale=2**15)
    value, got = jax.value_and_grad(scaled_loss)(params, batch)
    assert floating_dtypes(got) == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-2)
    np.testing.assert_array_equal(got["b"], want["b"])
    # the value is the unscaled loss
    np.testing.assert_array_equal(
        value, mixed_precision(tiny_gradient_loss, jnp.float16)(params, batch)
    )


def test_a_loss_scale_leaves_a_model_losss_value_state_and_gradient_as_without():
    """A gradient that neither underflows nor overflows is the same with and without the
    scale (a power of two): exactly, with batch norm's state and an aux dict through."""
    loss_fn, variables = bn_dropout_pair()
    params = variables["params"]
    state = {"batch_stats": variables["batch_stats"]}
    batch = make_batches(1, 16)[0]

    def run(fn):
        return jax.value_and_grad(lambda p: fn(p, state, batch, KEY), has_aux=True)(params)

    plain = mixed_precision(loss_fn, jnp.bfloat16)
    scaled = mixed_precision(loss_fn, jnp.bfloat16, loss_scale=2.0**8)
    assert_trees_equal(run(scaled.fn), run(plain.fn))


def test_an_overflowing_scaled_step_is_skipped_by_fit():
    """A scale that overflows float16 gives an inf gradient, which
    ``fit(skip_nonfinite=True)`` skips, leaving the parameters as they were."""
    loss_fn, params = mlp_pair()
    batches = make_batches(2, 32)
    loss = mixed_precision(loss_fn, jnp.float16, loss_scale=2.0**15)
    strategy = ddl.data_parallel(
        lambda p, b: loss(p, b) * 1e6, optax.sgd(0.1), ddl.make_mesh(data=2)
    )
    with pytest.warns(UserWarning, match="all 2 steps were skipped"):
        state, history = ddl.fit(strategy, params, iter(batches), steps=2,
                                 skip_nonfinite=True, progress=False)  # fmt: skip
    assert [r["skipped"] for r in history] == [1.0, 1.0]
    assert_trees_equal(strategy.params(state), params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compute_dtype": jnp.int32}, ValueError, "compute_dtype must be a floating dtype"),
        ({"compute_dtype": jnp.complex64}, ValueError, "compute_dtype must be a floating"),
        ({"compute_dtype": "not a dtype"}, TypeError, "compute_dtype must be a floating"),
        ({"compute_dtype": None}, TypeError, "compute_dtype must be a floating dtype"),
        ({"compute_dtype": jnp.float8_e4m3fn}, ValueError, "float8 needs per-tensor scaling"),
        ({"compute_dtype": jnp.float64}, ValueError, "float64 needs jax_enable_x64"),
        ({"cast_batch": "yes"}, TypeError, "cast_batch must be a bool"),
        ({"loss_scale": 0}, ValueError, "loss_scale must be a finite real number > 0"),
        ({"loss_scale": "8"}, ValueError, "loss_scale must be a finite real number"),
        ({"loss_scale": 1000.0}, ValueError, "loss_scale must be a power of two below"),
        ({"compute_dtype": jnp.float16, "loss_scale": 2**16}, ValueError, "below float16's"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be a callable .* or a ddl.ModelLoss"),
        ({"loss_fn": ddl.ModelLoss(fn=3)}, TypeError, "loss_fn.fn must be callable"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    args = {"loss_fn": lambda params, batch: 0.0, **kwargs}
    with pytest.raises(error, match=match):
        mixed_precision(**args)


def test_a_loss_wrapped_twice_is_refused():
    """The second cast would round the first one's values again (bfloat16 through float16)."""
    for loss in (mlp_pair()[0], bn_dropout_pair()[0]):
        with pytest.raises(ValueError, match="already computes in bfloat16 .* wrap the plain"):
            mixed_precision(mixed_precision(loss), jnp.float16)


REDUCERS_IN_BFLOAT16 = {
    "cast": lambda: ddl.compression.cast(jnp.bfloat16),
    "qsgd": lambda: ddl.compression.qsgd(8),
    "top_k": lambda: ddl.compression.top_k(0.5),
    "threshold": lambda: ddl.compression.threshold(1e-3),
    "sparse_loco": lambda: ddl.compression.sparse_loco(0.25),
    "demo": lambda: ddl.compression.demo(0.25),
    "cast_e3m0": lambda: ddl.compression.cast_e3m0(),
}


@pytest.mark.parametrize("name", sorted(REDUCERS_IN_BFLOAT16))
def test_a_compressing_reducer_keeps_bfloat16_parameters_in_bfloat16(name):
    """Parameters held in bfloat16: every reducer returns updates in their dtype, as the
    default all-reduce does, so local SGD's synchronisation and Adam's state keep it."""
    loss_fn, params = mlp_pair()
    params = bf16(params)
    mesh = ddl.make_mesh(data=4)
    batch = make_batches(1, 32)[0]
    for build in (
        lambda r: ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1, reducer=r),
        lambda r: ddl.data_parallel(loss_fn, optax.adam(1e-2), mesh, reducer=r),
    ):
        strategy = build(REDUCERS_IN_BFLOAT16[name]())
        state, _ = jax.jit(strategy.step)(strategy.init(params), batch)
        assert floating_dtypes(strategy.params(state)) == {jnp.dtype(jnp.bfloat16)}
        if hasattr(state, "opt_state"):
            assert jnp.dtype(jnp.float32) not in floating_dtypes(state.opt_state)
