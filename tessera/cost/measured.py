"""ModelCosts from task times measured by the engine (``Engine(..., profile=True)``).

The engine's chunks record ``(TaskKey, ms)`` for every task they run (``TorchChunk.timings``;
with ``eager_comm=True`` a communication task's time includes waiting for its all-to-all).
:func:`measured_costs` keeps the task structure of a template ModelCosts of the same model
(dependencies, FLOPs, memory) and replaces every duration by the median measured time of that
(phase, layer, kind), so the simulator can replay a Program with times measured on this machine.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Iterable, Mapping

from tessera.cost.types import LayerCost, ModelCosts, TaskKey


def median_times(timings: Iterable[tuple[TaskKey | str, float]]) -> dict[str, float]:
    """Median ms per task name (``str(TaskKey)``, e.g. ``"B.L3.expert"``)."""
    samples: dict[str, list[float]] = {}
    for key, ms in timings:
        samples.setdefault(str(key), []).append(ms)
    return {k: statistics.median(v) for k, v in samples.items()}


def measured_costs(template: ModelCosts, times: Mapping[str, float], *, p2p_ms: float,
                   overlap_slowdown: float = 1.0) -> ModelCosts:
    """``template`` with every task's ``ms`` replaced by ``times[str(TaskKey)]``.

    Args:
        template: costs of the same model (e.g. analytic) giving structure, FLOPs and memory.
        times: median ms per task name (:func:`median_times`).
        p2p_ms: measured time of one activation transfer, ms.
        overlap_slowdown: compute slowdown inside overlapped pairs (1.0: none measured).

    Raises:
        ValueError: a task of the template has no measured time (names up to five of them).
    """
    missing: list[str] = []

    def layer(lc: LayerCost) -> LayerCost:
        tasks = []
        for t in lc.tasks:
            name = str(TaskKey(t.phase.value, lc.index, t.kind.value))
            if name not in times:
                missing.append(name)
            tasks.append(replace(t, ms=float(times.get(name, 0.0))))
        return replace(lc, tasks=tuple(tasks))

    costs = replace(template, source="measured", layers=tuple(layer(lc) for lc in template.layers),
                    embed=layer(template.embed), head=layer(template.head), p2p_ms=float(p2p_ms),
                    overlap_slowdown=float(overlap_slowdown))
    if missing:
        raise ValueError(f"no measured time for {len(missing)} task(s), e.g. {missing[:5]}")
    return costs
