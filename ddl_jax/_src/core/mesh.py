"""Device meshes: simulated CPU devices and named mesh axes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ddl_jax._src.core.strategy import AXIS_NAMES, check_int


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX's CPU backend expose ``n`` devices (call before any JAX computation).

    The devices share the host's cores: use them to check that a distributed program is
    correct, not to measure speed-up. A loop of your own over a compiled step should wait
    for one every few steps (``jax.block_until_ready``), as ``ddl.fit`` does: with about a
    hundred steps dispatched ahead, XLA:CPU's collectives among these devices can
    deadlock, and XLA ends the process after 40 s ("Expected N threads to join the
    rendezvous"; seen with 2 devices on 2 cores and a program of two ``psum``).

    Args:
      n: number of CPU devices, >= 1.

    Raises:
      ValueError: ``n`` is not a positive integer.
      RuntimeError: JAX's backends are already initialised with a different device count.
    """
    n = check_int("simulate_cpu_devices: n", n, minimum=1)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"simulate_cpu_devices({n}) was called after JAX started with {have} CPU "
            "device(s); call it right after `import jax`, before any computation."
        ) from e


def make_mesh(
    data: int | None = None,
    *,
    island: int | None = None,
    stage: int = 1,
    model: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a mesh with named axes ``data`` (and ``island`` when given, ``stage`` /
    ``model`` when > 1).

    Args:
      data: size of the data-parallel axis; ``None`` takes every device left once
        ``island``, ``stage`` and ``model`` are served.
      island: number of islands (the outermost axis, omitted when ``None``): groups of
        ``data x stage x model`` consecutive devices, each training the inner strategy of
        an outer method (``ddl.local_sgd(inner=...)``), which alone talks across islands.
      stage: size of the pipeline axis (omitted from the mesh when 1).
      model: size of the tensor-parallel axis (omitted from the mesh when 1).
      devices: devices to use (default ``jax.devices()``); the first
        ``island * data * stage * model`` of them form the mesh, in this order along
        ``island, data, stage, model``. By default, with several processes, no islands
        and ``stage`` > 1, a process's devices fill one stage before the next: pipeline
        messages cross processes, collectives over ``data`` and ``model`` stay within one,
        and a process holding one stage compiles that stage's program alone
        (``ddl.pipeline``).

    Returns:
      A ``jax.sharding.Mesh`` with axes in the order ``island, data, stage, model``.

    Example:
      >>> import ddl_jax as ddl
      >>> dict(ddl.make_mesh(data=2, model=4).shape)
      {'data': 2, 'model': 4}
      >>> dict(ddl.make_mesh(stage=2).shape)  # data takes the devices left: 8 / 2
      {'data': 4, 'stage': 2}
      >>> dict(ddl.make_mesh(island=2, data=4).shape)
      {'island': 2, 'data': 4}
    """
    by_process = devices is None and stage > 1 and jax.process_count() > 1 and island is None
    devices = list(jax.devices() if devices is None else devices)
    stage = check_int("make_mesh: stage", stage, minimum=1)
    model = check_int("make_mesh: model", model, minimum=1)
    islands = 1 if island is None else check_int("make_mesh: island (or None)", island, minimum=1)
    if data is not None:
        data = check_int("make_mesh: data (or None)", data, minimum=1)
    else:
        if len(devices) % (islands * stage * model):
            shape = f"island={islands} x " if island is not None else ""
            raise ValueError(
                f"make_mesh: {len(devices)} devices do not split into {shape}stage={stage} x "
                f"model={model}; pass data= explicitly."
            )
        data = len(devices) // (islands * stage * model)
    sizes = {"island": islands, "data": data, "stage": stage, "model": model}
    needed = math.prod(sizes.values())
    if needed > len(devices):
        shape = " x ".join(f"{a}={n}" for a, n in sizes.items() if a != "island" or island)
        raise ValueError(
            f"make_mesh: {shape} needs {needed} devices, only {len(devices)} available "
            "(ddl.simulate_cpu_devices(n), called before JAX starts, makes more on CPU; or "
            "run several workers a device: the builders' workers=N on a smaller mesh)."
        )
    devices = devices[:needed]
    if by_process:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        devices = list(np.array(ordered).reshape(stage, data, model).transpose(1, 0, 2).flat)
    kept = {"island": island is not None, "data": True, "stage": stage > 1, "model": model > 1}
    names = tuple(a for a in AXIS_NAMES if kept[a])
    return jax.make_mesh(tuple(sizes[a] for a in names), names, devices=devices)
