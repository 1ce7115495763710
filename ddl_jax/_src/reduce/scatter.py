"""Compression on a reduce-scatter, for sharded data parallelism (``ddl.fsdp`` stages 2, 3).

A scatter reducer runs inside the strategy's ``shard_map``. Each worker hands it its
gradient of every sharded parameter cut into ``n`` chunks, one per owner
(``[n, *shard]``: chunk j is what worker j owns); it returns, for each parameter, the mean
over the workers of this worker's chunk (``[*shard]``), and may keep per-worker state
(error-feedback residuals). Everything travels in one ``all_to_all`` per payload; each
chunk is encoded for its owner, so the compressors here are those whose code of a chunk
means something on its own: a dtype cast, QSGD's buckets, top-k entries. Sign
compression and PowerSGD encode a whole tensor (one scale per tensor; low-rank factors
of the whole matrix) and have no scatter form.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ddl_jax._src.core.reducer import ScatterReducer
from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import (
    check_axis_name,
    check_qsgd_scale,
    check_wire_dtype,
    dequantise,
    pack_levels,
    quantise,
    unpack_levels,
)


class ScatterState(NamedTuple):
    """State of :func:`scatter_cast` and :func:`scatter_qsgd`: a step counter (QSGD's noise)
    and the metric ``compression_ratio`` (dense float32 bytes / bytes sent)."""

    step: jax.Array
    compression_ratio: jax.Array


class ScatterTopKState(NamedTuple):
    """State of :func:`scatter_top_k`: each worker's residuals (the entries it has not sent
    yet, ``[n, *shard]`` per parameter) and ``compression_ratio``."""

    residual: Any
    compression_ratio: jax.Array


def _ratio(chunks: Any, wire_bytes: float, n: int) -> jax.Array:
    """``compression_ratio``: a float32 reduce-scatter's bytes per device / ``wire_bytes``
    (1 where nothing is sent: no leaf splits over the workers)."""
    if n == 1 or wire_bytes == 0:
        return jnp.ones((), jnp.float32)
    dense = (n - 1) / n * 4 * sum(x.size for x in jax.tree.leaves(chunks))
    return jnp.asarray(dense / wire_bytes, jnp.float32)


def _fresh_state(params: Any) -> ScatterState:
    del params
    return ScatterState(jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32))


def scatter_cast(dtype: Any = jnp.bfloat16, *, axis: str = "data") -> ScatterReducer:
    """Reduce-scatter with the chunks sent as ``dtype`` and summed in float32.

    ``shard = (1/N) sum_i float32(dtype(chunk_i))``: one ``all_to_all`` of the chunks' bits
    (a ``psum_scatter`` in bfloat16 would be computed, and sent, in float32 on some
    backends, CPU among them). ``bfloat16`` halves the bytes of a float32 reduce-scatter.

    Args:
      dtype: floating dtype on the wire, 2 or 4 bytes (float8 is refused: unscaled,
        gradients flush to zero).
      axis: the mesh axis the workers live on.
    """
    check_axis_name("scatter_cast", axis)
    dtype = check_wire_dtype("scatter_cast", dtype, "ddl.compression.scatter_qsgd(127)")

    def update(chunks, state, params=None):
        del params
        n = check_axis_in_scope(axis)

        def one(c):
            sent = wire.to_bits(c.astype(dtype))
            received = wire.from_bits(wire.scatter_to_owners(sent, axis), dtype)
            return received.astype(jnp.float32).sum(axis=0).astype(c.dtype) / n

        total = sum(x.size for x in jax.tree.leaves(chunks))
        new = ScatterState(state.step + 1, _ratio(chunks, (n - 1) / n * total * dtype.itemsize, n))
        return jax.tree.map(one, chunks), wire.typed_like(new, state)

    return ScatterReducer(_fresh_state, update)


def scatter_qsgd(
    levels: int,
    *,
    bucket_size: int = 512,
    scale: str = "l2",
    seed: int = 0,
    axis: str = "data",
) -> ScatterReducer:
    """QSGD on a reduce-scatter: each chunk quantised for its owner, who averages.

    Each owner's chunk is cut into buckets of ``bucket_size`` entries sent as their norm
    and its levels, ``Q(v)_j = ||v|| sign(v_j) floor(s |v_j| / ||v|| + u_j) / s``
    (unbiased: ``E[Q(v)] = v``); the owner averages the dequantised chunks in float32:
    ``shard = (1/N) sum_i Q(chunk_i)``. The noise is keyed by ``seed``, the step and the
    worker. The levels travel in 2, 4 or 8 bits (as ``ddl.compression.qsgd``): 16x, 8x or
    4x fewer bytes than a float32 reduce-scatter, less the norms.

    References:
      Alistarh et al., "QSGD", NeurIPS 2017, arXiv:1610.02132.

    Args:
      levels: s, levels per sign, 1 <= s <= 127 (2, 4 or 8 bits on the wire).
      bucket_size: entries sharing one norm (a smaller chunk is one bucket; a larger one's
        last bucket is padded).
      scale: ``"l2"`` (the paper's 2-norm) or ``"max"`` (QSGDinf, the largest magnitude:
        less variance; see ``ddl.compression.qsgd``).
      seed: base of the keyed randomness.
      axis: the mesh axis the workers live on.
    """
    check_axis_name("scatter_qsgd", axis)
    levels = check_int(
        "scatter_qsgd: levels (at most 8 bits on the wire)", levels, minimum=1, maximum=127
    )
    bucket_size = check_int("scatter_qsgd: bucket_size", bucket_size, minimum=1)
    scale = check_qsgd_scale("scatter_qsgd", scale)
    seed = check_int("scatter_qsgd: seed", seed)

    def update(chunks, state, params=None):
        del params
        n = check_axis_in_scope(axis)
        key = jax.random.fold_in(jax.random.key(seed), state.step)
        key = jax.random.fold_in(key, lax.axis_index(axis))
        leaves, tree = jax.tree.flatten(chunks)
        out, sent = [], 0.0
        for i, c in enumerate(leaves):
            flat = c.reshape(n, -1).astype(jnp.float32)
            size = flat.shape[1]
            bucket = min(bucket_size, size)  # a small chunk is one bucket, not padded
            padded = math.ceil(size / bucket) * bucket
            buckets = jnp.pad(flat, ((0, 0), (0, padded - size))).reshape(n, -1, bucket)
            q, norms = quantise(buckets, levels, jax.random.fold_in(key, i), scale)
            codes = pack_levels(q.reshape(n, -1), levels)
            q = unpack_levels(wire.scatter_to_owners(codes, axis), levels, padded)
            mine = dequantise(q.reshape(buckets.shape), wire.scatter_to_owners(norms, axis), levels)
            mean = mine.mean(axis=0).reshape(-1)[:size]
            out.append(mean.reshape(c.shape[1:]).astype(c.dtype))
            sent += (n - 1) / n * (codes.size + 4 * norms.size)
        new = ScatterState(state.step + 1, _ratio(chunks, sent, n))
        return jax.tree.unflatten(tree, out), wire.typed_like(new, state)

    return ScatterReducer(_fresh_state, update)


def scatter_top_k(ratio: float, *, axis: str = "data") -> ScatterReducer:
    """Top-k with error feedback on a reduce-scatter: each chunk's largest entries go to
    its owner, the rest wait in the sender's residual.

    Worker i adds its residual to its chunks, ``a = chunk_i + e_i``, sends each owner the
    ``k = ceil(ratio * m)`` entries of largest magnitude of that owner's m-entry chunk
    (values and int32 indices, one ``all_to_all``) and keeps the others,
    ``e_i <- a - top_k(a)``; the owner sums what it receives into its shard and divides by
    N. Nothing is lost, only delayed; ``ratio=1`` is the exact mean.

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud computing",
      Interspeech 2015; Lin et al., "Deep gradient compression", ICLR 2018,
      arXiv:1712.01887.

    Args:
      ratio: fraction of each chunk's entries sent, in (0, 1].
      axis: the mesh axis the workers live on.
    """
    check_axis_name("scatter_top_k", axis)
    name = "scatter_top_k: ratio"
    ratio = check_real(name, check_real(name, ratio, minimum=0, exclusive=True), maximum=1)

    def init(chunks):
        zeros = jax.tree.map(lambda c: jnp.zeros(c.shape, jnp.float32), chunks)
        return ScatterTopKState(zeros, jnp.ones((), jnp.float32))

    def update(chunks, state, params=None):
        del params
        n = check_axis_in_scope(axis)
        out, residual, sent = [], [], 0.0
        leaves, tree = jax.tree.flatten(chunks)
        for c, e in zip(leaves, jax.tree.leaves(state.residual), strict=True):
            acc = c.reshape(n, -1).astype(jnp.float32) + e.reshape(n, -1)
            size = acc.shape[1]
            k = max(1, math.ceil(ratio * size))
            _, index = lax.top_k(jnp.abs(acc), k)
            values = jnp.take_along_axis(acc, index, axis=1)
            kept = jnp.put_along_axis(acc, index, 0.0, axis=1, inplace=False)
            residual.append(kept.reshape(e.shape))
            got_values = wire.scatter_to_owners(values, axis)
            got_index = wire.scatter_to_owners(index.astype(jnp.int32), axis)
            shard = (
                jnp.zeros(size, jnp.float32).at[got_index.reshape(-1)].add(got_values.reshape(-1))
            )
            out.append((shard / n).reshape(c.shape[1:]).astype(c.dtype))
            sent += (n - 1) * k * 8  # k values and k int32 indices to each other owner
        new = ScatterTopKState(jax.tree.unflatten(tree, residual), _ratio(chunks, sent, n))
        return jax.tree.unflatten(tree, out), wire.typed_like(new, state)

    return ScatterReducer(init, update)
