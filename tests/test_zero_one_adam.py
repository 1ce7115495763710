"""0/1 Adam against a NumPy transcription of DeepSpeed's code (github.com/deepspeedai/
DeepSpeed: deepspeed/runtime/fp16/onebit/zoadam.py, ZeroOneAdam.step, and the engine's
enable_backward_allreduce it sets; deepspeed/runtime/comm/nccl.py, compressed_allreduce,
transcribed in test_onebit.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_batches, mlp_pair
from test_onebit import (
    ODD_SHAPES,
    SHAPES,
    as_deepspeed_errors,
    ds_compressed_allreduce,
    ds_padded_size,
    unpadded_compressed_allreduce,
    unpadded_errors,
)

import ddl_jax as ddl

NAMES = sorted(SHAPES)  # the parameters' leaves, in tree order
assert sorted(ODD_SHAPES) == NAMES


class DSZeroOneAdam:
    """``ZeroOneAdam.step`` for N workers, one parameter group, each worker with its own
    copy of the parameters and of every state entry (``exp_avg[i]``: worker i's).

    ``grads[i][k]`` is worker i's gradient of parameter k; the engine averages them while
    ``enable_backward_allreduce``, which ``step`` sets for the next step.
    """

    def __init__(self, params, n, schedule, betas, eps, weight_decay, mask=None, padded=True):
        self.params = [[np.asarray(p, np.float64).copy() for p in params] for _ in range(n)]
        self.padded = padded  # False: padding="none", not DeepSpeed's
        self.n, self.betas, self.eps, self.wd, self.mask = n, betas, eps, weight_decay, mask
        self.var_freeze_step, self.var_update_scaler = schedule[:2]
        self.local_step_scaler, self.local_step_clipper = schedule[2:]
        self.initialize, self.freeze_key, self.reinitial_error_buffer = False, False, False
        self.enable_backward_allreduce = True  # the engine's default
        self.state = [{} for _ in params]

    def step(self, grads, lr):
        n, (beta1, beta2), eps = self.n, self.betas, self.eps
        if self.enable_backward_allreduce:
            mean = [np.mean([g[k] for g in grads], axis=0) for k in range(len(self.state))]
            grads = [mean] * n
        for k, state in enumerate(self.state):
            p = self.params[0][k]
            if not state:
                state["step"] = 0
                state["exp_avg"] = [np.zeros(p.shape) for _ in range(n)]
                state["exp_avg_sq"] = [np.zeros(p.shape) for _ in range(n)]
            if not self.initialize or "worker_error" not in state:
                state["var_interval"], state["var_counter"] = 1, 0
                state["local_step_interval"], state["local_step_counter"] = 1, 0
                state["lrs"] = 0.0
                padded = ds_padded_size(p.size, n)
                state["worker_error"] = [np.zeros(padded) for _ in range(n)]
                state["server_error"] = [np.zeros(padded // n) for _ in range(n)]
                if not self.padded:
                    state["worker_error"], state["server_error"] = unpadded_errors(p.size, n)
                state["momentum_accumulator"] = [np.zeros(p.shape) for _ in range(n)]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            comm_buffer = state["momentum_accumulator"]
            state["step"] += 1
            mask = None if self.mask is None else self.mask[k]

            def allreduce(buffers, state=state, mask=mask, shape=p.shape):
                compressed_allreduce = (
                    ds_compressed_allreduce if self.padded else unpadded_compressed_allreduce
                )
                flat = compressed_allreduce(
                    [b.ravel() for b in buffers], state["worker_error"], state["server_error"]
                ).reshape(shape)
                return flat if mask is None else flat * mask

            if self.initialize:
                if self.freeze_key is False:
                    if state["step"] % state["var_interval"] == 0:
                        for i in range(n):
                            g = grads[i][k]
                            exp_avg_sq[i] = exp_avg_sq[i] * beta2 + (1 - beta2) * g * g
                            exp_avg[i] = exp_avg[i] * beta1 + (1 - beta1) * g
                    elif n > 1:
                        grad_onebit = allreduce([grads[i][k] for i in range(n)])
                        for i in range(n):
                            exp_avg[i] = exp_avg[i] * beta1 + (1 - beta1) * grad_onebit
                else:
                    for i in range(n):
                        exp_avg[i] = exp_avg[i] * beta1 + (1 - beta1) * grads[i][k]
                    state["lrs"] += lr
            if not self.initialize and n > 1:
                reduced = allreduce(comm_buffer)
                for i in range(n):
                    comm_buffer[i] = reduced.copy()
            if self.initialize:
                for i in range(n):
                    update = exp_avg[i] / (np.sqrt(exp_avg_sq[i]) + eps)
                    if self.wd > 0.0:
                        update = update + self.wd * self.params[i][k]
                    self.params[i][k] = self.params[i][k] + -lr * update
                    if self.freeze_key is True:
                        comm_buffer[i] = comm_buffer[i] + -lr * update
                if state["step"] % state["local_step_interval"] == 0 and self.freeze_key:
                    for i in range(n):
                        self.params[i][k] = self.params[i][k] + -1 * comm_buffer[i]
                        comm_buffer[i] = comm_buffer[i] * (np.sqrt(exp_avg_sq[i]) + eps)
                    if n > 1:
                        reduced = allreduce(comm_buffer)
                        for i in range(n):
                            comm_buffer[i] = reduced.copy()
                    for i in range(n):
                        exp_avg[i] = -(comm_buffer[i] / state["lrs"])
                        root = np.sqrt(exp_avg_sq[i]) + eps
                        self.params[i][k] = self.params[i][k] + comm_buffer[i] / root
                        comm_buffer[i] = np.zeros(p.shape)
                    state["lrs"] = 0.0
                if self.freeze_key is False:
                    if state["step"] % state["var_interval"] == 0:
                        state["var_counter"] += 1
                        if state["var_counter"] == self.var_update_scaler:
                            state["var_counter"] = 0
                            state["var_interval"] *= 2
                    following = (state["step"] + 1) % state["var_interval"] == 0
                    self.enable_backward_allreduce = following
                else:
                    state["local_step_counter"] += 1
                    if state["local_step_counter"] == self.local_step_scaler:
                        state["local_step_counter"] = 0
                        state["local_step_interval"] = min(
                            self.local_step_clipper, state["local_step_interval"] * 2
                        )
        if not self.initialize:  # pops the last parameter's buffers only, as DeepSpeed does
            self.freeze_key = False
            state.pop("worker_error")
            state.pop("server_error")
            self.initialize = True
            return
        if self.state[0]["step"] > self.var_freeze_step:
            self.freeze_key = True
            self.enable_backward_allreduce = False
        if self.freeze_key is True and self.reinitial_error_buffer is False:
            for state in self.state:
                for i in range(n):
                    state["worker_error"][i][:] = 0
                    state["server_error"][i][:] = 0
            self.reinitial_error_buffer = True


# -- the problem: worker i's gradient of its replica p_i is mean(x_i) + p_i / 2 ---------------


def loss_fn(params, batch):
    linear = sum(jnp.sum(params[k] * batch[k].mean(0)) for k in NAMES)
    return linear + 0.25 * sum(jnp.sum(params[k] ** 2) for k in NAMES)


def worker_grads(params, batch, n):
    """Each worker's gradient of its own replica on its rows of ``batch`` (float64)."""
    rows = {k: np.split(batch[k].astype(np.float64), n) for k in NAMES}
    return [[rows[k][i].mean(0) + 0.5 * params[i][j] for j, k in enumerate(NAMES)]
            for i in range(n)]  # fmt: skip


def lr_schedule(t):
    """A decaying learning rate: the momentum restarts from the lr-weighted mean."""
    return 0.05 / (1.0 + 0.1 * t)


def close(actual, desired, msg):
    """Equal to float32's precision relative to the tensor's scale: entries far below it
    (a gradient summed to almost 0, squared in the variance) carry float32's error in the
    sum, not the method's."""
    scale = np.abs(desired).max()
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * scale, err_msg=msg)


#: var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper. DeepSpeed's
#: step numbers s = t + 2: the variance updates at s = 2, 3, 4, 6, 8 (the interval doubling
#: after every 2 updates) and the gradients of s = 5, 7, 9 are all-reduced in 1 bit; from
#: s = 10 local steps, synchronised at s = 10, 11, 12 (interval 1, then 2), 16, 20 (4,
#: clipped at 4).
SCHEDULE = (8, 2, 2, 4)
STEPS = 20
VARIANCE_UPDATES = [0, 1, 2, 4, 6]
SYNCHRONISED = [*range(8), 8, 9, 10, 14, 18]


@pytest.mark.parametrize(
    ("n", "weight_decay", "masked", "shapes", "padding"),
    [
        (4, 0.0, False, SHAPES, "deepspeed"),
        (4, 0.01, True, SHAPES, "deepspeed"),
        (1, 0.0, False, SHAPES, "deepspeed"),
        (4, 0.01, False, ODD_SHAPES, "deepspeed"),  # DeepSpeed pads: 10 and 21 to 32
        (8, 0.0, False, ODD_SHAPES, "deepspeed"),  # to 64
        (8, 0.0, False, ODD_SHAPES, "none"),  # the transcription with padding left out
    ],
)
def test_zero_one_adam_is_deepspeeds(n, weight_decay, masked, shapes, padding):
    """DeepSpeed's ZeroOneAdam on g_1, g_2, ..., whose first step only allocates buffers,
    against zero_one_adam with the same arguments on g_2, g_3, ...: every worker's
    parameters, moments, accumulator and residuals after every step."""
    rng = np.random.default_rng(5)
    params = {k: rng.normal(size=shapes[k]).astype(np.float32) for k in NAMES}
    batches = [
        {k: rng.normal(size=(2 * n, *shapes[k])).astype(np.float32) for k in NAMES}
        for _ in range(STEPS)
    ]
    mask = None
    if masked:  # the compressed all-reduces zero row 0 of w and the first half of b
        mask = {k: np.ones(SHAPES[k], np.float32) for k in NAMES}
        mask["w"][0], mask["b"][:32] = 0.0, 0.0
    betas, eps = (0.9, 0.999), 1e-8
    options = dict(zip(("var_freeze_step", "var_update_scaler", "local_step_scaler",
                        "local_step_clipper"), SCHEDULE, strict=True))  # fmt: skip
    strategy = ddl.zero_one_adam(
        loss_fn, lr_schedule, ddl.make_mesh(data=n), weight_decay=weight_decay,
        exp_avg_mask=mask, b1=betas[0], b2=betas[1], eps=eps, padding=padding, **options,
    )  # fmt: skip
    ds_mask = None if mask is None else [mask[k].astype(np.float64) for k in NAMES]
    ds = DSZeroOneAdam([params[k] for k in NAMES], n, SCHEDULE, betas, eps, weight_decay,
                       ds_mask, padded=padding == "deepspeed")  # fmt: skip
    ds.step(worker_grads(ds.params, batches[0], n), lr=None)  # allocates buffers only
    step = jax.jit(strategy.step)
    state = strategy.init(params)
    updated, synchronised = [], []
    for t, batch in enumerate(batches):
        ds.step(worker_grads(ds.params, batch, n), lr=lr_schedule(t))
        state, metrics = step(state, batch)
        s = jax.tree.map(np.asarray, state)
        updated += [t] if metrics["variance_updated"] else []
        synchronised += [t] if metrics["synchronised"] else []
        for j, k in enumerate(NAMES):
            dss = ds.state[j]
            msg = f"{k} at step {t}"
            for i in range(n):
                close(s.params[k][i], ds.params[i][j], msg)
                close(s.mu[k][i], dss["exp_avg"][i], msg)
                close(s.accumulator[k][i], dss["momentum_accumulator"][i], msg)
            close(s.nu[k], dss["exp_avg_sq"][0], msg)
            if padding == "deepspeed":  # DeepSpeed's buffers read back from the state
                worker_errors, server_error = as_deepspeed_errors(
                    s.residual[k], s.pad_residual[k], s.owner_residual[k],
                    s.owner_pad_residual[k], n,
                )  # fmt: skip
            else:
                worker_errors = [s.residual[k][i].ravel() for i in range(n)]
                server_error = s.owner_residual[k].sum(0).ravel()  # e', each its chunk
                np.testing.assert_array_equal(s.pad_residual[k], 0.0)
                np.testing.assert_array_equal(s.owner_pad_residual[k], 0.0)
            for i in range(n):
                close(worker_errors[i], dss["worker_error"][i], msg)
            close(server_error, np.concatenate(dss["server_error"]), msg)
            np.testing.assert_allclose(s.lrs, dss["lrs"], rtol=1e-6, atol=1e-8, err_msg=msg)
            schedule = ("var_interval", "var_counter", "local_step_interval",
                        "local_step_counter")  # fmt: skip
            assert [int(getattr(s, f)) for f in schedule] == [dss[f] for f in schedule], msg
    # The run went through every phase of the schedule above.
    assert updated == VARIANCE_UPDATES
    assert synchronised == SYNCHRONISED
    if n > 1:  # error feedback was at work in both phases, and replicas parted between syncs
        assert np.abs(s.residual["w"]).max() > 1e-3
        assert not np.allclose(s.params["w"][0], s.params["w"][1], atol=1e-3)


def test_zero_one_adam_trains():
    """The 12-16-5 MLP on random labels: the loss falls while the variance updates, and
    goes on falling through the local steps after it freezes."""
    loss, params = mlp_pair()
    n, steps, freeze = 4, 40, 10
    batches = make_batches(steps, 32, seed=1)
    strategy = ddl.zero_one_adam(
        loss, 0.01, ddl.make_mesh(data=n), var_freeze_step=freeze, var_update_scaler=2,
        local_step_scaler=4, local_step_clipper=4,
    )  # fmt: skip
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    whole = jax.tree.map(lambda *x: np.concatenate(x), *batches)
    losses = [float(loss(params, whole))]
    for t, batch in enumerate(batches):
        state, _ = step(state, batch)
        if t + 1 in (freeze, steps):
            losses.append(float(loss(strategy.params(state), whole)))
    assert losses[0] - 0.05 > losses[1] > losses[2] + 0.05, losses


def test_zero_one_adam_sends_a_float32_ring_one_bit_or_nothing():
    """Per device: a variance update's float32 ring all-reduce, the 1-bit all-reduce of the
    gradient between variance updates and of the accumulated updates at a synchronisation
    (signs and a scale per worker), nothing at a local step (the only other branch)."""
    n, d = 4, 64 * 64

    def linear(p, batch):
        return jnp.sum(p["w"] * batch["x"].mean(0))

    strategy = ddl.zero_one_adam(linear, 0.1, ddl.make_mesh(data=n), var_freeze_step=2)
    params = {"w": np.ones((64, 64), np.float32)}
    batch = {"x": np.ones((2 * n, 64, 64), np.float32)}
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    ring = 2 * (n - 1) / n
    one_bit = ring * (d / 8 + 4 * n)
    assert sorted(stats.branches.values()) == [one_bit, one_bit, ring * 4 * d]


def test_zero_one_adam_rejects_bad_arguments():
    mesh = ddl.make_mesh(data=2)
    for kwargs, name in [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"var_freeze_step": 0}, "var_freeze_step"),
        ({"var_freeze_step": 1.5}, "var_freeze_step"),
        ({"var_update_scaler": 0}, "var_update_scaler"),
        ({"local_step_scaler": 0}, "local_step_scaler"),
        ({"local_step_clipper": 0}, "local_step_clipper"),
        ({"b1": 1.0}, "b1"),
        ({"b2": -0.1}, "b2"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"exp_avg_mask": "zeros"}, "exp_avg_mask"),
        ({"padding": "zeros"}, "zero_one_adam: padding must be 'deepspeed' or 'none'"),
        ({"padding": None}, "padding"),
    ]:
        args = {"learning_rate": 0.1} | kwargs
        with pytest.raises(ValueError, match=name):
            ddl.zero_one_adam(loss_fn, args.pop("learning_rate"), mesh, **args)
    with pytest.raises(TypeError, match="axis"):
        ddl.zero_one_adam(loss_fn, 0.1, mesh, axis=0)
    with pytest.raises(TypeError, match="learning_rate"):  # an optax optimizer for the lr
        ddl.zero_one_adam(loss_fn, optax.adam(0.1), mesh)
    params = {k: np.zeros(SHAPES[k], np.float32) for k in NAMES}
    strategy = ddl.zero_one_adam(loss_fn, 0.1, mesh, exp_avg_mask={"w": np.ones((8, 16))})
    with pytest.raises(ValueError, match="exp_avg_mask must be a pytree"):
        strategy.init(params)


def test_zero_one_adam_carries_a_zero_size_leaf_and_trains_as_without_it():
    """A parameter without entries beside a matrix, across the variance freeze and the
    local phase's 1-bit synchronisations: the matrix trains as it does alone."""
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + jnp.sum(p.get("z", 0.0)) - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": np.ones((16, 4), np.float32)}
    trained = []
    for params in ({"w": jnp.full((16, 4), 0.1)}, {"w": jnp.full((16, 4), 0.1), "z": jnp.zeros(0)}):
        strategy = ddl.zero_one_adam(loss, 1e-2, ddl.make_mesh(data=4), var_freeze_step=2)
        state, step = strategy.init(params), jax.jit(strategy.step)
        for _ in range(5):
            state, _ = step(state, batch)
        trained.append(strategy.params(state))
    assert trained[1]["z"].shape == (0,)
    np.testing.assert_array_equal(trained[1]["w"], trained[0]["w"])
