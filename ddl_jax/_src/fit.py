"""The training loop: jit once, step, log, evaluate."""

from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ddl_jax._src import checkpoint
from ddl_jax._src.strategy import Batch, Metrics, Params, State, Strategy, check_positive_int


def _eval_record(eval_fn: Callable[[Params], Any], params: Params) -> dict[str, float]:
    result = jax.device_get(eval_fn(params))
    if isinstance(result, dict):
        return {f"eval_{k}": float(v) for k, v in result.items()}
    return {"eval": float(result)}


def _examples(batch: Any) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def guard_nonfinite(
    step: Callable[[State, Batch], tuple[State, Metrics]],
) -> Callable[[State, Batch], tuple[State, Metrics]]:
    """Wraps a ``Strategy.step`` so that a step producing NaN/inf is not applied.

    The update is kept only if the loss and every floating leaf of the new state (on
    every worker: the check reduces over the whole global state) are finite; otherwise
    the old state is kept, whole, on all workers, so they stay consistent and counters
    (optimizer count, synchronisation clocks) do not advance. Metric ``skipped`` is 1.0
    on a skipped step, else 0.0.
    """

    def guarded(state: State, batch: Batch) -> tuple[State, Metrics]:
        new, metrics = step(state, batch)
        finite = jnp.isfinite(metrics["loss"])
        for leaf in jax.tree.leaves(new):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                finite &= jnp.isfinite(leaf).all()
        kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
        return kept, {**metrics, "skipped": jnp.where(finite, 0.0, 1.0)}

    return guarded


def fit(
    strategy: Strategy,
    params: Params,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    steps: int,
    eval_fn: Callable[[Params], Any] | None = None,
    eval_every: int | None = None,
    log_every: int = 10,
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep: int | None = None,
    skip_nonfinite: bool = False,
) -> tuple[State, list[dict[str, float]]]:
    """Trains ``params`` with ``strategy`` for ``steps`` steps, resuming from a checkpoint.

    The step is jitted once with ``donate_argnums=0`` (the state's buffers are reused in
    place). Metrics stay on the device between log points, so logging does not stall the
    pipeline; every ``log_every`` steps they are fetched, checked for NaN/inf, and shown on
    a progress bar with examples per second (on process 0 only).

    With ``checkpoint_dir``, the whole strategy state (item ``state``) and
    ``strategy.params(state)`` (item ``variables``, which
    ``ddl.checkpoint.load_variables`` reads back without the strategy) are saved there
    asynchronously (orbax) every ``checkpoint_every`` steps and after the last step,
    keeping the last ``keep``; if the directory already holds a readable step ``s``,
    training resumes from its state and runs steps ``s + 1 .. steps`` on batches
    ``s, s + 1, ...`` of the stream, so a restarted command ends where an uninterrupted
    one would. A step that fails to restore is reported and the previous one used (see
    ``ddl.checkpoint.restore_latest``).

    Args:
      strategy: what ``ddl.data_parallel`` and the other builders return.
      params: initial model parameters (not modified; the strategy places a copy).
      batches: iterable of global batches (e.g. ``ddl.data.batches(train, 256)``), or
        ``start -> iterable`` yielding them from batch ``start`` on (e.g.
        ``lambda s: ddl.data.batches(train, 256, start=s)``), which lets a resumed run
        skip to its data position without replaying the earlier batches; an iterable is
        advanced past the ``start`` batches already trained on.
      steps: total number of training steps (including resumed ones), >= 1.
      eval_fn: ``params -> scalar | dict of scalars``, run on ``strategy.params(state)``
        every ``eval_every`` steps and after the last step; recorded as ``eval`` /
        ``eval_<name>``.
      eval_every: steps between evaluations; ``None`` evaluates after the last step only.
      log_every: steps between metric fetches and progress-bar updates.
      progress: show a progress bar.
      checkpoint_dir: directory of the checkpoints (the same path on every process);
        ``None`` neither saves nor resumes.
      checkpoint_every: steps between saves; ``None`` saves after the last step only.
      keep: number of most recent checkpoints kept (default 3).
      skip_nonfinite: do not apply a step whose loss or new state holds NaN/inf, on any
        worker (see ``guard_nonfinite``); such steps are recorded with ``skipped=1.0``
        instead of stopping training.

    Returns:
      ``(state, history)``: the final state, and one record per step trained in this
      call (``{"step": i, "loss": ..., ...}``, 1-based, counting resumed steps) with eval
      results merged into the steps where they ran.

    Raises:
      FloatingPointError: the loss became NaN or infinite (naming the step), unless
        ``skip_nonfinite``.
      TypeError: ``strategy`` is not a ``ddl.Strategy``, or ``skip_nonfinite`` not a bool.
      ValueError: bad arguments (among them ``checkpoint_every`` or ``keep`` without
        ``checkpoint_dir``, ``eval_every`` without ``eval_fn``), or a checkpoint of a
        differently shaped state.
    """
    for name, value in (
        ("steps", steps), ("log_every", log_every), ("eval_every", eval_every),
        ("checkpoint_every", checkpoint_every), ("keep", keep),
    ):  # fmt: skip
        if value is not None:
            check_positive_int(name, value)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"fit: strategy must be a ddl.Strategy, got {type(strategy).__name__}.")
    if not isinstance(skip_nonfinite, bool | np.bool_):
        raise TypeError(f"fit: skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
    if eval_every is not None and eval_fn is None:
        raise ValueError(f"fit: eval_every={eval_every!r} needs eval_fn, got eval_fn=None.")
    for name, value in (("checkpoint_every", checkpoint_every), ("keep", keep)):
        # Without a directory nothing is saved: a silently ignored setting would hide that.
        if value is not None and checkpoint_dir is None:
            raise ValueError(
                f"fit: {name}={value!r} needs checkpoint_dir, got checkpoint_dir=None; pass "
                "the directory to save checkpoints to."
            )

    step_fn = jax.jit(
        guard_nonfinite(strategy.step) if skip_nonfinite else strategy.step,
        donate_argnums=0,
    )
    state = strategy.init(params)
    start, manager = 0, None
    if checkpoint_dir is not None:
        manager = checkpoint.checkpoint_manager(checkpoint_dir, keep=3 if keep is None else keep)
        try:
            # Not restore_latest: its warning about a corrupt step must name the user's line.
            restored = checkpoint._restore_latest(manager, state)
        except BaseException:
            manager.close()
            raise
        if restored is not None:
            state, start = restored
            if jax.process_index() == 0:
                tqdm.write(f"fit: resumed from step {start} in {manager.directory}")
    stream = batches(start) if callable(batches) else itertools.islice(batches, start, None)
    history: list[dict[str, float]] = []
    pending: list[Any] = []
    bar = tqdm(
        total=steps, initial=min(start, steps), unit="step", dynamic_ncols=True,
        disable=not progress or jax.process_index() != 0,
    )  # fmt: skip
    examples, tick = 0, time.perf_counter()

    def flush() -> None:
        nonlocal examples, tick
        if not pending:
            return
        for metrics in jax.device_get(pending):
            record = {"step": start + len(history) + 1, **{k: float(v) for k, v in metrics.items()}}
            if not math.isfinite(record["loss"]) and not record.get("skipped"):
                raise FloatingPointError(
                    f"fit: loss is {record['loss']} at step {record['step']}; lower the learning "
                    "rate, check the data for NaNs, or clip gradients (optax.clip_by_global_norm)."
                )
            history.append(record)
        bar.update(len(pending))
        pending.clear()
        now = time.perf_counter()
        shown = {"loss": f"{history[-1]['loss']:.4f}", "ex_per_s": f"{examples / (now - tick):.0f}"}
        if skip_nonfinite:
            shown["skipped"] = f"{sum(r['skipped'] for r in history):.0f}"
        bar.set_postfix(shown)
        examples, tick = 0, now

    def evaluate() -> None:
        nonlocal tick
        flush()
        record = _eval_record(eval_fn, strategy.params(state))
        history[-1].update(record)
        if jax.process_index() == 0:
            bar.write(
                f"step {history[-1]['step']}: "
                + ", ".join(f"{k}={v:.4f}" for k, v in record.items())
            )
        tick = time.perf_counter()  # evaluation time is not training throughput

    try:
        for i, batch in enumerate(itertools.islice(stream, max(steps - start, 0)), start + 1):
            state, metrics = step_fn(state, batch)
            pending.append(metrics)
            examples += _examples(batch)
            if i % log_every == 0:
                flush()
            if eval_fn is not None and eval_every is not None and i % eval_every == 0:
                evaluate()
            if manager is not None and (
                i == steps or (checkpoint_every is not None and i % checkpoint_every == 0)
            ):
                checkpoint.save(manager, i, state, strategy.params(state))
        flush()
        if start >= steps:
            if jax.process_index() == 0:
                bar.write(f"fit: resumed at step {start} of {steps}; nothing left to train.")
            return state, history
        if not history:
            raise ValueError("fit: batches yielded no batch.")
        if start + len(history) < steps:
            warnings.warn(
                f"fit: batches ran out after {start + len(history)} of {steps} steps.",
                stacklevel=2,
            )
            if manager is not None and manager.latest_step() != start + len(history):
                checkpoint.save(manager, start + len(history), state, strategy.params(state))
        if eval_fn is not None and not any(k.startswith("eval") for k in history[-1]):
            evaluate()
        return state, history
    finally:
        bar.close()
        if manager is not None:
            manager.close()  # waits for the last asynchronous save
