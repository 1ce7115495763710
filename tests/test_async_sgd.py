"""async_sgd against synchronous SGD, a plain-Python event simulation, and the papers' claims."""

import functools

import chex
import hypothesis.strategies as hs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, worker_shards
from hypothesis import example, given, settings
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.async_sgd import async_sgd
from ddl_jax._src.staleness import (
    SSP,
    Downpour,
    SoftSync,
    compute_times,
    downpour,
    duration,
    scale_by_staleness,
    softsync,
    ssp,
)


def run(strategy, params, batches, state=None):
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params) if state is None else state
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


def reference_sgd(loss_fn, optimizer, params, batches):
    """Single-device training on each global batch (conftest's, with a jitted step)."""

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = optimizer.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params


def simulate(loss_fn, lr, params, batches, n, times, protocol="async", scale=lambda tau: 1.0):
    """The event model of ``async_sgd``, one event at a time in plain Python, with SGD.

    Per step: every started worker without a gradient computes it on its fetched params
    and its shard; then arrivals are taken in (time, worker) order until one has no
    gradient yet. Returns the final server params and each push's staleness.
    """
    group_n = protocol.n if isinstance(protocol, SoftSync) else 1
    bound = protocol.bound if isinstance(protocol, SSP) else None
    n_fetch, n_push = protocol if isinstance(protocol, Downpour) else (1, 1)
    key = jax.random.key_data(jax.random.key(times.seed, impl="threefry2x32"))

    d = functools.cache(lambda i, k: float(duration(times, n, key, jnp.int32(i), jnp.int32(k))))
    grad_fn = jax.jit(jax.grad(loss_fn))

    theta, version = params, 0
    fetched = [params] * n
    fetched_version, tasks = [0] * n, [0] * n
    arrival = [d(i, 0) for i in range(n)]
    grad = [None] * n
    accrued = [jax.tree.map(jnp.zeros_like, params) for _ in range(n)]
    waiting, group, taus = set(), [], []
    for batch in batches:
        shards = worker_shards(batch, n)
        for i in range(n):
            if grad[i] is None and i not in waiting:
                grad[i] = grad_fn(fetched[i], shards[i])
        while True:
            t, w = min((arrival[i], i) for i in range(n) if i not in waiting)
            if grad[w] is None:
                break
            tasks[w] += 1
            accrued[w] = jax.tree.map(jnp.add, accrued[w], grad[w])
            grad[w] = None
            if tasks[w] % n_push == 0:
                tau = version - fetched_version[w]
                taus.append(tau)
                group.append((accrued[w], tau))  # Dean et al.: the sum, Delta w
                accrued[w] = jax.tree.map(jnp.zeros_like, params)
                if len(group) == group_n:
                    g = jax.tree.map(lambda *gs: sum(gs) / group_n, *[g for g, _ in group])
                    s = scale(sum(tau for _, tau in group) / group_n)
                    theta = jax.tree.map(lambda p, g, s=s: p - lr * s * g, theta, g)
                    version += 1
                    group = []
            waiting.add(w)
            for i in sorted(waiting):
                if group or (bound is not None and tasks[i] - min(tasks) > bound):
                    continue
                waiting.discard(i)
                if tasks[i] % n_fetch == 0:
                    fetched[i], fetched_version[i] = theta, version
                arrival[i] = t + d(i, tasks[i])
    return theta, taus


@pytest.mark.parametrize("n", [8])
def test_softsync_n_with_equal_times_is_synchronous_sgd(mlp, n):
    loss_fn, params = mlp
    batches = make_batches(4, 32)
    strategy = async_sgd(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=n), protocol=softsync(n))
    state, history = run(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    assert [h["wall_clock"] for h in history] == [1.0, 2.0, 3.0, 4.0]
    assert [h["updates_applied"] for h in history] == [1.0, 2.0, 3.0, 4.0]
    assert all(h["staleness_max"] == 0 and h["pushes"] == n for h in history)
    first_loss = np.mean([jax.jit(loss_fn)(params, b) for b in worker_shards(batches[0], n)])
    np.testing.assert_allclose(history[0]["loss"], first_loss, rtol=1e-5)


CASES = {
    "async_random": (compute_times(1.0, spread=0.7, seed=3), "async"),
    "softsync_2": (compute_times([1.0, 2.0, 1.0, 3.0]), softsync(2)),
    "ssp_1": (compute_times([1.0, 1.0, 1.0, 3.0]), ssp(1)),
    "downpour": (compute_times([1.0, 1.0, 2.0, 1.0], spread=0.3, seed=1), downpour(3, 2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trajectory_equals_a_plain_event_simulation(mlp, case):
    loss_fn, params = mlp
    times, protocol = CASES[case]
    batches = make_batches(7, 16)
    strategy = async_sgd(
        loss_fn, optax.sgd(0.3), ddl.make_mesh(data=4), compute_time=times, protocol=protocol
    )
    state, history = run(strategy, params, batches)
    expected, taus = simulate(loss_fn, 0.3, params, batches, 4, times, protocol)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    assert sum(h["pushes"] for h in history) == len(taus)
    assert max(h["staleness_max"] for h in history) == max(taus)
    np.testing.assert_allclose(
        sum(h["staleness_mean"] * h["pushes"] for h in history), sum(taus), rtol=1e-6
    )


def test_downpour_fetching_and_pushing_every_gradient_is_plain_async(mlp):
    """downpour(1, 1) is "async" on a sharded server: Adam acts elementwise on the shards."""
    loss_fn, params = mlp
    times = compute_times(1.0, spread=0.7, seed=2)
    batches = make_batches(5, 32)
    plain, sharded = (
        async_sgd(loss_fn, optax.adam(0.05), ddl.make_mesh(data=8), compute_time=times,
                  protocol=protocol)
        for protocol in ("async", downpour(1, 1))
    )  # fmt: skip
    plain_state, plain_history = run(plain, params, batches)
    sharded_state, sharded_history = run(sharded, params, batches)
    assert max(h["staleness_max"] for h in plain_history) > 1
    assert sharded_state.params.shape[0] == 8  # the server really is sharded
    chex.assert_trees_all_close(
        sharded.params(sharded_state), plain.params(plain_state), atol=1e-6, rtol=0
    )
    for key in ("staleness_mean", "staleness_max", "pushes", "updates_applied", "wall_clock"):
        assert [h[key] for h in sharded_history] == [h[key] for h in plain_history], key


def test_staleness_scaled_steps_follow_lr_over_tau(mlp):
    loss_fn, params = mlp
    times = compute_times([1.0, 1.0, 1.0, 2.5])
    batches = make_batches(6, 16)
    optimizer = optax.chain(scale_by_staleness("inverse"), optax.sgd(0.3))
    strategy = async_sgd(loss_fn, optimizer, ddl.make_mesh(data=4), compute_time=times)
    state, _ = run(strategy, params, batches)
    expected, taus = simulate(
        loss_fn, 0.3, params, batches, 4, times, scale=lambda tau: 1 / max(tau, 1)
    )
    assert max(taus) > 1
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_plain_async_staleness_is_about_the_number_of_workers(mlp, n):
    """Gupta et al. 2016: with N equal learners the mean staleness is about N."""
    loss_fn, params = mlp
    strategy = async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n))
    _, history = run(strategy, params, make_batches(5, 8 * n))
    # The first N arrivals see 0..N-1 updates; from then on every gradient is N-1 behind.
    assert history[0]["staleness_mean"] == (n - 1) / 2
    assert all(h["staleness_mean"] == h["staleness_max"] == n - 1 for h in history[1:])


@pytest.fixture(scope="module")
def random_times_run():
    """One compiled step per protocol, reused over seeds: the seed lives in the state."""
    cache = {}

    def go(mlp, protocol, seed):
        loss_fn, params = mlp
        if protocol not in cache:
            times = compute_times([1.0, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0], spread=0.8)
            strategy = async_sgd(
                loss_fn, optax.sgd(0.05), ddl.make_mesh(data=8), compute_time=times,
                protocol=protocol,
            )  # fmt: skip
            cache[protocol] = (strategy, jax.jit(strategy.step))
        strategy, step = cache[protocol]
        state = strategy.init(params)
        key = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
        state = state._replace(key=jax.device_put(key, state.key.sharding))
        history = []
        for batch in make_batches(6, 16):
            state, metrics = step(state, batch)
            history.append(jax.device_get(metrics))
        return history

    return go


def test_ssp_never_exceeds_its_bound(mlp):
    """SSP's invariant on the state, not on the rule that enforces it.

    A worker at clock c (gradients completed) starts its next gradient only while
    c - min(clocks) <= bound, and the slowest clock cannot fall while it computes; so after
    every event the clocks span at most bound + 1, and a worker waits exactly when it is
    bound + 1 ahead. Checked after every step, over random compute times.
    """
    loss_fn, params = mlp
    spans = []

    @settings(max_examples=2, deadline=None)
    @example(bound=1, base=[1.0] * 6 + [2.0, 6.0], spread=0.0, seed=0)  # reaches the bound
    @given(
        bound=hs.integers(0, 2),
        base=hs.lists(hs.floats(0.25, 4.0), min_size=8, max_size=8),
        spread=hs.floats(0.0, 1.0),
        seed=hs.integers(0, 2**31 - 1),
    )
    def check(bound, base, spread, seed):
        times = compute_times(base, spread=spread, seed=seed)
        strategy = async_sgd(
            loss_fn, optax.sgd(0.05), ddl.make_mesh(data=8), compute_time=times,
            protocol=ssp(bound),
        )  # fmt: skip
        step = jax.jit(strategy.step, donate_argnums=0)
        state = strategy.init(params)
        for batch in make_batches(6, 16):
            state, metrics = step(state, batch)
            lead = np.asarray(state.tasks) - np.asarray(state.tasks).min()
            assert lead.max() <= bound + 1, lead
            np.testing.assert_array_equal(np.asarray(state.waiting), lead == bound + 1)
            # While a gradient is in flight every other worker can push at most 2s + 1 times.
            assert metrics["staleness_max"] <= 7 * (2 * bound + 1)
            spans.append(lead.max() - bound)

    check()
    assert 1 in spans  # the bound is reached: the check above is tight


def test_same_seed_same_trajectory_other_seed_another(mlp, random_times_run):
    first, again = random_times_run(mlp, ssp(2), 5), random_times_run(mlp, ssp(2), 5)
    other = random_times_run(mlp, ssp(2), 6)
    assert first == again
    assert [h["wall_clock"] for h in first] != [h["wall_clock"] for h in other]


def test_state_placement(mlp):
    loss_fn, params = mlp
    mesh = ddl.make_mesh(data=8)
    spec = lambda tree: {x.sharding.spec for x in jax.tree.leaves(tree)}  # noqa: E731
    state = async_sgd(loss_fn, optax.adam(0.1), mesh, protocol=softsync(2)).init(params)
    assert spec(state.params) == spec(state.opt_state) == spec(state.group) == {P()}
    assert spec(state.fetched) == spec(state.gradient) == {P("data")}
    assert spec(state.arrival) == spec(state.tasks) == spec(state.key) == {P()}
    # Downpour's server is sharded: device i holds the i-th slice of the flat parameters.
    strategy = async_sgd(loss_fn, optax.adam(0.1), mesh, protocol=downpour(2, 2))
    state = strategy.init(params)
    size = sum(x.size for x in jax.tree.leaves(params))
    assert state.params.shape == (8, -(-size // 8))
    assert spec(state.params) == spec(state.opt_state) == spec(state.accrued) == {P("data")}
    chex.assert_trees_all_equal(strategy.params(state), params)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"protocol": softsync(9)}, "softsync n=9 is outside \\[1, N\\] for N=8"),
        ({"protocol": SoftSync(0)}, "softsync n must be an int >= 1, got 0"),
        ({"protocol": SSP(-1)}, "ssp bound must be an int >= 0, got -1"),
        ({"protocol": "hogwild"}, "protocol='hogwild' is not known"),
        ({"compute_time": -1.0}, "finite and >= 0"),
        ({"compute_time": [1.0] * 7 + [float("nan")]}, "finite and >= 0"),
        ({"compute_time": [1.0, 2.0]}, "gives 2 per-worker times but the mesh has 8"),
    ],
)
def test_bad_arguments_raise_clear_errors(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), **kwargs)


def test_protocol_of_the_wrong_type_raises(mlp):
    loss_fn, _ = mlp
    with pytest.raises(TypeError, match="protocol must be 'async'"):
        async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), protocol=2)
