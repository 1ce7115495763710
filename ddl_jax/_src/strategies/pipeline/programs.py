"""The per-device programs of ``ddl.pipeline``: the ticks of one step under ``shard_map``.

``builder.py`` checks the arguments into a ``PipelineConfig`` (``types.py``), builds the
stages and the state; the functions here run on one device (one stage of one data worker) inside
``shard_map``: a ``lax.scan`` over ticks, a ``lax.switch`` to this stage's work, and
``ppermute`` to the neighbouring stages.

Model state (batch statistics) travels with its stage as one flat vector ``s`` of the
config's ``state_len`` entries; :func:`stage_key` gives each (stage, micro-batch) its
dropout key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddl_jax._src.core.kit import vary
from ddl_jax._src.core.model_loss import ModelVars, mean_over, worker_key
from ddl_jax._src.core.strategy import DATA, STAGE
from ddl_jax._src.strategies.pipeline.schedules import (
    Schedule,
    gradient_wait,
    one_kind_ticks,
    peak_stash,
)
from ddl_jax._src.strategies.pipeline.types import (
    DDGState,
    Metrics,
    PipelineConfig,
    PipelineState,
    Stages,
)


def _shift(x: jax.Array, k_: int, direction: int) -> jax.Array:
    """Sends ``x`` to the next (+1) or previous (-1) stage; the ends receive zeros."""
    perm = [(i, i + direction) for i in range(k_) if 0 <= i + direction < k_]
    return lax.ppermute(x, STAGE, perm)


def tick_tables(plan: Schedule) -> dict[str, np.ndarray]:
    """Per tick and stage: the branch to run, its micro-batch, and what arrives."""
    k_ = plan.stages
    forward, backward = plan.forward, plan.backward
    stage = np.arange(k_)[None, :]
    # The last stage's forward only feeds its loss, which its backward recomputes anyway.
    runs_forward = (forward >= 0) & (stage < k_ - 1)
    branch = np.where(runs_forward, 1 + stage, np.where(backward >= 0, 1 + k_ + stage, 0))
    micro = np.maximum(np.where(forward >= 0, forward, backward), 0)
    none = np.full((len(forward), 1), -1, np.int32)
    recv_act = np.concatenate([none, forward[:, :-1]], axis=1)
    recv_grad = np.concatenate([backward[:, 1:], none], axis=1)
    return {"branch": branch, "micro": micro, "recv_act": recv_act, "recv_grad": recv_grad}


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _local(tree: Any, depth: int) -> Any:
    """Inside ``shard_map``: this device's entry of leaves with ``depth`` leading mesh axes."""
    return jax.tree.map(lambda x: x[(0,) * depth], tree)


def _unlocal(tree: Any, depth: int) -> Any:
    """The inverse of :func:`_local`, for the state's out_specs."""
    return jax.tree.map(lambda x: x.reshape((1,) * depth + x.shape), tree)


def stage_key(cfg: PipelineConfig, key: jax.Array, k: jax.Array, j: jax.Array | None) -> Any:
    """Stage k's key for micro-batch j from the worker's key: ``fold_in(fold_in(key, k), j)``.

    Stage k is folded in only for K > 1 and j only for M > 1 (``j=None``: not at all), so
    a one-stage pipeline of one micro-batch draws the key of ``data_parallel``.
    """
    if cfg.k > 1:
        key = jax.random.fold_in(key, k)
    return key if j is None or cfg.m == 1 else jax.random.fold_in(key, j)


def local_model_state(cfg: PipelineConfig, model: ModelVars) -> jax.Array:
    """Inside ``shard_map``: this stage's flat model state, ``[S]`` (``[0]`` for none)."""
    return model.state[0] if cfg.state_len else jnp.zeros((0,), cfg.state_dtype)


def merged_model(cfg: PipelineConfig, model: ModelVars, s: jax.Array) -> ModelVars:
    """The state's ``ModelVars`` after a step: this stage's model state averaged over the
    data workers, the step counted."""
    state = mean_over(s, DATA)[None] if cfg.state_len else model.state
    return ModelVars(state, model.key, model.step + 1)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array, keep: jax.Array) -> jax.Array:
    old = lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, old), slot, 0)


def _columns(plan: Schedule) -> dict[str, np.ndarray]:
    """:func:`tick_tables` as ``[groups, G, K]``, with ``ran_forward``, ``ran_backward``
    (the stage runs a forward / a backward), ``any_act`` and ``any_grad`` (some stage sends
    an activation / an error gradient: the same on every stage) added."""
    k_ = plan.stages
    tables = tick_tables(plan)
    branch = tables["branch"]
    columns = {
        **tables,
        "ran_forward": (branch >= 1) & (branch <= k_),
        "ran_backward": branch > k_,
        "any_act": np.broadcast_to((tables["recv_act"] >= 0).any(axis=1)[:, None], branch.shape),
        "any_grad": np.broadcast_to((tables["recv_grad"] >= 0).any(axis=1)[:, None], branch.shape),
    }
    return {name: table.reshape(-1, plan.group, k_) for name, table in columns.items()}


def phases(plan: Schedule) -> list[tuple[list[tuple[bool, bool]], dict[str, np.ndarray]]]:
    """The schedule's groups of ticks in up to three runs, ``(kinds, rows)`` each: the
    warm-up (forwards alone), the steady state (both), the cool-down (backwards alone).
    ``rows`` are the run's :func:`_columns` rows, ``[groups, G, K]`` (G: the most ticks a
    stage runs in one of the run's groups); ``kinds[j]`` says whether some stage runs a
    forward (a backward) on tick j of some group of the run, and a tick without forwards
    has its backward branches renumbered to follow the idle one directly. Groups where
    every stage idles are left out (nothing arrives on them).

    A tick that runs no backward on any stage sends no error gradients and accumulates no
    parameter gradient, one without forwards sends no activations: each tick has only its
    kinds of work in it (GPipe is a warm-up and a cool-down). A run's groups are laid out
    by :func:`one_kind_ticks` where that leaves no tick of both kinds in the run (GPipe's
    forwards beside a backward in one group).
    """
    k_ = plan.stages
    layouts = [_columns(plan), _columns(one_kind_ticks(plan))]
    columns = layouts[0]
    forwards = columns["ran_forward"].any(axis=(1, 2))
    backwards = columns["ran_backward"].any(axis=(1, 2))
    groups = np.flatnonzero(forwards | backwards)
    first_backward = groups[backwards[groups]].min(initial=len(forwards))
    last_forward = groups[forwards[groups]].max(initial=-1)
    runs = [
        groups[groups < first_backward],
        groups[(groups >= first_backward) & (groups <= last_forward)],
        groups[groups > last_forward],
    ]
    out = []
    for run in filter(len, runs):
        for columns in reversed(layouts):
            # A stage's operations fill its group's first ticks: keep the ticks in use.
            used = 1 + np.flatnonzero((columns["branch"][run] > 0).any(axis=(0, 2))).max()
            rows = {name: table[run, :used].copy() for name, table in columns.items()}
            fwd = rows["ran_forward"].any(axis=(0, 2))
            bwd = rows["ran_backward"].any(axis=(0, 2))
            if not (fwd & bwd).any():
                break
        for j in np.flatnonzero(~fwd):  # backward branches follow the idle one directly
            rows["branch"][:, j] = np.where(
                rows["ran_backward"][:, j], rows["branch"][:, j] - k_, 0
            )
        out.append(([(bool(f), bool(b)) for f, b in zip(fwd, bwd, strict=True)], rows))
    return out


def _send_if(
    flag: jax.Array, send: Callable[[jax.Array], jax.Array], x: jax.Array, order: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``send(x)``, a ``ppermute``, on ticks where ``flag`` (the same on every device) says
    some stage sends; zeros on the others (1F1B's steady state sends activations on some
    ticks and error gradients on others). ``order`` is the step's ordering token (see
    :func:`synchronous_step`), returned advanced."""
    return lax.cond(
        after(order, flag),
        lambda a, o: (send(a), o + 1),
        lambda a, o: (jnp.zeros_like(a), o + 1),
        x,
        order,
    )


def after(order: jax.Array, x: jax.Array) -> jax.Array:
    """``x``, made to depend on the ordering token (``order`` is never negative; XLA
    cannot know that, so the operation ``x`` selects waits for the token's producer)."""
    return jnp.where(order >= 0, x, jnp.zeros_like(x))


def _tick_branches(
    cfg: PipelineConfig, fns: Stages, p: jax.Array, fwd: bool, bwd: bool
) -> list[Callable[..., dict[str, Any]]]:
    """The branches of the switch on a tick of forwards (``fwd``) and/or backwards
    (``bwd``): idle, each stage's forward, each stage's backward. Each returns what such a
    tick needs (zeros where its branch did none of it) and the ordering token advanced."""
    k_, both = cfg.k, (DATA, STAGE)

    def zero(name: str) -> jax.Array:
        if name == "grad_p":
            return jnp.zeros_like(p)
        return jnp.zeros((), jnp.float32) if name == "loss" else jnp.zeros((fns.width,), fns.dtype)

    def branch(kind: str, i: int) -> Callable[..., dict[str, Any]]:
        def run(
            p: jax.Array,
            s: jax.Array,
            x_buf: jax.Array,
            ct: jax.Array,
            mb: Any,
            key: Any,
            order: jax.Array,
        ) -> dict[str, Any]:
            out = {"s": s, "order": order + 1}
            if kind == "forward":
                out["act"], out["s"] = fns.forward[i](p, s, x_buf, mb, key)
            elif kind == "backward":
                grad_p, out["grad_x"], loss, new = fns.backward[i](
                    p, s, x_buf, ct, mb, key, 1 / cfg.m
                )
                out["grad_p"], out["loss"] = grad_p, loss.astype(jnp.float32)
                out["s"] = new if i == k_ - 1 else s
            needs = [
                "s",
                "order",
                *(["act"] if fwd else []),
                *(["grad_x", "grad_p", "loss"] if bwd else []),
            ]
            return vary({name: out[name] if name in out else zero(name) for name in needs}, both)

        return run

    return [
        branch("idle", 0),
        *([branch("forward", i) for i in range(k_)] if fwd else []),
        *([branch("backward", i) for i in range(k_)] if bwd else []),
    ]


def _exchange(
    outputs: list[jax.Array],
    sends: jax.Array | None,
    received: jax.Array | None,
    buffer: jax.Array,
    order: jax.Array,
    k_: int,
    direction: int,
) -> tuple[jax.Array, jax.Array]:
    """One message to the next (+1) or previous (-1) stage holding a group's ``outputs``,
    if some stage sends (``sends``: per output, the same on every device); what arrives is
    stored in ``buffer`` at the slots of the micro-batches ``received`` (-1: nothing).
    Returns the buffer and the ordering token."""
    if not outputs:
        return buffer, order
    got, order = _send_if(
        sends.any(), lambda a: _shift(a, k_, direction), jnp.stack(outputs), order
    )
    slots = buffer.shape[0]
    for i, m in enumerate(received):
        buffer = _store(buffer, m % slots, got[i], m >= 0)
    return buffer, order


def synchronous_step(
    cfg: PipelineConfig, plan: Schedule, fns: Stages, state: PipelineState, batch: Any
) -> tuple[PipelineState, Metrics]:
    """One GPipe / 1F1B step on one device: the scheduled ticks, then one update.

    The ticks run as :func:`phases`, one ``lax.scan`` per run of ticks of one kind. The
    stage's model state passes through its forwards in the schedule's order (the last
    stage runs no forward: through its backwards, in the same micro-batch order); the
    other stages' backwards re-run the stage from the current state and drop the update.

    An integer token passes through every tick's work and every message, in the
    schedule's order: XLA:CPU otherwise runs independent conditionals in any order (a
    group's later forwards before its first tick's message went out, keeping the next
    stage waiting).
    """
    k_, m_ = cfg.k, cfg.m
    slots, inbox_slots = peak_stash(plan), max(gradient_wait(plan), 1)
    k = lax.axis_index(STAGE)
    both = (DATA, STAGE)
    p = state.params[0]
    # Differentiate a data-varying view: each data worker's gradient goes to the reducer.
    p_var = vary(p, (DATA,))
    key = worker_key(state.model, lax.axis_index(DATA))
    micro = jax.tree.map(lambda x: x.reshape(m_, -1, *x.shape[1:]), batch)

    def run_phase(
        carry: tuple, kinds: list[tuple[bool, bool]], rows: dict[str, np.ndarray]
    ) -> tuple:
        # The ticks of a group whose outputs its messages carry: those on which some
        # group of the run sends.
        act_ticks = np.flatnonzero(rows["any_act"].any(axis=(0, 2))).tolist() if k_ > 1 else []
        grad_ticks = np.flatnonzero(rows["any_grad"].any(axis=(0, 2))).tolist() if k_ > 1 else []
        branches = {kind: _tick_branches(cfg, fns, p, *kind) for kind in set(kinds)}

        def group(carry: tuple, row: dict[str, jax.Array]) -> tuple[tuple, None]:
            """The group's ticks on this stage, then what they send."""
            acts, inbox, s, grad_sum, loss_sum, order = carry
            outs = []
            for j, kind in enumerate(kinds):
                m = row["micro"][j]
                out = lax.switch(
                    after(order, row["branch"][j]),
                    branches[kind],
                    p_var,
                    s,
                    acts[m % slots],
                    inbox[m % inbox_slots],
                    _index(micro, m),
                    stage_key(cfg, key, k, m),
                    order,
                )
                s, order = out["s"], out["order"]
                if kind[1]:
                    # Summed outside the switch (a sum threaded through the conditional
                    # made XLA copy it in and out of every tick), on this stage's backwards.
                    grad_sum = lax.cond(
                        row["ran_backward"][j],
                        lambda g, o=out: g + o["grad_p"],
                        lambda g: g,
                        grad_sum,
                    )
                    loss_sum = loss_sum + out["loss"] / m_
                outs.append(out)
            # One message per direction and group, holding its ticks' outputs, sent after
            # the group's last tick (the token orders them).
            zero = jnp.zeros((fns.width,), fns.dtype)
            acts, order = _exchange(
                [outs[j].get("act", zero) for j in act_ticks],
                row["any_act"][np.array(act_ticks)] if act_ticks else None,
                row["recv_act"][np.array(act_ticks)] if act_ticks else None,
                acts,
                order,
                k_,
                1,
            )
            inbox, order = _exchange(
                [outs[j].get("grad_x", zero) for j in grad_ticks],
                row["any_grad"][np.array(grad_ticks)] if grad_ticks else None,
                row["recv_grad"][np.array(grad_ticks)] if grad_ticks else None,
                inbox,
                order,
                k_,
                -1,
            )
            return (acts, inbox, s, grad_sum, loss_sum, order), None

        columns = {name: jnp.asarray(table)[:, :, k] for name, table in rows.items()}
        return lax.scan(group, carry, columns)[0]

    carry = vary(
        (
            jnp.zeros((slots, fns.width), fns.dtype),
            jnp.zeros((inbox_slots, fns.width), fns.dtype),
            local_model_state(cfg, state.model),
            jnp.zeros_like(p),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
        ),
        both,
    )
    for kinds, rows in phases(plan):
        carry = run_phase(carry, kinds, rows)
    _, _, s, grads, loss, _ = carry
    return _updated(cfg, state, p, s, grads, loss)


def _updated(
    cfg: PipelineConfig,
    state: PipelineState,
    p: jax.Array,
    s: jax.Array,
    grads: jax.Array,
    loss: jax.Array,
) -> tuple[PipelineState, Metrics]:
    """The end of a GPipe / 1F1B step: the stage's update with the step's gradient sum."""
    reducer_state = _local(state.reducer_state, 2)
    p, opt_state, reducer_state = cfg.update(p, _local(state.opt_state, 1), reducer_state, grads)
    model = merged_model(cfg, state.model, s)
    new = PipelineState(p[None], _unlocal(opt_state, 1), _unlocal(reducer_state, 2), model)
    return new, {"loss": lax.pmean(lax.psum(loss, STAGE), DATA)}


def _advanced(order: jax.Array, y: jax.Array) -> jax.Array:
    """The ordering token, made to depend on ``y``: it adds 1 where an entry of ``y`` is
    unequal to itself, which it never is; XLA cannot know that."""
    v = y.reshape(-1)[0]
    return order + (v != v).astype(order.dtype)


def _tied(order: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` with 0 times the token added to its first entry: what reads it waits for the
    token. XLA keeps the addition (0 times a float is not 0 for inf or NaN), so even a
    constant ``x`` (a stage that sends or sums nothing) waits."""
    flat = x.reshape(-1)
    return flat.at[0].add(order.astype(x.dtype) * 0).reshape(x.shape)


def stage_step(
    cfg: PipelineConfig,
    plan: Schedule,
    fns: Stages,
    state: PipelineState,
    batch: Any,
    stage: int,
) -> tuple[PipelineState, Metrics]:
    """:func:`synchronous_step` on a device of stage ``stage`` only: the program of a
    process whose devices all belong to that stage (one stage per process or host).

    The same ticks, messages and arithmetic, with this stage's work called directly: no
    switch over the stages, no zero outputs for the branches to agree, no conditionals,
    and each stage's gradient summed as it is computed. Each process compiles its own
    stage's program; the processes meet only in the messages, which run in the schedule's
    order in every program: each message reads the ordering token, which reads what the
    previous one received, and each tick's inputs wait for the token (XLA:CPU orders its
    operations by their data, not by the program's text).
    """
    k_, m_ = cfg.k, cfg.m
    slots, inbox_slots = peak_stash(plan), max(gradient_wait(plan), 1)
    both = (DATA, STAGE)
    k = lax.axis_index(STAGE)
    p = state.params[0]
    p_var = vary(p, (DATA,))
    key = worker_key(state.model, lax.axis_index(DATA))
    micro = jax.tree.map(lambda x: x.reshape(m_, -1, *x.shape[1:]), batch)
    acts, inbox, s, loss, order = vary(
        (
            jnp.zeros((slots, fns.width), fns.dtype),
            jnp.zeros((inbox_slots, fns.width), fns.dtype),
            local_model_state(cfg, state.model),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
        ),
        both,
    )
    grads = None
    for kinds, rows in phases(plan):
        for g in range(len(rows["branch"])):
            outs = []
            for j, (fwd, _) in enumerate(kinds):
                branch, m = int(rows["branch"][g, j, stage]), int(rows["micro"][g, j, stage])
                out = {}
                if branch:
                    x_buf, ct, mb = jax.tree.map(
                        lambda x, o=order: _tied(o, x),
                        (acts[m % slots], inbox[m % inbox_slots], _index(micro, m)),
                    )
                    key_m = stage_key(cfg, key, k, m)
                    if fwd and branch <= k_:
                        out["act"], s = fns.forward[branch - 1](p_var, s, x_buf, mb, key_m)
                        order = _advanced(order, out["act"])
                    else:
                        i = branch - 1 - (k_ if fwd else 0)
                        grad_p, out["grad_x"], loss_m, new = fns.backward[i](
                            p_var, s, x_buf, ct, mb, key_m, 1 / m_
                        )
                        s = new if i == k_ - 1 else s
                        grads = grad_p if grads is None else grads + grad_p
                        loss = loss + loss_m.astype(jnp.float32) / m_
                        order = _advanced(_advanced(order, out["grad_x"]), grads)
                outs.append(out)
            for name, flag, arrives, buffer_slots, direction in (
                ("act", "any_act", "recv_act", slots, 1),
                ("grad_x", "any_grad", "recv_grad", inbox_slots, -1),
            ):
                ticks = np.flatnonzero(rows[flag][g, :, 0]).tolist() if k_ > 1 else []
                if not ticks:
                    continue
                zero = jnp.zeros((fns.width,), fns.dtype)
                message = vary(jnp.stack([outs[j].get(name, zero) for j in ticks]), both)
                got = _shift(_tied(order, message), k_, direction)
                order = _advanced(order, got)
                for i, j in enumerate(ticks):
                    if (m := int(rows[arrives][g, j, stage])) >= 0:
                        if name == "act":
                            acts = acts.at[m % buffer_slots].set(got[i])
                        else:
                            inbox = inbox.at[m % buffer_slots].set(got[i])
    grads = jnp.zeros_like(p_var) if grads is None else grads
    # The stage axis' sum of the loss follows every message on every process.
    return _updated(cfg, state, p, s, grads, _tied(order, loss))


def ddg_step(
    cfg: PipelineConfig, fns: Stages, state: DDGState, batch: Any
) -> tuple[DDGState, Metrics]:
    """M DDG ticks on one device; each ends with this stage's (delayed-gradient) update.

    Locked (``cfg.ddg_forward``, K > 1), as Huo et al.'s code runs it (slowbull/DDG,
    ``main.py``: ``train_start``, ``train_n``, ``train_end``; the delays in
    ``models/resnet_ddg.py``): on tick t every stage forwards micro-batch t, stage h at the
    h-th of the K - 1 sends that carry it through the stages, then stage k backpropagates
    micro-batch ``t - (K-1-k)`` along the error stage k + 1 sent on tick t - 1 (the last
    stage its own loss of micro-batch t) and updates. Pipelined, stage k forwards
    micro-batch ``t - k`` from what stage k - 1 sent on tick t - 1, one stage further a tick,
    and backpropagates ``t - 2(K-1) + k``.

    Each tick's forward updates the stage's model state (the last stage's backward, of the
    same micro-batch); the delayed backward re-runs the stage from the current state.
    Micro-batch j (its global index: the tick stage 0 forwards it) draws its stage's key
    from ``worker_key(model, w, step=j)``: in DDG every tick is an update.
    """
    k_, m_, slots = cfg.k, cfg.m, cfg.ddg_slots
    k, w = lax.axis_index(STAGE), lax.axis_index(DATA)
    both = (DATA, STAGE)
    last = k_ - 1
    locked = cfg.ddg_forward == "locked" and k_ > 1
    current = jax.tree.map(lambda x: x.reshape(m_, -1, *x.shape[1:]), batch)
    if k_ > 1:
        inputs, inbox = state.inputs[0, 0], state.inbox[0, 0]
        sequence = jax.tree.map(lambda h, c: jnp.concatenate([h[0], c]), state.history, current)
    else:
        inputs, inbox = jnp.zeros((slots, 0), fns.dtype), jnp.zeros((0,), fns.dtype)
        sequence = current
    past = cfg.ddg_depth * m_  # micro-batches of earlier steps at the front of ``sequence``
    zeros_a = jnp.zeros((fns.width,), fns.dtype)
    Out = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]

    def stage_tick(i: int) -> Callable[..., Out]:
        """Stage i's tick: its forward (pipelined only) and its delayed backward."""

        def run(p: jax.Array, s: jax.Array, x_f: Any, x_b: Any, ct: Any, *micro: Any) -> Out:
            mb_f, mb_b, key_f, key_b = micro
            if i < last and not locked:
                out_act, s_f = fns.forward[i](p, s, x_f, mb_f, key_f)
            else:
                out_act, s_f = zeros_a, s
            grad_p, grad_x, loss, s_b = fns.backward[i](p, s, x_b, ct, mb_b, key_b, 1.0)
            s = s_b if i == last else s_f
            return vary((out_act, grad_x, grad_p, loss.astype(jnp.float32), s), both)

        return run

    branches = [stage_tick(i) for i in range(k_)]

    def forward_at(h: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
        def run(p: jax.Array, s: jax.Array, x: jax.Array, micro: Any, key: Any) -> Any:
            return vary(fns.forward[h](p, s, x, micro, key), both)

        return run

    def idle(p: jax.Array, s: jax.Array, x: jax.Array, micro: Any, key: Any) -> Any:
        return vary((zeros_a, s), both)

    def key(j: jax.Array) -> jax.Array:
        return stage_key(cfg, worker_key(state.model, w, jnp.maximum(j, 0)), k, None)

    def tick(carry: tuple, i: jax.Array) -> tuple[tuple, None]:
        p, opt_state, reducer_state, s, inputs, inbox, loss_sum, count = carry
        g = state.tick + i
        j_f = g if locked else g - k
        j_b = j_f - cfg.ddg_delay(k)
        mb_f = _index(sequence, past + i)
        mb_b = _index(sequence, jnp.maximum(j_b - state.tick + past, 0))
        p_v = vary(p, (DATA,))
        if locked:  # micro-batch g crosses the stages; stage h + 1 keeps what h sent
            x, key_g = vary(zeros_a, both), key(g)
            for h in range(last):
                out, s = lax.cond(k == h, forward_at(h), idle, p_v, s, x, mb_f, key_g)
                x = jnp.where(k == h + 1, lax.ppermute(out, STAGE, [(h, h + 1)]), x)
            inputs = _store(inputs, g % slots, x, True)
        out_act, grad_x, grad_p, loss, new_s = lax.switch(
            k,
            branches,
            p_v,
            s,
            inputs[j_f % slots],
            inputs[j_b % slots],
            inbox,
            mb_f,
            mb_b,
            key(j_f),
            key(j_b),
        )
        # Micro-batch j_f has reached stage k (the last stage's j_b is j_f).
        s = jnp.where(j_f >= 0, new_s, s)
        valid = j_b >= 0
        new = cfg.update(p, opt_state, reducer_state, grad_p, staleness=cfg.ddg_delay(k))
        p, opt_state, reducer_state = jax.tree.map(
            lambda a, b: jnp.where(valid, a, b), new, (p, opt_state, reducer_state)
        )
        if k_ > 1:
            if not locked:
                inputs = _store(inputs, (g - k + 1) % slots, _shift(out_act, k_, 1), True)
            inbox = _shift(grad_x, k_, -1)
        counted = valid & (k == last)
        loss_sum, count = loss_sum + jnp.where(counted, loss, 0.0), count + counted
        return (p, opt_state, reducer_state, s, inputs, inbox, loss_sum, count), None

    s = local_model_state(cfg, state.model)
    carry = (
        state.params[0],
        _local(state.opt_state, 1),
        _local(state.reducer_state, 2),
        *vary((s, inputs, inbox, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), both),
    )
    (p, opt_state, reducer_state, s, inputs, inbox, loss_sum, count), _ = lax.scan(
        tick, carry, jnp.arange(m_)
    )
    loss = lax.psum(loss_sum, STAGE) / jnp.maximum(lax.psum(count, STAGE), 1)
    history = inbox_out = inputs_out = ()
    if k_ > 1:
        inputs_out, inbox_out = inputs[None, None], inbox[None, None]
        history = jax.tree.map(lambda s: s[s.shape[0] - past :][None], sequence)
    new = DDGState(
        p[None],
        _unlocal(opt_state, 1),
        _unlocal(reducer_state, 2),
        inputs_out,
        inbox_out,
        history,
        state.tick + m_,
        merged_model(cfg, state.model, s),
    )
    return new, {"loss": lax.pmean(loss, DATA)}
