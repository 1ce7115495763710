"""A model's stacked layers in turn, one layer's parameters gathered at a time under FSDP.

A model whose blocks are one stacked pytree (a leading layer axis on every leaf, as
MaxText's ``scan_layers`` and Flax's ``nn.scan`` lay them out) runs them with
:func:`scan_layers`. On its own it is ``lax.scan``. Under ``ddl.fsdp(stage=3,
reshard_after_forward=True)`` the strategy leaves the stacked leaves sharded and
:func:`gathering` tells ``scan_layers`` how to all-gather one layer: each iteration gathers
its layer, and the body is rematerialised in the backward (``jax.checkpoint``), so the
gather runs again there and no layer's whole parameters outlive their use. Autodiff turns
each gather into the reduce-scatter of that layer's gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax

#: ``layer -> layer``: what gathers one layer's shards, set by ``ddl.fsdp`` while it traces.
_GATHER: contextvars.ContextVar[Callable[[Any], Any] | None] = contextvars.ContextVar(
    "ddl_layer_gather", default=None
)
#: While ``ddl.fsdp`` looks for them: the stacked leaves ``scan_layers`` was given.
_SEEN: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "ddl_layer_seen", default=None
)
#: While ``ddl.fsdp`` looks for them: ``id(made) -> (made, leaf)`` for arrays made from a
#: parameter leaf that stand for it (``stand_for``).
_STANDS_FOR: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "ddl_layer_stands_for", default=None
)


def stand_for(made: Any, params: Any) -> None:
    """Declares each leaf of ``made``, computed from the leaf of ``params`` at its place (a
    cast: ``ddl.mixed_precision``), as that leaf, so that :func:`scanned_leaves` finds a
    stacked leaf the loss casts before ``scan_layers``. Outside that search it does nothing."""
    table = _STANDS_FOR.get()
    if table is None:
        return
    for new, old in zip(jax.tree.leaves(made), jax.tree.leaves(params), strict=True):
        if new is not old:
            table[id(new)] = (new, old)  # both kept alive: their ids stay theirs


def scan_layers(
    fn: Callable[[Any, Any], Any], layers: Any, x: Any, *, policy: Callable[..., Any] | None = None
) -> Any:
    """``x`` through each layer of ``layers`` in turn: ``fn(layer, x) -> x``.

    Args:
      fn: one layer, ``(layer_params, x) -> x`` (``x``'s structure and shapes kept).
      layers: the layers' parameters, stacked: every leaf has a leading axis of L layers.
      x: the input of the first layer (any pytree).
      policy: a ``jax.checkpoint`` policy (``jax.checkpoint_policies``) for the body,
        where it is rematerialised: under ``ddl.fsdp(reshard_after_forward=True)``, or when
        given here. A policy that saves dots keeps the layer's activations and still
        gathers the parameters again in the backward.

    Returns:
      The last layer's output.

    Example:
      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> layers = {"w": jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])}
      >>> ddl.layers.scan_layers(lambda p, h: h @ p["w"], layers, jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    seen = _SEEN.get()
    if seen is not None:
        seen.extend(jax.tree.leaves(layers))
    gather = _GATHER.get()

    def body(h: Any, layer: Any) -> tuple[Any, None]:
        return fn(layer if gather is None else gather(layer), h), None

    if gather is not None or policy is not None:
        body = jax.checkpoint(body, policy=policy)
    return lax.scan(body, x, layers)[0]


@contextlib.contextmanager
def gathering(gather: Callable[[Any], Any]) -> Iterator[None]:
    """While tracing under it, :func:`scan_layers` gathers each layer with ``gather``."""
    token = _GATHER.set(gather)
    try:
        yield
    finally:
        _GATHER.reset(token)


def scanned_leaves(fn: Callable[[Any], Any], params: Any) -> list[int]:
    """The indices (in ``jax.tree.leaves(params)`` order) of the leaves of ``params`` that
    ``fn(params)`` passes to :func:`scan_layers` as they are, or as an array declared to
    stand for them (:func:`stand_for`); ``fn`` is traced once, abstractly, nothing runs.

    Args:
      fn: ``params -> anything``, e.g. the loss on a batch.
      params: arrays or ``jax.ShapeDtypeStruct``s.
    """
    found: list[int] = []

    def probe(p: Any) -> Any:
        leaves = jax.tree.leaves(p)
        seen: list[Any] = []
        table: dict[int, tuple[Any, Any]] = {}
        tokens = _SEEN.set(seen), _STANDS_FOR.set(table)
        try:
            out = fn(p)
        finally:
            _SEEN.reset(tokens[0])
            _STANDS_FOR.reset(tokens[1])

        def source(x: Any) -> Any:
            while id(x) in table:
                x = table[id(x)][1]
            return x

        index = {id(leaf): i for i, leaf in enumerate(leaves)}
        found.extend(sorted({index[id(source(s))] for s in seen if id(source(s)) in index}))
        return out

    jax.eval_shape(probe, params)
    return found
