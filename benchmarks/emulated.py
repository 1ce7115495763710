"""The compare app's simulator against real processes on an emulated network.

Two processes, each in its own Linux network namespace with its own hostname, joined by a
virtual ethernet pair whose both ends are limited by a ``tc`` token bucket (``tbf``) to
each ``--rates`` (100 Mb/s and 1 Gb/s by default), train each strategy as ``ddl-jax
compare`` builds it (one worker per process, gloo collectives across the link) for as
many steps as the simulator says it needs to reach the target. Per strategy and rate: the
measured wall time of those steps, the simulated time before calibration (the link's
nominal rate, 50 us per message, the ``cpu`` device model) and after (latency per
message, bandwidth and a step's fixed cost fitted to an all-reduce sweep across the same
link, each buffer of a combined all-reduce paying the latency as gloo sends them apart
unless the XLA:CPU tunings pack them into one bucket, the device model scaled to a
measured step of one worker alone), and the relative errors. ``--xla-cpu-tunings`` runs
the workers with the tunings on (gloo's spinning threads idled, gradients in buckets).

Needs root (``ip netns``, ``tc``) and says so otherwise. ``tc netem`` (delay) is not used.
Writes benchmarks/results/emulated.md and emulated.json.

    sudo python benchmarks/emulated.py [--rates 100mbit,1gbit] [--workload digits-mlp]
        [--strategies sync,fsdp:3,local:16,diloco:16,streaming:4,powersgd:4,topk:0.01]
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
WORKER = HERE / "_emulated_worker.py"
NAMESPACES = (("ddlA", "vA", "10.77.0.1", "ddlhostA"), ("ddlB", "vB", "10.77.0.2", "ddlhostB"))
NOMINAL_LATENCY = 50e-6
TUNINGS: dict[str, str] = {}  # the workers' DDL_JAX_XLA_CPU_TUNINGS (--xla-cpu-tunings)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def teardown() -> None:
    for ns, *_ in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def setup(rate: str) -> None:
    """Two namespaces, a veth pair between them, each end limited to ``rate``."""
    teardown()
    (a, va, _, _), (b, vb, _, _) = NAMESPACES
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
    hosts = "127.0.0.1 localhost\n" + "".join(f"{ip} {h}\n" for _, _, ip, h in NAMESPACES)
    for ns, dev, ip, _ in NAMESPACES:
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", "256kb", "latency", "100ms")  # fmt: skip
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/hosts").write_text(hosts)


def run_pair(*args: str, timeout: float = 300) -> dict:
    """Runs the worker as rank 0 and 1, each in its namespace; returns rank 0's result."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    coordinator = f"{NAMESPACES[0][2]}:{port}"
    procs = []
    for rank, (ns, _, _, host) in enumerate(NAMESPACES):
        inner = f"hostname {host} && exec {sys.executable} -P {WORKER} {args[0]} {rank} "
        inner += " ".join([coordinator, *args[1:]])
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner],
                env={**os.environ, "JAX_PLATFORMS": "cpu", **TUNINGS},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"emulated.py: {args} timed out after {timeout:.0f} s") from None
    if any(p.returncode for p in procs):
        tail = (outs[0][1] or outs[1][1]).strip().splitlines()[-3:]
        raise SystemExit(f"emulated.py: {args} failed: {' | '.join(tail)}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def fit_network(sweep: dict) -> tuple[float, float, float]:
    """Latency per message, bandwidth and a step's fixed cost from the sweep. Between two
    devices an all-reduce of K bytes sends K and takes 2 messages (``ddl.comm_stats``'s
    ring): the bandwidth from the sizes of 256 kB and up, the latency from 32 scalar
    all-reduces in one program against 1, the fixed cost from the one's program beyond
    its messages."""
    sizes = {float(k): v for k, v in sweep["allreduce_seconds"].items() if float(k) >= 2**18}
    slope, _ = np.polyfit(list(sizes), list(sizes.values()), 1)
    latency = max((sweep["scalar_32"] - sweep["scalar"]) / 31 / 2, 0.0)
    overhead = max(sweep["scalar"] - 2 * latency, 0.0)
    return latency, 1.0 / slope, overhead


def simulated(args: argparse.Namespace, out: Path) -> dict:
    """The compare app's runs on 2 simulated devices (steps to target, alpha-beta terms)."""
    command = [sys.executable, "-m", "ddl_jax.cli", "compare", "--devices", "2",
               "--workload", args.workload, "--strategies", args.strategies,
               "--steps", str(args.steps), "--eval-every", "5", "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads((out / "results.json").read_text())


def rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise SystemExit(f"--rates: {rate!r} is not like 100mbit or 1gbit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--workload", default="digits-mlp")
    parser.add_argument(
        "--strategies", default="sync,fsdp:3,local:16,diloco:16,streaming:4,powersgd:4,topk:0.01"
    )
    parser.add_argument("--steps", type=int, default=400, help="simulated run's steps")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--xla-cpu-tunings", action="store_true", help="the workers run with the tunings on"
    )
    args = parser.parse_args()
    TUNINGS["DDL_JAX_XLA_CPU_TUNINGS"] = "1" if args.xla_cpu_tunings else "0"
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("unshare"):
        raise SystemExit(
            "emulated.py needs root, `ip`, `tc` and `unshare` (network namespaces and a tbf "
            "bandwidth limit); run it as root on Linux, or compare on a real cluster with "
            "`ddl-jax launch` instead."
        )
    sys.path.insert(0, str(HERE.parent))
    from ddl_jax import sim as sim_model
    from ddl_jax.compare import report

    with tempfile.TemporaryDirectory() as tmp:
        sim = simulated(args, Path(tmp))
    runs = {r["strategy"]: r for r in sim["runs"] if r.get("steps_to_target")}
    local = subprocess.run(
        [sys.executable, "-P", str(WORKER), "compute", args.workload],
        check=True, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    alone = json.loads(local.stdout.strip().splitlines()[-1])
    work = sim_model.ComputeStats(alone["flops"], alone["bytes"])
    modeled = sim_model.estimate_compute_time(work, sim_model.CPU_CORE)  # `--compute cpu`
    device_scale = alone["seconds"] / modeled  # calibrated compute = modeled x this
    rows = []
    try:
        for rate in args.rates.split(","):
            setup(rate)
            latency, bandwidth, overhead = fit_network(run_pair("sweep"))
            for name, run in runs.items():
                steps = run["steps_to_target"]
                measured = run_pair("train", args.workload, name, str(steps))
                nominal = report.time_to_target(run, rate_bytes(rate), NOMINAL_LATENCY)
                compute = run["compute_seconds_to_target"] * device_scale
                calibrated = report.time_to_target(
                    {**run, "compute_seconds_to_target": compute},
                    bandwidth,
                    latency,
                    # gloo sends a combined all-reduce's buffers apart, unless the tunings
                    # packed them into one bucket
                    per_buffer=not args.xla_cpu_tunings,
                    step_overhead=overhead,
                )
                row = {
                    "rate": rate,
                    "strategy": name,
                    "steps": steps,
                    "measured_s": measured["seconds"],
                    "simulated_s": nominal,
                    "error": nominal / measured["seconds"] - 1,
                    "calibrated_s": calibrated,
                    "calibrated_error": calibrated / measured["seconds"] - 1,
                    "fitted_latency_s": latency,
                    "fitted_bandwidth": bandwidth,
                    "fitted_step_overhead_s": overhead,
                }
                rows.append(row)
                print(
                    f"{rate:8s} {name:12s} {steps:4d} steps: measured {row['measured_s']:.3f} s, "
                    f"simulated {nominal:.3f} s ({row['error']:+.0%}), calibrated "
                    f"{calibrated:.3f} s ({row['calibrated_error']:+.0%})",
                    flush=True,
                )
    finally:
        teardown()
    lines = [
        f"{sim['workload']['title']}, 2 processes x 1 CPU device, one per network namespace, "
        f"linked by veth limited with tc tbf; steps: the simulator's steps to target "
        f"{sim['workload']['target']:g}. Device model `cpu` scaled by {device_scale:.3g} "
        f"(one worker's step measured alone: {1e3 * alone['seconds']:.3g} ms).",
        "",
        "| rate | strategy | steps | measured (s) | simulated, nominal (s) | error | "
        "simulated, calibrated (s) | error | fitted latency (us), bandwidth (MB/s), step "
        "overhead (us) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['strategy']} | {r['steps']} | {r['measured_s']:.3f} | "
            f"{r['simulated_s']:.3f} | {r['error']:+.0%} | {r['calibrated_s']:.3f} | "
            f"{r['calibrated_error']:+.0%} | {1e6 * r['fitted_latency_s']:.0f}, "
            f"{r['fitted_bandwidth'] / 1e6:.3g}, {1e6 * r['fitted_step_overhead_s']:.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "emulated.md").write_text(text + "\n")
    (args.out / "emulated.json").write_text(
        json.dumps({"rows": rows, "device_scale": device_scale, "alone": alone}, indent=2)
    )


if __name__ == "__main__":
    main()
