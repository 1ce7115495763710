"""FSDP layer by layer: per-device memory of a deep MLP whose layers are one stacked pytree.

An MLP 1024 wide with 8 or 16 hidden layers run by ``ddl.layers.scan_layers``, Adam, 8
simulated CPU devices, 64 examples per step. From each compiled step's ``memory_analysis``:
its arguments (state and batch), temporaries, and all its buffers (arguments, outputs and
temporaries) per device, for ``data_parallel``,
``fsdp(stage=3, reshard_after_forward=False)`` (every parameter gathered once per step)
and ``fsdp(stage=3)`` (each layer gathered just before its use, forward and backward), and
the temporaries against the whole parameters' bytes. (XLA:CPU's buffer assignment may
place a temporary in an output buffer not yet written: the sum of all buffers bounds what
a step holds.)

    python benchmarks/fsdp_layers.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def main() -> None:
    mesh = ddl.make_mesh(data=8)
    batch = {"x": jnp.ones((BATCH, 64)), "y": jnp.zeros((BATCH,), jnp.int32)}
    print(
        "| layers | strategy | arguments / device | temporaries / device | all buffers / device "
        "| temporaries / whole parameters |"
    )
    print("|---|---|---|---|---|---|")
    for depth in (8, 16):
        params = model(depth)
        whole = sum(x.nbytes for x in jax.tree.leaves(params))
        strategies = {
            "data_parallel": ddl.data_parallel(loss_fn, optax.adam(1e-3), mesh),
            "fsdp stage 3, gathered once": ddl.fsdp(
                loss_fn, optax.adam(1e-3), mesh, stage=3, reshard_after_forward=False
            ),
            "fsdp stage 3, layer by layer": ddl.fsdp(loss_fn, optax.adam(1e-3), mesh, stage=3),
        }
        for name, strategy in strategies.items():
            state = strategy.init(params)
            memory = jax.jit(strategy.step).lower(state, batch).compile().memory_analysis()
            args, temps = memory.argument_size_in_bytes, memory.temp_size_in_bytes
            total = args + temps + memory.output_size_in_bytes
            print(
                f"| {depth} | {name} | {args / 1e6:.1f} MB | {temps / 1e6:.1f} MB | "
                f"{total / 1e6:.1f} MB | {temps / whole:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
