"""Tensor-parallel (intra-layer) layers and blocks for the ``model`` mesh axis, in Flax NNX
(``ShardedDropout`` for an activation split over it);
``scan_layers`` for a model's stacked layers (gathered one at a time under ``ddl.fsdp``)."""

from ddl_jax._src.core.layer_scan import scan_layers
from ddl_jax._src.models.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
    ShardedDropout,
    column_parallel_dense,
    param_specs,
    row_parallel_dense,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "ShardedDropout",
    "column_parallel_dense",
    "param_specs",
    "row_parallel_dense",
    "scan_layers",
]
