"""The per-device programs of ``ddl.pipeline``: the ticks of one step under ``shard_map``.

``pipeline.py`` checks the arguments into a :class:`PipelineConfig`, builds the stages and
the state; the functions here run on one device (one stage of one data worker) inside
``shard_map``: a ``lax.scan`` over ticks, a ``lax.switch`` to this stage's work, and
``ppermute`` to the neighbouring stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ddl_jax._src.flat import FlatView
from ddl_jax._src.kit import vary
from ddl_jax._src.pipeline_schedules import Schedule, gradient_wait, peak_stash

DATA, STAGE = "data", "stage"

StageFn = Callable[[Any, Any], Any]
Metrics = dict[str, jax.Array]


class PipelineConfig(NamedTuple):
    """What both pipeline builders and their per-device programs share, fixed when built.

    Attributes:
      applies: the K stages' ``apply(params_k, x) -> y``.
      views: each stage's :class:`FlatView` (its parameter pytree <-> a flat vector).
      loss_fn: ``(last stage's output, micro-batch) -> scalar``.
      optimizer: applied per stage to its flat parameter vector.
      reducer: reduces each stage's flat gradient over ``data``.
      param_len: P, the entries of every stage's (zero-padded) flat parameter vector.
      param_dtype: the dtype of those vectors (the stages' parameter dtypes promoted).
      k: K, stages (the ``stage`` axis' size).
      n: N, data workers (the ``data`` axis' size).
      m: M, micro-batches per data worker per step.
      example: the abstract ``example_batch`` (``jax.ShapeDtypeStruct`` leaves), or ``None``.
    """

    applies: tuple[StageFn, ...]
    views: tuple[FlatView, ...]
    loss_fn: Callable[[Any, Any], jax.Array]
    optimizer: optax.GradientTransformation
    reducer: optax.GradientTransformation
    param_len: int
    param_dtype: Any
    k: int
    n: int
    m: int
    example: Any

    @property
    def divisor(self) -> int:
        """What the global batch must divide by: N x M."""
        return self.n * self.m

    @property
    def why(self) -> str:
        return f"{self.n} data workers x microbatches={self.m}"

    @property
    def ddg_slots(self) -> int:
        """Stage inputs a DDG stage keeps: ``2K-1`` (its forward leads its backward by up to
        ``2(K-1)`` ticks)."""
        return 2 * self.k - 1

    @property
    def ddg_depth(self) -> int:
        """Earlier steps whose micro-batches DDG still needs: ``ceil(2(K-1)/M)``."""
        return math.ceil(2 * (self.k - 1) / self.m)

    def update(
        self, params: jax.Array, opt_state: Any, reducer_state: Any, grads: jax.Array
    ) -> tuple[jax.Array, Any, Any]:
        """One stage's reducer and optimizer step on its flat vector."""
        grads, reducer_state = self.reducer.update(grads, reducer_state, params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, reducer_state


class Stages(NamedTuple):
    """Stage k's forward and backward on flat buffers, for a fixed micro-batch shape.

    Attributes:
      forward: ``(p, x_buf, micro) -> y_buf`` per stage.
      backward: ``(p, x_buf, ct_buf, micro, acc, scale) -> (acc + scale * param grad,
        input grad, loss)`` per stage.
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
    """

    params: jax.Array
    opt_state: Any
    reducer_state: Any


class DDGState(NamedTuple):
    """State of :func:`pipeline` with ``schedule="ddg"``: the pipeline stays full between steps.

    Attributes:
      params, opt_state, reducer_state: as in ``PipelineState``.
      inputs: ``[N, K, 2K-1, A]``, the stage inputs each stage keeps for its delayed
        backward (slot ``micro-batch mod 2K-1``), ``P("data", "stage")``; ``()`` for K=1.
      inbox: ``[N, K, A]``, the error gradient each stage received on the last tick,
        ``P("data", "stage")``; ``()`` for K=1.
      history: the last ``ceil(2(K-1)/M)`` steps' micro-batches, leaves
        ``[N, H*M, b, ...]``, ``P("data")``: the first stage's inputs for its delayed
        backward and the labels of the micro-batches still in flight; ``()`` for K=1.
      tick: ``int32`` scalar, ticks run so far (``P()``).
    """

    params: jax.Array
    opt_state: Any
    reducer_state: Any
    inputs: Any
    inbox: Any
    history: Any
    tick: jax.Array


def _shift(x: jax.Array, k_: int, direction: int) -> jax.Array:
    """Sends ``x`` to the next (+1) or previous (-1) stage; the ends receive zeros."""
    perm = [(i, i + direction) for i in range(k_) if 0 <= i + direction < k_]
    return lax.ppermute(x, STAGE, perm)


def tick_tables(plan: Schedule) -> dict[str, np.ndarray]:
    """Per tick and stage: the branch to run, its micro-batch, and what arrives."""
    k_ = plan.stages
    forward, backward = plan.forward, plan.backward
    stage = np.arange(k_)[None, :]
    # The last stage's forward only feeds its loss, which its backward recomputes anyway.
    runs_forward = (forward >= 0) & (stage < k_ - 1)
    branch = np.where(runs_forward, 1 + stage, np.where(backward >= 0, 1 + k_ + stage, 0))
    micro = np.maximum(np.where(forward >= 0, forward, backward), 0)
    none = np.full((len(forward), 1), -1, np.int32)
    recv_act = np.concatenate([none, forward[:, :-1]], axis=1)
    recv_grad = np.concatenate([backward[:, 1:], none], axis=1)
    return {"branch": branch, "micro": micro, "recv_act": recv_act, "recv_grad": recv_grad}


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _local(tree: Any, depth: int) -> Any:
    """Inside ``shard_map``: this device's entry of leaves with ``depth`` leading mesh axes."""
    return jax.tree.map(lambda x: x[(0,) * depth], tree)


def _unlocal(tree: Any, depth: int) -> Any:
    """The inverse of :func:`_local`, for the state's out_specs."""
    return jax.tree.map(lambda x: x.reshape((1,) * depth + x.shape), tree)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array, keep: jax.Array) -> jax.Array:
    old = lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, old), slot, 0)


def synchronous_step(
    cfg: PipelineConfig, plan: Schedule, fns: Stages, state: PipelineState, batch: Any
) -> tuple[PipelineState, Metrics]:
    """One GPipe / 1F1B step on one device: the scheduled ticks, then one update."""
    k_, m_ = cfg.k, cfg.m
    slots, inbox_slots = peak_stash(plan), max(gradient_wait(plan), 1)
    k = lax.axis_index(STAGE)
    both = (DATA, STAGE)
    p = state.params[0]
    # Differentiate a data-varying view: each data worker's gradient goes to the reducer.
    p_var = vary(p, (DATA,))
    micro = jax.tree.map(lambda x: x.reshape(m_, -1, *x.shape[1:]), batch)
    rows = {name: jnp.asarray(t)[:, k] for name, t in tick_tables(plan).items()}
    zeros_a = jnp.zeros((fns.width,), fns.dtype)
    Out = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def idle(p: jax.Array, x_buf: jax.Array, ct: jax.Array, mb: Any) -> Out:
        return vary((zeros_a, zeros_a, jnp.zeros_like(p), jnp.zeros((), jnp.float32)), both)

    def forward(i: int) -> Callable[..., Out]:
        def run(p: jax.Array, x_buf: jax.Array, ct: jax.Array, mb: Any) -> Out:
            y = fns.forward[i](p, x_buf, mb)
            return vary((y, zeros_a, jnp.zeros_like(p), jnp.zeros((), jnp.float32)), both)

        return run

    def backward(i: int) -> Callable[..., Out]:
        def run(p: jax.Array, x_buf: jax.Array, ct: jax.Array, mb: Any) -> Out:
            grad_p, grad_x, loss = fns.backward[i](p, x_buf, ct, mb, jnp.zeros_like(p), 1 / m_)
            return vary((zeros_a, grad_x, grad_p, loss.astype(jnp.float32)), both)

        return run

    branches = [idle, *map(forward, range(k_)), *map(backward, range(k_))]

    def tick(carry: tuple, row: dict[str, jax.Array]) -> tuple[tuple, None]:
        acts, inbox, grad_sum, loss_sum = carry
        m = row["micro"]
        out_act, out_grad, grad_p, loss = lax.switch(
            row["branch"],
            branches,
            p_var,
            acts[m % slots],
            inbox[m % inbox_slots],
            _index(micro, m),
        )
        # Accumulated outside the switch: a sum threaded through the conditional made XLA
        # copy it in and out of every tick (GPipe ran 3x slower than sequential).
        grad_sum = grad_sum + grad_p
        if k_ > 1:
            received = row["recv_act"]
            acts = _store(acts, received % slots, _shift(out_act, k_, 1), received >= 0)
            received = row["recv_grad"]
            inbox = _store(inbox, received % inbox_slots, _shift(out_grad, k_, -1), received >= 0)
        return (acts, inbox, grad_sum, loss_sum + loss / m_), None

    carry = vary(
        (
            jnp.zeros((slots, fns.width), fns.dtype),
            jnp.zeros((inbox_slots, fns.width), fns.dtype),
            jnp.zeros_like(p),
            jnp.zeros((), jnp.float32),
        ),
        both,
    )
    (_, _, grads, loss), _ = lax.scan(tick, carry, rows)
    reducer_state = _local(state.reducer_state, 2)
    p, opt_state, reducer_state = cfg.update(p, _local(state.opt_state, 1), reducer_state, grads)
    new = PipelineState(p[None], _unlocal(opt_state, 1), _unlocal(reducer_state, 2))
    return new, {"loss": lax.pmean(lax.psum(loss, STAGE), DATA)}


def ddg_step(
    cfg: PipelineConfig, fns: Stages, state: DDGState, batch: Any
) -> tuple[DDGState, Metrics]:
    """M DDG ticks on one device; each ends with this stage's (delayed-gradient) update."""
    k_, m_, slots = cfg.k, cfg.m, cfg.ddg_slots
    k = lax.axis_index(STAGE)
    both = (DATA, STAGE)
    last = k_ - 1
    current = jax.tree.map(lambda x: x.reshape(m_, -1, *x.shape[1:]), batch)
    if k_ > 1:
        inputs, inbox = state.inputs[0, 0], state.inbox[0, 0]
        sequence = jax.tree.map(lambda h, c: jnp.concatenate([h[0], c]), state.history, current)
    else:
        inputs, inbox = jnp.zeros((slots, 0), fns.dtype), jnp.zeros((0,), fns.dtype)
        sequence = current
    past = cfg.ddg_depth * m_  # micro-batches of earlier steps at the front of ``sequence``
    zeros_a = jnp.zeros((fns.width,), fns.dtype)
    Out = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def stage_tick(i: int) -> Callable[..., Out]:
        def run(p: jax.Array, x_f: Any, x_b: Any, ct: Any, mb_f: Any, mb_b: Any) -> Out:
            out_act = fns.forward[i](p, x_f, mb_f) if i < last else zeros_a
            grad_p, grad_x, loss = fns.backward[i](p, x_b, ct, mb_b, jnp.zeros_like(p), 1.0)
            return vary((out_act, grad_x, grad_p, loss.astype(jnp.float32)), both)

        return run

    branches = [stage_tick(i) for i in range(k_)]

    def tick(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
        p, opt_state, reducer_state, inputs, inbox, loss_sum, count = carry
        g = state.tick + i
        j_f, j_b = g - k, g - 2 * last + k
        mb_f = _index(sequence, past + i)
        mb_b = _index(sequence, jnp.maximum(j_b - state.tick + past, 0))
        out_act, grad_x, grad_p, loss = lax.switch(
            k,
            branches,
            vary(p, (DATA,)),
            inputs[j_f % slots],
            inputs[j_b % slots],
            inbox,
            mb_f,
            mb_b,
        )
        valid = j_b >= 0
        new = cfg.update(p, opt_state, reducer_state, grad_p)
        p, opt_state, reducer_state = jax.tree.map(
            lambda a, b: jnp.where(valid, a, b), new, (p, opt_state, reducer_state)
        )
        if k_ > 1:
            inputs = _store(inputs, (g - k + 1) % slots, _shift(out_act, k_, 1), True)
            inbox = _shift(grad_x, k_, -1)
        counted = valid & (k == last)
        loss_sum, count = loss_sum + jnp.where(counted, loss, 0.0), count + counted
        return (p, opt_state, reducer_state, inputs, inbox, loss_sum, count), None

    carry = (
        state.params[0],
        _local(state.opt_state, 1),
        _local(state.reducer_state, 2),
        *vary((inputs, inbox, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), both),
    )
    (p, opt_state, reducer_state, inputs, inbox, loss_sum, count), _ = lax.scan(
        tick, carry, jnp.arange(m_)
    )
    loss = lax.psum(loss_sum, STAGE) / jnp.maximum(lax.psum(count, STAGE), 1)
    history = inbox_out = inputs_out = ()
    if k_ > 1:
        inputs_out, inbox_out = inputs[None, None], inbox[None, None]
        history = jax.tree.map(lambda s: s[s.shape[0] - past :][None], sequence)
    new = DDGState(
        p[None],
        _unlocal(opt_state, 1),
        _unlocal(reducer_state, 2),
        inputs_out,
        inbox_out,
        history,
        state.tick + m_,
    )
    return new, {"loss": lax.pmean(loss, DATA)}
