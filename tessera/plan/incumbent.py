"""A cheap feasible partition that bounds the MILP optimum from above, for pruning.

Profile-guided pruning (Tessera, OSDI 2026, §4.3) drops every candidate pair costlier than a
known feasible plan's bottleneck: such a pair cannot appear in any plan at least as good, so the
optimum survives. The paper uses the baseline's bottleneck; a better feasible plan prunes more
with the same guarantee. :func:`local_search` starts from the baseline partition and moves one
stage boundary by one layer at a time while that lowers (bottleneck, sum of selected costs),
keeping every rank within memory. It uses only the already-computed pair costs, so it takes
milliseconds.
"""

from __future__ import annotations

from typing import Sequence

from tessera.plan.candidates import Candidate, CandidateMemory
from tessera.plan.overlap_graph import PairCosts


def _score(pc: PairCosts, choice: Sequence[Candidate]) -> tuple[float, float] | None:
    by = {c.stage: c for c in choice}
    vals = []
    for e in pc.edges:
        v = pc.pair_ms.get((by[e.f_stage], by[e.b_stage]))
        if v is None:
            return None
        vals.append(v)
    paired = pc.paired_stages()
    vals += [pc.f_ms[c] + pc.b_ms[c] for c in choice if c.stage not in paired]
    return (max(vals, default=0.0), sum(vals))


def _fits(choice: Sequence[Candidate], memory: CandidateMemory | None, capacity: float | None) -> bool:
    if memory is None or capacity is None:
        return True
    use: dict[int, float] = {}
    for c in choice:
        r = memory.stage_rank[c.stage]
        use[r] = use.get(r, 0.0) + memory.bytes[c]
    return all(v <= capacity for v in use.values())


def local_search(candidates: Sequence[Sequence[Candidate]], pc: PairCosts, start: Sequence[Candidate],
                 memory: CandidateMemory | None = None, capacity_bytes: float | None = None,
                 max_rounds: int = 200) -> tuple[tuple[Candidate, ...], float]:
    """Improve ``start`` by single-layer boundary moves (first improvement, deterministic order).

    Args:
        candidates: per stage, its candidates; a move is allowed only between candidates.
        pc: pair costs of those candidates (:func:`tessera.plan.overlap_graph.pair_costs`).
        start: a feasible choice, one candidate per stage (e.g. the baseline's).
        memory, capacity_bytes: per-rank memory rule (``None``: none).
        max_rounds: bound on improving passes over all boundaries.

    Returns:
        (choice, bottleneck_ms): a feasible choice no worse than ``start`` and its bottleneck, ms.
    """
    sets = [set(s) for s in candidates]
    cur = list(start)
    best = _score(pc, cur)
    if best is None:
        return tuple(start), float("inf")
    for _ in range(max_rounds):
        improved = False
        for s in range(len(cur) - 1):
            for delta in (-1, 1):
                a, b = cur[s], cur[s + 1]
                na = Candidate(a.stage, a.start, a.stop + delta)
                nb = Candidate(b.stage, b.start + delta, b.stop)
                if na not in sets[s] or nb not in sets[s + 1]:
                    continue
                trial = cur[:s] + [na, nb] + cur[s + 2:]
                sc = _score(pc, trial)
                if sc is not None and sc < best and _fits(trial, memory, capacity_bytes):
                    cur, best, improved = trial, sc, True
        if not improved:
            break
    return tuple(cur), best[0]
