"""noloco against DiLoCo / synchronous SGD (N = 2) and a numpy reference of its outer rule."""

import functools
import itertools

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import make_batches, worker_shards

import ddl_jax as ddl
from ddl_jax._src.strategies.noloco import draw_round, pairing_rounds, perfect_matchings

LR = 0.1


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_pairing_rounds_hold_every_pair_once(n):
    rounds = pairing_rounds(n)
    assert len(rounds) == max(n - 1 + n % 2, 1)
    pairs = []
    for peer in rounds:
        assert all(peer[peer[i]] == i for i in range(n))  # a matching
        assert sum(peer[i] == i for i in range(n)) == n % 2  # one left alone for odd n
        pairs += [frozenset((i, p)) for i, p in enumerate(peer) if i < p]
    assert sorted(map(sorted, pairs)) == sorted(map(list, itertools.combinations(range(n), 2)))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_perfect_matchings_are_every_maximum_matching_once(n):
    matchings = perfect_matchings(n)
    count = 1
    for k in range(n + n % 2 - 1, 0, -2):
        count *= k
    assert len(matchings) == len(set(matchings)) == count  # (n - 1)!!, or n!! for odd n
    for peer in matchings:
        assert all(peer[peer[i]] == i for i in range(n))
        assert sum(peer[i] == i for i in range(n)) == n % 2


@pytest.mark.parametrize("period", [1, 3])
def test_two_workers_are_diloco(mlp, period):
    """N = 2: one pairing, equal anchors. H = 1 with plain averaging (outer SGD at lr 1) is
    synchronous SGD; H = 3 with the default outer step is DiLoCo with the same."""
    loss_fn, params = mlp
    mesh, batches = ddl.make_mesh(data=2), make_batches(6, 16)
    if period == 1:
        ours = ddl.noloco(loss_fn, optax.sgd(LR), mesh, period=1, outer_optimizer=optax.sgd(1.0))
        known = ddl.data_parallel(loss_fn, optax.sgd(LR), mesh)
    else:
        outer = optax.sgd(0.7, momentum=0.5)
        ours = ddl.noloco(loss_fn, optax.sgd(LR), mesh, period=3)
        known = ddl.local_sgd(loss_fn, optax.sgd(LR), mesh, period=3, outer_optimizer=outer)
    results, synchronised = [], []
    for strategy in (ours, known):
        state, step = strategy.init(params), jax.jit(strategy.step)
        for batch in batches:
            state, metrics = step(state, batch)
            synchronised.append(float(metrics.get("synchronised", -1)))
        results.append(strategy.params(state))
    chex.assert_trees_all_close(*results, atol=1e-5)
    assert synchronised[:6] == [float((t + 1) % period == 0) for t in range(6)]


@functools.cache
def jitted_grad(loss_fn):
    return jax.jit(jax.grad(loss_fn))


def reference(loss_fn, params, batches, n, period, alpha, beta, gamma, key):
    """NoLoCo under pairing="rounds" by its update rule on stacked numpy replicas: inner SGD,
    then every H steps
    delta_i <- alpha delta_i - beta mean_pair(phi - theta) - gamma (phi_i - mean_pair(phi)),
    phi_i <- phi_i + delta_i, theta_i <- phi_i."""
    theta = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), params)
    phi = jax.tree.map(np.copy, theta)
    delta = jax.tree.map(np.zeros_like, theta)
    rounds = pairing_rounds(n)
    for t, batch in enumerate(batches):
        grads = [
            jitted_grad(loss_fn)(jax.tree.map(lambda x, j=j: x[j], theta), shard)
            for j, shard in enumerate(worker_shards(batch, n))
        ]
        theta = jax.tree.map(lambda x, *g: x - LR * np.stack(g), theta, *grads)
        if (t + 1) % period == 0:
            peer = list(rounds[int(draw_round(key, t, n))])

            def outer(d, f, th, peer=peer):
                pseudo = f - th
                return alpha * d - beta * (pseudo + pseudo[peer]) / 2 - gamma * (f - f[peer]) / 2

            delta = jax.tree.map(outer, delta, phi, theta)
            phi = jax.tree.map(np.add, phi, delta)
            theta = jax.tree.map(np.copy, phi)
    return theta


@pytest.mark.parametrize(("n", "anchor_pull"), [(8, 0.5), (3, 1.0)])
def test_outer_rule_equals_the_modified_nesterov_reference(mlp, n, anchor_pull):
    loss_fn, params = mlp
    alpha, beta, period = 0.5, 0.7, 2
    batches = make_batches(4, 8 * n)
    strategy = ddl.noloco(
        loss_fn,
        optax.sgd(LR),
        ddl.make_mesh(data=n),
        period=period,
        outer_optimizer=optax.sgd(beta, momentum=alpha),
        anchor_pull=anchor_pull,
        consensus_every=1,
        pairing="rounds",
    )
    state, step = strategy.init(params), jax.jit(strategy.step)
    key = np.asarray(state.model.key)
    for batch in batches:
        state, metrics = step(state, batch)
    expected = reference(loss_fn, params, batches, n, period, alpha, beta, beta * anchor_pull, key)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), expected, atol=2e-5)
    flat = np.concatenate([x.reshape(n, -1) for x in jax.tree.leaves(expected)], 1)
    distance = np.linalg.norm(flat - flat.mean(0), axis=1).mean()
    np.testing.assert_allclose(metrics["consensus_distance"], distance, rtol=1e-4)
    assert distance > 1e-3  # pairs, not all workers, agree after an outer step


@pytest.mark.parametrize(("pairing", "count"), [(None, 105), ("uniform", 105), ("rounds", 7)])
def test_sends_to_one_peer_and_no_all_reduce_of_the_parameters(
    mlp, cluster_buckets, pairing, count
):
    """One branch per matching (all 105 perfect matchings of 8 workers, or the 7 rounds),
    each sending 2 x parameter bytes to one peer."""
    loss_fn, params = mlp
    n, param_bytes = 8, 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.noloco(
        loss_fn,
        optax.sgd(LR),
        ddl.make_mesh(data=n),
        period=1,
        consensus_every=0,
        pairing=pairing,
    )
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), make_batches(1, 32)[0])
    assert stats.bytes_by_kind == {"all-reduce": 2 * (n - 1) / n * 4}  # the loss metric
    assert sorted(set(stats.branches.values())) == [2 * param_bytes]  # Delta and phi, one peer
    # Each pairing's branch sends one bucket of one buffer, not one permute per leaf.
    permutes = [op for op in stats.ops if op.kind == "collective-permute"]
    branches = [op.branch for op in permutes]
    assert len(permutes) == len(set(branches)) == len(branches) == count
    assert {op.buffers for op in permutes} == {1}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"period": 0}, "period must be an int >= 1"),
        ({"period": 2, "anchor_pull": -1.0}, "anchor_pull must be a finite real number >= 0"),
        ({"period": 2, "consensus_every": -1}, "consensus_every must be an int >= 0"),
        ({"period": 2, "pairing": "random"}, "pairing must be 'uniform', 'rounds' or None"),
    ],
)
def test_bad_arguments(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        ddl.noloco(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4), **kwargs)
