"""Tensor-parallel (intra-layer) layers and blocks for the ``model`` mesh axis, in Flax NNX."""

from ddl_jax._src.models.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
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
    "column_parallel_dense",
    "param_specs",
    "row_parallel_dense",
]
