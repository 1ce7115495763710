"""All-reduce algorithms written as explicit ``ppermute`` rounds, for use inside ``shard_map``.

Each function sums a pytree over the devices of one mesh axis and equals ``lax.psum``
(exactly for integers). Leaves of one dtype are fused into a single flat buffer first, as
Horovod's tensor fusion does, so a model costs one algorithm run per dtype, not per leaf.
Over ``(mesh axis, VIRTUAL)`` (a strategy's ``workers=``, several workers a device) the
rounds run between workers through :func:`ppermute`, with the results of one worker a
device: a move within a device is local, and a device's moves to its neighbours travel
as one permute per device shift, all its workers' rows in it.

The results are equal on every device, but JAX types them as *varying* over the axis (it
cannot prove that values received from neighbours agree). Use them where per-device values
are expected, or in a ``shard_map`` with ``check_vma=False``; ``ddl.allreduce_mean`` does the
latter for you.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddl_jax._src.core.flat import map_fused
from ddl_jax._src.core.strategy import VIRTUAL

#: A mesh axis, or ``(mesh axis, VIRTUAL)``: every worker, several a device.
Axis = str | tuple[str, ...]


def check_axis_in_scope(axis: Axis, *, arg: str = "axis") -> int:
    """Returns the size of the enclosing ``shard_map``'s mesh axis ``axis``, or raises.
    ``(axis, VIRTUAL)``: every worker, several a device (a strategy's ``workers=``)."""
    names = jax.sharding.get_abstract_mesh().axis_names
    mesh_axes = (axis,) if isinstance(axis, str) else tuple(a for a in axis if a != VIRTUAL)
    if not all(a in names for a in mesh_axes):
        raise ValueError(
            f"{arg}={axis!r} is not an axis of the enclosing shard_map's mesh; "
            f"valid axis names: {list(names)}."
        )
    return lax.axis_size(axis)


def ppermute(x: jax.Array, axis: Axis, perm: Any) -> jax.Array:
    """``lax.ppermute(x, axis, perm)``; over ``(mesh axis, VIRTUAL)`` (several workers a
    device, inside the ``vmap`` over them), whose pairs ``lax.ppermute`` cannot take, the
    same move: the device's workers' values gathered, sent once per distinct device
    shift of ``perm`` (none for moves within a device), each worker taking its source's.
    A worker that is no pair's destination gets zeros, as from ``lax.ppermute``."""
    if isinstance(axis, str) or VIRTUAL not in axis:
        return lax.ppermute(x, axis, perm)
    (mesh_axis,) = (a for a in axis if a != VIRTUAL)
    devices, k = lax.axis_size(mesh_axis), lax.axis_size(VIRTUAL)
    source = np.full(devices * k, -1)
    for src, dst in perm:
        source[dst] = src
    me = lax.axis_index(axis)
    src = jnp.asarray(source)[me]
    shift_of = (np.arange(devices * k) // k - source // k) % devices
    rows = lax.all_gather(x, VIRTUAL)  # this device's workers' values, [k, ...]
    out = jnp.zeros_like(x)
    for shift in sorted({int(shift_of[dst]) for _, dst in perm}):
        moves = [(d, (d + shift) % devices) for d in range(devices)]
        got = rows if shift == 0 else lax.ppermute(rows, mesh_axis, moves)
        take = (src >= 0) & (jnp.asarray(shift_of)[me] == shift)
        out = jnp.where(take, got[src % k], out)
    return out


def gather_workers(x: jax.Array, axis: Axis) -> jax.Array:
    """Every worker's ``x``, ``[N, ...]`` in worker order, over ``axis`` or ``(mesh axis,
    VIRTUAL)`` (several workers a device: gathered within the device, then across)."""
    if isinstance(axis, str) or VIRTUAL not in axis:
        return lax.all_gather(x, axis)
    (mesh_axis,) = (a for a in axis if a != VIRTUAL)
    return lax.all_gather(lax.all_gather(x, VIRTUAL), mesh_axis, tiled=True)


def _allreduce(tree: Any, axis_name: Axis, algorithm: Callable[[jax.Array, Axis, int], jax.Array]):
    n = check_axis_in_scope(axis_name, arg="axis_name")
    if n == 1:  # the sum over one device is its own value: no buffers, no rounds
        return jax.tree.map(jnp.asarray, tree)
    total = map_fused(lambda flat: algorithm(flat, axis_name, n), tree)
    if isinstance(axis_name, str) or VIRTUAL not in axis_name:
        return total
    # a device's workers hold the same sum: one copy of it, shared by them (unmapped)
    return jax.tree.map(lambda x: lax.all_gather(x, VIRTUAL)[0], total)


def _ring(x: jax.Array, axis: Axis, n: int) -> jax.Array:
    size = x.size
    chunk = -(-size // n)
    buf = jnp.pad(x, (0, chunk * n - size)).reshape(n, chunk)
    me = lax.axis_index(axis)
    to_right = [(j, (j + 1) % n) for j in range(n)]

    def reduce_scatter(r, buf):  # send chunk me-r, add the chunk me-r-1 arriving from the left
        arrived = ppermute(buf[(me - r) % n], axis, to_right)
        return buf.at[(me - r - 1) % n].add(arrived)

    def all_gather(r, buf):  # pass the finished chunk me+1-r on, store chunk me-r
        arrived = ppermute(buf[(me + 1 - r) % n], axis, to_right)
        return buf.at[(me - r) % n].set(arrived)

    buf = lax.fori_loop(0, n - 1, reduce_scatter, buf)  # now chunk me+1 is the full sum
    buf = lax.fori_loop(0, n - 1, all_gather, buf)
    return buf.reshape(-1)[:size]


def ring_allreduce(x: Any, axis_name: Axis) -> Any:
    """Sums ``x`` over ``axis_name`` with the ring algorithm (Patarasuk & Yuan 2009; Horovod).

    The flat buffer is cut into N chunks. Reduce-scatter: in each of N-1 rounds every device
    sends one chunk to its right neighbour and adds the chunk arriving from its left; then
    each device owns one fully summed chunk. All-gather: N-1 more rounds pass the finished
    chunks around the ring. Any N works; a buffer whose size does not divide by N is padded.

    Cost for a K-byte buffer: each device sends ``2 (N-1) ceil(K/N)`` bytes, the bandwidth
    optimum ``2 (N-1)/N * K`` when N divides K, in ``2 (N-1)`` rounds.

    References:
      Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
      workstations", JPDC 2009. Sergeev & Del Balso, "Horovod", 2018, arXiv:1802.05799.

    Args:
      x: pytree of arrays, this device's values.
      axis_name: mesh axis of the enclosing ``shard_map`` to sum over, or ``(axis,
        VIRTUAL)``: every worker, several a device.

    Returns:
      The sum over the axis, same structure, shapes and dtypes as ``x``.

    Example:
      The result agrees across devices but is typed varying, hence ``check_vma=False``:

      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = ddl.make_mesh(data=4)
      >>> x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("data")))
      >>> total = jax.shard_map(
      ...     lambda x: ddl.collectives.ring_allreduce(x, "data"),
      ...     mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False,
      ... )
      >>> print(total(x))  # every device's row is the sum of the four rows
      [[12. 16.]
       [12. 16.]
       [12. 16.]
       [12. 16.]]
    """
    return _allreduce(x, axis_name, _ring)


def _tree(x: jax.Array, axis: Axis, n: int) -> jax.Array:
    me = lax.axis_index(axis)
    d = 1
    while d < n:  # reduce: the right child of each subtree sends its partial sum left
        x = x + ppermute(x, axis, [(j, j - d) for j in range(d, n, 2 * d)])
        d *= 2
    while d > 1:  # broadcast the root's sum back down the same tree
        d //= 2
        arrived = ppermute(x, axis, [(j, j + d) for j in range(0, n - d, 2 * d)])
        x = jnp.where(me % (2 * d) == d, arrived, x)
    return x


def tree_allreduce(x: Any, axis_name: Axis) -> Any:
    """Sums ``x`` over ``axis_name`` with a binomial tree: reduce to device 0, broadcast back.

    Reduce: in round k (k = 0, 1, ...) every device whose index is ``2^k`` modulo
    ``2^(k+1)`` sends its partial sum to the device ``2^k`` to its left. Broadcast: the same
    tree in reverse. Any N works (a device with no partner in a round sits it out).

    Cost for a K-byte buffer: ``2 ceil(log2 N)`` rounds (latency-optimal); every device
    but the root sends K bytes up once, and every device sends K bytes to each of its
    children on the way down; the root has the most, ``ceil(log2 N)`` children, so it sends
    ``ceil(log2 N) K`` bytes.

    Args:
      x: pytree of arrays, this device's values.
      axis_name: mesh axis of the enclosing ``shard_map`` to sum over, or ``(axis,
        VIRTUAL)``: every worker, several a device.

    Returns:
      The sum over the axis, same structure, shapes and dtypes as ``x``.
    """
    return _allreduce(x, axis_name, _tree)


def _ps(x: jax.Array, axis: Axis, n: int) -> jax.Array:
    if not isinstance(axis, str) and VIRTUAL in axis:
        # N - 1 permutes, each of every device's rows, would cost O(N^2): one gather
        rows = gather_workers(x, axis)  # the server's arrivals, in worker order
        return lax.scan(lambda total, row: (total + row, None), rows[0], rows[1:])[0]
    me = lax.axis_index(axis)
    total = x
    for j in range(1, n):  # every worker pushes to the server, one at a time
        total = total + ppermute(x, axis, [(j, 0)])
    for j in range(1, n):  # the server sends the sum back to each worker
        total = jnp.where(me == j, ppermute(total, axis, [(0, j)]), total)
    return total


def ps_allreduce(x: Any, axis_name: Axis) -> Any:
    """Sums ``x`` over ``axis_name`` through a central parameter server (device 0).

    Every worker sends its values to device 0, which sums them and sends the sum back to
    every worker: the centralised pattern of DistBelief's parameter server, with the
    server's link as the bottleneck.

    Cost for a K-byte buffer: ``2 (N-1)`` rounds; each worker sends K bytes and device 0
    sends ``(N-1) K`` bytes (and receives as many), growing with N. Over ``(axis,
    VIRTUAL)`` (several workers a device) the server's arrivals come from one gather of
    every worker's values, added in the same order: the sum of N devices, the
    simulation's bytes rather than the method's.

    References:
      Dean et al., "Large Scale Distributed Deep Networks", NeurIPS 2012.

    Args:
      x: pytree of arrays, this device's values.
      axis_name: mesh axis of the enclosing ``shard_map`` to sum over, or ``(axis,
        VIRTUAL)``: every worker, several a device.

    Returns:
      The sum over the axis, same structure, shapes and dtypes as ``x``.
    """
    return _allreduce(x, axis_name, _ps)
