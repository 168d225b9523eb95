"""Iteration-aware refinement: a local search over stage boundaries with the simulator in the loop.

The partition MILP (:mod:`tessera.plan.milp`) minimises the costliest overlapped pair, the
paper's objective (Tessera §4). Users pay for the iteration, which also depends on the warm-up
and cool-down chunks, on each rank's total work and on where the bubbles fall; the bottleneck
pair does not see those. With ``planner.objective: iteration`` the planner therefore re-ranks
its starting points (the MILP optimum, the baseline partition and, where the head is heavy, the
balanced partitions with the embedding and/or the head alone) by the *simulated* iteration
time and improves the best one by moving single stage boundaries (``docs/planner.md``):

1. every start is evaluated (``evaluate(plan) -> ms``: the caller compiles, checks memory and
   simulates; ``inf`` for a plan that does not fit or is invalid); the search climbs from the
   fastest start and, while the budget lasts, from the others in turn (a second local optimum);
2. from a start, boundaries are moved by ``step`` extended layers (``step`` = 1, then 2), the
   moves that shrink the heavier neighbouring stage (by serial time) first, the most unbalanced
   boundary first, then the opposite moves (:func:`boundary_moves`), cycling over them; a move that lowers the iteration is taken
   at once (first improvement) and the cycle goes on from the next move, until a full cycle of
   every step finds nothing or the budget of ``max_evals`` evaluations is spent;
   once they find nothing, *shift* moves carry one layer from a stage of the busiest ranks to a
   stage of the least busy ones, every boundary between them moving by one
   (:func:`shift_moves`), the largest rank-load difference first;
3. each partition's pairs get the pair scheduler's orders (:func:`tessera.plan.pair_cost.best_pair`,
   memoised per (F range, B range)); the best partition is also tried with the template's fixed
   orders (no stored orders), and the faster of the two is kept.

Boundaries are over *extended* layers (index -1 is the embedding, ``num_layers`` the head); a
move keeps at least one decoder layer in every stage, except that stage 0 may hold the embedding
alone and the last stage the head alone (ranges the compiler and the engine run).

The search never returns a plan slower than its best start; the planner compares that with the
baseline (:func:`tessera.plan.planner.make_plan`) so that a plan it emits is never slower than
the baseline it replaces. Pure function of its arguments (the memo lives in the call): its
budget is counted in evaluations, so the same starts and the same ``evaluate`` give the same
plan however fast the machine runs it. Wall time (``time_budget_s``) is only a safety cap; a
search it stops is marked (``RefineResult.cap_hit``), because its plan then depends on the
machine's speed and load.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from tessera.cost.types import ModelCosts
from tessera.plan.candidates import stage_range_ok
from tessera.plan.overlap_graph import OverlapEdge
from tessera.plan.pair_cost import PairChoice, Scheduler, best_pair
from tessera.program.plan import Partition, Plan

Evaluate = Callable[[Plan], float]
"""A plan's simulated iteration time, ms (``inf``: the plan does not fit memory or is invalid)."""


@dataclass(frozen=True)
class RefineResult:
    """What :func:`refine` found.

    Attributes:
        plan: the best plan seen.
        iteration_ms: its evaluated iteration time, ms.
        start_ms: the evaluated iteration time of each start, ms, in the order given.
        evaluations: plans evaluated (starts included).
        moves: boundary moves taken.
        search_s: wall time, s.
        fixed_orders: the best plan runs the template's fixed pair orders (no stored orders).
        max_evals: the evaluation budget the search was given.
        cap_hit: the wall-clock safety cap (``time_budget_s``) stopped the search before it had
            converged or spent ``max_evals``: the plan depends on the machine's speed and load.
    """

    plan: Plan
    iteration_ms: float
    start_ms: tuple[float, ...]
    evaluations: int
    moves: int
    search_s: float
    fixed_orders: bool
    max_evals: int = 0
    cap_hit: bool = False


def with_scheduled_orders(plan: Plan, edges: Sequence[OverlapEdge], with_w: bool,
                          choose: Callable[[tuple[int, int], tuple[int, int]], PairChoice]) -> Plan:
    """``plan`` with the pair scheduler's order for every (F stage, B stage) pair its edges form
    (``choose(f_range, b_range)``: the chosen way to run that pair)."""
    part, orders, seen = plan.partition, [], set()
    for e in edges:
        key = (e.f_stage, e.b_stage)
        if key in seen:
            continue
        seen.add(key)
        ch = choose(part.stage_range(e.f_stage), part.stage_range(e.b_stage))
        orders.append(ch.pair_order(e.f_stage, e.b_stage, with_w))
    return replace(plan, pair_orders=tuple(orders))


def _has_layer(start: int, stop: int, num_layers: int) -> bool:
    """Extended range ``[start, stop)`` may be a stage: it holds a decoder layer, or it is the
    embedding alone (``[-1, 0)``) or the head alone (``[L, L+1)``), which the compiler runs
    (:func:`tessera.plan.candidates.stage_range_ok`)."""
    return stage_range_ok(start, stop, num_layers)


def boundary_moves(part: Partition, step: int, stage_ms: Sequence[float] | None = None) -> list[Partition]:
    """Partitions one boundary move of ``step`` extended layers away from ``part`` (inner
    boundaries only; every stage keeps a decoder layer, or is the embedding or the head alone). Without ``stage_ms``:
    boundary by boundary, ``-step`` before ``+step``. With ``stage_ms`` (each stage's serial
    time, ms): the moves that shrink the heavier of the two stages a boundary separates come
    first, the most unbalanced boundary first; then the opposite moves in the same order."""
    b = list(part.bounds)
    n = b[-1] - 1  # decoder layers
    toward, away = [], []
    for i in range(1, len(b) - 1):
        gap = 0.0 if stage_ms is None else stage_ms[i - 1] - stage_ms[i]  # > 0: the left stage is heavier
        for d in (-step, step):
            nb = b[i] + d
            if not (_has_layer(b[i - 1], nb, n) and _has_layer(nb, b[i + 1], n)):
                continue
            move = (abs(gap), i, d, Partition(tuple(b[:i] + [nb] + b[i + 1:])))
            (toward if stage_ms is not None and (d < 0) == (gap > 0) else away).append(move)
    if stage_ms is None:
        return [m[3] for m in away]
    return [m[3] for m in sorted(toward, key=lambda m: -m[0]) + sorted(away, key=lambda m: -m[0])]


def shift_moves(part: Partition, stage_ms: Sequence[float], stage_rank: Sequence[int],
                limit: int) -> list[Partition]:
    """Partitions that move one layer from a stage ``a`` to a stage ``c`` further away: every
    boundary between them moves by one, so the stages in between keep their sizes and shift
    (what a single boundary move cannot do: balance the *ranks*, whose loads are the sums of
    their stages' ``stage_ms`` under ``stage_rank``). The ``limit`` moves with the largest
    donor-rank minus receiver-rank load, positive ones only; every stage stays a valid range
    (:func:`_has_layer`)."""
    b, n = list(part.bounds), part.bounds[-1] - 1
    load: dict[int, float] = {}
    for s, ms in enumerate(stage_ms):
        load[stage_rank[s]] = load.get(stage_rank[s], 0.0) + ms
    scored = []
    for a in range(len(stage_ms)):
        for c in range(len(stage_ms)):
            gain = load[stage_rank[a]] - load[stage_rank[c]]
            if abs(a - c) < 2 or gain <= 0:
                continue
            lo, hi = min(a, c), max(a, c)
            d = -1 if a < c else 1  # the boundaries lo+1 .. hi move toward the donor
            nb = b[:lo + 1] + [x + d for x in b[lo + 1:hi + 1]] + b[hi + 1:]
            if all(_has_layer(nb[s], nb[s + 1], n) for s in range(len(nb) - 1)):
                scored.append((-gain, a, c, Partition(tuple(nb))))
    return [m[3] for m in sorted(scored)[:limit]]


def stage_serial_ms(costs: ModelCosts, part: Partition) -> list[float]:
    """Serial F+B+W time of each stage of ``part`` (one microbatch), ms."""
    return [sum(costs.serial_ms(i) for i in range(*part.stage_range(s))) for s in range(part.num_stages)]


def refine(costs: ModelCosts, starts: Sequence[Plan], evaluate: Evaluate, edges: Sequence[OverlapEdge],
           with_w: bool, scheduler: Scheduler, *, max_evals: int = 400, time_budget_s: float = math.inf,
           steps: Sequence[int] = (1, 2), stage_rank: Sequence[int] | None = None,
           shift_limit: int = 24) -> RefineResult:
    """Local search over stage boundaries for the lowest evaluated iteration (module docstring).

    Args:
        costs: per-task costs (for the pair scheduler).
        starts: plans to start from (at least one; same template and shape); evaluated in order.
        evaluate: a plan's iteration time, ms (:data:`Evaluate`).
        edges: the overlap edges of the template (the pairs whose orders a plan stores; empty
            without overlap).
        with_w: the B side of an FB carries its W tasks.
        scheduler: the pair scheduler (backbone-first + gap-fit).
        max_evals: the search budget, evaluations (starts included; the result depends on it,
            not on the machine's speed).
        time_budget_s: wall-clock safety cap, s; when it stops the search first,
            ``RefineResult.cap_hit`` is set.
        steps: boundary move sizes, tried in this order (a sweep with a larger step runs only
            when the smaller one finds nothing).
        stage_rank: the rank of every virtual stage (the template's placement); enables the
            rank-balancing :func:`shift_moves` (``shift_limit`` per round) once the boundary
            moves find nothing, and orders the moves by stage times scaled by their rank's
            factor (``ModelCosts.rank_scale``: work leaves a slowed rank first).

    Returns:
        :class:`RefineResult`; its plan is the best of the starts or better.

    Raises:
        ValueError: no starts.
    """
    if not starts:
        raise ValueError("refine needs at least one start plan")
    t0 = time.perf_counter()
    memo: dict[tuple[tuple[int, int], tuple[int, int]], PairChoice] = {}

    def choose(f_range, b_range) -> PairChoice:
        key = (f_range, b_range)
        if key not in memo:
            memo[key] = best_pair(costs, f_range, b_range, with_w, scheduler)
        return memo[key]

    evals = 0

    def score(plan: Plan) -> float:
        nonlocal evals
        evals += 1
        ms = evaluate(plan)
        return ms if ms == ms else math.inf  # NaN counts as infeasible

    start_ms = tuple(score(p) for p in starts)
    moves = 0

    capped = False

    def budget_left() -> bool:
        nonlocal capped
        if evals >= max_evals:
            return False
        if time.perf_counter() - t0 >= time_budget_s:  # the safety cap: the search wanted to go on
            capped = True
            return False
        return True

    def _moves(part: Partition, step) -> list[Partition]:
        ms = stage_serial_ms(costs, part)
        if costs.rank_scale and stage_rank is not None:  # a slowed rank's stages count heavier
            ms = [x * costs.scale_of(stage_rank[s]) for s, x in enumerate(ms)]
        if step == "shift":
            return shift_moves(part, ms, stage_rank, shift_limit)
        return boundary_moves(part, step, ms)

    kinds = tuple(steps) + (("shift",) if stage_rank is not None else ())

    def climb(plan: Plan, plan_ms: float) -> tuple[Plan, float]:
        nonlocal moves
        improved = True
        while improved and budget_left():
            improved = False
            for step in kinds:
                i = stale = 0  # cycle through the moves; stop after a full cycle without a gain
                while budget_left():
                    cands = _moves(plan.partition, step)
                    if not cands or stale >= len(cands):
                        break
                    part = cands[i % len(cands)]
                    i += 1
                    cand = with_scheduled_orders(replace(plan, partition=part), edges, with_w, choose)
                    ms = score(cand)
                    if ms < plan_ms - 1e-9:
                        plan, plan_ms, improved, stale = cand, ms, True, 0
                        moves += 1
                    else:
                        stale += 1
        return plan, plan_ms

    best, best_ms = None, math.inf
    for k in sorted(range(len(starts)), key=lambda i: start_ms[i]):  # the fastest start first
        if start_ms[k] == math.inf or (best is not None and not budget_left()):
            continue
        plan, ms = climb(starts[k], start_ms[k])
        if best is None or ms < best_ms - 1e-9:
            best, best_ms = plan, ms
    if best is None:  # no start fits: the first one, as it is
        best, best_ms = starts[0], start_ms[0]
    fixed = False
    if best.pair_orders and budget_left():
        plain = replace(best, pair_orders=())
        ms = score(plain)
        if ms < best_ms - 1e-9:
            best, best_ms, fixed = plain, ms, True
    return RefineResult(best, best_ms, start_ms, evals, moves, time.perf_counter() - t0, fixed, max_evals, capped)
