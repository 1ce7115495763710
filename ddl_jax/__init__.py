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
from ddl_jax._src.core.islands import IslandsState
from ddl_jax._src.core.mesh import make_mesh, simulate_cpu_devices
from ddl_jax._src.core.model_loss import ModelLoss, ModelVars
from ddl_jax._src.core.strategy import Strategy
from ddl_jax._src.measure.comm import CommStats, comm_stats
from ddl_jax._src.reduce.adasum import adasum
from ddl_jax._src.reduce.allreduce import allreduce_mean, chain
from ddl_jax._src.strategies.asynchronous.delayed_nesterov import delayed_nesterov
from ddl_jax._src.strategies.asynchronous.sgd import AsyncSGDState, async_sgd
from ddl_jax._src.strategies.asynchronous.staleness import (
    ComputeTime,
    async_local,
    churn,
    compute_times,
    downpour,
    scale_by_staleness,
    softsync,
    ssp,
)
from ddl_jax._src.strategies.data_parallel import DataParallelState, data_parallel
from ddl_jax._src.strategies.fsdp import FSDPState, fsdp
from ddl_jax._src.strategies.gossip import GossipState, gossip, mixing_matrix
from ddl_jax._src.strategies.local_sgd import LocalSGDState, local_sgd
from ddl_jax._src.strategies.noloco import NoLoCoState, noloco
from ddl_jax._src.strategies.pipeline.builder import pipeline
from ddl_jax._src.strategies.pipeline.stages import pipeline_stages
from ddl_jax._src.strategies.pipeline.types import DDGState, PipelineState
from ddl_jax._src.strategies.streaming_diloco import StreamingDiLoCoState, streaming_diloco
from ddl_jax._src.strategies.tensor_parallel import TensorParallelState, tensor_parallel
from ddl_jax._src.strategies.zero_one_adam import ZeroOneAdamState, zero_one_adam
from ddl_jax._src.train.fit import fit, guard_nonfinite
from ddl_jax._src.train.log import LossGrowthWarning
from ddl_jax._src.train.precision import mixed_precision

__version__ = "0.1.0"

__all__ = [
    "AsyncSGDState",
    "CommStats",
    "ComputeTime",
    "DDGState",
    "DataParallelState",
    "FSDPState",
    "GossipState",
    "IslandsState",
    "LocalSGDState",
    "LossGrowthWarning",
    "ModelLoss",
    "ModelVars",
    "NoLoCoState",
    "PipelineState",
    "Strategy",
    "StreamingDiLoCoState",
    "TensorParallelState",
    "ZeroOneAdamState",
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
    "zero_one_adam",
]
