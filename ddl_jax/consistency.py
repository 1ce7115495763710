"""Unreliable workers: which messages arrive, and how far the replicas drift apart."""

from ddl_jax._src.measure.consistency import arrivals, best_replica, consensus_distance

__all__ = ["arrivals", "best_replica", "consensus_distance"]
