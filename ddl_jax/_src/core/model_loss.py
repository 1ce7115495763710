"""The model a strategy trains: trainable params, model state, and randomness.

A plain ``loss_fn(params, batch)`` has neither model state nor randomness. A model with
batch norm or dropout (``ddl.flax.loss_from_module`` of such a module) comes as a
:class:`ModelLoss`, whose *variables* are ``{"params": ..., <collection>: ...}`` (Linen's
layout): only ``"params"`` is trained, the other collections (``"batch_stats"``) are model
state that the loss returns updated. Every strategy carries both through the same
:class:`ModelVars` in its state, so a new strategy gets the contract from the kit.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Params = Any
Variables = Any


class ModelLoss(NamedTuple):
    """A loss over a model with state (batch statistics) and randomness (dropout).

    ``fn(params, model_state, batch, key) -> (out, new_model_state)``, where ``out`` is
    the scalar loss (or ``(loss, aux_dict)`` with ``has_aux=True``), ``model_state`` the
    variables' collections other than ``"params"`` and ``key`` a PRNG key that differs per
    worker and per step. ``ddl.flax.loss_from_module`` builds one from a Flax module; any
    function of this signature works.

    Attributes:
      fn: the loss, as above.
      seed: the seed every dropout key of a run is derived from: an int, or the
        ``uint32[2]`` data of a threefry key.
    """

    fn: Callable[[Params, Any, Any, jax.Array], tuple[Any, Any]]
    seed: int | Any = 0


#: What a builder's ``loss_fn`` may be: ``(params, batch) -> loss`` or a ModelLoss.
AnyLoss = Callable[..., Any] | ModelLoss


class ModelVars(NamedTuple):
    """The model side of every strategy's state.

    Attributes:
      state: model state (``{"batch_stats": ...}``), ``{}`` for a plain loss; replicated or
        one copy per worker, as the strategy says.
      key: the run's base PRNG key data, ``uint32[2]``, replicated.
      step: steps taken, int32, replicated. Worker w's key at step t is
        ``fold_in(fold_in(key, t), w)``, so a resumed run draws the masks an uninterrupted
        one would.
    """

    state: Any
    key: jax.Array
    step: jax.Array


def check_model_loss(loss_fn: ModelLoss) -> None:
    """Raises ``TypeError`` unless ``loss_fn.fn`` is callable and ``loss_fn.seed`` an int
    >= 0 or the ``uint32[2]`` data of a threefry key."""
    if not callable(loss_fn.fn):
        raise TypeError(
            "loss_fn.fn must be callable (params, model_state, batch, key) -> (out, "
            f"new_model_state), got {loss_fn.fn!r}."
        )
    seed = loss_fn.seed
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool | np.bool_):
        if seed >= 0:
            return
    elif np.shape(seed) == (2,) and np.asarray(seed).dtype == np.uint32:
        return
    raise TypeError(
        "loss_fn.seed must be an int >= 0 or the uint32[2] data of a threefry key "
        f"(jax.random.key_data), got {seed!r}."
    )


def as_model_loss(loss_fn: Callable[..., Any]) -> ModelLoss:
    """``loss_fn`` as a :class:`ModelLoss`: a plain loss gets no state and ignores the key."""
    if isinstance(loss_fn, ModelLoss):
        return loss_fn
    return ModelLoss(lambda params, state, batch, key: (call_loss(loss_fn, params, batch), state))


def call_loss(loss_fn: Callable[..., Any], params: Params, batch: Any) -> Any:
    """``loss_fn(params, batch)``, naming the likely mix-up when it calls its first argument:
    a Flax ``loss(model, batch)`` given where ``loss_fn(params, batch)`` belongs."""
    try:
        return loss_fn(params, batch)
    except TypeError as error:
        if f"'{type(params).__name__}' object is not callable" not in str(error):
            raise
        raise TypeError(
            f"loss_fn called its first argument, which is the parameters (a "
            f"{type(params).__name__}), not a model: it looks like a loss(model, batch). "
            "Strategies take loss_fn(params, batch); make one from the module and its loss "
            "with `loss_fn, params = ddl.flax.loss_from_module(model, loss)`."
        ) from error


def split_variables(loss_fn: Callable[..., Any], variables: Variables) -> tuple[Params, Any]:
    """``(params, model_state)`` of what ``Strategy.init`` receives."""
    if not isinstance(loss_fn, ModelLoss):
        return variables, {}
    if not (isinstance(variables, dict) and "params" in variables):
        raise TypeError(
            "this loss carries model state, so init takes the variables "
            "{'params': ..., 'batch_stats': ...} that ddl.flax.loss_from_module returned; "
            f"got {type(variables).__name__}"
            + (f" with keys {sorted(variables)}." if isinstance(variables, dict) else ".")
        )
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def join_variables(loss_fn: Callable[..., Any], params: Params, model_state: Any) -> Variables:
    """The inverse of :func:`split_variables`: what ``Strategy.params`` returns."""
    if not isinstance(loss_fn, ModelLoss):
        return params
    return {"params": params, **model_state}


def init_vars(loss_fn: Callable[..., Any], model_state: Any) -> ModelVars:
    """The model side of a fresh state (unplaced)."""
    seed = loss_fn.seed if isinstance(loss_fn, ModelLoss) else 0
    if isinstance(seed, int):
        key = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
    else:  # the key data of a stream the model brought
        key = jnp.asarray(seed, jnp.uint32).reshape(2)
    return ModelVars(
        state=model_state,
        key=key,
        step=jnp.zeros((), jnp.int32),
    )


def worker_key(
    model: ModelVars, worker: jax.Array | int, step: jax.Array | None = None
) -> jax.Array:
    """Worker ``worker``'s key at ``step`` (default: the state's step)."""
    key = jax.random.wrap_key_data(model.key, impl="threefry2x32")
    return jax.random.fold_in(jax.random.fold_in(key, model.step if step is None else step), worker)


def mean_over(tree: Any, axis: str, arrived: jax.Array | None = None) -> Any:
    """Averages model state over ``axis`` inside ``shard_map``: floating leaves by their
    mean (in at least float32; with ``arrived``, ``bool[N]``, over the workers it marks,
    zeros where none), integer counters by their maximum."""

    def one(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            wide = jnp.promote_types(x.dtype, jnp.float32)
            if arrived is None:
                return lax.pmean(x.astype(wide), axis).astype(x.dtype)
            mine = arrived[lax.axis_index(axis)]
            total = lax.psum(jnp.where(mine, x.astype(wide), 0), axis)
            return (total / jnp.maximum(jnp.sum(arrived), 1)).astype(x.dtype)
        return lax.pmax(x, axis)

    return jax.tree.map(one, tree)
