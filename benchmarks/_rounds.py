"""Interleaved timing rounds, shared by the multi-process benchmarks' workers."""

import time
from collections.abc import Callable
from typing import Any

import jax


def interleaved(
    runs: dict[str, tuple[Callable, Any]], rounds: int, steps: int, batch_at: Callable[[int], Any]
) -> dict[str, list[float]]:
    """Per program, the seconds of ``steps`` steps in each of ``rounds`` rounds; within a
    round the programs take turns, so drift in the machine's speed hits all alike, and
    round r starts with program r (mod their number), so none always runs first or last.

    ``runs`` maps a name to ``(jitted step, state)`` and is updated with the new states;
    step i of a round trains on ``batch_at(i)``.
    """
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, state = runs[name]
            start = time.perf_counter()
            for i in range(steps):
                state, metrics = step(state, batch_at(i))
            jax.block_until_ready(metrics)
            seconds[name].append(time.perf_counter() - start)
            runs[name] = (step, state)
    return seconds
