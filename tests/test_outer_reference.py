"""SparseLoCo and DeMo against plain NumPy transcriptions of their authors' code.

SparseLoCo: github.com/tplr-ai/templar, ``src/tplr/compress.py`` (``ChunkingTransformer``,
``TopKCompressor``: ``_clamp_topk``, ``_quantize_values``, ``decompress``'s
``scatter_reduce(mean, include_self=False)``) and ``src/tplr/neurons.py`` (the accumulator
``e = decay e + lr g``, error feedback, ``outer_step``'s median norm clipping).
DeMo: github.com/bloc97/DeMo, ``demo.py`` (``DeMo.step``, ``TransformDCT``, ``CompressDCT``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reducers import run_steps

import ddl_jax as ddl
from ddl_jax._src.reduce.outer import demo, sparse_loco

# A matrix cut into 64 x 48 tiles, a vector and a matrix smaller than a tile, a 3-D tensor
# (read as 2 x 12), a scalar (one entry: SparseLoCo's quantiser sees one value, std 0/0).
SHAPES = {"a": (128, 96), "b": (10,), "c": (3, 5), "d": (2, 3, 4), "e": ()}


def random_grads(steps: int, n: int, seed: int, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(steps, n, *s)).astype(np.float32) for k, s in shapes.items()}


# -- the authors' tiling (ChunkingTransformer / TransformDCT), as loops -------------------------


def smaller_split(n: int, close_to: int) -> int:
    """``_get_smaller_split``: the largest divisor of n that is <= close_to."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= close_to)


def tile_sides(shape, chunk):
    """``(rows, cols, h, w)``: a vector is one row of runs; more than 2-D, ``[d0, rest]``."""
    if len(shape) >= 2:
        rows, cols = shape[0], int(np.prod(shape[1:]))
        return rows, cols, smaller_split(rows, chunk), smaller_split(cols, chunk)
    cols = int(np.prod(shape))
    return 1, cols, 1, smaller_split(cols, chunk)


def to_tiles(x, chunk):
    rows, cols, h, w = tile_sides(x.shape, chunk)
    x = x.reshape(rows, cols)
    return np.stack(
        [
            x[y * h : (y + 1) * h, c * w : (c + 1) * w].reshape(-1)
            for y in range(rows // h)
            for c in range(cols // w)
        ]
    )


def from_tiles(tiles, shape, chunk):
    rows, cols, h, w = tile_sides(shape, chunk)
    x = np.zeros((rows, cols), tiles.dtype)
    i = 0
    for y in range(rows // h):
        for c in range(cols // w):
            x[y * h : (y + 1) * h, c * w : (c + 1) * w] = tiles[i].reshape(h, w)
            i += 1
    return x.reshape(shape)


def scatter_mean(tiles_shape, sent, aggregate="senders"):
    """``scatter_reduce(reduce="mean", include_self=False)`` of every worker's ``(idx, val)``."""
    sums = np.zeros(tiles_shape, np.float64)
    counts = np.zeros(tiles_shape)
    for idx, val in sent:
        for t in range(idx.shape[0]):
            for j, v in zip(idx[t], val[t], strict=True):
                sums[t, j] += v
                counts[t, j] += 1
    if aggregate == "workers":
        return sums / len(sent)
    return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)


def topk(x, k):
    """Indices of the k largest |x| of each row."""
    return np.argsort(-np.abs(x), axis=1, kind="stable")[:, :k]


# -- SparseLoCo ---------------------------------------------------------------------------


def clamp_topk(k, width):
    """``TopKCompressor._clamp_topk`` (a tile of one entry: that entry)."""
    k = max(min(k, width), 2)
    return min(k - k % 2, width)


def quantize(val, n_bins, range_in_sigmas):
    """``TopKCompressor._quantize_values`` then ``_dequantize_values``, in float32."""
    offset = n_bins // 2
    shift = val.mean(dtype=np.float32)
    centered = (val - shift).astype(np.float32)
    with np.errstate(invalid="ignore"):  # one value: 0 / 0, then scale 1 as below
        std = np.linalg.norm(centered) / np.sqrt(np.float32(centered.size - 1))
    scale = np.float32(range_in_sigmas * std / n_bins)
    if scale == 0 or not np.isfinite(scale):
        scale = np.float32(1.0)
    qval = np.clip(np.round(centered / scale + offset), 0, n_bins - 1).astype(int)
    lookup = np.zeros(n_bins, np.float32)
    for b in range(n_bins):
        if (qval == b).any():
            lookup[b] = centered[qval == b].mean()
    return lookup[qval] + shift


class SparseLoCoReference:
    """One tensor group on N workers: ``prepare_gradient_dict`` (the accumulator, top-k,
    quantisation, error feedback), then ``outer_step``'s aggregation, in float32."""

    def __init__(
        self,
        shapes,
        n,
        ratio,
        *,
        chunk=64,
        bits=2,
        sigmas=6,
        decay=0.95,
        lr=1.0,
        clip=True,
        agg="senders",
    ):
        self.shapes, self.n, self.chunk, self.bits, self.sigmas = shapes, n, chunk, bits, sigmas
        self.decay, self.lr, self.clip, self.agg = decay, lr, clip, agg
        self.topk_compression = int(np.ceil(ratio * chunk * chunk))
        self.error = {k: np.zeros((n, *s), np.float32) for k, s in shapes.items()}

    def aggregate(self, grads, arrived=None):
        """``grads {name: [N, *shape]}`` (pseudo-gradients) to the outer step's gradient,
        gathered from the workers that ``arrived`` (all by default), as the authors'
        ``outer_step`` gathers from the peers that sent; the others keep their accumulator."""
        out = {}
        for name, shape in self.shapes.items():
            e, sent = self.error[name], []
            for i in range(self.n):
                if arrived is not None and not arrived[i]:
                    continue
                e[i] = self.decay * e[i] + np.float32(self.lr) * grads[name][i]  # step 3
                tiles = to_tiles(e[i], self.chunk)
                k = clamp_topk(self.topk_compression, tiles.shape[1])
                idx = topk(tiles, k)
                val = np.take_along_axis(tiles, idx, axis=1)
                if self.bits is not None:
                    val = quantize(val, 2**self.bits, self.sigmas)
                transmit = np.zeros_like(tiles)
                np.put_along_axis(transmit, idx, val, axis=1)
                e[i] -= from_tiles(transmit, shape, self.chunk)  # error feedback, step 6
                sent.append((idx, val))
            if self.clip:  # outer_step: batch_decompress(clip_norm=True)
                norms = np.array([np.linalg.norm(v) for _, v in sent])
                median = np.sort(norms)[(len(sent) - 1) // 2]  # torch.median: the lower one
                sent = [
                    (i, v * min(median / (nm + 1e-8), 1))
                    for (i, v), nm in zip(sent, norms, strict=True)
                ]
            total = scatter_mean(tiles.shape, sent, self.agg)
            out[name] = from_tiles(total, shape, self.chunk)
        return out


def sparse_loco_reference(grads, ratio, arrived=None, **kwargs):
    """``({name: outputs [T, *shape]}, {name: final accumulators [N, *shape]})``; with
    ``arrived [T, N]``, step t gathers from the workers of ``arrived[t]``."""
    steps, n = next(iter(grads.values())).shape[:2]
    reference = SparseLoCoReference({k: g.shape[2:] for k, g in grads.items()}, n, ratio, **kwargs)
    outs = [
        reference.aggregate(
            {k: g[t] for k, g in grads.items()}, None if arrived is None else arrived[t]
        )
        for t in range(steps)
    ]
    return {k: np.stack([o[k] for o in outs]) for k in grads}, reference.error


def flat(tree: dict) -> np.ndarray:
    """Per worker, the leaves in the flat order (sorted names): ``[N, D]``."""
    return np.concatenate([tree[k].reshape(tree[k].shape[0], -1) for k in sorted(tree)], axis=1)


def check_outputs(outs, expected, atol):
    for name, out in outs.items():
        for i in range(out.shape[1]):  # every worker gets the same update
            np.testing.assert_allclose(out[:, i], expected[name], atol=atol, err_msg=name)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # the authors' defaults: 2-bit, clipped, averaged over senders
        {"bits": None, "clip": False, "decay": 0.9, "lr": 0.5},
        {"bits": 3, "sigmas": 4, "agg": "workers"},
    ],
)
def test_sparse_loco_matches_the_authors_code(kwargs):
    n, steps, ratio = 4, 3, 1 / 64
    grads = random_grads(steps, n, seed=1)
    ours = {k.replace("clip", "clip_norm").replace("lr", "alpha"): v for k, v in kwargs.items()}
    ours = {("aggregate" if k == "agg" else k): v for k, v in ours.items()}
    outs, state = run_steps(sparse_loco(ratio, **ours), grads)
    expected, errors = sparse_loco_reference(grads, ratio, **kwargs)
    check_outputs(outs, expected, atol=1e-5)
    np.testing.assert_allclose(state.error, flat(errors), atol=1e-5)
    # 64 of each 64 x 48 tile; each small tensor is one tile, k its size rounded down to
    # even: 10 of 10, 14 of 15, 24 of the 2 x 12 tile, and the scalar's one entry.
    assert np.count_nonzero(outs["a"][0, 0]) <= n * 4 * 64
    assert np.count_nonzero(outs["c"][0, 0]) >= 14


def told_who_arrived(reducer, arrived):
    """``reducer`` whose t-th update is told ``arrived[t]`` (``bool [T, N]``)."""

    def init(params):
        return reducer.init(params), jnp.zeros((), jnp.int32)

    def update(updates, state, params=None):
        inner, t = state
        out, inner = reducer.update(updates, inner, params, arrived=jnp.asarray(arrived)[t])
        return out, (inner, t + 1)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("kwargs", [{}, {"bits": None, "agg": "workers"}])
def test_sparse_loco_told_who_arrived_gathers_from_them_as_the_authors_code(kwargs):
    """Only the workers that arrived are combined (senders, the median clip), as the
    authors' ``outer_step`` gathers from the peers that sent; the others keep their
    accumulator, sending it all at a later step."""
    n, steps, ratio = 4, 3, 1 / 64
    grads = random_grads(steps, n, seed=2)
    arrived = np.array([[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 1]], bool)
    ours = {("aggregate" if k == "agg" else k): v for k, v in kwargs.items()}
    outs, (state, _) = run_steps(told_who_arrived(sparse_loco(ratio, **ours), arrived), grads)
    expected, errors = sparse_loco_reference(grads, ratio, arrived, **kwargs)
    check_outputs(outs, expected, atol=1e-5)
    np.testing.assert_allclose(state.error, flat(errors), atol=1e-5)
    untold, _ = run_steps(sparse_loco(ratio, **ours), grads)
    assert not np.allclose(untold["a"][0], outs["a"][0], atol=1e-3)  # the masks mattered


def test_sparse_loco_a_coordinate_with_one_sender_moves_by_its_value():
    """Worker 0 alone sends entry (0, 0) of the big tile: the update there is its value."""
    n = 8
    grads = {"a": np.zeros((1, n, 64, 64), np.float32)}
    rng = np.random.default_rng(0)
    grads["a"][0, :, 1:, :] = rng.normal(size=(n, 63, 64)) * 0.01
    grads["a"][0, 0, 0, 0] = 5.0
    for aggregate, expected in (("senders", 5.0), ("workers", 5.0 / n)):
        reducer = sparse_loco(1 / 64, bits=None, clip_norm=False, aggregate=aggregate)
        outs, _ = run_steps(reducer, grads)
        assert outs["a"][0, 0, 0, 0] == pytest.approx(expected)
        reference, _ = sparse_loco_reference(grads, 1 / 64, bits=None, clip=False, agg=aggregate)
        check_outputs(outs, reference, atol=1e-6)


# -- DeMo ----------------------------------------------------------------------------------


def dct_matrix(w: int) -> np.ndarray:
    """The orthonormal DCT-II (``_dct(I, norm="ortho")``, transposed): ``X = M @ x``."""
    j, f = np.arange(w), np.arange(w)[:, None]
    m = np.sqrt(2 / w) * np.cos(np.pi * (2 * j + 1) * f / (2 * w))
    m[0] /= np.sqrt(2)
    return m


class DemoReference:
    """``DeMo.step`` for one group of tensors on N workers, in float64."""

    def __init__(self, shapes, n, *, topk, chunk=64, decay=0.999, weight_decay=0.0):
        self.shapes, self.n, self.topk, self.chunk = shapes, n, topk, chunk
        self.decay, self.weight_decay = decay, weight_decay
        self.delta = {k: np.zeros((n, *s)) for k, s in shapes.items()}

    def encode(self, x):
        """``TransformDCT.encode``: the 2-D DCT of each h x w tile (1-D for a vector)."""
        _, _, h, w = tile_sides(x.shape, self.chunk)
        tiles = to_tiles(x, self.chunk).reshape(-1, h, w)
        return np.stack([dct_matrix(h) @ t @ dct_matrix(w).T for t in tiles]).reshape(
            len(tiles), -1
        )

    def decode(self, coeffs, shape):
        _, _, h, w = tile_sides(shape, self.chunk)
        blocks = coeffs.reshape(-1, h, w)
        tiles = np.stack([dct_matrix(h).T @ c @ dct_matrix(w) for c in blocks])
        return from_tiles(tiles.reshape(len(blocks), -1), shape, self.chunk)

    def grads_to_directions(self, grads, lr, agg="senders"):
        """``grads {name: [N, *shape]}`` to the aggregated direction ``new_grad`` (pre-sign)."""
        out = {}
        for name, shape in self.shapes.items():
            sent = []
            for i in range(self.n):
                self.delta[name][i] = self.decay * self.delta[name][i] + lr * grads[name][i]
                coeffs = self.encode(self.delta[name][i])
                k = min(max(self.topk, 1), coeffs.shape[1])  # CompressDCT._clamp_topk
                idx = topk(coeffs, k)
                val = np.take_along_axis(coeffs, idx, axis=1)
                kept = np.zeros_like(coeffs)
                np.put_along_axis(kept, idx, val, axis=1)
                self.delta[name][i] -= self.decode(kept, shape)
                sent.append((idx, val))
            out[name] = self.decode(scatter_mean(coeffs.shape, sent, agg), shape)
        return out

    def step(self, params, grads, lr):
        """The whole optimizer step: weight decay, then sign-SGD on the directions."""
        directions = self.grads_to_directions(grads, lr)
        return {
            k: p * (1 - lr * self.weight_decay) - lr * np.sign(directions[k])
            for k, p in params.items()
        }


@pytest.mark.parametrize(("agg", "lr"), [("senders", 0.1), ("workers", 1.0)])
def test_demo_matches_the_authors_code(agg, lr):
    n, steps = 4, 3
    grads = random_grads(steps, n, seed=2)
    outs, state = run_steps(demo(32 / 4096, beta=0.9, lr=lr, aggregate=agg), grads)
    reference = DemoReference(SHAPES, n, topk=32, decay=0.9)
    for t in range(steps):
        expected = reference.grads_to_directions({k: g[t] for k, g in grads.items()}, lr, agg)
        check_outputs(
            {k: o[t : t + 1] for k, o in outs.items()},
            {k: e[None] for k, e in expected.items()},
            atol=1e-5,
        )
    np.testing.assert_allclose(state.momentum, flat(reference.delta), atol=1e-5)
    assert np.count_nonzero(outs["b"][0, 0]) == 10  # a 10-vector: one run, 10 of 32 kept


def test_demo_with_a_schedule_scales_each_gradient_by_its_rate():
    n, steps = 2, 3
    grads = random_grads(steps, n, seed=3, shapes={"b": (10,)})
    schedule = optax.linear_schedule(1.0, 0.25, steps)
    outs, _ = run_steps(demo(1.0, beta=0.5, lr=schedule), grads)
    reference = DemoReference({"b": (10,)}, n, topk=4096, decay=0.5)
    for t in range(steps):
        expected = reference.grads_to_directions({"b": grads["b"][t]}, float(schedule(t)))
        check_outputs({"b": outs["b"][t : t + 1]}, {"b": expected["b"][None]}, atol=1e-5)


def test_demo_sign_descent_with_weight_decay_matches_the_authors_optimizer():
    """``data_parallel`` with DeMo against ``DeMo.step``: decay outside the sign."""
    n, lr, wd, steps = 4, 0.05, 0.1, 3
    params, batches, loss_fn, worker_grads = linear_problem(n, steps, seed=4)
    optimizer = optax.chain(optax.scale_by_sign(), optax.add_decayed_weights(wd), optax.scale(-lr))
    reducer = demo(0.25, chunk=4, beta=0.9, lr=lr)
    strategy = ddl.data_parallel(loss_fn, optimizer, ddl.make_mesh(data=n), reducer=reducer)
    state = strategy.init(params)
    step = jax.jit(strategy.step)
    for batch in batches:
        state, _ = step(state, batch)

    shapes = {k: v.shape for k, v in params.items()}
    reference = DemoReference(shapes, n, topk=4, chunk=4, decay=0.9, weight_decay=wd)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for batch in batches:
        p = reference.step(p, worker_grads(p, batch), lr)
    got = strategy.params(state)
    for k in p:
        np.testing.assert_allclose(np.asarray(got[k]), p[k], atol=1e-5, err_msg=k)


# -- in the strategies, against the authors' optimizer steps ----------------------------------


def linear_problem(n, steps, seed):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    batches = [
        {
            "x": rng.normal(size=(4 * n, 16)).astype(np.float32),
            "y": rng.normal(size=(4 * n, 8)).astype(np.float32),
        }
        for _ in range(steps)
    ]

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    def worker_grads(p, batch):
        """Each worker's gradient on its 4 rows of the batch, by hand: ``{name: [N, ...]}``."""
        grads = {"w": [], "b": []}
        for i in range(n):
            x, y = batch["x"][i * 4 : (i + 1) * 4], batch["y"][i * 4 : (i + 1) * 4]
            r = x @ p["w"] + p["b"] - y
            grads["w"].append(2 * x.T @ r / r.size)
            grads["b"].append(2 * r.sum(0) / r.size)
        return {k: np.stack(v) for k, v in grads.items()}

    return params, batches, loss_fn, worker_grads


def test_sparse_loco_in_local_sgd_matches_the_authors_outer_step():
    """``local_sgd`` (H = 1) with outer rate alpha: ``e = beta e + alpha Delta`` and
    ``theta -= alpha * aggregate``, as templar's miner and ``outer_step`` with SGD(alpha)."""
    n, lr, alpha, steps = 4, 0.1, 0.7, 3
    params, batches, loss_fn, worker_grads = linear_problem(n, steps, seed=5)
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(lr),
        ddl.make_mesh(data=n),
        period=1,
        outer_optimizer=optax.sgd(alpha),
        reducer=sparse_loco(0.25, chunk=4, alpha=alpha),
    )
    state = strategy.init(params)
    step = jax.jit(strategy.step)
    for batch in batches:
        state, _ = step(state, batch)

    shapes = {k: v.shape for k, v in params.items()}
    reference = SparseLoCoReference(shapes, n, 0.25, chunk=4, lr=alpha)
    p = dict(params)
    for batch in batches:
        pseudo = {k: lr * g for k, g in worker_grads(p, batch).items()}  # theta - theta_i
        aggregate = reference.aggregate(pseudo)
        p = {k: (p[k] - alpha * aggregate[k]).astype(np.float32) for k in p}
    got = strategy.params(state)
    for k in p:
        np.testing.assert_allclose(np.asarray(got[k]), p[k], atol=1e-5, err_msg=k)
