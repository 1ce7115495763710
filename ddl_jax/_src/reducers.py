"""Reducers: optax transforms that turn per-worker gradients into one agreed gradient.

A reducer is an ``optax.GradientTransformation`` whose ``update`` runs inside a
strategy's ``shard_map``: it receives this worker's gradient (varying over the data
axis) and returns an update that every worker agrees on. Its ``init`` builds the state of
*one* worker; strategies give each worker its own copy (a leading axis sharded over the
data axis), so error-feedback residuals and similar per-worker memories stay local.
"""

from __future__ import annotations

import jax
import optax

ALGORITHMS = ("psum",)


def check_axis_in_scope(axis: str, *, arg: str = "axis") -> None:
    """Raises ``ValueError`` if ``axis`` is not a mesh axis of the enclosing ``shard_map``."""
    names = jax.sharding.get_abstract_mesh().axis_names
    if axis not in names:
        raise ValueError(
            f"{arg}={axis!r} is not an axis of the mesh this reducer runs on; "
            f"valid axis names: {list(names)}."
        )


def allreduce_mean(axis: str = "data", algorithm: str = "psum") -> optax.GradientTransformation:
    """Averages updates over the workers of mesh axis ``axis``.

    ``g <- (1/N) sum_i g_i`` over the N workers of ``axis``. With ``algorithm="psum"``
    XLA picks the all-reduce implementation (a ring or tree on GPU/TPU interconnects);
    each device sends about ``2 (N-1)/N`` times the gradient bytes.

    Args:
      axis: mesh axis the workers live on.
      algorithm: how the sum is computed; one of ``ALGORITHMS``.

    Returns:
      A stateless ``optax.GradientTransformation`` to run inside ``shard_map``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"allreduce_mean: algorithm={algorithm!r} is not known; valid: {list(ALGORITHMS)}."
        )

    def update(updates, state, params=None):
        del params
        check_axis_in_scope(axis)
        return jax.lax.pmean(updates, axis), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
