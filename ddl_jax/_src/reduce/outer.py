"""Chunked top-k reducers with a decaying memory: SparseLoCo and DeMo.

Both cut the flattened update into chunks of consecutive entries, keep the k largest
entries of each chunk in a per-worker memory (SparseLoCo: the pseudo-gradient itself,
quantised; DeMo: the momentum's DCT coefficients), subtract what they send from that memory
(error feedback), and all-gather every worker's message as one ``uint8`` buffer (each
device sends ``(N-1) x`` its message, as ``ddl.comm_stats`` charges an all-gather). An index
travels as its position inside its chunk, in the narrowest unsigned integer that holds it
(``uint8`` for chunks of at most 256 entries, ``uint16`` up to 65536). The gathered
messages are typed invariant over the axis, so both are plain optax transforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.scipy.fft import dct, idct

from ddl_jax._src.core.flat import FlatView, pad_to
from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import check_axis_name
from ddl_jax._src.reduce.sparse import check_fraction, check_size, entries_kept


def _layout(size: int, chunk: int) -> tuple[int, int]:
    """``(count, width)``: a vector shorter than ``chunk`` is one chunk of its own length."""
    width = max(1, min(chunk, size))
    return -(-size // width), width


def _index_dtype(width: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16):
        if width <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def _exchange(parts: Sequence[jax.Array], axis: str) -> tuple[list[jax.Array], int]:
    """All-gathers one worker's message, ``parts`` of ``[C, ...]`` arrays, as one buffer.

    Returns each part gathered ``[n, C, ...]`` (worker order) and the message's bytes.
    """
    count = parts[0].shape[0]
    raw = [lax.bitcast_convert_type(p, jnp.uint8).reshape(count, -1) for p in parts]
    gathered = wire.gather_from_owners(jnp.concatenate(raw, axis=1), axis)
    n = gathered.shape[0]
    cuts = np.cumsum([r.shape[1] for r in raw])[:-1]
    out = []
    for piece, p in zip(jnp.split(gathered, cuts, axis=2), parts, strict=True):
        size = p.dtype.itemsize
        piece = piece.reshape(n, *p.shape, *((size,) if size > 1 else ()))
        out.append(lax.bitcast_convert_type(piece, p.dtype))
    return out, sum(r.size for r in raw)


def _scatter_mean(index: jax.Array, values: jax.Array, width: int) -> jax.Array:
    """``(1/n) sum_i`` of the workers' sparse chunks, ``index, values [n, C, k]``: ``[C width]``."""
    n, count, _ = index.shape
    flat = jnp.arange(count)[:, None] * width + index.astype(jnp.int32)
    return jnp.zeros(count * width, jnp.float32).at[flat.reshape(-1)].add(values.reshape(-1)) / n


def _quantise(v: jax.Array, valid: jax.Array, levels: int) -> tuple[jax.Array, jax.Array]:
    """Per chunk (row) of ``v [C, k]``: codes of ``levels`` equal bins over ``[min, max]`` and
    the table of each bin's mean (0 for an empty bin); entries not ``valid`` count for nothing."""
    lo = jnp.where(valid, v, jnp.inf).min(axis=1, keepdims=True)
    hi = jnp.where(valid, v, -jnp.inf).max(axis=1, keepdims=True)
    span = hi - lo
    span = jnp.where(span > 0, span, 1.0)
    codes = jnp.clip(jnp.floor((v - lo) / span * levels), 0, levels - 1).astype(jnp.int32)
    member = (codes[..., None] == jnp.arange(levels)) & valid[..., None]  # [C, k, L]
    counts = member.sum(axis=1)
    sums = jnp.where(member, v[..., None], 0.0).sum(axis=1)
    return codes, jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)


def _pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """``codes [C, k]`` of ``bits`` bits each, packed into ``uint8 [C, ceil(k bits / 8)]``."""
    planes = (codes[..., None] >> jnp.arange(bits)) & 1  # [C, k, bits], low bit first
    flat = planes.reshape(codes.shape[0], -1).astype(bool)
    return wire.pack_bits(jnp.pad(flat, ((0, 0), (0, -flat.shape[1] % 8))))


def _unpack_codes(packed: jax.Array, k: int, bits: int) -> jax.Array:
    """The inverse of :func:`_pack_codes`, for any leading axes: ``[..., m]`` to ``[..., k]``."""
    planes = wire.unpack_bits(packed)[..., : k * bits].reshape(*packed.shape[:-1], k, bits)
    return (planes.astype(jnp.int32) << jnp.arange(bits)).sum(axis=-1)


class SparseLoCoState(NamedTuple):
    """Per-worker state of :func:`sparse_loco`.

    Attributes:
      error: the error-feedback accumulator ``e``, flat float32 ``[D]``.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    error: jax.Array
    compression_ratio: jax.Array


def sparse_loco(
    ratio: float,
    *,
    chunk: int = 4096,
    bits: int | None = 2,
    decay: float = 0.95,
    axis: str = "data",
) -> optax.GradientTransformation:
    """SparseLoCo: chunked top-k of an error-feedback accumulator, 2-bit values, averaged.

    Meant for local SGD's outer exchange: ``ddl.local_sgd(..., reducer=sparse_loco(0.01),
    outer_optimizer=optax.sgd(alpha))``; the decaying accumulator stands in for DiLoCo's
    outer momentum, so the outer optimizer is plain SGD. Each worker i with update
    (pseudo-gradient) ``Delta_i`` keeps ``e_i <- beta e_i + Delta_i``; the flattened ``e_i``
    is cut into chunks of ``chunk`` consecutive entries (the last one zero-padded) and the
    ``k = ceil(ratio * chunk)`` entries of largest ``|e_i|`` of each chunk are sent as
    ``q_i = Q(topk(e_i))``; then ``e_i <- e_i - q_i``. ``Q`` gives each chunk ``2^bits``
    equal bins over the range of its k values and sends each value as its bin's code; the
    table of the bins' means (float32) travels with the codes and decodes them (the
    authors' earlier CCLoco code decodes to bin means too, its bins spaced by the values'
    standard deviation around their mean). Workers
    all-gather ``(indices, codes, table)`` and ``Delta = (1/N) sum_i q_i``. With
    ``beta = 1`` nothing is lost: ``sum_t Delta_t + mean_i e_i = mean_i sum_t Delta_{i,t}``.

    Each device sends ``(N-1) * C * (k * b_idx + ceil(k * bits / 8) + 4 * 2^bits)`` bytes
    for ``C`` chunks (``b_idx`` = 2 for chunks up to 65536 entries; without quantisation
    ``(N-1) * C * k * (b_idx + 4)``): at ``ratio=0.01``, N=8, about 37x less than a dense
    float32 ring. ``ratio=1, decay=0, bits=None`` sends everything exactly: the plain mean.

    References:
      Sarfi, Therien, Lidin & Belilovsky, "Communication efficient LLM pre-training with
      SparseLoCo", 2025, arXiv:2508.15706 (the paper's chunks are 64 x 64 blocks of a
      matrix; here, runs of the flattened update).

    Args:
      ratio: fraction of each chunk sent, in (0, 1]; ``k = ceil(ratio * chunk)`` (of
        ``min(chunk, D)`` for an update of D < ``chunk`` entries).
      chunk: entries per chunk, >= 1 (default 4096, the paper's 64 x 64 blocks).
      bits: bits per value on the wire, 1 to 8 (default 2, the paper's); ``None`` sends
        float32 values.
      decay: beta, the accumulator's decay, in [0, 1] (default 0.95).
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``SparseLoCoState``.
    """
    check_axis_name("sparse_loco", axis)
    ratio = check_fraction("sparse_loco: ratio", ratio)
    chunk = check_int("sparse_loco: chunk", chunk, minimum=1)
    if bits is not None:
        bits = check_int("sparse_loco: bits (or None)", bits, minimum=1, maximum=8)
    decay = check_real("sparse_loco: decay", decay, minimum=0, maximum=1)

    def init(params) -> SparseLoCoState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return SparseLoCoState(zeros, jnp.ones((), jnp.float32))

    def update(updates, state: SparseLoCoState, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("sparse_loco", view, state.error)
        count, width = _layout(view.size, chunk)
        k = entries_kept(ratio, width)
        e = decay * state.error + view.ravel(updates, dtype=jnp.float32)
        chunks = pad_to(e, width).reshape(count, width)
        valid = (jnp.arange(count * width) < view.size).reshape(count, width)
        # Padding scores -1: it is sent only where a chunk holds fewer than k entries.
        _, index = lax.top_k(jnp.where(valid, jnp.abs(chunks), -1.0), k)
        picked = jnp.take_along_axis(chunks, index, axis=1)
        message = [index.astype(_index_dtype(width))]
        if bits is None:
            sent = picked
            message.append(picked)
        else:
            codes, table = _quantise(picked, jnp.take_along_axis(valid, index, axis=1), 2**bits)
            sent = jnp.take_along_axis(table, codes, axis=1)
            message += [_pack_codes(codes, bits), table]
        flat = (jnp.arange(count)[:, None] * width + index).reshape(-1)
        e = pad_to(e, width).at[flat].add(-sent.reshape(-1))[: view.size]

        gathered, nbytes = _exchange(message, axis)
        if bits is None:
            values = gathered[1]
        else:
            codes = _unpack_codes(gathered[1], k, bits)
            values = jnp.take_along_axis(gathered[2], codes, axis=2)
        out = _scatter_mean(gathered[0], values, width)
        new_state = SparseLoCoState(e, wire.ratio(view.size, (n - 1) * nbytes, n))
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)


class DeMoState(NamedTuple):
    """Per-worker state of :func:`demo`.

    Attributes:
      momentum: the decoupled momentum ``m`` (what was not sent), flat float32 ``[D]``.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    momentum: jax.Array
    compression_ratio: jax.Array


def demo(
    ratio: float, *, chunk: int = 64, beta: float = 0.999, axis: str = "data"
) -> optax.GradientTransformation:
    """DeMo, Decoupled Momentum Optimization: the top DCT coefficients of local momenta.

    Each worker keeps its own momentum ``m_i <- beta m_i + g_i``; the flattened ``m_i`` is
    cut into chunks of ``chunk`` consecutive entries (the last one zero-padded), each chunk
    goes through the orthonormal DCT-II, and the ``k = ceil(ratio * chunk)`` coefficients of
    largest magnitude per chunk are sent (int index, float32 value); ``q_i`` = the inverse
    DCT of the kept coefficients, and ``m_i <- m_i - q_i``. Workers all-gather the
    coefficients, average them, ``Q = (1/N) sum_i topk_i``, and return the inverse DCT of
    ``Q``: the update direction. DeMo's optimizer is sign descent on it, so follow with
    ``optax.chain(optax.scale_by_sign(), optax.scale(-lr))`` (optionally
    ``optax.add_decayed_weights`` first, DeMo's decoupled weight decay):
    ``ddl.data_parallel(loss_fn, optax.chain(optax.scale_by_sign(), optax.scale(-lr)), mesh,
    reducer=demo(0.5))``. With ``beta = 0`` and ``ratio = 1`` it is the plain mean.

    Each device sends ``(N-1) * C * k * (b_idx + 4)`` bytes for ``C`` chunks (``b_idx`` = 1
    for chunks up to 256 entries): at ``chunk=64``, k = 1 (any ``ratio <= 1/64``), N=8,
    about 13x less than a dense float32 ring.

    Differences from the authors' code, which keeps 32 coefficients of each 64 x 64 block
    of a matrix (a 2-D DCT): here the DCT is 1-D over runs of the flattened update, so the
    density is at least ``1 / chunk``; the momentum adds ``g``, not ``lr * g`` (the same
    directions for a constant learning rate); a coefficient sent by some workers is
    averaged over all N (the authors' code averages over its senders).

    References:
      Peng, Quesnelle & Kingma, "DeMo: decoupled momentum optimization", 2024,
      arXiv:2411.19870.

    Args:
      ratio: fraction of each chunk's coefficients sent, in (0, 1]; ``k = ceil(ratio *
        chunk)`` (of ``min(chunk, D)`` for an update of D < ``chunk`` entries).
      chunk: entries per DCT chunk, >= 1 (default 64, the paper's block side).
      beta: the momentum's decay, in [0, 1) (default 0.999, the paper's).
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``DeMoState``.

    Example:
      Sign descent on the averaged top coefficients; 4 workers each send 1 of every 8:

      >>> import jax, jax.numpy as jnp, numpy as np, optax, ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> params = {"w": jnp.zeros((16, 4))}
      >>> batch = {"x": np.ones((8, 16), np.float32), "y": np.ones((8, 4), np.float32)}
      >>> sign_descent = optax.chain(optax.scale_by_sign(), optax.scale(-0.01))
      >>> reducer = ddl.compression.demo(0.125, chunk=8)
      >>> mesh = ddl.make_mesh(data=4)
      >>> strategy = ddl.data_parallel(loss_fn, sign_descent, mesh, reducer=reducer)
      >>> state, metrics = jax.jit(strategy.step)(strategy.init(params), batch)
      >>> print(metrics["compression_ratio"])  # 1.5 * 4 * 64 bytes / (3 * 8 * 5 bytes)
      3.2
    """
    check_axis_name("demo", axis)
    ratio = check_fraction("demo: ratio", ratio)
    chunk = check_int("demo: chunk", chunk, minimum=1)
    beta = check_real("demo: beta", beta, minimum=0)
    beta = check_real("demo: beta", beta, maximum=1, exclusive=True)

    def init(params) -> DeMoState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return DeMoState(zeros, jnp.ones((), jnp.float32))

    def update(updates, state: DeMoState, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("demo", view, state.momentum)
        count, width = _layout(view.size, chunk)
        k = entries_kept(ratio, width)
        m = beta * state.momentum + view.ravel(updates, dtype=jnp.float32)
        coeffs = dct(pad_to(m, width).reshape(count, width), type=2, norm="ortho", axis=1)
        _, index = lax.top_k(jnp.abs(coeffs), k)
        values = jnp.take_along_axis(coeffs, index, axis=1)
        kept = jnp.zeros_like(coeffs).at[jnp.arange(count)[:, None], index].set(values)
        m = m - idct(kept, type=2, norm="ortho", axis=1).reshape(-1)[: view.size]

        (index, values), nbytes = _exchange([index.astype(_index_dtype(width)), values], axis)
        mean = _scatter_mean(index, values, width).reshape(count, width)
        out = idct(mean, type=2, norm="ortho", axis=1).reshape(-1)
        new_state = DeMoState(m, wire.ratio(view.size, (n - 1) * nbytes, n))
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)
