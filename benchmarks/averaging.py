"""Model averaging side by side on the bundled digits: accuracy against communication.

Eight workers, the same data order, seed and inner optimizer (Adam 3e-3; AdamW for DiLoCo)
for ``data_parallel``, ``local_sgd`` with H = 4, 16, 64, DiLoCo with H = 16 (outer SGD
0.7, Nesterov momentum 0.9) and gossip on a ring and an exponential graph (D-PSGD; on
the ring also adapting then combining, ``order="adapt_then_combine"``; and one peer a
step on the exponential graph). For each:
final test accuracy of the averaged model, bytes each device sends over the whole run
(read from the compiled step's HLO: synchronisations are a conditional branch, priced
for the steps that take it), and that communication's time on 1 Gb/s Ethernet
(alpha-beta model; computation is the same for all and left out). Writes
benchmarks/results/averaging.{md,json}.

    python benchmarks/averaging.py [--steps 400]
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import ddl_jax as ddl


def build(name, loss_fn, mesh):
    adam = optax.adam(3e-3)
    if name == "data_parallel":
        return ddl.data_parallel(loss_fn, adam, mesh), None
    if name.startswith("local_sgd"):
        period = int(name.split("H=")[1])
        return ddl.local_sgd(loss_fn, adam, mesh, period=period), period
    if name.startswith("diloco"):
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        return ddl.local_sgd(loss_fn, optax.adamw(3e-3), mesh, period=16, outer_optimizer=outer), 16
    _, topology, *order = name.split(" ")
    order = order[0] if order else "dpsgd"
    return ddl.gossip(loss_fn, adam, mesh, topology=topology, order=order, consensus_every=0), None


def communication(strategy, params, batch, period, steps, network):
    """Bytes per device and seconds on ``network`` for ``steps`` steps, syncing every ``period``
    (``None``: every step; a one-peer gossip's branches, one a peer, one of them a step)."""
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    plain = ddl.sim.estimate_step_time(stats, network)
    if period is None:
        rounds = list(stats.branches)  # consensus_every=0: the branches are peers' rounds
        sent = stats.bytes_per_device + sum(stats.branches.values()) / max(len(rounds), 1)
        each = [ddl.sim.estimate_step_time(stats, network, branch=b) for b in rounds]
        return sent * steps, (sum(each) / len(each) if each else plain) * steps
    syncs = steps // period
    sync_label = max(stats.branches, key=stats.branches.get)
    sync_bytes = stats.bytes_per_device + stats.branches[sync_label]
    sync_time = ddl.sim.estimate_step_time(stats, network, branch=sync_label)
    return (
        stats.bytes_per_device * (steps - syncs) + sync_bytes * syncs,
        plain * (steps - syncs) + sync_time * syncs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ddl.simulate_cpu_devices(8)

    train, test = ddl.data.digits()
    model = ddl.models.MLP(64, [128, 128], 10, rngs=nnx.Rngs(0))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    apply, _ = ddl.flax.split(model)

    def accuracy(p):
        return jnp.mean(jnp.argmax(apply(p, test["image"]), -1) == test["label"])

    mesh = ddl.make_mesh(data=8)
    batch_size = 8 * args.per_worker_batch
    names = [
        "data_parallel",
        "local_sgd H=4",
        "local_sgd H=16",
        "local_sgd H=64",
        "diloco H=16",
        "gossip ring",
        "gossip ring adapt_then_combine",
        "gossip exponential",
        "gossip one_peer_exponential",
    ]
    rows = []
    for name in names:
        strategy, period = build(name, loss_fn, mesh)
        _, history = ddl.fit(
            strategy,
            params,
            ddl.data.batches(train, batch_size, seed=0),
            steps=args.steps,
            eval_fn=accuracy,
            log_every=50,
            progress=False,
        )
        sent, seconds = communication(
            strategy,
            params,
            next(ddl.data.batches(train, batch_size)),
            period,
            args.steps,
            ddl.sim.ETHERNET_1G,
        )
        rows.append(
            {
                "strategy": name,
                "accuracy": history[-1]["eval"],
                "final_loss": history[-1]["loss"],
                "bytes_per_device": sent,
                "seconds_1gbps": seconds,
            }
        )
        print(f"{name}: accuracy {rows[-1]['accuracy']:.4f}, {sent / 1e6:.1f} MB per device")

    base = rows[0]
    lines = [
        f"Digits MLP 64-128-128-10, 8 workers x {args.per_worker_batch} examples, "
        f"{args.steps} steps, same data order and seed.",
        "",
        "| strategy | test accuracy | vs sync (points) | last-batch loss | MB sent / device | "
        "vs sync | comm time on 1 Gb/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['accuracy']:.4f} | "
            f"{100 * (r['accuracy'] - base['accuracy']):+.2f} | {r['final_loss']:.4f} | "
            f"{r['bytes_per_device'] / 1e6:.1f} | "
            f"{r['bytes_per_device'] / base['bytes_per_device']:.3f} | "
            f"{r['seconds_1gbps']:.2f} s |"
        )
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "averaging.md").write_text(table)
    (args.out / "averaging.json").write_text(json.dumps(rows, indent=2))
    print(table)


if __name__ == "__main__":
    main()
