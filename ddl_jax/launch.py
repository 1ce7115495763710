"""Multi-process training: join JAX's distributed runtime, feed each process its rows.

Run a script on N local processes with ``ddl-jax launch -n N -- python script.py``.
"""

from ddl_jax._src.train.launch import (
    global_batch,
    idle_gloo_threads,
    initialize,
    process_batches,
    process_rows,
)

__all__ = ["global_batch", "idle_gloo_threads", "initialize", "process_batches", "process_rows"]
