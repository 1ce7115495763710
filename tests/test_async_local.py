"""async_sgd(protocol=async_local(H)): plain async at H = 1, a plain-Python event loop."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, train_steps, worker_shards

import ddl_jax as ddl
from ddl_jax._src.strategies.asynchronous import events as ev
from ddl_jax._src.strategies.asynchronous.delayed_nesterov import delayed_nesterov
from ddl_jax._src.strategies.asynchronous.sgd import async_sgd
from ddl_jax._src.strategies.asynchronous.staleness import (
    AsyncLocal,
    as_protocol,
    async_local,
    churn,
    compute_times,
    softsync,
)


def test_one_inner_sgd_step_pushed_to_outer_sgd_one_is_plain_async(mlp):
    """H = 1, inner sgd(lr), outer sgd(1): the pseudo-gradient is lr * g, so the server
    takes plain async's step theta - lr * g (to float rounding), faults included."""
    loss_fn, params = mlp
    faults = {"drop": 0.3, "churn": churn(0.3, 1.5)}
    times = compute_times([1.0, 2.0, 1.5], spread=0.5, seed=3)
    batches = make_batches(6, 12)
    mesh = ddl.make_mesh(data=3)
    plain = async_sgd(loss_fn, optax.sgd(0.3), mesh, compute_time=times, **faults)
    local = async_sgd(
        loss_fn,
        optax.sgd(1.0),
        mesh,
        compute_time=times,
        protocol=async_local(1),
        inner_optimizer=optax.sgd(0.3),
        **faults,
    )
    plain_state, plain_history = train_steps(plain, params, batches)
    local_state, local_history = train_steps(local, params, batches)
    assert max(h["staleness_max"] for h in plain_history) > 1
    assert sum(h["pushes_lost"] for h in plain_history) > 0
    assert max(h["workers_away"] for h in plain_history) > 0
    chex.assert_trees_all_close(local.params(local_state), plain.params(plain_state), atol=1e-6)
    chex.assert_trees_all_close(local_history, plain_history, atol=1e-6, rtol=1e-6)


def reference(loss_fn, inner, outer, params, batches, base, steps, reset):
    """Asynchronous local SGD, one event at a time in plain Python.

    Per step: every worker without a pseudo-gradient (all of them: under plain async a
    worker restarts at its arrival) takes H inner steps from what it fetched on the H
    consecutive parts of its shard; then arrivals in (time, worker) order until one has
    nothing computed: the server applies the pseudo-gradient with the outer optimizer and
    the worker fetches at once, its next arrival H * base later. Returns per step the
    server params and the metrics, and the workers' final inner states.
    """
    n = len(base)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    theta, outer_state, version = params, outer.init(params), 0
    fetched, fetched_version = [params] * n, [0] * n
    inner_state = [inner.init(params)] * n
    arrival = [np.float32(steps * b) for b in base]
    pending, log = [None] * n, []
    for batch in batches:
        losses = []
        for i, shard in enumerate(worker_shards(batch, n)):
            if pending[i] is None:
                local = fetched[i]
                state = inner.init(local) if reset else inner_state[i]
                for part in worker_shards(shard, steps):
                    loss, grads = grad_fn(local, part)
                    losses.append(loss / steps)
                    updates, state = inner.update(grads, state, local)
                    local = optax.apply_updates(local, updates)
                inner_state[i] = state
                pending[i] = jax.tree.map(jnp.subtract, fetched[i], local)
        taus = []
        while pending[w := min(range(n), key=lambda i: (arrival[i], i))] is not None:
            now = arrival[w]
            taus.append(version - fetched_version[w])
            updates, outer_state = outer.update(pending[w], outer_state, theta)
            theta, version = optax.apply_updates(theta, updates), version + 1
            pending[w], fetched[w], fetched_version[w] = None, theta, version
            arrival[w] = np.float32(now + np.float32(steps * base[w]))
        metrics = {
            "loss": sum(losses) / (len(losses) / steps),
            "pushes": len(taus),
            "staleness_max": max(taus),
            "staleness_mean": np.mean(taus),
            "updates_applied": version,
            "wall_clock": now,
        }
        log.append((theta, metrics))
    return log, inner_state


def test_three_unequal_workers_two_inner_steps_equal_a_plain_event_loop(mlp):
    """N = 3 at speeds 1, 2.5, 1.5 per gradient, H = 2, inner momentum SGD (its state
    persists from task to task), outer delayed Nesterov: server, metrics and inner states
    step by step against the plain-Python loop."""
    reset = False
    loss_fn, params = mlp
    base, steps = [1.0, 2.5, 1.5], 2
    inner = optax.sgd(0.2, momentum=0.9)
    outer = delayed_nesterov(0.7, momentum=0.5, delay=3)
    batches = make_batches(6, 12)
    strategy = async_sgd(
        loss_fn,
        outer,
        ddl.make_mesh(data=3),
        compute_time=base,
        protocol=async_local(steps, reset=reset),
        inner_optimizer=inner,
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    expected, inner_states = reference(loss_fn, inner, outer, params, batches, base, 2, reset)
    taus = []
    for batch, (theta, want) in zip(batches, expected, strict=True):
        state, got = step(state, batch)
        chex.assert_trees_all_close(strategy.params(state), theta, atol=2e-6, rtol=1e-5)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
        taus.append(want["staleness_max"])
    assert max(taus) >= 2  # the schedule really is asynchronous
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *inner_states)
    chex.assert_trees_all_close(state.protocol.opt_state, stacked, atol=2e-6, rtol=1e-5)


def test_schedule_is_plain_async_with_h_times_the_compute_time(mlp):
    """The event path is reused: async_local(3) at time d per gradient runs the event clock
    of "async" at 3 d (random times, lost pushes and churn drawn the same)."""
    loss_fn, params = mlp
    faults = {"drop": 0.2, "churn": churn(0.2, 2.0)}

    def times(scale):
        return compute_times([scale, 2 * scale, 3 * scale], spread=0.4, seed=1)

    local = async_sgd(
        loss_fn,
        optax.sgd(1.0),
        ddl.make_mesh(data=3),
        compute_time=times(1.0),
        protocol=async_local(3),
        inner_optimizer=optax.adam(1e-2),
        **faults,
    )
    rules = ev.Rules.of(as_protocol("async", 3), faults["drop"], faults["churn"])
    clock_step = jax.jit(lambda clock: ev.step_clock(clock, rules, times(3.0)))
    step = jax.jit(local.step)
    state, clock, lost, away = local.init(params), ev.initial_clock(times(3.0), 3), 0, 0
    for batch in make_batches(5, 18):
        state, metrics = step(state, batch)
        clock, _, events = clock_step(clock)
        got = jax.device_get(state.clock)._asdict()
        for name, want in jax.device_get(clock)._asdict().items():  # times to an ulp (exp)
            np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=name)
        assert metrics["pushes"] == events.push.sum()
        lost, away = lost + events.lost.sum(), away + events.leave.sum()
    assert lost > 0 and away > 0
    assert {x.sharding.spec[0] for x in jax.tree.leaves(state.protocol.opt_state)} == {"data"}
    counts = jax.device_get(state.protocol.opt_state[0].count)
    np.testing.assert_array_equal(counts, 3 * (np.asarray(clock.tasks) + clock.ready))


def test_model_state_keys_and_reset_inner_state_thread_through_the_inner_steps():
    """One worker, H = 2, a ModelLoss: inner step h of task k draws fold_in(key(k, 0), h)
    and takes the model state of step h - 1; the server takes the last one. reset=True:
    the inner momentum restarts from 0 at every task."""
    steps, lr, beta = 2, 0.1, 0.9

    def fn(params, state, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        x = jnp.where(keep, 2 * batch["x"], 0.0) - state["stats"]["mean"]
        loss = jnp.mean((x @ params["w"] - batch["y"]) ** 2)
        mean = 0.5 * state["stats"]["mean"] + 0.5 * batch["x"].mean(0)
        return loss, {"stats": {"mean": mean}}

    params, model_state = {"w": jnp.full(3, 0.1)}, {"stats": {"mean": jnp.zeros(3)}}
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=8)} for _ in range(3)
    ]
    batches = [{k: v.astype(np.float32) for k, v in b.items()} for b in batches]
    strategy = async_sgd(
        ddl.ModelLoss(fn, seed=4),
        optax.sgd(1.0),
        ddl.make_mesh(data=1),
        protocol=async_local(steps, reset=True),
        inner_optimizer=optax.sgd(lr, momentum=beta),
    )
    state, _ = train_steps(strategy, {"params": params, **model_state}, batches)
    base = jax.random.key(4, impl="threefry2x32")
    grad_fn = jax.jit(jax.grad(fn, has_aux=True))
    for k, batch in enumerate(batches):
        key = jax.random.fold_in(jax.random.fold_in(base, k), 0)
        momentum = jax.tree.map(jnp.zeros_like, params)
        for h, part in enumerate(worker_shards(batch, steps)):
            grads, model_state = grad_fn(params, model_state, part, jax.random.fold_in(key, h))
            momentum = jax.tree.map(lambda m, g: beta * m + g, momentum, grads)
            params = jax.tree.map(lambda p, m: p - lr * m, params, momentum)
    chex.assert_trees_all_close(
        strategy.params(state), {"params": params, **model_state}, atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"protocol": async_local(2)}, ValueError, "needs inner_optimizer="),
        ({"inner_optimizer": optax.sgd(0.1)}, ValueError, "inner_optimizer is the workers'"),
        (
            {"protocol": softsync(2), "inner_optimizer": optax.sgd(0.1)},
            ValueError,
            "inner_optimizer is the workers'",
        ),
        (
            {"protocol": async_local(2), "inner_optimizer": "sgd"},
            TypeError,
            "inner_optimizer must be an optax.GradientTransformation",
        ),
        ({"protocol": AsyncLocal(0, False)}, ValueError, "async_local steps must be an int >= 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(mlp, kwargs, error, match):
    loss_fn, _ = mlp
    with pytest.raises(error, match=match):
        async_sgd(loss_fn, optax.sgd(1.0), ddl.make_mesh(data=4), **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0,), {}, "async_local steps must be an int >= 1, got 0"),
        ((2.0,), {}, "async_local steps must be an int >= 1, got 2.0"),
        ((2,), {"reset": 1}, "async_local reset must be a bool, got 1"),
    ],
)
def test_bad_protocol_arguments_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        async_local(*args, **kwargs)


def test_a_shard_that_does_not_split_into_h_parts_is_refused(mlp):
    loss_fn, params = mlp
    strategy = async_sgd(
        loss_fn,
        optax.sgd(1.0),
        ddl.make_mesh(data=4),
        protocol=async_local(3),
        inner_optimizer=optax.sgd(0.1),
    )
    with pytest.raises(ValueError, match=r"not divisible by 12 \(4 workers .* steps=3"):
        strategy.step(strategy.init(params), make_batches(1, 16)[0])
