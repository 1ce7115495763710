"""ring / tree / ps all-reduce against lax.psum, and their bytes read from the HLO."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl

ALGORITHMS = {
    "ring": ddl.collectives.ring_allreduce,
    "tree": ddl.collectives.tree_allreduce,
    "ps": ddl.collectives.ps_allreduce,
}


def per_device(mesh, fn):
    """jit(shard_map(fn)) taking and returning pytrees stacked over the ``data`` axis."""

    def body(tree):
        out = fn(jax.tree.map(lambda x: x[0], tree))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))


shapes = hs.lists(hs.integers(1, 6), min_size=0, max_size=3).map(tuple)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@settings(max_examples=4, deadline=None)
@given(
    leaf_shapes=hs.lists(shapes, min_size=1, max_size=3),
    int_dtype=hs.sampled_from([np.int32, np.int8, np.uint32]),
    seed=hs.integers(0, 2**16),
)
def test_equals_psum(name, n, leaf_shapes, int_dtype, seed):
    """Floats agree to rounding; integers exactly, overflow wrapping included."""
    mesh = ddl.make_mesh(data=n)
    rng = np.random.default_rng(seed)
    info = np.iinfo(int_dtype)
    tree = {
        "float": [rng.normal(size=(n, *s)).astype(np.float32) for s in leaf_shapes],
        "int": [
            rng.integers(info.min, info.max, size=(n, *s), endpoint=True).astype(int_dtype)
            for s in leaf_shapes
        ],
    }
    tree = jax.device_put(tree, NamedSharding(mesh, P("data")))
    got = per_device(mesh, lambda t: ALGORITHMS[name](t, "data"))(tree)
    want = per_device(mesh, lambda t: jax.lax.psum(t, "data"))(tree)
    for g, w in zip(got["float"], want["float"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert g.shape == w.shape and g.dtype == w.dtype
    for g, w in zip(got["int"], want["int"], strict=True):
        np.testing.assert_array_equal(g, w)


def stats_of(name, n, size):
    mesh = ddl.make_mesh(data=n)
    x = jax.ShapeDtypeStruct((n, size), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return ddl.comm_stats(per_device(mesh, lambda t: ALGORITHMS[name](t, "data")), x)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_sends_the_bandwidth_optimum(n):
    k = 4 * 1000 * n  # bytes of the buffer, divisible by n
    stats = stats_of("ring", n, k // 4)
    assert stats.bytes_sent == (2 * (n - 1) / n * k,) * n
    assert stats.rounds == 2 * (n - 1)
    assert set(stats.bytes_by_kind) == {"collective-permute"}


def test_ring_pads_a_buffer_that_does_not_divide():
    n, size = 8, 1001
    assert stats_of("ring", n, size).bytes_per_device == 2 * (n - 1) * math.ceil(size / n) * 4


@pytest.mark.parametrize("n", [2, 4, 8])
def test_parameter_server_traffic_concentrates_on_the_root(n):
    k = 4 * 1000
    stats = stats_of("ps", n, k // 4)
    assert stats.bytes_sent == ((n - 1) * k,) + (k,) * (n - 1)
    assert stats.rounds == 2 * (n - 1)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_tree_takes_logarithmic_rounds(n):
    k = 4 * 1000
    stats = stats_of("tree", n, k // 4)
    depth = math.ceil(math.log2(n))
    assert stats.rounds == 2 * depth

    def children(j):  # j's children in the binomial tree rooted at 0
        return sum(1 for d in (2**i for i in range(depth)) if j % (2 * d) == 0 and j + d < n)

    # each device sends its subtree's sum up once (but the root), then the total to each child
    assert stats.bytes_sent == tuple(k * ((j > 0) + children(j)) for j in range(n))
    assert stats.bytes_per_device == depth * k  # the root, with the most children


def test_collectives_name_the_valid_axes():
    mesh = ddl.make_mesh(data=2)
    x = jax.device_put(np.ones((2, 3), np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"axis_name='model' is not an axis .*\['data'\]"):
        per_device(mesh, lambda t: ddl.collectives.ring_allreduce(t, "model"))(x)


def test_comm_stats_multiplies_loops_and_reports_branches_apart():
    mesh = ddl.make_mesh(data=4)

    def body(x, flag):
        def add_sum(_, acc):
            return acc + jax.lax.psum(acc + x, "data")

        looped = jax.lax.fori_loop(0, 5, add_sum, jnp.zeros_like(x))
        branch = jax.lax.cond(
            flag[0] > 0,
            lambda: jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)]),
            lambda: x,
        )
        return looped + branch

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    x = jax.device_put(np.ones((4 * 250,), np.float32), NamedSharding(mesh, P("data")))
    flag = jax.device_put(np.ones((4,), np.int32), NamedSharding(mesh, P("data")))
    stats = ddl.comm_stats(fn, x, flag)
    k = 250 * 4
    assert stats.bytes_by_kind == {"all-reduce": 5 * 2 * 3 / 4 * k}
    assert stats.rounds == 5 * 2 * 3
    assert list(stats.branches.values()) == [k]


def test_comm_stats_of_a_data_parallel_step_matches_the_parameter_count(mlp):
    loss_fn, params = mlp
    n = 8
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    batch = {"x": np.zeros((32, 12), np.float32), "y": np.zeros(32, np.int32)}
    for algorithm in ("psum", "ring"):
        reducer = ddl.allreduce_mean(algorithm=algorithm)
        mesh = ddl.make_mesh(data=n)
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
        loss_bytes = 4
        if algorithm == "psum":  # one all-reduce of the gradient with the loss riding along
            assert stats.bytes_per_device == 2 * (n - 1) / n * (grad_bytes + loss_bytes)
        else:
            chunk = math.ceil(grad_bytes / 4 / n) * 4
            assert stats.bytes_by_kind["collective-permute"] == 2 * (n - 1) * chunk
            assert stats.bytes_by_kind["all-reduce"] == 2 * (n - 1) / n * loss_bytes


def test_comm_stats_rejects_a_plain_function():
    with pytest.raises(TypeError, match="must be a jax.jit function"):
        ddl.comm_stats(lambda x: x, 1.0)


def test_a_combined_collective_priced_per_buffer_pays_each_buffers_messages():
    """Two calls of an all-reduce of 3 buffers over 4 devices (6 rounds), 300 bytes from
    the busiest device: per op, or per buffer as XLA:CPU's gloo sends them."""
    groups = ((0, 1, 2, 3),)
    op = ddl.sim.CollectiveOp("all-reduce", 200, 2, 4, (300.0,) * 4, 6, "", 3, groups)
    stats = ddl.sim.summarise((op,))
    net = ddl.sim.Network(bandwidth=100.0, latency=0.01, overhead=0.5)
    assert ddl.sim.estimate_step_time(stats, net) == pytest.approx(2 * (0.5 + 0.06 + 3.0))
    priced = ddl.sim.estimate_step_time(stats, net, per_buffer=True)
    assert priced == pytest.approx(2 * (3 * (0.5 + 0.06) + 3.0))
    with pytest.raises(TypeError, match="per_buffer must be a bool"):
        ddl.sim.estimate_step_time(stats, net, per_buffer="yes")


def test_the_step_time_names_a_wrong_network_or_island_size():
    op = ddl.sim.CollectiveOp("all-reduce", 8, 1, 8, (14.0,) * 8, 14, "", 1, (tuple(range(8)),))
    stats = ddl.sim.summarise((op,))
    with pytest.raises(TypeError, match="network must be a ddl.sim.Network"):
        ddl.sim.estimate_step_time(stats, (1e9, 1e-6))
    with pytest.raises(TypeError, match="inner_network must be a ddl.sim.Network"):
        ddl.sim.estimate_step_time(stats, ddl.sim.ETHERNET_1G, inner_network=1e9, island_devices=4)
    for size in (3, 16):
        with pytest.raises(ValueError, match=f"island_devices={size} does not divide the"):
            ddl.sim.estimate_step_time(
                stats, ddl.sim.ETHERNET_1G, inner_network=ddl.sim.TPU_V4_ICI, island_devices=size
            )
    with pytest.raises(TypeError, match="per_worker: stats must be a ddl.sim.CommStats"):
        ddl.sim.per_worker(None, 2)
    assert isinstance(stats, ddl.sim.CommStats)


def test_a_lowered_or_compiled_program_is_read_as_its_jit_function_is():
    mesh = ddl.make_mesh(data=4)
    body = lambda x: jax.lax.psum(x, "data") @ x.T  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
    lowered = f.lower(x)
    assert ddl.comm_stats(lowered) == ddl.comm_stats(lowered.compile()) == ddl.comm_stats(f, x)
    compute = ddl.sim.compute_stats(f, x)
    assert compute.flops > 0
    assert ddl.sim.compute_stats(lowered) == ddl.sim.compute_stats(lowered.compile()) == compute
    with pytest.raises(TypeError, match="a lowered or compiled program takes no arguments"):
        ddl.comm_stats(lowered, x)


def test_alpha_beta_step_time():
    n, k = 8, 4 * 1000 * 8
    stats = stats_of("ring", n, k // 4)
    net = ddl.sim.Network(bandwidth=1e9, latency=1e-5)
    expected = 0.5 + 2 * (n - 1) * (1e-5 + k / n / 1e9)
    assert ddl.sim.estimate_step_time(stats, net, compute_s=0.5) == pytest.approx(expected)
    assert ddl.sim.estimate_step_time(stats, ddl.sim.ETHERNET_1G) > ddl.sim.estimate_step_time(
        stats, ddl.sim.INFINIBAND_100G
    )
    with pytest.raises(ValueError, match="network.bandwidth must be a finite real number > 0"):
        ddl.sim.estimate_step_time(stats, ddl.sim.Network(0.0, 1e-6))
    with pytest.raises(ValueError, match="network.latency must be a finite real number >= 0"):
        ddl.sim.estimate_step_time(stats, ddl.sim.Network(1e9, -1.0))
    with pytest.raises(ValueError, match="compute_s must be a finite real number >= 0"):
        ddl.sim.estimate_step_time(stats, net, compute_s=float("nan"))
    numpy_net = ddl.sim.Network(np.float32(1e9), np.float64(1e-5))
    assert ddl.sim.estimate_step_time(stats, numpy_net, np.float32(0.5)) == pytest.approx(expected)
    jax_net = ddl.sim.Network(jnp.float32(1e9), jnp.float32(1e-5))  # JAX scalars, as NumPy's
    assert ddl.sim.estimate_step_time(stats, jax_net, jnp.float32(0.5)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="compute_s must be a finite real number"):
        ddl.sim.estimate_step_time(stats, net, compute_s=jnp.ones(2))
