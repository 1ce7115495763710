"""Unreliable workers: which messages arrive, and how far the replicas drift apart."""

from ddl_jax._src.consistency import arrivals, consensus_distance

__all__ = ["arrivals", "consensus_distance"]
