"""Validation of a pair schedule: the contract every scheduler of :mod:`tessera.plan` meets.

A valid :class:`TaskSchedule` of a :class:`TaskDAG` runs every task once for its duration on its
own resource (one task at a time per resource, no preemption), after all its dependencies, with
movable tasks done by their deadline; its per-resource order lists the tasks by start time and
its makespan is the latest end. Times in ms. Used by :func:`tessera.plan.pair_scheduler.schedule_pair`'s
tests, by :func:`tessera.plan.pair_ilp.solve_pair_ilp` (to validate a warm start) and by
``benchmarks/pair_gap.py``.
"""

from __future__ import annotations

from tessera.sched.dag import TaskDAG, TaskSchedule


def check_schedule(dag: TaskDAG, schedule: TaskSchedule, tol: float = 1e-6) -> None:
    """Validate a schedule of ``dag``; return None or raise ValueError naming the first fault.

    Checks: one start/end per task with ``end - start == ms`` and ``start >= 0``; every
    dependency ends before its dependant starts; the order lists every task exactly once on its
    own resource, sorted by start time; tasks on one resource do not overlap; movable tasks end by
    their deadline; the makespan is the latest end. ``tol`` is an absolute slack in ms.
    """
    n = len(dag.tasks)
    if len(schedule.start) != n or len(schedule.end) != n:
        raise ValueError(f"schedule has {len(schedule.start)} starts / {len(schedule.end)} ends for {n} tasks")
    for t in dag.tasks:
        s, e = schedule.start[t.id], schedule.end[t.id]
        if s < -tol:
            raise ValueError(f"{t.name} starts at {s} < 0")
        if abs(e - s - t.ms) > tol:
            raise ValueError(f"{t.name} runs {e - s} ms, its duration is {t.ms} ms")
        for d in t.deps:
            if schedule.end[d] > s + tol:
                raise ValueError(f"{t.name} starts at {s} before its dependency {dag.tasks[d].name} "
                                 f"ends at {schedule.end[d]}")
        if t.movable and t.deadline_ms is not None and e > t.deadline_ms + tol:
            raise ValueError(f"movable {t.name} ends at {e} after its deadline {t.deadline_ms}")
    seen = [False] * n
    for r, seq in schedule.order:
        prev = None
        for i in seq:
            if not 0 <= i < n or seen[i]:
                raise ValueError(f"order lists task {i} twice or out of range")
            if dag.tasks[i].resource != r:
                raise ValueError(f"{dag.tasks[i].name} runs on {dag.tasks[i].resource.value}, ordered on {r.value}")
            seen[i] = True
            if prev is not None:
                if schedule.start[i] < schedule.start[prev] - tol:
                    raise ValueError(f"order on {r.value} is not sorted by start at {dag.tasks[i].name}")
                if schedule.start[i] < schedule.end[prev] - tol:
                    raise ValueError(f"{dag.tasks[prev].name} and {dag.tasks[i].name} overlap on {r.value}")
            prev = i
    if not all(seen):
        raise ValueError(f"order misses {[dag.tasks[i].name for i in range(n) if not seen[i]][:5]}")
    if abs(schedule.makespan - max(schedule.end, default=0.0)) > tol:
        raise ValueError(f"makespan {schedule.makespan} is not the latest end {max(schedule.end, default=0.0)}")
