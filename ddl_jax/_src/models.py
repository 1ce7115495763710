"""Small Flax NNX models for examples, tests and benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
from flax import nnx


class MLP(nnx.Module):
    """A ReLU multi-layer perceptron: ``in_features -> *hidden -> out_features``."""

    def __init__(
        self, in_features: int, hidden: Sequence[int], out_features: int, *, rngs: nnx.Rngs
    ):
        sizes = [in_features, *hidden, out_features]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    """Two 3x3 convolutions and a dense head, for small images ``[batch, h, w, channels]``."""

    def __init__(
        self,
        image_shape: Sequence[int] = (8, 8, 1),
        out_features: int = 10,
        *,
        channels: int = 16,
        rngs: nnx.Rngs,
    ):
        h, w, c = image_shape
        self.conv1 = nnx.Conv(c, channels, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(2 * channels * -(-h // 2) * -(-w // 2), out_features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))
