"""``ddl.compression.top_k`` against a NumPy transcription of the DGC authors' code.

The reference is synxlin/deep-gradient-compression: ``dgc/compression.py``
(``DGCCompressor``: ``ceil(numel * compress_ratio)`` entries per tensor, values and indices
all-gathered, the others all-reduced), ``dgc/memory.py`` (``DGCSGDMemory``: momentum
correction, Nesterov, momentum factor masking; a tensor that is not compressed takes its
momentum after the average), ``dgc/optim/sgd.py`` (``DGCSGD``: weight decay with its own
momentum, outside the compressed one) and ``train.py`` (only tensors with ``dim() > 1`` are
compressed). Selection is the authors' sampled threshold (``DGCCompressor.initialize``'s
strides and sample sizes, ``_sparsify``'s strided or uniform sample, its adaptation loop and
``indices[:num_selects]``), transcribed below as :func:`dgc_initialize` and
:func:`dgc_sparsify`, with the sample drawn from the key ``top_k`` documents; with
``sample_ratio=1``, ``top_k``'s exact top-k.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reducers import run_steps

import ddl_jax as ddl
from ddl_jax._src.reduce import sparse
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


# -- DGCCompressor's sampled threshold, transcribed ---------------------------------------------


def dgc_initialize(numel: int, compress_ratio: float, sample_ratio: float):
    """``DGCCompressor.initialize``'s attributes of one tensor, as the authors compute them
    (``int(math.ceil(...))`` there): ``(num_selects, num_samples, top_k_samples,
    sample_stride)``."""
    sample_ratio = min(max(sample_ratio, 0.01), 1.0)  # DGCCompressor.__init__
    if sample_ratio < 1.0:
        pct_numel = math.ceil(numel * sample_ratio)
        cpr_numel = math.ceil(2 / compress_ratio)
        if numel <= cpr_numel:
            sample_stride = 1
            num_samples = numel
        else:
            sample_stride = math.ceil(numel / max(pct_numel, cpr_numel) / 32) * 32 + 1
            num_samples = numel // sample_stride
            while num_samples < max(pct_numel, cpr_numel):
                sample_stride = sample_stride - 8
                num_samples = numel // sample_stride
    else:
        sample_stride = 1
        num_samples = numel
    top_k_samples = math.ceil(num_samples * compress_ratio)
    num_selects = math.ceil(numel * compress_ratio)
    return num_selects, num_samples, top_k_samples, sample_stride


def dgc_sparsify(
    tensor,
    compress_ratio,
    sample_ratio,
    key,
    *,
    strided_sample=True,
    compress_upper_bound=1.3,
    compress_lower_bound=0.8,
    max_adaptation_iters=10,
    resample=True,
):
    """``DGCCompressor._sparsify`` in float32 NumPy: returns the indices it sends (up to
    num_selects) and what its adaptation loop did (``"lower"``, ``"raise"``, ``"resample"``).

    The authors draw the sample with ``random.randint(0, sample_stride - 1)`` (strided) or
    ``torch.randint(0, numel, (num_samples,))`` (uniform), from generators seeded alike on
    every worker; here the same numbers come from ``key`` as ``top_k`` documents. torch's
    ``topk(sorted=False)`` leaves ties unordered; here the lower index wins.
    """
    tensor = np.asarray(tensor, np.float32).reshape(-1)
    numel = tensor.size
    num_selects, num_samples, top_k_samples, sample_stride = dgc_initialize(
        numel, compress_ratio, sample_ratio
    )
    importance = np.abs(tensor)
    if numel == num_samples:
        samples = importance
    elif strided_sample:
        sample_start = int(jax.random.randint(key, (), 0, sample_stride))
        samples = importance[sample_start::sample_stride]
    else:
        samples = importance[np.asarray(jax.random.randint(key, (num_samples,), 0, numel))]

    threshold = np.sort(samples)[-top_k_samples]  # min of the top_k_samples largest
    mask = importance >= threshold
    indices = np.flatnonzero(mask)
    num_indices = indices.size
    trace = []
    if numel > num_samples:
        for _ in range(max_adaptation_iters):
            if num_indices > num_selects:
                if num_indices > num_selects * compress_upper_bound:
                    if resample:
                        top = np.argsort(-importance[indices], kind="stable")[:num_selects]
                        indices = indices[top]
                        trace.append("resample")
                        break
                    else:
                        threshold = threshold * np.float32(compress_upper_bound)
                        trace.append("raise")
                else:
                    break
            elif num_indices < compress_lower_bound * num_selects:
                threshold = threshold * np.float32(compress_lower_bound)
                trace.append("lower")
            else:
                break
            mask = importance >= threshold
            indices = np.flatnonzero(mask)
            num_indices = indices.size
    return indices[:num_selects], trace


def sample_key(seed: int, step: int, selection: int):
    """The key of the sample ``top_k`` draws for its ``selection``-th selection at ``step``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), selection)


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
    sample_ratio=0.01,
    strided_sample=True,
    seed=0,
    traces=None,
):
    """DGCCompressor + DGCSGDMemory + DGCSGD (synxlin/deep-gradient-compression), in float64
    (the selection in float32, :func:`dgc_sparsify`; ``sample_ratio=1``: exact top-k).

    Returns the parameters after each step.
    """
    p = {k: v.astype(np.float64) for k, v in params.items()}
    # train.py: param.dim() > 1; DGCCompressor.compress: only if compress_ratio < 1.0.
    compressed = {k for k, s in SHAPES.items() if len(s) > 1 and ratio < 1.0}
    selection = {k: j for j, k in enumerate(sorted(compressed))}  # jax.tree.leaves order
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
                    # compression._sparsify, then the all-gather and index_put_
                    if sample_ratio < 1:
                        key = sample_key(seed, t, selection[k])
                        indices, trace = dgc_sparsify(
                            v_i, ratio, sample_ratio, key, strided_sample=strided_sample
                        )
                        if traces is not None:
                            traces.append(tuple(trace))
                    else:
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


# The authors' default (a strided sample of 1%), their uniform sample, and exact top-k.
SELECTIONS = {
    "strided": dict(),
    "uniform": dict(strided_sample=False),
    "exact": dict(sample_ratio=1.0),
}


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_top_k_matches_the_authors_code(case, n, selection):
    ratio, lr, steps = 0.05, 0.1, 4
    grads, params = make_data(steps, n, seed=n)
    options = dict(CASES[case], **SELECTIONS[selection])
    # DGCSGD's weight decay is the optimizer's, with the optimizer's momentum and nesterov.
    decay = options.pop("weight_decay", 0.0)
    optimizer = optax.sgd(lr)
    if decay:
        m, nesterov = options.get("momentum", 0.0), options.get("nesterov", False)
        optimizer = optax.chain(dgc_weight_decay(decay, momentum=m, nesterov=nesterov), optimizer)
    ours, _ = run_ours(ddl.compression.top_k(ratio, **options), grads, params, n, lr, optimizer)
    options["weight_decay"] = decay
    assert_close(ours, reference(grads, params, n, ratio, lr, **options))


def test_the_sampled_reference_runs_the_adaptation_loop():
    """The data above exercise _sparsify's branches: the threshold from the sample kept as
    it is, lowered, and a resample to the exact top-k (with the seeds of the test above)."""
    traces = []
    for n in (4, 8):
        grads, params = make_data(4, n, seed=n)
        reference(grads, params, n, 0.05, 0.1, momentum=0.9, traces=traces)
    assert () in traces
    assert ("resample",) in traces
    assert any(t and t[0] == "lower" for t in traces)


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
    reducer = ddl.compression.top_k(ratio, scope="model", compress_1d=True, sample_ratio=1.0)
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
        (dict(sample_ratio=0.0), "top_k: sample_ratio must be a finite real number >= 0.01"),
        (dict(sample_ratio=0.001), "top_k: sample_ratio must be a finite real number >= 0.01"),
        (dict(sample_ratio=1.5), "top_k: sample_ratio must be .* <= 1, got 1.5"),
        (dict(sample_ratio=True), "top_k: sample_ratio must be a finite real number"),
        (dict(sample_ratio=float("nan")), "top_k: sample_ratio must be a finite real number"),
        (dict(strided_sample=1), "top_k: strided_sample must be a bool, got 1"),
        (dict(seed=1.5), "top_k: seed must be an int, got 1.5"),
        (dict(seed="0"), "top_k: seed must be an int, got '0'"),
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


@pytest.mark.parametrize("sample_ratio", [1.0, 0.01])
def test_scope_model_without_vectors_selects_over_the_matrices_together(sample_ratio):
    """scope="model", compress_1d=False: one selection over the matrices (in leaf order),
    exact top-k or the authors' sampled threshold over them as one tensor; the vector and
    the scalar dense."""
    n, ratio, lr, steps = 4, 0.05, 1.0, 3
    grads, params = make_data(steps, n, seed=7)
    reducer = ddl.compression.top_k(ratio, scope="model", sample_ratio=sample_ratio)
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
            if sample_ratio < 1:
                top, _ = dgc_sparsify(residual[i], ratio, sample_ratio, sample_key(0, t, 0))
            else:
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


# -- the sampled threshold, one tensor at a time ----------------------------------------------


def test_sample_plan_is_the_authors_initialize():
    for numel, ratio, sample_ratio in itertools.product(
        [1, 5, 12, 199, 200, 201, 512, 4096, 20_000, 100_000, 123_457, 2**20],
        [0.5, 0.05, 0.01, 0.001, 0.25**4],
        [0.01, 0.05, 0.3, 0.999, 1.0],
    ):
        case = (numel, ratio, sample_ratio)
        plan = sparse.sample_plan(numel, ratio, sample_ratio)
        assert plan.numel == numel, case
        expected = dgc_initialize(numel, ratio, sample_ratio)
        got = (plan.num_selects, plan.num_samples, plan.top_k_samples, plan.sample_stride)
        assert got == expected, case
        assert plan.num_selects == sparse.entries_kept(ratio, numel), case  # the static payload


def _sample_start(numel, ratio, key):
    stride = dgc_initialize(numel, ratio, 0.01)[3]
    return int(jax.random.randint(key, (), 0, stride)), stride


def _gaussian(rng, numel, ratio, key):
    return rng.normal(size=numel)


def _lowered(rng, numel, ratio, key):
    """Three large samples: the threshold is lowered until enough entries pass it."""
    x = rng.normal(size=numel)
    start, stride = _sample_start(numel, ratio, key)
    x[start + stride * np.arange(3)] = 10.0
    return x


def _exhausted(rng, numel, ratio, key):
    """Three huge samples: ten lowerings leave 3 entries (fewer than num_selects)."""
    x = rng.normal(size=numel)
    start, stride = _sample_start(numel, ratio, key)
    x[start + stride * np.arange(3)] = 1e6
    return x


def _zero_samples(rng, numel, ratio, key):
    """A zero threshold: every entry passes, more than 1.3 num_selects: resample."""
    x = rng.normal(size=numel)
    start, stride = _sample_start(numel, ratio, key)
    x[start::stride] = 0.0
    return x


def _truncated(rng, numel, ratio, key):
    """num_selects < passing entries <= 1.3 num_selects: the first num_selects in index
    order are sent, not the largest."""
    x = rng.uniform(0, 0.5, size=numel)
    start, stride = _sample_start(numel, ratio, key)
    sampled = np.zeros(numel, bool)
    sampled[start::stride] = True
    k = math.ceil(ratio * numel)
    big = rng.choice(np.flatnonzero(~sampled), size=int(1.2 * k), replace=False)
    x[big] = 2.0 + rng.uniform(size=big.size)
    x[start + stride * np.arange(3)] = 1.0
    return x


def _ties(rng, numel, ratio, key):
    """A tensor the authors do not sample (numel <= 2 / ratio): the threshold is the k-th
    largest |x|, and of the entries at or above it the first k in index order are sent."""
    x = np.zeros(numel)
    x[:3] = [1.0, -1.0, 2.0]
    return x


TENSORS = {
    "gaussian": (_gaussian, 20_000, 0.01, {}),
    "gaussian_large": (_gaussian, 100_000, 0.001, {}),
    "gaussian_uniform": (_gaussian, 20_000, 0.01, dict(strided_sample=False)),
    "lowered": (_lowered, 20_000, 0.01, {}),
    "exhausted": (_exhausted, 20_000, 0.01, {}),
    "resample": (_zero_samples, 20_000, 0.01, {}),
    "truncated": (_truncated, 20_000, 0.01, {}),
    "raised": (_gaussian, 20_000, 0.01, dict(resample=False)),
    "raised_from_zero": (_zero_samples, 20_000, 0.01, dict(resample=False)),
    "stride_1": (_gaussian, 201, 0.01, {}),
    "ties": (_ties, 150, 0.01, {}),
}


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("name", sorted(TENSORS))
def test_sparsify_is_the_authors_sparsify(name, step):
    make, numel, ratio, options = TENSORS[name]
    key = sample_key(0, step, 0)
    x = make(np.random.default_rng(step), numel, ratio, key).astype(np.float32)
    expected, trace = dgc_sparsify(x, ratio, 0.01, key, **options)

    plan = sparse.sample_plan(numel, ratio, 0.01)
    strided = options.get("strided_sample", True)
    resample = options.get("resample", True)
    select = jax.jit(lambda x, key: sparse.sparsify(x, key, plan, strided, resample=resample))
    index = np.asarray(select(jnp.asarray(x), key))
    assert index.shape == (plan.num_selects,) and index.dtype == np.int32
    sent = index[index < numel]
    assert np.all(index[sent.size :] == numel)  # the unused slots, at the end
    np.testing.assert_array_equal(np.sort(sent), np.sort(expected))

    exact = np.sort(np.argsort(-np.abs(x), kind="stable")[: plan.num_selects])
    if name == "lowered":
        assert trace[0] == "lower" and "resample" not in trace
    if name == "exhausted":
        assert trace == ["lower"] * 10 and sent.size == 3
    if name == "resample":
        assert trace == ["resample"]
        np.testing.assert_array_equal(np.sort(sent), exact)
    if name == "truncated":
        assert trace == [] and sent.size == plan.num_selects
        assert not np.array_equal(np.sort(sent), exact)
    if name.startswith("raised"):
        assert trace[0] == "raise"
    if name == "ties":
        np.testing.assert_array_equal(sent, [0, 1])  # not 2, the largest


def test_the_sample_is_keyed_by_the_seed_and_the_step():
    """The same seed repeats a run exactly; another draws other samples (the reference's
    with that seed). Every worker draws the same sample, as the authors' ranks do (each
    seeds Python's ``random`` and torch with ``configs.seed``)."""
    n, ratio, lr = 4, 0.05, 0.1
    grads, params = make_data(3, n, seed=11)
    first, _ = run_ours(ddl.compression.top_k(ratio, momentum=0.9), grads, params, n, lr)
    again, _ = run_ours(ddl.compression.top_k(ratio, momentum=0.9), grads, params, n, lr)
    other, _ = run_ours(ddl.compression.top_k(ratio, momentum=0.9, seed=1), grads, params, n, lr)
    for a, b in zip(first, again, strict=True):
        for k in SHAPES:
            np.testing.assert_array_equal(a[k], b[k])
    assert any(
        not np.array_equal(a["small"], c["small"]) for a, c in zip(first, other, strict=True)
    )
    assert_close(other, reference(grads, params, n, ratio, lr, momentum=0.9, seed=1))


def test_unused_slots_are_neither_sent_nor_masked():
    """Three huge samples: after ten lowerings only they pass, so each worker sends 3 of its
    200 slots; the rest of v stays in the residual, u is masked only where sent, and the
    filler slots reach no one."""
    n, ratio, numel = 4, 0.01, 20_000
    plan = sparse.sample_plan(numel, ratio, 0.01)
    start = int(jax.random.randint(sample_key(0, 0, 0), (), 0, plan.sample_stride))
    picked = start + plan.sample_stride * np.arange(3)
    flat = np.random.default_rng(0).normal(size=(1, n, numel)).astype(np.float32)
    flat[0][:, picked] = 1e6 * np.arange(1, n + 1, dtype=np.float32)[:, None]
    grads = {"w": flat.reshape(1, n, 100, 200)}  # a matrix: compressed
    outs, state = run_steps(ddl.compression.top_k(ratio, momentum=0.9), grads)
    out = outs["w"][0, 0].ravel()
    np.testing.assert_array_equal(np.flatnonzero(out), picked)
    np.testing.assert_allclose(out[picked], flat[0][:, picked].mean(0), rtol=1e-6)
    # Step 0: u = g and v = u; zeroed where sent only.
    kept = flat[0].copy()
    kept[:, picked] = 0.0
    np.testing.assert_array_equal(state.residual, kept)
    np.testing.assert_array_equal(state.momentum, kept)
