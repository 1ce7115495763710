"""Synchronous data parallelism: per-worker gradients, one all-reduce, one optimizer step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.kit import prepare, restack, unstack
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, mean_over, worker_key
from ddl_jax._src.core.reducer import check_drop_reducer, reduce_arrived, reducer_metrics
from ddl_jax._src.core.strategy import Strategy, vary_over
from ddl_jax._src.measure.consistency import arrivals, check_probability
from ddl_jax._src.reduce.allreduce import allreduce_mean


class DataParallelState(NamedTuple):
    """State of :func:`data_parallel`.

    Attributes:
      params: model parameters, replicated (``P()``).
      opt_state: optimizer state, replicated (``P()``).
      reducer_state: each worker's reducer state (error-feedback residuals and the like),
        with a leading worker axis sharded ``P(axis)``.
      model: model state (replicated: each worker's batch statistics of a step, averaged
        over the workers), the run's key and step count (see ``ddl.ModelVars``).
    """

    params: Any
    opt_state: Any
    reducer_state: Any
    model: ModelVars


def data_parallel(
    loss_fn: AnyLoss,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    reducer: optax.GradientTransformation | None = None,
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = "data",
    workers: int | None = None,
    drop: float = 0.0,
) -> Strategy:
    """Synchronous data-parallel SGD (the DDP / Horovod pattern) as a ``shard_map`` program.

    Each of the N workers on ``axis`` takes ``B/N`` examples of the global batch ``B``,
    computes its gradient ``g_i`` (averaged over ``accumulate`` micro-batches), the
    reducer agrees on ``g = (1/N) sum_i g_i`` (one all-reduce per step), and every worker
    applies the same optimizer update, so parameters stay replicated:
    ``theta <- theta + optimizer(reducer(g_1..g_N))``.

    Model state (a ``ddl.ModelLoss``'s batch statistics) is each worker's own during the
    step and averaged over the workers after it (for SyncBatchNorm, normalising by the
    global batch, build ``nnx.BatchNorm(axis_name=axis)``); worker w's dropout key at step
    t is ``fold_in(fold_in(seed_key, t), w)``.

    **Lost gradients** (``drop`` = p; torchft's fault-tolerant data parallelism). Each
    step each worker's gradient misses the all-reduce with probability p (a replica group
    failed or healing, as torchft's ``Manager`` has it): it sends zeros, and the sum is
    divided by the workers whose gradient arrived (``Manager.allreduce``: a replica not
    participating zeroes its tensor, the sum is divided by ``num_participants()``). Every
    worker applies that mean, so the replicas stay equal; a step none arrived at changes
    nothing (``Manager.should_commit`` is false below ``min_replica_size``, here 1).
    The batch statistics are the arrived workers' mean. The draws come from the run's key
    and step (``ddl.consistency.arrivals``): a resumed run draws the same.

    References (``drop``): github.com/pytorch/torchft, ``torchft/manager.py``
    (``Manager.allreduce``, ``should_commit``, ``num_participants``).

    Args:
      loss_fn: ``(params, batch) -> loss`` (a scalar mean over the batch), or
        ``(loss, aux_dict)`` with ``has_aux=True``; aux values must be scalars and are
        averaged over workers into the metrics.
      optimizer: an optax transform, applied after the reduction on every worker.
      mesh: a mesh with axis ``axis`` (see ``ddl.make_mesh``).
      reducer: optax transform that turns per-worker gradients into one agreed update,
        run inside ``shard_map``, or a function of the workers' axis returning one;
        default ``ddl.allreduce_mean(axis)``.
      accumulate: micro-batches per worker per step (gradient accumulation); the global
        batch must divide by ``N * accumulate``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.
      workers: N, a multiple of the devices on ``axis`` (default: one a device): each
        device runs N / devices workers through ``jax.vmap``, the run of N devices (their
        keys, batch rows and model states). A ``reducer`` then comes as a function of the
        axis, ``reducer=lambda axis: ddl.compression.top_k(0.01, axis=axis)``: the
        strategy calls it with the axis over every worker.
      drop: the probability in [0, 1) that a worker's gradient misses a step's
        all-reduce (above); with the default reducer, ``ddl.compression.cast`` or
        ``qsgd`` (stateless means: the zeros are rescaled away) or
        ``ddl.compression.sparse_loco`` (told who arrived). Not over islands (lose
        islands with ``ddl.local_sgd(drop=)``).

    Returns:
      A ``Strategy`` whose state is a ``DataParallelState`` and whose metrics hold
      ``loss`` (mean over the global batch), the aux values, and the reducer's metrics
      (``compression_ratio`` for a ``ddl.compression`` reducer; see ``reducer_metrics``),
      and with ``drop`` ``arrived``, the share of workers whose gradient arrived.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import optax
      >>> import ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=8))
      >>> state, metrics = jax.jit(strategy.step)(strategy.init({"w": jnp.zeros(())}), batch)
      >>> round(float(strategy.params(state)["w"]), 6), float(metrics["loss"])
      (0.2, 1.0)
    """
    kit = prepare(
        loss_fn,
        optimizer,
        mesh,
        axis,
        accumulate,
        has_aux,
        reducer=reducer,
        default_reducer=allreduce_mean,
        islands=True,
        workers=workers,
    )
    reducer, workers_axis = kit.reducer, kit.workers_axis
    drop = check_probability("drop", drop)
    check_drop_reducer("data_parallel", reducer, drop)
    if drop and kit.islands:
        raise ValueError(
            "data_parallel: drop loses workers inside an island, which islands do not model; "
            "give the outer method drop (ddl.local_sgd(inner=..., drop=p)) to lose islands."
        )
    specs = DataParallelState(P(), P(), P(axis), ModelVars(P(), P(), P()))

    def make_state(params: Any, model: ModelVars) -> DataParallelState:
        return DataParallelState(
            params, optimizer.init(params), kit.stack(reducer.init(params)), model
        )

    def worker_step(
        state: DataParallelState, batch: Any
    ) -> tuple[DataParallelState, dict[str, jax.Array]]:
        # Differentiate a worker-varying view of the replicated params: under check_vma the
        # gradient of an invariant input is already psum'd, and the reducer must see g_i.
        local_params = vary_over(state.params, workers_axis)
        key = worker_key(state.model, kit.worker_index())
        (loss, aux), grads, model_state = kit.value_and_grad(
            local_params, state.model.state, batch, key
        )
        reducer_state = unstack(state.reducer_state)
        arrived = None
        if drop:  # torchft's participants: the same draw on every worker
            arrived = arrivals(state.model.key, state.model.step, kit.n, drop)
            updates, reducer_state = reduce_arrived(
                reducer, grads, reducer_state, state.params, arrived, workers_axis
            )
        else:
            updates, reducer_state = reducer.update(grads, reducer_state, state.params)
        updates, opt_state = optimizer.update(updates, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # One all-reduce carries the loss, the aux values and the reducer's own metrics.
        metrics = {"loss": loss, **aux, **reducer_metrics(reducer_state)}
        metrics = jax.lax.pmean(metrics, workers_axis)
        model_state = mean_over(model_state, workers_axis, arrived)
        if arrived is not None:  # no gradient arrived: the step commits nothing
            metrics["arrived"] = jnp.mean(arrived.astype(jnp.float32))
            before = (state.params, state.opt_state, state.model.state)
            after = jax.tree.map(
                lambda new, old: jnp.where(jnp.any(arrived), new, old),
                (params, opt_state, model_state),
                before,
            )
            params, opt_state, model_state = after
        model = ModelVars(model_state, state.model.key, state.model.step + 1)
        return DataParallelState(params, opt_state, restack(reducer_state), model), metrics

    return Strategy(
        kit.init(make_state, specs),
        kit.step(worker_step, specs),
        kit.on_given_mesh(kit.over_islands(lambda state: kit.variables(state.params, state.model))),
    )
