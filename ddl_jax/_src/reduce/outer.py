"""Tiled top-k reducers with a decaying memory, as their authors' code does: SparseLoCo, DeMo.

Both cut each tensor of the update into tiles, as the authors' ``ChunkingTransformer`` /
``TransformDCT`` do: a matrix ``[d0, d1]`` into ``h x w`` tiles, ``h`` (``w``) the largest
divisor of ``d0`` (``d1``) that is at most ``chunk`` (64 in both papers); a vector of length
``d`` into runs of ``w``, the largest divisor of ``d`` at most ``chunk``, so a tensor smaller
than a tile is one tile of its own size. (The references handle vectors and matrices only; a
scalar is read here as a vector of one entry and a tensor of more dimensions as the matrix
``[d0, d1 * d2 * ...]``.) They keep the k largest entries of each tile of a per-worker memory
(SparseLoCo: an error-feedback accumulator, quantised; DeMo: the momentum's 2-D DCT
coefficients), subtract what they send from that memory, and all-gather every worker's
message as one ``uint8`` buffer (each device sends ``(N-1) x`` its message, as
``ddl.comm_stats`` charges an all-gather). A coordinate is averaged over the workers that
sent it (the references' ``scatter_reduce(reduce="mean", include_self=False)``), or over all
N with ``aggregate="workers"``. An index travels as its position inside its tile, in the
narrowest unsigned integer that holds it (``uint8`` for tiles of at most 256 entries,
``uint16`` up to 65536). The gathered messages are typed invariant over the axis, so both
are plain optax transforms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.reducer import mark_takes_arrivals
from ddl_jax._src.core.strategy import check_bool, check_int, check_real
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import check_axis_name
from ddl_jax._src.reduce.sparse import check_fraction, check_size, entries_kept

_AGGREGATES = ("senders", "workers")


def _largest_divisor(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (the references'
    ``_get_smaller_split``); 1 for ``n = 0`` (a tensor without entries: no tiles)."""
    return next((d for d in range(min(n, target), 0, -1) if n % d == 0), 1)


class _Tiling(NamedTuple):
    """How one tensor is cut: read as the matrix ``[rows, cols]``, in ``h x w`` tiles."""

    rows: int
    cols: int
    h: int
    w: int

    @classmethod
    def of(cls, shape: Sequence[int], chunk: int) -> _Tiling:
        if len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            return cls(rows, cols, _largest_divisor(rows, chunk), _largest_divisor(cols, chunk))
        cols = math.prod(shape)  # a vector (or a scalar, one entry): one row of runs
        return cls(1, cols, 1, _largest_divisor(cols, chunk))

    @property
    def count(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def width(self) -> int:
        return self.h * self.w

    def split(self, x: jax.Array) -> jax.Array:
        """Flat ``x [rows * cols]`` to tiles ``[count, h * w]``, each tile row-major."""
        x = x.reshape(self.rows // self.h, self.h, self.cols // self.w, self.w)
        return x.transpose(0, 2, 1, 3).reshape(self.count, self.width)

    def join(self, tiles: jax.Array) -> jax.Array:
        """The inverse of :meth:`split`: flat ``[rows * cols]``."""
        x = tiles.reshape(self.rows // self.h, self.cols // self.w, self.h, self.w)
        return x.transpose(0, 2, 1, 3).reshape(-1)


def _index_dtype(width: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16):
        if width <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def _exchange(parts: Sequence[jax.Array], axis: str) -> tuple[list[jax.Array], int]:
    """All-gathers one worker's message, ``parts`` (any shapes and dtypes), as one buffer.

    Returns each part gathered ``[n, *shape]`` (worker order) and the message's bytes.
    """
    raw = [lax.bitcast_convert_type(p, jnp.uint8).reshape(-1) for p in parts]
    gathered = wire.gather_from_owners(jnp.concatenate(raw), axis)
    n = gathered.shape[0]
    cuts = np.cumsum([r.size for r in raw])[:-1]
    out = []
    for piece, p in zip(jnp.split(gathered, cuts, axis=1), parts, strict=True):
        size = p.dtype.itemsize
        piece = piece.reshape(n, *p.shape, *((size,) if size > 1 else ()))
        out.append(lax.bitcast_convert_type(piece, p.dtype))
    return out, sum(r.size for r in raw)


def _combine(
    index: jax.Array,
    values: jax.Array,
    tiling: _Tiling,
    aggregate: str,
    weight: jax.Array | None = None,
) -> jax.Array:
    """The workers' sparse tiles, ``index, values [n, C, k]``, combined: flat ``[C * width]``.

    ``"senders"``: each coordinate's mean over the workers that sent it (0 where none did),
    the references' ``scatter_reduce(reduce="mean", include_self=False)``; ``"workers"``:
    the sum over ``n``. ``weight [n]`` (1 or 0): only the workers weighted 1 send, and
    ``"workers"`` divides by their number.
    """
    n, count, _ = index.shape
    flat = (jnp.arange(count)[:, None] * tiling.width + index.astype(jnp.int32)).reshape(-1)
    size = count * tiling.width
    sent = 1.0 if weight is None else jnp.broadcast_to(weight[:, None, None], index.shape)
    sums = jnp.zeros(size, jnp.float32).at[flat].add((values * sent).reshape(-1))
    if aggregate == "workers":
        return sums / (n if weight is None else jnp.maximum(jnp.sum(weight), 1.0))
    senders = jnp.zeros(size, jnp.float32).at[flat].add(jnp.reshape(sent, -1))
    return jnp.where(senders > 0, sums / jnp.maximum(senders, 1.0), 0.0)


def _lower_median(norms: jax.Array, weight: jax.Array | None) -> jax.Array:
    """``torch.median`` of ``norms [n]`` (the lower middle one), over the workers weighted
    1 if ``weight`` is given."""
    if weight is None:
        return jnp.sort(norms)[(norms.size - 1) // 2]
    count = jnp.maximum(jnp.sum(weight), 1.0).astype(jnp.int32)
    return jnp.sort(jnp.where(weight > 0, norms, jnp.inf))[(count - 1) // 2]


def _pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Flat ``codes [m]`` of ``bits`` bits each, packed into ``uint8 [ceil(m bits / 8)]``."""
    planes = ((codes[:, None] >> jnp.arange(bits)) & 1).reshape(-1).astype(bool)  # low bit 1st
    return wire.pack_bits(jnp.pad(planes, (0, -planes.size % 8)))


def _unpack_codes(packed: jax.Array, m: int, bits: int) -> jax.Array:
    """The inverse of :func:`_pack_codes`, for any leading axes: ``[..., b]`` to ``[..., m]``."""
    planes = wire.unpack_bits(packed)[..., : m * bits].reshape(*packed.shape[:-1], m, bits)
    return (planes.astype(jnp.int32) << jnp.arange(bits)).sum(axis=-1)


def _quantise(v: jax.Array, levels: int, sigmas: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """templar's ``TopKCompressor._quantize_values`` over all of one tensor's values ``v``.

    Returns ``(codes, table, shift)``: ``shift`` = the values' mean, ``scale = sigmas * std /
    levels`` (std with Bessel's correction; 1 where it is 0 or not finite), code =
    ``clip(round((v - shift) / scale + levels // 2), 0, levels - 1)``, and the table of each
    code's mean centred value (0 for an empty code); ``v`` decodes as ``table[code] + shift``.
    """
    flat = v.reshape(-1)
    shift = flat.mean()
    centred = flat - shift
    std = jnp.linalg.norm(centred) / jnp.sqrt(jnp.float32(flat.size - 1))
    scale = sigmas * std / levels
    scale = jnp.where(jnp.isfinite(scale) & (scale != 0), scale, 1.0)
    codes = jnp.clip(jnp.round(centred / scale + levels // 2), 0, levels - 1).astype(jnp.int32)
    sums = jnp.zeros(levels, jnp.float32).at[codes].add(centred)
    counts = jnp.zeros(levels, jnp.float32).at[codes].add(1.0)
    table = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    return codes.reshape(v.shape), table, shift


def _check_aggregate(fn: str, aggregate: Any) -> str:
    if aggregate not in _AGGREGATES:
        raise ValueError(f"{fn}: aggregate must be one of {_AGGREGATES}, got {aggregate!r}")
    return aggregate


def _leaf_slices(view: FlatView) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(start, size, shape)`` of each leaf in the flat vector."""
    out, start = [], 0
    for shape in view.shapes:
        size = math.prod(shape)
        out.append((start, size, tuple(shape)))
        start += size
    return out


class SparseLoCoState(NamedTuple):
    """Per-worker state of :func:`sparse_loco`.

    Attributes:
      error: the error-feedback accumulator ``e``, flat float32 ``[D]``.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    error: jax.Array
    compression_ratio: jax.Array


def _sparse_loco_k(k: int, width: int) -> int:
    """templar's ``TopKCompressor._clamp_topk``: at most the tile, at least 2, even (for its
    12-bit index pairs); at most the tile again, so a tile of one entry sends it."""
    k = max(min(k, width), 2)
    return min(k - k % 2, width)


def sparse_loco(
    ratio: float,
    *,
    chunk: int = 64,
    bits: int | None = 2,
    sigmas: float = 6.0,
    decay: float = 0.95,
    alpha: float = 1.0,
    clip_norm: bool = True,
    aggregate: str = "senders",
    axis: str = "data",
) -> optax.GradientTransformation:
    """SparseLoCo: tiled top-k of an error-feedback accumulator, 2-bit values, averaged.

    Meant for local SGD's outer exchange: ``ddl.local_sgd(..., reducer=sparse_loco(1 / 64,
    alpha=a), outer_optimizer=optax.sgd(a))`` (the authors' code uses the outer learning rate
    ``a`` twice, as here: it scales what enters the accumulator and the outer SGD step; its
    default is 1). Each worker i with update (pseudo-gradient) ``Delta_i`` keeps ``e_i <- beta
    e_i + a Delta_i``; each tensor of ``e_i`` is cut into tiles (see the module: ``chunk x
    chunk`` for a matrix whose sides ``chunk`` divides) and the ``k`` entries of largest
    ``|e_i|`` of each tile are sent as ``q_i = Q(topk(e_i))``; then ``e_i <- e_i - q_i``.
    ``k = ceil(ratio * chunk^2)``, clamped per tile as the authors' code does: at most the
    tile's size, at least 2, rounded down to even. ``Q`` (``bits`` not None) quantises all
    the values sent for one tensor together: shifted by their mean, binned by their standard
    deviation into ``2^bits`` codes (``scale = sigmas * std / 2^bits``, codes centred on
    ``2^(bits-1)``), each code decoded as the mean of the values it took; the code table
    (``2^bits`` float32) and the shift (float32) travel with the codes. After the all-gather
    of ``(indices, codes, table, shift)``, with ``clip_norm`` each worker's values for a
    tensor are scaled by ``min(1, median_j |q_j| / (|q_i| + 1e-8))`` (their L2 norm against
    the lower median over workers, as the authors' ``outer_step`` does), and each coordinate
    is averaged over the workers that sent it (``aggregate="senders"``; ``"workers"``
    divides by all N, this library's earlier definition).

    Each device sends ``(N-1) * sum over tensors of (C k b_idx + ceil(C k bits / 8) + 4 *
    2^bits + 4)`` bytes for a tensor of ``C`` tiles (``b_idx`` = 1 for tiles of at most 256
    entries, else 2; without quantisation ``C k (b_idx + 4)``): at ``ratio=1/64``, N=8, about
    28x less than a dense float32 ring. The authors pack indices in 12 bits and send one
    byte per 2-bit code; here indices are ``uint16`` and codes are packed. ``ratio=1,
    decay=0, bits=None, clip_norm=False`` sends everything exactly, the plain mean, where
    every tile has an even number of entries (an odd tile keeps its smallest entry back).

    References:
      Sarfi, Therien, Lidin & Belilovsky, "Communication efficient LLM pre-training with
      SparseLoCo", 2025, arXiv:2508.15706. Code: github.com/tplr-ai/templar,
      ``src/tplr/compress.py`` (``ChunkingTransformer``, ``TopKCompressor``) and
      ``src/tplr/neurons.py`` (the accumulator, error feedback and ``outer_step``);
      hyperparameters in ``hparams/hparams.json`` (``target_chunk`` 64, ``topk_compression``
      64, i.e. ``ratio = 1/64``, ``quantization_bins`` 4, ``quantization_range`` 6,
      ``momentum_decay`` 0.95, ``outer_learning_rate`` 1).

    Args:
      ratio: fraction of a ``chunk x chunk`` tile sent, in (0, 1]; ``k = ceil(ratio *
        chunk^2)`` entries per tile, clamped per tile as above.
      chunk: the target tile side, >= 1 (default 64, the authors').
      bits: bits per value on the wire, 1 to 8 (default 2, the authors'); ``None`` sends
        float32 values.
      sigmas: the quantiser's range in standard deviations, > 0 (default 6, the authors').
      decay: beta, the accumulator's decay, in [0, 1] (default 0.95).
      alpha: the outer learning rate scaling what enters the accumulator, > 0 (default 1);
        pass the same to the outer ``optax.sgd``.
      clip_norm: clip each worker's contribution to a tensor at the median norm (default
        True, as the authors' ``outer_step``).
      aggregate: ``"senders"`` (default, the authors') or ``"workers"``, see above.
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``SparseLoCoState``.
    """
    check_axis_name("sparse_loco", axis)
    ratio = check_fraction("sparse_loco: ratio", ratio)
    chunk = check_int("sparse_loco: chunk", chunk, minimum=1)
    if bits is not None:
        bits = check_int("sparse_loco: bits (or None)", bits, minimum=1, maximum=8)
    sigmas = check_real("sparse_loco: sigmas", sigmas, minimum=0, exclusive=True)
    decay = check_real("sparse_loco: decay", decay, minimum=0, maximum=1)
    alpha = check_real("sparse_loco: alpha", alpha, minimum=0, exclusive=True)
    clip_norm = check_bool("sparse_loco: clip_norm", clip_norm)
    aggregate = _check_aggregate("sparse_loco", aggregate)
    k_target = entries_kept(ratio, chunk * chunk)

    def init(params) -> SparseLoCoState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return SparseLoCoState(zeros, jnp.ones((), jnp.float32))

    def update(updates, state: SparseLoCoState, params=None, *, arrived=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("sparse_loco", view, state.error)
        # only the workers that arrived: their messages combined, a median among them
        weight = None if arrived is None else arrived.astype(jnp.float32)
        e = decay * state.error + alpha * view.ravel(updates, dtype=jnp.float32)
        message, plans, errors = [], [], []
        for start, size, shape in _leaf_slices(view):
            tiling = _Tiling.of(shape, chunk)
            k = _sparse_loco_k(k_target, tiling.width)
            tiles = tiling.split(e[start : start + size])
            _, index = lax.top_k(jnp.abs(tiles), k)
            picked = jnp.take_along_axis(tiles, index, axis=1)
            parts = [index.astype(_index_dtype(tiling.width))]
            if bits is None:
                sent = picked
                parts.append(picked)
            else:
                codes, table, shift = _quantise(picked, 2**bits, sigmas)
                sent = table[codes] + shift
                parts += [_pack_codes(codes.reshape(-1), bits), table, shift[None]]
            rows = jnp.arange(tiling.count)[:, None]
            errors.append(tiling.join(tiles.at[rows, index].add(-sent)))
            plans.append((tiling, k, len(message), len(parts)))
            message += parts

        gathered, nbytes = _exchange(message, axis)
        outs = []
        for tiling, k, first, count in plans:
            index, *rest = gathered[first : first + count]
            if bits is None:
                values = rest[0]
            else:
                codes = _unpack_codes(rest[0], tiling.count * k, bits)
                values = jnp.take_along_axis(rest[1], codes, axis=1) + rest[2]
                values = values.reshape(n, tiling.count, k)
            if clip_norm:
                norms = jnp.sqrt(jnp.sum(values**2, axis=(1, 2)))
                median = _lower_median(norms, weight)
                factor = jnp.minimum(median / (norms + 1e-8), 1.0)
                values = values * factor[:, None, None]
            outs.append(tiling.join(_combine(index, values, tiling, aggregate, weight)))
        out = jnp.concatenate(outs) if outs else jnp.zeros(0, jnp.float32)
        error = jnp.concatenate(errors) if errors else e
        if arrived is not None:  # a worker left out keeps its accumulator
            error = jnp.where(arrived[lax.axis_index(axis)], error, state.error)
        new_state = SparseLoCoState(error, wire.ratio(view.size, (n - 1) * nbytes, n))
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, mark_takes_arrivals(update))


class DeMoState(NamedTuple):
    """Per-worker state of :func:`demo`.

    Attributes:
      momentum: the decoupled momentum ``m`` (what was not sent), flat float32 ``[D]``.
      count: int32 scalar, the steps taken (for a learning-rate schedule).
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    momentum: jax.Array
    count: jax.Array
    compression_ratio: jax.Array


def _dct_matrix(size: int) -> np.ndarray:
    """The orthonormal DCT-II: ``coefficients = M @ x``, ``x = M.T @ coefficients``."""
    j, f = np.arange(size), np.arange(size)[:, None]
    m = np.sqrt(2 / size) * np.cos(np.pi * (2 * j + 1) * f / (2 * size))
    m[0] /= np.sqrt(2)
    return m.astype(np.float32)


def demo(
    ratio: float,
    *,
    chunk: int = 64,
    beta: float = 0.999,
    lr: float | Callable[[jax.Array], jax.Array] = 1.0,
    aggregate: str = "senders",
    axis: str = "data",
) -> optax.GradientTransformation:
    """DeMo, Decoupled Momentum Optimization: the top 2-D DCT coefficients of local momenta.

    Each worker keeps its own momentum ``m_i <- beta m_i + lr g_i`` (``lr`` the learning
    rate, a float or an optax schedule of the step count, as the authors' ``state["delta"]``
    accumulates ``lr * grad``); each tensor of ``m_i`` is cut into tiles (see the module: ``h
    x w`` blocks of a matrix, runs of a vector), each tile goes through the orthonormal 2-D
    DCT-II (1-D for a vector), and the ``k`` coefficients of largest magnitude per tile are
    sent (index in the tile, float32 value); ``q_i`` = the inverse DCT of the kept
    coefficients, and ``m_i <- m_i - q_i``. ``k = ceil(ratio * chunk^2)``, at most the
    tile's size (the authors' ``compression_topk``, default 32 of a 64 x 64 tile: ``ratio =
    1/128``). Workers all-gather the coefficients, average each over the workers that sent
    it (``aggregate="senders"``, the authors'; ``"workers"`` divides by all N, this
    library's earlier definition) and return the inverse DCT: the update direction.
    DeMo's optimizer is sign descent on it, with its weight decay outside the sign
    (``p <- p (1 - lr wd) - lr sign(.)``): follow with ``optax.chain(optax.scale_by_sign(),
    optax.add_decayed_weights(wd), optax.scale(-lr))`` (``add_decayed_weights`` after the
    sign, not before): ``ddl.data_parallel(loss_fn, that_chain, mesh, reducer=demo(1 / 128,
    lr=lr))``. With ``beta = 0`` and ``ratio = 1`` it is ``lr`` times the plain mean.

    Each device sends ``(N-1) * sum over tensors of C k (b_idx + 4)`` bytes for a tensor of
    ``C`` tiles (``b_idx`` = 1 for tiles of at most 256 entries, else 2; the authors send
    int64 indices).

    References:
      Peng, Quesnelle & Kingma, "DeMo: decoupled momentum optimization", 2024,
      arXiv:2411.19870. Code: github.com/bloc97/DeMo, ``demo.py`` (``DeMo.step``,
      ``TransformDCT``, ``CompressDCT``; defaults ``compression_chunk`` 64,
      ``compression_topk`` 32, ``compression_decay`` 0.999).

    Args:
      ratio: fraction of a ``chunk x chunk`` tile's coefficients sent, in (0, 1]; ``k =
        ceil(ratio * chunk^2)`` per tile, at most the tile's size.
      chunk: the target tile side, >= 1 (default 64, the authors').
      beta: the momentum's decay, in [0, 1) (default 0.999, the authors').
      lr: the learning rate scaling the gradient into the momentum, a float > 0 or a
        schedule (default 1.0). With a constant rate the signs do not depend on it, so
        the default is the authors'; with a schedule (the authors' configs warm up and
        decay it) pass the optimizer's schedule here too, or the momentum weighs the
        steps differently from theirs and the signs sent differ.
      aggregate: ``"senders"`` (default, the authors') or ``"workers"``, see above.
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``DeMoState``.

    Example:
      Sign descent on the averaged top coefficients; 4 workers, k = ceil(0.125 * 8^2) = 8
      coefficients of each 8 x 4 tile of ``w``:

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
      >>> print(metrics["compression_ratio"])  # 1.5 * 4 * 64 bytes / (3 * 2 tiles * 8 * 5 bytes)
      1.6
    """
    check_axis_name("demo", axis)
    ratio = check_fraction("demo: ratio", ratio)
    chunk = check_int("demo: chunk", chunk, minimum=1)
    beta = check_real("demo: beta", beta, minimum=0)
    beta = check_real("demo: beta", beta, maximum=1, exclusive=True)
    if not callable(lr):
        lr = check_real("demo: lr (or a schedule)", lr, minimum=0, exclusive=True)
    aggregate = _check_aggregate("demo", aggregate)
    k_target = entries_kept(ratio, chunk * chunk)

    def init(params) -> DeMoState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return DeMoState(zeros, jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32))

    def transform(tiles: jax.Array, tiling: _Tiling, inverse: bool) -> jax.Array:
        dh, dw = _dct_matrix(tiling.h), _dct_matrix(tiling.w)
        x = tiles.reshape(-1, tiling.h, tiling.w)
        spec = "cab,ah,bw->chw" if inverse else "chw,ah,bw->cab"
        out = jnp.einsum(spec, x, dh, dw, precision=lax.Precision.HIGHEST)
        return out.reshape(tiles.shape)

    def update(updates, state: DeMoState, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("demo", view, state.momentum)
        rate = lr(state.count) if callable(lr) else lr
        m = beta * state.momentum + rate * view.ravel(updates, dtype=jnp.float32)
        message, plans, momenta = [], [], []
        for start, size, shape in _leaf_slices(view):
            tiling = _Tiling.of(shape, chunk)
            k = min(k_target, tiling.width)
            tiles = tiling.split(m[start : start + size])
            coeffs = transform(tiles, tiling, inverse=False)
            _, index = lax.top_k(jnp.abs(coeffs), k)
            values = jnp.take_along_axis(coeffs, index, axis=1)
            rows = jnp.arange(tiling.count)[:, None]
            kept = jnp.zeros_like(coeffs).at[rows, index].set(values)
            momenta.append(tiling.join(tiles - transform(kept, tiling, inverse=True)))
            plans.append((tiling, len(message)))
            message += [index.astype(_index_dtype(tiling.width)), values]

        gathered, nbytes = _exchange(message, axis)
        outs = []
        for tiling, first in plans:
            index, values = gathered[first : first + 2]
            mean = _combine(index, values, tiling, aggregate).reshape(tiling.count, tiling.width)
            outs.append(tiling.join(transform(mean, tiling, inverse=True)))
        out = jnp.concatenate(outs) if outs else jnp.zeros(0, jnp.float32)
        momentum = jnp.concatenate(momenta) if momenta else m
        new_state = DeMoState(
            momentum,
            optax.safe_increment(state.count),
            wire.ratio(view.size, (n - 1) * nbytes, n),
        )
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)
