"""noloco against a NumPy transcription of the authors' code, and its matchings' law.

Reference: jkolehm/noloco, ``src/noloco/sparse_optimizer_c.py`` (``SparseOptimizerC``,
``outer_step``, ``create_random_permutation``, ``batched``) with the outer settings of its
``configs/no_reduce_exp/*/*noloco_mean_*.yaml`` (``outer_lr: 0.7``, ``outer_momentum: 0.5``,
``local_group_size: 2``).
"""

import collections
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, worker_shards

import ddl_jax as ddl
from ddl_jax._src.strategies import noloco as noloco_module
from ddl_jax._src.strategies.noloco import draw_pairing, perfect_matchings

LR = 0.1


@functools.cache
def jitted_grad(loss_fn):
    return jax.jit(jax.grad(loss_fn))


def authors_outer_step(groups, theta, phi, momentum, outer_lr, outer_momentum):
    """``outer_step`` of sparse_optimizer_c.py for every group, on one leaf ``[N, ...]``:
    ``p`` is theta (the model), ``p_old`` phi (the prior outer weights), ``m`` the momentum."""
    theta, phi, momentum = theta.copy(), phi.copy(), momentum.copy()
    for group in groups:
        group = list(group)
        mean = phi[group].mean(0)  # mean of p_old over the group
        mean_g = (theta[group] - phi[group]).mean(0)  # mean of p - p_old
        for rank in group:
            m_ = (
                (outer_momentum - 1.0) * momentum[rank]
                + outer_lr * mean_g
                + outer_lr * (mean - phi[rank])
            )
            momentum[rank] += m_
            phi[rank] += momentum[rank]
            theta[rank] = phi[rank]
    return theta, phi, momentum


def authors_groups(permutation, size=2):
    """``batched(ranks, size)`` of sparse_optimizer_c.py: rank i of the permutation joins
    group i mod (N / size)."""
    n = len(permutation) // size
    out = [[] for _ in range(n)]
    for i, x in enumerate(permutation):
        out[i % n].append(x)
    return out


def reference(loss_fn, params, batches, n, period, groups_at, outer_lr, outer_momentum):
    """SparseOptimizerC.step with inner SGD: an outer step after every ``period`` inner
    steps, in the groups ``groups_at(t)`` given for the outer step after step t."""
    theta = jax.tree.map(lambda x: np.stack([np.asarray(x, np.float64)] * n), params)
    phi = jax.tree.map(np.copy, theta)
    momentum = jax.tree.map(np.zeros_like, theta)
    for t, batch in enumerate(batches):
        grads = [
            jitted_grad(loss_fn)(jax.tree.map(lambda x, j=j: x[j].astype(np.float32), theta), s)
            for j, s in enumerate(worker_shards(batch, n))
        ]
        theta = jax.tree.map(lambda x, *g: x - LR * np.stack(g), theta, *grads)
        if (t + 1) % period == 0:
            groups = groups_at(t)
            leaves, tree = jax.tree.flatten(theta)
            out = [
                authors_outer_step(groups, th, ph, m, outer_lr, outer_momentum)
                for th, ph, m in zip(
                    leaves, jax.tree.leaves(phi), jax.tree.leaves(momentum), strict=True
                )
            ]
            theta, phi, momentum = (jax.tree.unflatten(tree, [o[i] for o in out]) for i in range(3))
    return theta


def peers_of(groups, n):
    peer = list(range(n))
    for group in groups:
        if len(group) == 2:
            a, b = group
            peer[a], peer[b] = b, a
    return tuple(peer)


@pytest.mark.parametrize("n", [4, 8])
def test_defaults_follow_the_authors_outer_step_on_fixed_matchings(mlp, monkeypatch, n):
    """Fixed matchings (from fixed permutations, grouped as the authors group them) fed to
    both; noloco's defaults are the authors' outer_lr 0.7, outer_momentum 0.5, gamma = lr."""
    loss_fn, params = mlp
    period, steps = 2, 6
    rng = np.random.default_rng(0)
    schedule = [authors_groups([int(x) for x in rng.permutation(n)]) for _ in range(steps)]
    table = jnp.asarray([peers_of(g, n) for g in schedule], jnp.int32)
    monkeypatch.setattr(noloco_module, "draw_pairing", lambda key, step, n: table[step // period])
    batches = make_batches(steps, 8 * n)
    strategy = ddl.noloco(loss_fn, optax.sgd(LR), ddl.make_mesh(data=n), period=period)
    state, step = strategy.init(params), jax.jit(strategy.step)
    for batch in batches:
        state, _ = step(state, batch)
    expected = reference(
        loss_fn, params, batches, n, period, lambda t: schedule[t // period], 0.7, 0.5
    )
    chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), expected, atol=2e-5)
    flat = np.concatenate([x.reshape(n, -1) for x in jax.tree.leaves(expected)], 1)
    assert np.linalg.norm(flat - flat.mean(0), axis=1).mean() > 1e-3  # pairs, not all, agree


DRAWN_PERIOD = 3


def drawn_noloco(loss_fn, n):
    """The noloco of the drawn-matching tests: at n = 8 its step is one compiled program
    (noloco's slowest to compile), shared through the compile cache."""
    outer = optax.sgd(0.5, momentum=0.3)
    mesh = ddl.make_mesh(data=n)
    return ddl.noloco(loss_fn, optax.sgd(LR), mesh, period=DRAWN_PERIOD, outer_optimizer=outer)


@pytest.mark.parametrize("n", [8, 3])
def test_drawn_matchings_follow_the_authors_outer_step(mlp, n):
    """Unpatched: the matchings noloco draws, read back by draw_pairing, fed to the
    reference; a non-default outer optimizer of the same form. Odd n (which the authors'
    code rejects): the worker left alone is a group of one."""
    loss_fn, params = mlp
    batches = make_batches(6, 8 * n)
    strategy = drawn_noloco(loss_fn, n)
    state, step = strategy.init(params), jax.jit(strategy.step)
    key = np.asarray(state.model.key)
    for batch in batches:
        state, _ = step(state, batch)

    def groups_at(t):
        peer = [int(p) for p in draw_pairing(key, t, n)]
        return [(i, p) if i < p else (i,) for i, p in enumerate(peer) if i <= p]

    expected = reference(loss_fn, params, batches, n, DRAWN_PERIOD, groups_at, 0.5, 0.3)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), expected, atol=2e-5)


@pytest.mark.parametrize("n", [4, 5, 6])
def test_matchings_are_uniform_over_perfect_matchings(n):
    """Over many steps every perfect matching of n workers (for odd n: every matching
    leaving one alone) is drawn about equally often (the authors: a uniform permutation,
    batched in pairs); nothing else is drawn."""
    matchings = perfect_matchings(n)
    assert len(matchings) == {4: 3, 5: 15, 6: 15}[n]
    draws = 6000
    peers = jax.jit(jax.vmap(lambda s: draw_pairing(jnp.array([0, 7], jnp.uint32), s, n)))(
        jnp.arange(draws)
    )
    counts = collections.Counter(tuple(int(p) for p in row) for row in np.asarray(peers))
    assert set(counts) == set(matchings)
    expected = draws / len(matchings)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # chi-square with 2 (n = 4) or 14 (n = 5, 6) degrees of freedom, p = 0.001
    assert chi2 < {4: 13.8, 5: 36.1, 6: 36.1}[n]


def test_one_matching_on_every_worker(mlp):
    """Every worker takes the same draw: after one outer step from equal weights with
    anchor pull, paired workers hold equal weights and the pairs are a perfect matching.
    (The drawn-matching test's strategy: its compiled step serves both.)"""
    loss_fn, params = mlp
    n = 8
    strategy = drawn_noloco(loss_fn, n)
    state, step = strategy.init(params), jax.jit(strategy.step)
    key = np.asarray(state.model.key)
    for batch in make_batches(DRAWN_PERIOD, 8 * n):  # workers apart until the outer step
        state, _ = step(state, batch)
    peer = [int(p) for p in draw_pairing(key, DRAWN_PERIOD - 1, n)]
    assert sorted(peer) == list(range(n)) and all(peer[peer[i]] == i != peer[i] for i in range(n))
    for x in jax.tree.leaves(state.params):
        np.testing.assert_allclose(np.asarray(x), np.asarray(x)[peer], atol=1e-6)
