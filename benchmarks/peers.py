"""PyTorch DDP side by side with ``ddl.data_parallel``, with and without the XLA:CPU
tunings, in the two settings users run: one pinned core per process, and processes free
to share the machine's cores.

The same MLP (784-1024-1024-10), the same initial weights (drawn once with numpy and
loaded into every framework), the same synthetic batches (256 examples per process) and
plain SGD (lr 0.01) train under five programs: ``ddl.data_parallel`` as a user gets it
(JAX's distributed runtime with gloo CPU collectives, via ``ddl.launch.initialize``), the
same with the XLA:CPU tunings on (``DDL_JAX_XLA_CPU_TUNINGS=1``), the same with one of
them alone, gloo's transport threads idled (``ddl.launch.idle_gloo_threads``), PyTorch
``DistributedDataParallel`` (gloo), and a hand-written ``jax.shard_map`` + ``pmean`` step
(leaf by leaf). Each runs with N = 1 and N = 2 processes in each setting: *pinned*, each
process on its own core with ``taskset`` and one thread; *free*, no ``taskset`` and JAX's
default threads (PyTorch keeps one thread per process, as ``torchrun`` sets it). Every run
is under a hard timeout. Rounds are interleaved (each round starts every configuration
once, in a rotated order), so drift in the machine's speed hits all alike. Reports the
median global samples/s with the min..max spread, ratios to PyTorch DDP and to the
hand-written step, and each program's scaling efficiency (samples/s at N = 2 / (2 x
samples/s at N = 1)); writes benchmarks/results/peers.md and peers.json. Without PyTorch
(the ``bench`` extra: ``pip install -e '.[bench]'``) its rows say "not installed".

    python benchmarks/peers.py [--rounds 7] [--steps 60] [--settings pinned,free] [--quick]
"""

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).parent))  # under python -P too
from _pinned import free_port, run_pinned

PROGRAMS = {
    "ddl": "ddl.data_parallel (default)",
    "ddl-tuned": "ddl.data_parallel, XLA:CPU tunings on",
    "ddl-idle": "ddl.data_parallel, gloo threads idled (only)",
    "torch": "PyTorch DDP",
    "hand": "hand-written shard_map + pmean",
}
SETTINGS = {
    "pinned": "one pinned core and one thread per process",
    "free": "processes free to share the cores, JAX's default threads",
}


def run_once(
    program: str, n: int, setting: str, cores: list[int], config: dict, timeout: float
) -> dict:
    """Starts ``n`` worker processes of ``program`` in ``setting``; returns process 0's
    report or an error."""
    port = str(free_port())
    worker = Path(__file__).parent / "_peers_worker.py"
    framework = "ddl" if program.startswith("ddl") else program
    argvs = [[framework, str(n), str(i), port, json.dumps(config)] for i in range(n)]
    env = {
        "DDL_JAX_XLA_CPU_TUNINGS": "1" if program == "ddl-tuned" else "0",
        "PEERS_IDLE_GLOO_THREADS": "1" if program == "ddl-idle" else "0",
    }
    try:
        outs, errors, codes = run_pinned(
            worker, argvs, cores if setting == "pinned" else None, timeout, env
        )
    except TimeoutError as e:
        return {"error": str(e)}
    if any(codes):
        tail = errors[0].strip().splitlines()[-3:] or errors[-1].strip().splitlines()[-3:]
        return {"error": f"exit codes {codes}: {' | '.join(tail)}"}
    return json.loads(outs[0].strip().splitlines()[-1])


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def summary_rows(runs: dict, configs: list, batch: int, steps: int) -> list[dict]:
    """Per setting, program and N: the median samples/s of the good rounds, their spread,
    losses."""
    rows = []
    for setting, program, n in configs:
        good = [x for x in runs[setting, program, n] if "error" not in x]
        rates = [n * batch * steps / x["seconds"] for x in good]
        rows.append(
            {
                "setting": setting,
                "program": program,
                "processes": n,
                "samples_per_s": statistics.median(rates) if rates else None,
                "min": min(rates, default=None),
                "max": max(rates, default=None),
                "rounds_ok": len(good),
                "errors": [x["error"] for x in runs[setting, program, n] if "error" in x],
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


def program_line(program: str, installed: bool, rows: dict, efficiency: float | None) -> str:
    """One program's row of a setting's samples/s table (``rows``: by N)."""
    label = PROGRAMS[program]
    if not installed:
        return f"| {label} | not installed | not installed | not installed | - |"
    cells = []
    for n in (1, 2):
        r = rows[n]
        cell = (
            f"{r['samples_per_s']:,.0f} ({r['min']:,.0f}..{r['max']:,.0f})"
            if r["samples_per_s"]
            else "failed"
        )
        if r["errors"]:
            cell += f" [{len(r['errors'])} failed]"
        cells.append(cell)
    losses = " / ".join(fmt(rows[n]["first_loss"], ".5f") for n in (1, 2))
    return f"| {label} | {cells[0]} | {cells[1]} | {fmt(efficiency, '.2f')} | {losses} |"


def ratio(by: dict, setting: str, a: str, b: str, n: int) -> float | None:
    """Median samples/s of program ``a`` over program ``b``'s, in one setting at N = n."""
    x, y = by.get((setting, a, n)), by.get((setting, b, n))
    if not x or not y or not x["samples_per_s"] or not y["samples_per_s"]:
        return None
    return x["samples_per_s"] / y["samples_per_s"]


def setting_lines(setting: str, programs: list[str], by: dict, efficiency: dict) -> list[str]:
    """A setting's table and its ratios."""
    lines = [
        f"### {setting}: {SETTINGS[setting]}",
        "",
        "| program | N=1 samples/s | N=2 samples/s | scaling efficiency | loss of the first "
        "step (N=1 / N=2) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        program_line(
            p,
            p in programs,
            {n: by.get((setting, p, n)) for n in (1, 2)},
            efficiency.get((setting, p)),
        )
        for p in PROGRAMS
    ]
    lines.append("")
    for n in (1, 2):
        parts = [
            f"ddl / PyTorch DDP **{fmt(ratio(by, setting, 'ddl', 'torch', n), '.2f')}**",
            f"ddl with the tunings / PyTorch DDP "
            f"{fmt(ratio(by, setting, 'ddl-tuned', 'torch', n), '.2f')}",
            f"ddl / hand-written pmean {fmt(ratio(by, setting, 'ddl', 'hand', n), '.2f')}",
            f"ddl with the tunings / ddl {fmt(ratio(by, setting, 'ddl-tuned', 'ddl', n), '.2f')}",
            f"ddl with idled gloo threads / ddl "
            f"{fmt(ratio(by, setting, 'ddl-idle', 'ddl', n), '.2f')}",
        ]
        lines.append(f"N={n}: " + "; ".join(parts) + "  ")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=256, help="examples per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument(
        "--settings", default="pinned,free", help="comma-separated: pinned, free (default both)"
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 10, 2
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings):
        raise SystemExit(f"--settings must name some of {list(SETTINGS)}, got {args.settings!r}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"benchmarks/peers.py needs 2 CPU cores, one per process, but this process may "
            f"run on {len(cores)} ({cores}). Run it where 2 cores are available."
        )
    sizes = [784, 1024, 1024, 10]
    torch_installed = importlib.util.find_spec("torch") is not None
    programs = [p for p in PROGRAMS if p != "torch" or torch_installed]
    configs = [(s, p, n) for s in settings for n in (1, 2) for p in programs]

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
            for setting, program, n in configs[shift:] + configs[:shift]:
                result = run_once(program, n, setting, cores, config, args.timeout)
                runs[setting, program, n].append(result)
                if "error" in result:
                    note = result["error"]
                else:
                    rate = n * args.batch * args.steps / result["seconds"]
                    note = f"{rate:,.0f} samples/s, loss {result['last_loss']:.4f}"
                print(
                    f"round {r + 1}/{args.rounds}  {setting:6s} {program:9s} N={n}: {note}",
                    flush=True,
                )
        dots = run_once("dots", 1, "pinned", cores, config, args.timeout)

    rows = summary_rows(runs, configs, args.batch, args.steps)
    by = {(r["setting"], r["program"], r["processes"]): r for r in rows}
    efficiency = {}
    for setting in settings:
        for program in programs:
            one = by[setting, program, 1]["samples_per_s"]
            two = by[setting, program, 2]["samples_per_s"]
            efficiency[setting, program] = two / (2 * one) if one and two else None

    lines = [
        f"MLP {'-'.join(map(str, sizes))}, {args.batch} examples per process, SGD "
        f"{args.lr}, same initial weights and batches; N processes over gloo; median "
        f"(min..max) of {args.rounds} interleaved rounds of {args.steps} timed steps after "
        f"{args.warmup} warm-up steps"
        + ("" if torch_installed else " (PyTorch not installed: pip install -e '.[bench]')"),
        "",
    ]
    for setting in settings:
        lines += setting_lines(setting, programs, by, efficiency)
    lines.append("scaling efficiency = samples/s at N=2 / (2 x samples/s at N=1)")
    finals = {
        n: [r["last_loss"] for r in rows if r["processes"] == n and r["last_loss"] is not None]
        for n in (1, 2)
    }
    agree = all(max(v) - min(v) <= 1e-3 for v in finals.values() if v)
    lines.append(
        "losses after the last timed step agree across programs and settings (within 1e-3): "
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
        "scaling_efficiency": {f"{s} {p}": e for (s, p), e in efficiency.items()},
        "losses_agree": agree,
        "ddl_over_torch": {
            f"{s} N={n}": ratio(by, s, "ddl", "torch", n) for s in settings for n in (1, 2)
        },
        "tuned_over_torch": {
            f"{s} N={n}": ratio(by, s, "ddl-tuned", "torch", n) for s in settings for n in (1, 2)
        },
        "idle_over_ddl": {
            f"{s} N={n}": ratio(by, s, "ddl-idle", "ddl", n) for s in settings for n in (1, 2)
        },
        "matrix_products_ms": dots.get("dots"),
    }
    (args.out / "peers.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
