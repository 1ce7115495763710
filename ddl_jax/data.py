"""Bundled real data and global-batch iterators."""

from ddl_jax._src.data import Dataset, batches, digits

__all__ = ["Dataset", "batches", "digits"]
