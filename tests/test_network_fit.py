"""``ddl.sim.Network.fit``: latency and bandwidth recovered from measured collectives."""

import numpy as np
import pytest

import ddl_jax as ddl


def _samples(latency, bandwidth, launch, noise=0.0, seed=0):
    """An all-reduce sweep between 2 devices (2 messages each) and 1 and 32 scalar
    all-reduces in one program, timed on a network of the given terms."""
    sizes = [2.0**k for k in range(18, 25)]
    messages = [2.0] * len(sizes) + [2.0, 64.0]
    sent = [*sizes, 4.0, 4.0 * 32]
    seconds = np.array(
        [m * latency + b / bandwidth + launch for m, b in zip(messages, sent, strict=True)]
    )
    rng = np.random.default_rng(seed)
    return messages, sent, seconds * (1 + noise * rng.standard_normal(seconds.shape))


def test_fit_recovers_the_terms_of_the_network_that_made_the_samples():
    net = ddl.sim.Network.fit(*_samples(latency=60e-6, bandwidth=11.6e6, launch=30e-6))
    assert net.latency == pytest.approx(60e-6, rel=1e-6)
    assert net.bandwidth == pytest.approx(11.6e6, rel=1e-6)


def test_fit_on_noisy_samples_stays_close():
    net = ddl.sim.Network.fit(*_samples(45e-6, 118e6, 40e-6, noise=0.03))
    assert net.bandwidth == pytest.approx(118e6, rel=0.1)
    assert net.latency == pytest.approx(45e-6, rel=0.3)


def test_fit_refuses_samples_that_cannot_separate_latency_from_bandwidth():
    with pytest.raises(ValueError, match="two message counts and two sizes"):
        ddl.sim.Network.fit([2, 2, 2], [1e6, 2e6, 4e6], [0.1, 0.2, 0.4])
    with pytest.raises(ValueError, match="one length"):
        ddl.sim.Network.fit([2, 2], [1e6], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite and >= 0"):
        ddl.sim.Network.fit([2, 64, 2], [1e6, 4, 2e6], [0.1, float("nan"), 0.2])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        ddl.sim.Network.fit([2, 64, 2], [1e6, 4, 2e6], [0.2, 0.3, 0.1])
