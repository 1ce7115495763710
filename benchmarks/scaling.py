"""Many workers on 8 devices: each strategy's step time against the worker count N, side
by side in one run; and the asynchronous simulator's mean staleness.

A 3-layer 64-wide MLP, 8 examples per worker (a global batch of 8N), on 8 simulated CPU
devices in one process, every strategy with ``workers=N`` (N / 8 workers a device):
``data_parallel`` (SGD), ``local_sgd`` (Adam, period 16), ``gossip`` (SGD, ring) and
``async_sgd`` (SGD, random compute times, spread 0.2) with its server replicated (the
default) and sharded (``server="sharded"``). Per N: compile seconds, the median of 15
steady-state steps after 3 warm-up steps (3 rounds of the strategies in turn, 5 steps
each after an untimed one, so a slow spell of the machine meets them all), async's step
over data parallelism's, and its mean staleness over those steps (Gupta et al.: about
N - 1 for naive async). Prints each one's growth exponent (the slope of log step time
against log N from 64 workers up), and whether each asynchronous server meets its targets:
at most 3x data parallelism's step at every N, growth at most N^1.2 (the sharded server met
both on 16 cores, 1.40x to 2.46x; on 2 cores the 8 devices' all-to-alls share the cores).
Writes benchmarks/results/scaling.md.

    python -P benchmarks/scaling.py [--workers 8,16,32,64,128,256,512,1024]
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl

HERE = Path(__file__).parent
ROUNDS, BLOCK = 3, 5  # rounds of the strategies in turn; steps timed per strategy a round
#: The asynchronous simulator's targets: its step at most this many times data parallelism's
#: at every N, and its growth exponent from 64 workers up at most this (1.2x linear).
TARGET_RATIO, TARGET_GROWTH = 3.0, 1.2


def _loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def measure(n: int) -> dict[str, dict[str, float]]:
    """Compile seconds, median step seconds (and async's staleness) at ``n`` workers."""
    loss_fn, params = ddl.flax.loss_from_module(
        ddl.models.MLP(64, [64, 64], 10, rngs=nnx.Rngs(0)), _loss
    )
    mesh = ddl.make_mesh(data=8)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(8 * n, 64)).astype(np.float32),
        "y": rng.integers(0, 10, 8 * n).astype(np.int32),
    }
    times = ddl.compute_times(1.0, spread=0.2, seed=0)
    strategies = {
        "data_parallel": ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, workers=n),
        "local_sgd": ddl.local_sgd(loss_fn, optax.adam(1e-3), mesh, period=16, workers=n),
        "gossip": ddl.gossip(loss_fn, optax.sgd(0.1), mesh, workers=n, consensus_every=0),
        "async_sgd": ddl.async_sgd(loss_fn, optax.sgd(0.01), mesh, workers=n, compute_time=times),
        "async_sharded": ddl.async_sgd(
            loss_fn, optax.sgd(0.01), mesh, workers=n, compute_time=times, server="sharded"
        ),
    }
    runs, out = {}, {}
    for name, strategy in strategies.items():
        state = strategy.init(params)
        tick = time.perf_counter()
        step = jax.jit(strategy.step, donate_argnums=0).lower(state, batch).compile()
        out[name] = {"compile": time.perf_counter() - tick}
        for _ in range(3):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs[name] = [step, state, [], []]
    # the strategies in turn, a block of steps each (the first, which finds the caches
    # holding another strategy's arrays, untimed), so a slow spell meets them all
    for _ in range(ROUNDS):
        for run in runs.values():
            step, _, seconds, staleness = run
            for timed in (False,) + (True,) * BLOCK:
                tick = time.perf_counter()
                run[1], metrics = step(run[1], batch)
                jax.block_until_ready(metrics)
                if timed:
                    seconds.append(time.perf_counter() - tick)
                    staleness.append(float(metrics.get("staleness_mean", np.nan)))
    for name, (_, _, seconds, staleness) in runs.items():
        out[name] |= {"step": statistics.median(seconds), "staleness": float(np.mean(staleness))}
    return out


def exponent(ns: list[int], seconds: list[float], start: int = 64) -> float:
    """The least-squares slope of log seconds against log N, from ``start`` workers up."""
    pairs = [(n, s) for n, s in zip(ns, seconds, strict=True) if n >= start]
    if len(pairs) < 2:
        return float("nan")
    x, y = np.log([p[0] for p in pairs]), np.log([p[1] for p in pairs])
    return float(np.polyfit(x, y, 1)[0])


def main() -> None:
    ddl.simulate_cpu_devices(8)  # whatever XLA_FLAGS the caller set
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="8,16,32,64,128,256,512,1024")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    ns = [int(w) for w in args.workers.split(",")]
    names = ("data_parallel", "local_sgd", "gossip", "async_sgd", "async_sharded")
    lines = [
        f"{os.cpu_count()} cores, 8 simulated CPU devices, one process. Step time in ms "
        "(compile seconds).",
        "",
        "| workers | "
        + " | ".join(names)
        + " | async / data parallel (replicated, sharded) | async mean staleness |",
        "|---" * (len(names) + 3) + "|",
    ]
    rows = {}
    for n in ns:
        t = rows[n] = measure(n)
        cells = [f"{1e3 * t[k]['step']:.1f} ({t[k]['compile']:.1f})" for k in names]
        ratios = [t[k]["step"] / t["data_parallel"]["step"] for k in ("async_sgd", "async_sharded")]
        staleness = t["async_sgd"]["staleness"]
        ratio = ", ".join(f"{r:.2f}x" for r in ratios)
        lines.append(f"| {n} | {' | '.join(cells)} | {ratio} | {staleness:.1f} |")
        print(lines[-1], flush=True)
    lines.append("")
    for name in names:
        growth = exponent(ns, [rows[n][name]["step"] for n in ns])
        if np.isnan(growth):
            lines.append(f"{name}: no growth exponent (it needs two worker counts >= 64).")
        else:
            lines.append(f"{name}: step time grows as N^{growth:.2f} from 64 workers up.")
    for name in ("async_sgd", "async_sharded"):
        worst = max(rows[n][name]["step"] / rows[n]["data_parallel"]["step"] for n in ns)
        growth = exponent(ns, [rows[n][name]["step"] for n in ns])
        met = worst <= TARGET_RATIO and not growth > TARGET_GROWTH  # nan: not measured
        lines.append(
            f"{name}: at most {worst:.2f}x data parallelism's step (target <= {TARGET_RATIO:g}x "
            f"at every N), growth N^{growth:.2f} (target <= N^{TARGET_GROWTH:g}): "
            f"{'met' if met else 'NOT met'}."
        )
    print("\n".join(lines[-len(names) - 2 :]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
