"""Delayed Nesterov: the outer optimizer of asynchronous local SGD (Liu et al. 2024).

A parameter server that applies each worker's pseudo-gradient on arrival with Nesterov
momentum lets the momentum of stale pushes pile up. Delayed Nesterov buffers the arrivals
and updates the momentum once every ``delay`` arrivals, from their average; in between,
each arrival is applied as a plain SGD step (plus, optionally, a fraction ``c`` of the
momentum). A transform here, so any server (``ddl.async_sgd``) can run it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ddl_jax._src.core.strategy import check_int, check_real


class DelayedNesterovState(NamedTuple):
    """State of :func:`delayed_nesterov`.

    Attributes:
      count: arrivals so far (int32 scalar), t - 1 before the t-th.
      momentum: m, updated every ``delay`` arrivals (params-shaped).
      buffer: Delta, the sum of the arrivals since the last momentum update.
    """

    count: jax.Array
    momentum: Any
    buffer: Any


def delayed_nesterov(
    learning_rate: float, momentum: float = 0.9, delay: int = 1, *, activation: float = 0.0
) -> optax.GradientTransformation:
    """Delayed Nesterov momentum (Liu et al. 2024, Algorithm 1, "DN"), as an optax transform.

    With eta = ``learning_rate``, beta = ``momentum``, N = ``delay``, c = ``activation``,
    the t-th update (t = 1, 2, ...) on the (pseudo-)gradient g_t is::

        Delta <- Delta + g_t
        if t mod N == 0:                       # every N arrivals
            m     <- beta * m + Delta / N      # the momentum, from the arrivals' average
            u_t    = -eta * ((1 - c (N - 1)) * beta * m + g_t / N)
            Delta <- 0
        else:
            u_t    = -eta * (c * beta * m + g_t / N)

    With c = 0 the N - 1 arrivals between momentum updates are plain SGD steps of
    ``eta / N`` and the cycle's last one adds the momentum, so over one cycle the
    parameters move by ``-eta * (beta * m + Delta / N)``: one Nesterov step on the mean of
    the N arrivals (synchronous local SGD's outer step). c > 0 applies ``c * beta * m``
    (the previous cycle's m) at each arrival in between and the rest,
    ``(1 - c (N - 1)) * beta * m``, with the new m at the cycle's end. N = 1 is
    ``optax.sgd(eta, beta, nesterov=True)`` exactly. m and Delta start at 0.

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous
      Local-SGD Training for Language Modeling", 2024, arXiv:2401.09135.

    Args:
      learning_rate: eta, the outer step size, finite and > 0.
      momentum: beta, in [0, 1).
      delay: N, arrivals per momentum update, an int >= 1.
      activation: c, the fraction of the momentum applied at each arrival between momentum
        updates, in [0, 1 / N].

    Returns:
      An ``optax.GradientTransformation`` whose updates are to be added to the params.

    Example (N = 2, c = 0: a plain step of eta / 2, then the Nesterov step of the cycle):

    >>> import jax.numpy as jnp
    >>> from ddl_jax._src.strategies.asynchronous.delayed_nesterov import delayed_nesterov
    >>> opt = delayed_nesterov(1.0, momentum=0.5, delay=2)
    >>> state = opt.init(jnp.zeros(()))
    >>> u1, state = opt.update(jnp.float32(2.0), state)
    >>> u2, state = opt.update(jnp.float32(4.0), state)
    >>> float(u1), float(u2)  # m = (2 + 4) / 2 = 3; u2 = -(0.5 * 3 + 4 / 2)
    (-1.0, -3.5)
    """
    learning_rate = check_real(
        "delayed_nesterov learning_rate", learning_rate, minimum=0, exclusive=True
    )
    beta = check_real("delayed_nesterov momentum", momentum, minimum=0)
    if beta >= 1:
        raise ValueError(f"delayed_nesterov momentum must be in [0, 1), got {momentum!r}.")
    n = check_int("delayed_nesterov delay", delay, minimum=1)
    c = check_real("delayed_nesterov activation", activation, minimum=0, maximum=1 / n)

    def init(params: Any) -> DelayedNesterovState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(
        updates: Any, state: DelayedNesterovState, params: Any = None
    ) -> tuple[Any, DelayedNesterovState]:
        del params
        count = state.count + 1
        cycle = count % n == 0
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        updated = jax.tree.map(lambda m, d: beta * m + d / n, state.momentum, buffer)
        m = jax.tree.map(lambda new, old: jnp.where(cycle, new, old), updated, state.momentum)
        share = jnp.where(cycle, 1 - c * (n - 1), c)

        def step(g: jax.Array, m: jax.Array) -> jax.Array:
            return (-learning_rate * (share * beta * m + g / n)).astype(g.dtype)

        out = jax.tree.map(step, updates, m)
        buffer = jax.tree.map(lambda d: jnp.where(cycle, jnp.zeros_like(d), d), buffer)
        return out, DelayedNesterovState(count, m, buffer)

    return optax.GradientTransformation(init, update)
