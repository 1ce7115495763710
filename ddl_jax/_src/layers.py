"""Tensor-parallel (Megatron-style) layers and blocks for the ``model`` mesh axis, in Flax NNX.

A column-parallel dense layer splits its kernel's output columns over the ``model`` axis
(each device computes its slice of the output; no communication), a row-parallel one
splits its input rows (each device multiplies its slice of the input, one all-reduce sums
the partial products). A column layer followed by a row layer costs one all-reduce per
pair (Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053): the MLP and the attention of a
Transformer block below each hold one.

The modules hold full-size parameters, each tagged with the ``PartitionSpec`` that shards
it (``param_specs``); inside ``shard_map`` they run on their local shards.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

MODEL = "model"


def column_parallel_dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None):
    """``x @ kernel + bias`` with ``kernel`` split by columns: no communication.

    Args:
      x: ``[..., d_in]``, the same on every device of the ``model`` axis.
      kernel: this device's ``[d_in, d_out / N]`` slice, ``P(None, "model")``.
      bias: this device's ``[d_out / N]`` slice, ``P("model")``.

    Returns:
      ``[..., d_out / N]``, this device's slice of the output columns.
    """
    y = x @ kernel
    return y if bias is None else y + bias


def row_parallel_dense(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, axis: str = MODEL
):
    """``x @ kernel + bias`` with ``x`` and ``kernel`` split by rows: one all-reduce.

    Each device sends ``2 (N-1)/N`` times the output's bytes (one all-reduce over ``axis``).

    Args:
      x: this device's ``[..., d_in / N]`` slice of the input features.
      kernel: this device's ``[d_in / N, d_out]`` slice, ``P("model", None)``.
      bias: ``[d_out]``, replicated (``P()``), added once after the sum.
      axis: the mesh axis the rows are split over.

    Returns:
      ``[..., d_out]``, the same on every device of ``axis``.
    """
    y = lax.psum(x @ kernel, axis)
    return y if bias is None else y + bias


class ColumnParallelLinear(nnx.Module):
    """A dense layer whose output features are split over the ``model`` axis."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(
            init(rngs.params(), (in_features, out_features)), tp_spec=P(None, MODEL)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,)), tp_spec=P(MODEL))

    def __call__(self, x: jax.Array) -> jax.Array:
        return column_parallel_dense(x, self.kernel[...], self.bias[...])


class RowParallelLinear(nnx.Module):
    """A dense layer whose input features are split over the ``model`` axis."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(
            init(rngs.params(), (in_features, out_features)), tp_spec=P(MODEL, None)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,)), tp_spec=P())

    def __call__(self, x: jax.Array) -> jax.Array:
        return row_parallel_dense(x, self.kernel[...], self.bias[...])


class ParallelMLP(nnx.Module):
    """``row(gelu(column(x)))``: ``d -> hidden -> d`` with one all-reduce."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = ColumnParallelLinear(features, hidden, rngs=rngs)
        self.down = RowParallelLinear(hidden, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class ParallelSelfAttention(nnx.Module):
    """Multi-head self-attention with the heads split over the ``model`` axis.

    The query/key/value projections are column-parallel (device j holds heads
    ``j H/N .. (j+1) H/N - 1``), the output projection row-parallel: one all-reduce.
    """

    def __init__(self, features: int, heads: int, *, rngs: nnx.Rngs):
        if features % heads:
            raise ValueError(f"features={features} must be a multiple of heads={heads}.")
        self.head_dim = features // heads
        self.query = ColumnParallelLinear(features, features, rngs=rngs)
        self.key = ColumnParallelLinear(features, features, rngs=rngs)
        self.value = ColumnParallelLinear(features, features, rngs=rngs)
        self.out = RowParallelLinear(features, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        def heads(y):  # [b, s, local features] -> [b, s, local heads, head_dim]
            return y.reshape(*y.shape[:-1], -1, self.head_dim)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim**0.5)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(mixed.reshape(*x.shape[:-1], -1))


class ParallelTransformerBlock(nnx.Module):
    """A pre-LayerNorm Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Two all-reduces in the forward pass (attention output, MLP output), two more in the
    backward pass (the gradients of the column layers' replicated inputs).
    """

    def __init__(self, features: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.attention = ParallelSelfAttention(features, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.mlp = ParallelMLP(features, hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def param_specs(module: nnx.Module) -> Any:
    """The ``PartitionSpec`` of each of ``module``'s params, as a pure dict like its params.

    Parameters of the parallel layers carry their spec; every other parameter (LayerNorm
    scales, plain layers) is replicated, ``P()``.
    """
    state = nnx.state(module, nnx.Param)
    specs = jax.tree.map(
        lambda v: v.get_metadata().get("tp_spec", P()),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(specs)
