"""DiLoCo over FSDP islands against flat DiLoCo: the GPT on the bundled text corpus.

Two islands of 4 devices (FSDP stage 3 inside each) and flat DiLoCo with 2 workers train
the same model on the same global batches; the islands' math is flat DiLoCo's with each
worker's gradient computed by its island (``tests/test_islands.py`` checks that exactly on
a model without dropout), so the validation bits per byte should agree within the noise of
dropout masks, which fold in each device's own index.

    python benchmarks/islands.py --steps 300 --island-devices 4

On 8 simulated CPU devices sharing 2 cores, ``--island-devices 4`` has deadlocked inside
XLA:CPU (one island's devices waiting in a collective across islands, three of the other's
in an FSDP all-gather, the fourth never arriving: its collectives' threads exhausted);
the unit tests' smaller models have not. Use real devices, or fewer per island.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import optax

import ddl_jax as ddl
from ddl_jax.compare.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--period", type=int, default=16)
    parser.add_argument("--island-devices", type=int, default=4)
    args = parser.parse_args()
    workload = make_workload("text-gpt", seed=0, devices=2 * args.island_devices)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    inner_opt = optax.adamw(3e-3)
    island_mesh = ddl.make_mesh(island=2, data=args.island_devices)
    strategies = {
        f"DiLoCo over FSDP stage 3 (island=2, data={args.island_devices})": ddl.local_sgd(
            inner=ddl.fsdp(workload.loss_fn, inner_opt, island_mesh, stage=3),
            period=args.period,
            outer_optimizer=outer,
        ),
        "flat DiLoCo, 2 workers": ddl.local_sgd(
            workload.loss_fn,
            inner_opt,
            ddl.make_mesh(data=2),
            period=args.period,
            outer_optimizer=outer,
        ),
    }
    print(f"| strategy | validation bits per byte after {args.steps} steps | seconds |")
    print("|---|---|---|")
    for name, strategy in strategies.items():
        start = time.perf_counter()
        state = strategy.init(workload.params)
        step = jax.jit(strategy.step, donate_argnums=0)
        for batch in itertools.islice(workload.batches(0), args.steps):
            state, _ = step(state, batch)
        bits = float(workload.evaluate(strategy.params(state)))
        print(f"| {name} | {bits:.4f} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
