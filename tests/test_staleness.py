"""scale_by_staleness, compute-time models and protocol values against their definitions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddl_jax._src.strategies.asynchronous.staleness import (
    SSP,
    Async,
    Downpour,
    SoftSync,
    as_protocol,
    compute_times,
    downpour,
    duration,
    scale_by_staleness,
    softsync,
    ssp,
)

UPDATES = {"w": jnp.array([1.0, -2.0, 4.0]), "b": jnp.array(3.0)}


@pytest.mark.parametrize(
    "rule, expected",
    [
        ("inverse", lambda tau: 1 / max(tau, 1)),
        ("exp", lambda tau: np.exp(-0.1 * tau)),
        (lambda tau: 1 / (1 + tau) ** 2, lambda tau: 1 / (1 + tau) ** 2),
    ],
)
@pytest.mark.parametrize("tau", [0.0, 1.0, 2.5, 7.0])
def test_sgd_after_scale_by_staleness_steps_by_lr_times_scale(rule, expected, tau):
    """In a chain, tau reaches the transform through optax extra args; sgd comes after."""
    chain = optax.chain(scale_by_staleness(rule), optax.sgd(0.5))
    state = chain.init(UPDATES)
    updates, _ = jax.jit(lambda u, s, t: chain.update(u, s, staleness=t))(UPDATES, state, tau)
    chex.assert_trees_all_close(
        updates, jax.tree.map(lambda u: -0.5 * expected(tau) * u, UPDATES), rtol=1e-6
    )


def test_after_adam_it_scales_the_step_and_before_adam_it_cancels():
    """Adam divides by the running gradient magnitude: a constant scale before it cancels."""

    def last_update(optimizer, **staleness):
        state = optimizer.init(UPDATES)
        for _ in range(3):
            updates, state = optimizer.update(UPDATES, state, UPDATES, **staleness)
        return updates

    adam = last_update(optax.adam(0.1))
    after = last_update(optax.chain(optax.adam(0.1), scale_by_staleness()), staleness=4.0)
    before = last_update(optax.chain(scale_by_staleness(), optax.adam(0.1)), staleness=4.0)
    chex.assert_trees_all_close(after, jax.tree.map(lambda u: u / 4, adam), rtol=1e-6)
    chex.assert_trees_all_close(before, adam, rtol=1e-5)


def test_exp_decay_is_lambda():
    updates, _ = scale_by_staleness("exp", decay=0.5).update(UPDATES, (), staleness=2.0)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda u: np.exp(-1.0) * u, UPDATES))


def test_missing_staleness_raises():
    with pytest.raises(TypeError, match="needs the staleness of the update"):
        scale_by_staleness().update(UPDATES, ())


@pytest.mark.parametrize(
    "rule, match",
    [
        (lambda tau: 1 / tau, "at tau=\\[0.\\]"),
        (lambda tau: jnp.log(tau - 1), "finite scalar scale >= 0"),
        (lambda tau: -tau, "finite scalar scale >= 0"),
        # Non-finite only at large tau: caught if within the range checked, which is named.
        (
            lambda tau: jnp.exp(tau / 40),
            "at tau=\\[4096.\\].*checked at tau in \\[0.0, 0.5, .*4096.0\\]",
        ),
        (lambda tau: jnp.ones(3) / (1 + tau), "finite scalar scale"),
        ("linear", "rule='linear' is not known"),
    ],
)
def test_bad_rules_raise_at_construction(rule, match):
    with pytest.raises(ValueError, match=match):
        scale_by_staleness(rule)


def test_bad_decay_raises():
    with pytest.raises(ValueError, match="decay must be a finite real number >= 0, got -1"):
        scale_by_staleness("exp", decay=-1.0)


KEY = jax.random.key_data(jax.random.key(4, impl="threefry2x32"))


def test_fixed_times_are_the_base_and_random_times_are_log_normal_around_it():
    fixed = compute_times([1.0, 4.0])
    assert [float(duration(fixed, 2, KEY, i, 9)) for i in (0, 1)] == [1.0, 4.0]
    noisy = compute_times([1.0, 4.0], spread=0.5, seed=4)
    draws = jax.vmap(lambda k: duration(noisy, 2, KEY, 1, k))(jnp.arange(4000))
    logs = np.log(np.asarray(draws) / 4.0)
    assert abs(logs.mean()) < 0.05 and abs(logs.std() - 0.5) < 0.05
    # A pure function of (seed, worker, task): no hidden state.
    assert float(duration(noisy, 2, KEY, 1, 17)) == float(draws[17])


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((-1.0,), {}, "finite and >= 0"),
        (([1.0, float("nan")],), {}, "finite and >= 0"),
        (([1.0, float("inf")],), {}, "finite and >= 0"),
        (([],), {}, "non-empty"),
        ((1.0,), {"spread": -0.1}, "spread must be a finite real number >= 0"),
        ((1.0,), {"spread": float("nan")}, "spread must be a finite real number >= 0"),
    ],
)
def test_bad_compute_times_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_times(*args, **kwargs)


def test_protocol_values():
    assert as_protocol("async", 8) == Async()
    assert softsync(8) == SoftSync(8) and ssp(0) == SSP(0) == SSP(0, "cached")
    assert ssp(2, reads="fresh") == SSP(2, "fresh")
    assert downpour(3, 2, local_lr=0.1) == Downpour(3, 2, 0.1) and downpour(1, 2) == Downpour(1, 2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: softsync(0), "softsync n must be an int >= 1, got 0"),
        (lambda: softsync(2.5), "softsync n must be an int >= 1, got 2.5"),
        (lambda: softsync(2, scale="linear"), "softsync scale rule='linear' is not known"),
        (lambda: softsync(2, scale=lambda tau: -tau), "softsync scale rule must map a staleness"),
        (lambda: ssp(-1), "ssp bound must be an int >= 0, got -1"),
        (lambda: ssp(1, reads="stale"), 'ssp reads must be "cached" or "fresh", got \'stale\''),
        (lambda: as_protocol(SSP(1, "newest"), 4), 'ssp reads must be "cached" or "fresh"'),
        (lambda: downpour(0, 1), "downpour n_fetch must be an int >= 1, got 0"),
        (lambda: downpour(1, -2), "downpour n_push must be an int >= 1, got -2"),
        (lambda: downpour(2, 1), "downpour: n_fetch=2 needs local_lr, the step a worker takes"),
        (lambda: downpour(2, 1, local_lr=-1), "downpour local_lr must be a finite real"),
        (lambda: as_protocol(softsync(5), 4), "softsync n=5 is outside \\[1, N\\] for N=4"),
    ],
)
def test_bad_protocols_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_scalars_are_arguments_like_python_numbers():
    assert compute_times(np.float32(2.0), spread=np.float32(0.5), seed=np.int64(3)) == (
        compute_times(2.0, spread=0.5, seed=3)
    )
    assert softsync(np.int64(2)) == SoftSync(2) and type(softsync(np.int64(2)).n) is int
    assert ssp(np.int32(0)) == SSP(0) and downpour(
        np.int64(3), np.int8(2), local_lr=np.float32(0.5)
    ) == (Downpour(3, 2, 0.5))
    assert as_protocol(SoftSync(np.int64(4)), 4) == SoftSync(4)
    updates, _ = scale_by_staleness("exp", decay=np.float32(0.5)).update(UPDATES, (), staleness=2.0)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda u: np.exp(-1.0) * u, UPDATES))
