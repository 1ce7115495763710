"""Pipeline throughput with real concurrency: 2 processes, one CPU core each.

Two stages of an MLP (``features -> width x layers | width x layers -> 10``) live in two
processes joined by gloo (``jax.distributed`` on 127.0.0.1), each pinned to its own core
with ``taskset`` (XLA's CPU threads follow the pinning), so the stages really run at the
same time; it exits if fewer than 2 cores are available. Eight modes train the same
model on the same global batch, interleaved round by round: sequential model parallelism
(the GPipe program with one micro-batch: each stage waits for the other), GPipe and 1F1B
with M micro-batches (ticks grouped as ``ddl.pipeline`` groups them, and one operation a
tick), and DDG (its authors' forward-locked form, and with the forward pipelined).
Each process holds one stage and turns the XLA:CPU tunings on, so each
compiles its own stage's program;
GPipe also runs as the one program with a switch over the stages that a process holding
several stages runs. Prints samples/s side by side with ratios to sequential (of the medians,
and the range of the ratio within one round), and writes JSON and markdown to
benchmarks/results/.

Each process also times its stage's compute (forward; backward as the pipeline runs
it), on a micro-batch and on the whole batch, alone (the other process asleep) and with
both cores busy at once. With these costs the table gives each schedule's tick bound
(``ddl.schedules.lockstep_time``): its ticks' time if every tick (or group of ticks)
lasted as long as its slowest stage's compute and nothing else, what lock-step ticks
allow with these stages. The pipelined modes keep both cores busy, which slows each
(shared cache and memory bandwidth): their bound with both cores busy is what they can
reach here; sequential runs one stage at a time and keeps its bound alone. GPipe and
1F1B run the schedules ``ddl.pipeline`` picks by the stages' flop counts
(``make_schedule(costs=...)``).

    python benchmarks/pipeline.py [--width 1024] [--layers-per-stage 2] [--batch 512]
        [--microbatches 4] [--steps 5] [--rounds 8]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).parent))  # under python -P too
from _pinned import free_port, run_pinned

from ddl_jax.schedules import idle_fraction, lockstep_time, make_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    # Eight rounds: each of the eight modes runs first in one of them (_rounds.interleaved).
    parser.add_argument("--rounds", type=int, default=8)
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
    reports = [json.loads(line) for out in outs for line in out.splitlines() if line[:1] == "{"]
    [result] = [r for r in reports if "seconds" in r]
    costs = sorted((r for r in reports if "stage" in r), key=lambda r: r["stage"])
    times = result["seconds"]
    micro, whole = [c["micro"] for c in costs], [c["batch"] for c in costs]
    m = args.microbatches
    # The schedules ddl.pipeline runs: GPipe and 1F1B grouped by the stages' flop counts.
    plans = {
        "sequential": make_schedule(2, 1, "gpipe", costs=[c["flops"] for c in whole]),
        "gpipe": make_schedule(2, m, "gpipe", costs=[c["flops"] for c in micro]),
        "gpipe, switch over the stages": make_schedule(
            2, m, "gpipe", costs=[c["flops"] for c in micro]
        ),
        "1f1b": make_schedule(2, m, "1f1b", fold_last=True, costs=[c["flops"] for c in micro]),
        "gpipe, unit ticks": make_schedule(2, m, "gpipe"),
        "1f1b, unit ticks": make_schedule(2, m, "1f1b", fold_last=True),
        "ddg, forward pipelined": make_schedule(2, m, "ddg", tick=2),
    }

    def bound(name: str, when: str) -> float:
        per_stage = whole if name == "sequential" else micro
        costs = [(c["forward"][when], c["backward"][when]) for c in per_stage]
        if name == "ddg":  # a locked tick: stage 0's forward, then both backwards at once
            return m * (costs[0][0] + max(b for _, b in costs))
        return lockstep_time(plans[name], costs)

    bounds = {name: bound(name, "alone") for name in times}
    # Sequential runs one stage at a time: its bound stays the one with one core busy.
    busy = {name: bound(name, "busy") if name != "sequential" else bounds[name] for name in times}

    samples = args.batch * args.steps
    rows = []
    base = samples / statistics.median(times["sequential"])
    for name, seconds in times.items():
        rate = samples / statistics.median(seconds)
        per_round = [a / b for a, b in zip(times["sequential"], seconds, strict=True)]
        m = 1 if name == "sequential" else args.microbatches
        rows.append(
            {
                "mode": name,
                "microbatches": m,
                "samples_per_s": rate,
                "vs_sequential": rate / base,
                "vs_sequential_per_round": per_round,
                "ms_per_step": 1e3 * args.batch / rate,
                "tick_bound_ms": bounds[name],
                "bound_vs_sequential": bounds["sequential"] / bounds[name],
                "busy_bound_ms": busy[name],
                "busy_bound_vs_sequential": bounds["sequential"] / busy[name],
                "ticks_per_group": plans[name].group if name in plans else 1,
                # a locked DDG tick: 3 units of work (a forward, two backwards) in 2 of time
                "schedule_idle_fraction": idle_fraction(plans[name]) if name in plans else 0.25,
                "round_seconds": seconds,
            }
        )
    lines = [
        f"2 processes x 1 core (gloo), K=2 stages, MLP {args.features} -> {args.width} x "
        f"{2 * args.layers_per_stage} -> 10, global batch {args.batch}, SGD; median of "
        f"{args.rounds} rounds of {args.steps} steps",
        "",
        "| mode | M | samples/s | vs sequential | in one round, min - max | ms a step | tick "
        "bound, ms | bound vs sequential | both cores busy: bound, ms | vs sequential | "
        "ticks a group | idle fraction of the schedule |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['microbatches']} | {r['samples_per_s']:,.0f} | "
            f"{r['vs_sequential']:.2f} | {min(r['vs_sequential_per_round']):.2f} - "
            f"{max(r['vs_sequential_per_round']):.2f} | {r['ms_per_step']:.1f} | "
            f"{r['tick_bound_ms']:.1f} | "
            f"{r['bound_vs_sequential']:.2f} | {r['busy_bound_ms']:.1f} | "
            f"{r['busy_bound_vs_sequential']:.2f} | {r['ticks_per_group']} | "
            f"{r['schedule_idle_fraction']:.3f} |"
            for r in rows
        ),
        "",
        *(
            f"Stage compute {title}, ms (forward / backward as the pipeline runs it): "
            + "; ".join(
                f"stage {c['stage']}: micro-batch {c['micro']['forward'][when]:.1f} / "
                f"{c['micro']['backward'][when]:.1f}, batch {c['batch']['forward'][when]:.1f}"
                f" / {c['batch']['backward'][when]:.1f}"
                for c in costs
            )
            for title, when in (("alone", "alone"), ("with both cores busy", "busy"))
        ),
    ]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.md").write_text("\n".join(lines) + "\n")
    (args.out / "pipeline.json").write_text(
        json.dumps({"config": config, "rows": rows, "stage_costs_ms": costs}, indent=2)
    )


if __name__ == "__main__":
    main()
