"""Adapters between Flax modules (NNX and Linen) and the losses strategies train.

A module with only trainable parameters becomes ``loss_fn(params, batch)`` and its params
(a plain nested dict). A module with batch norm or dropout becomes a ``ddl.ModelLoss`` and
its *variables* ``{"params": ..., "batch_stats": ...}``: strategies carry the batch
statistics as model state and give every worker and step its own dropout key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import errors, linen, nnx

from ddl_jax._src.core.model_loss import ModelLoss
from ddl_jax._src.core.strategy import check_int

Params = dict[str, Any]
Variables = dict[str, Any]

_CARRIED = (nnx.Param, nnx.BatchStat, nnx.RngKey, nnx.RngCount)


def _split_nnx(module: nnx.Module) -> tuple[Any, Params, Params, Params, Params]:
    """``(graphdef, params, batch_stats, rng_keys, rng_counts)`` as pure dicts. What
    ``sow`` kept from an earlier call (``nnx.Intermediate``) is an output, not state: it
    is left out (of a copy sharing the arrays; the module keeps it)."""
    if nnx.to_flat_state(nnx.state(module, nnx.Intermediate)):
        module = nnx.clone(module)
        nnx.pop(module, nnx.Intermediate)
    graphdef, *states, rest = nnx.split(module, *_CARRIED, ...)
    if other := [
        f"{'/'.join(map(str, path))} ({type(v).__name__})" for path, v in nnx.to_flat_state(rest)
    ]:
        raise ValueError(
            f"module holds state no strategy can carry: {other[:4]}. Strategies train "
            "nnx.Param, carry nnx.BatchStat as model state and reseed RNG streams every "
            "step; make the other variables nnx.BatchStat (state the forward pass updates), "
            "or remove them (e.g. a decoding cache) before training."
        )
    return graphdef, *(nnx.to_pure_dict(s) for s in states)


def _reseed(rng_keys: Params, key: jax.Array) -> Params:
    """Stream i of the module (in tree order) draws from ``fold_in(key, i)``."""
    leaves, treedef = jax.tree.flatten(rng_keys)
    return treedef.unflatten([jax.random.fold_in(key, i) for i in range(len(leaves))])


def _missing_stream(e: Exception) -> ValueError:
    return ValueError(
        f"the model draws randomness from a stream it was not given ({e}). Build NNX "
        "modules with the stream, e.g. nnx.Rngs(params=0, dropout=1); for Linen pass "
        "rngs=('dropout', ...) to ddl.flax.loss_from_module (or ddl.pipeline_stages)."
    )


def _run(loss: Callable[..., Any], model: nnx.Module, batch: Any) -> Any:
    try:
        return loss(model, batch)
    except (errors.FlaxError, ValueError) as e:
        if "rngs" not in str(e):
            raise
        raise _missing_stream(e) from e


def _nnx_loss(module: nnx.Module, loss: Callable[..., Any], seed: int | None):
    graphdef, params, batch_stats, rng_keys, rng_counts = _split_nnx(module)
    if not batch_stats and not rng_keys:
        return (lambda p, batch: _run(loss, nnx.merge(graphdef, p, {}, {}, {}), batch)), params

    def fn(p, model_state, batch, key):
        stats = model_state.get("batch_stats", {})
        model = nnx.merge(graphdef, p, stats, _reseed(rng_keys, key), rng_counts)
        out = _run(loss, model, batch)
        new = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        return out, ({"batch_stats": new} if stats else {})

    if seed is None:  # the run's randomness comes from the module's own first stream
        first = jax.tree.leaves(rng_keys)
        seed = jax.random.key_data(first[0]) if first else 0
    variables = {"params": params, **({"batch_stats": batch_stats} if batch_stats else {})}
    return ModelLoss(fn, seed), variables


def _linen_loss(
    module: linen.Module,
    loss: Callable[..., Any],
    variables: Any,
    rngs: Sequence[str],
    seed: int | None,
):
    _check_linen_variables(variables)
    rest = {k: v for k, v in variables.items() if k != "params"}
    if not rest and not rngs:
        bind = _bind_linen(module, rest)

        def plain(p, batch):
            try:
                return loss(bind(p), batch)
            except errors.InvalidRngError as e:
                raise _missing_stream(e) from e

        return plain, variables["params"]

    def fn(p, model_state, batch, key):
        current = dict(model_state)
        keys = {name: jax.random.fold_in(key, i) for i, name in enumerate(rngs)}

        def model(*args, **kwargs):
            # Each call sees the collections the previous call left, as in a Linen loop.
            out, updated = module.apply(
                {**current, "params": p}, *args, rngs=keys, mutable=list(current), **kwargs
            )
            current.update(updated)
            return out

        try:
            out = loss(model, batch)
        except errors.InvalidRngError as e:
            raise _missing_stream(e) from e
        return out, current

    return ModelLoss(fn, 0 if seed is None else seed), dict(variables)


def _check_linen_variables(variables: Any) -> None:
    if not (hasattr(variables, "keys") and "params" in variables):
        raise TypeError(
            "variables must be the dict returned by module.init(...), with a 'params' "
            f"collection; got {type(variables).__name__}."
        )


def _bind_linen(module: linen.Module, rest: Variables) -> Callable[[Params], Any]:
    def bind(p):
        return lambda *args, **kwargs: module.apply({**rest, "params": p}, *args, **kwargs)

    return bind


def _check_module(module: Any, variables: Any) -> None:
    if isinstance(module, nnx.Module):
        if variables is not None:
            raise TypeError("variables is only for Linen modules; an NNX module holds its own.")
    elif isinstance(module, linen.Module):
        if variables is None:
            raise TypeError("a Linen module needs variables=module.init(rng, example_input).")
    else:
        raise TypeError(
            f"module must be a flax.nnx.Module or a flax.linen.Module, got {type(module).__name__}."
        )


def split(module: Any, *, variables: Any = None) -> tuple[Callable[..., Any], Any]:
    """Splits a Flax module into a pure ``apply(variables, *inputs)`` and its variables.

    For evaluation: the module runs as it is when ``split`` is called (call
    ``model.eval()`` before ``split`` for inference with running batch statistics and no
    dropout: an NNX module's mode is part of what ``apply`` captures, so ``eval()`` after
    ``split`` does not change it); state it updates while running is dropped
    (a Linen ``apply`` given ``mutable=`` returns it, as Flax's does), and what ``sow``
    kept from an earlier call is left out.

    Args:
      module: a ``flax.nnx.Module``, or a ``flax.linen.Module`` together with ``variables``.
      variables: for Linen only, the dict from ``module.init``.

    Returns:
      ``(apply, variables)``: ``apply(v, *args, **kwargs)`` calls the module with ``v`` in
      place of its own, ``v`` laid out as ``loss_from_module`` and ``Strategy.params`` lay
      it out: the params dict for a module with only parameters, else
      ``{"params": ..., "batch_stats": ...}`` (``"batch_stats"`` only with batch norm).
    """
    _check_module(module, variables)
    if isinstance(module, linen.Module):
        _check_linen_variables(variables)
        rest = {k: v for k, v in variables.items() if k != "params"}
        if not rest:
            return (lambda p, *a, **k: module.apply({"params": p}, *a, **k)), variables["params"]

        def apply_linen(v, *args, **kwargs):
            if "mutable" in kwargs:  # the caller asks for the updated collections
                return module.apply(v, *args, **kwargs)
            # collections the module updates while running (batch statistics in training
            # mode, counters) are updated and dropped, not refused as immutable
            out, _ = module.apply(v, *args, mutable=[k for k in v if k != "params"], **kwargs)
            return out

        return apply_linen, dict(variables)
    graphdef, params, batch_stats, rng_keys, rng_counts = _split_nnx(module)
    if not batch_stats and not rng_keys:
        return (lambda p, *a, **k: nnx.merge(graphdef, p, {}, {}, {})(*a, **k)), params

    def apply(v, *args, **kwargs):
        stats = v.get("batch_stats", {})
        return nnx.merge(graphdef, v["params"], stats, rng_keys, rng_counts)(*args, **kwargs)

    return apply, {"params": params, **({"batch_stats": batch_stats} if batch_stats else {})}


def loss_from_module(
    module: Any,
    loss: Callable[..., Any],
    *,
    variables: Any = None,
    rngs: Sequence[str] = (),
    seed: int | None = None,
) -> tuple[Callable[..., Any] | ModelLoss, Any]:
    """Turns a Flax module and a loss into what strategies train, and its variables.

    A module with only parameters gives ``(loss_fn(params, batch), params)``. A module with
    batch norm (``nnx.BatchStat`` / a Linen ``batch_stats`` collection) or dropout (NNX RNG
    streams / Linen ``rngs``) gives a ``ddl.ModelLoss`` and
    ``{"params": ..., "batch_stats": ...}``: strategies train the params, carry the batch
    statistics, and give each worker and step its own dropout key. Stream i of an NNX
    module (in tree order) draws ``fold_in(fold_in(fold_in(seed_key, step), worker), i)``;
    Linen stream ``rngs[i]`` the same.

    Args:
      module: a ``flax.nnx.Module``, or a ``flax.linen.Module`` together with ``variables``.
      loss: ``loss(model, batch) -> scalar`` (or ``(scalar, aux)``), where ``model`` is the
        module carrying the variables (NNX: the module itself, in the mode it is in, so
        ``model.train()`` before and its methods work; Linen: a callable running
        ``module.apply``, to which pass ``train``-style flags yourself).
      variables: for Linen only, the dict from ``module.init``.
      rngs: for Linen only, the RNG streams the module draws from (e.g. ``("dropout",)``).
      seed: the seed of every dropout key of a run (an int); default: an NNX module's own
        first RNG stream, 0 for Linen.

    Returns:
      ``(loss_fn, variables)`` ready for any ddl_jax strategy and ``ddl.fit``.
    """
    if not callable(loss):
        raise TypeError(f"loss must be callable (model, batch) -> scalar, got {loss!r}.")
    _check_module(module, variables)
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    if isinstance(rngs, str) or not all(isinstance(r, str) for r in rngs):
        raise TypeError(
            f"rngs must be a sequence of stream names, e.g. ('dropout',); got {rngs!r}."
        )
    if isinstance(module, linen.Module):
        return _linen_loss(module, loss, variables, tuple(rngs), seed)
    if rngs:
        raise TypeError("rngs is only for Linen modules; NNX modules hold their RNG streams.")
    return _nnx_loss(module, loss, seed)


def update_module(module: Any, variables: Any) -> Any:
    """Writes trained variables (from ``Strategy.params(state)``) back into NNX modules.

    Args:
      module: an NNX module, or a sequence of them (the stages of ``ddl.pipeline``).
      variables: its params dict, or ``{"params": ..., "batch_stats": ...}``; a sequence of
        them for a sequence of modules.

    Returns:
      ``module``, updated in place. Linen modules hold no variables: use the dict itself.
    """
    if isinstance(module, Sequence) and not isinstance(module, nnx.Module):
        if not isinstance(variables, Sequence) or len(variables) != len(module):
            raise ValueError(
                f"update_module: {len(module)} modules need as many variables, got "
                f"{type(variables).__name__}"
                + (f" of length {len(variables)}." if isinstance(variables, Sequence) else ".")
            )
        for m, v in zip(module, variables, strict=True):
            update_module(m, v)
        return module
    if not isinstance(module, nnx.Module):
        raise TypeError(
            "update_module takes a flax.nnx.Module; for Linen use {**variables, 'params': params}."
        )
    params = nnx.state(module, nnx.Param)
    stats = nnx.state(module, nnx.BatchStat)
    if nnx.to_pure_dict(stats) and isinstance(variables, dict) and "params" in variables:
        _check_matches(params, variables["params"], "params")
        _check_matches(stats, variables.get("batch_stats", {}), "batch_stats")
        nnx.replace_by_pure_dict(params, variables["params"])
        nnx.replace_by_pure_dict(stats, variables.get("batch_stats", {}))
        nnx.update(module, params, stats)
    else:
        if isinstance(variables, dict) and set(variables) <= {"params", "batch_stats"}:
            variables = variables.get("params", variables)
        _check_matches(params, variables, "params")
        nnx.replace_by_pure_dict(params, variables)
        nnx.update(module, params)
    return module


def _check_matches(state: Any, given: Any, what: str) -> None:
    """``given`` has the module's ``what`` paths and shapes, or a ``ValueError`` names
    the difference."""

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {jax.tree_util.keystr(path): tuple(np.shape(x)) for path, x in leaves}

    mine, theirs = shapes(nnx.to_pure_dict(state)), shapes(given)
    if mine == theirs:
        return
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    resized = [k for k in sorted(set(mine) & set(theirs)) if mine[k] != theirs[k]]
    parts = [f"missing {missing[:3]}"] if missing else []
    parts += [f"not in the module {extra[:3]}"] if extra else []
    parts += [f"{k} is {theirs[k]} in the variables, {mine[k]} in the module" for k in resized[:3]]
    raise ValueError(
        f"update_module: the variables' {what} do not match the module ({'; '.join(parts)}); "
        "pass the variables of a strategy built from this model (Strategy.params(state))."
    )
