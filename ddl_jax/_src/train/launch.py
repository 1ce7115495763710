"""Joining JAX's distributed runtime, and feeding each process only its rows of a batch."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NoReturn

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.strategy import Batch, check_int, check_mesh_axis
from ddl_jax._src.data import datasets as data_lib
from ddl_jax._src.xla_cpu import gloo_threads, tunings

#: Environment variables ``ddl-jax launch`` sets in every process it starts.
ENV_COORDINATOR = "DDL_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "DDL_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "DDL_JAX_PROCESS_ID"
ENV_HEARTBEAT = "DDL_JAX_HEARTBEAT_TIMEOUT"
ENV_ATTEMPT = "DDL_JAX_ATTEMPT"
#: A folder where each rank that joins leaves ``rank-<id>`` (``ddl-jax launch`` checks it).
ENV_JOINED = "DDL_JAX_JOINED_DIR"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: int = 120,
    xla_cpu_tunings: bool | None = None,
) -> bool:
    """Joins this process to JAX's distributed runtime; call it first in a training script.

    Where the cluster comes from, first match wins:

    1. the arguments, when ``coordinator_address`` is given;
    2. the variables ``ddl-jax launch`` sets (``DDL_JAX_COORDINATOR``, ...);
    3. JAX's own detection (``jax.distributed.initialize()``): Cloud TPU pods, SLURM,
       Open MPI, Kubernetes;
    4. none of these: a single process, and nothing is done.

    With more than one process, CPU collectives go over gloo (JAX's default CPU client
    has none across processes). ``heartbeat_timeout_seconds`` bounds how long a survivor
    waits for a dead peer before the runtime aborts it.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: number of processes, >= 1 (with ``coordinator_address``).
      process_id: this process's rank in ``[0, num_processes)``.
      local_device_count: CPU devices this process exposes (``jax_num_cpu_devices``);
        ``None`` keeps the default (one, or ``--devices-per-process`` of the launcher).
      heartbeat_timeout_seconds: seconds without a heartbeat before a peer counts as
        dead; default 10 under ``ddl-jax launch``, else JAX's default (100).
      initialization_timeout: seconds to wait for every process to join (and for the
        coordinator to answer) before giving up.
      xla_cpu_tunings: turns on (``True``) or off (``False``) the tunings for a CPU
        cluster of one process per pinned core (``DDL_JAX_XLA_CPU_TUNINGS``; ``None``:
        leave that variable to decide, off when unset): weight gradients from explicit
        transposes in a process on one core, gradients packed into 25 MiB buckets before
        gloo's all-reduce, gloo's transport threads at ``SCHED_IDLE``, one program per
        pipeline stage (``docs/design.md``). They help that setting and slow processes
        that share cores (``benchmarks/peers.py``); off, results do not depend on the
        process's CPU affinity.

    Returns:
      Whether the distributed runtime was initialised (false: single process).

    Raises:
      ValueError: a process count, id or address that cannot be right, or only some of
        the launcher's variables set.
      RuntimeError: the coordinator could not be reached within ``initialization_timeout``.

    A count that is possible but wrong (``num_processes=4`` with 3 processes started, or
    two processes given one id) is only found by JAX's own rendezvous: after
    ``initialization_timeout`` seconds JAX aborts every waiting process with
    ``DEADLINE_EXCEEDED`` (no Python exception). ``ddl-jax launch`` always passes a
    consistent count and ids.
    """
    if xla_cpu_tunings is not None:
        if not isinstance(xla_cpu_tunings, bool):
            raise TypeError(
                f"initialize: xla_cpu_tunings must be True, False or None, got {xla_cpu_tunings!r}."
            )
        tunings.set_enabled(xla_cpu_tunings)
    explicit = coordinator_address is not None
    if not explicit and (num_processes is not None or process_id is not None):
        raise ValueError(
            "initialize: num_processes and process_id need coordinator_address too "
            f"(got num_processes={num_processes!r}, process_id={process_id!r}, "
            "coordinator_address=None); pass all three, or none to auto-detect."
        )
    required = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    launched = not explicit and any(name in os.environ for name in required)
    if launched:
        missing = [name for name in required if name not in os.environ]
        if missing:
            raise ValueError(
                f"initialize: {', '.join(missing)} not set, but "
                f"{', '.join(n for n in required if n not in missing)} set; ddl-jax launch "
                "sets all of them: set every one, or none to auto-detect the cluster."
            )
        coordinator_address = os.environ[ENV_COORDINATOR]
        num_processes = _env_int(ENV_NUM_PROCESSES)
        process_id = _env_int(ENV_PROCESS_ID)
        if heartbeat_timeout_seconds is None:
            heartbeat_timeout_seconds = _env_int(ENV_HEARTBEAT) or 10
    if explicit or launched:
        num_processes, process_id = _check_cluster(coordinator_address, num_processes, process_id)
    if launched and os.environ.get(ENV_JOINED):
        with contextlib.suppress(OSError):  # the launcher's note; never fatal
            open(os.path.join(os.environ[ENV_JOINED], f"rank-{process_id}"), "w").close()
    if local_device_count is not None:
        local_device_count = check_int("local_device_count", local_device_count, minimum=1)
        jax.config.update("jax_num_cpu_devices", local_device_count)
    initialization_timeout = check_int("initialization_timeout", initialization_timeout, minimum=1)
    kwargs: dict[str, Any] = {
        "initialization_timeout": initialization_timeout,
        "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S,
    }
    if heartbeat_timeout_seconds is not None:
        kwargs["heartbeat_timeout_seconds"] = check_int(
            "heartbeat_timeout_seconds", heartbeat_timeout_seconds, minimum=1
        )
    if (explicit or launched) and num_processes == 1:
        return False
    if (explicit or launched) and process_id != 0:
        # JAX aborts the whole process (no Python exception) when the coordinator never
        # answers; probing it first turns that into an error the caller can read.
        _wait_for_coordinator(
            coordinator_address, initialization_timeout, process_id, num_processes
        )
    elif explicit or launched:
        _check_port_free(coordinator_address)
    # Harmless off CPU: it only configures the CPU client's cross-process collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    except ValueError as e:
        # JAX found no cluster in the environment: a plain single-process run.
        if not (explicit or launched) and "coordinator_address" in str(e):
            return False
        raise
    if tunings.cluster():
        gloo_threads.start_idling()
    _end_failures_at_once()
    return True


def _end_failures_at_once() -> None:
    """Makes a failure end this process at once: an uncaught exception once it is printed
    (exit code 1, 130 for Ctrl-C), and ``sys.exit(code)`` with a failure code once the exit
    handlers registered after this call have run (that code).

    Python's exit would run JAX's shutdown, whose barrier waits for every process, up to
    300 s; a peer waiting in a collective for this one never gets there. Ended at once,
    the process is seen dead: ``ddl-jax launch`` names it and stops the others, and
    without the launcher the peers' collectives fail. ``finally`` blocks have run by then
    (``fit`` has finished its last checkpoint save). A successful exit (``sys.exit()``,
    ``sys.exit(0)``, the script's end) still waits at the barrier for the others, as JAX
    needs. ``sys.exit`` in the main thread is what is seen: Python tells its exit handlers
    no exit code, so ``sys.exit`` is wrapped to note it (a ``SystemExit`` raised by hand, or
    one caught and the script run on, is not told apart from what it was noted as).
    """
    previous_hook = sys.excepthook
    previous_exit = sys.exit
    failure: list[int] = []  # the code of the last sys.exit in the main thread, if a failure

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous_hook(kind, value, tb)
        _end(130 if issubclass(kind, KeyboardInterrupt) else 1)

    def exit_noting_failure(status: object = None) -> NoReturn:
        if threading.current_thread() is threading.main_thread():
            failure[:] = [code] if (code := _exit_code(status)) else []
        previous_exit(status)

    def at_exit() -> None:
        if failure:
            _end(failure[0])
        _note_the_wait_at_shutdown(*SHUTDOWN_NOTES_S)

    sys.excepthook = hook
    sys.exit = exit_noting_failure
    atexit.register(at_exit)  # runs before JAX's shutdown, registered earlier


#: Seconds a finished process waits at JAX's shutdown barrier before it says so, then
#: between its notes.
SHUTDOWN_NOTES_S = (30.0, 60.0)
#: JAX's shutdown barrier gives up after this many seconds (JAX's default).
SHUTDOWN_TIMEOUT_S = 300


def _note_the_wait_at_shutdown(first: float, every: float) -> None:
    """Says on stderr, after ``first`` seconds and then every ``every``, that this finished
    process still waits at JAX's shutdown barrier for the others: a wait that can look
    like a hang, and is one when a peer waits in a collective for this process (a process
    that ran fewer steps than the others), until JAX gives up at its shutdown timeout."""

    def note() -> None:
        waited = first
        time.sleep(first)
        while True:
            print(
                f"launch: this process finished and has waited {waited:g} s at JAX's "
                "shutdown barrier for the other processes (JAX gives up after "
                f"{SHUTDOWN_TIMEOUT_S} s); one that waits in a collective for this process "
                "never comes: every process must run the same steps.",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(every)
            waited += every

    threading.Thread(target=note, name="ddl-jax-shutdown-note", daemon=True).start()


def _exit_code(status: object) -> int:
    """The exit status Python gives ``sys.exit(status)``: 0 for ``None``, an integer as
    it is, 1 for anything else (a message, printed)."""
    if status is None:
        return 0
    return int(status) if isinstance(status, int) else 1


def _end(code: int) -> NoReturn:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def idle_gloo_threads() -> None:
    """Lowers this process's gloo TCP transport threads to ``SCHED_IDLE`` (Linux), those
    running now and those XLA starts later (one per group of devices a collective first
    runs over), so that they run only when the process's step waits.

    One of the XLA:CPU tunings (``xla_cpu_tunings``), on its own. A loop thread spins while
    a peer's message waits to be received; where processes share a host's cores it takes a
    core from a step, its own process's or another's: 2 processes of
    ``benchmarks/peers.py`` ran 2.16x faster pinned one a core and 1.56x free to share
    them (``docs/figures.md``), with the same results. Off by default, as the tunings are:
    a thread at ``SCHED_IDLE`` runs only on a core nothing else wants, and would starve on
    a host whose cores other work keeps busy. ``ddl-jax compare --measure`` runs its
    processes so: they stand for hosts of their own. A no-op off Linux and in a process
    without gloo.
    """
    gloo_threads.start_idling()


def _wait_for_coordinator(address: str, timeout: int, process_id: int, count: int) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"initialize: process {process_id} of {count} could not reach the "
                    f"coordinator at {address} within {timeout} s ({e}); check that process 0 "
                    "is running and that the address and port are reachable from this host."
                ) from e
            time.sleep(0.2)


def _check_port_free(address: str) -> None:
    """Process 0 runs the coordination service on ``address``'s port: raises where
    something else holds it (JAX's own error names no port, and the other processes would
    wait on what answers there until ``initialization_timeout``)."""
    port = int(address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the service binds
        try:
            probe.bind(("", port))
        except OSError as e:
            raise RuntimeError(
                f"initialize: port {port} of the coordinator address {address} is in use on "
                f"this host ({e.strerror}); process 0 runs the coordination service there: "
                "give another port, or stop what holds it."
            ) from None


def _check_cluster(address: Any, num_processes: Any, process_id: Any) -> tuple[int, int]:
    """Checks the cluster's description; returns ``(num_processes, process_id)`` as ints."""
    host, sep, port = str(address).rpartition(":")
    if not isinstance(address, str) or not sep or not host or not port.isdigit():
        raise ValueError(f"initialize: coordinator_address must be 'host:port', got {address!r}.")
    num_processes = check_int("num_processes", num_processes, minimum=1)
    name = f"process_id (a rank of num_processes={num_processes})"
    return num_processes, check_int(name, process_id, minimum=0, maximum=num_processes - 1)


def process_rows(mesh: Mesh, batch_size: int, axis: str = "data") -> slice:
    """The rows of a global batch whose shards live on this process's devices.

    Args:
      mesh: the strategy's mesh; the batch is sharded ``P(axis)`` over it.
      batch_size: global batch size; must divide by the size of ``axis``.
      axis: the data axis.

    Returns:
      A contiguous ``slice`` of ``range(batch_size)``.

    Raises:
      ValueError: ``batch_size`` does not divide, the mesh has no device of this process,
        or this process's rows are not contiguous (a mesh whose data axis interleaves
        processes).
    """
    n = check_mesh_axis(mesh, axis)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if batch_size % n:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by the {n} workers on axis {axis!r}."
        )
    if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
        raise ValueError(
            f"mesh {mesh} has no device of process {jax.process_index()}, so this process "
            "holds no rows of the batch; build the mesh from every process's devices "
            "(ddl.make_mesh does)."
        )
    indices = NamedSharding(mesh, P(axis)).addressable_devices_indices_map((batch_size,))
    starts = sorted({(idx[0].start or 0, idx[0].stop or batch_size) for idx in indices.values()})
    for (_, stop), (start, _) in itertools.pairwise(starts):
        if stop != start:
            raise ValueError(
                f"this process's rows of the batch are not contiguous on mesh {mesh}: "
                f"{starts}; order the mesh's devices by process (ddl.make_mesh does)."
            )
    return slice(starts[0][0], starts[-1][1])


def global_batch(local: Batch, mesh: Mesh, batch_size: int, axis: str = "data") -> Batch:
    """Assembles each process's rows (``process_rows``) into one global batch ``P(axis)``.

    Args:
      local: pytree of this process's rows, leaves ``[rows, ...]``.
      mesh: the strategy's mesh.
      batch_size: the global batch size.
      axis: the data axis.

    Returns:
      The global batch as ``jax.Array`` leaves ``[batch_size, ...]`` sharded ``P(axis)``,
      ready for ``Strategy.step``; no process holds the other processes' rows.
    """
    sharding = NamedSharding(mesh, P(axis))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (batch_size, *np.shape(x)[1:])
        ),
        local,
    )


def same_on_every_process(where: str, **values: int | bool | str | None) -> None:
    """Raises ``ValueError`` naming each of ``values`` that differs between processes (a
    collective of a few bytes; nothing with one process): every process of a run must
    train the same steps on the same batches, log, evaluate and save at the same steps,
    and one that does not would wait forever in a collective (or a checkpoint's barrier),
    or train on a batch of another shape. A text is compared by a checksum."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(values)
    codes = np.asarray([_code(values[n]) for n in names], np.int32)
    every = np.asarray(multihost_utils.process_allgather(codes))

    def shown(name: str, column: np.ndarray) -> str:
        if isinstance(values[name], str):
            return "a text, compared by checksum"
        return ", ".join(f"process {p}: {'None' if v == -1 else v}" for p, v in enumerate(column))

    differ = [
        f"{name} ({shown(name, every[:, i])})"
        for i, name in enumerate(names)
        if len(set(every[:, i].tolist())) > 1
    ]
    if differ:
        raise ValueError(
            f"{where}: {'; '.join(differ)} differ between processes; give every process "
            "the same arguments."
        )


def _code(value: int | bool | str | None) -> int:
    """A setting as one int32 to compare across processes: -1 for ``None``, a checksum of a
    text."""
    if value is None:
        return -1
    if isinstance(value, str):
        return zlib.crc32(value.encode()) % 2**31
    return int(value)


def process_batches(
    data: data_lib.Dataset,
    batch_size: int,
    mesh: Mesh,
    *,
    seed: int = 0,
    start: int = 0,
    axis: str = "data",
) -> Iterator[Batch]:
    """``ddl.data.batches`` as global batches, each process reading only its own rows.

    Every process draws the same shuffled order (from ``seed``) and gathers only
    ``process_rows`` of each batch, so the global batch of step ``s`` is the same on any
    number of processes, and ``start=s`` resumes exactly where an uninterrupted run
    would be.

    Args:
      data: dict of arrays sharing a leading example axis (e.g. ``ddl.data.digits()[0]``).
      batch_size: global batch size.
      mesh: the strategy's mesh.
      seed: seed of the shuffling.
      start: index of the first batch (the number of steps already trained).
      axis: the data axis.

    Raises:
      ValueError: ``batch_size`` or ``seed`` differs between processes.
    """
    same_on_every_process("process_batches", batch_size=batch_size, seed=seed)
    rows = process_rows(mesh, batch_size, axis)
    local = data_lib.batches(data, batch_size, seed=seed, start=start, rows=rows)
    return (global_batch(b, mesh, batch_size, axis) for b in local)
