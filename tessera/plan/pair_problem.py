"""Array form of one pair-scheduling problem, its semi-active evaluation and a makespan lower bound.

Shared by the list scheduler (:mod:`tessera.plan.pair_scheduler`) and its local search
(:mod:`tessera.plan.pair_polish`). A :class:`PairProblem` holds a :class:`TaskDAG` as flat tuples
indexed by task id (durations in ms, resources as small ints, predecessor and successor lists),
so that one evaluation of an order is a single allocation-light pass.

An *order* is a list per resource index of the task ids that resource runs, in sequence. Its
*semi-active* schedule starts every task as early as its resource predecessor and its
dependencies allow (what :func:`tessera.sched.dag.run_in_order` computes).

The lower bound is the largest of the critical path, Jackson's preemptive one-machine bound per
resource (:func:`preemptive_bound`) and, per resource whose tasks form one dependency chain per
side, the exact optimum of the two-chain merge relaxation (:func:`chain_merge_bound`), which
also gives the list scheduler its first seed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from tessera.sched.dag import TaskDAG
from tessera.spec.tasks import Resource

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
        lower_bound: no schedule is shorter (critical path, one-machine preemptive bounds, two-chain
            merge bound of :func:`chain_merge_bound`), ms.
        merge: ``(r, sequence)``: the order of resource ``r``'s tasks in the best merge found by
            :func:`chain_merge_bound` (the resource whose bound is largest), or None when no
            resource qualifies; a seed for list scheduling with a fixed sequence.
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
    merge: tuple[int, tuple[int, ...]] | None = None

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
        forward = tuple(t.side == "F" for t in tasks)
        lb = max(tail, default=0.0)
        merge, merge_lb = None, -INF
        for r in range(len(resources)):
            lb = max(lb, preemptive_bound([(head[i], ms[i], tail[i] - ms[i]) for i in range(n) if res[i] == r]))
            out = chain_merge_bound(ms, res, succs, topo, head, tail, forward, r)
            if out is not None and out[0] > merge_lb:
                merge_lb, merge = out[0], (r, out[1])
        lb = max(lb, merge_lb)
        return PairProblem(resources, ms, res, tuple(t.deps for t in tasks), succs, movable, forward, due,
                           any(d < INF for d in due), topo, tuple(head), tuple(tail), lb, merge)


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


def chain_merge_bound(ms: Sequence[float], res: Sequence[int], succs: Sequence[Sequence[int]],
                      topo: Sequence[int], head: Sequence[float], tail: Sequence[float],
                      forward: Sequence[bool], r: int) -> tuple[float, tuple[int, ...]] | None:
    """Makespan lower bound from resource ``r`` alone, ms, with the merge of its tasks that attains
    it; None unless the tasks of ``r`` on each side (``forward`` or not) form a chain of the
    dependencies (each depends, possibly through other tasks, on the previous one).

    Relaxation: ``r`` stays unary; every other resource gets unlimited capacity. Then a task of
    ``r`` starts no earlier than its head (longest chain before it), nor than the end of the
    previous task of its side plus the longest dependency path between the two (the *lag*); the
    makespan is at least every end plus the task's tail (longest chain after it). The sides'
    sequences are fixed by the dependencies, so a schedule of ``r`` is a merge of the two, and
    for a given merge the earliest (semi-active) times are optimal for this regular objective.
    :func:`_merge_dp` finds the best merge exactly, so its value is a valid lower bound (dropping
    constraints only lowers the optimum). This is the one-machine relaxation (Carlier 1982) with
    the chain structure and minimum time lags kept, which the preemptive bound
    (:func:`preemptive_bound`) loses: the resource must idle while both chains are busy
    elsewhere. On the EP-bound Qwen3-Next-80B ep 32 pairs it is the optimum for most pairs.
    """
    sides = ([i for i in topo if res[i] == r and forward[i]], [i for i in topo if res[i] == r and not forward[i]])
    if not sides[0] and not sides[1]:
        return None
    pos = [0] * len(ms)
    for k, i in enumerate(topo):
        pos[i] = k
    lags = []
    for seq in sides:
        lag = _chain_lags(ms, succs, topo, pos, seq)
        if lag is None:
            return None
        lags.append(lag)
    return _merge_dp(ms, head, tail, sides, lags)


def _chain_lags(ms: Sequence[float], succs: Sequence[Sequence[int]], topo: Sequence[int], pos: Sequence[int],
                seq: Sequence[int]) -> list[float] | None:
    """Per task of ``seq`` (in topological order), the longest dependency path from the end of
    the previous one to its start, ms (0.0 for the first); None if one is not reachable from the
    previous one (``seq`` is no chain)."""
    lag = [0.0] * len(seq)
    for k in range(1, len(seq)):
        a, b = seq[k - 1], seq[k]
        dist = {a: -ms[a]}  # longest path from the end of a to the start of x
        for x in topo[pos[a]:pos[b]]:
            dx = dist.get(x)
            if dx is None:
                continue
            dx += ms[x]
            for y in succs[x]:
                if dx > dist.get(y, -INF):
                    dist[y] = dx
        if b not in dist:
            return None
        lag[k] = dist[b]
    return lag


def _merge_dp(ms: Sequence[float], head: Sequence[float], tail: Sequence[float],
              sides: tuple[list[int], list[int]], lags: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """Least makespan over the merges of the two chains ``sides`` on one resource (the relaxation
    of :func:`chain_merge_bound`) and a merge attaining it.

    Dynamic program over the grid (tasks placed per side). A label holds the resource's free
    time, the earliest start of each side's next task (its head, or the previous task's end plus
    the lag), the makespan of the placed tasks, and a bound on the final makespan (that makespan,
    each next task's start plus its tail, and the latest release plus all remaining work). The
    makespan so far is set to 0 when the bound on the rest already exceeds it (then it does not
    matter). Labels are kept per cell as a Pareto set over the first four fields; a label whose
    bound reaches the greedy merge's makespan (next task that can start first, ties: longer
    tail) is dropped. Exact: a dominated or dropped label cannot lead to a better merge."""
    fs, bs = sides
    nf, nb = len(fs), len(bs)
    lf, lb = lags
    rem_f = [0.0] * (nf + 1)  # load of fs[a:], ms
    for a in range(nf - 1, -1, -1):
        rem_f[a] = rem_f[a + 1] + ms[fs[a]]
    rem_b = [0.0] * (nb + 1)
    for b in range(nb - 1, -1, -1):
        rem_b[b] = rem_b[b + 1] + ms[bs[b]]
    tf = [tail[i] for i in fs] + [-INF]
    tb = [tail[i] for i in bs] + [-INF]
    hf = [head[i] for i in fs] + [0.0]
    hb = [head[i] for i in bs] + [0.0]
    lf = list(lf) + [-INF]
    lb = list(lb) + [-INF]

    def step(a: int, b: int, lab: tuple, side: int) -> tuple:
        # label after placing the next task of side 0 (fs[a]) or 1 (bs[b]), fields as in the docstring
        t, rf, rb, cm = lab[0], lab[1], lab[2], lab[3]
        if side == 0:
            i = fs[a]
            e = (t if t > rf else rf) + ms[i]
            a += 1
            rf = e + lf[a]
            if hf[a] > rf:
                rf = hf[a]
        else:
            i = bs[b]
            e = (t if t > rb else rb) + ms[i]
            b += 1
            rb = e + lb[b]
            if hb[b] > rb:
                rb = hb[b]
        c = e + tail[i] - ms[i]
        if cm > c:
            c = cm
        fut = rf + tf[a]
        x = rb + tb[b]
        if x > fut:
            fut = x
        if a < nf or b < nb:
            lo = rf if a < nf and (b >= nb or rf < rb) else rb
            x = (e if e > lo else lo) + rem_f[a] + rem_b[b]
            if x > fut:
                fut = x
        return (e, rf, rb, c if c > fut else 0.0, c if c > fut else fut, lab, i)

    root = (0.0, hf[0] if nf else 0.0, hb[0] if nb else 0.0, 0.0, 0.0, None, -1)
    ub_lab, a, b = root, 0, 0
    while a < nf or b < nb:
        if b >= nb or (a < nf and (max(ub_lab[0], ub_lab[1]), -tf[a]) <= (max(ub_lab[0], ub_lab[2]), -tb[b])):
            ub_lab, a = step(a, b, ub_lab, 0), a + 1
        else:
            ub_lab, b = step(a, b, ub_lab, 1), b + 1
    ub = ub_lab[4]
    w = nb + 1
    grid: list[list[tuple]] = [[] for _ in range((nf + 1) * w)]
    grid[0].append(root)
    for a in range(nf + 1):
        for b in range(nb + 1):
            for lab in grid[a * w + b]:
                if a < nf:
                    nxt = step(a, b, lab, 0)
                    if nxt[4] < ub:
                        _add_label(grid[(a + 1) * w + b], nxt)
                if b < nb:
                    nxt = step(a, b, lab, 1)
                    if nxt[4] < ub:
                        _add_label(grid[a * w + b + 1], nxt)
    best = min(grid[-1], key=lambda x: x[4], default=ub_lab)
    seq_out: list[int] = []
    lab = best
    while lab[5] is not None:
        seq_out.append(lab[6])
        lab = lab[5]
    return best[4], tuple(reversed(seq_out))


def _add_label(labels: list[tuple], lab: tuple) -> None:
    """Insert ``lab`` into a Pareto set over its first four fields (all smaller is better)."""
    t, rf, rb, c = lab[0], lab[1], lab[2], lab[3]
    for x in labels:
        if x[0] <= t and x[1] <= rf and x[2] <= rb and x[3] <= c:
            return
    for k in range(len(labels) - 1, -1, -1):
        x = labels[k]
        if t <= x[0] and rf <= x[1] and rb <= x[2] and c <= x[3]:
            del labels[k]
    labels.append(lab)


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
