"""The training loop: jit once, step, log, evaluate."""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from ddl_jax._src.strategy import Params, State, Strategy


def _eval_record(eval_fn: Callable[[Params], Any], params: Params) -> dict[str, float]:
    result = jax.device_get(eval_fn(params))
    if isinstance(result, dict):
        return {f"eval_{k}": float(v) for k, v in result.items()}
    return {"eval": float(result)}


def _examples(batch: Any) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def fit(
    strategy: Strategy,
    params: Params,
    batches: Iterable[Any],
    *,
    steps: int,
    eval_fn: Callable[[Params], Any] | None = None,
    eval_every: int | None = None,
    log_every: int = 10,
    progress: bool = True,
) -> tuple[State, list[dict[str, float]]]:
    """Trains ``params`` with ``strategy`` for ``steps`` steps.

    The step is jitted once with ``donate_argnums=0`` (the state's buffers are reused in
    place). Metrics stay on the device between log points, so logging does not stall the
    pipeline; every ``log_every`` steps they are fetched, checked for NaN/inf, and shown on
    a progress bar with examples per second.

    Args:
      strategy: what ``ddl.data_parallel`` and the other builders return.
      params: initial model parameters (not modified; the strategy places a copy).
      batches: iterable of global batches (e.g. ``ddl.data.batches(train, 256)``).
      steps: number of training steps, >= 1.
      eval_fn: ``params -> scalar | dict of scalars``, run on ``strategy.params(state)``
        every ``eval_every`` steps and after the last step; recorded as ``eval`` /
        ``eval_<name>``.
      eval_every: steps between evaluations; ``None`` evaluates after the last step only.
      log_every: steps between metric fetches and progress-bar updates.
      progress: show a progress bar.

    Returns:
      ``(state, history)``: the final state, and one record per step
      (``{"step": i, "loss": ..., ...}``, 1-based) with eval results merged into the steps
      where they ran.

    Raises:
      FloatingPointError: the loss became NaN or infinite (naming the step).
    """
    for name, value in (("steps", steps), ("log_every", log_every), ("eval_every", eval_every)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"fit: {name} must be a positive int, got {value!r}.")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"fit: strategy must be a ddl.Strategy, got {type(strategy).__name__}.")

    step_fn = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    history: list[dict[str, float]] = []
    pending: list[Any] = []
    bar = tqdm(total=steps, disable=not progress, unit="step", dynamic_ncols=True)
    examples, tick = 0, time.perf_counter()

    def flush() -> None:
        nonlocal examples, tick
        if not pending:
            return
        for metrics in jax.device_get(pending):
            record = {"step": len(history) + 1, **{k: float(v) for k, v in metrics.items()}}
            if not math.isfinite(record["loss"]):
                bar.close()
                raise FloatingPointError(
                    f"fit: loss is {record['loss']} at step {record['step']}; lower the learning "
                    "rate, check the data for NaNs, or clip gradients (optax.clip_by_global_norm)."
                )
            history.append(record)
        bar.update(len(pending))
        pending.clear()
        now = time.perf_counter()
        bar.set_postfix(
            loss=f"{history[-1]['loss']:.4f}", ex_per_s=f"{examples / (now - tick):.0f}"
        )
        examples, tick = 0, now

    def evaluate() -> None:
        nonlocal tick
        flush()
        record = _eval_record(eval_fn, strategy.params(state))
        history[-1].update(record)
        bar.write(
            f"step {history[-1]['step']}: " + ", ".join(f"{k}={v:.4f}" for k, v in record.items())
        )
        tick = time.perf_counter()  # evaluation time is not training throughput

    for i, batch in enumerate(itertools.islice(batches, steps), start=1):
        state, metrics = step_fn(state, batch)
        pending.append(metrics)
        examples += _examples(batch)
        if i % log_every == 0:
            flush()
        if eval_fn is not None and eval_every is not None and i % eval_every == 0:
            evaluate()
    flush()
    if not history:
        bar.close()
        raise ValueError("fit: batches yielded no batch.")
    if len(history) < steps:
        warnings.warn(f"fit: batches ran out after {len(history)} of {steps} steps.", stacklevel=2)
    if eval_fn is not None and not any(k.startswith("eval") for k in history[-1]):
        evaluate()
    bar.close()
    return state, history
