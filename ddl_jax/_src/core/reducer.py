"""The reducer contract: what a strategy needs to know of the optax transform that
reduces its gradients (``ddl_jax._src.reduce`` holds the reducers themselves).

A reducer is an ``optax.GradientTransformation`` run inside the strategy's ``shard_map``
on each worker's gradient. Its output must be the same on every worker; its state is the
worker's own. A compressor's state has a ``compression_ratio`` field, reported by
:func:`reducer_metrics`; a reducer built from ``ppermute`` rounds carries the
:class:`PermuteReducer` mark (:func:`checks_vma`); FSDP's reduce-scatters are
:class:`ScatterReducer`s.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import optax
from jax import lax


class PermuteReducer(optax.GradientTransformation):
    """A reducer whose output JAX types as varying over the axis though it agrees across
    workers: the explicit ring, tree and parameter-server all-reduces (built from
    ``ppermute``), and 1-bit Adam (its frozen variance is each worker's own copy, equal on
    all, which JAX cannot prove).

    Its output agrees across workers, but there is no cast from varying to invariant, so a
    strategy runs it in a ``shard_map`` with ``check_vma=False`` (see ``checks_vma``). Pass
    such a reducer to a strategy as it is, or chained with ``ddl.chain``: ``optax.chain``
    would hide the mark.
    """


class ScatterReducer(optax.GradientTransformation):
    """A reducer of per-owner gradient chunks ``[n, *shard]`` to this worker's mean shard
    (``reduce/scatter.py``); ``ddl.fsdp(reducer=...)`` takes only these, and the other
    builders none."""


# The update functions of reducers a worker's zeros leave out (see ``leaves_zeros_out``).
_ZEROS_LEFT_OUT: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_leaves_zeros_out(update: Any) -> Any:
    """Marks a reducer's ``update`` as one a worker's zeros leave out (``leaves_zeros_out``)."""
    _ZEROS_LEFT_OUT.add(update)
    return update


def leaves_zeros_out(reducer: Any) -> bool:
    """Whether a worker that sends zeros to ``reducer`` is left out of its output, which is
    then the others' sum over N (what a strategy that leaves workers out of an exchange
    rescales), up to the wire's rounding and, for a stochastic quantiser, in expectation.
    Stateless means are: ``ddl.allreduce_mean``'s, ``cast`` and ``qsgd``. Error feedback
    would keep the zeros in its residual, a clip or Adasum would take them as a message."""
    return getattr(reducer, "update", None) in _ZEROS_LEFT_OUT


# The update functions of reducers that take ``arrived=`` (see ``takes_arrivals``).
_TAKES_ARRIVALS: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_takes_arrivals(update: Any) -> Any:
    """Marks a reducer's ``update`` as taking ``arrived=`` (``takes_arrivals``)."""
    _TAKES_ARRIVALS.add(update)
    return update


def takes_arrivals(reducer: Any) -> bool:
    """Whether ``reducer.update(updates, state, params, arrived=mask)`` leaves out the
    workers whose ``mask`` entry (``bool[N]``, the same on every worker) is False: their
    messages are not combined and their state is kept, and the output is the combination
    of the others' (a mean over them). Strategies that leave workers out of an exchange
    pass it, and do not rescale."""
    return getattr(reducer, "update", None) in _TAKES_ARRIVALS


def reduce_arrived(
    reducer: optax.GradientTransformation,
    updates: Any,
    state: Any,
    params: Any,
    arrived: jax.Array,
    axis: str | tuple[str, ...],
) -> tuple[Any, Any]:
    """``reducer``'s update over the workers whose message arrived, ``arrived`` (``bool[N]``,
    the same on every worker): the mean of their messages, the others' left out.

    A reducer told who arrived (``takes_arrivals``) is; to one a worker's zeros leave out
    (``leaves_zeros_out``) a left-out worker sends zeros and the sum over N is rescaled to
    the mean over those that arrived (torchft's ``Manager.allreduce``: a replica not
    participating zeroes its tensor, the sum is divided by the participants). Where none
    arrived the output is zeros. ``ValueError`` for another reducer.
    """
    if takes_arrivals(reducer):
        return reducer.update(updates, state, params, arrived=arrived)
    if not leaves_zeros_out(reducer):
        raise ValueError("reduce_arrived: the reducer neither leaves zeros out nor takes arrivals")
    mine = arrived[lax.axis_index(axis)]
    updates = jax.tree.map(lambda u: jnp.where(mine, u, 0), updates)
    updates, state = reducer.update(updates, state, params)
    scale = arrived.size / jnp.maximum(jnp.sum(arrived), 1)
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state


def check_drop_reducer(fn: str, reducer: Any, drop: Any, churn: Any = 0.0) -> None:
    """Refuses a reducer that cannot leave a worker out, where ``drop`` or ``churn`` would."""
    if (drop or churn) and not (leaves_zeros_out(reducer) or takes_arrivals(reducer)):
        given = f"drop={drop}" + (f" and churn={churn}" if churn else "")
        raise ValueError(
            f"{fn}: {given} leaves workers out of exchanges, which only a stateless mean "
            "leaves them out of (the plain mean ddl.allreduce_mean, the default reducer; "
            "ddl.compression.cast and qsgd) or a reducer told who arrived "
            "(ddl.compression.sparse_loco); the reducer given would take a left-out worker's "
            "zeros as its message (into its error feedback, a median clip, Adasum's "
            "combination). Use one of those with it, or this one without it."
        )


def checks_vma(reducer: optax.GradientTransformation) -> bool:
    """Whether a strategy using ``reducer`` can let ``shard_map`` check replication types."""
    return not isinstance(reducer, PermuteReducer)


def reducer_metrics(reducer_state: Any) -> dict[str, jax.Array]:
    """The metrics a reducer reports: ``{"compression_ratio": r}`` for a compressor, else ``{}``.

    ``r`` is the bytes a dense float32 ring all-reduce of the same gradient sends per device
    divided by the bytes the compressor sends per device (both as ``ddl.comm_stats`` charges
    them), for the last exchange; 1 before the first exchange and on a single worker. In a
    chain it is the compressor's own: a collective chained after it is not counted.

    Args:
      reducer_state: one worker's reducer state (any pytree, ``optax.chain`` states
        included); a NamedTuple field ``compression_ratio`` holds the metric.

    Raises:
      ValueError: the state holds several ``compression_ratio`` fields (a chain of several
        compressors), so which one the metric is would be a guess.
    """
    try:
        found = optax.tree.get(reducer_state, "compression_ratio")
    except KeyError:
        raise ValueError(
            "reducer_metrics: the reducer state holds several compression_ratio fields (a "
            "chain of several ddl.compression reducers?); chain at most one compressor, "
            "which averages over the workers, per reducer."
        ) from None
    return {} if found is None else {"compression_ratio": found}


def axes_communicated(jaxpr: Any) -> set[str]:
    """The mesh axes named by the collectives (and axis queries) of a traced program,
    inner jaxprs (``shard_map``, ``cond``, ``scan``) included.

    Args:
      jaxpr: a ``jax.make_jaxpr`` result (or its ``.jaxpr``).
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        for key in ("axes", "axis_name"):
            names = eqn.params.get(key, ())
            names = names if isinstance(names, tuple | list) else (names,)
            found.update(a for a in names if isinstance(a, str))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    found |= axes_communicated(sub)
    return found
