"""Pipeline model parallelism: GPipe, 1F1B and decoupled delayed gradients (DDG).

K stages live on the ``stage`` mesh axis, one per device; activations travel to the next
stage and error gradients to the previous one by ``ppermute``, inside a ``lax.scan`` over
the ticks of a schedule computed in numpy (``pipeline_schedules``). Stages may differ in
parameters and in activation shapes: each stage's parameters are one flat vector (padded
to the largest stage, so they stack over the ``stage`` axis) and activations travel as flat
buffers padded to the largest boundary, unpacked by the receiving stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src import strategy as st
from ddl_jax._src.compression_lowrank import PowerSGDState
from ddl_jax._src.data_parallel import check_builder_args
from ddl_jax._src.flax_bridge import split
from ddl_jax._src.pipeline_programs import (
    DATA,
    STAGE,
    DDGState,
    PipelineState,
    ddg_step,
    synchronous_step,
    tick_tables,
)
from ddl_jax._src.pipeline_schedules import (
    SCHEDULES,
    gradient_wait,
    make_schedule,
    peak_stash,
)
from ddl_jax._src.reducers import allreduce_mean, checks_vma

StageFn = Callable[[Any, Any], Any]


class _Flat(NamedTuple):
    """A stage's parameter pytree <-> a flat vector of ``size`` entries."""

    treedef: Any
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    size: int

    @classmethod
    def of(cls, template: Any) -> _Flat:
        leaves, treedef = jax.tree.flatten(template)
        shapes = [tuple(np.shape(x)) for x in leaves]
        return cls(treedef, shapes, [x.dtype for x in leaves], sum(map(math.prod, shapes)))

    def ravel(self, tree: Any, length: int, dtype: Any) -> jax.Array:
        flat = [jnp.ravel(x).astype(dtype) for x in jax.tree.leaves(tree)]
        return jnp.pad(jnp.concatenate(flat), (0, length - self.size))

    def unravel(self, vector: jax.Array) -> Any:
        offsets = np.cumsum([0, *map(math.prod, self.shapes)])
        leaves = [
            vector[a:b].reshape(s).astype(d)
            for a, b, s, d in zip(offsets[:-1], offsets[1:], self.shapes, self.dtypes, strict=True)
        ]
        return self.treedef.unflatten(leaves)

    def add_into(self, vector: jax.Array, tree: Any, scale: float) -> jax.Array:
        """``vector + scale * ravel(tree)``, leaf by leaf in place (no padded temporary)."""
        offset = 0
        for x, shape in zip(jax.tree.leaves(tree), self.shapes, strict=True):
            size = math.prod(shape)
            part = vector[offset : offset + size] + scale * jnp.ravel(x).astype(vector.dtype)
            vector = lax.dynamic_update_slice(vector, part, (offset,))
            offset += size
        return vector


def mesh_with_axes(mesh: Mesh, axes: tuple[str, ...]) -> Mesh:
    """``mesh``, every axis Explicit, with a size-1 axis for each of ``axes`` it lacks."""
    st.check_mesh_axis(mesh, mesh.axis_names[0], arg="mesh")
    devices, names, types = mesh.devices, tuple(mesh.axis_names), tuple(mesh.axis_types)
    for axis in axes:
        if axis not in names:
            devices, names, types = devices[..., None], (*names, axis), (*types, AxisType.Explicit)
    return st.explicit_mesh(Mesh(devices, names, axis_types=types))


def pipeline_stages(modules: Sequence[nnx.Module]) -> tuple[list[StageFn], list[Any]]:
    """Flax NNX modules -> ``(stages, params)`` for :func:`pipeline` and its ``init``."""
    pairs = [split(m) for m in modules]
    return [(apply, params) for apply, params in pairs], [params for _, params in pairs]


def _check_stages(
    stages: Any, k: int, mesh_axes: Sequence[str]
) -> tuple[list[StageFn], list[_Flat]]:
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
    applies, flats = [], []
    for i, stage in enumerate(stages):
        if not (isinstance(stage, tuple) and len(stage) == 2 and callable(stage[0])):
            raise TypeError(
                f"stages[{i}] must be a pair (apply(params, x) -> y, params), e.g. from "
                f"ddl.pipeline_stages(modules); got {type(stage).__name__}."
            )
        applies.append(stage[0])
        flats.append(_Flat.of(stage[1]))
    return applies, flats


class _Stages(NamedTuple):
    """Stage k's forward and backward on flat buffers, for a fixed micro-batch shape."""

    forward: list[Callable]  # (p, x_buf, micro) -> y_buf
    # (p, x_buf, ct_buf, micro, acc, scale) -> (acc + scale * param grad, input grad, loss)
    backward: list[Callable]
    width: int  # A, entries of the largest activation buffer
    dtype: Any


def _build_stages(applies, flats, loss_fn, param_len, param_dtype, micro) -> _Stages:
    """Traces the stage chain on abstract shapes and wraps each stage on flat buffers."""
    k_ = len(applies)
    inputs, x = [micro], micro
    for i, (apply, flat) in enumerate(zip(applies, flats, strict=True)):
        p = jax.ShapeDtypeStruct((param_len,), param_dtype)
        try:
            x = jax.eval_shape(lambda p, x, a=apply, f=flat: a(f.unravel(p), x), p, x)
        except (TypeError, ValueError) as e:
            got = jax.tree.map(lambda s: s.shape, x)
            raise ValueError(
                f"stage {i} does not accept the output of stage {i - 1} (shape {got}): "
                f"{type(e).__name__}: {e}"
                if i
                else f"stage 0 does not accept a micro-batch of shape {got}: {e}"
            ) from e
        if i < k_ - 1:
            if not (isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)):
                raise ValueError(
                    f"stage {i} must return one floating-point array to pass to stage {i + 1}, "
                    f"got {jax.tree.map(lambda s: (s.shape, s.dtype), x)}."
                )
            inputs.append(x)
    st.check_loss_output(jax.eval_shape(loss_fn, x, micro), has_aux=False)
    boundaries = inputs[1:]
    width = max([math.prod(s.shape) for s in boundaries], default=0)
    dtype = jnp.result_type(*[s.dtype for s in boundaries]) if boundaries else param_dtype

    def pack(y):
        return jnp.pad(jnp.ravel(y).astype(dtype), (0, width - y.size))

    def unpack(buf, like):
        return buf[: math.prod(like.shape)].reshape(like.shape).astype(like.dtype)

    def stage_fn(i):
        apply, flat, last = applies[i], flats[i], i == k_ - 1

        def run(params, x_buf, micro):
            x = micro if i == 0 else unpack(x_buf, inputs[i])
            y = apply(params, x)
            return loss_fn(y, micro) if last else y

        def forward(p, x_buf, micro):
            # The last stage sends nothing on: its loss is computed by its backward.
            return jnp.zeros((width,), dtype) if last else pack(run(flat.unravel(p), x_buf, micro))

        def backward(p, x_buf, ct_buf, micro, acc, scale):
            # Differentiate the unravelled tree and add leaf by leaf: a gradient of the flat
            # vector would build a zero-padded copy of every stage's size on every tick.
            y, vjp = jax.vjp(lambda q, x_buf: run(q, x_buf, micro), flat.unravel(p), x_buf)
            ct = jnp.ones_like(y) if last else unpack(ct_buf, y)
            grad_p, grad_x = vjp(ct)
            loss = y if last else jnp.zeros((), jnp.float32)
            return flat.add_into(acc, grad_p, scale), grad_x, loss

        return forward, backward

    fns = [stage_fn(i) for i in range(k_)]
    return _Stages([f for f, _ in fns], [b for _, b in fns], width, dtype)


def _check_reducer(reducer: optax.GradientTransformation, flat: jax.ShapeDtypeStruct) -> None:
    """Rejects reducers that need each stage's parameter tree, which the pipeline flattens."""
    state = jax.eval_shape(reducer.init, flat)
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, PowerSGDState))
    if any(isinstance(node, PowerSGDState) for node in nodes):
        raise ValueError(
            "reducer=ddl.compression.power_sgd(...) cannot be used with ddl.pipeline: the "
            "reducer sees each stage's parameters as one flat vector, so PowerSGD would find "
            "no matrices and silently run a dense all-reduce. Use another reducer here, or "
            "power_sgd with ddl.data_parallel."
        )


def _micro_shapes(batch: Any, count: int) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // count, *x.shape[1:]), x.dtype), batch
    )


def pipeline(
    stages: Sequence[tuple[StageFn, Any]],
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    example_batch: Any = None,
    reducer: optax.GradientTransformation | None = None,
) -> st.Strategy:
    """Pipeline model parallelism over the ``stage`` mesh axis (and data parallelism over ``data``).

    The model is ``loss_fn(f_{K-1}(... f_1(f_0(batch; w_0); w_1) ...; w_{K-1}), batch)``,
    stage ``f_k`` on the devices at position k of the ``stage`` axis. Each data worker's
    share of the global batch is cut into M micro-batches that flow through the stages.

    * ``"gpipe"`` and ``"1f1b"``: one step runs the schedule's ``2(M+K-1)`` ticks and then
      ``w_k <- w_k + optimizer(reducer(g_k))`` with ``g_k`` the exact gradient of the mean
      loss over the global batch, as in single-device training. GPipe (Huang et al. 2019,
      arXiv:1811.06965) runs all forwards then all backwards, idle fraction
      ``(K-1)/(M+K-1)``, and each stage keeps M micro-batches' inputs; 1F1B
      (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503) has the same bubble but
      keeps at most K.
    * ``"ddg"``, decoupled parallel backpropagation with delayed gradients (Huo et al. 2018,
      arXiv:1804.10574): every tick, every stage runs one forward and one backward and
      updates its weights, with no bubble. At global tick t stage k forwards micro-batch
      ``t-k`` and backpropagates micro-batch ``j = t-2(K-1)+k`` with the error gradient
      ``delta_j`` that stage k+1 sent on tick t-1 (the last stage uses its own loss at once):
      ``w_k <- w_k + optimizer(reducer(d f_k(h_j; w_k)/d w_k . delta_j))``, recomputing the
      stage from its stashed input ``h_j`` with its current weights. Huo et al. keep the
      forward pass locked, so their stage k sees a gradient delayed by K-1-k iterations;
      here the forward is pipelined too, so the delay is ``2(K-1-k)`` ticks. Each step runs
      M ticks, so M updates of micro-batch size; the pipeline stays full across steps.

    Stage inputs are rematerialised: a stage keeps the input of each micro-batch in flight
    and re-runs its forward for the backward (as GPipe does).

    What ``optimizer`` and ``reducer`` see: not the stages' parameter trees, but for each
    stage one flat vector, its leaves concatenated in tree order, cast to one dtype and
    zero-padded to the largest stage's size; each stage has its own optimizer and reducer
    state. Transforms that treat every entry on its own are exact (they update each
    parameter as on the tree): ``optax.sgd``, ``momentum``, ``adam``, ``adamw`` without a
    ``mask``, learning-rate schedules, ``ddl.allreduce_mean``, ``ddl.compression.cast``.
    Anything that looks at the tree changes meaning, mostly without an error: norms and
    scales are taken per stage over its padded vector (``optax.clip_by_global_norm`` clips
    each stage on its own, ``ddl.compression.sign`` has one scale per stage, ``top_k``'s and
    ``threshold``'s entry budgets and ``qsgd``'s buckets are per stage), and masks and
    ``optax.multi_transform`` labels get one array per stage instead of the tree.
    ``ddl.compression.power_sgd`` would find no matrices, so it is refused (``ValueError``).

    Args:
      stages: K pairs ``(apply, params)``: ``apply(params_k, x) -> y``; stage 0 receives the
        micro-batch pytree, stage k>0 the previous stage's output, which must be one
        floating-point array (any shape, stages may differ). ``params`` is a template (arrays
        or ``jax.ShapeDtypeStruct``) fixing each stage's parameter shapes; NNX modules
        convert with ``pipeline_stages``.
      loss_fn: ``(last stage's output, micro_batch) -> scalar`` mean over the micro-batch.
      optimizer: optax transform applied per stage to its flat parameter vector (exact for
        element-wise optimizers such as SGD or Adam; see above).
      mesh: a mesh with a ``stage`` axis of size K (and optionally ``data``), e.g.
        ``ddl.make_mesh(data=2, stage=4)``; a mesh without ``stage`` means K=1.
      microbatches: M, micro-batches per data worker per step; the global batch must
        divide by ``data`` x M.
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"ddg"``.
      example_batch: a global batch (arrays or ``jax.ShapeDtypeStruct``); required by
        ``"ddg"`` with K > 1, whose state stashes activations of the batch's shape. Every
        later batch must have these shapes.
      reducer: reduces each stage's flat gradient vector over ``data`` (default
        ``ddl.allreduce_mean("data")``); its state starts as ``reducer.init`` of the stage's
        flat parameter vector on every data worker. Not ``ddl.compression.power_sgd``.

    Returns:
      A ``Strategy``: ``init(params)`` takes the K stages' parameter pytrees (a sequence),
      ``params(state)`` returns them as a list. Metrics: ``loss``, the mean loss of the
      micro-batches whose loss was computed in this step.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, batch) -> loss, got {loss_fn!r}.")
    check_builder_args(loss_fn, optimizer, accumulate=1, reducer=reducer)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known; valid: {list(SCHEDULES)}.")
    st.check_positive_int("microbatches", microbatches)
    given_axes = tuple(getattr(mesh, "axis_names", ()))
    mesh = mesh_with_axes(mesh, (DATA, STAGE))
    n, k_ = mesh.shape[DATA], mesh.shape[STAGE]
    applies, flats = _check_stages(stages, k_, given_axes)
    param_len = max(f.size for f in flats)
    param_dtype = jnp.result_type(*[d for f in flats for d in f.dtypes])
    reducer = allreduce_mean(DATA) if reducer is None else reducer
    _check_reducer(reducer, jax.ShapeDtypeStruct((param_len,), param_dtype))
    stage_spec, cell_spec = P(STAGE), P(DATA, STAGE)
    divisor, why = n * microbatches, f"{n} data workers x microbatches={microbatches}"
    if schedule == "ddg" and k_ > 1 and example_batch is None:
        raise ValueError(
            "schedule='ddg' with K > 1 stages needs example_batch= (a global batch or its "
            "jax.ShapeDtypeStructs): its state stashes activations of that shape."
        )
    if example_batch is not None:
        st.check_batch(example_batch, divisor, why=why)
        example_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), example_batch
        )
        _build_stages(
            applies, flats, loss_fn, param_len, param_dtype, _micro_shapes(example_batch, divisor)
        )

    @jax.jit
    def stage_params(state) -> list[Any]:
        stacked = jax.sharding.reshard(state.params, NamedSharding(mesh, P()))
        return [f.unravel(stacked[i]) for i, f in enumerate(flats)]

    def place_common(params):
        if not isinstance(params, Sequence) or len(params) != k_:
            raise ValueError(
                f"params must be a sequence of {k_} stage parameter pytrees (one per stage), "
                f"got {type(params).__name__}"
                + (f" of length {len(params)}." if isinstance(params, Sequence) else ".")
            )
        for i, (p, f) in enumerate(zip(params, flats, strict=True)):
            st.check_params(p)
            got = _Flat.of(p)
            if got.treedef != f.treedef or got.shapes != f.shapes:
                raise ValueError(
                    f"params[{i}] has shapes {got.shapes} but stage {i} was built with {f.shapes}."
                )
        stacked = jnp.stack(
            [f.ravel(p, param_len, param_dtype) for p, f in zip(params, flats, strict=True)]
        )
        stacked = st._place(stacked, NamedSharding(mesh, stage_spec))
        opt_state = jax.jit(
            jax.vmap(optimizer.init), out_shardings=NamedSharding(mesh, stage_spec)
        )(stacked)
        # Each stage's reducer starts from reducer.init of its own (flat) parameters, and
        # each of its data workers from a copy of that state.
        reducer_state = jax.jit(
            lambda s: jax.tree.map(
                lambda x: jnp.broadcast_to(x, (n, *x.shape)), jax.vmap(reducer.init)(s)
            ),
            out_shardings=NamedSharding(mesh, cell_spec),
        )(stacked)
        return stacked, opt_state, reducer_state

    def check(batch) -> Any:
        size = st.check_batch(batch, divisor, why=why)
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((size // divisor, *np.shape(x)[1:]), x.dtype), batch
        )
        if example_batch is not None:
            given = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
            if given != example_batch:
                raise ValueError(
                    f"batch shapes {given} differ from example_batch {example_batch}, which "
                    "fixed the shapes of the pipeline's stashed activations."
                )
        return micro

    def update(params, opt_state, reducer_state, grads):
        grads, reducer_state = reducer.update(grads, reducer_state, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, reducer_state

    def local(tree):
        return jax.tree.map(lambda x: x[0], tree)

    def unlocal(tree, depth):
        return jax.tree.map(lambda x: x.reshape((1,) * depth + x.shape), tree)

    vma = checks_vma(reducer)

    if schedule in ("gpipe", "1f1b"):
        plan = make_schedule(k_, microbatches, schedule)
        slots, inbox_slots = peak_stash(plan), max(gradient_wait(plan), 1)
        tables = tick_tables(plan)
        specs = PipelineState(stage_spec, stage_spec, cell_spec)

        def init(params) -> PipelineState:
            return PipelineState(*place_common(params))

        def step(state: PipelineState, batch):
            micro = check(batch)
            fns = _build_stages(applies, flats, loss_fn, param_len, param_dtype, micro)
            program = jax.shard_map(
                lambda s, b: synchronous_step(
                    s, b, fns, tables, slots, inbox_slots, k_, microbatches, update, local, unlocal
                ),
                mesh=mesh, in_specs=(specs, P(DATA)), out_specs=(specs, P()), check_vma=vma,
            )  # fmt: skip
            return program(state, st.shard_batch(batch, mesh, DATA))

        return st.Strategy(init=init, step=step, params=stage_params)

    depth = math.ceil(2 * (k_ - 1) / microbatches)
    slots = 2 * k_ - 1

    def init(params) -> DDGState:
        stacked, opt_state, reducer_state = place_common(params)
        inputs = inbox = history = ()
        if k_ > 1:
            micro = _micro_shapes(example_batch, divisor)
            fns = _build_stages(applies, flats, loss_fn, param_len, param_dtype, micro)
            cells = NamedSharding(mesh, cell_spec)
            inputs = jax.jit(
                lambda: jnp.zeros((n, k_, slots, fns.width), fns.dtype), out_shardings=cells
            )()
            inbox = jax.jit(lambda: jnp.zeros((n, k_, fns.width), fns.dtype), out_shardings=cells)()
            history = jax.jit(
                lambda: jax.tree.map(
                    lambda s: jnp.zeros((n, depth * microbatches, *s.shape), s.dtype), micro
                ),
                out_shardings=NamedSharding(mesh, P(DATA)),
            )()
        tick = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=NamedSharding(mesh, P()))()
        return DDGState(stacked, opt_state, reducer_state, inputs, inbox, history, tick)

    specs = DDGState(stage_spec, stage_spec, cell_spec, cell_spec, cell_spec, P(DATA), P())

    def step(state: DDGState, batch):
        micro = check(batch)
        fns = _build_stages(applies, flats, loss_fn, param_len, param_dtype, micro)
        program = jax.shard_map(
            lambda s, b: ddg_step(
                s, b, fns, k_, microbatches, depth, slots, update, local, unlocal
            ),
            mesh=mesh, in_specs=(specs, P(DATA)), out_specs=(specs, P()), check_vma=vma,
        )  # fmt: skip
        return program(state, st.shard_batch(batch, mesh, DATA))

    return st.Strategy(init=init, step=step, params=stage_params)
