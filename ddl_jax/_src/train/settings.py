"""``fit``'s settings, shared by the training loop and its log."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from ddl_jax._src.core.model_loss import Variables


class FitSettings(NamedTuple):
    """``fit``'s arguments past the strategy, the variables and the batches."""

    steps: int
    eval_fn: Callable[[Variables], Any] | None
    eval_every: int | None
    log_every: int
    progress: bool
    checkpoint_dir: str | os.PathLike | None
    checkpoint_every: int | None
    keep: int | None
    skip_nonfinite: bool
    log_file: str | None
    tensorboard_dir: str | None
    callbacks: tuple[Callable[[dict[str, float]], Any], ...]
