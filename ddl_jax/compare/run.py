"""``ddl-jax compare``: every strategy on the same model, data and network, priced alike.

For each strategy of a ``Config``: the same initial variables and the same global batches
in the same order (one seed), ``ddl.fit`` with an evaluation every ``eval_every`` steps
(its records logged to ``<out>/logs/<strategy>.jsonl``, ``:`` written ``_``; an earlier
run's logs of other strategies there removed), then, on
the step as ``fit`` compiled it (the state donated: one compilation serves both),
``ddl.comm_stats`` (bytes each device sends) and ``ddl.sim.compute_stats`` (flops and bytes
each device computes), both read from the compiled HLO.

Simulated wall time after k steps, on the chosen network (``ddl.sim``'s alpha-beta model)
and device model (``--compute``), communication after computation, no overlap::

    time(k) = compute(k) + k * comm + events(k) * comm_event

``comm`` prices the step's unconditional collectives, ``comm_event`` one run of the
conditional collective that a metric counts: a synchronisation of local SGD and its kin
(metric ``synchronised``; DES-LOC's moment averages, ``synchronised_mu`` / ``_nu``, count
too), a push of the async family (metric ``pushes``); ``events(k)`` sums those metrics
over the first k steps. ``compute(k)`` is ``k * F * t`` for synchronous strategies (every
step waits for the slowest worker, F times slower under ``--straggler F``), ``t`` the
step's modeled compute time: a function of the program alone, so two runs of the same
command give the same times and the same ranking.

The asynchronous family is priced as a parameter server would run it, not as its SPMD
simulation: compute ``wall_clock(k) * g``, with ``wall_clock`` the event clock in units
of one worker's gradient (its straggler, ``compute_time`` F, included) and ``g`` the
modeled time of a synchronous data-parallel step of the same workload; each push sends
the gradient to the server and each fetch brings the parameters back over the server's
link (``latency + P / bandwidth`` each for P parameter bytes; the worker sends P). A
worker fetches after each push but under SSP's cached reads, which fetch only when the
copy falls out of the bound (metric ``fetches``).

The time to target is resolved to the evaluations: the target was crossed after the last
evaluation below it and by the first at it. Strategies whose such intervals overlap share
a rank (a tie), rather than being ordered by the evaluation grid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ddl_jax as ddl
from ddl_jax import consistency, sim
from ddl_jax.compare import measured, processes, workloads
from ddl_jax.compare import report as compare_report
from ddl_jax.compare.config import Config, make_config
from ddl_jax.compare.specs import (
    DEVICES,
    FAMILIES,
    LEARNING_RATE,
    NETWORKS,
    WORKLOADS,
    BuildContext,
    CompareError,
    Spec,
    parse_spec,
)
from ddl_jax.compare.workloads import Workload

#: States whose ``params`` hold one replica per worker; a run that measures its own
#: consensus distance (gossip, unless built without the measurement) reports that one.
REPLICA_STATES = (ddl.LocalSGDState, ddl.NoLoCoState, ddl.StreamingDiLoCoState, ddl.GossipState)


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
            f"devices={n} (--devices) is more than the {len(devices)} {devices[0].platform} "
            f"device(s) JAX started with; ask for fewer, or on a CPU-only machine call "
            f"ddl.simulate_cpu_devices({n}) before anything uses JAX (before building a "
            "workload)."
        )
    return devices[:n]


#: Metrics counting the steps' runs of a conditional collective: local SGD's (and its
#: kin's) synchronisations, async SGD's pushes, one-peer gossip's rounds (a branch a peer);
#: DES-LOC's ``synchronised_<field>`` moment averages count too (Adam's moments are
#: parameter-sized, as the synchronisation). Other branches (gossip's consensus
#: measurement) are instrumentation and not charged.
EVENT_METRICS = ("synchronised", "pushes", "mixing_rounds")


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
    if isinstance(state, ddl.IslandsState):  # the islands' models, one an island
        return consistency.consensus_distance(state.inner.params)
    return None


def _comm(stats: Any, network: sim.Network, event: str | None) -> dict[str, float]:
    """Bytes and seconds of a step's unconditional collectives, and of one run of what
    ``event`` counts: the mean over the step's communicating branches, each over its loop
    trip count. The branches of every family here run equally often or send alike (local
    SGD's synchronisation and warm-up catch-up, DES-LOC's moments: the same all-reduce;
    Streaming DiLoCo's fragments: each once per period; NoLoCo's pairings; one-peer
    gossip's peers, each once in turn), so the mean prices the run exactly."""
    plain = sim.estimate_step_time(stats, network)
    out = {"bytes": stats.bytes_per_device, "seconds": plain, **_terms(stats.ops, "")}
    out["event_bytes"] = out["event_seconds"] = 0.0
    for key in TERMS:
        out[f"event_{key}"] = 0.0
    labels = [label for label, sent in stats.branches.items() if sent > 0]
    if event is not None and labels:
        for label in labels:
            runs = max(op.count for op in stats.ops if op.branch == label) * len(labels)
            out["event_bytes"] += stats.branches[label] / runs
            seconds = sim.estimate_step_time(stats, network, branch=label) - plain
            out["event_seconds"] += seconds / runs
            for key, value in _terms(stats.ops, label).items():
                out[f"event_{key}"] += value / runs
    return out


#: The alpha-beta terms of a step's collectives (``_terms``), each kept per step and per
#: event in a run's record (``comm_<term>_per_step``, ``comm_<term>_per_event``).
TERMS = ("rounds", "calls", "ops", "op_buffers", "busy_bytes", "exchanged_bytes")


def _terms(ops: Any, branch: str) -> dict[str, float]:
    """The alpha-beta terms of the collectives in ``branch``: messages in turn (``rounds``,
    priced at the latency), collectives (``ops``, at the overhead) and the busiest
    device's bytes (at the bandwidth), so that their seconds on any network are
    ``ops * overhead + rounds * latency + busy_bytes / bandwidth``; ``calls`` and
    ``op_buffers`` count a combined op's buffers apart, as XLA:CPU's gloo sends them;
    ``exchanged_bytes``, the part of ``busy_bytes`` in permutes that exchange both ways
    between two devices (``two_way``), priced at the bandwidth both ways at once."""
    mine = [op for op in ops if op.branch == branch]
    return {
        "rounds": float(sum(op.count * op.rounds for op in mine)),
        "calls": float(sum(op.count * op.rounds * op.buffers for op in mine)),
        "ops": float(sum(op.count for op in mine)),
        "op_buffers": float(sum(op.count * op.buffers for op in mine)),
        "busy_bytes": float(sum(op.count * max(op.sent) for op in mine)),
        "exchanged_bytes": float(sum(op.count * max(op.sent) for op in mine if two_way(op))),
    }


def two_way(op: Any) -> bool:
    """Whether ``op`` is a permute in which two devices send to each other (a ring of 2,
    NoLoCo's pairs). Between 2 processes XLA:CPU's gloo sends such an exchange in turn when the
    process entering second has already taken in its peer's ready notice, else at once
    (``benchmarks/gloo_permutes.py``)."""
    pairs = {(s, t) for s, t in op.groups if s != t} if op.kind == "collective-permute" else set()
    return any((t, s) in pairs for s, t in pairs)


def _curves(
    history: list[dict[str, float]],
    comm: dict[str, float],
    event: str | None,
    compute_s: float,
    straggler: float,
    inner_s: float = 0.0,
) -> dict[str, list[float]]:
    """Per step: cumulative bytes per device and simulated seconds (a parameter server's
    fetches priced at ``comm["fetch_seconds"]`` each, their bytes the server's). The
    ``straggler`` slows the compute, not ``inner_s``, an island's collectives on its own
    network (counted with the compute: the bandwidth sweep does not re-price them)."""
    steps = np.array([r["step"] for r in history], dtype=np.float64)
    events = np.cumsum([sum(r[m] for m in event.split("+")) if event else 0.0 for r in history])
    fetches = np.cumsum([r.get("fetches", 0.0) for r in history])
    if "wall_clock" in history[0]:
        compute = np.array([r["wall_clock"] for r in history]) * compute_s
    else:
        compute = steps * (straggler * compute_s + inner_s)
    sent = steps * comm["bytes"] + events * comm["event_bytes"]
    comm_s = steps * comm["seconds"] + events * comm["event_seconds"]
    comm_s = comm_s + fetches * comm.get("fetch_seconds", 0.0)
    return {
        "bytes": sent.tolist(),
        "seconds": (compute + comm_s).tolist(),
        "compute": compute.tolist(),
        "events_by_step": events.tolist(),
        "events": float(events[-1]),
        "fetches_by_step": fetches.tolist(),
    }


def log_path(out: str | Path, spec: Spec) -> Path:
    """The JSON-lines log of ``spec``'s run: ``<out>/logs/<strategy>.jsonl``, named by
    ``file_name`` (``local_16.jsonl``), a name every file system takes."""
    return Path(out) / "logs" / f"{file_name(spec)}.jsonl"


def _float_bytes(params: Any) -> int:
    """Bytes of the floating leaves of ``params`` (what a parameter server sends)."""
    leaves = jax.tree.leaves(params)
    return sum(x.nbytes for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact))


def _server_comm(param_bytes: int, workers: int, network: sim.Network) -> dict[str, float]:
    """A push to a parameter server (the event) and a fetch of the parameters from it: the
    pushing worker sends ``param_bytes`` (per device, averaged over the ``workers``), the
    server sends them back at a fetch, and its link carries one message after another."""
    seconds = network.overhead + network.latency + param_bytes / network.bandwidth
    message = {"rounds": 1.0, "calls": 1.0, "ops": 1.0, "op_buffers": 1.0,
               "busy_bytes": float(param_bytes), "exchanged_bytes": 0.0}  # fmt: skip
    return {
        "bytes": 0.0,
        "seconds": 0.0,
        **dict.fromkeys(TERMS, 0.0),
        "event_bytes": param_bytes / workers,
        "event_seconds": seconds,
        **{f"event_{key}": value for key, value in message.items()},
        "fetch_seconds": seconds,
        **{f"fetch_{key}": value for key, value in message.items()},
    }


#: Seconds between a strategy's progress lines where stdout is not a terminal.
HEARTBEAT_SECONDS = 30.0


class _Heartbeat:
    """A ``fit`` callback for output that is not a terminal (a pipe, a log file, a
    notebook), where no progress bar shows: a line every ``HEARTBEAT_SECONDS``."""

    def __init__(self, label: str, steps: int) -> None:
        self.label, self.steps = label, steps
        self.last = time.monotonic()

    def __call__(self, record: dict[str, float]) -> None:
        if time.monotonic() - self.last >= HEARTBEAT_SECONDS:
            self.last = time.monotonic()
            loss = f", loss {record['loss']:.4g}" if "loss" in record else ""
            print(f"{self.label}: step {record['step']}/{self.steps}{loss}", flush=True)


def _fit(
    strategy: ddl.Strategy,
    workload: Workload,
    config: Config,
    spec: Spec,
    steps: int,
    eval_every: int,
    label: str,
) -> tuple[Any, list[dict[str, float]], str | None]:
    """``ddl.fit`` of one strategy: its state (``None`` where fit stopped on a non-finite
    loss: only the records until then are kept), its records, and why it diverged
    (``None``: it did not). A run diverged where ``fit`` warned that the loss grew 100x
    (``ddl.LossGrowthWarning``), stopped on a non-finite loss, or where an evaluation was
    not finite."""
    records: list[dict[str, float]] = []
    why = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state, history = ddl.fit(
                strategy,
                workload.params,
                workload.batches,
                steps=steps,
                eval_fn=workload.evaluate,
                eval_every=eval_every,
                log_every=1,  # each record checked, and kept, before a non-finite loss
                log_file=log_path(config.out, spec),
                tensorboard_dir=_tensorboard_dir(config, spec),
                # a bar on a terminal; elsewhere (a notebook, a pipe) a line now and then
                progress=sys.stdout.isatty(),
                callbacks=[records.append]
                + ([] if sys.stdout.isatty() else [_Heartbeat(f"{label} {spec.text}", steps)]),
            )
        except FloatingPointError as e:  # "fit: loss is nan at step 9; lower the ..."
            if not records:
                raise
            state, history, why = None, records, _clause(e)
    for w in caught:
        print(f"{label} {spec.text}: warning: {w.message}", file=sys.stderr, flush=True)
        if why is None and issubclass(w.category, ddl.LossGrowthWarning):
            why = _clause(w.message).partition(" (over")[0]
    bad = next((r for r in history if "eval" in r and not math.isfinite(r["eval"])), None)
    if why is None and bad is not None:
        why = f"{workload.metric} is {bad['eval']} at step {bad['step']}"
    return state, history, why


def _say_uncounted(work: sim.ComputeStats, label: str) -> None:
    """Notes what the compute model of a run could not count (``ddl.sim.ComputeStats``)."""
    if work.dynamic_loops:
        print(f"{label}: note: {work.dynamic_loops} data-dependent loop(s) of its step counted "
              "once in its compute (a lower bound)", flush=True)  # fmt: skip
    if work.library_calls:
        print(f"{label}: warning: {work.library_calls} matrix products in vendor libraries "
              "(cuBLAS, cuDNN) are missing from its compute; JAX_PLATFORMS=cpu prices the "
              "XLA:CPU program on the --compute device", file=sys.stderr, flush=True)  # fmt: skip


def _clause(message: Any) -> str:
    """A message of ``fit``'s up to its advice: ``loss is nan at step 9``."""
    return str(message).removeprefix("fit: ").split(";")[0].split(": ")[0]


def _tensorboard_dir(config: Config, spec: Spec) -> str | None:
    """``<tensorboard>/<strategy>``, one TensorBoard run per strategy (``:`` written ``_``)."""
    if config.tensorboard is None:
        return None
    return str(Path(config.tensorboard) / file_name(spec))


def file_name(spec: Spec) -> str:
    """``spec``'s text as a file name: ``:`` written ``_``, a stacked spec's ``/`` written
    ``_over_`` (``diloco_16_over_fsdp_3``)."""
    return spec.text.replace(":", "_").replace("/", "_over_")


def _is_strategy_log(path: Path) -> bool:
    """Whether ``path`` is named as ``log_path`` names a strategy's log."""
    try:
        parse_spec(path.stem.replace("_over_", "/").replace("_", ":"))
    except CompareError:
        return False
    return True


def run_one(
    spec: Spec,
    workload: Workload,
    mesh: Any,
    config: Config,
    steps: int,
    eval_every: int,
    label: str,
    gradient_s: float,
) -> dict[str, Any]:
    """Trains and measures one strategy; returns its results record. ``gradient_s``: the
    modeled compute time of a synchronous data-parallel step (the async family's unit)."""
    network = NETWORKS[config.network]
    family = FAMILIES[spec.family]
    mesh = mesh_for(spec, mesh, config)
    strategy = spec.build(_context(workload, mesh, config, eval_every))
    print(f"{label} {spec.text}: {family.describe}", flush=True)
    state, history, diverged = _fit(strategy, workload, config, spec, steps, eval_every, label)
    # the replicas' distance where the run ended (none measured where it stopped on a nan)
    consensus = history[-1].get("consensus_distance", None if state is None else _consensus(state))
    if state is None:  # the programs' costs, read from a fresh state's
        state = strategy.init(workload.params)
    batch = next(workload.batches(0))
    # fit's program (its state donated): priced as it ran, and not compiled again
    jitted = jax.jit(strategy.step, donate_argnums=0)
    stats = ddl.comm_stats(jitted, state, batch)
    events = _event_metrics(history[0])
    event = "+".join(events) or None
    per_device = config.worker_count // config.devices
    if family.asynchronous or per_device == 1:
        work = sim.compute_stats(jitted, state, batch)
    inner_s = 0.0  # an island's collectives, on the inner network
    if family.asynchronous:
        compute_s = gradient_s
        comm = _server_comm(_float_bytes(workload.params), config.worker_count, network)
    else:
        if per_device > 1:  # a worker's compute, and what each worker sends
            one_each = spec.build(
                _context(workload, mesh, config, eval_every)._replace(workers=None)
            )
            one_step = jax.jit(one_each.step, donate_argnums=0)  # as fit would run it
            rows = _worker_rows(batch, per_device)
            one_state = one_each.init(workload.params)
            work = sim.compute_stats(one_step, one_state, rows)
            stats = sim.per_worker(stats, per_device)
            if family.exchange_one_a_device:  # its exchange as one worker a device sends it
                one = ddl.comm_stats(one_step, one_state, rows)
                ops = [op for op in stats.ops if not op.branch]
                stats = sim.summarise((*ops, *(op for op in one.ops if op.branch)))
        compute_s = sim.estimate_compute_time(work, DEVICES[config.compute])
        _say_uncounted(work, f"{label} {spec.text}")
        if spec.inner is not None:  # an island's collectives on its own network
            within, stats = sim.split_islands(stats, mesh.size // config.islands)
            inner_s = sim.estimate_step_time(within, NETWORKS[config.inner_network])
        comm = _comm(stats, network, event)
    slow = 1.0 if family.asynchronous else config.straggler
    curves = _curves(history, comm, event, compute_s, slow, inner_s)
    evals = [(i, r["eval"]) for i, r in enumerate(history) if "eval" in r]
    target = config_target(config, workload)
    reached = next(
        (k for k, (_, v) in enumerate(evals) if _reached(v, target, workload.higher_is_better)),
        None,
    )
    initial = float(workload.evaluate(workload.params))
    record: dict[str, Any] = {
        "strategy": spec.text,
        "description": family.describe,
        "final": evals[-1][1] if evals else initial,
        "initial": initial,
        "diverged": diverged is not None,
        "diverged_why": diverged,
        "steps_trained": len(history),
        "eval_steps": [history[i]["step"] for i, _ in evals],
        "eval_values": [v for _, v in evals],
        "eval_bytes": [curves["bytes"][i] for i, _ in evals],
        "eval_seconds": [curves["seconds"][i] for i, _ in evals],
        "final_loss": history[-1]["loss"],
        "bytes_per_device_per_step": curves["bytes"][-1] / len(history),
        "bytes_per_device_total": curves["bytes"][-1],
        "comm_bytes_per_step": comm["bytes"],
        "comm_s_per_step": comm["seconds"],
        "event": event,
        "events": curves["events"],
        "comm_bytes_per_event": comm["event_bytes"],
        "comm_s_per_event": comm["event_seconds"],
        **{f"comm_{key}_per_step": comm[key] for key in TERMS},
        **{f"comm_{key}_per_event": comm[f"event_{key}"] for key in TERMS},
        **_fetch_record(comm, curves),
        "compute_flops_per_step": work.flops,
        "compute_bytes_per_step": work.bytes,
        "compute_ms_per_step": 1e3 * (compute_s + inner_s),
        "simulated_seconds_total": curves["seconds"][-1],
        "steps_to_target": None,
        "examples_to_target": None,
        "simulated_seconds_to_target": None,
        "simulated_seconds_before_target": None,
        "compute_seconds_to_target": None,
        "events_to_target": None,
        "consensus_distance": consensus,
    }
    if reached is not None:
        at = evals[reached][0]
        record["steps_to_target"] = history[at]["step"]
        record["examples_to_target"] = history[at]["step"] * workload.batch_size
        record["simulated_seconds_to_target"] = curves["seconds"][at]
        record["compute_seconds_to_target"] = curves["compute"][at]
        record["events_to_target"] = curves["events_by_step"][at]
        if "fetches" in record:
            record["fetches_to_target"] = curves["fetches_by_step"][at]
        before = curves["seconds"][evals[reached - 1][0]] if reached else 0.0
        record["simulated_seconds_before_target"] = before
    print(f"{label} {spec.text}: {_summary(record, workload)}", flush=True)
    return record


def _fetch_record(comm: dict[str, float], curves: dict[str, Any]) -> dict[str, Any]:
    """A parameter server's fetches in a run's record (nothing for other families):
    their count, the seconds and alpha-beta terms of one, and (set where the target is
    reached) the fetches until then."""
    if "fetch_seconds" not in comm:
        return {}
    return {
        "fetches": curves["fetches_by_step"][-1],
        "comm_s_per_fetch": comm["fetch_seconds"],
        **{f"comm_{key}_per_fetch": comm[f"fetch_{key}"] for key in TERMS},
        "fetches_to_target": None,
    }


def _summary(record: dict[str, Any], workload: Workload) -> str:
    """One line on a finished run: its final metric, when it reached the target."""
    text = f"{workload.metric} {record['final']:.4g}"
    if record["diverged"]:
        return f"{text}, diverged ({record['diverged_why']})"
    if record["steps_to_target"] is None:
        return f"{text}, target not reached"
    return (
        f"{text}, target reached by step {record['steps_to_target']} (simulated "
        f"{record['simulated_seconds_to_target']:.3g} s)"
    )


def ranks(runs: list[dict[str, Any]]) -> list[int | None]:
    """Each run's rank by simulated time to target (``None``: not reached, diverged, or
    failed): 1 + the runs that certainly reached it sooner, i.e. whose time at the target
    is before this run's last evaluation below it. Runs of the same rank are tied."""
    done = [None if r.get("diverged") else r.get("simulated_seconds_to_target") for r in runs]
    out: list[int | None] = []
    for r, high in zip(runs, done, strict=True):
        if high is None:
            out.append(None)
            continue
        low = r["simulated_seconds_before_target"]
        out.append(1 + sum(1 for other in done if other is not None and other < low))
    return out


def _reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def config_target(config: Config, workload: Workload) -> float:
    """The target of the metric: the config's, else the workload's default."""
    return workload.target if config.target is None else config.target


def mesh_for(spec: Spec, mesh: Any, config: Config) -> Any:
    """``mesh``, or for a stacked spec its devices as ``config.islands`` islands."""
    if spec.inner is None:
        return mesh
    devices = list(mesh.devices.flat)
    return ddl.make_mesh(island=config.islands, data=len(devices) // config.islands,
                         devices=devices)  # fmt: skip


def _context(workload: Workload, mesh: Any, config: Config, eval_every: int) -> BuildContext:
    rows = workload.batch_size // config.worker_count
    return BuildContext(workload.loss_fn, mesh, config.straggler, config.seed, eval_every,
                        config.drop, config.workers, rows, config.churn)  # fmt: skip


def _check_writable(name: str, folder: str) -> None:
    """The output folder ``name`` (``out``, ``tensorboard``) can be created and written,
    before anything trains."""
    probe = Path(folder) / ".ddl-jax-write-check"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CompareError(
            f"{name} {folder!r} cannot be written ({e.strerror or type(e).__name__}); give a "
            "folder this process can create and write to."
        ) from None


def _check_target(config: Config, workload: Workload) -> None:
    """An accuracy target must be a fraction (``--target 95`` is a percentage) where the
    workload's own target is one (a workload of yours may count accuracy in percent), and
    one the untrained model does not meet already."""
    target = config_target(config, workload)
    fraction = "accuracy" in workload.metric and 0 < workload.target <= 1
    if fraction and not 0 < target <= 1:
        raise CompareError(
            f"target {target:g} is not an accuracy in (0, 1] (the metric is "
            f"{workload.metric}); e.g. --target {target / 100 if target > 1 else 0.9:g}."
        )
    initial = float(workload.evaluate(workload.params))
    if initial >= target if workload.higher_is_better else initial <= target:
        side = ">=" if workload.higher_is_better else "<="
        raise CompareError(
            f"the untrained model already meets the target ({workload.metric} {initial:.4g} "
            f"{side} {target:g}): every strategy would reach it before its first step; give "
            f"a target beyond {initial:.4g} (--target)."
        )


def _check_measurable(config: Config, workload: Workload) -> None:
    """Real processes can be started here and can build the workload themselves."""
    if ":" not in config.workload and config.workload not in WORKLOADS:
        raise CompareError(
            f"measure: the processes build the workload themselves; give {workload.name!r} as "
            "'module:function' (a function of yours returning it), e.g. --workload "
            "mypkg.workloads:make."
        )
    if config.emulate is not None:
        processes.check_emulation_possible()


def _check_strategies(
    specs: tuple[Spec, ...], workload: Workload, mesh: Any, config: Config, eval_every: int
) -> None:
    """Builds every strategy, places its state and traces its first step (the step is
    not compiled and nothing trains), so one that refuses the mesh or the workload stops
    the comparison before any trains."""
    workers = config.worker_count
    if workload.batch_size % workers:
        raise CompareError(
            f"the workload's global batch of {workload.batch_size} rows does not split over "
            f"{workers} workers: give it a multiple of {workers} rows, or other --devices "
            "or --workers."
        )
    try:
        batch = next(workload.batches(0))
    except (ValueError, TypeError) as e:  # e.g. too many workers for --non-iid's split
        raise CompareError(f"the workload's batches: {str(e).splitlines()[0]}") from None
    refused = []
    for spec in specs:
        try:
            strategy = spec.build(_context(workload, mesh_for(spec, mesh, config), config,
                                           eval_every))  # fmt: skip
            jax.eval_shape(strategy.step, strategy.init(workload.params), batch)
        except Exception as e:  # a refusal, or the workload's loss failing on the mesh
            why = e if isinstance(e, ValueError | TypeError) else f"{type(e).__name__}: {e}"
            refused.append((spec.text, str(why).splitlines()[0]))
    by_reason: dict[str, list[str]] = {}
    for name, why in refused:  # each reason said once, after the strategies it stops
        by_reason.setdefault(why, []).append(name)
    if len(refused) == len(specs) > 1 and len(by_reason) == 1:  # the workload's
        raise CompareError(f"no strategy can run this workload here: {refused[0][1]}")
    if refused:
        reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
        raise CompareError(
            f"{len(refused)} of the strategies cannot run here (remove them or change "
            f"the setting): {reasons}"
        )


def _worker_rows(batch: Any, per_device: int) -> Any:
    """The rows of one worker a device: the first 1 / ``per_device`` of ``batch``'s. What
    one worker computes is a program with one worker a device on them (with several
    workers a device, a device's program shares its weights among its workers' rows)."""
    return jax.tree.map(lambda x: x[: x.shape[0] // per_device], batch)


def _gradient_seconds(workload: Workload, mesh: Any, config: Config) -> float:
    """The modeled compute time of a synchronous data-parallel step of ``workload``: one
    worker's gradient and update, the async family's unit of compute."""
    strategy = ddl.data_parallel(workload.loss_fn, optax.adam(LEARNING_RATE), mesh)
    state, batch = strategy.init(workload.params), next(workload.batches(0))
    rows = _worker_rows(batch, config.worker_count // config.devices)
    work = sim.compute_stats(jax.jit(strategy.step, donate_argnums=0), state, rows)
    return sim.estimate_compute_time(work, DEVICES[config.compute])


def run_compare(config: Config, workload: Workload | None = None) -> dict[str, Any]:
    """Runs the comparison ``config`` describes, prints its table, writes its files.

    ``workload``: the model and data (``ddl_jax.compare.Workload``); ``None`` builds the
    bundled ``config.workload``.

    Returns:
      The results: ``{"config", "environment", "workload", "runs"}`` (also written to
      ``config.out``/results.json).

    Raises:
      CompareError: too few devices, a target out of the metric's range, or strategies
        that refuse this mesh or workload (all named, before any trains).
    """
    _check_writable("out", config.out)
    if config.tensorboard is not None:
        _check_writable("tensorboard", config.tensorboard)
    devices = start_devices(config.devices)
    mesh = ddl.make_mesh(data=config.devices, devices=devices)
    if workload is None:
        workload = workloads.load(
            config.workload, seed=config.seed, devices=config.worker_count, non_iid=config.non_iid
        )
    else:
        workload = workloads.check(workload, workload.name)
    _check_target(config, workload)
    if config.measure:
        _check_measurable(config, workload)
    steps = workload.steps if config.steps is None else config.steps
    eval_every = config.eval_every or max(1, steps // 20)
    _check_strategies(config.strategies, workload, mesh, config, eval_every)
    ours = {log_path(config.out, spec) for spec in config.strategies}
    for stale in set((Path(config.out) / "logs").glob("*.jsonl")) - ours:  # an earlier run's
        if _is_strategy_log(stale):  # a file of the user's stays
            stale.unlink()
    if config.tensorboard is not None:  # an earlier run's curves, drawn over this run's
        for spec in config.strategies:
            for stale in Path(_tensorboard_dir(config, spec)).glob("events.out.tfevents.*"):
                stale.unlink()
    asynchronous = any(FAMILIES[s.family].asynchronous for s in config.strategies)
    gradient_s = _gradient_seconds(workload, mesh, config) if asynchronous else 0.0
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    interrupted = False
    for i, spec in enumerate(config.strategies, 1):
        label = f"[{i}/{len(config.strategies)}]"
        if interrupted:
            runs.append({"strategy": spec.text, "error": "interrupted"})
            continue
        try:
            runs.append(run_one(spec, workload, mesh, config, steps, eval_every, label, gradient_s))
        except KeyboardInterrupt:  # the finished strategies' results are written below
            interrupted = True
            runs.append({"strategy": spec.text, "error": "interrupted"})
        except Exception as e:  # one strategy's failure leaves the others' results
            message = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"{label} {spec.text}: failed: {message}", file=sys.stderr, flush=True)
            runs.append({"strategy": spec.text, "error": message})
    for run, rank in zip(runs, ranks(runs), strict=True):
        run["rank"] = rank
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
    figures = _write(results, config)
    if interrupted:
        raise KeyboardInterrupt
    if config.measure:
        try:
            measured.measure(results, config)
        finally:  # the simulated results stay written when a measured run fails
            figures = _write(results, config)
    out = Path(config.out)
    print()
    print((out / "results.md").read_text(), end="")
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'} and", file=sys.stdout)
    for path in [*figures, *(log_path(out, spec) for spec in config.strategies)]:
        print(f"  {path}")
    return results


def _write(results: dict[str, Any], config: Config) -> list[Path]:
    """Writes ``results.json``, ``results.md`` and the figures; returns the figures."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_finite(results), indent=2) + "\n")
    (out / "results.md").write_text(compare_report.markdown(results))
    return compare_report.figures(results, out)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (a diverged run's metric) as ``None``: JSON
    has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def compare(
    workload: Workload,
    strategies: str | Sequence[str] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Compares strategies on a workload of your own: the Python face of ``ddl-jax compare``.

    Args:
      workload: a ``ddl_jax.compare.Workload``: your model's loss and initial variables,
        its batches, its evaluation, the metric and its target.
      strategies: specs as on the command line (``"sync,local:16,diloco:16"`` or a list);
        ``None``: the default list.
      **settings: any other ``Config`` field (``devices``, ``steps``, ``network``,
        ``compute``, ``straggler``, ``drop``, ``churn``, ``seed``, ``target``, ``eval_every``,
        ``out``), checked as the command line's flags are. The workload is built, so
        ``seed`` seeds only the strategies' own draws (compute times, lost messages), and
        ``non_iid`` is refused: give the workload label-skewed batches instead; so are
        ``measure`` and ``emulate``, whose processes build the workload themselves (use
        the command line's ``--workload module:function``).

    Returns:
      The results the command writes to ``results.json``: ``{"config", "environment",
      "workload", "runs"}``.

    Raises:
      CompareError: a bad setting, a workload that does not work, or strategies that cannot
        run on it (one line naming what to change).
    """
    if not isinstance(workload, Workload):
        raise CompareError(
            f"compare: the workload is a {type(workload).__name__}, not a "
            "ddl_jax.compare.Workload; call it first if it makes one: compare(make(), ...)."
        )
    if settings.get("non_iid") is not None:
        raise CompareError(
            "compare: non_iid shapes the batches of a workload, and this one is built; give "
            "it label-skewed batches (ddl.data.non_iid_batches) and leave non_iid out."
        )
    if settings.get("measure") or settings.get("emulate") is not None:
        raise CompareError(
            "compare: measure and emulate start processes that build the workload "
            "themselves, which a built one cannot tell them how to do (a bundled name would "
            "build the bundled workload): run `ddl-jax compare --workload module:function "
            "--measure`, the function yours returning this workload."
        )
    values = {**settings, "strategies": strategies}
    config = dataclasses.replace(make_config(values), workload=workload.name)
    return run_compare(config, workload)
