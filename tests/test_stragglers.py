"""The straggler report of a multi-process ``fit``: each rank's loader and step times, and
the slowest rank named.

The 2-process run is fresh ``python`` processes under ``ddl-jax launch`` (1 CPU device
each, over gloo on 127.0.0.1), as in ``tests/test_launch.py``.
"""

import re
import subprocess
import sys
import textwrap

import numpy as np
from conftest import child_env

from ddl_jax._src.train.log import straggler_lines

SLEEP = 0.03  # seconds rank 1's loader sleeps per batch in the first run

# Two runs of the same 12 steps in one launch: first with rank 1's loader slowed by a sleep
# per batch, then with no sleep, a separator line between them.
WORKER = textwrap.dedent(
    f"""
    import time
    from ddl_jax._src.train import launch
    launch.initialize()
    import jax, numpy as np, optax
    from flax import nnx
    import ddl_jax as ddl

    rng = np.random.default_rng(0)
    train = {{"x": rng.normal(size=(256, 12)).astype(np.float32),
              "y": rng.integers(0, 5, size=256).astype(np.int32)}}
    loss_fn, params = ddl.flax.loss_from_module(
        ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0)),
        lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean(),
    )
    mesh = ddl.make_mesh()
    strategy = ddl.data_parallel(loss_fn, optax.sgd(1e-2), mesh)

    def batches(sleep):
        def from_start(start):
            for batch in launch.process_batches(train, 32, mesh, start=start):
                if jax.process_index() == 1:
                    time.sleep(sleep)
                yield batch
        return from_start

    ddl.fit(strategy, params, batches({SLEEP}), steps=12, log_every=2, progress=False)
    print("--- no sleep ---", flush=True)
    ddl.fit(strategy, params, batches(0.0), steps=12, log_every=2, progress=False)
    """
)


def test_a_two_process_run_names_the_rank_with_a_slow_loader(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launcher = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2"]
    options = ["--devices-per-process", "1", "--heartbeat-timeout", "5", "--grace", "2"]
    cmd = [*launcher, *options, "--", sys.executable, str(script)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    log = f"{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, log
    slowed, _, unslowed = proc.stdout.partition("[rank 0] --- no sleep ---")
    assert unslowed, log
    for out in (slowed, unslowed):
        for rank in (0, 1):  # one line per rank, printed by process 0 only
            line = rf"\[rank 0\] fit: rank {rank}: loader [\d.]+ ms median, [\d.]+ ms worst per "
            assert len(re.findall(line + r"step; step [\d.]+ ms median\n", out)) == 1, log
        assert "[rank 1] fit: rank" not in out, log
    named = r"\[rank 0\] fit: rank 1 is the straggler: its loader takes ([\d.]+) ms"
    named = re.search(named, slowed)
    assert named and float(named[1]) >= SLEEP * 1e3, log
    assert "wait for it inside each step's collectives" in slowed, log
    assert "[rank 0] fit: no rank stands out" in unslowed, log
    assert "straggler:" not in unslowed, log


def test_straggler_lines_name_a_rank_only_by_a_clear_margin():
    # [rank, loader median, loader worst, step median] in seconds, in any order.
    slow = straggler_lines(np.array([[1, 0.031, 0.04, 0.035], [0, 0.0004, 0.002, 0.034]]))
    assert slow[0] == (
        "fit: rank 0: loader 0.4 ms median, 2.0 ms worst per step; step 34.0 ms median"
    )
    assert slow[1].startswith("fit: rank 1: loader 31.0 ms median")
    assert slow[2].startswith(
        "fit: rank 1 is the straggler: its loader takes 31.0 ms per step (median), the "
        "others' at most 0.4 ms."
    )
    assert "their wait is about its extra loader time, 30.6 ms per step." in slow[2]
    # 2x but under 1 ms apart, then 1 ms apart but under 2x: no straggler.
    for medians in ((0.0009, 0.0003), (0.004, 0.0025)):
        lines = straggler_lines(np.array([[0, medians[0], 0.01, 0.01], [1, medians[1], 0, 0]]))
        assert lines[-1].startswith(
            f"fit: no rank stands out: the slowest loader, rank 0's, takes {medians[0] * 1e3:.1f}"
        )
