"""A pipeline whose stages live in different processes: each compiles its stage's program.

Two processes x 2 CPU devices over gloo (``ddl-jax launch``), a ``data=2, stage=2`` mesh laid
out so that each process holds one stage's two data workers; GPipe and 1F1B then run
``stage_step`` (no switch over the stages) and must train as one device does on the whole
batch.
"""

import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import child_env

from ddl_jax._src.pipeline import process_stage

# Shared by the launched processes and this one: the model, its data, its loss.
MODEL = textwrap.dedent(
    """
    import itertools
    import numpy as np, optax
    from flax import nnx
    import ddl_jax as ddl

    class Block(nnx.Module):
        def __init__(self, sizes, *, last, rngs):
            self.layers = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
            )
            self.last = last

        def __call__(self, x):
            x = x["x"] if isinstance(x, dict) else x
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if not (self.last and i == len(self.layers) - 1):
                    x = nnx.relu(x)
            return x

    def split_model():
        # Unequal stages: parameter vectors and activations are padded to the largest.
        blocks = [Block([12, 16, 8], last=False, rngs=nnx.Rngs(0)),
                  Block([8, 5], last=True, rngs=nnx.Rngs(1))]
        return ddl.pipeline_stages(blocks)

    def xent(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def make_batches():
        rng = np.random.default_rng(0)
        return [{"x": rng.normal(size=(16, 12)).astype(np.float32),
                 "y": rng.integers(0, 5, size=16).astype(np.int32)} for _ in range(3)]
    """
)

WORKER = (
    textwrap.dedent(
        """
    import sys
    from ddl_jax._src import launch
    launch.initialize()
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ddl_jax._src.pipeline import process_stage
    """
    )
    + MODEL
    + textwrap.dedent(
        """
    stages, params = split_model()
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    # Row-major (data, stage): stage s is process s's devices.
    devices = [d for row in zip(*by_process) for d in row]
    mesh = ddl.make_mesh(data=2, stage=2, devices=devices)
    sharding = NamedSharding(mesh, P("data"))
    batches = [
        {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
         for k, v in b.items()}
        for b in make_batches()
    ]
    out = {}
    for schedule in ("gpipe", "1f1b"):
        strategy = ddl.pipeline(stages, xent, optax.sgd(0.1), mesh, microbatches=4,
                                schedule=schedule)
        step = jax.jit(strategy.step)
        state = strategy.init(params)
        text = step.lower(state, batches[0]).compile().as_text()
        print(schedule, "stage", process_stage(mesh), "conditionals", text.count("conditional("))
        for batch in batches:
            state, metrics = step(state, batch)
        leaves = jax.tree.leaves(jax.device_get(strategy.params(state)))
        out |= {f"{schedule}_{i}": leaf for i, leaf in enumerate(leaves)}
        out[f"{schedule}_loss"] = jax.device_get(metrics["loss"])
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **out)
    """
    )
)


def test_one_process_holds_every_stage_so_its_step_switches_over_them():
    assert process_stage(jax.make_mesh((4, 2), ("data", "stage"))) is None


def test_stages_in_two_processes_run_their_own_programs_and_train_like_one_device(tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "params.npz"
    script.write_text(WORKER)
    launcher = [sys.executable, "-m", "ddl_jax._src.cli", "launch", "-n", "2"]
    options = ["--devices-per-process", "2", "--heartbeat-timeout", "10"]
    proc = subprocess.run(
        [*launcher, *options, "--", sys.executable, str(script), str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    for rank in (0, 1):
        for schedule in ("gpipe", "1f1b"):
            assert f"[rank {rank}] {schedule} stage {rank} conditionals 0" in proc.stdout, log

    namespace = {}
    exec(MODEL, namespace)  # the launched processes' model, built here too
    stages, params = namespace["split_model"]()
    batches = namespace["make_batches"]()

    def loss(params, batch):
        x = batch
        for (apply, _), p in zip(stages, params, strict=True):
            x = apply(p, x)
        return namespace["xent"](x, batch)

    optimizer = optax.sgd(0.1)
    expected, opt_state = jax.tree.map(jnp.asarray, params), optimizer.init(params)
    for batch in batches:
        last_loss = loss(expected, batch)
        updates, opt_state = optimizer.update(jax.grad(loss)(expected, batch), opt_state, expected)
        expected = optax.apply_updates(expected, updates)
    with np.load(out) as got:
        for schedule in ("gpipe", "1f1b"):
            leaves = [got[f"{schedule}_{i}"] for i in range(len(jax.tree.leaves(expected)))]
            chex.assert_trees_all_close(leaves, jax.tree.leaves(expected), atol=1e-5, rtol=0)
            np.testing.assert_allclose(got[f"{schedule}_loss"], last_loss, rtol=1e-5)
