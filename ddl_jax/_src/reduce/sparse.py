"""Sparsifying reducers: Strom's threshold codes and top-k with the DGC additions.

Both keep an error-feedback residual per worker and all-gather a fixed-size payload
(``all_gather``, so each device sends ``(N-1) x`` its payload): a static shape is what an
SPMD program can compile, so the payload has a capacity of k entries and whatever does not
fit waits in the residual. The gathered payloads are typed invariant over the axis, so
both are plain optax transforms (``optax.chain`` composes them).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.strategy import check_bool, check_int, check_real
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import check_axis_name

# DGC's warm-up: the density falls exponentially, 25% -> 6.25% -> 1.56% -> 0.39%, in four
# equal phases, before the target density.
WARMUP_DENSITIES = (0.25, 0.25**2, 0.25**3, 0.25**4)


def check_fraction(name: str, value: Any) -> float:
    """``value`` in (0, 1]: ``check_real`` bounds are all open or all closed, so two calls."""
    return check_real(name, check_real(name, value, minimum=0, exclusive=True), maximum=1)


def check_size(fn: str, view: FlatView, residual: jax.Array) -> None:
    if view.size != residual.size:
        raise ValueError(
            f"{fn}: the updates have {view.size} entries but reducer.init built the state for "
            f"{residual.size}: update must see the parameters init saw. (A gradient sharded "
            "over another mesh axis, as in ddl.tensor_parallel, is not supported: use "
            "ddl.allreduce_mean() there.)"
        )


def entries_kept(fraction: float, size: int) -> int:
    return min(size, max(1, math.ceil(fraction * size)))


class ThresholdState(NamedTuple):
    """Per-worker state of :func:`threshold`.

    Attributes:
      residual: the worker's accumulated unsent update ``r``, flat float32 ``[D]``.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    residual: jax.Array
    compression_ratio: jax.Array


#: The code a worker whose residual is not finite sends (valid codes are >= 0, -1 empty).
_NON_FINITE = -2


def threshold(
    tau: float, *, capacity: float = 0.01, axis: str = "data"
) -> optax.GradientTransformation:
    """Strom's threshold quantisation: send ``+-tau`` where the residual passes ``tau``.

    Each worker accumulates ``r <- r + g_i``; every entry j with ``|r_j| >= tau`` is sent
    as one 32-bit code (index and sign bit, ``2 j + [r_j < 0]``) meaning ``sign(r_j) tau``,
    and ``r_j <- r_j - sign(r_j) tau``. Workers all-gather their codes and
    ``g = (1/N) sum_i decode(codes_i)``. At most ``capacity * D`` entries (the largest
    ``|r_j|``) leave a worker per step; the others wait in ``r``, so
    ``sum_t g_t + mean_i r_i = mean_i sum_t g_{i,t}`` always.

    Each device sends ``(N-1) * 4 * ceil(capacity * D)`` bytes. A worker whose residual
    holds NaN or inf sends the code ``-2`` instead, and every worker's update is NaN, as a
    dense mean's would be (``fit`` stops on it, or skips the step with ``skip_nonfinite``);
    as a code it would never leave the residual (NaN) or leave it as ``+-tau`` every step
    (inf).

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud computing",
      Interspeech 2015.

    Args:
      tau: the threshold, finite and > 0, in gradient units; also the magnitude of every
        entry sent.
      capacity: the largest fraction of the D entries a worker sends per step, in (0, 1].
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``ThresholdState``.
    """
    check_axis_name("threshold", axis)
    tau = check_real("threshold: tau", tau, minimum=0, exclusive=True)
    capacity = check_fraction("threshold: capacity", capacity)

    def init(params) -> ThresholdState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return ThresholdState(zeros, jnp.ones((), jnp.float32))

    def update(updates, state: ThresholdState, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("threshold", view, state.residual)
        if 2 * view.size >= 2**31:
            raise ValueError(f"threshold: {view.size} entries do not fit 31-bit codes.")
        k = entries_kept(capacity, view.size)
        r = state.residual + view.ravel(updates, dtype=jnp.float32)
        _, index = lax.top_k(jnp.abs(r), k)
        picked = r[index]
        send = jnp.abs(picked) >= tau
        negative = picked < 0
        codes = jnp.where(send, 2 * index + negative, -1).astype(jnp.int32)
        codes = jnp.where(jnp.isfinite(r).all(), codes, _NON_FINITE)
        r = r.at[index].add(-jnp.where(send, jnp.where(negative, -tau, tau), 0.0))

        codes = wire.gather_from_owners(codes, axis).reshape(-1)
        valid = codes >= 0
        values = jnp.where(valid, jnp.where(codes & 1, -tau, tau), 0.0)
        out = jnp.zeros(view.size, jnp.float32).at[jnp.where(valid, codes >> 1, 0)].add(values)
        out = jnp.where((codes == _NON_FINITE).any(), jnp.nan, out)
        new_state = ThresholdState(r, wire.ratio(view.size, (n - 1) * 4 * k, n))
        return wire.unravel_updates(view, out / n), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)


class TopKState(NamedTuple):
    """Per-worker state of :func:`top_k`.

    Attributes:
      residual: the accumulated unsent update ``v``, flat float32 ``[D]`` (in the order of
        ``jax.tree.leaves``); zero on the entries of tensors that travel dense.
      momentum: the corrected momentum ``u``, flat float32 ``[D]``; on a dense tensor's
        entries, the momentum of the averaged gradient (the same on every worker).
        ``EmptyState`` when ``momentum == 0``.
      step: exchanges so far (int32), for the sparsity warm-up and the samples' keys.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    residual: jax.Array
    momentum: Any
    step: jax.Array
    compression_ratio: jax.Array


SCOPES = ("tensor", "model")


def _layout(
    view: FlatView, scope: str, compress_1d: bool, ratio: float
) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int]]]:
    """The selection groups and the dense tensors, as ``(offset, size)`` slices of the flat
    vector: one group per compressed tensor (``scope="tensor"``) or one for all of them.
    At ``ratio=1`` every tensor is dense (the reference compresses only below 1)."""
    sparse, dense, offset = [], [], 0
    for shape in view.shapes:
        size = math.prod(shape)
        if size:
            compressed = ratio < 1 and (len(shape) > 1 or compress_1d)
            (sparse if compressed else dense).append((offset, size))
        offset += size
    groups = [[s] for s in sparse] if scope == "tensor" else ([sparse] if sparse else [])
    return groups, dense


def _select(v: jax.Array, group: list[tuple[int, int]], k: int) -> jax.Array:
    """Flat int32 indices of the k entries of largest ``|v|`` among ``group``'s slices."""
    if len(group) == 1:
        (offset, size) = group[0]
        _, local = lax.top_k(jnp.abs(lax.slice_in_dim(v, offset, offset + size)), k)
        return local.astype(jnp.int32) + offset
    if sum(s for _, s in group) == v.size:  # every entry: no gather
        _, index = lax.top_k(jnp.abs(v), k)
        return index.astype(jnp.int32)
    segment = jnp.concatenate([lax.slice_in_dim(v, o, o + s) for o, s in group])
    _, local = lax.top_k(jnp.abs(segment), k)
    return _segment_to_flat(local, group)


def _segment_to_flat(local: jax.Array, group: list[tuple[int, int]]) -> jax.Array:
    """Indices into the concatenation of ``group``'s slices, as indices of the flat vector."""
    # Entry j of the segment lies in slice i = (the last start <= j): at offset_i + j - start_i.
    starts = np.cumsum([0] + [s for _, s in group[:-1]]).astype(np.int32)
    shift = np.array([o for o, _ in group], np.int32) - starts
    slice_of = jnp.searchsorted(jnp.asarray(starts), local, side="right") - 1
    return (local + jnp.asarray(shift)[slice_of]).astype(jnp.int32)


# DGCCompressor's adaptation of the sampled threshold, its defaults (dgc/compression.py),
# which configs/dgc/__init__.py keeps.
COMPRESS_UPPER_BOUND = 1.3
COMPRESS_LOWER_BOUND = 0.8
MAX_ADAPTATION_ITERS = 10
MIN_SAMPLE_RATIO = 0.01  # DGCCompressor: min(max(sample_ratio, 0.01), 1.0)


class SamplePlan(NamedTuple):
    """``DGCCompressor.initialize``'s attributes of one selection of ``numel`` entries:
    ``num_selects`` entries sent (the static payload), the threshold the
    ``top_k_samples``-th largest of ``num_samples`` sampled ``|v|`` (every
    ``sample_stride``-th entry, or drawn uniformly)."""

    numel: int
    num_selects: int
    num_samples: int
    top_k_samples: int
    sample_stride: int


def sample_plan(numel: int, ratio: float, sample_ratio: float) -> SamplePlan:
    """``DGCCompressor.initialize``, line for line: at least ``max(sample_ratio numel,
    2 / ratio)`` samples, at a stride of 1 mod 8, or every entry of a tensor of at most
    ``2 / ratio`` entries (and at ``sample_ratio=1``)."""
    if sample_ratio < 1.0:
        pct_numel = math.ceil(numel * sample_ratio)
        cpr_numel = math.ceil(2 / ratio)
        if numel <= cpr_numel:
            sample_stride, num_samples = 1, numel
        else:
            sample_stride = math.ceil(numel / max(pct_numel, cpr_numel) / 32) * 32 + 1
            num_samples = numel // sample_stride
            while num_samples < max(pct_numel, cpr_numel):  # ends by stride 1 at the latest
                sample_stride -= 8
                num_samples = numel // sample_stride
    else:
        sample_stride, num_samples = 1, numel
    return SamplePlan(
        numel=numel,
        num_selects=math.ceil(numel * ratio),
        num_samples=num_samples,
        top_k_samples=math.ceil(num_samples * ratio),
        sample_stride=sample_stride,
    )


def sparsify(
    x: jax.Array,
    key: jax.Array,
    plan: SamplePlan,
    strided: bool,
    *,
    upper: float = COMPRESS_UPPER_BOUND,
    lower: float = COMPRESS_LOWER_BOUND,
    max_iters: int = MAX_ADAPTATION_ITERS,
    resample: bool = True,
) -> jax.Array:
    """``DGCCompressor._sparsify`` of the flat ``x``: int32 ``[plan.num_selects]``, the
    indices sent in its first slots, ``plan.numel`` in the unused ones.

    The threshold is the smallest of the ``top_k_samples`` largest sampled ``|x|``; every
    entry at or above it passes. While fewer than ``lower * num_selects`` pass, the
    threshold is multiplied by ``lower``; once more than ``upper * num_selects`` pass, the
    ``num_selects`` largest of them are sent (``resample``; without it the threshold is
    multiplied by ``upper``), at most ``max_iters`` times. Otherwise the first
    ``num_selects`` passing entries in index order are sent (``indices[:num_selects]``),
    fewer when fewer pass.
    """
    numel, k = plan.numel, plan.num_selects
    importance = jnp.abs(x)
    if plan.num_samples == numel:
        samples = importance
    elif strided:
        # importance[start::stride]: num_samples or num_samples + 1 entries, by the start.
        start = jax.random.randint(key, (), 0, plan.sample_stride)
        at = start + plan.sample_stride * jnp.arange(plan.num_samples + 1)
        samples = jnp.where(at < numel, importance[jnp.minimum(at, numel - 1)], -jnp.inf)
    else:
        samples = importance[jax.random.randint(key, (plan.num_samples,), 0, numel)]
    threshold = lax.top_k(samples, plan.top_k_samples)[0][-1]

    def passing(t: jax.Array) -> jax.Array:
        return jnp.sum(importance >= t, dtype=jnp.int32)

    count = passing(threshold)
    resampled = count < 0  # False, typed as the data are
    if numel > plan.num_samples:
        # The counts against Python floats, as the reference compares them: an integer is
        # above x exactly when above floor(x), below x exactly when below ceil(x).
        too_many = math.floor(k * upper)
        too_few = math.ceil(k * lower)

        def body(carry):
            # One pass of the reference's loop: it stops unless too few pass (lower the
            # threshold) or, without resample, too many (raise it); too many with
            # resample stops it and resamples. Between num_selects and the bounds: stop.
            i, t, c, _, _ = carry
            over, under = c > too_many, c < too_few
            t = jnp.where(under, t * jnp.float32(lower), t)
            if resample:
                again, resampled = under, over
            else:
                again, resampled = under | over, c < 0
                t = jnp.where(over, t * jnp.float32(upper), t)
            c = jnp.where(again, passing(t), c)
            return i + 1, t, c, ~again, resampled

        def cond(carry):
            i, _, _, done, _ = carry
            return (i < max_iters) & ~done

        carry = (jnp.zeros((), jnp.int32), threshold, count, resampled, resampled)
        _, threshold, count, _, resampled = lax.while_loop(cond, body, carry)

    def first_passing():
        # jnp.nonzero's first k in index order: the reference's indices[:num_selects].
        (index,) = jnp.nonzero(importance >= threshold, size=k, fill_value=numel)
        return index.astype(jnp.int32)

    def largest():
        # The num_selects largest of the passing entries, which are more than num_selects
        # and include every entry larger than the threshold: the top num_selects of all.
        return lax.top_k(importance, k)[1].astype(jnp.int32)

    if numel == plan.num_samples:
        return first_passing()
    return lax.cond(resampled, largest, first_passing)


def _select_sampled(
    v: jax.Array, group: list[tuple[int, int]], plan: SamplePlan, strided: bool, key: jax.Array
) -> jax.Array:
    """Flat int32 indices of the entries :func:`sparsify` sends of ``group``'s slices taken
    as one tensor, ``v.size`` in the unused slots."""
    if len(group) == 1:
        (offset, size) = group[0]
        local = sparsify(lax.slice_in_dim(v, offset, offset + size), key, plan, strided)
        return jnp.where(local < size, local + offset, v.size)
    if plan.numel == v.size:  # every entry: no gather, and the unused slots are v.size
        return sparsify(v, key, plan, strided)
    segment = jnp.concatenate([lax.slice_in_dim(v, o, o + s) for o, s in group])
    local = sparsify(segment, key, plan, strided)
    return jnp.where(local < plan.numel, _segment_to_flat(local, group), v.size)


def _take(x: jax.Array, slices: list[tuple[int, int]]) -> jax.Array:
    return jnp.concatenate([lax.slice_in_dim(x, o, o + s) for o, s in slices])


def _put(x: jax.Array, slices: list[tuple[int, int]], values: jax.Array) -> jax.Array:
    start = 0
    for o, s in slices:
        x = lax.dynamic_update_slice_in_dim(x, values[start : start + s].astype(x.dtype), o, 0)
        start += s
    return x


def top_k(
    ratio: float,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_steps: int = 0,
    scope: str = "tensor",
    compress_1d: bool = False,
    sample_ratio: float = 0.01,
    strided_sample: bool = True,
    seed: int = 0,
    axis: str = "data",
) -> optax.GradientTransformation:
    """Top-k sparsification with error feedback and Deep Gradient Compression's additions.

    As the DGC authors' code does it, by default: each tensor of two or more dimensions
    sends its own k = ``ceil(ratio * numel)`` entries (at least 1), so a layer whose
    gradients are much smaller than its neighbours' still moves; vectors and scalars
    (biases, norms) are all-reduced dense and take their momentum after the average.

    Each worker (optionally) clips its gradient to ``clip_norm`` (local gradient clipping),
    accumulates ``u <- m u + g_i`` (momentum correction; ``u = g_i`` when ``m = 0``; with
    ``nesterov``, ``u <- m (u + g_i)`` and ``v`` takes ``u + g_i``) and ``v <- v + u``,
    sends up to k entries of each compressed tensor, those of largest ``|v|`` as a sampled
    threshold finds them (below), as float32 values and int32 indices, and zeroes them (those
    sent only) in ``v`` and (momentum factor masking) ``u``. Workers all-gather the pairs
    and ``g = (1/N) sum_i sparse_i``. A dense tensor's output is
    ``u <- m u + mean_i g_i`` (Nesterov: ``u <- m (u + mean_i g_i)``, output
    ``u + mean_i g_i``). With ``momentum > 0`` the momentum lives here: follow with plain
    ``optax.sgd(lr)`` (the reference's weight decay, with its own momentum outside the
    compressed one, is :func:`dgc_weight_decay` in that optimizer). With ``m = 0``,
    ``sum_t g_t + mean_i v_i = mean_i sum_t g_{i,t}`` always. With ``warmup_steps`` W the
    density falls 25%, 6.25%, 1.56%, 0.39% over four W/4-step phases before reaching
    ``ratio`` (each phase is a branch of its own payload size in the compiled program).

    The selection is the authors' (``DGCCompressor._sparsify``), by default: the threshold
    is the ``ceil(ratio * S)``-th largest ``|v|`` of S sampled entries of the tensor, every
    ``stride``-th from a random start (``strided_sample``) or S drawn uniformly with
    replacement; S is at least ``max(sample_ratio * numel, 2 / ratio)``, the stride
    ``32 ceil(numel / S / 32) + 1``, lowered by 8 until it gives that many
    (``DGCCompressor.initialize``); a tensor of at most ``2 / ratio`` entries is its own
    sample. The entries with ``|v|`` at or above the threshold pass. While fewer than
    ``0.8 k`` pass, the threshold is multiplied by 0.8, at most 10 times; if more than
    ``1.3 k`` pass, the k largest of them (the exact top-k) are sent; else the first k
    passing entries in index order, fewer if fewer pass. The sample of compressed tensor j
    (in ``jax.tree.leaves`` order) at exchange t starts at
    ``jax.random.randint(fold_in(fold_in(key(seed), t), j), (), 0, stride)`` (uniform:
    ``randint(that key, (S,), 0, numel)``): the same on every worker, as the authors'
    ranks, which all seed Python's ``random`` and torch alike, draw the same.
    ``sample_ratio=1`` selects the exact top-k (``lax.top_k``, ties to the lower index).

    ``scope="model", compress_1d=True`` is this reducer's earlier default: one selection
    over the flattened model (``k = ceil(ratio * D)``), every tensor sparsified; it starves
    layers whose gradients are small next to others'. The reference has no such scope: the
    sampled threshold takes the compressed entries together as one tensor (j = 0).

    Each device sends ``(N-1) * 8 * sum_t k_t`` bytes for the compressed tensors plus a
    ring all-reduce's ``2 (N-1)/N * 4 * D_dense`` for the dense ones: at ``ratio=0.001``,
    N=8, about 125x less than a float32 ring for a model of matrices. The payload is static,
    k slots per tensor however many the threshold fills (an unused slot carries index D
    and value 0, which no one adds and nothing masks); ``compression_ratio`` and
    ``ddl.comm_stats`` count all k: the reference's all-gather of what passes sends at most
    this. ``ratio=1`` compresses nothing, as the reference (``compress_ratio < 1.0``): every
    tensor is all-reduced and takes its momentum after the average; with ``m = 0``, the
    exact mean. A worker whose ``v`` holds NaN or inf sends NaN in every slot (at entry 0),
    so every worker's update is non-finite, as a dense mean's would be (``fit`` stops on
    it, or skips the step with ``skip_nonfinite``); the reference's selection keeps a NaN
    in ``v`` for good, never sent (``|v| >= threshold`` is false for it).

    Differences from the reference: the payload's static size, above. The samples come
    from JAX's keys, not Python's ``random`` and torch's generator; when more than
    ``1.3 k`` pass, ties at the k-th largest ``|v|`` go to the lower index (torch's
    ``topk`` leaves them unordered). ``sample_ratio=1`` is exact top-k, where the
    reference's (the exact k-th largest as threshold) sends the first k in index order of
    the entries at or above it: the two differ only where ``|v|`` ties at the k-th value.
    The bounds 1.3 and 0.8, the 10 adaptations and resampling are the reference's defaults
    (kept by its configs), not options. Their ``gradient_clipping`` hook clips each tensor;
    ``clip_norm`` clips the worker's whole gradient (the paper's local clipping). Their
    warm-up lowers the density per epoch by a factor ``ratio^(1/(E+1))``; ``warmup_steps``
    follows the paper's schedule (each density with its own samples and strides, as the
    reference re-initialises at each).

    References:
      Aji & Heafield, "Sparse communication for distributed gradient descent", EMNLP 2017,
      arXiv:1704.05021.
      Lin et al., "Deep gradient compression: reducing the communication bandwidth for
      distributed training", ICLR 2018, arXiv:1712.01887; the authors' code,
      github.com/synxlin/deep-gradient-compression: ``dgc/compression.py``
      (``DGCCompressor``; its defaults in ``configs/dgc/__init__.py``), ``dgc/memory.py``
      (``DGCSGDMemory``), ``dgc/optim/sgd.py`` (``DGCSGD``) and ``train.py`` (only
      ``param.dim() > 1`` is compressed; ``random.seed(configs.seed)`` on every rank).

    Args:
      ratio: density k / numel of each compressed tensor (of the compressed entries
        together with ``scope="model"``), in (0, 1].
      momentum: m, DGC's corrected momentum in [0, 1); 0 is plain top-k with error feedback.
      nesterov: Nesterov momentum correction (``DGCSGDMemory(nesterov=True)``); needs
        ``momentum > 0``.
      momentum_masking: zero the sent entries of ``u`` as well as of ``v`` (the
        reference's ``momentum_masking``, on by default there too).
      clip_norm: each worker's gradient is scaled to at most this L2 norm (DGC uses the
        global clipping threshold times ``N^-1/2``); ``None`` does not clip.
      warmup_steps: W, steps of DGC's exponential sparsity warm-up, >= 0.
      scope: ``"tensor"``: k entries per tensor, as the reference; ``"model"``: one
        selection over all compressed entries together.
      compress_1d: also sparsify tensors of fewer than two dimensions (vectors, scalars);
        ``False`` (the reference's ``dim() > 1``) all-reduces them dense.
      sample_ratio: the fraction of each compressed tensor's entries sampled for its
        threshold (at least ``2 / ratio`` of them), in [0.01, 1], the reference's
        ``sample_ratio`` (it raises smaller values to 0.01); 1 selects the exact top-k.
      strided_sample: sample every ``stride``-th entry from a random start, as the
        reference's default; ``False`` samples uniformly, with replacement.
      seed: an int, the key of the samples.
      axis: the mesh axis the workers live on.

    Returns:
      A reducer whose per-worker state is a ``TopKState``.

    Example:
      A strategy's ``reducer=``, here after clipping each worker's gradient, with plain
      ``optax.chain``; 8 of the 64 entries leave each of the 4 workers:

      >>> import jax, jax.numpy as jnp, numpy as np, optax, ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> params = {"w": jnp.zeros((16, 4))}
      >>> batch = {"x": np.ones((8, 16), np.float32), "y": np.ones((8, 4), np.float32)}
      >>> reducer = optax.chain(optax.clip_by_global_norm(1.0), ddl.compression.top_k(0.125))
      >>> mesh = ddl.make_mesh(data=4)
      >>> strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), mesh, reducer=reducer)
      >>> state, metrics = jax.jit(strategy.step)(strategy.init(params), batch)
      >>> print(metrics["compression_ratio"])  # a dense float32 ring's bytes / bytes sent
      2.0
    """
    check_axis_name("top_k", axis)
    ratio = check_fraction("top_k: ratio", ratio)
    # [0, 1): momentum 1 would never forget a gradient.
    momentum = check_real("top_k: momentum", momentum, minimum=0)
    momentum = check_real("top_k: momentum", momentum, maximum=1, exclusive=True)
    nesterov = check_bool("top_k: nesterov", nesterov)
    if nesterov and not momentum:
        raise ValueError("top_k: nesterov needs momentum > 0, got momentum=0.")
    momentum_masking = check_bool("top_k: momentum_masking", momentum_masking)
    if clip_norm is not None:
        clip_norm = check_real("top_k: clip_norm (or None)", clip_norm, minimum=0, exclusive=True)
    warmup_steps = check_int("top_k: warmup_steps", warmup_steps, minimum=0)
    if scope not in SCOPES:
        raise ValueError(f"top_k: scope must be 'tensor' or 'model', got {scope!r}")
    compress_1d = check_bool("top_k: compress_1d", compress_1d)
    sample_ratio = check_real(
        "top_k: sample_ratio", sample_ratio, minimum=MIN_SAMPLE_RATIO, maximum=1
    )
    strided_sample = check_bool("top_k: strided_sample", strided_sample)
    seed = check_int("top_k: seed", seed)
    sampled = sample_ratio < 1
    densities = [max(ratio, d) for d in WARMUP_DENSITIES] if warmup_steps else []
    densities.append(ratio)

    def init(params) -> TopKState:
        zeros = jnp.zeros(FlatView.of(params).size, jnp.float32)
        return TopKState(
            residual=zeros,
            momentum=zeros if momentum else optax.EmptyState(),
            step=jnp.zeros((), jnp.int32),
            compression_ratio=jnp.ones((), jnp.float32),
        )

    def update(updates, state: TopKState, params=None):
        del params
        n = check_axis_in_scope(axis)
        view = FlatView.of(updates)
        check_size("top_k", view, state.residual)
        groups, dense = _layout(view, scope, compress_1d, ratio)
        g = view.ravel(updates, dtype=jnp.float32)
        if clip_norm is not None:
            g = g * jnp.minimum(1.0, clip_norm / jnp.maximum(jnp.linalg.norm(g), 1e-30))
        # DGCSGDMemory.compensate(accumulate=True), on every entry; the dense tensors'
        # entries are replaced below.
        if nesterov:
            u = momentum * (state.momentum + g)
            v = state.residual + u + g
        elif momentum:
            u = momentum * state.momentum + g
            v = state.residual + u
        else:
            u, v = None, state.residual + g

        out = jnp.zeros(view.size, jnp.float32)
        dense_bytes = 0.0
        if dense:
            # All-reduced, then DGCSGDMemory.compensate(accumulate=False). The old momentum
            # is the same on every worker but typed per worker, so it rides in the one
            # all-reduce: mean_i (m u + g_i) = m u + mean_i g_i, typed invariant.
            g_dense = _take(g, dense)
            if momentum:
                u_old = _take(state.momentum, dense)
                scale = 1.0 + momentum if nesterov else 1.0
                sent = lax.pmean(momentum * u_old + scale * g_dense, axis)
                # Nesterov: sent = m u + (1 + m) mean g, so the new m (u + mean g) is
                # m (u + sent) / (1 + m).
                u_dense = (u_old + sent) * (momentum / scale) if nesterov else sent
                u = _put(u, dense, u_dense)
            else:
                sent = lax.pmean(g_dense, axis)
            out = _put(out, dense, sent)
            v = _put(v, dense, jnp.zeros(sum(s for _, s in dense), jnp.float32))
            dense_bytes = 2 * (n - 1) / n * 4 * sum(s for _, s in dense)

        # The sample's key: the same on every worker (the reference seeds Python's random
        # alike on every rank), one per exchange and selection.
        key = jax.random.fold_in(jax.random.key(seed), state.step) if sampled else None

        def exchange(density: float):
            ks = [entries_kept(density, sum(s for _, s in group)) for group in groups]
            plans = [sample_plan(sum(s for _, s in g), density, sample_ratio) for g in groups]

            def run(out, v, u):
                if groups:
                    if sampled:
                        # Up to k entries each; the unused slots carry index D and value 0,
                        # which the scatters below drop: not sent, not masked.
                        index = jnp.concatenate(
                            [
                                _select_sampled(
                                    v, group, plan, strided_sample, jax.random.fold_in(key, j)
                                )
                                for j, (group, plan) in enumerate(zip(groups, plans, strict=True))
                            ]
                        )
                        picked = jnp.where(index < view.size, v[index], 0.0)
                    else:
                        index = jnp.concatenate(
                            [_select(v, group, k) for group, k in zip(groups, ks, strict=True)]
                        )
                        picked = v[index]
                    # a non-finite residual is sent as NaN in every slot, at entry 0: as
                    # an entry, a NaN would never pass (|v| >= threshold is false for it)
                    bad = ~jnp.isfinite(v).all()
                    index, picked = jnp.where(bad, 0, index), jnp.where(bad, jnp.nan, picked)
                    values = wire.gather_from_owners(picked, axis).reshape(-1)
                    indices = wire.gather_from_owners(index, axis).reshape(-1)
                    out = out.at[indices].add(values / n, mode="drop")
                    v = v.at[index].set(0.0, mode="drop")
                    if momentum and momentum_masking:
                        u = u.at[index].set(0.0, mode="drop")
                wire_bytes = (n - 1) * 8 * sum(ks) + dense_bytes
                return out, v, u, wire.ratio(view.size, wire_bytes, n)

            return run

        branches = [exchange(d) for d in densities]
        if warmup_steps:
            # The step counts the same exchanges on every worker, so all take one branch;
            # JAX types a switch's outputs by its branches' (invariant) outputs.
            phase = jnp.minimum(state.step * 4 // warmup_steps, 4)
            out, v, u, compression = lax.switch(phase, branches, out, v, u)
        else:
            out, v, u, compression = branches[0](out, v, u)
        new_state = TopKState(
            residual=v,
            momentum=u if momentum else state.momentum,
            step=state.step + 1,
            compression_ratio=compression,
        )
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)


class DGCWeightDecayState(NamedTuple):
    """State of :func:`dgc_weight_decay`: the decay's momentum buffer, like the parameters
    (``EmptyState`` when ``momentum == 0``)."""

    buffer: Any


def dgc_weight_decay(
    weight_decay: float, *, momentum: float = 0.0, nesterov: bool = False
) -> optax.GradientTransformation:
    """DGC's weight decay, outside the compressed momentum: put it in the optimizer after
    :func:`top_k`, ``optax.chain(dgc_weight_decay(wd, momentum=m), optax.sgd(lr))``.

    Adds ``b <- m b + wd p`` (Nesterov: ``wd p + m b``; ``wd p`` when ``m = 0``) to the
    update, as ``DGCSGD.step`` does before adding the reducer's output (which already
    carries its own momentum), in github.com/synxlin/deep-gradient-compression
    ``dgc/optim/sgd.py`` (``dampening=0``). It is an optimizer, not part of the reducer:
    the parameters are the same on every worker, so it needs no communication.

    Args:
      weight_decay: wd, >= 0.
      momentum: m in [0, 1), the optimizer's momentum (the reference uses top_k's).
      nesterov: the Nesterov form; needs ``momentum > 0``.

    Returns:
      An optax transform that needs ``params`` in ``update``.
    """
    weight_decay = check_real("dgc_weight_decay: weight_decay", weight_decay, minimum=0)
    momentum = check_real("dgc_weight_decay: momentum", momentum, minimum=0)
    momentum = check_real("dgc_weight_decay: momentum", momentum, maximum=1, exclusive=True)
    nesterov = check_bool("dgc_weight_decay: nesterov", nesterov)
    if nesterov and not momentum:
        raise ValueError("dgc_weight_decay: nesterov needs momentum > 0, got momentum=0.")

    def init(params) -> DGCWeightDecayState:
        if not momentum:
            return DGCWeightDecayState(optax.EmptyState())
        return DGCWeightDecayState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state: DGCWeightDecayState, params=None):
        if params is None:
            raise ValueError("dgc_weight_decay: weight_decay needs the parameters: pass params.")
        decay = jax.tree.map(lambda p: weight_decay * p, params)
        if not momentum:
            return jax.tree.map(jnp.add, updates, decay), state
        buffer = jax.tree.map(lambda b, d: momentum * b + d, state.buffer, decay)
        # DGCSGD: d_p = buf, or d_p + m buf with Nesterov.
        decay = jax.tree.map(lambda d, b: d + momentum * b, decay, buffer) if nesterov else buffer
        out = jax.tree.map(lambda u, d: (u + d).astype(u.dtype), updates, decay)
        return out, DGCWeightDecayState(buffer)

    return optax.GradientTransformation(init, update)
