"""ddl.adasum against its defining identities and a plain NumPy recursion of the rule."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_pair, train, worker_shards
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl

SIZES = [2, 4, 8]
SHAPES = {"w": (6, 20), "b": (13,)}  # a matrix and a vector


def adasum_on_mesh(grads, n: int, reducer=None):
    """Worker i feeds ``grads[i]`` (a tree of ``[N, ...]`` leaves) to the reducer inside
    ``shard_map``; returns every worker's result, ``[N, ...]``, for comparing them.

    The worker returns its result through ``out_specs=P()`` as well, which ``shard_map``
    accepts only for a value typed invariant over ``data`` (provably the same everywhere).
    """
    mesh = ddl.make_mesh(data=n)
    reducer = ddl.adasum() if reducer is None else reducer

    def worker(g):
        g = jax.tree.map(lambda x: x[0], g)
        out, _ = reducer.update(g, reducer.init(g))
        return jax.tree.map(lambda x: x[None], out), out

    program = jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
    every, replicated = jax.jit(program)(jax.device_put(grads, NamedSharding(mesh, P("data"))))
    chex.assert_trees_all_equal(every, jax.tree.map(lambda x: np.stack([x] * n), replicated))
    return replicated


def numpy_combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    ca = 1 - dot / (2 * float(a @ a)) if a.any() else 1.0
    cb = 1 - dot / (2 * float(b @ b)) if b.any() else 1.0
    return ca * a + cb * b


def numpy_adasum(vectors: list[np.ndarray]) -> np.ndarray:
    """The rule applied recursively: Adasum of each half, then of the two results."""
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return numpy_combine(numpy_adasum(vectors[:half]), numpy_adasum(vectors[half:]))


def numpy_adasum_tree(grads: dict) -> dict:
    """Per leaf, in float64: leaf ``k`` of the result combines the workers' leaves ``k``."""
    out = {}
    for k, g in grads.items():
        rows = [np.asarray(x, np.float64).reshape(-1) for x in g]
        out[k] = numpy_adasum(rows).reshape(g.shape[1:])
    return out


def random_grads(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}


# -- the rule's identities -------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_equal_gradients_give_that_gradient(n):
    grads = jax.tree.map(lambda g: np.stack([g[0]] * n), random_grads(n, seed=n))
    out = adasum_on_mesh(grads, n)
    chex.assert_trees_all_close(out, jax.tree.map(lambda g: g[0], grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_orthogonal_gradients_give_their_sum(n):
    # Rows of a random orthogonal matrix, each scaled differently: mutually orthogonal.
    rng = np.random.default_rng(n)
    q, _ = np.linalg.qr(rng.normal(size=(12, 12)))
    rows = q[:n] * rng.uniform(0.1, 10.0, size=(n, 1))
    grads = {"w": rows.reshape(n, 3, 4).astype(np.float32)}
    out = adasum_on_mesh(grads, n)
    np.testing.assert_allclose(out["w"], grads["w"].sum(axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", SIZES)
def test_random_gradients_match_a_numpy_recursion_of_the_rule(n):
    grads = random_grads(n, seed=10 + n)
    out = adasum_on_mesh(grads, n)
    chex.assert_trees_all_close(out, numpy_adasum_tree(grads), rtol=1e-5, atol=1e-5)
    # Not the mean, not the sum: random gradients are neither equal nor orthogonal.
    assert not np.allclose(out["w"], grads["w"].mean(0), atol=1e-3)
    assert not np.allclose(out["w"], grads["w"].sum(0), atol=1e-3)


def test_two_workers_by_hand():
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: (1 - 1/2) a + (1 - 1/4) b.
    out = adasum_on_mesh({"g": np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)}, 2)
    np.testing.assert_allclose(out["g"], [1.25, 0.75], rtol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_leaves_combine_independently(n):
    # Leaf "same" is equal on every worker (Adasum averages), leaf "orth" orthogonal (sums):
    # dot products over the whole tree would mix them and give neither.
    rng = np.random.default_rng(n)
    same = np.stack([rng.normal(size=5).astype(np.float32)] * n)
    orth = (np.eye(n, 10) * rng.uniform(1.0, 3.0, size=(n, 1))).astype(np.float32)
    out = adasum_on_mesh({"same": same, "orth": orth}, n)
    np.testing.assert_allclose(out["same"], same[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["orth"], orth.sum(0), rtol=1e-5, atol=1e-6)
    # The same as running each leaf alone.
    alone = adasum_on_mesh({"orth": orth}, n)
    np.testing.assert_allclose(out["orth"], alone["orth"], rtol=1e-6)


def test_dtypes_are_kept_and_each_combined_in_float32():
    n = 4
    rng = np.random.default_rng(3)
    grads = {
        "f32": rng.normal(size=(n, 7)).astype(np.float32),
        "bf16": jnp.asarray(rng.normal(size=(n, 9)), jnp.bfloat16),
    }
    out = adasum_on_mesh(grads, n)
    assert out["f32"].dtype == jnp.float32 and out["bf16"].dtype == jnp.bfloat16
    expected = numpy_adasum_tree({k: np.asarray(v, np.float32) for k, v in grads.items()})
    np.testing.assert_allclose(out["f32"], expected["f32"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["bf16"], np.float32), expected["bf16"], rtol=1e-2)


# -- zeros, one worker, wrong sizes ------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8])
def test_zero_gradients_give_zeros_and_a_zero_worker_drops_out(n):
    zeros = {"w": np.zeros((n, 3, 4), np.float32)}
    out = adasum_on_mesh(zeros, n)
    assert np.all(np.isfinite(out["w"])) and not out["w"].any()
    # adasum(0, b) = b: with only worker 1 nonzero at N = 2, the result is its gradient.
    if n == 2:
        g = np.zeros((2, 3), np.float32)
        g[1] = [1.0, -2.0, 3.0]
        np.testing.assert_array_equal(adasum_on_mesh({"g": g}, 2)["g"], g[1])


def test_one_worker_returns_its_gradient():
    grads = random_grads(1)
    chex.assert_trees_all_equal(adasum_on_mesh(grads, 1), jax.tree.map(lambda g: g[0], grads))


@pytest.mark.parametrize("n", [3, 6])
def test_worker_counts_that_are_not_powers_of_two_are_refused(n):
    with pytest.raises(ValueError, match=rf"adasum: .*'data' has N={n} workers.*power of two"):
        adasum_on_mesh(random_grads(n), n)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="adasum: axis must be a mesh axis name"):
        ddl.adasum(axis=0)
    with pytest.raises(ValueError, match="axis='model' is not an axis"):
        adasum_on_mesh(random_grads(2), 2, reducer=ddl.adasum(axis="model"))


# -- communication -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8])
def test_one_all_gather_of_n_minus_1_gradients_per_device(n):
    grads = random_grads(n)
    mesh = ddl.make_mesh(data=n)
    reducer = ddl.adasum()

    def worker(g):
        g = jax.tree.map(lambda x: x[0], g)
        return reducer.update(g, reducer.init(g))[0]

    program = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P()))
    stats = ddl.comm_stats(program, jax.device_put(grads, NamedSharding(mesh, P("data"))))
    gradient_bytes = 4 * sum(np.prod(s) for s in SHAPES.values())
    assert set(stats.bytes_by_kind) == {"all-gather"}  # both leaves fused into one
    assert stats.bytes_per_device == pytest.approx((n - 1) * gradient_bytes)


# -- as a strategy's reducer ------------------------------------------------------------------


def test_data_parallel_step_applies_the_adasum_of_the_workers_gradients():
    n, lr = 4, 0.1
    loss_fn, params = mlp_pair()
    batch = make_batches(1, 32, seed=5)[0]
    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(lr), ddl.make_mesh(data=n), reducer=ddl.adasum()
    )
    state, _ = train(strategy, params, [batch])
    per_worker = [jax.grad(loss_fn)(params, shard) for shard in worker_shards(batch, n)]
    flat = [jax.tree.leaves(g) for g in per_worker]
    combined = [
        numpy_adasum([np.asarray(f[k], np.float64).reshape(-1) for f in flat]).reshape(
            np.shape(flat[0][k])
        )
        for k in range(len(flat[0]))
    ]
    leaves, treedef = jax.tree.flatten(params)
    expected = treedef.unflatten([p - lr * c for p, c in zip(leaves, combined, strict=True)])
    chex.assert_trees_all_close(strategy.params(state), expected, rtol=1e-5, atol=1e-6)


def test_data_parallel_trains_with_adasum_and_compiles_once():
    loss_fn, params = mlp_pair()
    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), reducer=ddl.adasum()
    )
    batches = make_batches(2, 64, seed=1) * 4  # two batches, four epochs
    traces = []

    def counted(state, batch):
        traces.append(1)
        return strategy.step(state, batch)

    step = jax.jit(counted, donate_argnums=0)
    state = strategy.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert len(traces) == 1
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05


def test_local_sgd_with_period_one_equals_data_parallel_with_adasum():
    # H = 1 with SGD: each replica moves by -lr g_i, and Adasum(lr g_i) = lr Adasum(g_i),
    # so local SGD exchanging pseudo-gradients through Adasum is data parallelism with it.
    loss_fn, params = mlp_pair()
    mesh, batches = ddl.make_mesh(data=4), make_batches(3, 32, seed=2)
    local = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1, reducer=ddl.adasum())
    sync = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=ddl.adasum())
    local_state, metrics = train(local, params, batches)
    sync_state, _ = train(sync, params, batches)
    assert float(metrics["synchronised"]) == 1.0
    chex.assert_trees_all_close(
        local.params(local_state), sync.params(sync_state), rtol=1e-4, atol=1e-5
    )
