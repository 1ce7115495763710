"""local_sgd against N workers simulated one after another on one device."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, reference_sgd, worker_shards

import ddl_jax as ddl


def mean_tree(trees):
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def reference_local_sgd(
    loss_fn, opt, params, batches, *, n, period, warmup=0, average_opt_state=False
):
    """Each worker trains on its rows of every batch; replicas averaged every `period` steps."""
    replicas, states = [params] * n, [opt.init(params)] * n
    for t, batch in enumerate(batches):
        shards = worker_shards(batch, n)
        grads = [jax.grad(loss_fn)(replicas[i], shards[i]) for i in range(n)]
        if t < warmup:
            grads = [mean_tree(grads)] * n
        for i in range(n):
            updates, states[i] = opt.update(grads[i], states[i], replicas[i])
            replicas[i] = optax.apply_updates(replicas[i], updates)
        if t >= warmup and (t - warmup + 1) % period == 0:
            replicas = [mean_tree(replicas)] * n
            if average_opt_state:
                states = [mean_tree(states)] * n
    return mean_tree(replicas)


def run(strategy, params, batches):
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


def test_period_one_with_sgd_is_data_parallel(mlp):
    loss_fn, params = mlp
    batches, mesh = make_batches(5, 32), ddl.make_mesh(data=8)
    state, _ = run(ddl.local_sgd(loss_fn, optax.sgd(0.1), mesh, period=1), params, batches)
    dp = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    dp_state, _ = run(dp, params, batches)
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
    state, _ = run(strategy, params, batches)
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
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


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
    state, _ = run(strategy, params, batches)
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
    a, _ = run(plain, params, batches)
    b, _ = run(diloco, params, batches)
    chex.assert_trees_all_close(plain.params(a), diloco.params(b), atol=1e-6)


def test_diloco_outer_nesterov_step_on_the_averaged_pseudo_gradient(mlp):
    """Two rounds of DiLoCo against its definition, written out on one device."""
    loss_fn, params = mlp
    n, period, batches = 4, 2, make_batches(4, 32)
    inner, outer = optax.adamw(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    strategy = ddl.local_sgd(
        loss_fn, inner, ddl.make_mesh(data=n), period=period, outer_optimizer=outer
    )
    state, _ = run(strategy, params, batches)
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
    state, metrics = run(strategy, params, make_batches(6, 32))
    assert metrics["synchronised"] == 1.0
    for leaf in jax.tree.leaves(state.params):
        leaf = np.asarray(leaf)
        assert (leaf == leaf[0]).all()  # bitwise: every replica is the new anchor
    state, metrics = run(strategy, params, make_batches(5, 32))
    assert metrics["synchronised"] == 0.0
    assert any((np.asarray(x) != np.asarray(x)[0]).any() for x in jax.tree.leaves(state.params))


def test_one_trajectory_between_syncs_reaches_reference_sgd_with_one_worker(mlp):
    loss_fn, params = mlp
    batches = make_batches(5, 16)
    strategy = ddl.local_sgd(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=1), period=2)
    state, _ = run(strategy, params, batches)
    expected = reference_sgd(loss_fn, optax.adam(1e-2), params, batches)
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-5)


def test_only_the_synchronising_branch_communicates_parameters(mlp):
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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"period": 0}, ValueError, "period must be an int >= 1"),
        ({"period": 2, "warmup_sync_steps": -1}, ValueError, "warmup_sync_steps must be"),
        ({"period": 2, "outer_optimizer": 0.7}, TypeError, "outer_optimizer must be an optax"),
        ({"period": 2, "reducer": "psum"}, TypeError, "reducer must be an optax"),
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
