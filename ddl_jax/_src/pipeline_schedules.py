"""Pipeline schedules as plain data: which micro-batch each stage runs at each tick.

A schedule is computed in numpy from ``(K stages, M micro-batches, kind)`` before anything
is traced, so its bubble and its activation memory can be read (and tested) without
running it, and ``ddl.pipeline`` drives its ``lax.scan`` over ticks from the same tables.

Time is counted in ticks; a forward or a backward of one micro-batch through one stage
takes one tick (the usual unit-cost model of the GPipe and PipeDream papers).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "ddg")
IDLE = -1


class Schedule(NamedTuple):
    """Which micro-batch each stage runs at each tick (``-1``: none).

    Attributes:
      forward: ``int[T, K]``, the micro-batch stage ``k`` runs forward at tick ``t``.
      backward: ``int[T, K]``, the micro-batch stage ``k`` runs backward at tick ``t``.
      stages: K.
      microbatches: M.
      kind: ``"gpipe"``, ``"1f1b"`` or ``"ddg"``.
    """

    forward: np.ndarray
    backward: np.ndarray
    stages: int
    microbatches: int
    kind: str


def _op_lists(
    stages: int, microbatches: int, kind: str, fold_last: bool
) -> list[list[tuple[str, int]]]:
    """Each stage's operations in the order it runs them; with ``fold_last`` the last
    stage's forwards are left out (each runs inside its backward)."""
    k_, m_ = stages, microbatches
    if kind == "gpipe":
        orders = [[("F", m) for m in range(m_)] + [("B", m) for m in range(m_)]] * k_
    else:
        orders = [_one_f_one_b(k_, m_, k) for k in range(k_)]
    if fold_last:
        orders[-1] = [op for op in orders[-1] if op[0] == "B"]
    return orders


def _one_f_one_b(k_: int, m_: int, k: int) -> list[tuple[str, int]]:
    """Stage k's operations under PipeDream-Flush: K-1-k warm-up forwards, then one
    forward and one backward in turn, so at most K-k micro-batches are in flight."""
    warmup = min(k_ - 1 - k, m_)
    ops = [("F", m) for m in range(warmup)]
    for i in range(m_ - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", m) for m in range(m_ - warmup, m_)]


def _simulate(
    stages: int, microbatches: int, kind: str, fold_last: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Runs each stage's next operation as soon as its inputs arrived on an earlier tick."""
    orders = _op_lists(stages, microbatches, kind, fold_last)
    done: dict[tuple[str, int, int], int] = {}  # (op, stage, micro-batch) -> tick
    position = [0] * stages
    forward, backward = [], []
    t = 0
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        row_f, row_b = [IDLE] * stages, [IDLE] * stages
        for k in range(stages):
            if position[k] == len(orders[k]):
                continue
            op, m = orders[k][position[k]]
            if op == "F":
                needs = [("F", k - 1, m)] if k > 0 else []
            elif k < stages - 1:
                needs = [("B", k + 1, m)]
            elif not fold_last:
                needs = [("F", k, m)]  # the last stage's own forward
            else:  # folded: the input its backward computes the forward from
                needs = [("F", k - 1, m)] if k > 0 else []
            if all(done.get(n, t) < t for n in needs):
                (row_f if op == "F" else row_b)[k] = m
        for k in range(stages):
            for op, row in (("F", row_f), ("B", row_b)):
                if row[k] != IDLE:
                    done[(op, k, row[k])] = t
                    position[k] += 1
        forward.append(row_f)
        backward.append(row_b)
        t += 1
    return np.array(forward, np.int32), np.array(backward, np.int32)


def make_schedule(
    stages: int, microbatches: int, kind: str, *, tick: int = 0, fold_last: bool = False
) -> Schedule:
    """The schedule of one training step.

    * ``gpipe`` (Huang et al. 2019, arXiv:1811.06965): all M forwards, then all M
      backwards; exact gradients; every stage holds all M micro-batches' inputs.
    * ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): after K-1-k
      warm-up forwards stage k alternates one forward and one backward; exact gradients;
      stage k holds at most K-k micro-batches' inputs.
    * ``ddg`` (Huo et al. 2018, arXiv:1804.10574): at every tick every stage runs one
      forward and one (delayed) backward: at global tick t stage k forwards micro-batch
      ``t - k`` and backpropagates micro-batch ``t - 2(K-1) + k``. The pipeline stays full
      from one step to the next, so these indices may point into earlier steps (negative
      values before the first step mean "nothing yet").

    Args:
      stages: K >= 1.
      microbatches: M >= 1 per step.
      kind: one of ``"gpipe"``, ``"1f1b"``, ``"ddg"``.
      tick: for ``ddg``, the global tick at which the step starts.
      fold_last: for ``gpipe`` and ``1f1b``, the last stage runs no forward of its own:
        its backward of a micro-batch computes the forward too, as soon as the input has
        arrived (``forward[:, K-1]`` is all ``-1``). ``ddl.pipeline`` runs 1F1B this way,
        where the last stage's forward and backward follow each other anyway: for K = 2,
        M = 4 its 10 ticks, every second one idle on the last stage, become 8.

    Returns:
      A ``Schedule``; ``gpipe`` and ``1f1b`` take ``2 (M + K - 1)`` ticks unfolded, ``ddg``
      takes M.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule={kind!r} is not known; valid: {list(SCHEDULES)}.")
    if kind == "ddg":
        t = np.arange(tick, tick + microbatches)[:, None]
        k = np.arange(stages)[None, :]
        forward, backward = t - k, t - 2 * (stages - 1) + k
    else:
        forward, backward = _simulate(stages, microbatches, kind, fold_last)
    return Schedule(forward, backward, stages, microbatches, kind)


def idle_fraction(schedule: Schedule) -> float:
    """The fraction of stage time spent waiting (the pipeline bubble).

    A tick lasts as long as its busiest stage (one unit per forward or backward), and
    ``idle = 1 - work / (K * total time)``; for GPipe this is ``(K-1) / (M+K-1)``.
    """
    work = (schedule.forward >= 0).astype(int) + (schedule.backward >= 0)
    return float(1 - work.sum() / (schedule.stages * work.max(axis=1).sum()))


def stash_intervals(schedule: Schedule) -> list[dict[int, tuple[int, int]]]:
    """For each stage, the ticks ``(first, last)`` it holds each micro-batch's input.

    A stage holds an input from the tick it arrives (the end of the tick its predecessor
    ran the forward; for the first stage, the tick of its own forward) through the tick of
    its backward, which re-runs the stage from that input.
    """
    held = []
    for k in range(schedule.stages):
        source = schedule.forward[:, max(k - 1, 0)]
        intervals = {}
        for m in range(schedule.microbatches):
            (last,) = np.flatnonzero(schedule.backward[:, k] == m)
            arrived = np.flatnonzero(source == m)
            # A single folded stage runs no forward: it holds its input in its backward only.
            intervals[m] = (int(arrived[0]) if len(arrived) else int(last), int(last))
        held.append(intervals)
    return held


def peak_stash(schedule: Schedule) -> int:
    """The most micro-batch inputs any stage holds at once (activation memory in units of
    one micro-batch's stage input). GPipe: M; 1F1B: at most K."""
    if schedule.kind == "ddg":
        # Stage k>0 holds micro-batches t-2(K-1)+k .. t-k; stage 0's inputs are the batch.
        return max([2 * (schedule.stages - 1 - k) + 1 for k in range(1, schedule.stages)] + [1])
    peak = 0
    for intervals in stash_intervals(schedule):
        ticks = np.zeros(len(schedule.forward), int)
        for first, last in intervals.values():
            ticks[first : last + 1] += 1
        peak = max(peak, int(ticks.max()))
    return peak


def gradient_wait(schedule: Schedule) -> int:
    """The most backward error gradients any stage holds that arrived before it could use
    them (the size of its gradient inbox)."""
    peak = 0
    for k in range(schedule.stages - 1):
        ticks = np.zeros(len(schedule.backward), int)
        for m in range(schedule.microbatches):
            (first,) = np.flatnonzero(schedule.backward[:, k + 1] == m)
            (last,) = np.flatnonzero(schedule.backward[:, k] == m)
            ticks[first:last] += 1
        peak = max(peak, int(ticks.max()))
    return peak
