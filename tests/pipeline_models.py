"""Pipeline stages for tests, importable without ``conftest`` (which sets this process's
devices): by ``test_pipeline`` and by the processes ``test_pipeline_processes`` launches."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl


class Block(nnx.Module):
    """Dense layers; ReLU after each but the model's last."""

    def __init__(self, sizes, *, last: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.last = last

    def __call__(self, x):
        x = x["x"] if isinstance(x, dict) else x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.last and i == len(self.layers) - 1):
                x = nnx.relu(x)
        return x


def split_model():
    """Two unequal stages: parameter vectors and activations are padded to the largest."""
    blocks = [
        Block([12, 16, 8], last=False, rngs=nnx.Rngs(0)),
        Block([8, 5], last=True, rngs=nnx.Rngs(1)),
    ]
    return ddl.pipeline_stages(blocks)


class NormBlock(nnx.Module):
    """Dense, batch norm, ReLU, dropout: a stage with model state and randomness."""

    def __init__(self, a, b, *, rngs):
        self.linear = nnx.Linear(a, b, rngs=rngs)
        self.norm = nnx.BatchNorm(b, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        x = x["x"] if isinstance(x, dict) else x
        return self.drop(nnx.relu(self.norm(self.linear(x))))


def split_norm_model():
    """Two stages with batch norm and dropout."""
    blocks = [
        NormBlock(12, 8, rngs=nnx.Rngs(0, dropout=7)),
        NormBlock(8, 5, rngs=nnx.Rngs(1, dropout=7)),
    ]
    return ddl.pipeline_stages(blocks)


# The launched processes' runs: name -> (schedule, model).
RUNS = {
    "gpipe": ("gpipe", split_model),
    "1f1b": ("1f1b", split_model),
    "1f1b_norm": ("1f1b", split_norm_model),
}


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def full_loss(stages):
    """The unsplit model's loss: the stages composed on one device."""

    def loss(params, batch):
        x = batch
        for (apply, _), p in zip(stages, params, strict=True):
            x = apply(p, x)
        return xent(x, batch)

    return loss


def reference(loss_fn, optimizer, params, batches):
    params = jax.tree.map(jnp.asarray, params)
    opt_state = optimizer.init(params)
    for batch in batches:
        updates, opt_state = optimizer.update(jax.grad(loss_fn)(params, batch), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def make_batches():
    """Three random batches of 16 for the models above."""
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 12)).astype(np.float32),
            "y": rng.integers(0, 5, size=16).astype(np.int32),
        }
        for _ in range(3)
    ]
