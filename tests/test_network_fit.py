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


def _with_permutes(latency, bandwidth, overhead, launch):
    """The sweep of ``worker.sweep`` between 2 devices: all-reduces (2 messages each) and
    permutes (1 each) of several sizes, and 32 scalar ones of each in turn."""
    sizes = [4.0, 2.0**16, 2.0**20, 2.0**24]
    rows = [(2.0, 1.0, b) for b in sizes] + [(64.0, 32.0, 128.0)]  # all-reduces
    rows += [(1.0, 1.0, b) for b in sizes] + [(32.0, 32.0, 128.0)]  # permutes
    messages, collectives, sent = (list(c) for c in zip(*rows, strict=True))
    seconds = [m * latency + c * overhead + b / bandwidth + launch for m, c, b in rows]
    return messages, sent, seconds, collectives


def test_fit_tells_the_overhead_of_a_collective_from_the_latency_of_its_messages():
    net = ddl.sim.Network.fit(*_with_permutes(40e-6, 120e6, overhead=25e-6, launch=30e-6))
    assert net.latency == pytest.approx(40e-6, rel=1e-6)
    assert net.overhead == pytest.approx(25e-6, rel=1e-6)
    assert net.bandwidth == pytest.approx(120e6, rel=1e-6)
    # without the collectives the overhead is folded into the latency (2 messages an op)
    folded = ddl.sim.Network.fit(*_with_permutes(40e-6, 120e6, 25e-6, 30e-6)[:3])
    assert folded.overhead == 0.0 and folded.latency > 45e-6


def test_an_overhead_fitted_below_zero_is_zero_and_the_rest_refitted():
    messages, sent, seconds, collectives = _with_permutes(40e-6, 120e6, 0.0, 30e-6)
    # permutes made 5 us faster each than the all-reduces' terms say: a negative overhead
    seconds = [
        t - (5e-6 * c if m == c else 0)
        for t, m, c in zip(seconds, messages, collectives, strict=True)
    ]
    net = ddl.sim.Network.fit(messages, sent, seconds, collectives)
    assert net.overhead == 0.0
    assert net.latency > 0 and net.bandwidth == pytest.approx(120e6, rel=0.05)


def test_the_overhead_is_priced_once_per_collective_whatever_its_rounds():
    pairs = ((0, 1), (1, 0))
    permute = ddl.sim.CollectiveOp("collective-permute", 8, 3, 2, (8.0, 8.0), 1, "", groups=pairs)
    stats = ddl.sim.summarise((permute,))
    net = ddl.sim.Network(bandwidth=8.0, latency=1.0, overhead=10.0)
    assert ddl.sim.estimate_step_time(stats, net) == pytest.approx(3 * (10.0 + 1.0 + 1.0))
    with pytest.raises(ValueError, match="network.overhead"):
        ddl.sim.estimate_step_time(stats, net._replace(overhead=-1.0))


def test_fit_refuses_samples_that_cannot_separate_latency_from_bandwidth():
    with pytest.raises(ValueError, match="two message counts and two sizes"):
        ddl.sim.Network.fit([2, 2, 2], [1e6, 2e6, 4e6], [0.1, 0.2, 0.4])
    with pytest.raises(ValueError, match="one length"):
        ddl.sim.Network.fit([2, 2], [1e6], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite and >= 0"):
        ddl.sim.Network.fit([2, 64, 2], [1e6, 4, 2e6], [0.1, float("nan"), 0.2])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        ddl.sim.Network.fit([2, 64, 2], [1e6, 4, 2e6], [0.2, 0.3, 0.1])
    # all-reduces alone: each collective's rounds are 2, overhead and latency inseparable
    with pytest.raises(ValueError, match="collectives of two different rounds"):
        ddl.sim.Network.fit([2, 64, 2], [1e6, 4, 2e6], [0.1, 0.05, 0.2], [1, 32, 1])


def test_fit_refuses_a_bandwidth_the_samples_do_not_determine():
    """Messages so small that bytes take 1e-6 of the time: the fitted bandwidth would be
    noise (1e16 B/s, say); the fit says to measure larger ones."""
    messages, sent, seconds = _samples(latency=60e-6, bandwidth=1e15, launch=30e-6)
    with pytest.raises(
        ValueError, match="the bandwidth is not determined .fitted .*measure larger"
    ):
        ddl.sim.Network.fit(messages, sent, seconds)
