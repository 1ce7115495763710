"""Tensor (intra-layer) parallelism on the ``model`` mesh axis: the training strategy.

The layers that run on the parameter shards (column- and row-parallel dense layers, the
MLP, attention and Transformer blocks built from them, ``param_specs``) live in
``ddl_jax._src.layers``; this strategy trains a model built from them, sharding each
parameter by its spec over ``model`` and running data parallelism over ``data``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddl_jax._src import strategy as st
from ddl_jax._src.data_parallel import check_builder_args
from ddl_jax._src.pipeline import mesh_with_axes
from ddl_jax._src.reducers import allreduce_mean, checks_vma

MODEL, DATA = "model", "data"


class TensorParallelState(NamedTuple):
    """State of :func:`tensor_parallel`.

    Attributes:
      params: model parameters, each sharded over ``model`` by its spec, replicated over
        ``data``.
      opt_state: optimizer state, sharded like the params it mirrors.
      reducer_state: each data worker's reducer state, a leading axis ``P("data", ...)``.
    """

    params: Any
    opt_state: Any
    reducer_state: Any


def _check_specs(params: Any, specs: Any, mesh: Mesh) -> None:
    if jax.tree.structure(params) != jax.tree.structure(specs, is_leaf=_is_spec):
        raise ValueError(
            "specs must have the structure of params (see param_specs(module)); got "
            f"{jax.tree.structure(specs, is_leaf=_is_spec)} for params "
            f"{jax.tree.structure(params)}."
        )
    flat_specs = jax.tree.leaves(specs, is_leaf=_is_spec)
    for (path, x), spec in zip(
        jax.tree_util.tree_leaves_with_path(params), flat_specs, strict=True
    ):
        for dim, names in zip(x.shape, spec, strict=False):
            names = (names,) if isinstance(names, str) else names or ()
            if DATA in names:
                raise ValueError(
                    f"specs{jax.tree_util.keystr(path)}={spec} shards over 'data'; params are "
                    "replicated over the data axis."
                )
            size = math.prod(mesh.shape[a] for a in names)
            if dim % size:
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} has shape {x.shape}; spec {spec} "
                    f"splits a dimension of {dim} into {size} parts, which does not divide."
                )


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def tensor_parallel(
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    specs: Any,
    reducer: optax.GradientTransformation | None = None,
) -> st.Strategy:
    """Tensor parallelism over ``model`` composed with data parallelism over ``data``.

    Each data worker takes ``B/N`` examples; within a data worker the ``model`` devices
    hold shards of the parameters (``specs``) and run ``loss_fn`` on their shards, the
    parallel layers communicating inside it. Gradients are reduced over ``data`` only:
    ``theta <- theta + optimizer(reducer(g_1 .. g_N))``, each device updating its shard.

    Args:
      loss_fn: ``(params, batch) -> loss``, run inside ``shard_map`` on the parameter
        shards (e.g. ``ddl.flax.loss_from_module`` of a model built from the parallel
        layers); the loss must agree over ``model`` (end the model in a row-parallel
        layer, or ``psum`` over ``"model"``).
      optimizer: an element-wise optax transform (each device updates its shard).
      mesh: a mesh with axes ``data`` and ``model``, e.g. ``ddl.make_mesh(data=2, model=4)``;
        a missing axis counts as size 1.
      specs: ``PartitionSpec`` per parameter over ``"model"`` (``param_specs(module)``).
      reducer: reduces gradients over ``data`` (default ``ddl.allreduce_mean("data")``).
        Reducers built from ``ppermute`` are not supported: they need ``check_vma=False``,
        under which JAX does not sum the gradients of ``model``-replicated parameters.

    Returns:
      A ``Strategy`` with a ``TensorParallelState``; metrics: ``loss``.
    """
    check_builder_args(loss_fn, optimizer, accumulate=1, reducer=reducer)
    mesh = mesh_with_axes(mesh, (DATA, MODEL))
    n = mesh.shape[DATA]
    reducer = allreduce_mean(DATA) if reducer is None else reducer
    if not checks_vma(reducer):
        raise ValueError(
            "tensor_parallel needs a psum-based reducer (e.g. ddl.allreduce_mean('data')); "
            f"got a ppermute-based {type(reducer).__name__}."
        )
    sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    def init(params) -> TensorParallelState:
        st.check_params(params)
        _check_specs(params, specs, mesh)
        params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=sharding)(params)

        def per_worker(x):
            spec = jax.typeof(x).sharding.spec
            x = jnp.broadcast_to(x, (n, *x.shape))
            return jax.sharding.reshard(x, NamedSharding(mesh, P(DATA, *spec)))

        with jax.set_mesh(mesh):  # so that fresh leaves (Adam's count) land on the mesh
            opt_state = jax.jit(optimizer.init)(params)
            reducer_state = jax.jit(lambda p: jax.tree.map(per_worker, reducer.init(p)))(params)
        return TensorParallelState(params, opt_state, reducer_state)

    def worker_step(state: TensorParallelState, batch):
        # A data-varying view, so the reducer sees each data worker's own gradient.
        local = lax.pcast(state.params, DATA, to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, batch)
        reducer_state = st.unstack(state.reducer_state)
        updates, reducer_state = reducer.update(grads, reducer_state, state.params)
        updates, opt_state = optimizer.update(updates, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TensorParallelState(params, opt_state, st.restack(reducer_state))
        return new, {"loss": lax.pmean(loss, DATA)}

    def step(state: TensorParallelState, batch):
        st.check_batch(batch, n, why=f"{n} data workers")
        state_specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state)
        program = jax.shard_map(
            worker_step, mesh=mesh, in_specs=(state_specs, P(DATA)), out_specs=(state_specs, P())
        )
        return program(state, st.shard_batch(batch, mesh, DATA))

    return st.Strategy(init=init, step=step, params=lambda state: state.params)
