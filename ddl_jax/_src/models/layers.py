"""Tensor-parallel (Megatron-style) layers and blocks for the ``model`` mesh axis, in Flax NNX.

A column-parallel dense layer splits its kernel's output columns over the ``model`` axis
(each device computes its slice of the output; no communication), a row-parallel one
splits its input rows (each device multiplies its slice of the input, one all-reduce sums
the partial products). A column layer followed by a row layer costs one all-reduce per
pair (Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053): the MLP and the attention of a
Transformer block below each hold one.

The modules hold full-size parameters, each tagged with Flax's partitioning metadata
(``nnx.with_partitioning``, read back by ``nnx.get_partition_spec`` and ``param_specs``).
Inside ``shard_map`` over ``model`` they run on their local shards; where ``model`` is not
bound (one device, or a mesh without it) they run on full parameters and need no
communication, computing the same function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ddl_jax._src.core.strategy import MODEL


def _bound_axis_size(axis: str) -> int | None:
    """The size of mesh axis ``axis`` where it is bound (``shard_map`` over it), else None.

    Outside ``shard_map``, or inside one that leaves ``axis`` automatic, JAX raises
    ``NameError("unbound axis name")``: then each device holds the full parameters.
    """
    try:
        return lax.axis_size(axis)
    except NameError:
        return None


# eager_sharding=False keeps the spec metadata only: creating a layer never places its
# parameters on a mesh (Flax would, were one set with jax.set_mesh, and would fail with
# none set); the strategy shards them.
def _partitioned(init: Any, spec: tuple[str | None, ...]) -> Any:
    return nnx.with_partitioning(init, spec, eager_sharding=False)


def _zeros(features: int, spec: tuple[str | None, ...]) -> nnx.Param:
    # Zeros need no key: the same metadata as _partitioned, without drawing one.
    return nnx.Param(jnp.zeros((features,)), out_sharding=spec, eager_sharding=False)


def column_parallel_dense(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """``x @ kernel + bias`` with ``kernel`` split by columns: no communication.

    Args:
      x: ``[..., d_in]``, the same on every device of the ``model`` axis.
      kernel: this device's ``[d_in, d_out / N]`` slice, ``P(None, "model")`` (the full
        kernel where ``model`` is not bound).
      bias: this device's ``[d_out / N]`` slice, ``P("model")``.

    Returns:
      ``[..., d_out / N]``, this device's slice of the output columns.
    """
    y = x @ kernel
    return y if bias is None else y + bias


def row_parallel_dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis: str = MODEL,
    rows: int | None = None,
) -> jax.Array:
    """``x @ kernel + bias`` with ``x`` and ``kernel`` split by rows: one all-reduce.

    Each device sends ``2 (N-1)/N`` times the output's bytes (one all-reduce over ``axis``).
    Where ``axis`` is not bound (outside ``shard_map``, e.g. on one device with the full
    kernel), or the kernel holds all ``rows`` (specs that replicate it over ``axis``, and
    the input whole too), there are no partial products to sum and no all-reduce.

    Args:
      x: this device's ``[..., d_in / N]`` slice of the input features.
      kernel: this device's ``[d_in / N, d_out]`` slice, ``P("model", None)``.
      bias: ``[d_out]``, replicated (``P()``), added once after the sum.
      axis: the mesh axis the rows are split over.
      rows: the full kernel's rows ``d_in``, where known: a kernel holding them all is
        whole, not a slice (``None``: a slice wherever ``axis`` is bound).

    Returns:
      ``[..., d_out]``, the same on every device of ``axis``.
    """
    y = x @ kernel
    size = _bound_axis_size(axis)
    # on an axis of one device the sum is the value, and types it the same on the axis
    if size is not None and (size == 1 or kernel.shape[0] != rows):
        y = lax.psum(y, axis)
    return y if bias is None else y + bias


class ColumnParallelLinear(nnx.Module):
    """A dense layer whose output features are split over the ``model`` axis.

    The kernel is tagged ``(None, "model")``, the bias ``("model",)``.

    Example:
      Outside ``shard_map`` the layer holds and uses its full parameters:

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from ddl_jax.layers import ColumnParallelLinear
      >>> layer = ColumnParallelLinear(4, 8, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 4))).shape, layer.kernel.out_sharding
      ((2, 8), (None, 'model'))
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs) -> None:
        """Creates the full ``[in_features, out_features]`` kernel and the bias.

        Args:
          in_features: input features (each device sees all of them).
          out_features: output features, split over ``model``.
          rngs: the ``params`` stream initializes the kernel (LeCun normal).
        """
        kernel = _partitioned(nnx.initializers.lecun_normal(), (None, MODEL))
        self.kernel = nnx.Param(kernel(rngs.params(), (in_features, out_features)))
        self.bias = _zeros(out_features, (MODEL,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., in_features]`` -> this device's ``[..., out_features / N]``."""
        return column_parallel_dense(x, self.kernel[...], self.bias[...])


class RowParallelLinear(nnx.Module):
    """A dense layer whose input features are split over the ``model`` axis.

    The kernel is tagged ``("model", None)``; the bias is replicated (untagged, ``P()``).
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs) -> None:
        """Creates the full ``[in_features, out_features]`` kernel and the bias.

        Args:
          in_features: input features, split over ``model``.
          out_features: output features (every device gets all of them).
          rngs: the ``params`` stream initializes the kernel (LeCun normal).
        """
        kernel = _partitioned(nnx.initializers.lecun_normal(), (MODEL, None))
        self.kernel = nnx.Param(kernel(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,)))
        self.in_features = in_features

    def __call__(self, x: jax.Array) -> jax.Array:
        """This device's ``[..., in_features / N]`` -> ``[..., out_features]`` (all of
        ``x``'s features where the kernel is whole: specs that replicate it)."""
        return row_parallel_dense(x, self.kernel[...], self.bias[...], rows=self.in_features)


class ShardedDropout(nnx.Dropout):
    """Dropout on an activation split over ``axis`` (``"model"``): each device draws its
    shard's mask from the key folded with its index on ``axis``, so the shards' masks are
    independent.

    ``nnx.Dropout`` under ``ddl.tensor_parallel`` (or ``ddl.fsdp(specs=...)``) draws with
    the data worker's key, the same on every ``model`` device: right for an activation
    every device holds whole, but on one split over ``model`` (a column-parallel layer's
    output, attention probabilities split by head) each shard drops the same local
    positions. Megatron-LM draws in such regions from a tensor-parallel seed offset by the
    tensor-parallel rank (``megatron/core/tensor_parallel/random.py``:
    ``model_parallel_cuda_manual_seed``, the ``get_cuda_rng_tracker().fork()`` its
    parallel attention's dropout runs under); this is that, by ``jax.random.fold_in``.
    Where ``axis`` is not bound (one device, or outside ``shard_map``) it is
    ``nnx.Dropout``, draw for draw.

    Example (in a block: ``self.drop = ddl.layers.ShardedDropout(0.1, rngs=rngs)`` after a
    ``ColumnParallelLinear``, before the ``RowParallelLinear``).
    """

    def __init__(self, rate: float, *, axis: str = MODEL, **kwargs: Any) -> None:
        """Args: as ``nnx.Dropout``'s, and ``axis``, the mesh axis the activation is split
        over."""
        super().__init__(rate, **kwargs)
        self.axis = axis

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:  # fmt: skip
        off = deterministic if deterministic is not None else self.deterministic
        if off or self.rate == 0.0 or _bound_axis_size(self.axis) is None:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        key = rngs if rngs is not None else self.rngs
        if isinstance(key, nnx.Rngs):
            key = key[self.rng_collection]()
        elif isinstance(key, nnx.RngStream):
            key = key()
        if not isinstance(key, jax.Array):  # none: nnx.Dropout says what is missing
            return super().__call__(inputs, deterministic=deterministic, rngs=key)
        key = jax.random.fold_in(key, lax.axis_index(self.axis))
        return super().__call__(inputs, deterministic=deterministic, rngs=key)


class ParallelMLP(nnx.Module):
    """``row(gelu(column(x)))``: ``d -> hidden -> d`` with one all-reduce."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        """Creates the column-parallel up- and row-parallel down-projection.

        Args:
          features: input and output features ``d``.
          hidden: hidden features, split over ``model`` (a multiple of its size).
          rngs: initializes both projections.
        """
        self.up = ColumnParallelLinear(features, hidden, rngs=rngs)
        self.down = RowParallelLinear(hidden, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., features]`` -> ``[..., features]``, the same on every ``model`` device."""
        return self.down(jax.nn.gelu(self.up(x)))


class ParallelSelfAttention(nnx.Module):
    """Multi-head self-attention with the heads split over the ``model`` axis.

    The query/key/value projections are column-parallel (device j holds heads
    ``j H/N .. (j+1) H/N - 1``), the output projection row-parallel: one all-reduce.
    """

    def __init__(self, features: int, heads: int, *, rngs: nnx.Rngs) -> None:
        """Creates the query, key, value and output projections.

        Args:
          features: model features, a multiple of ``heads``.
          heads: attention heads; the ``model`` axis size must divide it.
          rngs: initializes the projections.

        Raises:
          ValueError: ``heads`` does not divide ``features``.
        """
        if features % heads:
            raise ValueError(f"features={features} must be a multiple of heads={heads}.")
        self.features, self.heads = features, heads
        self.head_dim = features // heads
        self.query = ColumnParallelLinear(features, features, rngs=rngs)
        self.key = ColumnParallelLinear(features, features, rngs=rngs)
        self.value = ColumnParallelLinear(features, features, rngs=rngs)
        self.out = RowParallelLinear(features, features, rngs=rngs)

    def _check_heads(self) -> None:
        n = _bound_axis_size(MODEL) or 1
        if self.heads % n == 0:
            return
        heads = [h for h in range(n, self.features + 1, n) if self.features % h == 0]
        sizes = [m for m in range(1, self.heads + 1) if self.heads % m == 0]
        valid = f"heads in {heads} (for features={self.features}) or " if heads else ""
        raise ValueError(
            f"ParallelSelfAttention(features={self.features}, heads={self.heads}) runs on a "
            f"'model' axis of size {n}, which does not divide heads={self.heads}: each device "
            f"must hold whole heads. Use {valid}a 'model' axis size in {sizes}."
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, features]`` -> ``[batch, seq, features]``, the same on every device.

        Raises:
          ValueError: the ``model`` axis size does not divide ``heads``.
        """
        self._check_heads()

        def split_heads(y: jax.Array) -> jax.Array:  # [b, s, local features] -> [b, s, h, d]
            return y.reshape(*y.shape[:-1], -1, self.head_dim)

        q, k, v = (split_heads(f(x)) for f in (self.query, self.key, self.value))
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim**0.5)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(mixed.reshape(*x.shape[:-1], -1))


class ParallelTransformerBlock(nnx.Module):
    """A pre-LayerNorm Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Two all-reduces in the forward pass (attention output, MLP output), two more in the
    backward pass (the gradients of the column layers' replicated inputs).
    """

    def __init__(self, features: int, heads: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        """Creates the two LayerNorms (replicated), the attention and the MLP.

        Args:
          features: model features, a multiple of ``heads``.
          heads: attention heads; the ``model`` axis size must divide it.
          hidden: the MLP's hidden features; the ``model`` axis size must divide it.
          rngs: initializes every sublayer.
        """
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.attention = ParallelSelfAttention(features, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.mlp = ParallelMLP(features, hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, features]`` -> ``[batch, seq, features]``."""
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def param_specs(module: nnx.Module) -> dict[str, Any]:
    """The ``PartitionSpec`` of each of ``module``'s params, as a pure dict like its params.

    Read from Flax's partitioning metadata (``nnx.get_partition_spec``): the parallel
    layers tag their parameters with ``nnx.with_partitioning``; every other parameter
    (LayerNorm scales, plain layers) is replicated, ``P()``.

    Args:
      module: an NNX module, e.g. built from the layers of this module.

    Returns:
      A nested dict with the structure of ``nnx.to_pure_dict(nnx.state(module, nnx.Param))``
      and a ``jax.sharding.PartitionSpec`` at each leaf.

    Example:
      >>> from flax import nnx
      >>> from ddl_jax.layers import ParallelMLP, param_specs
      >>> specs = param_specs(ParallelMLP(4, 8, rngs=nnx.Rngs(0)))
      >>> specs["up"]["kernel"], specs["up"]["bias"]
      (P(None, 'model'), P('model',))
      >>> specs["down"]["kernel"], specs["down"]["bias"]
      (P('model', None), P())
    """
    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    return nnx.to_pure_dict(specs)
