"""SparseLoCo and DeMo against numpy loops of their definitions, their trivial cases, bytes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_pair, reference_sgd, train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.core import kit
from ddl_jax._src.measure.comm import collectives
from ddl_jax._src.reduce.outer import demo, sparse_loco

SHAPE = (7, 19)  # 133 entries: chunks of 32 or 16 leave a short, padded last chunk


@pytest.fixture(scope="module")
def mlp():
    """conftest's MLP (293 entries), built once for this file."""
    return mlp_pair()


def run_reducer(reducer, grads: np.ndarray):
    """Feeds worker i the gradients ``grads[:, i]`` (``[T, N, *SHAPE]``) for T steps.

    Returns the outputs ``[T, N, D]`` (flat) and the final states ``[N, ...]``, as numpy.
    """
    steps, n = grads.shape[:2]
    mesh = ddl.make_mesh(data=n)
    init = reducer.init(jnp.zeros(SHAPE))
    state = jax.device_put(
        jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), init),
        NamedSharding(mesh, P("data")),
    )

    def worker(state, grads):
        def one(state, g):
            out, state = reducer.update(g, state)
            return state, out

        state, outs = jax.lax.scan(one, kit.unstack(state), grads[:, 0])
        return kit.restack(state), outs[:, None]

    # check_vma: the outputs must be typed as agreeing across workers, as a strategy needs.
    specs = (P("data"), P(None, "data"))
    program = jax.shard_map(worker, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=True)
    placed = jax.device_put(grads, NamedSharding(mesh, P(None, "data")))
    state, outs = jax.tree.map(np.asarray, jax.jit(program)(state, placed))
    return outs.reshape(steps, n, -1), state


def random_grads(steps: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(steps, n, *SHAPE)).astype(np.float32)


# -- numpy references ----------------------------------------------------------------------


def quantise(v: np.ndarray, valid: np.ndarray, levels: int) -> np.ndarray:
    """Each value as the mean of its bin, of ``levels`` equal bins over [min, max] of the valid."""
    lo, hi = v[valid].min(), v[valid].max()
    span = hi - lo if hi > lo else np.float32(1)
    codes = np.clip(np.floor((v - lo) / span * levels), 0, levels - 1)
    members = [valid & (codes == b) for b in range(levels)]
    table = [v[member].mean() if member.any() else 0 for member in members]
    return np.asarray(table, np.float32)[codes.astype(int)]


def sparse_loco_reference(grads, ratio, chunk, bits, decay):
    """SparseLoCo step by step: ``(outputs [T, D], final errors [N, D])``."""
    steps, n = grads.shape[:2]
    g = grads.reshape(steps, n, -1)
    d = g.shape[2]
    width = min(chunk, d)
    count, k = -(-d // width), int(np.ceil(ratio * width))
    valid = np.arange(count * width) < d
    e = np.zeros((n, d), np.float32)
    outs = []
    for t in range(steps):
        total = np.zeros(count * width, np.float32)
        for i in range(n):
            e[i] = decay * e[i] + g[t, i]
            padded = np.zeros(count * width, np.float32)
            padded[:d] = e[i]
            sent = np.zeros(count * width, np.float32)
            for c in range(count):
                part = slice(c * width, (c + 1) * width)
                top = np.argsort(-np.where(valid[part], np.abs(padded[part]), -1))[:k]
                v = padded[part][top]
                if bits is not None:
                    v = quantise(v, valid[part][top], 2**bits)
                sent[c * width + top] = v
            total += sent
            e[i] -= sent[:d]
        outs.append(total[:d] / n)
    return np.stack(outs), e


def dct_matrix(w: int) -> np.ndarray:
    """The orthonormal DCT-II as a matrix: ``coefficients = M @ x``, ``x = M.T @ coefficients``."""
    j, f = np.arange(w), np.arange(w)[:, None]
    m = np.sqrt(2 / w) * np.cos(np.pi * (2 * j + 1) * f / (2 * w))
    m[0] /= np.sqrt(2)
    return m


def demo_reference(grads, ratio, chunk, beta):
    """DeMo step by step in float64: ``(outputs [T, D], final momenta [N, D])``."""
    steps, n = grads.shape[:2]
    g = grads.reshape(steps, n, -1).astype(np.float64)
    d = g.shape[2]
    count, k = -(-d // chunk), int(np.ceil(ratio * chunk))
    dct = dct_matrix(chunk)
    m = np.zeros((n, d))
    outs = []
    for t in range(steps):
        mean = np.zeros((count, chunk))
        for i in range(n):
            m[i] = beta * m[i] + g[t, i]
            coeffs = np.pad(m[i], (0, count * chunk - d)).reshape(count, chunk) @ dct.T
            kept = np.zeros_like(coeffs)
            for c in range(count):
                top = np.argsort(-np.abs(coeffs[c]))[:k]
                kept[c, top] = coeffs[c, top]
            mean += kept / n
            m[i] -= (kept @ dct).reshape(-1)[:d]
        outs.append((mean @ dct).reshape(-1)[:d])
    return np.stack(outs), m


# -- against the definitions -----------------------------------------------------------------


@pytest.mark.parametrize(("bits", "decay"), [(2, 0.9), (None, 1.0)])
def test_sparse_loco_follows_its_definition(bits, decay):
    n, steps = 4, 4
    grads = random_grads(steps, n, seed=1)
    outs, state = run_reducer(sparse_loco(0.1, chunk=32, bits=bits, decay=decay), grads)
    expected, errors = sparse_loco_reference(grads, 0.1, 32, bits, decay)
    for t in range(steps):
        for i in range(n):  # every worker gets the same update
            np.testing.assert_allclose(outs[t, i], expected[t], atol=1e-5)
    np.testing.assert_allclose(state.error, errors, atol=1e-5)
    assert np.count_nonzero(outs[0, 0]) <= n * 5 * 4  # 5 chunks of 32, k = 4 each
    if decay == 1:  # nothing is lost: sent + unsent = the workers' mean
        np.testing.assert_allclose(
            outs[:, 0].sum(0) + state.error.mean(0),
            grads.reshape(steps, n, -1).sum(0).mean(0),
            atol=1e-5,
        )


def test_demo_follows_its_definition():
    n, steps = 4, 4
    grads = random_grads(steps, n, seed=2)
    outs, state = run_reducer(demo(0.25, chunk=16, beta=0.9), grads)
    expected, momenta = demo_reference(grads, 0.25, 16, 0.9)
    for t in range(steps):
        for i in range(n):
            np.testing.assert_allclose(outs[t, i], expected[t], atol=1e-5)
    np.testing.assert_allclose(state.momentum, momenta, atol=1e-5)
    assert not np.allclose(outs[0, 0], grads[0].reshape(n, -1).mean(0), atol=1e-2)


# -- trivial cases -----------------------------------------------------------------------------


def test_sending_everything_exactly_without_memory_is_the_plain_mean():
    n, steps = 4, 2
    grads = random_grads(steps, n, seed=3)
    mean, _ = run_reducer(ddl.allreduce_mean(), grads)
    np.testing.assert_allclose(mean[:, 0], grads.reshape(steps, n, -1).mean(1), atol=1e-6)
    # DeMo: the DCT round trip of every coefficient, beta = 0.
    for reducer in (sparse_loco(1.0, decay=0.0, bits=None), demo(1.0, beta=0.0)):
        outs, _ = run_reducer(reducer, grads)
        np.testing.assert_allclose(outs, mean, atol=1e-6)


def test_sparse_loco_in_local_sgd_sending_everything_is_synchronous_sgd(mlp):
    # H = 1 with SGD inside and outer SGD(1) is synchronous SGD with the plain mean.
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(0.1),
        ddl.make_mesh(data=8),
        period=1,
        outer_optimizer=optax.sgd(1.0),
        reducer=sparse_loco(1.0, decay=0.0, bits=None),
    )
    state, metrics = train(strategy, params, batches)
    # Jitted as one program: op by op, the reference takes longer than the strategy.
    expected = jax.jit(lambda p: reference_sgd(loss_fn, optax.sgd(0.1), p, batches))(params)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    # (N-1) * 6 bytes per entry (uint16 index, float32 value) against a ring's 1.75 * 4.
    assert float(metrics["compression_ratio"]) == pytest.approx(7 / 42)
    assert state.reducer_state.error.shape == (8, 293)  # one accumulator per worker


# -- bytes on the wire, metrics ------------------------------------------------------------------


def test_bytes_from_the_compiled_step_at_ratio_001():
    """A 64-256-256-10 network (84480 weights) on N=8 workers: dense all-reduce vs each."""
    rng = np.random.default_rng(5)
    shapes = {"w1": (64, 256), "w2": (256, 256), "w3": (256, 10)}
    params = {k: rng.normal(size=s).astype(np.float32) / np.sqrt(s[0]) for k, s in shapes.items()}

    def loss_fn(params, batch):
        h = jnp.tanh(jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"])
        return jnp.mean((h @ params["w3"] - batch["y"]) ** 2)

    batch = {"x": np.zeros((16, 64), np.float32), "y": np.zeros((16, 10), np.float32)}
    n = 8
    mesh = ddl.make_mesh(data=n)
    sign_descent = optax.chain(optax.scale_by_sign(), optax.scale(-1e-3))
    strategies = {
        "dense": ddl.data_parallel(loss_fn, sign_descent, mesh),
        "demo": ddl.data_parallel(loss_fn, sign_descent, mesh, reducer=demo(0.01)),
        "sparse_loco": ddl.local_sgd(
            loss_fn, optax.sgd(1e-3), mesh, period=1, reducer=sparse_loco(0.01)
        ),
    }
    stats = {
        name: ddl.comm_stats(jax.jit(s.step), s.init(params), batch)
        for name, s in strategies.items()
    }
    dense = stats["dense"].bytes_per_device
    assert dense == 2 * (n - 1) / n * 4 * (84480 + 1)  # the gradient and the loss
    metrics = 2 * (n - 1) / n * 4 * 2  # the all-reduce of the loss and compression_ratio
    # demo: 1320 chunks of 64, k = 1: a uint8 index and a float32 value each.
    demo_bytes = stats["demo"].bytes_per_device
    assert demo_bytes == (n - 1) * 1320 * 5 + metrics
    # sparse_loco: 21 chunks of 4096, k = 41: uint16 indices, 2-bit codes (11 bytes), a
    # table of 4 float32 bin means. Local SGD's synchronisation is a branch of its step
    # (beside the plain model average, a dense all-reduce of the parameters).
    loco = stats["sparse_loco"]
    sync = min(loco.branches.values())
    assert sync == (n - 1) * 21 * (41 * 2 + 11 + 16)
    assert loco.bytes_per_device == metrics
    assert dense / demo_bytes > 12
    assert dense / (sync + metrics) > 35


def test_demo_with_sign_descent_trains_and_reports_the_compiled_ratio(mlp):
    loss_fn, params = mlp
    n = 8
    strategy = ddl.data_parallel(
        loss_fn,
        optax.chain(optax.scale_by_sign(), optax.scale(-3e-3)),
        ddl.make_mesh(data=n),
        reducer=demo(0.1, chunk=32),
    )
    state = strategy.init(params)
    batch = make_batches(1, 64, seed=4)[0]
    compiled = jax.jit(strategy.step, donate_argnums=0).lower(state, batch).compile()
    sent = sum(max(op.sent) * op.count for op in collectives(compiled.as_text()))
    losses = []
    for _ in range(15):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05
    assert set(metrics) == {"loss", "compression_ratio"}
    # The metric is a dense ring's bytes over the compressor's, as compiled.
    dense = 2 * (n - 1) / n * 4 * 293
    metrics_bytes = 2 * (n - 1) / n * 4 * 2
    np.testing.assert_allclose(
        metrics["compression_ratio"], dense / (sent - metrics_bytes), rtol=1e-6
    )
    assert state.reducer_state.momentum.shape == (n, 293)  # one momentum per worker


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: sparse_loco(0.0), "sparse_loco: ratio must be a finite real number > 0, got 0.0"),
        (lambda: sparse_loco(1.5), "sparse_loco: ratio must be a finite real number <= 1"),
        (lambda: sparse_loco(0.1, chunk=0), "sparse_loco: chunk must be an int >= 1, got 0"),
        (lambda: sparse_loco(0.1, chunk=64.0), "sparse_loco: chunk must be an int >= 1"),
        (lambda: sparse_loco(0.1, bits=0), r"bits \(or None\) must be an int >= 1 and <= 8"),
        (lambda: sparse_loco(0.1, bits=16), r"bits \(or None\) must be an int >= 1 and <= 8"),
        (lambda: sparse_loco(0.1, decay=1.5), "sparse_loco: decay must be .* <= 1, got 1.5"),
        (lambda: sparse_loco(0.1, decay=-0.1), "sparse_loco: decay must be .* >= 0"),
        (lambda: demo(float("nan")), "demo: ratio must be a finite real number > 0, got nan"),
        (lambda: demo(0.1, chunk=-1), "demo: chunk must be an int >= 1, got -1"),
        (lambda: demo(0.1, beta=1.0), "demo: beta must be a finite real number < 1, got 1.0"),
        (lambda: demo(0.1, beta=-0.5), "demo: beta must be a finite real number >= 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_axis_must_be_a_name_and_the_state_must_fit():
    for build in (sparse_loco, demo):
        with pytest.raises(TypeError, match=f"{build.__name__}: axis must be a mesh axis name"):
            build(0.1, axis=0)
    state = demo(0.5).init(jnp.zeros(5))
    with pytest.raises(ValueError, match="demo: the updates have 6 entries"):
        jax.shard_map(
            lambda g: demo(0.5).update(g, state)[0],
            mesh=ddl.make_mesh(data=1),
            in_specs=P(),
            out_specs=P(),
        )(jnp.zeros(6))
