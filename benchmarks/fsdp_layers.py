"""FSDP layer by layer: per-device memory of deep models whose layers are one stacked pytree.

An MLP 1024 wide with 8 or 16 hidden layers run by ``ddl.layers.scan_layers``, and the
byte-level GPT (256 wide, context 64, dropout 0.1) with 8 or 16 blocks and
``scan_layers=True``; Adam, 8 simulated CPU devices, 64 examples per step. From each
compiled step's ``memory_analysis``: its arguments (state and batch), temporaries, and all
its buffers (arguments, outputs and temporaries) per device, for ``data_parallel``,
``fsdp(stage=3, reshard_after_forward=False)`` (every parameter gathered once per step)
and ``fsdp(stage=3)`` (each layer gathered just before its use, forward and backward), and
the temporaries against the whole parameters' bytes (the last also in bfloat16: the loss
under ``ddl.mixed_precision``, the parameters gathered as bfloat16, ``gather_dtype``); from
the HLO, the all-gathers per step
(each buffer of a combined op counted) and the step's collectives priced on TPU v4 ICI by
``ddl.sim``. (XLA:CPU's buffer assignment may
place a temporary in an output buffer not yet written: the sum of all buffers bounds what
a step holds.)

    python benchmarks/fsdp_layers.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)

WIDTH, BATCH = 1024, 64


def model(depth: int) -> dict:
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "inp": {"w": jax.random.normal(k[0], (64, WIDTH)) / 8},
        "layers": {
            "w": jax.random.normal(k[1], (depth, WIDTH, WIDTH)) / np.sqrt(WIDTH),
            "b": jnp.zeros((depth, WIDTH)),
        },
        "out": {"w": jax.random.normal(k[2], (WIDTH, 10)) / 32},
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["inp"]["w"])
    h = ddl.layers.scan_layers(lambda p, h: jnp.tanh(h @ p["w"] + p["b"]), params["layers"], h)
    logits = h @ params["out"]["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def gpt(depth: int) -> tuple:
    model = ddl.models.GPT(
        context=64, features=256, heads=4, layers=depth, scan_layers=True,
        rngs=nnx.Rngs(params=0, dropout=1),
    )  # fmt: skip

    def loss(model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return ddl.flax.loss_from_module(model, loss)


def workloads(depth: int) -> dict:
    """``name -> (loss, variables, batch)``."""
    mlp_batch = {"x": jnp.ones((BATCH, 64)), "y": jnp.zeros((BATCH,), jnp.int32)}
    gpt_batch = {"tokens": jnp.zeros((BATCH, 65), jnp.int32)}
    return {"MLP": (loss_fn, model(depth), mlp_batch), "GPT": (*gpt(depth), gpt_batch)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    mesh = ddl.make_mesh(data=8)
    print(
        "| model | layers | strategy | arguments / device | temporaries / device "
        "| all buffers / device | all-gathers / step | comm. time / step, TPU v4 ICI "
        "| temporaries / whole parameters |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, depth in ((kind, depth) for kind in ("MLP", "GPT") for depth in (8, 16)):
        loss, params, batch = workloads(depth)[kind]
        whole = sum(x.nbytes for x in jax.tree.leaves(params))
        strategies = {
            "data_parallel": ddl.data_parallel(loss, optax.adam(1e-3), mesh),
            "fsdp stage 3, gathered once": ddl.fsdp(
                loss, optax.adam(1e-3), mesh, stage=3, reshard_after_forward=False
            ),
            "fsdp stage 3, layer by layer": ddl.fsdp(loss, optax.adam(1e-3), mesh, stage=3),
            "fsdp stage 3, layer by layer, bfloat16": ddl.fsdp(
                ddl.mixed_precision(loss, jnp.bfloat16),
                optax.adam(1e-3),
                mesh,
                stage=3,
                gather_dtype=jnp.bfloat16,
            ),
        }
        for name, strategy in strategies.items():
            state = strategy.init(params)
            memory = jax.jit(strategy.step).lower(state, batch).compile().memory_analysis()
            args, temps = memory.argument_size_in_bytes, memory.temp_size_in_bytes
            total = args + temps + memory.output_size_in_bytes
            stats = ddl.comm_stats(jax.jit(strategy.step), state, batch)
            gathers = sum(op.count * op.buffers for op in stats.ops if op.kind == "all-gather")
            ici = ddl.sim.estimate_step_time(stats, ddl.sim.TPU_V4_ICI)
            print(
                f"| {kind} | {depth} | {name} | {args / 1e6:.1f} MB | {temps / 1e6:.1f} MB | "
                f"{total / 1e6:.1f} MB | {gathers} | {ici * 1e6:.0f} us | {temps / whole:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
