"""local_sgd against N workers simulated one after another on one device."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    bn_dropout_pair,
    make_batches,
    reference_sgd,
    train,
    train_steps,
    worker_shards,
)

import ddl_jax as ddl
from ddl_jax._src.measure.consistency import CHURN_STREAM


def mean_tree(trees):
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def mean_field(states, name, among):
    """The optimizer states of the workers `among` with field `name` (Adam's mu or nu)
    replaced by their mean; the others' unchanged."""
    mean = mean_tree([states[i][0]._asdict()[name] for i in among])
    return [
        (s[0]._replace(**{name: mean}), *s[1:]) if i in among else s for i, s in enumerate(states)
    ]


def reference_local_sgd(
    loss_fn,
    opt,
    params,
    batches,
    *,
    n,
    period,
    warmup=0,
    average_opt_state=False,
    fields=(),
    arrived_at=None,
):
    """Each worker trains on its rows of every batch; replicas averaged every `period` steps,
    Adam's state fields (name, period) every such period; with `arrived_at(t)` (a mask per
    step) only over the workers that arrived, the others keeping theirs. Returns the
    replicas."""
    replicas, states = [params] * n, [opt.init(params)] * n
    for t, batch in enumerate(batches):
        shards = worker_shards(batch, n)
        grads = [jax.grad(loss_fn)(replicas[i], shards[i]) for i in range(n)]
        if t < warmup:
            grads = [mean_tree(grads)] * n
        for i in range(n):
            updates, states[i] = opt.update(grads[i], states[i], replicas[i])
            replicas[i] = optax.apply_updates(replicas[i], updates)
        among = range(n) if arrived_at is None else np.flatnonzero(arrived_at(t)).tolist()
        if t >= warmup and (t - warmup + 1) % period == 0 and among:
            mean = mean_tree([replicas[i] for i in among])
            replicas = [mean if i in among else r for i, r in enumerate(replicas)]
            if average_opt_state:
                states = [mean_tree(states)] * n
        for name, every in fields:
            if t >= warmup and (t - warmup + 1) % every == 0 and among:
                states = mean_field(states, name, among)
    return replicas


def test_period_one_with_sgd_is_data_parallel(mlp):
    loss_fn, params = mlp
    batches, mesh = make_batches(5, 32), ddl.make_mesh(data=8)
    state, _ = train(ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1), params, batches)
    dp = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    dp_state, _ = train(dp, params, batches)
    chex.assert_trees_all_close(
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1).params(state),
        dp.params(dp_state),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    ("period", "warmup", "average_opt_state"), [(3, 0, False), (2, 3, False), (4, 1, True)]
)
def test_matches_workers_simulated_on_one_device(mlp, period, warmup, average_opt_state):
    loss_fn, params = mlp
    n, batches = 4, make_batches(10, 32)  # the last step is local: replicas differ at the end
    strategy = ddl.local_sgd(
        loss_fn,
        optax.adam(1e-2),
        ddl.make_mesh(data=n),
        period=period,
        warmup_sync_steps=warmup,
        average_optimizer_state=average_opt_state,
    )
    state, _ = train(strategy, params, batches)
    expected = reference_local_sgd(
        loss_fn,
        optax.adam(1e-2),
        params,
        batches,
        n=n,
        period=period,
        warmup=warmup,
        average_opt_state=average_opt_state,
    )
    chex.assert_trees_all_close(strategy.params(state), mean_tree(expected), atol=1e-5)


@pytest.mark.parametrize(
    ("periods", "warmup", "drop"),
    [({"mu": 4, "nu": 6}, 0, 0.0), ({"nu": 3}, 2, 0.0), ({"mu": 2, "nu": 4}, 0, 0.5)],
)
def test_desloc_averages_each_adam_moment_on_its_own_period(mlp, periods, warmup, drop):
    """Also with workers missing synchronisations: the moments average over those that
    arrived, as the parameters do."""
    loss_fn, params = mlp
    n, batches = 4, make_batches(11, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.adam(1e-2),
        ddl.make_mesh(data=n),
        period=2,
        warmup_sync_steps=warmup,
        state_periods=periods,
        drop=drop,
    )
    state, metrics = train(strategy, params, batches)
    key = state.model.key
    expected = reference_local_sgd(
        loss_fn,
        optax.adam(1e-2),
        params,
        batches,
        n=n,
        period=2,
        warmup=warmup,
        fields=periods.items(),
        arrived_at=(lambda t: ddl.consistency.arrivals(key, t, n, drop)) if drop else None,
    )
    if drop:  # replica by replica: they differ
        final = [jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.params) for i in range(n)]
        chex.assert_trees_all_close(final, expected, atol=1e-5)
    else:
        chex.assert_trees_all_close(strategy.params(state), mean_tree(expected), atol=1e-5)
    for name, every in periods.items():  # the last step, t = 10, synchronised every such name
        assert float(metrics[f"synchronised_{name}"]) == float((10 - warmup + 1) % every == 0)


def test_desloc_with_the_parameters_period_is_averaging_the_optimizer_state(mlp):
    loss_fn, params = mlp
    batches, mesh = make_batches(6, 32), ddl.make_mesh(data=4)
    every = ddl.local_sgd(loss_fn, optax.adam(1e-2), mesh, period=3, average_optimizer_state=True)
    desloc = ddl.local_sgd(
        loss_fn, optax.adam(1e-2), mesh, period=3, state_periods={"mu": 3, "nu": 3}
    )
    chex.assert_trees_all_equal(train(desloc, params, batches)[0], train(every, params, batches)[0])


def test_desloc_moment_syncs_send_the_moments_bytes(mlp):
    """One more conditional branch than plain local SGD: mu's all-reduce, mu's bytes."""
    loss_fn, params = mlp
    n, batch = 8, make_batches(1, 32)[0]
    mu_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))  # Adam's mu: the params' shape

    def branches(**kwargs):
        strategy = ddl.local_sgd(
            loss_fn, optax.adam(1e-2), ddl.make_mesh(data=n), period=2, **kwargs
        )
        stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
        return sorted(stats.branches.values())

    plain, desloc = branches(), branches(state_periods={"mu": 6})
    assert len(desloc) == len(plain) + 1
    assert sorted([*plain, 2 * (n - 1) / n * mu_bytes]) == desloc


def test_warmup_is_synchronous_sgd_whatever_the_reducer(mlp):
    """The warm-up averages exact gradients; a lossy reducer compresses only what follows."""
    loss_fn, params = mlp
    batches = make_batches(3, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(0.1),
        ddl.make_mesh(data=4),
        period=100,
        warmup_sync_steps=3,
        reducer=ddl.compression.top_k(0.1),
    )
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.sgd(0.1), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)
    chex.assert_trees_all_close(state.anchor, expected, atol=1e-5)


def test_diloco_with_outer_sgd_one_is_plain_averaging(mlp):
    loss_fn, params = mlp
    batches, mesh = make_batches(6, 32), ddl.make_mesh(data=8)
    plain = ddl.local_sgd(loss_fn, optax.adamw(1e-2), mesh, period=3)
    diloco = ddl.local_sgd(
        loss_fn, optax.adamw(1e-2), mesh, period=3, outer_optimizer=optax.sgd(1.0)
    )
    a, _ = train(plain, params, batches)
    b, _ = train(diloco, params, batches)
    chex.assert_trees_all_close(plain.params(a), diloco.params(b), atol=1e-6)


def test_diloco_outer_nesterov_step_on_the_averaged_pseudo_gradient(mlp):
    """Two rounds of DiLoCo against its definition, written out on one device."""
    loss_fn, params = mlp
    n, period, batches = 4, 2, make_batches(4, 32)
    inner, outer = optax.adamw(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    strategy = ddl.local_sgd(
        loss_fn, inner, ddl.make_mesh(data=n), period=period, outer_optimizer=outer
    )
    state, _ = train(strategy, params, batches)
    anchor, outer_state, inner_states = params, outer.init(params), [inner.init(params)] * n
    for r in range(2):
        replicas = [anchor] * n
        for t in range(period):
            shards = worker_shards(batches[r * period + t], n)
            for i in range(n):
                g = jax.grad(loss_fn)(replicas[i], shards[i])
                u, inner_states[i] = inner.update(g, inner_states[i], replicas[i])
                replicas[i] = optax.apply_updates(replicas[i], u)
        delta = mean_tree([jax.tree.map(jnp.subtract, anchor, x) for x in replicas])
        u, outer_state = outer.update(delta, outer_state, anchor)
        anchor = optax.apply_updates(anchor, u)
    chex.assert_trees_all_close(strategy.params(state), anchor, atol=1e-5)


def test_replicas_are_identical_after_a_synchronisation(mlp):
    loss_fn, params = mlp
    strategy = ddl.local_sgd(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), period=3)
    state, metrics = train(strategy, params, make_batches(6, 32))
    assert metrics["synchronised"] == 1.0
    for leaf in jax.tree.leaves(state.params):
        leaf = np.asarray(leaf)
        assert (leaf == leaf[0]).all()  # bitwise: every replica is the new anchor
    state, metrics = train(strategy, params, make_batches(5, 32))
    assert metrics["synchronised"] == 0.0
    assert any((np.asarray(x) != np.asarray(x)[0]).any() for x in jax.tree.leaves(state.params))


def test_one_trajectory_between_syncs_reaches_reference_sgd_with_one_worker(mlp):
    loss_fn, params = mlp
    batches = make_batches(5, 16)
    strategy = ddl.local_sgd(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=1), period=2)
    state, _ = train(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


def test_only_the_synchronising_branch_communicates_parameters(mlp, cluster_buckets):
    loss_fn, params = mlp
    n = 8
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), period=4)
    [batch] = make_batches(1, 32)
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    assert stats.bytes_by_kind == {"all-reduce": 2 * (n - 1) / n * 4}  # the loss metric only
    assert stats.branches  # the synchronisation lives in a conditional branch
    for label, sent in stats.branches.items():
        ops = [op for op in stats.ops if op.branch == label]
        assert [op.kind for op in ops] == ["all-reduce"], label
        assert sent == 2 * (n - 1) / n * param_bytes
        # One bucket for the float32 parameters: XLA:CPU's gloo makes a call per buffer.
        assert [op.buffers for op in ops] == [1], label


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"period": 0}, ValueError, "period must be an int >= 1"),
        ({"period": 2, "warmup_sync_steps": -1}, ValueError, "warmup_sync_steps must be"),
        ({"period": 2, "outer_optimizer": 0.7}, TypeError, "outer_optimizer must be an optax"),
        ({"period": 2, "reducer": "psum"}, TypeError, "reducer must be an optax"),
        ({"period": 2, "state_periods": ["mu"]}, TypeError, "state_periods must be a dict"),
        ({"period": 2, "drop": 1.0}, ValueError, r"drop must be a probability in \[0, 1\)"),
        ({"period": 2, "drop": -0.1}, ValueError, "drop must be"),
        ({"period": 2, "state_periods": {"mu": 0}}, ValueError, r"state_periods\['mu'\] must"),
        (
            {"period": 2, "state_periods": {"mu": 4}, "average_optimizer_state": True},
            ValueError,
            "give one",
        ),
    ],
)
def test_bad_arguments(mlp, kwargs, error, match):
    loss_fn, _ = mlp
    with pytest.raises(error, match=match):
        ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2), **kwargs)


def test_a_synchronising_step_is_priced_with_its_branch(mlp):
    loss_fn, params = mlp
    n = 8
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), period=4)
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), make_batches(1, 32)[0])
    net = ddl.sim.Network(bandwidth=1e9, latency=1e-5)
    local = ddl.sim.estimate_step_time(stats, net)
    synced = ddl.sim.estimate_step_time(stats, net, branch=next(iter(stats.branches)))
    assert synced - local == pytest.approx(2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * param_bytes / 1e9)
    with pytest.raises(ValueError, match="is not one of stats.branches"):
        ddl.sim.estimate_step_time(stats, net, branch="nope")


# The schedules: PyTorch's averagers' rules (torch/distributed/algorithms/model_averaging),
# and averaging within contiguous groups of workers.


class PeriodicModelAveragerRule:
    """When ``PeriodicModelAverager(period, warmup_steps).average_parameters()`` averages
    (over all workers): its counter starts at 0 and grows by one per call, averaging or not."""

    def __init__(self, period, warmup_steps):
        self.period, self.warmup_steps, self.step = period, warmup_steps, 0

    def group_size(self, n):
        averages = self.step >= self.warmup_steps and (
            (self.step - self.warmup_steps) % self.period == 0
        )
        self.step += 1
        return n if averages else 0


class HierarchicalModelAveragerRule:
    """``HierarchicalModelAverager(period_group_size_dict, warmup_steps)``: from the warm-up
    on, the largest period dividing the counter itself picks the group size."""

    def __init__(self, period_group_size_dict, warmup_steps):
        self.groups, self.warmup_steps, self.step = dict(period_group_size_dict), warmup_steps, 0

    def group_size(self, n):
        size = 0
        if self.step >= self.warmup_steps:
            size = next((self.groups[p] for p in reversed(self.groups) if self.step % p == 0), 0)
        self.step += 1
        return size


class LocalStepsRule:
    """This library's default: the largest period dividing the number of local steps since
    the warm-up picks the group size."""

    def __init__(self, period_group_size_dict, warmup_steps):
        self.groups, self.warmup_steps, self.step = dict(period_group_size_dict), warmup_steps, 0

    def group_size(self, n):
        local_steps = self.step - self.warmup_steps + 1
        self.step += 1
        if local_steps < 1:
            return 0
        return next((self.groups[p] for p in reversed(self.groups) if local_steps % p == 0), 0)


def reference_group_averaging(
    loss_fn, opt, params, batches, *, n, warmup, rule, average_opt_state=False
):
    """Every worker's replica after training on its rows of each batch: gradients averaged
    over all workers in the first ``warmup`` steps; after step t, replicas averaged within
    blocks of ``rule.group_size(n)`` consecutive workers (none for 0)."""
    replicas, states, sizes = [params] * n, [opt.init(params)] * n, []
    grad = jax.jit(jax.grad(loss_fn))

    @jax.jit
    def apply(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for t, batch in enumerate(batches):
        shards = worker_shards(batch, n)
        grads = [grad(replicas[i], shards[i]) for i in range(n)]
        if t < warmup:
            grads = [mean_tree(grads)] * n
        for i in range(n):
            replicas[i], states[i] = apply(grads[i], states[i], replicas[i])
        size = rule.group_size(n)
        sizes.append(size)
        for start in range(0, n, size) if size else ():
            block = slice(start, start + size)
            replicas[block] = [mean_tree(replicas[block])] * size
            if average_opt_state:
                states[block] = [mean_tree(states[block])] * size
    return jax.tree.map(lambda *xs: jnp.stack(xs), *replicas), sizes


def toy_loss(params, batch):
    return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)


def synchronised_after(n=8, steps=12, **kwargs):
    """The steps (from 0) after which a local_sgd of ``kwargs`` synchronises, and the sizes
    of the groups it averages then (all ``n`` without a hierarchy)."""
    strategy = ddl.local_sgd(toy_loss, optax.sgd(0.1), ddl.make_mesh(data=n), **kwargs)
    batches = [{"x": np.ones(n, np.float32), "y": np.ones(n, np.float32)}] * steps
    _, history = train_steps(strategy, {"w": jnp.zeros(())}, batches)
    synced = [t for t, m in enumerate(history) if m["synchronised"]]
    sizes = [int(history[t].get("sync_group_size", n)) for t in synced]
    return synced, sizes


@pytest.mark.parametrize(
    ("kwargs", "steps", "sizes"),
    [
        ({"period": 4, "warmup_sync_steps": 2}, [5, 9], [8, 8]),
        ({"period": 4, "warmup_sync_steps": 2, "schedule": "torch"}, [2, 6, 10], [8, 8, 8]),
        ({"period": 3}, [2, 5, 8, 11], [8] * 4),
        ({"period": 3, "schedule": "torch"}, [0, 3, 6, 9], [8] * 4),
        ({"hierarchy": {2: 2, 4: 8}}, [1, 3, 5, 7, 9, 11], [2, 8] * 3),
        ({"hierarchy": {2: 2, 4: 8}, "schedule": "torch"}, [0, 2, 4, 6, 8, 10], [8, 2] * 3),
        (
            {"hierarchy": {2: 2, 4: 8}, "schedule": "torch", "warmup_sync_steps": 3},
            [4, 6, 8, 10],
            [8, 2, 8, 2],
        ),
        (
            {"hierarchy": ((1, 2), (2, 4), (6, 8)), "warmup_sync_steps": 1},
            list(range(1, 12)),
            [2, 4, 2, 4, 2, 8, 2, 4, 2, 4, 2],
        ),
    ],
)
def test_schedules_synchronise_after_these_steps(kwargs, steps, sizes):
    assert synchronised_after(**kwargs) == (steps, sizes)


@pytest.mark.parametrize(("period", "warmup"), [(3, 0), (4, 2), (2, 3), (1, 0)])
def test_torch_schedule_is_periodic_model_averagers(mlp, period, warmup):
    """schedule="torch" averages exactly when PeriodicModelAverager would, replica by replica."""
    loss_fn, params = mlp
    n, batches = 4, make_batches(9, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.adam(1e-2),
        ddl.make_mesh(data=n),
        period=period,
        warmup_sync_steps=warmup,
        schedule="torch",
    )
    state, history = train_steps(strategy, params, batches)
    expected, sizes = reference_group_averaging(
        loss_fn,
        optax.adam(1e-2),
        params,
        batches,
        n=n,
        warmup=warmup,
        rule=PeriodicModelAveragerRule(period, warmup),
    )
    assert [float(m["synchronised"]) for m in history] == [float(s > 0) for s in sizes]
    chex.assert_trees_all_close(state.params, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "hierarchy", "warmup", "momentum"),
    [
        ("ddl", {2: 2, 4: 8}, 0, None),
        ("torch", {2: 2, 4: 8}, 0, None),
        ("torch", {2: 2, 4: 8}, 3, None),
        ("ddl", ((1, 2), (2, 4), (6, 8)), 2, 0.9),
    ],
)
def test_hierarchy_averages_replicas_within_groups(mlp, schedule, hierarchy, warmup, momentum):
    """Against replicas averaged within blocks of workers at the steps of the schedule's rule
    (torch: HierarchicalModelAverager's); with momentum, its buffers averaged alike."""
    loss_fn, params = mlp
    n, batches, opt = 8, make_batches(10, 32), optax.sgd(0.1, momentum=momentum)
    strategy = ddl.local_sgd(
        loss_fn,
        opt,
        ddl.make_mesh(data=n),
        hierarchy=hierarchy,
        warmup_sync_steps=warmup,
        schedule=schedule,
        average_optimizer_state=momentum is not None,
    )
    state, history = train_steps(strategy, params, batches)
    rule = {"ddl": LocalStepsRule, "torch": HierarchicalModelAveragerRule}[schedule]
    expected, sizes = reference_group_averaging(
        loss_fn,
        opt,
        params,
        batches,
        n=n,
        warmup=warmup,
        rule=rule(dict(hierarchy), warmup),
        average_opt_state=momentum is not None,
    )
    assert [int(m["sync_group_size"]) for m in history] == sizes
    assert 0 < sizes.count(n) < len([s for s in sizes if s])  # both levels ran
    chex.assert_trees_all_close(state.params, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "warmup", "outer"),
    [("ddl", 2, None), ("torch", 3, optax.sgd(0.7, momentum=0.9, nesterov=True))],
)
def test_one_level_hierarchy_is_plain_local_sgd(mlp, schedule, warmup, outer):
    """((H, N),) is period=H (under torch when H divides W, where PyTorch's averagers agree)."""
    loss_fn, params = mlp
    n, batches, mesh = 8, make_batches(8, 32), ddl.make_mesh(data=8)
    common = {"warmup_sync_steps": warmup, "schedule": schedule, "outer_optimizer": outer}
    plain = ddl.local_sgd(loss_fn, optax.adam(1e-2), mesh, period=3, **common)
    levels = ddl.local_sgd(loss_fn, optax.adam(1e-2), mesh, hierarchy=((3, n),), **common)
    a, plain_history = train_steps(plain, params, batches)
    b, level_history = train_steps(levels, params, batches)
    assert [m["synchronised"] for m in plain_history] == [m["synchronised"] for m in level_history]
    chex.assert_trees_all_equal(a.params, b.params)
    chex.assert_trees_all_equal(a.anchor, b.anchor)


def test_a_group_average_leaves_equal_replicas_and_batch_statistics_per_group():
    loss_fn, variables = bn_dropout_pair()
    strategy = ddl.local_sgd(
        loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8), hierarchy={2: 2, 4: 8}
    )
    state, history = train_steps(strategy, variables, make_batches(2, 32))
    assert float(history[-1]["sync_group_size"]) == 2.0
    for leaf in jax.tree.leaves((state.params, state.model.state)):
        pairs = np.asarray(leaf).reshape(4, 2, -1)
        assert (pairs[:, 0] == pairs[:, 1]).all()  # bitwise: a pair's replicas are equal
        assert (pairs[0, 0] != pairs[1, 0]).any()  # pairs differ


@pytest.mark.parametrize(("hierarchy", "rounds"), [({2: 2, 4: 8}, 1), ({2: 4, 4: 8}, 3)])
def test_a_group_average_sends_the_parameters_once_per_round_within_the_group(
    mlp, hierarchy, rounds
):
    """G - 1 ppermute rounds of the parameters, each pair inside one block of G workers;
    the top level is the one all-reduce of plain local SGD."""
    loss_fn, params = mlp
    n = 8
    size = min(hierarchy.values())
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), hierarchy=hierarchy)
    state, [batch] = strategy.init(params), make_batches(1, 32)
    step = jax.jit(strategy.step)
    stats = ddl.comm_stats(step, state, batch)
    assert stats.bytes_by_kind == {"all-reduce": 2 * (n - 1) / n * 4}  # the loss metric only
    kinds = {label: {op.kind for op in stats.ops if op.branch == label} for label in stats.branches}
    [group] = [label for label, k in kinds.items() if k == {"collective-permute"}]
    assert stats.branches[group] == rounds * param_bytes
    assert [stats.branches[label] for label, k in kinds.items() if k == {"all-reduce"}] == [
        2 * (n - 1) / n * param_bytes
    ] * 2  # the synchronisation and the warm-up's catch-up
    hlo = step.lower(state, batch).compile().as_text()
    pairs = re.findall(
        r"\{(\d+),(\d+)\}", " ".join(re.findall(r"source_target_pairs=\{.*?\}\}", hlo))
    )
    assert pairs and all(int(s) // size == int(t) // size for s, t in pairs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"period": 2, "schedule": "pytorch"},
            ValueError,
            "schedule must be one of 'ddl', 'torch'",
        ),
        ({}, ValueError, "takes period=H or hierarchy=.*exactly one"),
        ({"period": 4, "hierarchy": {4: 8}}, ValueError, "exactly one"),
        ({"hierarchy": ((4, 2), (2, 8))}, ValueError, r"periods must increase.*\[4, 2\]"),
        ({"hierarchy": ((2, 3), (4, 8))}, ValueError, "group sizes must increase, each dividing"),
        ({"hierarchy": ((2, 4), (4, 4))}, ValueError, "group sizes must increase"),
        ({"hierarchy": {2: 2, 4: 4}}, ValueError, "last group size must be the number of work"),
        ({"hierarchy": ((0, 8),)}, ValueError, r"hierarchy\[0\]'s period must be an int >= 1"),
        ({"hierarchy": ()}, TypeError, "hierarchy must be a non-empty sequence of"),
        ({"hierarchy": ((2, 2, 8),)}, TypeError, r"\(period, group_size\) pairs"),
        ({"hierarchy": 4}, TypeError, "hierarchy must be"),
    ],
)
def test_bad_schedules_and_hierarchies(kwargs, error, match):
    with pytest.raises(error, match=match):
        ddl.local_sgd(toy_loss, optax.sgd(0.1), ddl.make_mesh(data=8), **kwargs)


def test_desloc_names_a_field_the_optimizer_state_lacks(mlp):
    loss_fn, params = mlp
    strategy = ddl.local_sgd(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=2), period=2, state_periods={"nu": 4}
    )
    with pytest.raises(ValueError, match="state_periods names 'nu'"):
        strategy.init(params)


def reference_unreliable_averaging(
    loss_fn, params, batches, *, n, period, arrived_at, present_at, groups=None
):
    """Per-worker SGD, a worker absent at t (present_at(t)) taking no step; at a
    synchronisation the workers whose message arrives (arrived_at(t)) take the mean of
    their replicas and the others keep their own. ``groups = (size, every)``: at the other
    steps t with (t + 1) % every == 0, the same within blocks of ``size`` workers."""
    replicas = [params] * n
    for t, batch in enumerate(batches):
        shards, here = worker_shards(batch, n), present_at(t)
        replicas = [
            jax.tree.map(lambda p, g: p - 0.1 * g, r, jax.grad(loss_fn)(r, s)) if here[i] else r
            for i, (r, s) in enumerate(zip(replicas, shards, strict=True))
        ]
        if (t + 1) % period == 0:
            blocks = [range(n)]
        elif groups is not None and (t + 1) % groups[1] == 0:
            blocks = [range(k, k + groups[0]) for k in range(0, n, groups[0])]
        else:
            continue
        for block in blocks:
            arrived = [i for i in block if arrived_at(t)[i]]
            if arrived:
                mean = mean_tree([replicas[i] for i in arrived])
                replicas = [mean if i in arrived else r for i, r in enumerate(replicas)]
    return replicas


def test_statement_1_replicas_agree_after_a_complete_synchronisation_not_a_lossy_one(mlp):
    """With every message delivered and plain SGD the replicas are equal after a
    synchronisation; with messages dropped (not accumulated) they are not, and each replica
    is what the per-worker reference with the same drop masks gives."""
    loss_fn, params = mlp
    n, batches, mesh = 8, make_batches(6, 32), ddl.make_mesh(data=8)
    complete = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=3)
    state, _ = train(complete, params, batches)
    assert ddl.consistency.consensus_distance(state.params) == 0.0
    default, _ = train(
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=3, drop=0.0), params, batches
    )
    chex.assert_trees_all_equal(default, state)

    lossy = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=3, drop=0.4)
    state, metrics = train(lossy, params, batches)
    key = state.model.key
    masks = {t: np.asarray(ddl.consistency.arrivals(key, t, n, 0.4)) for t in (2, 5)}
    assert 0 < masks[5].sum() < n  # this seed drops some, not all, at the last sync
    assert float(metrics["arrived"]) == masks[5].mean()
    expected = reference_unreliable_averaging(
        loss_fn, params, batches, n=n, period=3, arrived_at=masks.get, present_at=lambda t: [1] * n
    )
    for i in range(n):
        replica = jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.params)
        chex.assert_trees_all_close(replica, expected[i], atol=1e-5)
    assert ddl.consistency.consensus_distance(state.params) > 1e-3


def test_absent_workers_take_no_step_and_miss_the_synchronisation(mlp):
    """churn: a worker absent at a step neither trains nor synchronises; with drop as well, a
    present worker's message may still be lost."""
    loss_fn, params = mlp
    n, batches = 8, make_batches(6, 32)
    strategy = ddl.local_sgd(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), period=3, churn=0.3, drop=0.2
    )
    state, _ = train(strategy, params, batches)
    key = state.model.key

    def present(t):
        return np.asarray(ddl.consistency.arrivals(key, t, n, 0.3, CHURN_STREAM))

    def arrived(t):
        return np.asarray(ddl.consistency.arrivals(key, t, n, 0.2)) & present(t)

    assert 0 < sum(present(t).sum() for t in range(6)) < 6 * n  # some absences happened
    expected = reference_unreliable_averaging(
        loss_fn, params, batches, n=n, period=3, arrived_at=arrived, present_at=present
    )
    for i in range(n):
        replica = jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.params)
        chex.assert_trees_all_close(replica, expected[i], atol=1e-5)


def test_with_churn_the_loss_is_every_replicas_on_its_rows(mlp):
    """An absent worker's replica counts too: the loss is the global batch's, as gossip's
    and the islands'."""
    loss_fn, params = mlp
    n, batch = 8, make_batches(1, 32)[0]
    strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), period=3, churn=0.5)
    state = strategy.init(params)
    present = np.asarray(ddl.consistency.arrivals(state.model.key, 0, n, 0.5, CHURN_STREAM))
    assert 0 < present.sum() < n
    _, metrics = jax.jit(strategy.step)(state, batch)
    losses = [loss_fn(params, rows) for rows in worker_shards(batch, n)]  # replicas agree
    np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-6)
    present_only = np.mean([loss for loss, here in zip(losses, present, strict=True) if here])
    assert not np.isclose(metrics["loss"], present_only, rtol=1e-4)


@pytest.mark.parametrize(
    "reducer",
    [
        lambda: ddl.compression.top_k(0.5),
        lambda: ddl.adasum(),
        lambda: ddl.chain(optax.clip_by_global_norm(1.0), ddl.allreduce_mean()),
    ],
    ids=["top_k", "adasum", "chained_mean"],
)
@pytest.mark.parametrize("faults", [{"drop": 0.4}, {"churn": 0.2}], ids=["drop", "churn"])
def test_workers_left_out_need_a_stateless_mean_or_a_reducer_told_who_arrived(mlp, reducer, faults):
    """A worker left out of a synchronisation enters the reducer as zeros, which only a
    stateless mean leaves out (SparseLoCo, given them, fell to 0 at its median clip once
    half dropped; it is now told who arrived): any other reducer is refused with drop or
    churn; every all-reduce algorithm of the mean, cast, qsgd and sparse_loco are taken."""
    loss_fn, _ = mlp
    mesh = ddl.make_mesh(data=8)
    with pytest.raises(ValueError, match="only a stateless mean leaves them out of"):
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=2, reducer=reducer(), **faults)
    taken = [ddl.allreduce_mean(algorithm=a) for a in ("psum", "ring", "tree", "ps")]
    taken += [ddl.compression.cast(jnp.bfloat16), ddl.compression.qsgd(4)]
    taken += [ddl.compression.sparse_loco(0.25)]
    for mean in taken:
        ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=2, reducer=mean, **faults)
    ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=2, reducer=reducer())  # reliable


def test_a_quantised_mean_leaves_the_dropped_out_as_the_plain_mean_does(mlp):
    """With drop, cast(float32) is the plain mean's run (the same replicas), and qsgd at 127
    levels a bucket's largest magnitude (QSGDinf) stays within its quantisation error of
    it: the dropped workers' zeros are left out, not averaged in."""
    loss_fn, params = mlp
    batches, mesh = make_batches(6, 32), ddl.make_mesh(data=8)

    def run(reducer=None):
        strategy = ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=3, drop=0.4, reducer=reducer)
        state, metrics = train(strategy, params, batches)
        return state.params, metrics

    exact, metrics = run()
    assert 0 < float(metrics["arrived"]) < 1  # some dropped, not all, at the last sync
    cast, _ = run(ddl.compression.cast(jnp.float32))
    chex.assert_trees_all_close(cast, exact, atol=1e-6)
    quantised, _ = run(ddl.compression.qsgd(127, scale="max"))
    moved = max(float(jnp.max(jnp.abs(e - p))) for e, p in zip(
        jax.tree.leaves(exact), jax.tree.leaves(params), strict=True))  # fmt: skip
    error = max(float(jnp.max(jnp.abs(q - e))) for q, e in zip(
        jax.tree.leaves(quantised), jax.tree.leaves(exact), strict=True))  # fmt: skip
    assert 0 < error < 0.05 * moved, (error, moved)


def test_a_groups_average_leaves_out_the_absent_and_the_dropped(mlp):
    """hierarchy with churn and drop: a pair's average (every step) is over the members
    present whose message arrived, the others keeping their replicas, as at the
    synchronisation of all 8 (every 3 steps); against the per-worker reference."""
    loss_fn, params = mlp
    n, batches = 8, make_batches(6, 32)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(0.1),
        ddl.make_mesh(data=n),
        hierarchy=((1, 2), (3, n)),
        churn=0.3,
        drop=0.2,
    )
    state, step, history = strategy.init(params), jax.jit(strategy.step), []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    key = state.model.key

    def present(t):
        return np.asarray(ddl.consistency.arrivals(key, t, n, 0.3, CHURN_STREAM))

    def arrived(t):
        return np.asarray(ddl.consistency.arrivals(key, t, n, 0.2)) & present(t)

    pairs_short = [
        t for t in range(6) if any(arrived(t)[k] != arrived(t)[k + 1] for k in (0, 2, 4, 6))
    ]
    assert [t for t in pairs_short if (t + 1) % 3] != []  # a pair averaged with one left out
    expected = reference_unreliable_averaging(
        loss_fn, params, batches, n=n, period=3, arrived_at=arrived, present_at=present,
        groups=(2, 1),
    )  # fmt: skip
    for i in range(n):
        replica = jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.params)
        chex.assert_trees_all_close(replica, expected[i], atol=1e-5)
    assert [h["arrived"] for h in history] == pytest.approx([arrived(t).mean() for t in range(6)])
