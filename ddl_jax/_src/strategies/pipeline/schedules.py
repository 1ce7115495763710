"""Pipeline schedules as plain data: which micro-batch each stage runs at each tick.

A schedule is computed in numpy from ``(K stages, M micro-batches, kind)`` before anything
is traced, so its bubble and its activation memory can be read (and tested) without
running it, and ``ddl.pipeline`` drives its ``lax.scan`` over ticks from the same tables.

Time is counted in ticks; a forward or a backward of one micro-batch through one stage
takes one tick (the usual unit-cost model of the GPipe and PipeDream papers). Stages run
in lock-step: what a stage sends on a tick arrives for the next one, so a tick lasts as
long as its slowest stage. Given each stage's costs, ``make_schedule`` may instead group
ticks: up to G operations of a stage share a group, its messages travel at the group's
end, and a stage with cheap operations runs several while a costly one runs one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ddl_jax._src.core.strategy import check_int

SCHEDULES = ("gpipe", "1f1b", "ddg")
IDLE = -1
#: The least fraction of the unit-cost schedule's lock-step time a grouping must save to
#: be chosen: its ticks run more conditionals and larger messages, which costs do not count.
GROUPING_GAIN = 0.05


class Schedule(NamedTuple):
    """Which micro-batch each stage runs at each tick (``-1``: none).

    Attributes:
      forward: ``int[T, K]``, the micro-batch stage ``k`` runs forward at tick ``t``.
      backward: ``int[T, K]``, the micro-batch stage ``k`` runs backward at tick ``t``.
      stages: K.
      microbatches: M.
      kind: ``"gpipe"``, ``"1f1b"`` or ``"ddg"``.
      group: G, ticks per group: messages are exchanged at the end of each run of G ticks
        (ticks ``G g .. G g + G - 1``), not after every tick; 1 for the unit-cost schedules.
    """

    forward: np.ndarray
    backward: np.ndarray
    stages: int
    microbatches: int
    kind: str
    group: int = 1

    def arrival(self, t: int | np.ndarray) -> int | np.ndarray:
        """The tick at whose end a message sent on tick ``t`` arrives (its group's last)."""
        return (t // self.group + 1) * self.group - 1


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


def _needs(stages: int, k: int, op: str, m: int, fold_last: bool) -> list[tuple[str, int, int]]:
    """The operations ``(op, stage, micro-batch)`` whose results stage k's ``(op, m)`` uses."""
    if op == "F":
        return [("F", k - 1, m)] if k > 0 else []
    if k < stages - 1:
        return [("B", k + 1, m)]
    if not fold_last:
        return [("F", k, m)]  # the last stage's own forward
    # Folded: the input its backward computes the forward from.
    return [("F", k - 1, m)] if k > 0 else []


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
            if all(done.get(n, t) < t for n in _needs(stages, k, op, m, fold_last)):
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


Costs = Sequence[tuple[float, float]]


def _cost(costs: Costs, stages: int, k: int, op: str) -> float:
    """Stage k's cost of ``op``; the last stage's forward runs inside its backward."""
    return 0.0 if op == "F" and k == stages - 1 else float(costs[k][op == "B"])


def _grouped(
    stages: int, microbatches: int, kind: str, costs: Costs, overshoot: bool
) -> list[list[list[tuple[str, int]]]]:
    """Each stage's operations (in its order, the last stage folded) packed into groups of
    lock-step ticks: ``groups[g][k]`` are stage k's operations in group g, each needing only
    what arrived at the end of an earlier group (see :func:`_next_group`)."""
    orders = _op_lists(stages, microbatches, kind, fold_last=True)
    done: set[tuple[str, int, int]] = set()  # (op, stage, micro-batch) of earlier groups
    position = [0] * stages
    left = [sum(_cost(costs, stages, k, op) for op, _ in ops) for k, ops in enumerate(orders)]
    groups: list[list[list[tuple[str, int]]]] = []
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        # What each stage could run now, in its order: what the operations need has arrived.
        ready = [
            list(
                itertools.takewhile(
                    lambda o, k=k: all(n in done for n in _needs(stages, k, *o, fold_last=True)),
                    orders[k][position[k] :],
                )
            )
            for k in range(stages)
        ]
        costly = max(range(stages), key=left.__getitem__)
        group = _next_group(
            ready,
            [[_cost(costs, stages, k, op) for op, _ in r] for k, r in enumerate(ready)],
            costly if overshoot else None,
        )
        for k, ops in enumerate(group):
            done.update((op, k, m) for op, m in ops)
            position[k] += len(ops)
            left[k] -= sum(_cost(costs, stages, k, op) for op, _ in ops)
        groups.append(group)
    return groups


def _next_group(
    ready: list[list[tuple[str, int]]], costs: list[list[float]], costly: int | None
) -> list[list[tuple[str, int]]]:
    """What each stage runs in the next group, from the operations it could run in order
    (``ready[k]``, costing ``costs[k]``).

    The group lasts as long as the costliest first operation a stage can run; every stage
    then runs further operations while they fit. A ``costly`` stage (the one with the most
    work left, which sets the step's length) that would still idle runs one operation more
    and the group lengthens: idling it costs the whole step, idling another only its slack.
    """
    counts = [min(len(r), 1) for r in ready]
    work = [sum(c[:n]) for c, n in zip(costs, counts, strict=True)]

    def fill() -> None:
        length = max(work)
        for k, c in enumerate(costs):
            while counts[k] < len(c) and work[k] + c[counts[k]] <= length:
                work[k] += c[counts[k]]
                counts[k] += 1

    fill()
    if costly is not None and counts[costly] < len(costs[costly]) and work[costly] < max(work):
        work[costly] += costs[costly][counts[costly]]
        counts[costly] += 1
        fill()
    return [r[:n] for r, n in zip(ready, counts, strict=True)]


def _from_rows(
    layouts: list[list[list[tuple[str, int] | None]]], stages: int, microbatches: int, kind: str
) -> Schedule:
    """Groups given tick by tick (``layouts[g][j][k]``: stage k's operation ``(op, m)`` on
    tick j of group g, or ``None``) as a ``Schedule``: group g is ticks ``G g .. G g + G -
    1``, G the longest group."""
    size = max(1, *(len(rows) for rows in layouts))
    forward = np.full((len(layouts) * size, stages), IDLE, np.int32)
    backward = forward.copy()
    for g, rows in enumerate(layouts):
        for j, row in enumerate(rows):
            for k, op in enumerate(row):
                if op is not None:
                    (forward if op[0] == "F" else backward)[g * size + j, k] = op[1]
    return Schedule(forward, backward, stages, microbatches, kind, size)


def _tables(
    groups: list[list[list[tuple[str, int]]]], stages: int, microbatches: int, kind: str
) -> Schedule:
    """The groups (``groups[g][k]``: stage k's operations in group g) as a ``Schedule``,
    each stage's operations on its group's first ticks."""
    return _from_rows(
        [[list(row) for row in itertools.zip_longest(*group)] for group in groups],
        stages,
        microbatches,
        kind,
    )


def one_kind_ticks(plan: Schedule) -> Schedule:
    """The same groups of ticks, laid out so that no tick runs a forward on one stage and
    a backward on another: a stage's operations keep their order within its group, and
    the group grows by the ticks that takes (idle ticks cost next to nothing; nothing
    travels between a group's ticks). A tick of both kinds would have every stage's
    forward return a zero parameter gradient as large as the stage, for the switch's
    branches to agree. The last stage's forwards are left out (its backward runs them).
    """
    k_, g_ = plan.stages, plan.group
    groups = []
    for g in range(len(plan.forward) // g_):
        ops: list[list[tuple[str, int]]] = [[] for _ in range(k_)]
        for t, k in itertools.product(range(g * g_, (g + 1) * g_), range(k_)):
            if plan.forward[t, k] >= 0 and k < k_ - 1:
                ops[k].append(("F", int(plan.forward[t, k])))
            if plan.backward[t, k] >= 0:
                ops[k].append(("B", int(plan.backward[t, k])))
        layout: list[list[tuple[str, int] | None]] = []
        while any(ops):
            # Next, the kind of work of the stage with the most operations left.
            kind = max((len(o), o[0][0] == "F") for o in ops if o)[1]
            layout.append([o.pop(0) if o and (o[0][0] == "F") == kind else None for o in ops])
        groups.append(layout)
    return _from_rows(groups, k_, plan.microbatches, plan.kind)


def lockstep_time(schedule: Schedule, costs: Costs) -> float:
    """The schedule's time if stage k's forward and backward of a micro-batch cost
    ``costs[k]`` and nothing else does: the sum over groups of ticks (single ticks for
    ``group=1``) of the longest stage's work in it. The last stage's forward is free: it
    runs inside its backward. (``costs`` in any unit: seconds, flops.)"""
    check_costs(costs, schedule.stages)
    k_, g_ = schedule.stages, schedule.group
    per_stage = np.zeros(schedule.forward.shape)
    for k in range(k_):
        per_stage[:, k] = (schedule.forward[:, k] >= 0) * _cost(costs, k_, k, "F") + (
            schedule.backward[:, k] >= 0
        ) * _cost(costs, k_, k, "B")
    return float(per_stage.reshape(-1, g_, k_).sum(axis=1).max(axis=1).sum())


def check_costs(costs: Costs, stages: int, name: str = "costs") -> None:
    """A ``ValueError`` naming ``name`` unless ``costs`` is ``stages`` pairs of finite
    non-negative numbers."""
    try:
        pairs = np.asarray(costs, np.float64)
    except (TypeError, ValueError):
        pairs = None
    if (
        pairs is None
        or pairs.shape != (stages, 2)
        or not np.isfinite(pairs).all()
        or (pairs < 0).any()
    ):
        raise ValueError(
            f"{name} must be {stages} pairs (forward, backward) of finite non-negative numbers, "
            f"one per stage, got {costs!r}."
        )


def make_schedule(
    stages: int,
    microbatches: int,
    kind: str,
    *,
    tick: int = 0,
    fold_last: bool = False,
    costs: Costs | None = None,
) -> Schedule:
    """The schedule of one training step.

    * ``gpipe`` (Huang et al. 2019, arXiv:1811.06965): all M forwards, then all M
      backwards; exact gradients; every stage holds all M micro-batches' inputs.
    * ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): after K-1-k
      warm-up forwards stage k alternates one forward and one backward; exact gradients;
      a stage holds at most K micro-batches' inputs (:func:`peak_stash`).
    * ``ddg`` (Huo et al. 2018, arXiv:1804.10574) with its forward pipelined
      (``ddl.pipeline(ddg_forward="pipelined")``): at every tick every stage runs one
      forward and one (delayed) backward: at global tick t stage k forwards micro-batch
      ``t - k`` and backpropagates micro-batch ``t - 2(K-1) + k``. The pipeline stays full
      from one step to the next, so these indices may point into earlier steps (negative
      values before the first step mean "nothing yet"). The default, forward-locked DDG
      has no such table: within each tick its forwards run stage after stage (K - 1 sends)
      before every stage's backward, so a tick lasts K forwards and a backward.

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
      costs: for ``gpipe`` and ``1f1b``, stage k's ``(forward, backward)`` cost of one
        micro-batch (the backward as the pipeline runs it, re-running the forward; the last
        stage's forward is not used). The result groups ticks (``group`` > 1), the
        per-stage orders unchanged, where that makes :func:`lockstep_time` at least 5%
        (``GROUPING_GAIN``) shorter than the unit-cost schedule's: with unequal stages a
        cheap stage runs several operations while a costly one runs one.

    Returns:
      A ``Schedule``; ``gpipe`` and ``1f1b`` take ``2 (M + K - 1)`` ticks unfolded, ``ddg``
      takes M.
    """
    stages = check_int("make_schedule: stages", stages, minimum=1)
    microbatches = check_int("make_schedule: microbatches", microbatches, minimum=1)
    tick = check_int("make_schedule: tick", tick)
    if kind not in SCHEDULES:
        raise ValueError(f"schedule={kind!r} is not known; valid: {list(SCHEDULES)}.")
    if kind == "ddg" and fold_last:
        raise ValueError(
            "fold_last folds the last stage of 'gpipe' and '1f1b'; 'ddg' runs no fold."
        )
    if kind != "ddg" and tick:
        raise ValueError(f"tick= places a 'ddg' step in the pipeline; {kind!r} has no ticks.")
    if costs is not None:
        if kind == "ddg":
            raise ValueError(
                "costs= groups the ticks of 'gpipe' and '1f1b'; 'ddg' has none to group."
            )
        check_costs(costs, stages)
        unit = make_schedule(stages, microbatches, kind, fold_last=fold_last)
        grouped = min(
            (
                _tables(_grouped(stages, microbatches, kind, costs, o), stages, microbatches, kind)
                for o in (False, True)
            ),
            key=lambda s: lockstep_time(s, costs),
        )
        saves = lockstep_time(grouped, costs) < (1 - GROUPING_GAIN) * lockstep_time(unit, costs)
        return grouped if saves else unit
    if kind == "ddg":
        t = np.arange(tick, tick + microbatches)[:, None]
        k = np.arange(stages)[None, :]
        forward, backward = t - k, t - 2 * (stages - 1) + k
    else:
        forward, backward = _simulate(stages, microbatches, kind, fold_last)
    return Schedule(forward, backward, stages, microbatches, kind)


def idle_fraction(schedule: Schedule) -> float:
    """The fraction of stage time spent waiting (the pipeline bubble).

    A tick (a group of ticks) lasts as long as its busiest stage (one unit per forward or
    backward), and ``idle = 1 - work / (K * total time)``; for GPipe this is
    ``(K-1) / (M+K-1)``. A folded tick (``fold_last``: the last stage's forward inside its
    backward) counts as one unit of work, so a folded schedule, though shorter, reads idler
    (1F1B, K = 2: 0.25 at any M >= 2). For time under unequal forward and backward costs, see
    :func:`lockstep_time`.
    """
    work = (schedule.forward >= 0).astype(int) + (schedule.backward >= 0)
    per_group = work.reshape(-1, schedule.group, schedule.stages).sum(axis=1)
    return float(1 - work.sum() / (schedule.stages * per_group.max(axis=1).sum()))


def stash_intervals(schedule: Schedule) -> list[dict[int, tuple[int, int]]]:
    """For each stage, the ticks ``(first, last)`` it holds each micro-batch's input.

    A stage holds an input from the tick it arrives (the end of the tick, or group of
    ticks, its predecessor ran the forward in; for the first stage, the tick of its own
    forward) through the tick of its backward, which re-runs the stage from that input.
    """
    if schedule.kind == "ddg":
        raise ValueError(
            "stash_intervals: a 'ddg' schedule keeps the pipeline full across steps, so its "
            "stash has no intervals within one step; peak_stash gives its size."
        )
    held = []
    for k in range(schedule.stages):
        source = schedule.forward[:, max(k - 1, 0)]
        intervals = {}
        for m in range(schedule.microbatches):
            (last,) = np.flatnonzero(schedule.backward[:, k] == m)
            arrived = np.flatnonzero(source == m)
            if k > 0:
                arrived = schedule.arrival(arrived)
            # A single folded stage runs no forward: it holds its input in its backward only.
            intervals[m] = (int(arrived[0]) if len(arrived) else int(last), int(last))
        held.append(intervals)
    return held


def peak_stash(schedule: Schedule) -> int:
    """The most micro-batch inputs any stage holds at once (activation memory in units of
    one micro-batch's stage input). GPipe: M (1 for one stage folded); 1F1B: at most K."""
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
            (sent,) = np.flatnonzero(schedule.backward[:, k + 1] == m)
            (last,) = np.flatnonzero(schedule.backward[:, k] == m)
            ticks[schedule.arrival(sent) : last] += 1
        peak = max(peak, int(ticks.max()))
    return peak
