"""ddl_jax: distributed-training strategies for JAX and Flax as pure shard_map programs."""

from ddl_jax import (
    checkpoint,
    collectives,
    compression,
    consistency,
    data,
    flax,
    launch,
    layers,
    models,
    schedules,
    sim,
)
from ddl_jax._src.adasum import adasum
from ddl_jax._src.async_sgd import AsyncSGDState, async_sgd
from ddl_jax._src.comm import CommStats, comm_stats
from ddl_jax._src.data_parallel import DataParallelState, data_parallel
from ddl_jax._src.delayed_nesterov import delayed_nesterov
from ddl_jax._src.fit import fit, guard_nonfinite
from ddl_jax._src.fsdp import FSDPState, fsdp
from ddl_jax._src.gossip import GossipState, gossip, mixing_matrix
from ddl_jax._src.local_sgd import LocalSGDState, local_sgd
from ddl_jax._src.mesh import make_mesh, simulate_cpu_devices
from ddl_jax._src.model_loss import ModelLoss, ModelVars
from ddl_jax._src.noloco import NoLoCoState, noloco
from ddl_jax._src.pipeline import pipeline
from ddl_jax._src.pipeline_programs import DDGState, PipelineState
from ddl_jax._src.pipeline_stages import pipeline_stages
from ddl_jax._src.precision import mixed_precision
from ddl_jax._src.reducers import allreduce_mean, chain
from ddl_jax._src.staleness import (
    ComputeTime,
    async_local,
    churn,
    compute_times,
    downpour,
    scale_by_staleness,
    softsync,
    ssp,
)
from ddl_jax._src.strategy import Strategy
from ddl_jax._src.streaming_diloco import StreamingDiLoCoState, streaming_diloco
from ddl_jax._src.tensor_parallel import TensorParallelState, tensor_parallel

__version__ = "0.1.0"

__all__ = [
    "AsyncSGDState",
    "CommStats",
    "ComputeTime",
    "DDGState",
    "DataParallelState",
    "FSDPState",
    "GossipState",
    "LocalSGDState",
    "ModelLoss",
    "ModelVars",
    "NoLoCoState",
    "PipelineState",
    "Strategy",
    "StreamingDiLoCoState",
    "TensorParallelState",
    "adasum",
    "allreduce_mean",
    "async_local",
    "async_sgd",
    "chain",
    "checkpoint",
    "churn",
    "collectives",
    "comm_stats",
    "compression",
    "compute_times",
    "consistency",
    "data",
    "data_parallel",
    "delayed_nesterov",
    "downpour",
    "fit",
    "flax",
    "fsdp",
    "gossip",
    "guard_nonfinite",
    "launch",
    "layers",
    "local_sgd",
    "make_mesh",
    "mixed_precision",
    "mixing_matrix",
    "models",
    "noloco",
    "pipeline",
    "pipeline_stages",
    "scale_by_staleness",
    "schedules",
    "sim",
    "simulate_cpu_devices",
    "softsync",
    "ssp",
    "streaming_diloco",
    "tensor_parallel",
]
