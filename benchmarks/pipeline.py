"""Pipeline throughput with real concurrency: 2 processes, one CPU core each.

Two stages of an MLP (``features -> width x layers | width x layers -> 10``) live in two
processes joined by gloo (``jax.distributed`` on 127.0.0.1), each pinned to its own core
with ``taskset`` (XLA's CPU threads follow the pinning), so the stages really run at the
same time; it exits if fewer than 2 cores are available. Four modes train the same model
on the same global batch, interleaved round by round: sequential model parallelism (the
GPipe program with one micro-batch: each stage waits for the other), GPipe and 1F1B with
M micro-batches, and DDG. Prints samples/s side by side with ratios to sequential, and
writes JSON and markdown to benchmarks/results/.

    python benchmarks/pipeline.py [--width 1024] [--layers-per-stage 2] [--batch 512]
        [--microbatches 4] [--steps 5] [--rounds 5]
"""

import argparse
import json
import os
import statistics
from pathlib import Path

from _pinned import free_port, run_pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["layers_per_stage"] = config.pop("layers_per_stage")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"benchmarks/pipeline.py needs 2 CPU cores, one per stage process, but this process "
            f"may run on {len(cores)} ({cores}): both stages would share one core and the "
            "numbers would not measure pipelining. Run it where 2 cores are available."
        )
    port = str(free_port())
    worker = Path(__file__).parent / "_pipeline_worker.py"
    argvs = [[str(i), port, json.dumps(config)] for i in range(2)]
    outs, errors, codes = run_pinned(worker, argvs, cores, timeout=900)
    if any(codes):
        raise SystemExit(f"worker exit codes {codes}:\n{errors[0]}{errors[1]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    times, idle = result["seconds"], result["idle_fraction"]

    samples = args.batch * args.steps
    rows = []
    base = samples / statistics.median(times["sequential"])
    for name, seconds in times.items():
        rate = samples / statistics.median(seconds)
        m = 1 if name == "sequential" else args.microbatches
        rows.append(
            {
                "mode": name,
                "microbatches": m,
                "samples_per_s": rate,
                "vs_sequential": rate / base,
                "schedule_idle_fraction": idle[name],
                "round_seconds": seconds,
            }
        )
    lines = [
        f"2 processes x 1 core (gloo), K=2 stages, MLP {args.features} -> {args.width} x "
        f"{2 * args.layers_per_stage} -> 10, global batch {args.batch}, SGD; median of "
        f"{args.rounds} rounds of {args.steps} steps",
        "",
        "| mode | M | samples/s | vs sequential | idle fraction of the schedule |",
        "|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['microbatches']} | {r['samples_per_s']:,.0f} | "
            f"{r['vs_sequential']:.2f} | {r['schedule_idle_fraction']:.3f} |"
            for r in rows
        ),
    ]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.md").write_text("\n".join(lines) + "\n")
    (args.out / "pipeline.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
