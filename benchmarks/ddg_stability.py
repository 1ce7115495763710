"""DDG's stability against GPipe over learning rates, with and without staleness scaling.

An MLP 64 -> 128 -> 128 -> 128 -> 10 on the bundled digits, cut into K pipeline stages
(``data=1, stage=K`` on simulated CPU devices), trains for the same steps on the same
batches from the same initial weights in five modes:

* ``gpipe``: the exact gradient of each global batch, one update per step;
* ``micro``: DDG's updates without the delay (one stage: backprop on each micro-batch);
* ``ddg``: M delayed-gradient updates per step, stage k's gradient ``K-1-k`` ticks old
  (the authors' forward-locked DDG; ``--ddg-forward pipelined``: ``2(K-1-k)``);
* ``ddg+inverse`` and ``ddg+exp``: DDG with ``optax.chain(optimizer,
  ddl.scale_by_staleness(rule))``. The pipeline passes each stage's delay
  ``tau`` to the optimizer as the extra argument ``staleness``, so stage k's
  step is scaled by ``1 / max(tau, 1)`` or ``exp(-decay tau)``: smaller learning rates for
  the earlier stages, the last stage's unchanged.

Prints a markdown table, per (K, optimizer, learning rate) and mode, of the final test
accuracy and the worst test accuracy from ``--warmup`` on (spikes and collapses)::

    python benchmarks/ddg_stability.py             # K = 2 and 4, one seed: about 2 minutes
    python benchmarks/ddg_stability.py --seeds 3   # the table in docs/figures.md
    python benchmarks/ddg_stability.py --ks 2 --adam-lrs --modes gpipe ddg
"""

from __future__ import annotations

import argparse
import itertools
import time

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

WIDTHS = (64, 128, 128, 128, 10)
OPTIMIZERS = {"sgd": lambda lr: optax.sgd(lr, momentum=0.9), "adam": optax.adam}
OPTIMIZER_NAMES = {"sgd": "SGD, momentum 0.9", "adam": "Adam"}


class Block(nnx.Module):
    """Dense layers with ReLU after each but the model's last; stage 0 reads the image."""

    def __init__(self, layers: list[nnx.Linear], *, last: bool):
        self.layers = nnx.List(layers)
        self.last = last

    def __call__(self, x):
        x = x["image"] if isinstance(x, dict) else x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.last and i == len(self.layers) - 1):
                x = nnx.relu(x)
        return x


def split_mlp(k: int, seed: int):
    """The MLP cut into K stages of equally many layers; the same weights for every K."""
    rngs = nnx.Rngs(seed)
    layers = [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(WIDTHS)]
    per = len(layers) // k
    return ddl.pipeline_stages(
        [Block(layers[i * per : (i + 1) * per], last=i == k - 1) for i in range(k)]
    )


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


MODES = {
    "gpipe": "GPipe",
    "micro": "no delay",
    "ddg": "DDG",
    "ddg+inverse": "DDG + inverse",
    "ddg+exp": "DDG + exp",
}


def run(
    args, k: int, optimizer: optax.GradientTransformation, mode: str, seed: int, data
) -> tuple[float, float, int]:
    """One training run: (final test accuracy, worst from the warm-up on, step of the worst)."""
    test, batches = data
    if mode == "micro":  # DDG's micro-batch updates without the delay: a single stage
        k = 1
    if mode in ("ddg+inverse", "ddg+exp"):
        rule = mode.removeprefix("ddg+")
        optimizer = optax.chain(optimizer, ddl.scale_by_staleness(rule, decay=args.decay))
    stages, params = split_mlp(k, seed)
    strategy = ddl.pipeline(
        stages,
        xent,
        optimizer,
        ddl.make_mesh(data=1, stage=k),
        microbatches=args.microbatches,
        schedule="gpipe" if mode == "gpipe" else "ddg",
        example_batch=batches[0],
        **({} if mode == "gpipe" else {"ddg_forward": args.ddg_forward}),
    )
    step = jax.jit(strategy.step, donate_argnums=0)

    @jax.jit
    def accuracy(state):
        x = {"image": test["image"]}
        for (apply, _), p in zip(stages, strategy.params(state), strict=True):
            x = apply(p, x)
        return jnp.mean(x.argmax(-1) == test["label"])

    state = strategy.init(params)
    curve = []
    for t, batch in enumerate(batches, start=1):
        state, _ = step(state, batch)
        if t % args.eval_every == 0 or t == len(batches):
            curve.append((t, float(accuracy(state))))
    worst, at = min((a, t) for t, a in curve if t >= args.warmup)
    return curve[-1][1], worst, at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4], help="stage counts K")
    parser.add_argument("--sgd-lrs", type=float, nargs="*", default=[0.01, 0.02, 0.05, 0.1])
    parser.add_argument("--adam-lrs", type=float, nargs="*", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--decay", type=float, default=0.5, help="the exp rule's decay")
    parser.add_argument("--ddg-forward", default="locked", choices=["locked", "pipelined"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--microbatches", type=int, default=4, help="M")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--warmup", type=int, default=100, help="first step the worst counts")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    parser.add_argument("--seeds", type=int, default=1, help="runs per cell: seed, seed+1, ...")
    args = parser.parse_args()
    layers = len(WIDTHS) - 1
    if any(k < 1 or layers % k for k in args.ks):
        parser.error(f"--ks {args.ks}: each K must divide the MLP's {layers} layers")
    if args.warmup > args.steps:
        parser.error(f"--warmup {args.warmup} is beyond --steps {args.steps}")

    train, test = ddl.data.digits()
    seeds = range(args.seed, args.seed + args.seeds)
    streams = {s: ddl.data.batches(train, args.batch, seed=s) for s in seeds}
    data = {s: (test, [next(streams[s]) for _ in range(args.steps)]) for s in seeds}
    grid = [("sgd", lr) for lr in args.sgd_lrs] + [("adam", lr) for lr in args.adam_lrs]
    results, start = {}, time.perf_counter()
    for k, (name, lr), mode in itertools.product(args.ks, grid, args.modes):
        if mode == "micro" and (name, lr, mode) in results:
            results[k, name, lr, mode] = results[name, lr, mode]  # one stage: K plays no part
            continue
        finals, worsts = [], []
        for seed in seeds:
            final, worst, at = run(args, k, OPTIMIZERS[name](lr), mode, seed, data[seed])
            finals.append(final)
            worsts.append(worst)
            print(
                f"[{time.perf_counter() - start:6.1f}s] K={k} {name} lr={lr:g} {mode:11s} "
                f"seed {seed}: final {final:.3f}, worst from step {args.warmup} on "
                f"{worst:.3f} (step {at})",
                flush=True,
            )
        results[k, name, lr, mode] = results[name, lr, mode] = (
            sum(finals) / len(finals),
            min(worsts),
        )

    m_ = args.microbatches
    print(
        f"\nMLP {' -> '.join(map(str, WIDTHS))} on digits in K stages, {args.steps} steps of "
        f"global batch {args.batch}, M = {m_}, seeds {list(seeds)}; each cell: final test "
        f"accuracy (mean over seeds) / worst test accuracy from step {args.warmup} on "
        f"(evaluated every {args.eval_every} steps; lowest over seeds). "
        f"GPipe: one exact update per step. DDG: {m_} updates of {args.batch // m_} per "
        f"step. No delay: DDG's updates in one stage (backprop on the same micro-batches). "
        f"+ inverse / exp: optax.chain(optimizer, ddl.scale_by_staleness(rule)), stage k's "
        f"step scaled by 1 / max(tau, 1) or exp(-{args.decay:g} tau), tau = "
        f"{'K-1-k' if args.ddg_forward == 'locked' else '2(K-1-k)'} (DDG's forward "
        f"{args.ddg_forward}).\n"
    )
    print("| K | optimizer | lr | " + " | ".join(MODES[m] for m in args.modes) + " |")
    print("|---|---|---|" + "---|" * len(args.modes))
    for k, (name, lr) in itertools.product(args.ks, grid):
        cells = [results[k, name, lr, m] for m in args.modes]
        print(
            f"| {k} | {OPTIMIZER_NAMES[name]} | {lr:g} | "
            + " | ".join(f"{final:.3f} / {worst:.3f}" for final, worst in cells)
            + " |"
        )
    print(f"\n{sum(len(key) == 4 for key in results)} cells in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
