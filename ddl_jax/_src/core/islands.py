"""Islands: an outer method over an island-stacked inner strategy.

An inner strategy built on a mesh with an ``island`` axis (``kit.py``: data parallelism,
FSDP, tensor parallelism) trains one copy per island. :func:`over_islands` stacks an
outer method on it: each step it runs the inner step, then the method's *exchange* in one
``shard_map`` over the whole mesh, where each device works on its shard of the inner state
with its counterparts in the other islands (collectives over ``island`` only). The outer
method's state is stored one entry per device, each shaped like the device's shard.

An outer method (``local_sgd(inner=...)``, ``noloco(inner=...)``) gives, for the mesh, an
:class:`Exchange`: how its state starts from the parameters' shards, and the exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.kit import Kit, after, is_spec, one_worker, restack, unstack
from ddl_jax._src.core.reducer import axes_communicated
from ddl_jax._src.core.strategy import ISLAND, Strategy

#: One device's shard of what an exchange reads and writes of the inner state:
#: ``(params, opt_state, model_state, reducer_state)``.
Parts = tuple[Any, Any, Any, Any]


class IslandsState(NamedTuple):
    """State of an outer method over islands (``local_sgd(inner=...)``, ...).

    Attributes:
      inner: the inner strategy's state, one per island (each leaf's leading axis, split
        over ``island``).
      outer: the outer method's state (e.g. the anchor, the outer optimizer's state, a
        reducer's error feedback), one entry per device: a leading axis over every mesh
        axis, each entry shaped like the device's shard of the inner parameters.
    """

    inner: Any
    outer: Any


class Exchange(NamedTuple):
    """An outer method on a given mesh.

    Attributes:
      start: ``params -> outer``: one device's outer state from its shard of the
        parameters.
      exchange: ``(parts, before, outer, (key, step)) -> (parts, outer, metrics)``, on one
        device: ``parts`` its shard of the inner state after the step (``Parts``),
        ``before`` the same before it (``None`` unless ``keeps_before``), ``outer`` its
        outer state, ``key`` and ``step`` its island's key and step count before the step.
        ``metrics`` must be the same on every device.
      keeps_before: whether ``exchange`` reads the parts before the step (an absent
        island keeps them).
      check: ``inner_state ->`` None; raises for an inner state the method cannot use.
    """

    start: Callable[[Any], Any]
    exchange: Callable[..., tuple[Parts, Any, dict[str, jax.Array]]]
    keeps_before: bool = False
    check: Callable[[Any], None] = lambda inner_state: None


def over_islands(inner: Strategy, method: Callable[[Any, Any], Exchange], name: str) -> Strategy:
    """The outer method ``method(mesh)`` over the island-stacked ``inner`` strategy.

    Args:
      inner: ``ddl.data_parallel``, ``ddl.fsdp`` or ``ddl.tensor_parallel`` built on a mesh
        with an ``island`` axis.
      method: ``(mesh, params) -> Exchange``; ``params`` one island's parameters as
        abstract arrays, the whole model's shapes (an exchange sees a device's shard).
      name: the outer method's builder, for error messages (``"local_sgd"``).

    Returns:
      A ``Strategy`` whose state is an ``IslandsState``; metrics the inner step's
      (averaged over islands) and the exchange's; ``params`` the inner strategy's (the
      islands' mean).
    """
    if not isinstance(inner, Strategy):
        raise TypeError(
            f"{name}: inner must be a ddl strategy (ddl.data_parallel, ddl.fsdp or "
            f"ddl.tensor_parallel on a mesh with an 'island' axis), got {type(inner).__name__}."
        )

    starts: dict[Any, Callable[[Any], Any]] = {}  # by mesh and specs: compiled once

    def init(variables: Any) -> IslandsState:
        inner_state = inner.init(variables)
        mesh = island_mesh(inner_state)
        shapes = one_worker(inner_state.params)
        chosen = method(mesh, shapes)
        chosen.check(inner_state)
        params_specs = specs_of(inner_state.params)
        flat, tree = jax.tree.flatten(params_specs, is_leaf=is_spec)
        key = (mesh, tree, tuple(flat), tuple(jax.tree.leaves(shapes)))
        if key not in starts:
            starts[key] = jax.jit(
                jax.shard_map(
                    lambda params: restack(chosen.start(unstack(params))),
                    mesh=mesh,
                    in_specs=(params_specs,),
                    out_specs=P(mesh.axis_names),
                    check_vma=False,
                )
            )
        state = IslandsState(inner_state, starts[key](inner_state.params))
        _check_axes(name, chosen, mesh, state)
        return state

    def step(state: IslandsState, batch: Any) -> tuple[IslandsState, dict[str, jax.Array]]:
        mesh = island_mesh(state.inner)
        chosen = method(mesh, one_worker(state.inner.params))
        before = state.inner
        inner_state, metrics = inner.step(before, batch)
        # The exchange (its first collectives read the step) waits for the metrics'.
        clock = (before.model.key, after(before.model.step, metrics))
        parts, outer, exchanged = _program(chosen, mesh, before)(
            inner_parts(inner_state),
            inner_parts(before) if chosen.keeps_before else None,
            state.outer,
            clock,
        )
        params, opt_state, model_state, reducer_state = parts
        inner_state = inner_state._replace(
            params=params,
            opt_state=opt_state,
            reducer_state=reducer_state,
            model=inner_state.model._replace(state=model_state),
        )
        return IslandsState(inner_state, outer), {**metrics, **exchanged}

    return Strategy(init, step, lambda state: inner.params(state.inner))


def check_outer_only(
    name: str,
    given: dict[str, Any],
    axis: Any,
    axes: tuple[Any, ...],
    consensus_every: int | None = None,
) -> None:
    """With ``inner=``, the flat builder's arguments are the inner strategy's: each of
    ``given`` (``loss_fn``, ``optimizer``, ``mesh``, ``accumulate``, ``has_aux``,
    ``workers``) must keep its default, ``axis`` be one of ``axes``, and
    ``consensus_every`` (which measures whole replicas, not a device's shard) be left
    unset."""
    defaults = {"accumulate": 1, "has_aux": False}
    for key, value in (*given.items(), ("axis", axis)):
        if (value not in axes) if key == "axis" else (value != defaults.get(key)):
            raise ValueError(
                f"{name}: {key}={value!r} is the inner strategy's to set; with inner=, give "
                f"{name} only the outer method's settings."
            )
    if consensus_every:
        raise ValueError(
            f"{name}: consensus_every measures whole replicas; with inner= each device holds "
            "a shard, so it is not measured: leave consensus_every=None."
        )


def island_kit(mesh: Any, reducer: Any = None) -> Kit:
    """The kit an outer method's exchange runs with: its workers are the islands."""
    return Kit(mesh, ISLAND, mesh.shape[ISLAND], reducer, None, False, 1)


def island_mesh(inner_state: Any) -> Any:
    """The mesh of an island-stacked inner state (its ``params``' leaves' mesh), checked."""
    fields = ("params", "opt_state", "reducer_state", "model")
    if not all(hasattr(inner_state, f) for f in fields):
        raise TypeError(
            "inner must be ddl.data_parallel, ddl.fsdp or ddl.tensor_parallel (a state with "
            f"{', '.join(fields)}); its state is {type(inner_state).__name__}."
        )
    mesh = jax.typeof(jax.tree.leaves(inner_state.params)[0]).sharding.mesh
    if ISLAND not in mesh.axis_names:
        raise ValueError(
            f"inner must be built on a mesh with an {ISLAND!r} axis, e.g. "
            f"ddl.make_mesh(island=2, data=4); its mesh has axes {list(mesh.axis_names)}."
        )
    return mesh


def inner_parts(inner_state: Any) -> Parts:
    """What an exchange reads and writes of an inner state (the inner reducer's state
    only to keep an absent island's)."""
    model_state = inner_state.model.state
    return inner_state.params, inner_state.opt_state, model_state, inner_state.reducer_state


def specs_of(tree: Any) -> Any:
    """Each leaf's ``PartitionSpec``, read from its type (its place on the mesh)."""
    return jax.tree.map(lambda x: jax.typeof(x).sharding.spec, tree)


def _program(chosen: Exchange, mesh: Any, inner_state: Any) -> Any:
    """The exchange as one ``shard_map`` over the whole mesh, each device on its shard.

    It runs without replication checks: an entry stored per device holds the same value on
    devices that share a shard, which JAX cannot type (it is exact: they compute alike).
    """
    each = P(mesh.axis_names)
    specs = specs_of(inner_parts(inner_state))
    clock = specs_of((inner_state.model.key, inner_state.model.step))

    def body(parts: Any, before: Any, outer: Any, clock: Any) -> Any:
        before = None if before is None else unstack(before)
        parts, outer, metrics = chosen.exchange(unstack(parts), before, unstack(outer),
                                                unstack(clock))  # fmt: skip
        return restack(parts), restack(outer), metrics

    before = specs if chosen.keeps_before else None
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, before, each, clock),
                         out_specs=(specs, each, P()), check_vma=False)  # fmt: skip


def _check_axes(name: str, chosen: Exchange, mesh: Any, state: IslandsState) -> None:
    """The exchange talks over ``island`` only: a reducer built for another axis
    (``axis="data"``, the default) would mix the shards of one island."""
    parts = inner_parts(state.inner)
    clock = (state.inner.model.key, state.inner.model.step)
    program = _program(chosen, mesh, state.inner)
    before = parts if chosen.keeps_before else None
    others = sorted(axes_communicated(jax.make_jaxpr(program)(parts, before, state.outer, clock))
                    - {ISLAND})  # fmt: skip
    if others:
        raise ValueError(
            f"{name}(inner=...): the outer exchange communicates over {others}; it must run "
            f"over {ISLAND!r} only. Build the reducer with axis={ISLAND!r}, e.g. "
            f"ddl.compression.sparse_loco(0.01, axis={ISLAND!r})."
        )
