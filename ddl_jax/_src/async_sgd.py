"""Asynchronous SGD simulated exactly: a parameter server and N workers in one SPMD program."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src import staleness as sl
from ddl_jax._src import strategy as st
from ddl_jax._src.data_parallel import check_builder_args, local_value_and_grad


class AsyncSGDState(NamedTuple):
    """State of :func:`async_sgd`: the server, the workers, and the simulated clocks.

    Attributes:
      params: the server's parameters, replicated ``P()``; under Downpour, the flattened
        parameters (zero-padded to a multiple of N) as ``[N, ceil(size / N)]`` sharded
        ``P(axis)``: device i holds the server's i-th shard.
      opt_state: the server's optimizer state, replicated ``P()``; under Downpour, one
        state per shard, ``[N, ...]`` sharded ``P(axis)``.
      fetched: each worker's last fetched parameters, ``[N, ...]`` sharded ``P(axis)``.
      gradient: each worker's gradient of its task in flight (valid where ``ready``),
        ``[N, ...]`` sharded ``P(axis)``.
      accrued: Downpour only (else ``()``): each worker's sum of gradients since its
        last push, ``[N, ...]`` sharded ``P(axis)``.
      group: n-softsync with n > 1 only (else ``()``): the sum of the arrivals the server
        holds for its next update, replicated ``P()``.
      group_count: arrivals held in ``group``, int32 scalar.
      group_staleness: the sum of their staleness, float32 scalar.
      version: server updates applied so far, int32 scalar.
      now: the simulated time of the last event, float32 scalar.
      arrival: ``[N]`` float32, when each worker's task in flight completes (ignored
        where ``waiting``).
      fetched_version: ``[N]`` int32, the server version each worker last fetched.
      tasks: ``[N]`` int32, gradients each worker has completed (its SSP clock).
      ready: ``[N]`` bool, whether the gradient of a worker's task in flight is computed.
      waiting: ``[N]`` bool, workers that finished a task and wait to start the next one
        (for a softsync group to fill, or for the SSP bound).
      key: the PRNG key data (``uint32[2]``) of random compute times, ``P()``.

    The ``[N]`` bookkeeping is the server's view of its workers: every device runs the
    same event loop over it, so it is replicated ``P()``.
    """

    params: Any
    opt_state: Any
    fetched: Any
    gradient: Any
    accrued: Any
    group: Any
    group_count: jax.Array
    group_staleness: jax.Array
    version: jax.Array
    now: jax.Array
    arrival: jax.Array
    fetched_version: jax.Array
    tasks: jax.Array
    ready: jax.Array
    waiting: jax.Array
    key: jax.Array


def async_sgd(
    loss_fn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    compute_time: float | Sequence[float] | sl.ComputeTime = 1.0,
    protocol: str | sl.Protocol = "async",
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
) -> st.Strategy:
    """Asynchronous SGD against a parameter server, as an exact event-ordered simulation.

    N workers (one per device on ``axis``) repeatedly fetch the server's parameters,
    compute a gradient on them, and push it; the server applies what arrives, in simulated
    arrival order, with ``theta <- theta + optimizer(g, staleness=tau)``. The protocol says
    what waits:

    * ``"async"`` (plain async / Hogwild!): each gradient is applied on arrival and its
      worker fetches the new parameters and starts again at once.
    * ``ddl.softsync(n)`` (Gupta et al.): the server applies the mean of every n arrivals
      (with tau their mean staleness); a worker that pushed waits until its group is
      applied, then fetches. n = N with equal compute times is synchronous SGD. Here n
      counts gradients per update; Gupta et al.'s n-softsync waits for floor(N / n), so
      theirs is ``softsync(N // n)`` here.
    * ``ddl.ssp(s)`` (Ho et al.): as async, but a worker whose clock (gradients completed)
      is more than s ahead of the slowest worker's waits until it is not.
    * ``ddl.downpour(n_fetch, n_push)`` (Dean et al.): a worker fetches every n_fetch
      gradients and pushes the sum of its last n_push gradients (Dean et al.'s accumulated
      gradient Delta w) every n_push, so with SGD one push moves the server as far as those
      n_push gradients arriving one by one would; between fetches it keeps computing on the
      parameters it has (the client-side local update of Dean et al. is left out). The
      server is sharded over the data axis as in DistBelief: device i holds shard i of the
      flattened parameters and its optimizer state; a push is a reduce-scatter (each shard
      receives its slice of the gradient), a fetch an all-gather. The optimizer sees each
      shard as one flat vector, so elementwise optimizers (SGD, momentum, Adam, ...) act
      exactly as on the whole model, while transforms that look across leaves (global-norm
      clipping, masks) act per shard.

    Event model. Worker i's k-th gradient takes ``compute_time`` ``d(i, k)`` simulated
    time units (``ddl.compute_times``); it starts when the worker fetches (or is released)
    at time t and arrives at ``t + d(i, k)``. The server processes arrivals in time order,
    ties broken by the lower worker index. Staleness tau of a push is the number of server
    updates applied between the worker's fetch and the push. One ``Strategy.step``:

    1. Every worker that has started a task whose gradient is not computed yet computes it,
       in parallel on its own device, on its fetched parameters and its ``B/N`` shard of
       the global batch ``B`` (with ``accumulate`` micro-batches).
    2. The server processes arrivals in time order (a ``lax.scan`` of N events) while the
       next arrival's gradient is computed; it stops at the first arrival whose gradient
       is not (a worker that started a new task during this step). Each worker thus
       pushes at most once per step, and the next step computes the new gradients.

    So a step holds between 1 and N arrivals; equal compute times give exactly N (the
    trajectory of synchronous data parallelism under ``softsync(N)``). Wasted work: a
    worker whose gradient is still in flight, or that waits, leaves its shard of the
    step's batch unused (its device skips the gradient). Communication: each push is one
    param-sized all-reduce of the pushing worker's gradient, masked to zero elsewhere
    (Downpour: a reduce-scatter per push and an all-gather per step with a fetch), each
    inside a conditional branch that only pushing events take: a step of N pushes moves N
    times the bytes of one data-parallel all-reduce, a cost of simulating N point-to-point
    pushes in SPMD, not of the system simulated. The same ``compute_time``
    seed gives the same trajectory: ``d(i, k)`` depends only on (seed, i, k); the seed's
    key lives in the state, so a checkpoint resumes the same run.

    References:
      Dean et al., "Large scale distributed deep networks", NeurIPS 2012.
      Recht, Re, Wright, Niu, "Hogwild!: a lock-free approach to parallelizing stochastic
      gradient descent", NeurIPS 2011, arXiv:1106.5730.
      Ho et al., "More effective distributed ML via a stale synchronous parallel parameter
      server", NeurIPS 2013.
      Gupta, Zhang, Wang, "Model accuracy and runtime tradeoff in distributed deep
      learning: a systematic study", ICDM 2016, arXiv:1509.04210.
      Zhang, Gupta, Lian, Liu, "Staleness-aware async-SGD for distributed deep learning",
      IJCAI 2016, arXiv:1511.05950.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      optimizer: the server's optax optimizer; it receives the extra argument
        ``staleness`` (float32 scalar tau), so ``ddl.scale_by_staleness`` can sit in its
        chain.
      mesh: a mesh with axis ``axis``; its size is the number of workers N.
      compute_time: simulated seconds per gradient: one number for all workers, one per
        worker, or ``ddl.compute_times(base, spread=, seed=)`` for random times.
      protocol: ``"async"``, ``ddl.softsync(n)`` (1 <= n <= N), ``ddl.ssp(bound)`` or
        ``ddl.downpour(n_fetch, n_push)``.
      accumulate: micro-batches per worker gradient.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.

    Returns:
      A ``Strategy`` with ``AsyncSGDState``; ``params(state)`` is the server's parameters.
      Metrics: ``loss`` (and aux values), the mean over the gradients computed this step;
      ``staleness_mean`` / ``staleness_max`` over this step's pushes (0 if none);
      ``pushes`` (gradients sent this step); ``updates_applied`` (server version);
      ``wall_clock`` (simulated time); ``clock_gap_max`` (the largest lead, in clocks, of
      a worker that started a task this step over the slowest worker).
    """
    check_builder_args(loss_fn, optimizer, accumulate=accumulate)
    n = st.check_mesh_axis(mesh, axis)
    model = sl.as_compute_time(compute_time, n)
    protocol = sl.as_protocol(protocol, n)
    group_size = protocol.n if isinstance(protocol, sl.SoftSync) else 1
    bound = protocol.bound if isinstance(protocol, sl.SSP) else None
    n_fetch, n_push = protocol if isinstance(protocol, sl.Downpour) else (1, 1)
    accrues = sharded = isinstance(protocol, sl.Downpour)
    server_opt = optax.with_extra_args_support(optimizer)
    value_and_grad = local_value_and_grad(loss_fn, has_aux=has_aux, accumulate=accumulate)
    durations = jax.vmap(lambda key, i, k: sl.duration(model, n, key, i, k), (None, 0, 0))
    workers = jnp.arange(n)
    scalars = dict(group_count=P(), group_staleness=P(), version=P(), now=P())
    vectors = dict(arrival=P(), fetched_version=P(), tasks=P(), ready=P(), waiting=P(), key=P())
    server_spec = P(axis) if sharded else P()
    specs = AsyncSGDState(
        params=server_spec, opt_state=server_spec, fetched=P(axis), gradient=P(axis),
        accrued=P(axis), group=P(), **scalars, **vectors,
    )  # fmt: skip

    def shards(tree) -> jax.Array:
        """A params-shaped tree as the sharded server's ``[N, ceil(size / N)]`` blocks."""
        flat, _ = ravel_pytree(tree)
        return jnp.pad(flat, (0, -flat.size % n)).reshape(n, -1)

    def unshard(blocks: jax.Array, like) -> Any:
        """The inverse of ``shards``, shaped like the params-shaped tree ``like``."""
        flat, unravel = ravel_pytree(like)
        return unravel(blocks.reshape(-1)[: flat.size])

    def init(params) -> AsyncSGDState:
        st.check_params(params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        key = jax.random.key_data(jax.random.key(model.seed, impl="threefry2x32"))
        if sharded:
            server = jax.jit(
                lambda p: (shards(p), jax.vmap(server_opt.init)(shards(p))),
                out_shardings=NamedSharding(mesh, P(axis)),
            )(params)
        else:
            server = params, server_opt.init(params)
        # One placement per sharding: each st.replicate / stack_for_workers call compiles.
        per_worker = st.stack_for_workers((params, zeros, zeros if accrues else ()), mesh, axis)
        replicated = st.replicate(
            dict(
                server=() if sharded else server,
                group=zeros if group_size > 1 else (),
                group_count=jnp.zeros((), jnp.int32),
                group_staleness=jnp.zeros((), jnp.float32),
                version=jnp.zeros((), jnp.int32),
                now=jnp.zeros((), jnp.float32),
                arrival=durations(key, workers, jnp.zeros(n, jnp.int32)),
                fetched_version=jnp.zeros(n, jnp.int32),
                tasks=jnp.zeros(n, jnp.int32),
                ready=jnp.zeros(n, bool),
                waiting=jnp.zeros(n, bool),
                key=key,
            ),
            mesh,
        )
        server = server if sharded else replicated.pop("server")
        replicated.pop("server", None)
        fetched, gradient, accrued = per_worker
        return AsyncSGDState(
            params=server[0], opt_state=server[1], fetched=fetched, gradient=gradient,
            accrued=accrued, **replicated,
        )  # fmt: skip

    def push(s: AsyncSGDState, g, w):
        """The server receives gradient ``g`` from worker ``w``; applies it if its group is full."""
        tau = (s.version - s.fetched_version[w]).astype(jnp.float32)
        if group_size > 1:
            s = s._replace(group=jax.tree.map(jnp.add, s.group, g))
            g = jax.tree.map(lambda x: x / group_size, s.group)
        s = s._replace(group_count=s.group_count + 1, group_staleness=s.group_staleness + tau)

        def apply(s: AsyncSGDState) -> AsyncSGDState:
            updates, opt_state = server_opt.update(
                g, s.opt_state, s.params, staleness=s.group_staleness / group_size
            )
            return s._replace(
                params=optax.apply_updates(s.params, updates), opt_state=opt_state,
                group=jax.tree.map(jnp.zeros_like, s.group), group_count=jnp.zeros_like(
                    s.group_count), group_staleness=jnp.zeros_like(s.group_staleness),
                version=s.version + 1,
            )  # fmt: skip

        return lax.cond(s.group_count == group_size, apply, lambda s: s, s), tau

    def worker_step(state: AsyncSGDState, batch):
        me = lax.axis_index(axis)
        fetched = st.unstack(state.fetched)
        needs = ~state.ready[me] & ~state.waiting[me]
        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, fetched, batch))
        # A worker whose gradient is in flight (or that waits) computes nothing this step.
        (loss, aux), fresh = lax.cond(needs, value_and_grad, lambda p, b: zeros, fetched, batch)
        gradient = jax.tree.map(
            lambda new, old: jnp.where(needs, new, old), fresh, st.unstack(state.gradient)
        )
        computed = lax.psum(needs.astype(jnp.float32), axis)
        metrics = lax.psum(
            jax.tree.map(lambda x: jnp.where(needs, x, 0.0), {"loss": loss, **aux}), axis
        )
        metrics = {k: v / computed for k, v in metrics.items()}
        state = state._replace(ready=state.ready | ~state.waiting)
        if sharded:
            state = state._replace(
                params=st.unstack(state.params), opt_state=st.unstack(state.opt_state)
            )
        stats = dict(
            stopped=jnp.zeros((), bool), pushes=jnp.zeros((), jnp.float32),
            tau_sum=jnp.zeros((), jnp.float32), tau_max=jnp.zeros((), jnp.float32),
            gap_max=jnp.zeros((), jnp.float32),
        )  # fmt: skip
        local = (fetched, st.unstack(state.accrued))

        def event(carry, _):
            s, _, stats = carry
            w = jnp.argmin(jnp.where(s.waiting, jnp.inf, s.arrival))
            go = ~stats["stopped"] & s.ready[w]

            def process(carry):
                s, (fetched, accrued), stats = carry
                mine = me == w
                t = s.arrival[w]
                tasks = s.tasks.at[w].add(1)
                s = s._replace(tasks=tasks, now=t, ready=s.ready.at[w].set(False))
                if accrues:
                    accrued = jax.tree.map(
                        lambda a, g: jnp.where(mine, a + g, a), accrued, gradient
                    )
                sent = accrued if accrues else gradient

                def send(args):
                    s, accrued, stats = args
                    g = jax.tree.map(lambda x: jnp.where(mine, x, 0.0), sent)
                    if sharded:  # each server shard receives its slice of the push
                        g = lax.psum_scatter(shards(g), axis, scatter_dimension=0)
                    else:
                        g = lax.psum(g, axis)
                    s, tau = push(s, g, w)
                    if accrues:
                        accrued = jax.tree.map(lambda a: jnp.where(mine, 0.0, a), accrued)
                    stats = {
                        **stats, "pushes": stats["pushes"] + 1, "tau_sum": stats["tau_sum"] + tau,
                        "tau_max": jnp.maximum(stats["tau_max"], tau),
                    }  # fmt: skip
                    return s, accrued, stats

                pushes = tasks[w] % n_push == 0
                s, accrued, stats = lax.cond(pushes, send, lambda a: a, (s, accrued, stats))
                # Worker w has finished; it and every waiting worker start a new task now
                # unless a softsync group is still open or the SSP bound holds them back.
                waiting = s.waiting.at[w].set(True)
                allowed = jnp.ones(n, bool)
                if group_size > 1:
                    allowed &= s.group_count == 0
                lead = tasks - tasks.min()
                if bound is not None:
                    allowed &= lead <= bound
                start = waiting & allowed
                fetch = start & (tasks % n_fetch == 0)
                if sharded:  # an all-gather of the server's shards, when someone fetches
                    server = lax.cond(
                        fetch.any(),
                        lambda: unshard(lax.all_gather(s.params, axis, tiled=True), fetched),
                        lambda: fetched,
                    )
                else:
                    server = s.params
                fetched = jax.tree.map(lambda p, f: jnp.where(fetch[me], p, f), server, fetched)
                s = s._replace(
                    waiting=waiting & ~start,
                    arrival=jnp.where(start, t + durations(s.key, workers, tasks), s.arrival),
                    fetched_version=jnp.where(fetch, s.version, s.fetched_version),
                )
                gap = jnp.max(jnp.where(start, lead, 0)).astype(jnp.float32)
                stats = {**stats, "gap_max": jnp.maximum(stats["gap_max"], gap)}
                return s, (fetched, accrued), stats

            def stop(carry):
                s, local, stats = carry
                return s, local, {**stats, "stopped": jnp.ones((), bool)}

            return lax.cond(go, process, stop, carry), None

        (state, (fetched, accrued), stats), _ = lax.scan(
            event, (state, local, stats), None, length=n
        )
        state = state._replace(
            fetched=st.restack(fetched), gradient=st.restack(gradient), accrued=st.restack(accrued)
        )
        if sharded:
            state = state._replace(
                params=st.restack(state.params), opt_state=st.restack(state.opt_state)
            )
        metrics |= {
            "staleness_mean": stats["tau_sum"] / jnp.maximum(stats["pushes"], 1.0),
            "staleness_max": stats["tau_max"],
            "pushes": stats["pushes"],
            "updates_applied": state.version.astype(jnp.float32),
            "wall_clock": state.now,
            "clock_gap_max": stats["gap_max"],
        }
        return state, metrics

    step = st.worker_step_over_batch(
        worker_step, mesh, axis, specs, loss_fn=loss_fn, has_aux=has_aux, accumulate=accumulate,
        worker_params=lambda state: st.one_worker(state.fetched),
    )  # fmt: skip

    if not sharded:
        return st.Strategy(init, step, lambda state: state.params)

    @jax.jit
    def server_params(state: AsyncSGDState):
        like = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], x.dtype), state.fetched)
        return unshard(jax.sharding.reshard(state.params, NamedSharding(mesh, P())), like)

    return st.Strategy(init, step, server_params)
