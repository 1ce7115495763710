"""All-reduce algorithms as explicit ``ppermute`` rounds, for use inside ``shard_map``."""

from ddl_jax._src.reduce.collectives import ps_allreduce, ring_allreduce, tree_allreduce

__all__ = ["ps_allreduce", "ring_allreduce", "tree_allreduce"]
