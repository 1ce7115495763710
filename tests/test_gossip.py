"""gossip against a dense mixing matrix applied on one device."""

import math

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import make_batches, worker_shards
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.strategies import gossip as ddl_gossip


def dense_matrix(topology, n):
    """Uniform weights 1/(degree+1) over each device and the devices it hears from."""
    hears = [set() for _ in range(n)]
    for i in range(n):
        if topology == "ring":
            hears[i] |= {(i - 1) % n, (i + 1) % n}
        elif topology == "complete":
            hears[i] |= set(range(n))
        elif topology == "exponential":
            hears[i] |= {(i - 2**k) % n for k in range(n.bit_length()) if 2**k < n}
        elif topology == "torus":
            rows = {4: 2, 8: 2}[n]
            cols = n // rows
            r, c = divmod(i, cols)
            hears[i] |= {((r + d) % rows) * cols + c for d in (1, -1)}
            hears[i] |= {r * cols + (c + d) % cols for d in (1, -1)}
        hears[i] -= {i}
    w = np.zeros((n, n))
    for i in range(n):
        for j in hears[i] | {i}:
            w[i, j] = 1 / (len(hears[i]) + 1)
    return w


def mixed_once(topology, n, mlp, **kwargs):
    """Replicas set to random values, one step with a zero learning rate: only mixing acts."""
    loss_fn, params = mlp
    mesh = ddl.make_mesh(data=n)
    strategy = ddl.gossip(loss_fn, optax.sgd(0.0), mesh, topology=topology, **kwargs)
    state = strategy.init(params)
    rng = np.random.default_rng(0)
    replicas = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), state.params)
    state = state._replace(params=jax.device_put(replicas, NamedSharding(mesh, P("data"))))
    state, metrics = jax.jit(strategy.step)(state, make_batches(1, 4 * n)[0])
    return replicas, state, metrics


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "complete"])
def test_mixing_equals_the_dense_matrix(mlp, topology, n):
    w = dense_matrix(topology, n)
    np.testing.assert_allclose(w.sum(0), 1)
    np.testing.assert_allclose(w.sum(1), 1)
    np.testing.assert_allclose(ddl.mixing_matrix(topology, n), w, atol=1e-12)
    before, state, _ = mixed_once(topology, n, mlp)
    expected = jax.tree.map(lambda x: np.tensordot(w, x, axes=1), before)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), expected, atol=1e-5)


def test_custom_mixing_weights(mlp):
    n = 4
    w = 0.5 * np.eye(n) + 0.25 * (np.roll(np.eye(n), 1, 0) + np.roll(np.eye(n), -1, 0))
    before, state, _ = mixed_once("ring", n, mlp, mixing_weights=w)
    expected = jax.tree.map(lambda x: np.tensordot(w, x, axes=1), before)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), expected, atol=1e-5)


def test_consensus_distance_is_the_mean_distance_to_the_average(mlp):
    _, state, metrics = mixed_once("ring", 8, mlp, consensus_every=1)
    flat = np.concatenate(
        [np.asarray(x).reshape(8, -1) for x in jax.tree.leaves(state.params)], axis=1
    )
    expected = np.linalg.norm(flat - flat.mean(0), axis=1).mean()
    np.testing.assert_allclose(metrics["consensus_distance"], expected, rtol=1e-4)


def trained(strategy, params, batches):
    state, step = strategy.init(params), jax.jit(strategy.step)
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


def test_complete_graph_adapting_then_combining_is_data_parallel(mlp):
    loss_fn, params = mlp
    batches, mesh = make_batches(5, 32), ddl.make_mesh(data=8)
    results = []
    for strategy in (
        ddl.gossip(loss_fn, optax.sgd(0.1), mesh, topology="complete", order="adapt_then_combine"),
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh),
    ):
        results.append(strategy.params(trained(strategy, params, batches)[0]))
    chex.assert_trees_all_close(*results, atol=1e-5)


def test_dpsgd_keeps_each_workers_own_update_out_of_the_mix(mlp):
    """D-PSGD (the default) on the complete graph from equal replicas: the mix of the models
    before the step is the model itself, so each replica is it plus its own update, and the
    replicas' mean is one step of synchronous SGD while they disagree."""
    loss_fn, params = mlp
    batch, mesh = make_batches(1, 32)[0], ddl.make_mesh(data=8)
    sync = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    expected = sync.params(trained(sync, params, [batch])[0])
    strategy = ddl.gossip(loss_fn, optax.sgd(0.1), mesh, topology="complete", consensus_every=1)
    state, metrics = trained(strategy, params, [batch])
    chex.assert_trees_all_close(strategy.params(state), expected, atol=1e-6)
    own = [
        jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss_fn)(params, shard))
        for shard in worker_shards(batch, 8)
    ]
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, state.params), jax.tree.map(lambda *r: np.stack(r), *own),
        atol=1e-6,
    )  # fmt: skip
    assert float(metrics["consensus_distance"]) > 1e-3


@pytest.mark.parametrize(("topology", "degree"), [("ring", 2), ("exponential", 3), ("torus", 3)])
@pytest.mark.parametrize("consensus_every", [0, 10])
def test_sends_degree_times_the_parameters_and_no_all_reduce(
    mlp, topology, degree, consensus_every, cluster_buckets
):
    """Torus on 8 = 2x4: the two vertical neighbours coincide, so degree 3."""
    loss_fn, params = mlp
    n = 8
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.gossip(
        loss_fn,
        optax.sgd(0.1),
        ddl.make_mesh(data=n),
        topology=topology,
        consensus_every=consensus_every,
    )
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), make_batches(1, 32)[0])
    assert stats.bytes_sent == (degree * param_bytes + 2 * (n - 1) / n * 4,) * n
    assert stats.bytes_by_kind == {
        "collective-permute": degree * param_bytes,
        "all-reduce": 2 * (n - 1) / n * 4,  # the scalar loss metric, nothing else
    }
    # One buffer per round (XLA:CPU's gloo makes a call per buffer), not one per leaf.
    permutes = [op for op in stats.ops if op.kind == "collective-permute"]
    assert len(permutes) == degree and {op.buffers for op in permutes} == {1}
    # Measuring consensus_distance is the only global all-reduce of the parameters, in a
    # branch taken one step in consensus_every.
    expected = {} if not consensus_every else {"measure": 2 * (n - 1) / n * (param_bytes + 4)}
    assert sorted(stats.branches.values()) == sorted(expected.values())


def authors_phone_book(rank, world_size):
    """Rank's out-peers in the order Assran et al.'s code cycles through them, one an
    iteration (stochastic_gradient_push, gossip_module/graph_manager.py,
    DynamicDirectedExponentialGraph._make_graph)."""
    group = []
    for i in range(int(math.log(world_size - 1, 2)) + 1):
        for peer in ((rank + 2**i) % world_size, (rank - 2**i) % world_size):
            if peer not in group:
                group.append(peer)
    return group


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12])
def test_one_peer_exponential_cycles_the_authors_peers(n):
    perms = ddl_gossip.neighbour_permutations("one_peer_exponential", n)
    books = [authors_phone_book(rank, n) for rank in range(n)]
    assert [[perm[rank] for rank in range(n)] for perm in perms] == [
        [books[rank][k] for rank in range(n)] for k in range(len(books[0]))
    ]
    for t in range(2 * len(perms)):  # at step t each rank mixes 1/2 with book[t % L]
        expected = 0.5 * np.eye(n)
        for rank in range(n):
            expected[books[rank][t % len(perms)], rank] += 0.5
        w = ddl.mixing_matrix("one_peer_exponential", n, step=t)
        np.testing.assert_array_equal(w, expected)


def test_one_peer_exponential_sends_the_parameters_once_a_step(mlp):
    """One branch a peer, each sending the parameters once; only the taken one runs."""
    loss_fn, params = mlp
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    strategy = ddl.gossip(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8),
                          topology="one_peer_exponential", consensus_every=0)  # fmt: skip
    state, batch = strategy.init(params), make_batches(1, 32)[0]
    stats = ddl.comm_stats(jax.jit(strategy.step), state, batch)
    assert stats.bytes_by_kind == {"all-reduce": 2 * 7 / 8 * 4}  # the loss metric
    assert sorted(stats.branches.values()) == [param_bytes] * 5  # shifts 1, 7, 2, 6, 4
    _, metrics = jax.jit(strategy.step)(state, batch)
    assert float(metrics["mixing_rounds"]) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"topology": "one_peer_exponential", "mixing_weights": np.eye(4)},
            "mixing_weights weighs a static topology's neighbours; 'one_peer_exponential'",
        ),
        ({"topology": "star"}, r"topology='star' is not known; valid: \['ring', 'torus'"),
        ({"mixing_weights": np.ones((4, 4))}, "must be doubly stochastic"),
        ({"mixing_weights": np.eye(3)}, r"mixing_weights must have shape \(4, 4\)"),
        ({"mixing_weights": np.full((4, 4), 0.25)}, r"mixing_weights\[0, 2\].*not a neighbour"),
        ({"consensus_every": -1}, "consensus_every must be an int >= 0"),
        ({"order": "atc"}, r"order='atc' is not known; valid: \['dpsgd', 'adapt_then_combine'\]"),
        ({"mixing_weights": "uniform"}, "mixing_weights must be a numeric 4 x 4 array"),
    ],
)
def test_bad_arguments(mlp, kwargs, match):
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=match):
        ddl.gossip(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4), **kwargs)


def test_a_dynamic_topologys_matrix_needs_its_step():
    with pytest.raises(ValueError, match="changes every step; give step="):
        ddl.mixing_matrix("one_peer_exponential", 4)
    np.testing.assert_array_equal(ddl.mixing_matrix("one_peer_exponential", 1, step=3), [[1.0]])
