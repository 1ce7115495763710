"""Unreliable synchronisations and replica consistency: who arrived, and how far apart."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddl_jax._src.core.strategy import check_real

#: ``fold_in`` tag of the drop draws, apart from the per-worker dropout keys (tags < N).
DROP_STREAM = 0x7FFFFFFF


#: ``fold_in`` tag of the churn draws (workers absent for a step).
CHURN_STREAM = DROP_STREAM - 1


def arrivals(
    key_data: jax.Array,
    step: jax.Array | int,
    n: int | tuple[int, ...],
    drop: float,
    stream: int = DROP_STREAM,
) -> jax.Array:
    """Which of ``n`` workers' messages arrive at ``step``: ``bool[n]`` (or of shape ``n``,
    e.g. ``(n, n)`` receiver by sender), each lost with probability ``drop``, drawn from the
    run's key (``ModelVars.key``) and the step alone, so every worker draws the same mask
    and a resumed run draws the masks an uninterrupted one would. ``stream=CHURN_STREAM``
    draws which workers are present (``drop``: the probability of being absent)."""
    key = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32), impl="threefry2x32")
    key = jax.random.fold_in(jax.random.fold_in(key, step), stream)
    return jax.random.uniform(key, (n,) if isinstance(n, int) else n) >= drop


def check_probability(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1), or a ``ValueError`` naming ``name``."""
    value = check_real(name, value, minimum=0.0)
    if value >= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}.")
    return value


def consensus_distance(replicas: Any) -> float:
    """The replicas' mean Euclidean distance to their average model.

    ``replicas`` is a pytree whose leaves have a leading worker axis ``[N, ...]``, as the
    ``params`` of ``LocalSGDState`` and ``GossipState`` do:
    ``(1/N) sum_i ||theta_i - mean_j theta_j||``, computed on the host in float64, so it
    is 0 exactly when the replicas agree.
    """
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(replicas)]
    _workers(leaves)
    squared = sum(((x - x.mean(0)) ** 2).reshape(len(x), -1).sum(1) for x in leaves)
    return float(np.mean(np.sqrt(squared)))


def best_replica(replicas: Any, score: Callable[[Any], Any]) -> tuple[int, Any]:
    """The replica with the highest ``score``: ``(i, replica_i)``, the first on ties.

    Strategies with one replica per worker (``local_sgd``, ``gossip``, ``noloco``,
    ``streaming_diloco``) return the replicas' mean from ``Strategy.params``; when the
    replicas disagree (unreliable workers, gossip, between synchronisations) the mean may be
    worse than one of them, e.g. for non-convex models far apart. This keeps the best one
    instead, by a held-out score (an accuracy; negate a loss).

    Args:
      replicas: a pytree whose leaves have a leading worker axis ``[N, ...]`` (a state's
        ``params``).
      score: ``replica -> scalar``, higher is better, on one replica's pytree; a nan score
        (a diverged replica) is never the best.

    Raises:
      ValueError: no leading worker axis, or every score is nan.
    """
    leaves, treedef = jax.tree.flatten(replicas)
    host = [np.asarray(x) for x in leaves]
    n = _workers(host)
    trees = [jax.tree.unflatten(treedef, [x[i] for x in host]) for i in range(n)]
    scores = np.array([float(score(tree)) for tree in trees])
    if np.isnan(scores).all():
        raise ValueError(f"best_replica: every replica's score is nan ({n} replicas).")
    best = int(np.nanargmax(scores))  # a diverged replica (nan) is never the best
    return best, trees[best]


def _workers(leaves: list[np.ndarray]) -> int:
    if not leaves or any(x.ndim == 0 or len(x) != len(leaves[0]) for x in leaves):
        raise ValueError(
            "replicas must have a leading worker axis [N, ...] on every leaf (a state's "
            f"params), got shapes {[x.shape for x in leaves]}."
        )
    if not len(leaves[0]):
        raise ValueError("replicas must hold at least one worker, got a worker axis of 0.")
    return len(leaves[0])


def measured_consensus(params: Any, state: Any, every: int, axis: str) -> jax.Array:
    """The replicas' consensus distance at steps divisible by ``every`` (it costs a
    parameter all-reduce), else ``state.consensus_distance`` as last measured."""
    if not every:
        return state.consensus_distance
    return lax.cond(
        state.model.step % every == 0,
        functools.partial(_consensus_distance, axis=axis),
        lambda _: state.consensus_distance,
        params,
    )


def _consensus_distance(params: Any, axis: str) -> jax.Array:
    """The workers' mean distance to their average model."""
    mean = lax.pmean(params, axis)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(mean), strict=True)
    sq = sum(jnp.sum((p - m) ** 2) for p, m in pairs)
    return lax.pmean(jnp.sqrt(sq), axis).astype(jnp.float32)
