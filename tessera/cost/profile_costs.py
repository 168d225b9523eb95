"""Per-task costs from a profile (``planner.cost_source: profile``), and what a profile must time.

Tasks of layers with the same kind code (e.g. every ``"DE"`` layer: Gated DeltaNet + MoE) have
the same shapes in every preset, so they take the same time: a profile times one *item* per
distinct ``(phase, layer kind code, task kind)`` signature (:func:`task_signature`, e.g.
``"F.DE.expert"``; the embedding and the head are ``"F.embed.embed"``, ``"B.head.head"``, ...)
and every task with that signature gets the item's median. The *dedup factor* is tasks needed /
items timed. Overlapped pairs are items too (``"pair:<F signature>|<B signature>"``, the
signatures of the two chunks' layer codes: :func:`pair_item`), the activation transfer is the
item ``"p2p"``, and the compute slowdown fitted to the measured pairs the item
``"overlap_slowdown"``. Two more kinds of items hold factors, not times: ``"pair_with_w"`` (1 when
the timed pairs carry the backward chunk's W tasks, else 0) and ``"calib:<phase>.<task kind>"``, the
calibration scale of one phase of a task kind (median of measured / analytic over its timed items:
:func:`tessera.train.profile.fit.calibration_scales`).

:func:`profiled_costs` keeps the task structure, FLOPs and memory of a template
:class:`ModelCosts` (the analytic one) and replaces each task's ``ms`` by its item's median;
tasks whose item the profile lacks keep the template's time times the calibration scale of their
kind (when the profile has one) and are listed in :attr:`ProfileCostReport.fallback` (those
scaled also in ``scaled``; nothing falls back silently). Measured pairs become
``ModelCosts.measured_pairs``; a candidate pair without one is composed from the task times by
the pair scheduler (the analytic overlap model), counted in the planner's report.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from tessera.cost.types import LayerCost, ModelCosts, TaskKey

__all__ = ["task_signature", "task_signatures", "chunk_signature", "pair_item", "measured_pair_ms", "item_kind",
           "is_factor_item", "ProfileCostReport", "profiled_costs", "summarise_samples", "P2P_ITEM", "OVERLAP_ITEM",
           "PAIR_WITH_W_ITEM", "CALIB_PREFIX", "PAIR_PREFIX"]

P2P_ITEM = "p2p"
"""Item name of one activation transfer between neighbouring pipeline stages."""
OVERLAP_ITEM = "overlap_slowdown"
"""Item holding the compute slowdown fitted to the measured overlapped pairs (a factor, not ms:
:func:`tessera.train.job.profile.overlap_fits`); it becomes ``ModelCosts.overlap_slowdown``
(at least 1)."""
PAIR_WITH_W_ITEM = "pair_with_w"
"""Item holding 1.0 when the profile's pairs carry the backward chunk's W tasks, else 0.0 (a
measured pair is used only by a planner with the same ``with_w``)."""
CALIB_PREFIX = "calib:"
"""Prefix of the calibration-scale items (``"calib:expert"``: measured / analytic, a factor)."""
PAIR_PREFIX = "pair:"
"""Prefix of the pair items (:func:`pair_item`)."""


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


def pair_item(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int]) -> str:
    """The item timing the pair F ``f_range`` | B ``b_range`` (extended layer ranges), e.g.
    ``"pair:embed+DE+DE|AE+head"``."""
    return f"{PAIR_PREFIX}{chunk_signature(costs, *f_range)}|{chunk_signature(costs, *b_range)}"


def measured_pair_ms(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int],
                     with_w: bool) -> float | None:
    """The measured wall time of the pair, ms (``costs.measured_pairs``), or None when the costs
    have none for it or it was timed with another ``with_w``."""
    if not costs.measured_pairs:
        return None
    name = pair_item(costs, f_range, b_range)
    return next((ms for item, w, ms in costs.measured_pairs if item == name and w == with_w), None)


def item_kind(name: str) -> str:
    """The task kind of a task item (the last name part: ``"F.DE.expert"`` -> ``"expert"``)."""
    return name.rsplit(".", 1)[-1]


def is_factor_item(name: str) -> bool:
    """Whether item ``name`` holds a factor (overlap slowdown, ``pair_with_w``, a calibration
    scale), not a time."""
    return name in (OVERLAP_ITEM, PAIR_WITH_W_ITEM) or name.startswith(CALIB_PREFIX)


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
    fallback tasks kept the template's time, those in ``scaled`` times their kind's calibration
    scale), ``items_used`` (distinct items read), ``p2p_measured``, the ``dedup`` factor (tasks /
    distinct items) and ``pairs_measured`` (pair items that became ``measured_pairs``)."""

    measured: tuple[str, ...]
    fallback: tuple[str, ...]
    items_used: int
    p2p_measured: bool
    dedup: float
    scaled: tuple[str, ...] = ()
    pairs_measured: int = 0


def profiled_costs(template: ModelCosts, medians: Mapping[str, float]) -> tuple[ModelCosts, ProfileCostReport]:
    """``template`` with each task's ms the median of its item in ``medians`` (item name -> ms;
    module docstring), ``p2p_ms`` from the ``"p2p"`` item and ``overlap_slowdown`` from the
    ``"overlap_slowdown"`` item (at least 1); missing items keep the template's time, times the
    ``"calib:<phase>.<kind>"`` scale where the profile has one (a ``"calib:<kind>"`` item of an
    older profile applies to every phase). Pair items become ``measured_pairs`` when
    the profile says which ``with_w`` they were timed with (``"pair_with_w"``)."""
    sig = task_signatures(template)
    measured: list[str] = []
    fallback: list[str] = []
    scaled: list[str] = []
    scale = {k[len(CALIB_PREFIX):]: float(v) for k, v in medians.items() if k.startswith(CALIB_PREFIX) and v > 0}

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
                f = scale.get(f"{t.phase.value}.{t.kind.value}", scale.get(t.kind.value))  # per phase; per kind (older)
                if f is not None:
                    scaled.append(name)
                tasks.append(t if f is None else replace(t, ms=t.ms * f))
        return replace(lc, tasks=tuple(tasks))

    pairs: tuple[tuple[str, bool, float], ...] = ()
    if PAIR_WITH_W_ITEM in medians:
        w = bool(medians[PAIR_WITH_W_ITEM] >= 0.5)
        pairs = tuple(sorted((k, w, float(v)) for k, v in medians.items() if k.startswith(PAIR_PREFIX) and v > 0))

    costs = replace(template, source="profile", layers=tuple(layer(lc) for lc in template.layers),
                    embed=layer(template.embed), head=layer(template.head),
                    p2p_ms=float(medians.get(P2P_ITEM, template.p2p_ms)),
                    overlap_slowdown=max(1.0, float(medians.get(OVERLAP_ITEM, template.overlap_slowdown))),
                    measured_pairs=pairs)
    used = {sig[n] for n in measured}
    report = ProfileCostReport(tuple(measured), tuple(fallback), len(used), P2P_ITEM in medians,
                               len(sig) / max(1, len(set(sig.values()))), tuple(scaled), len(pairs))
    return costs, report
