"""``ddl.adasum`` against a NumPy transcription of Horovod's code.

The reference is horovod/horovod: ``horovod/common/ops/adasum/adasum.h``
(``FusedPairwiseReduceWithComm``: per tensor, dot and squared norms in float64, and a
coefficient of 1 for a vector whose squared norm is under ``sqrt(DBL_MIN)``) and
``horovod/torch/optimizer.py`` (``_DistributedAdasumOptimizer``: every worker steps its own
optimizer from the shared parameters, the deltas ``p_i - start`` are combined by Adasum,
and ``start += delta``). The pairs are those of the vector-halving / distance-doubling
levels, partner ``rank ^ level``: (0, 1), (2, 3), ... then the pairs' results.
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl

SHAPES = {"w": (6, 5), "b": (5,)}
SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # adasum.h: static double sqrt_double_min


def horovod_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum.h, FusedPairwiseReduceWithComm then ScaledAdd, for one tensor."""
    dot, anormsq, bnormsq = float(a @ b), float(a @ a), float(b @ b)
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= SQRT_DBL_MIN else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= SQRT_DBL_MIN else 1.0
    return acoeff * a + bcoeff * b


def horovod_adasum(rows: list[np.ndarray]) -> np.ndarray:
    """The levels: at level 1, 2, 4, ... rank r combines with rank r ^ level."""
    rows = [np.asarray(r, np.float64).reshape(-1) for r in rows]
    while len(rows) > 1:
        rows = [horovod_pair(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    return rows[0]


def loss_fn(params, batch):
    # Worker i's gradient for leaf k is params[k] - batch[k][i] (one row per worker).
    return sum(
        0.5 * jnp.mean(jnp.sum((params[k] - batch[k]) ** 2, axis=tuple(range(1, batch[k].ndim))))
        for k in params
    )


def horovod_delta_optimizer(params, batches, n, lr, momentum):
    """DistributedOptimizer(torch.optim.SGD(lr, momentum), op=Adasum), in float64."""
    start = {k: v.astype(np.float64) for k, v in params.items()}
    buf = {k: np.zeros((n, *s)) for k, s in SHAPES.items()}  # each worker's own state
    history = []
    for batch in batches:
        for k in SHAPES:
            deltas = []
            for i in range(n):
                g = start[k] - batch[k][i]
                buf[k][i] = momentum * buf[k][i] + g  # torch SGD, dampening 0
                p_i = start[k] - lr * buf[k][i]
                deltas.append(p_i - start[k])
            start[k] = start[k] + horovod_adasum(deltas).reshape(SHAPES[k])
        history.append({k: v.copy() for k, v in start.items()})
    return history


@pytest.mark.parametrize("n", [2, 4, 8])
def test_local_sgd_period_one_is_horovods_delta_form(n):
    lr, momentum, steps = 0.1, 0.9, 4
    rng = np.random.default_rng(n)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    batches = [
        {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]
    # optax.sgd's trace is torch's momentum buffer: b <- m b + g, p <- p - lr b.
    strategy = ddl.local_sgd(
        loss_fn,
        optax.sgd(lr, momentum=momentum),
        ddl.make_mesh(data=n),
        period=1,
        reducer=ddl.adasum(),
    )
    state = strategy.init(jax.tree.map(jnp.asarray, params))
    step = jax.jit(strategy.step)
    expected = horovod_delta_optimizer(params, batches, n, lr, momentum)
    for t, batch in enumerate(batches):
        state, _ = step(state, batch)
        got = strategy.params(state)
        for k in SHAPES:
            np.testing.assert_allclose(
                got[k], expected[t][k], rtol=1e-5, atol=1e-6, err_msg=f"step {t}, {k}"
            )
    # The gradient form (data_parallel) with the same momentum is a different method.
    dp = ddl.data_parallel(
        loss_fn, optax.sgd(lr, momentum=momentum), ddl.make_mesh(data=n), reducer=ddl.adasum()
    )
    dp_state = dp.init(jax.tree.map(jnp.asarray, params))
    for batch in batches:
        dp_state, _ = jax.jit(dp.step)(dp_state, batch)
    assert not np.allclose(dp.params(dp_state)["w"], expected[-1]["w"], atol=1e-4)


def combine_on_mesh(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    mesh = ddl.make_mesh(data=n)
    reducer = ddl.adasum()

    def worker(g):
        out, _ = reducer.update(g[0], reducer.init(g[0]))
        return out

    run = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P()))
    return np.asarray(run(jax.device_put(rows, NamedSharding(mesh, P("data")))))


@pytest.mark.parametrize("n", [2, 4])
def test_a_zero_vector_keeps_coefficient_one(n):
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(n, 8)).astype(np.float32)
    rows[0] = 0.0
    got = combine_on_mesh(rows)
    np.testing.assert_allclose(got, horovod_adasum(list(rows)), rtol=1e-5, atol=1e-7)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("norm_sq", [1e-10, 4e-8])
def test_a_small_vector_combines_by_the_rule_as_in_horovod(norm_sq):
    """Horovod's near-zero threshold is sqrt(DBL_MIN) ~ 1.5e-154: a vector of squared norm
    1e-10 still gets its coefficient 1 - a.b / (2 |a|^2), as any other."""
    a = np.zeros(4, np.float32)
    a[0] = np.sqrt(norm_sq)
    b = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
    got = combine_on_mesh(np.stack([a, b]))
    expected = horovod_pair(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        got[0], 0.5, atol=1e-3
    )  # a, scaled by 1 - 1/(2|a|), cancels half of b's
