"""1-bit compression and 1-bit Adam against NumPy transcriptions of DeepSpeed's code
(github.com/deepspeedai/DeepSpeed: deepspeed/runtime/comm/nccl.py, compressed_allreduce;
deepspeed/runtime/fp16/onebit/adam.py, OnebitAdam.step)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reducers import run_steps

import ddl_jax as ddl
from ddl_jax._src.core.reducer import checks_vma, reducer_metrics
from ddl_jax._src.reduce.onebit import onebit_adam
from ddl_jax._src.reduce.quantise import sign

# Sizes dividing by N * lcm(N, 8) for N in 1, 2, 4: DeepSpeed pads nothing.
SHAPES = {"w": (8, 16), "b": (64,)}
# Sizes dividing by no N * lcm(N, 8) for N > 1 (a bias of 10, a 3x7 matrix): DeepSpeed
# pads them, to 32 (N = 4), 64 (N = 8), 72 (N = 3).
ODD_SHAPES = {"w": (3, 7), "b": (10,)}


def random_grads(steps: int, n: int, seed: int = 0, shapes: dict = SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(steps, n, *s)).astype(np.float32) for k, s in shapes.items()}


def run(reducer, grads: dict, n: int):
    """Worker i fed ``grads[:, i]`` for T steps: every step's outputs and states,
    ``[T, N, ...]`` (numpy)."""
    assert jax.tree.leaves(grads)[0].shape[1] == n
    return run_steps(reducer, grads, every_state=True)


# -- DeepSpeed, transcribed -----------------------------------------------------------------


def ds_signs(x: np.ndarray) -> np.ndarray:
    """``x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)``: +1 where x >= 0, else -1."""
    return (np.sign(x) + 1).astype(bool).astype(np.float64) * 2 - 1


def ds_compressed_allreduce(buffers, worker_errors, server_errors):
    """``NcclBackend.compressed_allreduce`` run by all N workers at once.

    ``buffers[i]``: worker i's flat tensor; ``worker_errors[i]`` (padded size) and
    ``server_errors[i]`` (its chunk) are updated in place. Returns the common result.
    """
    n = len(buffers)
    size = buffers[0].size
    padded = worker_errors[0].size
    signs, scales = [], []
    for i in range(n):
        x = np.concatenate([buffers[i], np.zeros(padded - size)]) + worker_errors[i]
        scale = np.linalg.norm(x) / np.sqrt(x.size)
        worker_errors[i][:] = x - scale * ds_signs(x)
        signs.append(ds_signs(x).reshape(n, -1))  # packbits, split into n chunks
        scales.append(scale)
    out = []
    for j in range(n):  # server j: all_to_all of the signs, all_gather of the scales
        m = sum(signs[i][j] * (scales[i] / n) for i in range(n)) + server_errors[j]
        scale = np.linalg.norm(m) / np.sqrt(m.size)
        server_errors[j][:] = m - scale * ds_signs(m)
        out.append(scale * ds_signs(m))
    return np.concatenate(out)[:size]


def ds_padded_size(size: int, n: int) -> int:
    """``corrected_tensor_size`` (``OnebitAdam.step``, ``ZeroOneAdam.step``)."""
    divider = n * 8 // math.gcd(n, 8)
    return size + (-size) % (n * divider)


def unpadded_compressed_allreduce(buffers, worker_errors, server_errors):
    """``padding="none"``: ``ds_compressed_allreduce`` with the padding left out.

    ``worker_errors[i]`` has the tensor's size; the chunks have ``8 ceil(d / 8N)``
    entries, of which owner j's ``server_errors[j]`` covers those inside the tensor, the
    scales counting only those."""
    n = len(buffers)
    size = buffers[0].size
    chunk = -(-size // (8 * n)) * 8
    compressed = []
    for i in range(n):
        x = buffers[i] + worker_errors[i]
        scale = np.linalg.norm(x) / np.sqrt(max(x.size, 1))
        worker_errors[i][:] = x - scale * ds_signs(x)
        compressed.append(scale * ds_signs(x))
    out = []
    for j in range(n):
        part = slice(j * chunk, min((j + 1) * chunk, size))
        m = sum(c[part] for c in compressed) / n + server_errors[j]
        scale = np.linalg.norm(m) / np.sqrt(max(m.size, 1))
        server_errors[j][:] = m - scale * ds_signs(m)
        out.append(scale * ds_signs(m))
    return np.concatenate(out)


def unpadded_errors(size: int, n: int):
    """Zero ``worker_errors``, ``server_errors`` for :func:`unpadded_compressed_allreduce`."""
    chunk = -(-size // (8 * n)) * 8
    owned = [max(0, min(chunk, size - j * chunk)) for j in range(n)]
    return [np.zeros(size) for _ in range(n)], [np.zeros(c) for c in owned]


def as_deepspeed_errors(residual, pad, owner_residual, owner_pad, n):
    """One tensor's error feedback state, each worker's ``[N, ...]`` (the residuals) or
    ``[N]`` (their padding values), as DeepSpeed's buffers: every worker's
    ``worker_error`` (padded) and all ``server_error`` chunks concatenated."""
    size = residual[0].size
    padded = ds_padded_size(size, n)
    workers = [np.concatenate([residual[i].ravel(), np.full(padded - size, pad[i])])
               for i in range(n)]  # fmt: skip
    # Each worker's owner_residual is zero outside its chunk: summing assembles e'.
    server = np.concatenate([owner_residual.sum(0).ravel(), np.zeros(padded - size)])
    position = np.arange(padded)
    owner_values = np.asarray(owner_pad)[position // (padded // n)]
    return workers, np.where(position < size, server, owner_values)


class DSOnebitAdam:
    """``OnebitAdam.step`` for N workers, one parameter group; ``grads[i]`` is worker i's
    gradient as the engine hands it over (the engine averages it while
    ``enable_backward_allreduce``, i.e. until the freeze)."""

    def __init__(self, params, n, lr, freeze_step, betas, eps, weight_decay, padded=True):
        self.params = [np.asarray(p, np.float64).copy() for p in params]
        self.n, self.lr, self.freeze_step, self.padded = n, lr, freeze_step, padded
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.initialize, self.adam_freeze_key = False, False
        self.state = [{} for _ in params]
        self.updates = []

    def step(self, grads):  # grads[i][k]: worker i, parameter k
        n, (beta1, beta2) = self.n, self.betas
        if not self.adam_freeze_key:  # the engine's all-reduce
            mean = [np.mean([g[k] for g in grads], axis=0) for k in range(len(self.params))]
            grads = [mean] * n
        updates = []
        for k, p in enumerate(self.params):
            state = self.state[k]
            if not state:
                state["step"] = 0
                state["exp_avg"] = [np.zeros(p.shape) for _ in range(n)]
                state["exp_avg_sq"] = [np.zeros(p.shape) for _ in range(n)]
            if not self.initialize or (self.adam_freeze_key and "worker_error" not in state):
                padded = ds_padded_size(p.size, n)
                state["worker_error"] = [np.zeros(padded) for _ in range(n)]
                state["server_error"] = [np.zeros(padded // n) for _ in range(n)]
                if not self.padded:  # padding="none", not DeepSpeed's
                    state["worker_error"], state["server_error"] = unpadded_errors(p.size, n)
                self.adam_freeze_key = True
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            update = None
            if self.adam_freeze_key is False:
                for i in range(n):
                    exp_avg[i] = beta1 * exp_avg[i] + (1 - beta1) * grads[i][k]
                    exp_avg_sq[i] = beta2 * exp_avg_sq[i] + (1 - beta2) * grads[i][k] ** 2
            else:
                if self.initialize:
                    for i in range(n):
                        exp_avg[i] = beta1 * exp_avg[i] + (1 - beta1) * grads[i][k]
                if n > 1:
                    allreduce = (
                        ds_compressed_allreduce if self.padded else unpadded_compressed_allreduce
                    )
                    flat = allreduce(
                        [m.ravel() for m in exp_avg], state["worker_error"], state["server_error"]
                    )
                    for i in range(n):
                        exp_avg[i] = flat.reshape(p.shape)
            if self.initialize:
                update = exp_avg[0] / (np.sqrt(exp_avg_sq[0]) + self.eps)
                updates.append(update)
                self.params[k] = p - self.lr * (update + self.wd * p)
        if not self.initialize:  # pops the last parameter's buffers only, as DeepSpeed does
            state.pop("worker_error")
            state.pop("server_error")
            self.adam_freeze_key, self.initialize = False, True
            return
        self.updates.append(updates)
        if self.adam_freeze_key is False and state["step"] >= self.freeze_step:
            self.adam_freeze_key = True


# -- sign: DeepSpeed's compressed_allreduce ------------------------------------------------


@pytest.mark.parametrize(
    ("n", "shapes"), [(2, SHAPES), (4, SHAPES), (3, ODD_SHAPES), (4, ODD_SHAPES), (8, ODD_SHAPES)]
)
def test_sign_is_deepspeeds_compressed_allreduce(n, shapes):
    """Outputs and both residuals, DeepSpeed's buffers read back from the state; on
    ODD_SHAPES, DeepSpeed's padding counts in the scales and the residuals."""
    steps = 4
    grads = random_grads(steps, n, seed=1, shapes=shapes)
    outs, states = run(sign(), grads, n)
    for k in shapes:
        size = grads[k][0, 0].size
        padded = ds_padded_size(size, n)
        assert (padded == size) == (shapes is SHAPES)
        worker_errors = [np.zeros(padded) for _ in range(n)]
        server_errors = [np.zeros(padded // n) for _ in range(n)]
        for t in range(steps):
            expected = ds_compressed_allreduce(
                [grads[k][t, i].ravel().astype(np.float64) for i in range(n)],
                worker_errors,
                server_errors,
            )
            for i in range(n):
                np.testing.assert_allclose(outs[k][t, i].ravel(), expected, rtol=1e-5, atol=1e-6)
            ours, server = as_deepspeed_errors(
                states.residual[k][t],
                states.pad_residual[k][t],
                states.owner_residual[k][t],
                states.owner_pad_residual[k][t],
                n,
            )
            np.testing.assert_allclose(np.stack(ours), np.stack(worker_errors), atol=1e-5)
            np.testing.assert_allclose(server, np.concatenate(server_errors), atol=1e-5)


@pytest.mark.parametrize("n", [3, 8])
def test_sign_without_padding_leaves_it_out_of_scales_and_residuals(n):
    """``padding="none"``: the scales over the tensor's entries (the owners': theirs), no
    residual for the padding (its values stay 0)."""
    steps = 4
    grads = random_grads(steps, n, seed=1, shapes=ODD_SHAPES)
    outs, states = run(sign(padding="none"), grads, n)
    padded_outs, _ = run(sign(), grads, n)
    for k in ODD_SHAPES:
        worker_errors, server_errors = unpadded_errors(grads[k][0, 0].size, n)
        for t in range(steps):
            expected = unpadded_compressed_allreduce(
                [grads[k][t, i].ravel().astype(np.float64) for i in range(n)],
                worker_errors,
                server_errors,
            )
            for i in range(n):
                np.testing.assert_allclose(outs[k][t, i].ravel(), expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(
                states.residual[k][t].reshape(n, -1), np.stack(worker_errors), atol=1e-5
            )
            np.testing.assert_allclose(
                states.owner_residual[k][t].sum(0).ravel(),
                np.concatenate(server_errors),
                atol=1e-5,
            )
        np.testing.assert_array_equal(states.pad_residual[k], 0.0)
        np.testing.assert_array_equal(states.owner_pad_residual[k], 0.0)
        assert not np.allclose(outs[k], padded_outs[k], rtol=1e-3)  # DeepSpeed's differ


def test_sign_paddings_agree_where_deepspeed_pads_nothing():
    n = 4
    grads = random_grads(3, n, seed=1)
    outs, states = run(sign(), grads, n)
    unpadded_outs, unpadded_states = run(sign(padding="none"), grads, n)
    for k in SHAPES:
        np.testing.assert_allclose(outs[k], unpadded_outs[k], rtol=1e-6)
        for f in ("residual", "owner_residual"):
            np.testing.assert_allclose(
                getattr(states, f)[k], getattr(unpadded_states, f)[k], atol=1e-6
            )


def test_sign_rejects_an_unknown_padding():
    for padding in ("DeepSpeed", None, "zeros", 0):
        with pytest.raises(ValueError, match="sign: padding must be 'deepspeed' or 'none'"):
            sign(padding=padding)


def test_sign_l1_scale_is_the_mean_magnitude():
    grads = random_grads(1, 1, seed=2)
    outs, _ = run(sign(scale="l1"), grads, 1)
    x = grads["w"][0, 0]
    scale = np.abs(x).mean()  # one worker: C(C(x)) = C(x)
    np.testing.assert_allclose(outs["w"][0, 0], scale * np.where(x >= 0, 1, -1), rtol=1e-6)


def test_sign_rejects_an_unknown_scale():
    with pytest.raises(ValueError, match="scale"):
        sign(scale="l3")


# -- 1-bit Adam -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "shapes", "padding"),
    [
        (1, SHAPES, "deepspeed"),
        (4, SHAPES, "deepspeed"),
        (4, ODD_SHAPES, "deepspeed"),
        (8, ODD_SHAPES, "deepspeed"),
        (8, ODD_SHAPES, "none"),  # against the transcription with the padding left out
    ],
)
def test_onebit_adam_is_deepspeeds(n, shapes, padding):
    """DeepSpeed's OnebitAdam(freeze_step=F) on g_1..g_T, whose first step only allocates
    buffers, against onebit_adam(F - 1) on g_2..g_T: directions, moments and residuals."""
    steps, freeze = 8, 4
    betas, eps = (0.9, 0.999), 1e-8
    grads = random_grads(steps, n, seed=3, shapes=shapes)
    names = sorted(shapes)  # the reducer's leaves, in tree order
    ds = DSOnebitAdam(
        [np.zeros(shapes[k]) for k in names], n, 0.1, freeze, betas, eps, weight_decay=0.0,
        padded=padding == "deepspeed",
    )  # fmt: skip
    moments, errors = [], []
    for t in range(steps):
        ds.step([[grads[k][t, i].astype(np.float64) for k in names] for i in range(n)])
        moments.append([(s["exp_avg"][0].copy(), s["exp_avg_sq"][0].copy()) for s in ds.state])
        errors.append([[np.copy(e) for e in s.get("worker_error", [])] for s in ds.state])

    reducer = onebit_adam(freeze - 1, b1=betas[0], b2=betas[1], eps=eps, padding=padding)
    outs, states = run(reducer, jax.tree.map(lambda g: g[1:], grads), n)
    assert len(ds.updates) == steps - 1
    for t in range(steps - 1):
        for j, k in enumerate(names):
            for i in range(n):
                np.testing.assert_allclose(
                    outs[k][t, i], ds.updates[t][j], rtol=1e-4, atol=1e-5, err_msg=f"{k} {t}"
                )
                np.testing.assert_allclose(states.mu[k][t, i], moments[t + 1][j][0], atol=1e-6)
                np.testing.assert_allclose(states.nu[k][t, i], moments[t + 1][j][1], atol=1e-7)
            if n > 1 and t >= freeze - 1 and padding == "deepspeed":  # compressed
                ours, _ = as_deepspeed_errors(
                    states.residual[k][t], states.pad_residual[k][t],
                    states.owner_residual[k][t], states.owner_pad_residual[k][t], n,
                )  # fmt: skip
                np.testing.assert_allclose(np.stack(ours), errors[t + 1][j], atol=1e-5)
    # The variance is frozen after step freeze_step - 1 (DeepSpeed's step freeze_step) ...
    for k in names:
        if padding == "none":
            np.testing.assert_array_equal(states.pad_residual[k], 0.0)
        for t in range(freeze - 1, steps - 1):
            np.testing.assert_array_equal(states.nu[k][t], states.nu[k][freeze - 2])
        assert not np.allclose(states.nu[k][freeze - 2], states.nu[k][freeze - 3])
    # ... and from then on the momentum is compressed (with several workers).
    ratio = states.compression_ratio
    np.testing.assert_array_equal(ratio[: freeze - 1], 1.0)
    if n > 1:
        # the float32 ring's bytes over the signs of the padded tensors and the scales
        multiple = n * math.lcm(n, 8) if padding == "deepspeed" else 8 * n
        signs = sum(-(-math.prod(s) // multiple) * multiple / 8 for s in shapes.values())
        dense = 4 * sum(math.prod(s) for s in shapes.values())
        np.testing.assert_allclose(ratio[freeze - 1 :], dense / (signs + 4 * n * len(shapes)))
        assert shapes is not SHAPES or (ratio[freeze - 1 :] > 10).all()
        w = states.residual["w"]
        assert not np.allclose(w[freeze - 1], 0) and np.allclose(w[freeze - 2], 0)


def test_onebit_adam_trains_as_deepspeed_with_weight_decay():
    """data_parallel with onebit_adam and add_decayed_weights + sgd: DeepSpeed's params."""
    n, steps, freeze, lr, wd = 4, 7, 3, 0.05, 0.1
    rng = np.random.default_rng(4)
    params = {"w": rng.normal(size=(8, 16)).astype(np.float32)}
    batches = [{"x": rng.normal(size=(2 * n, 8, 16)).astype(np.float32)} for _ in range(steps)]

    def loss_fn(p, batch):  # linear: worker i's gradient is the mean of its rows
        return jnp.sum(p["w"] * batch["x"].mean(0))

    strategy = ddl.data_parallel(
        loss_fn,
        optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr)),
        ddl.make_mesh(data=n),
        reducer=onebit_adam(freeze - 1),
    )
    step = jax.jit(strategy.step, donate_argnums=0)
    state = strategy.init(params)
    for batch in batches[1:]:
        state, metrics = step(state, batch)
    assert float(metrics["compression_ratio"]) > 10

    ds = DSOnebitAdam([params["w"]], n, lr, freeze, (0.9, 0.999), 1e-8, wd)
    for batch in batches:
        ds.step([[x.mean(0).astype(np.float64)] for x in np.split(batch["x"], n)])
    np.testing.assert_allclose(strategy.params(state)["w"], ds.params[0], rtol=1e-4, atol=1e-5)


def test_onebit_adam_reports_compression_and_rejects_bad_arguments():
    params = {"w": jnp.zeros((3,))}
    assert reducer_metrics(onebit_adam(2).init(params)) == {"compression_ratio": 1.0}
    assert not checks_vma(onebit_adam(2))
    for kwargs, name in [
        ({"freeze_step": 2, "padding": "zero"}, "onebit_adam: padding must be 'deepspeed'"),
        ({"freeze_step": 2, "padding": None}, "padding"),
        ({"freeze_step": 0}, "freeze_step"),
        ({"freeze_step": 1.5}, "freeze_step"),
        ({"freeze_step": 2, "b1": 1.0}, "b1"),
        ({"freeze_step": 2, "b2": -0.1}, "b2"),
        ({"freeze_step": 2, "eps": 0.0}, "eps"),
    ]:
        with pytest.raises(ValueError, match=name):
            onebit_adam(**kwargs)
    with pytest.raises(TypeError, match="axis"):
        onebit_adam(2, axis=0)


def test_onebit_adam_sends_a_float32_ring_then_one_bit_per_entry():
    n, d = 4, 64 * 64

    def loss_fn(p, batch):
        return jnp.sum(p["w"] * batch["x"].mean(0))

    strategy = ddl.data_parallel(
        loss_fn, optax.sgd(0.1), ddl.make_mesh(data=n), reducer=onebit_adam(2)
    )
    params = {"w": np.ones((64, 64), np.float32)}
    batch = {"x": np.ones((2 * n, 64, 64), np.float32)}
    stats = ddl.comm_stats(jax.jit(strategy.step), strategy.init(params), batch)
    ring = 2 * (n - 1) / n
    # The phases are the branches of one cond: warm-up all-reduces, then signs and scales.
    assert sorted(stats.branches.values()) == [ring * (d / 8 + 4 * n), ring * 4 * d]


def test_the_momentum_mask_keeps_always_zero_entries_at_zero():
    """DeepSpeed: 1-bit compression cannot send an exact zero, so an entry whose gradient is
    always 0 needs ``exp_avg_mask``."""
    n, steps = 4, 6
    grads = random_grads(steps, n, seed=3)
    grads["w"][:, :, 0] = 0.0  # the first row never gets a gradient (an input never seen)
    outs, _ = run(onebit_adam(2), grads, n)
    dead = np.abs(outs["w"][-1][:, 0])
    assert dead.min() > 1e3  # +-scale / eps: what blows the parameters up
    mask = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    mask["w"][0] = 0.0
    masked_outs, masked_states = run(onebit_adam(2, exp_avg_mask=mask), grads, n)
    np.testing.assert_array_equal(masked_states.mu["w"][-1][:, 0], 0.0)
    np.testing.assert_array_equal(masked_outs["w"][-1][:, 0], 0.0)
    # the others move as Adam's steps do (the mask also changes the tensor's scale)
    assert np.abs(masked_outs["w"][-1]).max() < 1e3
    with pytest.raises(ValueError, match="exp_avg_mask must be None"):
        onebit_adam(2, exp_avg_mask="zeros")
    # a mask that would broadcast (a matrix's last axis: whole columns) or misses a key
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    row = {**mask, "w": np.ones(SHAPES["w"][-1:], np.float32)}
    for bad in (row, {"w": mask["w"]}):
        with pytest.raises(ValueError, match="onebit_adam: exp_avg_mask must be a pytree of 0/1"):
            onebit_adam(2, exp_avg_mask=bad).init(params)


def test_onebit_adam_where_it_cannot_run_says_why():
    """Several workers a device would each hold the frozen variance apart, and optax.chain
    hides the mark that lets the strategy skip shard_map's replication check: both are
    refused naming what to do; ddl.chain keeps the mark."""
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": np.ones((16, 4), np.float32)}
    params, mesh = {"w": jnp.full((16, 4), 0.1)}, ddl.make_mesh(data=4)
    with pytest.raises(ValueError, match="onebit_adam runs one worker a device.*drop workers="):
        per_axis = lambda a: ddl.compression.onebit_adam(2, axis=a)  # noqa: E731
        strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh, workers=8, reducer=per_axis)
        jax.jit(strategy.step)(strategy.init(params), batch)
    clip = optax.clip_by_global_norm(1.0)
    hidden = optax.chain(clip, ddl.compression.onebit_adam(2))
    strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh, reducer=hidden)
    with pytest.raises(TypeError, match="onebit_adam must run where .* ddl.chain"):
        jax.jit(strategy.step)(strategy.init(params), batch)
    kept = ddl.chain(clip, ddl.compression.onebit_adam(2))
    strategy = ddl.data_parallel(loss, optax.sgd(0.1), mesh, reducer=kept)
    jax.jit(strategy.step)(strategy.init(params), batch)
