"""``ddl-jax``: ``launch`` starts N local processes of a script and supervises them;
``compare`` trains a model with each distributed-training strategy and compares them."""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.train import launch
from ddl_jax._src.xla_cpu import tunings

_POLL_S = 0.05
#: Seconds after a rank's failure in which the failures of others are reported with it.
_SETTLE_S = 0.5


def _free_port() -> int:
    # Bind to port 0 and hand the port the kernel chose to the coordinator; the short window
    # before process 0 binds it again is the usual price of not passing sockets around.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code} (killed by signal {-code})"
    return f"exit code {code}"


def _pump(stream, prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"{prefix}{line}\n")
            sys.stdout.flush()
    stream.close()


def _start(args: argparse.Namespace, attempt: int, lock: threading.Lock, joined: str):
    port = _free_port()
    procs, pumps = [], []
    for rank in range(args.num_processes):
        env = {
            **os.environ,
            launch.ENV_COORDINATOR: f"127.0.0.1:{port}",
            launch.ENV_NUM_PROCESSES: str(args.num_processes),
            launch.ENV_PROCESS_ID: str(rank),
            launch.ENV_HEARTBEAT: str(args.heartbeat_timeout),
            launch.ENV_ATTEMPT: str(attempt),
            launch.ENV_JOINED: joined,
            "PYTHONUNBUFFERED": "1",
        }
        if args.devices_per_process is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(args.devices_per_process)
        if args.xla_cpu_tunings:
            env[tunings.ENV_VAR] = "1"
        # A session of its own, so stopping a rank also stops whatever it started.
        try:
            proc = subprocess.Popen(
                args.command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            _stop(procs, 0.0)
            raise _CannotStart(f"cannot run {args.command[0]!r}: {e.strerror}.") from None
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] ", lock))
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    return procs, pumps


class _CannotStart(Exception):
    """The command could not be started (a missing program, no permission)."""


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(_POLL_S)
    for proc in procs:
        proc.wait()


def _supervise(procs: list[subprocess.Popen]) -> list[tuple[int, int]]:
    """Waits until every rank succeeded (``[]``) or one failed; then returns ``(rank, code)``
    for each rank that failed within ``_SETTLE_S`` seconds of the first, in exit order.

    One waiting thread per rank reports exits in the order they happen. A rank whose peer
    dies often fails within milliseconds (gloo aborts it), and it can be reaped before the
    peer that caused it; naming every rank of that moment keeps the cause in the report.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, proc in enumerate(procs):
        threading.Thread(
            target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True
        ).start()
    failures: list[tuple[int, int]] = []
    deadline = None  # _SETTLE_S after the first failure
    for _ in procs:
        try:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0)
            rank, code = exits.get(timeout=wait)
        except queue.Empty:  # the others are alive (or hung on the dead rank): stop them
            break
        if code != 0:
            if deadline is None:
                deadline = time.monotonic() + _SETTLE_S
            failures.append((rank, code))
    return failures


def _failed(failures: list[tuple[int, int]]) -> str:
    """``rank 1 failed with exit code -9 (killed by SIGKILL)``, one clause per failure."""
    message = " and ".join(f"rank {r} failed with {_describe(c)}" for r, c in failures)
    if len(failures) > 1:
        message += (
            f" within {_SETTLE_S} s of each other (a rank that loses a peer fails with it, "
            "so the first to exit need not be the cause)"
        )
    return message


def _log(message: str, lock: threading.Lock) -> None:
    with lock:
        sys.stdout.flush()
        print(f"ddl-jax launch: {message}", file=sys.stderr, flush=True)


def _warn_unjoined(count: int, joined: str, lock: threading.Lock, failed: bool) -> None:
    """Warns about ranks that never called ``ddl_jax.launch.initialize()``: they ran as
    independent single-process jobs, not as one cluster (where the run failed, they may
    also have failed before reaching it)."""
    missing = [r for r in range(count) if not os.path.exists(os.path.join(joined, f"rank-{r}"))]
    if missing and count > 1:
        ranks = ", ".join(map(str, missing))
        before = " (if the script calls it, they failed before it)" if failed else ""
        _log(
            f"warning: rank(s) {ranks} never called ddl_jax.launch.initialize(){before}, so "
            f"the {count} processes ran as independent jobs, not one cluster; call it first "
            "in the script, before any JAX computation.",
            lock,
        )


def run_launch(args: argparse.Namespace) -> int:
    """Runs ``args.command`` as ``args.num_processes`` ranks; returns the exit status.

    Returns:
      0 when every rank exits 0; otherwise the exit code of the first rank to fail (128 +
      signal number for a rank killed by a signal), once restarts are used up.
    """
    lock = threading.Lock()
    for attempt in range(args.restarts + 1):
        joined = tempfile.mkdtemp(prefix="ddl-jax-launch-")
        try:  # the folder goes however the attempt ends (an error, Ctrl-C, SIGTERM)
            try:
                procs, pumps = _start(args, attempt, lock, joined)
            except _CannotStart as e:
                _log(f"error: {e}", lock)
                return 2
            try:
                failures = _supervise(procs)
            except KeyboardInterrupt:
                _log("interrupted; stopping every rank.", lock)
                return 130
            finally:  # also on SIGTERM (see main): no rank outlives the launcher
                _stop(procs, args.grace)
                for pump in pumps:
                    pump.join()
            _warn_unjoined(args.num_processes, joined, lock, failed=bool(failures))
            if not failures:
                return 0
        finally:
            shutil.rmtree(joined, ignore_errors=True)
        others = args.num_processes - len(failures)
        stopped = f"; stopped the other {others} process(es)" if others else ""
        _log(f"{_failed(failures)}{stopped}.", lock)
        if attempt < args.restarts:
            _log(
                f"restarting all {args.num_processes} processes (restart {attempt + 1} of "
                f"{args.restarts}); they resume from their latest checkpoint, where the script "
                "keeps one (ddl.fit(checkpoint_dir=...)), else from the start.",
                lock,
            )
    _log(f"giving up: {_failed(failures)}.", lock)
    code = failures[0][1]
    return code if code > 0 else 128 - code


def _number(
    check: Callable[..., Any], parse: type, name: str, **bounds: Any
) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse(text)`` checked by ``check_int`` / ``check_real``."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = text  # not a number: the check says what is valid
        try:
            return check(name, value, **bounds)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


_positive = _number(check_int, int, "value", minimum=1)
_non_negative = _number(check_int, int, "value", minimum=0)
# Finite: with inf or nan the launcher would wait forever, or not at all.
_seconds = _number(check_real, float, "seconds", minimum=0)


def parser() -> argparse.ArgumentParser:
    """The ``ddl-jax`` command line."""
    root = argparse.ArgumentParser(prog="ddl-jax", description=__doc__)
    sub = root.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "launch",
        help="run a script as N local processes joined by jax.distributed",
        description=(
            "Starts N copies of COMMAND on this machine, each a rank of one JAX cluster "
            "(coordinator on a free 127.0.0.1 port; the script calls "
            "ddl_jax.launch.initialize()). Output lines are prefixed with the rank. If a "
            "rank fails, the others are stopped (SIGTERM, then SIGKILL after --grace "
            "seconds) and all are restarted, up to --restarts times."
        ),
    )
    p.add_argument("-n", "--num-processes", type=_positive, required=True, help="ranks to start")
    p.add_argument(
        "--devices-per-process",
        type=_positive,
        default=None,
        help="CPU devices each rank exposes (JAX_NUM_CPU_DEVICES); default: JAX's",
    )
    p.add_argument(
        "--restarts",
        type=_non_negative,
        default=0,
        help="times to relaunch all ranks after a failure (default 0)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=_positive,
        default=10,
        help="seconds before JAX's runtime declares a silent rank dead (default 10)",
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=3.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)",
    )
    p.add_argument(
        "--xla-cpu-tunings",
        action="store_true",
        help=(
            f"turn on the XLA:CPU tunings in every rank ({tunings.ENV_VAR}=1): they help "
            "CPU clusters of one process per pinned core (see ddl_jax.launch.initialize)"
        ),
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python script.py args...")
    p.set_defaults(usage=p)
    _compare_parser(sub)
    return root


def _compare_parser(sub: Any) -> None:
    """The ``compare`` subcommand. Values stay strings here: ``make_config`` checks them,
    the same code that checks a ``--config`` file."""
    from ddl_jax.compare import specs as cs

    p = sub.add_parser(
        "compare",
        help="train one model with each strategy and compare accuracy, bytes and time",
        description=(
            "Trains the same model on the same data, in the same order, with each strategy "
            "(spec name[:param]), and reports final accuracy, steps and examples to the "
            "target, bytes each device sends per step and the step's flops (compiled HLO), "
            "and simulated time to the target on --network and --compute. Writes results.json, "
            "results.md and PNG figures to --out. Invalid input exits with code 2."
        ),
        epilog=(
            "strategies: "
            + "; ".join(
                f"{name}{'' if f.default is None else ':' + f.default} ({f.describe})"
                for name, f in cs.FAMILIES.items()
            )
        ),
    )
    p.add_argument(
        "--workload",
        help=f"one of {', '.join(cs.WORKLOADS)} (default digits-mlp), or module:function "
        "returning a ddl_jax.compare.Workload of your own",
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated specs (default {','.join(cs.DEFAULT_STRATEGIES)})",
    )
    p.add_argument(
        "--preset",
        help=f"a named strategy list instead of --strategies: {', '.join(cs.PRESETS)}",
    )
    p.add_argument("--devices", help="workers, one per device (default 8)")
    p.add_argument(
        "--workers",
        help="simulated workers, a multiple of --devices, several a device, each priced as "
        "one worker a device (e.g. --devices 8 --workers 256 --strategies "
        "sync,local:16,gossip,async,softsync:8)",
    )
    p.add_argument("--steps", help="training steps per strategy (default: the workload's)")
    p.add_argument("--network", help=f"one of {', '.join(cs.NETWORKS)} (default 1gbps)")
    p.add_argument(
        "--compute",
        help=f"device model pricing each worker's computation: {', '.join(cs.DEVICES)} "
        "(default cpu)",
    )
    p.add_argument(
        "--straggler",
        help="one worker's compute time relative to the others, >= 1 (default 1: none)",
    )
    p.add_argument(
        "--drop",
        help="probability that a message is lost, in [0, 1) (default 0; --preset unreliable)",
    )
    p.add_argument(
        "--churn",
        help="probability that a worker is absent from a step, in [0, 1) (default 0; "
        "--preset unreliable)",
    )
    p.add_argument(
        "--non-iid",
        help="Dirichlet alpha of label-skewed worker shares, > 0 (digits; default i.i.d.)",
    )
    p.add_argument("--seed", help="seed of initialisation and data order (default 0)")
    p.add_argument(
        "--target",
        help="metric to reach: test accuracy, or text-gpt's bits per byte (default: the "
        "workload's: digits-mlp 0.95, digits-cnn and digits-resnet 0.9, text-gpt 3.0)",
    )
    p.add_argument("--eval-every", help="steps between evaluations (default steps / 20)")
    p.add_argument("--out", help="output directory (default compare-results)")
    p.add_argument(
        "--tensorboard",
        help="directory for TensorBoard logs, a run per strategy (replaced when run again)",
    )
    p.add_argument(
        "--measure",
        action="store_const",
        const=True,
        help="also run each strategy as --devices real processes, time it to the target and "
        "show the simulator's error before and after calibrating it on them",
    )
    p.add_argument(
        "--emulate",
        help="RATE[,DELAY], e.g. 100mbit or 1gbit,2ms: --measure with each process in its own "
        "network namespace behind a tc limit (Linux, root; the delay needs tc netem)",
    )
    p.add_argument(
        "--launches",
        help="with --measure: launches of the processes timing the probe and each strategy, "
        ">= 1, the median kept (default 3)",
    )
    p.add_argument(
        "--islands",
        help="islands of stacked strategies (outer/inner, e.g. diloco:16/fsdp:3), >= 2 "
        "(default 2): --network links them",
    )
    p.add_argument(
        "--inner-network",
        help=f"the network inside an island: one of {', '.join(cs.NETWORKS)} (default ici)",
    )
    p.add_argument("--config", help="TOML file with any of these settings; flags override it")
    p.set_defaults(usage=p)


_COMPARE_FLAGS = (
    "workload",
    "strategies",
    "preset",
    "devices",
    "steps",
    "network",
    "compute",
    "straggler",
    "drop",
    "churn",
    "non_iid",
    "seed",
    "target",
    "eval_every",
    "out",
    "tensorboard",
    "measure",
    "emulate",
    "launches",
    "islands",
    "inner_network",
    "workers",
)


def run_compare(args: argparse.Namespace) -> int:
    """Runs ``ddl-jax compare``; a bad input prints one line to stderr and returns 2, a
    strategy that failed (the others' results written) 1."""
    from ddl_jax.compare import config as compare_config
    from ddl_jax.compare import run as compare
    from ddl_jax.compare import specs as compare_specs

    try:
        values = compare_config.read_toml(args.config) if args.config else {}
        flags = {key: getattr(args, key) for key in _COMPARE_FLAGS}
        flags = {key: value for key, value in flags.items() if value is not None}
        if {"strategies", "preset"} & set(flags):  # the flags' list replaces the file's
            values = {k: v for k, v in values.items() if k not in ("strategies", "preset")}
        values |= flags
        results = compare.run_compare(compare_config.make_config(values))
    except compare_specs.CompareError as e:
        print(f"ddl-jax compare: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # what finished while training or measuring is written
        print("ddl-jax compare: interrupted.", file=sys.stderr, flush=True)
        return 130
    runs = results["runs"]
    failed = [r["strategy"] for r in runs if "error" in r or "failed" in r.get("measured", {})]
    if failed:
        print(
            f"ddl-jax compare: {len(failed)} of {len(runs)} strategies failed: "
            f"{', '.join(failed)}.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddl-jax``."""
    root = parser()
    args, unknown = root.parse_known_args(argv)
    if unknown:  # under the subcommand's usage, not the top level's
        args.usage.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd == "compare":
        return run_compare(args)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        root.error("launch: give the command to run after --, e.g. -- python train.py")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return run_launch(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
