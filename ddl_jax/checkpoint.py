"""Whole-strategy checkpoints: asynchronous orbax saves, the last k kept, safe resume, and
the trained variables read back without the strategy."""

from ddl_jax._src.train.checkpoint import (
    check_compatible,
    checkpoint_manager,
    export,
    load_variables,
    restore_latest,
    save,
)

__all__ = [
    "check_compatible",
    "checkpoint_manager",
    "export",
    "load_variables",
    "restore_latest",
    "save",
]
