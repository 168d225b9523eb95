"""Per-task costs from a profile (``planner.cost_source: profile``), and what a profile must time.

Tasks of layers with the same kind code (e.g. every ``"DE"`` layer: Gated DeltaNet + MoE) have
the same shapes in every preset, so they take the same time: a profile times one *item* per
distinct ``(phase, layer kind code, task kind)`` signature (:func:`task_signature`, e.g.
``"F.DE.expert"``; the embedding and the head are ``"F.embed.embed"``, ``"B.head.head"``, ...)
and every task with that signature gets the item's median. The *dedup factor* is tasks needed /
items timed. Overlapped pairs are items too (``"pair:<F signature>|<B signature>"``, the
signatures of the two chunks' layer codes), the activation transfer is the item ``"p2p"``, and
the compute slowdown fitted to the measured pairs the item ``"overlap_slowdown"``.

:func:`profiled_costs` keeps the task structure, FLOPs and memory of a template
:class:`ModelCosts` (the analytic one) and replaces each task's ``ms`` by its item's median;
tasks whose item the profile lacks keep the template's time and are listed in
:attr:`ProfileCostReport.fallback` (nothing falls back silently).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from tessera.cost.types import LayerCost, ModelCosts, TaskKey

__all__ = ["task_signature", "task_signatures", "chunk_signature", "ProfileCostReport", "profiled_costs",
           "summarise_samples", "P2P_ITEM", "OVERLAP_ITEM"]

P2P_ITEM = "p2p"
"""Item name of one activation transfer between neighbouring pipeline stages."""
OVERLAP_ITEM = "overlap_slowdown"
"""Item holding the compute slowdown fitted to the measured overlapped pairs (a factor, not ms:
:func:`tessera.train.profiling.overlap_fits`); it becomes ``ModelCosts.overlap_slowdown``
(at least 1)."""


def _code(lc: LayerCost, costs: ModelCosts) -> str:
    if lc.index == -1:
        return "embed"
    if lc.index == len(costs.layers):
        return "head"
    return lc.code


def task_signature(costs: ModelCosts, key: TaskKey) -> str:
    """The item that times task ``key`` (module docstring), e.g. ``"B.AE.mixer"``."""
    return f"{key.phase}.{_code(costs.layer(key.layer), costs)}.{key.kind}"


def task_signatures(costs: ModelCosts) -> dict[str, str]:
    """Every task of the model (``str(TaskKey)``) -> its item, embedding and head included."""
    out: dict[str, str] = {}
    for lc in (costs.embed, *costs.layers, costs.head):
        for t in lc.tasks:
            key = TaskKey(t.phase.value, lc.index, t.kind.value)
            out[str(key)] = task_signature(costs, key)
    return out


def chunk_signature(costs: ModelCosts, start: int, stop: int) -> str:
    """The kind codes of extended layers ``start .. stop-1`` (-1 embedding, L head), e.g.
    ``"embed+DE+DE"``: two chunks with the same signature run the same tasks."""
    return "+".join(_code(costs.layer(i), costs) for i in range(start, stop))


def summarise_samples(samples: Mapping[str, Iterable[float]]) -> dict[str, tuple[float, float, float, int]]:
    """Per item ``(median, p25, p75, n)`` of its samples, ms (``statistics.quantiles``, inclusive
    method; one sample: all three equal)."""
    out = {}
    for name, vals in samples.items():
        v = sorted(float(x) for x in vals)
        if not v:
            continue
        if len(v) == 1:
            out[name] = (v[0], v[0], v[0], 1)
            continue
        q = statistics.quantiles(v, n=4, method="inclusive")
        out[name] = (statistics.median(v), q[0], q[2], len(v))
    return out


@dataclass(frozen=True)
class ProfileCostReport:
    """What :func:`profiled_costs` did: ``measured`` / ``fallback`` task names (``str(TaskKey)``;
    fallback tasks kept the template's time), ``items_used`` (distinct items read), ``p2p_measured``
    and the ``dedup`` factor (tasks / distinct items)."""

    measured: tuple[str, ...]
    fallback: tuple[str, ...]
    items_used: int
    p2p_measured: bool
    dedup: float


def profiled_costs(template: ModelCosts, medians: Mapping[str, float]) -> tuple[ModelCosts, ProfileCostReport]:
    """``template`` with each task's ms the median of its item in ``medians`` (item name -> ms;
    module docstring), ``p2p_ms`` from the ``"p2p"`` item and ``overlap_slowdown`` from the
    ``"overlap_slowdown"`` item (at least 1); missing items keep the template's."""
    sig = task_signatures(template)
    measured: list[str] = []
    fallback: list[str] = []

    def layer(lc: LayerCost) -> LayerCost:
        tasks = []
        for t in lc.tasks:
            name = str(TaskKey(t.phase.value, lc.index, t.kind.value))
            item = sig[name]
            if item in medians:
                measured.append(name)
                tasks.append(replace(t, ms=float(medians[item])))
            else:
                fallback.append(name)
                tasks.append(t)
        return replace(lc, tasks=tuple(tasks))

    costs = replace(template, source="profile", layers=tuple(layer(lc) for lc in template.layers),
                    embed=layer(template.embed), head=layer(template.head),
                    p2p_ms=float(medians.get(P2P_ITEM, template.p2p_ms)),
                    overlap_slowdown=max(1.0, float(medians.get(OVERLAP_ITEM, template.overlap_slowdown))))
    used = {sig[n] for n in measured}
    report = ProfileCostReport(tuple(measured), tuple(fallback), len(used), P2P_ITEM in medians,
                               len(sig) / max(1, len(set(sig.values()))))
    return costs, report
