"""Asynchronous SGD on the bundled digits: test accuracy against simulated wall time.

Eight workers, one of them a 4x straggler (compute times 1,1,1,1,1,1,1,4 simulated time
units per gradient of 16 examples), the same data order, seed and server optimizer
(SGD), for: synchronous SGD (``softsync(8)``), plain async, async with
``scale_by_staleness("inverse")`` (lr / tau), ``softsync(2)`` (2 gradients per update:
Gupta et al.'s 4-softsync), ``ssp(2)`` and Downpour (fetch every 2, push the sum of every
2), at each of a few SGD learning rates. Each runs for the same simulated time budget;
test accuracy of the server's parameters is recorded along the way. "Diverged": the loss
turned non-finite or the final test accuracy is below 0.2 (chance is 0.1). Writes
benchmarks/results/async.{md,json,png} (the figure needs matplotlib).

    python -P benchmarks/async.py [--time 300 --lr 0.1 0.5 1.0]

(``-P`` keeps ``benchmarks/`` off ``sys.path``, so that no script there shadows a module.)
"""

import argparse
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl

TIMES = [1.0] * 7 + [4.0]


def protocols(lr: float) -> dict:
    sgd = optax.sgd(lr)
    return {
        "synchronous (softsync(8))": (ddl.softsync(8), sgd),
        "async": ("async", sgd),
        "async + scale_by_staleness": ("async", optax.chain(ddl.scale_by_staleness(), sgd)),
        "softsync(2)": (ddl.softsync(2), sgd),
        "ssp(2)": (ddl.ssp(2), sgd),
        "downpour(2, 2)": (ddl.downpour(2, 2, local_lr=lr), sgd),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", type=float, default=300.0, help="simulated time budget")
    parser.add_argument("--lr", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--eval-every", type=float, default=10.0, help="simulated time")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ddl.simulate_cpu_devices(8)

    train, test = ddl.data.digits()
    model = ddl.models.MLP(64, [128], 10, rngs=nnx.Rngs(0))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    apply, _ = ddl.flax.split(model)
    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(apply(p, test["image"]), -1) == test["label"]))
    mesh = ddl.make_mesh(data=8)

    rows, curves = [], {lr: {} for lr in args.lr}
    runs = [(lr, *item) for lr in args.lr for item in protocols(lr).items()]
    for lr, name, (protocol, optimizer) in runs:
        strategy = ddl.async_sgd(loss_fn, optimizer, mesh, compute_time=TIMES, protocol=protocol)
        step = jax.jit(strategy.step, donate_argnums=0)
        state = strategy.init(params)
        curve = [(0.0, float(accuracy(strategy.params(state))))]
        pushes = tau_sum = tau_max = 0.0
        finite, steps, clock = True, 0, 0.0
        data = ddl.data.batches(train, 8 * args.per_worker_batch, seed=0)
        while clock < args.time:
            state, metrics = step(state, next(data))
            m = jax.device_get(metrics)
            steps, clock = steps + 1, float(m["wall_clock"])
            pushes += float(m["pushes"])
            tau_sum += float(m["staleness_mean"] * m["pushes"])
            tau_max = max(tau_max, float(m["staleness_max"]))
            finite = finite and math.isfinite(float(m["loss"]))
            if clock >= curve[-1][0] + args.eval_every or clock >= args.time:
                curve.append((clock, float(accuracy(strategy.params(state)))))
        accs = [a for _, a in curve]
        rows.append(
            {
                "lr": lr,
                "protocol": name,
                "final_accuracy": accs[-1],
                "best_accuracy": max(accs),
                "simulated_time": clock,
                "steps": steps,
                "pushes": pushes,
                "updates_applied": float(m["updates_applied"]),
                "staleness_mean": tau_sum / pushes,
                "staleness_max": tau_max,
                "final_loss": float(m["loss"]),
                "finite": finite,
                "diverged": not finite or accs[-1] < 0.2,
            }
        )
        curves[lr][name] = curve
        print(f"lr {lr:g}, {name}: accuracy {accs[-1]:.4f} at t={clock:.0f}, {steps} steps")

    lines = [
        f"Digits MLP 64-128-10, 8 workers x {args.per_worker_batch} examples per gradient, "
        f"compute times {TIMES} (one 4x straggler), SGD, simulated time budget "
        f"{args.time:g}, same data order and seed.",
        "",
        "| SGD lr | protocol | test accuracy | best | pushes | server updates | "
        "mean staleness | max staleness | steps | final loss | diverged |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['protocol']} | {r['final_accuracy']:.4f} | "
            f"{r['best_accuracy']:.4f} | "
            f"{r['pushes']:.0f} | {r['updates_applied']:.0f} | {r['staleness_mean']:.2f} | "
            f"{r['staleness_max']:.0f} | {r['steps']} | {r['final_loss']:.3g} | "
            f"{'yes' if r['diverged'] else 'no'} |"
        )
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async.md").write_text(table)
    curves_json = {f"{lr:g}": c for lr, c in curves.items()}
    (args.out / "async.json").write_text(
        json.dumps({"rows": rows, "curves": curves_json}, indent=2)
    )
    print(table)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure.")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(args.lr), figsize=(4.2 * len(args.lr), 4.2), sharey=True, squeeze=False
    )
    for ax, (lr, by_name) in zip(axes[0], curves.items(), strict=True):
        for name, curve in by_name.items():
            t, a = np.array(curve).T
            ax.plot(t, a, label=name)
        ax.set(xlabel="simulated wall time (one fast gradient = 1)", title=f"SGD lr {lr:g}")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("test accuracy")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.suptitle("Async SGD on digits, 8 workers, one 4x straggler")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(args.out / "async.png", dpi=120)
    print(f"figure: {args.out / 'async.png'}")


if __name__ == "__main__":
    main()
