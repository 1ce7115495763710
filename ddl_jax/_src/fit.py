"""The training loop: jit once, step, log, evaluate, checkpoint."""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import autonotebook, std
from tqdm.auto import tqdm

from ddl_jax._src import checkpoint
from ddl_jax._src.model_loss import Variables
from ddl_jax._src.strategy import Batch, Metrics, State, Strategy, check_int

#: ``fit`` warns once when the loss exceeds this multiple of the first recorded loss.
LOSS_GROWTH = 100.0


def _eval_record(eval_fn: Callable[[Variables], Any], variables: Variables) -> dict[str, float]:
    result = jax.device_get(eval_fn(variables))
    if isinstance(result, dict):
        return {f"eval_{k}": float(v) for k, v in result.items()}
    return {"eval": float(result)}


def _examples(batch: Any) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def _interactive() -> bool:
    """Whether a progress bar can redraw in place: stdout is a terminal, or a notebook."""
    if autonotebook.tqdm is not std.tqdm:  # tqdm.auto chose its notebook widget
        return True
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty is not None and isatty())


def _growth_warning(first: dict[str, float], records: list[dict[str, float]]) -> str | None:
    """The warning for a loss in ``records`` that outgrew ``first`` (a record) by
    ``LOSS_GROWTH``, if any: the sign of a learning rate too high, or negative."""
    scale = abs(first["loss"])
    for record in records:
        # An increase of (LOSS_GROWTH - 1) times |first|: > 100x for a positive loss; a
        # negative one (a log-likelihood) that falls further is not growth.
        if _counts(record) and record["loss"] - first["loss"] > (LOSS_GROWTH - 1.0) * scale > 0:
            return (
                f"fit: the loss grew from {first['loss']:.4g} at step {first['step']} to "
                f"{record['loss']:.4g} at step {record['step']} (over {LOSS_GROWTH:g}x): the "
                "learning rate is likely too high, or negative (optax's optimizers descend "
                "for a positive learning_rate). Lower it, add warmup, or clip gradients "
                "(optax.clip_by_global_norm)."
            )
    return None


def _counts(record: dict[str, float]) -> bool:
    return math.isfinite(record["loss"]) and not record.get("skipped")


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
    params: Variables,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    steps: int,
    eval_fn: Callable[[Variables], Any] | None = None,
    eval_every: int | None = None,
    log_every: int = 10,
    progress: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep: int | None = None,
    skip_nonfinite: bool = False,
) -> tuple[State, list[dict[str, float]]]:
    """Trains variables with ``strategy`` for ``steps`` steps, resuming from a checkpoint.

    The variables are what the strategy trains: the params pytree for a plain
    ``loss_fn(params, batch)``, or ``{"params": ..., "batch_stats": ...}`` for a
    ``ddl.ModelLoss`` (a model with batch norm or dropout, from
    ``ddl.flax.loss_from_module``); ``strategy.params(state)`` returns them in the same
    layout.

    The step is jitted once with ``donate_argnums=0`` (the state's buffers are reused in
    place). Metrics stay on the device between log points, so logging does not stall the
    pipeline; every ``log_every`` steps they are fetched and checked for NaN/inf. Process 0
    shows them with examples per second: on a progress bar when stdout is a terminal (or
    in a notebook), else (under a launcher, or redirected to a file) as one plain line
    ``step i/steps: loss=..., ex_per_s=...`` per ``log_every`` steps. A loss that grows over
    ``LOSS_GROWTH`` (100) times the first recorded one gives one ``UserWarning`` (a
    learning rate too high, or negative).

    With ``checkpoint_dir``, every ``checkpoint_every`` steps and after the last step a
    checkpoint is saved there asynchronously (orbax), keeping the last ``keep``: the whole
    strategy state (item ``state``) and ``strategy.params(state)`` (item ``variables``),
    which ``ddl.checkpoint.load_variables(checkpoint_dir)`` reads back without the
    strategy or a mesh. If the directory already holds a readable step ``s``, training
    resumes from its state and runs steps ``s + 1 .. steps`` on batches ``s, s + 1, ...``
    of the stream, so a restarted command ends where an uninterrupted one would (bitwise
    on the same mesh, dropout masks included). A step that fails to restore is reported
    and the previous one used (see ``ddl.checkpoint.restore_latest``).

    Args:
      strategy: what ``ddl.data_parallel`` and the other builders return.
      params: the initial variables (positional; named ``params`` for compatibility): the
        params, or ``{"params": ..., "batch_stats": ...}`` as
        ``ddl.flax.loss_from_module`` returned them for a ``ddl.ModelLoss``. Not
        modified; the strategy places a copy.
      batches: iterable of global batches (e.g. ``ddl.data.batches(train, 256)``), or
        ``start -> iterable`` yielding them from batch ``start`` on (e.g.
        ``lambda s: ddl.data.batches(train, 256, start=s)``), which lets a resumed run
        skip to its data position without replaying the earlier batches; an iterable is
        advanced past the ``start`` batches already trained on.
      steps: total number of training steps (including resumed ones), >= 1.
      eval_fn: ``variables -> scalar | dict of scalars``, run on
        ``strategy.params(state)`` every ``eval_every`` steps and after the last step;
        recorded as ``eval`` / ``eval_<name>``.
      eval_every: steps between evaluations; ``None`` evaluates after the last step only.
      log_every: steps between metric fetches and progress updates.
      progress: show progress (the bar or the plain lines) and one line per evaluation;
        ``False`` prints nothing per step or evaluation (the one-line notice of a resume
        remains). Warnings are given either way.
      checkpoint_dir: directory of the checkpoints (the same path on every process);
        ``None`` neither saves nor resumes.
      checkpoint_every: steps between saves; ``None`` saves after the last step only.
      keep: number of most recent checkpoints kept (default 3).
      skip_nonfinite: do not apply a step whose loss or new state holds NaN/inf, on any
        worker (see ``guard_nonfinite``); such steps are recorded with ``skipped=1.0``
        instead of stopping training.

    Returns:
      ``(state, history)``: the final state (``strategy.params(state)`` are the trained
      variables), and one record per step trained in this call (``{"step": i, "loss":
      ..., ...}``, 1-based, counting resumed steps) with eval results merged into the
      steps where they ran.

    Raises:
      FloatingPointError: the loss became NaN or infinite (naming the step), unless
        ``skip_nonfinite``.
      TypeError: ``strategy`` is not a ``ddl.Strategy``, or ``progress`` or
        ``skip_nonfinite`` not a bool.
      ValueError: bad arguments (among them ``checkpoint_every`` or ``keep`` without
        ``checkpoint_dir``, ``eval_every`` without ``eval_fn``), or a checkpoint of a
        differently shaped state.
    """
    steps = check_int("steps", steps, minimum=1)
    log_every = check_int("log_every", log_every, minimum=1)
    if eval_every is not None:
        eval_every = check_int("eval_every", eval_every, minimum=1)
    if checkpoint_every is not None:
        checkpoint_every = check_int("checkpoint_every", checkpoint_every, minimum=1)
    if keep is not None:
        keep = check_int("keep", keep, minimum=1)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"fit: strategy must be a ddl.Strategy, got {type(strategy).__name__}.")
    for name, value in (("progress", progress), ("skip_nonfinite", skip_nonfinite)):
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"fit: {name} must be a bool, got {value!r}.")
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
    main = jax.process_index() == 0
    show = bool(progress) and main
    bar = None

    def say(line: str, *, notice: bool = False) -> None:
        # A notice (a resume) is shown even with progress=False, once, from process 0.
        if not (show or (notice and main)):
            return
        if bar is None or bar.disable:
            print(line, flush=True)
        else:
            bar.write(line, file=sys.stdout)

    state = strategy.init(params)
    start, manager = 0, None
    try:
        if checkpoint_dir is not None:
            keep = 3 if keep is None else keep
            manager = checkpoint.checkpoint_manager(checkpoint_dir, keep=keep)
            # Not restore_latest: its warning about a corrupt step must name the user's line.
            restored = checkpoint._restore_latest(manager, state)
            if restored is not None:
                state, start = restored
                say(f"fit: resumed from step {start} in {manager.directory}", notice=True)
        # A bar redraws in place; elsewhere (a launcher, a file) flush prints plain lines.
        interactive = show and _interactive()
        bar = tqdm(
            total=steps,
            initial=min(start, steps),
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
            disable=not interactive,
        )
        stream = batches(start) if callable(batches) else itertools.islice(batches, start, None)
        history: list[dict[str, float]] = []
        pending: list[Any] = []
        examples, tick = 0, time.perf_counter()
        checked, warned, first = 0, False, None  # of the loss growth check

        def save(step: int) -> None:
            checkpoint.save(manager, step, state, strategy.params(state))

        def flush() -> None:
            nonlocal examples, tick
            if not pending:
                return
            for metrics in jax.device_get(pending):
                record = {
                    "step": start + len(history) + 1,
                    **{k: float(v) for k, v in metrics.items()},
                }
                if not math.isfinite(record["loss"]) and not record.get("skipped"):
                    raise FloatingPointError(
                        f"fit: loss is {record['loss']} at step {record['step']}; lower the "
                        "learning rate, check the data for NaNs, or clip gradients "
                        "(optax.clip_by_global_norm)."
                    )
                history.append(record)
            bar.update(len(pending))
            pending.clear()
            now = time.perf_counter()
            shown = {
                "loss": f"{history[-1]['loss']:.4f}",
                "ex_per_s": f"{examples / (now - tick):.0f}",
            }
            if skip_nonfinite:
                shown["skipped"] = f"{sum(r['skipped'] for r in history):.0f}"
            if bar.disable:
                say(
                    f"step {history[-1]['step']}/{steps}: "
                    + ", ".join(f"{k}={v}" for k, v in shown.items())
                )
            else:
                bar.set_postfix(shown)
            examples, tick = 0, now

        def evaluate() -> None:
            nonlocal tick
            flush()
            record = _eval_record(eval_fn, strategy.params(state))
            history[-1].update(record)
            say(
                f"step {history[-1]['step']}: "
                + ", ".join(f"{k}={v:.4f}" for k, v in record.items())
            )
            tick = time.perf_counter()  # evaluation time is not training throughput

        def growth() -> str | None:
            # Checks the records fetched since the last call against the first one, until
            # a first warning (one per run).
            nonlocal checked, warned, first
            new, checked = history[checked:], len(history)
            if first is None:
                first = next((r for r in new if _counts(r)), None)
            if warned or first is None:
                return None
            message = _growth_warning(first, new)
            warned = message is not None
            return message

        for i, batch in enumerate(itertools.islice(stream, max(steps - start, 0)), start + 1):
            state, metrics = step_fn(state, batch)
            pending.append(metrics)
            examples += _examples(batch)
            if i % log_every == 0:
                flush()
            if eval_fn is not None and eval_every is not None and i % eval_every == 0:
                evaluate()
            if (message := growth()) is not None:
                warnings.warn(message, stacklevel=2)
            if manager is not None and (
                i == steps or (checkpoint_every is not None and i % checkpoint_every == 0)
            ):
                save(i)
        flush()
        if (message := growth()) is not None:
            warnings.warn(message, stacklevel=2)
        if start >= steps:
            say(f"fit: resumed at step {start} of {steps}; nothing left to train.", notice=True)
            return state, history
        if not history:
            raise ValueError("fit: batches yielded no batch.")
        if start + len(history) < steps:
            warnings.warn(
                f"fit: batches ran out after {start + len(history)} of {steps} steps.",
                stacklevel=2,
            )
            if manager is not None and manager.latest_step() != start + len(history):
                save(start + len(history))
        if eval_fn is not None and not any(k.startswith("eval") for k in history[-1]):
            evaluate()
        return state, history
    finally:
        if bar is not None:
            bar.close()
        if manager is not None:
            manager.close()  # waits for the last asynchronous save
