"""Computation read from a compiled program's HLO: floating-point operations and bytes.

A measured step time on simulated devices that share a few cores is noise (and two runs
of the same program differ by tens of percent), so a comparison prices computation from
the program itself: ``compute_stats`` walks the optimised HLO of the compiled executable,
as ``comm_stats`` does, and counts per device

* ``flops``: ``2 * prod(result) * prod(contracted)`` per ``dot`` and the like per
  ``convolution`` (inside fusions too): the work of matrix units (a product XLA rewrites
  as a multiply and a reduce, as a vector by a vector, counts none). A convolution counts
  every kernel tap of every output, its padding's too, as dense hardware computes it
  (XLA's ``cost_analysis`` counts the taps inside the image only: 9% fewer for a 3x3
  SAME convolution of a 16x16 image, 44% fewer of a 4x4 one);
* ``bytes``: the bytes of every kernel's result (each top-level instruction that computes
  something; tuples, parameters, constants and collectives excluded): memory traffic.

While loops count ``known_trip_count`` times (a loop without one, data-dependent, once:
``dynamic_loops``); of a conditional's branches, each count's largest (a lock-step
program waits for the costliest branch; where one branch has the most flops and another
the most bytes, an upper bound on it, under any device model at most twice its time).
Matrix products in vendor libraries (XLA:GPU's cuBLAS and cuDNN custom-calls) are not
read (``library_calls`` counts them): XLA:CPU and TPU programs are counted whole.
``estimate_compute_time`` prices the counts on a ``Device``: ``flops /
device.flops_per_s + bytes / device.bytes_per_s``. Deterministic: the same program gives
the same time.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from ddl_jax._src.core.strategy import check_real
from ddl_jax._src.measure.comm import (
    KINDS,
    branch_computations,
    compiled_text,
    computations,
    shape_bytes,
)

# Instructions that move no data of their own.
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
_INSTRUCTION = re.compile(
    r"^(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)"
)
_DIMS = re.compile(r"\[([\d,]*)\]")
#: The custom-call targets of vendor libraries' kernels (XLA:GPU's matrix products).
_LIBRARY = re.compile(r'custom_call_target="__(cublas|cudnn)')


class ComputeStats(NamedTuple):
    """What one device computes in one call of a compiled program.

    Attributes:
      flops: floating-point operations of its matrix products and convolutions.
      bytes: bytes its kernels write (every instruction's result, loops repeated).
      dynamic_loops: while loops whose trip count the program does not know (a
        data-dependent loop, e.g. DGC's threshold search), each counted once: ``flops``
        and ``bytes`` are then a lower bound.
      library_calls: calls of vendor libraries (``custom-call`` to cuBLAS, cuDNN, as
        XLA:GPU writes matrix products), whose flops are not read: on a GPU's program
        ``flops`` misses them.
    """

    flops: float
    bytes: float
    dynamic_loops: int = 0
    library_calls: int = 0


class Device(NamedTuple):
    """A device in a two-number model: a step takes ``flops / flops_per_s + bytes /
    bytes_per_s`` seconds.

    Attributes:
      flops_per_s: sustained floating-point operations per second of matrix products.
      bytes_per_s: memory bandwidth in bytes per second.
    """

    flops_per_s: float
    bytes_per_s: float


#: One server CPU core (AVX-512 FP32 matrix products, its share of DDR bandwidth).
CPU_CORE = Device(flops_per_s=100e9, bytes_per_s=20e9)
#: NVIDIA A100 (TF32 tensor cores, HBM2e).
A100 = Device(flops_per_s=156e12, bytes_per_s=2.0e12)
#: NVIDIA H100 SXM (TF32 tensor cores, dense; HBM3).
H100 = Device(flops_per_s=495e12, bytes_per_s=3.35e12)
#: TPU v4 chip (bf16 matrix units, HBM2).
TPU_V4 = Device(flops_per_s=275e12, bytes_per_s=1.2e12)


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m[1].split(",") if d] if m else []


def _flops(m: re.Match, shapes: dict[str, str]) -> float:
    """Floating-point operations of a ``dot`` or ``convolution`` (``shapes``: the
    computation's instructions' shapes by name, for the operands)."""
    op, line = m["op"], m.string
    if op not in ("dot", "convolution"):
        return 0.0
    operands = [shapes.get(a.strip().split()[-1].lstrip("%"), "") for a in m["args"].split(",")]
    out = math.prod(_dims(m["shape"]))
    if op == "dot":
        lhs = _dims(operands[0])
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        dims = [int(d) for d in contracted[1].split(",") if d] if contracted else []
        return 2.0 * out * math.prod(lhs[d] for d in dims if d < len(lhs))
    kernel = _dims(operands[1]) if len(operands) > 1 else []
    labels = re.search(r"dim_labels=[^_]*_([^-]*)->", line)
    outputs = kernel[labels[1].index("o")] if labels and "o" in labels[1] and kernel else 1
    return 2.0 * out * math.prod(kernel) / max(outputs, 1)


def _walk(comps: dict[str, list[str]], name: str, top: bool) -> ComputeStats:
    """The counts of computation ``name``; ``top``: its instructions are kernels (bytes
    counted), not the inside of a fusion (flops only)."""
    total = ComputeStats(0.0, 0.0)
    matches = [m for line in comps.get(name, ()) if (m := _INSTRUCTION.search(line))]
    shapes = {m["name"]: m["shape"] for m in matches}
    for m in matches:
        line, op, shape = m.string, m["op"], m["shape"]
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", line)[1]
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            n = int(trip[1]) if trip else 1
            inside = _walk(comps, body, top)
            total = _add(total, inside._replace(flops=n * inside.flops, bytes=n * inside.bytes))
            total = total._replace(dynamic_loops=total.dynamic_loops + (trip is None))
            continue
        if op == "conditional":
            costs = [_walk(comps, s, top) for s in branch_computations(line)]
            most = ComputeStats(*(max((c[i] for c in costs), default=0) for i in range(4)))
            total = _add(total, most)
            continue
        calls = int(op == "custom-call" and bool(_LIBRARY.search(line)))
        total = _add(total, ComputeStats(_flops(m, shapes), 0.0, 0, calls))
        for sub in re.findall(r"calls=%?([\w.\-]+)", line):
            total = _add(total, _walk(comps, sub, top and op == "call"))
        base = op.removesuffix("-start").removesuffix("-done")
        if top and op not in _FREE and base not in KINDS and op != "call":
            total = total._replace(bytes=total.bytes + shape_bytes(shape))
    return total


def _add(a: ComputeStats, b: ComputeStats) -> ComputeStats:
    return ComputeStats(*(x + y for x, y in zip(a, b, strict=True)))


def hlo_compute(hlo: str) -> ComputeStats:
    """:class:`ComputeStats` of compiled HLO text."""
    comps, entry = computations(hlo)
    return _walk(comps, entry, top=True)


def compute_stats(jitted: Any, *args: Any, **kwargs: Any) -> ComputeStats:
    """What one device computes in a call of ``jitted`` (a ``jax.jit`` function) on these
    arguments, read from the compiled program's HLO (see the module docstring). ``jitted``
    may also be the program lowered or compiled already (``jax.jit(f).lower(...)``, and its
    ``.compile()``), without arguments.

    Example:
      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> x = jnp.ones((64, 32))
      >>> stats = ddl.sim.compute_stats(jax.jit(lambda x, w: x @ w), x, jnp.ones((32, 16)))
      >>> stats.flops  # 2 * 64 * 16 * 32
      65536.0
    """
    return hlo_compute(compiled_text("compute_stats", jitted, args, kwargs))


def estimate_compute_time(stats: ComputeStats, device: Device) -> float:
    """Seconds of one call on ``device``: ``flops / flops_per_s + bytes / bytes_per_s``."""
    if not isinstance(device, Device):
        raise TypeError(
            "estimate_compute_time: device must be a ddl.sim.Device(flops_per_s, bytes_per_s) "
            f"(e.g. ddl.sim.A100), got {type(device).__name__}."
        )
    flops_per_s = check_real("device.flops_per_s", device.flops_per_s, minimum=0, exclusive=True)
    bytes_per_s = check_real("device.bytes_per_s", device.bytes_per_s, minimum=0, exclusive=True)
    if not isinstance(stats, ComputeStats):
        raise TypeError(
            f"estimate_compute_time: stats must be a ddl.sim.ComputeStats (from "
            f"ddl.sim.compute_stats), got {type(stats).__name__}."
        )
    flops = check_real("stats.flops", stats.flops, minimum=0)
    return flops / flops_per_s + check_real("stats.bytes", stats.bytes, minimum=0) / bytes_per_s
