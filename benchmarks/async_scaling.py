"""The asynchronous simulator's step time against the worker count, beside data
parallelism's, side by side in one run.

A 3-layer 64-wide MLP, 8 examples per worker, plain SGD; W simulated CPU devices for W
workers (a process per W, as the device count is fixed when JAX starts); the median of 7
steady-state steps after 3 warm-up steps. Writes benchmarks/results/async_scaling.md.

    python -P benchmarks/async_scaling.py [--workers 8,32,64]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def measure(n: int) -> dict[str, float]:
    """Median step seconds of ``data_parallel`` and ``async_sgd`` on ``n`` devices."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import ddl_jax as ddl

    def loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(
        ddl.models.MLP(64, [64, 64], 10, rngs=nnx.Rngs(0)), loss
    )
    mesh = ddl.make_mesh(data=n)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(8 * n, 64)).astype(np.float32),
        "y": rng.integers(0, 10, 8 * n).astype(np.int32),
    }
    out = {}
    for name, strategy in (
        ("data_parallel", ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh)),
        ("async_sgd", ddl.async_sgd(loss_fn, optax.sgd(0.1), mesh)),
    ):
        state, step = strategy.init(params), jax.jit(strategy.step)
        for _ in range(3):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(7):
            tick = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - tick)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="8,32,64")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    lines = [
        "| workers | data_parallel (ms) | async_sgd (ms) | async / data parallel |",
        "|---|---|---|---|",
    ]
    for n in (int(w) for w in args.workers.split(",")):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        done = subprocess.run(
            [sys.executable, "-P", __file__, "--one", str(n)],
            env=env, capture_output=True, text=True, timeout=1800, check=True,
        )  # fmt: skip
        t = json.loads(done.stdout.strip().splitlines()[-1])
        ratio = t["async_sgd"] / t["data_parallel"]
        lines.append(
            f"| {n} | {1e3 * t['data_parallel']:.1f} | {1e3 * t['async_sgd']:.1f} | {ratio:.1f}x |"
        )
        print(lines[-1], flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "async_scaling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
