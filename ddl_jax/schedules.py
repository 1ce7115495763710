"""Pipeline schedules as data: which micro-batch each stage runs at each tick, its bubble,
its activation memory and its lock-step time under given stage costs, readable without
running anything."""

from ddl_jax._src.strategies.pipeline.schedules import (
    Schedule,
    idle_fraction,
    lockstep_time,
    make_schedule,
    peak_stash,
    stash_intervals,
)

__all__ = [
    "Schedule",
    "idle_fraction",
    "lockstep_time",
    "make_schedule",
    "peak_stash",
    "stash_intervals",
]
