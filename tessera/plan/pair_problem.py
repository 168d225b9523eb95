"""Array form of one pair-scheduling problem, its semi-active evaluation and a makespan lower bound.

Shared by the list scheduler (:mod:`tessera.plan.pair_scheduler`) and its local search
(:mod:`tessera.plan.pair_polish`). A :class:`PairProblem` holds a :class:`TaskDAG` as flat tuples
indexed by task id (durations in ms, resources as small ints, predecessor and successor lists),
so that one evaluation of an order is a single allocation-light pass.

An *order* is a list per resource index of the task ids that resource runs, in sequence. Its
*semi-active* schedule starts every task as early as its resource predecessor and its
dependencies allow (what :func:`tessera.sched.dag.run_in_order` computes).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tessera.cost.types import Resource
from tessera.sched.dag import TaskDAG

EPS = 1e-9  # ms; slack for comparisons of accumulated float times
INF = float("inf")

Order = list[list[int]]  # per resource index, the task ids in sequence
Score = tuple[float, float, float]  # (total lateness, makespan, sum of ends), ms; smaller is better


@dataclass(frozen=True)
class PairProblem:
    """Read-only arrays of one DAG (index = task id; times in ms).

    Attributes:
        resources: resources present, in :class:`Resource` order; ``res[i]`` indexes it.
        ms, res, preds, succs: duration, resource index, dependencies, dependants.
        movable: task may run in any gap (W); nothing non-movable waits for it, usually.
        forward: task belongs to the forward chain of the pair (``Task.side == "F"``).
        due: deadline of a movable task, ``INF`` when none (the end of the pair bounds it).
        has_due: some task has a finite deadline.
        topo: a topological order (Kahn, ties by id).
        head: longest dependency chain before each task (earliest start), ms.
        tail: longest chain from each task's start to the end, its own ``ms`` included, ms.
        lower_bound: no schedule is shorter (critical path, one-machine preemptive bounds), ms.
    """

    resources: tuple[Resource, ...]
    ms: tuple[float, ...]
    res: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    movable: tuple[bool, ...]
    forward: tuple[bool, ...]
    due: tuple[float, ...]
    has_due: bool
    topo: tuple[int, ...]
    head: tuple[float, ...]
    tail: tuple[float, ...]
    lower_bound: float

    @property
    def n(self) -> int:
        return len(self.ms)

    @staticmethod
    def build(dag: TaskDAG) -> "PairProblem":
        """Arrays of ``dag``; raises ValueError on a cycle (from :meth:`TaskDAG.topo_order`)."""
        tasks = dag.tasks
        n = len(tasks)
        resources = tuple(r for r in Resource if any(t.resource == r for t in tasks))
        ridx = {r: k for k, r in enumerate(resources)}
        succs = dag.successors()
        topo = dag.topo_order()
        ms = tuple(t.ms for t in tasks)
        movable = tuple(t.movable for t in tasks)
        head = [0.0] * n
        for i in topo:
            for d in tasks[i].deps:
                if head[d] + ms[d] > head[i]:
                    head[i] = head[d] + ms[d]
        tail = [0.0] * n
        for i in reversed(topo):
            tail[i] = ms[i] + max((tail[s] for s in succs[i]), default=0.0)
        res = tuple(ridx[t.resource] for t in tasks)
        due = tuple(t.deadline_ms if t.movable and t.deadline_ms is not None else INF for t in tasks)
        lb = max(tail, default=0.0)
        for r in range(len(resources)):
            lb = max(lb, preemptive_bound([(head[i], ms[i], tail[i] - ms[i]) for i in range(n) if res[i] == r]))
        return PairProblem(resources, ms, res, tuple(t.deps for t in tasks), succs, movable,
                           tuple(t.side == "F" for t in tasks), due,
                           any(d < INF for d in due), topo, tuple(head), tuple(tail), lb)


def preemptive_bound(jobs: list[tuple[float, float, float]]) -> float:
    """Makespan lower bound of one unary resource with release (head), duration and delivery
    (tail) times, ms: Jackson's preemptive schedule (always run the released job with the largest
    delivery time), the optimum of the preemptive one-machine relaxation (Carlier, "The
    one-machine sequencing problem", EJOR 1982; the classic job-shop bound)."""
    if not jobs:
        return 0.0
    jobs = sorted(jobs)
    left = [0.0] * len(jobs)
    heap: list[tuple[float, int]] = []
    t, k, best = 0.0, 0, 0.0
    while k < len(jobs) or heap:
        if not heap and jobs[k][0] > t:
            t = jobs[k][0]
        while k < len(jobs) and jobs[k][0] <= t + EPS:
            left[k] = jobs[k][1]
            heapq.heappush(heap, (-jobs[k][2], k))
            k += 1
        q, j = heap[0]
        nxt = jobs[k][0] if k < len(jobs) else INF
        if t + left[j] <= nxt + EPS:  # runs to completion before the next release
            t += left[j]
            heapq.heappop(heap)
            best = max(best, t - q)
        else:  # preempted at the next release
            left[j] -= nxt - t
            t = nxt
    return best


def run_order(p: PairProblem, order: Order, absent: int = -1
              ) -> tuple[list[float], list[float], list[int]] | None:
    """Semi-active schedule of ``order``: (start, end, sequence) with times in ms and
    ``sequence`` the tasks in the order they were timed (a topological order of the dependencies
    plus the resource orders); None if the order contradicts the dependencies (a task would wait
    for one queued behind it).

    ``order`` lists every task, or every task but ``absent``, a task without dependants that is
    then left out (start 0, end 0)."""
    ms, preds = p.ms, p.preds
    n = len(ms)
    start = [0.0] * n
    end = [-1.0] * n
    timed: list[int] = []
    pos = [0] * len(order)
    free = [0.0] * len(order)
    todo = n
    if absent >= 0:
        end[absent] = 0.0
        todo -= 1
    while todo:
        moved = False
        for k, seq in enumerate(order):
            q, t, m = pos[k], free[k], len(seq)
            while q < m:
                i = seq[q]
                s = t
                for d in preds[i]:
                    e = end[d]
                    if e < 0.0:
                        break
                    if e > s:
                        s = e
                else:
                    start[i] = s
                    t = end[i] = s + ms[i]
                    timed.append(i)
                    q += 1
                    continue
                break
            if q != pos[k]:
                todo -= q - pos[k]
                pos[k], free[k] = q, t
                moved = True
        if not moved:
            return None
    return start, end, timed


def score_of(p: PairProblem, end: list[float]) -> Score:
    """(total deadline overrun of movable tasks, makespan, sum of ends), ms; smaller is better."""
    late = 0.0
    if p.has_due:
        for i, d in enumerate(p.due):
            if end[i] > d:
                late += end[i] - d
    return late, max(end), sum(end)


def order_of_starts(p: PairProblem, start: list[float], end: list[float]) -> Order:
    """Per-resource order sorted by (start, end, id)."""
    order: Order = [[] for _ in p.resources]
    for i in sorted(range(len(p.ms)), key=lambda i: (start[i], end[i], i)):
        order[p.res[i]].append(i)
    return order


def proven_optimal(p: PairProblem, sc: Score) -> bool:
    """No deadline missed and the makespan reaches :attr:`PairProblem.lower_bound`."""
    return sc[0] <= EPS and sc[1] <= p.lower_bound + EPS
