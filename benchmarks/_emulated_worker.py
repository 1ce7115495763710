"""One process of ``benchmarks/emulated.py``.

    python benchmarks/_emulated_worker.py sweep RANK COORDINATOR
    python benchmarks/_emulated_worker.py train RANK COORDINATOR WORKLOAD SPEC STEPS
    python benchmarks/_emulated_worker.py compute WORKLOAD

``sweep``: all-reduces of 4 kB to 16 MB between the two processes, the median seconds of
each. ``train``: the compare app's strategy SPEC on WORKLOAD (2 workers, one per process), its
batches placed on the devices first, one untimed step (compilation), then STEPS timed
steps. ``compute``: one process, one
device: the data-parallel step of one worker alone, timed, and its modeled flops and bytes.
Process 0 prints one JSON line.
"""

import json
import statistics
import sys
import time

import numpy as np

mode = sys.argv[1]

import ddl_jax as ddl  # noqa: E402

if mode in ("sweep", "train"):
    rank, coordinator = int(sys.argv[2]), sys.argv[3]
    ddl.launch.initialize(
        coordinator, 2, rank, initialization_timeout=60, heartbeat_timeout_seconds=30
    )

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ddl_jax.compare import make_workload  # noqa: E402
from ddl_jax.compare.specs import LEARNING_RATE, BuildContext, parse_spec  # noqa: E402


def median_seconds(fn, *args, repeats=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


def sweep():
    """All-reduces across the link: one of each size (the bandwidth), 1 and 32 of a scalar
    in one program (the latency of each; a program's floor)."""
    mesh = ddl.make_mesh(data=2)
    sharding = NamedSharding(mesh, P("data"))

    def psums(count):
        def body(a):
            for _ in range(count):
                a = jax.lax.psum(a, "data") * 0.5
            return a

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    def array(n):
        return jax.make_array_from_process_local_data(sharding, np.ones((1, n), np.float32))

    sizes = {}
    for kb in (4, 16, 64, 256, 1024, 4096, 16384):
        sizes[kb * 1024] = median_seconds(psums(1), array(kb * 256))
    scalar = array(1)
    return {
        "allreduce_seconds": sizes,
        "scalar": median_seconds(psums(1), scalar, repeats=41),
        "scalar_32": median_seconds(psums(32), scalar, repeats=41),
    }


def global_batches(workload, mesh, steps):
    sharding = NamedSharding(mesh, P("data"))
    it = workload.batches(0)
    for _ in range(steps):
        batch = next(it)
        yield {
            k: jax.make_array_from_callback(np.shape(v), sharding, lambda i, v=v: np.asarray(v)[i])
            for k, v in batch.items()
        }


def train(name, spec_text, steps):
    mesh = ddl.make_mesh(data=2)
    workload = make_workload(name, seed=0, devices=2)
    spec = parse_spec(spec_text)
    strategy = spec.build(BuildContext(workload.loss_fn, mesh, 1.0, 0, 10, 0.0))
    state = strategy.init(workload.params)
    step = jax.jit(strategy.step, donate_argnums=0)
    batches = list(global_batches(workload, mesh, steps + 1))  # on the devices first
    jax.block_until_ready(batches)
    state, metrics = step(state, batches[0])  # compiles
    jax.block_until_ready(metrics)
    tick = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - tick
    return {"seconds": seconds, "steps": steps, "loss": float(metrics["loss"])}


def compute(name):
    workload = make_workload(name, seed=0, devices=1)
    mesh = ddl.make_mesh(data=1)
    strategy = ddl.data_parallel(workload.loss_fn, optax.adam(LEARNING_RATE), mesh)
    state = strategy.init(workload.params)
    batch = next(workload.batches(0))
    jitted = jax.jit(strategy.step)
    work = ddl.sim.compute_stats(jitted, state, batch)
    return {
        "seconds": median_seconds(jitted, state, batch, repeats=21),
        "flops": work.flops,
        "bytes": work.bytes,
    }


if mode == "sweep":
    result = sweep()
elif mode == "train":
    result = train(sys.argv[4], sys.argv[5], int(sys.argv[6]))
else:
    result = compute(sys.argv[2])
if jax.process_index() == 0:
    print(json.dumps(result), flush=True)
