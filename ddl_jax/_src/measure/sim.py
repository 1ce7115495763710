"""An alpha-beta network model: what a step's communication would cost on other networks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.measure.comm import CommStats, runs_in, split_islands


class Network(NamedTuple):
    """A network in the alpha-beta (Hockney) model: a message of b bytes takes
    ``latency + b / bandwidth`` seconds, and each collective ``overhead`` more.

    Attributes:
      bandwidth: bytes per second each device can send (1 Gb/s Ethernet is ``1e9 / 8``).
      latency: seconds per message (per communication round).
      overhead: seconds per collective beyond its messages (the runtime launching it and
        the transport setting it up), whatever its rounds: an all-reduce of 2 (N - 1)
        rounds and a permute of one pay it once. 0 in the stated networks; ``fit`` finds
        it where the samples hold collectives of different rounds.
    """

    bandwidth: float
    latency: float
    overhead: float = 0.0

    @classmethod
    def fit(
        cls,
        messages: Sequence[float],
        bytes_sent: Sequence[float],
        seconds: Sequence[float],
        collectives: Sequence[float] | None = None,
    ) -> Network:
        """The network that explains measured collectives: a least-squares fit, in relative
        error (each sample weighted by 1 / its seconds, so that small messages count as much
        as large ones), of ``seconds = messages * latency + bytes_sent / bandwidth + c``,
        or with ``collectives``, ``... + collectives * overhead + c``.

        Each sample is one measured program: the messages it sends in turn (``rounds``
        of ``ddl.comm_stats``: an all-reduce over N devices takes ``2 * (N - 1)``), the
        bytes its busiest device sends, its seconds (a median of repeats), and the
        collectives it runs in turn. ``c`` is each program's fixed cost (launching it),
        fitted and left out of the model. The samples need two different message counts
        and two different sizes (e.g. an all-reduce sweep of 4 B to 16 MB, and 32 scalar
        all-reduces in one program, each reading the last: XLA combines independent ones
        into one all-reduce of 32 buffers, one collective to ``comm_stats`` with
        ``buffers=32``, whose buffers XLA:CPU's gloo still sends one by one, so count
        ``rounds * buffers`` messages there); the overhead, collectives of two different rounds
        (e.g. 32 scalar permutes, one round each, beside the all-reduces). A fitted
        latency or overhead below 0 is taken as 0 (the other terms refitted).

        Raises:
          ValueError: the samples differ in length, hold a negative or non-finite
            value, or cannot separate latency from bandwidth (or from the overhead); or
            the fitted bandwidth is not positive (time does not grow with the bytes) or
            not determined (the largest sample's bytes take under 1% of its time).
        """
        named = {"messages": messages, "bytes_sent": bytes_sent, "seconds": seconds}
        if collectives is not None:
            named["collectives"] = collectives
        columns = {k: np.asarray(v, np.float64) for k, v in named.items()}
        if len({c.shape for c in columns.values()}) != 1 or columns["seconds"].ndim != 1:
            raise ValueError(
                f"Network.fit: {', '.join(named)} must be 1-D sequences of one length, got "
                f"shapes {[c.shape for c in columns.values()]}."
            )
        if not all(np.isfinite(c).all() and (c >= 0).all() for c in columns.values()):
            raise ValueError("Network.fit: every sample must be finite and >= 0.")
        seconds = columns.pop("seconds")
        if not (seconds > 0).all():
            raise ValueError("Network.fit: every sample's seconds must be > 0.")
        terms = _least_squares(columns, seconds)
        if terms["bytes_sent"] <= 0:
            raise ValueError(
                "Network.fit: the seconds do not grow with the bytes sent (fitted "
                f"{terms['bytes_sent']:.3g} s per byte); measure larger messages."
            )
        # the largest sample's bytes must take a visible part of its time, or the
        # bandwidth is whatever the noise made it
        largest = int(np.argmax(columns["bytes_sent"]))
        share = columns["bytes_sent"][largest] * terms["bytes_sent"] / seconds[largest]
        if share < UNDETERMINED_SHARE:
            raise ValueError(
                f"Network.fit: the bytes explain {share:.2g} of the largest sample's time "
                f"(under {UNDETERMINED_SHARE:g}): the bandwidth is not determined (fitted "
                f"{1 / terms['bytes_sent']:.3g} B/s); measure larger messages."
            )
        return cls(
            bandwidth=float(1 / terms["bytes_sent"]),
            latency=float(terms["messages"]),
            overhead=float(terms.get("collectives", 0.0)),
        )


#: ``Network.fit`` refuses a bandwidth under which the largest sample's bytes take less
#: than this share of its time: not measured, only noise.
UNDETERMINED_SHARE = 0.01


def _least_squares(columns: dict[str, np.ndarray], seconds: np.ndarray) -> dict[str, float]:
    """Per column, its seconds per unit in ``seconds = sum(column * term) + c``, weighted
    by ``1 / seconds``; a latency or overhead fitted below 0 is dropped (taken as 0) and
    the rest refitted."""
    names = list(columns)
    a = np.stack([*columns.values(), np.ones_like(seconds)], axis=1)
    if np.linalg.matrix_rank(a) < a.shape[1]:
        needs = (
            f"at least {a.shape[1]} samples that no combination of the others explains "
            "(each program also has a fixed cost fitted): two message counts and two sizes "
            "not in step (e.g. an all-reduce sweep of sizes, and many messages of one size)"
        )
        if "collectives" in columns:
            needs += (
                ", and collectives of two different rounds in programs of several "
                "collectives, to separate the overhead (e.g. many permutes in turn)"
            )
        raise ValueError(f"Network.fit: the samples do not determine the terms; they need {needs}.")
    weight = 1.0 / seconds
    solution, *_ = np.linalg.lstsq(a * weight[:, None], seconds * weight, rcond=None)
    terms = dict(zip(names, solution[:-1].tolist(), strict=True))
    negative = [k for k in ("collectives", "messages") if terms.get(k, 0.0) < 0]
    if negative:
        kept = {k: v for k, v in columns.items() if k != negative[0]}
        return {**_least_squares(kept, seconds), negative[0]: 0.0}
    return terms


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
    per_buffer: bool = False,
) -> float:
    """Seconds per step: compute, then every collective in turn, without overlap.

    Each collective costs ``count * (overhead + rounds * latency + bytes / bandwidth)`` where
    ``bytes`` is what its busiest device sends; with ``per_buffer``, each buffer of a
    combined collective pays the overhead and its rounds' latency,
    ``count * (buffers * (overhead + rounds * latency) + bytes / bandwidth)``, as XLA:CPU's
    gloo sends them (and as ``Network.fit`` counts messages there). Collectives inside
    conditional branches count only for the ``branch`` named, with those of the branches
    around it (only one branch of a conditional runs; see ``stats.branches``).
    With islands (``local_sgd(inner=...)``), the collectives within an island travel on
    the island's fast ``inner_network`` and those across islands on ``network``.

    Args:
      stats: what ``ddl.comm_stats`` read from the compiled step.
      network: the network to price it on (with islands: the one between them).
      compute_s: seconds of computation per step.
      branch: a key of ``stats.branches``: price a step that takes this branch (a local
        SGD synchronisation, say); ``None`` prices a step that takes none.
      inner_network: the network inside an island; give it with ``island_devices``.
      island_devices: devices per island (``ddl.sim.split_islands``): divides the
        program's devices.
      per_buffer: price each buffer of a combined collective apart (a network fitted on
        XLA:CPU with ``rounds * buffers`` messages, as ``Network.fit`` advises there).

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
    if not isinstance(stats, CommStats):
        raise TypeError(
            f"estimate_step_time: stats must be a ddl.sim.CommStats (from ddl.comm_stats), got "
            f"{type(stats).__name__}; a ComputeStats prices by "
            "ddl.sim.estimate_compute_time, passed here as compute_s."
        )
    for name, net in (("network", network), ("inner_network", inner_network)):
        if net is not None and not isinstance(net, Network):
            raise TypeError(
                f"estimate_step_time: {name} must be a ddl.sim.Network(bandwidth, latency), "
                f"got {type(net).__name__}."
            )
    if not isinstance(per_buffer, bool):
        raise TypeError(f"estimate_step_time: per_buffer must be a bool, got {per_buffer!r}.")
    if branch is not None and branch not in stats.branches:
        raise ValueError(f"branch={branch!r} is not one of stats.branches: {list(stats.branches)}.")
    if (inner_network is None) != (island_devices is None):
        raise ValueError(
            "estimate_step_time: give inner_network and island_devices together (islands), "
            f"or neither; got inner_network={inner_network!r}, island_devices={island_devices!r}."
        )
    compute_s = check_real("compute_s", compute_s, minimum=0)
    if inner_network is not None:
        devices = len(stats.bytes_sent)
        island_devices = check_int("island_devices", island_devices, minimum=1)
        if devices and devices % island_devices:
            raise ValueError(
                f"estimate_step_time: island_devices={island_devices} does not divide the "
                f"program's {devices} devices."
            )
        within, across = split_islands(stats, island_devices)
        return (
            compute_s
            + _comm_s(within, inner_network, branch, per_buffer)
            + _comm_s(across, network, branch, per_buffer)
        )
    return compute_s + _comm_s(stats, network, branch, per_buffer)


def _comm_s(stats: CommStats, network: Network, branch: str | None, per_buffer: bool) -> float:
    bandwidth = check_real("network.bandwidth", network.bandwidth, minimum=0, exclusive=True)
    latency = check_real("network.latency", network.latency, minimum=0)
    overhead = check_real("network.overhead", network.overhead, minimum=0)
    return sum(
        op.count
        * (
            (op.buffers if per_buffer else 1) * (overhead + op.rounds * latency)
            + max(op.sent) / bandwidth
        )
        for op in stats.ops
        if not op.branch or (branch is not None and runs_in(op.branch, branch))
    )
