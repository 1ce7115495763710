"""Parameter specs: one ``PartitionSpec`` per parameter, checked against a mesh."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.kit import is_spec
from ddl_jax._src.core.strategy import DATA, MODEL


def full_specs(params: Any, specs: Any) -> Any:
    """One spec per parameter: ``specs`` broadcast from a prefix of params' structure."""
    try:
        return jax.tree.broadcast(specs, params, is_leaf=is_spec)
    except ValueError:
        raise ValueError(
            "specs must have the structure of params, or a prefix of it (see "
            f"param_specs(module)); got {jax.tree.structure(specs, is_leaf=is_spec)} for "
            f"params {jax.tree.structure(params)}."
        ) from None


def like_params(state: Any, params: Any, specs: Any, *, worker: tuple[str, ...] = ()) -> Any:
    """Specs for a transform's state (an optimizer's, a reducer's) over ``params``: a leaf
    that mirrors a parameter, its key path ending with the parameter's and its shape the
    parameter's (after ``worker``'s leading axes), gets ``P(*worker, *spec)``; any other
    leaf (counts, factored moments) ``P(*worker)``.

    Read from the key paths of the state itself, not by calling ``init`` on a placeholder
    as ``optax.tree_map_params`` does: that cannot run ``optax.multi_transform`` or
    ``optax.masked`` whose labels or mask are a function reading the params, nor keep a
    masked leaf's ``optax.MaskedNode``.
    """
    flat_specs = jax.tree.leaves(full_specs(params, specs), is_leaf=is_spec)
    mirrored = {
        tuple(path): (jnp.shape(x), spec)
        for (path, x), spec in zip(
            jax.tree_util.tree_leaves_with_path(params), flat_specs, strict=True
        )
    }

    def spec_of(path: tuple[Any, ...], leaf: Any) -> P:
        shape = jnp.shape(leaf)[len(worker) :]
        for start in range(len(path) + 1):  # the longest matching path first
            if (found := mirrored.get(tuple(path[start:]))) is not None:
                return P(*worker, *found[1]) if found[0] == shape else P(*worker)
        return P(*worker)

    return jax.tree_util.tree_map_with_path(spec_of, state)


def check_specs(params: Any, specs: Any, mesh: Mesh) -> None:
    """Raises ``ValueError`` unless each parameter's spec names axes of ``mesh`` other than
    ``data``, has at most one entry per dimension and splits dimensions evenly."""
    specs = full_specs(params, specs)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    for (path, x), spec in zip(
        jax.tree_util.tree_leaves_with_path(params), flat_specs, strict=True
    ):
        where = jax.tree_util.keystr(path)
        if len(spec) > x.ndim:
            raise ValueError(
                f"specs{where}={spec} has more entries than params{where} has dimensions "
                f"(shape {x.shape}, rank {x.ndim}); a spec has at most one entry per dimension "
                "(P() for a scalar)."
            )
        for dim, names in zip(x.shape, spec, strict=False):
            names = (names,) if isinstance(names, str) else names or ()
            if unknown := [a for a in names if a not in mesh.axis_names]:
                raise ValueError(
                    f"specs{where}={spec} names axis {unknown[0]!r}, which the mesh does not "
                    f"have; valid axis names: {list(mesh.axis_names)}."
                )
            if DATA in names:
                raise ValueError(
                    f"specs{where}={spec} shards over 'data'; params are "
                    "replicated over the data axis."
                )
            size = math.prod(mesh.shape[a] for a in names)
            if dim % size:
                raise ValueError(
                    f"params{where} has shape {x.shape}; spec {spec} "
                    f"splits a dimension of {dim} into {size} parts, which does not divide."
                )


def check_same_over_model(metrics: dict[str, jax.Array]) -> None:
    """The loss must be one number per data worker, the same on its ``model`` devices."""
    for name, value in metrics.items():
        if MODEL in jax.typeof(value).manual_axis_type.varying:
            raise ValueError(
                f"the {name} differs across the 'model' axis: the model's output is still "
                "split over 'model' (e.g. it ends in a ColumnParallelLinear, whose output "
                "features are sharded). End the model with a RowParallelLinear (or a "
                "ParallelMLP / ParallelTransformerBlock, which end in one) or a replicated "
                "layer, so that every model device sees the whole output."
            )
