"""XLA:CPU's gloo collectives on an emulated link: a permute against an all-reduce.

    sudo python benchmarks/gloo_permutes.py [--processes 2] [--rate 100mbit]
        [--sizes 52244,262144,1048576]

N processes, each in its own network namespace behind a ``tc`` token bucket of RATE (as
``ddl-jax compare --emulate`` makes them), time per size (bytes a device): an all-reduce,
a permute round the ring (between 2 processes: both ways between them), a permute from
process 0 to 1 alone, ``ddl.collectives.ring_allreduce`` (permutes) and that ring after an
all-reduce of the same bytes, the median of 9 calls each. Prints each one's milliseconds
and the rate its busiest device sent at (an all-reduce's device sends 2 (N - 1) / N of the
size). Between 2 processes the permute both ways took twice the one-way time (2 cores, 100
Mb/s, 256 kB: 44 ms against 22, the all-reduce 23), and so did the ring all-reduce (43.8
ms); after the all-reduce, the ring took 33 ms more (104 kB: 9 ms more, the all-reduce's
time): the transport sends an exchange's two directions in turn or at once by what
crossed the link before it. ``compare --measure`` prices such exchanges both ways at once
and in turn (``in_turn_error``).
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
            all_reduces = kind.count("all-reduce")  # each sends 2 (N - 1) / N of the size
            sent = size * 2 * (n - 1) / n * all_reduces if all_reduces else size
            cells.append(f"{seconds * 1e3:.2f} ({sent / seconds / 1e6:.1f})")
        print(f"| {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
