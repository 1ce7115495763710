"""PyTorch DDP side by side with ``ddl.data_parallel``: 1 and 2 processes, one core each.

The same MLP (784-1024-1024-10), the same initial weights (drawn once with numpy and
loaded into every framework), the same synthetic batches (256 examples per process) and
plain SGD (lr 0.01) train under three programs: ``ddl.data_parallel`` (JAX's distributed
runtime with gloo CPU collectives, via ``ddl.launch.initialize``), PyTorch
``DistributedDataParallel`` (gloo), and a hand-written ``jax.shard_map`` + ``pmean`` step.
Each runs with N = 1 and N = 2 processes, each process pinned with ``taskset`` to its own
core and limited to one thread, every run under a hard timeout. Rounds are interleaved
(each round starts every configuration once, in a rotated order), so drift in the
machine's speed hits all alike. Reports the median global samples/s with the min..max
spread, ddl / DDP at N = 2, and each program's scaling efficiency
(samples/s at N = 2 / (2 x samples/s at N = 1)); writes benchmarks/results/peers.md and
peers.json. Without PyTorch (the ``bench`` extra: ``pip install -e '.[bench]'``) its rows
say "not installed".

    python benchmarks/peers.py [--rounds 7] [--steps 60] [--quick]
"""

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from _pinned import free_port, run_pinned

PROGRAMS = {
    "ddl": "ddl.data_parallel",
    "torch": "PyTorch DDP",
    "hand": "hand-written shard_map + pmean",
}


def run_once(program: str, n: int, cores: list[int], config: dict, timeout: float) -> dict:
    """Starts ``n`` worker processes of ``program``; returns process 0's report or an error."""
    port = str(free_port())
    worker = Path(__file__).parent / "_peers_worker.py"
    argvs = [[program, str(n), str(i), port, json.dumps(config)] for i in range(n)]
    try:
        outs, errors, codes = run_pinned(worker, argvs, cores, timeout)
    except TimeoutError as e:
        return {"error": str(e)}
    if any(codes):
        tail = errors[0].strip().splitlines()[-3:] or errors[-1].strip().splitlines()[-3:]
        return {"error": f"exit codes {codes}: {' | '.join(tail)}"}
    return json.loads(outs[0].strip().splitlines()[-1])


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def summary_rows(runs: dict, configs: list, batch: int, steps: int) -> list[dict]:
    """Per program and N: the median samples/s of the good rounds, their spread, losses."""
    rows = []
    for program, n in configs:
        good = [x for x in runs[program, n] if "error" not in x]
        rates = [n * batch * steps / x["seconds"] for x in good]
        rows.append(
            {
                "program": program,
                "processes": n,
                "samples_per_s": statistics.median(rates) if rates else None,
                "min": min(rates, default=None),
                "max": max(rates, default=None),
                "rounds_ok": len(good),
                "errors": [x["error"] for x in runs[program, n] if "error" in x],
                "first_loss": good[0]["first_loss"] if good else None,
                "last_loss": good[0]["last_loss"] if good else None,
                "round_samples_per_s": rates,
            }
        )
    return rows


def product_lines(dots: dict) -> list[str]:
    """The markdown table of the step's matrix products timed alone (the ``dots`` run)."""
    lines = [
        "",
        "Where one process's step time goes: each matrix product of the step alone, on one "
        "core, milliseconds:",
        "",
        "| layer | product | JAX autodiff (XLA:CPU) | ddl on one core | PyTorch | ddl / PyTorch |",
        "|---|---|---|---|---|---|",
    ]
    for d in dots.get("dots", []):
        torch_ms = d.get("torch_ms")
        share = fmt(torch_ms and d["ddl_ms"] / torch_ms, ".2f")
        lines.append(
            f"| {d['layer']} | {d['product']} | {d['jax_ms']:.2f} | {d['ddl_ms']:.2f} | "
            f"{fmt(torch_ms, '.2f')} | {share} |"
        )
    if "error" in dots:
        lines.append(f"| failed | {dots['error']} | | | | |")
    return lines


def program_line(program: str, installed: bool, by: dict, efficiency: dict) -> str:
    """One program's row of the samples/s table."""
    label = PROGRAMS[program]
    if not installed:
        return f"| {label} | not installed | not installed | not installed | - |"
    cells = []
    for n in (1, 2):
        r = by[program, n]
        cell = (
            f"{r['samples_per_s']:,.0f} ({r['min']:,.0f}..{r['max']:,.0f})"
            if r["samples_per_s"]
            else "failed"
        )
        if r["errors"]:
            cell += f" [{len(r['errors'])} failed]"
        cells.append(cell)
    losses = " / ".join(fmt(by[program, n]["first_loss"], ".5f") for n in (1, 2))
    return f"| {label} | {cells[0]} | {cells[1]} | {fmt(efficiency[program], '.2f')} | {losses} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=256, help="examples per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 10, 2
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"benchmarks/peers.py needs 2 CPU cores, one per process, but this process may "
            f"run on {len(cores)} ({cores}). Run it where 2 cores are available."
        )
    sizes = [784, 1024, 1024, 10]
    torch_installed = importlib.util.find_spec("torch") is not None
    programs = [p for p in PROGRAMS if p != "torch" or torch_installed]
    configs = [(p, n) for n in (1, 2) for p in programs]

    with tempfile.TemporaryDirectory() as tmp:
        # Initial weights: He-normal kernels (in, out) and zero biases, from one seed.
        rng = np.random.default_rng(0)
        weights = {}
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            weights[f"w{i}"] = (rng.normal(size=(a, b)) * np.sqrt(2 / a)).astype(np.float32)
            weights[f"b{i}"] = np.zeros(b, np.float32)
        np.savez(Path(tmp) / "weights.npz", **weights)
        config = {
            "weights": str(Path(tmp) / "weights.npz"),
            "sizes": sizes,
            "batch": args.batch,
            "batches": 4,
            "seed": 1,
            "lr": args.lr,
            "warmup": args.warmup,
            "steps": args.steps,
        }
        runs = {c: [] for c in configs}
        for r in range(args.rounds):
            shift = r % len(configs)
            for program, n in configs[shift:] + configs[:shift]:
                result = run_once(program, n, cores, config, args.timeout)
                runs[program, n].append(result)
                if "error" in result:
                    note = result["error"]
                else:
                    rate = n * args.batch * args.steps / result["seconds"]
                    note = f"{rate:,.0f} samples/s, loss {result['last_loss']:.4f}"
                print(f"round {r + 1}/{args.rounds}  {program:5s} N={n}: {note}", flush=True)
        dots = run_once("dots", 1, cores, config, args.timeout)

    rows = summary_rows(runs, configs, args.batch, args.steps)
    by = {(r["program"], r["processes"]): r for r in rows}
    efficiency = {}
    for program in programs:
        one, two = by[program, 1]["samples_per_s"], by[program, 2]["samples_per_s"]
        efficiency[program] = two / (2 * one) if one and two else None

    def ratio(n: int) -> float | None:
        if not torch_installed:
            return None
        a, b = by["ddl", n]["samples_per_s"], by["torch", n]["samples_per_s"]
        return a / b if a and b else None

    lines = [
        f"MLP {'-'.join(map(str, sizes))}, {args.batch} examples per process, SGD "
        f"{args.lr}, same initial weights and batches; N processes x 1 core x 1 thread "
        f"(gloo); median (min..max) of {args.rounds} interleaved rounds of {args.steps} "
        f"timed steps after {args.warmup} warm-up steps",
        "",
        "| program | N=1 samples/s | N=2 samples/s | scaling efficiency | loss of the first "
        "step (N=1 / N=2) |",
        "|---|---|---|---|---|",
    ]
    lines += [program_line(p, p in programs, by, efficiency) for p in PROGRAMS]
    lines += [
        "",
        f"ddl / PyTorch DDP samples/s: N=1 **{fmt(ratio(1), '.2f')}**, "
        f"N=2 **{fmt(ratio(2), '.2f')}**"
        + ("" if torch_installed else " (PyTorch not installed: pip install -e '.[bench]')"),
        "",
        "scaling efficiency = samples/s at N=2 / (2 x samples/s at N=1)",
    ]
    finals = {
        n: [by[p, n]["last_loss"] for p in programs if by[p, n]["last_loss"] is not None]
        for n in (1, 2)
    }
    agree = all(max(v) - min(v) <= 1e-3 for v in finals.values() if v)
    lines.append(
        "losses after the last timed step agree across programs (within 1e-3): "
        f"{agree} (N=1: {', '.join(f'{x:.5f}' for x in finals[1])}; "
        f"N=2: {', '.join(f'{x:.5f}' for x in finals[2])})"
    )
    lines += product_lines(dots)
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.md").write_text(text + "\n")
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"sizes": sizes},
        "cores": cores,
        "torch_installed": torch_installed,
        "rows": rows,
        "scaling_efficiency": efficiency,
        "losses_agree": agree,
        "ddl_over_torch": {"1": ratio(1), "2": ratio(2)},
        "matrix_products_ms": dots.get("dots"),
    }
    (args.out / "peers.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
