"""Exact pair schedule: a disjunctive (big-M) MILP of the pair scheduling problem, solved by SCIP.

Same problem as :mod:`tessera.plan.pair_scheduler`: the tasks of one pair DAG on unary,
non-preemptive resources, precedence from ``Task.deps``, movable tasks ending by their
``deadline_ms``, minimise the makespan. The paper checks its scheduler against an ILP solved per
instance (CBC there; 1.07% / 0.76% apart on EP32 / EP8: Tessera, OSDI 2026, §6.5 and Fig. 13);
this is that check, with SCIP.

Formulation (times in ms):

* ``S_i`` start of task ``i``, ``head_i <= S_i <= UB - tail_i`` (``head_i``: longest dependency
  chain before ``i``; ``tail_i``: :meth:`TaskDAG.tail_lengths`; ``UB``: the warm start's makespan,
  by default the list scheduler's) and ``S_i + ms_i <= deadline_i``;
* ``S_j >= S_i + ms_i`` for every dependency ``i -> j``;
* for each pair ``i < j`` on one resource with no dependency path between them, a binary ``y_ij``
  (1: ``i`` first), ``S_i + ms_i <= S_j + M1 (1 - y_ij)`` and ``S_j + ms_j <= S_i + M2 y_ij`` with
  per-pair big-M from the bounds of ``S`` (``M1 = ub_i + ms_i - lb_j``); a pair the bounds
  already order gets one inequality and no binary;
* ``C >= S_i + ms_i`` for the sinks; ``C`` at least the critical path and, per resource,
  (earliest head + load + least remaining tail); one-machine cuts
  ``C >= S_i + ms_i + sum(ms_j [j after i on the resource]) + least remaining tail``;
* minimise ``C``.

SCIP starts from the warm start (``addSol``) with a fixed random seed. The warm start's makespan
bounds every start variable and so every big-M: a better one can shorten the solve a lot (see
``docs/planner.md``, "Exact pair ILP"). The solution's
per-resource order (by start) is replayed with :func:`run_in_order`, so the returned schedule is
semi-active and never longer than SCIP's objective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pyscipopt import Model, quicksum

from tessera.plan.pair_scheduler import schedule_pair
from tessera.plan.schedule_check import check_schedule
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order
from tessera.spec.tasks import Resource

_SEED = 0  # SCIP random seed shift (fixed: deterministic runs)


@dataclass(frozen=True)
class PairILPResult:
    """Result of :func:`solve_pair_ilp`.

    Attributes:
        schedule: best schedule found (ms); the warm start if SCIP found nothing shorter.
        optimal: SCIP proved optimality (within its default gap tolerances).
        gap: relative gap ``(primal - dual) / dual`` reported by SCIP at the end (0 when optimal).
        solve_s: wall-clock seconds of the call (default warm start, model build, solve).
        lower_bound_ms: SCIP's dual bound on the makespan, ms.
        num_binaries: number of disjunction binaries in the model.
    """

    schedule: TaskSchedule
    optimal: bool
    gap: float
    solve_s: float
    lower_bound_ms: float = 0.0
    num_binaries: int = 0


def solve_pair_ilp(dag: TaskDAG, time_limit_s: float = 60.0, *,
                   warm_start: TaskSchedule | None = None) -> PairILPResult:
    """Minimise the makespan of ``dag`` exactly with SCIP.

    Args:
        dag: the pair's tasks (ms).
        time_limit_s: SCIP wall-clock limit, seconds; on timeout the best schedule found so far is
            returned with ``optimal=False``.
        warm_start: a feasible schedule: the upper bound and SCIP's first incumbent (default:
            :func:`schedule_pair`).

    Returns:
        PairILPResult.

    Raises:
        ValueError: if ``warm_start`` is not a valid schedule of ``dag`` (see ``check_schedule``),
            or from :func:`schedule_pair` when no deadline-meeting schedule is found.
    """
    t0 = time.perf_counter()
    tasks = dag.tasks
    n = len(tasks)
    if n == 0:
        return PairILPResult(TaskSchedule((), (), 0.0, ()), True, 0.0, time.perf_counter() - t0)
    inc = schedule_pair(dag) if warm_start is None else warm_start
    check_schedule(dag, inc)  # the bounds below are only valid for a feasible warm start
    ub = inc.makespan
    topo = dag.topo_order()
    tail = dag.tail_lengths()
    succ = dag.successors()
    head = [0.0] * n
    anc = [0] * n  # bitset of ancestors
    for i in topo:
        for d in tasks[i].deps:
            head[i] = max(head[i], head[d] + tasks[d].ms)
            anc[i] |= anc[d] | (1 << d)
    lo = head
    hi = [max(lo[i], ub - tail[i]) for i in range(n)]
    for t in tasks:
        if t.movable and t.deadline_ms is not None:
            hi[t.id] = max(lo[t.id], min(hi[t.id], t.deadline_ms - t.ms))
    lb = max(tail)
    for r in Resource:
        on = [t.id for t in tasks if t.resource == r]
        if on:
            lb = max(lb, min(lo[i] for i in on) + sum(tasks[i].ms for i in on) + min(tail[i] - tasks[i].ms for i in on))
    lb = min(lb, ub)

    m = Model("pair_ilp")
    m.hideOutput()
    m.setParam("randomization/randomseedshift", _SEED)
    m.setParam("limits/time", float(time_limit_s))
    S = [m.addVar(f"S{i}", lb=lo[i], ub=hi[i]) for i in range(n)]
    C = m.addVar("C", lb=lb, ub=ub)
    for t in tasks:
        for d in t.deps:
            m.addCons(S[t.id] >= S[d] + tasks[d].ms)
        if not succ[t.id]:
            m.addCons(C >= S[t.id] + t.ms)
    y: dict[tuple[int, int], object] = {}
    for r in Resource:
        on = [t.id for t in tasks if t.resource == r]
        after: dict[int, list] = {i: [] for i in on}  # i -> terms "1 if j runs after i" times ms_j
        for a, i in enumerate(on):
            for j in on[a + 1:]:
                pi, pj = tasks[i].ms, tasks[j].ms
                if (anc[j] >> i) & 1 or (anc[i] >> j) & 1:  # ordered by the dependencies
                    first = i if (anc[j] >> i) & 1 else j
                elif lo[i] + pi > hi[j] + 1e-9 or lo[j] + pj > hi[i] + 1e-9:  # the bounds allow one order
                    first = j if lo[i] + pi > hi[j] + 1e-9 else i
                    second = i + j - first
                    m.addCons(S[second] >= S[first] + tasks[first].ms)
                else:
                    v = m.addVar(f"y{i}_{j}", vtype="B")
                    y[(i, j)] = v
                    m.addCons(S[i] + pi <= S[j] + (hi[i] + pi - lo[j]) * (1 - v))
                    m.addCons(S[j] + pj <= S[i] + (hi[j] + pj - lo[i]) * v)
                    after[i].append(pj * v)
                    after[j].append(pi * (1 - v))
                    continue
                after[first].append(tasks[i + j - first].ms)
        if len(on) > 1:  # one-machine cuts: what runs after i on r fits between i's end and C
            rest = min(tail[i] - tasks[i].ms for i in on)
            for i in on:
                m.addCons(C >= S[i] + tasks[i].ms + quicksum(after[i]) + rest)
    m.setObjective(C, "minimize")

    sol = m.createSol()
    for i in range(n):
        m.setSolVal(sol, S[i], inc.start[i])
    m.setSolVal(sol, C, ub)
    pos = {i: k for _, seq in inc.order for k, i in enumerate(seq)}
    for (i, j), v in y.items():
        m.setSolVal(sol, v, 1.0 if pos[i] < pos[j] else 0.0)
    m.addSol(sol, free=True)
    m.optimize()

    status = m.getStatus()
    best = inc
    if m.getNSols() > 0:
        bs = m.getBestSol()
        starts = [m.getSolVal(bs, S[i]) for i in range(n)]
        rank = {i: k for k, i in enumerate(topo)}
        order: dict[Resource, list[int]] = {}
        for i in sorted(range(n), key=lambda i: (round(starts[i], 7), rank[i])):
            order.setdefault(tasks[i].resource, []).append(i)
        cand = run_in_order(dag, {r: tuple(order[r]) for r in Resource if r in order})
        if cand.makespan < best.makespan:
            best = cand
    gap = 0.0 if status == "optimal" else float(m.getGap())
    dual = float(m.getDualbound())
    return PairILPResult(best, status == "optimal", gap, time.perf_counter() - t0, dual, len(y))
