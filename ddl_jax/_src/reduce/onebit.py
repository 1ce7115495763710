"""1-bit Adam: Adam whose momentum, once the variance is frozen, is all-reduced in 1 bit.

A reducer (run inside the strategy's ``shard_map``) holding Adam's moments and returning
Adam's direction: follow it with a plain ``optax.sgd(lr)``. The compressed all-reduce is
``sign``'s (DeepSpeed's ``compressed_allreduce``), applied to the momentum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ddl_jax._src.core.reducer import PermuteReducer
from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.reduce import wire
from ddl_jax._src.reduce.collectives import check_axis_in_scope
from ddl_jax._src.reduce.quantise import (
    check_axis_name,
    check_exp_avg_mask,
    check_padding,
    compressed_allreduce,
)


class OnebitAdamState(NamedTuple):
    """Per-worker state of :func:`onebit_adam`.

    Attributes:
      count: int32 scalar, the steps taken.
      mu: Adam's momentum ``m`` (float32, shaped like the params): the same on every
        worker, the compressed all-reduce's output once the variance is frozen.
      nu: Adam's variance ``v`` (float32, shaped like the params), constant after step
        ``freeze_step``.
      residual: the worker's error-feedback residual ``e`` of the momentum.
      owner_residual: the residual ``e'`` of the momentum chunks this worker owns, in a
        params-shaped buffer of which it uses its own chunk.
      pad_residual: with ``padding="deepspeed"``, the value of every padding entry of
        ``e`` (they stay equal), a float32 scalar per tensor; 0 with ``"none"``.
      owner_pad_residual: likewise, the padding entries of the chunk of ``e'`` this
        worker owns (0 where it has none).
      compression_ratio: float32 scalar, see ``reducer_metrics`` (1 while warming up).
    """

    count: jax.Array
    mu: Any
    nu: Any
    residual: Any
    owner_residual: Any
    pad_residual: Any
    owner_pad_residual: Any
    compression_ratio: jax.Array


def onebit_adam(
    freeze_step: int,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    exp_avg_mask: Any = None,
    padding: str = "deepspeed",
    axis: str = "data",
) -> optax.GradientTransformation:
    """1-bit Adam (Tang et al.): full-precision Adam, then the variance frozen and the
    momentum all-reduced in 1 bit with error feedback.

    Update rule, on worker i with gradient ``g_i`` at step t (1-based):

    * warm-up, ``t <= freeze_step``: the gradients are averaged in float32,
      ``g = (1/N) sum_i g_i``; ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``.
    * compression, ``t > freeze_step``: ``v`` stays as it was after step ``freeze_step``;
      each worker updates the agreed momentum with its own gradient,
      ``m_i = b1 m + (1 - b1) g_i``, and ``m <- compressed_allreduce(m_i)``: ``sign``'s
      two-phase 1-bit all-reduce with worker and owner error feedback, scale
      ``||x||_2 / sqrt(d)`` per tensor, each tensor zero-padded as DeepSpeed (below;
      skipped on one worker, as DeepSpeed does).

    Every step returns ``u = m / (sqrt(v) + eps)``: no bias correction, ``eps`` outside
    the square root. The momentum lives here: follow with plain ``optax.sgd(lr)``
    (``theta <- theta - lr u``), or ``optax.chain(optax.add_decayed_weights(wd),
    optax.sgd(lr))`` for DeepSpeed's ``weight_decay`` (``u += wd theta``, decoupled, as
    DeepSpeed adds it to the update, not to the gradient). Preceding it with ``sign`` and
    following with ``optax.adam`` is the scheme 1-bit Adam avoids: the variance of
    compressed gradients is not Adam's.

    Each device sends ``2 (N-1)/N * 4 D`` bytes (a float32 ring) while warming up, then
    ``2 (N-1)/N * D'/8`` bytes of signs plus 8 per tensor and worker of scales, D' the
    padded size (each tensor's rounded up to a multiple of ``N * lcm(N, 8)``; of 8 N with
    ``padding="none"``).

    Follows ``deepspeed/runtime/fp16/onebit/adam.py`` (``OnebitAdam.step``) and
    ``deepspeed/runtime/comm/nccl.py`` (``NcclBackend.compressed_allreduce``) of
    github.com/deepspeedai/DeepSpeed, with these differences:

    * DeepSpeed's first ``step`` only allocates the error buffers: it discards the
      gradient, updates neither moment nor parameter, yet counts as step 1. So
      ``OnebitAdam(freeze_step=F)`` on gradients ``g_1, g_2, ...`` equals this reducer with
      ``freeze_step=F - 1`` on ``g_2, g_3, ...`` (F - 1 full-precision steps, then
      compression), which a test checks.
    * With ``padding="none"`` only: the padding is left out of the scales and residuals
      (the same on tensors whose size divides by ``N * lcm(N, 8)``). By default
      (``"deepspeed"``) it counts, as in DeepSpeed (below).
    * DeepSpeed's ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` are
      accepted there but unused, so they are absent here; ``non_freeze`` groups are not
      supported.

    **Padding.** ``OnebitAdam.step`` sizes each tensor's ``worker_error`` to its
    ``corrected_tensor_size``, the size rounded up to a multiple of ``N * lcm(N, 8)``
    (``size * divider``), and ``server_error`` to that over N; ``compressed_allreduce``
    zero-pads the momentum to it. So does this reducer (``padding="deepspeed"``): each
    tensor padded on its own, the padding counted in the worker's scale, the owners'
    chunks and scales and both residuals, the output cut back. The padding entries of a
    residual all hold one value (zeros in, elementwise updates), kept as one scalar per
    tensor (``pad_residual``, ``owner_pad_residual``), so the state does not depend on N.

    **Momentum mask.** 1-bit compression cannot send an exact zero, so an entry whose
    gradient is always 0 (an input never seen, a position never used) gets a momentum of
    +-scale that error feedback keeps alive, divided by a variance of 0 plus ``eps``: the
    parameters blow up within steps. DeepSpeed requires the user to pass such entries'
    mask, ``exp_avg_mask``, multiplied into the momentum after each compressed all-reduce;
    so does this reducer. Entries with a tiny but non-zero frozen variance (inputs seen
    rarely) take steps of the tensor's average momentum over that tiny root, which no mask
    helps: 1-bit Adam wants gradients of similar scale across a tensor (on the digits MLP,
    whose input pixels are mostly blank, it diverges a few steps after the freeze).

    The variance is worker state that JAX cannot prove agrees across workers (it does), so
    the output is typed varying: the reducer carries the ``PermuteReducer`` mark, and a
    strategy runs it without replication checks. Pass it as ``reducer=`` itself, or
    chained with ``ddl.chain`` (``optax.chain`` would hide the mark).

    References:
      Tang et al., "1-bit Adam: communication efficient large-scale training with Adam's
      convergence speed", ICML 2021, arXiv:2102.02888.

    Args:
      freeze_step: full-precision Adam steps before the variance freezes (>= 1).
      b1: the momentum's decay, in [0, 1).
      b2: the variance's decay, in [0, 1).
      eps: added to ``sqrt(v)``, > 0.
      exp_avg_mask: ``None`` (no mask) or a pytree of 0/1 arrays like the parameters
        (DeepSpeed's ``exp_avg_mask``, above).
      padding: ``"deepspeed"`` (DeepSpeed's zero-padding of each tensor to a multiple of
        ``N * lcm(N, 8)``, counted in the scales and residuals) or ``"none"`` (padding
        left out of them), above.
      axis: the mesh axis the workers live on, one a device (not with ``workers=``: the
        frozen variance is each worker's own copy).

    Returns:
      A reducer whose per-worker state is a ``OnebitAdamState``.

    Raises:
      ValueError: an argument out of range (the message names it).
    """
    check_axis_name("onebit_adam", axis)
    if not isinstance(axis, str):
        raise ValueError(
            "onebit_adam runs one worker a device: each worker's step divides by its own "
            "copy of the frozen variance, which a device's several workers (workers=) would "
            "each hold apart; drop workers= (or give as many devices as workers)."
        )
    freeze_step = check_int("onebit_adam: freeze_step", freeze_step, minimum=1)
    for name, beta in (("b1", b1), ("b2", b2)):
        check_real(f"onebit_adam: {name}", beta, minimum=0)
        check_real(f"onebit_adam: {name}", beta, maximum=1, exclusive=True)
    b1, b2 = float(b1), float(b2)
    eps = check_real("onebit_adam: eps", eps, minimum=0, exclusive=True)
    padding = check_padding("onebit_adam", padding)
    if isinstance(exp_avg_mask, str):
        raise ValueError(
            "onebit_adam: exp_avg_mask must be None or a pytree of 0/1 arrays like the "
            f"parameters, got {exp_avg_mask!r}."
        )

    def init(params) -> OnebitAdamState:
        check_exp_avg_mask("onebit_adam", exp_avg_mask, params)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        pads = jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
        one = jnp.ones((), jnp.float32)
        count = jnp.zeros((), jnp.int32)
        return OnebitAdamState(count, zeros, zeros, zeros, zeros, pads, pads, one)

    def update(updates, state: OnebitAdamState, params=None):
        del params
        n = check_axis_in_scope(axis)
        leaves, treedef = jax.tree.flatten(updates)
        grads = [g.astype(jnp.float32) for g in leaves]
        flat = [
            treedef.flatten_up_to(x)
            for x in (
                state.mu,
                state.nu,
                state.residual,
                state.owner_residual,
                state.pad_residual,
                state.owner_pad_residual,
            )
        ]

        def warm(mu, nu, *residuals):
            mean = [lax.pmean(g, axis) for g in grads]
            mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, mean, strict=True)]
            nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, mean, strict=True)]
            return mu, nu, *residuals, jnp.ones((), jnp.float32)

        def compressed(mu, nu, *residuals):
            local = [b1 * m + (1 - b1) * g for m, g in zip(mu, grads, strict=True)]
            if n == 1:
                return masked(local), nu, *residuals, jnp.ones((), jnp.float32)
            mu, *residuals, wire_bytes = compressed_allreduce(
                local, *residuals, axis, "l2", padding
            )
            ratio = wire.ratio(sum(g.size for g in grads), wire_bytes, n)
            return masked(mu), nu, *residuals, ratio

        def masked(mu):
            """The momentum times ``exp_avg_mask`` (after the all-reduce, as DeepSpeed)."""
            if exp_avg_mask is None:
                return mu
            masks = treedef.flatten_up_to(exp_avg_mask)
            return [m * jnp.asarray(k, m.dtype) for m, k in zip(mu, masks, strict=True)]

        try:
            mu, nu, *residuals, ratio = lax.cond(state.count < freeze_step, warm, compressed, *flat)
        except TypeError as error:  # run under shard_map's replication check
            if "branches must have equal output types" not in str(error):
                raise
            raise TypeError(
                "onebit_adam must run where a strategy skips shard_map's replication check "
                "(its frozen variance is each worker's own copy, equal on all, which JAX "
                "cannot prove): give it as reducer= as it is, or chained with ddl.chain(...); "
                "optax.chain hides the mark that asks for that."
            ) from None
        out = [
            (m / (jnp.sqrt(v) + eps)).astype(g.dtype)
            for m, v, g in zip(mu, nu, leaves, strict=True)
        ]
        new_state = OnebitAdamState(
            state.count + 1,
            *(treedef.unflatten(x) for x in (mu, nu, *residuals)),
            ratio,
        )
        return treedef.unflatten(out), new_state

    return PermuteReducer(init, update)
