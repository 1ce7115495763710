"""Whole-strategy checkpoints with orbax: asynchronous saves, the last k kept, safe resume."""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from ddl_jax._src.strategy import State, check_positive_int

#: Prefix of the name a step directory that failed to restore is moved to (kept, not deleted).
CORRUPT_PREFIX = "corrupt-"


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
    check_positive_int("keep", keep)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(
        _directory(directory), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def save(manager: ocp.CheckpointManager, step: int, state: State) -> None:
    """Starts saving ``state`` as step ``step`` (the number of steps trained); returns early.

    Every process must call it with the same step; each writes the shards it holds.
    """
    manager.save(step, args=ocp.args.StandardSave(state), force=True)


def _name(path: tuple) -> str:
    # orbax names a leaf by its key path joined with dots (NamedTuple fields, dict keys,
    # sequence indices): the same spelling its metadata reports.
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


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
        for md in jax.tree.leaves(manager.item_metadata(step).tree)
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
    for name, leaf in wanted.items():
        have, (want, dtype) = tuple(saved[name].shape), _stored(leaf)
        axis = _worker_axis(leaf)
        if have != want and axis is not None and have[1:] == want[1:]:
            raise ValueError(
                f"{where}: leaf {name!r} is worker-local state for {have[0]} workers, but the "
                f"mesh has {want[0]} workers on axis {axis!r}. Worker-local state (local "
                "replicas, residuals, queues) cannot change worker count; restore on a mesh "
                f"with {have[0]} workers."
            )
        if have != want or np.dtype(saved[name].dtype) != dtype:
            raise ValueError(
                f"{where}: leaf {name!r} is {saved[name].dtype}{list(have)} in the checkpoint "
                f"but {dtype}{list(want)} in this strategy's state; it was saved from a "
                "different model or strategy."
            )


def _all_ok(ok: bool) -> bool:
    # Every process must fall back to the same step, or their collectives would not match.
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _set_aside(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    src = manager.directory / str(step)
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

    Steps are tried newest first. One that fails to read (truncated or corrupted files,
    missing metadata) is reported with a ``UserWarning`` naming the step and the error,
    moved aside to ``corrupt-<step>`` (kept for inspection, never deleted), and the
    previous step is tried.

    Args:
      manager: from ``checkpoint_manager``.
      like: a state of the strategy being resumed (e.g. ``strategy.init(params)``), whose
        leaves give the shape, dtype and sharding to restore onto: replicated leaves are
        resharded onto its mesh by orbax.

    Returns:
      ``(state, step)``, or ``None`` when the directory holds no readable step.

    Raises:
      ValueError: the checkpoint holds a differently structured state (see
        ``check_compatible``); this is not treated as corruption.
    """
    return _restore_latest(manager, like)


def _restore_latest(manager: ocp.CheckpointManager, like: State) -> tuple[State, int] | None:
    # Called only directly by the functions users call (restore_latest, fit), so the
    # warning's stacklevel 3 is the user's line: 1 is here, 2 is that function.
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            manager.item_metadata(step)
            ok = True
        except Exception as e:  # any unreadable metadata is corruption
            ok, error = False, e
        if _all_ok(ok):
            check_compatible(manager, step, like)
            try:
                state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
                ok = True
            except Exception as e:  # any unreadable array is corruption
                ok, error = False, e
            if _all_ok(ok):
                return state, step
        moved = _set_aside(manager, step)
        reason = f"{type(error).__name__}: {error}" if not ok else "unreadable on another process"
        warnings.warn(
            f"checkpoint step {step} in {manager.directory} could not be restored "
            f"({reason[:500]}); moved it to {moved} and trying the previous step.",
            stacklevel=3,
        )
    return None
