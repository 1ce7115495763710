"""Tensor (intra-layer) parallelism on the ``model`` mesh axis: the training strategy.

The layers that run on the parameter shards (column- and row-parallel dense layers, the
MLP, attention and Transformer blocks built from them, ``param_specs``) live in
``ddl_jax._src.models.layers``; this strategy trains a model built from them, sharding each
parameter by its spec over ``model`` and running data parallelism over ``data``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.kit import check_agrees, island_specs, prepare, restack, unstack
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, mean_over, worker_key
from ddl_jax._src.core.reducer import checks_vma, reducer_metrics
from ddl_jax._src.core.specs import check_same_over_model, check_specs, full_specs, like_params
from ddl_jax._src.core.strategy import DATA, MODEL
from ddl_jax._src.reduce.allreduce import allreduce_mean


class TensorParallelState(NamedTuple):
    """State of :func:`tensor_parallel`.

    Attributes:
      params: model parameters, each sharded over ``model`` by its spec, replicated over
        ``data``.
      opt_state: optimizer state, sharded like the params it mirrors.
      reducer_state: each data worker's reducer state, a leading axis ``P("data", ...)``.
      model: model state (batch statistics), replicated, averaged over ``data`` after each
        step; the run's key and the step count (one key per data worker: the ``model``
        devices of a data worker draw the same dropout masks).
    """

    params: Any
    opt_state: Any
    reducer_state: Any
    model: ModelVars


def tensor_parallel(
    loss_fn: AnyLoss,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    specs: Any,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
) -> st.Strategy:
    """Tensor parallelism over ``model`` composed with data parallelism over ``data``.

    Each data worker takes ``B/N`` examples; within a data worker the ``model`` devices
    hold shards of the parameters (``specs``) and run ``loss_fn`` on their shards, the
    parallel layers communicating inside it. Gradients are reduced over ``data`` only:
    ``theta <- theta + optimizer(reducer(g_1 .. g_N))``, each device updating its shard.
    Model state (batch statistics) is replicated and averaged over ``data`` after each
    step; the devices of one data worker share its dropout key.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or a ``ddl.ModelLoss``), run inside
        ``shard_map`` on the parameter shards (e.g. ``ddl.flax.loss_from_module`` of a
        model built from ``ddl.layers``); the loss must agree over ``model`` (end the
        model in a row-parallel layer, or ``psum`` over ``"model"``).
      optimizer: any optax transform. It runs on the whole sharded arrays under
        ``jax.jit``, as one device would: element-wise transforms stay on each shard, a
        tree-wide one (``clip_by_global_norm``, ``apply_if_finite``) reads the whole
        gradient (XLA adds the reduction over ``model`` it needs).
      mesh: a mesh with axes ``data`` and ``model``, e.g. ``ddl.make_mesh(data=2, model=4)``;
        a missing axis counts as size 1.
      specs: ``PartitionSpec`` per parameter over ``"model"`` (``ddl.layers.param_specs``),
        or a prefix of the params' structure (``P()`` replicates every parameter).
      reducer: reduces gradients over ``data`` (default ``ddl.allreduce_mean("data")``).
        Reducers built from ``ppermute`` are not supported (they need ``check_vma=False``,
        under which JAX does not sum the gradients of ``model``-replicated parameters), nor
        are compressors.
      accumulate: micro-batches per data worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.

    Returns:
      A ``Strategy`` with a ``TensorParallelState``; metrics: ``loss`` and aux values.
      ``params(state)`` gathers the parameters (replicated), so the model built from
      ``ddl.layers`` evaluates them on one device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = ddl.make_mesh(data=2, model=4)
      >>> strategy = ddl.tensor_parallel(loss_fn, optax.sgd(0.1), mesh, specs=P())
      >>> state, metrics = jax.jit(strategy.step)(strategy.init({"w": jnp.zeros(())}), batch)
      >>> round(float(strategy.params(state)["w"]), 6)
      0.2
    """
    axes = (DATA, MODEL)
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        DATA,
        accumulate,
        has_aux,
        add_axes=axes,
        reducer=reducer,
        default_reducer=allreduce_mean,
        islands=True,
    )
    reducer = kit.reducer
    probe = jax.eval_shape(reducer.init, {"w": jax.ShapeDtypeStruct((8, 8), "float32")})
    if not checks_vma(reducer) or reducer_metrics(probe):
        kind = "a ppermute-based" if not checks_vma(reducer) else "a compressing"
        raise ValueError(
            "tensor_parallel needs an uncompressed psum-based reducer (e.g. "
            f"ddl.allreduce_mean('data')), got {kind} one: a ppermute-based reducer loses the "
            "sum of the gradients of model-replicated parameters, a compressor would flatten "
            "model-sharded and replicated gradients into one payload."
        )

    state_specs = functools.partial(_state_specs, specs)

    def make_state(params: Any, model: ModelVars) -> TensorParallelState:
        check_specs(params, specs, kit.mesh)
        reducer_state = kit.stack(reducer.init(params))
        return TensorParallelState(params, optimizer.init(params), reducer_state, model)

    def worker_step(state: TensorParallelState, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        # A data-varying view, so the reducer sees each data worker's own gradient.
        local = lax.pcast(state.params, DATA, to="varying")
        key = worker_key(state.model, kit.worker_index())
        (loss, aux), grads, model_state = kit.value_and_grad(local, state.model.state, batch, key)
        check_same_over_model({"loss": loss, **aux})
        grads, reducer_state = reducer.update(grads, unstack(state.reducer_state), state.params)
        where = full_specs(state.params, specs)  # with islands, each island's own
        where = island_specs(where) if kit.islands else where
        check_agrees(grads, where, "the reduced gradient")
        model = ModelVars(mean_over(model_state, DATA), state.model.key, state.model.step + 1)
        return (grads, restack(reducer_state), model), lax.pmean({"loss": loss, **aux}, DATA)

    def reduced_specs(state: TensorParallelState) -> tuple[Any, Any, ModelVars]:
        where = state_specs(state)
        return where.params, where.reducer_state, where.model

    program = kit.step(worker_step, state_specs, out_specs=reduced_specs)

    def update(params: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(
        state: TensorParallelState, batch: Any
    ) -> tuple[TensorParallelState, dict[str, jax.Array]]:
        # The shard_map ends at the reduced gradient; the optimizer runs on the sharded
        # arrays outside it (as fsdp's), so a tree-wide transform sees the whole gradient.
        (grads, reducer_state, model), metrics = program(state, batch)
        params, opt_state = kit.per_island(update)(state.params, grads, state.opt_state)
        return TensorParallelState(params, opt_state, reducer_state, model), metrics

    return st.Strategy(
        kit.init(make_state, state_specs),
        step,
        kit.replicated(kit.over_islands(lambda state: kit.variables(state.params, state.model))),
    )


def _state_specs(specs: Any, state: TensorParallelState) -> TensorParallelState:
    """Each parameter's spec, and the same for the optimizer and reducer state it mirrors."""
    return TensorParallelState(
        full_specs(state.params, specs),
        like_params(state.opt_state, state.params, specs),
        like_params(state.reducer_state, state.params, specs, worker=(DATA,)),
        ModelVars(P(), P(), P()),
    )
