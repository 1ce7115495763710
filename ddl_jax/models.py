"""Small Flax NNX models for examples, tests and benchmarks."""

from ddl_jax._src.models import CNN, MLP

__all__ = ["CNN", "MLP"]
