"""An alpha-beta network model: what a step's communication would cost on other networks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ddl_jax._src.core.strategy import check_real
from ddl_jax._src.measure.comm import CommStats, split_islands


class Network(NamedTuple):
    """A network in the alpha-beta (Hockney) model: a message of b bytes takes
    ``latency + b / bandwidth`` seconds.

    Attributes:
      bandwidth: bytes per second each device can send (1 Gb/s Ethernet is ``1e9 / 8``).
      latency: seconds per message (per communication round).
    """

    bandwidth: float
    latency: float

    @classmethod
    def fit(
        cls,
        messages: Sequence[float],
        bytes_sent: Sequence[float],
        seconds: Sequence[float],
    ) -> Network:
        """The network that explains measured collectives: a least-squares fit, in relative
        error (each sample weighted by 1 / its seconds, so that small messages count as much
        as large ones), of ``seconds = messages * latency + bytes_sent / bandwidth + c``.

        Each sample is one measured program: the messages it sends in turn (``rounds``
        of ``ddl.comm_stats``: an all-reduce over N devices takes ``2 * (N - 1)``), the
        bytes its busiest device sends, and its seconds (a median of repeats). ``c`` is
        each program's fixed cost (launching it), fitted and left out of the model. The
        samples need two different message counts and two different sizes (e.g. an
        all-reduce sweep of 4 B to 16 MB, and 32 scalar all-reduces in one program).

        Raises:
          ValueError: the samples differ in length, hold a negative or non-finite
            value, or cannot separate latency from bandwidth; or the fitted bandwidth is
            not positive (time does not grow with the bytes).
        """
        columns = [np.asarray(x, np.float64) for x in (messages, bytes_sent, seconds)]
        if len({c.shape for c in columns}) != 1 or columns[0].ndim != 1:
            raise ValueError(
                "Network.fit: messages, bytes_sent and seconds must be 1-D sequences of one "
                f"length, got shapes {[c.shape for c in columns]}."
            )
        if not all(np.isfinite(c).all() and (c >= 0).all() for c in columns):
            raise ValueError("Network.fit: every sample must be finite and >= 0.")
        if not (columns[2] > 0).all():
            raise ValueError("Network.fit: every sample's seconds must be > 0.")
        a = np.stack([columns[0], columns[1], np.ones_like(columns[0])], axis=1)
        if np.linalg.matrix_rank(a) < 3:
            raise ValueError(
                "Network.fit: the samples need at least two message counts and two sizes "
                "to separate latency from bandwidth."
            )
        weight = 1.0 / columns[2]
        (latency, per_byte, _), *_ = np.linalg.lstsq(
            a * weight[:, None], columns[2] * weight, rcond=None
        )
        if per_byte <= 0:
            raise ValueError(
                "Network.fit: the seconds do not grow with the bytes sent (fitted "
                f"{per_byte:.3g} s per byte); measure larger messages."
            )
        return cls(bandwidth=float(1 / per_byte), latency=float(max(latency, 0.0)))


#: 1 Gb/s Ethernet, about 50 us per message through the kernel's TCP stack.
ETHERNET_1G = Network(bandwidth=1e9 / 8, latency=50e-6)
#: 100 Gb/s InfiniBand (EDR/HDR-100) with RDMA, about 2 us per message.
INFINIBAND_100G = Network(bandwidth=100e9 / 8, latency=2e-6)
#: A TPU v4 inter-chip link, about 45 GB/s one way and 1 us per hop (approximate).
TPU_V4_ICI = Network(bandwidth=45e9, latency=1e-6)


def estimate_step_time(
    stats: CommStats,
    network: Network,
    compute_s: float = 0.0,
    *,
    branch: str | None = None,
    inner_network: Network | None = None,
    island_devices: int | None = None,
) -> float:
    """Seconds per step: compute, then every collective in turn, without overlap.

    Each collective costs ``count * (rounds * latency + bytes / bandwidth)`` where
    ``bytes`` is what its busiest device sends. Collectives inside conditional branches
    count only for the ``branch`` named (only one branch runs; see ``stats.branches``).
    With islands (``local_sgd(inner=...)``), the collectives within an island travel on
    the island's fast ``inner_network`` and those across islands on ``network``.

    Args:
      stats: what ``ddl.comm_stats`` read from the compiled step.
      network: the network to price it on (with islands: the one between them).
      compute_s: seconds of computation per step.
      branch: a key of ``stats.branches``: price a step that takes this branch (a local
        SGD synchronisation, say); ``None`` prices a step that takes none.
      inner_network: the network inside an island; give it with ``island_devices``.
      island_devices: devices per island (``ddl.sim.split_islands``).

    Returns:
      The estimated step time in seconds.

    Example:
      >>> import ddl_jax as ddl
      >>> pairs = ((0, 2), (1, 3))  # an all-reduce of 8 bytes in each pair of 4 devices
      >>> op = ddl.sim.CollectiveOp("all-reduce", 8, 1, 2, (8.0,) * 4, 2, "", groups=pairs)
      >>> stats = ddl.sim.summarise((op,))
      >>> slow, fast = ddl.sim.Network(8.0, 1.0), ddl.sim.Network(8e3, 1e-3)
      >>> ddl.sim.estimate_step_time(stats, slow, inner_network=fast, island_devices=2)
      3.0
      >>> ddl.sim.estimate_step_time(stats, slow, inner_network=fast, island_devices=4)
      0.003
    """
    if branch is not None and branch not in stats.branches:
        raise ValueError(f"branch={branch!r} is not one of stats.branches: {list(stats.branches)}.")
    if (inner_network is None) != (island_devices is None):
        raise ValueError(
            "estimate_step_time: give inner_network and island_devices together (islands), "
            f"or neither; got inner_network={inner_network!r}, island_devices={island_devices!r}."
        )
    compute_s = check_real("compute_s", compute_s, minimum=0)
    if inner_network is not None:
        within, across = split_islands(stats, island_devices)
        return compute_s + _comm_s(within, inner_network, branch) + _comm_s(across, network, branch)
    return compute_s + _comm_s(stats, network, branch)


def _comm_s(stats: CommStats, network: Network, branch: str | None) -> float:
    bandwidth = check_real("network.bandwidth", network.bandwidth, minimum=0, exclusive=True)
    latency = check_real("network.latency", network.latency, minimum=0)
    return sum(
        op.count * (op.rounds * latency + max(op.sent) / bandwidth)
        for op in stats.ops
        if op.branch in ("", branch)
    )
