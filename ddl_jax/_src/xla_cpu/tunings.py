"""The one switch for the XLA:CPU and gloo tunings, off by default.

Each tuning was measured to help a CPU cluster that runs one process per pinned core, and
none is worth its cost elsewhere (``docs/figures.md``). While the switch is on:

* a process whose CPU affinity is one core computes weight gradients from explicit
  transposes (``products.py``: same mathematics, different float rounding);
* ``allreduce_mean(bucket_mb="auto")`` and the replica averages pack each dtype's leaves
  into 25 MiB buckets when collectives cross processes on CPU;
* ``ddl.launch.initialize`` lowers gloo's transport threads to ``SCHED_IDLE``
  (``gloo_threads.py``);
* a process that holds devices of one pipeline stage only compiles that stage's program.

Off, a program's results do not depend on the process's CPU affinity. Turn it on with
``ddl.launch.initialize(xla_cpu_tunings=True)`` or the environment variable
``DDL_JAX_XLA_CPU_TUNINGS=1`` (read at each check; the argument wins once given).
"""

import logging
import os

import jax

ENV_VAR = "DDL_JAX_XLA_CPU_TUNINGS"

_logger = logging.getLogger("ddl_jax")
_state: dict[str, bool | None] = {"switch": None, "logged": False}


def set_enabled(on: bool) -> None:
    """Turns the tunings on or off for this process (overrides the environment variable)."""
    if not isinstance(on, bool):
        raise TypeError(f"xla_cpu_tunings must be True or False, got {on!r}.")
    _state["switch"] = on


def enabled() -> bool:
    """Whether the tunings are on: :func:`set_enabled`'s value, else ``DDL_JAX_XLA_CPU_TUNINGS``."""
    on = _state["switch"]
    if on is None:
        value = os.environ.get(ENV_VAR, "0").strip().lower()
        if value not in {"", "0", "1", "false", "true", "off", "on"}:
            raise ValueError(f"{ENV_VAR} must be 1 or 0 (true / false, on / off), got {value!r}.")
        on = value in {"1", "true", "on"}
    if on and not _state["logged"]:
        _state["logged"] = True
        _logger.warning(
            "ddl_jax: XLA:CPU tunings on (for one process per pinned core; see "
            "ddl_jax.launch.initialize): results may depend on CPU affinity."
        )
    return on


def active_on(platform: str) -> bool:
    """Whether a tuning applies to devices of ``platform``: the switch is on and they are CPUs."""
    return platform == "cpu" and enabled()


def cluster() -> bool:
    """Whether the tunings for CPU collectives across processes apply to this process."""
    return jax.process_count() > 1 and active_on(jax.default_backend())
