"""``fit``'s records: metrics fetched in batches, progress shown, the JSON-lines log file,
TensorBoard, callbacks, the loss-growth warning, and the straggler report (``stragglers``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import std

from ddl_jax._src.core.model_loss import Variables
from ddl_jax._src.core.strategy import Metrics
from ddl_jax._src.train.settings import FitSettings
from ddl_jax._src.train.stragglers import StepClock, straggler_lines

#: ``fit`` warns once when the loss exceeds this multiple of the first recorded loss.
LOSS_GROWTH = 100.0


class LossGrowthWarning(UserWarning):
    """``fit``'s warning that the loss grew over ``LOSS_GROWTH`` (100) times its first
    value: the run is diverging. A category of its own, to act on (``ddl-jax compare``
    marks the run diverged) or to make an error: ``warnings.simplefilter("error",
    ddl.LossGrowthWarning)``."""


def _eval_record(eval_fn: Callable[[Variables], Any], variables: Variables) -> dict[str, float]:
    result = jax.device_get(eval_fn(variables))
    named = result if isinstance(result, dict) else {"": result}
    for name, value in named.items():
        if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
            where = f"[{name!r}]" if name else ""
            raise TypeError(
                f"fit: eval_fn must return one number (a 0-d array) or a dict of them; its "
                f"result{where} is {type(value).__name__} of shape {np.shape(value)}: reduce "
                "it (e.g. .mean()) or return a dict of scalars."
            )
    if isinstance(result, dict):
        return {f"eval_{k}": float(v) for k, v in result.items()}
    return {"eval": float(result)}


def _examples(batch: Any) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (as tqdm.autonotebook decides)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _bar() -> type:
    """The progress bar class: tqdm's notebook widget in a Jupyter kernel with ipywidgets,
    else the plain bar (tqdm.auto would import its widget and warn "IProgress not found"
    without ipywidgets)."""
    if _in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm as notebook_bar

        return notebook_bar
    return std.tqdm


def _interactive() -> bool:
    """Whether a progress bar can redraw in place: stdout is a terminal, or a notebook."""
    if _in_notebook():
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


def _log_lines_kept(path: str, start: int) -> list[str] | None:
    """The lines of the log file ``path`` to keep, of steps up to ``start`` (``None``: keep
    the file as it is, or there is none)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        kept = []
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines) - 1:
                    continue  # a write cut short by a crash
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(
                    f"fit: log_file {path!r} is not a log of fit: line {n + 1} is not a JSON "
                    'object with an int "step"; pass a new file, or a log fit wrote.'
                )
            if record["step"] <= start:
                kept.append(line + "\n")
        if "".join(kept) != text:  # also ends a last line its newline did not
            return kept
    return None


def _open_log_file(path: str, kept: list[str] | None) -> TextIO:
    """``path`` opened for appending, holding only the lines ``kept`` (``None``: as it is)."""
    if kept is not None:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    elif os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "a", encoding="utf-8")  # closed by TrainingLog.close


def _json_line(record: dict[str, float]) -> str:
    """``record`` as a line of strict JSON: a non-finite value (a skipped step's loss) as
    ``null``."""
    return json.dumps({k: v if math.isfinite(v) else None for k, v in record.items()}) + "\n"


def summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported on first use (an optional dependency).

    Raises:
      ImportError: tensorboardX is not installed (the message names the extra to install).
    """
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "fit: tensorboard_dir needs tensorboardX, which is not installed; install it with "
            "pip install 'ddl-jax[tensorboard]'."
        ) from e
    return SummaryWriter


class TrainingLog:
    """``fit``'s records: metrics fetched from the device in batches, the progress shown
    (a bar that redraws on a terminal, plain lines elsewhere), the loss-growth check."""

    def __init__(self, settings: FitSettings, *, show: bool) -> None:
        self.steps, self.show, self.skipping = settings.steps, show, settings.skip_nonfinite
        self.path, self.callbacks = settings.log_file, settings.callbacks
        self.tensorboard_dir = settings.tensorboard_dir
        self.file: TextIO | None = None
        self.kept: list[str] | None = None  # the log file's lines to keep, when first written
        self.writer: Any = None  # tensorboardX's SummaryWriter, on process 0
        self.written = self.passed = 0  # records written to the file, given to callbacks
        self.main = jax.process_index() == 0
        self.start = 0
        self.bar: Any = None
        self.history: list[dict[str, float]] = []
        self.pending: list[Any] = []
        self.examples, self.tick = 0, time.perf_counter()
        self.step_seconds: list[float] = []  # wall seconds per step, one per log point
        self.clock = StepClock()  # the host's time per step and its waits (stragglers)
        self.checked, self.warned, self.first = 0, False, None

    def say(self, line: str, *, notice: bool = False) -> None:
        # A notice (a resume) is shown even with progress=False, once, from process 0.
        if not (self.show or (notice and self.main)):
            return
        if self.bar is None or self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line, file=sys.stdout)

    def open(self) -> None:
        """Reads the log file (process 0; it is rewritten from the start step on at the
        first record written: a run that fails before leaves it as it was), opens the
        TensorBoard writer (process 0) and the progress bar."""
        if self.path is not None and self.main:
            self.kept = _log_lines_kept(self.path, self.start)
        if self.tensorboard_dir is not None and self.main:
            # purge_step: TensorBoard hides the directory's earlier events of steps after the
            # start step (all when not resuming), so it shows each step once, as the file does.
            # The suffix keeps runs started in the same second apart, in the order they ran
            # (the file's name otherwise has the time in seconds, and is overwritten).
            self.writer = summary_writer_class()(
                self.tensorboard_dir,
                purge_step=self.start + 1,
                filename_suffix=f".{time.time_ns()}",
            )
        # A bar redraws in place; elsewhere (a launcher, a file) flush prints plain lines.
        self.bar = _bar()(
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
        with self.clock.waiting():
            fetched = jax.device_get(self.pending)
        for metrics in fetched:
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
        now = time.perf_counter()
        self.step_seconds.append((now - self.tick) / len(self.pending))
        self.pending.clear()
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
        with self.clock.waiting():  # the evaluation's results, and any collective in it
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

    def report_stragglers(self, loader_seconds: list[float]) -> None:
        """With several processes, each gives its row of the report (``StepClock.row``);
        process 0 prints ``straggler_lines`` of them, even with ``progress=False``. Every
        process calls this at the end of training."""
        if jax.process_count() == 1:
            return
        mine = self.clock.row(jax.process_index(), loader_seconds, self.step_seconds)
        ranks = multihost_utils.process_allgather(np.asarray(mine, dtype=np.float32))
        for line in straggler_lines(ranks):
            self.say(line, notice=True)

    def pass_on(self) -> bool:
        """Writes the records fetched since the last call to the log file and gives them to
        the callbacks (process 0); whether a callback asked to stop, on every process."""
        if self.passed == len(self.history):
            return False
        self.write()
        stop = False
        for record in self.history[self.passed :] if self.main else ():
            for callback in self.callbacks:
                result = callback(dict(record))
                stop |= result is True or (isinstance(result, np.bool_) and bool(result))
        self.passed = len(self.history)
        if jax.process_count() > 1:  # every process calls this at the same steps
            with self.clock.waiting():  # for process 0's callbacks, among others
                stop = bool(multihost_utils.broadcast_one_to_all(np.bool_(stop)))
        return stop

    def write(self, *, durable: bool = False) -> None:
        """Writes the records not written yet: to the log file, flushed (a crashed process
        keeps what it logged), and with ``durable`` synced to disk (so is a checkpoint's
        save: a crashed machine's log still covers it); to TensorBoard."""
        new = self.history[self.written :]
        if self.path is not None and self.main and new:
            if self.file is None:
                self.file = _open_log_file(self.path, self.kept)
            self.file.writelines(_json_line(r) for r in new)
            self.file.flush()
        if durable and self.file is not None:
            os.fsync(self.file.fileno())
        if self.writer is not None and new:
            for record in new:  # every scalar but the step: loss, metrics, eval results
                for tag, value in record.items():
                    if tag != "step":
                        self.writer.add_scalar(tag, value, global_step=record["step"])
            self.writer.flush()
        self.written = len(self.history)

    def close(self) -> None:
        try:
            self.write(durable=True)  # a run that raised: the records fetched before
        finally:
            for opened in (self.file, self.writer, self.bar):
                if opened is not None:
                    opened.close()
