"""An alpha-beta network model: what a step's communication would cost on other networks."""

from __future__ import annotations

from typing import NamedTuple

from ddl_jax._src.core.strategy import check_real
from ddl_jax._src.measure.comm import CommStats


class Network(NamedTuple):
    """A network in the alpha-beta (Hockney) model: a message of b bytes takes
    ``latency + b / bandwidth`` seconds.

    Attributes:
      bandwidth: bytes per second each device can send (1 Gb/s Ethernet is ``1e9 / 8``).
      latency: seconds per message (per communication round).
    """

    bandwidth: float
    latency: float


#: 1 Gb/s Ethernet, about 50 us per message through the kernel's TCP stack.
ETHERNET_1G = Network(bandwidth=1e9 / 8, latency=50e-6)
#: 100 Gb/s InfiniBand (EDR/HDR-100) with RDMA, about 2 us per message.
INFINIBAND_100G = Network(bandwidth=100e9 / 8, latency=2e-6)
#: A TPU v4 inter-chip link, about 45 GB/s one way and 1 us per hop (approximate).
TPU_V4_ICI = Network(bandwidth=45e9, latency=1e-6)


def estimate_step_time(
    stats: CommStats, network: Network, compute_s: float = 0.0, *, branch: str | None = None
) -> float:
    """Seconds per step: compute, then every collective in turn, without overlap.

    Each collective costs ``count * (rounds * latency + bytes / bandwidth)`` where
    ``bytes`` is what its busiest device sends. Collectives inside conditional branches
    count only for the ``branch`` named (only one branch runs; see ``stats.branches``).

    Args:
      stats: what ``ddl.comm_stats`` read from the compiled step.
      network: the network to price it on.
      compute_s: seconds of computation per step.
      branch: a key of ``stats.branches``: price a step that takes this branch (a local
        SGD synchronisation, say); ``None`` prices a step that takes none.

    Returns:
      The estimated step time in seconds.
    """
    if branch is not None and branch not in stats.branches:
        raise ValueError(f"branch={branch!r} is not one of stats.branches: {list(stats.branches)}.")
    bandwidth = check_real("network.bandwidth", network.bandwidth, minimum=0, exclusive=True)
    latency = check_real("network.latency", network.latency, minimum=0)
    compute_s = check_real("compute_s", compute_s, minimum=0)
    comm = sum(
        op.count * (op.rounds * latency + max(op.sent) / bandwidth)
        for op in stats.ops
        if op.branch in ("", branch)
    )
    return compute_s + comm
