"""One process of ``ddl-jax compare --measure`` (started by ``processes.run_worker``).

    python -m ddl_jax.compare.worker COORDINATOR N RANK sweep
    python -m ddl_jax.compare.worker COORDINATOR N RANK compute CONFIG
    python -m ddl_jax.compare.worker COORDINATOR N RANK train CONFIG SPEC STEPS

Each joins the N processes (``ddl.launch.initialize``), one device each, its gloo transport
threads lowered to ``SCHED_IDLE`` (``ddl.launch.idle_gloo_threads``): the processes share
this host's cores where the hosts they stand for would not, and a loop thread spinning for
a peer's message took a core from the steps (2 processes on 2 cores: a synchronous step of
the digits MLP 5.4 to 6.8 ms, 24.5 ms with each process pinned to a core; idled, 1.5 and
1.2 ms).

``sweep``: all-reduces across the processes, of 4 B to 16 MB, of 4 and 16 buffers
combined, and 32 of 64 B in turn; and permutes (each process sends to the next), one of
4 B and 32 of 64 B in turn: per program, the messages, collectives and bytes
``ddl.comm_stats`` reads from it and its median seconds.

``compute``: a probe step (each worker's gradient and Adam update on its own replica, only
the loss averaged) timed as it runs across the processes, with its modeled flops and bytes
and its collectives' terms.

``train``: the strategy SPEC as ``compare`` builds it from CONFIG (a JSON object of its
settings), its STEPS global batches placed on the devices and the step compiled first,
then STEPS timed steps, ``TRAIN_REPEATS`` times from the same state (the median kept: a
TCP retransmission behind the token bucket can add 200 ms to one run); the metric after.

Times are the slowest process's. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ddl_jax as ddl

#: All-reduce sizes of the sweep, in bytes (one buffer each): 4 B to 16 MB.
SWEEP_BYTES = (4, 64, 2**10, 2**14, 2**18, 2**20, 2**22, 2**24)
#: Buffers of the sweep's combined all-reduces (of 1 kB and 64 kB each).
SWEEP_BUFFERS = (4, 16)
#: Small collectives in turn in one of the sweep's programs: their seconds beyond one's
#: are latency and overhead (told apart by an all-reduce's 2 (N - 1) rounds and a
#: permute's one).
IN_TURN = 32
#: Their size, in bytes: not scalars. gloo all-reduces a scalar faster than any larger
#: buffer (2 processes at 1 Gb/s: 0.11 ms against 0.15 to 0.36 ms for 64 B to 16 kB), so
#: scalars in turn priced a gradient's buffers at half what they cost (16 of 1 kB
#: combined: 1.9 ms priced, 3.5 ms measured) and the CNN's synchronous step 37% low.
IN_TURN_BYTES = 64
#: Sizes of the sweep's single permutes, in bytes: small only. Larger permutes moved at
#: about half the all-reduces' bandwidth (XLA:CPU's gloo, 2 processes, 1 MB: 16 ms against
#: 8.8 ms at 1 Gb/s), which one bandwidth cannot fit.
PERMUTE_BYTES = (4,)
#: Timings of each of the sweep's programs (the median is kept): at most SWEEP_REPEATS, fewer
#: for a slow one, as many as take about SWEEP_SECONDS, at least 3 (at 100 Mb/s a 16 MB
#: all-reduce takes 1.4 s: 11 of it and of 4 MB were 20 s of a 35 s sweep).
SWEEP_REPEATS = 11
SWEEP_SECONDS = 2.0
#: Steps of the compute probe, and its runs (the median is kept).
PROBE_STEPS = 40
PROBE_REPEATS = 5
#: Timed runs of a strategy's steps (the median is kept).
TRAIN_REPEATS = 3


def _mesh() -> Any:
    """A ``data`` mesh of one device per process: process p's local device p (mod its
    count), so that processes sharing a host of several accelerators use different ones."""
    import jax

    local: dict[int, list] = {}
    for d in jax.devices():
        local.setdefault(d.process_index, []).append(d)
    chosen = [local[p][p % len(local[p])] for p in sorted(local)]
    return ddl.make_mesh(data=len(chosen), devices=chosen)


def sweep_repeats(first: float) -> int:
    """How many timings of a sweep's program whose first timing took ``first`` seconds."""
    return min(SWEEP_REPEATS, max(3, math.ceil(SWEEP_SECONDS / max(first, 1e-9))))


def _median_seconds(fn: Callable, *args: Any) -> float:
    """The median time of ``fn(*args)``, a collective: after a first call (it compiles),
    the slowest process's first timing sets every process's count (``sweep_repeats``)."""
    import jax

    jax.block_until_ready(fn(*args))
    times: list[float] = []
    repeats = 1
    while len(times) < repeats:
        tick = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - tick)
        if len(times) == 1:
            repeats = sweep_repeats(_slowest(times[0]))
    return statistics.median(times)


def sweep() -> dict[str, Any]:
    """Per program, a dict: what it runs (``program``), ``ddl.comm_stats``'s terms
    (``rounds``, ``calls`` and ``op_buffers`` counting a combined all-reduce's buffers
    apart, ``ops``, ``busy_bytes``: what the busiest device sends) and its median
    ``seconds``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    sharding = NamedSharding(mesh, P("data"))
    n = mesh.shape["data"]
    ring = [(i, (i + 1) % n) for i in range(n)]
    collectives = {
        "all-reduce": lambda a: jax.lax.psum(a, "data"),
        "permute": lambda a: jax.lax.ppermute(a, "data", ring),
    }

    def program(kind: str, count: int, buffers: int) -> Callable:
        def body(*arrays):
            for _ in range(count):
                arrays = tuple(a * 0.5 for a in collectives[kind](arrays))
            return arrays

        specs = (P("data"),) * buffers
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))

    def arrays(size: int, buffers: int) -> tuple:
        local = np.ones((1, max(size // 4, 1)), np.float32)
        return (jax.make_array_from_process_local_data(sharding, local),) * buffers

    shapes = [("all-reduce", 1, 1, b) for b in SWEEP_BYTES]
    shapes += [("all-reduce", 1, k, b) for k in SWEEP_BUFFERS for b in (2**10, 2**16)]
    shapes += [("all-reduce", IN_TURN, 1, IN_TURN_BYTES)]
    shapes += [("permute", 1, 1, b) for b in PERMUTE_BYTES]
    shapes += [("permute", IN_TURN, 1, IN_TURN_BYTES)]
    samples = []
    for kind, count, buffers, size in shapes:
        fn, x = program(kind, count, buffers), arrays(size, buffers)
        ops = ddl.comm_stats(fn, *x).ops
        samples.append({
            "program": f"{count} x {kind} of {buffers} x {size} B",
            "rounds": sum(op.count * op.rounds for op in ops),
            "calls": sum(op.count * op.rounds * op.buffers for op in ops),
            "ops": sum(op.count for op in ops),
            "op_buffers": sum(op.count * op.buffers for op in ops),
            "busy_bytes": sum(op.count * max(op.sent) for op in ops),
            "seconds": _median_seconds(fn, *x),
        })  # fmt: skip
    return {"samples": samples}


def _slowest(value: float) -> float:
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(value))))


def compute(config: dict[str, Any]) -> dict[str, Any]:
    """The probe step timed as it runs in the cluster: each worker's forward, backward and
    Adam update on its own replica, only the loss averaged across the processes (local
    SGD that never synchronises); its modeled flops and bytes and its collectives' terms,
    so that the caller can take the collectives out of the time."""
    import jax
    import jax.numpy as jnp
    import optax

    from ddl_jax.compare import workloads
    from ddl_jax.compare.specs import LEARNING_RATE

    n = jax.process_count()
    mesh = _mesh()
    workload = workloads.load(config["workload"], seed=config["seed"], devices=n,
                              non_iid=config["non_iid"])  # fmt: skip
    probe = ddl.local_sgd(workload.loss_fn, optax.adam(LEARNING_RATE), mesh, period=2**30)
    state = probe.init(workload.params)
    batches = _placed(workload, mesh, PROBE_STEPS)
    step = jax.jit(probe.step, donate_argnums=0)
    work = ddl.sim.compute_stats(step, state, batches[0])
    ops = [op for op in ddl.comm_stats(step, state, batches[0]).ops if not op.branch]
    compiled = step.lower(state, batches[0]).compile()
    times = []
    for _ in range(PROBE_REPEATS):
        seconds, _ = _loop_seconds(compiled, jax.tree.map(jnp.copy, state), batches)
        times.append(seconds / PROBE_STEPS)
    return {
        "seconds": statistics.median(times),  # per step
        "flops": work.flops,
        "bytes": work.bytes,
        "rounds": sum(op.count * op.rounds for op in ops),
        "calls": sum(op.count * op.rounds * op.buffers for op in ops),
        "ops": sum(op.count for op in ops),
        "op_buffers": sum(op.count * op.buffers for op in ops),
        "busy_bytes": sum(op.count * max(op.sent) for op in ops),
    }


def _loop_seconds(step: Callable, state: Any, batches: list) -> tuple[float, Any]:
    """Seconds of the steps of ``batches`` in turn from ``state`` (its buffers donated),
    as training runs them, on the slowest process; and the state after. First a warm-up
    step on a copy of ``state``: the first run of a compiled program, and the processes'
    first collective, cost tens of milliseconds once."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    jax.block_until_ready(step(jax.tree.map(jnp.copy, state), batches[0]))
    multihost_utils.sync_global_devices("timed")
    tick = time.perf_counter()
    for batch in batches:
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return _slowest(time.perf_counter() - tick), (state, metrics)


def _placed(workload: Any, mesh: Any, steps: int) -> list[dict[str, Any]]:
    """The first ``steps`` global batches, each process holding its rows."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    it = workload.batches(0)
    out = []
    for _ in range(steps):
        batch = next(it)
        out.append(
            jax.tree.map(
                lambda v: jax.make_array_from_callback(
                    np.shape(v), sharding, lambda i, v=v: np.asarray(v)[i]
                ),
                batch,
            )
        )
    return out


def train(config: dict[str, Any], spec_text: str, steps: int) -> dict[str, Any]:
    """``spec_text`` trained for ``steps`` timed steps across the processes."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from ddl_jax.compare import workloads
    from ddl_jax.compare.specs import BuildContext, parse_spec

    n = jax.process_count()
    mesh = _mesh()
    workload = workloads.load(config["workload"], seed=config["seed"], devices=n,
                              non_iid=config["non_iid"])  # fmt: skip
    context = BuildContext(workload.loss_fn, mesh, config["straggler"], config["seed"],
                           config["eval_every"], config["drop"],
                           churn=config["churn"])  # fmt: skip
    strategy = parse_spec(spec_text).build(context)
    state = strategy.init(workload.params)
    batches = _placed(workload, mesh, steps)
    step = jax.jit(strategy.step, donate_argnums=0).lower(state, batches[0]).compile()
    repeats = []
    for _ in range(TRAIN_REPEATS):
        seconds, (after, metrics) = _loop_seconds(step, jax.tree.map(jnp.copy, state), batches)
        repeats.append(seconds)
    params = multihost_utils.process_allgather(strategy.params(after), tiled=True)
    return {
        "seconds": statistics.median(repeats),
        "repeats": repeats,
        "steps": steps,
        "loss": float(np.mean(multihost_utils.process_allgather(metrics["loss"], tiled=True))),
        "metric": float(workload.evaluate(params)),
    }


def main(argv: list[str]) -> None:
    coordinator, n, rank, mode, *rest = argv
    ddl.launch.initialize(
        coordinator, int(n), int(rank), initialization_timeout=120, heartbeat_timeout_seconds=30
    )
    # the processes stand for hosts of their own: a gloo thread spinning for a peer's
    # message must not take a core that another process's step needs on this one
    ddl.launch.idle_gloo_threads()
    import jax

    if mode == "sweep":
        result = sweep()
    elif mode == "compute":
        result = compute(json.loads(rest[0]))
    elif mode == "train":
        result = train(json.loads(rest[0]), rest[1], int(rest[2]))
    else:
        raise SystemExit(f"worker: unknown mode {mode!r}")
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
