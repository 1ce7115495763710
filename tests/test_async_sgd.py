"""async_sgd against synchronous SGD, a plain-Python event simulation, and the papers' claims."""

import doctest
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
from ddl_jax._src.strategies.asynchronous import events as ev
from ddl_jax._src.strategies.asynchronous.sgd import async_sgd
from ddl_jax._src.strategies.asynchronous.staleness import (
    SSP,
    Downpour,
    SoftSync,
    as_protocol,
    churn,
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


def simulate(
    loss_fn, lr, params, batches, n, times, protocol="async", scale=lambda tau: 1.0, each=None
):
    """The event model of ``async_sgd``, one event at a time in plain Python, with SGD.

    Per step: every started worker without a gradient computes it on its fetched params
    and its shard; then arrivals are taken in (time, worker) order until one has no
    gradient yet. Returns the final server params and each push's staleness. ``scale``
    scales an update by its group's mean staleness; ``each``, Zhang et al.'s rule, each
    gradient of the group by its own: ``(lr / n) sum_l each(tau_l) g_l``. Downpour
    follows Dean et al.'s Algorithm 7.1: with ``step`` a worker's gradients before this
    one, it fetches where ``step mod n_fetch == 0``, steps its own copy by ``-alpha g``
    after each gradient, and pushes its accrued sum where ``step mod n_push == 0``.
    SSP's cached reads follow Ho et al.'s SSPTable (Bosen's ``SSPConsistencyController::
    Get``): a worker at clock c fetches only where its copy's clock (the least clock when
    it was fetched) is below c - bound; otherwise its copy takes its own update.
    """
    group_n = protocol.n if isinstance(protocol, SoftSync) else 1
    bound = protocol.bound if isinstance(protocol, SSP) else None
    cached = isinstance(protocol, SSP) and protocol.reads == "cached"
    n_fetch, n_push, alpha = protocol if isinstance(protocol, Downpour) else (1, 1, 0.0)
    key = jax.random.key_data(jax.random.key(times.seed, impl="threefry2x32"))

    d = functools.cache(lambda i, k: float(duration(times, n, key, jnp.int32(i), jnp.int32(k))))
    grad_fn = jax.jit(jax.grad(loss_fn))

    theta, version = params, 0
    fetched = [params] * n
    fetched_version, tasks, read_clock, own = [0] * n, [0] * n, [0] * n, [None] * n
    arrival = [d(i, 0) for i in range(n)]
    grad = [None] * n
    accrued = [jax.tree.map(jnp.zeros_like, params) for _ in range(n)]
    waiting, group, taus = set(), [], []
    for batch in batches:
        shards = worker_shards(batch, n)
        for i in range(n):
            if grad[i] is None and i not in waiting:
                grad[i] = grad_fn(fetched[i], shards[i])
                fetched[i] = jax.tree.map(lambda p, g: p - alpha * g, fetched[i], grad[i])
        while True:
            t, w = min((arrival[i], i) for i in range(n) if i not in waiting)
            if grad[w] is None:
                break
            step = tasks[w]  # Dean et al.'s step: this worker's gradients before this one
            tasks[w] += 1
            accrued[w] = jax.tree.map(jnp.add, accrued[w], grad[w])
            grad[w] = None
            if step % n_push == 0:
                tau = version - fetched_version[w]
                taus.append(tau)
                weight = 1.0 if each is None else each(tau)
                pushed = jax.tree.map(lambda a, c=weight: c * a, accrued[w])
                group.append((pushed, tau))  # Dean et al.: the sum, Delta w
                accrued[w] = jax.tree.map(jnp.zeros_like, params)
                if len(group) == group_n:
                    g = jax.tree.map(lambda *gs: sum(gs) / group_n, *[g for g, _ in group])
                    s = scale(sum(tau for _, tau in group) / group_n)
                    before = theta
                    theta = jax.tree.map(lambda p, g, s=s: p - lr * s * g, theta, g)
                    own[w] = jax.tree.map(jnp.subtract, theta, before)
                    version += 1
                    group = []
            waiting.add(w)
            for i in sorted(waiting):
                if group or (bound is not None and tasks[i] - min(tasks) > bound):
                    continue
                waiting.discard(i)
                if read_clock[i] < tasks[i] - bound if cached else tasks[i] % n_fetch == 0:
                    fetched[i], fetched_version[i] = theta, version
                    read_clock[i] = min(tasks)
                elif cached:  # read-my-writes: the copy takes its own update
                    fetched[i] = jax.tree.map(jnp.add, fetched[i], own[i])
                    fetched_version[i] += 1
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
    "ssp_1_fresh": (compute_times([1.0, 1.0, 1.0, 3.0]), ssp(1, reads="fresh")),
    "ssp_2_random": (compute_times(1.0, spread=0.8, seed=5), ssp(2)),
    "downpour": (
        compute_times([1.0, 1.0, 2.0, 1.0], spread=0.3, seed=1),
        downpour(3, 2, local_lr=0.3),
    ),
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
        async_sgd(
            loss_fn, optax.adam(0.05), ddl.make_mesh(data=8), compute_time=times, protocol=protocol
        )
        for protocol in ("async", downpour(1, 1))
    )
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


def test_softsync_with_a_scale_scales_each_gradient_by_its_own_staleness(mlp):
    """Zhang et al.'s staleness-aware n-softsync: ``(lr / n) sum_l g_l / tau_l``, which
    differs from scaling the group's mean by its mean staleness where the taus differ."""
    loss_fn, params = mlp
    times = compute_times([1.0, 2.0, 1.0, 3.0])
    batches = make_batches(8, 16)
    protocol = softsync(2, scale="inverse")
    strategy = async_sgd(
        loss_fn, optax.sgd(0.3), ddl.make_mesh(data=4), compute_time=times, protocol=protocol
    )
    state, _ = run(strategy, params, batches)
    inverse = lambda tau: 1 / max(tau, 1)  # noqa: E731
    expected, _ = simulate(loss_fn, 0.3, params, batches, 4, times, softsync(2), each=inverse)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5, rtol=0)
    by_mean, _ = simulate(loss_fn, 0.3, params, batches, 4, times, softsync(2), scale=inverse)
    assert max(np.abs(a - b).max() for a, b in zip(
        jax.tree.leaves(expected), jax.tree.leaves(by_mean), strict=True)) > 1e-3  # fmt: skip


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
                loss_fn,
                optax.sgd(0.05),
                ddl.make_mesh(data=8),
                compute_time=times,
                protocol=protocol,
            )
            cache[protocol] = (strategy, jax.jit(strategy.step))
        strategy, step = cache[protocol]
        state = strategy.init(params)
        key = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
        clock = state.clock._replace(key=jax.device_put(key, state.clock.key.sharding))
        state = state._replace(clock=clock)
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
            loss_fn,
            optax.sgd(0.05),
            ddl.make_mesh(data=8),
            compute_time=times,
            protocol=ssp(bound),
        )
        step = jax.jit(strategy.step, donate_argnums=0)
        state = strategy.init(params)
        for batch in make_batches(6, 16):
            state, metrics = step(state, batch)
            lead = np.asarray(state.clock.tasks) - np.asarray(state.clock.tasks).min()
            assert lead.max() <= bound + 1, lead
            np.testing.assert_array_equal(np.asarray(state.clock.waiting), lead == bound + 1)
            # Ho et al.'s read: every task in flight computes on a copy whose clock (the
            # server's when it was fetched) is at least the task's number minus the bound.
            clock = jax.device_get(state.clock)
            started = ~clock.waiting
            assert np.all(clock.read_clock[started] >= clock.tasks[started] - bound)
            # While a gradient is in flight every other worker can push at most 2s + 1 times.
            assert metrics["staleness_max"] <= 7 * (2 * bound + 1)
            spans.append(lead.max() - bound)

    check()
    assert 1 in spans  # the bound is reached: the check above is tight


def test_ssp_cached_reads_are_staler_than_fresh_ones(mlp, random_times_run):
    """Ho et al.'s cached copy misses the updates that arrive while it serves; a fresh
    fetch before every gradient does not: the same bound, staler gradients."""

    def mean_staleness(history):
        return sum(h["staleness_mean"] * h["pushes"] for h in history) / sum(
            h["pushes"] for h in history
        )

    cached = mean_staleness(random_times_run(mlp, ssp(1), 2))
    fresh = mean_staleness(random_times_run(mlp, ssp(1, reads="fresh"), 2))
    assert cached > fresh + 0.25, (cached, fresh)


def test_same_seed_same_trajectory_other_seed_another(mlp, random_times_run):
    # ssp(1): the step the test above compiled, run from other seeds
    first, again = random_times_run(mlp, ssp(1), 5), random_times_run(mlp, ssp(1), 5)
    other = random_times_run(mlp, ssp(1), 6)
    assert first == again
    assert [h["wall_clock"] for h in first] != [h["wall_clock"] for h in other]


def test_state_placement(mlp):
    loss_fn, params = mlp
    mesh = ddl.make_mesh(data=8)
    spec = lambda tree: {x.sharding.spec for x in jax.tree.leaves(tree)}  # noqa: E731
    state = async_sgd(loss_fn, optax.adam(0.1), mesh, protocol=softsync(2)).init(params)
    assert spec(state.params) == spec(state.opt_state) == spec(state.protocol.gradient) == {P()}
    assert spec(state.workers.params) == spec(state.workers.gradient) == {P("data")}
    assert spec(state.clock.arrival) == spec(state.clock.tasks) == spec(state.clock.key) == {P()}
    # Downpour's server is sharded: device i holds the i-th slice of the flat parameters.
    strategy = async_sgd(loss_fn, optax.adam(0.1), mesh, protocol=downpour(2, 2, local_lr=0.1))
    state = strategy.init(params)
    size = sum(x.size for x in jax.tree.leaves(params))
    assert state.params.shape == (8, -(-size // 8))
    assert (
        spec(state.params) == spec(state.opt_state) == spec(state.protocol.gradient) == {P("data")}
    )
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
        ({"compute_time": 0.0}, "a worker with compute time 0 would push without end"),
        ({"compute_time": [1.0] * 7 + [0.0], "protocol": softsync(2)}, "or bound it with"),
        ({"compute_time": "fast"}, "compute_time base must be a number .* got 'fast'"),
        ({"compute_time": ["1"] * 7 + ["a"]}, "compute_time base must be a number"),
    ],
)
def test_bad_arguments_raise_clear_errors(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), **kwargs)


@pytest.mark.parametrize("decay", [-1.0, "x", float("nan")])
def test_softsync_refuses_a_bad_decay_with_or_without_a_scale(decay):
    for scale in (None, "exp"):
        with pytest.raises(ValueError, match="softsync decay must be a finite real number >= 0"):
            softsync(2, scale=scale, decay=decay)


def test_protocol_of_the_wrong_type_raises(mlp):
    loss_fn, _ = mlp
    with pytest.raises(TypeError, match="protocol must be 'async'"):
        async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), protocol=2)


def test_docstring_example_runs():
    (test,) = doctest.DocTestFinder().find(async_sgd, "async_sgd")
    assert doctest.DocTestRunner().run(test).failed == 0


def plain_schedule(n, times, protocol, steps):
    """The event clock alone, one event at a time in plain Python (times in float32).

    Returns per step ``(computes, events, clock)``: the workers that compute, each
    processed arrival as ``(worker, time, tau or None, update_tau or None, started,
    fetched)``, and the clock after the step. SSP's cached reads as in ``simulate``.
    """
    group_n = protocol.n if isinstance(protocol, SoftSync) else 1
    bound = protocol.bound if isinstance(protocol, SSP) else None
    cached = isinstance(protocol, SSP) and protocol.reads == "cached"
    n_fetch, n_push, _ = protocol if isinstance(protocol, Downpour) else (1, 1, 0.0)
    key = jax.random.key_data(jax.random.key(times.seed, impl="threefry2x32"))
    d = functools.cache(
        lambda i, k: np.float32(duration(times, n, key, jnp.int32(i), jnp.int32(k)))
    )
    version, fetched_version, tasks, read_clock = 0, [0] * n, [0] * n, [0] * n
    arrival, ready, waiting, group, now = [d(i, 0) for i in range(n)], [False] * n, set(), [], 0
    log = []
    for _ in range(steps):
        computes = [not ready[i] and i not in waiting for i in range(n)]
        ready = [r or i not in waiting for i, r in enumerate(ready)]
        events = []
        while True:
            now, w = min((arrival[i], i) for i in range(n) if i not in waiting)
            if not ready[w]:
                break
            step = tasks[w]  # Dean et al.'s step: this worker's gradients before this one
            ready[w], tasks[w], tau, update = False, tasks[w] + 1, None, None
            if step % n_push == 0:
                tau = version - fetched_version[w]
                group.append(tau)
                if len(group) == group_n:
                    update, version, group = sum(group) / group_n, version + 1, []
            waiting.add(w)
            started, fetched = [], []
            for i in sorted(waiting):
                if group or (bound is not None and tasks[i] - min(tasks) > bound):
                    continue
                waiting.discard(i)
                started.append(i)
                if read_clock[i] < tasks[i] - bound if cached else tasks[i] % n_fetch == 0:
                    fetched.append(i)
                    fetched_version[i], read_clock[i] = version, min(tasks)
                elif cached:  # its own update is in its copy
                    fetched_version[i] += 1
                arrival[i] = np.float32(now + d(i, tasks[i]))
            events.append((w, now, tau, update, started, fetched))
        clock = {
            "arrival": list(arrival),
            "fetched_version": list(fetched_version),
            "tasks": list(tasks),
            "ready": list(ready),
            "waiting": [i in waiting for i in range(n)],
            "version": version,
            "group_count": len(group),
            "group_staleness": sum(group),
            "read_clock": list(read_clock),
        }
        log.append((computes, events, clock))
    return log


SCHEDULES = {
    "async_random_5": (5, compute_times(1.0, spread=0.7, seed=3), "async"),
    "async_equal_3": (3, compute_times(1.0), "async"),
    "softsync_2_of_4": (4, compute_times([1.0, 2.0, 1.0, 3.0]), softsync(2)),
    "softsync_3_of_6_random": (6, compute_times(1.0, spread=0.5, seed=4), softsync(3)),
    "softsync_4_of_4_equal": (4, compute_times(1.0), softsync(4)),
    "ssp_0_of_3": (3, compute_times([1.0, 2.0, 0.5]), ssp(0)),
    "ssp_1_straggler": (4, compute_times([1.0, 1.0, 1.0, 3.0]), ssp(1)),
    "ssp_2_random_8": (8, compute_times([1.0] * 6 + [2.0, 5.0], spread=0.8, seed=1), ssp(2)),
    "ssp_1_fresh": (4, compute_times([1.0, 1.0, 1.0, 3.0]), ssp(1, reads="fresh")),
    "downpour_3_2": (
        4,
        compute_times([1.0, 1.0, 2.0, 1.0], spread=0.3, seed=1),
        downpour(3, 2, local_lr=0.1),
    ),
    "downpour_1_3": (5, compute_times(1.0, spread=0.4, seed=9), downpour(1, 3)),
}


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_event_clock_equals_a_plain_schedule_without_a_mesh(case):
    """The pure event clock, alone (no mesh, no model), against plain Python."""
    n, times, protocol = SCHEDULES[case]
    rules = ev.Rules.of(protocol)
    step = jax.jit(lambda clock: ev.step_clock(clock, rules, times))
    clock = ev.initial_clock(times, n)
    expected = plain_schedule(n, times, protocol, steps=12)
    for computes, events, plain in expected:
        clock, got_computes, got, last = step(clock)
        assert last.tolist() == ev.last_fetch(got).tolist()
        got = jax.device_get(got)
        assert got_computes.tolist() == computes
        happened = np.flatnonzero(got.happens)
        assert happened.tolist() == list(range(len(events)))  # the empty events come last
        assert 1 <= len(events) <= n
        for j, (w, _, tau, update, started, fetched) in enumerate(events):
            assert got.worker[j] == w and got.push[j] == (tau is not None)
            assert got.staleness[j] == (tau or 0) and got.apply[j] == (update is not None)
            np.testing.assert_allclose(got.update_staleness[j], update or 0, rtol=1e-6)
            assert np.flatnonzero(got.start[j]).tolist() == started
            assert np.flatnonzero(got.fetch[j]).tolist() == fetched
        # Times to an ulp: XLA's jitted exp may round the durations differently.
        np.testing.assert_allclose(clock.now, events[-1][1], rtol=1e-6)
        np.testing.assert_allclose(clock.arrival, plain.pop("arrival"), rtol=1e-6)
        for name, value in plain.items():
            np.testing.assert_array_equal(getattr(clock, name), value, err_msg=name)
        summary = ev.summarize(got)
        taus = [e[2] for e in events if e[2] is not None]
        assert summary.pushes == len(taus) and summary.staleness_max == max(taus, default=0)


IN_ORDER = {  # protocols without the SSP bound or churn: (n, times, protocol, drop)
    "one_worker": (1, compute_times(1.0), "async", 0.0),
    "equal_times_all_tied": (5, compute_times(1.0), "async", 0.0),
    "second_arrivals_tie_first_ones": (4, compute_times([2.0, 1.0, 2.0, 1.0]), "async", 0.0),
    "zero_times": (4, compute_times([0.0, 1.0, 0.0, 2.0]), "async", 0.0),
    "random_8": (8, compute_times(1.0, spread=0.8, seed=3), "async", 0.0),
    "stragglers_drop": (7, compute_times([1.0] * 5 + [3.0, 0.5], spread=0.2), "async", 0.4),
    "downpour_3_2_drop": (
        5,
        compute_times(1.0, spread=0.5, seed=2),
        downpour(3, 2, local_lr=0.1),
        0.2,
    ),
    "downpour_1_3_16": (16, compute_times(1.0, spread=0.3, seed=9), downpour(1, 3), 0.0),
    "softsync_1": (6, compute_times(1.0, spread=0.6, seed=5), softsync(1), 0.1),
    "softsync_2_random": (6, compute_times(1.0, spread=0.6, seed=5), softsync(2), 0.0),
    "softsync_3_stragglers_drop": (
        7,
        compute_times([1.0] * 5 + [3.0, 0.5], spread=0.3),
        softsync(3),
        0.3,
    ),
    "softsync_4_equal": (4, compute_times(1.0), softsync(4), 0.0),
    "softsync_4_of_8_tied": (8, compute_times([2.0, 1.0] * 4), softsync(4), 0.2),
    "softsync_5_of_16": (16, compute_times(1.0, spread=0.8, seed=1), softsync(5), 0.1),
    "ssp_0": (5, compute_times(1.0, spread=0.6, seed=4), ssp(0), 0.0),
    "ssp_1_straggler": (6, compute_times([1.0] * 5 + [3.0]), ssp(1), 0.0),
    "ssp_2_random_drop": (
        8,
        compute_times([1.0] * 6 + [2.0, 5.0], spread=0.8, seed=1),
        ssp(2),
        0.3,
    ),
    "ssp_3_of_16": (16, compute_times(1.0, spread=1.0, seed=7), ssp(3), 0.1),
    "ssp_2_fresh_drop": (8, compute_times(1.0, spread=0.8, seed=1), ssp(2, reads="fresh"), 0.3),
    # churn: workers leave after a task and return ``away`` later, within a step or after
    "churn": (8, compute_times(1.0, spread=0.5, seed=2), "async", 0.0, churn(0.3, 2.5)),
    "churn_short_away": (6, compute_times(1.0, spread=0.5), "async", 0.2, churn(0.4, 0.3)),
    "churn_equal_times": (5, compute_times(1.0), "async", 0.0, churn(0.5, 1.0)),
    "churn_back_at_once": (5, compute_times([1.0] * 4 + [0.0]), ssp(1), 0.0, churn(0.5, 0.0)),
    "ssp_0_churn_held_on_return": (
        6,
        compute_times(1.0, spread=0.6, seed=3),
        ssp(0),
        0.0,
        churn(0.5, 0.5),
    ),
    "softsync_4_churn_held_on_return": (
        8,
        compute_times(1.0, spread=0.6, seed=4),
        softsync(4),
        0.0,
        churn(0.5, 0.2),
    ),
    "softsync_2_churn_drop": (
        8,
        compute_times(1.0, spread=0.5, seed=3),
        softsync(2),
        0.2,
        churn(0.3, 1.5),
    ),
    "ssp_1_churn": (7, compute_times([1.0] * 6 + [2.0], spread=0.3), ssp(1), 0.0, churn(0.2, 2.0)),
    "downpour_3_2_churn": (
        6,
        compute_times(1.0, spread=0.4, seed=6),
        downpour(3, 2, local_lr=0.1),
        0.1,
        churn(0.3, 1.0),
    ),
    "softsync_3_of_16_churn": (
        16,
        compute_times(1.0, spread=0.8, seed=8),
        softsync(3),
        0.1,
        churn(0.2, 0.7),
    ),
}


@pytest.mark.parametrize("case", sorted(IN_ORDER))
def test_events_in_arrival_order_are_the_scanned_ones(case):
    """A step computed at once from the arrivals' order: the same clock and events,
    bitwise, as taking them one at a time, and each worker's last fetch."""
    n, times, protocol, drop, *away = IN_ORDER[case]
    rules = ev.Rules.of(as_protocol(protocol, n), drop, *away)

    def both(clock):
        started, _ = ev.start_step(clock)
        drawn = ev.draws(started, rules, times)
        return ev.events_in_order(started, rules, drawn), ev.scanned_events(started, rules, drawn)

    step, clock, happened = jax.jit(both), ev.initial_clock(times, n), []
    for _ in range(10):
        (got, events, last), (expected, their_events) = step(clock)
        chex.assert_trees_all_equal(got, expected)
        chex.assert_trees_all_equal(events, their_events)
        assert last.tolist() == ev.last_fetch(their_events).tolist()
        happened.append(int(events.happens.sum()))
        clock = got
    assert min(happened) >= 1  # a step always has an event; most have several
    assert max(happened) > 1 or case in ("one_worker", "zero_times")


def counting_loss(seed=7):
    """A ModelLoss by hand: its state counts batches and keeps a running mean of ``x``, which
    the loss centres with; dropout keeps each input with probability 1/2 (scaled by 2)."""

    def fn(params, state, batch, key):
        stats = state["stats"]
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        x = jnp.where(keep, 2 * batch["x"], 0.0) - stats["mean"]
        loss = jnp.mean((x @ params["w"] + params["b"] - batch["y"]) ** 2)
        count = stats["count"] + 1
        mean = stats["mean"] + (batch["x"].mean(0) - stats["mean"]) / count
        return loss, {"stats": {"count": count, "mean": mean}}

    variables = {
        "params": {"w": jnp.full(3, 0.1), "b": jnp.zeros(())},
        "stats": {"count": jnp.zeros((), jnp.int32), "mean": jnp.zeros(3)},
    }
    return ddl.ModelLoss(fn, seed=seed), variables


def regression_batches(count, size, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 1.0, (count, size, 3)).astype(np.float32)
    y = rng.normal(size=(count, size)).astype(np.float32)
    return [{"x": x[i], "y": y[i]} for i in range(count)]


@pytest.mark.parametrize("case", ["async", "ssp_cached", "ssp_cached_sharded"])
def test_model_state_and_dropout_on_one_worker_equal_a_hand_written_loop(case):
    """One async worker: fetch (params, state), gradient and new state with the key of
    task k, push both; the server takes the state with the update. Under SSP's cached
    reads with a bound it never reaches, the worker never fetches: its copy takes its own
    update and keeps the state it pushed, which is the same run."""
    loss, variables = counting_loss()
    batches = regression_batches(4, 8)
    protocol, server = {
        "async": ("async", None),
        "ssp_cached": (ssp(8), None),
        "ssp_cached_sharded": (ssp(8), "sharded"),
    }[case]
    strategy = async_sgd(loss, optax.sgd(0.1), ddl.make_mesh(data=1), protocol=protocol,
                         server=server)  # fmt: skip
    state, history = run(strategy, variables, batches)
    if case != "async":  # fetched at the start only, version 0 at clock 0
        assert state.clock.read_clock.tolist() == [0] and state.clock.tasks.tolist() == [4]
        assert state.clock.fetched_version.tolist() == [4]  # its own 4 updates
    base = jax.random.key(7, impl="threefry2x32")
    grad_fn = jax.jit(jax.value_and_grad(loss.fn, has_aux=True))
    params, model_state = variables["params"], {"stats": variables["stats"]}
    for k, batch in enumerate(batches):
        key = jax.random.fold_in(jax.random.fold_in(base, k), 0)
        (value, model_state), grads = grad_fn(params, model_state, batch, key)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        np.testing.assert_allclose(history[k]["loss"], value, rtol=1e-6)
    got = strategy.params(state)
    chex.assert_trees_all_close(got, {"params": params, **model_state}, atol=1e-6, rtol=0)
    assert got["stats"]["count"] == 4 and state.model.step == 4


def test_softsync_n_model_state_is_the_mean_of_the_workers():
    """softsync(N), equal times: each step every worker computes on the server's (params,
    state) with its own key and shard; the server's state becomes the workers' mean."""
    n = 8
    loss, variables = counting_loss(seed=3)
    batches = regression_batches(2, 4 * n)
    strategy = async_sgd(loss, optax.sgd(0.1), ddl.make_mesh(data=n), protocol=softsync(n))
    state, _ = run(strategy, variables, batches)
    base = jax.random.key(3, impl="threefry2x32")
    grad_fn = jax.jit(jax.grad(loss.fn, has_aux=True))
    params, model_state = variables["params"], {"stats": variables["stats"]}
    for k, batch in enumerate(batches):
        keys = [jax.random.fold_in(jax.random.fold_in(base, k), w) for w in range(n)]
        outs = [
            grad_fn(params, model_state, s, key)
            for s, key in zip(worker_shards(batch, n), keys, strict=True)
        ]
        means = [o[1]["stats"]["mean"] for o in outs]
        assert not np.allclose(means[0], means[1])  # the workers' states differ
        grads = jax.tree.map(lambda *g: sum(g) / n, *[o[0] for o in outs])
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        model_state = {"stats": {"count": jnp.int32(k + 1), "mean": sum(means) / n}}
    chex.assert_trees_all_close(
        strategy.params(state), {"params": params, **model_state}, atol=1e-5, rtol=0
    )
    # Every worker has fetched the new server state for its next task.
    fetched = jax.tree.map(lambda x: x[3], jax.device_get(state.workers.model_state))
    chex.assert_trees_all_equal(fetched, {"stats": strategy.params(state)["stats"]})


def test_downpour_1_1_carries_model_state_as_async_does():
    """The sharded server keeps the model state of the latest push, as plain async does."""
    loss, variables = counting_loss()
    times = compute_times(1.0, spread=0.7, seed=2)
    batches = regression_batches(4, 32)
    plain, sharded = (
        async_sgd(loss, optax.sgd(0.05), ddl.make_mesh(data=8), compute_time=times, protocol=p)
        for p in ("async", downpour(1, 1))
    )
    plain_state, plain_history = run(plain, variables, batches)
    sharded_state, sharded_history = run(sharded, variables, batches)
    assert max(h["staleness_max"] for h in plain_history) > 1
    chex.assert_trees_all_close(
        sharded.params(sharded_state), plain.params(plain_state), atol=1e-6, rtol=0
    )
    assert plain.params(plain_state)["stats"]["count"] > 1
    chex.assert_trees_all_close(sharded_history, plain_history, atol=1e-6, rtol=0)


def test_model_state_with_unequal_times_follows_tasks_not_steps():
    """Async, two workers at speeds 1 and 2.5: worker w's k-th task draws key (k, w) (its
    task count, not the step), computes on the state it fetched, and the server's state is
    the latest push's. A hand-written event loop for plain async."""
    loss, variables = counting_loss(seed=5)
    batches = regression_batches(6, 8)
    strategy = async_sgd(loss, optax.sgd(0.1), ddl.make_mesh(data=2), compute_time=[1.0, 2.5])
    state, history = run(strategy, variables, batches)
    base = jax.random.key(5, impl="threefry2x32")
    grad_fn = jax.jit(jax.grad(loss.fn, has_aux=True))
    server = (variables["params"], {"stats": variables["stats"]})
    fetched, arrival, tasks, pending = [server] * 2, [1.0, 2.5], [0, 0], [None, None]
    for batch in batches:
        for w, shard in enumerate(worker_shards(batch, 2)):
            if pending[w] is None:
                key = jax.random.fold_in(jax.random.fold_in(base, tasks[w]), w)
                pending[w] = grad_fn(*fetched[w], shard, key)
        while pending[w := min((0, 1), key=lambda i: (arrival[i], i))] is not None:
            (grads, model_state), pending[w], tasks[w] = pending[w], None, tasks[w] + 1
            params = jax.tree.map(lambda p, g: p - 0.1 * g, server[0], grads)
            server = fetched[w] = (params, model_state)
            arrival[w] += [1.0, 2.5][w]
    assert tasks == [6, 2] and history[-1]["wall_clock"] == 6.0
    chex.assert_trees_all_close(
        strategy.params(state), {"params": server[0], **server[1]}, atol=1e-6, rtol=0
    )
