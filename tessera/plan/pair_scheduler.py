"""Pair scheduler: order the tasks of one overlapped F&B pair on the rank's unary resources.

A pair DAG (:func:`tessera.sched.chunkdag.pair_dag`) holds two independent chains (the forward
of one chunk, the backward of another) and movable W tasks that depend on their B tasks. Each
resource (compute, EP comm, PP comm) runs one task at a time, without preemption. Goal: the
smallest makespan with every task done, W included, each movable task by its ``deadline_ms``
(``None``: by the end of the pair). Times in ms.

Method (Tessera, OSDI 2026, §4 "core method": an event-driven
scheduler with backbone-first and gap-fit rules, much faster than an ILP per instance):

0. *Merge seed*: :meth:`PairProblem.build` solves the relaxation where one resource stays unary
   and the others have unlimited capacity exactly (:func:`tessera.plan.pair_problem.
   chain_merge_bound`: the best merge of the two chains' A2As); step 1 with that resource's
   sequence fixed to the merge. When that reaches the lower bound (many EP-bound pairs: of the
   distinct Qwen3-Next-80B ep 32 pairs, 160 of 322 without W and 46 of 322 with W on the
   analytic cost model) nothing else runs.
1. *Backbone first, gap-fit* (:func:`list_schedule`): Giffler-Thompson (Oper. Res. 1960)
   event-driven list scheduling under a few rules (:data:`VARIANTS`): critical-path priority
   (``PairProblem.tail``), optionally one chain's tasks first, a conflict window ``alpha`` per
   resource (0: non-delay; 1: active schedules). Movable tasks rank after every backbone task:
   they start only when no backbone task of their resource is ready (``eager``), or only in a
   gap they fit entirely (strict gap-fit); one that fits nowhere is deferred to the end and
   placed by step 3.
2. *Chain interleaving* (:func:`tessera.plan.pair_polish.sequence_search`): for the first
   :data:`SEQUENCE_SEEDS` rules, hill-climb the order of the busiest communication resource
   (shift an A2A past up to three A2As of the other chain) and list-schedule everything else
   around it: the look-ahead a list rule lacks when a critical forward A2A must go before a
   ready backward one.
3. *Delay and backfill* (:func:`tessera.plan.pair_polish.tabu_search`): for the first
   :data:`SEEDS` rules (after step 2) and the merge seed, ``polish`` tabu steps (default: one
   per task, ending after :data:`TABU_PATIENCE` steps without a shorter makespan) that swap
   adjacent critical tasks of one resource or re-insert a critical W where it lengthens the
   makespan least.

Every stage stops once the schedule reaches :attr:`PairProblem.lower_bound` (it is optimal
then). The result is the semi-active run (:func:`run_in_order`) of the best per-resource order
(score: deadline lateness, makespan, sum of ends); everything is deterministic. The exact
optimum is :mod:`tessera.plan.pair_ilp`; validation is :func:`check_schedule`
(:mod:`tessera.plan.schedule_check`). Quality and speed against the ILP over every distinct pair
of the Qwen3-Next-80B plans: ``benchmarks/pair_gap.py`` and ``docs/planner.md``. Which seeds
are refined and the budgets were chosen on those pairs (``benchmarks/pair_gap.py``): refining the
third rule (``B/c1/e``) or searching the sequence of the second never found a shorter schedule
there, refining the merge seed did.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

from tessera.plan.pair_polish import sequence_search, tabu_search
from tessera.plan.pair_problem import EPS, INF, Order, PairProblem, Score, proven_optimal, run_order, score_of
from tessera.plan.schedule_check import check_schedule
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order
from tessera.spec.tasks import Resource

__all__ = ["SchedulerVariant", "VARIANTS", "check_schedule", "list_schedule", "priority_ranks", "schedule_pair"]


@dataclass(frozen=True)
class SchedulerVariant:
    """One rule for the event-driven pass (step 1).

    Attributes:
        name: short id used in reports.
        chain: ``""`` (critical path only), ``"F"`` or ``"B"`` (that chain's backbone tasks rank
            before the other's, critical path inside each), or ``"due"`` (movable tasks with a
            deadline rank first, earliest deadline first: pulls them into the main stream).
        alpha: conflict window on the compute resource, in [0, 1]; 0: non-delay, 1: active.
        alpha_comm: conflict window on the communication resources.
        eager: movable tasks start whenever nothing more urgent can (not only in gaps).
    """

    name: str
    chain: str = ""
    alpha: float = 0.0
    alpha_comm: float = 0.0
    eager: bool = False


VARIANTS: tuple[SchedulerVariant, ...] = (
    SchedulerVariant("F/e", "F", eager=True),
    SchedulerVariant("cp/c.5/e", alpha_comm=0.5, eager=True),
    SchedulerVariant("B/c1/e", "B", alpha_comm=1.0, eager=True),
    SchedulerVariant("cp/a1c.5", alpha=1.0, alpha_comm=0.5),
    SchedulerVariant("due/e", "due", eager=True),
)

SEEDS = 2  # the first SEEDS rules' results (and the merge seed's) are refined by step 3
SEQUENCE_SEEDS = 1  # the first SEQUENCE_SEEDS of them by step 2 before
SEQUENCE_EVALS = 64  # most trial sequences of one sequence search (step 2)
TABU_PATIENCE: int | None = 20  # a tabu search ends after this many steps without a shorter makespan


def schedule_pair(dag: TaskDAG, variants: Sequence[SchedulerVariant] = VARIANTS,
                  polish: int | None = None) -> TaskSchedule:
    """Schedule one pair DAG: merge seed, list scheduling, chain interleaving search, tabu
    polish (see the module docstring); at most ``1 + len(variants) + SEQUENCE_SEEDS *
    SEQUENCE_EVALS`` list passes and ``(SEEDS + 1) * polish`` tabu steps.

    Args:
        dag: the pair's tasks (durations in ms).
        variants: list-scheduling rules to try (default :data:`VARIANTS`); the first
            :data:`SEEDS` are refined; the merge seed ranks tasks by the first.
        polish: tabu steps per refined seed in step 3 (default: one per task; 0: steps 2 and 3
            off, the best of the merge seed and the rules).

    Returns:
        TaskSchedule (ms) whose per-resource order is sorted by start time; replaying the order
        with :func:`run_in_order` gives the same times.

    Raises:
        ValueError: on a cyclic DAG, or if no schedule found meets every deadline of the movable
            tasks.
    """
    if not dag.tasks:
        return TaskSchedule((), (), 0.0, ())
    if not variants:
        raise ValueError("schedule_pair needs at least one variant")
    p = PairProblem.build(dag)
    steps = p.n if polish is None else polish
    found: list[tuple[Score, int, Order, tuple[list[int], bool]]] = []
    zero = (0.0,) * len(p.resources)
    merged = None  # step 0: the merge seed, ranked by the first rule, no conflict window, gap-fit
    if p.merge is not None:
        rank = priority_ranks(p, variants[0].chain)
        out = list_schedule(p, rank, zero, p.merge, eager=False)
        if out is not None:
            merged = (score_of(p, out[1]), -1, out[0], (rank, False))
            if proven_optimal(p, merged[0]):
                return _schedule(dag, p, out[0])
    for k, v in enumerate(variants):
        rank = priority_ranks(p, v.chain)
        alpha = tuple(v.alpha if r == Resource.COMPUTE else v.alpha_comm for r in p.resources)
        out = list_schedule(p, rank, alpha, eager=v.eager)
        assert out is not None  # no fixed sequence: every task is scheduled
        found.append((score_of(p, out[1]), k, out[0], (rank, v.eager)))
        if proven_optimal(p, found[-1][0]):
            break
    best_sc, _, best, _ = min(found + ([merged] if merged else []), key=lambda x: (x[0], x[1]))
    if steps > 0 and not proven_optimal(p, best_sc):
        comm = _busiest_comm(p)
        seeds = [(x, k < SEQUENCE_SEEDS) for k, x in enumerate(found[:SEEDS])] + ([(merged, False)] if merged else [])
        for (sc, _, order, (rank, eager)), seq_search in seeds:
            if comm >= 0 and seq_search:
                relist = partial(list_schedule, p, rank, zero, eager=eager)
                sc, order = sequence_search(p, order, sc, comm, relist, SEQUENCE_EVALS)
            if not proven_optimal(p, sc):
                sc, order = tabu_search(p, order, sc, steps, patience=TABU_PATIENCE)
            if sc < best_sc:
                best_sc, best = sc, order
            if proven_optimal(p, best_sc):
                break
    if best_sc[0] > EPS:
        late = [dag.tasks[i].name for i in range(p.n) if p.due[i] < INF and _end(p, best)[i] > p.due[i] + EPS]
        raise ValueError(f"pair scheduler cannot meet the deadlines of movable tasks {late[:5]} "
                         f"(total lateness {best_sc[0]:.6g} ms)")
    return _schedule(dag, p, best)


def _schedule(dag: TaskDAG, p: PairProblem, order: Order) -> TaskSchedule:
    """The semi-active schedule (ms) of a per-resource order."""
    return run_in_order(dag, {p.resources[r]: tuple(seq) for r, seq in enumerate(order)})


def _busiest_comm(p: PairProblem) -> int:
    """Index of the communication resource with the most load (ms), -1 if there is none."""
    load = [0.0] * len(p.resources)
    for i, r in enumerate(p.res):
        load[r] += p.ms[i]
    comm = [r for r, res in enumerate(p.resources) if res != Resource.COMPUTE and load[r] > 0.0]
    return max(comm, key=lambda r: (load[r], -r), default=-1)


def _end(p: PairProblem, order: Order) -> list[float]:
    out = run_order(p, order)
    assert out is not None
    return out[1]


def priority_ranks(p: PairProblem, chain: str = "") -> list[int]:
    """Rank of every task, 0 = most urgent: backbone before movable tasks (``chain="due"``:
    movable tasks with a deadline first, earliest first), ``chain`` (``"F"``/``"B"``) before the
    other chain, then longest remaining path (``PairProblem.tail``), then id."""
    def key(i: int) -> tuple:
        mov = p.movable[i]
        if chain == "due":
            first = (0, p.due[i]) if mov and p.due[i] < INF else (1 if not mov else 2, 0.0)
        else:
            first = (1 if mov else 0, 0.0)
        side = 0 if not chain or chain == "due" else (0 if p.forward[i] == (chain == "F") else 1)
        return first, side, -p.tail[i], i
    order = sorted(range(p.n), key=key)
    rank = [0] * p.n
    for k, i in enumerate(order):
        rank[i] = k
    return rank


def list_schedule(p: PairProblem, rank: Sequence[int], alpha: Sequence[float],
                  fixed: tuple[int, Sequence[int]] | None = None, eager: bool = False
                  ) -> tuple[Order, list[float]] | None:
    """One event-driven (Giffler-Thompson) list-scheduling pass over all tasks.

    Each step takes the ready backbone task that can end first (ties: rank) and, on its resource
    ``r``, the most urgent ready backbone task (lowest rank) among those that can start by
    ``lo + alpha[r] * (that end - lo)`` (``lo``: the earliest start on ``r``). If that task would
    leave ``r`` idle before it starts, the most urgent ready movable task that fits entirely in
    that gap runs first (gap-fit); a movable task that fits nowhere waits until no backbone task
    is ready (deferred to the end). Backbone tasks that are ready later have a later release than
    the chosen end, so a gap-fit task never delays one.

    Args:
        p: the problem.
        rank: per task, 0 = most urgent (:func:`priority_ranks`).
        alpha: conflict window per resource index, in [0, 1].
        fixed: ``(r, sequence)``: resource ``r`` runs exactly ``sequence`` in that order.
        eager: movable tasks compete like backbone ones (at their rank, the lowest): one starts
            whenever it is the most urgent task that can start in the window, gap or not.

    Returns:
        (per-resource order, end times in ms); None if ``fixed`` contradicts the dependencies.
    """
    ms, res, preds, succs, movable = p.ms, p.res, p.preds, p.succs, p.movable
    n = len(ms)
    missing = [len(x) for x in preds]
    rel = [0.0] * n  # latest end of the dependencies scheduled so far
    end = [0.0] * n
    free = [0.0] * len(p.resources)
    order: Order = [[] for _ in p.resources]
    gate = [True] * n  # False: waits for its turn in the fixed sequence
    fr, fseq, fpos = -1, (), 0
    if fixed is not None:
        fr, fseq = fixed
        for i in fseq:
            gate[i] = False
        if fseq:
            gate[fseq[0]] = True
    ready = [i for i in range(n) if not missing[i] and gate[i]]
    lead = [True] * n if eager else [not m for m in movable]  # competes in the main window
    nres = len(free)
    done = 0
    while ready:
        be, star, bb = INF, -1, False  # earliest end, its task, it leads; leading tasks first
        lo_lead, lo_rest = [INF] * nres, [INF] * nres  # earliest release per resource and class
        for i in ready:
            ri = res[i]
            x = rel[i]
            s = free[ri]
            if x > s:
                s = x
            e = s + ms[i]
            if lead[i]:
                if x < lo_lead[ri]:
                    lo_lead[ri] = x
                if not bb or e < be - EPS or (e <= be + EPS and rank[i] < rank[star]):
                    be, star, bb = e, i, True
            else:
                if x < lo_rest[ri]:
                    lo_rest[ri] = x
                if not bb and (e < be - EPS or (e <= be + EPS and rank[i] < rank[star])):
                    be, star = e, i
        r = res[star]
        f = free[r]
        lo = lo_lead[r] if bb else lo_rest[r]
        if f > lo:
            lo = f
        limit = lo + alpha[r] * (be - lo) - EPS
        if limit < lo + EPS:
            limit = lo + EPS
        pick = -1
        for i in ready:
            if res[i] == r and lead[i] == bb and rel[i] < limit and (pick < 0 or rank[i] < rank[pick]):
                pick = i
        s = rel[pick]
        if f > s:
            s = f
        if bb and not eager and s > f + EPS:  # gap-fit: a movable task that ends before the backbone task starts
            for i in ready:
                if res[i] == r and not lead[i] and (rel[i] if rel[i] > f else f) + ms[i] <= s + EPS and (
                        lead[pick] or rank[i] < rank[pick]):
                    pick = i
            if not lead[pick]:
                s = rel[pick] if rel[pick] > f else f
        ready.remove(pick)
        e = end[pick] = free[r] = s + ms[pick]
        order[r].append(pick)
        done += 1
        if r == fr:
            fpos += 1
            if fpos < len(fseq):
                j = fseq[fpos]
                gate[j] = True
                if not missing[j]:
                    ready.append(j)
        for j in succs[pick]:
            missing[j] -= 1
            if e > rel[j]:
                rel[j] = e
            if not missing[j] and gate[j]:
                ready.append(j)
    if done < n:
        return None
    return order, end
