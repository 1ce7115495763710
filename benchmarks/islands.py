"""DiLoCo over FSDP islands against flat DiLoCo: the GPT on the bundled text corpus.

Two islands of 4 devices (FSDP stage 3 inside each, or data parallelism) and flat DiLoCo
with 2 workers train the same model on the same global batches with ``ddl.fit``; the
islands' math is flat DiLoCo's with each worker's gradient computed by its island
(``tests/test_islands.py`` checks that exactly on a model without dropout). Dropout masks
fold in each device's index, so the islands draw other masks than the 2 flat workers: the
gap between the data-parallel islands and flat DiLoCo is that noise, and FSDP's islands
(the same masks as data parallelism's) should sit within it.

    python benchmarks/islands.py --steps 300
"""

from __future__ import annotations

import argparse
import time

import optax

import ddl_jax as ddl
from ddl_jax.compare.workloads import make_workload


def main() -> None:
    ddl.simulate_cpu_devices(8)  # whatever XLA_FLAGS the caller set
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--period", type=int, default=16)
    args = parser.parse_args()
    workload = make_workload("text-gpt", seed=0, devices=8)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    inner_opt = optax.adamw(3e-3)
    island_mesh = ddl.make_mesh(island=2, data=4)
    strategies = {
        "DiLoCo over FSDP stage 3 (island=2, data=4)": ddl.local_sgd(
            inner=ddl.fsdp(workload.loss_fn, inner_opt, island_mesh, stage=3),
            period=args.period,
            outer_optimizer=outer,
        ),
        "DiLoCo over data parallelism (island=2, data=4)": ddl.local_sgd(
            inner=ddl.data_parallel(workload.loss_fn, inner_opt, island_mesh),
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
    print(f"| strategy | validation bits per byte after {args.steps} steps | last loss | seconds |")
    print("|---|---|---|---|")
    for name, strategy in strategies.items():
        start = time.perf_counter()
        state, history = ddl.fit(
            strategy, workload.params, workload.batches, steps=args.steps, progress=False,
            log_every=50,
        )  # fmt: skip
        bits = float(workload.evaluate(strategy.params(state)))
        loss = history[-1]["loss"]
        seconds = time.perf_counter() - start
        print(f"| {name} | {bits:.4f} | {loss:.4f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
