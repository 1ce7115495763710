"""Several workers a device (``workers=``) against one worker a device: the same run.

W = 8 workers on 8 devices (one each), against the same 8 on 4 and on 2 devices (two and
four each): parameters and every metric within float32 rounding, every step."""

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import bn_dropout_pair, make_batches, mlp_pair, train_steps

import ddl_jax as ddl
from ddl_jax._src.strategies.asynchronous.staleness import compute_times

W = 8  # workers, on 8 devices (one each) or on 4 and 2 (two and four each)

CASES = {
    "async": dict(compute_time=compute_times(1.0, spread=0.6, seed=4)),
    "softsync_2": dict(
        compute_time=compute_times(1.0, spread=0.5, seed=1), protocol=ddl.softsync(2)
    ),
    "ssp_1": dict(compute_time=compute_times([1.0] * 7 + [3.0]), protocol=ddl.ssp(1)),
    "ssp_2_drop": dict(
        compute_time=compute_times(1.0, spread=0.8, seed=3), protocol=ddl.ssp(2), drop=0.3
    ),
    "drop_churn": dict(
        compute_time=compute_times(1.0, spread=0.5, seed=2),
        drop=0.3,
        churn=ddl.churn(leave=0.3, away=2.5),
    ),
    "downpour_drop_churn": dict(
        compute_time=compute_times(1.0, spread=0.5, seed=5),
        protocol=ddl.downpour(3, 2, local_lr=0.1),
        drop=0.2,
        churn=ddl.churn(leave=0.2, away=2.0),
    ),
    "async_local_dylu": dict(
        compute_time=compute_times([1.0, 2.0] * 4),
        protocol=ddl.async_local(2, dynamic=True),
        inner_optimizer=optax.adam(1e-2),
    ),
}


def _data_parallel_with(reducer):
    """SGD data parallelism over W workers, ``reducer`` a function of the workers' axis."""
    return lambda loss, mesh: ddl.data_parallel(
        loss, optax.sgd(0.1), mesh, workers=W, reducer=reducer
    )


def _local_sgd_with(reducer, **options):
    """Local SGD (Adam, period 2) over W workers, ``reducer`` a function of the axis."""
    return lambda loss, mesh: ddl.local_sgd(
        loss, optax.adam(1e-2), mesh, period=2, workers=W, reducer=reducer, **options
    )


SYNCHRONOUS = {
    "data_parallel": lambda loss, mesh: ddl.data_parallel(loss, optax.sgd(0.1), mesh, workers=W),
    "local_sgd": lambda loss, mesh: ddl.local_sgd(
        loss, optax.adam(1e-2), mesh, period=2, workers=W
    ),
    "diloco_drop_churn_warmup": lambda loss, mesh: ddl.local_sgd(
        loss,
        optax.adam(1e-2),
        mesh,
        period=3,
        workers=W,
        drop=0.3,
        churn=0.2,
        warmup_sync_steps=2,
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    ),
    "hierarchy": lambda loss, mesh: ddl.local_sgd(
        loss, optax.adam(1e-2), mesh, hierarchy=((1, 2), (2, 4), (3, W)), workers=W
    ),
    "desloc": lambda loss, mesh: ddl.local_sgd(
        loss,
        optax.adam(1e-2),
        mesh,
        period=2,
        workers=W,
        state_periods={"mu": 4, "nu": 4},
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    ),
    "average_optimizer_state": lambda loss, mesh: ddl.local_sgd(
        loss, optax.adam(1e-2), mesh, period=2, workers=W, average_optimizer_state=True
    ),
    "streaming_diloco_overlap": lambda loss, mesh: ddl.streaming_diloco(
        loss,
        optax.adam(1e-2),
        mesh,
        period=4,
        fragments=2,
        overlap=1,
        mix=0.5,
        workers=W,
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    ),
    "noloco_rounds": lambda loss, mesh: ddl.noloco(
        loss, optax.adam(1e-2), mesh, period=2, workers=W, pairing="rounds"
    ),
    "noloco_uniform_no_pull": lambda loss, mesh: ddl.noloco(
        loss, optax.adam(1e-2), mesh, period=3, workers=W, pairing="uniform", anchor_pull=0.0
    ),
    "data_parallel_top_k": _data_parallel_with(lambda axis: ddl.compression.top_k(0.1, axis=axis)),
    "data_parallel_power_sgd": _data_parallel_with(
        lambda axis: ddl.compression.power_sgd(2, start_iter=0, axis=axis)
    ),
    "data_parallel_sign": _data_parallel_with(lambda axis: ddl.compression.sign(axis=axis)),
    **{
        f"data_parallel_{algorithm}": _data_parallel_with(
            lambda axis, algorithm=algorithm: ddl.allreduce_mean(axis, algorithm=algorithm)
        )
        for algorithm in ("ring", "tree", "ps")
    },
    "sparseloco": _local_sgd_with(lambda axis: ddl.compression.sparse_loco(0.1, axis=axis)),
    "sparseloco_drop": _local_sgd_with(
        lambda axis: ddl.compression.sparse_loco(0.1, axis=axis), drop=0.3
    ),
    "demo": _local_sgd_with(lambda axis: ddl.compression.demo(0.25, axis=axis)),
    "gossip_ring": lambda loss, mesh: ddl.gossip(
        loss, optax.sgd(0.1), mesh, topology="ring", workers=W, consensus_every=2
    ),
    "gossip_torus_drop_churn": lambda loss, mesh: ddl.gossip(
        loss, optax.sgd(0.1), mesh, topology="torus", workers=W, drop=0.3, churn=0.2
    ),
    "gossip_exponential": lambda loss, mesh: ddl.gossip(
        loss, optax.adam(1e-2), mesh, topology="exponential", workers=W
    ),
    "gossip_one_peer_drop": lambda loss, mesh: ddl.gossip(
        loss, optax.sgd(0.1), mesh, topology="one_peer_exponential", workers=W, drop=0.3
    ),
}


def _mesh(devices):
    return ddl.make_mesh(data=devices, devices=jax.devices()[:devices])


def _async(case, optimizer=None, **kwargs):
    def build(loss, mesh):
        chosen = optax.sgd(0.1) if optimizer is None else optimizer
        return ddl.async_sgd(loss, chosen, mesh, workers=W, **CASES[case], **kwargs)

    return build


@functools.cache
def _built(devices, build, pair):
    """``build`` on ``devices`` for ``pair``, made once: the runs of one strategy and the
    bytes read from its step share one traced and compiled program (JAX caches them by
    the step function, and ``jax.jit`` with the same arguments finds them)."""
    loss_fn, params = pair()
    return build(loss_fn, _mesh(devices)), params


def _run(devices, build, pair=mlp_pair, steps=6):
    strategy, params = _built(devices, build, pair)
    state, history = train_steps(strategy, params, make_batches(steps, 32, seed=3))
    return strategy.params(state), history


def _check_same(got, expected):
    (params, history), (their_params, their_history) = got, expected
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(their_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(history, their_history, strict=True):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7, err_msg=key)


@functools.cache
def _one_each(case):
    """The run of ``case`` with one worker a device (replicated server), shared by the tests
    that compare against it."""
    return _run(W, _async(case))


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_sgd_with_several_workers_a_device_is_the_run_of_one_each(case):
    # four a device; two a device (the same code: a device's k rows, any k > 1) runs under
    # the sharded server in test_a_sharded_server_is_the_replicated_one
    got = _run(2, _async(case))
    _check_same(got, _one_each(case))
    assert max(h["pushes"] for h in got[1]) > 1  # events happened, several a step


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sharded_server_is_the_replicated_one(case):
    expected = _one_each(case)
    for devices in (W, 4):  # one worker a device, and two
        _check_same(_run(devices, _async(case, server="sharded")), expected)


def test_a_sharded_server_with_adam_momentum_and_model_state_is_the_replicated_one():
    # Adam keeps its state per shard, as on the whole model
    adam = optax.adam(1e-2)
    sharded, build = _async("softsync_2", adam, server="sharded"), _async("softsync_2", adam)
    _check_same(_run(2, sharded), _run(W, build))
    # so does momentum, here in the runs that show the model state (batch norm) staying
    # replicated and travelling with the pushes (not Adam: see
    # test_model_state_and_dropout_keys_travel_as_with_one_worker_a_device)
    sgd = optax.sgd(0.1, momentum=0.9)
    sharded, build = _async("softsync_2", sgd, server="sharded"), _async("softsync_2", sgd)
    _check_same(_run(2, sharded, pair=bn_dropout_pair), _run(W, build, pair=bn_dropout_pair))


def test_a_sharded_server_takes_an_optimizer_whose_state_has_shared_parts():
    """Adafactor keeps placeholders its update computes afresh (not typed varying): the
    sharded server still runs it, as the replicated one (unfactored, without its two
    whole-tensor rules, it acts elementwise: the same run)."""
    elementwise = optax.adafactor(0.05, multiply_by_parameter_scale=False, clipping_threshold=None)
    sharded = _async("softsync_2", elementwise, server="sharded")
    _check_same(_run(2, sharded), _run(W, _async("softsync_2", elementwise)))
    params, history = _run(2, _async("async", optax.adafactor(0.05), server="sharded"))
    assert all(np.isfinite(h["loss"]).all() for h in history)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_a_sharded_server_holds_one_shard_a_device():
    loss_fn, params = mlp_pair()
    strategy = _async("async", server="sharded")(loss_fn, _mesh(2))
    state = strategy.init(params)
    size = sum(x.size for x in jax.tree.leaves(params))
    assert state.params.shape == (2, -(-size // 2))
    assert [s.data.shape for s in state.params.addressable_shards] == [(1, -(-size // 2))] * 2


def test_bad_server_arguments_raise():
    loss_fn, _ = mlp_pair()
    mesh = _mesh(4)
    with pytest.raises(ValueError, match='server must be "replicated" or "sharded"'):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, server="ps")
    with pytest.raises(ValueError, match='keeps a sharded server: drop server="replicated"'):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, protocol=ddl.downpour(2, 2, local_lr=0.1),
                      server="replicated")  # fmt: skip


@pytest.mark.parametrize("name", sorted(SYNCHRONOUS))
def test_synchronous_strategies_with_several_workers_a_device_are_the_run_of_one_each(name):
    expected = _run(W, SYNCHRONOUS[name])
    for devices in (4, 2):
        _check_same(_run(devices, SYNCHRONOUS[name]), expected)


def _collectives(devices, build):
    strategy, params = _built(devices, build, mlp_pair)
    batch = make_batches(1, 32, seed=3)[0]
    # jitted as train_steps jits it: the program the test above runs, compiled once
    step = jax.jit(strategy.step, donate_argnums=0)
    stats = ddl.comm_stats(step, strategy.init(params), batch)
    return ddl.sim.per_worker(stats, W // devices)


def _priced(stats):
    """Each collective as the network model prices it; conditional ones marked, not named
    (XLA numbers its branches differently in different programs)."""
    return sorted((op.kind, op.nbytes, op.group, op.count, op.rounds, max(op.sent),
                   bool(op.branch)) for op in stats.ops)  # fmt: skip


@pytest.mark.parametrize(
    "name",
    ["data_parallel", "local_sgd", "data_parallel_top_k", "data_parallel_power_sgd",
     "sparseloco", "demo", "streaming_diloco_overlap", "gossip_ring", "data_parallel_ring"],
)  # fmt: skip
def test_bytes_per_worker_are_those_of_one_worker_a_device(name):
    expected = _priced(_collectives(W, SYNCHRONOUS[name]))
    assert expected  # the step communicates
    got = _priced(_collectives(4, SYNCHRONOUS[name]))
    assert got == expected
    if name != "gossip_ring":  # on 2 devices the ring's two moves are one device shift
        assert _priced(_collectives(2, SYNCHRONOUS[name])) == expected


@pytest.mark.parametrize("build", [_async("async"), SYNCHRONOUS["data_parallel"]])
def test_model_state_and_dropout_keys_travel_as_with_one_worker_a_device(build):
    # SGD: Adam's step on the bias before batch norm (a zero gradient) amplifies rounding
    _check_same(_run(2, build, pair=bn_dropout_pair), _run(W, build, pair=bn_dropout_pair))


def test_workers_must_divide_over_the_devices():
    loss_fn, _ = mlp_pair()
    mesh = ddl.make_mesh(data=4, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="workers=6 must be a multiple of the 4 devices"):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=6)
    with pytest.raises(ValueError, match="workers must be"):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=0)
    with pytest.raises(ValueError, match="Give it as a function of the axis"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, workers=8, reducer=ddl.allreduce_mean())
    with pytest.raises(TypeError, match="or a function of the workers' axis"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer="top_k")
    with pytest.raises(ValueError, match="which islands do not"):
        ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(island=2, data=2), workers=8)
    inner = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(island=2, data=2))
    with pytest.raises(ValueError, match="workers=16 is the inner strategy's to set"):
        ddl.local_sgd(inner=inner, period=4, workers=16)


@pytest.mark.parametrize(
    "name",
    ["local_sgd", "gossip_ring", "async", "async_sharded", "data_parallel_ring",
     "data_parallel_power_sgd", "streaming_diloco_overlap", "noloco_uniform_no_pull"],
)  # fmt: skip
def test_several_workers_a_device_compile_once_and_resume_bitwise(name, tmp_path):
    builds = {"async": _async("async"), "async_sharded": _async("async", server="sharded")}
    build = builds.get(name) or SYNCHRONOUS[name]
    loss_fn, params = bn_dropout_pair()  # the model state and the keys resume too
    strategy, traces = build(loss_fn, _mesh(2)), []

    def step(state, batch):  # the strategy's step, counting fit's traces of it
        traces.append(1)
        return strategy.step(state, batch)

    counted = strategy._replace(step=step)
    batches = make_batches(6, 32, seed=3)
    whole, _ = ddl.fit(counted, params, batches, steps=6, progress=False)
    assert len(traces) == 1  # six steps from the initial state, one program
    args = {"checkpoint_dir": tmp_path, "progress": False}
    ddl.fit(counted, params, batches, steps=3, checkpoint_every=3, **args)
    resumed, _ = ddl.fit(counted, params, batches, steps=6, **args)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(traces) == 1  # and the same program from the restored state
