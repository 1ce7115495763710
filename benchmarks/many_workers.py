"""Partial communication as the worker count grows: accuracy, staleness and consensus
distance against N, 8 to 1,024 workers simulated on 8 devices.

The digits MLP workload of ``ddl-jax compare`` (its model, test set and Adam learning
rate; 16 examples per worker each step, drawn with replacement from the 1,437 training
images, as 1,024 workers' batches outnumber them), every strategy with ``workers=N``
(N / 8 workers a device): naive ``async`` SGD, ``softsync(8)``, ``ssp(4)`` (reading
its cached copy, Ho et al.'s SSPTable, and fetching before every gradient; random
compute times, spread 0.2), async and softsync(8) with Zhang et al.'s staleness-aware
learning rate (``ddl.scale_by_staleness()`` after Adam: lr / tau), ``gossip`` on a ring,
and local SGD (period 16) whose
synchronisations drop 10% of the workers' messages and whose workers leave with
probability 10% a step. Each trains ``--steps`` steps; per run: the test accuracy after
them, the async family's mean staleness over the last 10 steps, and the replicas'
consensus distance at the end (gossip's as it measures it). Writes
benchmarks/results/many_workers.md.

    python -P benchmarks/many_workers.py [--workers 8,64,256,1024] [--steps 150]
        [--strategies NAME,...]
"""

import argparse
import time
from pathlib import Path

import jax
import numpy as np
import optax

import ddl_jax as ddl
from ddl_jax.compare import make_workload
from ddl_jax.compare.specs import LEARNING_RATE

HERE = Path(__file__).parent


def strategies(loss_fn, mesh, n):
    """The strategies of the study, each with ``n`` workers on ``mesh``."""
    adam = optax.adam(LEARNING_RATE)
    aware = optax.chain(adam, ddl.scale_by_staleness())  # Zhang et al.: lr / tau
    times = ddl.compute_times(1.0, spread=0.2, seed=0)
    # Adam acts elementwise: a sharded server is the same run, each device a block
    server = {"compute_time": times, "workers": n, "server": "sharded"}
    softsync = {"protocol": ddl.softsync(8), **server}
    return {
        "async": ddl.async_sgd(loss_fn, adam, mesh, **server),
        "softsync:8": ddl.async_sgd(loss_fn, adam, mesh, **softsync),
        "ssp:4": ddl.async_sgd(loss_fn, adam, mesh, protocol=ddl.ssp(4), **server),
        "ssp:4 (fresh reads)": ddl.async_sgd(
            loss_fn, adam, mesh, protocol=ddl.ssp(4, reads="fresh"), **server
        ),
        "async, lr / tau": ddl.async_sgd(loss_fn, aware, mesh, **server),
        "softsync:8, lr / tau": ddl.async_sgd(loss_fn, aware, mesh, **softsync),
        "gossip:ring": ddl.gossip(loss_fn, adam, mesh, workers=n, consensus_every=1),
        "local:16, drop 0.1, churn 0.1": ddl.local_sgd(
            loss_fn, adam, mesh, period=16, drop=0.1, churn=0.1, workers=n
        ),
    }


def run(n: int, steps: int, only: list[str] | None) -> dict[str, dict[str, float]]:
    workload = make_workload("digits-mlp", seed=0, devices=8)
    mesh = ddl.make_mesh(data=8)
    out, study = {}, strategies(workload.loss_fn, mesh, n)
    if only is not None and not set(only) <= set(study):
        raise SystemExit(f"--strategies: {sorted(set(only) - set(study))} not in {list(study)}")
    for name, strategy in study.items():
        if only is not None and name not in only:
            continue
        state, step = strategy.init(workload.params), jax.jit(strategy.step, donate_argnums=0)
        train, _ = ddl.data.digits(flatten=True)  # 16 examples a worker, with replacement
        stream, history = ddl.data.batches(train, 16 * n, replace=True), []
        tick = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, next(stream))
            history.append(jax.device_get(metrics))
        seconds = (time.perf_counter() - tick) / steps
        consensus = history[-1].get("consensus_distance")
        if consensus is None and name.startswith("local"):
            consensus = ddl.consistency.consensus_distance(jax.device_get(state.params))
        staleness = [h["staleness_mean"] for h in history[-10:] if "staleness_mean" in h]
        out[name] = {
            "accuracy": float(workload.evaluate(strategy.params(state))),
            "staleness": float(np.mean(staleness)) if staleness else float("nan"),
            "consensus": float("nan") if consensus is None else float(consensus),
            "seconds": seconds,
        }
        print(f"N={n} {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ddl.simulate_cpu_devices(8)  # whatever XLA_FLAGS the caller set
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="8,64,256,1024")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--strategies", help="comma-separated names of the study (default: all)")
    args = parser.parse_args()
    ns = [int(w) for w in args.workers.split(",")]
    only = None if args.strategies is None else args.strategies.split(",")
    results = {n: run(n, args.steps, only) for n in ns}
    names = list(results[ns[0]])
    lines = [
        f"digits MLP, {args.steps} steps, 16 examples per worker, 8 simulated CPU devices. "
        "Cells: test accuracy; staleness (async family) or consensus distance (replicas).",
        "",
        "| strategy | " + " | ".join(f"N = {n}" for n in ns) + " |",
        "|---" * (len(ns) + 1) + "|",
    ]
    for name in names:
        cells = []
        for n in ns:
            r = results[n][name]
            extra = r["staleness"] if name[0] in "as" else r["consensus"]
            label = "staleness" if name[0] in "as" else "consensus"
            cells.append(f"{r['accuracy']:.3f}; {label} {extra:.3g}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "many_workers.md").write_text(text)


if __name__ == "__main__":
    main()
