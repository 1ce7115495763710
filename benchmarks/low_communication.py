"""The papers' orderings that can hold at this size, checked on the bundled text corpus.

The byte-level GPT of ``ddl-jax compare --workload text-gpt`` (8 simulated CPU devices,
global batch 64 windows of 64 bytes), trained for ``--steps`` steps from the same weights on
the same batches, per seed:

* DiLoCo's outer optimizer (Douillard et al. 2023, Table 4): Nesterov SGD (lr 0.7, momentum
  0.9) against plain outer SGD (lr 0.7) and parameter averaging (outer SGD lr 1), inner
  AdamW 3e-3, H = 16. The claim: Nesterov reaches the lowest validation bits per byte.
* Streaming DiLoCo's peak bandwidth (Douillard et al. 2025): the bytes of its busiest
  synchronising branch against DiLoCo's, from the compiled HLO, for P = 2 and 4 fragments:
  the claim is 1/P.

Prints a markdown table of final validation bits per byte (lower is better) and the
bytes ratios::

    python benchmarks/low_communication.py              # 300 steps, 2 seeds: about 8 minutes
    python benchmarks/low_communication.py --steps 100 --seeds 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)

import jax  # noqa: E402
import optax  # noqa: E402

from ddl_jax.compare.workloads import make_workload  # noqa: E402

PERIOD = 16
OUTER = {
    "Nesterov SGD 0.7, momentum 0.9 (DiLoCo)": lambda: optax.sgd(0.7, momentum=0.9, nesterov=True),
    "SGD 0.7": lambda: optax.sgd(0.7),
    "SGD 1.0 (parameter averaging)": lambda: optax.sgd(1.0),
}


def final_bits(strategy, workload, steps: int) -> float:
    _, history = ddl.fit(
        strategy,
        workload.params,
        workload.batches,
        steps=steps,
        eval_fn=workload.evaluate,
        eval_every=steps,
        progress=False,
    )
    return float(history[-1]["eval"])


def outer_optimizers(steps: int, seeds: int, mesh) -> None:
    print(
        f"| outer optimizer (H = {PERIOD}, inner AdamW 3e-3) | "
        + " | ".join(f"seed {s}" for s in range(seeds))
        + " | mean |"
    )
    print("|---|" + "---|" * (seeds + 1))
    for name, outer in OUTER.items():
        values = []
        for seed in range(seeds):
            workload = make_workload("text-gpt", seed=seed, devices=8)
            strategy = ddl.local_sgd(
                workload.loss_fn,
                optax.adamw(3e-3),
                mesh,
                period=PERIOD,
                outer_optimizer=outer(),
            )
            values.append(final_bits(strategy, workload, steps))
        cells = " | ".join(f"{v:.4f}" for v in values)
        print(f"| {name} | {cells} | {statistics.mean(values):.4f} |", flush=True)


def peak_bytes(mesh) -> None:
    workload = make_workload("text-gpt", seed=0, devices=8)
    batch = next(workload.batches(0))

    def busiest(strategy) -> float:
        stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(workload.params), batch)
        return max(stats.branches.values())

    inner, outer = optax.adamw(3e-3), optax.sgd(0.7, momentum=0.9, nesterov=True)
    options = {"period": PERIOD, "outer_optimizer": outer}
    diloco = busiest(ddl.local_sgd(workload.loss_fn, inner, mesh, **options))
    print("\n| strategy | busiest synchronising step (bytes per device) | / DiLoCo's | 1 / P |")
    print("|---|---|---|---|")
    print(f"| DiLoCo, H = {PERIOD} | {diloco:,.0f} | 1.000 | 1 |")
    for fragments in (2, 4):
        streaming = ddl.streaming_diloco(
            workload.loss_fn, inner, mesh, fragments=fragments, overlap=1, mix=0.5, **options
        )
        peak = busiest(streaming)
        print(
            f"| Streaming DiLoCo, P = {fragments} | {peak:,.0f} | {peak / diloco:.3f} | "
            f"{1 / fragments:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    if args.steps < PERIOD:
        parser.error(
            f"--steps {args.steps} runs no outer step (H = {PERIOD}): give at least {PERIOD}."
        )
    started = time.perf_counter()
    mesh = ddl.make_mesh(data=8)
    print(f"text-gpt, 8 simulated CPU devices, {args.steps} steps; validation bits per byte\n")
    outer_optimizers(args.steps, args.seeds, mesh)
    peak_bytes(mesh)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
