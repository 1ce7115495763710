"""XLA:CPU's gloo collectives on an emulated link: permutes against an all-reduce.

    sudo python benchmarks/gloo_permutes.py [--processes 2] [--rate 100mbit]
        [--sizes 52244,262144,1048576]

N processes, each in its own network namespace behind a ``tc`` token bucket of RATE (as
``ddl-jax compare --emulate`` makes them), time per size (bytes a device): an all-reduce,
an all-gather and a reduce-scatter of that size a device, a permute round the ring
(between 2 processes: both ways between them), a permute from process 0 to 1 alone,
``ddl.collectives.ring_allreduce`` (permutes), that ring after an all-reduce of the same
bytes, the permute round the ring with process 0 entering 20 ms after the others (timed
from its entry), and the same bytes both ways between processes 0 and 1 over a plain TCP
socket (no gloo), the median of 9 calls each. Prints each one's milliseconds and the rate
its busiest device sent at (an all-reduce's device sends 2 (N - 1) / N of the size, an
all-gather's N - 1 times it, a reduce-scatter's (N - 1) / N).

Between 2 processes (2 cores, 100 Mb/s, 256 kB) the permute both ways took twice the
one-way time (44 ms against 22, the all-reduce 23), and so did the ring all-reduce and
the permute process 0 entered late; after the all-reduce, the 104 kB ring took the
all-reduce's own time more (9 ms): both ways at once. Why, from the sources: XLA:CPU's
gloo permute posts its send before its receive (openxla/xla,
``xla/backends/cpu/collectives/gloo_communicator.cc``, ``CollectivePermute``), and gloo's
TCP pair sends data only once the peer has said it is ready to receive, that notice going
out through the same queue as the data (pytorch/gloo, ``gloo/transport/tcp/pair.cc``:
``send``, ``recv``, ``handleRemotePendingRecv``). A process entering after its peer's notice
has arrived sends its whole payload at once, its own notice queued behind it, so the peer
sends only then: the two directions in turn. They go at once when the second process
enters before it has taken in the first's notice, as on leaving an all-reduce of the same
bytes together. ``compare --measure`` prices such exchanges both ways at once and in turn
(``in_turn_error``).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ddl_jax.compare import processes

sys.path.append(str(Path(__file__).parent))  # under python -P too
from _pinned import free_port

WORKER = Path(__file__).with_name("_permutes_worker.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--sizes", default="52244,262144,1048576")
    args = parser.parse_args()
    if args.processes < 2:
        raise SystemExit("--processes must be at least 2")
    sizes = [int(s) for s in args.sizes.split(",")]
    link = processes.parse_emulation(args.rate)
    with processes.emulated(args.processes, link) as cluster:
        coordinator = f"{cluster.host}:{free_port()}"
        procs = [
            subprocess.Popen([*prefix, sys.executable, "-P", str(WORKER), coordinator,
                              str(args.processes), str(rank), args.sizes],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, prefix in enumerate(cluster.prefixes)
        ]  # fmt: skip
        try:
            out, err = procs[0].communicate(timeout=600)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    if procs[0].returncode or not out.strip():
        raise SystemExit(f"rank 0 failed: {err.strip()[-2000:]}")
    results = json.loads(out.strip().splitlines()[-1])
    n = args.processes
    print(f"{cluster.description}; ms (MB/s the busiest device sent)")
    print("| bytes a device | " + " | ".join(results[str(sizes[0])]) + " |")
    print("|---" * (1 + len(results[str(sizes[0])])) + "|")
    for size in sizes:
        cells = []
        for kind, seconds in results[str(size)].items():
            sent = size * {"all-gather": n - 1, "reduce-scatter": (n - 1) / n}.get(kind, 1)
            if all_reduces := kind.count("all-reduce"):  # each sends 2 (N - 1) / N of the size
                sent = size * 2 * (n - 1) / n * all_reduces
            cells.append(f"{seconds * 1e3:.2f} ({sent / seconds / 1e6:.1f})")
        print(f"| {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
