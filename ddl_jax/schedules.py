"""Pipeline schedules as data: which micro-batch each stage runs at each tick, its bubble
and its activation memory, readable without running anything."""

from ddl_jax._src.pipeline_schedules import (
    Schedule,
    idle_fraction,
    make_schedule,
    peak_stash,
    stash_intervals,
)

__all__ = ["Schedule", "idle_fraction", "make_schedule", "peak_stash", "stash_intervals"]
