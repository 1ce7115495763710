"""Asynchronous SGD simulated exactly: a parameter server and N workers in one SPMD program.

The schedule (who arrives, pushes, fetches, when the server applies) is the pure event
clock of ``events.py``; this module replays it on the parameters and model state,
several workers a device with ``workers=``, the server replicated on every device or
sharded over them (``server="sharded"``, and always under Downpour).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.kit import Kit, one_worker, prepare, restack, unstack, vary
from ddl_jax._src.core.model_loss import ModelVars, worker_key
from ddl_jax._src.measure.consistency import check_probability
from ddl_jax._src.reduce.wire import typed_like
from ddl_jax._src.strategies.asynchronous import events as ev
from ddl_jax._src.strategies.asynchronous import staleness as sl


class Workers(NamedTuple):
    """Each worker's side of :class:`AsyncSGDState`, ``[N, ...]`` sharded ``P(axis)``.

    Attributes:
      params: the server parameters the worker last fetched.
      model_state: the server model state it fetched with them (``{}`` for a plain loss).
      gradient: the gradient of its task in flight (valid where ``clock.ready``).
      new_model_state: the model state that task returned; it travels with the gradient.
    """

    params: Any
    model_state: Any
    gradient: Any
    new_model_state: Any


class Plain(NamedTuple):
    """``"async"``, ``ssp`` and ``softsync(1)``: the server holds nothing between pushes."""


class Group(NamedTuple):
    """``softsync(n)``, n > 1: the pushes the server holds for its next update, ``P()``.

    Attributes:
      gradient: the sum of their gradients.
      model_state: the sum of their model states' floating leaves (in at least float32),
        the maximum of their integer leaves.
    """

    gradient: Any
    model_state: Any


class Accrued(NamedTuple):
    """``downpour``: each worker's gradients since its last push, ``[N, ...]`` ``P(axis)``.

    Attributes:
      gradient: their sum (Dean et al.'s accumulated Delta w).
    """

    gradient: Any


class Inner(NamedTuple):
    """``async_local``: each worker's inner optimizer state, ``[N, ...]`` ``P(axis)``.

    Attributes:
      opt_state: the state of ``inner_optimizer`` on the worker's local copy; kept from
        task to task unless ``async_local(reset=True)``.
    """

    opt_state: Any


class AsyncSGDState(NamedTuple):
    """State of :func:`async_sgd`: the server, the workers, the protocol's and the clock.

    Attributes:
      params: the server's parameters, replicated ``P()``; a sharded server (Downpour, or
        ``server="sharded"``) holds the flattened parameters (zero-padded to a multiple
        of the D devices on the axis) as ``[D, ceil(size / D)]`` sharded ``P(axis)``:
        device i holds the server's i-th shard.
      opt_state: the server's optimizer state, replicated ``P()``; sharded, one state
        per shard, ``[D, ...]`` sharded ``P(axis)``.
      model: the server's model state (``P()``), the run's dropout key and the steps taken.
      workers: each worker's fetched parameters and model state and its task in flight.
      protocol: ``Plain()``, a softsync ``Group`` (its sum placed as ``params``),
        Downpour's ``Accrued`` or ``async_local``'s ``Inner``.
      clock: the simulated clocks (``events.Clock``), replicated ``P()``: every
        device runs the same event schedule.
    """

    params: Any
    opt_state: Any
    model: ModelVars
    workers: Workers
    protocol: Plain | Group | Accrued | Inner
    clock: ev.Clock


class _Local(NamedTuple):
    """Inside ``shard_map``: the server (its shard, if sharded) and this device's workers."""

    params: Any
    opt_state: Any
    model_state: Any
    workers: Workers
    protocol: Plain | Group | Accrued | Inner


def _blocks(tree: Any, n: int) -> jax.Array:
    """A params-shaped tree as the sharded server's ``[n, ceil(size / n)]`` blocks."""
    return FlatView.of(tree).blocks(tree, n)


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _rows(pred: jax.Array, x: jax.Array) -> jax.Array:
    """``pred`` (``[k]``) shaped to select rows of ``x`` (``[k, ...]``)."""
    return pred.reshape(pred.shape + (1,) * (x.ndim - 1))


def _select_rows(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(_rows(pred, a), a, b), new, old)


def _masked_rows(tree: Any, keep: jax.Array) -> Any:
    return jax.tree.map(lambda x: jnp.where(_rows(keep, x), x, jnp.zeros_like(x)), tree)


def _write(slots: Any, x: Any, at: jax.Array) -> Any:
    """``x`` written to row ``at`` of ``slots`` (leaves ``[rows, ...]``)."""
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v, at, 0), slots, x)


def _write_over(rows: jax.Array, x: jax.Array, at: jax.Array) -> jax.Array:
    """``x`` written to row ``at`` of ``rows`` (``[m, ...]``); nothing for ``at == m``."""
    m = rows.shape[0]
    row = jnp.minimum(at, m - 1)
    old = lax.dynamic_index_in_dim(rows, row, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(rows, jnp.where(at < m, x, old), row, 0)


def _held_empty(model_state: Any) -> Any:
    """An empty group's model state: zero sums (at least float32), integers at their min."""

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.full(x.shape, jnp.iinfo(x.dtype).min, x.dtype)
        return jnp.zeros_like(x)

    return jax.tree.map(one, model_state)


def _held_add(held: Any, model_state: Any) -> Any:
    def one(h: jax.Array, x: jax.Array) -> jax.Array:
        return h + x.astype(h.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.maximum(h, x)

    return jax.tree.map(one, held, model_state)


def _held_mean(held: Any, size: int, like: Any) -> Any:
    def one(h: jax.Array, x: jax.Array) -> jax.Array:
        return (h / size).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else h

    return jax.tree.map(one, held, like)


def _shard(server: _Local, how: Callable[[Any], Any]) -> _Local:
    """``unstack`` or ``restack`` a sharded server's state (softsync's held sum too)."""
    protocol = server.protocol
    if isinstance(protocol, Group):
        protocol = protocol._replace(gradient=how(protocol.gradient))
    return server._replace(params=how(server.params), opt_state=how(server.opt_state),
                           protocol=protocol)  # fmt: skip


def _check_server(server: str | None, protocol: sl.Protocol) -> bool:
    """Whether the server is sharded: ``server="sharded"``, or Downpour's (always)."""
    if server not in (None, "replicated", "sharded"):
        raise ValueError(
            f'server must be "replicated" or "sharded" (or None, the protocol\'s), got {server!r}.'
        )
    if isinstance(protocol, sl.Downpour):
        if server == "replicated":
            raise ValueError(
                f'protocol={protocol!r} keeps a sharded server: drop server="replicated".'
            )
        return True
    return server == "sharded"


def _keep(local: _Local, *_: Any) -> _Local:
    return local


def _mean0(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)


def local_steps(
    value_and_grad: Callable[..., Any],
    inner: optax.GradientTransformation,
    protocol: sl.AsyncLocal,
    axis: str,
    params: Any,
    model_state: Any,
    batch: st.Batch,
    key: jax.Array,
    opt_state: Any,
    count: jax.Array | None = None,
    skip: bool = True,
) -> tuple[Any, Any, Any, Any]:
    """One ``async_local`` task on one worker: H inner steps from the fetched ``params``.

    Step h (a ``lax.scan``) takes ``value_and_grad`` on the h-th of H consecutive slices
    of the worker's ``batch`` with key ``fold_in(key, h)`` (``key`` itself for H = 1),
    the model state threaded through, and applies ``inner``. Returns ``((loss, aux), the
    pseudo-gradient params - local params, the new model state, the inner state)``; loss
    and aux are the means over the H steps.

    ``count`` (DyLU, an int32 scalar in [1, H], this worker's H_i): only steps h < count
    are taken (a ``lax.cond`` skips the others, their slices unused; with ``skip=False``,
    under ``jax.vmap``, they run and their results are dropped); loss and aux are the
    means over those. ``None``: all H.
    """
    steps = protocol.steps
    if protocol.reset:  # a fresh inner state at every task (= at every fetch)
        opt_state = vary(inner.init(params), (axis,))
    micro = jax.tree.map(lambda x: x.reshape(steps, -1, *x.shape[1:]), batch)

    def one(carry: Any, xs: Any) -> tuple[Any, Any]:
        local, state, opt = carry
        h, part = xs
        out, grads, state = value_and_grad(
            local, state, part, key if steps == 1 else jax.random.fold_in(key, h)
        )
        updates, opt = inner.update(grads, opt, local)
        return (optax.apply_updates(local, updates), state, opt), out

    carry = (params, model_state, opt_state)
    if count is None:
        (local, model_state, opt_state), out = lax.scan(one, carry, (jnp.arange(steps), micro))
        out = _mean0(out)
    else:
        shape = jax.eval_shape(one, carry, (jnp.zeros((), jnp.int32), _first(micro)))[1]
        skipped = vary(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shape), (axis,))

        def maybe(carry: Any, xs: Any) -> tuple[Any, Any]:
            if not skip:  # every step taken, the skipped ones' results dropped
                return _select(xs[0] < count, one(carry, xs), (carry, skipped))
            return lax.cond(xs[0] < count, one, lambda c, _: (c, skipped), carry, xs)

        (local, model_state, opt_state), out = lax.scan(maybe, carry, (jnp.arange(steps), micro))
        out = jax.tree.map(lambda x: jnp.sum(x, axis=0) / count, out)
    pseudo = jax.tree.map(lambda a, b: (a - b).astype(a.dtype), params, local)
    return out, pseudo, model_state, opt_state


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _check_inner(
    protocol: sl.Protocol, inner_optimizer: optax.GradientTransformation | None
) -> sl.AsyncLocal | None:
    """``inner_optimizer`` is required by ``async_local`` and refused by the others."""
    if not isinstance(protocol, sl.AsyncLocal):
        if inner_optimizer is not None:
            raise ValueError(
                "inner_optimizer is the workers' optimizer of protocol=ddl.async_local(steps) "
                f"only; protocol={protocol!r} computes plain gradients: drop inner_optimizer."
            )
        return None
    if inner_optimizer is None:
        raise ValueError(
            f"protocol={protocol!r} needs inner_optimizer=, the optimizer of each worker's "
            "H local steps (e.g. optax.adamw(1e-3)); optimizer= is the server's outer one."
        )
    st.check_transform("inner_optimizer", inner_optimizer, "optax.adamw(1e-3)")
    return protocol


class _Program(NamedTuple):
    """The SPMD program of :func:`async_sgd`: builds the state and replays the events."""

    kit: Kit
    rules: ev.Rules
    times: sl.ComputeTime
    optimizer: optax.GradientTransformationExtraArgs
    downpour: sl.Downpour | None
    local: sl.AsyncLocal | None = None
    inner: optax.GradientTransformation | None = None
    counts: tuple[int, ...] | None = None
    sharded: bool = False
    group_scale: Callable[[jax.Array], jax.Array] | None = None

    @property
    def shards(self) -> int:
        """The server's shards under ``sharded``: one a device on the axis."""
        return self.kit.n // self.kit.per_device

    @classmethod
    def build(
        cls,
        kit: Kit,
        optimizer: optax.GradientTransformation,
        compute_time: float | Sequence[float] | sl.ComputeTime,
        protocol: str | sl.Protocol,
        drop: float = 0.0,
        churn: sl.Churn | None = None,
        inner_optimizer: optax.GradientTransformation | None = None,
        server: str | None = None,
    ) -> st.Strategy:
        """Checks the protocol, the faults and the compute times; the ``Strategy``."""
        times = sl.as_compute_time(compute_time, kit.n)
        protocol = sl.as_protocol(protocol, kit.n)
        fastest = min(times.base) if isinstance(times.base, tuple) else times.base
        if fastest == 0 and not isinstance(protocol, sl.SSP):
            raise ValueError(
                f"compute_time={compute_time!r}: a worker with compute time 0 would push without "
                "end at one instant of the clock; give every worker a time > 0, or bound it "
                "with protocol=ddl.ssp(bound)."
            )
        local = _check_inner(protocol, inner_optimizer)
        drop = check_probability("drop", drop)
        rules = ev.Rules.of(protocol, drop, sl.as_churn(churn))
        downpour = protocol if isinstance(protocol, sl.Downpour) else None
        server_opt = optax.with_extra_args_support(optimizer)
        counts = None  # DyLU's H_i, where they are not all H
        if local is not None and local.dynamic:
            counts = sl.dynamic_steps(times, local, kit.n)
            counts = None if set(counts) == {local.steps} else counts
        times = sl.task_time(times, protocol)
        sharded = _check_server(server, protocol)
        group_scale = None  # softsync(n, scale=rule): each push by its own staleness
        if isinstance(protocol, sl.SoftSync) and protocol.scale is not None:
            group_scale = sl.staleness_scale(protocol.scale, protocol.decay, "softsync scale")
        program = cls(
            kit,
            rules,
            times,
            server_opt,
            downpour,
            local,
            inner_optimizer,
            counts,
            sharded,
            group_scale,
        )
        specs = program.specs()
        params = (kit.replicated if sharded else kit.on_given_mesh)(program.variables)
        divisor, why = None, None
        if local is not None:  # each worker's shard splits into H inner micro-batches
            divisor = kit.n * kit.accumulate * local.steps
            why = (
                f"{kit.n} workers on axis {kit.axis!r} x async_local steps={local.steps}, "
                f"each worker's rows split into H inner micro-batches, x accumulate="
                f"{kit.accumulate}"
            )
        # several workers a device: the worker step takes the device's rows itself
        step = kit.step(program.worker_step, specs, divisor=divisor, why=why, vmap_workers=False)
        return st.Strategy(kit.init(program.make_state, specs), step, params)

    def specs(self) -> AsyncSGDState:
        axis = self.kit.axis
        server = P(axis) if self.sharded else P()
        protocol = P(axis) if self.downpour or self.local else P()
        if self.rules.group_size > 1:  # softsync's held sum lives with the server
            protocol = Group(server, P())
        return AsyncSGDState(
            params=server,
            opt_state=server,
            model=ModelVars(P(), P(), P()),
            workers=P(axis),
            protocol=protocol,
            clock=P(),
        )

    def make_state(self, params: st.Params, model: ModelVars) -> AsyncSGDState:
        kit = self.kit
        zeros = jax.tree.map(jnp.zeros_like, params)
        if self.sharded:
            server = _blocks(params, self.shards)
            opt_state = jax.vmap(self.optimizer.init)(server)
        else:
            server, opt_state = params, self.optimizer.init(params)
        protocol: Plain | Group | Accrued | Inner = Plain()
        if self.downpour:
            protocol = Accrued(kit.stack(zeros))
        elif self.local:
            protocol = Inner(kit.stack(self.inner.init(params)))
        elif self.rules.group_size > 1:
            protocol = Group(jax.tree.map(jnp.zeros_like, server), _held_empty(model.state))
        stacked = kit.stack((params, model.state, zeros, model.state))
        return AsyncSGDState(
            server,
            opt_state,
            model,
            Workers(*stacked),
            protocol,
            ev.initial_clock(self.times, kit.n),
        )

    def task(
        self, params: Any, model_state: Any, batch: st.Batch, key: Any, inner: Any, me: Any
    ) -> Any:
        """Worker ``me``'s task: ``((loss, aux), what is pushed, new model state, inner
        state)``."""
        if self.local is None:
            return (*self.kit.value_and_grad(params, model_state, batch, key), inner)
        kit = self.kit
        count = None
        if self.counts is not None:  # DyLU: this worker's H_i
            count = jnp.asarray(self.counts, jnp.int32)[me]
        return local_steps(
            kit.value_and_grad,
            self.inner,
            self.local,
            kit.axis,
            params,
            model_state,
            batch,
            key,
            inner,
            count,
            skip=kit.per_device == 1,
        )

    def compute(
        self, state: AsyncSGDState, me: jax.Array, computes: jax.Array, batch: st.Batch
    ) -> tuple[Workers, Any, st.Metrics]:
        """Phase 1 on the devices: each of this device's workers ``me`` (``[k]``) that
        ``computes`` takes its task's gradient (``async_local``: pseudo-gradient) and model
        state on what it fetched, on its rows of the device's batch, with the key
        ``worker_key(model, w, step=k)`` of its k-th task; the others skip it. Returns the
        workers' rows, the protocol (``Inner`` updated) and the mean metrics of those
        computing."""
        model, tasks, k = state.model, state.clock.tasks, self.kit.per_device

        def one(params, model_state, batch, w, computes, inner):
            args = (params, model_state, batch, worker_key(model, w, step=tasks[w]), inner, w)
            if k > 1:  # under vmap every task runs; the skipped ones' outputs are unused
                return self.task(*args)
            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(self.task, *args)[:3])
            return lax.cond(computes, self.task, lambda *a: (*zeros, a[-2]), *args)

        workers = state.workers
        inner = state.protocol.opt_state if self.local else None
        rows = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        args = (workers.params, workers.model_state, rows, me, computes, inner)
        out = restack(one(*unstack(args))) if k == 1 else jax.vmap(one)(*args)
        if k > 1 and self.local:
            out = (*out[:3], _select_rows(computes, out[3], inner))
        (loss, aux), gradient, model_state, inner = out
        protocol = Inner(inner) if self.local else state.protocol
        workers = workers._replace(
            gradient=_select_rows(computes, gradient, workers.gradient),
            new_model_state=_select_rows(computes, model_state, workers.new_model_state),
        )
        axis = self.kit.axis
        count = jnp.maximum(lax.psum(computes.sum(dtype=jnp.float32), axis), 1.0)
        metrics = _masked_rows({"loss": loss, **aux}, computes)
        metrics = lax.psum(jax.tree.map(lambda x: x.sum(axis=0), metrics), axis)
        return workers, protocol, {k: v / count for k, v in metrics.items()}

    def replay_server(
        self, me: jax.Array, local: _Local, events: ev.Event, last: jax.Array, pushed: Any
    ) -> _Local:
        """The step's events on the server: push and apply, in order; then each of this
        device's workers ``me`` that fetched takes the server's parameters and model state
        as they were at its last fetch (``last``, ``[N]``: its event, -1 none).

        The work is linear in the events: after event e the server's state is written to
        one slot, that of the first worker whose last fetch is e, and after the events
        each worker reads its slot. A replicated server keeps slots for this device's
        workers (``k + 1``, the last a scratch one), from an all-gather of every push
        (typed the same on every device, as the server's updates read from it must be). A
        sharded one receives its shard of every push by an all-to-all and writes its
        shard of the parameters over the pushes' own rows: a worker's push is read at its
        arrival, which comes before its last fetch or is that event (the push is read
        first), so its row is free when its slot is written. Each event then has at most
        one fetching worker, its own, unless softsync groups or the SSP bound release
        several at once; an all-to-all sends each worker its shards.

        Under SSP's cached reads a worker that keeps its copy (``events.keep``) adds the
        server's update for its push: the update is written to the worker's own row at
        its arrival (a row no fetch reads: it is not fetching), and added to its copy
        after the events."""
        owners = last if self.sharded else last[me]  # the workers whose slots are here
        m, count = owners.shape[0], events.worker.shape[0]
        at = jnp.where(owners >= 0, owners, count)  # a worker that did not fetch: the end
        first = jnp.full(count + 1, m, jnp.int32).at[at].min(jnp.arange(m, dtype=jnp.int32))
        writer, slot = first[:count], first[at]  # slot m: none (a scratch row, or clamped)
        keeper = kept = None  # SSP's cached reads: each event's keeping row, those here
        if self.rules.cached:
            here = events.worker - (0 if self.sharded else me[0])  # the row of its worker
            keeper = jnp.where(events.keep & (here >= 0) & (here < m), here, m)
            kept = jnp.zeros(m + 1, bool).at[keeper].set(True)[:m]
        rows = (pushed, local.workers.new_model_state)
        gradients, model_states = self.scatter_pushes(*rows) if self.sharded else self.gather(rows)
        server = local._replace(workers=None)  # the events leave the workers' rows alone
        if self.sharded:  # this device's shard, unstacked
            server = _shard(server, unstack)
        empty = lambda x: jnp.zeros((m + 1, *x.shape), x.dtype)  # noqa: E731
        # a sharded server's slots for the parameters are the pushes' rows
        params = gradients if self.sharded else jax.tree.map(empty, server.params)
        slots = (params, jax.tree.map(empty, server.model_state))

        write = _write_over if self.sharded else _write

        def one(carry: tuple[_Local, Any], xs: Any) -> tuple[tuple[_Local, Any], None]:
            local, (params, model_state) = carry
            event, at, keeps = xs
            pushes = (params if self.sharded else gradients, model_states)
            before = local.params
            local = lax.cond(event.push, functools.partial(self.push, pushes), _keep, local, event)
            if kept is not None:  # the push's update, for its worker's cached copy
                params = write(params, jax.tree.map(jnp.subtract, local.params, before), keeps)
            params = write(params, local.params, at)
            return (local, (params, _write(model_state, local.model_state, at))), None

        carry = (server, vary(slots, (self.kit.axis,)))
        # not the events' [events, N] start and fetch flags: O(N^2), read through ``last``
        events = events._replace(start=None, fetch=None)
        (server, (params, model_state)), _ = lax.scan(one, carry, (events, writer, keeper))
        model_state = jax.tree.map(lambda s: s[slot], model_state)
        if kept is not None:  # a keeper's own row holds its update
            params = jax.tree.map(lambda s: jnp.where(_rows(kept, s[:m]), s[:m], s[slot]), params)
        elif not (self.sharded and self.rules.group_size == 1 and self.rules.bound is None):
            params = jax.tree.map(lambda s: s[slot], params)  # else each row is its worker's
        workers = local.workers
        if self.sharded:
            server = _shard(server, restack)
            params = self.fetch_shards(params, workers.params)
            model_state = jax.tree.map(lambda x: x[me], model_state)
            kept = None if kept is None else kept[me]
        fetched = last[me] >= 0
        own_params, own_state = workers.params, workers.model_state
        if kept is not None:  # the copy with its own update, and the state it pushed
            updated = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), own_params, params)
            own_params = _select_rows(kept, updated, own_params)
            own_state = _select_rows(kept, workers.new_model_state, own_state)
        return server._replace(
            workers=workers._replace(
                params=_select_rows(fetched, params, own_params),
                model_state=_select_rows(fetched, model_state, own_state),
            )
        )

    def accrue(self, me: jax.Array, local: _Local, events: ev.Event) -> tuple[Any, _Local]:
        """Downpour: what this device's workers would push (``[k, ...]``), and the protocol
        after the step. A worker completes at most one task a step: if it does, its
        gradient joins its sum since its last push (Dean et al.'s accumulated Delta w), and
        a push at that event, received or lost, sends the sum and empties it."""

        arrived = ev.of_workers(events.worker, events.happens & ~events.rejoin, self.kit.n)[me]
        sent = ev.of_workers(events.worker, events.push | events.lost, self.kit.n)[me]
        accrued = local.protocol.gradient
        total = jax.tree.map(jnp.add, accrued, local.workers.gradient)
        total = _select_rows(arrived, total, accrued)
        return total, local._replace(protocol=Accrued(_masked_rows(total, ~sent)))

    def scatter_pushes(self, gradient: Any, model_state: Any) -> Any:
        """Sharded server: every worker's push's block on this device, ``[N, chunk]`` (an
        all-to-all of the device's rows), and every new model state, ``[N, ...]``."""
        view = FlatView.of(unstack(gradient))
        blocks = jax.vmap(lambda g: view.blocks(g, self.shards))(gradient)
        shard = lax.all_to_all(blocks, self.kit.axis, 1, 0, tiled=True)[:, 0]  # [N, chunk]
        return shard, self.gather(model_state)

    def fetch_shards(self, shards: jax.Array, like: Any) -> Any:
        """Sharded server: every worker's fetched shard (``[N, chunk]``) to this device's
        workers' parameters (``[k, ...]``, the rows of ``like``), by an all-to-all."""
        rows = lax.all_to_all(shards[:, None], self.kit.axis, 0, 1, tiled=True)  # [k, D, chunk]
        return jax.vmap(FlatView.of(unstack(like)).from_blocks)(rows)

    def gather(self, rows: Any) -> Any:
        """Every worker's entry of ``rows`` (this device's ``[k, ...]``), ``[N, ...]``, by
        one all-gather a step: a push reads its worker's."""
        # typed invariant: the same on every worker, as the server's state is
        gather = functools.partial(
            lax.all_gather, axis_name=self.kit.axis, tiled=True, to="invarying"
        )
        return jax.tree.map(gather, rows)

    def push(self, pushed: Any, local: _Local, event: ev.Event) -> _Local:
        """The arriving worker sends its gradient (Downpour: its accrued sum) and its new
        model state, read from the step's exchanged pushes."""
        gradient, model_state = jax.tree.map(lambda x: x[event.worker], pushed)
        return self.receive(local, gradient, model_state, event)

    def receive(self, local: _Local, gradient: Any, model_state: Any, event: ev.Event) -> _Local:
        """The server takes a push into its group (scaled by its own staleness under
        ``softsync(n, scale=...)``); applies the group's mean if it is full."""
        if self.group_scale is not None:  # Zhang et al.: each gradient by its own tau
            factor = self.group_scale(event.staleness)
            gradient = jax.tree.map(lambda g: (factor * g).astype(g.dtype), gradient)
        if isinstance(local.protocol, Group):
            size = self.rules.group_size
            held = Group(
                jax.tree.map(jnp.add, local.protocol.gradient, gradient),
                _held_add(local.protocol.model_state, model_state),
            )
            gradient = jax.tree.map(lambda x: x / size, held.gradient)
            model_state = _held_mean(held.model_state, size, model_state)
            local = local._replace(protocol=held)
        staleness = event.update_staleness
        if self.rules.group_size == 1:  # every push is an update: event.apply is event.push
            return self.apply(local, gradient, model_state, staleness)
        return lax.cond(event.apply, self.apply, _keep, local, gradient, model_state, staleness)

    def apply(self, local: _Local, gradient: Any, model_state: Any, staleness: jax.Array) -> _Local:
        """``theta <- theta + optimizer(g, staleness=tau)``; the model state is replaced."""
        updates, opt_state = self.optimizer.update(
            gradient, local.opt_state, local.params, staleness=staleness
        )
        # A sharded server's state is a device's own; parts an optimizer computes afresh
        # (Adafactor's placeholders) come out invariant: typed back, as they came in.
        opt_state = typed_like(opt_state, local.opt_state)
        protocol = local.protocol
        if isinstance(protocol, Group):
            protocol = Group(
                jax.tree.map(jnp.zeros_like, protocol.gradient), _held_empty(protocol.model_state)
            )
        return local._replace(
            params=optax.apply_updates(local.params, updates),
            opt_state=opt_state,
            model_state=model_state,
            protocol=protocol,
        )

    def worker_step(
        self, state: AsyncSGDState, batch: st.Batch
    ) -> tuple[AsyncSGDState, st.Metrics]:
        """One ``Strategy.step`` on one device (under ``shard_map``)."""
        me = self.kit.device_workers()
        clock, computes, events, last = ev.step_clock(state.clock, self.rules, self.times)
        workers, protocol, metrics = self.compute(state, me, computes[me], batch)
        if self.downpour and self.downpour.local_lr:  # the client's step on its own copy
            stepped = jax.tree.map(
                lambda p, g: p - self.downpour.local_lr * g, workers.params, workers.gradient
            )
            workers = workers._replace(params=_select_rows(computes[me], stepped, workers.params))
        local = _Local(state.params, state.opt_state, state.model.state, workers, protocol)
        pushed = workers.gradient
        if self.downpour:
            pushed, local = self.accrue(me, local, events)
        local = self.replay_server(me, local, events, last, pushed)
        server, protocol = (local.params, local.opt_state), local.protocol
        model = ModelVars(local.model_state, state.model.key, state.model.step + 1)
        state = AsyncSGDState(*server, model, local.workers, protocol, clock)
        summary = ev.summarize(events)
        metrics |= {
            "staleness_mean": summary.staleness_mean,
            "staleness_max": summary.staleness_max,
            "pushes": summary.pushes,
            "fetches": (last >= 0).sum().astype(jnp.float32),  # a worker fetches once a step
            "updates_applied": clock.version.astype(jnp.float32),
            "wall_clock": clock.now,
            "clock_gap_max": summary.clock_gap_max,
            "replica_lag": ev.replica_lag(clock),
        }
        if self.rules.drop > 0:
            metrics["pushes_lost"] = summary.pushes_lost
        if self.rules.churn:
            metrics["workers_away"] = clock.away.sum().astype(jnp.float32)
        return state, metrics

    def variables(self, state: AsyncSGDState) -> Any:
        """``Strategy.params``: the server's parameters (and model state)."""
        params = state.params
        if self.sharded:
            replicated = jax.sharding.reshard(params, NamedSharding(self.kit.mesh, P()))
            params = FlatView.of(one_worker(state.workers.params)).from_blocks(replicated)
        return self.kit.variables(params, state.model)


def async_sgd(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    compute_time: float | Sequence[float] | sl.ComputeTime = 1.0,
    protocol: str | sl.Protocol = "async",
    drop: float = 0.0,
    churn: sl.Churn | None = None,
    inner_optimizer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
    workers: int | None = None,
    server: str | None = None,
) -> st.Strategy:
    """Asynchronous SGD against a parameter server, as an exact event-ordered simulation.

    N workers (one per device on ``axis``, or ``workers`` of them, several a device)
    repeatedly fetch the server's parameters,
    compute a gradient on them, and push it; the server applies what arrives, in simulated
    arrival order: ``theta <- theta + optimizer(g, staleness=tau)``. Protocols:

    * ``"async"`` (Hogwild!): each gradient is applied on arrival; its worker fetches.
    * ``ddl.softsync(n)`` (Gupta et al.): the server applies the mean of every n arrivals
      (with tau their mean staleness); a worker that pushed waits until its group is
      applied, then fetches. n = N with equal compute times is synchronous SGD (Gupta et
      al.'s n-softsync, which waits for floor(N / n), is ``softsync(N // n)`` here).
    * ``ddl.ssp(s)`` (Ho et al.): as async, but a worker whose clock (gradients completed)
      is more than s ahead of the slowest worker's waits until it is not; it computes on
      its cached copy (with its own updates) while the copy is fresh enough for the bound,
      fetching only then (``ddl.ssp(s, reads="fresh")``: before every gradient).
    * ``ddl.downpour(n_fetch, n_push, local_lr=alpha)`` (Dean et al.'s Algorithm 7.1): a
      worker fetches before its 1st, (n_fetch + 1)-th, ... gradient, steps its own copy
      by ``-alpha g`` after each, and pushes the sum since its last push (their Delta w)
      after its 1st, (n_push + 1)-th, ... gradient. The server is sharded over ``axis``
      as in DistBelief (``server="sharded"``,
      below): elementwise optimizers act as on the whole model, clipping per shard.
    * ``ddl.async_local(H)`` (Liu et al.): a task is H steps of ``inner_optimizer`` on the
      worker's copy, on H consecutive slices of its ``B/N`` rows (H must divide them),
      and the push is the pseudo-gradient ``theta_fetched - theta_local``; ``optimizer``
      is the outer one (``ddl.delayed_nesterov``; ``optax.sgd(1.0)`` averages). Events are
      plain async's; a task takes H times ``compute_time``. Each worker's inner state
      (``P(axis)``) is kept across tasks, or reset at each fetch with ``reset=True``.
      ``async_local(H, dynamic=True)`` (DyLU): worker i takes ``H_i = max(1, floor(H *
      v_i / max v))`` steps, v its speed (expected, under random times), on the first
      H_i of its H slices (the others unused), and its task takes H_i times its time.

    Model state and dropout (a ``ddl.ModelLoss``): the server holds the model state
    (batch statistics) with its parameters; a worker fetches both, its k-th task computes
    on what it last fetched (Downpour: also between fetches) with the key ``worker_key(
    model, w, step=k)`` (async_local: inner step h its ``fold_in`` with h, for H > 1), and
    the new model state travels with the push. An update sets the server's to the pushing
    worker's (softsync(n): the mean of the group's, integer leaves their maximum).

    Event model (``events.py``). Worker i's k-th gradient takes ``d(i, k)``
    (``compute_time``), from its fetch (or release) at t to its arrival at ``t + d(i, k)``;
    arrivals are processed in time order, ties to the lower worker. A push's staleness
    tau counts the server updates since the worker's fetch. One ``Strategy.step``: (1)
    every worker whose started task has no gradient yet computes it on its device, its
    fetched parameters and its ``B/N`` shard of the global batch (a worker in flight or
    waiting leaves its shard unused); (2) the server processes arrivals in time order up
    to the first whose gradient is not computed: 1 to N arrivals, at most one per worker,
    exactly N with equal times. A replicated server all-gathers the workers' pushes once
    per step, each push reading its worker's: the bytes of the simulation, N x the
    parameters on every device. A sharded server sends each device its shard of every
    push and each worker its fetch, an all-to-all each way per step: a parameter server's
    bytes, with every worker's row in each (under Downpour, those that do not push or
    fetch in the step too).
    ``d(i, k)`` depends only on (seed, i, k), and the seed's key lives in the state: a
    checkpoint resumes the same run.

    Unreliable workers (``events.py``), drawn from (seed, i, k) like ``d(i, k)``:
    ``drop=p`` loses the push of worker i's task k with probability p; the worker, unaware,
    fetches at once, even under softsync (whose group waits for the next arrivals): with
    equal times softsync(N) is then synchronous SGD in which a lost gradient is redone by
    its worker on its next shard. ``churn``: after task k - 1 worker i leaves with
    probability q, computes nothing for T, then fetches and starts task k.

    References:
      Dean et al., "Large scale distributed deep networks", NeurIPS 2012.
      Recht, Re, Wright, Niu, "Hogwild!", NeurIPS 2011, arXiv:1106.5730.
      Ho et al., "More effective distributed ML via a stale synchronous parallel parameter
      server", NeurIPS 2013.
      Gupta, Zhang, Wang, "Model accuracy and runtime tradeoff in distributed deep
      learning: a systematic study", ICDM 2016, arXiv:1509.04210.
      Zhang, Gupta, Lian, Liu, "Staleness-aware async-SGD for distributed deep learning",
      IJCAI 2016, arXiv:1511.05950.
      Liu et al., "Asynchronous Local-SGD Training for Language Modeling", arXiv:2401.09135.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), or a
        ``ddl.ModelLoss``.
      optimizer: the server's optax optimizer; it receives the extra argument
        ``staleness`` (float32 scalar tau), so ``ddl.scale_by_staleness`` can sit in its
        chain.
      mesh: a mesh with axis ``axis``; its size is the number of workers N.
      compute_time: simulated seconds per gradient: one number for all workers, one per
        worker, or ``ddl.compute_times(base, spread=, seed=)`` for random times.
      protocol: ``"async"``, ``ddl.softsync(n)`` (1 <= n <= N), ``ddl.ssp(bound)``,
        ``ddl.downpour(n_fetch, n_push)`` or ``ddl.async_local(steps, reset=,
        dynamic=)``.
      drop: p in [0, 1), the probability that a push is lost; churn: ``None`` or
        ``ddl.churn(leave=q, away=T)``, workers that leave and rejoin (see above).
      inner_optimizer: the workers' optimizer, required by ``async_local`` and only there.
      accumulate: micro-batches per worker gradient.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.
      workers: N, a multiple of the devices on ``axis`` (default: one a device). Each
        device runs N / devices of them (their tasks through ``jax.vmap``) and replays
        the step's events once for all, so a step costs O(N x parameters) on each device
        (``server="sharded"``: O(N x parameters / devices)):
        ``async_sgd(..., ddl.make_mesh(data=8), workers=1024)`` simulates 1,024 workers
        on 8 devices, with the results of 1,024 devices (the same keys, batches, events
        and updates).
      server: ``"replicated"`` (the default, but for Downpour) or ``"sharded"``.
        Replicated, every device holds the whole server and applies every push: exact
        for any optax optimizer. Sharded (DistBelief's parameter server; Downpour's
        always), device i holds the i-th block of the flattened parameters and its
        optimizer state, and applies every push to it: elementwise optimizers (SGD,
        momentum, Adam, ``ddl.scale_by_staleness``) act as on the whole model, to float
        rounding, while a transform that reads several entries (global-norm clipping,
        per-tensor norms, factored statistics) acts per block, and a random one
        (``optax.add_noise``, ``optax.noisy_sgd``) draws the same noise in every block
        (one key, each block's copy of the state). The blocks hold one dtype: parameters
        of several are promoted (a bfloat16 leaf beside float32 ones is updated in
        float32 and rounded to bfloat16 where a worker fetches it or ``params(state)``
        reads it; the replicated server updates it in bfloat16). Each device then does
        1 / devices of the server's work and memory: at 1,024 workers on 8 devices the
        step is several times faster (``benchmarks/scaling.py``).

    Returns:
      A ``Strategy`` with ``AsyncSGDState``; ``params(state)`` is the server's parameters
      (``{"params": ..., <model state>}`` for a ``ModelLoss``). Metrics: ``loss`` (and
      aux), the mean over this step's tasks (0 if none); ``staleness_mean`` / ``_max``
      over its pushes (0 if none); ``pushes`` (received); ``fetches`` (the workers that
      fetched the server's state: after a push, a rejoin, or under Downpour and SSP's
      cached reads only when due); ``updates_applied`` (server version); ``wall_clock``
      (simulated time); ``clock_gap_max`` (the largest lead, in clocks, of a worker
      starting a task over the slowest); ``replica_lag`` (the mean over workers of the
      server updates since their fetch that their copy lacks); ``pushes_lost``
      (``drop``), ``workers_away`` (``churn``).

    Example (four equal workers averaging their four gradients: synchronous SGD):

    >>> import jax, jax.numpy as jnp, optax, ddl_jax as ddl
    >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
    >>> strategy = ddl.async_sgd(loss, optax.sgd(0.1), ddl.make_mesh(data=4),
    ...                          protocol=ddl.softsync(4))
    >>> state = strategy.init({"w": jnp.zeros(())})
    >>> state, metrics = jax.jit(strategy.step)(state, {"x": jnp.ones(8), "y": jnp.ones(8)})
    >>> round(float(strategy.params(state)["w"]), 6), float(metrics["pushes"])
    (0.2, 4.0)
    """
    kit = prepare(loss_fn, optimizer, mesh, axis, accumulate, has_aux, workers=workers)
    return _Program.build(
        kit, optimizer, compute_time, protocol, drop, churn, inner_optimizer, server
    )
