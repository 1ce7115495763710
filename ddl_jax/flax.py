"""Flax adapters: NNX and Linen modules to ``loss_fn(params, batch)`` and back."""

from ddl_jax._src.core.flax_bridge import loss_from_module, split, update_module

__all__ = ["loss_from_module", "split", "update_module"]
