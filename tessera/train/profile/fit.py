"""What a profile's measured items tell about the models that predicted them (job side).

* :func:`overlap_fits`: the compute slowdown under overlap, fitted per measured ``FB`` pair of
  the Program (``ModelCosts.overlap_slowdown``);
* :func:`calibration_scales`: per phase and task kind (``"F.expert"``, ``"W.mixer"``), the scale
  ``measured / analytic`` fitted over that group's timed items, stored with the profile as
  ``"calib:<phase>.<kind>"`` items and applied to the analytic time of tasks the profile never
  timed (:func:`tessera.cost.profile_costs.profiled_costs`); one scale per kind alone cannot fit a
  kind's F, B and W at once (their analytic ratios differ from the device's);
* :func:`calibration`: the calibration report, analytic vs measured per task kind, before and
  after that scale;
* :func:`profile_items`: the items a Program needs (tasks and the pairs it co-executes).
"""

from __future__ import annotations

import statistics

__all__ = ["profile_items", "pair_items", "overlap_fits", "analytic_medians", "calibration_scales", "calibration"]


def profile_items(costs, programs) -> tuple[dict[str, str], dict[str, int]]:
    """``(task -> item, pair item -> count)`` the Programs need (``str(TaskKey)`` -> item, and
    per pair item how many ``FB`` instructions run it)."""
    from tessera.cost.profile_costs import task_signatures

    counts: dict[str, int] = {}
    for prog in programs:
        for item in pair_items(costs, prog).values():
            counts[item] = counts.get(item, 0) + 1
    return task_signatures(costs), counts


def pair_items(costs, program) -> dict[int, str]:
    """Instruction index -> pair item (:func:`tessera.cost.profile_costs.pair_item`) of every
    ``FB`` instruction of ``program``."""
    from tessera.cost.profile_costs import pair_item
    from tessera.program.instructions import Op

    rng = {s.chunk: (s.start, s.stop) for s in program.stages}
    return {i: pair_item(costs, rng[ins.chunk], rng[ins.chunk2])
            for i, ins in enumerate(program.instructions) if ins.op == Op.FB}


def overlap_fits(costs, programs, medians: dict[str, float]) -> list[float]:
    """Per measured ``FB`` pair, the compute slowdown ``s`` at which the pair's replay
    (:func:`tessera.sched.chunkdag.replay_pair`, the plan's stored order) on the profiled task
    times matches the pair's measured median: the interference of co-executed communication on
    compute, calibrated from measurement (bisection on ``s`` in [0.25, 8]; the makespan grows
    with ``s``). Pairs whose measured time lies outside the replay's range at the bounds are
    left out."""
    from dataclasses import replace

    from tessera.cost.profile_costs import profiled_costs
    from tessera.program.instructions import Op
    from tessera.sched.chunkdag import replay_pair

    timed, _ = profiled_costs(costs, medians)
    timed = replace(timed, measured_pairs=())  # the replay composes the pair from task times
    out = []
    for prog in programs:
        rng = {s.chunk: (s.start, s.stop) for s in prog.stages}
        items = pair_items(costs, prog)
        for i, ins in enumerate(prog.instructions):
            if ins.op != Op.FB or items[i] not in medians:
                continue
            order = prog.pair_orders[ins.order].order if ins.order >= 0 else None

            def makespan(s: float) -> float:
                return replay_pair(replace(timed, overlap_slowdown=s), rng[ins.chunk], rng[ins.chunk2], ins.with_w,
                                   order)[1].makespan

            want, lo, hi = medians[items[i]], 0.25, 8.0
            if not makespan(lo) <= want <= makespan(hi):
                continue
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if makespan(mid) < want else (lo, mid)
            out.append((lo + hi) / 2)
    return out


def analytic_medians(costs) -> dict[str, float]:
    """Task item -> the median analytic time of the tasks it stands for, ms."""
    from tessera.cost.profile_costs import task_signatures
    from tessera.cost.types import TaskKey

    sig = task_signatures(costs)
    by_item: dict[str, list[float]] = {}
    for lc in (costs.embed, *costs.layers, costs.head):
        for t in lc.tasks:
            by_item.setdefault(sig[str(TaskKey(t.phase.value, lc.index, t.kind.value))], []).append(t.ms)
    return {k: statistics.median(v) for k, v in by_item.items()}


def _pairs_by_kind(costs, medians: dict[str, float], phase: bool = False) -> dict[str, list[tuple[float, float]]]:
    """Task kind (``phase``: ``"<phase>.<kind>"``) -> ``(analytic, measured)`` ms of every timed
    task item of that group."""
    from tessera.cost.profile_costs import item_kind

    analytic = analytic_medians(costs)
    out: dict[str, list[tuple[float, float]]] = {}
    for item, ms in medians.items():
        if item in analytic and ms > 0 and analytic[item] > 0:
            out.setdefault(_group(item) if phase else item_kind(item), []).append((analytic[item], ms))
    return out


def _group(item: str) -> str:
    """``"F.DE.expert"`` -> ``"F.expert"``: the calibration group of a task item."""
    from tessera.cost.profile_costs import item_kind

    return f"{item.split('.', 1)[0]}.{item_kind(item)}"


def _l1_scale(pairs: list[tuple[float, float]]) -> float:
    """The ``s`` minimising ``sum |a s - m| / m`` over ``(a, m)`` pairs: ``sum (a/m) |s - m/a|`` is
    a weighted L1 distance, so ``s`` is the weighted median of ``m/a`` with weights ``a/m``."""
    pts = sorted((m / a, a / m) for a, m in pairs)
    half, acc = sum(w for _, w in pts) / 2, 0.0
    for q, w in pts:
        acc += w
        if acc >= half:
            return q
    return pts[-1][0]


def calibration_scales(costs, medians: dict[str, float]) -> dict[str, float]:
    """Per phase and task kind (``"F.expert"``, ``"B.mixer"``, ...), the scale ``s`` of the analytic
    time that minimises the mean relative error ``|analytic * s - measured| / measured`` over the
    group's timed items (``costs``: the analytic costs; ``medians``: item -> measured ms; an L1
    fit, the weighted median of ``measured / analytic``: :func:`_l1_scale`), so the report's error
    after the scales is never above the error before them. The factors tune the analytic model's
    time of each phase of each kind to this device (stored as ``"calib:<phase>.<kind>"``, used for
    items the profile lacks)."""
    return {k: _l1_scale(v) for k, v in sorted(_pairs_by_kind(costs, medians, phase=True).items())}


def calibration(costs, medians: dict[str, float], scales: dict[str, float] | None = None) -> dict[str, dict]:
    """Analytic vs measured per task kind: for every timed task item, the relative error
    ``|analytic - measured| / measured`` of the analytic median time of its tasks, grouped by kind:
    ``{"mean_err", "max_err", "n", "scales", "mean_err_fit", "max_err_fit"}``; ``scales`` maps the
    kind's phases to their scale (``scales`` argument, keyed ``"<phase>.<kind>"``, default
    :func:`calibration_scales` of the same items: an in-sample fit) and the ``_fit`` errors are those
    of the analytic time times its phase's scale."""
    from tessera.cost.profile_costs import item_kind

    analytic = analytic_medians(costs)
    scales = calibration_scales(costs, medians) if scales is None else scales
    rows: dict[str, list[tuple[float, float, float]]] = {}
    used: dict[str, dict[str, float]] = {}
    for item, m in medians.items():
        a = analytic.get(item, 0.0)
        if a > 0 and m > 0:
            g, kind = _group(item), item_kind(item)
            s = scales.get(g, 1.0)
            rows.setdefault(kind, []).append((abs(a - m) / m, abs(a * s - m) / m, s))
            used.setdefault(kind, {})[g.split(".", 1)[0]] = s
    out = {}
    for k, v in sorted(rows.items()):
        out[k] = {"mean_err": sum(r[0] for r in v) / len(v), "max_err": max(r[0] for r in v), "n": len(v),
                  "scales": dict(sorted(used[k].items())),
                  "mean_err_fit": sum(r[1] for r in v) / len(v), "max_err_fit": max(r[1] for r in v)}
    return out
