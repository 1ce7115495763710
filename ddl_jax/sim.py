"""An alpha-beta network model for pricing a step's communication on other networks."""

from ddl_jax._src.measure.sim import (
    ETHERNET_1G,
    INFINIBAND_100G,
    TPU_V4_ICI,
    Network,
    estimate_step_time,
)

__all__ = ["ETHERNET_1G", "INFINIBAND_100G", "TPU_V4_ICI", "Network", "estimate_step_time"]
