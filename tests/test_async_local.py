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
    dynamic_steps,
    softsync,
    task_time,
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


def reference(loss_fn, inner, outer, params, batches, base, steps, reset, counts=None):
    """Asynchronous local SGD, one event at a time in plain Python.

    Per step: every worker without a pseudo-gradient (all of them: under plain async a
    worker restarts at its arrival) takes H inner steps from what it fetched on the H
    consecutive parts of its shard (``counts``, DyLU: worker i takes ``counts[i]`` steps on
    the first ``counts[i]`` parts, the rest unused); then arrivals in (time, worker) order
    until one has nothing computed: the server applies the pseudo-gradient with the outer
    optimizer and the worker fetches at once, its next arrival ``counts[i] * base[i]``
    later. Returns per step the server params, the metrics and the pushing workers in
    order, and the workers' final inner states.
    """
    n = len(base)
    counts = [steps] * n if counts is None else counts
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    theta, outer_state, version = params, outer.init(params), 0
    fetched, fetched_version = [params] * n, [0] * n
    inner_state = [inner.init(params)] * n
    arrival = [np.float32(c * b) for c, b in zip(counts, base, strict=True)]
    pending, log = [None] * n, []
    for batch in batches:
        losses = []
        for i, shard in enumerate(worker_shards(batch, n)):
            if pending[i] is None:
                local = fetched[i]
                state = inner.init(local) if reset else inner_state[i]
                task_losses = []
                for part in worker_shards(shard, steps)[: counts[i]]:
                    loss, grads = grad_fn(local, part)
                    task_losses.append(loss)
                    updates, state = inner.update(grads, state, local)
                    local = optax.apply_updates(local, updates)
                losses.append(np.mean(task_losses))
                inner_state[i] = state
                pending[i] = jax.tree.map(jnp.subtract, fetched[i], local)
        taus, order = [], []
        while pending[w := min(range(n), key=lambda i: (arrival[i], i))] is not None:
            now = arrival[w]
            taus.append(version - fetched_version[w])
            order.append(w)
            updates, outer_state = outer.update(pending[w], outer_state, theta)
            theta, version = optax.apply_updates(theta, updates), version + 1
            pending[w], fetched[w], fetched_version[w] = None, theta, version
            arrival[w] = np.float32(now + np.float32(counts[w] * base[w]))
        metrics = {
            "loss": np.mean(losses),
            "pushes": len(taus),
            "staleness_max": max(taus),
            "staleness_mean": np.mean(taus),
            "updates_applied": version,
            "wall_clock": now,
        }
        log.append((theta, metrics, order))
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
    for batch, (theta, want, _) in zip(batches, expected, strict=True):
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
        clock, _, events, _ = clock_step(clock)
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


def paper_local_steps(base, steps):
    """DyLU (Liu et al. 2024): worker w takes floor(H * v_w / max_w' v_w') inner steps,
    at least 1, with v_w = 1 / base_w its speed (gradients per simulated time unit)."""
    speeds = [1.0 / b for b in base]
    return [max(1, int(np.floor(steps * v / max(speeds) + 1e-9))) for v in speeds]


@pytest.mark.parametrize("reset", [False, True])
def test_dynamic_local_updates_equal_a_plain_event_loop(mlp, reset):
    """DyLU, N = 4 at 1, 2, 3, 1.5 per gradient, H = 4: H_i = 4, 2, 1, 2 (the paper's
    floor(H v_i / max v)); each worker takes H_i inner momentum-SGD steps on the first
    H_i of its H micro-batches and its task takes H_i times its time; outer delayed
    Nesterov. Server, metrics and inner states step by step against the plain loop."""
    loss_fn, params = mlp
    base, steps = [1.0, 2.0, 3.0, 1.5], 4
    assert paper_local_steps(base, steps) == [4, 2, 1, 2]
    # momentum SGD; the (identity) schedule counts each worker's inner steps
    inner = optax.chain(optax.sgd(0.2, momentum=0.9), optax.scale_by_schedule(lambda _: 1.0))
    outer = delayed_nesterov(0.7, momentum=0.5, delay=4)
    batches = make_batches(6, 32)
    strategy = async_sgd(
        loss_fn,
        outer,
        ddl.make_mesh(data=4),
        compute_time=base,
        protocol=async_local(steps, reset=reset, dynamic=True),
        inner_optimizer=inner,
    )
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    counts = paper_local_steps(base, steps)
    expected, inner_states = reference(
        loss_fn, inner, outer, params, batches, base, steps, reset, counts
    )
    taus, pushers = [], set()
    for batch, (theta, want, order) in zip(batches, expected, strict=True):
        state, got = step(state, batch)
        chex.assert_trees_all_close(strategy.params(state), theta, atol=2e-6, rtol=1e-5)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
        taus.append(want["staleness_max"])
        pushers |= set(order)
    assert max(taus) >= 2 and pushers == {0, 1, 2, 3}
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *inner_states)
    chex.assert_trees_all_close(state.protocol.opt_state, stacked, atol=2e-6, rtol=1e-5)
    if not reset:  # worker i's inner step count: H_i per task computed
        counts = jax.device_get(state.protocol.opt_state[1].count)
        tasks = np.asarray(state.clock.tasks) + np.asarray(state.clock.ready)
        np.testing.assert_array_equal(counts, np.array([4, 2, 1, 2]) * tasks)


@pytest.mark.parametrize(
    "base, steps, want",
    [
        ([1.0, 2.0], 4, (4, 2)),
        ([1.0, 2.0, 3.0, 1.5], 4, (4, 2, 1, 2)),
        ([2.0, 1.0, 4.0], 6, (3, 6, 1)),  # the fastest need not be worker 0
        ([1.0, 10.0], 4, (4, 1)),  # floor(0.4) = 0: at least one step
        ([0.1, 0.3, 0.2], 3, (3, 1, 1)),  # floor(3 * 0.1 / 0.3) = 1 despite rounding
        ([0.5, 0.5], 3, (3, 3)),
        ([0.0, 1.0], 3, (3, 1)),  # an instant worker is the fastest
    ],
)
def test_dynamic_local_steps_follow_the_paper_rule(base, steps, want):
    """H_i = max(1, floor(H * v_i / max_j v_j)), v_i = 1 / base_i; the log-normal noise
    scales every worker's expected time by the same exp(sigma^2 / 2), so H_i is that of
    the median times (noise or not)."""
    if 0.0 not in base:
        assert tuple(paper_local_steps(base, steps)) == want
    for spread in (0.0, 0.7):
        times = compute_times(base, spread=spread, seed=2)
        assert dynamic_steps(times, async_local(steps, dynamic=True), len(base)) == want
    assert dynamic_steps(compute_times(base), async_local(steps), len(base)) == (steps,) * len(base)
    scaled = task_time(compute_times(base, spread=0.3, seed=1), async_local(steps, dynamic=True))
    assert scaled.base == tuple(h * b for h, b in zip(want, base, strict=True))
    assert (scaled.spread, scaled.seed) == (0.3, 1)


def test_dynamic_tasks_of_slow_workers_take_about_as_long_as_fast_ones(mlp):
    """Times 1 and 2 per gradient, H = 4: without DyLU the slow worker's task takes 8 and
    the fast one pushes twice as often; with DyLU (H_i = 4, 2) both take 4: the event clock
    is plain async's at 4 and 4 (random times, lost pushes and churn drawn the same)."""
    loss_fn, params = mlp
    faults = {"drop": 0.2, "churn": churn(0.2, 2.0)}

    def run(dynamic, spread=0.0):
        strategy = async_sgd(
            loss_fn,
            optax.sgd(1.0),
            ddl.make_mesh(data=2),
            compute_time=compute_times([1.0, 2.0], spread=spread, seed=5),
            protocol=async_local(4, dynamic=dynamic),
            inner_optimizer=optax.sgd(0.1),
            **({} if spread == 0 else faults),
        )
        step, state, clocks = jax.jit(strategy.step), strategy.init(params), []
        for batch in make_batches(6, 16):
            state, _ = step(state, batch)
            clocks.append(jax.device_get(state.clock))
        return clocks

    fixed, dynamic = run(False)[-1], run(True)[-1]
    # At t = 24: fixed, worker 0 has pushed 6 tasks and worker 1 3; with DyLU both 6.
    np.testing.assert_array_equal(fixed.tasks, [6, 3])
    np.testing.assert_array_equal(dynamic.tasks, [6, 6])
    np.testing.assert_allclose(dynamic.arrival, [28.0, 28.0])
    np.testing.assert_allclose(fixed.arrival, [28.0, 32.0])
    rules = ev.Rules.of(as_protocol("async", 2), faults["drop"], faults["churn"])
    times = compute_times([4.0, 4.0], spread=0.5, seed=5)
    clock = ev.initial_clock(times, 2)
    clock_step = jax.jit(lambda clock: ev.step_clock(clock, rules, times))
    for got in run(True, spread=0.5):
        clock, *_ = clock_step(clock)
        for name, want in jax.device_get(clock)._asdict().items():
            np.testing.assert_allclose(getattr(got, name), want, rtol=1e-6, err_msg=name)


def test_dynamic_with_equal_speeds_is_bitwise_the_fixed_h(mlp):
    """DyLU with equal workers (one shared time) gives every worker H: today's run, bit
    for bit, as is dynamic=False with unequal times."""
    loss_fn, params = mlp
    batches = make_batches(4, 24)

    def run(dynamic, compute_time):
        strategy = async_sgd(
            loss_fn,
            optax.sgd(1.0),
            ddl.make_mesh(data=3),
            compute_time=compute_time,
            protocol=async_local(2, dynamic=dynamic),
            inner_optimizer=optax.adam(1e-2),
        )
        state, history = train_steps(strategy, params, batches)
        return strategy.params(state), history

    chex.assert_trees_all_equal(run(True, 1.5), run(False, 1.5))
    chex.assert_trees_all_equal(run(True, [2.0, 2.0, 2.0]), run(False, [2.0, 2.0, 2.0]))


@pytest.mark.parametrize("dynamic", [1, 0, "yes", None, np.bool_(True)])
def test_dynamic_must_be_a_bool(dynamic):
    with pytest.raises(ValueError, match=r"async_local dynamic must be a bool, got "):
        async_local(2, dynamic=dynamic)
    with pytest.raises(ValueError, match=r"async_local dynamic must be a bool"):
        as_protocol(AsyncLocal(2, False, dynamic), 2)


def test_dynamic_model_state_and_keys_follow_the_worker_h():
    """A ModelLoss with dropout and batch statistics, 2 workers at 1 and 2 per gradient,
    H = 2, DyLU (H_i = 2, 1): both tasks take 2, so both push in the first step (worker 0
    first). Worker w's step h draws fold_in(key(0, w), h) on micro-batch h of its shard;
    worker 1 takes only h = 0. Outer sgd(1): the server is l0 + l1 - theta, its model
    state worker 1's, the loss the mean of the workers' task means."""
    steps, lr = 2, 0.1

    def fn(params, state, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        x = jnp.where(keep, 2 * batch["x"], 0.0) - state["stats"]["mean"]
        loss = jnp.mean((x @ params["w"] - batch["y"]) ** 2)
        mean = 0.5 * state["stats"]["mean"] + 0.5 * batch["x"].mean(0)
        return loss, {"stats": {"mean": mean}}

    params, model_state = {"w": jnp.full(3, 0.1)}, {"stats": {"mean": jnp.full(3, 0.2)}}
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(8, 3)).astype(np.float32),
        "y": rng.normal(size=8).astype(np.float32),
    }
    strategy = async_sgd(
        ddl.ModelLoss(fn, seed=7),
        optax.sgd(1.0),
        ddl.make_mesh(data=2),
        compute_time=[1.0, 2.0],
        protocol=async_local(steps, dynamic=True),
        inner_optimizer=optax.sgd(lr),
    )
    state, history = train_steps(strategy, {"params": params, **model_state}, [batch])
    assert history[0]["pushes"] == 2
    base = jax.random.key(7, impl="threefry2x32")
    grad_fn = jax.jit(jax.value_and_grad(fn, has_aux=True))
    locals_, losses, state_w = [], [], model_state
    for w, (shard, count) in enumerate(zip(worker_shards(batch, 2), (2, 1), strict=True)):
        key = jax.random.fold_in(jax.random.fold_in(base, 0), w)
        local, state_w, task = params, model_state, []
        for h, part in enumerate(worker_shards(shard, steps)[:count]):
            (loss, state_w), grads = grad_fn(local, state_w, part, jax.random.fold_in(key, h))
            local = jax.tree.map(lambda p, g: p - lr * g, local, grads)
            task.append(loss)
        locals_.append(local)
        losses.append(np.mean(task))
    server = jax.tree.map(lambda a, b, t: a + b - t, *locals_, params)
    chex.assert_trees_all_close(
        strategy.params(state), {"params": server, **state_w}, atol=1e-6, rtol=1e-6
    )
    np.testing.assert_allclose(history[0]["loss"], np.mean(losses), rtol=1e-6)


def test_dynamic_resumes_bitwise_from_a_checkpoint(tmp_path):
    """DyLU's H_i live in the program, not the state: an orbax checkpoint of a run with
    batch norm, dropout and unequal speeds resumes it bit for bit."""
    import orbax.checkpoint as ocp
    from conftest import bn_dropout_pair

    loss_fn, variables = bn_dropout_pair()
    strategy = async_sgd(
        loss_fn,
        delayed_nesterov(0.5, momentum=0.5, delay=4),
        ddl.make_mesh(data=4),
        compute_time=compute_times([1.0, 2.0, 3.0, 1.5], spread=0.3, seed=1),
        protocol=async_local(4, dynamic=True),
        inner_optimizer=optax.adam(1e-2),
    )
    step, batches = jax.jit(strategy.step), make_batches(6, 32)

    def run(state, batches):
        for batch in batches:
            state, _ = step(state, batch)
        return state

    state = run(strategy.init(variables), batches[:3])
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(3, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(3, args=ocp.args.StandardRestore(like))
    chex.assert_trees_all_equal(restored, state)
    chex.assert_trees_all_equal(run(restored, batches[3:]), run(state, batches[3:]))
