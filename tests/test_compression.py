"""Compressing reducers against their definitions: identity settings, error feedback, bytes."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_loss, reference_sgd, train
from flax import nnx
from jax.sharding import PartitionSpec as P
from reducers import reducer_program, run_steps

import ddl_jax as ddl
from ddl_jax._src.core.reducer import PermuteReducer, checks_vma, reducer_metrics
from ddl_jax._src.measure.comm import collectives
from ddl_jax._src.reduce import quantise as quantise_module
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.lowrank import _power_sgd
from ddl_jax._src.reduce.lowrank import power_sgd as power_sgd_from_step_1000
from ddl_jax._src.reduce.quantise import cast, dequantise, qsgd, quantise, sign
from ddl_jax._src.reduce.sparse import threshold, top_k

# These tests check the compressed exchange: they compress from the first step, where
# power_sgd's default, PyTorch's, sends the plain mean for 1,000 steps first.
power_sgd = functools.partial(power_sgd_from_step_1000, start_iter=0)

SHAPES = {"w": (6, 20), "b": (13,)}  # a matrix and a vector; neither divides by 8 x workers


def random_grads(steps: int, n: int, seed: int = 0) -> dict:
    """Per-step, per-worker gradients ``[T, N, ...]``, different on every worker."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(steps, n, *s)).astype(np.float32) for k, s in SHAPES.items()}


def run_reducer(reducer, grads: dict, n: int):
    """Runs ``reducer`` on ``n`` workers (``reducers.run_steps``).

    Returns each worker's sum of the reducer's outputs ``[N, ...]``, its outputs
    ``[T, N, ...]`` and its final state ``[N, ...]``.
    """
    assert jax.tree.leaves(grads)[0].shape[1] == n
    outs, state = run_steps(reducer, grads)
    return jax.tree.map(lambda o: o.sum(0), outs), outs, state


# -- identity settings ----------------------------------------------------------------------

IDENTITY = {
    "cast_float32": lambda: cast(jnp.float32),
    "top_k_ratio_1": lambda: top_k(1.0),
    "power_sgd_full_rank": lambda: power_sgd(16),  # the MLP's matrices are 12x16 and 16x5
}


def test_identity_settings_equal_single_device_training(mlp):
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    for name, reducer in IDENTITY.items():
        strategy = ddl.data_parallel(
            loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), reducer=reducer()
        )
        state, _ = train(strategy, params, batches)
        chex.assert_trees_all_close(
            strategy.params(state), expected, atol=1e-5, rtol=0, custom_message=name
        )


# -- error feedback conserves mass ----------------------------------------------------------


def residuals(name: str, state) -> dict:
    """Each worker's error-feedback residual e_i, ``[N, ...]`` per parameter."""
    if name == "sign":
        return state.residual
    if name == "power_sgd":  # vectors are sent dense and keep no residual
        e = state.residual[0]
        return {"w": e, "b": np.zeros((len(e), *SHAPES["b"]), np.float32)}
    flat = state.residual
    return {"b": flat[:, :13], "w": flat[:, 13:].reshape(-1, *SHAPES["w"])}  # ravel_pytree


def owners_residual(name: str, state) -> dict:
    """sign's second residual e' (of the averaged chunks, on their owners); else zero."""
    if name == "sign":
        # Each worker's owner_residual is zero outside the chunk it owns: summing assembles e'.
        return jax.tree.map(lambda e2: e2.sum(0), state.owner_residual)
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


EF = {
    "sign": lambda: sign(),
    "threshold": lambda: threshold(0.5, capacity=0.05),
    "top_k": lambda: top_k(0.05),
    "power_sgd": lambda: power_sgd(1),
}


@pytest.mark.parametrize("name", sorted(EF))
def test_error_feedback_conserves_mass(name):
    n, steps = 4, 6
    grads = random_grads(steps, n)
    total, outs, state = run_reducer(EF[name](), grads, n)
    raw = jax.tree.map(lambda g: g.sum(0).mean(0), grads)  # mean_i sum_t g_{i,t}
    sent = jax.tree.map(lambda t: t[0], total)
    unsent = jax.tree.map(
        lambda e, e2: e.mean(0) + e2, residuals(name, state), owners_residual(name, state)
    )
    chex.assert_trees_all_close(jax.tree.map(jnp.add, sent, unsent), raw, atol=2e-5, rtol=0)
    # Every worker got the same update, and it is compressed: not the plain mean.
    chex.assert_trees_all_equal(
        total, jax.tree.map(lambda t: jnp.broadcast_to(t[0], t.shape), total)
    )
    assert not np.allclose(outs["w"][0, 0], grads["w"][0].mean(0), atol=1e-3)


@pytest.mark.parametrize("active", [0, 3])
@pytest.mark.parametrize("name", ["sign", "threshold", "top_k"])
def test_error_feedback_conserves_mass_per_worker(name, active):
    """Only worker ``active`` has gradients, so all that arrives is what it transmitted.

    A worker with zero gradients and residual sends nothing, so N times the summed update
    (plus, for sign, N e': its transmissions the owners still hold back) is worker
    ``active``'s transmitted total. For every worker i: transmitted_i + e_i = sum_t g_{i,t}.
    """
    n, steps = 4, 6
    mask = np.arange(n) == active
    grads = jax.tree.map(
        lambda g: g * mask.reshape(1, n, *[1] * (g.ndim - 2)), random_grads(steps, n)
    )
    total, _, state = run_reducer(EF[name](), grads, n)
    arrived = jax.tree.map(lambda t, e2: n * (t[0] + e2), total, owners_residual(name, state))
    transmitted = jax.tree.map(lambda a: np.where(mask.reshape(n, *[1] * a.ndim), a, 0), arrived)
    chex.assert_trees_all_close(  # [N, ...]: worker by worker
        jax.tree.map(jnp.add, transmitted, residuals(name, state)),
        jax.tree.map(lambda g: g.sum(0), grads),
        atol=1e-4,
        rtol=0,
    )


# -- sign: the documented scale ---------------------------------------------------------------


def sign_reference(xs: list[np.ndarray], n: int, padding: str = "deepspeed") -> np.ndarray:
    """One step of the docstring's rule from zero residuals, for one tensor, in numpy.

    ``"deepspeed"``: the tensor zero-padded to a multiple of N lcm(N, 8), the padding
    counted in every scale; ``"none"``: chunks of ``8 ceil(d / 8N)`` entries, the padding
    past the tensor's end left out."""

    def compress(x):
        return np.linalg.norm(x) / np.sqrt(x.size) * np.where(x >= 0, 1.0, -1.0)

    size = xs[0].size
    if padding == "deepspeed":
        padded = size + (-size) % (n * np.lcm(n, 8))
        xs = [np.concatenate([x.ravel(), np.zeros(padded - size)]) for x in xs]
    y = np.mean([compress(x.ravel()) for x in xs], axis=0)
    chunk = y.size // n if padding == "deepspeed" else -(-y.size // (8 * n)) * 8
    chunks = [y[j * chunk : (j + 1) * chunk] for j in range(n)]
    out = np.concatenate([compress(c) for c in chunks if c.size])  # "none": owners past d
    return out[:size]


@pytest.mark.parametrize("padding", ["deepspeed", "none"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_sign_is_the_scaled_sign_averaged_by_owners(n, padding):
    grads = random_grads(1, n, seed=3)
    _, outs, _ = run_reducer(sign(padding=padding), grads, n)
    for k in SHAPES:
        expected = sign_reference([grads[k][0, i] for i in range(n)], n, padding)
        np.testing.assert_allclose(outs[k][0, 0].ravel(), expected, rtol=1e-6)
    if n == 1:  # one worker: exactly (||x||_2 / sqrt(d)) sign(x), d = 120 = 15 x 8
        x = grads["w"][0, 0]
        scale = np.linalg.norm(x) / np.sqrt(x.size)
        np.testing.assert_allclose(outs["w"][0, 0], scale * np.sign(x), rtol=1e-6)


@pytest.mark.parametrize("padding", ["deepspeed", "none"])
def test_sign_sends_the_signs_of_the_padded_tensors(mlp, padding):
    """The compiled step's bytes and ``compression_ratio``: with DeepSpeed's padding every
    tensor's signs padded to a multiple of N lcm(N, 8) travel (N = 6: 144 entries), with
    ``padding="none"`` to a multiple of 8 N (48)."""
    loss_fn, params = mlp
    n = 6
    [batch] = make_batches(1, 48)
    reducer = sign(padding=padding)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), reducer=reducer)
    state = strategy.init(params)
    compiled = jax.jit(strategy.step).lower(state, batch).compile()
    sent = sum(max(op.sent) * op.count for op in collectives(compiled.as_text()))
    _, metrics = compiled(state, batch)
    ring = 2 * (n - 1) / n
    sent -= ring * 4 * 2  # the all-reduce of loss and compression_ratio
    multiple = 144 if padding == "deepspeed" else 48
    sizes = [x.size for x in jax.tree.leaves(params)]
    signs = sum(-(-d // multiple) * multiple // 8 for d in sizes)
    np.testing.assert_allclose(sent, ring * (signs + 4 * n * len(sizes)), rtol=1e-6)
    dense = ring * 4 * sum(sizes)
    np.testing.assert_allclose(metrics["compression_ratio"], dense / sent, rtol=1e-5)


def test_bit_packing_round_trips():
    bits = np.random.default_rng(0).integers(0, 2, size=(3, 64)).astype(bool)
    packed = wire.pack_bits(jnp.asarray(bits))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 8)
    assert int(packed[0, 0]) == sum(int(b) << j for j, b in enumerate(bits[0, :8]))
    np.testing.assert_array_equal(wire.unpack_bits(packed), bits)


# -- QSGD: unbiased, keyed --------------------------------------------------------------------


def qsgd_variance_factor(d: int, s: int) -> float:
    """Alistarh et al., Lemma 3.1: E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 per bucket."""
    return min(d / s**2, np.sqrt(d) / s)


@pytest.mark.parametrize("d, s", [(64, 1), (16, 8)])  # either side of the min
def test_qsgd_quantiser_is_unbiased_within_its_variance_bound(d, s):
    samples = 20_000
    v = jnp.asarray(np.random.default_rng(5).normal(size=(3, d)), jnp.float32)  # 3 buckets
    keys = jax.random.split(jax.random.key(0), samples)
    draws = np.asarray(jax.vmap(lambda key: dequantise(*quantise(v, s, key), s))(keys))
    bound = qsgd_variance_factor(d, s) * np.sum(np.asarray(v) ** 2, axis=-1)  # per bucket
    variance = np.mean(np.sum((draws - v) ** 2, axis=-1), axis=0)
    assert np.all(variance <= bound), (variance, bound)
    # Unbiased: the mean of K independent draws has E||mean - v||^2 <= bound / K. The error
    # sums d independent entries, so it concentrates: twice its expected bound is ample.
    error = np.sum((draws.mean(axis=0) - v) ** 2, axis=-1)
    assert np.all(error <= 2 * bound / samples), (error, bound / samples)


@pytest.mark.parametrize("scale", [3e19, 1e-20])
def test_qsgd_quantises_entries_whose_squares_leave_float32(scale):
    """Buckets of entries past 1.8e19 (whose squares overflow float32) or under 1e-19
    (underflow): their norms, and so their dequantised values, keep their scale."""
    v = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64)) * scale, jnp.float32)
    q, norms = quantise(v, 127, jax.random.key(0))
    np.testing.assert_allclose(norms, np.linalg.norm(np.asarray(v, np.float64), axis=-1), rtol=1e-5)
    back = dequantise(q, norms, 127)
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back, v, atol=float(norms.max()) / 127 * 1.01)


@pytest.mark.parametrize("scale", ["l2", "max"])
def test_qsgd_never_sends_a_level_past_s(scale):
    """A bucket's top entry sits exactly on level s; s + u rounds up to s + 1 in float32
    for u within 2**-18 of 1 (a few draws in 10**6 at s = 127). Negative, that is -128 in
    int8: an entry sent larger than the bucket's scale, the estimate no longer unbiased."""
    q, _ = quantise(-jnp.ones((1 << 22, 1), jnp.float32), 127, jax.random.key(0), scale)
    np.testing.assert_array_equal(np.unique(np.asarray(q)), [-127])


def ref_qsgd_inf(v: np.ndarray, s: int, u: np.ndarray) -> np.ndarray:
    """QSGDinf as the NUQSGD code's ``qdqLinf`` (fartashf/nuqsgd, ``nuq/quantize.py``)
    scales a bucket, on QSGD's grid of 0..s levels a sign: with the uniforms u,
    ``M sign(v_j) floor(s |v_j| / M + u_j) / s``, M the bucket's largest magnitude."""
    m = np.abs(v).max(axis=-1, keepdims=True)
    safe = np.where(m > 0, m, 1.0)
    return m * np.sign(v) * np.floor(s * np.abs(v) / safe + u) / s


def test_qsgd_max_scale_matches_the_reference_draw_for_draw():
    v = np.random.default_rng(2).normal(size=(5, 32)).astype(np.float32)
    v[3] = 0.0  # an empty bucket stays zero
    key, s = jax.random.key(3), 4
    q, norms = quantise(jnp.asarray(v), s, key, "max")
    u = np.asarray(jax.random.uniform(key, v.shape))
    np.testing.assert_allclose(norms, np.abs(v).max(axis=-1))
    np.testing.assert_allclose(dequantise(q, norms, s), ref_qsgd_inf(v, s, u), rtol=1e-6)
    assert int(np.abs(np.asarray(q)).max()) == s  # the largest entry lands on the top level


def test_qsgd_max_scale_is_unbiased_and_uses_less_variance_than_the_2_norm():
    samples, d, s = 20_000, 64, 2
    v = jnp.asarray(np.random.default_rng(5).normal(size=(3, d)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), samples)

    def draws(scale):
        return np.asarray(jax.vmap(lambda k: dequantise(*quantise(v, s, k, scale), s))(keys))

    l2, inf = draws("l2"), draws("max")
    # Each entry rounds between neighbours M / s apart: variance at most (M / s)^2 / 4.
    bound = d * np.abs(np.asarray(v)).max(axis=-1) ** 2 / (4 * s**2)
    variance = {
        k: np.mean(np.sum((x - v) ** 2, axis=-1), axis=0) for k, x in (("l2", l2), ("max", inf))
    }
    assert np.all(variance["max"] <= bound), (variance, bound)
    assert np.all(variance["max"] < 0.5 * variance["l2"]), variance
    error = np.sum((inf.mean(axis=0) - v) ** 2, axis=-1)  # unbiased, as above
    assert np.all(error <= 2 * bound / samples), (error, bound / samples)


@pytest.mark.parametrize("scale", ["l2", "max"])
def test_qsgd_reducer_is_unbiased_within_its_variance_bound(scale):
    n, steps, levels, bucket = 4, 400, 2, 16
    one = random_grads(1, n, seed=1)
    grads = jax.tree.map(lambda g: np.broadcast_to(g, (steps, *g.shape[1:])), one)
    total, _, _ = run_reducer(qsgd(levels, bucket_size=bucket, scale=scale), grads, n)
    # g = Q(y), y = (1/N) sum_i Q(g_i), independent noise on each worker and on the owners:
    # E||g - mean||^2 = E||Q(y) - y||^2 + E||y - mean||^2
    #                <= beta E||y||^2 + beta/N^2 sum_i ||g_i||^2
    #                <= beta ||mean||^2 + beta (1 + beta)/N^2 sum_i ||g_i||^2.
    # The max scale's beta, d / (4 s^2) (a bucket's variance is at most d M^2 / (4 s^2) and
    # M^2 <= ||v||^2), is 1 here, under the 2-norm's 2: the same bound holds.
    beta = qsgd_variance_factor(bucket, levels)
    mean_sq = sum(float(np.sum(g[0].mean(0) ** 2)) for g in one.values())
    workers_sq = sum(float(np.sum(g[0] ** 2)) for g in one.values())
    variance = beta * mean_sq + beta * (1 + beta) / n**2 * workers_sq
    error = sum(float(np.sum((total[k][0] / steps - one[k][0].mean(0)) ** 2)) for k in SHAPES)
    assert error <= 2 * variance / steps, (error, variance / steps)  # as above


@pytest.mark.parametrize("levels", [1, 3, 7])
def test_qsgd_packs_its_levels_losslessly(monkeypatch, levels):
    """Levels packed 4 or 2 to a byte give the very update sent as int8, and a half or a
    quarter of the codes' bytes (the bucket's norms stay 4 bytes)."""
    n, steps, bucket = 4, 2, 5  # 5 entries a bucket: the packing pads each chunk's last byte
    grads = random_grads(steps, n, seed=7)
    _, packed, state = run_reducer(qsgd(levels, bucket_size=bucket), grads, n)
    monkeypatch.setattr(quantise_module, "code_bits", lambda levels: 8)
    _, unpacked, int8_state = run_reducer(qsgd(levels, bucket_size=bucket), grads, n)
    chex.assert_trees_all_equal(packed, unpacked)
    # bytes a device sends, up to the common factor 2 (N - 1) / N: codes and norms
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    chunk = -(-size // (n * bucket)) * bucket  # an owner's entries, in whole buckets
    norms = 4 * n * chunk // bucket
    packed = n * -(-chunk * (2 if levels == 1 else 4) // 8) + norms
    int8 = n * chunk + norms
    ratio = float(int8_state.compression_ratio[0]) / float(state.compression_ratio[0])
    assert ratio == pytest.approx(packed / int8, rel=1e-6)


def test_qsgd_noise_is_keyed_by_seed_and_step():
    n, steps = 2, 2
    one = random_grads(1, n, seed=4)
    grads = jax.tree.map(lambda g: np.broadcast_to(g, (steps, *g.shape[1:])), one)
    _, first, _ = run_reducer(qsgd(2, seed=0), grads, n)
    _, again, _ = run_reducer(qsgd(2, seed=0), grads, n)
    _, other, _ = run_reducer(qsgd(2, seed=1), grads, n)
    chex.assert_trees_all_equal(first, again)
    assert not np.array_equal(first["w"], other["w"])
    assert not np.array_equal(first["w"][0], first["w"][1])  # same gradient, fresh noise


# -- top_k: DGC's rule ------------------------------------------------------------------------


def dgc_reference(grads: dict, n: int, ratio: float, m: float, clip: float) -> list[np.ndarray]:
    """top_k's docstring rule in numpy, on the flattened gradient (ravel_pytree's order)."""
    flat = np.concatenate([grads["b"], grads["w"].reshape(*grads["w"].shape[:2], -1)], axis=2)
    steps, _, d = flat.shape
    k = int(np.ceil(ratio * d))
    u, v, outs = np.zeros((n, d)), np.zeros((n, d)), []
    for t in range(steps):
        out = np.zeros(d)
        for i in range(n):
            g = flat[t, i] * min(1.0, clip / np.linalg.norm(flat[t, i]))
            u[i] = m * u[i] + g
            v[i] = v[i] + u[i]
            top = np.argsort(-np.abs(v[i]))[:k]
            out[top] += v[i, top] / n
            v[i, top], u[i, top] = 0.0, 0.0
        outs.append(out)
    return outs


def test_top_k_follows_dgc():
    n, steps = 2, 5
    grads = random_grads(steps, n, seed=2)
    # One selection over the flattened model, the vector included: the named old behaviour
    # (the authors' per-tensor default is tests/test_top_k_reference.py's).
    # Exact top-k (sample_ratio=1), as dgc_reference selects.
    reducer = top_k(
        0.1, momentum=0.9, clip_norm=3.0, scope="model", compress_1d=True, sample_ratio=1.0
    )
    _, outs, _ = run_reducer(reducer, grads, n)
    expected = dgc_reference(grads, n, 0.1, 0.9, 3.0)
    for t in range(steps):
        got = np.concatenate([outs["b"][t, 0], outs["w"][t, 0].ravel()])
        np.testing.assert_allclose(got, expected[t], atol=1e-5)


def test_top_k_warmup_phases_send_fewer_bytes_each(mlp):
    loss_fn, params = mlp
    n = 8
    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), reducer=top_k(0.01, warmup_steps=8)
    )
    batch = make_batches(1, 32)[0]
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    # k entries per matrix (the authors' per-tensor selection); vectors are all-reduced
    # outside the phases' branches.
    sizes = [x.size for x in jax.tree.leaves(params) if x.ndim > 1]
    ks = [sum(int(np.ceil(r * s)) for s in sizes) for r in (0.25, 0.25**2, 0.25**3, 0.01, 0.01)]
    assert sorted(stats.branches.values()) == sorted((n - 1) * 8 * k for k in ks)
    state = strategy.init(params)
    step = jax.jit(strategy.step)
    ratios = []
    for b in make_batches(10, 32):
        state, metrics = step(state, b)
        ratios.append(float(metrics["compression_ratio"]))
    assert ratios[0] < ratios[2] < ratios[4] < ratios[6] <= ratios[8] == ratios[9]


# -- bytes on the wire ------------------------------------------------------------------------


def test_wire_bytes_against_a_dense_fp32_ring():
    """Bytes per device from the compiled step, the MLP 784-1024-1024-10 on N=8 workers."""
    model = ddl.models.MLP(784, [1024, 1024], 10, rngs=nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(model, mlp_loss)
    batch = {"x": np.zeros((64, 784), np.float32), "y": np.zeros(64, np.int32)}
    mesh = ddl.make_mesh(data=8)

    def sent(reducer):
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        return ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch).bytes_per_device

    dense = sent(ddl.allreduce_mean(algorithm="ring"))
    assert 1.99 <= dense / sent(cast(jnp.bfloat16)) <= 2.0  # the 4-byte loss rides along
    assert dense / sent(sign()) >= 25
    assert dense / sent(top_k(0.001)) >= 100
    assert dense / sent(power_sgd(4)) >= 50


@pytest.mark.parametrize(
    "reducer",
    [
        lambda: cast(jnp.bfloat16),
        sign,
        lambda: sign(padding="none"),
        lambda: threshold(0.01),
        lambda: top_k(0.01),
        lambda: qsgd(4),
        lambda: qsgd(1),  # 2 bits a level
        lambda: qsgd(8),  # 8 bits
        lambda: qsgd(7, bucket_size=3),  # 4 bits, a chunk's last byte half padding
        lambda: power_sgd(2),
    ],
)
def test_compression_ratio_metric_matches_the_compiled_program(mlp, reducer):
    loss_fn, params = mlp
    n = 8
    [batch] = make_batches(1, 32)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), reducer=reducer())
    state = strategy.init(params)
    compiled = jax.jit(strategy.step).lower(state, batch).compile()
    sent = sum(max(op.sent) * op.count for op in collectives(compiled.as_text()))
    _, metrics = compiled(state, batch)
    metrics_bytes = 2 * (n - 1) / n * 4 * 2  # the all-reduce of loss and compression_ratio
    dense = 2 * (n - 1) / n * 4 * sum(x.size for x in jax.tree.leaves(params))
    np.testing.assert_allclose(
        metrics["compression_ratio"], dense / (sent - metrics_bytes), rtol=1e-5
    )


def test_power_sgd_views_a_conv_kernel_as_its_inputs_by_its_outputs():
    """A Flax conv kernel [h, w, in, out] is the (h w in) x out matrix (Vogels et al.)."""
    n, rank = 4, 4
    h, w, c_in, c_out = 3, 3, 16, 32
    rng = np.random.default_rng(6)
    grads = {
        "kernel": rng.normal(size=(1, n, h, w, c_in, c_out)).astype(np.float32),
        "bias": rng.normal(size=(1, n, c_out)).astype(np.float32),
    }
    program, state, placed = reducer_program(power_sgd(rank), grads)
    rows, cols = h * w * c_in, c_out
    # P [rows, r] and Q [cols, r] travel instead of the kernel; the bias travels dense.
    sent = rank * (rows + cols) + c_out
    dense = rows * cols + c_out
    stats = ddl.comm_stats(program, state, placed)
    assert stats.bytes_per_device == pytest.approx(2 * (n - 1) / n * 4 * sent)
    state, outs = jax.tree.map(np.asarray, program(state, placed))
    assert state.compression_ratio[0] == pytest.approx(dense / sent)
    update = outs["kernel"][0, 0].reshape(rows, cols)
    assert np.linalg.matrix_rank(update) == rank
    np.testing.assert_allclose(outs["bias"][0, 0], grads["bias"][0].mean(0), rtol=1e-6)


# -- local SGD's outer exchange ---------------------------------------------------------------


def test_a_compressor_reduces_local_sgds_pseudo_gradient(mlp):
    # H = 1 with SGD is synchronous SGD: the compressed exchange at ratio 1 must keep it so.
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    strategy = ddl.local_sgd(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), period=1, reducer=top_k(1.0)
    )
    state, metrics = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    # ratio 1 compresses nothing (the DGC authors' compress_ratio < 1.0): a dense all-reduce.
    assert float(metrics["compression_ratio"]) == 1.0
    assert state.reducer_state.residual.shape[0] == 8  # one residual per worker


@pytest.mark.parametrize("reducer", [lambda: power_sgd(16), lambda: cast(jnp.float32)])
def test_a_shared_state_survives_local_sgds_synchronisation_branch(mlp, reducer):
    # PowerSGD's Q and every compression ratio come out of a collective the same on every
    # worker; as per-worker state they must keep the type they came in with.
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    strategy = ddl.local_sgd(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), period=1, reducer=reducer()
    )
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


# -- plain optax transforms --------------------------------------------------------------------

COMPRESSORS = {
    "cast": lambda: cast(jnp.bfloat16),
    "sign": sign,
    "qsgd": lambda: qsgd(4),
    "threshold": lambda: threshold(0.01),
    "top_k": lambda: top_k(0.5),
    "top_k_dgc": lambda: top_k(0.1, momentum=0.5, clip_norm=1.0, warmup_steps=2),
    "power_sgd": lambda: power_sgd(2),
}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_a_non_finite_gradient_on_one_worker_reaches_every_workers_update(name, bad):
    """As a dense mean would: one worker's NaN or inf makes every worker's update
    non-finite, so that fit stops on it, or skips the step (``skip_nonfinite``). Kept in an
    error-feedback residual instead, it trained on silently: the threshold quantiser
    never sent a NaN entry (NaN >= tau is false) and sent an inf one as +-tau every step."""
    grads = random_grads(2, 4)
    grads["w"][0, 2, 1, 1] = bad  # step 0, worker 2
    _, outs, _ = run_reducer(COMPRESSORS[name](), grads, 4)
    for worker in range(4):
        update = [leaf[0, worker] for leaf in outs.values()]
        assert not all(np.isfinite(u).all() for u in update), (name, worker)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_a_compressor_in_optax_chain_trains_like_the_unchecked_program(mlp, name):
    """``optax.chain(clip, compressor)`` runs with shard_map's replication check, and equals
    the same chain run unchecked (``check_vma=False``, as a ``PermuteReducer``)."""
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    mesh = ddl.make_mesh(data=8)
    assert type(COMPRESSORS[name]()) is optax.GradientTransformation  # no mark

    def trained(reducer):
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        state, metrics = train(strategy, params, batches)
        return strategy.params(state), metrics

    chained = optax.chain(optax.clip_by_global_norm(1.0), COMPRESSORS[name]())
    assert checks_vma(chained)
    got, metrics = trained(chained)
    unchecked = PermuteReducer(*optax.chain(optax.clip_by_global_norm(1.0), COMPRESSORS[name]()))
    want, want_metrics = trained(unchecked)
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal(metrics, want_metrics)
    assert set(metrics) == {"loss", "compression_ratio"}


def test_optax_chain_of_top_k_equals_ddl_chain(mlp):
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    mesh = ddl.make_mesh(data=8)
    results = []
    for chain in (optax.chain, ddl.chain):
        reducer = chain(optax.clip_by_global_norm(1.0), ddl.compression.top_k(0.5))
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        state, metrics = train(strategy, params, batches)
        results.append((strategy.params(state), metrics))
    chex.assert_trees_all_equal(*results)
    assert np.isfinite(float(results[0][1]["loss"]))


def test_power_sgd_refuses_a_tree_without_a_matrix():
    vectors = {"b": jnp.zeros(4), "scale": jnp.ones(())}
    with pytest.raises(ValueError, match=r"power_sgd: no parameter is a matrix .*\(4,\), \(\)"):
        power_sgd(2).init(vectors)
    with pytest.raises(ValueError, match="power_sgd: no parameter is a matrix"):
        optax.chain(optax.clip(1.0), power_sgd(2)).init(vectors)
    power_sgd(2).init({**vectors, "w": jnp.zeros((3, 4))})  # one matrix is enough


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: top_k(0.0), "top_k: ratio must be a finite real number > 0, got 0.0"),
        (lambda: top_k(1.5), "top_k: ratio must be a finite real number <= 1, got 1.5"),
        (lambda: top_k(0.1, momentum=1.0), "momentum must be a finite real number < 1, got 1.0"),
        (lambda: top_k(0.1, momentum=-0.5), "momentum must be a finite real number >= 0"),
        (lambda: top_k(0.1, warmup_steps=-1), "warmup_steps must be an int >= 0, got -1"),
        (lambda: top_k(0.1, warmup_steps=2.0), "warmup_steps must be an int >= 0, got 2.0"),
        (
            lambda: top_k(0.1, clip_norm=0),
            r"clip_norm \(or None\) must be a finite real number > 0, got 0",
        ),
        (lambda: top_k(float("nan")), "ratio must be a finite real number > 0, got nan"),
        (lambda: top_k(True), "ratio must be a finite real number > 0, got True"),
        (lambda: threshold(-0.1), "threshold: tau must be a finite real number > 0, got -0.1"),
        (lambda: threshold(float("inf")), "tau must be a finite real number > 0, got inf"),
        (lambda: threshold(float("nan")), "tau must be a finite real number > 0, got nan"),
        (lambda: threshold(0.1, capacity=2), "capacity must be a finite real number <= 1, got 2"),
        (lambda: power_sgd(0), "power_sgd: rank must be an int >= 1, got 0"),
        (lambda: power_sgd(2.0), "power_sgd: rank must be an int >= 1, got 2.0"),
        (lambda: power_sgd(np.int64(0)), "power_sgd: rank must be an int >= 1"),
        (lambda: power_sgd(2, seed=1.5), "power_sgd: seed must be an int, got 1.5"),
        (
            lambda: qsgd(0),
            r"qsgd: levels \(at most 8 bits on the wire\) must be an int >= 1 and <= 127",
        ),
        (lambda: qsgd(4.0), "qsgd: levels .* must be an int >= 1 and <= 127, got 4.0"),
        (lambda: qsgd(200), "levels .* must be an int >= 1 and <= 127, got 200"),
        (lambda: qsgd(4, bucket_size=0), "qsgd: bucket_size must be an int >= 1, got 0"),
        (lambda: qsgd(4, seed=True), "qsgd: seed must be an int, got True"),
        (lambda: qsgd(4, scale="inf"), r"qsgd: scale must be one of \('l2', 'max'\), got 'inf'"),
        (
            lambda: ddl.compression.scatter_qsgd(4, scale=None),
            "scatter_qsgd: scale must be one of .*, got None",
        ),
        (lambda: sign(padding="DeepSpeed"), "sign: padding must be 'deepspeed' or 'none', got"),
        (lambda: sign(padding=None), "sign: padding must be 'deepspeed' or 'none', got None"),
        (lambda: cast(jnp.int8), "dtype must be a floating dtype of at most 4 bytes"),
        (lambda: cast(jnp.float64), "dtype must be a floating dtype of at most 4 bytes"),
        (lambda: cast(jnp.float8_e4m3fn), "cast: dtype float8_e4m3fn is 8 bits: .*0.002.*qsgd"),
        (
            lambda: ddl.compression.scatter_cast(jnp.float8_e5m2),
            "scatter_cast: dtype float8_e5m2 is 8 bits: .*scatter_qsgd",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_reducer_in_the_wrong_place_or_that_does_not_average_is_named(mlp):
    """A reducer chained into optimizer= reduced the reduced gradient again (top_k of the
    mean, not DGC), or made local SGD synchronous every step, silently; a scatter reducer
    (FSDP's) given to an all-reducing strategy failed deep inside, or, in ddl.chain with a
    ring, broadcast a shard's mean onto the whole parameter."""
    loss_fn, _ = mlp
    mesh = ddl.make_mesh(data=8)
    for build in (
        lambda: ddl.data_parallel(loss_fn, optax.chain(top_k(0.5), optax.sgd(0.1)), mesh),
        lambda: ddl.local_sgd(
            loss_fn, optax.chain(ddl.allreduce_mean(), optax.sgd(0.1)), mesh, period=4
        ),
        lambda: ddl.fsdp(loss_fn, optax.chain(ddl.allreduce_mean(), optax.sgd(0.1)), mesh),
    ):
        with pytest.raises(ValueError, match=r"optimizer communicates over \['data'\].*reducer="):
            build()
    scatter = ddl.compression.scatter_cast(jnp.bfloat16)
    for build in (
        lambda: ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=scatter),
        lambda: ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=2, reducer=scatter),
    ):
        with pytest.raises(ValueError, match="reducer: a scatter reducer .* for ddl.fsdp"):
            build()
    # tensor_parallel takes no compressor: the message does not send one there
    with pytest.raises(ValueError, match=r"allreduce_mean\(\), or where it takes one \(not tensor"):
        ddl.tensor_parallel(loss_fn, optax.sgd(0.1), mesh, specs=P(), reducer=scatter)
    with pytest.raises(ValueError, match="chain: a scatter reducer"):
        ddl.chain(scatter, ddl.allreduce_mean(algorithm="ring"))
    # local SGD's reducer that does not average (JAX's "Unsupported pcast" before; with
    # several workers a device, vmap's "out_axes is None")
    params, batch, clip = mlp[1], make_batches(1, 16)[0], optax.clip(1.0)
    for strategy in (
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1, reducer=clip),
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1, workers=16, reducer=lambda _: clip),
    ):
        with pytest.raises(ValueError, match="A reducer must average over the workers"):
            jax.jit(strategy.step)(strategy.init(params), batch)


def test_numpy_scalars_are_arguments_like_python_numbers():
    grads = random_grads(1, 2, seed=7)
    numpy_top_k = top_k(np.float32(0.25), momentum=np.float64(0.5), warmup_steps=np.int64(4))
    numpy_qsgd = qsgd(np.int32(4), bucket_size=np.int64(16), seed=np.int64(2))
    pairs = [
        (numpy_top_k, top_k(float(np.float32(0.25)), momentum=0.5, warmup_steps=4)),
        (threshold(np.float32(0.5), capacity=np.float64(0.25)), threshold(0.5, capacity=0.25)),
        (power_sgd(np.int64(4), seed=np.int32(1)), power_sgd(4, seed=1)),
        (numpy_qsgd, qsgd(4, bucket_size=16, seed=2)),
    ]
    for numpy_args, python_args in pairs:  # the same program, constants included
        program, state, placed = reducer_program(numpy_args, grads)
        expected, state_py, _ = reducer_program(python_args, grads)
        chex.assert_trees_all_equal(state, state_py)
        assert program.lower(state, placed).as_text() == expected.lower(state, placed).as_text()


def test_axis_must_be_a_name():
    with pytest.raises(TypeError, match="axis must be a mesh axis name"):
        sign(axis=0)


def test_reducer_metrics_finds_the_compressor_in_a_chain():
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    chained = optax.chain(optax.clip_by_global_norm(1.0), top_k(0.1))
    assert set(reducer_metrics(chained.init(params))) == {"compression_ratio"}
    assert reducer_metrics(ddl.allreduce_mean().init(params)) == {}
    assert reducer_metrics(optax.chain(optax.clip(1.0), sign()).init(params)) == {
        "compression_ratio": 1.0
    }
    with pytest.raises(ValueError, match="several compression_ratio fields"):
        reducer_metrics(optax.chain(cast(), top_k(0.1)).init(params))


# -- power_sgd's options (PyTorch's powerSGD_hook) --------------------------------------------


def ring_bytes(entries: int, n: int) -> float:
    """Bytes a device sends all-reducing ``entries`` float32 numbers over ``n`` workers."""
    return 2 * (n - 1) / n * 4 * entries


def rank_r_step(g: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One power iteration on the matrix ``g`` from ``q``: the update ``P Q^T`` and new ``Q``."""
    p = np.linalg.qr(g @ q)[0]
    q = g.T @ p
    return p @ q.T, q


def test_power_sgd_by_default_sends_the_plain_mean_first_as_pytorch_does():
    """PyTorch's start_powerSGD_iter, 1000 by default: the first steps are plain."""
    n, steps = 4, 3
    grads = random_grads(steps, n, seed=8)
    _, outs, state = run_reducer(power_sgd_from_step_1000(1), grads, n)
    _, plain, _ = run_reducer(ddl.allreduce_mean(), grads, n)
    for k in SHAPES:
        np.testing.assert_array_equal(outs[k], plain[k])
    np.testing.assert_array_equal(state.step, steps)


def test_power_sgd_start_iter_sends_the_plain_mean_first():
    n, steps, start = 4, 5, 2
    grads = random_grads(steps, n, seed=8)
    _, outs, state = run_reducer(power_sgd(1, start_iter=start), grads, n)
    _, plain, _ = run_reducer(ddl.allreduce_mean(), grads, n)
    later = jax.tree.map(lambda g: g[start:], grads)
    _, fresh, fresh_state = run_reducer(power_sgd(1), later, n)
    for k in SHAPES:
        np.testing.assert_array_equal(outs[k][:start], plain[k][:start])
        np.testing.assert_allclose(outs[k][start:], fresh[k], rtol=1e-6, atol=1e-6)
    assert not np.allclose(outs["w"][start:], plain["w"][start:], atol=1e-3)
    np.testing.assert_array_equal(state.step, steps)
    np.testing.assert_allclose(state.residual[0], fresh_state.residual[0], atol=1e-6)
    # One program holds both exchanges, each charged as a branch (per step of the scan).
    program, init, placed = reducer_program(power_sgd(1, start_iter=start), grads)
    branches = ddl.comm_stats(program, init, placed).branches
    sent = 1 * sum(SHAPES["w"]) + SHAPES["b"][0]
    dense = sum(int(np.prod(s)) for s in SHAPES.values())
    assert sorted(branches.values()) == [steps * ring_bytes(sent, n), steps * ring_bytes(dense, n)]


def test_power_sgd_takes_float64_gradients_under_x64():
    """Its factors are float32 whatever the gradients' dtype: under x64 a float64 Q made
    the plain and compressed phases' branches disagree (a ``TypeError`` in ``lax.cond``)."""
    n, steps, start = 4, 3, 2
    with jax.enable_x64():
        grads = jax.tree.map(lambda g: g.astype(np.float64), random_grads(steps, n, seed=8))
        _, outs, _ = run_reducer(power_sgd(1, start_iter=start), grads, n)
        _, plain, _ = run_reducer(ddl.allreduce_mean(), grads, n)
    for k in SHAPES:
        assert outs[k].dtype == np.float64
        np.testing.assert_array_equal(outs[k][:start], plain[k][:start])
        assert np.all(np.isfinite(outs[k]))


def test_power_sgd_start_iter_reports_a_dense_ratio_until_it_compresses(mlp):
    loss_fn, params = mlp
    reducer = power_sgd(2, start_iter=2)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), reducer=reducer)
    state = strategy.init(params)
    step = jax.jit(strategy.step)
    ratios = []
    for batch in make_batches(4, 32):
        state, metrics = step(state, batch)
        ratios.append(float(metrics["compression_ratio"]))
    assert ratios[0] == ratios[1] == 1.0
    assert ratios[2] == ratios[3] > 1.0


def test_power_sgd_min_compression_rate_sends_a_matrix_dense_unless_its_factors_win():
    """A 10 x 32 kernel at rank 8: factors of 8 (10 + 32) = 336 entries against 320."""
    n = 4
    rng = np.random.default_rng(9)
    grads = {"w": rng.normal(size=(1, n, 10, 32)).astype(np.float32)}

    def sent(reducer):
        program, state, placed = reducer_program(reducer, grads)
        return ddl.comm_stats(program, state, placed).bytes_per_device

    assert sent(power_sgd(8)) == pytest.approx(ring_bytes(320, n))  # PyTorch's default, 2
    assert sent(power_sgd(8, min_compression_rate=0)) == pytest.approx(ring_bytes(336, n))
    assert sent(power_sgd(2)) == pytest.approx(ring_bytes(84, n))  # 84 * 2 < 320
    # Sent dense: the exact mean, no residual or Q kept for it.
    _, outs, state = run_reducer(power_sgd(8), grads, n)
    np.testing.assert_allclose(outs["w"][0, 0], grads["w"][0].mean(0), rtol=1e-6, atol=1e-7)
    assert state.residual == () and state.q == ()
    assert float(state.compression_ratio[0]) == 1.0


def test_power_sgd_never_sends_more_than_dense_for_small_layers():
    n = 4
    shapes = {"a": (3, 4), "b": (10, 32), "c": (16, 5), "d": (12, 16), "e": (64, 8)}
    shapes |= {"conv": (3, 3, 2, 8), "bias": (7,)}
    rng = np.random.default_rng(10)
    grads = {k: rng.normal(size=(1, n, *s)).astype(np.float32) for k, s in shapes.items()}
    dense = sum(int(np.prod(s)) for s in shapes.values())

    def expected(rank):  # PyTorch's rule, written out
        entries = 0
        for s in shapes.values():
            size = int(np.prod(s))
            if len(s) < 2:
                entries += size
                continue
            a, b = sorted((size // s[-1], s[-1]))
            r = min(rank, a)
            entries += r * (a + b) if r * (a + b) * 2.0 < size else size
        return entries

    for rank in (1, 2):
        program, state, placed = reducer_program(power_sgd(rank), grads)
        sent = ddl.comm_stats(program, state, placed).bytes_per_device
        assert sent == pytest.approx(ring_bytes(expected(rank), n))
        assert sent <= ring_bytes(dense, n)
    assert expected(1) < expected(2) < expected(4) == dense  # rank 4: nothing is worth it


def test_power_sgd_without_error_feedback_approximates_the_mean_gradient_afresh():
    n, steps, rank = 4, 4, 2
    grads = random_grads(steps, n, seed=11)
    reducer = power_sgd(rank, use_error_feedback=False)
    q = np.asarray(reducer.init({k: jnp.zeros(s) for k, s in SHAPES.items()}).q[0])
    _, outs, state = run_reducer(reducer, grads, n)
    assert state.residual == ()  # no residual leaves: the state is Q, the step and the ratio
    assert len(jax.tree.leaves(state)) == 3
    for t in range(steps):
        # the kernel is [6 in, 20 out]: the outputs-first view is its transpose, 20 x 6
        mean = grads["w"][t].mean(0).astype(np.float64).T
        expected, q = rank_r_step(mean, q)
        np.testing.assert_allclose(outs["w"][t, 0], expected.T, atol=2e-5)
        np.testing.assert_allclose(outs["b"][t, 0], grads["b"][t].mean(0), rtol=1e-6, atol=1e-7)
        assert np.linalg.matrix_rank(outs["w"][t, 0], tol=1e-4) == rank


def test_power_sgd_smaller_orientation_puts_p_on_the_smaller_side():
    """``orientation="smaller"``: the 6 x 20 kernel is its own view, P 6 x r."""
    n, rank = 4, 2
    grads = random_grads(2, n, seed=11)
    reducer = power_sgd(rank, use_error_feedback=False, orientation="smaller")
    q = np.asarray(reducer.init({k: jnp.zeros(s) for k, s in SHAPES.items()}).q[0])
    assert q.shape == (20, rank)
    _, outs, _ = run_reducer(reducer, grads, n)
    for t in range(2):
        expected, q = rank_r_step(grads["w"][t].mean(0).astype(np.float64), q)
        np.testing.assert_allclose(outs["w"][t, 0], expected, atol=2e-5)
    with pytest.raises(ValueError, match=r"orientation must be one of \['outputs', 'smaller'\]"):
        power_sgd(rank, orientation="rows")


def test_power_sgd_without_warm_start_draws_q_per_step_from_the_seed():
    n, steps, seed = 2, 3, 5
    one = random_grads(1, n, seed=12)
    grads = jax.tree.map(lambda g: np.broadcast_to(g, (steps, *g.shape[1:])), one)

    def outputs(seed):
        reducer = power_sgd(1, use_error_feedback=False, warm_start=False, seed=seed)
        _, outs, state = run_reducer(reducer, grads, n)
        assert state.q == () and state.residual == ()
        return outs["w"][:, 0]

    got = outputs(seed)
    np.testing.assert_array_equal(got, outputs(seed))  # reproducible
    assert not np.allclose(got, outputs(seed + 1), atol=1e-4)
    mean = one["w"][0].mean(0).astype(np.float64).T  # the outputs-first view, 20 x 6
    for t in range(steps):
        key = jax.random.fold_in(jax.random.key(seed), t)
        q = np.asarray(jax.random.normal(jax.random.fold_in(key, 0), (6, 1)), np.float64)
        np.testing.assert_allclose(got[t], rank_r_step(mean, q)[0].T, atol=2e-5)
    assert not np.allclose(got[0], got[1], atol=1e-4)  # same gradient, a different Q


def test_power_sgd_batches_matrices_of_one_view():
    """Same-view matrices (a transposed one and a conv kernel included) stacked: the same
    updates as matrix by matrix, in fewer all-reduces."""
    n, steps = 4, 2
    shapes = {f"w{i}": (8, 24) for i in range(4)}
    shapes |= {"t": (24, 8), "conv": (3, 3, 4, 8), "u": (8, 36), "b": (24,)}
    rng = np.random.default_rng(13)
    grads = {k: rng.normal(size=(steps, n, *s)).astype(np.float32) for k, s in shapes.items()}
    options = dict(
        start_iter=0,
        min_compression_rate=2.0,
        use_error_feedback=True,
        warm_start=True,
        seed=0,
        axis="data",
    )
    results = []
    for batch in (True, False):
        program, state, placed = reducer_program(_power_sgd(2, **options, batch=batch), grads)
        compiled = program.lower(state, placed).compile()  # once: run and read
        ops = collectives(compiled.as_text())
        sent = sum(max(op.sent) * op.count for op in ops)
        results.append((compiled(state, placed), sum(op.kind == "all-reduce" for op in ops), sent))
    (got, ops, sent), (want, ops_unbatched, sent_unbatched) = results
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)  # outputs and state
    assert sent == pytest.approx(sent_unbatched)
    assert ops <= 2 < 7 <= ops_unbatched  # P and Q (with the bias): seven matrices


def test_power_sgd_full_rank_compressing_every_matrix_is_the_mean():
    """min_compression_rate=0 runs the power iteration on a 6 x 20 matrix at rank 6, which
    sends more than the matrix (6 * 26 > 120); the default sends it dense."""
    n = 4
    grads = random_grads(2, n, seed=14)
    for reducer, entries in ((power_sgd(6, min_compression_rate=0), 6 * 26), (power_sgd(6), 120)):
        _, outs, _ = run_reducer(reducer, grads, n)
        for k in SHAPES:
            np.testing.assert_allclose(outs[k][:, 0], grads[k].mean(1), atol=1e-5)
        program, state, placed = reducer_program(reducer, grads)
        sent = ddl.comm_stats(program, state, placed).bytes_per_device
        assert sent == pytest.approx(2 * ring_bytes(entries + 13, n))  # two steps


@pytest.mark.parametrize(
    "options",
    [dict(min_compression_rate=0), dict(min_compression_rate=0, start_iter=2, warm_start=False)],
)
def test_power_sgd_state_survives_local_sgds_synchronisation_branch(mlp, options):
    # Full rank on every kernel (compressed, not sent dense): exact, with Q and the step
    # passing through local SGD's branch and power_sgd's own.
    loss_fn, params = mlp
    batches = make_batches(2, 32)
    reducer = power_sgd(16, **options)
    strategy = ddl.local_sgd(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), period=1, reducer=reducer
    )
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: power_sgd(2, start_iter=-1), ValueError, "start_iter must be an int >= 0, got -1"),
        (lambda: power_sgd(2, start_iter=2.0), ValueError, "start_iter must be an int >= 0"),
        (
            lambda: power_sgd(2, min_compression_rate=-1),
            ValueError,
            "power_sgd: min_compression_rate must be a finite real number >= 0, got -1",
        ),
        (
            lambda: power_sgd(2, min_compression_rate=float("nan")),
            ValueError,
            "min_compression_rate must be a finite real number >= 0, got nan",
        ),
        (
            lambda: power_sgd(2, use_error_feedback=1),
            TypeError,
            "power_sgd: use_error_feedback must be a bool, got 1",
        ),
        (
            lambda: power_sgd(2, warm_start="no"),
            TypeError,
            "power_sgd: warm_start must be a bool, got 'no'",
        ),
    ],
)
def test_power_sgd_bad_options_raise_clear_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_power_sgd_refuses_a_state_of_other_parameters():
    state = power_sgd(2).init({"w": jnp.zeros((6, 20))})
    program = jax.shard_map(
        lambda g: power_sgd(2).update(g, state)[0],
        mesh=ddl.make_mesh(data=2),
        in_specs=P(),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="power_sgd: the state holds 1 residual arrays, the "):
        program({"w": jnp.zeros((6, 20)), "v": jnp.zeros((6, 20))})


WITH_AN_EMPTY_LEAF = {
    "cast": lambda: cast(jnp.bfloat16),
    "sign": sign,
    "qsgd": lambda: qsgd(4),
    "top_k": lambda: top_k(0.5),
    "power_sgd": lambda: power_sgd(2),
    "sparse_loco": lambda: ddl.compression.sparse_loco(0.25),
    "demo": lambda: ddl.compression.demo(0.25),
    "onebit_adam": lambda: ddl.compression.onebit_adam(2),
    "adasum": ddl.adasum,
}


@pytest.mark.parametrize("name", sorted(WITH_AN_EMPTY_LEAF))
def test_a_zero_size_leaf_is_carried_and_changes_nothing(name):
    """A parameter with no entries (a layer of width 0) beside a matrix: the matrix trains
    as it does alone."""
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + jnp.sum(p.get("z", 0.0)) - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": np.ones((16, 4), np.float32)}
    mesh, trained = ddl.make_mesh(data=4), []
    for params in ({"w": jnp.full((16, 4), 0.1)}, {"w": jnp.full((16, 4), 0.1), "z": jnp.zeros(0)}):
        strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh, reducer=WITH_AN_EMPTY_LEAF[name]())
        state, _ = train(strategy, params, [batch] * 2)
        trained.append(strategy.params(state))
    assert trained[1]["z"].shape == (0,)
    chex.assert_trees_all_close(trained[1]["w"], trained[0]["w"], atol=1e-6, rtol=0)


def test_a_builder_given_uncalled_as_the_reducer_says_to_call_it(mlp):
    loss_fn, _ = mlp
    mesh = ddl.make_mesh(data=4)
    with pytest.raises(TypeError, match=r"reducer=top_k is a builder taking ratio first: call"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=top_k)
    ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=ddl.allreduce_mean)  # of the axis
