"""What compressing reducers share: compact payloads on the wire, and their metrics.

The compressors of ``ddl.compression`` send compact arrays (packed bits, int8 levels,
values plus int32 indices, low-rank factors) through ``all_to_all`` / ``all_gather`` /
``psum``, so the bytes they save are visible in the compiled program (``ddl.comm_stats``).
Quantisers that would otherwise all-gather a payload growing with N use the compressed
all-reduce of 1-bit Adam (Tang et al. 2021): a compressed reduce-scatter (``all_to_all``
of one chunk per owner), the owner averages and re-compresses its chunk, and a compressed
all-gather brings every chunk back to every worker.

Every compressing reducer's state is a NamedTuple with a ``compression_ratio`` field, which
strategies report in their step metrics through :func:`reducer_metrics`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddl_jax._src.core.flat import FlatView, varying_axes
from ddl_jax._src.reduce.collectives import gather_workers

# numpy, not jnp: a jnp array made at import time would start JAX's backend.
_BIT = np.arange(8, dtype=np.uint8)


def typed_like(new_state: Any, state: Any) -> Any:
    """``new_state`` with each leaf typed varying over the axes its ``state`` leaf varies over.

    A reducer's state is a worker's own (strategies stack one per worker), so it comes in
    typed varying; parts computed from gathered or summed values (a shared factor, the
    compression ratio) come out invariant. Typing them back keeps the state one type
    through ``lax.scan`` and ``lax.cond`` (local SGD's synchronisation branch). Under
    ``check_vma=False`` nothing is typed varying and this does nothing.
    """

    def one(new: Any, old: Any) -> Any:
        missing = tuple(sorted(varying_axes(old) - varying_axes(new)))
        return lax.pcast(new, missing, to="varying") if missing else new

    return jax.tree.map(one, new_state, state)


def ratio(dense_elements: int, wire_bytes: float, n: int) -> jax.Array:
    """``compression_ratio`` of a payload sending ``wire_bytes`` per device, over ``n`` workers."""
    if n == 1:
        return jnp.ones((), jnp.float32)
    return jnp.asarray(2 * (n - 1) / n * 4 * dense_elements / wire_bytes, jnp.float32)


def unravel_updates(view: FlatView, vector: jax.Array) -> Any:
    """The updates tree read from the flat ``vector`` (padding past ``view.size`` ignored),
    each leaf cast back to its gradient's dtype, as the plain all-reduce returns it (so
    bfloat16 parameters get bfloat16 updates, and an optimizer's state keeps its dtype)."""
    return view.unravel(vector)


def pack_bits(bits: jax.Array) -> jax.Array:
    """Packs booleans ``[..., 8m]`` into ``uint8 [..., m]``; bit j of byte b is entry 8b+j."""
    grouped = bits.reshape(*bits.shape[:-1], -1, 8).astype(jnp.uint8)
    return (grouped << _BIT).sum(axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_bits`: ``uint8 [..., m]`` to booleans ``[..., 8m]``."""
    bits = (packed[..., None] >> _BIT) & jnp.uint8(1)
    return bits.astype(bool).reshape(*packed.shape[:-1], -1)


def to_bits(x: jax.Array) -> jax.Array:
    """``x`` reinterpreted as unsigned integers of its width.

    XLA's CPU backend widens 16-bit float collectives to float32; integers travel as they
    are, so the wire carries the bytes the dtype promises.
    """
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of :func:`to_bits`."""
    return lax.bitcast_convert_type(x, dtype)


def scatter_to_owners(chunks: jax.Array, axis: str) -> jax.Array:
    """Row ``j`` of ``chunks [n, ...]`` goes to worker ``j``; returns ``[n, ...]`` by sender.

    One ``all_to_all``: each device sends ``(n-1)/n`` of its payload. Over ``(mesh axis,
    VIRTUAL)`` (several workers a device), every worker's chunks gathered, each worker
    taking the rows addressed to it: the simulation's bytes, not the reducer's.
    """
    if isinstance(axis, str):
        return lax.all_to_all(chunks, axis, 0, 0, tiled=False)
    return gather_workers(chunks, axis)[:, lax.axis_index(axis)]


def gather_from_owners(chunk: jax.Array, axis: str) -> jax.Array:
    """Every owner's ``chunk [...]``, stacked ``[n, ...]`` in worker order (one ``all_gather``).

    The result is typed invariant over ``axis`` (the same on every worker), so a reducer
    whose output is computed from gathered values only passes ``shard_map``'s
    replication check, inside ``optax.chain`` too: the compiled all-gather is the same.
    Over ``(mesh axis, VIRTUAL)``: ``collectives.gather_workers``.
    """
    if isinstance(axis, str):
        return lax.all_gather(chunk, axis, to="invarying")
    return gather_workers(chunk, axis)


def owner_slice(full: jax.Array, owner: jax.Array, size: int) -> jax.Array:
    """Entries ``[owner * size, (owner + 1) * size)`` of the flat ``full``."""
    return lax.dynamic_slice_in_dim(full, owner * size, size)


def owner_update(full: jax.Array, owner: jax.Array, chunk: jax.Array) -> jax.Array:
    """``full`` with :func:`owner_slice` replaced by ``chunk``."""
    return lax.dynamic_update_slice_in_dim(full, chunk, owner * chunk.size, 0)
