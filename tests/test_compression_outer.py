"""SparseLoCo and DeMo against numpy loops of their definitions, their trivial cases, bytes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_pair, reference_sgd, train
from jax.sharding import PartitionSpec as P
from reducers import run_steps

import ddl_jax as ddl
from ddl_jax._src.measure.comm import collectives
from ddl_jax._src.reduce.outer import demo, sparse_loco

SHAPE = (7, 19)  # 133 entries; 19 is prime: tiles of 7 x 1 (chunk 8) or 7 x 19 (chunk >= 19)


@pytest.fixture(scope="module")
def mlp():
    """conftest's MLP (293 entries), built once for this file."""
    return mlp_pair()


def run_reducer(reducer, grads: np.ndarray):
    """Feeds worker i the gradients ``grads[:, i]`` (``[T, N, *shape]``) for T steps.

    Returns the outputs ``[T, N, D]`` (flat) and the final states ``[N, ...]``, as numpy.
    """
    outs, state = run_steps(reducer, grads)
    return outs.reshape(*grads.shape[:2], -1), state


def random_grads(steps: int, n: int, seed: int, shape=SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(steps, n, *shape)).astype(np.float32)


# -- what the error feedback keeps -------------------------------------------------------------
# The references (the authors' code, transcribed) are in tests/test_outer_reference.py.


@pytest.mark.parametrize("bits", [2, None])
def test_sparse_loco_averaged_over_all_workers_without_decay_loses_nothing(bits):
    # With the mean over all N (not over senders), no clipping and beta = 1, what was sent
    # plus what is left is the workers' mean: sum_t Delta_t + mean_i e_i = mean_i sum_t g_it.
    n, steps = 4, 4
    grads = random_grads(steps, n, seed=1)
    reducer = sparse_loco(0.1, chunk=8, bits=bits, decay=1.0, clip_norm=False, aggregate="workers")
    outs, state = run_reducer(reducer, grads)
    for i in range(1, n):  # every worker gets the same update
        np.testing.assert_allclose(outs[:, i], outs[:, 0], atol=0)
    np.testing.assert_allclose(
        outs[:, 0].sum(0) + state.error.mean(0),
        grads.reshape(steps, n, -1).sum(0).mean(0),
        atol=1e-5,
    )


# -- trivial cases -----------------------------------------------------------------------------


def test_sending_everything_exactly_without_memory_is_the_plain_mean():
    n, steps = 4, 2
    grads = random_grads(steps, n, seed=3)
    mean, _ = run_reducer(ddl.allreduce_mean(), grads)
    np.testing.assert_allclose(mean[:, 0], grads.reshape(steps, n, -1).mean(1), atol=1e-6)
    # DeMo: the DCT round trip of every coefficient, beta = 0.
    outs, _ = run_reducer(demo(1.0, beta=0.0), grads)
    np.testing.assert_allclose(outs, mean, atol=1e-6)
    # SparseLoCo: k is even (the authors' clamp, for their 12-bit index pairs), so each
    # worker keeps back its smallest entry of the 7 x 19 tile (averaged over the other
    # senders there); a tile of 8 x 19 entries is sent whole.
    loco = sparse_loco(1.0, decay=0.0, bits=None, clip_norm=False)
    outs, _ = run_reducer(loco, grads)
    assert 1 <= np.sum(~np.isclose(outs[0, 0], mean[0, 0], atol=1e-6)) <= n
    grads = random_grads(steps, n, seed=3, shape=(8, 19))
    mean, _ = run_reducer(ddl.allreduce_mean(), grads)
    outs, _ = run_reducer(loco, grads)
    np.testing.assert_allclose(outs, mean, atol=1e-6)


def test_sparse_loco_in_local_sgd_sending_everything_is_synchronous_sgd():
    # H = 1 with SGD inside and outer SGD(1) is synchronous SGD with the plain mean. Every
    # tile even (the MLP's 5-entry bias would keep 4 of 5: the authors' even k).
    def loss_fn(params, batch):
        logits = batch["x"] @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(12, 6)).astype(np.float32) / 4, "b": np.zeros(6, np.float32)}
    batches = make_batches(3, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(0.1),
        ddl.make_mesh(data=8),
        period=1,
        outer_optimizer=optax.sgd(1.0),
        reducer=sparse_loco(1.0, decay=0.0, bits=None, clip_norm=False),
    )
    state, metrics = train(strategy, params, batches)
    # Jitted as one program: op by op, the reference takes longer than the strategy.
    expected = jax.jit(lambda p: reference_sgd(loss_fn, optax.sgd(0.1), p, batches))(params)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    # (N-1) * 5 bytes per entry (uint8 index, float32 value) against a ring's 1.75 * 4.
    assert float(metrics["compression_ratio"]) == pytest.approx(7 / 35)
    assert state.reducer_state.error.shape == (8, 78)  # one accumulator per worker


def test_sparse_loco_in_local_sgd_under_drop_is_the_plain_mean_over_those_that_arrived():
    """Told who arrived, SparseLoCo sending everything exactly gives the plain mean's run
    with the same drop masks: the left-out workers' messages are not combined (the mean
    over the senders that arrived), and they keep their replicas."""

    def loss_fn(params, batch):
        logits = batch["x"] @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(12, 6)).astype(np.float32) / 4, "b": np.zeros(6, np.float32)}
    batches, mesh = make_batches(6, 32), ddl.make_mesh(data=8)

    def run(reducer=None):
        strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=3, drop=0.4,
                                 outer_optimizer=optax.sgd(1.0), reducer=reducer)  # fmt: skip
        return train(strategy, params, batches)

    (plain, metrics), (loco, _) = (
        run(),
        run(sparse_loco(1.0, decay=0.0, bits=None, clip_norm=False)),
    )
    assert 0 < float(metrics["arrived"]) < 1  # some dropped, not all, at the last sync
    chex.assert_trees_all_close(loco.params, plain.params, atol=1e-5, rtol=0)
    assert ddl.consistency.consensus_distance(loco.params) > 1e-3  # the left-out kept theirs


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
    # demo: tiles of 64 x 64 (4 + 16) and of 64 x 10 (4), k = ceil(0.01 * 4096) = 41 each:
    # a uint16 index and a float32 value.
    demo_bytes = stats["demo"].bytes_per_device
    assert demo_bytes == (n - 1) * 24 * 41 * 6 + metrics
    # sparse_loco: the same 4 + 16 + 4 tiles, k = 40 (even): uint16 indices, 2-bit codes
    # packed per tensor (C * 10 bytes), a table of 4 float32 bin means and the float32 shift
    # per tensor. Local SGD's synchronisation is a branch of its step (beside the plain
    # model average, a dense all-reduce of the parameters).
    loco = stats["sparse_loco"]
    sync = min(loco.branches.values())
    assert sync == (n - 1) * (24 * (40 * 2 + 10) + 3 * (16 + 4))
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
        (lambda: demo(0.1, lr=0.0), r"demo: lr \(or a schedule\) must be .* > 0"),
        (lambda: demo(0.1, aggregate="all"), "demo: aggregate must be one of"),
        (lambda: sparse_loco(0.1, aggregate="mean"), "sparse_loco: aggregate must be one of"),
        (lambda: sparse_loco(0.1, sigmas=0), "sparse_loco: sigmas must be .* > 0"),
        (lambda: sparse_loco(0.1, alpha=-1), "sparse_loco: alpha must be .* > 0"),
        (lambda: sparse_loco(0.1, clip_norm=1), "sparse_loco: clip_norm must be a bool"),
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
