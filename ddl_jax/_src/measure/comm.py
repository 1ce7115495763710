"""Communication read from a compiled program's HLO: which collectives, how many bytes.

No JAX API reports what a program sends, so ``comm_stats`` parses the optimised HLO text
of the compiled executable. It follows while loops (multiplying by XLA's known trip
count) and reports the collectives of conditional branches per branch, since only one
branch runs. Asynchronous collectives (GPU, TPU) count once, at their ``-done``, with the
attributes of the ``-start`` it completes.

Bytes a device sends per collective, for a result of K bytes over a group of g devices
(the bandwidth-optimal ring implementations that NCCL and gloo use):

=====================  ===================  =========
collective             bytes sent / device  rounds
=====================  ===================  =========
all-reduce             2 (g-1)/g * K        2 (g-1)
all-gather             (g-1)/g * K          g-1
reduce-scatter         (g-1) * K            g-1
all-to-all             (g-1)/g * K          g-1
collective-permute     K (sources only)     1
=====================  ===================  =========
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from ddl_jax._src.core.strategy import check_int

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# Bits per element of every array type of XLA's PrimitiveType (xla_data.proto), by width;
# sub-byte types travel packed. token[] carries no data.
_TYPES_BY_BITS = {
    0: "token",
    1: "s1 u1",
    2: "s2 u2",
    4: "s4 u4 f4e2m1fn",
    8: "pred s8 u8 f8e5m2 f8e4m3 f8e4m3fn f8e4m3b11fnuz f8e3m4 f8e5m2fnuz f8e4m3fnuz f8e8m0fnu",
    16: "s16 u16 f16 bf16",
    32: "s32 u32 f32",
    64: "s64 u64 f64 c64",
    128: "c128",
}
_DTYPE_BITS = {name: bits for bits, names in _TYPES_BY_BITS.items() for name in names.split()}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
# One instruction. Async ops print as ``<op>-start``, ``-update``s and ``-done`` (GPU, TPU),
# e.g. all-reduce-start, or a generic async-start whose ``calls=`` computation holds a
# synchronous collective.
_OP = re.compile(
    r"^(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) "
    r"(?P<kind>[a-z][\w\-]*?)(?P<phase>-start|-update|-done)?\("
)


class CollectiveOp(NamedTuple):
    """One collective of a compiled program.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute`` or
        ``all-to-all``.
      nbytes: bytes of the op's result.
      count: executions per call (the product of enclosing loops' trip counts, plus one
        for a collective in a loop's condition).
      group: devices in each replica group.
      sent: bytes each device sends per execution, indexed by device.
      rounds: communication rounds per execution.
      branch: ``""`` outside conditionals, else which conditional branch holds the op.
      buffers: arrays the op carries (XLA may combine several collectives into one op of
        tuple shape; XLA:CPU's gloo collectives still make one call per buffer).
      groups: the devices of each replica group (a collective-permute: each source and
        target pair), as the program numbers them (the mesh's device order).
    """

    kind: str
    nbytes: int
    count: int
    group: int
    sent: tuple[float, ...]
    rounds: int
    branch: str
    buffers: int = 1
    groups: tuple[tuple[int, ...], ...] = ()


class CommStats(NamedTuple):
    """What one call of a compiled program communicates (unconditional ops only).

    Attributes:
      bytes_per_device: bytes sent per call by the busiest device.
      bytes_sent: bytes sent per call, indexed by device.
      bytes_by_kind: per collective kind, bytes sent per call by its busiest device.
      rounds: communication rounds per call.
      ops: every collective, including those in conditional branches.
      branches: per conditional branch, bytes sent by its busiest device when it runs
        (with those of the branches around it; one inside a loop, as if taken every trip).
    """

    bytes_per_device: float
    bytes_sent: tuple[float, ...]
    bytes_by_kind: dict[str, float]
    rounds: int
    ops: tuple[CollectiveOp, ...]
    branches: dict[str, float]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as ``f32[3,4]{1,0}`` or a tuple ``(f32[3], bf16[])``."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BITS:
            raise ValueError(
                f"comm_stats: unknown HLO element type {dtype!r} in {shape!r}; known: "
                f"{sorted(_DTYPE_BITS)}."
            )
        count = math.prod(int(d) for d in filter(None, dims.split(",")))
        total += -(-count * _DTYPE_BITS[dtype] // 8)  # a packed sub-byte array rounds up
    return total


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        stripped = line.strip()
        m = _COMPUTATION.match(stripped)
        if m and not stripped.startswith("HloModule"):
            current = m[1]
            comps[current] = []
            if stripped.startswith("ENTRY"):
                entry = current
        elif stripped == "}":
            current = None
        elif current is not None:
            comps[current].append(stripped)
    return comps, entry


def replica_groups(line: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of an HLO collective, in either of XLA's notations.

    ``replica_groups={{0,2},{1,3}}`` lists them; ``replica_groups=[2,2]<=[2,2]T(1,0)`` is
    ``iota(4).reshape(2, 2).transpose(1, 0).reshape(2, 2)``, one group per row; none (or
    ``{}``) is one group of all ``devices``. A collective-permute's groups are its
    ``source_target_pairs``.
    """
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return tuple((int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m[1]))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        dims = [int(d) for d in m[3].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m[4]:
            ids = ids.transpose([int(p) for p in m[4].split(",")])
        return tuple(tuple(row) for row in ids.reshape(int(m[1]), int(m[2])).tolist())
    listed = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if listed:
        return tuple(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", listed[1]))
    return (tuple(range(devices)),)


def _collective(kind: str, line: str, nbytes: int, devices: int, count: int, branch: str):
    groups = replica_groups(line, devices)
    if kind == "collective-permute":
        sources = {s for s, t in groups if s != t}
        sent = tuple(float(nbytes) if d in sources else 0.0 for d in range(devices))
        return CollectiveOp(kind, nbytes, count, 2, sent, 1, branch, groups=groups)
    g = len(groups[0])
    per_device, rounds = _ring_cost(kind, nbytes, g)
    op = CollectiveOp(kind, nbytes, count, g, (per_device,) * devices, rounds, branch)
    return op._replace(groups=groups)


def _ring_cost(kind: str, nbytes: float, g: int) -> tuple[float, int]:
    """Bytes each of g members sends, and the rounds, for a result of ``nbytes`` (the
    module's table)."""
    per_device = {
        "all-reduce": 2 * (g - 1) / g * nbytes,
        "all-gather": (g - 1) / g * nbytes,
        "reduce-scatter": (g - 1) * nbytes,
        "all-to-all": (g - 1) / g * nbytes,
    }[kind]
    return per_device, 2 * (g - 1) if kind == "all-reduce" else g - 1


def _operand(line: str, paren: int) -> str:
    """Name of the last operand in the list that opens at ``line[paren]``.

    Compiled HLO may print each operand's shape before its name, e.g.
    ``async-done(((f32[8]{0}), f32[2]{0}, u32[]) %async-start)``.
    """
    depth = 0
    for i in range(paren, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return line[paren + 1 : i].split()[-1].lstrip("%")
    raise ValueError(f"comm_stats: unbalanced operand list in HLO line {line!r}.")


def _start_of(done: re.Match, ops: dict[str, re.Match]) -> re.Match:
    """The ``-start`` an async ``-done`` completes, through any ``-update`` between them."""
    m = done
    while True:
        name = _operand(m.string, m.end() - 1)
        m = ops.get(name)
        if m is None or m["kind"] != done["kind"] or m["phase"] not in ("-start", "-update"):
            raise ValueError(
                f"comm_stats: {done['name']} does not complete a {done['kind']}-start "
                f"(its operand is {name!r})."
            )
        if m["phase"] == "-start":
            return m


def branch_computations(line: str) -> list[str]:
    """The branch computations of a ``conditional`` instruction, in branch order."""
    names = re.search(r"branch_computations=\{([^}]*)\}", line)
    if names:
        return [n.strip().lstrip("%") for n in names[1].split(",")]
    return re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)


def _walk(comps, name, devices, count, branch, out) -> None:
    ops = {m["name"]: m for line in comps.get(name, ()) if (m := _OP.search(line))}
    subs = []
    for m in ops.values():
        line, kind, phase = m.string, m["kind"], m["phase"]
        if phase not in ("-update", "-done"):  # those name their -start's computation again
            subs += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line)
        if kind == "while":
            body = re.search(r"body=%?([\w.\-]+)", line)[1]
            cond = re.search(r"condition=%?([\w.\-]+)", line)[1]
            body_ops: list[CollectiveOp] = []
            cond_ops: list[CollectiveOp] = []
            _walk(comps, body, devices, count, branch, body_ops)
            _walk(comps, cond, devices, count, branch, cond_ops)
            if not body_ops and not cond_ops:
                continue
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            if trip is None:
                raise ValueError(
                    "comm_stats: a while loop with collectives has no known trip count; "
                    "use lax.fori_loop/scan with static bounds."
                )
            n = int(trip[1])
            # The condition runs once more than the body: its last run ends the loop.
            out += [op._replace(count=op.count * n) for op in body_ops]
            out += [op._replace(count=op.count * (n + 1)) for op in cond_ops]
        elif kind == "conditional":
            for i, sub in enumerate(branch_computations(line)):
                _walk(comps, sub, devices, count, f"{branch}{sub} (branch {i})/", out)
        elif kind in KINDS and phase in (None, "-done"):
            # A -done's shape is the collective's result (its -start's shape also holds the
            # operands and context), but the attributes are on the -start.
            attrs = _start_of(m, ops).string if phase else line
            nbytes = shape_bytes(m["shape"])
            op = _collective(kind, attrs, nbytes, devices, count, branch.rstrip("/"))
            out.append(op._replace(buffers=len(_ARRAY.findall(m["shape"]))))
    for sub in subs:
        _walk(comps, sub, devices, count, branch, out)


def collectives(hlo: str) -> tuple[CollectiveOp, ...]:
    """Lists the collectives of compiled HLO text (an async pair counts once, at ``-done``)."""
    comps, entry = computations(hlo)
    devices = re.search(r"num_partitions=(\d+)", hlo)
    devices = int(devices[1]) if devices else 1
    out: list[CollectiveOp] = []
    _walk(comps, entry, devices, 1, "", out)
    return tuple(out)


def comm_stats(jitted: Any, *args: Any, **kwargs: Any) -> CommStats:
    """Bytes each device sends per call of ``jitted(*args, **kwargs)``, from the compiled HLO.

    Args:
      jitted: a ``jax.jit``-wrapped function, or the program lowered or compiled already
        (``jax.jit(f).lower(...)``, and its ``.compile()``), then without arguments.
      *args, **kwargs: arguments to lower it with (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      A ``CommStats``; see the module docstring for what each collective is charged.

    The bytes are those of the compiled program for the backend that compiled it: XLA:CPU
    widens a bfloat16 collective to float32 (the simulated devices and a gloo cluster send
    4 bytes an entry; float16 stays 2), which GPU and TPU collectives need not: count a
    bfloat16 model's bytes from a program compiled there. ``ddl.compression.cast
    (jnp.bfloat16)`` sends its values bit-cast, 2 bytes an entry on every backend.

    Example:
      A data-parallel step on 8 workers all-reduces the 64 gradient entries and the loss:

      >>> import jax, jax.numpy as jnp, numpy as np, optax, ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> params = {"w": jnp.zeros((16, 4))}
      >>> batch = {"x": np.ones((8, 16), np.float32), "y": np.ones((8, 4), np.float32)}
      >>> strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
      >>> stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
      >>> stats.bytes_per_device  # 2 (N-1)/N * 65 floats * 4 bytes
      455.0
    """
    return summarise(collectives(compiled_text("comm_stats", jitted, args, kwargs)))


def compiled_text(caller: str, jitted: Any, args: tuple, kwargs: dict) -> str:
    """The optimised HLO text of ``jitted`` compiled for ``args`` (a ``jax.jit`` function),
    or of a program already lowered (``jax.stages.Lowered``) or compiled (``Compiled``)."""
    if isinstance(jitted, (jax.stages.Lowered, jax.stages.Compiled)):
        if args or kwargs:
            raise TypeError(
                f"{caller}: a lowered or compiled program takes no arguments (it was lowered "
                "with them); pass the jax.jit function and the arguments instead."
            )
        compiled = jitted.compile() if isinstance(jitted, jax.stages.Lowered) else jitted
        return compiled.as_text()
    if not hasattr(jitted, "lower"):
        raise TypeError(
            f"{caller}: jitted must be a jax.jit function (or its .lower(...) or "
            f".lower(...).compile()), got {jitted!r}."
        )
    return jitted.lower(*args, **kwargs).compile().as_text()


def runs_in(op_branch: str, branch: str) -> bool:
    """Whether a collective of ``op_branch`` runs when ``branch`` is taken: it is that
    branch, or one around it (a nested branch's key extends its parents' with ``/``)."""
    return branch == op_branch or branch.startswith(op_branch + "/")


def summarise(ops: tuple[CollectiveOp, ...]) -> CommStats:
    """The ``CommStats`` of a program whose collectives are ``ops``."""
    devices = max((len(op.sent) for op in ops), default=1)
    sent = [0.0] * devices
    by_kind: dict[str, list[float]] = {}
    branches: dict[str, list[float]] = {}
    rounds = 0
    for key in dict.fromkeys(op.branch for op in ops if op.branch):
        branches[key] = [0.0] * devices
    for op in ops:
        # a branch's ops run with it, and with every branch inside it
        targets = [v for k, v in branches.items() if runs_in(op.branch, k)] if op.branch else [sent]
        for target in targets:
            for d, b in enumerate(op.sent):
                target[d] += b * op.count
        if not op.branch:
            rounds += op.rounds * op.count
            kind = by_kind.setdefault(op.kind, [0.0] * devices)
            for d, b in enumerate(op.sent):
                kind[d] += b * op.count
    return CommStats(
        bytes_per_device=max(sent),
        bytes_sent=tuple(sent),
        bytes_by_kind={k: max(v) for k, v in by_kind.items()},
        rounds=rounds,
        ops=tuple(ops),
        branches={k: max(v) for k, v in branches.items()},
    )


def per_worker(stats: CommStats, per_device: int) -> CommStats:
    """What each worker sends when a program runs ``per_device`` workers a device (a
    strategy's ``workers=``): the collectives of the same run on one device a worker, the
    algorithm's bytes rather than the simulation's.

    A collective over g devices becomes one over ``g * per_device`` workers. An
    all-reduce's result is a worker's (a device sums its workers' values, then
    all-reduces), and so is an all-gather's (every worker's rows); an all-to-all's, a
    reduce-scatter's and a permute's carry the device's workers' rows, ``per_device``
    times a worker's. Bytes and rounds then follow the module's table; a permute's
    sources send 1 / ``per_device`` of their device's bytes each. Exact where each device
    shift of a permutation is one worker shift: on 2 devices a ring's left and right
    moves are the same device shift, one permute, and count once. Not otherwise: gossip's
    exponential graph over 8 workers on 4 devices (worker shifts 1, 2, 4) compiles to 2
    device permutes where 8 devices send 3, and is priced at the 2 (a third low).

    Args:
      stats: what ``comm_stats`` read from the program.
      per_device: workers a device, >= 1 (``workers / devices``).

    Returns:
      The ``CommStats`` of the ``devices * per_device`` workers, indexed by worker.
    """
    if not isinstance(stats, CommStats):
        raise TypeError(
            f"per_worker: stats must be a ddl.sim.CommStats (from ddl.comm_stats), got "
            f"{type(stats).__name__}."
        )
    k = check_int("per_device", per_device, minimum=1)
    if k == 1:
        return stats
    ops = []
    for op in stats.ops:
        if op.kind == "collective-permute":
            sent = tuple(b / k for b in op.sent for _ in range(k))
            pairs = tuple((s * k + j, t * k + j) for s, t in op.groups for j in range(k))
            ops.append(op._replace(nbytes=op.nbytes // k, sent=sent, groups=pairs))
            continue
        nbytes = op.nbytes if op.kind in ("all-reduce", "all-gather") else op.nbytes // k
        each, rounds = _ring_cost(op.kind, nbytes, op.group * k)
        groups = tuple(tuple(d * k + j for d in g for j in range(k)) for g in op.groups)
        ops.append(op._replace(nbytes=nbytes, group=op.group * k, rounds=rounds,
                               sent=(each,) * (len(op.sent) * k), groups=groups))  # fmt: skip
    return summarise(tuple(ops))


def split_islands(stats: CommStats, island_devices: int) -> tuple[CommStats, CommStats]:
    """A program's collectives split into those within an island and those across islands.

    Devices ``k * island_devices, ..., (k + 1) * island_devices - 1`` form island k, as
    ``ddl.make_mesh(island=...)`` lays them out (the ``island`` axis outermost).

    Args:
      stats: what ``comm_stats`` read from the program.
      island_devices: devices per island, >= 1.

    Returns:
      ``(within, across)``: the ``CommStats`` of the collectives whose every group lies
      in one island, and of the others (``ddl.sim.estimate_step_time`` prices each on its
      own network).
    """
    island_devices = check_int("island_devices", island_devices, minimum=1)
    inside, across = [], []
    for op in stats.ops:
        one = all(len({d // island_devices for d in group}) == 1 for group in op.groups)
        (inside if one else across).append(op)
    return summarise(tuple(inside)), summarise(tuple(across))
