"""``ddl-jax compare --measure``: each strategy as real processes, timed, next to the
simulator's time, before and after calibrating it on the same processes.

After the simulated runs, for N = ``devices`` processes (one device each, on the loopback
interface or on an emulated network, ``processes``):

1. **Calibration.** A sweep of all-reduces and permutes across the processes
   (``worker.sweep``) fitted by ``ddl.sim.Network.fit``: the latency, per-collective
   overhead and bandwidth the processes really get. A probe step timed as it runs across
   the processes (``worker.compute``: each worker's gradient and Adam update on its own
   replica, only the loss averaged; local SGD that never synchronises), its collectives'
   fitted cost taken out: the ratio of what remains to its modeled compute (``--compute``'s
   device model) scales every strategy's modeled compute.
   It holds what a step costs beyond its flops and bytes when it runs in the cluster
   (cores shared between processes, the runtime's launch of a multi-process program).
2. **Measured.** Each strategy that reached the target trains as the N processes for its
   steps to target (the same program, data and seed as its simulated run), timed from its
   first step to its last, the median of ``worker.TRAIN_REPEATS`` runs, in each of
   ``--launches`` launches of the processes (the median launch kept); its metric after.
3. **Errors.** Per strategy, simulated over measured time minus 1: *nominal* (the
   network's stated terms: the emulated rate with 50 us per message, or ``--network``'s on
   loopback; the device model unscaled) and *calibrated* (the fitted network and the scaled
   device model; on CPU each buffer of a combined all-reduce pays the latency and the
   overhead, as XLA:CPU's gloo sends them apart).

The asynchronous family is not measured: its processes would run its SPMD simulation, not
the parameter server its simulated time prices.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from ddl_jax import sim
from ddl_jax.compare import processes
from ddl_jax.compare import report as compare_report
from ddl_jax.compare.config import Config
from ddl_jax.compare.specs import DEVICES, FAMILIES, NETWORKS, CompareError, parse_spec

#: Seconds per message of the nominal emulated network (the kernel's TCP stack), as
#: ``ddl.sim.ETHERNET_1G``.
NOMINAL_LATENCY = sim.ETHERNET_1G.latency
#: Seconds a measured run may take before its processes are stopped.
TIMEOUT = 900.0


def _launched(
    cluster: processes.Cluster, args: list[str], launches: int
) -> tuple[dict, list[float]]:
    """The worker ``args`` run in ``launches`` launches of the processes: the result of the
    launch whose ``seconds`` is the median (of an even count, the slower middle one), and
    every launch's ``seconds`` in turn.

    A launch keeps its speed across its runs, but launches differ: 2 processes on 2 cores,
    the CNN's probe step took 0.74 to 1.06 ms in ten launches, each the median of 5 or 15
    runs, most within 10% of it."""
    got = [processes.run_worker(cluster, args, TIMEOUT) for _ in range(launches)]
    return sorted(got, key=lambda g: g["seconds"])[launches // 2], [g["seconds"] for g in got]


def _nominal(config: Config) -> sim.Network:
    if config.emulate is None:
        return NETWORKS[config.network]
    link = processes.parse_emulation(config.emulate)
    return sim.Network(link.bandwidth, NOMINAL_LATENCY + link.latency)


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def crowding(processes: int, cores: int) -> str | None:
    """The warning for ``processes`` measured on ``cores`` cores, if they outnumber them."""
    if processes <= cores:
        return None
    return (
        f"measure: warning: {processes} processes on {cores} cores: at most {cores} run at "
        f"once and every collective waits for all {processes}, a wait that hosts of their "
        "own would not have and the calibration does not see (4 processes on 2 cores at "
        "1 Gb/s: the calibrated simulator 45% below to 88% above the measured runs, 3 of 6 "
        "within 25%); give each process a core for a faithful check."
    )


def _cluster(config: Config) -> contextlib.AbstractContextManager[processes.Cluster]:
    if config.emulate is None:
        return contextlib.nullcontext(processes.loopback(config.devices))
    return processes.emulated(config.devices, processes.parse_emulation(config.emulate))


def _compute_scale(
    probe: dict[str, float], fitted: sim.Network, device: sim.Device, per_buffer: bool
) -> float:
    """The probe step's measured seconds, its collectives' fitted cost taken out, over its
    modeled compute.

    Taken out whatever share of the step the fit gives them: every strategy's step repeats
    the probe's collective (the loss's all-reduce) at the same fitted price, so a step like
    the probe's is priced at the probe's measured seconds even where the fit misprices that
    collective. Scaling to the whole step instead counts the collective twice in every step
    (on 16 cores, 4 processes at 1 Gb/s: the fit priced the probe's scalar all-reduce at
    378 us of its 556 us, measured alone at 242 us, and the local-SGD strategies came out
    20% to 45% slow in two runs; 5% to 22% fast with it taken out). Only where the fit prices the
    collectives at the whole step or more, and nothing is left, is the device model scaled
    to the whole step, with a warning."""
    rounds, ops = _columns(per_buffer)
    comm = probe[rounds] * fitted.latency + probe[ops] * fitted.overhead
    comm += probe["busy_bytes"] / fitted.bandwidth
    modeled = sim.estimate_compute_time(sim.ComputeStats(probe["flops"], probe["bytes"]), device)
    if comm < probe["seconds"]:
        return (probe["seconds"] - comm) / modeled
    # the fit prices the probe's one scalar all-reduce above its whole step: a model so
    # small its step is that collective, a loaded machine, or a coarse fit
    print(
        f"measure: warning: the fitted network prices the probe step's collectives at "
        f"{1e3 * comm:.3g} ms, above its whole {1e3 * probe['seconds']:.3g} ms; the device model "
        "is scaled to the whole step, so compute is overestimated by up to that much (a model "
        "this small is timed mostly by its collectives; or the machine is busy)",
        file=sys.stderr,
        flush=True,
    )
    return probe["seconds"] / modeled


def _columns(per_buffer: bool) -> tuple[str, str]:
    """The terms counting messages and collectives: on CPU a combined all-reduce's buffers
    apart (XLA:CPU's gloo sends them so)."""
    return ("calls", "op_buffers") if per_buffer else ("rounds", "ops")


def fit_network(samples: list[dict[str, Any]], per_buffer: bool) -> sim.Network:
    """``ddl.sim.Network.fit`` on the sweep's ``samples`` (``worker.sweep``)."""
    rounds, ops = _columns(per_buffer)
    column = lambda key: [s[key] for s in samples]  # noqa: E731
    return sim.Network.fit(column(rounds), column("busy_bytes"), column("seconds"), column(ops))


def _measurable(run: dict[str, Any]) -> str | None:
    """Why ``run`` is not measured (``None``: it is)."""
    if "error" in run:
        return "failed"
    if FAMILIES[parse_spec(run["strategy"]).family].asynchronous:
        return "asynchronous: simulated as a parameter server, not run as one"
    if run.get("diverged") or run.get("steps_to_target") is None:
        return "did not reach the target"
    return None


def _calibrated(
    run: dict[str, Any], seconds: float, fitted: sim.Network, scale: float, per_buffer: bool
) -> dict[str, float]:
    """``run``'s calibrated time to target (the fitted network, its compute scaled) and its
    error against the measured ``seconds``; where its permutes exchange both ways between
    two devices, also priced with those bytes sent in turn (``in_turn_*``), as XLA:CPU's
    gloo sends them between 2 processes when the second to enter has already taken in its
    peer's ready notice (``run.two_way``)."""
    scaled = {**run, "compute_seconds_to_target": run["compute_seconds_to_target"] * scale}
    calibrated = compare_report.time_to_target(
        scaled, fitted.bandwidth, fitted.latency, overhead=fitted.overhead, per_buffer=per_buffer
    )
    out = {"calibrated_seconds": calibrated, "calibrated_error": calibrated / seconds - 1}
    exchanged = compare_report.exchanged_bytes_to_target(run)
    if exchanged > 0:
        in_turn = calibrated + exchanged / fitted.bandwidth
        out.update(in_turn_seconds=in_turn, in_turn_error=in_turn / seconds - 1)
    return out


def reprice(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` (a ``results.json`` of ``--measure``) with its calibration and every
    calibrated time recomputed by this version of the model from the sweep, probe and
    timings it holds: the processes' measurements checked again after a change to the
    model, without running them again."""
    m = results["measured"]
    device = DEVICES[results["config"]["compute"]]
    fitted = fit_network(m["sweep"], m["per_buffer_latency"])
    scale = _compute_scale(m["probe"], fitted, device, m["per_buffer_latency"])
    runs = []
    for run in results["runs"]:
        got = run.get("measured", {})
        if "seconds" in got:
            run = {**run, "measured": {**got, **_calibrated(
                run, got["seconds"], fitted, scale, m["per_buffer_latency"])}}  # fmt: skip
        runs.append(run)
    measured = {**m, "fitted_network": fitted._asdict(), "compute_scale": scale}
    return {**results, "runs": runs, "measured": measured}


def measure(results: dict[str, Any], config: Config) -> dict[str, Any]:
    """Times ``results``' strategies as real processes and adds, per run, ``measured``
    (seconds, metric after, simulated nominal and calibrated seconds, their errors), and
    ``results["measured"]`` (the processes, the fitted network, the compute scale).

    A strategy whose processes fail gets ``measured.failed`` (the reason) and the others
    are measured still. Where no strategy can be measured (none reached the target), no
    process starts and ``results["measured"]`` is ``{"skipped": why}``.

    Raises:
      CompareError: the network cannot be emulated here (what to do instead), or the
        calibration's processes failed or outlived their time (their ranks stopped).
    """
    reasons = [_measurable(run) for run in results["runs"]]
    if all(reasons):  # nothing to check the simulator against: no process starts
        for run, why in zip(results["runs"], reasons, strict=True):
            run["measured"] = {"skipped": why}
        named = ", ".join(f"{r['strategy']}: {r['measured']['skipped']}" for r in results["runs"])
        results["measured"] = {"skipped": f"no strategy to measure ({named})"}
        print(
            f"measure: no strategy to measure ({named}); nothing calibrated. Lower --target "
            "or raise --steps to measure the strategies that reach it.",
            file=sys.stderr,
            flush=True,
        )
        return results
    settings = json.dumps({**config.as_dict(), "eval_every": results["config"]["eval_every"]})
    nominal = _nominal(config)
    per_buffer = results["environment"]["platform"] == "cpu"
    cores = _cores()
    with _cluster(config) as cluster:
        print(f"measure: {cluster.description}: calibrating", flush=True)
        warning = crowding(config.devices, cores)
        if warning:
            print(warning, flush=True)
        samples = processes.run_worker(cluster, ["sweep"], TIMEOUT)["samples"]
        fitted = fit_network(samples, per_buffer)
        probe, launches = _launched(cluster, ["compute", settings], config.launches)
        probe = {**probe, "launch_seconds": launches}
        scale = _compute_scale(probe, fitted, DEVICES[config.compute], per_buffer)
        print(
            f"measure: fitted {1e6 * fitted.latency:.3g} us per message, "
            f"{1e6 * fitted.overhead:.3g} us per collective, {fitted.bandwidth / 1e6:.4g} MB/s; "
            f"the probe step {1e3 * probe['seconds']:.3g} ms (the median of {len(launches)} "
            f"launches, {1e3 * min(launches):.3g} to {1e3 * max(launches):.3g} ms) "
            f"(compute {scale:.3g}x the {config.compute} model)",
            flush=True,
        )
        results["measured"] = {  # before the runs: a run that fails leaves it written
            "processes": config.devices,
            "cluster": cluster.description,
            "cores": cores,
            "nominal_network": nominal._asdict(),
            "fitted_network": fitted._asdict(),
            "sweep": samples,
            "probe": probe,
            "compute_scale": scale,
            "per_buffer_latency": per_buffer,
        }
        for i, (run, why) in enumerate(zip(results["runs"], reasons, strict=True), 1):
            label = f"[{i}/{len(results['runs'])}] {run['strategy']}"
            if why is not None:
                run["measured"] = {"skipped": why}
                print(f"{label}: not measured: {why}", flush=True)
                continue
            steps = run["steps_to_target"]
            try:
                got, launches = _launched(
                    cluster, ["train", settings, run["strategy"], str(steps)], config.launches
                )
            except CompareError as e:  # the others are measured still
                run["measured"] = {"failed": str(e)}
                print(f"{label}: measured run failed: {e}", file=sys.stderr, flush=True)
                continue
            simulated = compare_report.time_to_target(run, nominal.bandwidth, nominal.latency)
            run["measured"] = {
                "seconds": got["seconds"],
                "repeats": got["repeats"],
                "launch_seconds": launches,
                "steps": steps,
                "metric": got["metric"],
                "simulated_seconds": simulated,
                "error": simulated / got["seconds"] - 1,
                **_calibrated(run, got["seconds"], fitted, scale, per_buffer),
            }
            m = run["measured"]
            print(
                f"{label}: {steps} steps in "
                f"{m['seconds']:.3g} s ({results['workload']['metric']} {m['metric']:.4g}); "
                f"simulated {m['simulated_seconds']:.3g} s ({m['error']:+.0%}), calibrated "
                f"{m['calibrated_seconds']:.3g} s ({m['calibrated_error']:+.0%})",
                file=sys.stdout,
                flush=True,
            )
    return results
