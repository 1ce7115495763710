"""Bundled real data and global-batch iterators."""

from ddl_jax._src.data.datasets import (
    TEXT_TRAIN_FILES,
    TEXT_VALIDATION_FILES,
    Dataset,
    batches,
    digits,
    lm_batches,
    text,
)
from ddl_jax._src.data.non_iid import dirichlet_shares, non_iid_batches

__all__ = [
    "TEXT_TRAIN_FILES",
    "TEXT_VALIDATION_FILES",
    "Dataset",
    "batches",
    "digits",
    "dirichlet_shares",
    "lm_batches",
    "non_iid_batches",
    "text",
]
