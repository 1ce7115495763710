"""The straggler report of a multi-process ``fit``: per rank, the time its host works and
the time it waits for device results, and the rank the others wait for, named.

In a synchronous program every rank's step ends together, so step times cannot tell the
ranks apart. What can: the host's time between waits. A rank whose host is slow (its
loader, a callback, logging) starts its steps late; the others' steps then stall inside
their collectives, and their hosts wait for results. So each rank measures, per step after
the first (which compiles), its wall time and the part of it spent blocked on device
results; the rest is its host's. The rank whose host time stands out is the straggler.

A rank slow in its device computation (a core shared with other work, a slower
accelerator) makes every rank's host wait alike; these timings do not tell it apart, and
the report says so.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np

#: A rank is named a straggler when its host seconds per step (mean) exceed every other
#: rank's by this factor and by a margin, the larger of ``STRAGGLER_MIN_SECONDS`` and
#: ``STRAGGLER_STEP_SHARE`` of the step (the median of the ranks' median steps), and every
#: other rank waited for results that margin longer than it did: a clear margin that costs
#: the others a share of each step, not a loaded machine's noise.
STRAGGLER_RATIO = 2.0
STRAGGLER_MIN_SECONDS = 1e-3
STRAGGLER_STEP_SHARE = 0.25


class StepClock:
    """Per step after the first: the host's seconds (wall time less the waits) and the
    seconds waited on device results (``waiting``)."""

    def __init__(self) -> None:
        self.host: list[float] = []
        self.waited: list[float] = []
        self._last: float | None = None
        self._blocked = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Times a wait on device results (``block_until_ready``, a fetch)."""
        tick = time.perf_counter()
        try:
            yield
        finally:
            self._blocked += time.perf_counter() - tick

    def lap(self) -> None:
        """Ends a step (its loop iteration, from drawing its batch on); the first, which
        compiles, only starts the clock."""
        now = time.perf_counter()
        if self._last is not None:
            self.host.append(now - self._last - self._blocked)
            self.waited.append(self._blocked)
        self._last, self._blocked = now, 0.0

    def row(self, rank: int, loader_seconds: list[float], step_seconds: list[float]) -> list[float]:
        """This rank's row of the report (``straggler_lines``): the first step's loader
        time (the batches' cross-process check) and the first log interval (compiling) left
        out where there are others."""
        loader = loader_seconds[1:] or loader_seconds
        steps = step_seconds[1:] or step_seconds
        mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
        return [
            rank,
            mean(self.host),
            max(self.host, default=0.0),
            mean(loader),
            mean(self.waited),
            float(np.median(steps)) if steps else 0.0,
        ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def straggler_lines(ranks: np.ndarray) -> list[str]:
    """The report: one line per rank, then one naming the straggler, or saying none stands
    out.

    Args:
      ranks: one row per process (``StepClock.row``), in seconds: ``[rank, host per step
        (mean), host worst step, loader per step (mean), waited per step (mean), step
        (median)]``.
    """
    ranks = np.asarray(ranks, dtype=np.float64)
    ranks = ranks[np.argsort(ranks[:, 0])]
    lines = [
        f"fit: rank {int(rank)}: host {_ms(host)} a step (mean; loader {_ms(loader)}), "
        f"{_ms(worst)} worst; waited {_ms(waited)} a step (mean) for results; step "
        f"{_ms(step)} median"
        for rank, host, worst, loader, waited, step in ranks
    ]
    slowest = int(np.argmax(ranks[:, 1]))
    rank, host, waited = int(ranks[slowest, 0]), ranks[slowest, 1], ranks[slowest, 4]
    others = np.delete(ranks, slowest, axis=0)
    busiest, least_waited = max(others[:, 1], default=0.0), min(others[:, 4], default=0.0)
    margin = max(STRAGGLER_MIN_SECONDS, STRAGGLER_STEP_SHARE * float(np.median(ranks[:, 5])))
    waited_for = least_waited - waited >= margin
    if host > STRAGGLER_RATIO * busiest and host - busiest >= margin and waited_for:
        lines.append(
            f"fit: rank {rank} is the straggler: its host takes {_ms(host)} a step (mean: its "
            f"loader, callbacks, logging; anything but waiting on results), the others' at most "
            f"{_ms(busiest)}. The others wait for it inside each step's collectives: they "
            f"waited {_ms(least_waited)} a step or more for results, it waited {_ms(waited)}."
        )
    else:
        lines.append(
            f"fit: no rank stands out: the busiest host, rank {rank}'s, takes {_ms(host)} a "
            f"step (mean), the others' at most {_ms(busiest)} (a straggler's would exceed "
            f"theirs {STRAGGLER_RATIO:g}x and by at least {_ms(margin)}, the larger of "
            f"{_ms(STRAGGLER_MIN_SECONDS)} and {STRAGGLER_STEP_SHARE:.0%} of a step, and the "
            "others would wait that much longer than it). A rank slow in its device "
            "computation (a shared core, a slower accelerator) makes every rank wait alike and "
            "is not told apart by these timings."
        )
    return lines
