"""Flat views of pytrees: one vector (or ``[n, chunk]`` blocks, or one buffer per dtype).

Compressors, fused all-reduces, pipeline stages and a sharded parameter server all treat a
parameter pytree as one flat vector. :class:`FlatView` records a template tree's structure
once (from arrays or ``jax.ShapeDtypeStruct``), so the vector can be built, read back, padded
and cut into blocks without tracing the tree again. :func:`map_fused` applies a function to
one flat buffer per dtype, as Horovod's tensor fusion does. Everything here is pure and
static-shaped, usable under ``jit``, ``shard_map`` and ``vmap``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def padded_size(size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``size``."""
    return size + (-size % multiple)


def pad_to(x: jax.Array, multiple: int) -> jax.Array:
    """Flattens ``x`` and pads it with zeros to a multiple of ``multiple`` entries."""
    x = x.reshape(-1)
    return jnp.pad(x, (0, -x.size % multiple))


def _promoted(dtypes: tuple[np.dtype, ...]) -> np.dtype:
    # ravel_pytree's rule: the promoted dtype of the leaves, float32 for a tree with none.
    return jnp.result_type(*dtypes) if dtypes else np.dtype(np.float32)


class FlatView(NamedTuple):
    """A template pytree <-> a flat vector of ``size`` entries, leaves in tree order.

    Attributes:
      treedef: the template's tree structure.
      shapes: each leaf's shape.
      dtypes: each leaf's dtype (canonical: no float64 unless x64 is on).
      size: total number of entries, the sum of the leaves' sizes.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    size: int

    @classmethod
    def of(cls, tree: Any) -> FlatView:
        """The view of ``tree``, whose leaves are arrays, scalars or ``jax.ShapeDtypeStruct``."""
        leaves, treedef = jax.tree.flatten(tree)
        shapes = tuple(tuple(np.shape(x)) for x in leaves)
        # result_type canonicalises (a NumPy float64 leaf is float32 without x64), as the
        # arrays JAX would make from these leaves are.
        dtypes = tuple(jnp.result_type(x) for x in leaves)
        return cls(treedef, shapes, dtypes, sum(map(math.prod, shapes)))

    def _sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def ravel(self, tree: Any, length: int | None = None, dtype: Any = None) -> jax.Array:
        """``tree``'s leaves, flattened, cast to ``dtype``, concatenated and zero-padded.

        Args:
          tree: a tree of the template's structure and shapes.
          length: entries of the result, at least ``size``; ``None`` is ``size``.
          dtype: the result's dtype; ``None`` promotes the template's dtypes, as
            ``jax.flatten_util.ravel_pytree`` does.

        Returns:
          A ``[length]`` vector; entries past ``size`` are zero.
        """
        length = self.size if length is None else length
        if length < self.size:
            raise ValueError(f"FlatView.ravel: length {length} < the tree's size {self.size}.")
        dtype = _promoted(self.dtypes) if dtype is None else dtype
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.shapes):
            raise ValueError(
                f"FlatView.ravel: the tree has {len(leaves)} leaves, the view {len(self.shapes)}."
            )
        if not leaves:
            return jnp.zeros((length,), dtype)
        pieces = [jnp.ravel(x).astype(dtype) for x in leaves]
        size = sum(x.size for x in pieces)
        if size != self.size:
            raise ValueError(f"FlatView.ravel: the tree has {size} entries, not {self.size}.")
        # Zeros concatenated, not jnp.pad: XLA:CPU's pad fusion writes several times slower.
        zeros = [jnp.zeros((length - size,), dtype)] if length > size else []
        return jnp.concatenate(pieces + zeros)

    def unravel(self, vector: jax.Array) -> Any:
        """The tree whose raveled form is ``vector``, each leaf cast back to its dtype.

        Args:
          vector: ``[length]`` with ``length >= size``; entries past ``size`` (padding) are
            ignored.
        """
        if vector.ndim != 1 or vector.shape[0] < self.size:
            raise ValueError(
                f"FlatView.unravel: expected a vector of at least {self.size} entries, "
                f"got shape {vector.shape}."
            )
        sizes = self._sizes()
        # One split, the padding as its last piece: a slice per leaf would trace len(leaves)
        # separate ops.
        pieces = lax.split(vector, [*sizes, vector.shape[0] - self.size])[:-1]
        leaves = [
            p.reshape(s).astype(d) for p, s, d in zip(pieces, self.shapes, self.dtypes, strict=True)
        ]
        return self.treedef.unflatten(leaves)

    def blocks(self, tree: Any, n: int, dtype: Any = None) -> jax.Array:
        """``ravel(tree)``, zero-padded and cut into ``[n, ceil(size / n)]`` blocks.

        Row j is the block of worker (or shard) j: entries ``[j * chunk, (j + 1) * chunk)``.

        Args:
          tree: a tree of the template's structure and shapes.
          n: the number of blocks, >= 1.
          dtype: as in :meth:`ravel`.
        """
        if n < 1:
            raise ValueError(f"FlatView.blocks: n must be >= 1, got {n!r}.")
        return self.ravel(tree, padded_size(self.size, n), dtype).reshape(n, -1)

    def from_blocks(self, blocks: jax.Array) -> Any:
        """The inverse of :meth:`blocks`: ``[n, chunk]`` (any shape, read row-major) to a tree."""
        return self.unravel(blocks.reshape(-1))


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes ``x`` is typed varying over (``aval.mat.varying``; ``vma`` before)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def map_fused(
    fn: Callable[[jax.Array], jax.Array], tree: Any, bucket_bytes: int | None = None
) -> Any:
    """Applies ``fn`` to flat buffers of ``tree``'s leaves, one dtype each, and splits them back.

    Fusing the leaves of a dtype (Horovod's tensor fusion, DDP's gradient buckets) makes a
    collective run once per buffer rather than once per leaf; ``fn`` sees no mixed-dtype
    casts, so integers stay exact. Inside ``shard_map`` leaves are grouped by the mesh axes
    they vary over too: a leaf replicated over an axis never shares a buffer with one that
    varies over it, and keeps its type.

    Args:
      fn: maps a 1-D buffer to a 1-D buffer of the same size and dtype; entry i of its result
        goes back where entry i of its argument came from.
      tree: a pytree of arrays (or scalars, which become arrays).
      bucket_bytes: ``None``: one buffer per dtype. Else the leaves of a dtype fill buffers
        in tree order up to this many bytes each; a larger leaf is a buffer of its own.

    Returns:
      A tree of ``tree``'s structure, shapes and dtypes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(x) for x in leaves]
    groups: dict[Any, list[list[int]]] = {}  # (dtype, axes) in order of first appearance
    sizes: dict[Any, int] = {}
    for i, leaf in enumerate(leaves):
        kind = (leaf.dtype, varying_axes(leaf))
        buckets = groups.setdefault(kind, [[]])
        full = bucket_bytes is not None and sizes.get(kind, 0) + leaf.nbytes > bucket_bytes
        if full and buckets[-1]:
            buckets.append([])
            sizes[kind] = 0
        buckets[-1].append(i)
        sizes[kind] = sizes.get(kind, 0) + leaf.nbytes
    out: list[Any] = [None] * len(leaves)
    for members in (m for buckets in groups.values() for m in buckets):
        group = [leaves[i] for i in members]
        view = FlatView.of(group)
        for i, leaf in zip(members, view.unravel(fn(view.ravel(group))), strict=True):
            out[i] = leaf
    return treedef.unflatten(out)
