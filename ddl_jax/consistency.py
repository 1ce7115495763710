"""Unreliable workers: which messages arrive, and how far the replicas drift apart."""

from ddl_jax._src.consistency import arrivals, best_replica, consensus_distance

__all__ = ["arrivals", "best_replica", "consensus_distance"]
