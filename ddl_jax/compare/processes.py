"""Real processes for ``ddl-jax compare --measure``: N local processes of the compare
worker (``ddl_jax.compare.worker``), joined by ``ddl.launch.initialize``, on the loopback
interface or on an emulated network.

The emulated network (``--emulate RATE[,DELAY]``, Linux, root): one network namespace per
process, each with its own hostname (JAX's gloo advertises the address its hostname
resolves to), joined to a bridge in a namespace of its own by a virtual ethernet pair
whose both ends are limited to RATE by a ``tc`` token bucket (``tbf``): every process
sends and receives at most RATE, as through its own network card. DELAY adds a one-way
delay with ``tc netem`` where the kernel has it (and says so where it does not).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ddl_jax.compare.specs import CompareError

#: The token bucket holds this many seconds of traffic at the rate (at least MIN_BURST
#: bytes, two Ethernet frames): a message after an idle spell (a gradient after a step's
#: compute) passes at the veth's speed up to the bucket's bytes. 1 ms let a 64 kB message
#: through in 0.14 ms where 1 Gb/s takes 0.52 (0.61 with 0.1 ms), and the digits MLP's
#: synchronous step of 104 kB whole; it carried bulk traffic at 107 MB/s, 0.1 ms at 98.
BURST_SECONDS = 1e-4
MIN_BURST = 3028

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class Emulation(NamedTuple):
    """An emulated link: ``rate`` and ``delay`` as ``tc`` reads them, and their values."""

    rate: str
    bandwidth: float  # bytes per second
    delay: str | None = None
    latency: float = 0.0  # seconds one way

    @property
    def text(self) -> str:
        return self.rate if self.delay is None else f"{self.rate},{self.delay}"


def parse_emulation(text: str) -> Emulation:
    """``"100mbit"`` or ``"1gbit,2ms"``: a rate in kbit, mbit or gbit per second, and an
    optional one-way delay in us, ms or s.

    Raises:
      CompareError: not of that form (one line with an example).
    """
    rate, _, delay = str(text).partition(",")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip())
    d = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay.strip()) if delay else None
    if m is None or float(m[1]) <= 0 or (delay and d is None):
        raise CompareError(
            f"emulate {text!r} is not a rate with an optional delay, e.g. 100mbit, 1gbit "
            "or 100mbit,2ms."
        )
    bandwidth = float(m[1]) * _UNITS[m[2]] / 8
    if d is None:
        return Emulation(rate.strip(), bandwidth)
    return Emulation(rate.strip(), bandwidth, delay.strip(), float(d[1]) * _DELAY_UNITS[d[2]])


class Cluster(NamedTuple):
    """Where N processes run: a command prefix per rank (empty: this namespace) and the
    coordinator's host (rank 0's address)."""

    prefixes: tuple[tuple[str, ...], ...]
    host: str
    description: str


def loopback(n: int) -> Cluster:
    """N processes on this machine's loopback interface (no bandwidth limit)."""
    return Cluster(((),) * n, "127.0.0.1", f"{n} processes on the loopback interface")


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise CompareError(
            f"emulate: `{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}."
        )


def check_emulation_possible() -> None:
    """Raises ``CompareError`` (saying what to do instead) unless this is Linux, as root,
    with ``ip``, ``tc`` and ``unshare``."""
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if sys.platform != "linux" or os.geteuid() != 0 or missing:
        why = f"missing {', '.join(missing)}" if missing else "not root on Linux"
        raise CompareError(
            f"emulate needs root on Linux with ip, tc and unshare ({why}): network "
            "namespaces and a tc bandwidth limit. Run it as root (e.g. sudo), or use "
            "--measure alone to time real processes over loopback, or `ddl-jax launch` on a "
            "real cluster."
        )


def _qdiscs(ns: str, dev: str, emulation: Emulation) -> None:
    burst = max(int(emulation.bandwidth * BURST_SECONDS), MIN_BURST)
    tbf = ("tbf", "rate", emulation.rate, "burst", f"{burst}b", "latency", "100ms")
    if emulation.delay is None:
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf)
        return
    done = subprocess.run(
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
         emulation.delay], capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise CompareError(
            f"emulate: this kernel has no tc netem ({done.stderr.strip()}), so a delay cannot "
            f"be emulated; give the rate alone (--emulate {emulation.rate})."
        )
    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)


@contextlib.contextmanager
def _terminate_as_exit(doing: str) -> Iterator[None]:
    """Inside, a SIGTERM (``kill``, a job scheduler's stop) raises ``SystemExit(143)`` in
    the main thread, so that the ``finally`` blocks it unwinds through run (``doing``
    says what they undo): Python's own handling of SIGTERM ends the process without them."""
    nested = getattr(signal.getsignal(signal.SIGTERM), "terminate_as_exit", False)
    if nested or threading.current_thread() is not threading.main_thread():
        yield  # an outer one says what it undoes, and raises through this one's too
        return

    def stop(signum: int, frame: Any) -> None:
        print(f"ddl-jax compare: terminated; {doing}", file=sys.stderr)
        raise SystemExit(128 + signum)

    stop.terminate_as_exit = True  # type: ignore[attr-defined]

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def emulated(n: int, emulation: Emulation) -> Iterator[Cluster]:
    """N network namespaces on a bridge, every link limited to ``emulation``; removed on
    exit (also after an error, an interrupt or a SIGTERM, which stops the processes on
    it first)."""
    check_emulation_possible()
    tag = f"d{os.getpid() % 100000}"
    bridge = f"{tag}br"
    names = [(f"{tag}n{i}", f"{tag}v{i}", f"{tag}b{i}", f"10.77.0.{i + 1}", f"{tag}h{i}")
             for i in range(n)]  # fmt: skip
    hosts = "127.0.0.1 localhost\n" + "".join(f"{ip} {host}\n" for *_, ip, host in names)
    with _terminate_as_exit("removing the emulated network"), contextlib.ExitStack() as cleanup:
        cleanup.callback(_remove, names, bridge)
        _sh("ip", "netns", "add", bridge)
        _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for ns, dev, peer, ip, _ in names:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", peer, "netns", bridge)
            _sh("ip", "-n", bridge, "link", "set", peer, "master", "br0")
            _sh("ip", "-n", bridge, "link", "set", peer, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _qdiscs(ns, dev, emulation)
            _qdiscs(bridge, peer, emulation)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
        prefixes = tuple(
            ("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
             f'hostname {host} && exec "$@"', "sh")
            for ns, *_, host in names
        )  # fmt: skip
        link = emulation.rate + (f", {emulation.delay} delay" if emulation.delay else "")
        yield Cluster(prefixes, names[0][3], f"{n} processes, each in a network namespace, {link}")


def _remove(names: list[tuple[str, ...]], bridge: str) -> None:
    """The namespaces ``names`` (and their hosts files) and ``bridge`` removed."""
    for ns, *_ in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    subprocess.run(["ip", "netns", "del", bridge], capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _first_failure(procs: list[subprocess.Popen], deadline: float) -> int | None:
    """Waits for every rank to exit: ``-1`` when all succeed, the rank of the first to
    fail as soon as it does, ``None`` at ``deadline``."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return -1
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _drain(stream, into: list[str]) -> None:
    into.extend(stream)


def run_worker(cluster: Cluster, args: Sequence[str], timeout: float) -> dict:
    """Runs ``python -m ddl_jax.compare.worker COORDINATOR N RANK ARGS`` as one process
    per rank of ``cluster``; returns the JSON object rank 0 prints last.

    Raises:
      CompareError: a rank failed (its last lines) or the run outlived ``timeout``
        seconds (every rank is killed; none is left behind).
    """
    coordinator = f"{cluster.host}:{_free_port()}"
    env = {
        **os.environ,
        # the processes import the user's workload module as this one did
        "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
        # several processes on one host's accelerators: each takes memory as it needs it
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        # one device each, whatever this process simulates
        "XLA_FLAGS": re.sub(
            r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
        ),
    }
    with _terminate_as_exit("stopping the measured processes"):
        return _run_ranks(cluster, args, timeout, coordinator, env)


def _run_ranks(
    cluster: Cluster, args: Sequence[str], timeout: float, coordinator: str, env: dict
) -> dict:
    """``run_worker``'s processes: started, waited for, every one stopped on the way out.

    A thread starts them: a SIGTERM (raised as ``SystemExit`` in the main thread) that
    came inside ``Popen``, after its fork, left that process running and unknown; the
    thread's ``Popen`` returns, and the ``finally`` stops what it started. (It waits on an
    event: a ``join`` interrupted by the signal marks the thread finished while it runs.)"""
    n = len(cluster.prefixes)
    procs, outs, errs, pumps, start_error = [], [], [], [], []
    started = threading.Event()

    def start() -> None:
        try:
            for rank, prefix in enumerate(cluster.prefixes):
                worker = [sys.executable, "-m", "ddl_jax.compare.worker", coordinator, str(n),
                          str(rank)]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        [*prefix, *worker, *args],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        start_new_session=True,  # a group of its own, stopped whole below
                    )
                )
                outs.append([])
                errs.append([])
                for stream, into in ((procs[-1].stdout, outs[-1]), (procs[-1].stderr, errs[-1])):
                    pumps.append(threading.Thread(target=_drain, args=(stream, into), daemon=True))
                    pumps[-1].start()
        except BaseException as error:  # an executable missing, say: raised below
            start_error.append(error)
        finally:
            started.set()

    try:
        threading.Thread(target=start, daemon=True).start()
        started.wait()
        if start_error:
            raise start_error[0]
        failed = _first_failure(procs, time.monotonic() + timeout)
    finally:  # the others of a failed rank wait on it in a collective: stop them now
        started.wait()  # a start under way ends first, so that its process is stopped
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    if failed is None:
        raise CompareError(
            f"measure: `{' '.join(args[:1])}` outlived {timeout:.0f} s; every rank stopped."
        )
    if failed >= 0:
        code = procs[failed].returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = " | ".join("".join(errs[failed]).strip().splitlines()[-3:])
        raise CompareError(f"measure: rank {failed} of `{args[0]}` {how}: {tail}")
    lines = "".join(outs[0]).strip().splitlines()
    if not lines:
        raise CompareError(f"measure: rank 0 of `{args[0]}` printed no result.")
    return json.loads(lines[-1])
