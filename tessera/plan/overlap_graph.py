"""The overlap graph: which (F chunk, B chunk) pairs the template co-executes, and the
post-overlap cost of every candidate pair on each of them.

Tessera (OSDI 2026, §4, "core method"): an *overlap edge* is a pair of virtual stages
``(f_stage, b_stage)`` whose forward (one microbatch) and backward (another microbatch) chunks run
overlapped on one rank in the template's steady state. For every candidate of ``f_stage`` and
every candidate of ``b_stage`` we build the pair's task DAG (:func:`tessera.sched.chunkdag.pair_dag`)
and schedule it (:func:`tessera.plan.pair_scheduler.schedule_pair` by default); the makespan, ms,
is the pair's post-overlap cost. The partition MILP minimises the largest cost over the selected
pairs.

Identical pairs are scheduled once: pairs are keyed by the *content* of their layers (the
``LayerCost`` tasks and memory, not the layer indices), so a model whose layer pattern repeats
(Qwen3-Next: three DeltaNet layers then one gated-attention layer) yields few distinct pairs.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Sequence

from tessera.cost.types import ModelCosts
from tessera.plan.candidates import Candidate, candidates_of
from tessera.plan.pair_cost import best_pair
from tessera.plan.pair_scheduler import schedule_pair
from tessera.program.memory import pair_peak_bytes
from tessera.program.plan import Partition
from tessera.program.templates import co_executed_pairs
from tessera.sched.chunkdag import chunk_dag
from tessera.sched.dag import TaskDAG, TaskSchedule

Scheduler = Callable[[TaskDAG], TaskSchedule]


@dataclass(frozen=True, order=True)
class OverlapEdge:
    """On ``rank``, the F chunk of virtual stage ``f_stage`` co-executes with the B chunk of
    ``b_stage`` (another microbatch) in the steady state. ``f_stage == b_stage`` happens in
    plain 1F1B (vpp=1)."""

    rank: int
    f_stage: int
    b_stage: int


def overlap_edges(template: str, pp: int, vpp: int, num_microbatches: int) -> tuple[OverlapEdge, ...]:
    """Distinct overlap edges of a template, from
    :func:`tessera.program.templates.co_executed_pairs`, sorted."""
    return tuple(sorted({OverlapEdge(r, f, b) for r, f, b in co_executed_pairs(template, pp, vpp, num_microbatches)}))


@dataclass(frozen=True)
class PairCosts:
    """Post-overlap pair costs and chunk-alone costs over a candidate set.

    Attributes:
        edges: the overlap edges the costs cover.
        pair_ms: ``(f candidate, b candidate) -> makespan`` of the overlapped pair, ms, for every
            edge ``(f_stage, b_stage)`` and every candidate of each (only ``(c, c)`` when
            ``f_stage == b_stage``: a stage has one range).
        f_ms: candidate -> its F chunk run alone (warmup), ms.
        b_ms: candidate -> its B chunk (with W if ``with_w``) run alone (cooldown), ms.
        with_w: W tasks of the backward chunk are part of the pair / B chunk (as movable tasks).
        pairs_total: pairs over all edges (``len(pair_ms)``).
        pairs_distinct: pair DAGs actually scheduled (distinct layer content).
        chunks_distinct: chunk-alone DAGs actually scheduled.
        seconds: wall time to build and schedule them, s.
        pair_peak: ``(f candidate, b candidate) -> bytes``, the pair's own memory peak under the
            schedule that prices it (:func:`tessera.program.memory.pair_peak_bytes`; what an
            ``FB`` running the planner's order holds above what was live before it), for the
            planner's exact memory rows (:func:`tessera.plan.candidates.exact_candidate_memory`).
    """

    edges: tuple[OverlapEdge, ...]
    pair_ms: dict[tuple[Candidate, Candidate], float]
    f_ms: dict[Candidate, float]
    b_ms: dict[Candidate, float]
    with_w: bool
    pairs_total: int
    pairs_distinct: int
    chunks_distinct: int
    seconds: float
    pair_peak: dict[tuple[Candidate, Candidate], float] = field(default_factory=dict)

    def paired_stages(self) -> frozenset[int]:
        """Stages that take part in at least one overlap edge."""
        return frozenset(s for e in self.edges for s in (e.f_stage, e.b_stage))

    def unpaired_stage_ms(self) -> dict[Candidate, float]:
        """Serial F + B time, ms, of the candidates of stages in no overlap edge: the objective
        bounds such stages by it (they never overlap)."""
        paired = self.paired_stages()
        return {c: self.f_ms[c] + self.b_ms[c] for c in self.f_ms if c.stage not in paired}


def _content_ids(costs: ModelCosts) -> dict[int, int]:
    """Extended layer index -> id of its cost content (equal tasks and memory => equal id)."""
    ids: dict[tuple, int] = {}
    out = {}
    for i in range(-1, len(costs.layers) + 1):
        lc = costs.layer(i)
        out[i] = ids.setdefault((lc.tasks, lc.memory), len(ids))
    return out


def _content_key(costs: ModelCosts) -> Callable[[Candidate], tuple[int, ...]]:
    """Candidate -> the content ids of its extended layers (equal keys: equal DAGs)."""
    cid = _content_ids(costs)
    return lambda c: tuple(cid[i] for i in range(c.start, c.stop))


def _distinct_pairs(key: Callable[[Candidate], tuple[int, ...]], candidates: Sequence[Sequence[Candidate]],
                    edges: Sequence[OverlapEdge]) -> tuple[dict[tuple, tuple], dict[tuple[Candidate, Candidate], tuple]]:
    """(content key -> (F range, B range) of its first pair, (cf, cb) -> content key) over every
    candidate pair of every edge (edges sorted; only ``(c, c)`` when ``f_stage == b_stage``)."""
    first: dict[tuple, tuple] = {}
    pair_key: dict[tuple[Candidate, Candidate], tuple] = {}
    for e in sorted(set(edges)):
        for cf in candidates[e.f_stage]:
            for cb in candidates[e.b_stage]:
                if e.f_stage == e.b_stage and cf != cb:
                    continue
                k = ("pair", key(cf), key(cb))
                first.setdefault(k, (cf.range, cb.range))
                pair_key[(cf, cb)] = k
    return first, pair_key


def distinct_pairs(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]],
                   edges: Sequence[OverlapEdge]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(F range, B range) of one representative per distinct candidate-pair content, in the order
    :func:`pair_costs` schedules them (its ``pairs_distinct`` DAGs)."""
    return list(_distinct_pairs(_content_key(costs), candidates, edges)[0].values())


def _makespan(costs: ModelCosts, with_w: bool, sched: Scheduler, serial_fallback: bool,
              job: tuple) -> tuple[float, float]:
    """(makespan ms, own memory peak bytes) of one job: ``("pair", f_range, b_range)`` (the peak
    under the chosen schedule, :func:`tessera.program.memory.pair_peak_bytes`) or ``(phases,
    start, stop)`` (peak 0: not used)."""
    if job[0] == "pair":
        ch = best_pair(costs, job[1], job[2], with_w, sched, serial_fallback)
        return ch.makespan_ms, pair_peak_bytes(costs, ch.dag, ch.schedule, job[1], job[2], with_w)
    return sched(chunk_dag(costs, job[1], job[2], job[0])).makespan, 0.0


def pair_costs(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], edges: Sequence[OverlapEdge],
               scheduler: Scheduler | None = None, with_w: bool = True, workers: int = 1,
               serial_fallback: bool = False,
               on_progress: Callable[[int, int], None] | None = None) -> PairCosts:
    """Schedule every candidate pair of every overlap edge (and every chunk alone).

    Args:
        costs: per-layer task costs (the pair DAG slows compute by ``chunkdag.pair_slowdown``).
        candidates: per stage, its candidates (:func:`tessera.plan.candidates.stage_candidates`).
        edges: overlap edges (:func:`overlap_edges`).
        scheduler: ``TaskDAG -> TaskSchedule``; default the backbone-first + gap-fit
            :func:`tessera.plan.pair_scheduler.schedule_pair`. Must be picklable if ``workers > 1``.
        with_w: include the backward chunk's W tasks (movable) in pairs and B chunks.
        workers: processes scheduling the distinct DAGs (1: in this process).
        serial_fallback: a pair costs the cheaper of its overlapped schedule and its two chunks
            back to back at full speed (:func:`tessera.plan.pair_cost.best_pair`).
        on_progress: called as ``on_progress(done, total)`` over the distinct DAGs.

    Returns:
        :class:`PairCosts`; identical layer content is scheduled once (see ``pairs_distinct``).
    """
    t0 = time.perf_counter()
    sched = scheduler or schedule_pair
    key = _content_key(costs)
    distinct, pair_key = _distinct_pairs(key, candidates, edges)
    jobs: dict[tuple, tuple] = {k: ("pair",) + ranges for k, ranges in distinct.items()}
    all_c = [c for stage in candidates for c in stage]
    b_phases = "BW" if with_w else "B"
    chunk_key: dict[tuple[str, Candidate], tuple] = {}
    for c in all_c:
        for ph in ("F", b_phases):
            k = (ph, key(c))
            jobs.setdefault(k, (ph, c.start, c.stop))
            chunk_key[(ph, c)] = k
    keys = list(jobs)
    run = partial(_makespan, costs, with_w, sched, serial_fallback)
    if workers > 1 and len(keys) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            values = list(pool.map(run, [jobs[k] for k in keys], chunksize=max(1, len(keys) // (4 * workers))))
    else:
        values = []
        for n, k in enumerate(keys):
            values.append(run(jobs[k]))
            if on_progress is not None:
                on_progress(n + 1, len(keys))
    ms = {k: v[0] for k, v in zip(keys, values)}
    peak = {k: v[1] for k, v in zip(keys, values)}
    pair_ms = {p: ms[k] for p, k in pair_key.items()}
    pair_peak = {p: peak[k] for p, k in pair_key.items()}
    f_ms = {c: ms[chunk_key[("F", c)]] for c in all_c}
    b_ms = {c: ms[chunk_key[(b_phases, c)]] for c in all_c}
    n_pair_jobs = sum(1 for k in keys if k[0] == "pair")
    return PairCosts(tuple(sorted(set(edges))), pair_ms, f_ms, b_ms, with_w, len(pair_ms), n_pair_jobs,
                     len(keys) - n_pair_jobs, time.perf_counter() - t0, pair_peak)


def rank_scaled(pc: PairCosts, costs: ModelCosts, stage_rank: Sequence[int]) -> PairCosts:
    """``pc`` with every cost times the compute factor of the rank that runs it
    (``costs.scale_of``, ``ModelCosts.rank_scale``; ``stage_rank[s]``: the rank of virtual stage
    ``s``, the template's placement): a pair of an edge on a slowed rank costs more, so the MILP
    moves work off that rank with the same variables. The whole makespan is scaled, its exposed
    communication with it (an upper estimate of the compute-only slowdown the simulator runs;
    the iteration search evaluates plans exactly). ``pc`` itself when no rank is scaled."""
    if not costs.rank_scale:
        return pc
    f = [costs.scale_of(r) for r in stage_rank]
    return replace(pc, pair_ms={p: ms * f[p[0].stage] for p, ms in pc.pair_ms.items()},
                   f_ms={c: ms * f[c.stage] for c, ms in pc.f_ms.items()},
                   b_ms={c: ms * f[c.stage] for c, ms in pc.b_ms.items()})


def partition_pair_costs(costs: ModelCosts, partition: Partition, edges: Sequence[OverlapEdge],
                         scheduler: Scheduler | None = None, with_w: bool = True,
                         serial_fallback: bool = False) -> PairCosts:
    """:func:`pair_costs` of one partition (each stage's single range as its only candidate)."""
    return pair_costs(costs, tuple((c,) for c in candidates_of(partition)), edges, scheduler, with_w,
                      serial_fallback=serial_fallback)


def bottleneck_ms(pc: PairCosts, choice: Sequence[Candidate]) -> float:
    """The MILP objective for one candidate per stage, ms: the largest cost over the overlap edges
    (the pair the choice forms on each), and serial F + B of stages in no edge."""
    by_stage = {c.stage: c for c in choice}
    paired = pc.paired_stages()
    vals = [pc.pair_ms[(by_stage[e.f_stage], by_stage[e.b_stage])] for e in pc.edges]
    vals += [pc.f_ms[c] + pc.b_ms[c] for c in choice if c.stage not in paired]
    return max(vals, default=0.0)


def partition_bottleneck_ms(costs: ModelCosts, partition: Partition, edges: Sequence[OverlapEdge],
                            scheduler: Scheduler | None = None, with_w: bool = True,
                            serial_fallback: bool = False) -> float:
    """Bottleneck (largest selected pair cost, ms) of a given partition, e.g. the baseline's: the
    pruning threshold of :func:`tessera.plan.milp.solve_partition`."""
    pc = partition_pair_costs(costs, partition, edges, scheduler, with_w, serial_fallback)
    return bottleneck_ms(pc, candidates_of(partition))
