"""``ddl-jax compare --measure`` / ``--emulate``: the strategies as real processes, timed,
next to the simulator's time before and after calibrating it on those processes."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GLOO_LOOPS_REPORT, child_env

from ddl_jax import cli
from ddl_jax.compare import measured, processes, worker
from ddl_jax.compare.config import make_config
from ddl_jax.compare.specs import CompareError


@pytest.mark.parametrize(
    ("text", "rate", "bandwidth", "delay", "latency"),
    [
        ("100mbit", "100mbit", 12.5e6, None, 0.0),
        ("1gbit,2ms", "1gbit", 125e6, "2ms", 2e-3),
        ("2.5gbit,500us", "2.5gbit", 312.5e6, "500us", 5e-4),
    ],
)
def test_parse_emulation(text, rate, bandwidth, delay, latency):
    link = processes.parse_emulation(text)
    assert (link.rate, link.delay, link.text) == (rate, delay, text)
    assert link.bandwidth == pytest.approx(bandwidth)
    assert link.latency == pytest.approx(latency)


@pytest.mark.parametrize("text", ["5g", "100mb", "0mbit", "100mbit,2", "100mbit,fast", ""])
def test_a_bad_emulation_is_one_line_with_an_example(text):
    with pytest.raises(CompareError, match="e.g. 100mbit, 1gbit or 100mbit,2ms"):
        processes.parse_emulation(text)


def test_emulate_implies_measure_and_both_refuse_what_processes_cannot_run():
    config = make_config({"emulate": "100mbit"})
    assert (config.measure, config.emulate) == (True, "100mbit")
    assert make_config({"measure": True}).measure
    with pytest.raises(CompareError, match="no simulated straggler"):
        make_config({"measure": True, "straggler": 2})
    with pytest.raises(CompareError, match="cannot go with measure=false"):
        make_config({"measure": False, "emulate": "1gbit"})
    with pytest.raises(CompareError, match="measure must be true or false"):
        make_config({"measure": "yes"})
    assert make_config({"measure": True}).launches == 3
    assert make_config({"emulate": "1gbit", "launches": "1"}).launches == 1
    with pytest.raises(CompareError, match="launches must be an integer >= 1, got 0"):
        make_config({"measure": True, "launches": 0})
    with pytest.raises(CompareError, match="launches times measured processes: give it with"):
        make_config({"launches": 2})


def test_emulate_without_root_says_what_to_do_before_anything_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    args = ["compare", "--devices", "2", "--strategies", "sync", "--steps", "2"]
    assert cli.main([*args, "--emulate", "100mbit", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "emulate needs root on Linux" in captured.err
    assert "use --measure alone" in captured.err
    assert "sync:" not in captured.out  # refused before the first run trained


def _compare(out, *args, timeout=420):
    """``ddl-jax compare`` as a process of its own (its measured runs start more), in a
    process group killed whole on a timeout; returns results.json. One launch of the
    processes a timing unless ``args`` give ``--launches``."""
    launches = () if "--launches" in args else ("--launches", "1")
    cmd = [sys.executable, "-m", "ddl_jax.cli", "compare", "--devices", "2", "--out", str(out),
           "--workload", "digits-mlp", "--steps", "40", "--eval-every", "4", "--target", "0.8",
           *launches, *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, stderr[-2000:]
    return json.loads((out / "results.json").read_text()), stdout


def _check_measured(results, stdout):
    m = results["measured"]
    assert m["processes"] == 2
    fitted = m["fitted_network"]
    assert fitted["bandwidth"] > 0 and fitted["latency"] >= 0 and fitted["overhead"] >= 0
    # the sweep holds collectives of two different rounds, which tell overhead from latency
    kinds = {s["program"].split(" of ")[0] for s in m["sweep"]}
    assert {"32 x all-reduce", "32 x permute"} <= kinds, kinds
    assert m["compute_scale"] > 0
    for run in results["runs"]:
        got = run["measured"]
        # the processes trained the same model on the same batches as the simulated run:
        # the metric after its steps to target is the simulated run's there
        assert got["steps"] == run["steps_to_target"]
        at = run["eval_steps"].index(got["steps"])
        assert got["metric"] == pytest.approx(run["eval_values"][at], abs=2 / 360)
        assert got["seconds"] > 0 and sorted(got["repeats"])[1] == got["seconds"]  # the median
        launches = results["config"]["launches"]
        assert len(got["launch_seconds"]) == len(m["probe"]["launch_seconds"]) == launches
        assert got["seconds"] == sorted(got["launch_seconds"])[launches // 2]
        for key in ("error", "calibrated_error"):
            simulated = got["simulated_seconds" if key == "error" else "calibrated_seconds"]
            assert got[key] == pytest.approx(simulated / got["seconds"] - 1)
    assert "| strategy | steps | measured |" in stdout
    assert m["cores"] == len(os.sched_getaffinity(0)) and f"on {m['cores']} CPU cores" in stdout
    assert ("warning: 2 processes on" in stdout) == (m["cores"] < 2)  # the crowding warning


def test_a_slow_sweep_program_is_timed_fewer_times():
    """The sweep's programs are timed 11 times (the median kept), a slow one (a large
    all-reduce on a slow link) as many times as take about 2 s, at least 3."""
    assert worker.sweep_repeats(1e-4) == worker.sweep_repeats(0.18) == 11
    assert worker.sweep_repeats(0.37) == 6  # 4 MB at 100 Mb/s
    assert worker.sweep_repeats(1.44) == worker.sweep_repeats(60.0) == 3  # 16 MB


def test_more_processes_than_cores_are_warned_of():
    assert measured.crowding(2, 2) is None and measured.crowding(4, 16) is None
    warning = measured.crowding(4, 2)
    assert warning.startswith("measure: warning: 4 processes on 2 cores: at most 2 run at once")
    assert "give each process a core" in warning


def test_measured_processes_train_what_the_simulator_priced(tmp_path):
    results, stdout = _compare(
        tmp_path, "--strategies", "sync,local:4,async", "--measure", "--launches", "2"
    )
    _check_measured(
        {**results, "runs": [r for r in results["runs"] if r["strategy"] != "async"]}, stdout
    )
    assert "loopback" in results["measured"]["cluster"]
    (asynchronous,) = [r for r in results["runs"] if r["strategy"] == "async"]
    assert asynchronous["measured"] == {
        "skipped": "asynchronous: simulated as a parameter server, not run as one"
    }
    assert "not measured: asynchronous" in stdout


SWEEP_THEN_LOOK = (
    """
import sys
from ddl_jax.compare import worker

worker.main(sys.argv[1:])
"""
    + GLOO_LOOPS_REPORT
)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_measured_processes_idle_their_gloo_threads(tmp_path):
    """The calibration sweep's processes (the tunings off) lower gloo's transport threads
    to SCHED_IDLE: processes on one host stand for hosts of their own."""
    script = tmp_path / "sweep_then_look.py"
    script.write_text(SWEEP_THEN_LOOK)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen([sys.executable, str(script), coordinator, "2", str(rank), "sweep"],
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
        for rank in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-2000:]
        loops = re.search(r"gloo loop threads (\d+) all at SCHED_IDLE (\w+)", stdout)
        assert loops and int(loops[1]) >= 1 and loops[2] == "True", stdout[-2000:]


_NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "unshare")),
    reason="network namespaces and tc need root",
)


@_NEEDS_ROOT
def test_an_emulated_link_is_what_the_calibration_finds(tmp_path):
    results, stdout = _compare(tmp_path, "--strategies", "sync", "--emulate", "100mbit")
    _check_measured(results, stdout)
    # tbf at 100 Mb/s carries about 93% of 12.5 MB/s; the fit found 11.2 MB/s on an idle
    # machine, 10.0 to 10.7 beside three busy processes, 15.4 once under the suite's load:
    # the link's rate, not the unlimited veth's (GB/s) nor a tenth of it
    fitted = results["measured"]["fitted_network"]["bandwidth"]
    assert fitted == pytest.approx(0.93 * 12.5e6, rel=0.35)
    assert "each in a network namespace, 100mbit" in stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not re.search(r"^d\d+(n\d+|br)\b", names, re.M), names  # all removed


# Rank 0 receives messages of a length given in their first 8 bytes and answers each with
# one byte; rank 1 sends 64 kB after 5 ms idle, 15 times, and prints the median round trip.
_ECHO = """
import socket, statistics, sys, time
rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if rank == 0:
    listener = socket.create_server((host, port))
    peer, _ = listener.accept()
    while header := peer.recv(8, socket.MSG_WAITALL):
        peer.recv(int.from_bytes(header, "little"), socket.MSG_WAITALL)
        peer.sendall(b"k")
else:
    for _ in range(100):
        try:
            peer = socket.create_connection((host, port))
            break
        except OSError:
            time.sleep(0.1)
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(15):
        time.sleep(0.005)
        tick = time.perf_counter()
        peer.sendall((65536).to_bytes(8, "little") + bytes(65536))
        peer.recv(1)
        times.append(time.perf_counter() - tick)
    print(statistics.median(times))
"""


@_NEEDS_ROOT
def test_an_emulated_link_carries_a_message_no_faster_than_its_rate():
    """A message after an idle spell (a gradient after a step's compute) crosses the
    emulated link at its rate, as a real link of that rate carries it: the token bucket
    must not let it pass at the virtual ethernet's speed (a bucket of 1 ms at 1 Gb/s did:
    64 kB in 135 us where 1 Gb/s takes 524 us)."""
    link = processes.parse_emulation("1gbit")
    with processes.emulated(2, link) as cluster:
        args = ["-c", _ECHO, "{rank}", cluster.host, str(_free_port())]
        ranks = [subprocess.Popen([*prefix, sys.executable, *(a.format(rank=r) for a in args)],
                                  stdout=subprocess.PIPE, text=True)
                 for r, prefix in enumerate(cluster.prefixes)]  # fmt: skip
        try:
            stdout, _ = ranks[1].communicate(timeout=60)
        finally:
            for rank in ranks:
                rank.kill()
    assert ranks[1].returncode == 0
    assert float(stdout) >= 0.8 * 65536 / link.bandwidth, stdout


def _free_port():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def _descendants(pid, command):
    """The pids of ``pid``'s descendants whose command line holds ``command``."""
    parents = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += [c for c in frontier if command.encode() in _cmdline(c)]
    return found


def _cmdline(pid):
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def _namespaces(tag):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return re.findall(rf"^{tag}\w+", listed, re.M) + [p for p in os.listdir("/etc/netns")
                                                     if p.startswith(tag)]  # fmt: skip


def test_a_sigterm_while_a_rank_starts_stops_that_rank_too(monkeypatch):
    """A SIGTERM that comes inside ``Popen``, after its fork, stops that process too: raised
    there (as ``SystemExit``, in the thread that started the ranks) it left the process
    running, unknown to the cleanup (a rank left running after the emulation's test)."""
    started = []

    class SignalledWhileStarting(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
            if len(started) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # a handler of this thread's runs here

    monkeypatch.setattr(processes.subprocess, "Popen", SignalledWhileStarting)
    try:
        with pytest.raises(SystemExit):
            processes.run_worker(processes.loopback(2), ["sweep"], timeout=60)
        assert [p.poll() is not None for p in started] == [True] * len(started)
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@_NEEDS_ROOT
def test_a_terminated_emulation_removes_its_network(tmp_path):
    """A SIGTERM while the processes run on the emulated network (a job scheduler's stop,
    ``kill``) removes the namespaces, as an error does."""
    cmd = [sys.executable, "-m", "ddl_jax.cli", "compare", "--devices", "2", "--out",
           str(tmp_path), "--workload", "digits-mlp", "--steps", "8", "--target", "0.3",
           "--strategies", "sync", "--emulate", "100mbit"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    tag = f"d{proc.pid % 100000}"
    try:
        deadline = time.monotonic() + 300
        while not _namespaces(tag):  # the simulated run trains first
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        while not (ranks := _descendants(proc.pid, "ddl_jax.compare.worker")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)  # the calibration's processes start on it
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "terminated; removing the emulated network" in stderr
    assert _namespaces(tag) == []
    time.sleep(0.5)
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")], "ranks left running"


def test_the_compute_scale_takes_the_probes_collectives_out_unless_they_are_all_of_it(capsys):
    from ddl_jax import sim
    from ddl_jax.compare import measured, report

    probe = {"seconds": 1e-3, "flops": 1e6, "bytes": 1e5, "rounds": 2, "calls": 2, "ops": 1,
             "op_buffers": 1, "busy_bytes": 4.0}  # fmt: skip
    modeled = sim.estimate_compute_time(sim.ComputeStats(1e6, 1e5), sim.CPU_CORE)
    net = sim.Network(bandwidth=1e8, latency=100e-6, overhead=50e-6)  # 0.25 ms of the 1 ms
    scale = measured._compute_scale(probe, net, sim.CPU_CORE, per_buffer=True)
    assert scale == pytest.approx((1e-3 - 2e-4 - 5e-5 - 4e-8) / modeled)
    # most of the step, still taken out: a run of probe-like steps (the same compute and
    # collective) is then priced at the probe's measured time, not that plus its collective
    most = sim.Network(bandwidth=1e8, latency=400e-6)  # 0.8 ms of the 1 ms
    scale = measured._compute_scale(probe, most, sim.CPU_CORE, True)
    assert scale == pytest.approx((1e-3 - 8e-4 - 4e-8) / modeled)
    steps = 10
    like_probe = {"compute_seconds_to_target": steps * modeled * scale, "steps_to_target": steps,
                  "events_to_target": 0, "comm_calls_per_step": 2, "comm_op_buffers_per_step": 1,
                  "comm_busy_bytes_per_step": 4.0, "comm_calls_per_event": 0,
                  "comm_op_buffers_per_event": 0, "comm_busy_bytes_per_event": 0}  # fmt: skip
    priced = report.time_to_target(like_probe, most.bandwidth, most.latency, per_buffer=True)
    assert priced == pytest.approx(steps * probe["seconds"])
    assert capsys.readouterr().err == ""
    slow = sim.Network(bandwidth=1e8, latency=600e-6)  # 1.2 ms of the 1 ms: nothing left
    assert measured._compute_scale(probe, slow, sim.CPU_CORE, True) == pytest.approx(1e-3 / modeled)
    assert "timed mostly by its collectives; or the machine is busy" in capsys.readouterr().err


def test_a_rank_that_fails_is_named_at_once_while_its_peer_still_runs():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    tick = time.monotonic()
    try:
        assert processes._first_failure([sleeper, failing], time.monotonic() + 30) == 1
        assert time.monotonic() - tick < 20
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_strategy_whose_measured_run_fails_leaves_the_others_measured(
    tmp_path, monkeypatch, capsys
):
    """The calibration and one strategy's processes stand in (no processes start): the
    other strategy is measured, the failed one says why, the calibration stays written."""
    from ddl_jax.compare import report
    from ddl_jax.compare.run import run_compare

    settings = {"strategies": "sync,local:4", "steps": 8, "eval_every": 4, "target": 0.3,
                "devices": 2, "out": str(tmp_path)}  # fmt: skip
    results = run_compare(make_config(settings))

    def run_worker(cluster, args, timeout):
        if args[0] == "sweep":
            return {"samples": []}
        if args[0] == "compute":
            return {"seconds": 1e-3}
        if args[2] == "local:4":
            raise CompareError("measure: rank 1 of `train` was killed by signal 9: ")
        return {"seconds": 0.5, "repeats": [0.5], "metric": 0.5}

    monkeypatch.setattr(processes, "run_worker", run_worker)
    monkeypatch.setattr(measured, "fit_network", lambda samples, per_buffer: measured._nominal(
        make_config({"devices": 2})))  # fmt: skip
    monkeypatch.setattr(measured, "_compute_scale", lambda *args: 1.0)
    measured.measure(results, make_config({**settings, "measure": True}))
    sync, local = results["runs"]
    assert sync["measured"]["seconds"] == 0.5 and results["measured"]["compute_scale"] == 1.0
    assert local["measured"] == {"failed": "measure: rank 1 of `train` was killed by signal 9: "}
    assert "[2/2] local:4: measured run failed: measure: rank 1" in capsys.readouterr().err
    assert "| local:4 | failed: measure: rank 1 of `train` was killed" in report.markdown(results)


def test_the_probe_and_each_strategy_are_timed_in_several_launches_the_median_kept(
    tmp_path, monkeypatch
):
    """A launch of the processes keeps its speed across its runs, but launches differ (on 2
    cores one probe launch took 0.74 ms a step, another 0.99): the probe and each strategy
    run in ``launches`` launches (3 by default) and the median launch's time is kept, every
    launch's recorded."""
    from ddl_jax.compare import report
    from ddl_jax.compare.run import run_compare

    settings = {"strategies": "sync,local:4", "steps": 8, "eval_every": 4, "target": 0.3,
                "devices": 2, "out": str(tmp_path)}  # fmt: skip
    results = run_compare(make_config(settings))
    speeds = iter([1.3, 0.7, 1.0] * 3)  # each launch's speed, in turn
    launched = []

    def run_worker(cluster, args, timeout):
        launched.append(args[0] if args[0] != "train" else args[2])
        if args[0] == "sweep":
            return {"samples": []}
        speed = next(speeds)
        if args[0] == "compute":
            return {"seconds": 1e-3 * speed}
        return {"seconds": 0.5 * speed, "repeats": [0.5 * speed], "metric": speed}

    monkeypatch.setattr(processes, "run_worker", run_worker)
    monkeypatch.setattr(measured, "fit_network", lambda samples, per_buffer: measured._nominal(
        make_config({"devices": 2})))  # fmt: skip
    monkeypatch.setattr(measured, "_compute_scale", lambda *args: 1.0)
    measured.measure(results, make_config({**settings, "measure": True}))
    assert launched == ["sweep", *["compute"] * 3, *["sync"] * 3, *["local:4"] * 3]
    m = results["measured"]
    assert m["probe"]["seconds"] == 1e-3
    assert m["probe"]["launch_seconds"] == pytest.approx([1.3e-3, 7e-4, 1e-3])
    for run in results["runs"]:
        got = run["measured"]
        assert got["seconds"] == 0.5 and got["metric"] == 1.0 and got["repeats"] == [0.5]
        assert got["launch_seconds"] == pytest.approx([0.65, 0.35, 0.5])
    assert "the median of 3 launches, 0.7 ms to 1.3 ms" in report.markdown(results)


@pytest.mark.parametrize(
    ("pairs", "two_way"),
    [
        (((0, 1), (1, 0)), True),  # a ring of 2
        (((0, 1), (1, 0), (2, 3), (3, 2)), True),  # NoLoCo's pairs
        (((0, 1), (1, 2), (2, 3), (3, 0)), False),  # a ring of 4
        (((0, 1),), False),
        (((0, 0), (1, 1)), False),  # each device its own
    ],
)
def test_a_permute_exchanges_both_ways_where_two_devices_send_to_each_other(pairs, two_way):
    from ddl_jax import sim
    from ddl_jax.compare import run

    permute = sim.CollectiveOp("collective-permute", 8, 3, 2, (8.0,) * 4, 1, "", groups=pairs)
    both = sim.CollectiveOp("all-reduce", 8, 1, 4, (12.0,) * 4, 6, "", groups=((0, 1, 2, 3),))
    assert run.two_way(permute) is two_way and not run.two_way(both)
    terms = run._terms((permute, both), "")
    assert terms["busy_bytes"] == 3 * 8 + 12
    assert terms["exchanged_bytes"] == (3 * 8 if two_way else 0)


def test_saved_runs_are_priced_again_as_they_were_measured(tmp_path, monkeypatch):
    """``reprice`` recomputes, from a results.json's own sweep, probe and timings, what
    ``measure`` wrote: the same numbers while the model is the same, and a faster probe
    gives less compute to every strategy."""
    from ddl_jax import sim
    from ddl_jax.compare.report import markdown
    from ddl_jax.compare.run import run_compare

    settings = {"strategies": "sync,local:4,ring", "steps": 8, "eval_every": 4, "target": 0.3,
                "devices": 2, "out": str(tmp_path)}  # fmt: skip
    results = run_compare(make_config(settings))
    truth = sim.Network(bandwidth=1e8, latency=60e-6, overhead=20e-6)
    shapes = [(2, 1, 4), (2, 1, 1 << 20), (2, 1, 1 << 24), (32, 16, 16384), (64, 32, 2048),
              (1, 1, 4), (32, 32, 2048)]  # (calls, op_buffers, busy bytes)  # fmt: skip
    sweep = [{"calls": c, "op_buffers": o, "busy_bytes": b, "rounds": 2, "ops": 1,
              "seconds": c * truth.latency + o * truth.overhead + b / truth.bandwidth + 1e-5}
             for c, o, b in shapes]  # fmt: skip
    probe = {"seconds": 2e-3, "flops": 1e6, "bytes": 1e5, "rounds": 2, "calls": 2, "ops": 1,
             "op_buffers": 1, "busy_bytes": 4.0}  # fmt: skip
    timings = {"sync": 0.5, "local:4": 0.25, "ring": 0.5}

    def run_worker(cluster, args, timeout):
        if args[0] == "sweep":
            return {"samples": sweep}
        if args[0] == "compute":
            return probe
        return {"seconds": timings[args[2]], "repeats": [timings[args[2]]], "metric": 0.5}

    monkeypatch.setattr(processes, "run_worker", run_worker)
    measured.measure(results, make_config({**settings, "measure": True}))
    fitted = sim.Network(**results["measured"]["fitted_network"])
    assert fitted.latency == pytest.approx(truth.latency)
    assert fitted.overhead == pytest.approx(truth.overhead)
    again = measured.reprice(json.loads(json.dumps(results)))
    for run, priced in zip(results["runs"], again["runs"], strict=True):
        assert priced["measured"].keys() == run["measured"].keys()
        for key in ("seconds", "error", "calibrated_seconds", "calibrated_error"):
            assert priced["measured"][key] == pytest.approx(run["measured"][key], rel=1e-12)
    # a ring of 2 exchanges its chunks both ways: priced also with them sent in turn
    sync, local, ring = results["runs"]
    assert sync["comm_exchanged_bytes_per_step"] == local["comm_exchanged_bytes_per_event"] == 0
    assert "in_turn_error" not in sync["measured"] | local["measured"]
    exchanged = ring["comm_exchanged_bytes_per_step"]
    assert 0.9 * ring["comm_busy_bytes_per_step"] < exchanged <= ring["comm_busy_bytes_per_step"]
    m = ring["measured"]
    in_turn = m["calibrated_seconds"] + ring["steps_to_target"] * exchanged / fitted.bandwidth
    assert m["in_turn_seconds"] == pytest.approx(in_turn)
    assert m["in_turn_error"] == pytest.approx(in_turn / m["seconds"] - 1)
    assert f"{m['calibrated_error']:+.0%}, in turn {m['in_turn_error']:+.0%} |" in markdown(results)
    assert again["measured"]["compute_scale"] == pytest.approx(results["measured"]["compute_scale"])
    results["measured"]["probe"]["seconds"] = 1e-3  # the same steps, half the compute
    faster = measured.reprice(results)
    assert faster["measured"]["compute_scale"] < again["measured"]["compute_scale"]
    for run, priced in zip(again["runs"], faster["runs"], strict=True):
        assert priced["measured"]["calibrated_seconds"] < run["measured"]["calibrated_seconds"]
        assert priced["measured"]["seconds"] == run["measured"]["seconds"]


def test_nothing_is_calibrated_when_no_strategy_can_be_measured(tmp_path, monkeypatch, capsys):
    """No strategy reached the target: no process starts, each run and the report say why."""
    from ddl_jax.compare import report
    from ddl_jax.compare.run import run_compare

    settings = {"strategies": "sync,local:4", "steps": 4, "eval_every": 2, "target": 0.99,
                "devices": 2, "out": str(tmp_path)}  # fmt: skip
    results = run_compare(make_config(settings))
    started = []
    monkeypatch.setattr(processes, "run_worker", lambda *args: started.append(args))
    measured.measure(results, make_config({**settings, "measure": True}))
    assert not started
    assert [r["measured"] for r in results["runs"]] == [{"skipped": "did not reach the target"}] * 2
    assert "measure: no strategy to measure" in capsys.readouterr().err
    assert "Measured: nothing" in report.markdown(results)
