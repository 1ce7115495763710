"""ddl_jax: distributed-training strategies for JAX and Flax as pure shard_map programs."""

from ddl_jax import checkpoint, collectives, compression, data, flax, launch, models, sim
from ddl_jax._src.comm import CommStats, comm_stats
from ddl_jax._src.data_parallel import DataParallelState, data_parallel
from ddl_jax._src.fit import fit, guard_nonfinite
from ddl_jax._src.gossip import GossipState, gossip, mixing_matrix
from ddl_jax._src.local_sgd import LocalSGDState, local_sgd
from ddl_jax._src.mesh import make_mesh, simulate_cpu_devices
from ddl_jax._src.reducers import allreduce_mean
from ddl_jax._src.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "DataParallelState",
    "GossipState",
    "LocalSGDState",
    "Strategy",
    "allreduce_mean",
    "checkpoint",
    "collectives",
    "comm_stats",
    "compression",
    "data",
    "data_parallel",
    "fit",
    "flax",
    "gossip",
    "guard_nonfinite",
    "launch",
    "local_sgd",
    "make_mesh",
    "mixing_matrix",
    "models",
    "sim",
    "simulate_cpu_devices",
]
