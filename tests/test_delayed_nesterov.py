"""delayed_nesterov against its definition, Nesterov SGD, and one Nesterov step per cycle."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddl_jax._src.strategies.asynchronous.delayed_nesterov import delayed_nesterov


def arrivals(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": rng.normal(size=(3, 2)).astype(np.float32),
            "b": rng.normal(size=2).astype(np.float32),
        }
        for _ in range(count)
    ]


def run(opt, params, grads):
    update = jax.jit(opt.update)
    state, out = opt.init(params), []
    for g in grads:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        out.append(params)
    return out


def definition(lr, beta, n, c, params, grads):
    """Algorithm 1 of Liu et al., one arrival at a time in NumPy (float64)."""
    theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    delta = {k: np.zeros_like(v) for k, v in theta.items()}
    out = []
    for t, g in enumerate(grads, start=1):
        for k in theta:
            delta[k] = delta[k] + g[k]
            if t % n == 0:
                m[k] = beta * m[k] + delta[k] / n
                theta[k] = theta[k] - lr * ((1 - c * (n - 1)) * beta * m[k] + g[k] / n)
                delta[k] = np.zeros_like(delta[k])
            else:
                theta[k] = theta[k] - lr * (c * beta * m[k] + g[k] / n)
        out.append(dict(theta))
    return out


PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}


@pytest.mark.parametrize("n, c", [(1, 0.0), (3, 0.0), (3, 0.2), (4, 0.25), (2, 0.5)])
def test_equals_its_definition(n, c):
    grads = arrivals(11)
    got = run(delayed_nesterov(0.3, 0.9, n, activation=c), PARAMS, grads)
    want = definition(0.3, 0.9, n, c, PARAMS, grads)
    for g, w in zip(got, want, strict=True):
        chex.assert_trees_all_close(g, w, atol=1e-5, rtol=1e-5)


def test_delay_one_is_nesterov_sgd():
    grads = arrivals(9, seed=1)
    got = run(delayed_nesterov(0.1, 0.8, 1), PARAMS, grads)
    want = run(optax.sgd(0.1, momentum=0.8, nesterov=True), PARAMS, grads)
    chex.assert_trees_all_close(got, want, atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("n", [2, 4])
def test_each_cycle_is_one_nesterov_step_on_the_mean(n):
    """c = 0: after every N arrivals the parameters are Nesterov SGD's on the N-means."""
    grads = arrivals(12, seed=2)
    got = run(delayed_nesterov(0.2, 0.9, n), PARAMS, grads)[n - 1 :: n]
    means = [jax.tree.map(lambda *g: sum(g) / n, *grads[i : i + n]) for i in range(0, 12, n)]
    want = run(optax.sgd(0.2, momentum=0.9, nesterov=True), PARAMS, means)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_between_momentum_updates_c_zero_takes_plain_sgd_steps():
    n, grads = 3, arrivals(6, seed=3)
    opt = delayed_nesterov(0.5, 0.9, n)
    state = opt.init(PARAMS)
    for t, g in enumerate(grads, start=1):
        u, state = opt.update(g, state)
        if t % n:
            chex.assert_trees_all_close(u, jax.tree.map(lambda x: -0.5 * x / n, g), atol=1e-7)
    assert int(state.count) == 6
    chex.assert_trees_all_equal(state.buffer, jax.tree.map(jnp.zeros_like, PARAMS))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learning_rate": 0.0}, "delayed_nesterov learning_rate must be"),
        ({"momentum": 1.0}, "delayed_nesterov momentum must be in \\[0, 1\\)"),
        ({"momentum": -0.1}, "delayed_nesterov momentum must be"),
        ({"delay": 0}, "delayed_nesterov delay must be an int >= 1, got 0"),
        ({"delay": 2.0}, "delayed_nesterov delay must be an int"),
        ({"delay": 4, "activation": 0.3}, "delayed_nesterov activation must be"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"learning_rate": 0.1} | kwargs
    with pytest.raises(ValueError, match=match):
        delayed_nesterov(**args)
