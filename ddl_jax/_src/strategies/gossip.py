"""Gossip (decentralised) SGD: neighbours average through ppermute, no global all-reduce."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.islands import (
    Exchange,
    Parts,
    check_outer_only,
    island_kit,
    over_islands,
)
from ddl_jax._src.core.kit import Kit, prepare, restack, unstack
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, worker_key
from ddl_jax._src.core.strategy import ISLAND, Strategy, check_int
from ddl_jax._src.measure.consistency import (
    CHURN_STREAM,
    arrivals,
    check_probability,
    measured_consensus,
)
from ddl_jax._src.reduce.allreduce import in_buckets, on_floating
from ddl_jax._src.reduce.collectives import ppermute

TOPOLOGIES = ("ring", "torus", "exponential", "complete", "one_peer_exponential")
#: Topologies whose graph changes every step: one of their permutations a step, in turn.
DYNAMIC = ("one_peer_exponential",)
#: When a worker's own update joins the mixing (``gossip(order=...)``).
ORDERS = ("dpsgd", "adapt_then_combine")


def _torus_shape(n: int) -> tuple[int, int]:
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def neighbour_permutations(topology: str, n: int) -> list[tuple[int, ...]]:
    """The sends of one gossip round: each entry maps device i to the device it sends to.

    ``ring``: i -> i+1 and i -> i-1. ``torus``: the same along both axes of the most square
    ``rows x cols`` grid of n devices (``1 x n`` for a prime n: the ring).
    ``exponential``: i -> i + 2^k for 2^k < n (the directed exponential graph of Assran et
    al. 2019). ``complete``: i -> i + s for every s in 1..n-1.
    ``one_peer_exponential`` (dynamic: one of these a step, in turn): i -> i + 1, i - 1,
    i + 2, i - 2, ..., i +- 2^k for 2^k <= n - 1, the peers in the order Assran et al.'s
    code cycles through them (facebookresearch/stochastic_gradient_push,
    ``gossip_module/graph_manager.py``, ``DynamicDirectedExponentialGraph``, one peer per
    iteration). Duplicate and self-sends (small n) are dropped.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r} is not known; valid: {list(TOPOLOGIES)}.")
    if topology == "torus":
        rows, cols = _torus_shape(n)
        perms = []
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            perms.append(
                tuple(((i // cols + dr) % rows) * cols + (i % cols + dc) % cols for i in range(n))
            )
    else:
        shifts = {
            "ring": (1, -1),
            "exponential": tuple(2**k for k in range(max(n - 1, 1).bit_length()) if 2**k < n),
            "complete": tuple(range(1, n)),
            "one_peer_exponential": tuple(
                s for k in range(max(n - 1, 1).bit_length()) for s in (2**k, -(2**k))
            ),
        }[topology]
        perms = [tuple((i + s) % n for i in range(n)) for s in shifts]
    unique = []
    for perm in perms:
        if perm != tuple(range(n)) and perm not in unique:
            unique.append(perm)
    return unique


def mixing_matrix(topology: str, n: int, *, step: int | None = None) -> np.ndarray:
    """The default gossip mixing matrix W: ``1/(d+1)`` on self and each of the d in-neighbours.

    ``W[i, j]`` is the weight device i gives device j's model; W is doubly stochastic for
    every topology here (each is regular and built from permutations). A dynamic topology
    (``one_peer_exponential``) mixes with one peer a step, 1/2 each: give the ``step``
    (counted from 0) whose W to return.
    """
    n = check_int("mixing_matrix: n", n, minimum=1)
    perms = neighbour_permutations(topology, n)
    if topology in DYNAMIC:
        if step is None:
            raise ValueError(
                f"mixing_matrix: the {topology!r} topology changes every step; give step=."
            )
        step = check_int("mixing_matrix: step", step, minimum=0)
        perms = [perms[step % len(perms)]] if perms else []  # one worker: none
    w = np.eye(n) / (len(perms) + 1)
    for perm in perms:
        for src, dst in enumerate(perm):
            w[dst, src] += 1 / (len(perms) + 1)
    return w


def _check_mixing(weights: Any, topology: str, n: int) -> np.ndarray:
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"mixing_weights must be a numeric {n} x {n} array: {e}") from e
    if w.shape != (n, n):
        raise ValueError(f"mixing_weights must have shape ({n}, {n}), got {w.shape}.")
    if (w < 0).any() or not (
        np.allclose(w.sum(0), 1, atol=1e-6) and np.allclose(w.sum(1), 1, atol=1e-6)
    ):
        raise ValueError(
            "mixing_weights must be doubly stochastic (non-negative, rows and columns summing "
            f"to 1); row sums {np.round(w.sum(1), 4)}, column sums {np.round(w.sum(0), 4)}."
        )
    allowed = np.eye(n, dtype=bool)
    for perm in neighbour_permutations(topology, n):
        for src, dst in enumerate(perm):
            allowed[dst, src] = True
    if (bad := np.argwhere((w != 0) & ~allowed)).size:
        i, j = bad[0]
        raise ValueError(
            f"mixing_weights[{i}, {j}] = {w[i, j]:g}, but device {j} is not a neighbour of "
            f"device {i} in the {topology!r} topology."
        )
    return w


def link_masks(
    key: Any, step: Any, n: int, *, drop: float = 0.0, churn: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """The unreliable network of one gossip step: which messages arrive, who is present.

    Drawn from the run's shared key (``ModelVars.key``) and the step by
    ``ddl.consistency.arrivals``, as ``local_sgd``'s are, the same on every worker and
    restored with a checkpoint: messages ``(n, n)`` on the drop stream, presence ``(n,)``
    on the churn stream.

    Args:
      key: the run's key data, ``uint32[2]``.
      step: the step count.
      n: the number of workers.
      drop: the probability that one message (a (sender, receiver) pair, this step) is lost.
      churn: the probability that a worker is absent this step.

    Returns:
      ``(arrives, present)``: ``arrives[i, j]`` whether worker j's model reaches worker i
      (false if the message is lost or either is absent; the diagonal is not a message),
      ``present[i]`` whether worker i takes part in the step.
    """
    arrives = arrivals(key, step, (n, n), drop)
    present = arrivals(key, step, n, churn, CHURN_STREAM)
    return arrives & present[:, None] & present[None, :], present


class GossipState(NamedTuple):
    """State of :func:`gossip`.

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``.
      opt_state: each worker's optimizer state, ``[N, ...]`` sharded ``P(axis)``.
      consensus_distance: mean distance of the replicas to their average at the last
        measurement, ``P()``.
      model: each worker's model state (batch statistics), ``P(axis)``, mixed with its
        neighbours' as the parameters are; the run's key and the step count, ``P()``.
    """

    params: Any
    opt_state: Any
    consensus_distance: jax.Array
    model: ModelVars


def gossip(
    loss_fn: AnyLoss | None = None,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    *,
    inner: Strategy | None = None,
    topology: str = "ring",
    mixing_weights: Any = None,
    order: str = "dpsgd",
    drop: float = 0.0,
    churn: float = 0.0,
    consensus_every: int | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
    workers: int | None = None,
) -> Strategy:
    """Decentralised gossip SGD (D-PSGD): each worker averages the models of its neighbours
    and adds its own update.

    Every worker i computes its update ``u_i`` (its optimizer's step on the gradient of its
    shard, at its own model) and, from the same models, the average of its neighbours':
    ``theta_i <- sum_j W_ij theta_j + u_i`` (``order="dpsgd"``, the default: Lian et al.'s
    Algorithm 1, as Bagua, from the paper's authors, runs it: BaguaSys/bagua
    ``bagua/torch_api/algorithms/decentralized.py`` and its op
    ``rust/bagua-core/bagua-core-internal/src/comm_ops/
    decentralized_full_precision_synchronous.rs``, the weights sent when the forward
    starts, the average copied into the parameters after the backward, then the optimizer's
    step with the gradient taken before). The average does not wait for the gradient, so a
    runtime may overlap the two; the replicas differ by their own updates even on the
    complete graph. ``order="adapt_then_combine"`` mixes the updated models instead,
    ``theta_i <- sum_j W_ij (theta_j + u_j)``, so that the complete graph is exactly
    synchronous SGD with SGD or momentum (Adam's moments stay each worker's own, so not
    with Adam); the average then waits for the step.
    Model state (batch statistics) is each worker's own, updated by its step and then mixed
    by the same ``W`` in either order; dropout keys differ per worker and step.
    Models travel by ``ppermute``, one round per neighbour: each device sends
    ``degree x parameter bytes`` per step and there is no global all-reduce.

    **Unreliable workers** ("dropped, not accumulated"). With ``drop`` = p each message
    (worker j's model to worker i, this step) is lost with probability p; with ``churn`` = q
    each worker is absent with probability q (no local step: its parameters, optimizer and
    model state stay as they were; it sends and receives nothing), independently every step,
    so it is back at the next step it is drawn present. A receiver keeps a lost message's
    weight on its own model: ``W'_ij = W_ij [j's message arrives]``,
    ``W'_ii = 1 - sum_{j != i} W'_ij``. ``W'`` is row-stochastic but no longer doubly
    stochastic, so the replicas' average drifts from the average of ``theta_j + u_j``: a lost
    update is dropped, not accumulated for a later round. The draws come from the run's key
    and the step (:func:`link_masks`), the same on every worker and resumed with a
    checkpoint. With ``drop = churn = 0`` the step is the reliable one, unchanged.

    References:
      Lian et al., "Can decentralized algorithms outperform centralized algorithms?",
      NeurIPS 2017, arXiv:1705.09056. Assran et al., "Stochastic gradient push",
      ICML 2019, arXiv:1811.10792 (the exponential graphs; with
      ``"one_peer_exponential"`` and ``order="adapt_then_combine"`` this is their SGP
      without overlap: on a graph whose every node hears from one peer, push-sum's weights
      stay 1).

    **Islands.** ``gossip(inner=strategy, topology=...)`` makes each worker an island
    running ``strategy`` (``ddl.data_parallel``, ``ddl.fsdp`` or ``ddl.tensor_parallel`` on
    a mesh with an ``island`` axis), as ``ddl.local_sgd(inner=...)`` does: after every inner
    step each device mixes its shard with its counterparts in the neighbouring islands (by
    ``order``: their shards before the step, its island's update added, or after it). The
    consensus distance is not measured there; with ``churn`` the loss is every island's.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); not with
        ``inner``.
      optimizer: optax optimizer, one state per worker; not with ``inner``.
      mesh: a mesh with axis ``axis``; not with ``inner``.
      inner: an island's strategy (Islands, above), instead of ``loss_fn``, ``optimizer``
        and ``mesh``.
      topology: ``"ring"``, ``"torus"``, ``"exponential"``, ``"complete"`` (every
        neighbour every step) or ``"one_peer_exponential"`` (one peer a step, in turn, 1/2
        each: Assran et al.'s time-varying exponential graph; a device sends the
        parameters once a step, against ``log2 N`` times on ``"exponential"``);
        ``neighbour_permutations`` lists each one's sends.
      mixing_weights: N x N doubly-stochastic W supported on the topology's edges;
        default ``mixing_matrix(topology, N)``; not with ``"one_peer_exponential"``.
      order: ``"dpsgd"`` (mix the models before the step, add one's own update) or
        ``"adapt_then_combine"`` (mix the models after every worker's step); above.
      drop: probability in [0, 1) that a message is lost.
      churn: probability in [0, 1) that a worker is absent for a step.
      consensus_every: measure ``consensus_distance`` every this many steps (it costs an
        all-reduce of the parameters, so not every step); 0 never; ``None``: 10 (0 with
        ``inner``). Measured in the parameters' dtype against their all-reduced mean,
        whose rounding shows: equal float32 replicas read about 1e-7, not 0
        (``ddl.consistency.consensus_distance`` of the state's params is exact).
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.
      workers: N, a multiple of the devices on ``axis`` (default: one a device): each
        device runs N / devices workers through ``jax.vmap``, the run of N devices; a
        round's permute sends each device's workers' models once per device shift (the
        ring: to the next device only).

    Returns:
      A ``Strategy`` with ``GossipState`` (with ``inner``: an ``IslandsState``); metrics
      ``loss`` and aux values (the mean over every worker's replica on its rows, an
      absent one's too), unless ``consensus_every=0`` ``consensus_distance`` as last
      measured (after the mixing of a step t with ``t % consensus_every == 0``), with
      ``drop`` ``messages_dropped`` (the fraction of this step's messages between present
      workers that were lost), with ``churn`` ``workers_present`` (their number this
      step), with ``"one_peer_exponential"`` ``mixing_rounds`` (1.0: the step's round with
      its one peer, which runs in a branch of the step's program, one branch a peer).
      ``params(state)`` is the mean of the replicas.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> strategy = ddl.gossip(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), topology="ring")
      >>> state, metrics = jax.jit(strategy.step)(strategy.init({"w": jnp.zeros(())}), batch)
      >>> w, distance = strategy.params(state)["w"], metrics["consensus_distance"]
      >>> round(float(w), 6), round(float(distance), 6)  # equal data: the replicas agree
      (0.2, 0.0)
    """
    drop, churn = check_probability("drop", drop), check_probability("churn", churn)
    if order not in ORDERS:
        raise ValueError(f"gossip: order={order!r} is not known; valid: {list(ORDERS)}.")
    if topology not in TOPOLOGIES:  # over islands, the rest is checked at init (N unknown)
        raise ValueError(f"topology={topology!r} is not known; valid: {list(TOPOLOGIES)}.")
    if inner is not None:
        flat = {"loss_fn": loss_fn, "optimizer": optimizer, "mesh": mesh,
                "accumulate": accumulate, "has_aux": has_aux, "workers": workers}  # fmt: skip
        check_outer_only("gossip", flat, axis, ("data", ISLAND), consensus_every)

        def method(mesh: Any, params: Any) -> Exchange:
            n = mesh.shape[ISLAND]
            kit = island_kit(mesh)
            phases = _phases(topology, mixing_weights, n)
            cfg = _Config(kit, None, phases, drop, churn, 0, order)
            exchange = functools.partial(_island_exchange, cfg)
            keeps_before = bool(churn) or order == "dpsgd"
            return Exchange(lambda params: (), exchange, keeps_before=keeps_before)

        return over_islands(inner, method, "gossip")
    kit = prepare(loss_fn, optimizer, mesh, axis, accumulate, has_aux, workers=workers)
    consensus_every = 10 if consensus_every is None else consensus_every
    consensus_every = check_int("consensus_every", consensus_every, minimum=0)
    n = kit.n
    phases = _phases(topology, mixing_weights, n)
    specs = GossipState(P(axis), P(axis), P(), ModelVars(P(axis), P(), P()))

    def make_state(params: Any, model: ModelVars) -> GossipState:
        return GossipState(
            params=kit.stack(params),
            opt_state=kit.stack(optimizer.init(params)),
            consensus_distance=jnp.zeros((), jnp.float32),
            model=model._replace(state=kit.stack(model.state)),
        )

    cfg = _Config(kit, optimizer, phases, drop, churn, consensus_every, order)
    return Strategy(
        kit.init(make_state, specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


def _phases(topology: str, mixing_weights: Any, n: int) -> tuple[_Phase, ...]:
    """The mixing of each step in turn: one phase for a static topology (its W, the
    topology's or the user's checked against it, over all its permutations); one a
    permutation for a dynamic one."""
    perms = neighbour_permutations(topology, n)
    if topology not in DYNAMIC:
        if mixing_weights is None:
            return (_Phase(mixing_matrix(topology, n), perms),)
        return (_Phase(_check_mixing(mixing_weights, topology, n), perms),)
    if mixing_weights is not None:
        raise ValueError(
            f"mixing_weights weighs a static topology's neighbours; {topology!r} mixes with "
            "one peer a step, 1/2 each: drop mixing_weights, or give a static topology."
        )
    if not perms:  # one worker
        return (_Phase(np.eye(n), []),)
    return tuple(_Phase(mixing_matrix(topology, n, step=k), [perm]) for k, perm in enumerate(perms))


class _Phase(NamedTuple):
    """One step's mixing: ``weights`` (W) over the permutations ``perms``."""

    weights: np.ndarray
    perms: list[tuple[int, ...]]


def _mixer(cfg: _Config, axis: str, step: Any, arrives: jax.Array | None = None) -> Any:
    """``y -> sum_j W_ij y_j`` on device i for this ``step``'s phase (with ``arrives``,
    ``W'``: each lost message's weight moved to the diagonal); over several phases, one
    branch of a ``lax.switch`` each."""

    def phase(weights: np.ndarray, perms: list[tuple[int, ...]]) -> Any:
        if arrives is None:
            return functools.partial(_mix, axis=axis, weights=weights, perms=perms)
        return functools.partial(
            _mix_unreliable, axis=axis, weights=weights, perms=perms, arrives=arrives
        )

    branches = [phase(*one) for one in cfg.phases]
    if len(branches) == 1:
        return branches[0]
    return lambda y: lax.switch(step % len(branches), branches, y)


def _island_exchange(
    cfg: _Config, parts: Parts, before: Parts | None, outer: Any, clock: Any
) -> tuple[Parts, Any, dict[str, jax.Array]]:
    """One device's exchange over islands: its shard mixed with its counterparts in the
    neighbouring islands, in ``cfg.order`` (an absent island keeps its shard from before
    the step)."""
    key, step = clock
    metrics = _phase_metrics(cfg, {})
    if not (cfg.drop or cfg.churn):
        mix = _mixer(cfg, ISLAND, step)
    else:
        arrives, present = link_masks(key, step, cfg.kit.n, drop=cfg.drop, churn=cfg.churn)
        here = present[lax.axis_index(ISLAND)]
        if before is not None:
            parts = jax.tree.map(lambda new, old: jnp.where(here, new, old), parts, before)
        mix = _mixer(cfg, ISLAND, step, arrives)
        metrics = _network_metrics(cfg, step, arrives, present, metrics)
    params, opt_state, model_state, reducer_state = parts
    if cfg.order == "dpsgd":  # the island's update, added to the mix of the shards before
        start = before[0]  # the parameters' shard before the step
        updates = jax.tree.map(lambda new, old: new - old, params, start)
        params, model_state = _mixed(cfg.order, mix, start, updates, model_state)
    else:
        params, model_state = mix((params, model_state))
    return (params, opt_state, model_state, reducer_state), outer, metrics


class _Config(NamedTuple):
    kit: Kit
    optimizer: optax.GradientTransformation
    phases: tuple[_Phase, ...]
    drop: float
    churn: float
    consensus_every: int
    order: str


def _worker_step(
    cfg: _Config, state: GossipState, batch: Any
) -> tuple[GossipState, dict[str, jax.Array]]:
    axis, n = cfg.kit.workers_axis, cfg.kit.n
    params, opt_state = unstack(state.params), unstack(state.opt_state)
    me = lax.axis_index(axis)
    key = worker_key(state.model, me)
    old_model_state = unstack(state.model.state)
    (loss, aux), grads, model_state = cfg.kit.value_and_grad(params, old_model_state, batch, key)
    updates, new_opt_state = cfg.optimizer.update(grads, opt_state, params)
    step = state.model.step
    if not (cfg.drop or cfg.churn):
        mix = _mixer(cfg, axis, step)
        metrics = _phase_metrics(cfg, lax.pmean({"loss": loss, **aux}, axis))
    else:
        arrives, present = link_masks(state.model.key, step, n, drop=cfg.drop, churn=cfg.churn)
        here = present[me]  # an absent worker takes no step
        updates = jax.tree.map(lambda u: jnp.where(here, u, jnp.zeros_like(u)), updates)
        model_state, new_opt_state = jax.tree.map(
            lambda new, old: jnp.where(here, new, old),
            (model_state, new_opt_state),
            (old_model_state, opt_state),
        )
        mix = _mixer(cfg, axis, step, arrives)
        values = _phase_metrics(cfg, {"loss": loss, **aux})
        metrics = _network_metrics(cfg, step, arrives, present, values)
    params, model_state = _mixed(cfg.order, mix, params, updates, model_state)
    distance = measured_consensus(params, state, cfg.consensus_every, axis)
    if cfg.consensus_every:
        metrics["consensus_distance"] = distance
    model = ModelVars(restack(model_state), state.model.key, state.model.step + 1)
    return GossipState(restack(params), restack(new_opt_state), distance, model), metrics


def _mixed(order: str, mix: Any, params: Any, updates: Any, model_state: Any) -> tuple[Any, Any]:
    """The parameters and model state after one round of sends (``mix``): ``"dpsgd"``:
    ``sum_j W_ij params_j + updates_i``; ``"adapt_then_combine"``:
    ``sum_j W_ij (params_j + updates_j)``. The model state, after the step, is mixed in
    both."""
    if order == "dpsgd":
        mixed, model_state = mix((params, model_state))
        return optax.apply_updates(mixed, updates), model_state
    return mix((optax.apply_updates(params, updates), model_state))


def _phase_metrics(cfg: _Config, metrics: dict) -> dict:
    """``metrics`` with, for a dynamic topology, ``mixing_rounds``: 1.0, the step's round
    with its one peer (run in a branch of the step's program)."""
    if len(cfg.phases) > 1:
        return {**metrics, "mixing_rounds": jnp.float32(1.0)}
    return metrics


def _network_metrics(
    cfg: _Config, step: Any, arrives: jax.Array, present: jax.Array, values: dict
) -> dict[str, jax.Array]:
    """The loss and aux values over every worker's replica on its rows (an absent one's
    too: the global batch's, as local SGD's and the islands'), and the network's metrics."""
    axis, n = cfg.kit.workers_axis, cfg.kit.n
    metrics = lax.pmean(values, axis)
    if cfg.churn:
        metrics["workers_present"] = present.sum().astype(jnp.float32)
    if cfg.drop:
        edges = np.zeros((len(cfg.phases), n, n), bool)  # [phase, i, j]: j sends to i
        for k, phase in enumerate(cfg.phases):
            for perm in phase.perms:
                edges[k, list(perm), list(range(n))] = True
        now = jnp.asarray(edges)[step % len(cfg.phases)]
        sent = now & present[:, None] & present[None, :]
        lost = (sent & ~arrives).sum()
        metrics["messages_dropped"] = (lost / jnp.maximum(sent.sum(), 1)).astype(jnp.float32)
    return metrics


def _mix(y: Any, axis: str, weights: np.ndarray, perms: list[tuple[int, ...]]) -> Any:
    """``sum_j W_ij y_j`` on device i: one ``ppermute`` round per neighbour permutation,
    of the floating leaves; integer ones (counters) stay each worker's own."""
    me = lax.axis_index(axis)
    w = jnp.asarray(weights, jnp.float32)

    def mix(y: list[jax.Array]) -> list[jax.Array]:
        mixed = [w[me, me].astype(a.dtype) * a for a in y]
        for perm in perms:
            send = lambda f, perm=perm: ppermute(f, axis, list(enumerate(perm)))  # noqa: E731
            arrived = in_buckets(send, y)
            wk = w[me, jnp.asarray(np.argsort(perm))[me]]  # whom device i hears from
            mixed = [m + wk.astype(r.dtype) * r for m, r in zip(mixed, arrived, strict=True)]
        return mixed

    return on_floating(mix, y)


def _mix_unreliable(
    y: Any, axis: str, weights: np.ndarray, perms: list[tuple[int, ...]], arrives: jax.Array
) -> Any:
    """``sum_j W'_ij y_j`` on device i, ``W'`` being ``W`` with the weight of each message
    that did not arrive moved to the diagonal. With every message arriving the arithmetic is
    :func:`_mix`'s, operation for operation (integer leaves kept as there)."""
    me = lax.axis_index(axis)
    w = jnp.asarray(weights, jnp.float32)

    def mix(y: list[jax.Array]) -> list[jax.Array]:
        own, rounds = w[me, me], []
        for perm in perms:
            send = lambda f, perm=perm: ppermute(f, axis, list(enumerate(perm)))  # noqa: E731
            arrived = in_buckets(send, y)
            source = jnp.asarray(np.argsort(perm))[me]
            kept = jnp.where(arrives[me, source], w[me, source], jnp.float32(0))
            own = own + (w[me, source] - kept)
            rounds.append((kept, arrived))
        mixed = [own.astype(a.dtype) * a for a in y]
        for wk, arrived in rounds:
            mixed = [m + wk.astype(r.dtype) * r for m, r in zip(mixed, arrived, strict=True)]
        return mixed

    return on_floating(mix, y)
