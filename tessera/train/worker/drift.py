"""Profile drift during training: the run's own task times against the profile it was planned on.

With ``planner.cost_source: profile`` and ``profile.check_every > 0``, every ``check_every``
steps each rank compares the engine's per-task times of that iteration (``TorchChunk.timings``,
recorded on those steps only: the step runner runs them on its ``profile=True`` engine) with
the profile's medians, item by item (:func:`tessera.cost.profile_costs.task_signature`). Only tasks that wait on no communication
are compared: weight-gradient (W) tasks, shared experts, the embedding and the head. In training
the all-to-alls are asynchronous, so a dispatch's or combine's wait lands inside whichever task
first reads its result (an expert, the next mixer), unlike in the profile, where each task is
timed alone.

``drift = median over the compared items of |measured median / profiled median - 1|``; the
job's ``profile_drift`` (metrics.jsonl and W&B) is the largest over ranks. Above
``profile.drift_threshold`` the console shows a warning, ``metrics.jsonl`` gets a
``profile_drift`` event and the profile is marked stale in the cache when the job ends.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["DriftCheck", "COMPARED_KINDS"]

COMPARED_KINDS = ("shared", "embed", "head")
"""Task kinds compared in every phase (and every kind in phase W): those that wait on no
all-to-all in training (module docstring)."""


def _compared(name: str) -> bool:
    phase, _, kind = name.split(".", 2)
    return phase == "W" or kind in COMPARED_KINDS


@dataclass(frozen=True)
class DriftCheck:
    """``reference``: item -> profiled median ms; ``signature``: task name (``"W.L3.expert"``) ->
    its item (:func:`tessera.cost.profile_costs.task_signatures`); ``every``: steps between checks."""

    reference: Mapping[str, float]
    signature: Mapping[str, str]
    every: int

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def drift(self, timings: Iterable[tuple[object, float]]) -> float | None:
        """The drift of one iteration's ``(task, ms)`` timings (module docstring), or None when no
        compared task has a profiled time."""
        samples: dict[str, list[float]] = {}
        for key, ms in timings:
            name = str(key)
            item = self.signature.get(name)
            if item is None or not _compared(name) or self.reference.get(item, 0.0) <= 0:
                continue
            samples.setdefault(item, []).append(float(ms))
        errs = [abs(statistics.median(v) / self.reference[item] - 1) for item, v in samples.items()]
        return statistics.median(errs) if errs else None
