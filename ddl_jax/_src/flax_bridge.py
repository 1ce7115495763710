"""Adapters between Flax modules (NNX and Linen) and ddl_jax's ``loss_fn(params, batch)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import linen, nnx

Params = dict[str, Any]


def _bind_nnx(module: nnx.Module) -> tuple[Callable[[Params], nnx.Module], Params]:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    frozen = [
        f"{'/'.join(map(str, path))} ({type(v).__name__})"
        for path, v in nnx.to_flat_state(rest)
        if isinstance(v, nnx.BatchStat | nnx.RngState)
    ]
    if frozen:
        raise ValueError(
            "module holds state that a pure loss_fn(params, batch) would freeze: "
            f"{frozen[:4]}; only nnx.Param is trained. Remove BatchNorm/Dropout "
            "(or build the model with deterministic layers) before distributing it."
        )
    return (lambda p: nnx.merge(graphdef, p, rest)), nnx.to_pure_dict(params)


def _bind_linen(module: linen.Module, variables: Any) -> tuple[Callable[[Params], Any], Params]:
    if not (hasattr(variables, "keys") and "params" in variables):
        raise TypeError(
            "variables must be the dict returned by module.init(...), with a 'params' "
            f"collection; got {type(variables).__name__}."
        )
    rest = {k: v for k, v in variables.items() if k != "params"}
    if "batch_stats" in rest:
        raise ValueError(
            "variables hold 'batch_stats', which a pure loss_fn(params, batch) would freeze; "
            "only 'params' is trained."
        )

    def bind(p):
        return lambda *args, **kwargs: module.apply({**rest, "params": p}, *args, **kwargs)

    return bind, variables["params"]


def _binder(module: Any, variables: Any) -> tuple[Callable[[Params], Any], Params]:
    if isinstance(module, nnx.Module):
        if variables is not None:
            raise TypeError("variables is only for Linen modules; an NNX module holds its own.")
        return _bind_nnx(module)
    if isinstance(module, linen.Module):
        if variables is None:
            raise TypeError("a Linen module needs variables=module.init(rng, example_input).")
        return _bind_linen(module, variables)
    raise TypeError(
        f"module must be a flax.nnx.Module or a flax.linen.Module, got {type(module).__name__}."
    )


def split(module: Any, *, variables: Any = None) -> tuple[Callable[..., Any], Params]:
    """Splits a Flax module into a pure ``apply(params, *inputs)`` and its params pytree.

    Args:
      module: a ``flax.nnx.Module``, or a ``flax.linen.Module`` together with ``variables``.
      variables: for Linen only, the dict from ``module.init``.

    Returns:
      ``(apply, params)``: ``apply(params, *args, **kwargs)`` calls the module with
      ``params`` (a plain nested dict of arrays) in place of its own.
    """
    bind, params = _binder(module, variables)
    return (lambda p, *args, **kwargs: bind(p)(*args, **kwargs)), params


def loss_from_module(
    module: Any, loss: Callable[..., Any], *, variables: Any = None
) -> tuple[Callable[[Params, Any], Any], Params]:
    """Turns a Flax module and a loss into ``loss_fn(params, batch)`` and its params.

    Args:
      module: a ``flax.nnx.Module``, or a ``flax.linen.Module`` together with ``variables``.
      loss: ``loss(model, batch) -> scalar`` (or ``(scalar, aux)``), where ``model`` is the
        module carrying ``params`` (NNX: the module itself, so its methods and submodules
        work; Linen: a callable running ``module.apply``).
      variables: for Linen only, the dict from ``module.init``.

    Returns:
      ``(loss_fn, params)`` ready for any ddl_jax strategy.
    """
    if not callable(loss):
        raise TypeError(f"loss must be callable (model, batch) -> scalar, got {loss!r}.")
    bind, params = _binder(module, variables)
    return (lambda p, batch: loss(bind(p), batch)), params


def update_module(module: nnx.Module, params: Params) -> nnx.Module:
    """Writes trained ``params`` (from ``Strategy.params(state)``) back into an NNX module.

    Linen modules hold no parameters: use ``{**variables, "params": params}`` instead.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            "update_module takes a flax.nnx.Module; for Linen use {**variables, 'params': params}."
        )
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    return module
