"""Worker processes pinned one per core, one thread each, or free to share the machine's
cores, under a hard timeout (the multi-process benchmarks: peers.py, pipeline.py,
buckets.py)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# One thread per process: taskset pins each process to one core (XLA's CPU thread pools
# follow the affinity), --xla_cpu_multi_thread_eigen=false keeps Eigen's kernels on the
# calling thread, and the OpenMP / MKL variables (with torch.set_num_threads(1) in a
# PyTorch worker) do the same for PyTorch. XLA has no thread-count flag
# (intra_op_parallelism_threads is TensorFlow's and XLA_FLAGS rejects it).
# XLA_FLAGS set by the caller are passed on after it (e.g. a library flag to compare).
ONE_THREAD_ENV = {
    "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false {os.environ.get('XLA_FLAGS', '')}".strip(),
    "JAX_PLATFORMS": "cpu",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pinned(
    worker: Path,
    argvs: list[list[str]],
    cores: list[int] | None,
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[list[str], list[str], list[int]]:
    """Runs ``worker`` once per argument list, process i on ``cores[i]`` with one thread
    (``cores=None``: every process free to use every core, with JAX's default threads);
    returns their stdouts, stderrs and exit codes. ``env`` is added to each process's
    environment. Raises ``TimeoutError`` (all killed) past ``timeout``."""
    threads = ONE_THREAD_ENV if cores else {"JAX_PLATFORMS": "cpu"}
    base = {**os.environ, **threads, **(env or {})}

    def pin(i: int) -> list[str]:
        return ["taskset", "-c", str(cores[i])] if cores else []

    procs = [
        subprocess.Popen(
            # -P keeps benchmarks/ off sys.path: its scripts' names may shadow modules.
            [*pin(i), sys.executable, "-P", str(worker), *argv],
            env=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, argv in enumerate(argvs)
    ]
    deadline = time.monotonic() + timeout
    outs, errors = [], []
    # SIGTERM raises here, so the finally below stops the workers (they outlived it, on
    # their pinned cores, and shared them with whatever ran next)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"timed out after {timeout:.0f} s") from None
            outs.append(out)
            errors.append(err)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.communicate()
    return outs, errors, [p.returncode for p in procs]
