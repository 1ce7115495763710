"""Mixed precision: float32 master parameters, a low-precision forward and backward pass.

:func:`mixed_precision` wraps any loss a strategy trains (a plain ``loss_fn(params,
batch)`` or a ``ddl.ModelLoss``) so that it computes in ``compute_dtype`` while everything
the strategy keeps (parameters, gradients, optimizer state, model state) stays in its own
dtype. It is a change to the loss only, so it composes with every strategy; the precision
of the gradient reduction is the reducer's business (``ddl.compression.cast``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddl_jax._src.core.layer_scan import stand_for
from ddl_jax._src.core.model_loss import AnyLoss, ModelLoss, call_loss
from ddl_jax._src.core.strategy import check_real


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """``tree`` with its floating-point array leaves cast to ``dtype``; others untouched."""

    def one(x):
        if not _is_floating(x) or x.dtype == dtype:
            return x
        return jnp.asarray(x).astype(dtype)

    return jax.tree.map(one, tree)


def _widen(tree: Any) -> Any:
    """Floating leaves narrower than float32 (the loss, aux metrics) back to float32."""

    def one(x):
        if not _is_floating(x):
            return x
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return x if x.dtype == wide else jnp.asarray(x).astype(wide)

    return jax.tree.map(one, tree)


def _like(new: Any, old: Any) -> Any:
    """The returned model state in the dtypes of the state the loss received."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new  # the strategy names the mismatch

    def one(n, o):
        if _is_floating(n) and hasattr(o, "dtype") and n.dtype != o.dtype:
            return jnp.asarray(n).astype(o.dtype)
        return n

    return jax.tree.map(one, new, old)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_cotangent(tree: Any, factor: float) -> Any:
    """``tree``, whose gradient is multiplied by ``factor`` on its way back (a power of two:
    exact)."""
    return tree


def _scale_fwd(tree, factor):
    return tree, None


def _scale_bwd(factor, _, cotangents):
    # integer leaves' cotangents are float0 and stay as they are
    return (jax.tree.map(lambda g: g * factor if _is_floating(g) else g, cotangents),)


_scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def _scaled(out: Any, scale: float) -> Any:
    """The loss output ``out`` (the loss, or ``(loss, aux)``) with its loss scaled on the way
    back."""
    if isinstance(out, tuple | list) and len(out) == 2:
        return type(out)((_scale_cotangent(out[0], scale), out[1]))
    return _scale_cotangent(out, scale)


def _check_loss_scale(loss_scale: Any, dtype: jnp.dtype) -> float:
    """A finite power of two > 0 that the compute dtype holds (the gradient of the loss
    enters the low-precision pass as ``loss_scale``)."""
    scale = check_real("mixed_precision: loss_scale", loss_scale, minimum=0, exclusive=True)
    largest = float(jnp.finfo(dtype).max)
    if scale >= largest or math.frexp(scale)[0] != 0.5:
        raise ValueError(
            f"mixed_precision: loss_scale must be a power of two below {dtype}'s largest "
            f"value {largest:g} (e.g. 2**15 for float16), got {loss_scale!r}: it multiplies "
            "the gradient in that dtype, and a power of two scales it exactly."
        )
    return scale


def _check_dtype(compute_dtype: Any) -> jnp.dtype:
    valid = "a floating dtype such as jnp.bfloat16, jnp.float16 or jnp.float32"
    dtype = None
    if compute_dtype is not None:  # numpy would read None as float64
        with contextlib.suppress(TypeError):
            dtype = jnp.dtype(compute_dtype)
    if dtype is None:
        raise TypeError(f"mixed_precision: compute_dtype must be {valid}, got {compute_dtype!r}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"mixed_precision: compute_dtype must be {valid}, got {dtype}.")
    if jnp.finfo(dtype).bits < 16:  # float8: no promotion to float32, and no scaling here
        raise ValueError(
            f"mixed_precision: compute_dtype must be {valid}, got {dtype}: float8 needs "
            "per-tensor scaling, which this wrapper does not do."
        )
    if dtype.itemsize > 4 and not jax.config.jax_enable_x64:  # JAX would compute in float32
        raise ValueError(
            f"mixed_precision: compute_dtype {dtype} needs jax_enable_x64 (e.g. "
            "jax.config.update('jax_enable_x64', True) before any array is made); without "
            "it JAX computes in float32."
        )
    return dtype


def mixed_precision(
    loss_fn: AnyLoss,
    compute_dtype: Any = jnp.bfloat16,
    *,
    cast_batch: bool = True,
    loss_scale: float | None = None,
) -> AnyLoss:
    """Runs a loss in ``compute_dtype`` (bfloat16) over float32 master parameters.

    Rule: ``loss(theta, x) = float32(f(c(theta), c(x)))`` with ``c`` the cast of
    floating-point leaves to ``compute_dtype``. The forward pass, and so the backward pass
    through it, runs in ``compute_dtype``; the cast's transpose returns the gradient in the
    master parameters' dtype, ``g = float32(dL/dc(theta))``, so the parameters, their
    gradients and the optimizer state a strategy keeps stay float32. Integer leaves (labels,
    token ids, step counters) are not touched. For a ``ddl.ModelLoss`` the model state
    (batch statistics) goes in as it is and comes back in its own dtype, and the seed is
    kept; only what is computed is cast. The loss and floating aux values come back as
    float32 (at least).

    Loss scaling (Micikevicius et al., section 3.2: a constant scale): bfloat16 has
    float32's range and needs none; with ``float16`` gradients below 2**-24 flush to zero.
    ``loss_scale=S`` multiplies the loss's gradient by S as it enters the low-precision
    backward pass and divides the parameters' gradient by S in float32 after it, so the
    gradient is unchanged where nothing underflowed or overflowed. An overflow (a gradient
    over S times float16's 65504) makes that step's gradient inf: train with
    ``fit(skip_nonfinite=True)`` to skip such steps, as PyTorch's ``GradScaler`` does (it
    also lowers its scale then; this one stays constant).

    A Flax layer computes in the dtype of what it is given unless its ``dtype`` says
    otherwise, with one exception: a layer that mixes float32 model state into its output
    at ``dtype=None`` returns float32 (NNX ``BatchNorm``: its running statistics stay
    float32, as model state does), so everything after it computes in float32 again; give
    such a layer ``dtype=jnp.bfloat16`` (``ddl.models.GPT(dtype=...)`` sets every layer's).
    ``LayerNorm`` and ``RMSNorm`` at ``dtype=None`` return bfloat16 here (their input and
    scale are cast).

    Under ``ddl.fsdp`` with layers run by ``ddl.layers.scan_layers`` (gathered one at a
    time), each cast stacked leaf stands for its shard, so the layers are still found and
    gathered one at a time, in ``compute_dtype``; their gradient's reduce-scatter sums in
    float32 with ``fsdp(gather_dtype=compute_dtype)`` (in ``compute_dtype`` without it),
    and comes back rounded to ``compute_dtype`` (the cast comes before the gather).

    Reduction precision is the strategy's choice, independent of this one: with
    ``ddl.data_parallel`` or ``ddl.local_sgd`` pass ``reducer=ddl.compression.cast(dtype)``
    to send gradients as ``dtype`` (summed in float32); ``ddl.fsdp`` takes
    ``reducer=ddl.compression.scatter_cast(dtype)``. Without either, gradients are reduced
    in float32.

    References:
      Micikevicius et al., "Mixed precision training", ICLR 2018, arXiv:1710.03740.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)``), or a ``ddl.ModelLoss``.
      compute_dtype: the floating dtype the loss computes in (``jnp.bfloat16``,
        ``jnp.float16``; ``jnp.float32`` gives back the loss unchanged in value).
      cast_batch: also cast the batch's floating leaves (inputs) to ``compute_dtype``;
        ``False`` passes the batch as it comes, for a model that casts its own inputs.
      loss_scale: ``None`` (no scaling), or a power of two below the compute dtype's
        largest value by which the backward pass's gradients are scaled (``2**15`` for
        float16, a common start).

    Returns:
      A loss of the same kind as ``loss_fn`` (a function, or a ``ddl.ModelLoss`` with the
      same seed), to give to any strategy in place of ``loss_fn``.

    Example:
      The forward pass multiplies in bfloat16; the loss and the gradient of the float32
      parameters are float32:

      >>> import jax, jax.numpy as jnp, optax, ddl_jax as ddl
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> loss = ddl.mixed_precision(loss_fn, jnp.bfloat16)
      >>> params = {"w": jnp.zeros((3, 1))}
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
      >>> "bf16[8,3]" in str(jax.make_jaxpr(loss)(params, batch))
      True
      >>> value, grads = jax.value_and_grad(loss)(params, batch)
      >>> print(value, value.dtype, grads["w"].dtype)
      1.0 float32 float32

      With any strategy, here reducing the gradients as bfloat16 too:

      >>> strategy = ddl.data_parallel(
      ...     loss, optax.sgd(0.1), ddl.make_mesh(data=4),
      ...     reducer=ddl.compression.cast(jnp.bfloat16))
      >>> state, metrics = jax.jit(strategy.step)(strategy.init(params), batch)
      >>> print(strategy.params(state)["w"].dtype, metrics["loss"])
      float32 1.0
    """
    dtype = _check_dtype(compute_dtype)
    inner = loss_fn.fn if isinstance(loss_fn, ModelLoss) else loss_fn
    if (wrapped := getattr(inner, "mixed_precision_dtype", None)) is not None:
        raise ValueError(
            f"mixed_precision: loss_fn already computes in {wrapped} (a mixed_precision "
            "loss); wrap the plain loss once, with the compute_dtype and loss_scale wanted."
        )
    if not isinstance(cast_batch, bool | np.bool_):
        raise TypeError(f"mixed_precision: cast_batch must be a bool, got {cast_batch!r}.")
    cast_batch = bool(cast_batch)
    scale = 1.0 if loss_scale is None else _check_loss_scale(loss_scale, dtype)

    def low(params, batch):
        """The parameters and batch as the loss computes with them (each cast parameter
        standing for its leaf: ``ddl.fsdp`` finds the layers ``scan_layers`` gets)."""
        scaled = params if scale == 1.0 else _scale_cotangent(params, 1 / scale)
        cast = _cast_floating(scaled, dtype)
        stand_for(cast, params)
        return cast, _cast_floating(batch, dtype) if cast_batch else batch

    def high(out):
        """The loss output back in float32 (at least), its gradient scaled on the way in."""
        out = _widen(out)
        return out if scale == 1.0 else _scaled(out, scale)

    if isinstance(loss_fn, ModelLoss):
        if not callable(loss_fn.fn):
            raise TypeError(
                "mixed_precision: loss_fn.fn must be callable (params, model_state, batch, "
                f"key) -> (loss, model_state), got {loss_fn.fn!r}."
            )
        fn = loss_fn.fn

        def model_loss(params, model_state, batch, key):
            params, batch = low(params, batch)
            out, new_state = fn(params, model_state, batch, key)
            return high(out), _like(new_state, model_state)

        model_loss.mixed_precision_dtype = dtype  # type: ignore[attr-defined]
        return ModelLoss(model_loss, loss_fn.seed)
    if not callable(loss_fn):
        raise TypeError(
            "mixed_precision: loss_fn must be a callable (params, batch) -> loss or a "
            f"ddl.ModelLoss, got {type(loss_fn).__name__}."
        )

    def loss(params, batch):
        return high(call_loss(loss_fn, *low(params, batch)))

    loss.mixed_precision_dtype = dtype  # type: ignore[attr-defined]
    return loss
