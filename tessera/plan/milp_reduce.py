"""The partition MILP's problem tables and exact reductions (:mod:`tessera.plan.milp`).

The edge table (pair costs grouped by overlap edge), pruning to a fixpoint at a cost threshold
(:func:`_reduce`), the lower bound that pruning alone proves (:func:`propagation_bound`), the split
of edges into those that keep their cost terms and those that cannot bind the bottleneck
(:func:`_edge_split`), and a choice's selected costs. Solver-free; shared by the SCIP model
(:mod:`tessera.plan.milp`) and the cvxpy one (:mod:`tessera.plan.milp_cvxpy`). Formulas and the
reductions' proofs: ``docs/planner.md`` ("Partition MILP", "Exact reduction 2").
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from tessera.plan.candidates import Candidate, CandidateMemory, restrict_to_chains
from tessera.plan.milp_memory import REL_TOL

Pair = tuple[Candidate, Candidate]  # (F-side candidate, B-side candidate)
Edges = dict[tuple[int, int], dict[Pair, float]]  # (f_stage, b_stage) -> pair -> ms


def _edge_table(candidates: Sequence[Sequence[Candidate]], edge_costs: Mapping[Pair, float]) -> Edges:
    """Group pair costs by edge ``(f_stage, b_stage)``; check every pair of the edge is costed."""
    edges: Edges = {}
    for (cf, cb), ms in edge_costs.items():
        edges.setdefault((cf.stage, cb.stage), {})[(cf, cb)] = float(ms)
    for (f, b), pairs in edges.items():
        for cf in candidates[f]:
            for cb in (candidates[b] if f != b else (cf,)):
                if (cf, cb) not in pairs:
                    raise ValueError(f"edge (F S{f}, B S{b}) has no cost for pair ({cf}, {cb})")
    return edges


def _problem(candidates: Sequence[Sequence[Candidate]], edge_costs: Mapping[Pair, float],
             stage_ms: Mapping[Candidate, float] | None) -> tuple[Edges, dict[Candidate, float]]:
    """A solve's checked inputs: the edge table (:func:`_edge_table`) and ``stage_ms`` as a dict
    (ms; ``None``: empty).

    Raises:
        ValueError: ``candidates[s]`` holds a candidate of another stage, or an edge lacks the
            cost of one of its candidate pairs.
    """
    if any(c.stage != s for s, stage in enumerate(candidates) for c in stage):
        raise ValueError("candidates[s] must hold stage-s candidates")
    return _edge_table(candidates, edge_costs), dict(stage_ms or {})


def _allowed(edges: Edges, alive: Sequence[set[Candidate]], tau: float) -> dict[tuple[int, int], list[Pair]]:
    """Per edge, the pairs of surviving candidates that cost at most ``tau``."""
    return {e: [p for p, ms in pairs.items() if p[0] in alive[e[0]] and p[1] in alive[e[1]] and ms <= tau]
            for e, pairs in edges.items()}


def _reduce(candidates: Sequence[Sequence[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
            memory: CandidateMemory | None, capacity: float | None, tau: float) -> list[set[Candidate]]:
    """Pruning to a fixpoint: drop candidates all of whose pairs on some edge cost more than
    ``tau`` (or whose unpaired serial cost does), that cannot fit their rank even with the
    smallest candidates on the rank's other stages, or that lie on no contiguous chain."""
    alive = [set(s) for s in candidates]
    while True:
        before = sum(len(a) for a in alive)
        for (f, b), pairs in _allowed(edges, alive, tau).items():
            alive[f] &= {p[0] for p in pairs}
            alive[b] &= {p[1] for p in pairs}
        for s, a in enumerate(alive):
            alive[s] = {c for c in a if stage_ms.get(c, 0.0) <= tau}
        if memory is not None and capacity is not None and all(alive):
            for _, row in memory.rank_rows():
                stages = sorted({c.stage for c in row})
                mins = {s: min(row[c] for c in alive[s]) for s in stages}
                for s in stages:
                    rest = sum(mins[t] for t in stages if t != s)
                    alive[s] = {c for c in alive[s] if row[c] + rest <= capacity * (1 + REL_TOL)}
                if not all(alive):
                    break
        ordered = restrict_to_chains([sorted(a) for a in alive])
        alive = [set(a) for a in ordered]
        if not all(alive) or sum(len(a) for a in alive) == before:
            return alive


def _lower_bound(allowed: Mapping[tuple[int, int], list[Pair]], edges: Edges, alive: Sequence[set[Candidate]],
                 stage_ms: Mapping[Candidate, float], paired: set[int]) -> float:
    """A lower bound on the optimum, ms: every plan selects one pair on each edge and one
    candidate on each unpaired stage, so it costs at least the largest of their minima."""
    lows = [min((edges[e][p] for p in pairs), default=0.0) for e, pairs in allowed.items()]
    lows += [min((stage_ms.get(c, 0.0) for c in a), default=0.0) for s, a in enumerate(alive) if s not in paired]
    return max(lows, default=0.0)


def propagation_bound(candidates: Sequence[Sequence[Candidate]], edge_costs: Mapping[Pair, float],
                      stage_ms: Mapping[Candidate, float] | None = None, memory: CandidateMemory | None = None,
                      capacity_bytes: float | None = None, upper_ms: float = math.inf) -> float:
    """A lower bound on the optimal bottleneck of :func:`solve_partition`'s problem, ms (same
    arguments); see :func:`_propagation_bound`.

    Raises:
        ValueError: an edge lacks the cost of one of its candidate pairs.
    """
    return _propagation_bound(candidates, _edge_table(candidates, edge_costs), dict(stage_ms or {}), memory,
                              capacity_bytes, upper_ms)


def _propagation_bound(candidates: Sequence[Sequence[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
                       memory: CandidateMemory | None, capacity: float | None, upper_ms: float = math.inf) -> float:
    """A lower bound on the optimal bottleneck from pruning alone, ms.

    Every plan whose selected costs are all at most ``v`` survives :func:`_reduce` at threshold
    ``v`` (it only removes candidates that no such plan uses), so the optimum ``v*`` leaves every
    stage a candidate. Bisection over the distinct costs (pair costs and unpaired stage costs, at
    most ``upper_ms``) finds the least threshold at which :func:`_reduce` leaves every stage a
    candidate; it is at most ``v*``. ``O(log #costs)`` reductions, milliseconds on the real
    presets. Returns 0.0 when no cost is at most ``upper_ms``. ``candidates`` may already be
    reduced at a threshold at least ``upper_ms`` (the reduction is monotone in the threshold, so
    the bound is the same).
    """
    vals = sorted({v for pairs in edges.values() for v in pairs.values() if v <= upper_ms}
                  | {v for v in stage_ms.values() if v <= upper_ms})
    if not vals:
        return 0.0
    def feasible(k: int) -> bool:
        return all(_reduce(candidates, edges, stage_ms, memory, capacity, _threshold(vals[k])))

    lo, hi = 0, len(vals) - 1
    if not feasible(hi):
        return 0.0  # nothing at most upper_ms is feasible: no information
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return vals[lo]


def _threshold(ms: float) -> float:
    """A pruning threshold that keeps costs equal to ``ms`` up to float noise, ms."""
    return ms * (1 + REL_TOL) + 1e-12


def _edge_split(edges: Edges, alive: Sequence[set[Candidate]], tau: float, slack_lb: float | None
                ) -> list[tuple[tuple[int, int], list[Pair], list[tuple[Candidate, list[Candidate]]] | None]]:
    """Per edge, sorted, ``((f, b), pairs, banned)`` for :func:`_build` (and the cvxpy one).

    ``pairs``: the edge's pairs of ``alive`` candidates costing at most ``tau`` ms. ``banned`` is
    ``None`` when the edge keeps its cost terms; when all its ``pairs`` cost at most ``slack_lb``
    (ms; ``None``: no edge is slack) it is the conflict rows that replace them, ``[(cf, [cb, ...]),
    ...]`` sorted: the alive pairs of the edge left out of ``pairs``, by F-side candidate (on a
    self-edge ``f == b``, ``cf`` itself is banned)."""
    lb = -math.inf if slack_lb is None else slack_lb
    out: list[tuple[tuple[int, int], list[Pair], list[tuple[Candidate, list[Candidate]]] | None]] = []
    for (f, b), pairs in sorted(_allowed(edges, alive, tau).items()):
        if max((edges[(f, b)][p] for p in pairs), default=0.0) > lb:
            out.append(((f, b), pairs, None))
            continue
        kept = set(pairs)
        banned: dict[Candidate, list[Candidate]] = {}
        for (cf, cb) in edges[(f, b)]:
            if (cf, cb) not in kept and cf in alive[f] and cb in alive[b]:
                banned.setdefault(cf, []).append(cb)
        out.append(((f, b), pairs, [(cf, sorted(cbs)) for cf, cbs in sorted(banned.items())]))
    return out


def _selected(choice: Sequence[Candidate], edges: Edges, stage_ms: Mapping[Candidate, float]) -> list[float]:
    by = {c.stage: c for c in choice}
    vals = [pairs[(by[f], by[b])] for (f, b), pairs in edges.items()]
    paired = {s for e in edges for s in e}
    return vals + [stage_ms[c] for c in choice if c.stage not in paired and c in stage_ms]


def _objective(choice: Sequence[Candidate], edges: Edges, stage_ms: Mapping[Candidate, float]) -> float:
    """Largest selected cost of a choice, ms."""
    return max(_selected(choice, edges, stage_ms), default=0.0)


def _sum_cost(choice: Sequence[Candidate], edges: Edges, stage_ms: Mapping[Candidate, float]) -> float:
    return sum(_selected(choice, edges, stage_ms))
