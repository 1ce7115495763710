"""gossip with lost messages and absent workers, against a dense row-stochastic reference.

The reference: every worker's SGD-with-momentum update on its shard (none when absent), and
``W'``: the mixing matrix with each lost message's weight moved to the receiver's diagonal,
built in numpy from the masks of ``link_masks`` (the run's key and the step); ``W'`` mixes
the models before the updates, each worker's own update added after (``order="dpsgd"``), or
the updated models (``order="adapt_then_combine"``).
"""

import functools

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal_to_rounding, make_batches, worker_shards
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.strategies.gossip import link_masks

LR, MOMENTUM = 0.1, 0.9


@functools.cache
def jitted_grad(loss_fn):
    return jax.jit(jax.grad(loss_fn))


def flat(stacked):
    return np.concatenate(
        [np.asarray(x).reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)], 1
    )


def effective_matrix(w, arrives):
    """``W`` with the weight of each message that did not arrive moved to the diagonal."""
    n = len(w)
    out = np.where(np.asarray(arrives) & ~np.eye(n, dtype=bool), w, 0.0)
    out[np.diag_indices(n)] = 1.0 - out.sum(1)
    return out


def reference_step(loss_fn, replicas, traces, batch, w, arrives, present, order):
    """One unreliable gossip step of SGD with momentum on stacked replicas, on one device."""
    n = len(w)
    grads = [
        jitted_grad(loss_fn)(jax.tree.map(lambda x, j=j: x[j], replicas), shard)
        for j, shard in enumerate(worker_shards(batch, n))
    ]
    grads = jax.tree.map(lambda *g: np.stack(g), *grads)
    mask = lambda x: np.asarray(present).reshape(-1, *[1] * (x.ndim - 1))  # noqa: E731
    traces = jax.tree.map(lambda t, g: np.where(mask(t), g + MOMENTUM * t, t), traces, grads)
    updates = jax.tree.map(lambda p, t: -LR * mask(p) * t, replicas, traces)
    wp = effective_matrix(w, arrives)
    if order == "dpsgd":
        mixed = jax.tree.map(lambda x, u: np.tensordot(wp, x, axes=1) + u, replicas, updates)
    else:
        mixed = jax.tree.map(lambda x, u: np.tensordot(wp, x + u, axes=1), replicas, updates)
    return mixed, traces


def random_start(strategy, params, mesh):
    state = strategy.init(params)
    rng = np.random.default_rng(1)
    replicas = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), state.params)
    return state._replace(params=jax.device_put(replicas, NamedSharding(mesh, P("data"))))


@pytest.mark.parametrize("order", ["dpsgd", "adapt_then_combine"])
@pytest.mark.parametrize(
    ("topology", "drop", "churn"),
    [
        ("ring", 0.0, 0.0),
        ("ring", 0.3, 0.0),
        ("exponential", 0.2, 0.3),
        ("one_peer_exponential", 0.0, 0.0),
        ("one_peer_exponential", 0.3, 0.2),
    ],
)
def test_steps_equal_the_dense_row_stochastic_reference(mlp, topology, drop, churn, order):
    loss_fn, params = mlp
    n, mesh = 8, ddl.make_mesh(data=8)
    strategy = ddl.gossip(
        loss_fn,
        optax.sgd(LR, momentum=MOMENTUM),
        mesh,
        topology=topology,
        order=order,
        drop=drop,
        churn=churn,
        consensus_every=1,
    )
    state, step = random_start(strategy, params, mesh), jax.jit(strategy.step)
    replicas = jax.tree.map(np.asarray, state.params)
    traces = jax.tree.map(np.zeros_like, replicas)
    key, lost_any, absent_any = np.asarray(state.model.key), False, False
    for t, batch in enumerate(make_batches(3, 32)):
        w = ddl.mixing_matrix(topology, n, step=t)  # a dynamic topology's changes every step
        edges = w > 0
        arrives, present = map(np.asarray, link_masks(key, t, n, drop=drop, churn=churn))
        rows = worker_shards(batch, n)  # every replica's loss on its rows, an absent one's too
        losses = [loss_fn(jax.tree.map(lambda x, i=i: x[i], replicas), rows[i]) for i in range(n)]
        replicas, traces = reference_step(
            loss_fn, replicas, traces, batch, w, arrives, present, order
        )
        lost_any |= bool((edges & ~arrives & present[:, None] & present[None, :]).any())
        absent_any |= not present.all()
        state, metrics = step(state, batch)
        chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), replicas, atol=2e-5)
        chex.assert_trees_all_close(
            jax.tree.map(np.asarray, state.opt_state[0].trace), traces, atol=2e-5
        )
        x = flat(replicas)
        distance = np.linalg.norm(x - x.mean(0), axis=1).mean()
        np.testing.assert_allclose(metrics["consensus_distance"], distance, rtol=1e-4)
        np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-5)
        if drop:
            sent = edges & ~np.eye(n, dtype=bool) & present[:, None] & present[None, :]
            lost = (sent & ~arrives).sum() / max(sent.sum(), 1)
            np.testing.assert_allclose(metrics["messages_dropped"], lost, rtol=1e-6)
        if churn:
            assert float(metrics["workers_present"]) == present.sum()
        assert ("messages_dropped" in metrics) == bool(drop)
        assert ("workers_present" in metrics) == bool(churn)
    assert lost_any == bool(drop) and absent_any == bool(churn)  # the draws did act


def test_complete_graph_agrees_only_when_nothing_is_dropped(mlp, capsys):
    """Complete graph adapting then combining, plain SGD, equal replicas: one step is
    synchronous SGD (the replicas agree); with lost messages they disagree and their mean
    is no longer the mean of ``theta_j + u_j``: dropped, not accumulated."""
    loss_fn, params = mlp
    n, mesh, batch = 8, ddl.make_mesh(data=8), make_batches(1, 32)[0]
    stacked = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), params)
    zeros = jax.tree.map(np.zeros_like, stacked)
    updated, _ = reference_step(  # every message arriving: the mean of theta_j + u_j, everywhere
        loss_fn, stacked, zeros, batch, np.full((n, n), 1 / n), np.ones((n, n), bool),
        [True] * n, "adapt_then_combine",
    )  # fmt: skip
    for drop in (0.0, 0.3):
        strategy = ddl.gossip(loss_fn, optax.sgd(LR), mesh, topology="complete",
                              order="adapt_then_combine", drop=drop, consensus_every=1)  # fmt: skip
        state = strategy.init(params)
        arrives, _ = link_masks(np.asarray(state.model.key), 0, n, drop=drop)
        state, metrics = jax.jit(strategy.step)(state, batch)
        got, distance = flat(state.params), float(metrics["consensus_distance"])
        shift = np.abs(got.mean(0) - flat(updated).mean(0)).max()
        if drop == 0:
            assert distance < 1e-5 and shift < 1e-6
        else:
            assert distance > 1e-3 and shift > 1e-5
            expected, _ = reference_step(
                loss_fn, stacked, zeros, batch, np.full((n, n), 1 / n), arrives, [True] * n,
                "adapt_then_combine",
            )  # fmt: skip
            np.testing.assert_allclose(got, flat(expected), atol=1e-6)
        with capsys.disabled():
            lost = float(metrics.get("messages_dropped", 0.0))
            print(
                f"\ndrop={drop}: consensus distance {distance:.3g}, |mean shift| {shift:.3g}, "
                f"messages lost {lost:.3f}"
            )


def test_nothing_lost_is_the_reliable_path(mlp):
    """drop > 0 that loses no message takes the masked path; it computes what the reliable
    path computes, to the rounding of a sum in another order (the two compiled apart), and
    drop = churn = 0 is the reliable path itself, bit for bit."""
    loss_fn, params = mlp
    mesh, batches = ddl.make_mesh(data=8), make_batches(2, 32)
    results = []
    for options in ({}, {"drop": 0.0, "churn": 0.0}, {"drop": 1e-12}, {"churn": 1e-12}):
        strategy = ddl.gossip(loss_fn, optax.sgd(LR, momentum=MOMENTUM), mesh, **options)
        state, step = strategy.init(params), jax.jit(strategy.step)
        for t, batch in enumerate(batches):
            arrives, present = link_masks(np.asarray(state.model.key), t, 8, **options)
            assert np.asarray(present).all() and np.asarray(arrives).sum() == 64
            state, _ = step(state, batch)
        results.append(jax.tree.map(np.asarray, (state.params, state.opt_state)))
    chex.assert_trees_all_equal(results[0], results[1])
    for other in results[2:]:
        assert_trees_equal_to_rounding(results[0], other)


def test_masks_are_seeded_by_key_and_step_and_resume(mlp):
    key = np.asarray(jax.random.key_data(jax.random.key(0)))
    first = link_masks(key, 3, 64, drop=0.3, churn=0.2)
    chex.assert_trees_all_equal(first, link_masks(key, 3, 64, drop=0.3, churn=0.2))
    assert not np.array_equal(first[0], link_masks(key, 4, 64, drop=0.3, churn=0.2)[0])
    arrives, present = map(np.asarray, link_masks(key, 0, 1000, drop=0.3, churn=0.2))
    lost = ~arrives[np.ix_(present, present)]
    assert abs(lost.mean() - 0.3) < 0.01 and abs(present.mean() - 0.8) < 0.04
    assert not arrives[~present].any() and not arrives[:, ~present].any()
    # A run interrupted after two steps (its state fetched and put back) ends as one that was not.
    loss_fn, params = mlp
    mesh, batches = ddl.make_mesh(data=8), make_batches(3, 32)
    strategy = ddl.gossip(loss_fn, optax.sgd(LR), mesh, drop=0.4, churn=0.3)
    step, runs = jax.jit(strategy.step), []
    for stop in (None, 2):
        state = strategy.init(params)
        for t, batch in enumerate(batches):
            if t == stop:
                state = jax.device_put(
                    jax.device_get(state), jax.tree.map(lambda x: x.sharding, state)
                )
            state, _ = step(state, batch)
        runs.append(jax.tree.map(np.asarray, state))
    chex.assert_trees_all_equal(*runs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"drop": 1.0}, r"drop must be a probability in \[0, 1\), got 1.0"),
        ({"drop": -0.1}, "drop must be a finite real number >= 0.0, got -0.1"),
        ({"churn": 1.5}, r"churn must be a probability in \[0, 1\), got 1.5"),
        ({"churn": "often"}, "churn must be a finite real number"),
    ],
)
def test_bad_arguments(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        ddl.gossip(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4), **kwargs)
