"""Meshes and simulated devices."""

import jax
import pytest

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
    ],
)
def test_make_mesh_axes(kwargs, shape):
    assert dict(ddl.make_mesh(**kwargs).shape) == shape


def test_make_mesh_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="needs 16 devices, only 8"):
        ddl.make_mesh(data=16)
    with pytest.raises(ValueError, match="do not split into stage=3"):
        ddl.make_mesh(stage=3)
    with pytest.raises(ValueError, match="data must be a positive int"):
        ddl.make_mesh(data=0)


def test_simulate_cpu_devices_after_start():
    ddl.simulate_cpu_devices(8)  # what JAX already has: fine
    with pytest.raises(RuntimeError, match="after JAX started with 8"):
        ddl.simulate_cpu_devices(4)
    with pytest.raises(ValueError, match="positive int"):
        ddl.simulate_cpu_devices(0)
