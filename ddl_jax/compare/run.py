"""``ddl-jax compare``: every strategy on the same model, data and network, measured alike.

For each strategy of a ``Config``: the same initial variables and the same global batches
in the same order (one seed), ``ddl.fit`` with an evaluation every ``eval_every`` steps
(its records logged to ``<out>/logs/<strategy>.jsonl``, ``:`` written ``_``), then, on
the jitted step, ``ddl.comm_stats`` (bytes each device sends, from the compiled HLO) and
the compiled step time (median of a few timed calls after compilation).

Simulated wall time after k steps, on the chosen network (``ddl.sim``'s alpha-beta model,
communication after computation, no overlap)::

    time(k) = compute(k) + k * comm + events(k) * comm_event

``comm`` prices the step's unconditional collectives, ``comm_event`` one run of the
conditional collective that a metric counts: a synchronisation of local SGD and its kin
(metric ``synchronised``; DES-LOC's moment averages, ``synchronised_mu`` / ``_nu``, count
too), a push of the async family (metric ``pushes``); ``events(k)`` sums those metrics
over the first k steps. Bytes add up the same way. ``compute(k)`` is
``k * F * t`` for synchronous strategies (every step waits for the slowest worker, F
times slower under ``--straggler F``) and ``wall_clock(k) * t`` for the async family,
whose event simulation runs the straggler (the last worker, ``compute_time`` F, the
others 1) and reports ``wall_clock`` in units of one worker's gradient; ``t`` is the
measured compiled step time.

The async family's bytes are those of its SPMD simulation, where each push is a masked
parameter-sized all-reduce (see ``ddl.async_sgd``), not those of a real parameter server.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import ddl_jax as ddl
from ddl_jax import consistency, sim
from ddl_jax.compare import report as compare_report
from ddl_jax.compare.config import Config
from ddl_jax.compare.specs import (
    FAMILIES,
    NETWORKS,
    BuildContext,
    CompareError,
    Spec,
)
from ddl_jax.compare.workloads import Workload, make_workload

#: States whose ``params`` hold one replica per worker (gossip measures its own).
REPLICA_STATES = (ddl.LocalSGDState, ddl.NoLoCoState, ddl.StreamingDiLoCoState)

#: Timed calls of the compiled step (after one untimed call).
TIMED_STEPS = 5


def start_devices(n: int) -> list[jax.Device]:
    """``n`` devices: simulated CPU ones when JAX has no accelerator, else real ones.

    Call before any other JAX computation: on a CPU-only machine the CPU backend is
    made to expose ``n`` devices.

    Raises:
      CompareError: fewer than ``n`` devices are available (the message says how many).
    """
    # JAX may already have started (a test, a notebook): then take what it has.
    with contextlib.suppress(RuntimeError):
        ddl.simulate_cpu_devices(n)
    devices = jax.devices()
    if n > len(devices):
        raise CompareError(
            f"--devices {n} is more than the {len(devices)} {devices[0].platform} device(s) "
            "available."
        )
    return devices[:n]


def _time_step(jitted: Any, state: Any, batch: Any) -> float:
    """Median seconds of ``TIMED_STEPS`` calls of the compiled step."""
    jax.block_until_ready(jitted(state, batch))
    times = []
    for _ in range(TIMED_STEPS):
        tick = time.perf_counter()
        jax.block_until_ready(jitted(state, batch))
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


#: Metrics counting the steps' runs of a conditional collective: local SGD's (and its
#: kin's) synchronisations, async SGD's pushes; DES-LOC's ``synchronised_<field>`` moment
#: averages count too (Adam's moments are parameter-sized, as the synchronisation). Other
#: branches (gossip's consensus measurement) are instrumentation and not charged.
EVENT_METRICS = ("synchronised", "pushes")


def _event_metrics(record: dict[str, Any]) -> tuple[str, ...]:
    """The metrics of ``record`` that count conditional collectives (``EVENT_METRICS``)."""
    first = next((m for m in EVENT_METRICS if m in record), None)
    if first is None:
        return ()
    return (first, *sorted(m for m in record if m.startswith(f"{first}_")))


def _consensus(state: Any) -> float | None:
    """The replicas' consensus distance, for states holding one replica per worker."""
    if isinstance(state, REPLICA_STATES):
        return consistency.consensus_distance(state.params)
    return None


def _comm(stats: Any, network: sim.Network, event: str | None) -> dict[str, float]:
    """Bytes and seconds of a step's unconditional collectives, and of one run of what
    ``event`` counts: the mean over the step's communicating branches, each over its loop
    trip count. The branches of every family here run equally often or send alike (local
    SGD's synchronisation and warm-up catch-up, DES-LOC's moments: the same all-reduce;
    Streaming DiLoCo's fragments: each once per period; NoLoCo's pairings), so the mean
    prices the run exactly."""
    plain = sim.estimate_step_time(stats, network)
    out = {"bytes": stats.bytes_per_device, "seconds": plain}
    out["event_bytes"] = out["event_seconds"] = 0.0
    labels = [label for label, sent in stats.branches.items() if sent > 0]
    if event is not None and labels:
        for label in labels:
            runs = max(op.count for op in stats.ops if op.branch == label) * len(labels)
            out["event_bytes"] += stats.branches[label] / runs
            seconds = sim.estimate_step_time(stats, network, branch=label) - plain
            out["event_seconds"] += seconds / runs
    return out


def _curves(
    history: list[dict[str, float]],
    comm: dict[str, float],
    event: str | None,
    compute_s: float,
    straggler: float,
) -> dict[str, list[float]]:
    """Per step: cumulative bytes per device and simulated seconds."""
    steps = np.array([r["step"] for r in history], dtype=np.float64)
    events = np.cumsum([sum(r[m] for m in event.split("+")) if event else 0.0 for r in history])
    if "wall_clock" in history[0]:
        compute = np.array([r["wall_clock"] for r in history]) * compute_s
    else:
        compute = steps * straggler * compute_s
    sent = steps * comm["bytes"] + events * comm["event_bytes"]
    comm_s = steps * comm["seconds"] + events * comm["event_seconds"]
    return {
        "bytes": sent.tolist(),
        "seconds": (compute + comm_s).tolist(),
        "events": float(events[-1]),
    }


def log_path(out: str | Path, spec: Spec) -> Path:
    """The JSON-lines log of ``spec``'s run: ``<out>/logs/<strategy>.jsonl``, with the
    spec's ``:`` written ``_`` (``local_16.jsonl``), a name every file system takes."""
    return Path(out) / "logs" / f"{spec.text.replace(':', '_')}.jsonl"


def run_one(
    spec: Spec,
    workload: Workload,
    mesh: Any,
    config: Config,
    steps: int,
    eval_every: int,
    label: str,
) -> dict[str, Any]:
    """Trains and measures one strategy; returns its results record."""
    network = NETWORKS[config.network]
    family = FAMILIES[spec.family]
    ctx = BuildContext(
        workload.loss_fn, mesh, config.straggler, config.seed, eval_every, config.drop
    )
    try:
        strategy = spec.build(ctx)
    except ValueError as e:
        raise CompareError(f"strategy {spec.text!r}: {e}") from None
    print(f"{label} {spec.text}: {family.describe}", flush=True)
    state, history = ddl.fit(
        strategy,
        workload.params,
        workload.batches,
        steps=steps,
        eval_fn=workload.evaluate,
        eval_every=eval_every,
        log_every=min(10, eval_every),
        log_file=log_path(config.out, spec),
    )
    batch = next(workload.batches(0))
    jitted = jax.jit(strategy.step)
    stats = ddl.comm_stats(jitted, state, batch)
    compute_s = _time_step(jitted, state, batch)
    events = _event_metrics(history[0])
    event = "+".join(events) or None
    comm = _comm(stats, network, event)
    slow = 1.0 if family.asynchronous else config.straggler
    curves = _curves(history, comm, event, compute_s, slow)
    evals = [(i, r["eval"]) for i, r in enumerate(history) if "eval" in r]
    target = config_target(config, workload)
    reached = next((i for i, v in evals if _reached(v, target, workload.higher_is_better)), None)
    record: dict[str, Any] = {
        "strategy": spec.text,
        "description": family.describe,
        "final": history[-1]["eval"],
        "initial": float(workload.evaluate(workload.params)),
        "eval_steps": [history[i]["step"] for i, _ in evals],
        "eval_values": [v for _, v in evals],
        "eval_bytes": [curves["bytes"][i] for i, _ in evals],
        "eval_seconds": [curves["seconds"][i] for i, _ in evals],
        "final_loss": history[-1]["loss"],
        "bytes_per_device_per_step": curves["bytes"][-1] / steps,
        "bytes_per_device_total": curves["bytes"][-1],
        "comm_bytes_per_step": comm["bytes"],
        "comm_s_per_step": comm["seconds"],
        "event": event,
        "events": curves["events"],
        "comm_bytes_per_event": comm["event_bytes"],
        "comm_s_per_event": comm["event_seconds"],
        "compiled_step_ms": 1e3 * compute_s,
        "simulated_seconds_total": curves["seconds"][-1],
        "steps_to_target": None,
        "examples_to_target": None,
        "simulated_seconds_to_target": None,
        "consensus_distance": history[-1].get("consensus_distance", _consensus(state)),
    }
    if reached is not None:
        record["steps_to_target"] = history[reached]["step"]
        record["examples_to_target"] = history[reached]["step"] * workload.batch_size
        record["simulated_seconds_to_target"] = curves["seconds"][reached]
    return record


def _reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def config_target(config: Config, workload: Workload) -> float:
    """The target of the metric: the config's, else the workload's default."""
    return workload.target if config.target is None else config.target


def run_compare(config: Config) -> dict[str, Any]:
    """Runs the comparison ``config`` describes, prints its table, writes its files.

    Returns:
      The results: ``{"config", "environment", "workload", "runs"}`` (also written to
      ``config.out``/results.json).

    Raises:
      CompareError: too few devices, or a strategy that refuses this mesh.
    """
    devices = start_devices(config.devices)
    mesh = ddl.make_mesh(data=config.devices, devices=devices)
    workload = make_workload(
        config.workload, seed=config.seed, devices=config.devices, non_iid=config.non_iid
    )
    steps = workload.steps if config.steps is None else config.steps
    eval_every = config.eval_every or max(1, steps // 20)
    started = time.perf_counter()
    runs = []
    for i, spec in enumerate(config.strategies, 1):
        label = f"[{i}/{len(config.strategies)}]"
        runs.append(run_one(spec, workload, mesh, config, steps, eval_every, label))
    results = {
        "config": {**config.as_dict(), "steps": steps, "eval_every": eval_every},
        "environment": {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "jax": jax.__version__,
            "seconds": time.perf_counter() - started,
        },
        "workload": {
            "name": workload.name,
            "title": workload.title,
            "metric": workload.metric,
            "higher_is_better": workload.higher_is_better,
            "target": config_target(config, workload),
            "batch_size": workload.batch_size,
            "network": NETWORKS[config.network]._asdict(),
        },
        "runs": runs,
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = compare_report.markdown(results)
    (out / "results.md").write_text(table)
    figures = compare_report.figures(results, out)
    print()
    print(table, end="")
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'} and", file=sys.stdout)
    for path in [*figures, *(log_path(out, spec) for spec in config.strategies)]:
        print(f"  {path}")
    return results
