"""One process of ``benchmarks/buckets.py``: one CPU device on one core.

    python benchmarks/_buckets_worker.py PROCESS_ID PORT CONFIG_JSON

Process 0 prints one JSON line: per program, the seconds of each timed round and the
buffers its collectives carry per step (read from the compiled HLO).
"""

import json
import sys
from pathlib import Path

import ddl_jax as ddl

# Appended, not prepended: the benchmarks' script names must not shadow real modules.
sys.path.append(str(Path(__file__).parent))
from _rounds import interleaved

process_id, port, config = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
ddl.launch.initialize(f"127.0.0.1:{port}", 2, process_id, heartbeat_timeout_seconds=60)

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ddl_jax.compare.workloads import make_workload  # noqa: E402

workload = make_workload("text-gpt", seed=0, devices=2 * config["windows"] // 8)
mesh = ddl.make_mesh(data=2)
adam = optax.adam(3e-3)
programs = {
    f"data_parallel, {packing}": ddl.data_parallel(
        workload.loss_fn, adam, mesh, reducer=ddl.allreduce_mean(bucket_mb=bucket_mb)
    )
    for packing, bucket_mb in (("per leaf", None), ("buckets", 25.0))
}
# Each process holds its half of every global batch.
batches = [
    jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")),
            x[process_id * len(x) // 2 : (process_id + 1) * len(x) // 2],
        ),
        batch,
    )
    for batch, _ in zip(workload.batches(0), range(4), strict=False)
]
runs, buffers = {}, {}
for name, strategy in programs.items():
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(workload.params)
    stats = ddl.comm_stats(jax.jit(strategy.step), state, batches[0])
    buffers[name] = sum(op.buffers * op.count for op in stats.ops)
    for batch in batches[:2]:  # compile and warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    runs[name] = (step, state)
seconds = interleaved(runs, config["rounds"], config["steps"], lambda i: batches[i % len(batches)])
if process_id == 0:
    print(json.dumps({"seconds": seconds, "buffers": buffers}), flush=True)
jax.distributed.shutdown()
