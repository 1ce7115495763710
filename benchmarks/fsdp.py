"""Sharded data parallelism (``ddl.fsdp``) against ``ddl.data_parallel`` on the bundled
byte-level GPT: memory, traffic and validation loss, side by side in one run.

Eight simulated CPU devices, the ``text-gpt`` workload of ``ddl-jax compare`` (2 layers, 64
wide, context 64, Python's own sources), Adam 3e-3.

* Memory: each device's state (parameters and optimizer state) from the compiled step's
  ``memory_analysis`` (its arguments, less the device's share of the batch), and its ratio
  to ``data_parallel``'s.
* Traffic: bytes each device sends per step and the all-gathers, from the HLO
  (``ddl.comm_stats``), priced on 1 Gb/s Ethernet and TPU v4 ICI by ``ddl.sim``.
* Training: ``data_parallel`` in float32 (seeds 0 and 1: the noise between two seeds),
  stage 3 with bfloat16 compute (the GPT's layers built with ``dtype=jnp.bfloat16``; the
  parameters and Adam's state stay float32) and bfloat16 gradient reduction, and stage 3
  with int8 weight gathers (ZeRO++'s qwZ), seed 0: validation bits per byte after
  ``--steps`` steps.

Writes benchmarks/results/fsdp.{md,json}.

    python benchmarks/fsdp.py [--steps 300]
"""

import argparse
import json
import time
from pathlib import Path

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from ddl_jax.compare.workloads import make_workload  # noqa: E402

DEVICES = 8


BF16 = "fsdp stage 3, bf16 compute and reduction"
QWZ = "fsdp stage 3, int8 weight gathers (qwZ)"


def strategies(loss_fn, mesh):
    adam = optax.adam(3e-3)
    return {
        "data_parallel": ddl.data_parallel(loss_fn, adam, mesh),
        "fsdp stage 1": ddl.fsdp(loss_fn, adam, mesh, stage=1),
        "fsdp stage 2": ddl.fsdp(loss_fn, adam, mesh, stage=2),
        "fsdp stage 3": ddl.fsdp(loss_fn, adam, mesh, stage=3),
        "fsdp stage 3, reduced in bf16": ddl.fsdp(
            loss_fn, adam, mesh, stage=3, reducer=ddl.compression.scatter_cast(jnp.bfloat16)
        ),
        "fsdp stage 3, scatter_qsgd(8)": ddl.fsdp(
            loss_fn, adam, mesh, stage=3, reducer=ddl.compression.scatter_qsgd(8)
        ),
        "fsdp stage 3, scatter_top_k(0.01)": ddl.fsdp(
            loss_fn, adam, mesh, stage=3, reducer=ddl.compression.scatter_top_k(0.01)
        ),
        QWZ: ddl.fsdp(loss_fn, adam, mesh, stage=3, quantized_weights=True),
    }


def costs(workload, mesh):
    """Per strategy: state bytes per device, bytes sent per step, all-gathers, priced time."""
    batch = next(workload.batches(0))
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) / DEVICES
    rows = {}
    for name, strategy in strategies(workload.loss_fn, mesh).items():
        state = strategy.init(workload.params)
        step = jax.jit(strategy.step)
        memory = step.lower(state, batch).compile().memory_analysis()
        stats = ddl.comm_stats(step, state, batch)
        rows[name] = {
            "state_bytes_per_device": memory.argument_size_in_bytes - batch_bytes,
            "bytes_per_device_per_step": stats.bytes_per_device,
            "bytes_by_kind": stats.bytes_by_kind,
            # each buffer of a combined all-gather counted, as fsdp_layers.py counts them
            "all_gathers": sum(o.count * o.buffers for o in stats.ops if o.kind == "all-gather"),
            "comm_s_1gbps": ddl.sim.estimate_step_time(stats, ddl.sim.ETHERNET_1G),
            "comm_s_ici": ddl.sim.estimate_step_time(stats, ddl.sim.TPU_V4_ICI),
        }
    base = rows["data_parallel"]["state_bytes_per_device"]
    for row in rows.values():
        row["state_vs_data_parallel"] = row["state_bytes_per_device"] / base
    return rows


def train(workload, strategy, steps):
    state, history = ddl.fit(
        strategy, workload.params, workload.batches, steps=steps, log_every=steps // 10 or 1
    )
    return float(workload.evaluate(strategy.params(state))), history[-1]["loss"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    mesh = ddl.make_mesh(data=DEVICES)
    workload = make_workload("text-gpt", seed=0, devices=DEVICES)
    rows = costs(workload, mesh)

    runs = {}
    for label, seed, dtype, name in [
        ("data_parallel, float32, seed 0", 0, None, "data_parallel"),
        ("data_parallel, float32, seed 1", 1, None, "data_parallel"),
        (f"{BF16}, seed 0", 0, jnp.bfloat16, "fsdp stage 3, reduced in bf16"),
        (f"{QWZ}, float32, seed 0", 0, None, QWZ),
    ]:
        w = make_workload("text-gpt", seed=seed, devices=DEVICES, compute_dtype=dtype)
        strategy = strategies(w.loss_fn, mesh)[name]
        print(f"== {label}", flush=True)
        start = time.perf_counter()
        bpb, loss = train(w, strategy, args.steps)
        runs[label] = {"bits_per_byte": bpb, "train_loss": loss}
        print(f"   validation bits/byte {bpb:.4f} ({time.perf_counter() - start:.0f} s)")

    lines = [
        f"# ddl.fsdp against ddl.data_parallel: {workload.title}, {DEVICES} simulated CPU "
        "devices, Adam 3e-3",
        "",
        "| strategy | state bytes / device | vs data_parallel | bytes sent / device / step "
        "| all-gathers / step | comm. time / step, 1 Gb/s | comm. time / step, TPU v4 ICI |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['state_bytes_per_device']:,.0f} | {r['state_vs_data_parallel']:.3f} "
            f"| {r['bytes_per_device_per_step']:,.0f} | {r['all_gathers']} "
            f"| {r['comm_s_1gbps'] * 1e3:.2f} ms | {r['comm_s_ici'] * 1e6:.1f} us |"
        )
    lines += ["", f"Validation bits per byte after {args.steps} steps:", ""]
    lines += ["| run | validation bits / byte | last training loss |", "|---|---|---|"]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['bits_per_byte']:.4f} | {r['train_loss']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp.md").write_text(text)
    (out / "fsdp.json").write_text(json.dumps({"costs": rows, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
