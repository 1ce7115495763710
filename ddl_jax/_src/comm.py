"""Reading the collectives of a compiled program from its HLO text."""

from __future__ import annotations

import re
from typing import NamedTuple

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_OP = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[\w\[\],{}:]+)\s+(?P<kind>"
    + "|".join(KINDS)
    + r")(?P<phase>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


class Collective(NamedTuple):
    """One collective op of a compiled program: its kind and the bytes of its result."""

    kind: str
    nbytes: int


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as ``f32[3,4]{1,0}`` or a tuple ``(f32[3], bf16[])``."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _DTYPE_BYTES[dtype]
    return total


def collectives(hlo_text: str) -> list[Collective]:
    """Lists the collective ops in compiled HLO text (an async pair counts once, at ``-done``).

    Ops inside a loop body appear once, whatever the trip count.
    """
    return [
        Collective(m["kind"], shape_bytes(m["shape"]))
        for m in _OP.finditer(hlo_text)
        if m["phase"] != "-start"
    ]
