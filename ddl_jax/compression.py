"""Gradient compression as reducers: pass one as ``reducer=`` to a strategy."""

from ddl_jax._src.compression import CastState, QSGDState, SignState, cast, qsgd, sign
from ddl_jax._src.compression_lowrank import PowerSGDState, power_sgd
from ddl_jax._src.compression_sparse import ThresholdState, TopKState, threshold, top_k
from ddl_jax._src.compression_wire import reducer_metrics

__all__ = [
    "CastState",
    "PowerSGDState",
    "QSGDState",
    "SignState",
    "ThresholdState",
    "TopKState",
    "cast",
    "power_sgd",
    "qsgd",
    "reducer_metrics",
    "sign",
    "threshold",
    "top_k",
]
