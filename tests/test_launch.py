"""Multi-process training: the launcher, process-local data, resume after kill -9.

The multi-process runs are fresh ``python`` processes with an explicit environment (2
processes x 4 CPU devices over gloo on 127.0.0.1), so they do not inherit this test
process's 8 simulated devices.
"""

import contextlib
import glob
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import GLOO_LOOPS_REPORT, child_env, mlp_loss
from flax import nnx

import ddl_jax as ddl
from ddl_jax import cli
from ddl_jax._src.train import launch
from ddl_jax._src.train.fit import fit

STEPS, BATCH, EVERY = 8, 32, 2

# The MLP of conftest under data_parallel on every device of every process, trained twice:
# from the checkpoints in CHECKPOINT_DIR (rank 1 kills itself with SIGKILL when asked for
# batch KILL_AT in the launcher's first attempt), then uninterrupted from scratch. Process 0
# saves both final params.
WORKER = (
    textwrap.dedent(
        f"""
    import os, signal, sys
    from ddl_jax._src.train import launch
    launch.initialize()
    import jax, numpy as np, optax
    from flax import nnx
    import ddl_jax as ddl
    from ddl_jax._src.train.fit import fit

    checkpoint_dir, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(0)  # not digits: sklearn's import would slow each start
    train = {{"x": rng.normal(size=(256, 12)).astype(np.float32),
              "y": rng.integers(0, 5, size=256).astype(np.int32)}}
    loss_fn, params = ddl.flax.loss_from_module(
        ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0)),
        lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean(),
    )
    mesh = ddl.make_mesh()
    first = os.environ[launch.ENV_ATTEMPT] == "0"

    def batches(start):
        for s, batch in enumerate(launch.process_batches(train, {BATCH}, mesh, start=start), start):
            if s == kill_at and first and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), mesh)  # one compile for both

    def train_params(**kwargs):
        state, history = fit(strategy, params, batches, steps={STEPS}, progress=False, **kwargs)
        print("devices", len(jax.devices()), "first step", history[0]["step"])
        return jax.tree.leaves(jax.device_get(strategy.params(state)))

    resumed = train_params(checkpoint_dir=checkpoint_dir, checkpoint_every={EVERY})
    first = False
    uninterrupted = train_params()
    if jax.process_index() == 0:
        np.savez(out, *resumed, *uninterrupted)
    """
    )
    + GLOO_LOOPS_REPORT
)  # initialize's watcher idles them with the tunings on


def run_launcher(tmp_path, name: str, kill_at: int, *extra: str):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{name}.npz"
    launcher = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2"]
    options = ["--devices-per-process", "4", "--heartbeat-timeout", "5", "--grace", "2"]
    worker = [sys.executable, str(script), str(tmp_path / f"{name}_ckpt"), str(out), str(kill_at)]
    cmd = [*launcher, *options, *extra, "--", *worker]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    return proc, out


def load(out):
    with np.load(out) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    return leaves[: len(leaves) // 2], leaves[len(leaves) // 2 :]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A 2-process run killed (-9) at a random step and restarted, and its output."""
    # A step after the save at step 4 began, which waits for the one at step 2 to finish:
    # the restart must resume from a checkpoint, not from scratch.
    kill_at = random.randint(5, STEPS - 1)
    tmp_path = tmp_path_factory.mktemp("killed")
    proc, out = run_launcher(tmp_path, "killed", kill_at, "--restarts", "1", "--xla-cpu-tunings")
    log = f"kill_at={kill_at}\n{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, log
    return proc, log, kill_at, *load(out)


def test_kill_9_is_reported_and_the_restarted_run_ends_bitwise_equal(restarted):
    proc, log, kill_at, resumed, uninterrupted = restarted
    assert "rank 1 failed with exit code -9 (killed by SIGKILL)" in proc.stderr, log
    assert "restarting all 2 processes (restart 1 of 1)" in proc.stderr, log
    step = re.search(r"\[rank 0\] fit: resumed from step (\d+)", proc.stdout)
    assert step and 2 <= int(step.group(1)) <= kill_at, log
    for rank in (0, 1):
        assert f"[rank {rank}] devices 8 first step {int(step.group(1)) + 1}" in proc.stdout
        assert f"[rank {rank}] devices 8 first step 1" in proc.stdout  # the uninterrupted run
        # With the tunings (--xla-cpu-tunings), initialize lowered gloo's spinning
        # transport threads (one per device group).
        loops = rf"\[rank {rank}\] gloo loop threads (\d+) all at SCHED_IDLE (\w+)"
        loops = re.search(loops, proc.stdout)
        assert loops and int(loops[1]) >= 1 and loops[2] == "True", log
    # Bitwise: the same compiled programs on the same devices and data, resumed from a
    # checkpoint that stores the float32 state exactly.
    chex.assert_trees_all_equal(resumed, uninterrupted)


def test_two_processes_equal_one_process_on_eight_devices(restarted):
    uninterrupted = restarted[-1]
    rng = np.random.default_rng(0)  # the workers' data and model
    train = {
        "x": rng.normal(size=(256, 12)).astype(np.float32),
        "y": rng.integers(0, 5, size=256).astype(np.int32),
    }
    loss_fn, params = ddl.flax.loss_from_module(
        ddl.models.MLP(12, [16], 5, rngs=nnx.Rngs(0)), mlp_loss
    )
    strategy = ddl.data_parallel(loss_fn, optax.adam(1e-2), ddl.make_mesh(data=8))
    state, _ = fit(strategy, params, ddl.data.batches(train, BATCH), steps=STEPS, progress=False)
    # allclose, not bitwise: gloo sums across processes in another order than XLA in one.
    chex.assert_trees_all_close(
        uninterrupted, jax.tree.leaves(strategy.params(state)), atol=1e-6, rtol=1e-5
    )


def script(tmp_path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_launcher_stops_the_others_and_names_the_dead_rank(tmp_path, capsys):
    path = script(
        tmp_path,
        """
        import os, signal, time
        rank = int(os.environ["DDL_JAX_PROCESS_ID"])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 must be SIGKILLed
        print("hello from", rank, os.environ["DDL_JAX_NUM_PROCESSES"], flush=True)
        time.sleep(0.5 if rank == 1 else 60)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    tick = time.monotonic()
    code = cli.main(["launch", "-n", "2", "--grace", "0.5", "--", sys.executable, path])
    elapsed = time.monotonic() - tick
    out, err = capsys.readouterr()
    assert code == 128 + 9
    assert "[rank 0] hello from 0 2" in out and "[rank 1] hello from 1 2" in out
    assert "rank 1 failed with exit code -9 (killed by SIGKILL); stopped the other 1" in err
    assert "rank 0 failed" not in err  # stopped by the launcher, not a failure
    assert "giving up" in err
    assert elapsed < 10  # rank 0 would sleep 60 s had it not been killed


def test_ranks_failing_together_are_all_named_in_the_order_they_exit(tmp_path, capsys):
    # As when a peer of a killed rank aborts in gloo and is reaped first: both are named.
    path = script(
        tmp_path,
        f"""
        import os, pathlib, signal, time
        rank = int(os.environ["DDL_JAX_PROCESS_ID"])
        first = pathlib.Path({str(tmp_path / "first")!r})
        if rank == 0:
            first.touch()  # however late each rank starts, rank 1 dies 0.15 s after rank 0
        while rank == 1 and not first.exists():
            time.sleep(0.01)
        time.sleep(0.15 * rank)
        os.kill(os.getpid(), [signal.SIGABRT, signal.SIGKILL][rank] if rank < 2 else 0)
        time.sleep(60)
        """,
    )
    code = cli.main(["launch", "-n", "3", "--grace", "0.5", "--", sys.executable, path])
    err = capsys.readouterr().err
    assert code == 128 + 6  # the first to exit
    both = (
        "rank 0 failed with exit code -6 (killed by SIGABRT) and rank 1 failed with exit "
        "code -9 (killed by SIGKILL) within 0.5 s of each other"
    )
    assert f"launch: {both}" in err and "stopped the other 1 process(es)" in err, err
    assert f"giving up: {both}" in err, err
    assert "rank 2 failed" not in err  # alive until stopped


def test_launcher_returns_the_exit_code_after_the_restarts(tmp_path, capsys):
    path = script(
        tmp_path,
        """
        import os, sys
        print("attempt", os.environ["DDL_JAX_ATTEMPT"])
        sys.exit(3 if os.environ["DDL_JAX_PROCESS_ID"] == "0" else 0)
        """,
    )
    code = cli.main(["launch", "-n", "2", "--restarts", "2", "--", sys.executable, path])
    out, err = capsys.readouterr()
    assert code == 3
    assert [f"[rank 0] attempt {a}" in out for a in range(3)] == [True] * 3
    assert err.count("rank 0 failed with exit code 3; stopped the other 1") == 3


def test_a_terminated_launcher_leaves_no_rank_behind(tmp_path):
    path = script(
        tmp_path, "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    )
    prefix = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2"]
    cmd = [*prefix, "--", sys.executable, path]
    launcher = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.terminate()
        # generous: on a loaded machine (the suite's other workers compiling on the same
        # cores) the launcher's stop and exit once took over 20 s
        assert launcher.wait(timeout=120) == 128 + 15
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:  # a failed check leaves nothing running
        for pid in [launcher.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def rank_1_ends_in_the_collectives(tmp_path, ending: str, setting: str = "") -> str:
    """A script of two ranks summing in a loop until rank 1 runs ``ending`` at step 3,
    its peer then waiting in a collective for it; ``setting`` runs after ``initialize``."""
    return script(
        tmp_path,
        f"""
        from ddl_jax._src.train import launch
        launch.initialize()
        {setting}
        import sys, jax, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import ddl_jax as ddl

        mesh = ddl.make_mesh()
        rows = np.ones(jax.local_device_count(), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rows)
        total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
        for step in range(10_000):
            if step == 3 and jax.process_index() == 1:
                {ending}
            total(x).block_until_ready()
        """,
    )


@pytest.mark.parametrize(
    ("failure", "code", "printed"),
    [
        ('raise RuntimeError("boom on rank 1")', 1, "[rank 1] RuntimeError: boom on rank 1"),
        ("sys.exit(3)", 3, None),
        ('sys.exit("bad data on rank 1")', 1, "[rank 1] bad data on rank 1"),
    ],
)
def test_a_rank_that_fails_ends_at_once_and_is_named(tmp_path, failure, code, printed):
    """Its peer waits in a collective for it; it must not wait at JAX's shutdown barrier
    for that peer (300 s), so the launcher names it, with its code, and stops the peer."""
    path = rank_1_ends_in_the_collectives(tmp_path, failure)
    cmd = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2", "--grace", "1"]
    tick = time.monotonic()
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    launcher = subprocess.Popen([*cmd, "--", sys.executable, path], env=child_env(), **pipes)
    try:
        out, err = launcher.communicate(timeout=120)
    finally:  # a hang stops here, its ranks with it
        launcher.terminate()
        launcher.wait()
    # rank 0's collective then fails too (exit code 1), and may be reaped first: the
    # launcher exits with the first code, and names both
    assert launcher.returncode in {code, 1}, (out, err)
    assert f"rank 1 failed with exit code {code}" in err.splitlines()[0], err
    if printed is not None:
        assert printed in out, out
    assert time.monotonic() - tick < 60


def test_a_rank_that_finishes_early_says_it_waits_at_jax_shutdown(tmp_path):
    """A rank that ends with success while its peer waits in a collective for it waits at
    JAX's shutdown barrier (300 s): it must say so, and why, not look hung."""
    path = rank_1_ends_in_the_collectives(
        tmp_path, "sys.exit(0)", "launch.SHUTDOWN_NOTES_S = (0.5, 60.0)"
    )
    cmd = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2", "--grace", "1"]
    launcher = subprocess.Popen(
        [*cmd, "--", sys.executable, path],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    timer = threading.Timer(90, launcher.terminate)  # a note never printed ends here
    timer.start()
    try:
        for line in launcher.stdout:
            lines.append(line)
            if "waited" in line:
                break
    finally:
        timer.cancel()
        launcher.terminate()
        launcher.communicate(timeout=30)
    assert lines[-1].startswith(
        "[rank 1] launch: this process finished and has waited 0.5 s at JAX's shutdown"
    ), lines
    assert "every process must run the same steps" in lines[-1]


def test_a_failed_exit_is_noted_in_the_main_thread_only(monkeypatch):
    """``sys.exit`` in another thread ends that thread only (Python's rule): it must not
    end the process with its code; a later successful exit clears a failure noted."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "exit", sys.exit)
    handlers = []
    monkeypatch.setattr(launch.atexit, "register", handlers.append)
    ended = []
    monkeypatch.setattr(launch, "_end", ended.append)
    monkeypatch.setattr(launch, "_note_the_wait_at_shutdown", lambda *_: None)
    launch._end_failures_at_once()
    (end_a_failed_exit,) = handlers

    raised = []

    def exit_in_a_thread():
        try:
            sys.exit(4)
        except SystemExit as e:  # uncaught, it would end the thread only
            raised.append(e.code)

    thread = threading.Thread(target=exit_in_a_thread)
    thread.start()
    thread.join()
    end_a_failed_exit()
    assert raised == [4]
    assert ended == []
    for status, expected in [(5, [5]), ("a message", [1]), (None, []), (True, [1])]:
        with pytest.raises(SystemExit):
            sys.exit(status)
        end_a_failed_exit()
        assert ended == expected, status
        ended.clear()


@pytest.mark.parametrize(
    ("steps", "batch", "fit", "message"),
    [
        ("4 + 2 * rank", "32", "", "fit: steps (process 0: 4, process 1: 6) differ between"),
        ("4", "32 + 32 * rank", "", "process_batches: batch_size (process 0: 32, process 1: 64) d"),
        # fit's schedule of logs and saves too: a process that logs or saves at other steps
        # waited forever in the others' collectives or orbax's barriers
        ("4", "32", "log_every=1 + rank", "fit: log_every (process 0: 1, process 1: 2) differ"),
        ("4", "32", "checkpoint_dir=f'ck{rank}'",
         "fit: checkpoint_dir (a text, compared by checksum) differ between processes"),
    ],
)  # fmt: skip
def test_processes_given_other_arguments_are_refused(tmp_path, steps, batch, fit, message):
    path = script(
        tmp_path,
        f"""
        from ddl_jax._src.train import launch
        launch.initialize()
        import jax, numpy as np, optax
        import ddl_jax as ddl

        rank = jax.process_index()
        data = {{"x": np.ones((256, 3), np.float32)}}
        mesh = ddl.make_mesh()
        loss = lambda params, batch: ((batch["x"] @ params["w"]) ** 2).mean()
        strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh)
        batches = lambda start: launch.process_batches(data, {batch}, mesh, start=start)
        ddl.fit(strategy, {{"w": np.ones(3, np.float32)}}, batches, steps={steps}, {fit})
        """,
    )
    cmd = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2", "--", sys.executable, path]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert f"[rank 0] ValueError: {message}" in done.stdout, done.stdout


def test_a_command_that_cannot_start_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "ddl-jax-launch-*")))
    assert cli.main(["launch", "-n", "2", "--", missing]) == 2
    err = capsys.readouterr().err
    assert err == f"ddl-jax launch: error: cannot run {missing!r}: No such file or directory.\n"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "ddl-jax-launch-*"))) <= left


def test_launcher_succeeds_when_every_rank_does(tmp_path, capsys):
    path = script(tmp_path, "print('done')")
    assert cli.main(["launch", "-n", "3", "--", sys.executable, path]) == 0
    assert capsys.readouterr().out.count("done") == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--bogus", "--", "true"], "launch: error: unrecognized arguments: --bogus"),
        (["-n", "0", "--", "true"], "argument -n/--num-processes: value must be an int >= 1"),
        (["-n", "two", "--", "true"], "-n/--num-processes: value must be an int >= 1, got 'two'"),
        (["-n", "2"], "give the command to run after --"),
        (["--", "true"], "required: -n/--num-processes"),
        (["-n", "2", "--restarts", "-1", "--", "true"], "value must be an int >= 0, got -1"),
        (
            ["-n", "2", "--grace", "-1", "--", "true"],
            "argument --grace: seconds must be a finite real number >= 0, got -1.0",
        ),
        (["-n", "2", "--grace", "inf", "--", "true"], "argument --grace: seconds must be"),
    ],
)
def test_launcher_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ("127.0.0.1:1234", 2, 2),
            r"process_id \(a rank of num_processes=2\) must be an int >= 0 and <= 1, got 2",
        ),
        (("127.0.0.1:1234", 2, -1), r"process_id .* must be an int >= 0 and <= 1, got -1"),
        (("127.0.0.1:1234", 2, 1.0), r"process_id .* must be an int >= 0 and <= 1, got 1.0"),
        (("127.0.0.1:1234", 0, 0), "num_processes must be an int >= 1, got 0"),
        (("localhost", 2, 0), "coordinator_address must be 'host:port', got 'localhost'"),
        ((None, 2, 0), "need coordinator_address too"),
    ],
)
def test_initialize_rejects_a_cluster_that_cannot_be_right(args, match):
    with pytest.raises(ValueError, match=match):
        launch.initialize(*args)


def test_initialize_rejects_bad_launcher_variables(monkeypatch):
    monkeypatch.setenv(launch.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(launch.ENV_NUM_PROCESSES, "two")
    monkeypatch.setenv(launch.ENV_PROCESS_ID, "0")
    with pytest.raises(ValueError, match="DDL_JAX_NUM_PROCESSES='two' must be an integer"):
        launch.initialize()


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        ([launch.ENV_COORDINATOR], "DDL_JAX_NUM_PROCESSES, DDL_JAX_PROCESS_ID not set"),
        ([launch.ENV_COORDINATOR, launch.ENV_PROCESS_ID], "DDL_JAX_NUM_PROCESSES not set"),
        ([launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID], "DDL_JAX_COORDINATOR not set"),
    ],
)
def test_initialize_names_the_missing_launcher_variable(monkeypatch, present, missing):
    values = {
        launch.ENV_COORDINATOR: "127.0.0.1:1234",
        launch.ENV_NUM_PROCESSES: "2",
        launch.ENV_PROCESS_ID: "0",
    }
    for name, value in values.items():
        if name in present:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=f"initialize: {missing}, but "):
        launch.initialize()


def test_unreachable_coordinator_is_a_clear_error_within_the_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "from ddl_jax._src.train.launch import initialize; "
        f"initialize('127.0.0.1:{port}', 2, 1, initialization_timeout=2)"
    )
    tick = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1  # a Python exception, not JAX's abort (134)
    assert (
        f"RuntimeError: initialize: process 1 of 2 could not reach the coordinator at "
        f"127.0.0.1:{port} within 2 s" in proc.stderr
    )
    assert time.monotonic() - tick < 30


def test_a_coordinator_port_held_by_something_else_is_a_clear_error():
    """Process 0 would fail to start its service with an error naming no port, and the
    others would wait on the listener there until the timeout."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"initialize: port {port} of the coordinator"):
            launch.initialize(f"127.0.0.1:{port}", 2, 0)


def test_process_batches_on_one_process_are_the_global_batches():
    train, _ = ddl.data.digits()
    mesh = ddl.make_mesh(data=8)
    assert launch.process_rows(mesh, 32) == slice(0, 32)
    got = list(zip(range(3), launch.process_batches(train, 32, mesh, start=5), strict=False))
    want = list(zip(range(8), ddl.data.batches(train, 32), strict=False))[5:]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert g["image"].sharding.spec == jax.sharding.PartitionSpec("data")
        chex.assert_trees_all_equal(jax.device_get(g), w)
    with pytest.raises(ValueError, match="batch_size=30 is not divisible by the 8 workers"):
        launch.process_rows(mesh, 30)


def test_a_mesh_without_a_device_of_this_process_is_a_clear_error(monkeypatch):
    train, _ = ddl.data.digits()
    mesh = ddl.make_mesh(data=8)  # all on process 0: seen from a process 1, none is its own
    monkeypatch.setattr(jax, "process_index", lambda *_: 1)
    match = "has no device of process 1, so this process holds no rows"
    with pytest.raises(ValueError, match=match):
        launch.process_rows(mesh, 32)
    with pytest.raises(ValueError, match=match):
        launch.process_batches(train, 32, mesh)


def test_batches_from_start_are_the_tail_and_rows_cut_each_batch():
    data = {"x": np.arange(20), "y": -np.arange(20)}
    whole = [b["x"] for _, b in zip(range(12), ddl.data.batches(data, 6, seed=3), strict=False)]
    tail = [
        b["x"] for _, b in zip(range(7), ddl.data.batches(data, 6, seed=3, start=5), strict=False)
    ]
    np.testing.assert_array_equal(tail, whole[5:])  # 3 batches per epoch: crosses 2 epochs
    halves = [
        np.concatenate([b["x"] for b in (lo, hi)])
        for lo, hi in zip(
            ddl.data.batches(data, 6, seed=3, start=2, rows=slice(0, 3), epochs=3),
            ddl.data.batches(data, 6, seed=3, start=2, rows=slice(3, 6), epochs=3),
            strict=True,
        )
    ]
    np.testing.assert_array_equal(halves, whole[2:9])
    with pytest.raises(ValueError, match="start must be an int >= 0, got -1"):
        ddl.data.batches(data, 6, start=-1)
    with pytest.raises(ValueError, match=r"rows must be a non-empty slice of range\(6\)"):
        ddl.data.batches(data, 6, rows=slice(4, 8))


def test_numpy_integers_are_arguments_like_python_ints():
    # One process: initialize checks its arguments and returns without starting a runtime.
    args = ("127.0.0.1:1234", np.int64(1), np.int32(0))
    options = {"initialization_timeout": np.int64(5), "heartbeat_timeout_seconds": np.int16(3)}
    assert launch.initialize(*args, **options) is False
    assert launch.process_rows(ddl.make_mesh(data=np.int64(8)), np.int64(32)) == slice(0, 32)


def test_ranks_that_never_join_are_warned_about(tmp_path):
    launcher = [sys.executable, "-m", "ddl_jax.cli", "launch", "-n", "2", "--"]

    def launched(name, text):
        (tmp_path / name).write_text(text)
        run = [*launcher, sys.executable, str(tmp_path / name)]
        return subprocess.run(run, env=child_env(), capture_output=True, text=True, timeout=120)

    alone = launched("alone.py", "print('trained alone')\n")
    assert alone.returncode == 0
    assert "rank(s) 0, 1 never called ddl_jax.launch.initialize()" in alone.stderr, alone.stderr
    joining = "from ddl_jax._src.train import launch\nlaunch.initialize()\nprint('joined')\n"
    together = launched("joined.py", joining)
    assert together.returncode == 0, together.stderr
    assert "never called" not in together.stderr
    # Ranks that fail without having joined: the warning, which may be why, still comes.
    failed = launched("crashing.py", "import sys\nprint('alone')\nsys.exit(3)\n")
    assert failed.returncode == 3, failed.stderr
    assert "never called ddl_jax.launch.initialize() (if the script calls it, they failed " in (
        failed.stderr
    )
