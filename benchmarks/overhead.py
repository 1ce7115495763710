"""Overhead of ``ddl.data_parallel`` against a hand-written ``shard_map`` + ``pmean`` step.

Both steps train the same MLP 784-1024-1024-10 with Adam on the same sharded batch
(256 examples per worker); they run interleaved, round by round, so drift in the machine's
speed hits both alike. Prints the median step time of each and their ratio (target <= 1.03),
and writes JSON and markdown to benchmarks/results/.

    python benchmarks/overhead.py [--devices 8] [--rounds 15] [--steps 3]
"""

import argparse
import collections
import json
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import ddl_jax as ddl

#: ddl's step time over the hand-written one's, at most.
TARGET = 1.03


def hand_written_step(loss_fn, optimizer, mesh):
    """The minimal correct data-parallel step, written directly against JAX."""

    def body(params, opt_state, batch):
        local = jax.lax.pcast(params, "data", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, batch)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    return jax.jit(step, donate_argnums=(0, 1))


def hlo_op_counts(jitted, *args) -> collections.Counter:
    """How many of each HLO op the compiled program holds (names and metadata aside)."""
    text = jitted.lower(*args).compile().as_text()
    return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--per-worker-batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps of each per round")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ddl.simulate_cpu_devices(args.devices)

    model = ddl.models.MLP(784, [1024, 1024], 10, rngs=nnx.Rngs(0))

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    optimizer = optax.adam(1e-3)
    mesh = ddl.make_mesh(data=args.devices)
    rng = np.random.default_rng(0)
    size = args.devices * args.per_worker_batch
    batch = jax.device_put(
        {
            "image": rng.normal(size=(size, 784)).astype(np.float32),
            "label": rng.integers(0, 10, size).astype(np.int32),
        },
        NamedSharding(mesh, P("data")),
    )

    strategy = ddl.data_parallel(loss_fn, optimizer, mesh)
    ddl_step = jax.jit(strategy.step, donate_argnums=0)
    ddl_state = strategy.init(params)
    hand_step = hand_written_step(loss_fn, optimizer, mesh)
    hand_params = jax.device_put(params, NamedSharding(mesh, P()))
    hand_state = (
        hand_params,
        jax.device_put(optimizer.init(hand_params), NamedSharding(mesh, P())),
    )

    ddl_ops = hlo_op_counts(ddl_step, ddl_state, batch)
    hand_ops = hlo_op_counts(hand_step, *hand_state, batch)
    same_program = ddl_ops == hand_ops
    # What the strategy's program holds beyond the hand-written one (e.g. its step counter).
    extra_ops = dict(ddl_ops - hand_ops)
    missing_ops = dict(hand_ops - ddl_ops)

    def run_ddl(state):
        state, metrics = ddl_step(state, batch)
        return state, metrics["loss"]

    def run_hand(state):
        params, opt_state, loss = hand_step(*state, batch)
        return (params, opt_state), loss

    def timed(run, state):
        start = time.perf_counter()
        for _ in range(args.steps):
            state, loss = run(state)
        loss.block_until_ready()
        return state, (time.perf_counter() - start) / args.steps

    ddl_state, _ = timed(run_ddl, ddl_state)  # compile and warm up both
    hand_state, _ = timed(run_hand, hand_state)
    times = {"ddl": [], "hand": []}
    for r in tqdm(range(args.rounds), desc="rounds"):
        order = [("ddl", run_ddl), ("hand", run_hand)][:: 1 if r % 2 == 0 else -1]
        for name, run in order:
            if name == "ddl":
                ddl_state, t = timed(run, ddl_state)
            else:
                hand_state, t = timed(run, hand_state)
            times[name].append(t)

    same = jax.tree.map(
        lambda a, b: bool(jnp.allclose(a, b, atol=1e-4)), strategy.params(ddl_state), hand_state[0]
    )
    result = {
        "devices": args.devices,
        "global_batch": size,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_ddl_over_hand": statistics.median(times["ddl"]) / statistics.median(times["hand"]),
        "target": TARGET,
        "same_params_after_training": all(jax.tree.leaves(same)),
        "same_hlo_op_counts": same_program,
        "hlo_ops_only_in_ddl": extra_ops,
        "hlo_ops_only_in_hand_written": missing_ops,
        "backend": jax.default_backend(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=2))
    table = (
        "| step | median s/step |\n|---|---|\n"
        f"| ddl.data_parallel | {result['median_s']['ddl']:.4f} |\n"
        f"| hand-written shard_map + pmean | {result['median_s']['hand']:.4f} |\n"
        f"\nratio ddl / hand = **{result['ratio_ddl_over_hand']:.3f}** (target <= {TARGET}: "
        f"{'met' if result['ratio_ddl_over_hand'] <= TARGET else 'NOT met'}); "
        f"same params after training: {result['same_params_after_training']}; "
        f"compiled programs hold the same HLO ops: {same_program} (ops only in ddl's: "
        f"{extra_ops}; only in the hand-written one: {missing_ops})\n"
    )
    (args.out / "overhead.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
