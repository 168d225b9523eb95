"""The overlap-aware planner: baseline -> candidates -> overlap graph -> pair costs -> MILP -> Plan.

Tessera (OSDI 2026, §4 "core method"; ``docs/planner.md``):

1. the baseline plan: serial-balanced partition (:func:`tessera.plan.baseline.serial_balanced_partition`)
   and the template's fixed overlap order (:func:`tessera.sched.chunkdag.fixed_order`);
2. candidates: contiguous layer ranges within ``planner.candidate_radius`` layers of the baseline's
   stage boundaries (:func:`tessera.plan.candidates.stage_candidates`);
3. the overlap graph: the (F stage, B stage) pairs the template co-executes on each rank
   (:func:`tessera.plan.overlap_graph.overlap_edges`);
4. every candidate pair of every edge costed by the pair scheduler (backbone-first + gap-fit), or
   run back to back where overlapping does not pay (:func:`tessera.plan.pair_cost.best_pair`);
5. the SCIP partition MILP (:func:`tessera.plan.milp.solve_partition`), pruned at the bottleneck
   of the best feasible partition known (the baseline, improved by a boundary local search:
   :mod:`tessera.plan.incumbent`);
6. the Tessera plan: the chosen partition with the scheduler's task order for every pair it forms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from tessera.cost.types import ModelCosts
from tessera.plan.baseline import baseline_plan
from tessera.plan.candidates import candidates_of, exact_candidate_memory, stage_candidates
from tessera.plan.incumbent import local_search
from tessera.plan.milp import MilpResult, solve_partition
from tessera.plan.overlap_graph import OverlapEdge, PairCosts, bottleneck_ms, overlap_edges, pair_costs
from tessera.plan.pair_cost import best_pair
from tessera.plan.pair_scheduler import schedule_pair
from tessera.program.plan import Partition, Plan
from tessera.program.templates import get_template
from tessera.sched.chunkdag import replay_pair
from tessera.sched.dag import TaskDAG, TaskSchedule

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EdgeCost:
    """Cost of the pair one partition forms on one overlap edge, ms (``overlapped``: how it runs)."""

    rank: int
    f_stage: int
    b_stage: int
    ms: float
    overlapped: bool = True


@dataclass(frozen=True)
class PlanReport:
    """What :func:`make_plan` decided and why.

    Attributes:
        baseline, tessera: the two plans.
        baseline_edges: per overlap edge, the baseline partition's pair cost under the template's
            fixed order (what the baseline runs), ms.
        tessera_edges: per edge, the Tessera plan's pair cost under its chosen orders, ms.
        baseline_bottleneck_ms, tessera_bottleneck_ms: the largest of those (and of the serial
            F+B of stages in no edge), ms.
        baseline_own_ms: the baseline partition's bottleneck under the planner's own pair costs, ms.
        pruning_threshold_ms: the bottleneck of the best feasible partition known before the solve
            (the baseline improved by :func:`tessera.plan.incumbent.local_search`); the MILP drops
            pairs above it, which never removes the optimum, ms.
        milp: solver result (sizes before/after pruning, solve time).
        pairs_total, pairs_distinct: candidate pairs over all edges, and distinct DAGs scheduled.
        candidates: number of candidates over all stages.
        pair_cost_s: wall time to cost all pairs, s.
        with_w: W tasks are part of the pairs (W not split off).
    """

    baseline: Plan
    tessera: Plan
    baseline_edges: tuple[EdgeCost, ...]
    tessera_edges: tuple[EdgeCost, ...]
    baseline_bottleneck_ms: float
    tessera_bottleneck_ms: float
    baseline_own_ms: float
    pruning_threshold_ms: float
    milp: MilpResult
    pairs_total: int
    pairs_distinct: int
    candidates: int
    pair_cost_s: float
    with_w: bool


def pair_with_w(template: str, split_w: bool) -> bool:
    """Whether the B side of an FB instruction carries its W tasks: the template's
    :meth:`~tessera.program.templates.Template.pair_with_w` (DualPipeV keeps W inside its overlapped
    pairs; 1F1B and interleaved do exactly when W is not split off)."""
    return get_template(template).pair_with_w(split_w)


def _edge_costs_fixed(costs: ModelCosts, partition: Partition, edges: tuple[OverlapEdge, ...],
                      with_w: bool) -> tuple[EdgeCost, ...]:
    return tuple(EdgeCost(e.rank, e.f_stage, e.b_stage,
                          replay_pair(costs, partition.stage_range(e.f_stage), partition.stage_range(e.b_stage),
                                      with_w)[1].makespan) for e in edges)


def _unpaired_ms(pc: PairCosts, partition: Partition) -> list[float]:
    paired = pc.paired_stages()
    return [pc.f_ms[c] + pc.b_ms[c] for c in candidates_of(partition) if c.stage not in paired]


def plan_pair_schedule(costs: ModelCosts, plan: Plan, f_stage: int, b_stage: int) -> tuple[TaskDAG, TaskSchedule]:
    """The pair DAG of ``(F f_stage, B b_stage)`` under ``plan`` and the schedule the plan runs it
    with, ms: its :class:`PairOrder` replayed (without the overlap slowdown when the order is
    not overlapped), or the template's fixed order where the plan has none (the baseline).

    Raises:
        ValueError: a stage index outside the partition.
    """
    n = plan.partition.num_stages
    if not (0 <= f_stage < n and 0 <= b_stage < n):
        raise ValueError(f"pair (F S{f_stage}, B S{b_stage}) is outside the plan's {n} stages")
    f_range, b_range = plan.partition.stage_range(f_stage), plan.partition.stage_range(b_stage)
    for o in plan.pair_orders:
        if (o.f_stage, o.b_stage) == (f_stage, b_stage):
            return replay_pair(costs, f_range, b_range, o.with_w, o.order, o.overlapped)
    return replay_pair(costs, f_range, b_range, pair_with_w(plan.template, plan.split_w))


def make_plan(costs: ModelCosts, *, template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = True,
              split_w: bool = True, radius: int = 1, prune: bool = True, time_limit_s: float = 60.0,
              capacity_bytes: float | None = None, progress: Progress | None = None) -> PlanReport:
    """Plan a pipeline with the overlap-aware method and compare it with the baseline.

    Args:
        costs: per-task costs (any cost source).
        template, pp, vpp, num_microbatches, overlap, split_w: the pipeline shape (recipe).
        radius: candidate radius in layers around the baseline's stage boundaries.
        prune: profile-guided pruning before the MILP.
        time_limit_s: SCIP time limit, s.
        capacity_bytes: usable device memory per rank, bytes (``None``: no memory constraint).
        progress: ``progress(phase, done, total)`` for the pair-scheduling and solving phases.

    Returns:
        PlanReport with both plans; the Tessera plan's bottleneck is never above the baseline's
        (the baseline partition is a feasible MILP solution, given as the warm start).

    Raises:
        TesseraConfigError: memory makes every candidate partition infeasible (names the rank and
            GB), or the MILP finds no solution in time.
    """
    base = baseline_plan(costs, template, pp, vpp, num_microbatches, overlap=overlap, split_w=split_w)
    with_w = pair_with_w(template, split_w)
    edges = overlap_edges(template, pp, vpp, num_microbatches) if overlap else ()
    base_edges = _edge_costs_fixed(costs, base.partition, edges, with_w)
    L = len(costs.layers)
    cands = stage_candidates(base.partition, radius, L)
    t0 = time.perf_counter()
    pc = pair_costs(costs, cands, edges, schedule_pair, with_w, serial_fallback=True,
                    on_progress=(lambda d, n: progress("pairs", d, n)) if progress else None)
    pair_s = time.perf_counter() - t0
    base_choice = candidates_of(base.partition)
    threshold = bottleneck_ms(pc, base_choice)
    memory = None
    if capacity_bytes is not None:
        memory = exact_candidate_memory(costs, cands, template, pp, vpp, num_microbatches, overlap, split_w,
                                        pair_peak=pc.pair_peak)
    incumbent, inc_ms = base_choice, threshold
    if prune:
        incumbent, inc_ms = local_search(cands, pc, base_choice, memory, capacity_bytes)
    if progress:
        progress("milp", 0, 1)
    milp = solve_partition(cands, pc.pair_ms, memory, capacity_bytes, min(threshold, inc_ms), prune, time_limit_s,
                           stage_ms=pc.unpaired_stage_ms(), warm_start=incumbent)
    if progress:
        progress("milp", 1, 1)
    part = milp.partition
    orders, t_edges = [], []
    for e in edges:
        ch = best_pair(costs, part.stage_range(e.f_stage), part.stage_range(e.b_stage), with_w, schedule_pair)
        t_edges.append(EdgeCost(e.rank, e.f_stage, e.b_stage, ch.makespan_ms, ch.overlapped))
        if all((o.f_stage, o.b_stage) != (e.f_stage, e.b_stage) for o in orders):
            orders.append(ch.pair_order(e.f_stage, e.b_stage, with_w))
    tessera = Plan("tessera", template, pp, vpp, num_microbatches, part, overlap, split_w, tuple(orders))
    unpaired_base = _unpaired_ms(pc, base.partition)
    tess_unpaired = [pc.f_ms[c] + pc.b_ms[c] for c in milp.choice if c.stage not in pc.paired_stages()]
    return PlanReport(
        baseline=base, tessera=tessera, baseline_edges=base_edges, tessera_edges=tuple(t_edges),
        baseline_bottleneck_ms=max([e.ms for e in base_edges] + unpaired_base, default=0.0),
        tessera_bottleneck_ms=max([e.ms for e in t_edges] + tess_unpaired, default=0.0),
        baseline_own_ms=threshold, pruning_threshold_ms=min(threshold, inc_ms), milp=milp, pairs_total=pc.pairs_total, pairs_distinct=pc.pairs_distinct,
        candidates=sum(len(s) for s in cands), pair_cost_s=pair_s, with_w=with_w)
