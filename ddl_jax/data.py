"""Bundled real data and global-batch iterators."""

from ddl_jax._src.data import (
    TEXT_TRAIN_FILES,
    TEXT_VALIDATION_FILES,
    Dataset,
    batches,
    digits,
    lm_batches,
    text,
)

__all__ = [
    "TEXT_TRAIN_FILES",
    "TEXT_VALIDATION_FILES",
    "Dataset",
    "batches",
    "digits",
    "lm_batches",
    "text",
]
