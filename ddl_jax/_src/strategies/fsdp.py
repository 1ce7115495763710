"""Sharded data parallelism (ZeRO stages 1 to 3, FSDP) over ``data``, with tensor
parallelism over ``model`` when the model is built from ``ddl.layers``.

Each parameter is split over the ``data`` workers along one of its dimensions (its *shard
dimension*: the largest one that the worker count divides, among those ``specs`` does not
already split over ``model``); a parameter with no such dimension (a bias of odd size)
stays whole on every worker. The gradient side runs in the strategy's ``shard_map``; the
optimizer then updates each worker's shard, as ``jax.jit`` lays out the sharded arrays.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core import strategy as st
from ddl_jax._src.core.kit import abstract, call_loss, is_spec, prepare, restack, unstack, vary
from ddl_jax._src.core.layer_scan import gathering, scanned_leaves
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, as_model_loss, mean_over, worker_key
from ddl_jax._src.core.reducer import ScatterReducer, reducer_metrics
from ddl_jax._src.core.specs import check_same_over_model, check_specs, full_specs, like_params
from ddl_jax._src.core.strategy import DATA, MODEL
from ddl_jax._src.reduce.allreduce import allreduce_mean
from ddl_jax._src.reduce.gather import cast_all_gather, quantised_all_gather

STAGES = (1, 2, 3)
#: Every parameter whole over ``model`` (no tensor parallelism).
REPLICATED = P()


class FSDPState(NamedTuple):
    """State of :func:`fsdp`.

    Attributes:
      params: model parameters, split over ``model`` by ``specs``; at stage 3 also split over
        ``data`` on each one's shard dimension, at stages 1 and 2 whole on every data worker.
      opt_state: optimizer state, split over ``data`` (and ``model``) like stage 3's params.
      reducer_state: each data worker's scatter-reducer state (error-feedback residuals),
        a leading axis ``P("data", ...)``; ``()`` without a reducer.
      model: model state (batch statistics), replicated and averaged over ``data`` after
        each step; the run's key and step count (see ``ddl.ModelVars``).
    """

    params: Any
    opt_state: Any
    reducer_state: Any
    model: ModelVars


class Layout(NamedTuple):
    """Where each parameter lives: ``whole`` its ``model``-only spec, ``dims`` its shard
    dimension (``None``: not split over ``data``), ``sharded`` its spec with ``data`` there."""

    whole: Any
    dims: Any
    sharded: Any


def layout(params: Any, specs: Any, mesh: Mesh) -> Layout:
    """Each parameter's shard dimension over ``data`` and its specs, from shapes alone."""
    whole = full_specs(params, specs)
    n = mesh.shape[DATA]

    def dim_of(x: Any, spec: P) -> int | None:
        entries = tuple(spec) + (None,) * (x.ndim - len(spec))
        free = [d for d in range(x.ndim) if entries[d] is None and x.shape[d] % n == 0]
        free = free if x.size else []  # an empty leaf stays whole: nothing to split
        return max(free, key=lambda d: x.shape[d], default=None) if n > 1 else None

    def with_data(x: Any, spec: P, dim: int | None) -> P:
        if dim is None:
            return spec
        entries = list(spec) + [None] * (x.ndim - len(spec))
        entries[dim] = DATA
        return P(*entries)

    dims = jax.tree.map(dim_of, params, whole, is_leaf=is_spec)
    sharded = jax.tree.map(with_data, params, whole, dims, is_leaf=is_spec)
    return Layout(whole, dims, sharded)


def fsdp(
    loss_fn: AnyLoss,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    stage: int = 3,
    specs: Any = REPLICATED,
    reducer: ScatterReducer | None = None,
    reshard_after_forward: bool = True,
    quantized_weights: bool = False,
    gather_dtype: Any = None,
    accumulate: int = 1,
    has_aux: bool = False,
) -> st.Strategy:
    """Sharded data parallelism: ZeRO stages 1 to 3 (FSDP is stage 3), over ``data``.

    Training is synchronous data parallelism, ``theta <- theta + optimizer(mean_i g_i)``,
    exactly as ``ddl.data_parallel`` with its default reducer; what differs is what each of
    the N workers keeps and sends (D parameters, per device):

    * stage 1: the optimizer state is split over the workers (1/N each). Gradients are
      all-reduced, each worker updates its shard of the parameters, and the new parameters
      are all-gathered.
    * stage 2: also the gradient, reduce-scattered: each worker receives the mean of its
      shard; the traffic of one all-reduce (``(N-1)/N D`` in each of the two collectives).
    * stage 3: also the parameters: each worker stores its shard only and all-gathers every
      parameter (one all-gather each) for the forward and backward; memory for parameters
      and optimizer state is 1/N of ``data_parallel``'s.

    **Layer by layer** (stage 3, ``reshard_after_forward=True``, PyTorch FSDP2's name). A
    model that runs its stacked layers with ``ddl.layers.scan_layers`` gets each layer's
    parameters gathered inside the scan, just before its use, and gathered again in the
    backward (the scan's body is rematerialised), so about one layer's parameters are
    whole at a time and temporaries no longer grow with depth; autodiff turns each
    layer's gather into the reduce-scatter of its gradient. The other parameters (and
    every parameter of a model without ``scan_layers``) are gathered once per step, as
    with ``False``, which keeps every gathered layer alive through the backward: faster
    (no second gather, no recomputation) where memory allows. A stacked leaf must not be
    split on its layer axis (its largest dimension that N divides is then another).

    Its own builder, as its state is sharded and it takes ``specs``: on a ``data`` x
    ``model`` mesh a ``ddl.layers`` model runs Megatron over ``model``, each parameter's
    block further split over ``data`` (MaxText's layout). The optimizer runs on the sharded
    arrays under ``jax.jit``, so a tree-wide transform (``clip_by_global_norm``) gets the
    scalar all-reduce it needs and every optax transform acts as on one device.

    References:
      Rajbhandari et al., "ZeRO", SC 2020, arXiv:1910.02054; Zhao et al., "PyTorch FSDP",
      VLDB 2023, arXiv:2304.11277.

    Args:
      loss_fn: ``(params, batch) -> loss`` or a ``ddl.ModelLoss`` (batch norm, dropout:
        model state averaged over ``data`` after each step, keys as in ``data_parallel``).
      optimizer: an optax transform; its state is sharded like stage 3's parameters.
      mesh: a mesh with a ``data`` axis and, for tensor parallelism, a ``model`` axis.
      stage: 1, 2 or 3 (above).
      specs: each parameter's ``PartitionSpec`` over ``model`` (``ddl.layers.param_specs``),
        or a prefix; ``P()`` (the default) keeps every parameter whole over ``model``.
      reshard_after_forward: at stage 3, gather the layers ``ddl.layers.scan_layers`` runs
        one at a time, forward and backward (above); ``False``: gather every parameter once
        per step.
      quantized_weights: at stage 3, all-gather the parameters as int8 codes in groups with
        a float32 scale each (ZeRO++'s qwZ, DeepSpeed's ``zero_quantized_weights``;
        ``ddl_jax._src.reduce.gather``): about 1/4 of the gather's bytes; the master weights
        stay float32 and sharded, and the gradient is reduce-scattered in float32.
      gather_dtype: at stage 3, all-gather the parameters cast to this floating dtype
        (``jnp.bfloat16``: half the gather's bytes and of the gathered parameters' memory),
        as PyTorch FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: the loss receives
        them in it, the master weights stay float32 and sharded, and the gradient is
        reduce-scattered in float32. With a loss that computes in that dtype
        (``ddl.mixed_precision(loss_fn, dtype)``, which also casts the inputs) training is
        exactly the same as without it; ``None`` gathers in the parameters' dtype.
      reducer: at stages 2 and 3, how the gradient chunks travel to their owners: a scatter
        reducer, ``ddl.compression.scatter_cast(jnp.bfloat16)`` (half the bytes, summed in
        float32), ``scatter_qsgd(levels)`` or ``scatter_top_k(ratio)`` (error feedback on
        each worker's chunks); ``None``: an exact ``psum_scatter``. Parameters no dimension
        of which N divides are averaged whole (``pmean``). Not with ``model`` > 1.
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.

    Returns:
      A ``Strategy`` whose state is an ``FSDPState``; ``params(state)`` gathers the
      parameters. Metrics: ``loss`` and the aux values, averaged over the global batch, and
      the reducer's ``compression_ratio`` (a float32 reduce-scatter's bytes / bytes sent).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones((16, 8)), "y": jnp.ones((16, 1))}
      >>> strategy = ddl.fsdp(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8), stage=3)
      >>> state = strategy.init({"w": jnp.zeros((8, 1))})
      >>> state.params["w"].sharding.spec  # each worker holds one row
      P('data', None)
      >>> state, metrics = jax.jit(strategy.step)(state, batch)
      >>> float(metrics["loss"]), round(float(strategy.params(state)["w"][0, 0]), 6)
      (1.0, 0.2)
    """
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        DATA,
        accumulate,
        has_aux,
        add_axes=(DATA, MODEL),
        default_reducer=allreduce_mean,
        islands=True,
    )
    if isinstance(stage, bool) or stage not in STAGES:  # True == 1
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}.")
    reshard_after_forward = st.check_bool("reshard_after_forward", reshard_after_forward)
    quantized_weights = st.check_bool("quantized_weights", quantized_weights)
    if quantized_weights and stage != 3:
        raise ValueError(
            f"fsdp: quantized_weights quantises the all-gather of the parameters, which only "
            f"stage 3 has; got stage={stage}."
        )
    gather_one = _quantised_gather if quantized_weights else _gather
    if gather_dtype is not None:
        gather_one = _cast_gather(_check_gather_dtype(gather_dtype, stage, quantized_weights))
    _check_reducer(reducer, stage, kit.mesh)
    n, mesh = kit.n, kit.mesh
    layout_of = functools.partial(layout, specs=specs, mesh=mesh)

    state_specs = functools.partial(_state_specs, layout_of, stage)

    def make_state(params: Any, model: ModelVars) -> FSDPState:
        check_specs(params, specs, mesh)
        reducer_state = ()
        if reducer is not None:
            dims = layout_of(abstract(params)).dims
            reducer_state = kit.stack(reducer.init(jax.tree.map(_chunks_of(n), params, dims)))
        return FSDPState(params, optimizer.init(params), reducer_state, model)

    def worker_step(state: FSDPState, batch: Any, dims: Any) -> tuple[Any, dict]:
        params = state.params
        key = worker_key(state.model, kit.worker_index())
        scanned, gather = (), None
        if stage == 3:
            if reshard_after_forward:
                scanned, gather = _per_layer(kit, state, batch, key, dims, gather_one)
            params = _gather_except(params, dims, scanned, gather_one)
        # A data-varying view, so that each worker differentiates its own loss.
        local = vary(params, (DATA,))
        with contextlib.nullcontext() if gather is None else gathering(gather):
            (loss, aux), grads, model_state = kit.value_and_grad(
                local, state.model.state, batch, key
            )
        # a gather_dtype's gradient, of its gathered parameters, in the parameters' dtype
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        check_same_over_model({"loss": loss, **aux})
        if scanned and reducer is not None:
            raise ValueError(
                "fsdp: a scatter reducer encodes each whole gradient before it is scattered; "
                "layers gathered one at a time (ddl.layers.scan_layers) are scattered by "
                "autodiff, layer by layer. Use reshard_after_forward=False with a reducer."
            )
        grads, reducer_state, wire = _reduce(
            grads, dims, state.reducer_state, stage, reducer, scanned
        )
        model = ModelVars(mean_over(model_state, DATA), state.model.key, state.model.step + 1)
        return (grads, reducer_state, model), lax.pmean({"loss": loss, **aux, **wire}, DATA)

    def step(state: FSDPState, batch: Any) -> tuple[FSDPState, dict]:
        where = layout_of(kit.one_island(abstract(state.params)))
        out_specs = (where.sharded, P(DATA), ModelVars(P(), P(), P()))
        program = kit.step(
            functools.partial(worker_step, dims=where.dims), state_specs, out_specs=out_specs
        )
        (grads, reducer_state, model), metrics = program(state, batch)

        def update(params: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
            shards = params if stage == 3 else _place(params, where.sharded, mesh)
            updates, opt_state = optimizer.update(grads, opt_state, shards)
            shards = optax.apply_updates(shards, updates)
            return (shards if stage == 3 else _place(shards, where.whole, mesh)), opt_state

        params, opt_state = kit.per_island(update)(state.params, grads, state.opt_state)
        return FSDPState(params, opt_state, reducer_state, model), metrics

    return st.Strategy(
        kit.init(make_state, state_specs),
        step,
        kit.replicated(kit.over_islands(lambda state: kit.variables(state.params, state.model))),
    )


def _state_specs(layout_of: Any, stage: int, state: FSDPState) -> FSDPState:
    """Where each part of the state lives (see ``FSDPState``)."""
    where = layout_of(state.params)
    params = where.sharded if stage == 3 else where.whole
    opt_specs = like_params(state.opt_state, state.params, where.sharded)
    return FSDPState(params, opt_specs, P(DATA), ModelVars(P(), P(), P()))


def _gather(x: jax.Array, dim: int | None) -> jax.Array:
    """Inside ``shard_map``: the whole parameter from this worker's shard."""
    return x if dim is None else lax.all_gather(x, DATA, axis=dim, tiled=True)


def _quantised_gather(x: jax.Array, dim: int | None) -> jax.Array:
    """``_gather`` with int8 values on the wire (ZeRO++'s qwZ)."""
    return x if dim is None else quantised_all_gather(x, DATA, dim)


def _cast_gather(dtype: jnp.dtype) -> Any:
    """``_gather`` in ``dtype`` (floating leaves; one kept whole is cast alone)."""

    def gather(x: jax.Array, dim: int | None) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return _gather(x, dim)
        return x.astype(dtype) if dim is None else cast_all_gather(x, DATA, dim, dtype)

    return gather


def _check_gather_dtype(gather_dtype: Any, stage: int, quantized_weights: bool) -> jnp.dtype:
    valid = "a floating dtype of 2 or 4 bytes such as jnp.bfloat16"
    try:
        dtype = jnp.dtype(gather_dtype)
    except TypeError:
        raise TypeError(f"fsdp: gather_dtype must be {valid}, got {gather_dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize not in (2, 4):
        raise ValueError(f"fsdp: gather_dtype must be {valid}, got {dtype}.")
    if stage != 3 or quantized_weights:
        raise ValueError(
            "fsdp: gather_dtype casts the all-gather of the parameters, which only stage 3 "
            f"has, and not quantized_weights (int8 codes); got stage={stage}, "
            f"quantized_weights={quantized_weights}."
        )
    return dtype


def _mean_shard(g: jax.Array, dim: int | None, stage: int) -> jax.Array:
    """This worker's part of the mean gradient: its shard (whole if ``dim`` is None)."""
    n = lax.axis_size(DATA)
    if dim is not None and stage > 1:
        return lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True) / n
    mean = lax.pmean(g, DATA)
    if dim is None:
        return mean
    size = g.shape[dim] // n  # stage 1: this worker's shard of the all-reduced gradient
    return lax.dynamic_slice_in_dim(mean, lax.axis_index(DATA) * size, size, dim)


def _per_layer(
    kit: Any, state: FSDPState, batch: Any, key: Any, dims: Any, gather_one: Any
) -> tuple[tuple[int, ...], Any]:
    """The leaves the loss runs through ``scan_layers`` (indices in leaf order), and the
    function that gathers one layer of them (``None`` when there are none)."""
    n = lax.axis_size(DATA)
    leaves, treedef = jax.tree.flatten(state.params)
    dim_leaves = treedef.flatten_up_to(dims)
    whole = [
        jax.ShapeDtypeStruct(_whole_shape(x.shape, d, n), x.dtype)
        for x, d in zip(leaves, dim_leaves, strict=True)
    ]
    fn = as_model_loss(kit.loss_fn).fn
    micro = jax.tree.map(lambda x: x[: x.shape[0] // kit.accumulate], batch)
    scanned = tuple(
        scanned_leaves(
            lambda p: call_loss(fn, p, state.model.state, micro, key),
            jax.tree.unflatten(treedef, whole),
        )
    )
    if not scanned:
        return (), None
    axes: dict[tuple[int, ...], int | None] = {}  # a layer's shard shape -> its gather axis
    for i in scanned:
        d, shape = dim_leaves[i], leaves[i].shape[1:]
        if d == 0:
            raise ValueError(
                f"fsdp: the stacked leaf of shape {whole[i].shape} passed to scan_layers is "
                "split over 'data' on its layer axis: fsdp splits each leaf on its largest "
                "dimension the worker count divides, here the layer count. Give the layers "
                "a dimension larger than their count that the workers divide, or "
                "reshard_after_forward=False (each parameter gathered once a step)."
            )
        axis = None if d is None else d - 1
        if axes.setdefault(shape, axis) != axis:
            raise ValueError(
                f"fsdp: two stacked leaves passed to scan_layers have layer shards of shape "
                f"{shape} split on different dimensions; reshard_after_forward=False."
            )

    def gather(layer: Any) -> Any:
        def one(x: jax.Array) -> jax.Array:
            return gather_one(x, axes.get(tuple(x.shape)))

        return jax.tree.map(one, layer)

    return scanned, gather


def _whole_shape(shape: tuple[int, ...], dim: int | None, n: int) -> tuple[int, ...]:
    return shape if dim is None else (*shape[:dim], shape[dim] * n, *shape[dim + 1 :])


def _gather_except(params: Any, dims: Any, scanned: tuple[int, ...], gather_one: Any) -> Any:
    """Every parameter gathered whole by ``gather_one``, but the leaves ``scanned`` (left
    as shards)."""
    leaves, treedef = jax.tree.flatten(params)
    dim_leaves = treedef.flatten_up_to(dims)
    out = [
        x if i in scanned else gather_one(x, d)
        for i, (x, d) in enumerate(zip(leaves, dim_leaves, strict=True))
    ]
    return jax.tree.unflatten(treedef, out)


def _reduce(
    grads: Any,
    dims: Any,
    reducer_state: Any,
    stage: int,
    reducer: ScatterReducer | None,
    scanned: tuple[int, ...] = (),
) -> tuple[Any, Any, dict]:
    """Inside ``shard_map``: gradient shards, the reducer's new state and its metrics. The
    split leaves ``scanned`` arrive as shards summed over the workers already (autodiff's
    reduce-scatter of each layer's gather); a whole one (``dim`` None, its gather a no-op)
    arrives as this worker's own gradient, averaged like the other whole leaves."""
    if reducer is None:
        n = lax.axis_size(DATA)
        leaves, treedef = jax.tree.flatten(grads)
        dim_leaves = treedef.flatten_up_to(dims)
        out = [
            g / n if i in scanned and d is not None else _mean_shard(g, d, stage)
            for i, (g, d) in enumerate(zip(leaves, dim_leaves, strict=True))
        ]
        return jax.tree.unflatten(treedef, out), reducer_state, {}
    chunks = jax.tree.map(_chunks_of(lax.axis_size(DATA)), grads, dims)
    shards, new = reducer.update(chunks, unstack(reducer_state))
    whole = jax.tree.map(
        lambda g, d, s: lax.pmean(g, DATA) if d is None else s, grads, dims, shards
    )
    return whole, restack(new), reducer_metrics(new)


def _chunks_of(n: int) -> Any:
    """``(g, dim) ->`` g cut along ``dim`` into its n owners' chunks ``[n, *shard]``, or
    ``None`` for a parameter that is not split (``dim`` None): a scatter reducer's input."""

    def chunks(g: Any, dim: int | None) -> Any:
        return None if dim is None else jnp.stack(jnp.split(g, n, axis=dim))

    return chunks


def _check_reducer(reducer: Any, stage: int, mesh: Mesh) -> None:
    if reducer is None:
        return
    if not isinstance(reducer, ScatterReducer):
        raise TypeError(
            "fsdp: reducer must be a scatter reducer (ddl.compression.scatter_cast, "
            "scatter_qsgd or scatter_top_k), got "
            f"{type(reducer).__name__}. fsdp reduce-scatters gradients, each chunk to its "
            "owner; the all-reduce reducers of the other strategies (ddl.allreduce_mean, "
            "ddl.compression.cast, qsgd, top_k, ...) average whole gradients, and sign and "
            "power_sgd encode whole tensors (one scale, low-rank factors), which a chunk is "
            "not."
        )
    if stage == 1:
        raise ValueError(
            "fsdp: stage 1 all-reduces the gradients; a scatter reducer needs the "
            "reduce-scatter of stage 2 or 3."
        )
    if mesh.shape[MODEL] > 1:
        raise ValueError(
            "fsdp: a scatter reducer works on a data-only mesh (model axis of size 1); with "
            f"tensor parallelism (model={mesh.shape[MODEL]}) use the exact reduce-scatter "
            "(reducer=None)."
        )


def _place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``tree`` resharded to ``specs``: a slice (to shards) or an all-gather (to whole)."""
    return jax.tree.map(lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)), tree, specs)
