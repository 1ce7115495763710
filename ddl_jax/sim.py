"""Models for pricing a step on other hardware: an alpha-beta network model for its
communication, a two-number device model for its computation."""

from ddl_jax._src.measure.comm import (
    CollectiveOp,
    CommStats,
    per_worker,
    split_islands,
    summarise,
)
from ddl_jax._src.measure.compute import (
    A100,
    CPU_CORE,
    H100,
    TPU_V4,
    ComputeStats,
    Device,
    compute_stats,
    estimate_compute_time,
)
from ddl_jax._src.measure.sim import (
    ETHERNET_1G,
    INFINIBAND_100G,
    TPU_V4_ICI,
    Network,
    estimate_step_time,
)

__all__ = [
    "A100",
    "CPU_CORE",
    "ETHERNET_1G",
    "H100",
    "INFINIBAND_100G",
    "TPU_V4",
    "TPU_V4_ICI",
    "CollectiveOp",
    "CommStats",
    "ComputeStats",
    "Device",
    "Network",
    "compute_stats",
    "estimate_compute_time",
    "estimate_step_time",
    "per_worker",
    "split_islands",
    "summarise",
]
