"""``ddl-jax compare``'s outputs: the markdown table and the figures."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

_MARKERS = "osD^v<>pP*Xh"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float | None) -> str:
    if s is None:
        return "not reached"
    if s >= 1.0:
        return f"{s:.3g} s"
    return f"{1e3 * s:.3g} ms"


def _launches(measured: dict[str, Any]) -> str:
    """``, the median of N launches, A to B`` where ``measured`` was timed in several
    launches of the processes (``launch_seconds``)."""
    launches = measured.get("launch_seconds", [])
    if len(launches) < 2:
        return ""
    return (
        f", the median of {len(launches)} launches, {_seconds(min(launches))} to "
        f"{_seconds(max(launches))}"
    )


def _network(results: dict[str, Any]) -> str:
    net = results["workload"]["network"]
    return (
        f"{results['config']['network']} ({net['bandwidth'] / 1e6:.4g} MB/s, "
        f"{1e6 * net['latency']:.3g} us per message)"
    )


def subtitle(results: dict[str, Any]) -> str:
    """One line naming the workload, devices, steps and the settings that shape the answer
    (compute model, straggler, drop, non-i.i.d. shares)."""
    c, w, env = results["config"], results["workload"], results["environment"]
    settings = [f"compute {c['compute']}"]
    if c["straggler"] != 1:
        settings.append(f"straggler {c['straggler']:g}x")
    if c["drop"]:
        settings.append(f"drop {c['drop']:g}")
    if c.get("churn"):
        settings.append(f"churn {c['churn']:g}")
    if c["non_iid"] is not None:
        settings.append(f"non-iid alpha {c['non_iid']:g}")
    if any("/" in text for text in c["strategies"]):
        settings.append(f"stacked: {c['islands']} islands, {c['inner_network']} inside")
    devices = f"{c['devices']} {env['platform']} devices"
    if c.get("workers") not in (None, c["devices"]):
        devices = f"{c['workers']} workers on {devices}"
    steps = f"{c['steps']} steps"
    trained = {r.get("steps_trained") for r in results["runs"] if not r.get("diverged")} - {None}
    if trained and max(trained) < c["steps"]:  # the workload's batches ran out
        steps = f"{c['steps']} steps asked, {max(trained)} trained (the batches ran out)"
    return f"{w['title']}, {devices}, {steps} x {w['batch_size']} examples, {', '.join(settings)}"


def _stacked_bytes(c: dict[str, Any]) -> str:
    """What the bytes column counts for stacked strategies, where the run has them."""
    if not any("/" in text for text in c["strategies"]):
        return ""
    return (
        "; a stacked strategy's bytes are those crossing islands, and what moves inside an "
        f"island is priced as time on its {c['inner_network']} network, in the compute column"
    )


def _time(r: dict[str, Any]) -> str:
    if r.get("diverged"):
        return "diverged"
    return _seconds(r["simulated_seconds_to_target"])


def _row(r: dict[str, Any], tied: bool) -> str:
    if "error" in r:
        return f"| - | {r['strategy']} | failed: {r['error']} | | | | | | |"
    consensus = r["consensus_distance"]
    rank = "-" if r["rank"] is None else f"{r['rank']}{'=' if tied else ''}"
    steps, examples = r["steps_to_target"], r["examples_to_target"]
    return (
        f"| {rank} | {r['strategy']} | {r['final']:.4f} | {'-' if steps is None else steps} | "
        f"{'-' if examples is None else examples} | "
        f"{_bytes(r['bytes_per_device_per_step'])} | {r['compute_ms_per_step']:.3g} | "
        f"{_time(r)} | {'-' if consensus is None else f'{consensus:.3g}'} |"
    )


def markdown(results: dict[str, Any]) -> str:
    """The results table in markdown, with a line of context above and notes below."""
    c, w = results["config"], results["workload"]
    metric = w["metric"]
    several = c.get("workers") not in (None, c["devices"])  # priced per worker
    sender = "worker" if several else "device"
    lines = [
        f"{subtitle(results)}, network {_network(results)}, seed {c['seed']}; target {_target(w)}.",
        "",
        f"| rank | strategy | final {metric} | steps to target | examples to target | "
        f"bytes / {sender} / step | compute / step (ms, {c['compute']}) | simulated time to "
        f"target ({c['network']}) | consensus distance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ranks = [r.get("rank") for r in results["runs"]]
    lines += [_row(r, ranks.count(r.get("rank")) > 1) for r in results["runs"]]
    lines += _answer(results)
    lines += [
        "",
        f"Rank: by simulated time to target; `n=` marks a tie: the target was crossed "
        f"between two evaluations (every {c['eval_every']} steps), and these runs' "
        f"intervals overlap. Bytes: sent by the busiest {sender}, read from the compiled "
        "step's HLO, averaged over the run (synchronisations included"
        f"{_stacked_bytes(c)}). Compute: the "
        "compiled step's flops and bytes on the device model (`ddl.sim.compute_stats`), "
        "the same in every run of this command. Simulated time: steps x (compute + the "
        "alpha-beta cost of the step's collectives on the network; local SGD's "
        "synchronisations as they happen); async strategies run on their event clock in "
        "units of a data-parallel step's compute, each push sending the gradient to a "
        "parameter server and each fetch bringing the parameters back (under SSP, only "
        "when a worker's cached copy falls out of the bound). Diverged (unranked): the "
        "loss grew 100x or went non-finite, or the metric did.",
    ]
    lines += _none_reached(results)
    cross = crossovers(results)
    if cross:
        runs = [r for r in results["runs"] if "error" not in r]  # as crossovers takes it
        first = next((r for r in runs if r["strategy"] == "sync"), runs[0])
        base = first["strategy"]
        if first.get("steps_to_target") is None or first.get("diverged"):
            base += " (which does not reach the target)"
        lines += [
            "",
            f"Against {base}, on bandwidths from 10 Mb/s to 100 Gb/s at "
            f"{1e6 * results['workload']['network']['latency']:.3g} us per message (the "
            "same runs re-priced; `time_vs_bandwidth.png`):",
            "",
            "| strategy | reaches the target sooner |",
            "|---|---|",
            *(f"| {name} | {verdict} |" for name, verdict in cross),
        ]
    return "\n".join(lines + _measured(results)) + "\n"


def _target(workload: dict[str, Any]) -> str:
    """``test accuracy >= 0.95``: the metric, the side it is reached from, the target."""
    side = ">=" if workload["higher_is_better"] else "<="
    return f"{workload['metric']} {side} {workload['target']:g}"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _answer(results: dict[str, Any]) -> list[str]:
    """The table's answer in a line: the strategy that reaches the target first on the
    network (those tied with it, where the evaluation grid cannot order them), its
    simulated time, and synchronous training's beside it."""
    first = [r for r in results["runs"] if r.get("rank") == 1]
    if not first:
        return []
    w, c = results["workload"], results["config"]
    times = sorted(r["simulated_seconds_to_target"] for r in first)
    when, tied = _seconds(times[0]), len(first) > 1
    if tied:
        when += f" to {_seconds(times[-1])} simulated, tied: evaluations every "
        when += f"{c['eval_every']} steps cannot order them"
    else:
        when += " simulated"
    line = (
        f"Answer: on {c['network']}, {_names([r['strategy'] for r in first])} "
        f"reach{'' if tied else 'es'} {_target(w)} first ({when})"
    )
    sync = next((r for r in results["runs"] if r["strategy"] == "sync" and "error" not in r), None)
    if sync is not None and sync.get("rank") != 1:
        seconds = None if sync.get("diverged") else sync["simulated_seconds_to_target"]
        if seconds is None:
            line += "; sync does not reach it"
        else:
            line += f"; sync takes {_seconds(seconds)}, {seconds / times[0]:.2g}x as long"
    return ["", line + "."]


def _none_reached(results: dict[str, Any]) -> list[str]:
    """A note when no strategy reached the target: the best value any reached, and a
    target it would have met (two decimals, towards the untrained side)."""
    w, c = results["workload"], results["config"]
    runs = [r for r in results["runs"] if "error" not in r and not r.get("diverged")]
    if not runs or any(r["steps_to_target"] is not None for r in runs):
        return []
    higher = w["higher_is_better"]
    pick = max if higher else min
    best = {r["strategy"]: pick(r["eval_values"]) for r in runs if r["eval_values"]}
    if not best:
        return []
    strategy = pick(best, key=best.get)
    value = best[strategy]
    met = math.floor(value * 100) / 100 if higher else math.ceil(value * 100) / 100
    return [
        "",
        f"No strategy reached the target in {c['steps']} steps: the best {w['metric']} any "
        f"reached was {value:.4g} ({strategy}). Train longer (--steps), or give a target "
        f"that run met (e.g. --target {met:g}).",
    ]


def _measured(results: dict[str, Any]) -> list[str]:
    """The measured runs next to the simulated ones (``compare --measure``)."""
    m = results.get("measured")
    if not m:
        return []
    if "skipped" in m:
        return ["", f"Measured: nothing, {m['skipped']}."]
    nominal, fitted = m["nominal_network"], m["fitted_network"]
    lines = [
        "",
        f"Measured: {m['cluster']}, on {m['cores']} CPU cores. Simulated, nominal: "
        f"{nominal['bandwidth'] / 1e6:.4g} MB/s, "
        f"{1e6 * nominal['latency']:.3g} us per message, the {results['config']['compute']} "
        f"model. Calibrated: fitted to a sweep of all-reduces and permutes across the "
        f"processes, {fitted['bandwidth'] / 1e6:.4g} MB/s, {1e6 * fitted['latency']:.3g} us "
        f"per message and {1e6 * fitted['overhead']:.3g} us per collective"
        f"{' (per buffer)' if m['per_buffer_latency'] else ''}; compute x "
        f"{m['compute_scale']:.3g} (a probe step timed across the processes, "
        f"{_seconds(m['probe']['seconds'])}{_launches(m['probe'])}: each worker's gradient "
        "and update, only the loss averaged). Measured: the median launch of the processes "
        "where several ran. Error: simulated / measured - 1.",
        "",
        f"| strategy | steps | measured | {results['workload']['metric']} after | simulated, "
        "nominal | error | simulated, calibrated | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        x = r.get("measured", {})
        if "failed" in x:
            lines.append(f"| {r['strategy']} | failed: {x['failed']} | | | | | | |")
            continue
        if "seconds" not in x:
            lines.append(f"| {r['strategy']} | not measured: {x.get('skipped', '-')} | | | | | | |")
            continue
        lines.append(
            f"| {r['strategy']} | {x['steps']} | {_seconds(x['seconds'])} | {x['metric']:.4g} | "
            f"{_seconds(x['simulated_seconds'])} | {x['error']:+.0%} | "
            f"{_seconds(x['calibrated_seconds'])} | {x['calibrated_error']:+.0%}"
            + (f", in turn {x['in_turn_error']:+.0%} |" if "in_turn_error" in x else " |")
        )
    if any("in_turn_error" in r.get("measured", {}) for r in results["runs"]):
        lines += [
            "",
            "In turn: the strategy's permutes exchange both ways between two processes, "
            "priced as sent both ways at once and, after the comma, in turn: XLA:CPU's gloo "
            "sends such an exchange between 2 processes in turn when the process entering "
            "second has already taken in its peer's notice that it is ready to receive, "
            "else at once (`benchmarks/gloo_permutes.py`).",
        ]
    return lines


#: Bandwidths of the crossover sweep, bytes per second: 10 Mb/s to 100 Gb/s.
BANDWIDTHS = tuple(10 ** (7 + k / 8) / 8 for k in range(33))


def time_to_target(
    run: dict[str, Any],
    bandwidth: float,
    latency: float,
    *,
    overhead: float = 0.0,
    per_buffer: bool = False,
) -> float | None:
    """``run``'s simulated time to target on a network of ``bandwidth`` (bytes/s),
    ``latency`` (s per message) and ``overhead`` (s per collective): its compute, and its
    collectives' alpha-beta terms re-priced (``None``: never reached, diverged or failed).
    ``per_buffer``: a combined collective pays the latency and overhead per buffer
    (XLA:CPU's gloo)."""
    if run.get("compute_seconds_to_target") is None or run.get("diverged"):
        return None
    rounds, ops = ("calls", "op_buffers") if per_buffer else ("rounds", "ops")

    def seconds(per: str) -> float:
        comm = run[f"comm_{rounds}_per_{per}"] * latency
        comm += run[f"comm_busy_bytes_per_{per}"] / bandwidth
        return comm + run[f"comm_{ops}_per_{per}"] * overhead

    total = (
        run["compute_seconds_to_target"]
        + run["steps_to_target"] * seconds("step")
        + run["events_to_target"] * seconds("event")
    )
    if run.get("fetches_to_target") is not None:  # a parameter server's fetches
        total += run["fetches_to_target"] * seconds("fetch")
    return total


def exchanged_bytes_to_target(run: dict[str, Any]) -> float:
    """The bytes ``run``'s busiest device sends until the target in permutes that exchange
    both ways between two devices (``run.two_way``; 0 in a results.json from before
    they were counted)."""
    per = lambda name: run.get(f"comm_exchanged_bytes_per_{name}", 0.0)  # noqa: E731
    return run["steps_to_target"] * per("step") + run["events_to_target"] * per("event")


def crossovers(results: dict[str, Any]) -> list[tuple[str, str]]:
    """Per strategy, on the sweep ``BANDWIDTHS`` at the network's latency: where it reaches
    the target sooner than the synchronous baseline (``sync``, else the first strategy)."""
    runs = [r for r in results["runs"] if "error" not in r]
    if not runs:
        return []
    base = next((r for r in runs if r["strategy"] == "sync"), runs[0])
    latency = results["workload"]["network"]["latency"]
    out = []
    for r in runs:
        if r is base:
            continue
        wins = []
        for bw in BANDWIDTHS:
            mine, theirs = time_to_target(r, bw, latency), time_to_target(base, bw, latency)
            wins.append(mine is not None and (theirs is None or mine < theirs))
        if r.get("diverged"):
            verdict = "diverged"
        elif mine is None and not any(wins):
            verdict = "never reaches the target"
        elif all(wins):
            verdict = "faster at every bandwidth"
        elif not any(wins):
            verdict = "never faster"
        elif wins[0] and not wins[-1]:
            last = max(i for i, w in enumerate(wins) if w)
            verdict = f"faster below {_rate(BANDWIDTHS[last + 1])}"
        else:
            first = min(i for i, w in enumerate(wins) if w)
            verdict = f"faster from {_rate(BANDWIDTHS[first])}"
        out.append((r["strategy"], verdict))
    return out


def _rate(bandwidth: float) -> str:
    bits = 8 * bandwidth
    for unit, scale in (("Gb/s", 1e9), ("Mb/s", 1e6)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} b/s"


def _zoom(ax: Any, results: dict[str, Any], with_initial: bool) -> None:
    """Limits the metric's axis to the region near the target, where strategies differ
    (early evaluations far from it run off the edge)."""
    w = results["workload"]
    runs = [r for r in results["runs"] if "error" not in r]
    values = [v for r in runs for v in r["eval_values"] if math.isfinite(v)]
    if with_initial:
        values += [r["initial"] for r in runs]
    if not values:
        return
    if w["higher_is_better"]:
        low = w["target"] - 0.2 * max(abs(w["target"]), 1e-9)
        if min(values) < low < max(values):  # some evaluations near the target
            top = max(*values, w["target"])  # the target's line and label in view
            ax.set_ylim(bottom=low, top=top + 0.02 * (top - low))
    else:
        high = w["target"] * 1.5
        if min(values) < high < max(values):
            bottom = min(*values, w["target"])
            ax.set_ylim(top=high, bottom=bottom - 0.02 * (high - bottom))


def figures(results: dict[str, Any], out: Path) -> list[Path]:
    """Writes ``accuracy_vs_steps.png``, ``accuracy_vs_bytes.png`` and
    ``accuracy_vs_time.png`` to ``out`` (another metric's ``figure_stem`` in place of
    accuracy: ``bpb_vs_steps.png``).

    Returns:
      The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    w = results["workload"]
    metric = w["metric"]
    stem = figure_stem(metric)
    axes = (
        ("steps", "eval_steps", "training step", False, "vs training steps"),
        (
            "bytes",
            "eval_bytes",
            "bytes sent per device, cumulative (log scale)",
            True,
            "vs communication",
        ),
        (
            "time",
            "eval_seconds",
            f"simulated wall time on {results['config']['network']}, seconds (log scale)",
            True,
            "vs simulated wall time",
        ),
    )
    cmap = plt.get_cmap("tab10")
    paths = []
    for name, key, xlabel, log, what in axes:
        fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
        positive = False  # a log axis needs a value > 0 (one device sends no bytes)
        for i, r in enumerate(results["runs"]):
            if "error" in r:
                continue
            xs, ys = list(r[key]), list(r["eval_values"])
            if name == "steps":
                xs, ys = [0, *xs], [r["initial"], *ys]
            finite = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
            if not finite:  # a metric non-finite from the first evaluation: no curve
                continue
            xs, ys = map(list, zip(*finite, strict=True))
            positive |= any(x > 0 for x in xs)
            ax.plot(
                xs,
                ys,
                label=r["strategy"] + (" (diverged)" if r.get("diverged") else ""),
                color=cmap(i % 10),
                marker=_MARKERS[i % len(_MARKERS)],
                markersize=4,
                linewidth=1.5,
                linestyle=("-", "--", "-.", ":")[i // 10 % 4],
            )
        ax.axhline(w["target"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(
            f"target {w['target']:g}",
            (0.005, w["target"]),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(2, 3),
            color="grey",
            fontsize=8,
        )
        if log and positive:
            ax.set_xscale("log")
        _zoom(ax, results, name == "steps")
        ax.set_xlabel(xlabel if log and positive else xlabel.replace(" (log scale)", ""))
        ax.set_ylabel(metric + (" (higher is better)" if w["higher_is_better"] else ""))
        ax.set_title(
            f"{metric} {what}\n{subtitle(results)}\nnetwork {_network(results)}", fontsize=10
        )
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # every run failed: no curve, no legend
            ax.legend(title="strategy", loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
        path = out / f"{stem}_vs_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths.append(_bandwidth_figure(results, out, plt, cmap))
    return paths


def figure_stem(metric: str) -> str:
    """The figures' file names' stem for ``metric``: ``accuracy`` for an accuracy, ``bpb``
    for bits per byte, else the metric's words joined by ``_`` (``test_cross_entropy``)."""
    if "accuracy" in metric:
        return "accuracy"
    if "bits per byte" in metric:
        return "bpb"
    return re.sub(r"[^a-z0-9]+", "_", metric.lower()).strip("_") or "metric"


def _bandwidth_figure(results: dict[str, Any], out: Path, plt: Any, cmap: Any) -> Path:
    """``time_vs_bandwidth.png``: each strategy's simulated time to target on the sweep."""
    latency = results["workload"]["network"]["latency"]
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    gbits = [8 * bw / 1e9 for bw in BANDWIDTHS]
    for i, r in enumerate(results["runs"]):
        if "error" in r:
            continue
        times = [time_to_target(r, bw, latency) for bw in BANDWIDTHS]
        if all(x is None for x in times):
            continue
        ax.plot(
            gbits,
            [float("nan") if x is None else x for x in times],
            label=r["strategy"],
            color=cmap(i % 10),
            marker=_MARKERS[i % len(_MARKERS)],
            markevery=8,
            markersize=4,
            linestyle=("-", "--", "-.", ":")[i // 10 % 4],
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth per device, Gb/s (log scale)")
    ax.set_ylabel("simulated time to target, seconds (log scale)")
    ax.set_title(
        f"time to target vs bandwidth ({1e6 * latency:.3g} us per message)\n{subtitle(results)}",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    if ax.lines:
        ax.legend(title="strategy", loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
    else:
        ax.text(0.5, 0.5, "no strategy reached the target", transform=ax.transAxes, ha="center")
    path = out / "time_vs_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
