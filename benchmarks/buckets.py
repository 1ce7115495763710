"""Gradient buckets on a CPU cluster: 2 processes, one core each, gloo.

XLA:CPU's gloo collectives make one call per buffer, however XLA combines them. With the
XLA:CPU tunings on and more than one process, ``ddl.allreduce_mean(bucket_mb="auto")``
packs a step's gradient leaves in flat 25 MiB buckets; this measures what that buys on a
model of many small leaves, the byte-level GPT of ``ddl-jax compare`` (2 layers, 64
wide, 36 parameter leaves; Adam 3e-3): ``ddl.data_parallel`` leaf by leaf
(``bucket_mb=None``) and in buckets (``bucket_mb=25``), interleaved round by round in
the same two processes. (``benchmarks/peers.py`` measures it on an MLP of 6 leaves
against PyTorch DDP.) Prints milliseconds per step (median and spread), the ratio, and
the buffers the collectives of one step carry (from the compiled HLO); writes
benchmarks/results/buckets.{md,json}.

    python benchmarks/buckets.py [--windows 16] [--steps 20] [--rounds 7]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).parent))  # under python -P too
from _pinned import free_port, run_pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=16, help="global batch, 64 bytes each")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.windows % 16:
        raise SystemExit(f"--windows must be a multiple of 16 (8 per process), got {args.windows}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"benchmarks/buckets.py needs 2 CPU cores, one per process, but this process may "
            f"run on {len(cores)} ({cores}). Run it where 2 cores are available."
        )
    config = {"windows": args.windows, "steps": args.steps, "rounds": args.rounds}
    worker = Path(__file__).parent / "_buckets_worker.py"
    port = str(free_port())
    outs, errors, codes = run_pinned(
        worker, [[str(i), port, json.dumps(config)] for i in range(2)], cores, timeout=900
    )
    if any(codes):
        raise SystemExit(f"worker exit codes {codes}:\n{errors[0]}{errors[1]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    ms = {
        name: [1e3 * s / args.steps for s in rounds] for name, rounds in result["seconds"].items()
    }
    lines = [
        f"2 processes x 1 core (gloo), byte-level GPT, global batch {args.windows} windows of "
        f"64; median of {args.rounds} rounds of {args.steps} steps",
        "",
        "| program | buffers per step | ms per step (min..max) | per leaf / buckets |",
        "|---|---|---|---|",
    ]
    for name, rounds in ms.items():
        program, packing = name.rsplit(", ", 1)
        ratio = statistics.median(ms[f"{program}, per leaf"]) / statistics.median(rounds)
        lines.append(
            f"| {name} | {result['buffers'][name]} | {statistics.median(rounds):.2f} "
            f"({min(rounds):.2f}..{max(rounds):.2f}) | "
            + (f"{ratio:.2f} |" if packing == "buckets" else "|")
        )
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "buckets.md").write_text("\n".join(lines) + "\n")
    (args.out / "buckets.json").write_text(
        json.dumps({"config": config, "ms_per_step": ms, "buffers": result["buffers"]}, indent=2)
    )


if __name__ == "__main__":
    main()
