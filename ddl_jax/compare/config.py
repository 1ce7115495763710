"""``ddl-jax compare``'s settings: one checked ``Config`` from flags or a TOML file."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddl_jax.compare.processes import parse_emulation
from ddl_jax.compare.specs import (
    DEFAULT_STRATEGIES,
    DEVICES,
    FAMILIES,
    NETWORKS,
    PRESETS,
    WORKLOADS,
    CompareError,
    Spec,
    parse_spec,
    parse_specs,
)


@dataclasses.dataclass(frozen=True)
class Config:
    """A checked comparison config (``make_config`` builds it).

    Attributes:
      workload: one of ``WORKLOADS``, or ``"module:function"``: a function of the user's
        that returns a ``Workload`` (``workloads.load``).
      strategies: the parsed specs, in order.
      preset: the ``PRESETS`` list ``strategies`` came from (``None``: given, or default).
      devices: workers (devices on the mesh's ``data`` axis).
      steps: training steps per strategy (``None``: the workload's default).
      network: a key of ``NETWORKS``.
      compute: a key of ``DEVICES``: the device model each worker's computation is priced
        on (from the compiled step's flops and bytes).
      straggler: one worker's compute time relative to the others (>= 1; 1 is none).
      drop: the probability that a message is lost, in [0, 1): only for the families with
        a model of it (``Family.unreliable``; ``--preset unreliable``).
      churn: the probability that a worker is absent from a step, in [0, 1) (the async
        family: leaves after a task, away for one task's compute); the same families.
      non_iid: Dirichlet alpha of label-skewed worker shares (``ddl.data.non_iid_batches``;
        digits workloads); ``None`` is i.i.d. shuffling.
      seed: seed of the model's initialisation, the data order and compute-time noise.
      target: the test accuracy (validation bits per byte for text-gpt) to reach
        (``None``: the workload's default).
      eval_every: steps between evaluations (``None``: about 20 per run).
      out: directory of ``results.json``, ``results.md`` and the figures.
      tensorboard: a directory for TensorBoard event files, one run per strategy, in
        ``<tensorboard>/<strategy>`` (a run again replaces its event files there; other
        files stay) (``None``: none).
      measure: also run each strategy as ``devices`` real processes (one device each)
        and time it to the target, next to its simulated time (``measured``).
      emulate: the processes' network, ``"RATE[,DELAY]"`` (``"100mbit"``,
        ``"1gbit,2ms"``): each in its own network namespace behind a ``tc`` limit (Linux,
        root; implies ``measure``). ``None``: the loopback interface.
      launches: with ``measure``, the launches of the processes that time the calibration's
        probe step and each strategy, the median launch's time kept (a launch keeps its
        speed across its runs, launches differ).
      islands: islands of a stacked spec (``diloco:16/fsdp:3``): its mesh is ``islands x
        devices / islands``, and ``network`` links the islands.
      inner_network: a key of ``NETWORKS``: the network inside an island.
      workers: simulated workers, a multiple of ``devices`` (``None``: one a device); more
        than ``devices`` runs several a device (the strategies' ``workers=``), each priced
        as one worker of the same run on one device each (``ddl.sim.per_worker``); FSDP,
        the ring all-reduce and stacked specs keep one a device and refuse.
    """

    workload: str = "digits-mlp"
    strategies: tuple[Spec, ...] = tuple(parse_spec(s) for s in DEFAULT_STRATEGIES)
    preset: str | None = None
    devices: int = 8
    steps: int | None = None
    network: str = "1gbps"
    compute: str = "cpu"
    straggler: float = 1.0
    drop: float = 0.0
    churn: float = 0.0
    non_iid: float | None = None
    seed: int = 0
    target: float | None = None
    eval_every: int | None = None
    out: str = "compare-results"
    tensorboard: str | None = None
    measure: bool = False
    emulate: str | None = None
    launches: int = 3
    islands: int = 2
    inner_network: str = "ici"
    workers: int | None = None

    @property
    def worker_count(self) -> int:
        """The workers: ``workers``, else one a device."""
        return self.devices if self.workers is None else self.workers

    def as_dict(self) -> dict[str, Any]:
        """The config as plain JSON values (strategies as their spec strings)."""
        values = dataclasses.asdict(self)
        values["strategies"] = [s.text for s in self.strategies]
        return values


_FIELDS = tuple(f.name for f in dataclasses.fields(Config))


def _integer(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CompareError(f"{key} must be an integer >= {minimum}, got {value!r}.")
    return value


def _number(key: str, value: Any, minimum: float) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        least = "" if minimum == -math.inf else f" >= {minimum:g}"
        raise CompareError(f"{key} must be a number{least}, got {value!r}.")
    if abs(value) == math.inf:
        raise CompareError(f"{key} must be finite, got {value!r}.")
    return float(value)


def _choice(key: str, value: Any, valid: Sequence[str]) -> str:
    if value not in valid:
        raise CompareError(f"unknown {key} {value!r}; valid: {', '.join(valid)}.")
    return value


def make_config(values: Mapping[str, Any]) -> Config:
    """Checks comparison settings and returns the ``Config``.

    Args:
      values: any of ``Config``'s fields (``strategies`` as a comma-separated string or a
        list of specs; numbers as numbers or strings); a value of ``None`` keeps the
        default.

    Raises:
      CompareError: an unknown key, or a value out of range (one line each).
    """
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise CompareError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(_FIELDS)}.")
    v = {k: x for k, x in values.items() if x is not None}
    checked: dict[str, Any] = {}
    if "workload" in v:
        name = v["workload"]
        user = isinstance(name, str) and ":" in name
        checked["workload"] = name if user else _choice("workload", name, WORKLOADS)
    if "strategies" in v and "preset" in v:
        raise CompareError("give strategies or a preset, not both.")
    if "strategies" in v:
        checked["strategies"] = parse_specs(v["strategies"])
    if "preset" in v:
        checked["preset"] = _choice("preset", v["preset"], tuple(PRESETS))
        checked["strategies"] = parse_specs(PRESETS[checked["preset"]])
    if "network" in v:
        checked["network"] = _choice("network", v["network"], tuple(NETWORKS))
    if "compute" in v:
        checked["compute"] = _choice("compute", v["compute"], tuple(DEVICES))
    if "inner_network" in v:
        checked["inner_network"] = _choice("inner_network", v["inner_network"], tuple(NETWORKS))
    if "islands" in v:
        checked["islands"] = _integer("islands", v["islands"], 2)
    for key, minimum in (("devices", 1), ("steps", 1), ("eval_every", 1), ("workers", 1)):
        if key in v:
            checked[key] = _integer(key, v[key], minimum)
    if "seed" in v:
        checked["seed"] = _integer("seed", v["seed"], 0)
    if "straggler" in v:
        checked["straggler"] = _number("straggler", v["straggler"], 1.0)
    if "target" in v:
        # any finite number: a metric of one's own may be negative (a log-likelihood);
        # an accuracy's range is checked against the workload
        checked["target"] = _number("target", v["target"], -math.inf)
    _unreliable(v, checked)
    if "out" in v:
        if not isinstance(v["out"], str | Path) or not str(v["out"]):
            raise CompareError(f"out must be a directory path, got {v['out']!r}.")
        checked["out"] = str(v["out"])
    if "tensorboard" in v:
        if not isinstance(v["tensorboard"], str | Path) or not str(v["tensorboard"]):
            raise CompareError(f"tensorboard must be a directory path, got {v['tensorboard']!r}.")
        checked["tensorboard"] = str(v["tensorboard"])
    _measure(v, checked)
    _islands(Config(**checked), given=[k for k in ("islands", "inner_network") if k in v])
    _workers(Config(**checked))
    return Config(**checked)


def _workers(config: Config) -> None:
    """Several workers a device: a multiple of the devices, flat specs only, simulated
    only (a strategy that keeps one worker a device refuses when it is built)."""
    if config.workers is None or config.workers == config.devices:
        return
    if config.workers % config.devices:
        raise CompareError(
            f"workers={config.workers} must be a multiple of devices={config.devices} (each "
            "device runs workers / devices of them)."
        )
    stacked = [s.text for s in config.strategies if s.inner is not None]
    if stacked:
        raise CompareError(
            f"workers={config.workers} runs {config.workers // config.devices} workers a "
            f"device, which islands do not (each island is devices); drop "
            f"{', '.join(stacked)}, or workers."
        )
    if config.measure:
        raise CompareError("measure runs one device per process: drop measure or workers.")


def _islands(config: Config, given: list[str]) -> None:
    """Stacked specs need the devices to split into the islands, and no --measure; the
    islands' settings (``given``) need a stacked spec to shape."""
    stacked = [s.text for s in config.strategies if s.inner is not None]
    if not stacked:
        if given:
            raise CompareError(
                f"{' and '.join(given)} shape stacked strategies (OUTER/INNER, e.g. "
                "diloco:16/fsdp:3), and none is listed: add one, or drop "
                f"{' and '.join(given)}."
            )
        return
    if config.devices % config.islands:
        raise CompareError(
            f"devices={config.devices} do not split into islands={config.islands} for "
            f"{', '.join(stacked)}; give devices a multiple of islands."
        )
    if config.measure:
        raise CompareError(
            f"measure runs one device per process, not islands: drop measure or the stacked "
            f"strategies {', '.join(stacked)}."
        )


def _measure(v: dict[str, Any], checked: dict[str, Any]) -> None:
    """``measure`` and ``emulate`` checked against the settings real processes can run."""
    if "emulate" in v:
        checked["emulate"] = parse_emulation(v["emulate"]).text
        checked["measure"] = True
    if "measure" in v:
        if not isinstance(v["measure"], bool):
            raise CompareError(f"measure must be true or false, got {v['measure']!r}.")
        if not v["measure"] and "emulate" in checked:
            raise CompareError("emulate runs real processes: it cannot go with measure=false.")
        checked["measure"] = checked.get("measure", False) or v["measure"]
    if "launches" in v:
        checked["launches"] = _integer("launches", v["launches"], 1)
        if not checked.get("measure"):
            raise CompareError("launches times measured processes: give it with measure.")
    if checked.get("measure") and checked.get("straggler", 1.0) != 1.0:
        raise CompareError(
            "measure times real processes, which have no simulated straggler: drop straggler "
            "(or slow one process of your own and read fit's straggler report)."
        )


def _unreliable(v: dict[str, Any], checked: dict[str, Any]) -> None:
    """``drop``, ``churn`` and ``non_iid`` checked against the strategies and the workload."""
    for key, what in (("drop", "lost messages"), ("churn", "absent workers")):
        if key not in v:
            continue
        checked[key] = p = _number(key, v[key], 0.0)
        if p >= 1:
            raise CompareError(f"{key} must be a probability in [0, 1), got {p:g}.")
        strategies = checked.get("strategies", Config.strategies)
        refused = [s.text for s in strategies if not FAMILIES[s.family].unreliable]
        if p and refused:
            able = ", ".join(name for name, f in FAMILIES.items() if f.unreliable)
            raise CompareError(
                f"{key}: {', '.join(refused)} have no model of {what}; the families "
                f"that do: {able} (e.g. --preset unreliable)."
            )
    if "non_iid" in v:
        alpha = v["non_iid"]
        with contextlib.suppress(ValueError, TypeError):
            alpha = alpha if isinstance(alpha, bool) else float(alpha)
        if not isinstance(alpha, float) or not 0 < alpha < float("inf"):
            raise CompareError(
                f"non_iid (a Dirichlet alpha) must be a finite number > 0, got {alpha!r}."
            )
        checked["non_iid"] = alpha
        if checked.get("workload", Config.workload) == "text-gpt":
            raise CompareError("non_iid splits labels: a digits workload, not text-gpt.")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML config file (its top-level table, or its ``[compare]`` one).

    Raises:
      CompareError: the file cannot be read or is not valid TOML.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise CompareError(f"cannot read config {str(path)!r}: {e.strerror}.") from None
    except tomllib.TOMLDecodeError as e:
        raise CompareError(f"config {str(path)!r} is not valid TOML: {e}.") from None
    if isinstance(data.get("compare"), dict):
        data = data["compare"]
    return {k.replace("-", "_"): x for k, x in data.items()}
