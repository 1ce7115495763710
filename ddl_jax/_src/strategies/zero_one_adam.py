"""0/1 Adam: Adam whose variance updates on a growing schedule, then local steps whose
accumulated updates are all-reduced in 1 bit on a growing interval."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddl_jax._src.core.kit import Kit, prepare, restack, unstack, vary
from ddl_jax._src.core.model_loss import AnyLoss, ModelVars, mean_over, worker_key
from ddl_jax._src.core.strategy import DATA, Strategy, check_int, check_real
from ddl_jax._src.reduce.quantise import (
    check_exp_avg_mask,
    check_padding,
    compressed_allreduce,
)

#: DeepSpeed's ``step()`` counts its first call, which only allocates buffers, as step 1:
#: the step numbers its schedules test are this builder's 0-based step counter plus this.
_DEEPSPEED_STEP_OFFSET = 2


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam` (DeepSpeed's names in brackets).

    Attributes:
      params: each worker's replica, ``[N, ...]`` sharded ``P(axis)``: equal while the
        variance may update, then apart between synchronisations.
      mu: each worker's momentum [``exp_avg``], float32, ``[N, ...]``, ``P(axis)``.
      nu: the variance [``exp_avg_sq``], float32, replicated ``P()`` (only averaged
        gradients update it, so every worker holds the same).
      accumulator: each worker's sum of its ``-lr u`` since the last synchronisation
        [``momentum_accumulator``], float32, ``[N, ...]``, ``P(axis)``.
      residual: each worker's error-feedback residual ``e`` of the 1-bit all-reduce
        [``worker_error``], float32, ``[N, ...]``, ``P(axis)``.
      owner_residual: each worker's residual ``e'`` of the chunks it owns
        [``server_error``], in a params-shaped float32 buffer of which it uses its own
        chunk, ``[N, ...]``, ``P(axis)``.
      pad_residual: each worker's value of the padding entries of its ``worker_error``
        (they stay equal; ``padding="deepspeed"``, 0 with ``"none"``), a float32 scalar
        per tensor, ``[N]``, ``P(axis)``.
      owner_pad_residual: likewise, of the padding entries of its ``server_error`` (0
        where its chunk has none), ``[N]``, ``P(axis)``.
      lrs: float32 scalar, the learning rates summed since the last synchronisation
        [``lrs``], ``P()``.
      var_interval, var_counter: int32 scalars, the variance schedule [``var_interval``,
        ``var_counter``], ``P()``.
      local_step_interval, local_step_counter: int32 scalars, the synchronisation schedule
        [``local_step_interval``, ``local_step_counter``], ``P()``.
      model: each worker's model state (batch statistics), ``P(axis)``, averaged whenever
        the workers synchronise; the run's key and the step count, ``P()``.
    """

    params: Any
    mu: Any
    nu: Any
    accumulator: Any
    residual: Any
    owner_residual: Any
    pad_residual: Any
    owner_pad_residual: Any
    lrs: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_step_interval: jax.Array
    local_step_counter: jax.Array
    model: ModelVars


class _Config(NamedTuple):
    kit: Kit
    learning_rate: Callable[[jax.Array], jax.Array]
    b1: float
    b2: float
    eps: float
    weight_decay: float
    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    exp_avg_mask: Any
    padding: str


def zero_one_adam(
    loss_fn: AnyLoss,
    learning_rate: float | optax.Schedule,
    mesh: Mesh,
    *,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exp_avg_mask: Any = None,
    padding: str = "deepspeed",
    accumulate: int = 1,
    has_aux: bool = False,
    axis: str = DATA,
) -> Strategy:
    """0/1 Adam (Lu et al.): Adam whose variance updates on an exponentially growing
    schedule and then freezes, the gradients between its updates all-reduced in 1 bit;
    after the freeze, local steps whose accumulated updates are all-reduced in 1 bit on a
    growing interval.

    The optimizer is the method (no ``optimizer=``). Steps count t = 0, 1, ...; DeepSpeed
    numbers step t ``s = t + 2`` (its first ``step()`` call, below), and its schedules,
    followed here, test s. Per worker i with gradient ``g_i`` of its own replica ``p_i``
    and learning rate ``lr = learning_rate(t)`` (each device one worker: no ``workers=``,
    no islands):

    * **Variance phase**, t < ``var_freeze_step`` (the variance may update at steps 1 to
      ``var_freeze_step``, counted from 1, DeepSpeed's ``max T_v``). With the interval
      ``I_v`` (first 1): if ``s % I_v == 0``, the gradients are averaged in float32,
      ``g = (1/N) sum_i g_i``, and ``v <- b2 v + (1 - b2) g^2``, ``m <- b1 m + (1 - b1) g``;
      each ``var_update_scaler`` (kappa) such steps double ``I_v``. Otherwise ``v`` stays and
      ``m <- b1 m + (1 - b1) C(g_i)``, ``C`` the 1-bit all-reduce below (times
      ``exp_avg_mask``). Every worker steps ``p <- p - lr u``, ``u = m / (sqrt(v) + eps) +
      weight_decay p``: the replicas stay equal.
    * **Local phase**, t >= ``var_freeze_step``: ``v`` is frozen and the error-feedback
      residuals restart at 0. Each worker steps alone: ``m_i <- b1 m_i + (1 - b1) g_i``,
      ``p_i <- p_i - lr u_i``, and accumulates ``a_i <- a_i - lr u_i`` and ``L <- L + lr``.
      When ``s % H == 0`` (H, first 1, doubles after every ``local_step_scaler`` local-phase
      steps, up to ``local_step_clipper``) the workers synchronise: ``p_i <- p_i - a_i``
      rolls the local steps back, ``a = C(a_i (sqrt(v) + eps))`` (times ``exp_avg_mask``)
      is the agreed sum of ``-lr m``, the momentum restarts from its lr-weighted mean
      ``m_i <- -a / L``, ``p_i <- p_i + a / (sqrt(v) + eps)``, and ``a_i``, ``L`` restart
      at 0. The rollback is DeepSpeed's arithmetic, ``(p - lr u) + lr u``, so replicas
      agree after a synchronisation up to float32 rounding.

    ``C`` is DeepSpeed's ``compressed_allreduce`` (``ddl.compression.sign``'s): each worker
    sends ``sign(x + e)`` scaled by ``||x + e||_2 / sqrt(d)`` per tensor and keeps the rest
    in ``e``; each chunk's owner averages them, adds its ``e'`` and sends the result
    compressed the same way; each tensor is zero-padded as DeepSpeed (below). On one worker
    ``C`` is skipped, as DeepSpeed skips it, and with it (DeepSpeed's code) the momentum's
    update on variance-phase steps between variance updates. No bias correction, ``eps``
    outside the square root, weight decay added to the update (decoupled), as DeepSpeed.

    **Momentum mask.** 1-bit compression cannot send an exact zero: an entry whose gradient
    is always 0 gets a momentum of +-scale that error feedback keeps alive, divided by a
    variance of about 0 (see ``ddl.compression.onebit_adam``). DeepSpeed requires the
    user's mask of such entries, ``exp_avg_mask``, multiplied into the output of every
    compressed all-reduce; so does this builder. Entries whose variance is tiny but not 0
    take the tensor's average momentum over that tiny root, which no mask helps: on the
    digits MLP (pixels mostly blank) it diverges by step 40 to 60 at learning rates from
    1e-4 to 3e-3, with the blank pixels masked or not, as 1-bit Adam does there.

    Communication per device: a float32 ring all-reduce ``2 (N-1)/N * 4 D`` bytes at a
    variance update, ``2 (N-1)/N * D'/8`` bytes of signs plus scales at any other
    variance-phase step and at a synchronisation (D' the padded size: each tensor's
    rounded up to a multiple of ``N * lcm(N, 8)``, of 8 N with ``padding="none"``),
    nothing at a local step.

    **Padding.** ``ZeroOneAdam.step`` sizes each tensor's ``worker_error`` to its
    ``corrected_tensor_size``, the size rounded up to a multiple of ``N * lcm(N, 8)``
    (``size * divider``), and ``server_error`` to that over N; ``compressed_allreduce``
    zero-pads the gradient or accumulator to it. So does this builder
    (``padding="deepspeed"``): each tensor padded on its own, the padding counted in the
    worker's scale, the owners' chunks and scales and both residuals, the output cut back.
    The padding entries of a residual all hold one value (zeros in, elementwise updates),
    kept as one scalar per tensor (``pad_residual``, ``owner_pad_residual``), zeroed with
    the residuals at the freeze as DeepSpeed zeroes its buffers.

    Follows ``deepspeed/runtime/fp16/onebit/zoadam.py`` (``ZeroOneAdam.step``, with the
    engine's ``enable_backward_allreduce`` that it sets) and
    ``deepspeed/runtime/comm/nccl.py`` (``NcclBackend.compressed_allreduce``) of
    github.com/deepspeedai/DeepSpeed, with these differences:

    * DeepSpeed's first ``step`` only allocates buffers: it discards the gradient and
      updates nothing, yet counts as step 1. Here every step steps, and the schedules test
      ``t + 2``: ``ZeroOneAdam`` on gradients ``g_1, g_2, ...`` equals this builder, with
      the same arguments, on ``g_2, g_3, ...`` (a test checks it).
    * With ``padding="none"`` only: the padding is left out of the scales and residuals
      (the same on tensors whose size divides by ``N * lcm(N, 8)``). By default
      (``"deepspeed"``) it counts, as in DeepSpeed (above).
    * One parameter group: ``exp_avg_mask`` is a pytree like the parameters (DeepSpeed: one
      per group). DeepSpeed's ``bias_correction``, ``eps_inside_sqrt`` and
      ``max_grad_norm`` are accepted there and unused, ``amsgrad`` refused: all absent.
    * ``lrs`` is float32 (a Python float there); the moments and steps are computed in
      float32 whatever the parameters' dtype (DeepSpeed's fp16 optimizers keep float32
      master weights).
    * The learning rate is ``learning_rate`` or ``learning_rate(t)`` (an optax schedule of
      t); DeepSpeed's is its param group's, set by its scheduler.
    * A resumed run continues exactly (the whole state is checkpointed); DeepSpeed's
      ``load_state_dict`` drops the residuals and the accumulator (local steps not yet
      synchronised), and its next ``step`` again only allocates buffers.
    * Model state (batch statistics) is averaged over the workers whenever they
      synchronise (every variance-phase step, each local-phase synchronisation); DeepSpeed
      leaves buffers to its engine.

    References:
      Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
      Adam", arXiv:2202.06009 (2022).

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      learning_rate: lr > 0 (DeepSpeed's default 1e-3), or an optax schedule ``t -> lr``.
      mesh: a mesh with axis ``axis``.
      var_freeze_step: steps whose variance may update (counted from 1: the last one's
        number), >= 1; DeepSpeed's default 100000.
      var_update_scaler: kappa, variance updates per interval before it doubles, >= 1.
      local_step_scaler: local-phase steps per synchronisation interval before it
        doubles, >= 1 (DeepSpeed's default, 32678 sic).
      local_step_clipper: H_max, the largest synchronisation interval, >= 1.
      b1: the momentum's decay, in [0, 1).
      b2: the variance's decay, in [0, 1).
      eps: added to ``sqrt(v)``, > 0.
      weight_decay: added to the update times the parameters, >= 0.
      exp_avg_mask: ``None`` or a pytree of 0/1 arrays like the parameters (above).
      padding: ``"deepspeed"`` (DeepSpeed's zero-padding of each tensor to a multiple of
        ``N * lcm(N, 8)``, counted in the scales and residuals) or ``"none"`` (padding
        left out of them), above.
      accumulate: micro-batches per worker per step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux_dict)``.
      axis: the mesh axis the workers live on.

    Returns:
      A ``Strategy`` with ``ZeroOneAdamState``; metrics ``loss``, aux values,
      ``variance_updated`` (1.0 at a variance update) and ``synchronised`` (1.0 when the
      workers exchanged their gradients or accumulated updates). ``params(state)``: the
      replicas' mean.

    Raises:
      ValueError: an argument out of range (the message names it), or an ``exp_avg_mask``
        unlike the parameters (at ``init``).
      TypeError: ``axis`` not a name, ``learning_rate`` an optax transformation, or the
        loss or mesh not ones (as every builder).

    Example:
      >>> import jax, jax.numpy as jnp, ddl_jax as ddl
      >>> loss_fn = lambda params, b: jnp.mean((b["x"] * params["w"] - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones(16), "y": jnp.ones(16)}
      >>> strategy = ddl.zero_one_adam(loss_fn, 0.1, ddl.make_mesh(data=8), var_freeze_step=2)
      >>> state = strategy.init({"w": jnp.zeros(())})
      >>> step = jax.jit(strategy.step)
      >>> for _ in range(3):
      ...     state, metrics = step(state, batch)
      >>> float(metrics["variance_updated"]), float(metrics["synchronised"])
      (0.0, 1.0)
    """
    cfg = _configure(
        loss_fn,
        learning_rate,
        mesh,
        var_freeze_step=var_freeze_step,
        var_update_scaler=var_update_scaler,
        local_step_scaler=local_step_scaler,
        local_step_clipper=local_step_clipper,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        exp_avg_mask=exp_avg_mask,
        padding=padding,
        accumulate=accumulate,
        has_aux=has_aux,
        axis=axis,
    )
    kit = cfg.kit
    stacked = P(kit.axis)
    specs = ZeroOneAdamState(
        stacked, stacked, P(), stacked, stacked, stacked, stacked, stacked, P(), P(), P(),
        P(), P(), ModelVars(stacked, P(), P()),
    )  # fmt: skip

    def make_state(params: Any, model: ModelVars) -> ZeroOneAdamState:
        check_exp_avg_mask("zero_one_adam", cfg.exp_avg_mask, params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        pads = jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
        one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
        return ZeroOneAdamState(
            params=kit.stack(params),
            mu=kit.stack(zeros),
            nu=zeros,
            accumulator=kit.stack(zeros),
            residual=kit.stack(zeros),
            owner_residual=kit.stack(zeros),
            pad_residual=kit.stack(pads),
            owner_pad_residual=kit.stack(pads),
            lrs=jnp.zeros((), jnp.float32),
            var_interval=one,
            var_counter=zero,
            local_step_interval=one,
            local_step_counter=zero,
            model=model._replace(state=kit.stack(model.state)),
        )

    return Strategy(
        kit.init(make_state, specs),
        kit.step(functools.partial(_worker_step, cfg), specs),
        kit.replica_variables(),
    )


def _configure(
    loss_fn: Any,
    learning_rate: Any,
    mesh: Any,
    *,
    var_freeze_step: Any,
    var_update_scaler: Any,
    local_step_scaler: Any,
    local_step_clipper: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    exp_avg_mask: Any,
    padding: Any,
    accumulate: Any,
    has_aux: Any,
    axis: Any,
) -> _Config:
    """``zero_one_adam``'s arguments checked."""
    name = "zero_one_adam"
    if not isinstance(axis, str):
        raise TypeError(f"{name}: axis must be a mesh axis name (a str), got {axis!r}.")
    # 0/1 Adam is its own optimizer; the kit's optimizer slot holds a stand-in.
    kit = prepare(loss_fn, optax.identity(), mesh, axis, accumulate, has_aux)
    if all(callable(getattr(learning_rate, f, None)) for f in ("init", "update")):
        raise TypeError(
            f"{name}: learning_rate must be a number or an optax schedule, got an optax "
            "transformation: 0/1 Adam is the optimizer itself, e.g. "
            "ddl.zero_one_adam(loss_fn, 1e-3, mesh)."
        )
    if callable(learning_rate):
        schedule = learning_rate
    else:
        lr = check_real(f"{name}: learning_rate", learning_rate, minimum=0, exclusive=True)
        schedule = lambda t: lr  # noqa: E731
    var_freeze_step = check_int(f"{name}: var_freeze_step", var_freeze_step, minimum=1)
    var_update_scaler = check_int(f"{name}: var_update_scaler", var_update_scaler, minimum=1)
    local_step_scaler = check_int(f"{name}: local_step_scaler", local_step_scaler, minimum=1)
    local_step_clipper = check_int(f"{name}: local_step_clipper", local_step_clipper, minimum=1)
    for arg, beta in (("b1", b1), ("b2", b2)):
        check_real(f"{name}: {arg}", beta, minimum=0)
        check_real(f"{name}: {arg}", beta, maximum=1, exclusive=True)
    eps = check_real(f"{name}: eps", eps, minimum=0, exclusive=True)
    weight_decay = check_real(f"{name}: weight_decay", weight_decay, minimum=0)
    if exp_avg_mask is not None and not all(
        np.asarray(k).dtype.kind in "biuf" for k in jax.tree.leaves(exp_avg_mask) or ["none"]
    ):
        raise ValueError(
            f"{name}: exp_avg_mask must be None or a pytree of 0/1 arrays like the "
            f"parameters, got {exp_avg_mask!r}."
        )
    padding = check_padding(name, padding)
    return _Config(
        kit,
        schedule,
        float(b1),
        float(b2),
        eps,
        weight_decay,
        var_freeze_step,
        var_update_scaler,
        local_step_scaler,
        local_step_clipper,
        exp_avg_mask,
        padding,
    )


class _Worker(NamedTuple):
    """One worker's flat view of the optimizer's state (lists of float32 leaves)."""

    params: list[jax.Array]
    mu: list[jax.Array]
    nu: list[jax.Array]
    accumulator: list[jax.Array]
    residual: list[jax.Array]
    owner_residual: list[jax.Array]
    pad_residual: list[jax.Array]
    owner_pad_residual: list[jax.Array]
    lrs: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_step_interval: jax.Array
    local_step_counter: jax.Array


def _worker_step(
    cfg: _Config, state: ZeroOneAdamState, batch: Any
) -> tuple[ZeroOneAdamState, dict[str, jax.Array]]:
    """One worker's step: its gradient, then the variance phase's or the local phase's."""
    kit, axis = cfg.kit, cfg.kit.axis
    step = state.model.step
    params = unstack(state.params)
    key = worker_key(state.model, lax.axis_index(axis))
    (loss, aux), grads, model_state = kit.value_and_grad(
        params, unstack(state.model.state), batch, key
    )
    leaves, treedef = jax.tree.flatten(params)
    flat = functools.partial(_flat, treedef)
    worker = _Worker(
        params=[p.astype(jnp.float32) for p in leaves],
        mu=flat(unstack(state.mu)),
        nu=flat(state.nu),
        accumulator=flat(unstack(state.accumulator)),
        residual=flat(unstack(state.residual)),
        owner_residual=flat(unstack(state.owner_residual)),
        pad_residual=flat(unstack(state.pad_residual)),
        owner_pad_residual=flat(unstack(state.owner_pad_residual)),
        lrs=state.lrs,
        var_interval=state.var_interval,
        var_counter=state.var_counter,
        local_step_interval=state.local_step_interval,
        local_step_counter=state.local_step_counter,
    )
    worker = _vary_workers(worker, axis)
    grads = [g.astype(jnp.float32) for g in flat(grads)]
    masks = None if cfg.exp_avg_mask is None else flat(cfg.exp_avg_mask)
    lr = jnp.asarray(cfg.learning_rate(step), jnp.float32)
    phases = (
        functools.partial(_variance_phase, cfg, masks),
        functools.partial(_local_phase, cfg, masks),
    )
    frozen = step >= cfg.var_freeze_step
    worker, (variance_updated, synchronised) = lax.cond(
        frozen, phases[1], phases[0], worker, grads, lr, step
    )
    model_state = lax.cond(
        synchronised,
        lambda s: vary(mean_over(s, axis), (axis,)),
        lambda s: vary(s, (axis,)),
        model_state,
    )
    metrics = lax.pmean({"loss": loss, **aux}, axis)
    metrics["variance_updated"] = variance_updated.astype(jnp.float32)
    metrics["synchronised"] = synchronised.astype(jnp.float32)
    new_params = [p.astype(x.dtype) for p, x in zip(worker.params, leaves, strict=True)]
    tree = treedef.unflatten
    new = ZeroOneAdamState(
        params=restack(tree(new_params)),
        mu=restack(tree(worker.mu)),
        nu=tree(worker.nu),
        accumulator=restack(tree(worker.accumulator)),
        residual=restack(tree(worker.residual)),
        owner_residual=restack(tree(worker.owner_residual)),
        pad_residual=restack(tree(worker.pad_residual)),
        owner_pad_residual=restack(tree(worker.owner_pad_residual)),
        lrs=worker.lrs,
        var_interval=worker.var_interval,
        var_counter=worker.var_counter,
        local_step_interval=worker.local_step_interval,
        local_step_counter=worker.local_step_counter,
        model=ModelVars(restack(model_state), state.model.key, step + 1),
    )
    return new, metrics


#: The fields of ``_Worker`` that differ between workers (the others agree).
_PER_WORKER = (
    "params",
    "mu",
    "accumulator",
    "residual",
    "owner_residual",
    "pad_residual",
    "owner_pad_residual",
)
#: The fields of ``_Worker`` that the compressed all-reduce updates (its error feedback).
_RESIDUALS = ("residual", "owner_residual", "pad_residual", "owner_pad_residual")


def _vary_workers(w: _Worker, axis: str) -> _Worker:
    """``w`` with its per-worker fields typed varying over ``axis`` (the branches of a
    ``lax.cond`` must agree, and an all-reduce's output is typed invariant)."""
    return w._replace(**{f: vary(getattr(w, f), (axis,)) for f in _PER_WORKER})


def _flat(treedef: Any, tree: Any) -> list[jax.Array]:
    return treedef.flatten_up_to(tree)


def _masked(values: list[jax.Array], masks: list[Any] | None) -> list[jax.Array]:
    """``values`` times ``exp_avg_mask`` (after each compressed all-reduce, as DeepSpeed)."""
    if masks is None:
        return values
    return [v * jnp.asarray(k, v.dtype) for v, k in zip(values, masks, strict=True)]


def _direction(cfg: _Config, w: _Worker) -> list[jax.Array]:
    """``u = m / (sqrt(v) + eps)`` (``+ weight_decay p``): DeepSpeed's ``update``."""
    out = [m / (jnp.sqrt(v) + cfg.eps) for m, v in zip(w.mu, w.nu, strict=True)]
    if cfg.weight_decay > 0.0:
        out = [u + cfg.weight_decay * p for u, p in zip(out, w.params, strict=True)]
    return out


def _variance_phase(
    cfg: _Config, masks: Any, w: _Worker, grads: list[jax.Array], lr: jax.Array, step: Any
) -> tuple[_Worker, tuple[jax.Array, jax.Array]]:
    """A step before the freeze: the variance updated on schedule from the averaged
    gradient, the momentum otherwise from its 1-bit all-reduce; the replicas step alike."""
    axis, n, b1, b2 = cfg.kit.axis, cfg.kit.n, cfg.b1, cfg.b2
    update_variance = (step + _DEEPSPEED_STEP_OFFSET) % w.var_interval == 0

    def full(mu, nu, residuals):
        mean = [lax.pmean(g, axis) for g in grads]
        nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, mean, strict=True)]
        mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, mean, strict=True)]
        return mu, nu, residuals

    def compressed(mu, nu, residuals):
        if n == 1:  # DeepSpeed: no all-reduce, and no momentum update either
            return mu, nu, residuals
        onebit, *residuals, _ = compressed_allreduce(grads, *residuals, axis, "l2", cfg.padding)
        onebit = _masked(onebit, masks)
        mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, onebit, strict=True)]
        return vary(mu, (axis,)), nu, vary(residuals, (axis,))

    residuals = [getattr(w, f) for f in _RESIDUALS]
    mu, nu, residuals = lax.cond(update_variance, full, compressed, w.mu, w.nu, residuals)
    # DeepSpeed zeroes the residuals once, after the last step before the freeze: they
    # held the gradients' compression errors, and will hold the accumulated updates'.
    last = step == cfg.var_freeze_step - 1
    # (typed varying again: a residual without entries comes back from where unvarying)
    residuals = vary([[jnp.where(last, 0.0, x) for x in r] for r in residuals], (axis,))
    w = w._replace(mu=mu, nu=nu, **dict(zip(_RESIDUALS, residuals, strict=True)))
    params = [p + -lr * u for p, u in zip(w.params, _direction(cfg, w), strict=True)]
    counter = jnp.where(update_variance, w.var_counter + 1, w.var_counter)
    doubles = counter == cfg.var_update_scaler
    w = w._replace(
        params=params,
        var_counter=jnp.where(doubles, 0, counter),
        var_interval=jnp.where(doubles, 2 * w.var_interval, w.var_interval),
    )
    return w, (update_variance, jnp.asarray(True))


def _local_phase(
    cfg: _Config, masks: Any, w: _Worker, grads: list[jax.Array], lr: jax.Array, step: Any
) -> tuple[_Worker, tuple[jax.Array, jax.Array]]:
    """A step after the freeze: a local Adam step with the frozen variance, then, on
    schedule, the rollback and the 1-bit all-reduce of the accumulated updates."""
    axis, n, b1 = cfg.kit.axis, cfg.kit.n, cfg.b1
    mu = [b1 * m + (1 - b1) * g for m, g in zip(w.mu, grads, strict=True)]
    w = w._replace(mu=mu, lrs=w.lrs + lr)
    delta = [-lr * u for u in _direction(cfg, w)]
    w = w._replace(
        params=[p + d for p, d in zip(w.params, delta, strict=True)],
        accumulator=[a + d for a, d in zip(w.accumulator, delta, strict=True)],
    )
    synchronise = (step + _DEEPSPEED_STEP_OFFSET) % w.local_step_interval == 0

    def sync(w: _Worker) -> _Worker:
        root = [jnp.sqrt(v) + cfg.eps for v in w.nu]
        params = [p + -1.0 * a for p, a in zip(w.params, w.accumulator, strict=True)]
        acc = [a * r for a, r in zip(w.accumulator, root, strict=True)]
        residuals = [getattr(w, f) for f in _RESIDUALS]
        if n > 1:
            acc, *residuals, _ = compressed_allreduce(acc, *residuals, axis, "l2", cfg.padding)
            acc = _masked(acc, masks)
        w = w._replace(
            params=[p + a / r for p, a, r in zip(params, acc, root, strict=True)],
            mu=[-(a / w.lrs) for a in acc],
            accumulator=[jnp.zeros_like(a) for a in acc],
            lrs=jnp.zeros_like(w.lrs),
            **dict(zip(_RESIDUALS, residuals, strict=True)),
        )
        return _vary_workers(w, axis)

    w = lax.cond(synchronise, sync, lambda w: w, w)
    counter = w.local_step_counter + 1
    doubles = counter == cfg.local_step_scaler
    interval = jnp.minimum(cfg.local_step_clipper, 2 * w.local_step_interval)
    w = w._replace(
        local_step_counter=jnp.where(doubles, 0, counter),
        local_step_interval=jnp.where(doubles, interval, w.local_step_interval),
    )
    return w, (jnp.asarray(False), synchronise)
