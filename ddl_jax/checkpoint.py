"""Whole-strategy checkpoints: asynchronous orbax saves, the last k kept, safe resume."""

from ddl_jax._src.checkpoint import check_compatible, checkpoint_manager, restore_latest, save

__all__ = ["check_compatible", "checkpoint_manager", "restore_latest", "save"]
