"""Small Flax NNX models for examples, tests and benchmarks."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddl_jax._src.core.layer_scan import scan_layers

_Loss = TypeVar("_Loss", float, jax.Array)


class MLP(nnx.Module):
    """A ReLU multi-layer perceptron: ``in_features -> *hidden -> out_features``."""

    def __init__(
        self, in_features: int, hidden: Sequence[int], out_features: int, *, rngs: nnx.Rngs
    ):
        sizes = [in_features, *hidden, out_features]
        names = ["in_features", *(f"hidden[{i}]" for i in range(len(sizes) - 2)), "out_features"]
        _check_positive("MLP", **dict(zip(names, sizes, strict=True)))
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
        if len(image_shape) != 3:
            raise ValueError(f"CNN: image_shape must be (h, w, channels), got {image_shape!r}.")
        h, w, c = image_shape
        _check_positive("CNN", out_features=out_features, channels=channels,
                        **{f"image_shape[{i}]": v for i, v in enumerate(image_shape)})  # fmt: skip
        self.conv1 = nnx.Conv(c, channels, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(2 * channels * -(-h // 2) * -(-w // 2), out_features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


def _check_positive(fn: str, **values: int) -> None:
    for name, value in values.items():
        if (
            isinstance(value, bool | np.bool_)
            or not isinstance(value, numbers.Integral)
            or value < 1
        ):
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {value!r}.")


class _ResidualBlock(nnx.Module):
    """conv-BN-relu-conv-BN plus a shortcut (a strided 1x1 conv-BN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, bn: dict, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(c_in, c_out, (3, 3), strides=stride, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(c_out, **bn, rngs=rngs)
        self.conv2 = nnx.Conv(c_out, c_out, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(c_out, **bn, rngs=rngs)
        if stride != 1 or c_in != c_out:
            self.project = nnx.Sequential(
                nnx.Conv(c_in, c_out, (1, 1), strides=stride, use_bias=False, rngs=rngs),
                nnx.BatchNorm(c_out, **bn, rngs=rngs),
            )
        else:
            self.project = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.project is None else self.project(x)
        return nnx.relu(y + shortcut)


class ResNet(nnx.Module):
    """A small ResNet with batch norm, for images ``float[batch, h, w, channels]``.

    A 3x3 conv-BN-relu stem, one residual block per entry of ``channels`` (each after the
    first halves the resolution), global average pooling and a dense head. Batch norm
    normalises with the batch's statistics and updates its running averages (the module's
    ``nnx.BatchStat`` variables) after ``model.train()``, and uses the running averages
    after ``model.eval()``. A new model is in training mode.

    Args:
      image_shape: ``(h, w, channels)`` of one image; the default fits ``ddl.data.digits``
        with ``flatten=False``.
      out_features: number of classes.
      channels: output channels of the stem and of each residual block.
      momentum: decay of batch norm's running averages.
      batch_norm_axis: ``axis_name`` of every ``nnx.BatchNorm``: ``None`` normalises with
        the statistics of the examples this call sees; a mesh axis (``"data"``) averages
        them over the workers of that axis (the model must then run under that axis).
      rngs: parameter initialisation.
    """

    def __init__(
        self,
        image_shape: Sequence[int] = (8, 8, 1),
        out_features: int = 10,
        *,
        channels: Sequence[int] = (16, 32),
        momentum: float = 0.9,
        batch_norm_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        if len(image_shape) != 3:
            raise ValueError(f"ResNet: image_shape must be (h, w, channels), got {image_shape!r}.")
        _check_positive("ResNet", out_features=out_features, **{"image_shape[2]": image_shape[2]})
        if not channels:
            raise ValueError("ResNet: channels must name at least one block.")
        for c in channels:
            _check_positive("ResNet", channels=c)
        bn = {"momentum": momentum, "axis_name": batch_norm_axis}
        self.stem = nnx.Conv(image_shape[2], channels[0], (3, 3), use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(channels[0], **bn, rngs=rngs)
        self.blocks = nnx.List(
            [
                _ResidualBlock(c_in, c_out, 1 if i == 0 else 2, bn, rngs=rngs)
                for i, (c_in, c_out) in enumerate(itertools.pairwise([channels[0], *channels]))
            ]
        )
        self.head = nnx.Linear(channels[-1], out_features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``float32[batch, out_features]`` of images ``[batch, h, w, channels]``."""
        x = nnx.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class _DecoderBlock(nnx.Module):
    """Pre-LayerNorm causal self-attention and MLP, each followed by dropout (whose stream
    it keeps unless ``keep_rngs=False``: then each call passes its key)."""

    def __init__(
        self,
        features: int,
        heads: int,
        dropout: float,
        *,
        dtype: Any,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
    ):
        self.ln1 = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads, features, decode=False, keep_rngs=False, dtype=dtype, rngs=rngs
        )
        kept = rngs if keep_rngs else None
        self.drop1 = nnx.Dropout(dropout, rngs=kept)
        self.ln2 = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(features, 4 * features, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * features, features, dtype=dtype, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout, rngs=kept)

    def __call__(self, x: jax.Array, mask: jax.Array, rngs: Any) -> jax.Array:
        x = x + self.drop1(self.attention(self.ln1(x), mask=mask), rngs=rngs)
        return x + self.drop2(self.down(nnx.gelu(self.up(self.ln2(x)))), rngs=rngs)


class GPT(nnx.Module):
    """A small GPT-style decoder-only transformer over tokens (bytes by default).

    Token embedding plus learned positions, ``layers`` pre-LayerNorm blocks of causal
    multi-head self-attention and a 4x MLP, each followed by ``nnx.Dropout(dropout)`` (as
    is the embedding), a final LayerNorm and a head tied to the token embedding (or a
    separate linear layer). Position ``t`` of the logits depends only on tokens ``0..t``.

    Dropout is active after ``model.train()`` (a new model is in training mode) and off
    after ``model.eval()``; its masks come from the ``rngs.dropout`` stream (``default``
    if absent) of the constructor's ``rngs``, advanced on every call, unless the call
    passes its own ``rngs``.

    Args:
      vocab: vocabulary size; 256 for the bytes of ``ddl.data.text``. Tokens must lie in
        ``[0, vocab)``: one outside it is not an error but an embedding of NaN (JAX's
        gather fills out-of-range rows), so NaN logits and loss.
      context: longest sequence the model takes (the number of learned positions).
      features: width of the residual stream; divisible by ``heads``.
      heads: attention heads.
      layers: transformer blocks.
      dropout: dropout rate in [0, 1).
      tied: the output head is the transpose of the token embedding.
      dtype: the dtype every layer computes in (``jnp.bfloat16`` for mixed precision: the
        parameters stay float32, LayerNorm statistics are taken in float32, the logits
        come back float32); ``None``: the parameters' dtype.
      scan_layers: keep the blocks as one stacked module (every parameter with a leading
        axis of ``layers``) run by ``ddl.layers.scan_layers``, as MaxText's
        ``scan_layers``: one block's program compiled once, and under
        ``ddl.fsdp(stage=3)`` one block's parameters gathered at a time. Each block's
        dropout key is split from one draw of the model's stream per call.
      rngs: parameter initialisation and the dropout stream.
    """

    def __init__(
        self,
        vocab: int = 256,
        context: int = 128,
        features: int = 128,
        heads: int = 4,
        layers: int = 2,
        dropout: float = 0.1,
        *,
        tied: bool = True,
        dtype: Any = None,
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ):
        _check_positive(
            "GPT", vocab=vocab, context=context, features=features, heads=heads, layers=layers
        )
        if not isinstance(scan_layers, bool):
            raise ValueError(f"GPT: scan_layers must be a bool, got {scan_layers!r}.")
        if features % heads:
            raise ValueError(f"GPT: features={features} is not divisible by heads={heads}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GPT: dropout must be in [0, 1), got {dropout!r}.")
        self.context = context
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, features, embedding_init=init, dtype=dtype, rngs=rngs)
        self.positions = nnx.Embed(context, features, embedding_init=init, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.scan_layers = scan_layers
        if scan_layers:
            self.blocks = _stacked(
                [
                    _DecoderBlock(features, heads, dropout, dtype=dtype, rngs=rngs, keep_rngs=False)
                    for _ in range(layers)
                ]
            )
            self.block_rngs = nnx.Rngs(dropout=rngs.dropout() if "dropout" in rngs else rngs())
        else:
            self.blocks = nnx.List(
                [
                    _DecoderBlock(features, heads, dropout, dtype=dtype, rngs=rngs)
                    for _ in range(layers)
                ]
            )
        self.ln = nnx.LayerNorm(features, dtype=dtype, rngs=rngs)
        self.head = (
            None if tied else nnx.Linear(features, vocab, use_bias=False, dtype=dtype, rngs=rngs)
        )

    def __call__(self, tokens: jax.Array, *, rngs: nnx.Rngs | jax.Array | None = None) -> jax.Array:
        """Next-token logits ``float32[batch, t, vocab]`` of tokens ``int[batch, t]``.

        Args:
          tokens: integer tokens, ``t <= context``.
          rngs: dropout randomness for this call, an ``nnx.Rngs`` or a PRNG key; ``None``
            uses the model's own stream.
        """
        if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= self.context:
            raise ValueError(
                f"GPT: tokens must be int[batch, t] with 1 <= t <= context={self.context}, "
                f"got shape {tokens.shape}."
            )
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            rngs = nnx.Rngs(dropout=rngs)
        x = self.embed(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        x = self.drop(x, rngs=rngs)
        mask = nnx.make_causal_mask(tokens)
        if self.scan_layers:
            x = self._scanned_blocks(x, mask, rngs)
        else:
            for block in self.blocks:
                x = block(x, mask, rngs)
        x = self.ln(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))

    def _scanned_blocks(self, x: jax.Array, mask: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        """The stacked blocks in turn through ``ddl.layers.scan_layers``, block i's dropout
        drawing the i-th of keys split from one draw of the stream."""
        graphdef, state = nnx.split(self.blocks)
        layers = jax.tree.leaves(state)[0].shape[0]
        stream = (rngs if rngs is not None else self.block_rngs).dropout
        keys = jax.random.split(stream(), layers)

        def block(layer: Any, h: jax.Array) -> jax.Array:
            state, key = layer
            return nnx.merge(graphdef, state)(h, mask, key)

        return scan_layers(block, (state, keys), x)


def _stacked(blocks: list[nnx.Module]) -> nnx.Module:
    """One module of the blocks' structure whose every variable stacks the blocks' along a
    leading axis."""
    graphdef, *states = zip(*(nnx.split(b) for b in blocks), strict=True)
    return nnx.merge(graphdef[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states[0]))


def bits_per_byte(loss_nats: _Loss) -> _Loss:
    """Mean cross-entropy in nats per token as bits per byte (token), ``loss / ln 2``.

    With one token per byte (``ddl.data.text``), a model that knows nothing scores 8.
    """
    return loss_nats / math.log(2)
