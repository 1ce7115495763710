"""Meshes and simulated devices."""

import os
import subprocess
import sys

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import make_batches

import ddl_jax as ddl


def test_conftest_simulates_eight_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize(
    ("kwargs", "shape"),
    [
        ({"data": 8}, {"data": 8}),
        ({"data": 2}, {"data": 2}),
        ({}, {"data": 8}),
        ({"stage": 4}, {"data": 2, "stage": 4}),
        ({"data": 2, "model": 4}, {"data": 2, "model": 4}),
        ({"island": 2}, {"island": 2, "data": 4}),
        ({"island": 1, "data": 8}, {"island": 1, "data": 8}),
        ({"island": 2, "model": 2}, {"island": 2, "data": 2, "model": 2}),
    ],
)
def test_make_mesh_axes(kwargs, shape):
    assert dict(ddl.make_mesh(**kwargs).shape) == shape


def test_make_mesh_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="needs 16 devices, only 8"):
        ddl.make_mesh(data=16)
    with pytest.raises(ValueError, match="do not split into stage=3"):
        ddl.make_mesh(stage=3)
    with pytest.raises(ValueError, match="do not split into island=3 x stage=1"):
        ddl.make_mesh(island=3)
    with pytest.raises(ValueError, match="island=4 x data=4 x stage=1 x model=1 needs 16"):
        ddl.make_mesh(island=4, data=4)
    with pytest.raises(ValueError, match=r"make_mesh: data \(or None\) must be an int >= 1"):
        ddl.make_mesh(data=0)
    with pytest.raises(ValueError, match="make_mesh: model must be an int >= 1, got 2.0"):
        ddl.make_mesh(model=2.0)
    with pytest.raises(ValueError, match="make_mesh: stage must be an int >= 1, got True"):
        ddl.make_mesh(stage=True)


def test_make_mesh_takes_numpy_integers():
    mesh = ddl.make_mesh(data=np.int64(2), stage=np.int32(2), model=np.int64(2))
    assert dict(mesh.shape) == {"data": 2, "stage": 2, "model": 2}
    assert dict(ddl.make_mesh(stage=np.int64(4)).shape) == {"data": 2, "stage": 4}


def test_simulate_cpu_devices_after_start():
    ddl.simulate_cpu_devices(8)  # what JAX already has: fine
    with pytest.raises(RuntimeError, match="after JAX started with 8"):
        ddl.simulate_cpu_devices(4)
    with pytest.raises(ValueError, match="simulate_cpu_devices: n must be an int >= 1, got 0"):
        ddl.simulate_cpu_devices(0)
    with pytest.raises(ValueError, match="n must be an int >= 1, got 8.0"):
        ddl.simulate_cpu_devices(8.0)
    ddl.simulate_cpu_devices(np.int64(8))  # a NumPy int is an int: what JAX has, fine


def test_simulate_cpu_devices_takes_a_numpy_int_before_jax_starts():
    # This process's JAX has started: a fresh interpreter sets the count from a NumPy int.
    code = (
        "import numpy as np, ddl_jax as ddl; ddl.simulate_cpu_devices(np.int64(3)); "
        "import jax; print(len(jax.devices('cpu')))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3"]


def test_variables_trained_on_other_devices_start_a_strategy_on_these(mlp):
    """Fine-tuning on fewer devices: the trained variables live on the 8 devices of the
    first mesh; ``init`` copies them onto the second's 4 (or 1)."""
    loss_fn, params = mlp
    batches = make_batches(2, 16)
    eight = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
    state, _ = ddl.fit(eight, params, batches, steps=2, progress=False)
    trained = eight.params(state)
    for n in (4, 1):
        mesh = ddl.make_mesh(data=n)
        again = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
        start = again.params(again.init(trained))
        chex.assert_trees_all_equal(jax.device_get(start), jax.device_get(trained))
        assert {d for x in jax.tree.leaves(start) for d in x.devices()} == set(mesh.devices.flat)
    on_one = jax.device_put(trained, jax.devices()[3])  # committed to a device of the mesh
    chex.assert_trees_all_equal(jax.device_get(eight.params(eight.init(on_one))), on_one)
