"""Gradient compression as reducers: pass one as ``reducer=`` to a strategy (the
``scatter_*`` ones to ``ddl.fsdp``, which reduce-scatters)."""

from ddl_jax._src.core.reducer import ScatterReducer, reducer_metrics
from ddl_jax._src.reduce.lowbit import E3M0State, cast_e3m0
from ddl_jax._src.reduce.lowrank import PowerSGDState, power_sgd
from ddl_jax._src.reduce.onebit import OnebitAdamState, onebit_adam
from ddl_jax._src.reduce.outer import DeMoState, SparseLoCoState, demo, sparse_loco
from ddl_jax._src.reduce.quantise import CastState, QSGDState, SignState, cast, qsgd, sign
from ddl_jax._src.reduce.scatter import (
    ScatterState,
    ScatterTopKState,
    scatter_cast,
    scatter_qsgd,
    scatter_top_k,
)
from ddl_jax._src.reduce.sparse import (
    DGCWeightDecayState,
    ThresholdState,
    TopKState,
    dgc_weight_decay,
    threshold,
    top_k,
)

__all__ = [
    "CastState",
    "DGCWeightDecayState",
    "DeMoState",
    "E3M0State",
    "OnebitAdamState",
    "PowerSGDState",
    "QSGDState",
    "ScatterReducer",
    "ScatterState",
    "ScatterTopKState",
    "SignState",
    "SparseLoCoState",
    "ThresholdState",
    "TopKState",
    "cast",
    "cast_e3m0",
    "demo",
    "dgc_weight_decay",
    "onebit_adam",
    "power_sgd",
    "qsgd",
    "reducer_metrics",
    "scatter_cast",
    "scatter_qsgd",
    "scatter_top_k",
    "sign",
    "sparse_loco",
    "threshold",
    "top_k",
]
