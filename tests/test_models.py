"""The bundled NNX models: shapes, causality, and train/eval behaviour of dropout and BN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ddl_jax as ddl


def batch_stats(model):
    return jax.tree.map(np.array, nnx.state(model, nnx.BatchStat))


def images(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).random((n, 8, 8, 1)), jnp.float32)


GPT_SIZE = {"context": 8, "features": 16, "heads": 2, "layers": 1}


def byte_tokens(b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, t)), jnp.int32)


def test_resnet_batch_stats_move_in_train_mode_only():
    model = ddl.models.ResNet(rngs=nnx.Rngs(0))
    x = images(8)
    before = batch_stats(model)
    logits = model(x)  # a new model trains
    assert logits.shape == (8, 10) and logits.dtype == jnp.float32
    after = batch_stats(model)
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, after)
    assert all(jax.tree.leaves(changed)) and len(jax.tree.leaves(changed)) == 12
    # Training mode normalises with the batch's statistics: a row depends on its batch.
    assert not np.allclose(model(x[:4]), model(x)[:4], atol=1e-4)

    model.eval()
    frozen = batch_stats(model)
    out = model(x)
    jax.tree.map(np.testing.assert_array_equal, frozen, batch_stats(model))
    np.testing.assert_allclose(model(x[:4]), out[:4], rtol=1e-5, atol=1e-5)
    model.train()
    model(x)
    assert not np.allclose(batch_stats(model)["stem_bn"]["mean"], frozen["stem_bn"]["mean"])


def test_resnet_batch_norm_axis_pools_statistics_over_workers():
    x = images(8)
    whole = ddl.models.ResNet(rngs=nnx.Rngs(0))
    expected = whole(x)
    graphdef, state = nnx.split(ddl.models.ResNet(batch_norm_axis="data", rngs=nnx.Rngs(0)))

    def worker(state, rows):
        model = nnx.merge(graphdef, state)
        return model(rows), nnx.state(model, nnx.BatchStat)

    out, stats = jax.vmap(worker, in_axes=(None, 0), axis_name="data")(
        state, x.reshape(2, 4, 8, 8, 1)
    )
    np.testing.assert_allclose(out.reshape(8, 10), expected, rtol=1e-4, atol=1e-5)
    leaves = zip(jax.tree.leaves(stats), jax.tree.leaves(batch_stats(whole)), strict=True)
    for mine, full in leaves:
        np.testing.assert_allclose(mine[0], full, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(mine[1], full, rtol=1e-4, atol=1e-6)


def test_gpt_shapes_and_heads():
    tied = ddl.models.GPT(**GPT_SIZE, rngs=nnx.Rngs(0))
    untied = ddl.models.GPT(**GPT_SIZE, tied=False, rngs=nnx.Rngs(0))
    for model in (tied, untied):
        assert model(byte_tokens(2, 8)).shape == (2, 8, 256)
        assert model(byte_tokens(3, 5)).shape == (3, 5, 256)  # shorter than the context
    sizes = [sum(p.size for p in jax.tree.leaves(nnx.state(m, nnx.Param))) for m in (tied, untied)]
    assert sizes[1] - sizes[0] == 16 * 256
    with pytest.raises(ValueError, match="1 <= t <= context=8"):
        tied(byte_tokens(2, 9))


def test_gpt_is_causal():
    model = ddl.models.GPT(**{**GPT_SIZE, "layers": 2}, rngs=nnx.Rngs(0))
    model.eval()
    x = byte_tokens(2, 8)
    base = model(x)
    for t in (0, 5, 7):
        changed = model(x.at[:, t].set((x[:, t] + 1) % 256))
        np.testing.assert_allclose(changed[:, :t], base[:, :t], rtol=1e-5, atol=1e-5)
        assert np.abs(changed[:, t] - base[:, t]).max() > 1e-3


def test_gpt_with_scan_layers_is_the_gpt_with_its_blocks_stacked():
    size = {**GPT_SIZE, "layers": 3}
    scanned = ddl.models.GPT(**size, dropout=0.2, scan_layers=True, rngs=nnx.Rngs(0))
    unrolled = ddl.models.GPT(**size, dropout=0.2, rngs=nnx.Rngs(0))
    stacked = nnx.state(scanned.blocks, nnx.Param)
    assert {x.shape[0] for x in jax.tree.leaves(stacked)} == {3}
    for i, block in enumerate(unrolled.blocks):
        nnx.update(block, jax.tree.map(lambda x, i=i: x[i], stacked))
    for name in ("embed", "positions", "ln"):
        nnx.update(getattr(unrolled, name), nnx.state(getattr(scanned, name), nnx.Param))
    x = byte_tokens(2, 8)
    assert np.abs(scanned(x) - scanned(x)).max() > 1e-3  # dropout, a key per call
    scanned.eval()
    unrolled.eval()
    np.testing.assert_allclose(scanned(x), unrolled(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scan_layers must be a bool"):
        ddl.models.GPT(**size, scan_layers=1, rngs=nnx.Rngs(0))


def test_gpt_dropout_in_train_mode_only():
    kw = GPT_SIZE
    model = ddl.models.GPT(**kw, dropout=0.2, rngs=nnx.Rngs(params=0, dropout=1))
    x = byte_tokens(2, 8)
    first, second = model(x), model(x)  # a new model trains; the stream advances
    assert np.abs(first - second).max() > 1e-3
    # The masks come from rngs.dropout: same stream, same masks; another, other masks.
    again = ddl.models.GPT(**kw, dropout=0.2, rngs=nnx.Rngs(params=0, dropout=1))
    np.testing.assert_array_equal(again(x), first)
    other = ddl.models.GPT(**kw, dropout=0.2, rngs=nnx.Rngs(params=0, dropout=2))
    assert np.abs(other(x) - first).max() > 1e-3
    # ... or from the call's key.
    key = jax.random.key(7)
    np.testing.assert_array_equal(model(x, rngs=key), model(x, rngs=key))

    model.eval()
    plain = ddl.models.GPT(**kw, dropout=0.0, rngs=nnx.Rngs(params=0, dropout=1))
    np.testing.assert_array_equal(model(x), model(x))
    np.testing.assert_allclose(model(x), plain(x), rtol=1e-6, atol=1e-6)  # same params


def test_bits_per_byte():
    assert ddl.models.bits_per_byte(np.log(256.0)) == pytest.approx(8.0)
    np.testing.assert_allclose(ddl.models.bits_per_byte(jnp.array([np.log(2.0)])), [1.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="features=30 is not divisible by heads=4"):
        ddl.models.GPT(features=30, heads=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout must be in"):
        ddl.models.GPT(dropout=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="context must be an int >= 1"):
        ddl.models.GPT(context=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="image_shape must be"):
        ddl.models.ResNet((8, 8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^CNN: image_shape must be \(h, w, channels\)"):
        ddl.models.CNN((8, 8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^CNN: image_shape\[2\] must be an int >= 1, got 0"):
        ddl.models.CNN((8, 8, 0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^MLP: hidden\[1\] must be an int >= 1, got 0"):
        ddl.models.MLP(64, [8, 0], 10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^MLP: out_features must be an int >= 1, got 2.5"):
        ddl.models.MLP(64, [8], 2.5, rngs=nnx.Rngs(0))
    assert len(ddl.models.MLP(np.int64(64), [np.int32(8)], 10, rngs=nnx.Rngs(0)).layers) == 2


def test_gpt_in_bfloat16_computes_in_bfloat16_over_float32_parameters():
    """dtype=bfloat16: the same float32 parameters, matrix products in bfloat16, float32
    logits close to the float32 model's."""
    wide = ddl.models.GPT(**GPT_SIZE, rngs=nnx.Rngs(0))
    half = ddl.models.GPT(**GPT_SIZE, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for model in (wide, half):
        model.eval()
    params = nnx.state(half, nnx.Param)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    x = byte_tokens(2, 8)
    products = [
        e.outvars[0].aval.dtype
        for e in jax.make_jaxpr(half)(x).jaxpr.eqns
        if e.primitive.name == "dot_general"
    ]
    assert len(products) >= 6 and products.count(jnp.bfloat16) >= len(products) - 2
    logits = half(x)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, wide(x), atol=0.05)
    assert not np.array_equal(logits, wide(x))
