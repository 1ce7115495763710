"""async_sgd with lost pushes and churn, against a plain-Python scheduler; replica_lag."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, worker_shards
from jax import lax

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
    softsync,
    ssp,
)


def plain(n, times, protocol, steps, drop=0.0, leave=0.0, away=0.0, model=None):
    """The event model with faults, one event at a time in plain Python (times float32).

    A softsync group is a list of (worker, gradient, tau); a waiting worker is held while
    its push is in it. ``model = (loss_fn, lr, params, batches)`` also replays SGD on
    the parameters. Returns per step ``(computes, events)``, the final clock as a dict,
    and the final server params.
    """
    group_n = protocol.n if isinstance(protocol, SoftSync) else 1
    bound = protocol.bound if isinstance(protocol, SSP) else None
    cached = isinstance(protocol, SSP) and protocol.reads == "cached"
    n_fetch, n_push, alpha = protocol if isinstance(protocol, Downpour) else (1, 1, 0.0)
    key = jax.random.key_data(jax.random.key(times.seed, impl="threefry2x32"))
    d = functools.cache(
        lambda i, k: np.float32(duration(times, n, key, jnp.int32(i), jnp.int32(k)))
    )
    flip = functools.cache(lambda s, i, k, p: bool(ev.coin(key, s, jnp.int32(i), jnp.int32(k), p)))
    loss_fn, lr, theta, batches = model or (None, 0.0, {"w": jnp.zeros(())}, [None] * steps)
    grad_fn = jax.jit(jax.grad(loss_fn)) if loss_fn else None
    zero = jax.tree.map(jnp.zeros_like, theta)
    version, fetched_version, tasks, fetched = 0, [0] * n, [0] * n, [theta] * n
    read_clock, own = [0] * n, [None] * n  # SSP's cached reads (Ho et al.)
    arrival, ready, waiting, gone, group = (
        [d(i, 0) for i in range(n)],
        [False] * n,
        set(),
        set(),
        [],
    )
    grad, accrued, log = [zero] * n, [zero] * n, []
    for batch in batches:
        computes = [not ready[i] and i not in waiting and i not in gone for i in range(n)]
        for i in np.flatnonzero(computes):
            if grad_fn:
                grad[i] = grad_fn(fetched[i], worker_shards(batch, n)[i])
                # Dean et al.'s Algorithm 7.1: the worker steps its own copy
                fetched[i] = jax.tree.map(lambda p, g: p - alpha * g, fetched[i], grad[i])
            ready[i] = True
        events = []
        while True:
            now, w = min((arrival[i], i) for i in range(n) if i not in waiting)
            rejoin = w in gone
            if not (ready[w] or rejoin):
                break
            tau = update = None
            lost = leaves = False
            if rejoin:
                gone.discard(w)
            else:
                k, ready[w], tasks[w] = tasks[w], False, tasks[w] + 1
                accrued[w] = jax.tree.map(jnp.add, accrued[w], grad[w])
                own[w] = None  # a lost push's update is nowhere
                if k % n_push == 0:  # Dean et al.'s step mod n_push, k counting from 0
                    lost = flip(ev.DROP, w, k, drop)
                    if not lost:
                        tau = version - fetched_version[w]
                        group.append((w, accrued[w], tau))
                    accrued[w] = zero
                    if len(group) == group_n:
                        g = jax.tree.map(lambda *gs: sum(gs) / group_n, *[e[1] for e in group])
                        before = theta
                        theta = jax.tree.map(lambda p, g: p - lr * g, theta, g)
                        own[w] = jax.tree.map(jnp.subtract, theta, before)
                        update, version, group = sum(e[2] for e in group) / group_n, version + 1, []
                leaves = flip(ev.LEAVE, w, tasks[w], leave)
            if leaves:
                gone.add(w)
                arrival[w] = np.float32(now + np.float32(away))
            else:
                waiting.add(w)
            held = {e[0] for e in group}
            started, fetched_now = [], []
            for i in sorted(waiting):
                if i in held or (bound is not None and tasks[i] - min(tasks) > bound):
                    continue
                waiting.discard(i)
                started.append(i)
                due = read_clock[i] < tasks[i] - bound if cached else tasks[i] % n_fetch == 0
                if due or (i == w and rejoin):
                    fetched_now.append(i)
                    fetched[i], fetched_version[i], read_clock[i] = theta, version, min(tasks)
                elif cached and own[i] is not None:  # read-my-writes: its own update
                    fetched[i] = jax.tree.map(jnp.add, fetched[i], own[i])
                    fetched_version[i] += 1
                arrival[i] = np.float32(now + d(i, tasks[i]))
            events.append((w, now, tau, update, started, fetched_now, lost, rejoin, leaves))
        log.append((computes, events))
    clock = {
        "fetched_version": fetched_version,
        "tasks": tasks,
        "waiting": [i in waiting for i in range(n)],
        "away": [i in gone for i in range(n)],
        "version": version,
        "group_count": len(group),
        "read_clock": read_clock,
    }
    return log, clock, theta


SCHEDULES = {
    "async_drop": (5, compute_times(1.0, spread=0.7, seed=3), "async", 0.3, 0.0, 0.0),
    "async_churn": (4, compute_times(1.0, spread=0.5, seed=2), "async", 0.0, 0.3, 2.5),
    "softsync_2_drop_churn": (4, compute_times([1.0, 2.0, 1.0, 3.0]), softsync(2), 0.3, 0.2, 1.5),
    "softsync_4_drop": (4, compute_times(1.0), softsync(4), 0.25, 0.0, 0.0),
    "softsync_3_all_leave": (3, compute_times(1.0, spread=0.3, seed=5), softsync(3), 0.0, 1.0, 0.5),
    "ssp_1_drop_churn": (4, compute_times([1.0, 1.0, 1.0, 3.0]), ssp(1), 0.2, 0.3, 4.0),
    "ssp_2_fresh_drop_churn": (
        5,
        compute_times(1.0, spread=0.6, seed=4),
        ssp(2, reads="fresh"),
        0.3,
        0.2,
        1.5,
    ),
    "downpour_drop_churn": (
        4,
        compute_times([1.0, 1.0, 2.0, 1.0], spread=0.3, seed=1),
        downpour(3, 2, local_lr=0.1),
        0.4,
        0.2,
        2.0,
    ),
}


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_event_clock_with_faults_equals_a_plain_schedule(case):
    n, times, protocol, drop, leave, away = SCHEDULES[case]
    rules = ev.Rules.of(protocol, drop, churn(leave, away))
    step = jax.jit(lambda clock: ev.step_clock(clock, rules, times))
    clock = ev.initial_clock(times, n)
    log, final, _ = plain(n, times, protocol, 14, drop, leave, away)
    seen = {"lost": 0, "rejoin": 0, "leave": 0}
    for computes, events in log:
        clock, got_computes, got, last = step(clock)
        assert last.tolist() == ev.last_fetch(got).tolist()
        got = jax.device_get(got)
        assert got_computes.tolist() == computes
        assert np.flatnonzero(got.happens).tolist() == list(range(len(events)))
        for j, (w, _, tau, update, started, fetched, lost, rejoin, leaves) in enumerate(events):
            assert got.worker[j] == w and got.push[j] == (tau is not None)
            assert got.staleness[j] == (tau or 0) and got.apply[j] == (update is not None)
            np.testing.assert_allclose(got.update_staleness[j], update or 0, rtol=1e-6)
            assert np.flatnonzero(got.start[j]).tolist() == started
            assert np.flatnonzero(got.fetch[j]).tolist() == fetched
            assert (got.lost[j], got.rejoin[j], got.leave[j]) == (lost, rejoin, leaves)
            seen["lost"] += lost
            seen["rejoin"] += rejoin
            seen["leave"] += leaves
        np.testing.assert_allclose(clock.now, events[-1][1], rtol=1e-6)
    for name, value in final.items():
        np.testing.assert_array_equal(getattr(clock, name), value, err_msg=name)
    # Every fault that the case turns on does happen.
    assert (seen["lost"] > 0) == (drop > 0)
    assert (seen["leave"] > 0) == (leave > 0) and (seen["rejoin"] > 0) == (leave > 0)
    assert (got.lost <= got.happens).all()


def test_no_fault_is_the_same_clock():
    """drop = 0 and leave = 0 give the clock of the rules without faults, bitwise."""
    times = compute_times(1.0, spread=0.7, seed=3)
    for protocol in (softsync(2), downpour(2, 3, local_lr=0.1)):
        runs = []
        for faults in ((), (0.0, churn(0.0, 3.0))):
            rules = ev.Rules.of(as_protocol(protocol, 4), *faults)
            steps = jax.jit(
                lambda c, rules=rules: lax.scan(
                    lambda c, _: (ev.step_clock(c, rules, times)[0], c), c, None, length=6
                )
            )
            runs.append(steps(ev.initial_clock(times, 4)))
        chex.assert_trees_all_equal(*runs)


def test_drop_zero_is_bitwise_the_path_without_the_option(mlp):
    loss_fn, params = mlp
    times = compute_times([1.0, 1.5, 1.0, 2.0], spread=0.4, seed=1)
    batches = make_batches(4, 16)
    out = []
    for kwargs in ({}, {"drop": 0.0, "churn": None}):
        strategy = async_sgd(
            loss_fn, optax.adam(0.05), ddl.make_mesh(data=4), compute_time=times, **kwargs
        )
        state, step, history = strategy.init(params), jax.jit(strategy.step), []
        for batch in batches:
            state, metrics = step(state, batch)
            history.append(jax.device_get(metrics))
        out.append((jax.device_get(strategy.params(state)), history))
    chex.assert_trees_all_equal(*out)
    assert "pushes_lost" not in out[0][1][0] and "workers_away" not in out[0][1][0]


def test_softsync_n_with_lost_pushes_is_synchronous_sgd_redoing_the_lost_gradients(mlp):
    """softsync(N), equal times, drop = p: every update is the mean of N gradients taken
    on the same parameters (staleness 0); a worker whose push is lost computes again, on
    its shard of the next batch, and the others wait. Reference from the same drop mask."""
    loss_fn, params = mlp
    n, lr, batches = 4, 0.3, make_batches(8, 16)
    times = compute_times(1.0, seed=11)
    strategy = async_sgd(
        loss_fn,
        optax.sgd(lr),
        ddl.make_mesh(data=n),
        compute_time=times,
        protocol=softsync(n),
        drop=0.3,
    )
    step, state, history = jax.jit(strategy.step), strategy.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    key = jax.random.key_data(jax.random.key(11, impl="threefry2x32"))
    grad_fn = jax.jit(jax.grad(loss_fn))
    theta, tasks, due, group, lost_total = params, [0] * n, set(range(n)), {}, 0
    for batch in batches:
        for w in sorted(due):
            g = grad_fn(theta, worker_shards(batch, n)[w])
            lost = bool(ev.coin(key, ev.DROP, jnp.int32(w), jnp.int32(tasks[w]), 0.3))
            tasks[w], lost_total = tasks[w] + 1, lost_total + lost
            if not lost:
                group[w] = g
        due = set(range(n)) - set(group)
        if not due:
            mean = jax.tree.map(lambda *g: sum(g) / n, *group.values())
            theta = jax.tree.map(lambda p, g: p - lr * g, theta, mean)
            due, group = set(range(n)), {}
    assert lost_total >= 2 and sum(h["pushes_lost"] for h in history) == lost_total
    assert all(h["staleness_max"] == 0 and h["replica_lag"] == 0 for h in history)
    chex.assert_trees_all_close(strategy.params(state), theta, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["async", "downpour", "ssp"])
def test_trajectory_with_faults_equals_the_plain_simulation(mlp, case):
    loss_fn, params = mlp
    times, protocol = {
        "async": (compute_times(1.0, spread=0.6, seed=4), "async"),
        "ssp": (compute_times([1.0, 1.0, 1.0, 3.0], spread=0.4, seed=2), ssp(1)),
        "downpour": (
            compute_times([1.0, 1.0, 2.0, 1.0], spread=0.3, seed=1),
            downpour(2, 2, local_lr=0.1),
        ),
    }[case]
    batches = make_batches(8, 16)
    strategy = async_sgd(
        loss_fn,
        optax.sgd(0.3),
        ddl.make_mesh(data=4),
        compute_time=times,
        protocol=protocol,
        drop=0.3,
        churn=churn(leave=0.3, away=1.7),
    )
    step, state, history = jax.jit(strategy.step), strategy.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    log, final, theta = plain(4, times, protocol, 8, 0.3, 0.3, 1.7, (loss_fn, 0.3, params, batches))
    chex.assert_trees_all_close(strategy.params(state), theta, atol=1e-5, rtol=0)
    for h, (_, events) in zip(history, log, strict=True):
        assert h["pushes"] == sum(e[2] is not None for e in events)
        assert h["pushes_lost"] == sum(e[6] for e in events)
    assert sum(h["pushes_lost"] for h in history) > 0
    assert sum(e[8] for _, events in log for e in events) > 0  # workers did leave
    assert history[-1]["workers_away"] == sum(final["away"])
    lag = np.mean([final["version"] - v for v in final["fetched_version"]])
    np.testing.assert_allclose(history[-1]["replica_lag"], lag, rtol=1e-6)


def test_replica_lag_of_plain_async_with_equal_workers():
    """N equal async workers: after each step every worker but the last to push has
    fetched before the others' updates, so the lags are 0..N-1 behind: mean (N - 1) / 2."""
    n, times = 4, compute_times(1.0)
    rules = ev.Rules.of(as_protocol("async", n))
    clock, step = ev.initial_clock(times, n), jax.jit(lambda c: ev.step_clock(c, rules, times))
    for _ in range(3):
        clock, *_ = step(clock)
        assert float(ev.replica_lag(clock)) == (n - 1) / 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"drop": 1.5}, r"drop must be a probability in \[0, 1\), got 1.5"),
        ({"drop": -0.1}, "drop must be"),
        ({"churn": churn(0.1, 1.0)._replace(leave=2.0)}, "churn leave must be"),
        ({"churn": (0.1, 1.0)}, "churn must be None or ddl.churn"),
    ],
)
def test_bad_fault_arguments_raise(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        async_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4), **kwargs)


def test_churn_checks_its_arguments():
    with pytest.raises(ValueError, match="churn away must be"):
        churn(0.1, -1.0)
    with pytest.raises(ValueError, match="churn leave must be"):
        churn(1.1, 1.0)
