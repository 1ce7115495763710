"""Several workers a device (``workers=``) against one worker a device: the same run."""

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
    "drop_churn": dict(
        compute_time=compute_times(1.0, spread=0.5, seed=2),
        drop=0.3,
        churn=ddl.churn(leave=0.3, away=2.5),
    ),
    "async_local_dylu": dict(
        compute_time=compute_times([1.0, 2.0] * 4),
        protocol=ddl.async_local(2, dynamic=True),
        inner_optimizer=optax.adam(1e-2),
    ),
}


def _run(devices, case, pair=mlp_pair, steps=6):
    loss_fn, params = pair()
    mesh = ddl.make_mesh(data=devices, devices=jax.devices()[:devices])
    strategy = ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=W, **CASES[case])
    state, history = train_steps(strategy, params, make_batches(steps, 32, seed=3))
    return strategy.params(state), history


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("devices", [4, 2])
def test_async_sgd_with_several_workers_a_device_is_the_run_of_one_each(case, devices):
    expected, expected_history = _run(W, case)
    got, history = _run(devices, case)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(history, expected_history, strict=True):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert max(h["pushes"] for h in history) > 1  # events happened, several a step


def test_model_state_and_dropout_keys_travel_as_with_one_worker_a_device():
    expected, _ = _run(W, "async", pair=bn_dropout_pair)
    got, _ = _run(2, "async", pair=bn_dropout_pair)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_workers_must_divide_over_the_devices_and_downpour_keeps_one_a_device():
    loss_fn, _ = mlp_pair()
    mesh = ddl.make_mesh(data=4, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="workers=6 must be a multiple of the 4 devices"):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=6)
    with pytest.raises(ValueError, match="workers must be"):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=0)
    with pytest.raises(ValueError, match="one shard a device"):
        ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh, workers=8, protocol=ddl.downpour(2, 2))
