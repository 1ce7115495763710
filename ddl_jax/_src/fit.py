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
      params: the initial variables: the params of a plain ``loss_fn(params, batch)``, or
        ``{"params": ..., "batch_stats": ...}`` for a ``ddl.ModelLoss`` (as
        ``ddl.flax.loss_from_module`` returns them; ``strategy.params(state)`` gives the
        same layout). Not modified; the strategy places a copy.
      batches: iterable of global batches (e.g. ``ddl.data.batches(train, 256)``), or
        ``start -> iterable`` from batch ``start`` on (``lambda s: ddl.data.batches(train,
        256, start=s)``: a resumed run skips to its data position without replaying it).
      steps: total number of training steps (including resumed ones), >= 1.
      eval_fn: ``variables -> scalar | dict of scalars``, run on
        ``strategy.params(state)`` every ``eval_every`` steps and after the last step;
        recorded as ``eval`` / ``eval_<name>``.
      eval_every: steps between evaluations; ``None`` evaluates after the last step only.
      log_every: steps between metric fetches and progress updates.
      progress: show progress and one line per evaluation; ``False`` prints nothing but
        the one-line notice of a resume (warnings are given either way).
      checkpoint_dir: the checkpoints' directory, the same on every process (``None``: none).
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
      TypeError: ``strategy`` is not a ``ddl.Strategy``, or a flag is not a bool.
      ValueError: bad arguments (among them ``checkpoint_every`` or ``keep`` without
        ``checkpoint_dir``, ``eval_every`` without ``eval_fn``), or a checkpoint of a
        differently shaped state.
    """
    steps, log_every, eval_every, checkpoint_every, keep = _check_fit_arguments(
        strategy,
        steps,
        eval_fn,
        eval_every,
        log_every,
        progress,
        checkpoint_dir,
        checkpoint_every,
        keep,
        skip_nonfinite,
    )
    step_fn = jax.jit(
        guard_nonfinite(strategy.step) if skip_nonfinite else strategy.step,
        donate_argnums=0,
    )
    log = _Log(steps, show=bool(progress) and jax.process_index() == 0, skipping=skip_nonfinite)
    state = strategy.init(params)
    manager = None
    try:
        if checkpoint_dir is not None:
            manager = checkpoint.checkpoint_manager(
                checkpoint_dir, keep=3 if keep is None else keep
            )
            # Not restore_latest: its warning about a corrupt step must name the user's line.
            restored = checkpoint._restore_latest(manager, state)
            if restored is not None:
                state, log.start = restored
                log.say(f"fit: resumed from step {log.start} in {manager.directory}", notice=True)
        log.open_bar()
        return _train(
            strategy,
            step_fn,
            state,
            batches,
            log,
            manager,
            eval_fn,
            eval_every,
            log_every,
            checkpoint_every,
        )
    finally:
        log.close()
        if manager is not None:
            manager.close()  # waits for the last asynchronous save


def _train(
    strategy: Strategy,
    step_fn: Callable[[State, Batch], tuple[State, Metrics]],
    state: State,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    log: _Log,
    manager: Any,
    eval_fn: Callable[[Variables], Any] | None,
    eval_every: int | None,
    log_every: int,
    checkpoint_every: int | None,
) -> tuple[State, list[dict[str, float]]]:
    """``fit``'s loop from its start step on, and what follows the last step (warnings
    here name ``fit``'s caller: stacklevel 3)."""
    steps = log.steps
    start = log.start
    stream = batches(start) if callable(batches) else itertools.islice(batches, start, None)

    def save(step: int) -> None:
        checkpoint.save(manager, step, state, strategy.params(state))

    def evaluate() -> None:
        log.evaluate(eval_fn, lambda: strategy.params(state))

    for i, batch in enumerate(itertools.islice(stream, max(steps - start, 0)), start + 1):
        state, metrics = step_fn(state, batch)
        log.add(metrics, batch)
        if i % log_every == 0:
            log.flush()
        if eval_fn is not None and eval_every is not None and i % eval_every == 0:
            evaluate()
        if (message := log.growth()) is not None:
            warnings.warn(message, stacklevel=3)
        if manager is not None and (
            i == steps or (checkpoint_every is not None and i % checkpoint_every == 0)
        ):
            save(i)
    log.flush()
    if (message := log.growth()) is not None:
        warnings.warn(message, stacklevel=3)
    history = log.history
    if start >= steps:
        log.say(f"fit: resumed at step {start} of {steps}; nothing left to train.", notice=True)
        return state, history
    if not history:
        raise ValueError("fit: batches yielded no batch.")
    if start + len(history) < steps:
        warnings.warn(
            f"fit: batches ran out after {start + len(history)} of {steps} steps.",
            stacklevel=3,
        )
        if manager is not None and manager.latest_step() != start + len(history):
            save(start + len(history))
    if eval_fn is not None and not any(k.startswith("eval") for k in history[-1]):
        evaluate()
    return state, history


def _check_fit_arguments(
    strategy: Any,
    steps: Any,
    eval_fn: Any,
    eval_every: Any,
    log_every: Any,
    progress: Any,
    checkpoint_dir: Any,
    checkpoint_every: Any,
    keep: Any,
    skip_nonfinite: Any,
) -> tuple[int, int, int | None, int | None, int | None]:
    """``fit``'s argument checks; returns the checked integers."""
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
    return steps, log_every, eval_every, checkpoint_every, keep


class _Log:
    """``fit``'s records: metrics fetched from the device in batches, the progress shown
    (a bar that redraws on a terminal, plain lines elsewhere), the loss-growth check."""

    def __init__(self, steps: int, *, show: bool, skipping: bool) -> None:
        self.steps, self.show, self.skipping = steps, show, skipping
        self.main = jax.process_index() == 0
        self.start = 0
        self.bar: Any = None
        self.history: list[dict[str, float]] = []
        self.pending: list[Any] = []
        self.examples, self.tick = 0, time.perf_counter()
        self.checked, self.warned, self.first = 0, False, None

    def say(self, line: str, *, notice: bool = False) -> None:
        # A notice (a resume) is shown even with progress=False, once, from process 0.
        if not (self.show or (notice and self.main)):
            return
        if self.bar is None or self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line, file=sys.stdout)

    def open_bar(self) -> None:
        # A bar redraws in place; elsewhere (a launcher, a file) flush prints plain lines.
        self.bar = tqdm(
            total=self.steps,
            initial=min(self.start, self.steps),
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
            disable=not (self.show and _interactive()),
        )
        self.tick = time.perf_counter()

    def add(self, metrics: Metrics, batch: Any) -> None:
        self.pending.append(metrics)
        self.examples += _examples(batch)

    def flush(self) -> None:
        if not self.pending:
            return
        history = self.history
        for metrics in jax.device_get(self.pending):
            record = {"step": self.start + len(history) + 1}
            record |= {k: float(v) for k, v in metrics.items()}
            if not math.isfinite(record["loss"]) and not record.get("skipped"):
                raise FloatingPointError(
                    f"fit: loss is {record['loss']} at step {record['step']}; lower the "
                    "learning rate, check the data for NaNs, or clip gradients "
                    "(optax.clip_by_global_norm)."
                )
            history.append(record)
        self.bar.update(len(self.pending))
        self.pending.clear()
        now = time.perf_counter()
        shown = {
            "loss": f"{history[-1]['loss']:.4f}",
            "ex_per_s": f"{self.examples / (now - self.tick):.0f}",
        }
        if self.skipping:
            shown["skipped"] = f"{sum(r['skipped'] for r in history):.0f}"
        if self.bar.disable:
            fields = ", ".join(f"{k}={v}" for k, v in shown.items())
            self.say(f"step {history[-1]['step']}/{self.steps}: {fields}")
        else:
            self.bar.set_postfix(shown)
        self.examples, self.tick = 0, now

    def evaluate(self, eval_fn: Callable[[Variables], Any], variables: Callable[[], Any]) -> None:
        self.flush()
        record = _eval_record(eval_fn, variables())
        self.history[-1].update(record)
        fields = ", ".join(f"{k}={v:.4f}" for k, v in record.items())
        self.say(f"step {self.history[-1]['step']}: {fields}")
        self.tick = time.perf_counter()  # evaluation time is not training throughput

    def growth(self) -> str | None:
        """The loss-growth warning for the records fetched since the last call, once."""
        new, self.checked = self.history[self.checked :], len(self.history)
        if self.first is None:
            self.first = next((r for r in new if _counts(r)), None)
        if self.warned or self.first is None:
            return None
        message = _growth_warning(self.first, new)
        self.warned = message is not None
        return message

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
