"""NoLoCo: local steps, then an outer step shared with one random peer; no all-reduce."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
from ddl_jax._src.core.strategy import ISLAND, Strategy, check_int, check_real, check_transform
from ddl_jax._src.measure.consistency import measured_consensus
from ddl_jax._src.reduce.allreduce import in_buckets
from ddl_jax._src.reduce.collectives import gather_workers

# The stream of the shared pairing draw: fold_in(fold_in(key, step), _PAIR_STREAM); worker
# keys fold in w < N, gossip's link draws 2**32 - 1.
_PAIR_STREAM = 0xFFFFFFFE
# pairing="uniform" switches over every matching: (N - 1)!! of them, 105 at N = 7 and 8, 945
# at 9 and 10; it is allowed up to this many workers.
_MAX_UNIFORM = 8
_PAIRINGS = ("uniform", "rounds")


def pairing_rounds(n: int) -> list[tuple[int, ...]]:
    """The matchings ``pairing="rounds"`` draws from: ``rounds[r][i]`` is worker i's peer.

    The circle method's rounds of a round-robin tournament on n workers (one phantom worker
    added when n is odd): n - 1 perfect matchings for even n, n matchings each leaving one
    worker alone (its own peer) for odd n. Together they hold every pair exactly once, so
    under a uniformly drawn round each pair meets with probability 1/(n - 1) (n even), as
    under a uniformly random perfect matching; for n > 4 the rounds are n - 1 of the
    (n - 1)!! perfect matchings, so the joint law of a step's pairs differs.
    """
    n = check_int("n", n, minimum=1)
    m = n + n % 2
    rounds = []
    for r in range(m - 1):
        peer = list(range(m))
        pairs = [(r, m - 1)] + [((r + k) % (m - 1), (r - k) % (m - 1)) for k in range(1, m // 2)]
        for a, b in pairs:
            peer[a], peer[b] = b, a
        rounds.append(tuple(p if p < n else i for i, p in enumerate(peer[:n])))
    return rounds


def perfect_matchings(n: int) -> list[tuple[int, ...]]:
    """Every matching a uniform NoLoCo outer step may draw: ``matchings[r][i]`` is worker i's
    peer. All (n - 1)!! perfect matchings for even n; for odd n the n!! matchings that
    leave one worker alone (its own peer). In the lexicographic order of the peer tuples.
    """
    n = check_int("n", n, minimum=1)
    found = []

    def extend(peer: list[int]) -> None:
        free = [i for i, p in enumerate(peer) if p < 0]
        if len(free) <= 1:
            found.append(tuple(i if p < 0 else p for i, p in enumerate(peer)))
            return
        first, rest = free[0], free[1:]
        if len(free) % 2:  # odd n: the first free worker may be the one left alone
            peer[first] = first
            extend(peer)
        for other in rest:
            peer[first], peer[other] = other, first
            extend(peer)
            peer[other] = -1
        peer[first] = -1

    extend([-1] * n)
    return sorted(found)


def draw_pairing(key: Any, step: Any, n: int) -> jax.Array:
    """The peers (``int32[n]``, worker i's at i) of the outer step after step ``step``: a
    uniformly random perfect matching (one worker alone for odd n), the same on every
    worker, from the run's key data (``ModelVars.key``) and the step.

    As the authors draw it (jkolehm/noloco, ``src/noloco/sparse_optimizer_c.py``,
    ``create_random_permutation`` then ``batched(ranks, 2)``): a uniform permutation
    ``perm`` of the workers, and pairs ``(perm[j], perm[j + n // 2])``; for odd n the last,
    ``perm[n - 1]``, stays alone. Every matching arises from equally many permutations.
    """
    base = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl="threefry2x32")
    k = jax.random.fold_in(jax.random.fold_in(base, step), _PAIR_STREAM)
    perm = jax.random.permutation(k, n)
    half = n // 2
    a, b = perm[:half], perm[half : 2 * half]
    return jnp.arange(n, dtype=jnp.int32).at[a].set(b).at[b].set(a)


def draw_round(key: Any, step: Any, n: int) -> jax.Array:
    """The index into ``pairing_rounds(n)`` of the outer step after step ``step`` under
    ``pairing="rounds"``: uniform, from the run's key data and the step, the same on every
    worker."""
    base = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32), impl="threefry2x32")
    k = jax.random.fold_in(jax.random.fold_in(base, step), _PAIR_STREAM)
    return jax.random.randint(k, (), 0, len(pairing_rounds(n)))


class NoLoCoState(NamedTuple):
    """State of :func:`noloco`.

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``.
      opt_state: each worker's inner optimizer state, ``P(axis)``.
      anchor: each worker's outer (slow) weights phi_i, ``P(axis)``: they differ between
        workers, each mixing with its peers of past outer steps.
      outer_opt_state: each worker's outer optimizer state (its momentum), ``P(axis)``.
      consensus_distance: the replicas' mean distance to their average at the last
        measurement, ``P()``.
      model: each worker's model state, ``P(axis)``, averaged with the peer's at each outer
        step; the run's key and the step count, ``P()``.
    """

    params: Any
    opt_state: Any
    anchor: Any
    outer_opt_state: Any
    consensus_distance: jax.Array
    model: ModelVars


def noloco(
    loss_fn: AnyLoss | None = None,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    *,
    period: int,
    inner: Strategy | None = None,
    outer_optimizer: optax.GradientTransformation | None = None,
    anchor_pull: float = 1.0,
    pairing: str | None = None,
    consensus_every: int | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
    workers: int | None = None,
) -> Strategy:
    """NoLoCo: DiLoCo whose outer step is shared with one random peer instead of all workers.

    Each worker i takes ``period`` (H) steps of ``optimizer`` from its outer weights phi_i,
    reaching theta_i. Then the workers pair up (a uniformly random perfect matching, the same
    on every worker, drawn from the run's key and the step: :func:`draw_pairing`) and worker
    i, paired with p, takes an outer step on the pair's averaged pseudo-gradient plus a pull
    towards the pair's mean outer weights::

        Delta_j = phi_j - theta_j
        G_i = (Delta_i + Delta_p) / 2 + anchor_pull * (phi_i - (phi_i + phi_p) / 2)
        phi_i <- phi_i + outer_optimizer(G_i);   theta_i <- phi_i

    The default ``outer_optimizer=optax.sgd(0.7, momentum=0.5)`` (heavy-ball momentum, not
    Nesterov) with ``anchor_pull=1`` is the authors' outer step (jkolehm/noloco,
    ``src/noloco/sparse_optimizer_c.py``, ``outer_step``, with ``outer_lr: 0.7`` and
    ``outer_momentum: 0.5`` as in every ``configs/no_reduce_exp/*/*noloco_mean_*.yaml``):
    ``m_i <- alpha m_i - beta mean_pair(Delta) - gamma (phi_i - mean_pair(phi))``,
    ``phi_i <- phi_i + m_i``, with ``alpha = 0.5``, ``beta = 0.7`` and ``gamma = beta *
    anchor_pull``. ``outer_optimizer=optax.sgd(1.0)`` sets both workers to the mean of their
    two replicas (plain pairwise averaging). Inner and outer optimizer states stay each
    worker's own; model state is averaged within the pair. With N = 2 there is one pairing
    and the anchors stay equal: NoLoCo is DiLoCo (``local_sgd(period=H,
    outer_optimizer=...)``), and at H = 1 with ``optax.sgd(1.0)`` synchronous SGD. An odd N
    (which the authors' code rejects) leaves one worker alone per outer step, uniformly
    drawn (it steps on its own pseudo-gradient).

    Communication: each worker sends its pseudo-gradient and its outer weights to its peer
    by one ``ppermute`` (2 x parameter bytes, one with ``anchor_pull=0``, plus model state)
    every H steps; nothing is all-reduced but the loss (and ``consensus_distance`` when
    measured). A ``ppermute``'s pairs are fixed when it compiles, so the drawn matching
    selects one branch of a ``lax.switch`` holding one ``ppermute`` per matching: with
    ``pairing="uniform"`` all :func:`perfect_matchings` ((N - 1)!!: 3 at N = 4, 105 at N = 8,
    945 at N = 10), allowed up to 8 workers; with ``pairing="rounds"`` only the N - 1
    rounds of a round-robin tournament (:func:`pairing_rounds`, one drawn uniformly by
    :func:`draw_round`): each pair still meets with probability 1/(N - 1) per outer step, and
    as the pairwise mean W = (I + P)/2 is a symmetric projection, the expected squared
    consensus distance after a pure averaging step, x^T (E[W] - J) x, is the same as under a
    uniform matching; what differs is the joint law of one step's pairs. The default,
    ``pairing=None``, is ``"uniform"`` up to 8 workers and ``"rounds"`` beyond.

    References:
      Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
      Models", 2025, arXiv:2506.10911. Douillard et al., "DiLoCo", 2023, arXiv:2311.08105.

    **Islands.** ``noloco(inner=strategy, period=H)`` makes each worker an island running
    ``strategy`` (``ddl.data_parallel``, ``ddl.fsdp`` or ``ddl.tensor_parallel`` on a mesh
    with an ``island`` axis), as ``ddl.local_sgd(inner=...)`` does: each device keeps its
    shard's outer weights and momentum and exchanges them with its counterpart in the peer
    island. The consensus distance is not measured there.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); not with
        ``inner``.
      optimizer: the inner optax optimizer, one state per worker; not with ``inner``.
      mesh: a mesh with axis ``axis``; not with ``inner``.
      period: H, inner steps between outer steps, >= 1.
      inner: an island's strategy (Islands, above), instead of ``loss_fn``, ``optimizer``
        and ``mesh``.
      outer_optimizer: applied to G_i; default ``optax.sgd(0.7, momentum=0.5)``, the authors'.
      anchor_pull: the weight of the pull towards the pair's mean outer weights, >= 0;
        the authors' 1.
      pairing: ``"uniform"`` (a uniformly random perfect matching, as the authors draw
        it; N <= 8), ``"rounds"`` (a uniformly drawn round-robin round) or None (``"uniform"``
        for N <= 8, else ``"rounds"``).
      consensus_every: measure ``consensus_distance`` every this many steps; 0 never;
        ``None``: 10 (0 with ``inner``).
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.
      workers: N, a multiple of the devices on ``axis`` (default: one a device): each
        device runs N / devices workers through ``jax.vmap``, the run of N devices. A
        peer's values come from every worker's, all-gathered (the simulation's bytes, not
        the method's), so ``pairing="uniform"`` takes any N.

    Returns:
      A ``Strategy`` with ``NoLoCoState`` (with ``inner``: an ``IslandsState`` whose
      ``outer`` is each device's outer weights and momentum); metrics ``loss``, aux values,
      ``synchronised`` (1.0 after an outer step) and (unless ``consensus_every=0``)
      ``consensus_distance`` as last measured. ``params(state)`` is the mean of the
      replicas.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> strategy = ddl.noloco(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), period=2)
      >>> state = strategy.init({"w": jnp.zeros(())})
      >>> step = jax.jit(strategy.step)
      >>> for _ in range(2):
      ...     state, metrics = step(state, batch)
      >>> float(metrics["synchronised"]), round(float(strategy.params(state)["w"]), 6)
      (1.0, 0.252)
    """
    period = check_int("period", period, minimum=1)
    anchor_pull = check_real("anchor_pull", anchor_pull, minimum=0.0)
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(0.7, momentum=0.5)
    check_transform("outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9)")
    if inner is not None:
        flat = {"loss_fn": loss_fn, "optimizer": optimizer, "mesh": mesh,
                "accumulate": accumulate, "has_aux": has_aux, "workers": workers}  # fmt: skip
        check_outer_only("noloco", flat, axis, ("data", ISLAND), consensus_every)

        def method(mesh: Any, params: Any) -> Exchange:
            n = mesh.shape[ISLAND]
            kit = island_kit(mesh)
            chosen = _pairing(pairing, n)
            cfg = _Config(kit, None, outer_optimizer, period, anchor_pull, 0, chosen)
            start = lambda params: (params, outer_optimizer.init(params))  # noqa: E731
            return Exchange(start, functools.partial(_island_exchange, cfg))

        return over_islands(inner, method, "noloco")
    kit = prepare(loss_fn, optimizer, mesh, axis, accumulate, has_aux, workers=workers)
    consensus_every = 10 if consensus_every is None else consensus_every
    consensus_every = check_int("consensus_every", consensus_every, minimum=0)
    pairing = _pairing(pairing, kit.n, gathered=kit.per_device > 1)
    specs = NoLoCoState(P(axis), P(axis), P(axis), P(axis), P(), ModelVars(P(axis), P(), P()))

    def make_state(params: Any, model: ModelVars) -> NoLoCoState:
        return NoLoCoState(
            params=kit.stack(params),
            opt_state=kit.stack(optimizer.init(params)),
            anchor=kit.stack(jax.tree.map(jnp.copy, params)),
            outer_opt_state=kit.stack(outer_optimizer.init(params)),
            consensus_distance=jnp.zeros((), jnp.float32),
            model=model._replace(state=kit.stack(model.state)),
        )

    cfg = _Config(kit, optimizer, outer_optimizer, period, anchor_pull, consensus_every, pairing)
    return Strategy(
        kit.init(make_state, specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


def _pairing(pairing: Any, n: int, gathered: bool = False) -> str:
    """``pairing`` checked for ``n`` workers, ``None`` resolved. ``gathered``: the peers'
    values are gathered (several workers a device), not switched over, so any N may pair
    uniformly."""
    if pairing is None:
        pairing = "uniform" if n <= _MAX_UNIFORM else "rounds"
    if pairing not in _PAIRINGS:
        raise ValueError(f"pairing must be 'uniform', 'rounds' or None, got {pairing!r}")
    if pairing == "uniform" and n > _MAX_UNIFORM and not gathered:
        raise ValueError(
            f"pairing='uniform' switches over all (N - 1)!! perfect matchings and allows at "
            f"most 8 workers, got N = {n}; use pairing='rounds'"
        )
    return pairing


def _island_exchange(
    cfg: _Config, parts: Parts, before: None, outer: Any, clock: Any
) -> tuple[Parts, Any, dict[str, jax.Array]]:
    """One device's exchange over islands: the outer step with its counterpart in the
    peer island, on its shard."""
    key, step = clock
    params, opt_state, model_state, reducer_state = parts
    anchor, outer_opt_state = outer
    synchronised = (step + 1) % cfg.period == 0
    outer_step = functools.partial(_outer_step, cfg, key, step)
    carry = (params, model_state, anchor, outer_opt_state)
    carry = outer_step(carry) if cfg.period == 1 else lax.cond(synchronised, outer_step, _keep,
                                                                carry)  # fmt: skip
    params, model_state, anchor, outer_opt_state = carry
    metrics = {"synchronised": synchronised.astype(jnp.float32)}
    return (params, opt_state, model_state, reducer_state), (anchor, outer_opt_state), metrics


class _Config(NamedTuple):
    kit: Kit
    optimizer: optax.GradientTransformation
    outer_optimizer: optax.GradientTransformation
    period: int
    anchor_pull: float
    consensus_every: int
    pairing: str


def _worker_step(
    cfg: _Config, state: NoLoCoState, batch: Any
) -> tuple[NoLoCoState, dict[str, jax.Array]]:
    axis = cfg.kit.workers_axis
    params, opt_state = unstack(state.params), unstack(state.opt_state)
    key = worker_key(state.model, lax.axis_index(axis))
    (loss, aux), grads, model_state = cfg.kit.value_and_grad(
        params, unstack(state.model.state), batch, key
    )
    updates, opt_state = cfg.optimizer.update(grads, opt_state, params)
    carry = (
        optax.apply_updates(params, updates),
        model_state,
        unstack(state.anchor),
        unstack(state.outer_opt_state),
    )
    outer = functools.partial(_outer_step, cfg, state.model.key, state.model.step)
    synchronised = (state.model.step + 1) % cfg.period == 0
    carry = outer(carry) if cfg.period == 1 else lax.cond(synchronised, outer, _keep, carry)
    params, model_state, anchor, outer_opt_state = carry
    metrics = lax.pmean({"loss": loss, **aux}, axis)
    metrics["synchronised"] = synchronised.astype(jnp.float32)
    distance = measured_consensus(params, state, cfg.consensus_every, axis)
    if cfg.consensus_every:
        metrics["consensus_distance"] = distance
    model = ModelVars(restack(model_state), state.model.key, state.model.step + 1)
    new = (params, opt_state, anchor, outer_opt_state)
    return NoLoCoState(*map(restack, new), distance, model), metrics


def _keep(carry: Any) -> Any:
    return carry


def _outer_step(cfg: _Config, key: jax.Array, step: jax.Array, carry: Any) -> Any:
    """The outer step with this step's peer: the pair's mean pseudo-gradient, the pull
    towards the pair's mean outer weights, and the pair's mean model state."""
    params, model_state, anchor, outer_opt_state = carry
    delta = jax.tree.map(jnp.subtract, anchor, params)
    mine = (delta, model_state, anchor if cfg.anchor_pull else None)
    if cfg.kit.per_device > 1:  # several workers a device: every worker's, gathered
        peer = _peers(cfg.pairing, key, step, cfg.kit.n)[lax.axis_index(cfg.kit.workers_axis)]
        theirs = jax.tree.map(lambda x: gather_workers(x, cfg.kit.workers_axis)[peer], mine)
    else:
        theirs = _from_peer(mine, cfg.kit.axis, *_draw(cfg.pairing, key, step, cfg.kit.n))
    grad = jax.tree.map(lambda a, b: (a + b) / 2, delta, theirs[0])
    if cfg.anchor_pull:
        pull = cfg.anchor_pull
        grad = jax.tree.map(lambda g, a, b: g + pull * (a - b) / 2, grad, anchor, theirs[2])
    updates, outer_opt_state = cfg.outer_optimizer.update(grad, outer_opt_state, anchor)
    anchor = optax.apply_updates(anchor, updates)
    model_state = jax.tree.map(_pair_mean, model_state, theirs[1])
    return jax.tree.map(jnp.copy, anchor), model_state, anchor, outer_opt_state


def _pair_mean(mine: jax.Array, theirs: jax.Array) -> jax.Array:
    if jnp.issubdtype(mine.dtype, jnp.inexact):
        wide = jnp.promote_types(mine.dtype, jnp.float32)
        return ((mine.astype(wide) + theirs.astype(wide)) / 2).astype(mine.dtype)
    return jnp.maximum(mine, theirs)


def _draw(pairing: str, key: jax.Array, step: jax.Array, n: int) -> tuple[list, jax.Array]:
    """The matchings the exchange switches over, and the index of this step's one."""
    if pairing == "rounds":
        return pairing_rounds(n), draw_round(key, step, n)
    matchings = perfect_matchings(n)
    peer = draw_pairing(key, step, n)
    hits = jnp.all(jnp.asarray(matchings, jnp.int32) == peer, axis=1)
    return matchings, jnp.argmax(hits)


def _peers(pairing: str, key: jax.Array, step: jax.Array, n: int) -> jax.Array:
    """``int32[n]``: every worker's peer in this step's matching (``_draw``'s)."""
    if pairing == "rounds":
        return jnp.asarray(pairing_rounds(n), jnp.int32)[draw_round(key, step, n)]
    return draw_pairing(key, step, n)


def _from_peer(tree: Any, axis: str, matchings: list, index: jax.Array) -> Any:
    """``tree`` of this worker's peer in ``matchings[index]`` (its own for a worker left
    alone): one ``ppermute`` in the branch ``lax.switch`` takes."""
    me = lax.axis_index(axis)

    def exchange(peer: tuple[int, ...], y: Any) -> Any:
        sends = [(i, p) for i, p in enumerate(peer) if p != i]
        arrived = in_buckets(lambda f: lax.ppermute(f, axis, sends), y) if sends else y
        alone = jnp.asarray([p == i for i, p in enumerate(peer)])[me]
        return jax.tree.map(lambda a, b: jnp.where(alone, a, b), y, arrived)

    branches = [functools.partial(exchange, peer) for peer in matchings]
    return branches[0](tree) if len(branches) == 1 else lax.switch(index, branches, tree)
