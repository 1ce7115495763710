"""The straggler report of a multi-process ``fit``: each rank's host, loader, wait and step
times, and the rank the others wait for named.

The 2-process run is fresh ``python`` processes under ``ddl-jax launch`` (1 CPU device
each, over gloo on 127.0.0.1), as in ``tests/test_launch.py``.
"""

import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import child_env

from ddl_jax._src.train.stragglers import StepClock, straggler_lines

SLEEP = 0.05  # seconds rank 1's loader sleeps per batch in the first run

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
    print("--- a slow callback ---", flush=True)  # callbacks run on process 0
    slow_callback = lambda record: time.sleep({SLEEP})
    ddl.fit(strategy, params, batches(0.0), steps=12, log_every=1, progress=False,
            callbacks=[slow_callback])
    print("--- no sleep ---", flush=True)
    ddl.fit(strategy, params, batches(0.0), steps=12, log_every=2, progress=False)
    """
)


def test_a_two_process_run_names_the_rank_whose_host_is_slow(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launcher = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2"]
    options = ["--devices-per-process", "1", "--heartbeat-timeout", "5", "--grace", "2"]
    cmd = [*launcher, *options, "--", sys.executable, str(script)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    log = f"{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, log
    slow_loader, _, rest = proc.stdout.partition("[rank 0] --- a slow callback ---")
    slow_callback, _, unslowed = rest.partition("[rank 0] --- no sleep ---")
    assert unslowed, log
    for out in (slow_loader, slow_callback, unslowed):
        for rank in (0, 1):  # one line per rank, printed by process 0 only
            line = (
                rf"\[rank 0\] fit: rank {rank}: host [\d.]+ ms a step \(mean; loader [\d.]+ ms\), "
                r"[\d.]+ ms worst; waited [\d.]+ ms a step \(mean\) for results; step [\d.]+ ms "
                r"median\n"
            )
            assert len(re.findall(line, out)) == 1, log
        assert "[rank 1] fit: rank" not in out, log
    for out, slow in ((slow_loader, 1), (slow_callback, 0)):
        named = rf"\[rank 0\] fit: rank {slow} is the straggler: its host takes ([\d.]+) ms"
        named = re.search(named, out)
        assert named and float(named[1]) >= 0.8 * SLEEP * 1e3, log
        waits = re.search(r"they waited ([\d.]+) ms a step or more for results, it waited "
                          r"([\d.]+) ms", out)  # fmt: skip
        assert waits and float(waits[1]) > float(waits[2]), log
    assert "[rank 0] fit: no rank stands out" in unslowed, log
    assert "straggler:" not in unslowed, log


def test_straggler_lines_name_a_rank_only_by_a_clear_margin():
    # [rank, host mean, host worst, loader mean, waited mean, step median] in seconds.
    slow = straggler_lines(
        np.array([[1, 0.031, 0.04, 0.030, 0.001, 0.035], [0, 0.0004, 0.002, 0.0001, 0.03, 0.034]])
    )
    assert slow[0] == (
        "fit: rank 0: host 0.4 ms a step (mean; loader 0.1 ms), 2.0 ms worst; waited 30.0 ms a "
        "step (mean) for results; step 34.0 ms median"
    )
    assert slow[1].startswith("fit: rank 1: host 31.0 ms a step (mean; loader 30.0 ms)")
    assert slow[2].startswith("fit: rank 1 is the straggler: its host takes 31.0 ms a step")
    assert "the others' at most 0.4 ms." in slow[2]
    assert "they waited 30.0 ms a step or more for results, it waited 1.0 ms." in slow[2]
    # The other rank waiting 10 ms longer, host times 2x but under 1 ms apart; 1 ms apart but
    # under 2x; 2x and 1 ms apart but under a quarter of the step (a loaded machine's noise,
    # seen in CI twice): no straggler.
    for hosts, step in (
        ((0.0009, 0.0003), 0.01),
        ((0.004, 0.0025), 0.01),
        ((0.0017, 0.0006), 0.022),
        ((0.0020, 0.0009), 0.0096),
    ):
        lines = straggler_lines(
            np.array([[0, hosts[0], 0.01, 0, 0, step], [1, hosts[1], 0, 0, 0.01, step]])
        )
        assert lines[-1].startswith(
            f"fit: no rank stands out: the busiest host, rank 0's, takes {hosts[0] * 1e3:.1f}"
        )
        assert "is not told apart by these timings" in lines[-1]
    # Its host 2x the others' and a step's quarter more, but the others did not wait for it.
    lines = straggler_lines(
        np.array([[0, 0.012, 0.02, 0, 0.010, 0.02], [1, 0.001, 0.01, 0, 0.0105, 0.02]])
    )
    assert lines[-1].startswith("fit: no rank stands out: the busiest host, rank 0's, takes 12.0")
    assert "and the others would wait that much longer than it" in lines[-1]


def test_the_step_clock_counts_waits_apart_from_the_host_and_skips_the_first_step():
    clock = StepClock()
    time.sleep(0.05)  # the first step: compiling, not counted
    clock.lap()
    for _ in range(2):
        time.sleep(0.01)  # the host's work
        with clock.waiting():
            time.sleep(0.03)  # a wait on results
        clock.lap()
    assert len(clock.host) == len(clock.waited) == 2
    assert all(0.009 < h < 0.025 for h in clock.host), clock.host
    assert all(0.029 < w < 0.045 for w in clock.waited), clock.waited
    row = clock.row(3, [0.5, 0.002, 0.004], [0.2, 0.01, 0.03])
    assert row[0] == 3 and row[3] == pytest.approx(0.003) and row[5] == pytest.approx(0.02)
