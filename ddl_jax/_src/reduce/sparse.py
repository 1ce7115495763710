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
import optax
from jax import lax

from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.strategy import check_int, check_real
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

    Each device sends ``(N-1) * 4 * ceil(capacity * D)`` bytes.

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
        r = r.at[index].add(-jnp.where(send, jnp.where(negative, -tau, tau), 0.0))

        codes = wire.gather_from_owners(codes, axis).reshape(-1)
        valid = codes >= 0
        values = jnp.where(valid, jnp.where(codes & 1, -tau, tau), 0.0)
        out = jnp.zeros(view.size, jnp.float32).at[jnp.where(valid, codes >> 1, 0)].add(values)
        new_state = ThresholdState(r, wire.ratio(view.size, (n - 1) * 4 * k, n))
        return wire.unravel_updates(view, out / n), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)


class TopKState(NamedTuple):
    """Per-worker state of :func:`top_k`.

    Attributes:
      residual: the accumulated unsent update ``v``, flat float32 ``[D]``.
      momentum: the corrected momentum ``u``, flat float32 ``[D]``; ``EmptyState`` when
        ``momentum == 0``.
      step: exchanges so far (int32), for the sparsity warm-up.
      compression_ratio: float32 scalar, see ``reducer_metrics``.
    """

    residual: jax.Array
    momentum: Any
    step: jax.Array
    compression_ratio: jax.Array


def top_k(
    ratio: float,
    *,
    momentum: float = 0.0,
    clip_norm: float | None = None,
    warmup_steps: int = 0,
    axis: str = "data",
) -> optax.GradientTransformation:
    """Top-k sparsification with error feedback and Deep Gradient Compression's additions.

    Each worker (optionally) clips its gradient to ``clip_norm`` (local gradient clipping),
    accumulates ``u <- m u + g_i`` (momentum correction; ``u = g_i`` when ``m = 0``) and
    ``v <- v + u``, sends the k = ``ceil(ratio * D)`` entries of largest ``|v|`` as float32
    values and int32 indices, and zeroes them in ``v`` and ``u`` (momentum factor masking).
    Workers all-gather the pairs and ``g = (1/N) sum_i sparse_i``. With ``momentum > 0``
    the momentum lives here: follow with plain ``optax.sgd(lr)``. With ``m = 0``,
    ``sum_t g_t + mean_i v_i = mean_i sum_t g_{i,t}`` always. With ``warmup_steps`` W the
    density falls 25%, 6.25%, 1.56%, 0.39% over four W/4-step phases before reaching
    ``ratio`` (each phase is a branch of its own payload size in the compiled program).

    Each device sends ``(N-1) * 8 k`` bytes: at ``ratio=0.001``, N=8, 125x less than a
    float32 ring. ``ratio=1`` sends everything and is the exact mean.

    References:
      Aji & Heafield, "Sparse communication for distributed gradient descent", EMNLP 2017,
      arXiv:1704.05021.
      Lin et al., "Deep gradient compression: reducing the communication bandwidth for
      distributed training", ICLR 2018, arXiv:1712.01887.

    Args:
      ratio: density k / D, in (0, 1].
      momentum: m, DGC's corrected momentum in [0, 1); 0 is plain top-k with error feedback.
      clip_norm: each worker's gradient is scaled to at most this L2 norm (DGC uses the
        global clipping threshold times ``N^-1/2``); ``None`` does not clip.
      warmup_steps: W, steps of DGC's exponential sparsity warm-up, >= 0.
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
    if clip_norm is not None:
        clip_norm = check_real("top_k: clip_norm (or None)", clip_norm, minimum=0, exclusive=True)
    warmup_steps = check_int("top_k: warmup_steps", warmup_steps, minimum=0)
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
        g = view.ravel(updates, dtype=jnp.float32)
        if clip_norm is not None:
            g = g * jnp.minimum(1.0, clip_norm / jnp.maximum(jnp.linalg.norm(g), 1e-30))
        u = momentum * state.momentum + g if momentum else g
        v = state.residual + u

        def exchange(k: int):
            def run(v, u):
                _, index = lax.top_k(jnp.abs(v), k)
                values = wire.gather_from_owners(v[index], axis).reshape(-1)
                indices = wire.gather_from_owners(index, axis).reshape(-1)
                out = jnp.zeros(v.shape, jnp.float32).at[indices].add(values) / n
                u = u.at[index].set(0.0) if momentum else u
                wire_bytes = (n - 1) * 8 * k
                return out, v.at[index].set(0.0), u, wire.ratio(v.size, wire_bytes, n)

            return run

        branches = [exchange(entries_kept(d, view.size)) for d in densities]
        if warmup_steps:
            # The step counts the same exchanges on every worker, so all take one branch;
            # JAX types a switch's outputs by its branches' (invariant) outputs.
            phase = jnp.minimum(state.step * 4 // warmup_steps, 4)
            out, v, u, compression = lax.switch(phase, branches, v, u)
        else:
            out, v, u, compression = branches[0](v, u)
        new_state = TopKState(
            residual=v,
            momentum=u if momentum else state.momentum,
            step=state.step + 1,
            compression_ratio=compression,
        )
        return wire.unravel_updates(view, out), wire.typed_like(new_state, state)

    return optax.GradientTransformation(init, update)
