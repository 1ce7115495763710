"""Gradient compressors side by side: bytes on the wire against accuracy on the digits.

Eight workers train the digits MLP 64-128-128-10 with ``data_parallel`` and Adam 3e-3,
the same data order and seed for every reducer: the uncompressed mean (XLA's all-reduce
and the explicit float32 ring), then each ``ddl.compression`` reducer. For each: bytes each
device sends per step (read from the compiled step's HLO), their ratio to the dense fp32
ring, the test accuracy after ``--steps`` steps and its distance to the uncompressed run,
and the first evaluated step (every 10) reaching 90% test accuracy. A second table gives
the HLO byte ratios for the MLP 784-1024-1024-10 at N=8 (the sizes the unit tests assert).
Writes benchmarks/results/compression.{md,json}.

    python benchmarks/gradient_compression.py [--steps 400]
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl
from ddl_jax import compression as C

EVAL_EVERY = 10


def reducers():
    return {
        "allreduce_mean (psum)": ddl.allreduce_mean(),
        "allreduce_mean (ring, dense fp32)": ddl.allreduce_mean(algorithm="ring"),
        "cast(bfloat16)": C.cast(jnp.bfloat16),
        "sign()": C.sign(),
        "threshold(0.5, capacity=0.02)": C.threshold(0.5, capacity=0.02),
        "top_k(0.01)": C.top_k(0.01),
        "top_k(0.001, warmup_steps=100)": C.top_k(0.001, warmup_steps=100),
        "qsgd(4)": C.qsgd(4),
        'qsgd(4, scale="max")': C.qsgd(4, scale="max"),
        "qsgd(1)": C.qsgd(1),
        'qsgd(1, scale="max")': C.qsgd(1, scale="max"),
        "power_sgd(4)": C.power_sgd(4, start_iter=0),
    }


def loss_of(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def train(strategy, params, batches, steps, accuracy):
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    curve = []
    for i, batch in zip(range(1, steps + 1), batches, strict=False):
        state, _ = step(state, batch)
        if i % EVAL_EVERY == 0 or i == steps:
            curve.append((i, float(accuracy(strategy.params(state)))))
    return curve


def bytes_per_step(strategy, params, batch) -> float:
    """Bytes each device sends per step after any warm-up, from the compiled step's HLO."""
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    # top_k's warm-up phases are branches of the step; the last, smallest one is its target.
    return stats.bytes_per_device + (min(stats.branches.values()) if stats.branches else 0)


def large_model_ratios(mesh) -> dict[str, float]:
    """Dense fp32 ring bytes / each reducer's bytes, MLP 784-1024-1024-10, from the HLO."""
    model = ddl.models.MLP(784, [1024, 1024], 10, rngs=nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(model, loss_of)
    batch = {"image": np.zeros((64, 784), np.float32), "label": np.zeros(64, np.int32)}
    sent = {}
    for name, reducer in reducers().items():
        strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
        sent[name] = bytes_per_step(strategy, params, batch)
    dense = sent["allreduce_mean (ring, dense fp32)"]
    return {name: dense / b for name, b in sent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ddl.simulate_cpu_devices(8)

    train_set, test_set = ddl.data.digits()
    model = ddl.models.MLP(64, [128, 128], 10, rngs=nnx.Rngs(0))
    loss_fn, params = ddl.flax.loss_from_module(model, loss_of)
    apply, _ = ddl.flax.split(model)
    accuracy = jax.jit(
        lambda p: jnp.mean(jnp.argmax(apply(p, test_set["image"]), -1) == test_set["label"])
    )
    mesh = ddl.make_mesh(data=8)
    batch_size = 8 * args.per_worker_batch
    example = next(ddl.data.batches(train_set, batch_size))

    rows = []
    for name, reducer in reducers().items():
        strategy = ddl.data_parallel(loss_fn, optax.adam(3e-3), mesh, reducer=reducer)
        curve = train(
            strategy, params, ddl.data.batches(train_set, batch_size, seed=0), args.steps, accuracy
        )
        sent = bytes_per_step(strategy, params, example)
        reached = next((step for step, acc in curve if acc >= 0.9), None)
        rows.append(
            {
                "reducer": name,
                "bytes_per_step": sent,
                "accuracy": curve[-1][1],
                "steps_to_90": reached,
            }
        )
        print(f"{name}: accuracy {curve[-1][1]:.4f}, {sent:,.0f} bytes per step, 90% at {reached}")

    base = rows[0]
    dense = rows[1]["bytes_per_step"]
    large = large_model_ratios(mesh)
    lines = [
        f"Digits MLP 64-128-128-10, 8 workers x {args.per_worker_batch} examples, Adam 3e-3, "
        f"{args.steps} steps, same data order and seed; bytes from the compiled step's HLO.",
        "",
        "| reducer | bytes / device / step | vs dense fp32 ring | test accuracy | "
        "vs uncompressed (points) | steps to 90% | ring / reducer bytes, MLP 784-1024-1024-10 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['reducer']} | {r['bytes_per_step']:,.0f} | {dense / r['bytes_per_step']:.1f}x | "
            f"{r['accuracy']:.4f} | {100 * (r['accuracy'] - base['accuracy']):+.2f} | "
            f"{r['steps_to_90'] or 'never'} | {large[r['reducer']]:.1f}x |"
        )
        r["large_mlp_ratio"] = large[r["reducer"]]
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression.md").write_text(table)
    (args.out / "compression.json").write_text(json.dumps(rows, indent=2))
    print(table)


if __name__ == "__main__":
    main()
