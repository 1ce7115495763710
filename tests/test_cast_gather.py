"""FSDP's parameter all-gather cast to bfloat16 (PyTorch FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` gather): half the bytes, the same training with a
loss that computes in bfloat16."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import make_batches, mlp_pair
from test_fsdp_layers import loss_fn as scan_loss
from test_fsdp_layers import scan_mlp
from test_quantised_gather import gathered_bytes

import ddl_jax as ddl


@pytest.mark.parametrize("reshard", [True, False], ids=["layer-by-layer", "gathered-once"])
def test_a_bfloat16_gather_trains_exactly_as_a_float32_one_under_bfloat16_compute(reshard):
    """The loss casts its parameters to bfloat16 either way, and a value rounded to
    bfloat16 rounds to itself: the parameters after 3 steps are the same bit for bit. The
    backward of a layer gathered inside the scan is the float32 reduce-scatter, as
    without the cast."""
    params, batches = scan_mlp(16, 4), make_batches(3, 32)
    loss = ddl.mixed_precision(scan_loss, jnp.bfloat16)
    mesh = ddl.make_mesh(data=8)
    results = []
    for gather_dtype in (None, jnp.bfloat16):
        strategy = ddl.fsdp(loss, optax.adam(1e-2), mesh, reshard_after_forward=reshard,
                            gather_dtype=gather_dtype)  # fmt: skip
        step, state = jax.jit(strategy.step), strategy.init(params)
        for batch in batches:
            state, _ = step(state, batch)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
        results.append(jax.device_get(strategy.params(state)))
    chex.assert_trees_all_equal(*results)
    # and they trained: not the initial parameters
    pairs = zip(jax.tree.leaves(results[0]), jax.tree.leaves(params), strict=True)
    assert not all((a == b).all() for a, b in pairs)


def test_a_bfloat16_gather_sends_half_the_bytes():
    """From the compiled HLO: the all-gathers carry bfloat16."""
    params, batch = scan_mlp(256, 2), make_batches(1, 32)[0]
    mesh = ddl.make_mesh(data=8)
    sent = [
        gathered_bytes(ddl.fsdp(scan_loss, optax.sgd(0.1), mesh, gather_dtype=d), params, batch)
        for d in (None, jnp.bfloat16)
    ]
    assert sent[1] == sent[0] / 2


def test_the_loss_receives_the_gathered_parameters_in_the_gather_dtype():
    """As FSDP2's ``param_dtype``: the unsharded parameters are bfloat16, their gradient
    comes back float32 to the float32 master shards."""
    loss_fn, params = mlp_pair()
    seen = []

    def spy(p, batch):
        seen.append({x.dtype for x in jax.tree.leaves(p)})
        return loss_fn(p, batch)

    strategy = ddl.fsdp(spy, optax.sgd(0.1), ddl.make_mesh(data=8), gather_dtype=jnp.bfloat16)
    state, metrics = jax.jit(strategy.step)(strategy.init(params), make_batches(1, 32)[0])
    assert seen[-1] == {jnp.dtype(jnp.bfloat16)}  # the step's (the first: a shape probe)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert jnp.isfinite(metrics["loss"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gather_dtype": jnp.int8}, ValueError, "gather_dtype must be a floating dtype of 2"),
        ({"gather_dtype": jnp.float8_e4m3fn}, ValueError, "must be a floating dtype of 2 or 4"),
        ({"gather_dtype": "no dtype"}, TypeError, "gather_dtype must be a floating dtype"),
        ({"gather_dtype": jnp.bfloat16, "stage": 2}, ValueError, "only stage 3 has.*stage=2"),
        ({"gather_dtype": jnp.bfloat16, "quantized_weights": True}, ValueError,
         "not quantized_weights"),
    ],
)  # fmt: skip
def test_bad_gather_dtypes_are_named(kwargs, error, match):
    loss_fn, _ = mlp_pair()
    with pytest.raises(error, match=match):
        ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), **kwargs)
