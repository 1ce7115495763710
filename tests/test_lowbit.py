"""The 4-bit E3M0 reducer (Streaming DiLoCo's outer-gradient format) against plain NumPy.

The NumPy reference below is written from the format's definition (1 sign bit, 3 exponent
bits, no mantissa; exponent field 0 is zero, field e > 0 is 2^(e - 3)), the per-block
absmax scale and round-to-nearest-even of ``lowbit.cast_e3m0``'s docstring, and torchft's
compressed all-reduce (``torchft/collectives.py``, ``allreduce_quantized``: all-to-all of
codes, the owner dequantises, sums in float32, requantises, all-gather).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import worker_shards
from reducers import run_steps

import ddl_jax as ddl
from ddl_jax._src.measure.comm import collectives
from ddl_jax._src.reduce.lowbit import (
    E3M0State,
    cast_e3m0,
    decode_e3m0,
    encode_e3m0,
    pack_nibbles,
    unpack_nibbles,
)

# -- NumPy reference ------------------------------------------------------------------------

# code = sign << 3 | exponent field; magnitudes by field: 0, 1/4, 1/2, 1, 2, 4, 8, 16.
MAGNITUDES = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0], np.float32)
TABLE = np.concatenate([MAGNITUDES, -MAGNITUDES]).astype(np.float32)


def ref_encode(x: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
    """Codes of ``x`` (already scaled): nearest magnitude, ties to the even field; with
    uniforms ``u``, up with probability (|x| - lo) / (hi - lo). Saturates at 16."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    lo_field = np.searchsorted(MAGNITUDES, a, side="right") - 1  # largest magnitude <= a
    hi_field = np.minimum(lo_field + 1, 7)
    lo, hi = MAGNITUDES[lo_field], MAGNITUDES[hi_field]
    if u is None:
        mid = (lo + hi) / 2
        up = (a > mid) | ((a == mid) & (hi_field % 2 == 0))
    else:
        width = np.where(hi > lo, hi - lo, 1.0)
        up = u < np.where(hi > lo, (a - lo) / width, 0.0)
    field = np.where(up, hi_field, lo_field)
    return (np.where(np.signbit(x), 8, 0) | field).astype(np.uint8)


def ref_quantise(blocks: np.ndarray, u: np.ndarray | None = None):
    """``[..., block]`` to codes and float32 scales ``absmax / 16`` per block."""
    scales = (np.abs(blocks).max(axis=-1) / np.float32(16)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    return ref_encode(blocks / safe[..., None], u), scales


def ref_dequantise(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return TABLE[codes] * scales[..., None]


def ref_reduce(xs: list[np.ndarray], block: int) -> np.ndarray:
    """The workers' flat vectors ``xs`` averaged as the reducer does, to nearest."""
    n, d = len(xs), xs[0].size
    length = -(-d // (n * block)) * n * block
    padded = np.zeros((n, length), np.float32)
    for i, x in enumerate(xs):
        padded[i, :d] = x
    chunks = padded.reshape(n, n, -1, block)  # [worker, owner, blocks, block]
    owners = []
    for j in range(n):
        total = np.zeros(chunks.shape[2:], np.float32)
        for i in range(n):
            total = total + ref_dequantise(*ref_quantise(chunks[i, j]))
        owners.append(ref_dequantise(*ref_quantise(total / np.float32(n))))
    return np.concatenate([o.reshape(-1) for o in owners])[:d]


# -- the quantiser ----------------------------------------------------------------------------


def test_the_16_codes_decode_as_the_table():
    np.testing.assert_array_equal(np.asarray(decode_e3m0(jnp.arange(16, dtype=jnp.uint8))), TABLE)
    # Both zeros decode to +0 or -0 and every other value once: 15 distinct numbers.
    assert len(set(TABLE.tolist())) == 15


def test_every_code_encodes_to_itself_but_negative_zero():
    codes = np.asarray(encode_e3m0(jnp.asarray(TABLE)))
    np.testing.assert_array_equal(codes, ref_encode(TABLE))
    expected = np.arange(16)
    expected[8] = 8  # -0.0 keeps its sign bit; it decodes to zero all the same
    np.testing.assert_array_equal(codes, expected)


def test_encode_rounds_to_nearest_with_ties_to_even_and_saturates():
    x = np.array(
        [
            0.1,
            0.125,
            0.13,
            0.374,
            0.375,
            0.376,
            0.75,
            1.5,
            3.0,
            6.0,
            12.0,
            11.99,
            12.01,
            16.0,
            17.0,
            1e30,
            -0.125,
            -0.2,
            -12.0,
            -1e30,
            0.0,
            1e-30,
        ],
        np.float32,
    )
    codes = np.asarray(encode_e3m0(jnp.asarray(x)))
    np.testing.assert_array_equal(codes, ref_encode(x))
    got = TABLE[codes]
    np.testing.assert_array_equal(
        got,
        [0, 0, 0.25, 0.25, 0.5, 0.5, 0.5, 2, 2, 8, 8, 8, 16, 16, 16, 16, 0, -0.25, -8, -16, 0, 0],
    )


def test_encode_matches_the_reference_on_random_values():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=20000) * np.exp2(rng.uniform(-4, 5, size=20000))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(encode_e3m0(jnp.asarray(x))), ref_encode(x))


def test_stochastic_encoding_matches_the_reference_and_is_unbiased_in_range():
    rng = np.random.default_rng(1)
    x = rng.uniform(-16, 16, size=4096).astype(np.float32)
    u = rng.uniform(size=x.shape).astype(np.float32)
    codes = np.asarray(encode_e3m0(jnp.asarray(x), jnp.asarray(u)))
    np.testing.assert_array_equal(codes, ref_encode(x, u))
    # Averaged over many draws, a value inside [0, 16] comes back as itself.
    value = np.full(200000, 2.7, np.float32)
    draws = np.asarray(
        encode_e3m0(jnp.asarray(value), jax.random.uniform(jax.random.key(0), value.shape))
    )
    assert abs(TABLE[draws].mean() - 2.7) < 0.01


def test_nibble_packing_round_trips_two_codes_per_byte():
    codes = jnp.asarray(np.random.default_rng(2).integers(0, 16, size=(3, 10)), jnp.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(
        np.asarray(packed[0, 0]), int(codes[0, 0]) | int(codes[0, 1]) << 4
    )
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(packed)), np.asarray(codes))


# -- the reducer ------------------------------------------------------------------------------

SHAPES = {"a": (40, 9), "b": (7,), "c": ()}


@pytest.mark.parametrize(("n", "block"), [(4, 16), (8, 8), (4, 256)])
def test_reducer_is_the_reference_compressed_allreduce(n, block):
    rng = np.random.default_rng(n + block)
    steps = 2
    grads = {
        k: (rng.normal(size=(steps, n, *s)) * 10.0 ** rng.uniform(-4, 0)).astype(np.float32)
        for k, s in SHAPES.items()
    }
    outs, state = run_steps(cast_e3m0(block_size=block), grads)
    names = sorted(SHAPES)  # the tree's leaf order
    for t in range(steps):
        xs = [np.concatenate([grads[k][t, i].reshape(-1) for k in names]) for i in range(n)]
        expected = ref_reduce(xs, block)
        for i in range(n):  # every worker gets the same answer
            got = np.concatenate([outs[k][t, i].reshape(-1) for k in names])
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    assert isinstance(state, E3M0State)
    np.testing.assert_array_equal(state.step, np.full(n, steps))


def test_stochastic_reducer_is_keyed_by_seed_and_step_and_unbiased():
    n, block = 4, 32
    rng = np.random.default_rng(5)
    steps = 64
    g = rng.normal(size=(1, n, 100)).astype(np.float32)
    grads = {"a": np.repeat(g, steps, axis=0)}  # the same gradients at every step
    outs, _ = run_steps(cast_e3m0(block_size=block, rounding="stochastic", seed=3), grads)
    again, _ = run_steps(cast_e3m0(block_size=block, rounding="stochastic", seed=3), grads)
    other, _ = run_steps(cast_e3m0(block_size=block, rounding="stochastic", seed=4), grads)
    np.testing.assert_array_equal(outs["a"], again["a"])
    assert not np.array_equal(outs["a"], other["a"])
    assert not np.array_equal(outs["a"][0], outs["a"][1])  # fresh noise each step
    for i in range(1, n):
        np.testing.assert_array_equal(outs["a"][:, i], outs["a"][:, 0])
    mean = g[0].mean(axis=0)
    # Unbiased: the average over steps approaches the mean, well past the nearest error.
    err = np.abs(outs["a"].mean(axis=(0, 1)) - mean).max()
    assert err < 0.25 * np.abs(mean).max()


def test_zero_and_non_finite_blocks():
    n, block = 4, 8
    x = np.zeros((1, n, 16), np.float32)
    x[0, 1, 9] = np.inf  # block 1 holds an inf: its output is not finite, block 0 is zero
    outs, _ = run_steps(cast_e3m0(block_size=block), {"a": x})
    assert np.all(outs["a"][0, :, :8] == 0)
    assert not np.any(np.isfinite(outs["a"][0, :, 8:]))


# -- in a strategy: local SGD with DiLoCo's outer Nesterov ----------------------------------


def linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def test_local_sgd_with_outer_nesterov_matches_the_reference():
    n, period, block, lr_in = 4, 2, 16, 0.05
    rng = np.random.default_rng(7)
    params = {
        "b": rng.normal(size=5).astype(np.float32),
        "w": rng.normal(size=(12, 5)).astype(np.float32),
    }
    batches = [
        {
            "x": rng.normal(size=(16, 12)).astype(np.float32),
            "y": rng.normal(size=(16, 5)).astype(np.float32),
        }
        for _ in range(2 * period)
    ]
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    strategy = ddl.local_sgd(
        linear_loss,
        optax.sgd(lr_in),
        ddl.make_mesh(data=n),
        period=period,
        outer_optimizer=outer,
        reducer=cast_e3m0(block_size=block),
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    got = strategy.params(state)

    # Reference: per-worker plain SGD, the NumPy reduction of Delta, NumPy Nesterov.
    names = sorted(params)
    anchor = {k: v.copy() for k, v in params.items()}
    trace = {k: np.zeros_like(v) for k, v in params.items()}
    grad = jax.jit(jax.grad(linear_loss))
    for r in range(2):
        deltas = []
        for i in range(n):
            theta = {k: jnp.asarray(v) for k, v in anchor.items()}
            for batch in batches[r * period : (r + 1) * period]:
                g = grad(theta, worker_shards(batch, n)[i])
                theta = jax.tree.map(lambda p, g: p - lr_in * g, theta, g)
            deltas.append(
                np.concatenate([(anchor[k] - np.asarray(theta[k])).ravel() for k in names])
            )
        mean = ref_reduce(deltas, block)
        start = 0
        for k in names:
            d = mean[start : start + anchor[k].size].reshape(anchor[k].shape)
            start += anchor[k].size
            trace[k] = d + 0.9 * trace[k]
            anchor[k] = anchor[k] - 0.7 * (d + 0.9 * trace[k])
    for k in names:
        np.testing.assert_allclose(np.asarray(got[k]), anchor[k], rtol=1e-5, atol=1e-6)
    ratio = float(metrics["compression_ratio"])
    d = sum(v.size for v in params.values())
    length = -(-d // (n * block)) * n * block
    np.testing.assert_allclose(ratio, 4 * d / (length / 2 + 4 * length / block), rtol=1e-6)


def test_streaming_diloco_accepts_it():
    n = 4
    rng = np.random.default_rng(8)
    params = {
        "b": rng.normal(size=5).astype(np.float32),
        "w": rng.normal(size=(12, 5)).astype(np.float32),
    }
    batch = {
        "x": rng.normal(size=(16, 12)).astype(np.float32),
        "y": rng.normal(size=(16, 5)).astype(np.float32),
    }
    strategy = ddl.streaming_diloco(
        linear_loss,
        optax.sgd(0.05),
        ddl.make_mesh(data=n),
        period=2,
        fragments=2,
        reducer=cast_e3m0(block_size=16),
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


# -- bytes on the wire --------------------------------------------------------------------------


def test_bytes_sent_are_about_an_eighth_of_a_float32_ring():
    n, d_in, d_out, block = 8, 1024, 64, 256  # no padding
    params = {"w": jnp.zeros((d_in, d_out))}
    batch = {"x": np.zeros((16, d_in), np.float32), "y": np.zeros((16, d_out), np.float32)}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    mesh = ddl.make_mesh(data=n)
    dense_strategy = ddl.data_parallel(
        loss, optax.sgd(0.1), mesh, reducer=ddl.allreduce_mean(algorithm="ring")
    )
    dense = ddl.comm_stats(jax.jit(dense_strategy.step), dense_strategy.init(params), batch)
    strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh, reducer=cast_e3m0(block_size=block))
    state = strategy.init(params)
    program = jax.jit(strategy.step).lower(state, batch).compile()
    ops = collectives(program.as_text())
    assert {op.kind for op in ops} == {"all-to-all", "all-gather", "all-reduce"}
    sent = sum(max(op.sent) * op.count for op in ops)
    d = d_in * d_out
    length = -(-d // (n * block)) * n * block
    metrics = 2 * (n - 1) / n * 4 * 2  # loss and compression_ratio, all-reduced
    payload = 2 * (n - 1) / n * (length / 2 + 4 * length / block)
    np.testing.assert_allclose(sent, payload + metrics, rtol=1e-9)
    ratio = (dense.bytes_per_device - 2 * (n - 1) / n * 4) / (sent - metrics)
    assert 7.7 <= ratio <= 8.0  # 32 / (4 + 32 / 256) = 7.76
    _, out = program(state, batch)
    np.testing.assert_allclose(out["compression_ratio"], ratio, rtol=1e-5)


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: cast_e3m0(block_size=0), r"cast_e3m0: block_size must be an even int >= 2, got 0"),
        (lambda: cast_e3m0(block_size=7), r"cast_e3m0: block_size must be an even int >= 2, got 7"),
        (lambda: cast_e3m0(block_size=8.0), r"cast_e3m0: block_size must be an even int"),
        (lambda: cast_e3m0(block_size=True), r"cast_e3m0: block_size must be an even int"),
        (
            lambda: cast_e3m0(rounding="up"),
            r"cast_e3m0: rounding must be 'nearest' or 'stochastic', got 'up'",
        ),
        (lambda: cast_e3m0(seed=1.5), r"cast_e3m0: seed must be an int, got 1.5"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_axis_must_be_a_name():
    with pytest.raises(TypeError, match="cast_e3m0: axis must be a mesh axis name"):
        cast_e3m0(axis=0)
