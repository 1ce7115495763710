"""The XLA:CPU tunings: off by default, one switch, and by default ddl's results do not
depend on the process's CPU affinity.

Each run is a fresh process (a process's affinity and its switch are process-wide), under
a hard timeout. XLA:CPU's own YNNPACK reduction fusions split a reduction by the number
of threads, so the runs here keep them off (``XLA_FLAGS``): what is measured is whether
ddl adds a dependence on affinity.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import child_env

import ddl_jax as ddl
from ddl_jax._src.reduce import allreduce
from ddl_jax._src.xla_cpu import products, tunings

# A data-parallel MLP trained for 3 steps on one device; prints its parameters' digest
# and whether the weight gradients were rewritten (products.applies).
_TRAIN = textwrap.dedent(
    """
    import hashlib, json
    import jax, numpy as np, optax
    from flax import nnx
    import ddl_jax as ddl
    from ddl_jax._src.xla_cpu import products

    model = ddl.models.MLP(784, [512], 10, rngs=nnx.Rngs(0))
    def loss(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()
    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    mesh = ddl.make_mesh(data=1)
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)
    state, step = strategy.init(params), jax.jit(strategy.step)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(256, 784)).astype(np.float32), "y": rng.integers(0, 10, 256)}
    for _ in range(3):
        state, _ = step(state, batch)
    leaves = jax.tree.leaves(strategy.params(state))
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()
    print(json.dumps({"digest": digest, "rewritten": bool(products.applies(mesh))}))
    """
)
_NO_YNN_REDUCTIONS = "--xla_cpu_experimental_ynn_fusion_type=individual_dot,eltwise"

needs_taskset = pytest.mark.skipif(
    shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity"),
    reason="needs taskset (Linux)",
)


def _train(pinned: bool, tunings_on: bool) -> dict:
    env = child_env()
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {_NO_YNN_REDUCTIONS}"
    env.pop(tunings.ENV_VAR, None)
    if tunings_on:
        env[tunings.ENV_VAR] = "1"
    command = [sys.executable, "-c", _TRAIN]
    if pinned:
        command = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *command]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_taskset
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to unpin")
def test_results_do_not_depend_on_affinity_by_default_and_do_with_the_tunings():
    free = _train(pinned=False, tunings_on=False)
    pinned = _train(pinned=True, tunings_on=False)
    assert not free["rewritten"] and not pinned["rewritten"]
    assert pinned["digest"] == free["digest"]  # bitwise
    # The check can fail: with the tunings on, a process on one core rewrites its weight
    # gradients and rounds differently from the same program unpinned.
    tuned = _train(pinned=True, tunings_on=True)
    assert tuned["rewritten"]
    assert tuned["digest"] != free["digest"]


@pytest.fixture
def switch():
    """The switch as the process had it, restored after the test."""
    saved = dict(tunings._state)
    yield
    tunings._state.update(saved)


def test_off_by_default(switch, monkeypatch):
    monkeypatch.delenv(tunings.ENV_VAR, raising=False)
    tunings._state["switch"] = None
    monkeypatch.setattr(products, "one_core", lambda: True)
    assert not tunings.enabled()
    assert not products.applies(ddl.make_mesh(data=1))
    assert allreduce.default_bucket_bytes() is None


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_the_environment_variable_turns_them_on_and_it_is_logged_once(
    switch, monkeypatch, caplog, value
):
    monkeypatch.setenv(tunings.ENV_VAR, value)
    tunings._state.update(switch=None, logged=False)
    monkeypatch.setattr(products, "one_core", lambda: True)
    with caplog.at_level(logging.WARNING, logger="ddl_jax"):
        assert products.applies(ddl.make_mesh(data=1))
        assert tunings.enabled()
    logged = [r.getMessage() for r in caplog.records if "XLA:CPU tunings on" in r.getMessage()]
    assert logged == [
        "ddl_jax: XLA:CPU tunings on (for one process per pinned core; see "
        "ddl_jax.launch.initialize): results may depend on CPU affinity."
    ]
    # One process here: the gradient buckets are for collectives across processes.
    assert allreduce.default_bucket_bytes() is None


def test_set_enabled_overrides_the_environment(switch, monkeypatch):
    monkeypatch.setenv(tunings.ENV_VAR, "1")
    tunings.set_enabled(False)
    assert not tunings.enabled()


def test_bad_values_are_named(switch, monkeypatch):
    monkeypatch.setenv(tunings.ENV_VAR, "yes please")
    tunings._state["switch"] = None
    with pytest.raises(ValueError, match="DDL_JAX_XLA_CPU_TUNINGS must be 1 or 0"):
        tunings.enabled()
    with pytest.raises(TypeError, match="xla_cpu_tunings must be True, False or None, got 'y'"):
        ddl.launch.initialize("127.0.0.1:1234", 2, 0, xla_cpu_tunings="y")
