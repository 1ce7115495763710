"""The training loop: jit once, step, log, evaluate, checkpoint."""

from __future__ import annotations

import collections
import functools
import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddl_jax._src.core.model_loss import Variables
from ddl_jax._src.core.strategy import ISLAND, Batch, Metrics, State, Strategy, check_int
from ddl_jax._src.train import checkpoint, launch
from ddl_jax._src.train.log import LossGrowthWarning, TrainingLog, summary_writer_class
from ddl_jax._src.train.settings import FitSettings


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
        finite = jnp.isfinite(metrics["loss"]) & _finite(new)
        kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
        return kept, {**metrics, "skipped": jnp.where(finite, 0.0, 1.0)}

    return guarded


def _finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (over the global arrays:
    the same answer on every worker and process)."""
    finite = jnp.bool_(True)
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            finite &= jnp.isfinite(leaf).all()
    return finite


_all_finite = jax.jit(_finite)  # a state checked before it is checkpointed


@functools.lru_cache(maxsize=16)
def _guarded(step: Callable[[State, Batch], tuple[State, Metrics]]) -> Any:
    """``guard_nonfinite(step)``, the same function for the same step: ``jax.jit`` finds
    it compiled in a later ``fit`` of the strategy (a new wrapper would compile again)."""
    return guard_nonfinite(step)


#: Steps dispatched ahead of their results: beyond this the host waits for the oldest.
#: Unbounded asynchronous dispatch (``log_every`` larger than the run) of multi-device
#: programs deadlocks XLA:CPU's in-process collectives on a few cores (8 simulated
#: devices on 2 cores: "Expected 8 threads to join the rendezvous"); a few steps ahead
#: keep the host and the devices overlapped.
MAX_IN_FLIGHT = 4


def _timed(batches: Iterable[Any], seconds: list[float]) -> Iterator[Any]:
    """``batches``, appending to ``seconds`` the time each one took to draw (the loader)."""
    iterator = iter(batches)
    while True:
        tick = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        seconds.append(time.perf_counter() - tick)
        yield batch


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
    log_file: str | os.PathLike | None = None,
    tensorboard_dir: str | os.PathLike | None = None,
    callbacks: Sequence[Callable[[dict[str, float]], Any]] = (),
) -> tuple[State, list[dict[str, float]]]:
    """Trains variables with ``strategy`` for ``steps`` steps, resuming from a checkpoint.

    The step is jitted once with ``donate_argnums=0`` (the state's buffers are reused in
    place). Metrics stay on the device between log points, so logging does not stall the
    pipeline; every ``log_every`` steps they are fetched and checked for NaN/inf. Process 0
    shows them with examples per second: on a progress bar when stdout is a terminal (or
    in a notebook), else (under a launcher, or redirected to a file) as one plain line
    ``step i/steps: loss=..., ex_per_s=...`` per ``log_every`` steps. A loss that grows over
    ``LOSS_GROWTH`` (100) times the first recorded one gives one ``ddl.LossGrowthWarning``
    (a learning rate too high, or negative).

    With several processes, each measures per step after the first (which compiles) its
    host's seconds (wall time less its waits on device results: the loader, callbacks,
    logging) and its waits, the loader's part (the time inside ``next`` of ``batches``),
    and its wall seconds per step between log points. At the end all exchange them, and
    process 0 prints, even with ``progress=False``, one line per rank (host mean, loader
    mean, host worst step, wait mean, step median) and names the straggler: the rank
    whose host time exceeds every other rank's ``STRAGGLER_RATIO`` (2) times and by at
    least 1 ms. The others wait for it inside each step's collectives, so their waits on
    results grow by about its extra host time. A rank slow in its device computation
    (a shared core) delays every rank alike and is not told apart; the report says so.
    One process reports nothing.

    With ``checkpoint_dir``, every ``checkpoint_every`` steps and after the last step a
    checkpoint is saved there asynchronously (orbax), keeping the last ``keep``: the whole
    strategy state (item ``state``) and ``strategy.params(state)`` (item ``variables``),
    which ``ddl.checkpoint.load_variables(checkpoint_dir)`` reads back without the
    strategy or a mesh. If the directory already holds a readable step ``s``, training
    resumes from its state and runs steps ``s + 1 .. steps`` on batches ``s, s + 1, ...``
    of the stream, so a restarted command ends where an uninterrupted one would (bitwise
    on the same mesh, dropout masks included). A step that fails to restore is reported
    and the previous one used (see ``ddl.checkpoint.restore_latest``); when none can be,
    ``fit`` says it trains from step 0. Before each save the steps' losses are fetched and
    the state is checked: a non-finite loss, or a finite one whose update made the state
    non-finite, raises there (no checkpoint holds it, none before it is rotated out).
    The last step is saved before the final evaluation and the callbacks, so that their
    failure loses no training.

    Records (the history's dicts) are passed on to ``log_file`` and ``tensorboard_dir``,
    then to each callback, on process 0, once final: those fetched at a log point (every
    ``log_every`` steps, each evaluation, the end) before the next step runs, their eval
    results merged. A callback returning ``True`` stops training there: ``fit`` saves a
    checkpoint of the last step trained (with ``checkpoint_dir``) and returns the history
    so far, with no final evaluation. The records fetched with the stopping one are still
    passed on: to stop at an exact step, use ``log_every=1`` or decide on eval results.
    Early stopping when ``eval_loss`` has not improved for 5 evaluations, for example::

        evals = []
        def early_stop(record):
            if "eval_loss" in record:
                evals.append(record["eval_loss"])
                return len(evals) > 5 and min(evals[-5:]) > min(evals[:-5])
        fit(strategy, params, batches, steps=10**4, eval_fn=evaluate, eval_every=100,
            callbacks=[early_stop])

    Args:
      strategy: what ``ddl.data_parallel`` and the other builders return.
      params: the initial variables: the params of a plain ``loss_fn(params, batch)``, or
        ``{"params": ..., "batch_stats": ...}`` for a ``ddl.ModelLoss`` (as
        ``ddl.flax.loss_from_module`` returns them; ``strategy.params(state)`` gives the
        same layout). Not modified; the strategy places a copy.
      batches: iterable of global batches (e.g. ``ddl.data.batches(train, 256)``), or
        ``start -> iterable`` from batch ``start`` on (a resumed run skips to its data).
      steps: total number of training steps (including resumed ones), >= 1.
      eval_fn: ``variables -> scalar | dict of scalars``, run on
        ``strategy.params(state)`` every ``eval_every`` steps and after the last step;
        recorded as ``eval`` / ``eval_<name>``. The variables it gets share the state's
        buffers, which the next step reuses (the state is donated): to keep them (the
        best so far), keep a copy, ``jax.tree.map(jnp.copy, variables)``.
      eval_every: steps between evaluations; ``None`` evaluates after the last step only.
      log_every: steps between metric fetches and progress updates.
      progress: show progress and one line per evaluation; ``False`` prints nothing but
        the one-line notice of a resume and the straggler report of several processes
        (warnings are given either way).
      checkpoint_dir: the checkpoints' directory, the same on every process (``None``: none).
      checkpoint_every: steps between saves; ``None`` saves after the last step only.
      keep: number of most recent checkpoints kept (default 3).
      skip_nonfinite: do not apply a step whose loss or new state holds NaN/inf, on any
        worker (see ``guard_nonfinite``); such steps are recorded with ``skipped=1.0``
        instead of stopping training, and a run that skipped more than half of its steps
        ends with a warning.
      log_file: a JSON-lines file (parents created) to which process 0 appends the records
        as they are passed on, and those up to each checkpoint before it is saved (but the
        last, written after the final evaluation), flushed;
        non-finite values are written ``null`` (strict JSON). With its first record, the
        lines of steps after the start step are dropped (all of them when not resuming);
        a run that fails before leaves the file as it was.
      tensorboard_dir: a TensorBoard log directory (created) to which process 0 writes
        every scalar of each record but ``step`` at its step (tensorboardX, the extra
        ``pip install 'ddl-jax[tensorboard]'``), each step once across resumes. An
        argument, not a callback: ``fit`` knows where the run starts and when it ends.
      callbacks: ``record -> Any``, called on process 0 with a copy of each record as it is
        passed on; ``True`` (a bool or NumPy bool) stops training on every process.

    Returns:
      ``(state, history)``: the final state (``strategy.params(state)`` are the trained
      variables), and one record per step trained in this call (``{"step": i, "loss":
      ..., ...}``, 1-based, counting resumed steps) with eval results merged into the
      steps where they ran. A checkpoint already at ``steps`` or beyond trains nothing:
      its state and an empty history, with no evaluation.

    Raises:
      ImportError: ``tensorboard_dir`` is given and tensorboardX is not installed.
      FloatingPointError: the loss became NaN or infinite (naming the step), unless
        ``skip_nonfinite``.
      TypeError, ValueError: bad arguments (e.g. ``checkpoint_every`` without
        ``checkpoint_dir``, a ``log_file`` that is a directory, ``steps``, ``log_every``,
        ``eval_every`` (or an ``eval_fn`` on some processes only), ``checkpoint_dir``,
        ``checkpoint_every``, ``keep`` or ``skip_nonfinite`` that differ between
        processes), or a checkpoint of a differently shaped state (``ValueError``).
    """
    settings = _check_fit_arguments(strategy, locals())  # fit's arguments by name
    launch.same_on_every_process(
        "fit",
        steps=settings.steps,
        log_every=settings.log_every,
        eval_every=settings.eval_every,
        evaluates=settings.eval_fn is not None,
        checkpoint_dir=None if settings.checkpoint_dir is None else str(settings.checkpoint_dir),
        checkpoint_every=settings.checkpoint_every,
        keep=settings.keep,
        skip_nonfinite=settings.skip_nonfinite,
    )
    log = TrainingLog(settings, show=settings.progress and jax.process_index() == 0)
    state = strategy.init(params)
    _warn_islands_apart(state)
    manager = None
    try:
        if settings.checkpoint_dir is not None:
            manager = checkpoint.checkpoint_manager(
                settings.checkpoint_dir, keep=settings.keep or 3
            )
            # Not restore_latest: its warning about a corrupt step must name the user's line.
            if saved := manager.all_steps():
                # restored into the state's shapes, its arrays freed first: one in memory
                like, state = checkpoint.abstract_state(state), None
                if (restored := checkpoint.newest_readable(manager, like)) is not None:
                    state, log.start = restored
                    log.say(f"fit: resumed from step {log.start} in {manager.directory}",
                            notice=True)  # fmt: skip
                else:
                    state = strategy.init(params)
                    log.say(
                        f"fit: none of the {len(saved)} checkpoints in {manager.directory} "
                        "could be restored (each moved aside, see the warnings): training from "
                        "step 0.",
                        notice=True,
                    )
        log.open()
        return _train(strategy, state, batches, log, manager, settings)
    except KeyboardInterrupt:
        if manager is not None:
            manager.wait_until_finished()  # a save under way completes first
        log.say(_interrupted(manager), notice=True)
        raise
    finally:
        log.close()
        if manager is not None:
            manager.close()  # waits for the last asynchronous save


def _interrupted(manager: Any) -> str:
    """What an interrupted ``fit`` leaves: the step its last complete checkpoint holds."""
    if manager is None:
        return "fit: interrupted; no checkpoint_dir, so nothing was saved."
    step = manager.latest_step()
    if step is None:
        return f"fit: interrupted before the first checkpoint in {manager.directory}."
    return (
        f"fit: interrupted; the last complete checkpoint holds step {step} in "
        f"{manager.directory}: run the same fit again to resume from it."
    )


def _warn_islands_apart(state: State) -> None:
    """Warns where a strategy meant as an island's (``inner=``) trains on its own: its
    islands never exchange. An outer method's state has no ``params`` of its own."""
    leaves = jax.tree.leaves(getattr(state, "params", None))
    mesh = getattr(getattr(leaves[0], "sharding", None), "mesh", None) if leaves else None
    if mesh is None or mesh.shape.get(ISLAND, 1) == 1:
        return
    warnings.warn(
        f"fit: the strategy's mesh has {mesh.shape[ISLAND]} islands, which never exchange: "
        "pass the strategy as inner= to an outer method (ddl.local_sgd(inner=strategy, "
        "period=H), streaming_diloco, noloco, gossip), or build it without an island axis.",
        stacklevel=3,
    )


def _train(
    strategy: Strategy,
    state: State,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    log: TrainingLog,
    manager: Any,
    settings: FitSettings,
) -> tuple[State, list[dict[str, float]]]:
    """``fit``'s loop from its start step on, and what follows the last step (warnings
    here name ``fit``'s caller: stacklevel 3)."""
    step_fn = jax.jit(
        _guarded(strategy.step) if settings.skip_nonfinite else strategy.step,
        donate_argnums=0,
    )
    steps, eval_fn, eval_every = settings.steps, settings.eval_fn, settings.eval_every
    start = log.start
    stream = batches(start) if callable(batches) else itertools.islice(batches, start, None)

    of_state: list[Any] = [None, None]  # a state and its strategy.params, for one step

    def variables() -> Any:
        """``strategy.params(state)`` once for a step's evaluation and checkpoint alike
        (under FSDP each is a gather of the whole model)."""
        if of_state[0] is not state:
            of_state[:] = [state, strategy.params(state)]
        return of_state[1]

    def save(step: int, *, final: bool = False) -> None:
        # The loss of every step saved is checked first (a non-finite one raises: no bad
        # state is saved, no good one rotated out), and its records are written (but the
        # last, which the final evaluation may still add to): the log covers every
        # checkpoint, so a resume after a crash leaves no step unlogged.
        log.flush()
        if not bool(_all_finite(state)):  # a finite loss, then an update that overflowed
            raise FloatingPointError(
                f"fit: the state after step {step} holds non-finite values (its loss was "
                "finite: the update made them); no checkpoint of it is saved. Lower the "
                "learning rate, clip gradients (optax.clip_by_global_norm), or skip such "
                "steps (skip_nonfinite=True)."
            )
        if not final:
            log.write(durable=True)
        checkpoint.save(manager, step, state, variables())

    def evaluate() -> None:
        log.evaluate(eval_fn, variables)

    stopped = False
    in_flight: collections.deque[Any] = collections.deque()
    loader_seconds: list[float] = []  # per batch drawn: the straggler report's
    drawn = _timed(itertools.islice(stream, max(steps - start, 0)), loader_seconds)
    for i, batch in enumerate(drawn, start + 1):
        # Step i - 1's records are final (evaluated) now: pass them on before step i.
        if stopped := log.pass_on():
            break
        state, metrics = step_fn(state, batch)
        log.add(metrics, batch)
        in_flight.append(metrics)
        if len(in_flight) > MAX_IN_FLIGHT:
            with log.clock.waiting():
                jax.block_until_ready(in_flight.popleft())
        if i % settings.log_every == 0:
            log.flush()
        if eval_fn is not None and eval_every is not None and i % eval_every == 0:
            evaluate()
        if (message := log.growth()) is not None:
            warnings.warn(message, LossGrowthWarning, stacklevel=3)
        if manager is not None and (
            settings.checkpoint_every is not None and i % settings.checkpoint_every == 0
        ):
            with log.clock.waiting():  # the gather and the processes' barriers, mostly
                save(i)
        of_state[:] = [None, None]  # not held into the next step
        log.clock.lap()
    log.flush()
    if (message := log.growth()) is not None:
        warnings.warn(message, LossGrowthWarning, stacklevel=3)
    history = log.history
    if start >= steps:
        log.say(
            f"fit: resumed at step {start} of {steps}; nothing left to train (no evaluation: "
            "eval_fn(strategy.params(state)) evaluates the state returned).",
            notice=True,
        )
        return state, history
    if not history:
        if start:
            raise ValueError(
                f"fit: batches yielded no batch from step {start + 1} on, where the run "
                f"resumes (its checkpoint of step {start} in {manager.directory}); give "
                "batches beyond it, or steps <= the steps they hold."
            )
        raise ValueError("fit: batches yielded no batch.")
    last = start + len(history)
    if manager is not None and manager.latest_step() != last:
        save(last, final=True)  # before the final evaluation and callbacks: kept if they fail
    if not stopped:
        if last < steps:
            warnings.warn(f"fit: batches ran out after {last} of {steps} steps.", stacklevel=3)
        if eval_fn is not None and not any(k.startswith("eval") for k in history[-1]):
            evaluate()
        log.pass_on()
    skipped = sum(1 for r in history if r.get("skipped")) if settings.skip_nonfinite else 0
    if skipped == len(history) > 0:
        warnings.warn(
            f"fit: all {len(history)} steps were skipped (a non-finite loss or new state on "
            "some worker, every step): the parameters did not change. Check the initial "
            "parameters and the data for NaN/inf, or lower the learning rate.",
            stacklevel=3,
        )
    elif 2 * skipped > len(history):  # overflowing again and again: hardly trained
        warnings.warn(
            f"fit: {skipped} of {len(history)} steps were skipped (a non-finite loss or new "
            "state on some worker): most updates were not applied. Lower the learning rate "
            "or mixed_precision's loss_scale, or clip gradients (optax.clip_by_global_norm).",
            stacklevel=3,
        )
    log.report_stragglers(loader_seconds)
    return state, history


def _check_fit_arguments(strategy: Any, arguments: dict[str, Any]) -> FitSettings:
    """``fit``'s argument checks, of its ``arguments`` by name; returns the checked ones."""
    args = FitSettings(**{name: arguments[name] for name in FitSettings._fields})
    steps = check_int("fit: steps", args.steps, minimum=1)
    log_every = check_int("fit: log_every", args.log_every, minimum=1)
    eval_every, checkpoint_every, keep = (
        None if value is None else check_int(f"fit: {name}", value, minimum=1)
        for name, value in (
            ("eval_every", args.eval_every),
            ("checkpoint_every", args.checkpoint_every),
            ("keep", args.keep),
        )
    )
    if not isinstance(strategy, Strategy):
        raise TypeError(f"fit: strategy must be a ddl.Strategy, got {type(strategy).__name__}.")
    batches = arguments["batches"]
    if isinstance(batches, Mapping | str | bytes) or not (
        callable(batches) or isinstance(batches, Iterable)
    ):
        raise TypeError(
            f"fit: batches must be an iterable of global batches, or start -> one, got "
            f"{type(batches).__name__} (a dataset? ddl.data.batches(train, batch_size) "
            "draws batches from it)."
        )
    for name, value in (("progress", args.progress), ("skip_nonfinite", args.skip_nonfinite)):
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"fit: {name} must be a bool, got {value!r}.")
    if args.eval_fn is not None and not callable(args.eval_fn):
        raise TypeError(
            f"fit: eval_fn must be callable (variables -> a scalar or a dict of scalars), got "
            f"{type(args.eval_fn).__name__}."
        )
    if eval_every is not None and args.eval_fn is None:
        raise ValueError(f"fit: eval_every={eval_every!r} needs eval_fn, got eval_fn=None.")
    if isinstance(args.checkpoint_dir, str) and not args.checkpoint_dir:
        raise ValueError(
            "fit: checkpoint_dir must name a directory, got '' (None saves no checkpoints)."
        )
    _check_path_type("checkpoint_dir", args.checkpoint_dir)
    for name, value in (("checkpoint_every", checkpoint_every), ("keep", keep)):
        # Without a directory nothing is saved: a silently ignored setting would hide that.
        if value is not None and args.checkpoint_dir is None:
            raise ValueError(
                f"fit: {name}={value!r} needs checkpoint_dir, got checkpoint_dir=None; pass "
                "the directory to save checkpoints to."
            )
    tensorboard_dir = _check_path("tensorboard_dir", args.tensorboard_dir, directory=True)
    if tensorboard_dir is not None:
        summary_writer_class()  # tensorboardX is there, on every process, before training
    return args._replace(
        steps=steps,
        log_every=log_every,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        keep=keep,
        progress=bool(args.progress),
        skip_nonfinite=bool(args.skip_nonfinite),
        log_file=_check_path("log_file", args.log_file, directory=False),
        tensorboard_dir=tensorboard_dir,
        callbacks=_check_callbacks(args.callbacks),
    )


def _check_path(name: str, value: Any, *, directory: bool) -> str | None:
    """``value`` as a str path naming a file (or a directory), or ``None``."""
    if value is None:
        return None
    path = _check_path_type(name, value)
    isdir = os.path.isdir(path)
    wrong = (os.path.exists(path) and not isdir) if directory else isdir
    if not path or wrong:
        what = f" ({'a file' if directory else 'a directory'})" if path else ""
        kind = "a directory" if directory else "a file"
        raise ValueError(f"fit: {name} must name {kind}, got {path!r}{what}.")
    return path


def _check_path_type(name: str, value: Any) -> str | None:
    """``value`` as a str path, or ``None``; raises ``TypeError`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or isinstance(os.fspath(value), bytes):
        raise TypeError(
            f"fit: {name} must be a str or os.PathLike path, or None, got "
            f"{type(value).__name__} {value!r}."
        )
    return os.fspath(value)


def _check_callbacks(callbacks: Any) -> tuple[Callable[[dict[str, float]], Any], ...]:
    if callable(callbacks) or not isinstance(callbacks, Sequence) or isinstance(callbacks, str):
        raise TypeError(
            f"fit: callbacks must be a sequence of callables (callbacks=[fn] for one), got "
            f"{type(callbacks).__name__} {callbacks!r}."
        )
    for n, callback in enumerate(callbacks):
        if not callable(callback):
            raise TypeError(f"fit: callbacks[{n}] must be callable, got {callback!r}.")
    return tuple(callbacks)
