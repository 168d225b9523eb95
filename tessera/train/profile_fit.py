"""What a profile's measured items tell about the models that predicted them (job side).

* :func:`overlap_fits`: the compute slowdown under overlap, fitted per measured ``FB`` pair of
  the Program (``ModelCosts.overlap_slowdown``);
* :func:`calibration_scales`: per task kind, the scale ``measured / analytic`` (the median over
  the kind's timed items), stored with the profile as ``"calib:<kind>"`` items and applied to the
  analytic time of tasks the profile never timed (:func:`tessera.cost.profile_costs.profiled_costs`);
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


def _pairs_by_kind(costs, medians: dict[str, float]) -> dict[str, list[tuple[float, float]]]:
    """Task kind -> ``(analytic, measured)`` ms of every timed task item of that kind."""
    from tessera.cost.profile_costs import item_kind

    analytic = analytic_medians(costs)
    out: dict[str, list[tuple[float, float]]] = {}
    for item, ms in medians.items():
        if item in analytic and ms > 0 and analytic[item] > 0:
            out.setdefault(item_kind(item), []).append((analytic[item], ms))
    return out


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
    """Per task kind (``"expert"``, ``"mixer"``, ...), the scale ``s`` of the analytic time that
    minimises the mean relative error ``|analytic * s - measured| / measured`` over the kind's
    timed items (``costs``: the analytic costs; ``medians``: item -> measured ms; an L1 fit, the
    weighted median of ``measured / analytic``: :func:`_l1_scale`), so the report's error after the
    scale is never above the error before it. The factor tunes the analytic model's time of that
    kind to this device (stored as ``"calib:<kind>"``, used for items the profile lacks)."""
    return {k: _l1_scale(v) for k, v in sorted(_pairs_by_kind(costs, medians).items())}


def calibration(costs, medians: dict[str, float], scales: dict[str, float] | None = None) -> dict[str, dict]:
    """Analytic vs measured per task kind: for every timed task item, the relative error
    ``|analytic - measured| / measured`` of the analytic median time of its tasks, grouped by kind:
    ``{"mean_err", "max_err", "n", "scale", "mean_err_fit", "max_err_fit"}``, the ``_fit`` errors
    of the analytic time times ``scale`` (``scales``, default :func:`calibration_scales` of the
    same items: an in-sample fit)."""
    by_kind = _pairs_by_kind(costs, medians)
    scales = calibration_scales(costs, medians) if scales is None else scales
    out = {}
    for k, v in sorted(by_kind.items()):
        s = scales.get(k, 1.0)
        err = [abs(a - m) / m for a, m in v]
        fit = [abs(a * s - m) / m for a, m in v]
        out[k] = {"mean_err": sum(err) / len(err), "max_err": max(err), "n": len(v), "scale": s,
                  "mean_err_fit": sum(fit) / len(fit), "max_err_fit": max(fit)}
    return out
