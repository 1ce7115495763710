"""Whole-strategy checkpoints with orbax: asynchronous saves, the last k kept, safe resume.

Layout: every step is a directory ``<directory>/<step>/`` holding two orbax items,

* ``state/``: the whole strategy state (what ``Strategy.init`` returns), from which ``fit``
  resumes onto a mesh;
* ``variables/``: what ``Strategy.params(state)`` returns (the params, or
  ``{"params": ..., "batch_stats": ...}`` for a ``ddl.ModelLoss``), replicated, so that
  :func:`load_variables` reads the trained model back with neither the strategy nor a
  mesh, for inference or fine-tuning.

:func:`export` writes a step holding ``variables/`` alone.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from ddl_jax._src.core.model_loss import Variables
from ddl_jax._src.core.strategy import State, check_int

#: Prefix of the name a step directory that failed to restore is moved to (kept, not deleted).
CORRUPT_PREFIX = "corrupt-"
#: The orbax items of a step: the strategy state, and the variables ``Strategy.params`` gives.
STATE, VARIABLES = "state", "variables"
_INT_KEYS = "ddl_jax_int_keys"


def _directory(directory: str | os.PathLike) -> epath.Path:
    """``directory`` as a path orbax accepts: local paths made absolute, URLs kept as URLs.

    ``os.path.abspath`` (and ``epath.Path.absolute``) would turn ``gs://bucket/run`` into a
    local ``<cwd>/gs:/bucket/run``; a URL is already absolute and is left alone.
    """
    path = epath.Path(directory)
    return path if path.is_absolute() else path.absolute()


def checkpoint_manager(directory: str | os.PathLike, *, keep: int = 3) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for strategy states, saving asynchronously.

    A save copies the state to host memory and returns; the files are written in the
    background and a step becomes visible only once complete (orbax writes it under a
    temporary name and renames it), so a crash mid-save leaves the previous steps intact.

    Args:
      directory: where the steps go (created if missing); the same path on every process.
        A local path, or a URL of a file system ``etils.epath`` knows (``gs://bucket/run``).
      keep: number of most recent steps kept, >= 1.

    Returns:
      A manager for ``save`` and ``restore_latest``; close it (or use it as a context
      manager) to wait for the last save.
    """
    keep = check_int("keep", keep, minimum=1)
    return _manager(directory, keep=keep)


def _check_writable(path: epath.Path) -> None:
    """Creates ``path`` if missing and writes a file in it, or raises a ``ValueError``
    naming it: a folder that cannot be written fails here in one line, before the first
    step, not in orbax's background save (whose failure can keep the process from ending)."""
    if "://" in str(path):  # a remote file system reports its own errors, on first use
        return
    probe = path / f".ddl-jax-write-check-{os.getpid()}-{jax.process_index()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(
            f"checkpoint_dir {str(path)!r} cannot be written ({reason}); give a folder this "
            "process can create and write to, the same on every process."
        ) from None


def _manager(directory: str | os.PathLike, *, keep: int | None) -> ocp.CheckpointManager:
    _check_writable(_directory(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True
    )
    handlers = {STATE: ocp.StandardCheckpointHandler(), VARIABLES: ocp.StandardCheckpointHandler()}
    return ocp.CheckpointManager(_directory(directory), options=options, item_handlers=handlers)


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: State | None,
    variables: Variables | None = None,
) -> None:
    """Starts saving step ``step`` (the number of steps trained); returns early.

    Every process must call it with the same step; each writes the shards it holds.

    Args:
      manager: from ``checkpoint_manager``.
      step: the step number, >= 0.
      state: the strategy state (item ``state``), or ``None`` to save ``variables`` alone.
      variables: ``strategy.params(state)`` (item ``variables``), which
        :func:`load_variables` reads back without the strategy; ``None`` leaves it out
        (such a step resumes training but cannot be loaded by :func:`load_variables`).
    """
    step = check_int("step", step, minimum=0)
    items = {}
    if state is not None:
        items[STATE] = ocp.args.StandardSave(state)
    if variables is not None:
        # orbax names dict keys by strings; the int ones (NNX lists) are restored from this.
        metadata = {_INT_KEYS: _int_keys(variables)}
        items[VARIABLES] = ocp.args.StandardSave(variables, custom_metadata=metadata)
    if not items:
        raise ValueError("save: nothing to save; pass state, variables, or both.")
    manager.save(step, args=ocp.args.Composite(**items), force=True)


def export(directory: str | os.PathLike, variables: Variables, *, step: int = 0) -> None:
    """Writes ``variables`` alone as step ``step`` of ``directory``, for :func:`load_variables`.

    For a model trained outside ``fit`` (``fit``'s checkpoints already hold the
    variables). Returns once the files are complete. In a multi-process job every process
    calls it with the same (global) arrays.

    Args:
      directory: where the step goes (created if missing); a local path or a URL.
      variables: a pytree of arrays, e.g. ``strategy.params(state)``, or the variables of
        ``ddl.flax.split(module)``.
      step: the step number, >= 0; it must not exist yet.

    Raises:
      ValueError: ``directory`` already holds step ``step``.
    """
    step = check_int("step", step, minimum=0)
    with _manager(directory, keep=None) as manager:
        if step in manager.all_steps():
            raise ValueError(
                f"export: {manager.directory} already holds step {step}; pass another step= "
                "or another directory."
            )
        save(manager, step, None, variables)


def _int_keys(tree: Any) -> list[list[Any]]:
    """``[path, keys]`` for each dict of ``tree`` with int keys (an NNX list's pure dict):
    ``path`` its key path as orbax names it (strings), ``keys`` those int keys."""
    found: dict[tuple[str, ...], list[int]] = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        for i, key in enumerate(path):
            if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, int | np.integer):
                keys = found.setdefault(tuple(_parts(path[:i])), [])
                if int(key.key) not in keys:
                    keys.append(int(key.key))
    return [[list(path), keys] for path, keys in sorted(found.items())]


def _restore_int_keys(tree: Any, int_keys: list[list[Any]]) -> Any:
    """Gives back the int keys :func:`_int_keys` recorded (orbax restores them as strings)."""
    for path, keys in int_keys:  # parents before children
        node = tree
        for part in path:
            node = node[int(part)] if isinstance(node, list) or part not in node else node[part]
        for key in keys:
            node[key] = node.pop(str(key))
    return tree


def _parts(path: tuple) -> list[str]:
    # orbax names a leaf by its key path (NamedTuple fields, dict keys, sequence indices)
    # as strings.
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return parts


def _name(path: tuple) -> str:
    # Joined with dots: the spelling orbax's metadata reports.
    return ".".join(_parts(path))


def _stored(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    # orbax stores a typed PRNG key array as its uint32 key data.
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(np.shape(leaf)), np.dtype(leaf.dtype)


def _worker_axis(leaf: Any) -> str | None:
    spec = getattr(getattr(leaf, "sharding", None), "spec", ())
    return spec[0] if len(spec) and isinstance(spec[0], str) else None


def check_compatible(manager: ocp.CheckpointManager, step: int, like: State) -> None:
    """Raises ``ValueError`` unless step ``step`` holds a state shaped like ``like``.

    Replicated leaves may be restored onto any mesh; leaves with a leading worker axis
    (``P(axis, ...)``) need the worker count they were saved with.

    Raises:
      ValueError: naming the first leaf that is missing, extra, or of another shape or
        dtype (and saying when the difference is the number of workers).
    """
    saved = {
        md.name: md
        for md in jax.tree.leaves(_state_metadata(manager, step).tree)
        if getattr(md, "name", None) is not None
    }
    wanted = {_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(like)}
    where = f"checkpoint step {step} in {manager.directory}"
    for name in sorted(wanted.keys() - saved.keys()):
        raise ValueError(
            f"{where} has no leaf {name!r} that this strategy's state has; it was saved from "
            f"a different model or strategy (it holds {sorted(saved)[:8]}...)."
        )
    for name in sorted(saved.keys() - wanted.keys()):
        raise ValueError(
            f"{where} holds leaf {name!r} that this strategy's state does not have; it was "
            "saved from a different model or strategy."
        )
    if _skeleton(_state_metadata(manager, step).tree) != _skeleton(
        ocp.tree.serialize_tree(like, keep_empty_nodes=True)
    ):
        raise ValueError(
            f"{where} holds a state of another structure than this strategy's: the same "
            "arrays, but other empty parts (another optimizer chain, e.g. optax.adam "
            "against optax.adamw, or another outer optimizer); it was saved with a "
            "different optimizer or strategy."
        )
    for name, leaf in wanted.items():
        have, (want, dtype) = tuple(saved[name].shape), _stored(leaf)
        axis = _worker_axis(leaf)
        if have != want and axis is not None and have[1:] == want[1:]:
            raise ValueError(
                f"{where}: leaf {name!r} is worker-local state for {have[0]} workers, but the "
                f"mesh has {want[0]} workers on axis {axis!r}. Worker-local state (local "
                "replicas, residuals, queues) cannot change worker count; restore with "
                f"{have[0]} workers: a mesh of that many devices on {axis!r}, or the "
                f"strategy's workers={have[0]} where it takes one."
            )
        if have != want or np.dtype(saved[name].dtype) != dtype:
            raise ValueError(
                f"{where}: leaf {name!r} is {saved[name].dtype}{list(have)} in the checkpoint "
                f"but {dtype}{list(want)} in this strategy's state; it was saved from a "
                "different model or strategy."
            )


def _skeleton(tree: Any) -> Any:
    """The shape of ``tree`` as orbax stores it, empty nodes (``optax.EmptyState()``,
    ``None``, ``{}``) included, which the named leaves alone do not show."""
    empty = lambda x: x is None or (isinstance(x, tuple | list | dict) and not x)  # noqa: E731
    return jax.tree.structure(jax.tree.map(lambda x: None if empty(x) else 0, tree, is_leaf=empty))


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return manager.directory / str(step)


def _check_has_state(manager: ocp.CheckpointManager, step: int) -> None:
    if not (_step_dir(manager, step) / STATE).exists():
        raise ValueError(
            f"checkpoint step {step} in {manager.directory} holds no strategy state (no "
            f"{STATE!r} item): it holds variables alone (ddl.checkpoint.export) or was "
            "written by an older ddl_jax. Resume from a directory of fit's checkpoints, or "
            "read it with ddl.checkpoint.load_variables."
        )


def _has_state(manager: ocp.CheckpointManager, step: int, steps: list[int]) -> bool:
    """Whether ``step`` holds its state item. A step without one is damaged where it holds
    nothing else or another step of the folder holds a state (fit's folder); otherwise it
    is an export, which fit does not resume from (``ValueError``)."""
    has = lambda s: (_step_dir(manager, s) / STATE).exists()  # noqa: E731
    if has(step):
        return True
    if (_step_dir(manager, step) / VARIABLES).exists() and not any(map(has, steps)):
        _check_has_state(manager, step)  # raises: not corruption, no fallback
    return False


def _item_metadata(manager: ocp.CheckpointManager, step: int, item: str) -> Any:
    # One item's alone: unreadable variables must not make a step's state unusable, nor
    # the other way round.
    handler = ocp.StandardCheckpointHandler()
    try:
        return handler.metadata(_step_dir(manager, step) / item)
    finally:
        handler.close()


def _state_metadata(manager: ocp.CheckpointManager, step: int) -> Any:
    _check_has_state(manager, step)
    return _item_metadata(manager, step, STATE)


def _reason(error: Exception, directory: epath.Path) -> str:
    """One short line: the file that failed to read (relative to ``directory``) and why.

    A TensorStore error is a chain ``what: while doing: ... file "<path>": <cause>`` that
    ends in the JSON spec of the whole store: the line keeps the last file and its cause. An
    error that names no file (a JSON file cut short) gets the innermost ``path`` its
    traceback read.
    """
    text = re.sub(r"\s*\[tensorstore_spec=.*", "", str(error), flags=re.DOTALL)
    files = re.findall(r'file "([^"]+)"', text)
    cause = text.rsplit('": ', 1)[-1] if files else text
    frames = [frame.f_locals.get("path") for frame, _ in traceback.walk_tb(error.__traceback__)]
    files = files or [os.fspath(f) for f in frames if isinstance(f, str | os.PathLike)]
    cause = " ".join(cause.split())
    cause = cause if len(cause) <= 200 else cause[:199] + "\u2026"
    where = f"{os.path.relpath(files[-1], os.fspath(directory))}: " if files else ""
    return f"{where}{type(error).__name__}: {cause}"


def _drop_closed_loop_reports() -> None:
    """Silences the noise of a failed orbax read, and nothing else.

    When the first read of a damaged step fails, orbax closes its event loop while
    TensorStore's other reads of that step are still in flight; each then reports
    ``RuntimeError: Event loop is closed`` from ``call_soon_threadsafe`` to
    ``sys.unraisablehook``, one traceback per read, as soon as the failure happens or after
    the fallback returned. Installed before the first read of a restore, the filter drops
    exactly those reports from then on; every other one goes to the hook that was there
    before.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_reports", False):
        return

    def hook(unraisable: Any) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback)
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and frames
            and frames[0].name == "call_soon_threadsafe"
        ):
            previous(unraisable)

    hook.drops_closed_loop_reports = True
    sys.unraisablehook = hook


def _all_ok(ok: bool) -> bool:
    # Every process must fall back to the same step, or their collectives would not match.
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _set_aside(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    src = _step_dir(manager, step)
    dst = manager.directory / f"{CORRUPT_PREFIX}{step}"
    suffix = 0
    while dst.exists():
        suffix += 1
        dst = manager.directory / f"{CORRUPT_PREFIX}{step}.{suffix}"
    # Every process picks its name before any renames, so they all report the same one.
    multihost_utils.sync_global_devices(f"ddl_jax name corrupt checkpoint {step}")
    if jax.process_index() == 0:
        src.rename(dst)
    multihost_utils.sync_global_devices(f"ddl_jax set aside checkpoint {step}")
    manager.reload()
    return dst


def restore_latest(manager: ocp.CheckpointManager, like: State) -> tuple[State, int] | None:
    """Restores the newest readable step onto the shardings of ``like``.

    Steps are tried newest first. One whose state fails to read (truncated or corrupted
    files, missing metadata, no state item where other steps have one: a save or a copy
    cut short) is reported with a ``UserWarning`` naming the step and the
    error, moved aside to ``corrupt-<step>`` (kept for inspection, never deleted), and the
    previous step is tried. Only the step's ``state`` item is read.

    Args:
      manager: from ``checkpoint_manager``.
      like: a state of the strategy being resumed (e.g. ``strategy.init(params)``), whose
        leaves give the shape, dtype and sharding to restore onto: replicated leaves are
        resharded onto its mesh by orbax.

    Returns:
      ``(state, step)``, or ``None`` when the directory holds no readable step.

    Raises:
      ValueError: the checkpoint holds a differently structured state (see
        ``check_compatible``), or no state (a step of ``export``); this is not treated as
        corruption.
    """
    return newest_readable(manager, like)


def abstract_state(state: State) -> State:
    """``state`` as ``jax.ShapeDtypeStruct``s with their shardings: a restore's target
    that holds no memory."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def newest_readable(manager: ocp.CheckpointManager, like: State) -> tuple[State, int] | None:
    """:func:`restore_latest`'s work, for the functions users call (stacklevel below)."""
    # Called only directly by the functions users call (restore_latest, fit), so the
    # warning's stacklevel 3 is the user's line: 1 is here, 2 is that function.
    abstract = abstract_state(like)
    _drop_closed_loop_reports()  # before any read: the reports can come at once
    steps = sorted(manager.all_steps(), reverse=True)
    for step in steps:
        ok = _has_state(manager, step, steps)
        error: Exception = FileNotFoundError(f"no {STATE!r} item: a save or a copy cut short")
        try:
            if ok:
                _item_metadata(manager, step, STATE)
        except Exception as e:  # any unreadable metadata is corruption
            ok, error = False, e
        if _all_ok(ok):
            check_compatible(manager, step, like)
            try:
                args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
                state = manager.restore(step, args=args)[STATE]
                ok = True
            except Exception as e:  # any unreadable array is corruption
                ok, error = False, e
            if _all_ok(ok):
                return state, step
        moved = _set_aside(manager, step)
        reason = _reason(error, manager.directory) if not ok else "unreadable on another process"
        warnings.warn(
            f"checkpoint step {step} in {manager.directory} could not be restored "
            f"({reason}); moved it to {moved} and trying the previous step.",
            stacklevel=3,
        )
    return None


def _read_variables(manager: ocp.CheckpointManager, step: int) -> Variables:
    metadata = _item_metadata(manager, step, VARIABLES)
    # No template to give: NumPy leaves (zero-stride views, no memory) of the stored shapes
    # and dtypes restore as NumPy arrays, whatever mesh wrote them.
    like = jax.tree.map(lambda m: np.broadcast_to(np.zeros((), m.dtype), m.shape), metadata.tree)
    like = _restore_int_keys(like, (metadata.custom_metadata or {}).get(_INT_KEYS, []))
    args = ocp.args.Composite(**{VARIABLES: ocp.args.StandardRestore(like)})
    return manager.restore(step, args=args)[VARIABLES]


def load_variables(directory: str | os.PathLike, step: int | None = None) -> Variables:
    """Reads a checkpoint's variables back as NumPy arrays, without the strategy or a mesh.

    The variables are what ``strategy.params(state)`` returned when ``fit`` saved the step
    (the params, or ``{"params": ..., "batch_stats": ...}`` for a ``ddl.ModelLoss``), or
    what :func:`export` wrote. Put them into a model with ``ddl.flax.update_module(model,
    variables)`` (``model.eval()`` for inference), pass them to ``ddl.flax.split``'s
    ``apply``, or start a new run with ``strategy.init(variables)``. Only the step's
    ``variables`` item is read; nothing in ``directory`` is changed.

    By default the newest step is read; one that fails to read (truncated or corrupted
    files) is reported with a ``UserWarning`` naming the step and the error, and the
    previous step is tried (the step is not moved: ``fit`` sets it aside when it resumes).
    In a multi-process job every process calls it and gets the whole variables.

    Args:
      directory: the ``checkpoint_dir`` of ``fit``, or the directory of :func:`export`; a
        local path or a URL.
      step: the step to read (no fallback), or ``None`` for the newest readable one.

    Returns:
      The variables, a pytree of ``np.ndarray`` (sequences come back as lists).

    Raises:
      FileNotFoundError: ``directory`` does not exist, holds no step (or not ``step``), or
        no step that can be read; the message names the directory.
      ValueError: no step holds variables (saved without them, or by an older ddl_jax),
        the ``step`` asked for holds none or cannot be read, ``step`` is not an int >= 0,
        or ``directory`` is a file.
    """
    if step is not None:
        step = check_int("step", step, minimum=0)
    path = _directory(directory)
    if not path.exists():
        raise FileNotFoundError(f"load_variables: checkpoint directory {path} does not exist.")
    if not path.is_dir():
        raise ValueError(f"load_variables: {path} is a file, not a checkpoint directory.")
    # A manager that never saves: it creates, cleans up and deletes nothing.
    options = ocp.CheckpointManagerOptions(
        create=False, cleanup_tmp_directories=False, enable_async_checkpointing=False
    )
    handlers = {STATE: ocp.StandardCheckpointHandler(), VARIABLES: ocp.StandardCheckpointHandler()}
    with ocp.CheckpointManager(path, options=options, item_handlers=handlers) as manager:
        steps = sorted(manager.all_steps(), reverse=True)
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"load_variables: {path} holds no checkpoint step {step}; it holds steps "
                f"{sorted(steps)}."
            )
        if not steps:
            raise FileNotFoundError(
                f"load_variables: {path} holds no checkpoint step; write one with "
                "ddl.fit(checkpoint_dir=...) or ddl.checkpoint.export."
            )
        failed = []
        _drop_closed_loop_reports()  # before any read: the reports can come at once
        holding = [s for s in steps if (_step_dir(manager, s) / VARIABLES).exists()]
        for s in steps if step is None else [step]:
            if s not in holding:
                if step is not None or not holding:
                    raise ValueError(
                        f"load_variables: checkpoint step {s} in {path} holds no {VARIABLES!r} "
                        "item: it was saved without them (ddl.checkpoint.save(..., variables="
                        "None)) or by an older ddl_jax."
                    )
                failed.append(s)  # the other steps hold them: this one was cut short
                warnings.warn(
                    f"checkpoint step {s} in {path} holds no {VARIABLES!r} item (a save or a "
                    "copy cut short); trying the previous step.",
                    stacklevel=2,
                )
                continue
            error: Exception | None = None
            try:
                variables = _read_variables(manager, s)
            except Exception as e:  # any unreadable file is corruption
                error = e
            if _all_ok(error is None):
                return variables
            reason = "unreadable on another process" if error is None else _reason(error, path)
            if step is not None:
                raise ValueError(
                    f"load_variables: checkpoint step {s} in {path} could not be read ({reason})."
                ) from error
            failed.append(s)
            warnings.warn(
                f"checkpoint step {s} in {path} could not be read ({reason}); trying the "
                "previous step.",
                stacklevel=2,
            )
        raise FileNotFoundError(
            f"load_variables: {path} holds no readable step; steps {sorted(failed)} could not "
            "be read (see the warnings)."
        )
