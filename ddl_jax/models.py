"""Small Flax NNX models for examples, tests and benchmarks."""

from ddl_jax._src.models.zoo import CNN, GPT, MLP, ResNet, bits_per_byte

__all__ = ["CNN", "GPT", "MLP", "ResNet", "bits_per_byte"]
