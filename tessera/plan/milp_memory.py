"""Memory rules of the partition MILP (:mod:`tessera.plan.milp`) and the SCIP model they share.

:func:`tiling_model` is the base of every partition model (one binary per candidate, one
candidate per stage, contiguous ranges); :func:`rank_memory` gives each memory row of a
:class:`tessera.plan.candidates.CandidateMemory` as a linear expression (:func:`binding_pair_terms`:
which of a row's pair terms can matter, shared with :mod:`tessera.plan.milp_cvxpy`); :func:`check_memory`
diagnoses, before the main solve, a capacity that no candidate partition fits, naming the rank and
GB in one line (``docs/planner.md``, "Memory errors").
"""

from __future__ import annotations

from typing import Container, Mapping, Sequence

from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

from tessera.errors import TesseraConfigError
from tessera.plan.candidates import Candidate, CandidateMemory

GB = 1e9  # bytes per GB in messages (decimal, as device capacities are quoted)
REL_TOL = 1e-9  # relative tolerance when comparing bytes or ms with a capacity or threshold

NODE_LIMIT = 20_000
"""Branch-and-bound nodes each phase of the partition MILP may explore (SCIP ``limits/totalnodes``,
HiGHS ``mip_max_nodes``), and each memory pre-check: the solvers' deterministic limit, so the
same model gives the same choice on any machine at any load (a node limit stops a run at the same
node every time; a time limit does not). ``planner.time_limit_s`` is only the wall-clock safety
cap (``MilpResult.cap_hit``). The MILPs of ``benchmarks/planner.py`` close in at most 24 nodes
(``docs/planner.md``, "Deterministic budgets")."""


def check_memory(candidates: Sequence[Sequence[Candidate]], memory: CandidateMemory | None,
                 capacity_bytes: float | None, time_limit_s: float) -> None:
    """Raise unless some contiguous choice of candidates fits every rank in ``capacity_bytes``.

    Raises:
        TesseraConfigError: field ``memory``: "rank r needs X GB, capacity Y GB (...)", from the
            smallest candidate of each of the rank's stages, or else from the least memory of the
            fullest rank over all candidate partitions (a min-max MILP).
    """
    _memory_precheck(candidates, memory, capacity_bytes)
    if memory is not None and capacity_bytes is not None:
        if not _memory_feasible(candidates, memory, capacity_bytes * (1 + REL_TOL), time_limit_s):
            r, need, optimal = _least_peak_memory(candidates, memory, time_limit_s)
            raise _memory_error(r, need, capacity_bytes, ("" if optimal else "at least; ") + "the least memory "
                                "of the fullest rank over all candidate partitions")


def _memory_precheck(candidates: Sequence[Sequence[Candidate]], memory: CandidateMemory | None,
                     capacity: float | None) -> None:
    """Raise if some rank cannot fit even with the smallest candidate on each of its stages."""
    if memory is None or capacity is None:
        return
    need: dict[int, float] = {}
    for r, row in memory.rank_rows():
        stages = {c.stage for c in row}
        need[r] = max(need.get(r, 0.0), sum(min(row[c] for c in candidates[s]) for s in stages))
    for r in sorted(need):
        if need[r] > capacity * (1 + REL_TOL):
            raise _memory_error(r, need[r], capacity, "with the smallest candidate of each of its stages")


def _tune(m: Model) -> None:
    """SCIP settings for these models: no cutting planes. Measured on random 4-6 stage instances
    (0.03-0.14 s off vs 0.5-7 s default) and on Qwen3-Next-80B pp=8 vpp=2 radius 2 (2.7 s vs
    4.1 s): root cuts barely move the bound of the min-max objective and cost most of the time."""
    m.setSeparating(SCIP_PARAMSETTING.OFF)


def tiling_model(candidates: Sequence[Sequence[Candidate]], name: str) -> tuple[Model, dict[Candidate, object]]:
    """A SCIP model with one binary per candidate, one candidate per stage and contiguity."""
    m = Model(name)
    m.hideOutput()
    _tune(m)
    x = {c: m.addVar(f"x_{c.stage}_{c.start}_{c.stop}", vtype="B") for stage in candidates for c in stage}
    for s, stage in enumerate(candidates):
        m.addCons(quicksum(x[c] for c in stage) == 1, f"one_{s}")
        if s + 1 < len(candidates):
            for v in sorted({c.stop for c in stage} | {c.start for c in candidates[s + 1]}):
                m.addCons(quicksum(x[c] for c in stage if c.stop == v)
                          == quicksum(x[c] for c in candidates[s + 1] if c.start == v), f"tile_{s}_{v}")
    return m, x


def rank_memory(x: dict[Candidate, object], memory: CandidateMemory, model: Model | None = None,
                products: dict[tuple[Candidate, Candidate], object] | None = None,
                capacity_bytes: float | None = None) -> list[tuple[int, object]]:
    """Per memory row (:meth:`CandidateMemory.exact_rows`), its rank and the linear expression of
    the rank's memory there, GB (candidates not in the model are left out: pruned, never chosen).

    A row's pair term ``(cf, cb) -> bytes`` multiplies ``x[cf] * x[cb]``: ``products[(cf, cb)]``
    where the model already has that product (the partition MILP's ``y``), else a new continuous
    ``z >= x[cf] + x[cb] - 1, z >= 0`` in ``model`` (added to ``products``): the memory rows bound
    the terms from above, so ``z`` takes the product's value at every integer point. With
    ``capacity_bytes``, a row that cannot exceed it under any choice (its largest candidate per
    stage plus its largest pair term) keeps only its linear part: it never binds, and the model
    stays as small as without pair terms.
    """
    prods = products if products is not None else {}

    def product(p: tuple[Candidate, Candidate]) -> object:
        if p not in prods:
            if model is None:
                raise ValueError("rank_memory: memory rows with pair terms need the SCIP model")
            cf, cb = p
            z = model.addVar(f"z_{cf.stage}_{cf.start}_{cf.stop}_{cb.stage}_{cb.start}_{cb.stop}", lb=0.0, ub=1.0)
            model.addCons(z >= x[cf] + x[cb] - 1, f"zlink_{cf.stage}_{cf.start}_{cf.stop}_{cb.stage}_{cb.start}_{cb.stop}")
            prods[p] = z
        return prods[p]

    out = []
    for r, row, terms in memory.exact_rows():
        expr = quicksum(b / GB * x[c] for c, b in sorted(row.items()) if c in x)
        pairs = binding_pair_terms(row, terms, x, capacity_bytes)
        if pairs:
            expr = expr + quicksum(b / GB * product(p) for p, b in pairs)
        out.append((r, expr))
    return out


def binding_pair_terms(row: Mapping[Candidate, float], terms: Mapping[tuple[Candidate, Candidate], float],
                       present: Container[Candidate],
                       capacity_bytes: float | None) -> list[tuple[tuple[Candidate, Candidate], float]]:
    """The pair terms a model needs of one memory row (:meth:`CandidateMemory.exact_rows`).

    Args:
        row: candidate -> bytes of the row; terms: ``(cf, cb) -> bytes`` of its pair terms.
        present: the candidates in the model (pruned ones are left out).
        capacity_bytes: device capacity, bytes; ``None``: keep every term.

    Returns:
        ``[((cf, cb), bytes), ...]`` sorted by pair: the positive terms of pairs in the model, or
        ``[]`` when the row cannot exceed ``capacity_bytes`` under any choice (its largest present
        candidate per stage plus its largest such term): then only its linear part matters.
    """
    pairs = [(p, b) for p, b in sorted(terms.items()) if b > 0 and p[0] in present and p[1] in present]
    if pairs and capacity_bytes is not None:
        most: dict[int, float] = {}
        for c, b in row.items():
            if c in present:
                most[c.stage] = max(most.get(c.stage, b), b)
        if sum(most.values()) + max(b for _, b in pairs) <= capacity_bytes * (1 + REL_TOL):
            return []
    return pairs


def _memory_feasible(candidates: Sequence[Sequence[Candidate]], memory: CandidateMemory, capacity: float,
                     time_limit_s: float) -> bool:
    """Whether some contiguous choice fits every rank in ``capacity`` bytes (SCIP feasibility;
    ``True`` when undecided within :data:`NODE_LIMIT` nodes or the time cap: the main solve then
    decides)."""
    m, x = tiling_model(candidates, "tessera-memory-feasibility")
    for k, (r, expr) in enumerate(rank_memory(x, memory, m, capacity_bytes=capacity)):
        m.addCons(expr <= capacity / GB, f"mem_{r}_{k}")
    m.setParam("limits/totalnodes", NODE_LIMIT)
    m.setParam("limits/time", max(time_limit_s, 1.0))
    m.setParam("limits/solutions", 1)
    m.optimize()
    return m.getStatus() != "infeasible"


def _least_peak_memory(candidates: Sequence[Sequence[Candidate]], memory: CandidateMemory,
                       time_limit_s: float) -> tuple[int, float, bool]:
    """(rank, bytes, optimal): the smallest memory of the fullest rank over all contiguous choices
    (a min-max MILP within :data:`NODE_LIMIT` nodes and the time cap; when not solved to
    optimality, ``bytes`` is SCIP's proven lower bound and ``rank`` the fullest rank of its best
    choice)."""
    m, x = tiling_model(candidates, "tessera-least-memory")
    peak = m.addVar("peak", lb=0.0)
    m.setObjective(peak, "minimize")
    for k, (r, expr) in enumerate(rank_memory(x, memory, m)):
        m.addCons(expr <= peak, f"mem_{r}_{k}")
    m.setParam("limits/totalnodes", NODE_LIMIT)
    m.setParam("limits/time", max(time_limit_s, 1.0))
    m.optimize()
    if m.getNSols() == 0:
        raise TesseraConfigError("planner.candidate_radius", "-", "the candidates admit no contiguous partition",
                                 "build candidates with stage_candidates")
    use = memory.peak(c for st in candidates for c in st if m.getVal(x[c]) > 0.5)
    r = max(use, key=lambda k: (use[k], -k))
    optimal = m.getStatus() == "optimal"
    return r, (use[r] if optimal else m.getDualbound() * GB), optimal


def _memory_error(rank: int, need: float, capacity: float, why: str) -> TesseraConfigError:
    """One-line memory diagnosis, e.g. ``rank 3 needs 92.4 GB, capacity 80.0 GB (...)``."""
    return TesseraConfigError(
        "memory", f"rank {rank}", f"rank {rank} needs {need / GB:.1f} GB, capacity {capacity / GB:.1f} GB ({why})",
        "use more pipeline stages, activation_recompute, a smaller micro batch or a wider candidate_radius")
