"""A cheap feasible partition that bounds the MILP optimum from above, for pruning.

Profile-guided pruning (Tessera, OSDI 2026, §4.3) drops every candidate pair costlier than a
known feasible plan's bottleneck: such a pair cannot appear in any plan at least as good, so the
optimum survives. The paper uses the baseline's bottleneck; a better feasible plan prunes more
with the same guarantee. :func:`local_search` starts from the baseline partition and moves one
layer from one stage to another (shifting the boundaries between them) while that lowers
(bottleneck, sum of selected costs), keeping every rank within memory. It uses only the already-computed pair costs, so it takes
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
    return all(v <= capacity for v in memory.peak(choice).values())


def _moves(cur: Sequence[Candidate], sets: Sequence[set[Candidate]]):
    """Every neighbour of ``cur`` that moves one layer from one stage to another: stages ``s < t``
    and ``delta = +1`` (stage ``s`` takes the first layer of ``s + 1``, every stage up to ``t``
    shifts by one, stage ``t`` gives up its first layer) or ``-1`` (the reverse). ``t = s + 1`` is
    a single boundary move. Shorter segments first (deterministic)."""
    n = len(cur)
    for span in range(1, n):
        for s in range(n - span):
            t = s + span
            for delta in (-1, 1):
                a, b = cur[s], cur[t]
                new = [Candidate(a.stage, a.start, a.stop + delta)]
                new += [Candidate(c.stage, c.start + delta, c.stop + delta) for c in cur[s + 1:t]]
                new.append(Candidate(b.stage, b.start + delta, b.stop))
                if all(c in sets[c.stage] for c in new):
                    yield cur[:s] + new + cur[t + 1:]


def local_search(candidates: Sequence[Sequence[Candidate]], pc: PairCosts, start: Sequence[Candidate],
                 memory: CandidateMemory | None = None, capacity_bytes: float | None = None,
                 max_rounds: int = 200) -> tuple[tuple[Candidate, ...], float]:
    """Improve ``start`` by moving one layer between two stages at a time (steepest descent on
    (bottleneck, sum of selected costs): each round takes the best move of :func:`_moves`, the
    first in its order on ties; a first-improvement walk lowers the sum into partitions that no
    single move can leave): moving a layer from stage ``s`` to a distant stage ``t``
    shifts every boundary between them, the move a single boundary step cannot make without
    passing through worse partitions (e.g. the extra layer of a 49-position model relocated from
    rank 1 to rank 3).

    Args:
        candidates: per stage, its candidates; a move is allowed only between candidates.
        pc: pair costs of those candidates (:func:`tessera.plan.overlap_graph.pair_costs`).
        start: a feasible choice, one candidate per stage (e.g. the baseline's).
        memory, capacity_bytes: per-rank memory rule (``None``: none).
        max_rounds: bound on improving moves (each round scores ``O(stages^2)`` moves).

    Returns:
        (choice, bottleneck_ms): a feasible choice no worse than ``start`` and its bottleneck, ms.
    """
    sets = [set(s) for s in candidates]
    cur = list(start)
    best = _score(pc, cur)
    if best is None:
        return tuple(start), float("inf")
    for _ in range(max_rounds):
        step = None
        for trial in _moves(cur, sets):
            sc = _score(pc, trial)
            if sc is not None and sc < (best if step is None else step[0]) and _fits(trial, memory, capacity_bytes):
                step = (sc, trial)
        if step is None:
            break
        best, cur = step
    return tuple(cur), best[0]
