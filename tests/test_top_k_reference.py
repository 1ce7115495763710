"""``ddl.compression.top_k`` against a NumPy transcription of the DGC authors' code.

The reference is synxlin/deep-gradient-compression: ``dgc/compression.py``
(``DGCCompressor``: ``ceil(numel * compress_ratio)`` entries per tensor, values and indices
all-gathered, the others all-reduced), ``dgc/memory.py`` (``DGCSGDMemory``: momentum
correction, Nesterov, momentum factor masking; a tensor that is not compressed takes its
momentum after the average), ``dgc/optim/sgd.py`` (``DGCSGD``: weight decay with its own
momentum, outside the compressed one) and ``train.py`` (only tensors with ``dim() > 1`` are
compressed). Selection is exact top-k: the authors' sampled threshold with
``sample_ratio=1`` (no sampling), which is what a static payload of k entries computes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ddl_jax as ddl
from ddl_jax._src.reduce.sparse import dgc_weight_decay

# "small" has gradients 1000x smaller than "big"'s; "tiny" has fewer than 1/ratio entries;
# "bias" is 1-D (dense in the reference); "scale" is 0-D (dense too).
SHAPES = {"big": (16, 32), "small": (64, 64), "tiny": (3, 4), "bias": (32,), "scale": ()}
SCALES = {"big": 1.0, "small": 1e-3, "tiny": 1.0, "bias": 1.0, "scale": 1.0}


def make_data(steps: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    grads = {
        k: (SCALES[k] * rng.normal(size=(steps, n, *s))).astype(np.float32)
        for k, s in SHAPES.items()
    }
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return grads, params


def loss_fn(params, batch):
    # Linear in the parameters: worker i's gradient for leaf k is the mean of its rows of
    # batch[k], one row per worker here, so the reference knows every g_{i,t} exactly.
    return sum(
        jnp.mean(jnp.sum(batch[k] * params[k], axis=tuple(range(1, batch[k].ndim)))) for k in params
    )


def reference(
    grads,
    params,
    n,
    ratio,
    lr,
    *,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    momentum_masking=True,
):
    """DGCCompressor + DGCSGDMemory + DGCSGD (synxlin/deep-gradient-compression), in float64.

    Returns the parameters after each step.
    """
    p = {k: v.astype(np.float64) for k, v in params.items()}
    # train.py: param.dim() > 1; DGCCompressor.compress: only if compress_ratio < 1.0.
    compressed = {k for k, s in SHAPES.items() if len(s) > 1 and ratio < 1.0}
    mmt = {k: np.zeros((n, *s)) for k, s in SHAPES.items()}  # memory.momentums, per worker
    vec = {k: np.zeros((n, *s)) for k, s in SHAPES.items()}  # memory.velocities
    buf = {k: np.zeros(s) for k, s in SHAPES.items()}  # DGCSGD's weight-decay momentum buffer
    steps = next(iter(grads.values())).shape[0]
    history = []
    for t in range(steps):
        out = {}
        for k, shape in SHAPES.items():
            g = grads[k][t].astype(np.float64).reshape(n, -1)
            if k in compressed:
                numel = g.shape[1]
                num_selects = math.ceil(numel * ratio)
                total = np.zeros(numel)
                for i in range(n):
                    m_i, v_i = mmt[k].reshape(n, -1)[i], vec[k].reshape(n, -1)[i]
                    # memory.compensate(accumulate=True)
                    if nesterov:
                        m_i[:] = (m_i + g[i]) * momentum
                        v_i += m_i + g[i]
                    else:
                        m_i[:] = momentum * m_i + g[i]
                        v_i += m_i
                    # compression._sparsify (exact), then the all-gather and index_put_
                    indices = np.argsort(-np.abs(v_i), kind="stable")[:num_selects]
                    np.add.at(total, indices, v_i[indices])
                    # memory.update
                    if momentum_masking:
                        m_i[indices] = 0.0
                    v_i[indices] = 0.0
                out[k] = (total / n).reshape(shape)
            else:
                # allreduce (Average), then memory.compensate(accumulate=False); the momentum
                # is the same on every worker: keep worker 0's.
                avg = g.mean(0)
                m0 = mmt[k].reshape(n, -1)[0]  # a view, 0-D tensors too
                if nesterov:
                    m0[:] = (m0 + avg) * momentum
                    out[k] = (m0 + avg).reshape(shape)
                else:
                    m0[:] = momentum * m0 + avg
                    out[k] = m0.copy().reshape(shape)
        for k in SHAPES:  # DGCSGD.step
            if weight_decay != 0:
                d_p = weight_decay * p[k]
                if momentum != 0:
                    buf[k] = momentum * buf[k] + d_p  # the first step's buf = d_p alike
                    d_p = d_p + momentum * buf[k] if nesterov else buf[k]
                d_p = d_p + out[k]
            else:
                d_p = out[k]
            p[k] = p[k] - lr * d_p
        history.append({k: v.copy() for k, v in p.items()})
    return history


def run_ours(reducer, grads, params, n, lr, optimizer=None):
    mesh = ddl.make_mesh(data=n)
    optimizer = optax.sgd(lr) if optimizer is None else optimizer
    strategy = ddl.data_parallel(loss_fn, optimizer, mesh, reducer=reducer)
    state = strategy.init(jax.tree.map(jnp.asarray, params))
    step = jax.jit(strategy.step)
    steps = next(iter(grads.values())).shape[0]
    history, metrics = [], []
    for t in range(steps):
        state, m = step(state, {k: g[t] for k, g in grads.items()})
        history.append(jax.tree.map(np.asarray, strategy.params(state)))
        metrics.append(m)
    return history, metrics


def assert_close(ours, ref):
    for t, (a, b) in enumerate(zip(ours, ref, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(
                a[k], b[k], rtol=1e-5, atol=1e-6 * SCALES[k], err_msg=f"step {t}, {k}"
            )


CASES = {
    "plain": dict(),
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "no_masking": dict(momentum=0.9, momentum_masking=False),
    "weight_decay": dict(momentum=0.9, weight_decay=1e-2),
    "nesterov_weight_decay": dict(momentum=0.5, nesterov=True, weight_decay=1e-1),
    "weight_decay_no_momentum": dict(weight_decay=1e-1),
}


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_top_k_matches_the_authors_code(case, n):
    ratio, lr, steps = 0.05, 0.1, 4
    grads, params = make_data(steps, n, seed=n)
    options = dict(CASES[case])
    # DGCSGD's weight decay is the optimizer's, with the optimizer's momentum and nesterov.
    decay = options.pop("weight_decay", 0.0)
    optimizer = optax.sgd(lr)
    if decay:
        m, nesterov = options.get("momentum", 0.0), options.get("nesterov", False)
        optimizer = optax.chain(dgc_weight_decay(decay, momentum=m, nesterov=nesterov), optimizer)
    ours, _ = run_ours(ddl.compression.top_k(ratio, **options), grads, params, n, lr, optimizer)
    options["weight_decay"] = decay
    assert_close(ours, reference(grads, params, n, ratio, lr, **options))


def test_a_layer_with_tiny_gradients_still_gets_its_entries():
    """The starved layer: 1000x smaller gradients still move ceil(ratio * numel) entries."""
    n, ratio, lr = 8, 0.05, 1.0
    grads, params = make_data(1, n, seed=3)
    ours, _ = run_ours(ddl.compression.top_k(ratio), grads, params, n, lr)
    changed = int(np.sum(ours[0]["small"] != params["small"]))
    # Each worker sends its own ceil(0.05 * 4096) = 205 entries of the layer.
    assert changed >= math.ceil(ratio * 64 * 64) == 205
    assert_close(ours, reference(grads, params, n, ratio, lr))
    # A tensor with fewer than 1/ratio entries sends one entry per worker.
    moved = np.sum(ours[0]["tiny"] != params["tiny"])
    assert 1 <= moved <= n
    # 1-D and 0-D tensors travel dense: the exact mean.
    for k in ("bias", "scale"):
        np.testing.assert_allclose(
            ours[0][k], params[k] - lr * grads[k][0].mean(0), rtol=1e-6, atol=1e-6
        )


def test_scope_model_is_one_selection_over_the_flattened_model():
    """The old behaviour, by name: one top-k over every entry, 1-D tensors included."""
    n, ratio, lr = 8, 0.05, 1.0
    grads, params = make_data(1, n, seed=3)
    reducer = ddl.compression.top_k(ratio, scope="model", compress_1d=True)
    ours, _ = run_ours(reducer, grads, params, n, lr)
    assert np.sum(ours[0]["small"] != params["small"]) == 0  # starved: the whole-model selection
    assert np.sum(ours[0]["bias"] != params["bias"]) < SHAPES["bias"][0]


def test_compression_ratio_counts_the_gather_and_the_dense_all_reduce():
    n, ratio = 8, 0.05
    grads, params = make_data(1, n)
    _, metrics = run_ours(ddl.compression.top_k(ratio), grads, params, n, 0.1)
    sizes = {k: math.prod(s) for k, s in SHAPES.items()}
    k_sent = sum(math.ceil(ratio * sizes[k]) for k in ("big", "small", "tiny"))
    dense = sizes["bias"] + sizes["scale"]
    wire_bytes = (n - 1) * 8 * k_sent + 2 * (n - 1) / n * 4 * dense
    expected = 2 * (n - 1) / n * 4 * sum(sizes.values()) / wire_bytes
    np.testing.assert_allclose(metrics[0]["compression_ratio"], expected, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scope="layer"), "top_k: scope must be 'tensor' or 'model', got 'layer'"),
        (dict(compress_1d=1), "top_k: compress_1d must be a bool, got 1"),
        (dict(nesterov="yes"), "top_k: nesterov must be a bool, got 'yes'"),
        (dict(nesterov=True), "top_k: nesterov needs momentum > 0"),
        (dict(momentum_masking=None), "top_k: momentum_masking must be a bool, got None"),
    ],
)
def test_bad_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ddl.compression.top_k(0.1, **kwargs)


def test_weight_decay_checks_its_arguments():
    with pytest.raises(ValueError, match="dgc_weight_decay: weight_decay must be a finite real"):
        dgc_weight_decay(-1.0)
    with pytest.raises(ValueError, match="dgc_weight_decay: nesterov needs momentum > 0"):
        dgc_weight_decay(1e-4, nesterov=True)
    transform = dgc_weight_decay(1e-4, momentum=0.9)
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="dgc_weight_decay: weight_decay needs the parameters"):
        transform.update(params, transform.init(params))


@pytest.mark.parametrize("nesterov", [False, True])
def test_ratio_one_compresses_nothing_and_keeps_the_momentum(nesterov):
    """The reference compresses only below ratio 1: at 1 every tensor is all-reduced and
    takes its momentum after the average (masking would otherwise erase the momentum)."""
    n, lr, steps = 4, 0.1, 3
    grads, params = make_data(steps, n, seed=5)
    reducer = ddl.compression.top_k(1.0, momentum=0.9, nesterov=nesterov)
    ours, metrics = run_ours(reducer, grads, params, n, lr)
    assert_close(ours, reference(grads, params, n, 1.0, lr, momentum=0.9, nesterov=nesterov))
    assert float(metrics[-1]["compression_ratio"]) == 1.0


def test_scope_model_without_vectors_selects_over_the_matrices_together():
    """scope="model", compress_1d=False: one top-k over the matrices (in leaf order), the
    vector and the scalar dense."""
    n, ratio, lr, steps = 4, 0.05, 1.0, 3
    grads, params = make_data(steps, n, seed=7)
    reducer = ddl.compression.top_k(ratio, scope="model")
    ours, _ = run_ours(reducer, grads, params, n, lr)
    matrices = sorted(k for k, s in SHAPES.items() if len(s) > 1)  # jax.tree.leaves order
    sizes = [math.prod(SHAPES[k]) for k in matrices]
    k_sent = math.ceil(ratio * sum(sizes))
    residual = np.zeros((n, sum(sizes)))
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for t in range(steps):
        flat = np.concatenate([grads[k][t].reshape(n, -1) for k in matrices], axis=1)
        residual += flat
        total = np.zeros(sum(sizes))
        for i in range(n):
            top = np.argsort(-np.abs(residual[i]), kind="stable")[:k_sent]
            total[top] += residual[i, top] / n
            residual[i, top] = 0.0
        for k, piece in zip(matrices, np.split(total, np.cumsum(sizes)[:-1]), strict=True):
            p[k] = p[k] - lr * piece.reshape(SHAPES[k])
        for k in SHAPES:
            if k not in matrices:
                p[k] = p[k] - lr * grads[k][t].mean(0)
        for k in SHAPES:
            np.testing.assert_allclose(
                ours[t][k], p[k], rtol=1e-5, atol=1e-6 * SCALES[k], err_msg=f"step {t}, {k}"
            )
