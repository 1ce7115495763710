"""A pipeline whose stages live in different processes: each compiles its stage's program.

Two processes x 2 CPU devices over gloo (``ddl-jax launch``), a ``data=2, stage=2`` mesh
(``ddl.make_mesh`` gives each process one stage's two data workers); with the XLA:CPU
tunings on (``--xla-cpu-tunings``) GPipe and 1F1B then run ``stage_step`` (no switch over
the stages) and must train as one device does on the whole batch.
"""

import pathlib
import subprocess
import sys
import textwrap

import chex
import jax
import numpy as np
import optax
import pipeline_models
import pytest
from conftest import child_env

import ddl_jax as ddl
from ddl_jax._src.strategies.pipeline.builder import process_stage

WORKER = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
    from ddl_jax._src.train import launch
    launch.initialize()
    import jax
    import numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import ddl_jax as ddl
    from ddl_jax._src.strategies.pipeline.builder import process_stage
    from pipeline_models import RUNS, make_batches, xent
    """
) + textwrap.dedent(
    """
    mesh = ddl.make_mesh(data=2, stage=2)  # across processes: one stage each
    sharding = NamedSharding(mesh, P("data"))
    batches = [
        {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
         for k, v in b.items()}
        for b in make_batches()
    ]
    out = {}
    for name, (schedule, split) in RUNS.items():
        stages, params = split()
        strategy = ddl.pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=4,
                                schedule=schedule)
        state = strategy.init(params)
        step = jax.jit(strategy.step).lower(state, batches[0]).compile()  # the program run
        text = step.as_text()
        print(name, "stage", process_stage(mesh), "conditionals", text.count("conditional("))
        for batch in batches:
            state, metrics = step(state, batch)
        leaves = jax.tree.leaves(jax.device_get(strategy.params(state)))
        out |= {f"{name}_{i}": leaf for i, leaf in enumerate(leaves)}
        out[f"{name}_loss"] = jax.device_get(metrics["loss"])
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **out)
    """
)


def test_one_process_holds_every_stage_so_its_step_switches_over_them():
    assert process_stage(jax.make_mesh((4, 2), ("data", "stage"))) is None


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The worker's stdout and saved arrays: 2 processes x 2 devices, one stage each."""
    tmp_path = tmp_path_factory.mktemp("stages")
    script, out = tmp_path / "worker.py", tmp_path / "params.npz"
    script.write_text(WORKER)
    launcher = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2"]
    options = ["--devices-per-process", "2", "--heartbeat-timeout", "10", "--xla-cpu-tunings"]
    proc = subprocess.run(
        [*launcher, *options, "--", sys.executable, str(script), str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with np.load(out) as arrays:
        return proc.stdout, dict(arrays)


def saved(arrays, name, count):
    return [arrays[f"{name}_{i}"] for i in range(count)], arrays[f"{name}_loss"]


def test_each_process_compiles_its_own_stage_without_a_switch(launched):
    stdout, _ = launched
    for rank in (0, 1):
        for name in pipeline_models.RUNS:
            assert f"[rank {rank}] {name} stage {rank} conditionals 0" in stdout, stdout


def test_gpipe_and_1f1b_train_like_one_device_on_the_whole_batch(launched):
    _, arrays = launched
    stages, params = pipeline_models.split_model()
    loss, batches = pipeline_models.full_loss(stages), pipeline_models.make_batches()
    expected = jax.tree.leaves(pipeline_models.reference(loss, optax.sgd(0.1), params, batches))
    previous = pipeline_models.reference(loss, optax.sgd(0.1), params, batches[:2])
    last_loss = loss(previous, batches[2])
    for name in ("gpipe", "1f1b"):
        leaves, last = saved(arrays, name, len(expected))
        chex.assert_trees_all_close(leaves, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(last, last_loss, rtol=1e-5)


def test_batch_norm_and_dropout_stages_train_as_the_program_with_a_switch(launched):
    """The reference: the same pipeline in this process, which holds both stages (the
    switch program, itself tested against a loop over micro-batches in test_pipeline)."""
    _, arrays = launched
    stages, params = pipeline_models.split_norm_model()
    mesh = ddl.make_mesh(data=2, stage=2)
    strategy = ddl.pipeline(
        stages, pipeline_models.xent, optax.sgd(0.1), mesh, microbatches=4, schedule="1f1b"
    )
    step, state = jax.jit(strategy.step), strategy.init(params)
    for batch in pipeline_models.make_batches():
        state, metrics = step(state, batch)
    expected = jax.tree.leaves(strategy.params(state))
    leaves, last = saved(arrays, "1f1b_norm", len(expected))
    chex.assert_trees_all_close(leaves, expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(last, metrics["loss"], rtol=1e-5)
