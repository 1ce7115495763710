"""Streaming DiLoCo: DiLoCo synchronising one fragment of the parameters at a time,
with the outer gradient's exchange overlapped with inner steps."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
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
from ddl_jax._src.core.kit import Kit, check_agrees, prepare, restack, unstack
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, worker_key
from ddl_jax._src.core.reducer import reducer_metrics
from ddl_jax._src.core.strategy import (
    ISLAND,
    Strategy,
    check_int,
    check_real,
    check_transform,
    vary_over,
)
from ddl_jax._src.reduce.allreduce import allreduce_mean, reducer_for, worker_mean

_ORDERS = ("depth", "strided")
_SCHEDULES = ("paper", "torchft")


class StreamingDiLoCoState(NamedTuple):
    """State of :func:`streaming_diloco`.

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``.
      opt_state: each worker's inner optimizer state, ``[N, ...]`` sharded ``P(axis)``.
      anchor: the global model (every fragment as its last outer step left it), ``P()``.
      outer_opt_state: one outer optimizer state per fragment, of the list of its leaves
        (``optax.EmptyState()`` each without an outer optimizer), ``P()``.
      reducer_state: one reducer state per fragment, of the list of its leaves, per worker
        ``P(axis)``.
      pending: with ``overlap`` > 0, per fragment the list of its last reduced outer
        gradients (the one in flight until it lands), ``P()``; ``()`` with ``overlap=0``.
      model: each worker's model state (batch statistics), ``P(axis)``, averaged at every
        fragment's send; the run's key and the step count, ``P()``.
    """

    params: Any
    opt_state: Any
    anchor: Any
    outer_opt_state: tuple[Any, ...]
    reducer_state: tuple[Any, ...]
    pending: tuple[Any, ...]
    model: ModelVars


def streaming_diloco(
    loss_fn: AnyLoss | None = None,
    optimizer: optax.GradientTransformation | None = None,
    mesh: Mesh | None = None,
    *,
    inner: Strategy | None = None,
    period: int,
    fragments: int | Sequence[Sequence[str]],
    fragment_order: str = "depth",
    overlap: int = 0,
    mix: float = 0.0,
    schedule: str = "paper",
    outer_optimizer: optax.GradientTransformation | None = None,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
    workers: int | None = None,
) -> Strategy:
    """Streaming DiLoCo: DiLoCo whose fragments synchronise in turn, overlapped with training.

    The parameters are cut into ``fragments`` (P) fragments, their leaves in the natural
    order of their key paths (``layers_2`` before ``layers_10``): by default by depth, P
    contiguous runs of leaves of roughly equal bytes; ``fragment_order="strided"`` puts
    block i (``layers_i``: a leaf's path up to its first name holding a digit) in fragment
    i mod P, the paper's strided pattern; or ``fragments`` lists each fragment's key paths,
    as torchft takes its ``model_fragments`` as given. :func:`fragment_indices` says which
    leaves each fragment holds.

    Every worker i trains its replica theta_i with ``optimizer`` on its shard of the
    batches. Counting the local steps s = 1, 2, ... (s = t + 1 after step t), fragment p
    is *sent* after the steps with s = p H/P (mod H), s >= 1 (H = ``period``): p > 0 first
    after p H/P steps, fragment 0 after H, and each every H steps from then on, so one
    fragment is sent every H/P steps. A send reduces the fragment's outer gradient
    ``Delta_p = (1/N) sum_i (anchor_p - theta_i,p)`` through ``reducer``, and averages the
    model state (batch statistics) over the workers. The reduced ``Delta_p`` *lands*
    ``overlap`` (tau) steps later, after step s + tau, while the workers keep training:

    * the global fragment moves, ``anchor_p <- anchor_p + outer_optimizer(Delta_p)`` (or
      ``anchor_p - Delta_p``, parameter averaging, without an outer optimizer), each
      fragment with its own outer optimizer state;
    * every replica's fragment is mixed with it,
      ``theta_i,p <- mix theta_i,p + (1 - mix) anchor_p`` (the paper's alpha).

    With ``fragments=1, overlap=0, mix=0`` this is DiLoCo, ``ddl.local_sgd(...,
    period=H, outer_optimizer=...)``, step for step. The inner optimizer state stays each
    worker's own. A send runs one ``lax.switch`` branch per fragment, so
    ``ddl.comm_stats(...).branches`` shows each fragment's bytes: the peak bytes a step
    sends are about 1/P of DiLoCo's. Outer gradients are quantized by giving a
    compressing ``reducer`` (``ddl.compression.cast(jnp.bfloat16)``, ``qsgd``, ...).

    ``mix`` defaults to 0: replicas take the global fragment, as DiLoCo does, and the
    trivial case above holds with the defaults. With ``overlap`` >= 1 the paper mixes
    (alpha between 0 and 1, e.g. 0.5) to keep part of the tau steps' local progress.
    ``Strategy.params`` is the replicas' mean.

    **Islands.** ``streaming_diloco(inner=strategy, ...)`` makes each worker an island
    running ``strategy`` (``ddl.data_parallel``, ``ddl.fsdp`` or ``ddl.tensor_parallel`` on
    a mesh with an ``island`` axis), as ``ddl.local_sgd(inner=...)`` does: each device
    sends its shard of a fragment to its counterparts (the fragments cut from the whole
    model's leaves, as without islands: FSDP keeps a leaf that does not divide its devices
    whole, so cuts by a device's shard sizes would differ), and keeps its shard's anchor,
    outer states and in-flight gradients. The reducer must average over ``island``.

    The reference implementation, pytorch/torchft ``torchft/local_sgd.py`` (``DiLoCo``),
    takes the fragments from the user (``model_fragments``); torchtitan's default
    (pytorch/torchtitan ``torchtitan/components/ft/diloco/utils.py``, ``fragment_llm``) cuts
    the layers into contiguous runs in depth order, which the default here follows
    (balanced by bytes rather than by layer count).

    **Schedule.** The default, ``schedule="paper"``, times the syncs as the paper does: a
    fragment's outer gradient is sent at its offset t_p (mod H) and applied tau steps
    later, here with the offsets t_p = p H/P (above). torchft times its syncs the other
    way round (``DiLoCo._step_post_hook``): the k-th sync *lands* after k H/P local steps
    and was sent tau steps before, and its fragment is k - 1 (mod P), fragment 0 first.
    ``schedule="torchft"`` follows it step for step: fragment (k - 1) mod P sent after
    k H/P - tau steps, landing after k H/P. The two are the same schedule shifted by
    tau steps and with the fragments relabelled.

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", 2025, arXiv:2501.18512.
      Douillard et al., "DiLoCo", 2023, arXiv:2311.08105 (inner AdamW; outer
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), or a
        ``ddl.ModelLoss``; not with ``inner``.
      optimizer: the inner optax optimizer, one state per worker; not with ``inner``.
      mesh: a mesh with axis ``axis``; not with ``inner``.
      inner: an island's strategy (Islands, above), instead of ``loss_fn``, ``optimizer``
        and ``mesh``.
      period: H, the local steps between two sends of a fragment, >= 1, a multiple of
        ``fragments``.
      fragments: P, how many fragments, >= 1 and at most the parameters' number of leaves
        (of blocks when strided; checked by ``init``); or a list of P lists of key
        paths into the trained parameters (``"layers_0"``, ``"Dense_0/kernel"`` for a
        Flax model through ``ddl.flax``, whose ``params`` collection is the tree; ``/`` or
        ``.`` between names), every parameter leaf under exactly one of them.
      fragment_order: with an int ``fragments``, ``"depth"`` (contiguous runs of blocks
        of about equal bytes) or ``"strided"`` (block i to fragment i mod P).
      overlap: tau, the steps an outer gradient is in flight, 0 <= tau < H/P (a fragment
        lands before the next one is sent).
      mix: alpha in [0, 1], the share of a replica's own fragment kept when it lands.
      schedule: ``"paper"`` (default) or ``"torchft"``: when each fragment is sent and
        lands (Schedule, above).
      outer_optimizer: applied to each fragment's reduced outer gradient (any
        per-parameter optax optimizer); ``None`` is parameter averaging.
      reducer: how a fragment's outer gradient is averaged (default
        ``ddl.allreduce_mean(axis)``, ``"island"`` with ``inner``); any reducer,
        compressing ones included, or a function of the workers' axis returning one.
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.
      workers: N, a multiple of the devices on ``axis`` (default: one a device): each
        device runs N / devices replicas through ``jax.vmap``, the run of N devices; a
        ``reducer`` then as a function of the axis (``data_parallel``'s ``workers``); not
        with ``inner``.

    Returns:
      A ``Strategy`` with ``StreamingDiLoCoState`` (with ``inner``: an ``IslandsState``
      whose ``outer`` is each device's anchor, outer and reducer states and pending
      gradients); metrics ``loss``, aux values,
      ``synchronised`` (1.0 when a fragment was sent this step), ``fragment`` (the one
      sent, -1.0 if none) and the reducer's metrics (of the last fragment sent).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     pred = batch["x"] * (params["a"] + params["b"])
      ...     return jnp.mean((pred - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> mesh = ddl.make_mesh(data=8)
      >>> strategy = ddl.streaming_diloco(
      ...     loss_fn, optax.sgd(0.1), mesh, period=4, fragments=2, overlap=1, mix=0.5
      ... )
      >>> state = strategy.init({"a": jnp.zeros(()), "b": jnp.zeros(())})
      >>> sent, step = [], jax.jit(strategy.step)
      >>> for _ in range(4):
      ...     state, metrics = step(state, batch)
      ...     sent.append(int(metrics["fragment"]))
      >>> sent  # fragment 1 after 2 local steps, fragment 0 after 4
      [-1, 1, -1, 0]
      >>> round(float(state.anchor["a"]), 6), round(float(state.anchor["b"]), 6)  # "a" in flight
      (0.0, 0.32)
    """
    settings = (outer_optimizer, period, fragments, fragment_order, overlap, mix, schedule)
    if inner is not None:
        flat = {"loss_fn": loss_fn, "optimizer": optimizer, "mesh": mesh,
                "accumulate": accumulate, "has_aux": has_aux, "workers": workers}  # fmt: skip
        check_outer_only("streaming_diloco", flat, axis, ("data", ISLAND))
        reducer = reducer_for(reducer, ISLAND)

        def method(mesh: Any, params: Any) -> Exchange:
            kit = island_kit(mesh, reducer)
            # cut from the whole model's leaves: a device's shards need not split alike
            # (FSDP keeps a leaf that does not divide its devices whole)
            cfg = _configure(kit, None, *settings)
            bounds = fragment_indices(params, cfg.layout, cfg.order)
            start = lambda shard: (shard, *_outer_start(cfg, shard, bounds))  # noqa: E731
            return Exchange(start, functools.partial(_island_exchange, cfg, bounds))

        return over_islands(inner, method, "streaming_diloco")
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        axis,
        accumulate,
        has_aux,
        reducer=reducer,
        default_reducer=allreduce_mean,
        workers=workers,
    )
    cfg = _configure(kit, optimizer, *settings)
    model = ModelVars(P(axis), P(), P())
    specs = StreamingDiLoCoState(P(axis), P(axis), P(), P(), P(axis), P(), model)
    return Strategy(
        kit.init(functools.partial(_make_state, cfg), specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


class _Config(NamedTuple):
    kit: Kit
    optimizer: optax.GradientTransformation
    outer: optax.GradientTransformation | None
    period: int  # H
    fragments: int  # P
    layout: int | tuple  # fragment_indices' fragments: P, or the explicit list
    order: str  # fragment_order
    overlap: int  # tau
    mix: float  # alpha
    schedule: str  # "paper" or "torchft"


def _configure(
    kit: Kit,
    optimizer: optax.GradientTransformation,
    outer_optimizer: Any,
    period: Any,
    layout: Any,
    order: Any,
    overlap: Any,
    mix: Any,
    schedule: Any,
) -> _Config:
    """``streaming_diloco``'s own arguments checked."""
    period = check_int("period", period, minimum=1)
    if isinstance(layout, (int, np.integer)) and not isinstance(layout, bool):
        layout = fragments = check_int("fragments", layout, minimum=1)
    else:
        fragments = len(_check_list(layout))
        layout = tuple(tuple(f) for f in layout)
        if order != "depth":
            raise ValueError(
                f"fragment_order applies to a number of fragments; an explicit list of "
                f"fragments is taken as given, got fragment_order={order!r}"
            )
    if order not in _ORDERS:
        raise ValueError(f"fragment_order must be 'depth' or 'strided', got {order!r}")
    if period % fragments:
        raise ValueError(
            f"period must be a multiple of fragments (one fragment is sent every "
            f"period/fragments steps), got period={period}, fragments={fragments}."
        )
    spacing = period // fragments
    overlap = check_int("overlap", overlap, minimum=0)
    if overlap >= spacing:
        raise ValueError(
            f"overlap must be < period/fragments = {spacing} (a fragment's outer gradient "
            f"lands before the next fragment is sent), got overlap={overlap}."
        )
    mix = check_real("mix", mix, minimum=0.0, maximum=1.0)
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be 'paper' or 'torchft', got {schedule!r}")
    if outer_optimizer is not None:
        check_transform(
            "outer_optimizer", outer_optimizer, "optax.sgd(0.7, momentum=0.9, nesterov=True)"
        )
    return _Config(
        kit, optimizer, outer_optimizer, period, fragments, layout, order, overlap, mix, schedule
    )


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _natural(text: str) -> list[Any]:
    """``text`` as alternating text and numbers, so that "layers_2" sorts before "layers_10"."""
    runs: list[Any] = re.split(r"(\d+)", text)
    runs[1::2] = [int(r) for r in runs[1::2]]
    return runs


def _leaf_paths(params: Any) -> list[tuple[str, ...]]:
    """Each leaf's key path (in tree-leaf order) as a tuple of names."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [tuple(_key_name(k) for k in path) for path, _ in flat]


def _block(path: tuple[str, ...]) -> tuple[str, ...]:
    """The block a leaf belongs to: its path up to the first name holding a digit (``layers_3``,
    a list's ``3``), else its parent module (the leaf itself at the top level)."""
    for i, name in enumerate(path):
        if any(c.isdigit() for c in name):
            return path[: i + 1]
    return path[:-1] or path


def fragment_indices(
    params: Any, fragments: int | Sequence[Sequence[str]], order: str = "depth"
) -> tuple[tuple[int, ...], ...]:
    """The leaves (indices in tree-leaf order) of each fragment of ``params``.

    The leaves are taken in the natural order of their key paths (numbers by value:
    ``layers_2`` before ``layers_10``, not the sorted key order ``jax.tree.leaves`` flattens
    in, which puts ``layers_10`` beside ``layers_1``). Names without numbers keep
    alphabetical order (``embed``, ``head``, ``stem``): where that is not the model's
    depth, list the fragments.

    * ``fragments=P``, ``order="depth"``: P contiguous runs of leaves of roughly equal
      bytes: boundary k goes after the leaf where the running byte count comes closest to
      k/P of the total (the earliest on a tie), every run keeping at least one leaf. By
      depth, as torchtitan cuts a model for torchft (pytorch/torchtitan,
      ``torchtitan/components/ft/diloco/utils.py``, ``fragment_llm``: contiguous layers,
      balanced by layer count rather than bytes, never splitting a layer; a layer's leaves
      are adjacent here, but a boundary may fall between them).
    * ``fragments=P``, ``order="strided"``: the leaves grouped in *blocks* (a leaf's key
      path up to its first name holding a digit, ``layers_3`` or a list's ``3``, else its
      parent module); block i (in natural order) goes to fragment i mod P, the Streaming
      DiLoCo paper's strided pattern (arXiv:2501.18512, slightly better than sequential
      in its ablation). At most as many fragments as blocks.
    * ``fragments`` a list of lists of key paths (``"layers_0"``, ``"layers_0/kernel"``;
      ``/`` or ``.`` between names): fragment p holds the leaves whose path starts with one
      of ``fragments[p]``, as torchft's ``DiLoCo(model_fragments=...)`` takes the fragments
      as given (pytorch/torchft, ``torchft/local_sgd.py``) and torchtitan names them
      (``module_fqns_per_model_fragment``). Every leaf must be in exactly one fragment.
    """
    paths = _leaf_paths(params)
    if not isinstance(fragments, int):
        return _listed(paths, _check_list(fragments))
    if order not in _ORDERS:
        raise ValueError(f"fragment_order must be 'depth' or 'strided', got {order!r}")
    natural = sorted(range(len(paths)), key=lambda i: [_natural(n) for n in paths[i]])
    if order == "strided":
        blocks: dict[tuple[str, ...], list[int]] = {}
        for i in natural:
            blocks.setdefault(_block(paths[i]), []).append(i)
        members, unit = list(blocks.values()), "blocks"
    else:
        members, unit = [[i] for i in natural], "leaves"
    if fragments > len(members):
        raise ValueError(
            f"fragments must be at most the parameters' number of {unit}, {len(members)}, "
            f"got {fragments}: a fragment is a group of whole {unit}."
        )
    if order == "strided":
        return tuple(tuple(i for b in members[p::fragments] for i in b) for p in range(fragments))
    leaves = jax.tree.leaves(params)
    nbytes = [int(np.prod(jnp.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves]
    running = np.cumsum([sum(nbytes[i] for i in b) for b in members])  # units 0..j
    cuts = [0]
    for k in range(1, fragments):
        target = k * running[-1] / fragments
        # A cut at c ends the run before unit c; leave a unit for each later run.
        options = range(cuts[-1] + 1, len(members) - (fragments - k) + 1)
        cuts.append(min(options, key=lambda c: abs(running[c - 1] - target)))
    cuts.append(len(members))
    return tuple(tuple(i for b in members[lo:hi] for i in b) for lo, hi in itertools.pairwise(cuts))


def _check_list(fragments: Any) -> list[list[tuple[str, ...]]]:
    """An explicit list of fragments, each a list of key paths, as tuples of names."""
    if (
        isinstance(fragments, (str, bytes))
        or not isinstance(fragments, Sequence)
        or not all(
            isinstance(f, Sequence)
            and not isinstance(f, (str, bytes))
            and all(isinstance(k, str) for k in f)
            for f in fragments
        )
    ):
        raise ValueError(
            "fragments must be an int >= 1 or a list of lists of key paths (one list per "
            f"fragment, e.g. [['embed', 'layers_0'], ['layers_1', 'norm']]), got {fragments!r}"
        )
    if not fragments:
        raise ValueError("fragments must hold at least one fragment, got []")
    for p, f in enumerate(fragments):
        if not f:
            raise ValueError(f"fragments' {p} is empty: every fragment names a key path")
    return [[tuple(n for n in re.split(r"[/.]", k) if n) for k in f] for f in fragments]


def _listed(
    paths: list[tuple[str, ...]], fragments: list[list[tuple[str, ...]]]
) -> tuple[tuple[int, ...], ...]:
    owner: dict[int, int] = {}
    for p, prefixes in enumerate(fragments):
        for prefix in prefixes:
            hits = [i for i, path in enumerate(paths) if path[: len(prefix)] == prefix]
            if not hits:
                raise ValueError(
                    f"fragments names {'/'.join(prefix)!r}, which matches no parameter; "
                    f"the parameters' paths: {sorted('/'.join(q) for q in paths)}"
                )
            for i in hits:
                if owner.setdefault(i, p) != p:
                    raise ValueError(
                        f"fragments puts {'/'.join(paths[i])!r} in fragments {owner[i]} and "
                        f"{p}: every parameter belongs to one fragment"
                    )
    missing = sorted("/".join(paths[i]) for i in range(len(paths)) if i not in owner)
    if missing:
        raise ValueError(f"fragments leaves out {missing}: every parameter belongs to one fragment")
    natural = sorted(range(len(paths)), key=lambda i: [_natural(n) for n in paths[i]])
    return tuple(tuple(i for i in natural if owner[i] == p) for p in range(len(fragments)))


def _groups(tree: Any, indices: tuple[tuple[int, ...], ...]) -> list[list[Any]]:
    leaves = jax.tree.leaves(tree)
    return [[leaves[i] for i in group] for group in indices]


def _with_group(tree: Any, indices: tuple[tuple[int, ...], ...], p: int, group: list) -> Any:
    """``tree`` with fragment ``p``'s leaves replaced by ``group``."""
    leaves, treedef = jax.tree.flatten(tree)
    for i, leaf in zip(indices[p], group, strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _replace(items: tuple[Any, ...], p: int, item: Any) -> tuple[Any, ...]:
    return (*items[:p], item, *items[p + 1 :])


def _outer_start(
    cfg: _Config, params: Any, bounds: tuple[tuple[int, ...], ...] | None = None
) -> tuple[Any, Any, Any]:
    """Per fragment (``bounds``, else cut from ``params``): the outer optimizer's state, one
    worker's reducer state, and (with overlap) the gradient in flight."""
    outer = cfg.outer
    bounds = fragment_indices(params, cfg.layout, cfg.order) if bounds is None else bounds
    groups = _groups(params, bounds)
    outer_state = tuple(optax.EmptyState() if outer is None else outer.init(g) for g in groups)
    pending = () if cfg.overlap == 0 else tuple(jax.tree.map(jnp.zeros_like, groups))
    return outer_state, tuple(cfg.kit.reducer.init(g) for g in groups), pending


def _make_state(cfg: _Config, params: Any, model: ModelVars) -> StreamingDiLoCoState:
    kit = cfg.kit
    outer_state, reducer_state, pending = _outer_start(cfg, params)
    return StreamingDiLoCoState(
        params=kit.stack(params),
        opt_state=kit.stack(cfg.optimizer.init(params)),
        anchor=params,
        outer_opt_state=outer_state,
        reducer_state=kit.stack(reducer_state),
        pending=pending,
        model=model._replace(state=kit.stack(model.state)),
    )


# What the switch's branches carry: params, anchor, outer states, reducer states, pending,
# model state (one worker's).
Carry = tuple[Any, Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], Any]


def _worker_step(
    cfg: _Config, state: StreamingDiLoCoState, batch: Any
) -> tuple[StreamingDiLoCoState, dict[str, jax.Array]]:
    """One worker's step: a local step, then (on schedule) one fragment's send or landing."""
    kit, axis = cfg.kit, cfg.kit.workers_axis
    params, opt_state = unstack(state.params), unstack(state.opt_state)
    step = state.model.step
    key = worker_key(state.model, lax.axis_index(axis))
    (loss, aux), grads, model_state = kit.value_and_grad(
        params, unstack(state.model.state), batch, key
    )
    updates, opt_state = cfg.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    carry = (params, state.anchor, state.outer_opt_state, unstack(state.reducer_state))
    carry, schedule = _exchange(cfg, (*carry, state.pending, model_state), step)
    params, anchor, outer_state, reducer_state, pending, model_state = carry
    metrics = lax.pmean({"loss": loss, **aux, **schedule.pop("reducer")}, axis)
    model = ModelVars(restack(model_state), state.model.key, step + 1)
    new = StreamingDiLoCoState(
        restack(params),
        restack(opt_state),
        anchor,
        outer_state,
        restack(reducer_state),
        pending,
        model,
    )
    return new, {**metrics, **schedule}


def _exchange(
    cfg: _Config, carry: Carry, step: jax.Array, bounds: tuple[tuple[int, ...], ...] | None = None
) -> tuple[Carry, dict[str, Any]]:
    """What follows a worker's local step ``step``: on schedule, one fragment's send or
    landing (the fragments ``bounds``, else cut from the carry's parameters). Returns the
    carry and the schedule's metrics, with ``"reducer"``: the reducer's own (of the last
    fragment sent), not yet averaged over the workers."""
    # Branch 0: nothing; 1 + p: fragment p is sent (and lands, without overlap);
    # 1 + P + p (with overlap): fragment p's outer gradient lands. overlap < H/P keeps a
    # landing off the steps that send.
    bounds = fragment_indices(carry[1], cfg.layout, cfg.order) if bounds is None else bounds
    spacing, count = cfg.period // cfg.fragments, cfg.fragments
    # "paper": the k-th send after k H/P local steps, of fragment k mod P; "torchft": the
    # k-th landing after k H/P steps, sent tau before, of fragment k - 1 mod P
    torchft = cfg.schedule == "torchft"
    slot = step + 1 + (cfg.overlap if torchft else 0)  # counts to the sends' slots
    sends = slot % spacing == 0
    fragment = (slot // spacing - torchft) % count
    landed = slot - cfg.overlap
    lands = (landed >= 1) & (landed % spacing == 0) & (cfg.overlap > 0)
    branch = jnp.where(sends, 1 + fragment, 0)
    branch = jnp.where(lands, 1 + count + (landed // spacing - torchft) % count, branch)
    branches = [_keep]
    branches += [functools.partial(_send, cfg=cfg, bounds=bounds, p=p) for p in range(count)]
    if cfg.overlap:
        branches += [
            functools.partial(_land_pending, cfg=cfg, bounds=bounds, p=p) for p in range(count)
        ]
    carry = lax.switch(branch, branches, carry)
    return carry, {
        "reducer": _last_reducer_metrics(carry[3], fragment),
        "synchronised": sends.astype(jnp.float32),
        "fragment": jnp.where(sends, fragment, -1).astype(jnp.float32),
    }


def _island_exchange(
    cfg: _Config,
    bounds: tuple[tuple[int, ...], ...],
    parts: Parts,
    before: None,
    outer: Any,
    clock: Any,
) -> tuple[Parts, Any, dict[str, jax.Array]]:
    """One device's exchange over islands: ``_exchange`` on its shard, of the fragments
    ``bounds`` cut from the whole model."""
    _, step = clock
    params, opt_state, model_state, inner_reducer_state = parts
    carry, metrics = _exchange(cfg, (params, *outer, model_state), step, bounds)
    params, anchor, outer_state, reducer_state, pending, model_state = carry
    metrics |= lax.pmean(metrics.pop("reducer"), ISLAND)
    parts = (params, opt_state, model_state, inner_reducer_state)
    return parts, (anchor, outer_state, reducer_state, pending), metrics


def _last_reducer_metrics(reducer_state: tuple[Any, ...], last: jax.Array) -> dict[str, Any]:
    """The reducer's metrics for fragment ``last`` (the last sent, after this step)."""
    per_fragment = [reducer_metrics(s) for s in reducer_state]
    return {name: jnp.stack([m[name] for m in per_fragment])[last] for name in per_fragment[0]}


def _keep(carry: Carry) -> Carry:
    """The branch of a step that neither sends nor lands: the carry unchanged."""
    return carry


def _send(carry: Carry, cfg: _Config, bounds: tuple[tuple[int, ...], ...], p: int) -> Carry:
    """Fragment ``p``'s outer gradient reduced over the workers; the model state averaged."""
    params, anchor, outer_state, reducer_state, pending, model_state = carry
    local, glob = _groups(params, bounds)[p], _groups(anchor, bounds)[p]
    delta = jax.tree.map(jnp.subtract, glob, local)
    delta, fragment_reducer = cfg.kit.reducer.update(delta, reducer_state[p], glob)
    check_agrees(delta, P(), "the reduced outer gradient")
    reducer_state = _replace(reducer_state, p, fragment_reducer)
    model_state = worker_mean(model_state, cfg.kit.workers_axis)
    if cfg.overlap:
        pending = _replace(pending, p, delta)
    else:
        params, anchor, outer_state = _land(params, anchor, outer_state, delta, cfg, bounds, p)
    return params, anchor, outer_state, reducer_state, pending, model_state


def _land_pending(carry: Carry, cfg: _Config, bounds: tuple[tuple[int, ...], ...], p: int) -> Carry:
    """Fragment ``p``'s reduced outer gradient, in flight since its send, lands."""
    params, anchor, outer_state, reducer_state, pending, model_state = carry
    params, anchor, outer_state = _land(params, anchor, outer_state, pending[p], cfg, bounds, p)
    return params, anchor, outer_state, reducer_state, pending, model_state


def _land(
    params: Any,
    anchor: Any,
    outer_state: tuple[Any, ...],
    delta: list[Any],
    cfg: _Config,
    bounds: tuple[tuple[int, ...], ...],
    p: int,
) -> tuple[Any, Any, tuple[Any, ...]]:
    """The outer step of fragment ``p``, then each replica's fragment mixed with it."""
    glob = _groups(anchor, bounds)[p]
    if cfg.outer is None:
        glob = jax.tree.map(jnp.subtract, glob, delta)
    else:
        updates, fragment_outer = cfg.outer.update(delta, outer_state[p], glob)
        glob = optax.apply_updates(glob, updates)
        outer_state = _replace(outer_state, p, fragment_outer)
    arrived = vary_over(glob, cfg.kit.workers_axis)
    if cfg.mix:
        local, alpha = _groups(params, bounds)[p], cfg.mix
        arrived = jax.tree.map(lambda x, g: alpha * x + (1 - alpha) * g, local, arrived)
    params = _with_group(params, bounds, p, arrived)
    return params, _with_group(anchor, bounds, p, glob), outer_state
