"""The types ``ddl.pipeline``'s modules share: the config fixed when built, the stages'
flat-buffer functions, the training states, and their type aliases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ddl_jax._src.core.flat import FlatView
from ddl_jax._src.core.model_loss import ModelLoss, ModelVars

#: A stage's apply: ``(params, x) -> y``, or a ``ModelLoss`` whose
#: ``fn(params, model_state, x, key) -> (y, new_model_state)`` (a stateful stage).
StageFn = Callable[[Any, Any], Any] | ModelLoss
#: How ``"ddg"`` forwards: the first is Huo et al.'s and the default.
DDG_FORWARDS = ("locked", "pipelined")
Metrics = dict[str, jax.Array]


class PipelineConfig(NamedTuple):
    """What both pipeline builders and their per-device programs share, fixed when built.

    Attributes:
      applies: the K stages' ``apply(params_k, x) -> y``, or a ``ModelLoss`` for a stage
        with model state or randomness.
      views: each stage's :class:`FlatView` (its parameter pytree <-> a flat vector).
      state_views: each stage's model state's :class:`FlatView` (of ``{}`` for none).
      loss_fn: ``(last stage's output, micro-batch) -> scalar``.
      optimizer: applied per stage to its flat parameter vector.
      reducer: reduces each stage's flat gradient over ``data``.
      param_len: P, the entries of every stage's (zero-padded) flat parameter vector.
      param_dtype: the dtype of those vectors (the stages' parameter dtypes promoted).
      state_len: S, the entries of every stage's (zero-padded) flat model state; 0 for none.
      state_dtype: the dtype of those vectors (the model states' dtypes promoted).
      k: K, stages (the ``stage`` axis' size).
      n: N, data workers (the ``data`` axis' size).
      m: M, micro-batches per data worker per step.
      example: the abstract ``example_batch`` (``jax.ShapeDtypeStruct`` leaves), or ``None``.
      transposes_weight_gradients: whether the backward computes its weight gradients
        from explicit transposes, for XLA:CPU (``cpu_products.applies``).
      ddg_forward: under ``"ddg"``, ``"locked"`` (every stage forwards a tick's
        micro-batch within the tick) or ``"pipelined"`` (one stage further a tick).
    """

    applies: tuple[StageFn, ...]
    views: tuple[FlatView, ...]
    state_views: tuple[FlatView, ...]
    loss_fn: Callable[[Any, Any], jax.Array]
    optimizer: optax.GradientTransformation
    reducer: optax.GradientTransformation
    param_len: int
    param_dtype: Any
    state_len: int
    state_dtype: Any
    k: int
    n: int
    m: int
    example: Any
    transposes_weight_gradients: bool
    ddg_forward: str = DDG_FORWARDS[0]

    @property
    def divisor(self) -> int:
        """What the global batch must divide by: N x M."""
        return self.n * self.m

    @property
    def why(self) -> str:
        return f"{self.n} data workers x microbatches={self.m}"

    def ddg_delay(self, k: Any) -> Any:
        """Ticks by which DDG's stage ``k`` backpropagates behind the micro-batch it
        forwards, its gradient's delay: ``K-1-k`` with the forward locked, ``2(K-1-k)``
        pipelined."""
        return (self.k - 1 - k) * (1 if self.ddg_forward == "locked" else 2)

    @property
    def ddg_slots(self) -> int:
        """Stage inputs a DDG stage keeps: its longest delay and one (``K`` locked,
        ``2K-1`` pipelined)."""
        return self.ddg_delay(0) + 1

    @property
    def ddg_depth(self) -> int:
        """Earlier steps whose micro-batches DDG still needs: ``ceil(delay of stage 0 / M)``."""
        return math.ceil(self.ddg_delay(0) / self.m)

    @property
    def seed_stage(self) -> Callable[..., Any] | ModelLoss:
        """What the run's base key is derived from (``model_loss.init_vars``): the first
        stateful stage, or the loss (seed 0) when no stage is stateful."""
        return next((a for a in self.applies if isinstance(a, ModelLoss)), self.loss_fn)

    def update(
        self,
        params: jax.Array,
        opt_state: Any,
        reducer_state: Any,
        grads: jax.Array,
        staleness: jax.Array | float = 0.0,
    ) -> tuple[jax.Array, Any, Any]:
        """One stage's reducer and optimizer step on its flat vector; the optimizer gets
        the gradient's delay in this stage's updates as the optax extra argument
        ``staleness`` (what ``ddl.scale_by_staleness`` reads)."""
        grads, reducer_state = self.reducer.update(grads, reducer_state, params)
        tau = jnp.asarray(staleness, jnp.float32)
        optimizer = optax.with_extra_args_support(self.optimizer)
        updates, opt_state = optimizer.update(grads, opt_state, params, staleness=tau)
        return optax.apply_updates(params, updates), opt_state, reducer_state


class Stages(NamedTuple):
    """Stage k's forward and backward on flat buffers, for a fixed micro-batch shape.

    ``s`` is the stage's flat model state, ``key`` the micro-batch's key (:func:`stage_key`).

    Attributes:
      forward: ``(p, s, x_buf, micro, key) -> (y_buf, new s)`` per stage.
      backward: ``(p, s, x_buf, ct_buf, micro, key, scale) -> (param grad, input grad,
        loss, new s)`` per stage: the forward re-run from ``s``; the last stage
        differentiates ``scale * loss``, the others the error gradient ``ct_buf`` (which
        carries that scale).
      width: A, entries of the largest activation buffer.
      dtype: the activation buffers' dtype.
    """

    forward: list[Callable[..., jax.Array]]
    backward: list[Callable[..., tuple[jax.Array, jax.Array, jax.Array]]]
    width: int
    dtype: Any


class PipelineState(NamedTuple):
    """State of :func:`pipeline` with ``schedule="gpipe"`` or ``"1f1b"``.

    Attributes:
      params: ``[K, P]``, stage k's parameters flattened (zero-padded to the largest
        stage's size P), ``P("stage")``.
      opt_state: each stage's optimizer state, leading axis K, ``P("stage")``.
      reducer_state: each (data worker, stage)'s reducer state, leading axes ``[N, K]``,
        ``P("data", "stage")``.
      model: ``ModelVars``: ``state`` is ``[K, S]``, stage k's model state flattened
        (zero-padded to S), ``P("stage")`` (``{}`` when no stage has any); the run's key
        and the step count, replicated.
    """

    params: jax.Array
    opt_state: Any
    reducer_state: Any
    model: ModelVars


class DDGState(NamedTuple):
    """State of :func:`pipeline` with ``schedule="ddg"``: the pipeline stays full between steps.

    Attributes:
      params, opt_state, reducer_state: as in ``PipelineState``.
      inputs: ``[N, K, S, A]``, the stage inputs each stage keeps for its delayed
        backward (slot ``micro-batch mod S``; S = ``PipelineConfig.ddg_slots``),
        ``P("data", "stage")``; ``()`` for K=1.
      inbox: ``[N, K, A]``, the error gradient each stage received on the last tick,
        ``P("data", "stage")``; ``()`` for K=1.
      history: the last ``PipelineConfig.ddg_depth`` steps' micro-batches, leaves
        ``[N, H*M, b, ...]``, ``P("data")``: the first stage's inputs for its delayed
        backward and the labels of the micro-batches still in flight; ``()`` for K=1.
      tick: ``int32`` scalar, ticks run so far (``P()``).
      model: as in ``PipelineState``.
    """

    params: jax.Array
    opt_state: Any
    reducer_state: Any
    inputs: Any
    inbox: Any
    history: Any
    tick: jax.Array
    model: ModelVars
