"""The overlap-aware planner: baseline -> candidates -> overlap graph -> pair costs -> MILP -> Plan.

Tessera (OSDI 2026, §4 "core method"; ``docs/planner.md``):

1. the baseline plan: serial-balanced partition (:func:`tessera.plan.baseline.serial_balanced_partition`)
   and the template's fixed overlap order (:func:`tessera.sched.chunkdag.fixed_order`);
2. candidates: contiguous layer ranges within ``planner.candidate_radius`` layers of the baseline's
   stage boundaries (:func:`tessera.plan.candidates.stage_candidates`), with the head (embedding)
   alone on the last (first) stage where it is heavy enough (:func:`alone_pays`);
3. the overlap graph: the (F stage, B stage) pairs the template co-executes on each rank
   (:func:`tessera.plan.overlap_graph.overlap_edges`);
4. every candidate pair of every edge costed by the pair scheduler (backbone-first + gap-fit), or
   run back to back where overlapping does not pay (:func:`tessera.plan.pair_cost.best_pair`),
   times the compute factor of the edge's rank (``ModelCosts.rank_scale``:
   :func:`tessera.plan.overlap_graph.rank_scaled`);
5. the SCIP partition MILP (:func:`tessera.plan.milp.solve_partition`), pruned at the bottleneck
   of the best feasible partition known (the baseline, improved by a boundary local search:
   :mod:`tessera.plan.incumbent`);
6. the Tessera plan: the chosen partition with the scheduler's task order for every pair it forms;
7. ``objective="iteration"`` (the default of ``planner.objective``): the MILP optimum, the
   baseline partition and (where :func:`alone_pays`) the serial-balanced partitions with the head,
   the embedding or both alone (:func:`tessera.plan.baseline.alone_partition`) re-ranked by the simulated iteration and
   refined by a boundary local search with the simulator in the loop (:mod:`tessera.plan.refine`);
8. never slower: when the caller gives ``evaluate`` (the simulated iteration of a plan), a plan
   that is not faster than the baseline is replaced by the baseline partition with the baseline's
   own pair orders, and the report says so (``PlanReport.fallback``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from tessera.cost.types import ModelCosts
from tessera.plan.baseline import alone_partition, baseline_plan
from tessera.plan.candidates import candidates_of, exact_candidate_memory, stage_candidates
from tessera.plan.incumbent import local_search
from tessera.plan.milp import MilpResult, check_solver, solve_partition
from tessera.plan.overlap_graph import (OverlapEdge, PairCosts, bottleneck_ms, distinct_pairs, overlap_edges,
                                       pair_costs, rank_scaled)
from tessera.plan.pair_cost import best_pair
from tessera.plan.pair_scheduler import schedule_pair
from tessera.plan.partition_bound import PartitionBound
from tessera.plan.refine import Evaluate, RefineResult, refine, with_scheduled_orders
from tessera.plan.list_scheduler import list_schedule
from tessera.plan.synthesis import PREDICT_SLACK, SynthesisResult, synthesize
from tessera.program.compiler import compile_plan
from tessera.program.memory import rank_static_bytes
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
            fixed order (what the baseline runs), ms; every edge cost here and below is times
            its rank's factor (``ModelCosts.rank_scale``, a slowed rank's pairs cost more).
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
        objective: ``bottleneck`` (the paper's MILP objective) or ``iteration``.
        baseline_iteration_ms, tessera_iteration_ms: the two plans' evaluated (simulated)
            iteration times, ms; ``None`` without ``evaluate``.
        search: the iteration search (``objective="iteration"`` with ``evaluate``), else ``None``.
        fallback: why the Tessera plan is the baseline partition (no candidate beat the
            baseline's simulated iteration), or ``""``.
        alternatives: under ``auto`` (template, vpp, overlap, split W), every layout tried:
            ``(template, vpp, baseline_iteration_ms, tessera_iteration_ms, overlap, split_w)`` (filled by
            :func:`tessera.flow.plan_recipe`; empty otherwise).
        radius, radii_tried, widen_s: the candidate radius whose MILP optimum the plan starts
            from, every radius tried (``planner.candidate_radius`` first, widened by one while
            the optimum lies on the candidates' edge, the wider radii's distinct pair DAGs fit
            :data:`WIDEN_PAIRS` and the bottleneck dropped), and the seconds the widening took.
        alone: the MILP's candidates included the embedding alone and the head alone
            (:func:`alone_pays`).
        partition_bound: the least iteration any partition of the plan's shape (under ``auto``:
            of any layout tried) can reach (:mod:`tessera.plan.partition_bound`; filled by
            :func:`tessera.flow.partition_bound`, ``None`` otherwise).
        synthesis: the schedule synthesis (``planner.synthesis``, :func:`synthesize_jointly`):
            the Tessera plan's own rank orders where they beat the template's; ``None`` when it
            did not run.
        caps_hit: the phases a wall-clock safety cap stopped (``"milp"``: SCIP's or HiGHS's time
            limit, ``planner.time_limit_s``; ``"search"``: ``planner.search_time_s``; under
            ``auto`` with the layout, e.g. ``"search (zb-v vpp 2)"``); empty when the plan
            depends on its inputs only, not on the machine's speed and load. :attr:`cap_hit`
            adds the partition bound's.
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
    objective: str = "bottleneck"
    baseline_iteration_ms: float | None = None
    tessera_iteration_ms: float | None = None
    search: RefineResult | None = None
    fallback: str = ""
    alternatives: tuple[tuple[str, int, float, float, bool, bool], ...] = ()
    partition_bound: PartitionBound | None = None
    radius: int = 1
    radii_tried: tuple[int, ...] = (1,)
    widen_s: float = 0.0
    alone: bool = False
    caps_hit: tuple[str, ...] = ()
    synthesis: SynthesisResult | None = None

    @property
    def cap_hit(self) -> tuple[str, ...]:
        """:attr:`caps_hit` and ``"partition bound"`` when the bound's wall-clock cap stopped it
        (:attr:`tessera.plan.partition_bound.PartitionBound.cap_hit`)."""
        pb = self.partition_bound
        return self.caps_hit + (("partition bound",) if pb is not None and pb.cap_hit else ())


ALONE_SHARE = 0.5
"""The MILP's candidates include the head alone on the last stage (the embedding alone on stage
0) when its serial F+B+W time is at least this share of the mean stage's (all serial time over
``pp * vpp`` stages): a lighter block alone leaves its rank mostly idle, and its candidates add
pair DAGs to cost (Qwen3-Next-80B pp 8 vpp 2: 354 -> 454 distinct, +40% CPU)."""


def alone_pays(costs: ModelCosts, num_stages: int) -> bool:
    """Whether the head or the embedding is heavy enough to be offered a stage of its own in the
    MILP's candidates (:data:`ALONE_SHARE`)."""
    n = len(costs.layers)
    mean = sum(costs.serial_ms(i) for i in range(-1, n + 1)) / max(num_stages, 1)
    return max(costs.serial_ms(-1), costs.serial_ms(n)) >= ALONE_SHARE * mean


WIDEN_PAIRS = 300
"""Distinct pair DAGs (:func:`tessera.plan.overlap_graph.distinct_pairs`) that widening the
candidate radius may schedule over all the wider radii it tries: a count, so that the radius
does not depend on the machine's speed. It lets Qwen3-235B (266 at radius 2), Kimi K2 (123) and
DeepSeek-V3 (126) try radius 2 but not 3 (212 and 224 more; DeepSeek-V3's radius-2 and -3 phases
took 3 and 7 s of CPU) and keeps Qwen3-Next-80B pp 8 vpp 2 (977) and Nemotron 3 Super (3234) at
radius 1."""

SEARCH_WORK = 5_000_000
"""The iteration search's default budget in task-microbatches (:func:`search_budget`): each
evaluation simulates every task of every layer for every microbatch, so a plan costs about its
model's tasks times ``num_microbatches`` (``docs/recipes.md``, "Limits"); 5M is 400 plans of
Qwen3-Next-80B at 16 microbatches (774 tasks), 164 of DeepSeek-V3 at 32 (952 tasks), 100 of
Qwen3-Next-80B at 64."""
SEARCH_EVALS = (10, 400)
"""The least and the most evaluations :func:`search_budget` gives."""


def search_budget(costs: ModelCosts, num_microbatches: int) -> int:
    """The iteration search's default budget, simulated plans (``planner.search_evals: null``):
    :data:`SEARCH_WORK` over the model's tasks (embedding and head included) times
    ``num_microbatches``, within :data:`SEARCH_EVALS`. A count that depends on the model and
    the microbatches only, so the plan does not depend on the machine's speed, while planning
    a larger model simulates fewer plans."""
    tasks = sum(len(costs.layer(i).tasks) for i in range(-1, len(costs.layers) + 1))
    lo, hi = SEARCH_EVALS
    return max(lo, min(hi, SEARCH_WORK // max(tasks * num_microbatches, 1)))


def _on_edge(part: Partition, base: Partition, radius: int) -> bool:
    """Some inner stage boundary of ``part`` lies ``radius`` layers from the baseline's (the edge
    of the candidates of that radius)."""
    return any(abs(a - b) >= radius for a, b in zip(part.bounds[1:-1], base.bounds[1:-1]))


def pair_with_w(template: str, split_w: bool) -> bool:
    """Whether the B side of an FB instruction carries its W tasks: the template's
    :meth:`~tessera.program.templates.Template.pair_with_w` (DualPipeV keeps W inside its overlapped
    pairs; 1F1B and interleaved do exactly when W is not split off)."""
    return get_template(template).pair_with_w(split_w)


def _edge_costs_fixed(costs: ModelCosts, partition: Partition, edges: tuple[OverlapEdge, ...],
                      with_w: bool) -> tuple[EdgeCost, ...]:
    return tuple(EdgeCost(e.rank, e.f_stage, e.b_stage,
                          replay_pair(costs, partition.stage_range(e.f_stage), partition.stage_range(e.b_stage),
                                      with_w)[1].makespan * costs.scale_of(e.rank)) for e in edges)


def _unpaired_ms(pc: PairCosts, partition: Partition) -> list[float]:
    paired = pc.paired_stages()
    return [pc.f_ms[c] + pc.b_ms[c] for c in candidates_of(partition) if c.stage not in paired]


def _serial_fb_ms(costs: ModelCosts, start: int, stop: int, with_w: bool) -> float:
    """Serial F + B (+ W with ``with_w``) of the extended layers ``[start, stop)``, ms."""
    phases = ("F", "B", "W") if with_w else ("F", "B")
    return sum(t.ms for i in range(start, stop) for t in costs.layer(i).tasks if t.phase.value in phases)


def _alone_ms(costs: ModelCosts, pc: PairCosts, c, with_w: bool, scale: float = 1.0) -> float:
    """F + B of a stage that runs in no overlap edge, ms: the pair-costing value, or (for a range
    outside the candidates, reached by the iteration search) its tasks' serial sum times
    ``scale``, its rank's factor (``pc`` is already scaled: :func:`tessera.plan.overlap_graph.rank_scaled`)."""
    if c in pc.f_ms:
        return pc.f_ms[c] + pc.b_ms[c]
    return _serial_fb_ms(costs, c.start, c.stop, with_w) * scale


def _plan_edge_costs(costs: ModelCosts, plan: Plan, edges) -> tuple[EdgeCost, ...]:
    """Per overlap edge, the cost of the pair ``plan`` forms there under its own orders, times
    the edge rank's factor (``ModelCosts.rank_scale``), ms."""
    return tuple(EdgeCost(e.rank, e.f_stage, e.b_stage,
                          plan_pair_schedule(costs, plan, e.f_stage, e.b_stage)[1].makespan * costs.scale_of(e.rank))
                 for e in edges)


def _stage_ranks(plan: Plan) -> list[int]:
    """The rank of every virtual stage of ``plan`` (its template's placement)."""
    owner = get_template(plan.template).owner
    return [owner(st, plan.pp)[0] for st in range(plan.partition.num_stages)]


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


def _alone_starts(costs: ModelCosts, base: Plan, edges: tuple[OverlapEdge, ...], with_w: bool) -> tuple[Plan, ...]:
    """Extra starts of the iteration search where :func:`alone_pays`: the serial-balanced
    partitions with the head, the embedding, or both on a stage of their own
    (:func:`tessera.plan.baseline.alone_partition`), with the pair scheduler's orders; those the
    layer count cannot give are left out."""
    n, out, seen = len(costs.layers), [], {base.partition}
    for emb, head in ((False, True), (True, False), (True, True)):
        if base.partition.num_stages - emb - head < 1 or base.partition.num_stages - emb - head > n:
            continue
        part = alone_partition(costs, base.partition.num_stages, embedding=emb, head=head)
        if part in seen:
            continue
        seen.add(part)
        plan = replace(base, name="tessera", partition=part)
        out.append(with_scheduled_orders(plan, edges, with_w,
                                         lambda f, b: best_pair(costs, f, b, with_w, schedule_pair)))
    return tuple(out)


def candidate_ranges(base: Partition, radius: int, num_layers: int, alone: bool = False):
    """The candidates :func:`make_plan` costs at ``radius`` around the baseline partition ``base``
    (:func:`tessera.plan.candidates.stage_candidates`; the one definition, shared with the
    profiler, which times every candidate pair). ``alone``: with the embedding alone and the head
    alone, as :func:`make_plan` costs them where :func:`alone_pays` (``PlanReport.alone``)."""
    return stage_candidates(base, radius, num_layers, alone=alone)


def make_plan(costs: ModelCosts, *, template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = True,
              split_w: bool = True, radius: int = 1, prune: bool = True, time_limit_s: float = 60.0,
              capacity_bytes: float | None = None, progress: Progress | None = None,
              objective: str = "iteration", evaluate: Evaluate | None = None, search_time_s: float = math.inf,
              search_evals: int | None = None, solver: str = "scip", max_radius: int | None = None,
              alone: bool | None = None, widen_pairs: int = WIDEN_PAIRS, synthesis: bool = False,
              synthesis_evals: int | None = None, screen: Evaluate | None = None) -> PlanReport:
    """Plan a pipeline with the overlap-aware method and compare it with the baseline.

    Args:
        costs: per-task costs (any cost source).
        template, pp, vpp, num_microbatches, overlap, split_w: the pipeline shape (recipe).
        radius: candidate radius in layers around the baseline's stage boundaries (the first tried).
        max_radius: widen the radius up to this (``PlanReport.radius``; default ``radius``: no
            widening), while the wider radii's distinct pair DAGs fit ``widen_pairs``
            (:data:`WIDEN_PAIRS`).
        prune: profile-guided pruning before the MILP.
        time_limit_s: the MILP's wall-clock safety cap, s (its deterministic limit is a node
            count, :data:`tessera.plan.milp_memory.NODE_LIMIT`).
        capacity_bytes: usable device memory per rank, bytes (``None``: no memory constraint).
        progress: ``progress(phase, done, total)`` for the pair-scheduling, solving and search phases.
        objective: ``bottleneck`` (the MILP optimum as is) or ``iteration`` (re-ranked and refined
            by ``evaluate``; without ``evaluate`` it is ``bottleneck``).
        evaluate: a plan's simulated iteration, ms (``inf`` if it does not fit); enables the
            iteration search and the never-slower rule (module docstring).
        search_evals: the iteration search's budget, evaluations (the plan depends on it and on
            the inputs, not on the machine's speed; ``None``: :func:`search_budget`).
        search_time_s: the iteration search's wall-clock safety cap, s (``PlanReport.caps_hit``
            says when it stopped the search).
        solver: the partition MILP's solver (:func:`tessera.plan.milp.solve_partition`).
        synthesis: after the iteration search, write each rank's instruction order
            (:func:`synthesize_jointly`; needs ``evaluate`` and the ``iteration`` objective).
        synthesis_evals: its budget, evaluations (``None``: the iteration search's).
        screen: the evaluator the synthesis ranks its candidates with (``None``: ``evaluate``;
            :func:`tessera.flow.iteration_evaluator` without the validator), its winner confirmed
            by ``evaluate``.
        alone: offer the embedding alone on stage 0 and the head alone on the last stage in the
            MILP's candidates (``None``: where :func:`alone_pays`, under the bottleneck objective:
            the iteration search starts from those placements and may move into them whatever
            this is, and reached the same iteration without them, docs/planner.md).

    Returns:
        PlanReport with both plans. Under ``bottleneck`` the Tessera plan's bottleneck is never
        above the baseline's (the baseline partition is a feasible MILP solution, given as the
        warm start); with ``evaluate`` its simulated iteration is never above the baseline's.

    Raises:
        ValueError: an unknown objective.
        TesseraConfigError: memory makes every candidate partition infeasible (names the rank and
            GB), or the MILP finds no solution in time.
    """
    if objective not in ("bottleneck", "iteration"):
        raise ValueError(f"objective={objective!r}: use bottleneck or iteration")
    check_solver(solver)  # a missing solver fails before the pair costing
    max_radius = radius if max_radius is None else max(radius, max_radius)
    search_evals = search_budget(costs, num_microbatches) if search_evals is None else search_evals
    base = baseline_plan(costs, template, pp, vpp, num_microbatches, overlap=overlap, split_w=split_w)
    with_w = pair_with_w(template, split_w)
    edges = overlap_edges(template, pp, vpp, num_microbatches) if overlap else ()
    base_edges = _edge_costs_fixed(costs, base.partition, edges, with_w)
    L = len(costs.layers)
    if alone is None:  # under the iteration objective the search's alone starts reach the same plans
        alone = alone_pays(costs, pp * vpp) and (objective == "bottleneck" or evaluate is None)

    def solve_at(r: int):
        """Candidates of radius ``r``, their pair costs, memory table and the MILP optimum."""
        cands = candidate_ranges(base.partition, r, L, alone)
        t0 = time.perf_counter()
        pc = pair_costs(costs, cands, edges, schedule_pair, with_w, serial_fallback=True,
                        on_progress=(lambda d, n: progress("pairs", d, n)) if progress else None)
        pc = rank_scaled(pc, costs, ranks)  # a slowed rank's pairs cost more (ModelCosts.rank_scale)
        pair_s = time.perf_counter() - t0
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
        milp = solve_partition(cands, pc.pair_ms, memory, capacity_bytes, min(threshold, inc_ms), prune,
                               time_limit_s, stage_ms=pc.unpaired_stage_ms(), warm_start=incumbent, solver=solver)
        if progress:
            progress("milp", 1, 1)
        return cands, pc, pair_s, threshold, inc_ms, milp

    base_choice = candidates_of(base.partition)
    ranks = _stage_ranks(base)
    cands, pc, pair_s, threshold, inc_ms, milp = solve_at(radius)
    chosen, tried = radius, [radius]
    caps = ["milp"] if milp.cap_hit else []
    t_widen, widened = time.perf_counter(), 0
    # widen the radius while the optimum sits on the candidates' edge (a wider set may hold a
    # lower bottleneck) and the wider radii's pair DAGs fit the widening budget (a count)
    while (tried[-1] < max_radius and edges and _on_edge(milp.partition, base.partition, tried[-1])):
        wider = candidate_ranges(base.partition, tried[-1] + 1, L, alone)
        widened += len(distinct_pairs(costs, wider, edges))
        if widened > widen_pairs:
            break
        got = solve_at(tried[-1] + 1)
        tried.append(tried[-1] + 1)
        if got[5].cap_hit and "milp" not in caps:
            caps.append("milp")
        if not got[5].bottleneck_ms < milp.bottleneck_ms - 1e-9:
            break  # a wider radius did not pay
        cands, pc, pair_s, threshold, inc_ms, milp = got
        chosen = tried[-1]
    widen_s = time.perf_counter() - t_widen if len(tried) > 1 else 0.0
    part = milp.partition
    orders, t_edges = [], []
    for e in edges:
        ch = best_pair(costs, part.stage_range(e.f_stage), part.stage_range(e.b_stage), with_w, schedule_pair)
        t_edges.append(EdgeCost(e.rank, e.f_stage, e.b_stage, ch.makespan_ms * costs.scale_of(e.rank), ch.overlapped))
        if all((o.f_stage, o.b_stage) != (e.f_stage, e.b_stage) for o in orders):
            orders.append(ch.pair_order(e.f_stage, e.b_stage, with_w))
    tessera = Plan("tessera", template, pp, vpp, num_microbatches, part, overlap, split_w, tuple(orders))
    search, fallback, base_it, tess_it, syn = None, "", None, None, None
    if evaluate is not None:
        if objective == "iteration":
            if progress:
                progress("search", 0, 1)
            own = replace(base, name="tessera")
            extra = _alone_starts(costs, base, edges, with_w) if alone_pays(costs, pp * vpp) else ()
            search = refine(costs, (tessera, own) + extra, evaluate, edges,
                            with_w, schedule_pair,
                            max_evals=search_evals, time_budget_s=search_time_s, stage_rank=_stage_ranks(base))
            if progress:
                progress("search", 1, 1)
            if search.cap_hit:
                caps.append("search")
            tessera, tess_it = search.plan, search.iteration_ms
            base_it = search.start_ms[1]
            if synthesis:
                if progress:
                    progress("synthesis", 0, 1)
                syn = synthesize_jointly(costs, tessera, tess_it, evaluate, edges, with_w, capacity_bytes,
                                         search_evals if synthesis_evals is None else synthesis_evals, search_time_s,
                                         _stage_ranks(base), screen)
                if progress:
                    progress("synthesis", 1, 1)
                if syn.cap_hit:
                    caps.append("synthesis")
                tessera, tess_it = syn.plan, syn.iteration_ms
        else:
            tess_it = evaluate(tessera)
        if base_it is None:
            base_it = evaluate(base)
        if not tess_it < base_it:
            fallback = (f"no candidate beat the baseline's simulated iteration ({base_it:.2f} ms; best "
                        f"{tess_it:.2f} ms): the Tessera plan is the baseline partition with its own pair orders")
            tessera, tess_it = replace(base, name="tessera"), base_it
        part = tessera.partition
        t_edges = _plan_edge_costs(costs, tessera, edges)
    unpaired_base = _unpaired_ms(pc, base.partition)
    tess_unpaired = [_alone_ms(costs, pc, c, with_w, costs.scale_of(ranks[c.stage])) for c in candidates_of(part)
                     if c.stage not in pc.paired_stages()]
    return PlanReport(
        baseline=base, tessera=tessera, baseline_edges=base_edges, tessera_edges=tuple(t_edges),
        baseline_bottleneck_ms=max([e.ms for e in base_edges] + unpaired_base, default=0.0),
        tessera_bottleneck_ms=max([e.ms for e in t_edges] + tess_unpaired, default=0.0),
        baseline_own_ms=threshold, pruning_threshold_ms=min(threshold, inc_ms), milp=milp, pairs_total=pc.pairs_total, pairs_distinct=pc.pairs_distinct,
        candidates=sum(len(s) for s in cands), pair_cost_s=pair_s, with_w=with_w, objective=objective,
        radius=chosen, radii_tried=tuple(tried), widen_s=widen_s, alone=alone, caps_hit=tuple(caps),
        baseline_iteration_ms=base_it, tessera_iteration_ms=tess_it, search=search, fallback=fallback,
        synthesis=syn if synthesis and objective == "iteration" and evaluate is not None else None)


SYNTHESIS_SHARES = (0.6, 0.2)
"""How :func:`synthesize_jointly` splits its budget: the first synthesis on the searched
partition, then the joint boundary search under the winning policy; the rest re-synthesises the
partition the joint search ends on."""


def avail_activation_bytes(costs: ModelCosts, plan: Plan, capacity_bytes: float | None) -> tuple[float, ...] | None:
    """Per rank, the bytes ``plan``'s live activations may take: ``capacity_bytes`` less the
    rank's static and transient bytes (:func:`tessera.program.memory.rank_static_bytes`);
    ``None`` without a capacity."""
    if capacity_bytes is None:
        return None
    return tuple(capacity_bytes - sum(rank_static_bytes(p, costs)) for p in compile_plan(replace(plan, schedule=())))


def synthesize_jointly(costs: ModelCosts, plan: Plan, plan_ms: float, evaluate: Evaluate, edges, with_w: bool,
                       capacity_bytes: float | None, max_evals: int, time_budget_s: float,
                       stage_rank: list[int], screen: Evaluate | None = None) -> SynthesisResult:
    """Schedule synthesis jointly with the partition (``docs/planner.md``, "Schedule synthesis").

    1. :func:`tessera.plan.synthesis.synthesize` on ``plan`` (the iteration search's result,
       ``plan_ms``): the policy grid and the per-rank local search, the template's order kept
       unless beaten;
    2. where a synthesized order won, the boundary search of :func:`tessera.plan.refine.refine`
       runs again from ``plan`` with every candidate partition's order re-synthesised under the
       winning policy (one list-scheduling pass per evaluation, cheaper than the simulation);
    3. where that found a faster partition, the synthesis runs again on it.

    Budget: ``max_evals`` evaluations split by :data:`SYNTHESIS_SHARES`; ``time_budget_s`` is
    the wall-clock safety cap of each phase. ``screen`` ranks candidates (default ``evaluate``),
    the synthesis' winner is confirmed by ``evaluate``. Returns the fastest of the three (never
    slower than ``plan``), with ``evaluations`` over all phases.
    """
    screen = evaluate if screen is None else screen
    t0 = time.perf_counter()
    if max_evals <= 0:  # planner.synthesis_evals=0: the template's order, nothing written
        return SynthesisResult(plan, plan, plan_ms, plan_ms, None, 0, 0.0)
    avail = avail_activation_bytes(costs, plan, capacity_bytes)
    cache: dict = {}
    first_n = max(1, int(SYNTHESIS_SHARES[0] * max_evals))
    best = synthesize(costs, plan, evaluate, scheduler=schedule_pair, avail_bytes=avail, start_ms=plan_ms,
                      max_evals=first_n, time_budget_s=time_budget_s, cache=cache, screen=screen)
    spent = best.evaluations
    if best.policy is None or max_evals - spent <= 0:
        return replace(best, max_evals=max_evals, search_s=time.perf_counter() - t0)
    policy = best.policy

    def under_policy(p: Plan) -> float:
        sched, new, predicted = list_schedule(costs, replace(p, schedule=()), policy, scheduler=schedule_pair,
                                              avail_bytes=avail, cache=cache)
        if not sched or predicted > best.iteration_ms * (1 + PREDICT_SLACK):  # cannot win: not simulated
            return math.inf
        return screen(replace(p, schedule=sched, pair_orders=p.pair_orders + new))

    joint_n = min(max_evals - spent, max(1, int(SYNTHESIS_SHARES[1] * max_evals)))
    joint = refine(costs, (plan,), under_policy, edges, with_w, schedule_pair, max_evals=joint_n,
                   time_budget_s=time_budget_s, stage_rank=stage_rank)
    spent += joint.evaluations
    capped = best.cap_hit or joint.cap_hit
    if joint.iteration_ms < best.iteration_ms - 1e-9:
        again = synthesize(costs, joint.plan, evaluate, scheduler=schedule_pair, avail_bytes=avail,
                           max_evals=max(1, max_evals - spent), time_budget_s=time_budget_s, cache=cache,
                           policies=(policy,), screen=screen)
        spent += again.evaluations
        written = best.written + again.written
        capped = capped or again.cap_hit
        if again.policy is not None and again.iteration_ms < best.iteration_ms - 1e-9:
            best = replace(again, start=best.start, start_ms=best.start_ms)
        best = replace(best, written=written)
    return replace(best, evaluations=spent, search_s=time.perf_counter() - t0, cap_hit=capped,
                   joint_evaluations=joint.evaluations, joint_moves=joint.moves, max_evals=max_evals)


def continue_search(report: PlanReport, costs: ModelCosts, evaluate: Evaluate, search_evals: int,
                    search_time_s: float = math.inf, synthesis_evals: int = 0,
                    capacity_bytes: float | None = None, screen: Evaluate | None = None) -> PlanReport:
    """``report`` with its iteration search (:func:`tessera.plan.refine.refine`) run on from its
    Tessera plan for ``search_evals`` more evaluations (wall-clock safety cap ``search_time_s``,
    s; ``"search"`` joins ``caps_hit`` when it stops the search); unchanged when nothing faster
    is found. Where the report's plan has a synthesized order, the search runs on from the
    template-order plan the synthesis started from, and (``synthesis_evals > 0``) the schedule
    synthesis (:func:`synthesize_jointly`, memory ``capacity_bytes``) runs again on what it
    finds. The Tessera plan's edges, bottleneck, iteration and the search counts are updated;
    the baseline is untouched, so the plan stays never slower than it."""
    t = report.tessera
    if report.tessera_iteration_ms is None or search_evals <= 0:
        return report
    syn = report.synthesis
    start = syn.start if syn is not None and syn.policy is not None else t
    edges = overlap_edges(t.template, t.pp, t.vpp, t.num_microbatches) if t.overlap else ()
    more = refine(costs, (start,), evaluate, edges, report.with_w, schedule_pair, max_evals=search_evals,
                  time_budget_s=search_time_s, stage_rank=_stage_ranks(t))
    old = report.search
    search = more if old is None else replace(
        old, plan=more.plan, iteration_ms=more.iteration_ms, evaluations=old.evaluations + more.evaluations,
        moves=old.moves + more.moves, search_s=old.search_s + more.search_s, fixed_orders=more.fixed_orders,
        max_evals=old.max_evals + more.max_evals, cap_hit=old.cap_hit or more.cap_hit)
    if more.cap_hit and "search" not in report.caps_hit:
        report = replace(report, caps_hit=report.caps_hit + ("search",))
    best_plan, best_ms, new_syn = more.plan, more.iteration_ms, syn
    if syn is not None and synthesis_evals > 0:
        again = synthesize_jointly(costs, more.plan, more.iteration_ms, evaluate, edges, report.with_w,
                                   capacity_bytes, synthesis_evals, search_time_s, _stage_ranks(t), screen)
        if again.cap_hit and "synthesis" not in report.caps_hit:
            report = replace(report, caps_hit=report.caps_hit + ("synthesis",))
        if again.iteration_ms < best_ms - 1e-9:
            best_plan, best_ms = again.plan, again.iteration_ms
        if again.iteration_ms < report.tessera_iteration_ms - 1e-9:
            new_syn = replace(again, evaluations=again.evaluations + syn.evaluations,
                              search_s=again.search_s + syn.search_s, max_evals=again.max_evals + syn.max_evals)
    if not best_ms < report.tessera_iteration_ms - 1e-9:
        return replace(report, search=search)
    if syn is not None and not best_plan.synthesized:  # the template's order won after all
        new_syn = replace(new_syn, plan=best_plan, start=best_plan, start_ms=best_ms, iteration_ms=best_ms,
                          policy=None, changes=())
    plan = replace(best_plan, name="tessera")
    t_edges = _plan_edge_costs(costs, plan, edges)
    paired = {s for e in edges for s in (e.f_stage, e.b_stage)}
    ranks = _stage_ranks(plan)
    alone = [_serial_fb_ms(costs, *plan.partition.stage_range(st), report.with_w) * costs.scale_of(ranks[st])
             for st in range(plan.partition.num_stages) if st not in paired]
    fallback = report.fallback if not best_ms < (report.baseline_iteration_ms or math.inf) else ""
    return replace(report, tessera=plan, tessera_edges=t_edges,
                   tessera_bottleneck_ms=max([e.ms for e in t_edges] + alone, default=0.0),
                   tessera_iteration_ms=best_ms, search=search, fallback=fallback, synthesis=new_syn)
