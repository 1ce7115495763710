"""Pipeline stages: from NNX modules, checked, and run on flat buffers.

A stage is a pair ``(apply, params)`` with ``apply(params, x) -> y``, or, for a stage with
model state or dropout, ``(ddl.ModelLoss, variables)`` with ``fn(params, model_state, x,
key) -> (y, model_state)``. :func:`build_stages` traces the chain on abstract shapes and
wraps each stage on the flat parameter, state and activation buffers the pipeline's
per-device programs pass around.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from ddl_jax._src.core import model_loss as ml
from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.flax_bridge import loss_from_module
from ddl_jax._src.core.model_loss import ModelLoss
from ddl_jax._src.core.strategy import STAGE
from ddl_jax._src.strategies.pipeline.types import PipelineConfig, StageFn, Stages
from ddl_jax._src.xla_cpu.products import transposed_weight_gradients


def pipeline_stages(
    modules: Sequence[nnx.Module | linen.Module],
    variables: Sequence[Any] | None = None,
    *,
    rngs: Sequence[str] = (),
    seed: int | None = None,
) -> tuple[list[tuple[StageFn, Any]], list[Any]]:
    """Flax modules -> ``(stages, variables)`` for :func:`pipeline` and its ``init``.

    NNX modules hold their variables; Linen modules need theirs, ``variables[k] =
    modules[k].init(rng, x_k)`` for stage k's input ``x_k`` (``None`` for an NNX module in
    the list). Linen modules that draw randomness (dropout) need the streams' names,
    ``rngs=("dropout",)``, as ``ddl.flax.loss_from_module`` does: every Linen module then
    makes a stateful stage, its variables ``{"params": ...}`` at least.

    ``stages[k]`` is the pair ``(apply, variables_k)`` of module k, as
    ``ddl.flax.loss_from_module(module, lambda model, x: model(x))`` makes it:

    * a module with only parameters: ``apply(params_k, x) -> y`` and its params pytree;
    * a module with batch norm (``nnx.BatchStat``) or dropout (RNG streams): a stateful
      stage, ``apply`` a ``ddl.ModelLoss`` whose ``fn(params_k, model_state_k, x, key) ->
      (y, new_model_state_k)``, and its variables ``{"params": ..., "batch_stats": ...}``
      (``"batch_stats"`` only with batch norm). Stream i of the module draws
      ``fold_in(key, i)``; the module runs in the mode it is in (``train()`` / ``eval()``).

    ``variables`` is the list of the ``variables_k``, which ``Strategy.init`` takes and
    ``Strategy.params`` returns (write them back with
    ``ddl.flax.update_module(modules, variables)``). Every stateful stage carries the same
    seed, the run's base key: ``seed`` if given, else the first RNG stream of the first
    module that has one (0 for Linen).
    """
    given = [None] * len(modules) if variables is None else list(variables)
    if len(given) != len(modules):
        raise ValueError(
            f"pipeline_stages: {len(given)} variables for {len(modules)} modules; give one per "
            "module (None for an NNX module)."
        )
    for k, (module, v) in enumerate(zip(modules, given, strict=True)):
        if isinstance(module, linen.Module) and v is None:
            raise TypeError(
                f"pipeline_stages: modules[{k}] is a Linen module, which does not hold its "
                "variables: pass them, ddl.pipeline_stages(modules, variables=[m.init(rng, "
                "x) for each stage's module m and input x])."
            )
    if rngs and not any(isinstance(m, linen.Module) for m in modules):
        raise TypeError("rngs is only for Linen modules; NNX modules hold their RNG streams.")
    pairs = [
        loss_from_module(
            m, _call, variables=v, rngs=rngs if isinstance(m, linen.Module) else (), seed=seed
        )
        for m, v in zip(modules, given, strict=True)
    ]
    seeds = [apply.seed for apply, _ in pairs if isinstance(apply, ModelLoss)]
    stages = [
        (apply._replace(seed=seeds[0]) if isinstance(apply, ModelLoss) else apply, variables)
        for apply, variables in pairs
    ]
    return stages, [variables for _, variables in pairs]


def _call(model: nnx.Module, x: Any) -> Any:
    return model(x)


def _apply(apply: StageFn, params: Any, model_state: Any, x: Any, key: jax.Array) -> Any:
    """Runs a stage: ``(y, new_model_state)``; a plain stage returns its state as it is."""
    if isinstance(apply, ModelLoss):
        return apply.fn(params, model_state, x, key)
    return apply(params, x), model_state


def check_like(what: str, tree: Any, view: FlatView) -> None:
    """Raises ``ValueError`` unless ``tree`` has ``view``'s structure and shapes."""
    got = FlatView.of(tree)
    if got.treedef != view.treedef or got.shapes != view.shapes:
        raise ValueError(
            f"{what} has shapes {jax.tree.map(np.shape, tree)} but the stage was built with "
            f"{view.treedef.unflatten(view.shapes)}."
        )


def check_stages(
    stages: Any, k: int, mesh_axes: Sequence[str]
) -> tuple[list[StageFn], list[FlatView], list[FlatView]]:
    """The stages' apply functions and the flat views of their parameter and model-state
    templates."""
    if not isinstance(stages, Sequence) or not stages:
        raise TypeError(
            "stages must be a non-empty list of (apply, params) pairs, got "
            f"{type(stages).__name__}."
        )
    if len(stages) != k:
        axis = (
            f"the mesh's 'stage' axis has size {k}"
            if STAGE in mesh_axes
            else f"the mesh has no 'stage' axis (its axes: {list(mesh_axes)})"
        )
        raise ValueError(
            f"len(stages)={len(stages)} but {axis}; build the mesh with "
            f"ddl.make_mesh(stage={len(stages)}, ...) or pass {k} stages."
        )
    applies, views, state_views = [], [], []
    for i, stage in enumerate(stages):
        if not (
            isinstance(stage, tuple)
            and len(stage) == 2
            and (callable(stage[0]) or isinstance(stage[0], ModelLoss))
        ):
            raise TypeError(
                f"stages[{i}] must be a pair (apply(params, x) -> y, params) or "
                "(ddl.ModelLoss, variables), e.g. from ddl.pipeline_stages(modules); got "
                f"{type(stage).__name__}."
            )
        try:
            params, model_state = ml.split_variables(stage[0], stage[1])
        except TypeError as e:
            raise TypeError(f"stages[{i}] is a stateful stage (a ddl.ModelLoss): {e}") from None
        if not jax.tree.leaves(params):
            raise TypeError(
                f"stages[{i}] has no parameters; every stage needs some (fold a stage without "
                "parameters, e.g. an activation, into the stage before or after it)."
            )
        applies.append(stage[0])
        views.append(FlatView.of(params))
        state_views.append(FlatView.of(model_state))
    return applies, views, state_views


def _stage_inputs(cfg: PipelineConfig, micro: Any) -> list[Any]:
    """Traces the stage chain on abstract shapes: each stage's input (stage 0's is the
    micro-batch), checking that each stage takes the last one's output and the loss is a
    scalar."""
    inputs, x = [micro], micro
    p = jax.ShapeDtypeStruct((cfg.param_len,), cfg.param_dtype)
    s = jax.ShapeDtypeStruct((cfg.state_len,), cfg.state_dtype)
    key = jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32"))
    for i, (apply, view, sview) in enumerate(
        zip(cfg.applies, cfg.views, cfg.state_views, strict=True)
    ):

        def run(
            p: jax.Array, s: jax.Array, x: Any, key: Any, stage: tuple = (apply, view, sview)
        ) -> Any:
            a, v, sv = stage
            return _apply(a, v.unravel(p), sv.unravel(s), x, key)

        try:
            x, new_state = jax.eval_shape(run, p, s, x, key)
        except (TypeError, ValueError) as e:
            got = jax.tree.map(lambda s: s.shape, x)
            raise ValueError(
                f"stage {i} does not accept the output of stage {i - 1} (shape {got}): "
                f"{type(e).__name__}: {e}"
                if i
                else f"stage 0 does not accept a micro-batch of shape {got}: {e}"
            ) from e
        check_like(f"the model state stage {i} returned", new_state, sview)
        if i < cfg.k - 1:
            if not (isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)):
                raise ValueError(
                    f"stage {i} must return one floating-point array to pass to stage {i + 1}, "
                    f"got {jax.tree.map(lambda s: (s.shape, s.dtype), x)}."
                )
            inputs.append(x)
    try:
        loss = jax.eval_shape(cfg.loss_fn, x, micro)
    except (TypeError, ValueError) as e:
        got = jax.tree.map(lambda s: (s.shape, s.dtype), x)
        raise ValueError(
            f"loss_fn does not accept the output of the last stage, stage {cfg.k - 1} "
            f"({got}), with a micro-batch: {type(e).__name__}: {e}"
        ) from e
    st.check_loss_output(loss, has_aux=False)
    return inputs


def build_stages(cfg: PipelineConfig, micro: Any) -> Stages:
    """Each stage's forward and backward on flat buffers, for micro-batches of shape ``micro``."""
    inputs = _stage_inputs(cfg, micro)
    boundaries = inputs[1:]
    width = max([math.prod(s.shape) for s in boundaries], default=0)
    dtype = jnp.result_type(*[s.dtype for s in boundaries]) if boundaries else cfg.param_dtype

    def pack(y: jax.Array) -> jax.Array:
        return jnp.pad(jnp.ravel(y).astype(dtype), (0, width - y.size))

    def unpack(buf: jax.Array, like: Any) -> jax.Array:
        return buf[: math.prod(like.shape)].reshape(like.shape).astype(like.dtype)

    def stage_fn(i: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        apply, view, sview, last = cfg.applies[i], cfg.views[i], cfg.state_views[i], i == cfg.k - 1

        def run(params: Any, s: jax.Array, x_buf: jax.Array, micro: Any, key: Any) -> Any:
            x = micro if i == 0 else unpack(x_buf, inputs[i])
            y, new_state = _apply(apply, params, sview.unravel(s), x, key)
            new = sview.ravel(new_state, cfg.state_len, cfg.state_dtype)
            return (cfg.loss_fn(y, micro) if last else y), new

        def forward(
            p: jax.Array, s: jax.Array, x_buf: jax.Array, micro: Any, key: Any
        ) -> tuple[jax.Array, jax.Array]:
            # The last stage sends nothing on: its loss is computed by its backward.
            if last:
                return jnp.zeros((width,), dtype), s
            y, s = run(view.unravel(p), s, x_buf, micro, key)
            return pack(y), s

        def backward(
            p: jax.Array,
            s: jax.Array,
            x_buf: jax.Array,
            ct_buf: jax.Array,
            micro: Any,
            key: Any,
            scale: float,
        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
            # Differentiate the unravelled tree and concatenate: a gradient of the flat
            # vector, or adding leaf by leaf into zeros, becomes XLA:CPU pad fusions of the
            # stage's size, several times slower than the concatenation (docs/design.md).
            def differentiate(q: Any, x_buf: jax.Array, ct_buf: jax.Array) -> Any:
                y, vjp, new = jax.vjp(
                    lambda q, x_buf: run(q, s, x_buf, micro, key), q, x_buf, has_aux=True
                )
                # The last stage differentiates scale * loss; the others receive error
                # gradients scaled so (one product per micro-batch instead of a pass over
                # every stage's gradient).
                ct = jnp.full_like(y, scale) if last else unpack(ct_buf, y)
                return y, *vjp(ct), new

            if cfg.transposes_weight_gradients:
                differentiate = transposed_weight_gradients(differentiate)
            y, grad_p, grad_x, new = differentiate(view.unravel(p), x_buf, ct_buf)
            loss = y if last else jnp.zeros((), jnp.float32)
            return view.ravel(grad_p, p.shape[0], p.dtype), grad_x, loss, new

        return forward, backward

    fns = [stage_fn(i) for i in range(cfg.k)]
    return Stages([f for f, _ in fns], [b for _, b in fns], width, dtype)


def flop_costs(cfg: PipelineConfig, fns: Stages, micro: Any) -> list[tuple[float, float]] | None:
    """Each stage's ``(forward, backward)`` flops on one micro-batch of shape ``micro``, as
    XLA's cost analysis counts them (the backward as the pipeline runs it, the forward
    re-run included); ``None`` where the backend gives no count."""
    p = jax.ShapeDtypeStruct((cfg.param_len,), cfg.param_dtype)
    s = jax.ShapeDtypeStruct((cfg.state_len,), cfg.state_dtype)
    buf = jax.ShapeDtypeStruct((fns.width,), fns.dtype)
    key = jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32"))
    costs = []
    for forward, backward in zip(fns.forward, fns.backward, strict=True):
        pair = []
        for fn, args in (
            (forward, (p, s, buf, micro, key)),
            (backward, (p, s, buf, buf, micro, key, 1.0)),
        ):
            analysis = jax.jit(fn).lower(*args).cost_analysis()
            if not analysis:
                return None
            pair.append(float(analysis.get("flops", 0.0)))  # none counted: no arithmetic
        costs.append((pair[0], pair[1]))
    return costs
