"""4-bit floating-point reducers: ``cast_e3m0``, Streaming DiLoCo's outer-gradient format.

E3M0 is a 4-bit float of 1 sign bit, 3 exponent bits and no mantissa: a sign and a power
of two. The values travel as 4-bit codes, two per ``uint8``, with one float32 scale per
block, through the compressed all-reduce of ``quantise`` (see ``wire``): a compressed
reduce-scatter (``all_to_all``), a float32 average on each chunk's owner, and a
compressed all-gather.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ddl_jax._src.core.flat import FlatView, padded_size
from ddl_jax._src.core.strategy import check_int
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import check_axis_name

# Exponent field e in 0..7 of a code ``sign << 3 | e``: e = 0 is zero (a subnormal with no
# mantissa), e > 0 is 2^(e - BIAS). No code is reserved for inf or NaN (as OCP's
# finite-only FP4 E2M1); BIAS = 2^(3-1) - 1 as IEEE's, so the magnitudes are
# 0, 1/4, 1/2, 1, 2, 4, 8, 16. The bias only names the codes: every block is scaled to put
# its largest magnitude at E3M0_MAX.
E3M0_BIAS = 3
E3M0_MAX = 16.0
ROUNDINGS = ("nearest", "stochastic")
# numpy, not jnp: a jnp array made at import time would start JAX's backend.
_MAGNITUDES = np.array([0.0] + [2.0 ** (e - E3M0_BIAS) for e in range(1, 8)], np.float32)


def decode_e3m0(codes: jax.Array) -> jax.Array:
    """float32 values of E3M0 codes (``uint8`` in 0..15): ``(-1)^s * magnitude(e)``."""
    codes = codes.astype(jnp.int32)
    magnitude = jnp.asarray(_MAGNITUDES)[codes & 7]
    return jnp.where(codes & 8, -magnitude, magnitude)


def encode_e3m0(x: jax.Array, uniform: jax.Array | None = None) -> jax.Array:
    """E3M0 codes (``uint8``) of float32 ``x``, already scaled into ``[-16, 16]``.

    Without ``uniform``: the nearest value, ties to the even exponent field (IEEE's
    roundTiesToEven on the code; |x| = 1/8 goes to 0, 3/8 to 1/2, 3 to 2, 12 to 8). With
    ``uniform`` (``U[0, 1)`` draws shaped like ``x``): stochastic rounding between the two
    neighbours ``lo <= |x| <= hi``, up with probability ``(|x| - lo) / (hi - lo)``, unbiased
    inside the range. Magnitudes past 16 saturate to 16; the sign bit is kept (-0 is
    code 8, which decodes to zero).
    """
    x = x.astype(jnp.float32)
    a = jnp.abs(x)
    _, exponent = jnp.frexp(a)  # a = m 2^exponent, m in [1/2, 1): floor(log2 a) = exponent - 1
    normal = a >= _MAGNITUDES[1]
    lo_field = jnp.where(normal, jnp.clip(exponent - 1 + E3M0_BIAS, 1, 7), 0)
    hi_field = jnp.minimum(lo_field + 1, 7)
    table = jnp.asarray(_MAGNITUDES)
    lo, hi = table[lo_field], table[hi_field]
    if uniform is None:
        mid = (lo + hi) / 2  # exact: powers of two
        up = (a > mid) | ((a == mid) & (hi_field % 2 == 0))
    else:
        gap = hi - lo
        up = uniform < jnp.where(gap > 0, (a - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    field = jnp.where(up, hi_field, lo_field)
    return (jnp.where(jnp.signbit(x), 8, 0) | field).astype(jnp.uint8)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Packs 4-bit codes ``[..., 2m]`` into ``uint8 [..., m]``: entry 2j in the low nibble."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_nibbles`: ``uint8 [..., m]`` to codes ``[..., 2m]``."""
    pairs = jnp.stack([packed & jnp.uint8(15), packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], -1)


def quantise_e3m0(blocks: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Packed codes ``uint8 [..., block/2]`` and float32 scales ``[...]`` of ``[..., block]``.

    Each block is divided by its scale ``max |x| / 16`` (its largest entry becomes +-16),
    encoded (to nearest, or stochastically with ``key``) and packed. An all-zero block has
    scale 0 and zero codes. A block holding inf or NaN has a non-finite scale, so it
    decodes to non-finite values: a divergence is not hidden.
    """
    scales = jnp.max(jnp.abs(blocks), axis=-1) / E3M0_MAX
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    scaled = blocks / safe
    uniform = None if key is None else jax.random.uniform(key, blocks.shape)
    return pack_nibbles(encode_e3m0(scaled, uniform)), scales


def dequantise_e3m0(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """The float32 blocks ``[..., block]`` of :func:`quantise_e3m0`'s output."""
    return decode_e3m0(unpack_nibbles(packed)) * scales[..., None]


def check_rounding(fn: str, rounding: Any) -> str:
    """Raises ``ValueError`` unless ``rounding`` is ``"nearest"`` or ``"stochastic"``."""
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"{fn}: rounding must be 'nearest' or 'stochastic', got {rounding!r}.")
    return rounding


class E3M0State(NamedTuple):
    """Per-worker state of :func:`cast_e3m0`.

    Attributes:
      step: exchanges so far (int32); with the worker index it keys stochastic rounding.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    step: jax.Array
    compression_ratio: jax.Array


def cast_e3m0(
    *,
    block_size: int = 256,
    rounding: str = "nearest",
    seed: int = 0,
    axis: str = "data",
) -> optax.GradientTransformation:
    """Averages gradients sent as 4-bit E3M0 floats (1 sign, 3 exponent, 0 mantissa bits).

    Streaming DiLoCo exchanges its outer gradients (pseudo-gradients) in E3M0 and reports
    no loss of quality against float32; the quantisation is of the communication only,
    the accumulation over workers and the outer optimizer stay in float32. Pass it as
    ``reducer=`` to ``ddl.streaming_diloco`` or ``ddl.local_sgd``.

    Update rule, on the flattened gradient cut into blocks of ``block_size`` entries:
    ``Q(v) = s * e3m0(v / s)`` with ``s = max_j |v_j| / 16`` per block (the block's
    largest entry is sent exactly) and ``e3m0`` rounding to the values
    ``{0, +-1/4, +-1/2, +-1, +-2, +-4, +-8, +-16}``. Workers send each chunk's owner
    ``Q(g_i)`` (``all_to_all``), the owner averages them in float32 and all-gathers
    ``g = Q((1/N) sum_i Q(g_i))`` (requantised with fresh scales): every worker returns the
    same ``g``. No error feedback.

    Each device sends ``2 (N-1)/N * (D/2 + 4 D / block_size)`` bytes for D entries
    (padded to a multiple of ``N * block_size``): 4 bits per entry plus a float32 scale
    per block, ``32 / (4 + 32 / block_size)`` = 7.76x less than a float32 ring at the
    default 256.

    What is matched, and what is chosen here:

    * The format, and float32 accumulation of the dequantised values: Douillard et al.
      2025 (below), its quantised communication of outer gradients. The paper does not
      say (in what could be found) how values are scaled into E3M0's range or rounded;
      no public code of the authors' was found.
    * The reduction, after pytorch/torchft's quantised all-reduce for (Streaming) DiLoCo
      (``torchft/collectives.py``, ``allreduce_quantized``; kernels in
      ``torchft/quantization.py``, ``fused_quantize_into_fp8`` / ``fused_reduce_fp8``),
      which communicates in FP8, not 4 bits: codes and float32 scales go to their owner by
      an all-to-all; the owner dequantises, sums in float32, divides by N, requantises the
      mean with a new absmax scale; codes and scales are all-gathered and dequantised.
      torchft's scale is one per row of each tensor, ``FP8_MAX / max |row|`` (a zero row:
      1); here it is one per block of the flattened gradient, ``max |block| / 16``
      (choice: blocks keep the bytes independent of shapes; an all-zero block: 0).
    * The exponent bias 3 with field 0 as zero and no inf/NaN codes (choice: the IEEE
      convention; under the absmax scale the bias changes nothing: what matters is the
      factor 2 between neighbouring values and the factor 64 spanned by the non-zero
      ones).
    * Rounding: to nearest, ties to even (choice: what a float cast does, torchft's FP8
      one included); ``rounding="stochastic"`` is unbiased instead.
    * Values past the range saturate to +-16 (none can: the absmax lands on 16
      exactly); entries with ``|v| <= s/8`` round to zero (``s/8`` is a tie, which goes to
      the even field, zero's); a block with inf or NaN decodes non-finite.

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: towards a
      distributed free lunch", 2025, arXiv:2501.18512.

    Args:
      block_size: entries sharing one float32 scale, an even int >= 2 (two codes per
        byte). Smaller blocks follow the values' range more closely (E3M0 spans only a
        factor 64 within a block) and send more scales.
      rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; the noise is
        keyed by ``seed``, the step counter and the worker index).
      seed: base of the keyed randomness of stochastic rounding.
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is an ``E3M0State``.

    Raises:
      ValueError: ``block_size`` is not an even int >= 2, ``rounding`` is neither
        ``"nearest"`` nor ``"stochastic"``, or ``seed`` is not an int.
      TypeError: ``axis`` is not a mesh axis name.

    Example:
      Inside ``shard_map``, 4 workers average ``[3, 1, 0.1, -0.3]`` in one block: the scale
      is 3/16, and 1, 0.1, -0.3 (16/3, 8/15 and -8/5 in its units) come back as 4, 1/2 and
      -2 units:

      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = ddl.make_mesh(data=4)
      >>> reducer = ddl.compression.cast_e3m0(block_size=4)
      >>> def worker(g):
      ...     mean, _ = reducer.update(g[0], reducer.init(g[0]))
      ...     return mean
      >>> grads = jnp.tile(jnp.array([3.0, 1.0, 0.1, -0.3]), (4, 1))
      >>> grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
      >>> print(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P())(grads))
      [ 3.       0.75     0.09375 -0.375  ]
    """
    check_axis_name("cast_e3m0", axis)
    ok = not isinstance(block_size, bool | np.bool_)
    try:
        if ok:
            block_size = check_int("cast_e3m0: block_size", block_size, minimum=2)
    except ValueError:
        ok = False
    if not ok or block_size % 2:
        raise ValueError(f"cast_e3m0: block_size must be an even int >= 2, got {block_size!r}.")
    rounding = check_rounding("cast_e3m0", rounding)
    seed = check_int("cast_e3m0: seed", seed)
    stochastic = rounding == "stochastic"

    def init(params) -> E3M0State:
        del params
        return E3M0State(jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32))

    def update(updates, state: E3M0State, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        key_send = key_owner = None
        if stochastic:
            key = jax.random.fold_in(jax.random.key(seed), state.step)
            key_send, key_owner = jax.random.split(jax.random.fold_in(key, lax.axis_index(axis)))
        length = padded_size(view.size, n * block_size)
        chunks = view.ravel(updates, length, jnp.float32).reshape(n, -1, block_size)
        codes, scales = quantise_e3m0(chunks, key_send)
        received = dequantise_e3m0(
            wire.scatter_to_owners(codes, axis), wire.scatter_to_owners(scales, axis)
        )
        mine = received.sum(axis=0) / n
        codes, scales = quantise_e3m0(mine, key_owner)
        out = dequantise_e3m0(
            wire.gather_from_owners(codes, axis), wire.gather_from_owners(scales, axis)
        )
        wire_bytes = 2 * (n - 1) / n * (length // 2 + 4 * length // block_size)
        new_state = E3M0State(state.step + 1, wire.ratio(view.size, wire_bytes, n))
        return wire.unravel_updates(view, out.reshape(-1)), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)
