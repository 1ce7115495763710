"""One process of ``benchmarks/pipeline.py``: one CPU device on one core, one stage.

    python benchmarks/_pipeline_worker.py PROCESS_ID PORT CONFIG_JSON

Process 0 prints one JSON line: per mode, the seconds of each timed round. Each process
then prints its stage's compute alone, in milliseconds, on a micro-batch and on the whole
batch: the forward, and the backward as the pipeline runs it (the forward re-run, then its
vjp; the last stage's with the loss), with XLA's flop counts of both (what the pipeline
groups its ticks by).
"""

import json
import sys
import time
from pathlib import Path

import jax

import ddl_jax as ddl
from ddl_jax._src.xla_cpu import products as cpu_products

# Appended, not prepended: the benchmarks' script names must not shadow real modules.
sys.path.append(str(Path(__file__).parent))
from _rounds import interleaved

process_id, port, config = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
ddl.launch.initialize(
    f"127.0.0.1:{port}", 2, process_id, heartbeat_timeout_seconds=60, xla_cpu_tunings=True
)

import contextlib  # noqa: E402
import itertools  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ddl_jax._src.strategies.pipeline import builder as pipeline_module  # noqa: E402


class Stage(nnx.Module):
    def __init__(self, sizes, *, first: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.first = first

    def __call__(self, x):
        x = x["x"] if self.first else x
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


width, depth, size = config["width"], config["layers_per_stage"], config["batch"]
sizes = [[config["features"]] + [width] * depth, [width] * depth + [10]]
modules = [Stage(s, first=i == 0, rngs=nnx.Rngs(i)) for i, s in enumerate(sizes)]
stages, params = ddl.pipeline_stages(modules)
mesh = ddl.make_mesh(data=1, stage=2)
rng = np.random.default_rng(0)
local = {
    "x": rng.normal(size=(size, config["features"])).astype(np.float32),
    "y": rng.integers(0, 10, size=size).astype(np.int32),
}
# data=1: every process holds the whole global batch.
batch = jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), x), local
)
modes = {
    "sequential": dict(microbatches=1, schedule="gpipe"),
    "gpipe": dict(microbatches=config["microbatches"], schedule="gpipe"),
    # What every process ran before each compiled its own stage's program: all stages' work
    # behind a switch on the stage index (what one process holding several stages runs).
    "gpipe, switch over the stages": dict(
        microbatches=config["microbatches"], schedule="gpipe", switch=True
    ),
    "1f1b": dict(microbatches=config["microbatches"], schedule="1f1b"),
    "gpipe, unit ticks": dict(
        microbatches=config["microbatches"], schedule="gpipe", tick_costs="unit"
    ),
    "1f1b, unit ticks": dict(
        microbatches=config["microbatches"], schedule="1f1b", tick_costs="unit"
    ),
    "ddg": dict(microbatches=config["microbatches"], schedule="ddg", example_batch=local),
    "ddg, forward pipelined": dict(
        microbatches=config["microbatches"],
        schedule="ddg",
        example_batch=local,
        ddg_forward="pipelined",
    ),
}
runs = {}
for name, kwargs in modes.items():
    switch = kwargs.pop("switch", False)
    strategy = ddl.pipeline(stages, xent, optax.sgd(0.01), mesh, **kwargs)
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    with (
        mock.patch.object(pipeline_module, "process_stage", return_value=None)
        if switch
        else contextlib.nullcontext()
    ):
        for _ in range(2):  # compile (tracing reads process_stage), and fill DDG's pipeline
            state, metrics = step(state, batch)
    jax.block_until_ready(state)
    runs[name] = (step, state)

times = interleaved(runs, config["rounds"], config["steps"], lambda i: batch)
if process_id == 0:
    print(json.dumps({"seconds": times}), flush=True)


def stage_costs(rows: int) -> dict[str, float]:
    """This process's stage on ``rows`` examples: forward and backward, milliseconds
    (:func:`timed`), and their flops."""
    apply, p = stages[process_id]
    labels = {"y": local["y"][:rows]}
    if process_id == 0:
        x, ct = {"x": local["x"][:rows]}, np.ones((rows, width), np.float32)

        def backward(p, x, ct):
            return jax.vjp(lambda q: apply(q, x), p)[1](ct)

        args = (p, x, ct)
    else:
        x = np.ones((rows, width), np.float32)
        backward = jax.grad(lambda p, x: xent(apply(p, x), labels), argnums=(0, 1))
        args = (p, x)
    if cpu_products.applies(mesh):  # as the pipeline computes them on one core
        backward = cpu_products.transposed_weight_gradients(backward)
    backward = jax.jit(backward)
    forward = jax.jit(apply)

    def flops(fn, *args):
        return jax.jit(fn).lower(*args).cost_analysis()["flops"]

    return {
        "forward": timed(forward, p, x),
        "backward": timed(backward, *args),
        "flops": [flops(apply, p, x), flops(backward, *args)],
    }


def timed(fn, *args) -> dict[str, float]:
    """Median milliseconds of ``fn`` with this process's core alone busy (the other
    process asleep), and with both cores busy at once: the pipelined modes run so, and
    two cores running at once slow each other (shared cache and memory bandwidth).

    Both processes call this for the same functions in the same order; the three windows
    (stage 0 alone, stage 1 alone, both) start together, after a barrier, and last as long
    as eight runs of the slower stage's."""
    jax.block_until_ready(fn(*args))  # compiled and warm
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    slowest = multihost_utils.process_allgather(np.float64(time.perf_counter() - start))
    window = max(0.5, 8 * float(np.max(slowest)))
    multihost_utils.sync_global_devices(f"stage costs {next(_barriers)}")
    opened = time.perf_counter()
    medians = {}
    for w, (name, busy) in enumerate([("alone", [0]), ("alone", [1]), ("busy", [0, 1])]):
        close = opened + (w + 1) * window
        runs = []  # no run starts unless 1.5 of the longest so far end in the window
        while process_id in busy and (not runs or time.perf_counter() + 1.5e-3 * max(runs) < close):
            begin = time.perf_counter()
            jax.block_until_ready(fn(*args))
            runs.append(1e3 * (time.perf_counter() - begin))
        if runs:
            medians[name] = float(np.median(runs))
        time.sleep(max(close - time.perf_counter(), 0))
    return medians


_barriers = itertools.count()
rows = {"micro": size // config["microbatches"], "batch": size}
print(json.dumps({"stage": process_id, **{k: stage_costs(r) for k, r in rows.items()}}))
jax.distributed.shutdown()
