"""FSDP's parameter gathers in fewer bytes: ZeRO++'s qwZ (int8 codes), and a cast
(bfloat16: PyTorch FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` gather).

Quantised: ZeRO++'s qwZ, an int8 all-gather of FSDP's parameter shards.

As DeepSpeed's ``zero_quantized_weights`` (``deepspeed/runtime/zero/partition_parameters.py``,
``CUDAQuantizer``; the kernel's ``Params<Type::Symmetric, 8>`` in
``csrc/includes/quantization_utils.h``): each worker quantises its own shard in groups,
symmetric 8-bit, ``q = clamp(round(x * s), -128, 127)`` with ``s = 2^8 / (2 max|x|)`` per
group (``s = 1`` for a group of zeros), all-gathers the codes and ``1 / s`` per group, and
every worker dequantises ``q / s``. The group count is DeepSpeed's for the shard's n
entries: ``ceil(n / 8000)``, raised until ``8 * groups`` divides n, then doubled while
``16 * groups`` divides n and groups hold over 8000 entries. DeepSpeed refuses a shard
whose size 8 does not divide; here such a shard is one group.

The float32 master weights stay sharded; only the gather is quantised. Its transpose (the
backward of a layer gathered inside the model, ``ddl.layers.scan_layers``) is the exact
reduce-scatter of the float32 cotangent.

References:
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
  Training", 2023, arXiv:2306.10209 (qwZ).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ddl_jax._src.reduce import wire

#: DeepSpeed's ``CUDAQuantizer.target_group_size``.
TARGET_GROUP_SIZE = 8000


def qwz_groups(n: int) -> int:
    """DeepSpeed's number of quantisation groups for a shard of ``n`` entries."""
    if n % 8:
        return 1
    groups = math.ceil(n / TARGET_GROUP_SIZE)
    while groups < n and n % (8 * groups):
        groups += 1
    while n % (16 * groups) == 0 and n / groups > TARGET_GROUP_SIZE:
        groups *= 2
    return groups


def quantise(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(int8 codes [groups, n / groups], float32 1 / scale [groups])`` of ``x``."""
    groups = qwz_groups(x.size)
    flat = x.reshape(groups, -1).astype(jnp.float32)
    peak = jnp.max(jnp.abs(flat), axis=1)
    scale = jnp.where(peak == 0, 1.0, 256.0 / (2 * peak))
    codes = jnp.clip(jnp.round(flat * scale[:, None]), -128, 127).astype(jnp.int8)
    return codes, 1.0 / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def quantised_all_gather(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """Inside ``shard_map``: the whole array from each worker's shard ``x`` along ``dim``
    (``lax.all_gather(x, axis, axis=dim, tiled=True)``), its values sent as int8 (above)."""
    codes, inverse = quantise(x)
    codes = lax.all_gather(codes, axis)  # [n, groups, size]
    inverse = lax.all_gather(inverse, axis)  # [n, groups]
    shards = (codes.astype(jnp.float32) * inverse[..., None]).astype(x.dtype)
    shards = shards.reshape(-1, *x.shape)  # [n, *shard]
    whole = jnp.moveaxis(shards, 0, dim)
    return whole.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])


def _forward(x: jax.Array, axis: str, dim: int) -> tuple[jax.Array, None]:
    return quantised_all_gather(x, axis, dim), None


def _backward(axis: str, dim: int, _: None, cotangent: jax.Array) -> tuple[jax.Array]:
    return (lax.psum_scatter(cotangent, axis, scatter_dimension=dim, tiled=True),)


quantised_all_gather.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def cast_all_gather(x: jax.Array, axis: str, dim: int, dtype: jnp.dtype) -> jax.Array:
    """Inside ``shard_map``: the whole array from each worker's shard ``x`` along ``dim``,
    in ``dtype`` (cast before it is sent): the all-gather of PyTorch FSDP2's
    ``MixedPrecisionPolicy(param_dtype=dtype)`` (pytorch/pytorch,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``), whose unsharded parameters are
    ``dtype``. Its transpose reduce-scatters the cotangent in ``x.dtype`` (float32 at
    least: a shard the loss cast to bfloat16 first, ``ddl.mixed_precision`` inside
    ``scan_layers``, has its gradient summed in float32), as that policy's ``reduce_dtype``
    left unset reduces in the parameters' original dtype. The values travel as unsigned
    integers of their width (``wire.to_bits``): XLA:CPU widens a 16-bit float all-gather
    to float32."""
    bits = lax.all_gather(wire.to_bits(x.astype(dtype)), axis, axis=dim, tiled=True)
    return wire.from_bits(bits, dtype)


def _cast_forward(x: jax.Array, axis: str, dim: int, dtype: jnp.dtype) -> tuple[jax.Array, Any]:
    return cast_all_gather(x, axis, dim, dtype), jnp.zeros((), x.dtype)


def _cast_backward(
    axis: str, dim: int, dtype: jnp.dtype, like: jax.Array, cotangent: jax.Array
) -> tuple[jax.Array]:
    wide = cotangent.astype(jnp.promote_types(like.dtype, jnp.float32))
    summed = lax.psum_scatter(wide, axis, scatter_dimension=dim, tiled=True)
    return (summed.astype(like.dtype),)


cast_all_gather.defvjp(_cast_forward, _cast_backward)
