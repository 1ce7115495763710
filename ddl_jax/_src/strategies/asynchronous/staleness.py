"""Asynchronous-SGD building blocks: compute-time models, protocols, staleness scaling.

Everything here is a small validated value or an optax transform; ``async_sgd`` reads
them. A protocol decides what waits in the simulated parameter server: plain async
(apply each gradient on arrival), n-softsync (apply the average of every n arrivals),
stale-synchronous parallel (a worker more than ``bound`` clocks ahead waits),
Downpour (fetch every ``n_fetch`` gradients, push every ``n_push``, a local step between)
and asynchronous local SGD (each task is ``steps`` inner optimizer steps, or a number
scaled to the worker's speed with dynamic local updates; the push is their
pseudo-gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddl_jax._src.core.strategy import check_bool, check_int, check_real


class ComputeTime(NamedTuple):
    """How long each simulated gradient computation takes (in simulated time units).

    The k-th gradient of worker i takes ``base[i] * exp(spread * z)``, with ``z`` a
    standard normal drawn from ``fold_in(fold_in(key(seed), i), k)``: a pure
    function of (seed, i, k), so the same seed gives the same run whatever the event
    order. ``spread = 0`` gives fixed times; unequal ``base`` gives heterogeneous speeds
    (a straggler is one large entry).

    Attributes:
      base: per-worker median compute time, a tuple of N floats >= 0, or one float
        shared by all workers.
      spread: sigma of the log-normal noise, >= 0.
      seed: seed of the noise.
    """

    base: float | tuple[float, ...]
    spread: float
    seed: int


def compute_times(
    base: float | Sequence[float] = 1.0, *, spread: float = 0.0, seed: int = 0
) -> ComputeTime:
    """Builds a validated :class:`ComputeTime` (equal, random, heterogeneous, stragglers).

    Examples: ``compute_times(1.0)`` (equal workers), ``compute_times([1] * 7 + [4])``
    (one 4x straggler among 8), ``compute_times(1.0, spread=0.5, seed=3)`` (random).

    Args:
      base: one median time for every worker, or one per worker; finite and >= 0 (a
        time of 0 only under ``ssp``, whose bound stops that worker: ``async_sgd``
        refuses it under the other protocols).
      spread: sigma of the log-normal noise around ``base``; finite and >= 0.
      seed: integer seed of the noise.

    Returns:
      A ``ComputeTime``.
    """
    try:
        values = np.atleast_1d(np.asarray(base, dtype=np.float64))
    except (TypeError, ValueError):
        values = np.empty((0,))
    if isinstance(base, str) or values.ndim != 1 or values.size == 0:
        raise ValueError(
            f"compute_time base must be a number or a non-empty sequence of numbers, got {base!r}."
        )
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(
            f"compute_time base must be finite and >= 0 (simulated time units), got {base!r}."
        )
    spread = check_real("compute_time spread", spread, minimum=0)
    seed = check_int("compute_time seed", seed)
    shared = np.ndim(base) == 0
    return ComputeTime(
        float(values[0]) if shared else tuple(float(v) for v in values), spread, seed
    )


def as_compute_time(value: float | Sequence[float] | ComputeTime, n: int) -> ComputeTime:
    """Turns ``async_sgd``'s ``compute_time`` argument into a ``ComputeTime`` for N workers."""
    if not isinstance(value, ComputeTime):
        value = compute_times(value)
    else:
        value = compute_times(value.base, spread=value.spread, seed=value.seed)
    if isinstance(value.base, tuple) and len(value.base) != n:
        raise ValueError(
            f"compute_time gives {len(value.base)} per-worker times but the mesh has {n} "
            f"workers; give one number or exactly {n}."
        )
    return value


def duration(
    model: ComputeTime, n: int, key: jax.Array, worker: jax.Array, task: jax.Array
) -> jax.Array:
    """Simulated time of worker ``worker``'s ``task``-th gradient (traceable).

    ``key`` is the threefry key data of ``model.seed``; the strategy keeps it in its state.
    """
    base = jnp.broadcast_to(jnp.asarray(model.base, jnp.float32), (n,))[worker]
    if model.spread == 0:
        return base
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.wrap_key_data(key, impl="threefry2x32"), worker), task
    )
    return base * jnp.exp(model.spread * jax.random.normal(key, (), jnp.float32))


class Async(NamedTuple):
    """Plain asynchronous SGD (Hogwild!-style): the server applies each gradient on arrival."""


class SoftSync(NamedTuple):
    """n-softsync (Gupta et al. 2016): the server applies the average of every n arrivals.

    Here n counts gradients per update. Gupta et al. count the other way: their
    n-softsync waits for floor(N / n) gradients (1-softsync is synchronous, N-softsync is
    async), so their n-softsync is ``SoftSync(N // n)`` here.

    Attributes:
      n: gradients per server update, in [1, N]; n = N is synchronous SGD, n = 1 is async.
      scale: a staleness rule scaling each gradient by its own staleness as it joins the
        group (Zhang et al.'s), or ``None``.
      decay: lambda of the ``"exp"`` rule.
    """

    n: int
    scale: str | Callable[[jax.Array], jax.Array] | None = None
    decay: float = 0.1


class SSP(NamedTuple):
    """Stale-synchronous parallel (Ho et al. 2013): bounded clock gap.

    Attributes:
      bound: s, a worker that has pushed more than ``s`` gradients beyond the slowest
        worker waits before starting its next one; s = 0 keeps all workers on one clock.
      reads: ``"cached"`` (Ho et al.'s SSPTable): a worker computes on its cached copy,
        with its own updates, while the copy is fresh enough for the bound, and fetches
        only when it is not; ``"fresh"``: it fetches the server's state before every
        gradient.
    """

    bound: int
    reads: str = "cached"


class Downpour(NamedTuple):
    """Downpour SGD (Dean et al. 2012): infrequent fetches and pushes.

    Attributes:
      n_fetch: a worker fetches the server's parameters every ``n_fetch`` gradients.
      n_push: a worker sends the sum of its gradients since its last push after its
        1st, (``n_push`` + 1)-th, ... gradient.
      local_lr: the step a worker takes on its own copy after each gradient.
    """

    n_fetch: int
    n_push: int
    local_lr: float = 0.0


class AsyncLocal(NamedTuple):
    """Asynchronous local SGD (Liu et al. 2024): a task is H inner steps (see :func:`async_local`).

    Attributes:
      steps: H, inner optimizer steps per task, >= 1.
      reset: whether a worker's inner optimizer state restarts from ``init`` at each task.
      dynamic: dynamic local updates (DyLU): worker i takes H_i <= H steps, scaled to its
        speed (see :func:`dynamic_steps`).
    """

    steps: int
    reset: bool
    dynamic: bool = False


Protocol = Async | SoftSync | SSP | Downpour | AsyncLocal


class Churn(NamedTuple):
    """Workers that leave and rejoin (see :func:`churn`).

    Attributes:
      leave: q, the probability that a worker leaves after completing a task.
      away: T, how long (simulated time) it stays away before rejoining.
    """

    leave: float
    away: float


def churn(leave: float, away: float) -> Churn:
    """Churn for ``async_sgd``: after each completed task (and its push), a worker leaves
    with probability ``leave`` and rejoins ``away`` simulated time later, fetching the
    server's current parameters and starting its next task at once.

    Args:
      leave: q in [0, 1].
      away: T, finite and >= 0.
    """
    return Churn(
        check_real("churn leave", leave, minimum=0, maximum=1),
        check_real("churn away", away, minimum=0),
    )


def as_churn(value: Churn | None) -> Churn:
    """Validates ``async_sgd``'s ``churn`` argument (``None``: no churn)."""
    if value is None:
        return Churn(0.0, 0.0)
    if not isinstance(value, Churn):
        raise ValueError(f"churn must be None or ddl.churn(leave=, away=), got {value!r}.")
    return churn(value.leave, value.away)


def softsync(
    n: int, *, scale: str | Callable[[jax.Array], jax.Array] | None = None, decay: float = 0.1
) -> SoftSync:
    """The n-softsync protocol: the server averages every ``n`` arrivals into one update.

    ``n`` is gradients per update; Gupta et al.'s n-softsync (which waits for floor(N / n)
    gradients) is ``softsync(N // n)`` here: their 1-softsync, synchronous SGD, is
    ``softsync(N)``.

    **Staleness-aware** (Zhang et al.): ``scale="inverse"`` (or ``"exp"``, or a callable,
    :func:`scale_by_staleness`'s rules) scales each gradient by its own staleness as it
    joins the group, so that with ``optax.sgd(lr)`` the server applies Zhang et al.'s
    ``(1/n) sum_l (lr / tau_l) g_l``. :func:`scale_by_staleness` in the server's optimizer
    instead scales the group's step by a function of its mean staleness: the two agree
    where a group's gradients are equally stale. The first is their rule; the second also
    scales the step of an adaptive optimizer (Adam), which normalises a scaled gradient.

    References:
      Gupta, Zhang, Wang, "Model accuracy and runtime tradeoff in distributed deep
      learning: a systematic study", ICDM 2016, arXiv:1509.04210.
      Zhang, Gupta, Lian, Liu, "Staleness-aware async-SGD for distributed deep learning",
      IJCAI 2016, arXiv:1511.05950.

    Args:
      n: gradients per server update, an int >= 1 (and <= N, checked by ``async_sgd``).
      scale: ``None`` (default, Gupta et al.'s plain mean), ``"inverse"`` (``1 /
        max(tau, 1)``, Zhang et al.), ``"exp"`` or a callable ``tau -> scale``.
      decay: lambda of the ``"exp"`` rule, finite and >= 0.
    """
    n = check_int("softsync n", n, minimum=1)
    decay = check_real("softsync decay", decay, minimum=0)
    if scale is not None:
        staleness_scale(scale, decay, "softsync scale")  # checked now, not in a step
    return SoftSync(n, scale, float(decay))


def ssp(bound: int, *, reads: str = "cached") -> SSP:
    """Stale-synchronous parallel: no worker runs more than ``bound`` clocks ahead.

    A worker's clock counts the gradients it has pushed; the server's clock is the least
    of them. A worker at clock c computes its next gradient on parameters that hold every
    worker's updates from clocks before ``c - bound``, and waits until the server's clock
    reaches ``c - bound`` if it must. With ``reads="cached"`` (the default) it reads as
    Ho et al.'s SSPTable does (Petuum Bosen, ``SSPConsistencyController::Get`` in
    ``src/petuum_ps/consistency/ssp_consistency_controller.cpp``): from its cached copy,
    which holds the server's state at its last fetch and its own updates since
    (read-my-writes), while the copy's clock (the server's when it was fetched) is at
    least ``c - bound``; only then does it fetch the server's current state (its clock
    becoming the copy's). A push's own update is the server's update for it (the
    gradient's ``-lr g`` under SGD), none where the push is lost (``drop``). With
    ``reads="fresh"`` a worker fetches before every gradient, reading the newest state
    the server holds: at the same bound its gradients are less stale than Ho et al.'s.

    References:
      Ho et al., "More effective distributed ML via a stale synchronous parallel parameter
      server", NeurIPS 2013; their code: sailing-pmls/bosen.

    Args:
      bound: s >= 0, the largest allowed gap between a worker's clock (gradients pushed)
        and the slowest worker's clock when it starts a gradient.
      reads: ``"cached"`` (Ho et al.'s) or ``"fresh"``.
    """
    bound = check_int("ssp bound", bound, minimum=0)
    if reads not in ("cached", "fresh"):
        raise ValueError(f'ssp reads must be "cached" or "fresh", got {reads!r}.')
    return SSP(bound, reads)


def downpour(n_fetch: int = 1, n_push: int = 1, *, local_lr: float | None = None) -> Downpour:
    """Downpour SGD's client, Dean et al.'s Algorithm 7.1 ("Downpour SGD client").

    Counting a worker's gradients from 0 (the algorithm's ``step``), it fetches the
    server's parameters before gradient ``step`` where ``step mod n_fetch == 0``; after
    each gradient it adds it to its accrued sum (Delta w) and takes a step on its own copy,
    ``parameters <- parameters - local_lr * gradient``; and where ``step mod n_push == 0``
    it pushes the accrued sum and empties it: after its 1st, (n_push + 1)-th, ... gradient.
    With ``n_fetch = 1`` the copy is replaced by a fetch before every gradient, so the
    local step changes nothing and ``local_lr`` may be left out.

    References:
      Dean et al., "Large scale distributed deep networks", NeurIPS 2012, Algorithm 7.1.

    Args:
      n_fetch: gradients between parameter fetches, >= 1.
      n_push: gradients between pushes, >= 1 (a push sends the sum since the last one).
      local_lr: alpha, the worker's step on its own copy, >= 0 (the algorithm's learning
        rate; 0 computes every gradient on what was fetched); needed with ``n_fetch > 1``.

    Raises:
      ValueError: a bad ``n_fetch``, ``n_push`` or ``local_lr``, or no ``local_lr`` with
        ``n_fetch > 1``.
    """
    n_fetch = check_int("downpour n_fetch", n_fetch, minimum=1)
    n_push = check_int("downpour n_push", n_push, minimum=1)
    if local_lr is None:
        if n_fetch > 1:
            raise ValueError(
                f"downpour: n_fetch={n_fetch} needs local_lr, the step a worker takes on its "
                "own copy after each gradient between fetches (Dean et al.'s Algorithm 7.1: "
                "parameters -= alpha * gradient), e.g. the server's learning rate; "
                "local_lr=0 computes every gradient on what was fetched."
            )
        local_lr = 0.0
    return Downpour(n_fetch, n_push, check_real("downpour local_lr", local_lr, minimum=0.0))


def async_local(steps: int, *, reset: bool = False, dynamic: bool = False) -> AsyncLocal:
    """Asynchronous local SGD: a worker takes ``steps`` inner optimizer steps per task.

    A worker that fetched the server's parameters theta takes H = ``steps`` steps of
    ``async_sgd``'s ``inner_optimizer`` on its own copy, on H consecutive micro-batches of
    its shard of the step's batch, and pushes the pseudo-gradient ``theta - theta_local``;
    the server applies it on arrival with ``async_sgd``'s (outer) ``optimizer``, e.g.
    ``ddl.delayed_nesterov(lr, momentum, delay=N)``; ``optax.sgd(1.0)`` is parameter
    averaging. Events are plain async's; a task takes H times the per-gradient time.

    **Batch size.** A step's batch holds every worker's H inner micro-batches: for ``b``
    examples per inner step on N workers, give batches of ``N * H * b`` rows (the paper's
    per-inner-step batch is ``b``); a batch whose rows do not split so is refused with the
    arithmetic.

    **Dynamic local updates** (Liu et al.'s DyLU, ``dynamic=True``): worker i takes
    ``H_i = max(1, floor(H * v_i / max_j v_j))`` inner steps per task, ``v_i`` its speed
    in ``async_sgd``'s compute-time model (see :func:`dynamic_steps`), so a task of a
    slow worker takes about as long as a fast one's: ``H_i`` times its per-gradient time.
    The batch still holds H micro-batches per worker: worker i uses the first ``H_i`` of
    its H and leaves the other ``H - H_i`` unused. Everything else (events, keys: inner
    step h draws ``fold_in(key, h)`` for H > 1, inner state, resume) is as without DyLU;
    with equal speeds every ``H_i`` is H and the run is the same, bit for bit. The rule
    is the one of jdinalt/forgather's DiLoCo server (``src/forgather/ml/diloco/server.py``,
    ``_compute_dylu_sync_every``), a public implementation of the paper's DyLU; the
    paper's own text was not at hand to check its exact rounding.

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous
      Local-SGD Training for Language Modeling", 2024, arXiv:2401.09135.

    Args:
      steps: H, inner steps per task, an int >= 1.
      reset: ``False`` (default): each worker keeps its inner optimizer state (momenta,
        step count) from task to task, as DiLoCo's workers do; ``True``: the state is
        ``inner_optimizer.init`` of the fetched parameters at the start of every task
        (every task starts with a fetch: a reset at each fetch).
      dynamic: ``False`` (default): every worker takes H steps per task; ``True``:
        dynamic local updates, worker i takes ``H_i`` (above).
    """
    reset = check_bool("async_local reset", reset)
    dynamic = check_bool("async_local dynamic", dynamic)
    return AsyncLocal(check_int("async_local steps", steps, minimum=1), reset, dynamic)


# Relative slack of DyLU's floor: H * v_i / max v computed in floating point may land just
# below an integer it equals exactly (e.g. 3 * 0.1 / 0.3), which must not lose a step.
_DYLU_SLACK = 1e-9


def dynamic_steps(times: ComputeTime, protocol: AsyncLocal, n: int) -> tuple[int, ...]:
    """Each of the N workers' inner steps per task under ``protocol``: H_i.

    Without ``dynamic``, H for all. With it, Liu et al.'s (2024) dynamic local updates
    (DyLU): ``H_i = max(1, floor(H * v_i / max_j v_j))``, with ``v_i = 1 /
    base[i]`` worker i's speed (gradients per simulated time unit; a worker of time 0 is
    the fastest, ``v_i / max v = 1``, and the others then take 1 step). Under random times
    (``spread > 0``) the speed is the expected one: the log-normal noise multiplies every
    worker's expected time by the same ``exp(spread**2 / 2)`` (its expected speed by the
    same ``exp(spread**2 / 2)`` too), so ``v_i / max v = min_j base[j] / base[i]``, the
    ratio of the median times, fixed for the whole run (one H_i per worker, not per task).
    The floor forgives a relative rounding error of 1e-9.
    """
    base = np.broadcast_to(np.asarray(times.base, np.float64), (n,))
    if not protocol.dynamic:
        return (protocol.steps,) * n
    fastest = base.min()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(base == fastest, 1.0, fastest / base)
    steps = np.floor(protocol.steps * ratio * (1 + _DYLU_SLACK))
    return tuple(int(max(1, h)) for h in steps)


def task_time(times: ComputeTime, protocol: Protocol) -> ComputeTime:
    """The compute-time model of one task: under ``async_local(H)`` H gradients, so H
    times the per-gradient ``base`` (the noise, one draw per task, scales with it); under
    ``async_local(H, dynamic=True)`` worker i's H_i (:func:`dynamic_steps`) times its own
    (with one ``base`` shared by all workers every H_i is H)."""
    if not isinstance(protocol, AsyncLocal):
        return times
    base = times.base
    if protocol.dynamic and isinstance(base, tuple):
        steps = dynamic_steps(times, protocol, len(base))
        return times._replace(base=tuple(b * h for b, h in zip(base, steps, strict=True)))
    scaled = tuple(b * protocol.steps for b in base) if isinstance(base, tuple) else None
    return times._replace(base=base * protocol.steps if scaled is None else scaled)


def as_protocol(protocol: str | Protocol, n: int) -> Protocol:
    """Validates ``async_sgd``'s ``protocol`` argument for N workers."""
    if isinstance(protocol, str):
        if protocol != "async":
            raise ValueError(
                f"protocol={protocol!r} is not known; valid: 'async', ddl.softsync(n), "
                "ddl.ssp(bound), ddl.downpour(n_fetch, n_push), ddl.async_local(steps)."
            )
        return Async()
    if not isinstance(protocol, Async | SoftSync | SSP | Downpour | AsyncLocal):
        raise TypeError(
            "protocol must be 'async', ddl.softsync(n), ddl.ssp(bound), "
            f"ddl.downpour(n_fetch, n_push) or ddl.async_local(steps); got {protocol!r}."
        )
    # Built again by their checked constructors: a SoftSync(...) made by hand is checked too.
    if isinstance(protocol, SoftSync):
        protocol = softsync(protocol.n, scale=protocol.scale, decay=protocol.decay)
        if protocol.n > n:
            raise ValueError(
                f"softsync n={protocol.n} is outside [1, N] for N={n} workers; n=N is "
                "synchronous SGD, n=1 is plain async."
            )
    if isinstance(protocol, SSP):
        protocol = ssp(protocol.bound, reads=protocol.reads)
    if isinstance(protocol, Downpour):
        protocol = downpour(protocol.n_fetch, protocol.n_push, local_lr=protocol.local_lr)
    if isinstance(protocol, AsyncLocal):
        protocol = async_local(protocol.steps, reset=protocol.reset, dynamic=protocol.dynamic)
    return protocol


RULES: dict[str, str] = {
    "inverse": "1 / max(tau, 1) (Zhang et al. 2016)",
    "exp": "exp(-decay * tau)",
}

# Staleness values a callable rule is checked on at construction: zero, fractions (a
# softsync group's mean), and powers of two up to far beyond any realistic staleness.
# Only these points are checked: a rule may still misbehave between them or beyond.
SAMPLE_STALENESS = np.array([0.0, 0.5, 1.0, 1.5, *(2.0**k for k in range(1, 13))], np.float32)


class ScaleByStalenessState(NamedTuple):
    """``scale_by_staleness`` keeps no state."""


def scale_by_staleness(
    rule: str | Callable[[jax.Array], jax.Array] = "inverse", *, decay: float = 0.1
) -> optax.GradientTransformationExtraArgs:
    """Scales an update by a function of its staleness: ``u <- s(tau) * u``.

    ``tau`` is the number of server updates applied between the fetch of the parameters a
    gradient was computed on and the gradient's arrival; ``async_sgd`` passes it as the
    optax extra argument ``staleness`` (a softsync group passes its mean). ``optax.chain``
    forwards extra args to every link. Put it after the optimizer that computes the step,
    e.g. ``optax.chain(optax.adam(1e-3), ddl.scale_by_staleness())``: it then scales the
    learning rate, ``lr / tau`` in Zhang et al. Before an adaptive optimizer such as Adam,
    which divides by a running gradient magnitude, the scale is normalised away (for a
    constant tau, up to Adam's ``eps``: exactly only where ``eps`` is negligible next to
    the gradients). With plain SGD the order does not matter.

    Rules: ``"inverse"``: ``s = 1 / max(tau, 1)``; ``"exp"``: ``s = exp(-decay * tau)``;
    or a callable ``tau -> s`` (traceable jnp code on a float32 scalar). A callable rule
    is checked eagerly, at construction, on tau in {0, 0.5, 1, 1.5, 2, 4, ..., 4096}: a
    scale that is not a finite number >= 0 there raises ``ValueError`` then, rather than
    silently turning parameters to NaN inside a jitted step. Only those points are
    checked: a rule that misbehaves between them or beyond 4096 is not caught, and its
    non-finite scale reaches the parameters (``async_sgd``'s ``staleness_max`` metric
    shows the staleness a run actually meets).

    References:
      Zhang, Gupta, Lian, Liu, "Staleness-aware async-SGD for distributed deep learning",
      IJCAI 2016, arXiv:1511.05950.

    Args:
      rule: ``"inverse"``, ``"exp"`` or a callable ``tau -> scale``.
      decay: lambda of the ``"exp"`` rule, finite and >= 0.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(updates, state, params,
      *, staleness)`` requires the ``staleness`` keyword (a scalar).
    """
    scale_fn = staleness_scale(rule, decay)

    def init(params):
        del params
        return ScaleByStalenessState()

    def update(updates, state, params=None, *, staleness=None, **extra_args):
        del params, extra_args
        if staleness is None:
            raise TypeError(
                "scale_by_staleness needs the staleness of the update: call "
                "update(updates, state, params, staleness=tau) (ddl.async_sgd does)."
            )
        scale = scale_fn(jnp.asarray(staleness, jnp.float32))
        return jax.tree.map(lambda u: (scale * u).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def staleness_scale(
    rule: str | Callable[[jax.Array], jax.Array], decay: float, name: str = "scale_by_staleness"
) -> Callable[[jax.Array], jax.Array]:
    """The checked function ``tau -> scale`` of :func:`scale_by_staleness`'s ``rule``
    (``name`` the function whose argument it is, for the errors)."""
    if rule == "inverse":
        scale_fn = lambda tau: 1.0 / jnp.maximum(tau, 1.0)  # noqa: E731
    elif rule == "exp":
        decay = check_real(f"{name} decay", decay, minimum=0)
        scale_fn = lambda tau: jnp.exp(-decay * tau)  # noqa: E731
    elif callable(rule):
        scale_fn = rule
        scales = np.asarray([np.asarray(rule(jnp.float32(t))) for t in SAMPLE_STALENESS])
        bad = ~(np.isfinite(scales) & (scales >= 0))
        if scales.shape != SAMPLE_STALENESS.shape or bad.any():
            where = SAMPLE_STALENESS[bad] if scales.shape == SAMPLE_STALENESS.shape else "?"
            raise ValueError(
                f"{name} rule must map a staleness tau to a finite scalar scale "
                f">= 0; at tau={where} it returned {scales[bad] if bad.any() else scales} "
                f"(checked at tau in {SAMPLE_STALENESS.tolist()})."
            )
    else:
        raise ValueError(
            f"{name} rule={rule!r} is not known; valid: {list(RULES)} or a callable tau -> scale."
        )

    return scale_fn
