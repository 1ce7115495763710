"""The compare app's simulator against real processes on emulated networks, as a grid.

For every workload x process count x rate: ``ddl-jax compare --emulate RATE --devices N``
(each process in its own network namespace behind a ``tc`` token bucket; root), which
trains each strategy simulated, calibrates the simulator on the processes (an all-reduce
sweep fitted by ``ddl.sim.Network.fit``, a probe step for the compute) and times each
strategy as the processes for its steps to target. Collects every run's measured time and
the simulator's errors before and after calibration into one table.

    sudo python benchmarks/emulated.py [--workloads digits-mlp,digits-cnn]
        [--processes 2,3,4] [--rates 100mbit,1gbit] [--strategies ...]

Writes benchmarks/results/emulated.md and emulated.json (and each compare's own output
under benchmarks/results/emulated/). ``DDL_JAX_XLA_CPU_TUNINGS=1`` runs the processes
with the XLA:CPU tunings on. ``--reprice`` runs nothing: it reads each grid point's saved
``results.json`` under ``--out`` and prices it again with this version of the model
(``ddl_jax.compare.measured.reprice``: the fit, the compute scale and every calibrated
time, from the sweep, probe and timings measured then).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ddl_jax.compare import measured

HERE = Path(__file__).parent
STRATEGIES = "sync,ring,fsdp:3,local:16,diloco:16,streaming:4,noloco:16,powersgd:4,topk:0.01"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="digits-mlp,digits-cnn")
    parser.add_argument("--processes", default="2,3,4")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--reprice", action="store_true", help="price saved runs again")
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for n in args.processes.split(","):
            for rate in args.rates.split(","):
                out = args.out / "emulated" / f"{workload}-{n}-{rate}"
                command = [sys.executable, "-m", "ddl_jax.cli", "compare", "--workload",
                           workload, "--devices", n, "--emulate", rate, "--strategies",
                           args.strategies, "--out", str(out)]  # fmt: skip
                print(" ".join(command[2:]), flush=True)
                if not args.reprice:
                    done = run_stoppable(command, timeout=3600)
                    if done.returncode:
                        raise SystemExit(done.stderr.strip().splitlines()[-1])
                results = json.loads((out / "results.json").read_text())
                if args.reprice:
                    results = measured.reprice(results)
                fitted = results["measured"]["fitted_network"]
                for run in results["runs"]:
                    m = run["measured"]
                    if "seconds" not in m:
                        continue
                    row = {"workload": workload, "processes": int(n), "rate": rate,
                           "strategy": run["strategy"], **m, "fitted": fitted,
                           "compute_scale": results["measured"]["compute_scale"],
                           "cores": results["measured"]["cores"]}  # fmt: skip
                    rows.append(row)
                    print(
                        f"  {run['strategy']:12s} measured {m['seconds']:.3f} s, nominal "
                        f"{m['error']:+.0%}, calibrated {m['calibrated_error']:+.0%}",
                        flush=True,
                    )
                write(rows, args.out)  # after every grid point: a stopped run keeps its rows
    print((args.out / "emulated.md").read_text(), end="")


def run_stoppable(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a compare whose processes and network namespaces outlive no
    stop: past ``timeout``, or when this script gets SIGTERM, the compare gets SIGTERM and
    is waited for while it removes them (a SIGKILL, or this script dying alone, left them
    running); on Ctrl-C it got the interrupt too and is waited for."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        out, err = child.communicate(timeout=timeout)
    except BaseException as stop:
        if not isinstance(stop, KeyboardInterrupt):
            child.terminate()
        try:
            child.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def _in_turn(row: dict) -> str:
    return f", in turn {row['in_turn_error']:+.0%}" if "in_turn_error" in row else ""


def _bracketed(row: dict) -> bool:
    """Whether the measured time is within 25% of the calibrated price, or of the range
    to its price with the two-way exchanges in turn."""
    low = row["calibrated_error"]
    high = row.get("in_turn_error", low)
    return low - 0.25 <= 0 <= high + 0.25


def write(rows: list[dict], out: Path) -> None:
    """``emulated.md`` (the table) and ``emulated.json`` (the rows) in ``out``."""
    tunings = os.environ.get("DDL_JAX_XLA_CPU_TUNINGS", "0")
    cores = " or ".join(str(c) for c in sorted({r["cores"] for r in rows}))
    lines = [
        f"{cores} cores, XLA:CPU tunings {'on' if tunings not in ('0', '') else 'off'}. "
        "Error: simulated / measured - 1.",
        "",
        "| workload | processes | rate | strategy | steps | measured (s) | nominal | "
        "calibrated | fitted (MB/s, us per message, us per collective) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['processes']} | {r['rate']} | {r['strategy']} | "
            f"{r['steps']} | {r['seconds']:.3f} | {r['error']:+.0%} | "
            f"{r['calibrated_error']:+.0%}{_in_turn(r)} | {r['fitted']['bandwidth'] / 1e6:.3g}, "
            f"{1e6 * r['fitted']['latency']:.0f}, {1e6 * r['fitted']['overhead']:.0f} |"
        )
    within = [abs(r["calibrated_error"]) <= 0.25 for r in rows]
    lines += ["", f"Within 25% after calibration: {sum(within)} of {len(rows)}."]
    exchanging = [r for r in rows if "in_turn_error" in r]
    if exchanging:
        bracketed = sum(_bracketed(r) for r in rows)
        lines += [
            "",
            f"{len(exchanging)} rows exchange both ways between two processes in permutes, "
            "priced both ways at once and, after the comma, in turn: within 25% of that "
            f"range (or inside it), {bracketed} of {len(rows)}.",
        ]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "emulated.md").write_text(text + "\n")
    (out / "emulated.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
