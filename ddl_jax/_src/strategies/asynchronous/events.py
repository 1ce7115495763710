"""The event clock of ``async_sgd``: a pure simulation of a parameter server's schedule.

Which worker arrives when, who pushes, when the server applies an update and who fetches
depends only on the compute times and the protocol, never on the parameters. So the
whole schedule of one ``Strategy.step`` is a pure function of a small :class:`Clock`
(N-sized vectors and scalars), computed and tested here without a mesh or a model;
``async_sgd`` replays the :class:`Event`s it returns on the parameters.

Event model: worker i's k-th gradient takes ``d(i, k)`` simulated time units
(``staleness.duration``; under ``async_local(H)`` a task is H gradients and the
strategy hands the clock H times the per-gradient times, ``staleness.task_time``; under
DyLU, worker i's H_i times its own); it
starts when the worker fetches (or is released) at time t and arrives at ``t + d(i, k)``.
Arrivals are taken in time order, ties broken by the lower worker index. One step:

1. :func:`start_step`: every worker that has started a task whose gradient is not
   computed yet computes it (``computes``), so its gradient is ``ready``.
2. :func:`next_event`, N times (2N with churn): the next arrival is processed if its
   gradient is ready (or it is a rejoin); the first that is not (a worker that started a
   new task during this step) stops the step, and every later event is empty. Each
   worker thus completes at most one task per step (and rejoins at most once). The
   strategy runs :func:`events_in_order`, which computes the same events at once from
   the order of the arrivals; :func:`scanned_events`, one event after another, is the
   reference it is tested against.

Unreliable workers (``Rules.drop``, ``Rules.leave`` / ``Rules.away``), both seeded by the
clock's key and (worker i, task k) alone (:func:`coin`), so a resumed run and a plain
scheduler draw the same:

* A push of task k is lost with probability ``drop``: the server never sees it (no
  staleness, no group count, no update). The worker does not know; it fetches as after
  any push, and since the server holds no push of its, nothing holds its fetch back: it
  gets the server's current state at once, even under softsync (where the group keeps
  waiting for the next arrivals). Its clock (SSP) counts the task all the same.
* After completing task k - 1 (and its push), a worker leaves with probability ``leave``
  (drawn for task k, the one it would start next): it is away, computing nothing, for
  ``away`` simulated time; its return is an event (a *rejoin*) at which it fetches the
  server's state and starts task k as a worker that just completed one would: the SSP
  bound, or its push still in the open softsync group, may hold it (it fetches when
  it starts).

SSP's cached reads (``Rules.cached``, Ho et al.'s SSPTable): a worker that starts task c
fetches only where its copy's clock (``Clock.read_clock``, the least task count when it
last fetched) is below c - bound; a worker held by the bound always fetches (its copy's
clock is at most the least, which is below c - bound), so one that keeps its copy does
so at its own arrival (``Event.keep``), and its push's update, in its copy, is not
counted in its next push's staleness.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ddl_jax._src.strategies.asynchronous import staleness as sl


class Clock(NamedTuple):
    """The server's view of its N workers, replicated on every device.

    Attributes:
      now: the simulated time of the last event, float32 scalar.
      arrival: ``[N]`` float32, when each worker's task in flight completes (ignored
        where ``waiting``).
      fetched_version: ``[N]`` int32, the server version each worker last fetched, plus
        the updates of its own pushes its copy took since (SSP's cached reads): a push's
        staleness is the server's version minus this.
      tasks: ``[N]`` int32, gradients each worker has completed (its SSP clock); the task
        in flight of worker i is its ``tasks[i]``-th (from 0).
      ready: ``[N]`` bool, whether the gradient of a worker's task in flight is computed.
      waiting: ``[N]`` bool, workers that finished a task and wait to start the next one
        (for a softsync group to fill, or for the SSP bound).
      version: server updates applied so far, int32 scalar.
      group_count: pushes the server holds for its next update (softsync), int32 scalar.
      group_staleness: the sum of their staleness, float32 scalar.
      key: the PRNG key data (``uint32[2]``) of random compute times, lost pushes and
        churn.
      away: ``[N]`` bool, workers that left; their ``arrival`` is their rejoin time.
      grouped: ``[N]`` bool, workers whose push is in the server's open softsync group.
      read_clock: ``[N]`` int32, the server's clock (the least of ``tasks``) when each
        worker last fetched: under SSP's cached reads its copy serves a task while this
        is at least the task's number minus the bound.
    """

    now: jax.Array
    arrival: jax.Array
    fetched_version: jax.Array
    tasks: jax.Array
    ready: jax.Array
    waiting: jax.Array
    version: jax.Array
    group_count: jax.Array
    group_staleness: jax.Array
    key: jax.Array
    away: jax.Array
    grouped: jax.Array
    read_clock: jax.Array


class Event(NamedTuple):
    """What one arrival makes the server and the workers do (all zero/False where not
    ``happens``).

    Attributes:
      happens: bool, the next arrival's gradient is ready, so it is processed.
      worker: int32, the arriving worker (the next in time order, whether or not it
        ``happens``).
      push: bool, the server receives a push (every arrival, or under Downpour the
        worker's 1st, (``n_push`` + 1)-th, ... gradient's, unless it is ``lost``).
      apply: bool, the server then applies an update (the push completes a group).
      staleness: float32, the push's tau: server updates since the worker's fetch, less
        its own that its copy holds.
      update_staleness: float32, the mean tau of the pushes the update applies.
      start: ``[N]`` bool, workers that start a new task after the event.
      fetch: ``[N]`` bool, those of them that first fetch the server's (updated) state.
      gap: float32, the largest lead in clocks of a starting worker over the slowest one.
      lost: bool, the worker sent a push that is lost in transit.
      rejoin: bool, the event is the worker's return (no task completes).
      leave: bool, the worker leaves after this event's task.
      keep: bool, the worker starts its next task at this event on its own copy, without
        fetching (Downpour between fetches; SSP's cached read, the copy then holding the
        push's update).
    """

    happens: jax.Array
    worker: jax.Array
    push: jax.Array
    apply: jax.Array
    staleness: jax.Array
    update_staleness: jax.Array
    start: jax.Array
    fetch: jax.Array
    gap: jax.Array
    lost: jax.Array
    rejoin: jax.Array
    leave: jax.Array
    keep: jax.Array


class Rules(NamedTuple):
    """A protocol and its faults as the numbers the clock needs (static Python values).

    Attributes:
      group_size: pushes per server update (softsync n; 1 otherwise).
      bound: the SSP bound, or ``None``.
      cached: SSP's cached reads: a starting worker fetches only where its copy's
        ``read_clock`` is below its task count minus the bound (or it rejoins).
      n_fetch: a worker fetches every ``n_fetch`` gradients (Downpour; 1 otherwise).
      n_push: a worker pushes after its 1st, (``n_push`` + 1)-th, ... gradient (Downpour,
        Dean et al.'s ``step mod n_push == 0`` counting from 0; 1 otherwise).
      drop: the probability that a push is lost.
      leave: the probability that a worker leaves after a task.
      away: how long a worker that leaves stays away.
    """

    group_size: int = 1
    bound: int | None = None
    cached: bool = False
    n_fetch: int = 1
    n_push: int = 1
    drop: float = 0.0
    leave: float = 0.0
    away: float = 0.0

    @classmethod
    def of(cls, protocol: sl.Protocol, drop: float = 0.0, churn: sl.Churn | None = None) -> Rules:
        """The rules of a validated protocol (``staleness.as_protocol``), a push loss
        probability in [0, 1] and a validated churn."""
        faults = {"drop": drop}
        if churn is not None:
            faults |= {"leave": churn.leave, "away": churn.away}
        if isinstance(protocol, sl.SoftSync):
            return cls(group_size=protocol.n, **faults)
        if isinstance(protocol, sl.SSP):
            return cls(bound=protocol.bound, cached=protocol.reads == "cached", **faults)
        if isinstance(protocol, sl.Downpour):
            return cls(n_fetch=protocol.n_fetch, n_push=protocol.n_push, **faults)
        return cls(**faults)

    @property
    def churn(self) -> bool:
        return self.leave > 0


# Streams of ``coin``: distinct from the durations' draws, which fold in no stream.
DROP, LEAVE = 1, 2


def coin(key: jax.Array, stream: int, worker: jax.Array, task: jax.Array, p: float) -> jax.Array:
    """A bool that is True with probability ``p``, a pure function of (key, stream, worker,
    task): ``uniform(fold_in(fold_in(fold_in(key, worker), task), stream)) < p``."""
    if p == 0:
        return jnp.zeros(jnp.shape(worker), bool)
    key = jax.random.wrap_key_data(key, impl="threefry2x32")
    draw = lambda i, k: jax.random.uniform(  # noqa: E731
        jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, i), k), stream)
    )
    return jax.vmap(draw)(jnp.ravel(worker), jnp.ravel(task)).reshape(jnp.shape(worker)) < p


def durations(times: sl.ComputeTime, key: jax.Array, tasks: jax.Array) -> jax.Array:
    """``[N]``: how long each worker's ``tasks[i]``-th gradient takes."""
    n = tasks.shape[0]
    one = lambda i, k: sl.duration(times, n, key, i, k)  # noqa: E731
    return jax.vmap(one)(jnp.arange(n), tasks)


class Draws(NamedTuple):
    """A step's random draws, made at its start for every worker at once (``[N]`` each).

    A worker completes at most one task in a step, so the task it starts in the step is
    its ``tasks`` at the start (released from waiting, or rejoining) or the next one (it
    arrived): both its durations are drawn here, and each event reads its worker's
    instead of drawing. The values are ``durations`` and ``coin``'s, the same as drawn one
    at a time.

    Attributes:
      tasks: each worker's ``Clock.tasks`` at the step's start.
      now: ``d(i, tasks[i])``; next: ``d(i, tasks[i] + 1)``.
      lost: whether the push of task ``tasks[i]`` is lost (``Rules.drop``).
      leave: whether the worker leaves after task ``tasks[i]`` (``Rules.leave``).
    """

    tasks: jax.Array
    now: jax.Array
    next: jax.Array
    lost: jax.Array
    leave: jax.Array


def draws(clock: Clock, rules: Rules, times: sl.ComputeTime) -> Draws:
    """Every worker's draws of the step that starts at ``clock``."""
    tasks, n = clock.tasks, clock.tasks.shape[0]
    workers = jnp.arange(n)
    return Draws(
        tasks=tasks,
        now=durations(times, clock.key, tasks),
        next=durations(times, clock.key, tasks + 1),
        lost=coin(clock.key, DROP, workers, tasks, rules.drop),
        leave=coin(clock.key, LEAVE, workers, tasks + 1, rules.leave),
    )


def initial_clock(times: sl.ComputeTime, n: int) -> Clock:
    """Time 0: every worker has fetched version 0 and started its first task."""
    key = jax.random.key_data(jax.random.key(times.seed, impl="threefry2x32"))
    zeros = jnp.zeros(n, jnp.int32)
    return Clock(
        now=jnp.zeros((), jnp.float32),
        arrival=durations(times, key, zeros),
        fetched_version=zeros,
        tasks=zeros,
        ready=jnp.zeros(n, bool),
        waiting=jnp.zeros(n, bool),
        version=jnp.zeros((), jnp.int32),
        group_count=jnp.zeros((), jnp.int32),
        group_staleness=jnp.zeros((), jnp.float32),
        key=key,
        away=jnp.zeros(n, bool),
        grouped=jnp.zeros(n, bool),
        read_clock=zeros,
    )


def start_step(clock: Clock) -> tuple[Clock, jax.Array]:
    """Step phase 1: returns the clock with every started gradient ready, and ``computes``
    (``[N]`` bool), the workers that compute a gradient this step."""
    present = ~clock.waiting & ~clock.away
    return clock._replace(ready=clock.ready | present), ~clock.ready & present


def next_event(clock: Clock, rules: Rules, drawn: Draws) -> tuple[Clock, Event]:
    """Step phase 2, one event: the next arrival, what it does, and the clock after it.

    The arriving worker w completes a task (or rejoins, if it was away); if it pushes and
    the push is not lost, the server counts it into its group and applies an update when
    the group is full. Then w (unless it leaves) and every waiting worker start a new task
    unless their push is in a softsync group still open or the SSP bound holds them back;
    a starting worker fetches first if its task count is a multiple of ``n_fetch`` (under
    SSP's cached reads: if its copy's clock is behind its task count minus the bound), or
    if it rejoins; one that does not keeps its copy (with its own update, under SSP), and
    its next arrival is ``now + d(i, tasks[i])``; a leaving one returns at
    ``now + away``. Where the arrival's gradient is not ready (and it is no rejoin), the
    clock is returned unchanged and the event is empty.
    """
    n = clock.arrival.shape[0]
    w = jnp.argmin(jnp.where(clock.waiting, jnp.inf, clock.arrival))
    me = jnp.arange(n) == w
    rejoin = clock.away[w]
    happens = clock.ready[w] | rejoin
    t = clock.arrival[w]
    tasks = clock.tasks.at[w].add(jnp.where(rejoin, 0, 1))
    sent = ~rejoin & ((tasks[w] - 1) % rules.n_push == 0)  # Dean et al.: step = tasks - 1
    lost = sent & drawn.lost[w]  # task clock.tasks[w] = drawn.tasks[w]: its first arrival
    push = sent & ~lost
    leave = ~rejoin & drawn.leave[w]
    tau = (clock.version - clock.fetched_version[w]).astype(jnp.float32)
    count = jnp.where(push, clock.group_count + 1, clock.group_count)
    tau_sum = jnp.where(push, clock.group_staleness + tau, clock.group_staleness)
    apply = push & (count == rules.group_size)
    version = clock.version + apply.astype(jnp.int32)
    count, held_tau = jnp.where(apply, 0, count), jnp.where(apply, 0.0, tau_sum)
    # Held by the open softsync group: the workers whose push is in it (none after an
    # update, so never with groups of one).
    grouped = jnp.where(apply, False, clock.grouped | (me & push))
    waiting = clock.waiting | (me & ~leave)
    lead = tasks - tasks.min()
    allowed = ~grouped
    if rules.bound is not None:
        allowed &= lead <= rules.bound
    start = waiting & allowed
    due = clock.read_clock < tasks - rules.bound if rules.cached else tasks % rules.n_fetch == 0
    fetch = start & (due | (me & rejoin))
    keep = start[w] & ~fetch[w]
    # SSP's cached read holds the worker's own update: not one it missed
    own = me & keep & apply if rules.cached else jnp.zeros(n, bool)
    took = jnp.where(tasks == drawn.tasks, drawn.now, drawn.next)
    arrival = jnp.where(start, t + took, clock.arrival)
    after = Clock(
        now=t,
        arrival=jnp.where(me & leave, t + rules.away, arrival),
        fetched_version=jnp.where(fetch, version, clock.fetched_version + own),
        tasks=tasks,
        ready=clock.ready.at[w].set(False),
        waiting=waiting & ~start,
        version=version,
        group_count=count,
        group_staleness=held_tau,
        key=clock.key,
        away=(clock.away & ~me) | (me & leave),
        grouped=grouped,
        read_clock=jnp.where(fetch, tasks.min(), clock.read_clock),
    )
    clock = jax.tree.map(lambda new, old: jnp.where(happens, new, old), after, clock)
    event = Event(
        happens=happens,
        worker=w.astype(jnp.int32),
        push=happens & push,
        apply=happens & apply,
        staleness=jnp.where(happens & push, tau, 0.0),
        update_staleness=jnp.where(happens & apply, tau_sum / rules.group_size, 0.0),
        start=happens & start,
        fetch=happens & fetch,
        gap=jnp.where(happens, jnp.max(jnp.where(start, lead, 0)), 0).astype(jnp.float32),
        lost=happens & lost,
        rejoin=happens & rejoin,
        leave=happens & leave,
        keep=happens & keep,
    )
    return clock, event


def scanned_events(clock: Clock, rules: Rules, drawn: Draws) -> tuple[Clock, Event]:
    """``next_event`` N times (2N with churn), in a ``lax.scan``: the event model as it
    reads, the reference ``events_in_order`` is tested against (bitwise)."""
    n = clock.arrival.shape[0] * (2 if rules.churn else 1)
    return lax.scan(lambda c, _: next_event(c, rules, drawn), clock, None, length=n)


def _lexical_min(x: tuple[jax.Array, jax.Array], y: tuple[jax.Array, jax.Array]) -> Any:
    """The smaller of two (time, worker) pairs, elementwise: the earlier, ties to the lower
    worker (``next_event``'s order)."""
    first = (x[0] < y[0]) | ((x[0] == y[0]) & (x[1] < y[1]))
    return jnp.where(first, x[0], y[0]), jnp.where(first, x[1], y[1])


def _first_by_index(at: jax.Array, time: jax.Array, worker: jax.Array, size: int) -> Any:
    """Per index 0..size-1, the least (time, worker) pair scattered to it (``(inf, BIG)``
    where none): the earliest time, ties to the lower worker."""
    big = jnp.iinfo(jnp.int32).max
    least = jnp.full(size, jnp.inf, time.dtype).at[at].min(time, mode="drop")
    tied = jnp.where(time == least[jnp.minimum(at, size - 1)], worker, big)
    return least, jnp.full(size, big, jnp.int32).at[at].min(tied, mode="drop")


def of_workers(w: jax.Array, flag: jax.Array, n: int) -> jax.Array:
    """``[N]``: whether any event of each worker (``w``, its events' workers) has ``flag``."""
    return jnp.zeros(n, jnp.int32).at[w].max(flag.astype(jnp.int32)) > 0


def events_in_order(clock: Clock, rules: Rules, drawn: Draws) -> tuple[Clock, Event, jax.Array]:
    """``scanned_events`` at once: the same clock and events, and ``last_fetch`` of the
    events, in O(N log N) (the events' ``start`` and ``fetch`` flags, ``[events, N]``,
    cost O(N^2) where they are read; ``last_fetch`` is computed in O(N)).

    Every worker has at most two candidate events in a step, known at its start: its
    first (its arrival if it is ready, its return if it is away; none if it waits at the
    server), and, if it leaves after that arrival, its return ``away`` later. The events
    are the candidates in (time, worker) order, up to the first that comes after the
    second arrival of a worker started earlier in the step (whose gradient is not
    computed). A worker starts at its arrival (unless it leaves) or its return, or later
    at the event that applies its softsync group, or at the first event after which the
    slowest worker is within the SSP bound of it (the least task count never decreases).
    Pushes, groups, versions, staleness, fetches and the least task count are prefix sums
    and minima over the events."""
    n, big = clock.arrival.shape[0], jnp.iinfo(jnp.int32).max
    workers = jnp.arange(n, dtype=jnp.int32)
    held, away = clock.waiting, clock.away  # waiting at the server; away (to return)
    # candidates: each worker's first event, then (churn) the return of one that leaves
    leaves = drawn.leave & ~away & ~held
    time = jnp.where(held, jnp.inf, clock.arrival)
    if rules.churn:
        time = jnp.concatenate([time, jnp.where(leaves, clock.arrival + rules.away, jnp.inf)])
    size = time.shape[0]
    owner = workers if size == n else jnp.concatenate([workers, workers])
    kind = (jnp.arange(size) >= n) | jnp.tile(away, size // n)  # a return
    order = jnp.lexsort((kind, owner, time)).astype(jnp.int32)
    w, is_return, t = owner[order], kind[order], time[order]
    valid = jnp.isfinite(t)
    index = jnp.arange(size, dtype=jnp.int32)
    arrives = valid & ~is_return
    returned_after_arriving = is_return & ~away[w]  # its arrival was earlier this step
    tasks = drawn.tasks[w] + (arrives | returned_after_arriving)
    sent = arrives & ((tasks - 1) % rules.n_push == 0)
    lost = sent & drawn.lost[w]
    push = sent & ~lost
    leave = arrives & leaves[w]
    pushes = clock.group_count + jnp.cumsum(push.astype(jnp.int32))
    apply = push & (pushes % rules.group_size == 0)
    applied = jnp.cumsum(apply.astype(jnp.int32)) - apply  # updates before each event
    version = clock.version + applied
    tau = version - clock.fetched_version[w]
    # the least task count after each event: the arrivals so far one task on
    done = lax.cummin(jnp.where(arrives, tasks, big))
    rest = lax.cummin(jnp.where(arrives, drawn.tasks[w], big), reverse=True)
    still = jnp.min(jnp.where(held | away, drawn.tasks, big))  # no arrival this step
    rest = jnp.minimum(jnp.concatenate([rest[1:], jnp.full(1, big, jnp.int32)]), still)
    least = jnp.minimum(done, rest)  # never decreases
    # the event that starts each event's worker (big: none): its own, the one applying
    # its group, or the first after which the slowest is within the SSP bound
    next_apply = lax.cummin(jnp.where(apply, index, big), reverse=True)
    arrival_of = jnp.full(n, big, jnp.int32).at[w].min(jnp.where(arrives, index, big))
    j = jnp.minimum(arrival_of, size - 1)
    pushed_at = jnp.where((arrival_of < big) & push[j], next_apply[j], 0)  # its group's update
    group = jnp.where(clock.grouped, next_apply[0], pushed_at)  # the update it waits for
    free = lambda count: jnp.zeros_like(count)  # noqa: E731
    if rules.bound is not None:
        free = lambda count: jnp.searchsorted(least, count - rules.bound).astype(jnp.int32)  # noqa: E731
    release = jnp.maximum(jnp.maximum(index, group[w]), free(tasks))
    release = jnp.where(leave | ~valid, big, release)
    held_release = jnp.maximum(group, free(drawn.tasks))
    # a started worker's second arrival competes from the event after its start
    took = jnp.where(held | away, drawn.now, drawn.next)
    arrival = t[jnp.minimum(release, size - 1)] + took[w]
    held_arrival = t[jnp.minimum(held_release, size - 1)] + took
    at = jnp.concatenate([
        jnp.where(release < size, release + 1, size + 1),
        jnp.where(held & (held_release < size), held_release + 1, size + 1),
    ])  # fmt: skip
    rivals = _first_by_index(at, jnp.concatenate([arrival, held_arrival]),
                             jnp.concatenate([w, workers]), size + 1)  # fmt: skip
    rival = lax.associative_scan(_lexical_min, rivals)
    first = (t < rival[0][:size]) | ((t == rival[0][:size]) & (w < rival[1][:size]))
    happens = jnp.cumsum(~(valid & first)) == 0
    count = happens.sum()
    push, lost, apply, leave = push & happens, lost & happens, apply & happens, leave & happens
    started = happens & (release < count)
    held_started = held & (held_release < count)
    # each worker's start event (big: none), its task count then, whether it fetches
    start_of = jnp.full(n, big, jnp.int32).at[w].min(jnp.where(started, release, big))
    start_of = jnp.where(held_started, held_release, start_of)
    arrived = of_workers(w, arrives & happens, n)
    now_tasks = drawn.tasks + arrived
    own_return = of_workers(w, started & is_return & (release == index), n)
    if rules.cached:
        due = clock.read_clock < now_tasks - rules.bound
    else:
        due = now_tasks % rules.n_fetch == 0
    fetches = (start_of < big) & (due | own_return)
    keeps = (start_of < big) & ~fetches
    keep = started & (release == index) & ~fetches[w]
    own = keeps & of_workers(w, apply, n) if rules.cached else jnp.zeros(n, bool)
    after_start = clock.version + jnp.cumsum(apply.astype(jnp.int32))  # after each event
    # the open group's staleness: integers, whose float32 sums (the scan's) are exact
    taus = jnp.cumsum(jnp.where(push, tau, 0))
    closed = jnp.where(apply, taus, 0)
    before_group = lax.cummax(jnp.concatenate([jnp.zeros(1, jnp.int32), closed[:-1]]))
    carried = jnp.where(applied == 0, clock.group_staleness, 0.0)
    group_tau = (taus - before_group).astype(jnp.float32) + carried
    # the largest lead of a starting worker at each event
    most = (
        jnp.full(size, -1, jnp.int32)
        .at[jnp.where(start_of < big, start_of, size)]
        .max(now_tasks, mode="drop")
    )
    gap = jnp.where(happens & (most >= 0), most - least, 0)
    last = jnp.maximum(count - 1, 0)
    left = of_workers(w, leave, n)
    returned = of_workers(w, is_return & happens, n)
    now_away = (away | left) & ~returned
    starts = start_of < big
    waiting = ~now_away & ~starts & (held | arrived | returned)
    unapplied = next_apply >= count  # pushes in a group still open at the step's end
    grouped = of_workers(w, push & unapplied, n) | (clock.grouped & unapplied[0])
    new_arrival = (
        jnp.zeros_like(clock.arrival).at[jnp.where(started, w, n)].set(arrival, mode="drop")
    )
    new_arrival = jnp.where(held_started, held_arrival, new_arrival)
    # one that left returns ``away`` after its arrival (unchanged by its return)
    pending = jnp.where(left, clock.arrival + rules.away, clock.arrival)
    fetched_at = after_start[jnp.minimum(start_of, size - 1)]
    clock = clock._replace(
        now=jnp.where(count > 0, t[last], clock.now),
        arrival=jnp.where(starts, new_arrival, pending),
        fetched_version=jnp.where(fetches, fetched_at, clock.fetched_version + own),
        tasks=clock.tasks + arrived,
        ready=clock.ready & ~arrived & ~returned,
        waiting=waiting,
        version=clock.version + apply.sum(dtype=jnp.int32),
        group_count=jnp.where(count > 0, pushes[last] % rules.group_size, clock.group_count),
        group_staleness=jnp.where(
            count > 0, jnp.where(apply[last], 0.0, group_tau[last]), clock.group_staleness
        ),
        away=now_away,
        grouped=grouped,
        read_clock=jnp.where(fetches, least[jnp.minimum(start_of, size - 1)], clock.read_clock),
    )
    stop = jnp.argmin(jnp.where(clock.waiting, jnp.inf, clock.arrival)).astype(jnp.int32)
    starting = (index[:, None] == start_of[None, :]) & happens[:, None]
    events = Event(
        happens=happens,
        worker=jnp.where(happens, w, stop),
        push=push,
        apply=apply,
        staleness=jnp.where(push, tau.astype(jnp.float32), 0.0),
        update_staleness=jnp.where(apply, group_tau / rules.group_size, 0.0),
        start=starting,
        fetch=starting & fetches[None, :],
        gap=gap.astype(jnp.float32),
        lost=lost,
        rejoin=happens & is_return,
        leave=leave,
        keep=keep,
    )
    return clock, events, jnp.where(fetches, start_of, -1)  # a worker starts once a step


def step_clock(
    clock: Clock, rules: Rules, times: sl.ComputeTime
) -> tuple[Clock, jax.Array, Event, jax.Array]:
    """One whole step of the schedule: ``(clock, computes, events, last_fetch(events))``
    (see the module), every part in O(N log N)."""
    clock, computes = start_step(clock)
    clock, events, last = events_in_order(clock, rules, draws(clock, rules, times))
    return clock, computes, events, last


def last_fetch(events: Event) -> jax.Array:
    """``[N]`` int32: the event at which each worker last fetched in the step, -1 if none."""
    order = jnp.arange(events.fetch.shape[0])[:, None]
    return jnp.max(jnp.where(events.fetch, order, -1), axis=0)


class Summary(NamedTuple):
    """A step's events in the metrics' terms (float32 scalars)."""

    pushes: jax.Array
    staleness_mean: jax.Array
    staleness_max: jax.Array
    clock_gap_max: jax.Array
    pushes_lost: jax.Array


def summarize(events: Event) -> Summary:
    """Pushes received, their mean and largest staleness (0 if none), the largest clock
    gap, and the pushes lost."""
    pushes = events.push.sum().astype(jnp.float32)
    return Summary(
        pushes=pushes,
        staleness_mean=events.staleness.sum() / jnp.maximum(pushes, 1.0),
        staleness_max=events.staleness.max(),
        clock_gap_max=events.gap.max(),
        pushes_lost=events.lost.sum().astype(jnp.float32),
    )


def replica_lag(clock: Clock) -> jax.Array:
    """The mean over workers of the server updates since each one's last fetch that its
    copy lacks (float32): how far behind the server, in versions, the parameters the
    workers hold are."""
    return jnp.mean((clock.version - clock.fetched_version).astype(jnp.float32))
