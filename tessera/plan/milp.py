"""The partition MILP: one candidate per virtual stage, minimising the largest selected pair cost.

Tessera (OSDI 2026, §4, "core method"): choose one candidate range per virtual stage so
that the ranges tile the layers exactly once, every rank fits in device memory, and the maximum
post-overlap cost over the overlap edges is minimal. Before solving, "profile-guided pruning"
drops candidate pairs costlier than the serial-balanced baseline's bottleneck (the paper reports a
3-5x smaller problem, solved in < 5 s by a MILP solver). We solve with SCIP (PySCIPOpt).

Formulation (``x`` binary, ``y`` continuous in [0, 1], ``T`` continuous, ms)::

    min T
    sum_c x[s,c] = 1                                   every stage s
    sum_{c: stop=v} x[s,c] = sum_{c: start=v} x[s+1,c] every boundary s|s+1, every cut v
    sum_cb y[e,cf,cb] = x[f,cf],  sum_cf y[e,cf,cb] = x[b,cb]   every edge e=(f,b), f != b
    T >= sum_{cf,cb} cost(cf,cb) * y[e,cf,cb]          every edge e=(f,b), f != b
    T >= sum_c cost(c,c) * x[f,c]                      every edge e=(f,f)
    T >= sum_c serial_ms(c) * x[s,c]                   every stage s in no edge
    sum_{s on r} sum_c mem(c) * x[s,c]
      + sum_{(cf,cb)} extra(cf,cb) * x[f,cf] x[b,cb] <= capacity   every memory row of rank r

``y[e,cf,cb]`` linearises ``x[f,cf] * x[b,cb]`` with the marginal (transportation) constraints:
with binary ``x`` they force ``y`` to the product, and their LP relaxation is much tighter than
``T >= cost * (x_f + x_b - 1)``. A pruned pair simply has no ``y``, which forbids choosing both.
Optionally a second, lexicographic phase keeps ``T`` optimal and minimises the sum of the selected
costs (ties in the bottleneck are common; the sum is the rest of the steady state).

Topology: the template fixes which rank holds each virtual stage (``CandidateMemory.stage_rank``)
and the candidates fix the embedding on stage 0 and the head on the last stage, so the only
rank-level constraint left to the MILP is memory: one row per memory point of the rank
(:class:`~tessera.plan.candidates.CandidateMemory`), whose pair terms (an ``FB``'s own peak, which
depends on both chunks) use ``y`` where the edge has it and a ``z >= x_f + x_b - 1`` otherwise
(:func:`tessera.plan.milp_memory.rank_memory`). Pruning (``prune=True``) removes, to a fixpoint,
pairs above the threshold, candidates with no surviving pair on some edge, candidates that cannot
fit their rank, and candidates on no contiguous chain; if that leaves no feasible choice (the
baseline itself does not fit), the unpruned problem is solved instead. It then bounds the optimum
from below (:func:`tessera.plan.milp_reduce.propagation_bound`) and leaves out the cost terms of every edge that cannot
exceed that bound (``docs/planner.md``, "Exact reduction 2").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from pyscipopt import Model, quicksum

from tessera.errors import TesseraConfigError
from tessera.plan.candidates import Candidate, CandidateMemory
from tessera.plan.milp_memory import GB, NODE_LIMIT, rank_memory, tiling_model
from tessera.plan.milp_phases import CAPPED, MilpResult, _no_solution, _pruned_model, _tie_break_model
from tessera.plan.milp_reduce import Edges, _edge_split, _objective, _problem


@dataclass
class _Built:
    """A SCIP model under construction/solution (mutable by nature; private)."""

    model: Model
    x: dict[Candidate, object]
    y: dict[tuple[Candidate, Candidate], object]
    t: object
    cost_expr: object
    n_pairs: int

    def choice(self, alive: Sequence[set[Candidate]]) -> tuple[Candidate, ...]:
        return tuple(max(sorted(a), key=lambda c: self.model.getVal(self.x[c])) for a in alive)

    def add_start(self, choice: Sequence[Candidate], t: float) -> None:
        """Give SCIP ``choice`` (objective ``t``) as a starting solution, if it is in the model."""
        if not all(c in self.x for c in choice):
            return
        m, chosen = self.model, set(choice)
        sol = m.createSol()
        for c, v in self.x.items():
            m.setSolVal(sol, v, 1.0 if c in chosen else 0.0)
        for (cf, cb), v in self.y.items():
            m.setSolVal(sol, v, 1.0 if cf in chosen and cb in chosen else 0.0)
        m.setSolVal(sol, self.t, t)
        m.addSol(sol, free=True)

    def run(self, limit_s: float) -> tuple[str, float]:
        """Solve within :data:`NODE_LIMIT` nodes (deterministic) and ``limit_s`` s (the safety
        cap, at least 1 s): (SCIP status, SCIP's solving time s)."""
        self.model.setParam("limits/totalnodes", NODE_LIMIT)
        self.model.setParam("limits/time", max(limit_s, 1.0))
        self.model.optimize()
        return self.model.getStatus(), self.model.getSolvingTime()


def _build(alive: Sequence[set[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
           memory: CandidateMemory | None, capacity: float | None, tau: float,
           slack_lb: float | None = None) -> _Built:
    """The SCIP model over the ``alive`` candidates and the pairs costing at most ``tau``.

    ``slack_lb`` (a lower bound on the optimal T, ms; ``None``: keep every edge): ``T >= slack_lb``,
    and leave out the pair variables of every edge whose allowed pairs all cost at most it (it can
    never be the unique bottleneck, so the optimal T is unchanged); its pruned pairs stay forbidden
    by one conflict row per F-side candidate, ``x_f + sum_{b banned with f} x_b <= 1`` (at most
    one ``x_b`` of a stage is 1, so this is exactly "no banned pair")."""
    m, x = tiling_model([sorted(a) for a in alive], "tessera-partition")
    t = m.addVar("T", lb=max(slack_lb or 0.0, 0.0))
    m.setObjective(t, "minimize")
    costs_terms = []
    ys: dict[tuple[Candidate, Candidate], object] = {}
    n_pairs = 0
    paired = {s for e in edges for s in e}
    for (f, b), pairs, banned in _edge_split(edges, alive, tau, slack_lb):
        if banned is not None:  # the edge cannot bind T, but its pruned pairs must stay forbidden
            for cf, cbs in banned:
                if f == b:
                    m.addCons(x[cf] <= 0, f"ban_{f}_{b}_{cf.start}_{cf.stop}")
                else:
                    m.addCons(x[cf] + quicksum(x[cb] for cb in cbs) <= 1, f"ban_{f}_{b}_{cf.start}_{cf.stop}")
            continue
        n_pairs += len(pairs)
        if f == b:
            expr = quicksum(edges[(f, b)][p] * x[p[0]] for p in pairs)
        else:
            y = {p: m.addVar(f"y_{f}_{b}_{p[0].start}_{p[0].stop}_{p[1].start}_{p[1].stop}", lb=0.0, ub=1.0)
                 for p in pairs}
            ys.update(y)
            for cf in sorted(alive[f]):
                m.addCons(quicksum(y[p] for p in pairs if p[0] == cf) == x[cf], f"mf_{f}_{b}_{cf.start}_{cf.stop}")
            for cb in sorted(alive[b]):
                m.addCons(quicksum(y[p] for p in pairs if p[1] == cb) == x[cb], f"mb_{f}_{b}_{cb.start}_{cb.stop}")
            expr = quicksum(edges[(f, b)][p] * y[p] for p in pairs)
        m.addCons(t >= expr, f"edge_{f}_{b}")
        costs_terms.append(expr)
    for s, a in enumerate(alive):
        if s not in paired and any(c in stage_ms for c in a):
            expr = quicksum(stage_ms.get(c, 0.0) * x[c] for c in a)
            m.addCons(t >= expr, f"alone_{s}")
            costs_terms.append(expr)
    if memory is not None and capacity is not None:
        for k, (r, mem_expr) in enumerate(rank_memory(x, memory, m, ys, capacity)):
            m.addCons(mem_expr <= capacity / GB, f"mem_{r}_{k}")
    return _Built(m, x, ys, t, quicksum(costs_terms), n_pairs)


def _scip_size(b: _Built) -> tuple[int, int, int]:
    """(variables, constraints, pairs with a cost term) of a PySCIPOpt model."""
    return b.model.getNVars(), b.model.getNConss(), b.n_pairs


SOLVERS = ("scip", "cvxpy-scip", "cvxpy-highs")
"""``planner.solver`` values: this module's PySCIPOpt model, or the same model through cvxpy
(:mod:`tessera.plan.milp_cvxpy`) solved by SCIP or HiGHS."""


def check_solver(solver: str) -> None:
    """Raise unless ``solver`` is one of :data:`SOLVERS` and installed (cheap: call it before the
    pair costs, so that a missing solver fails at once).

    Raises:
        TesseraConfigError: field ``planner.solver``: an unknown name, or cvxpy or the solver it
            needs is not installed (the fix names the package, or ``planner.solver=scip``).
    """
    if solver not in SOLVERS:
        raise TesseraConfigError("planner.solver", solver, "is not a known MILP solver",
                                 f"use one of: {', '.join(SOLVERS)}")
    if solver != "scip":
        from tessera.plan.milp_cvxpy import require_backend

        require_backend(solver)


def solve_partition(candidates: Sequence[Sequence[Candidate]], edge_costs: Mapping[tuple[Candidate, Candidate], float],
                    memory: CandidateMemory | None, capacity_bytes: float | None,
                    baseline_bottleneck_ms: float | None = None, prune: bool = True, time_limit_s: float = 60.0,
                    *, stage_ms: Mapping[Candidate, float] | None = None, tie_break: bool = True,
                    warm_start: Sequence[Candidate] | None = None, solver: str = "scip") -> MilpResult:
    """Choose one candidate per stage minimising the largest selected pair cost (SCIP).

    Args:
        candidates: per stage, its candidates (:func:`tessera.plan.candidates.stage_candidates`).
        edge_costs: ``(f candidate, b candidate) -> post-overlap cost``, ms; the edges are the
            ``(f.stage, b.stage)`` that occur (:attr:`tessera.plan.overlap_graph.PairCosts.pair_ms`).
        memory: per-candidate bytes and stage ranks
            (:func:`tessera.plan.candidates.candidate_memory`); ``None``: no limit.
        capacity_bytes: usable device memory per rank, bytes; ``None``: no limit.
        baseline_bottleneck_ms: pruning threshold, ms (the serial-balanced partition's
            bottleneck); pairs costlier than it are dropped. ``None``: no cost pruning.
        prune: apply cost, memory and contiguity pruning before solving.
        time_limit_s: the wall-clock safety cap over all phases, s (``MilpResult.cap_hit``);
            the deterministic limit is :data:`~tessera.plan.milp_phases.NODE_LIMIT` nodes per phase.
        stage_ms: candidate -> cost, ms, bounding the objective for stages in no edge
            (:meth:`tessera.plan.overlap_graph.PairCosts.unpaired_stage_ms`).
        tie_break: second phase minimising the sum of selected costs at the optimal bottleneck.
        warm_start: one candidate per stage (e.g. the baseline's) given to SCIP as a first
            solution, so a node limit or the time cap still returns at least that.
        solver: ``"scip"`` (this module's PySCIPOpt model), ``"cvxpy-scip"`` or ``"cvxpy-highs"``
            (the same model through cvxpy, :func:`tessera.plan.milp_cvxpy.solve_partition_cvxpy`:
            same result; cvxpy passes no warm start, so a ``warm_start`` that satisfies the rows
            becomes a cutoff row ``T <= its bottleneck`` and the result when the solver finds
            nothing better).

    Raises:
        TesseraConfigError: memory makes the problem infeasible (names the rank and GB), or no
            solution within the time limit; ``planner.solver``: unknown or not installed.
    """
    check_solver(solver)
    if solver != "scip":
        from tessera.plan.milp_cvxpy import solve_partition_cvxpy

        return solve_partition_cvxpy(candidates, edge_costs, memory, capacity_bytes, baseline_bottleneck_ms, prune,
                                     time_limit_s, stage_ms=stage_ms, tie_break=tie_break, warm_start=warm_start,
                                     solver=solver)
    edges, stage_ms = _problem(candidates, edge_costs, stage_ms)
    pm = _pruned_model(candidates, edges, stage_ms, memory, capacity_bytes, time_limit_s, prune,
                       baseline_bottleneck_ms, _build, _scip_size)

    start = tuple(warm_start) if warm_start is not None else None
    built = pm.model
    if start is not None:
        built.add_start(start, _objective(start, edges, stage_ms))
    status, solve_s = built.run(time_limit_s)
    capped = status == CAPPED
    if built.model.getNSols() == 0 and built is not pm.before:  # pruned problem infeasible: solve unpruned
        pm = pm.unpruned()
        built = pm.model
        if start is not None:
            built.add_start(start, _objective(start, edges, stage_ms))
        status, s2 = built.run(time_limit_s - solve_s)
        solve_s += s2
        capped = capped or status == CAPPED
    if built.model.getNSols() == 0:
        raise _no_solution(time_limit_s, "SCIP", status)
    gap = 0.0 if status == "optimal" else built.model.getGap()
    choice = built.choice(pm.alive)
    tie_s, n_vars_tie = 0.0, 0
    if tie_break and len(pm.alive) > 1:
        t_star, tau2, alive2, tb = _tie_break_model(candidates, edges, stage_ms, memory, capacity_bytes, prune,
                                                    choice, _build)
        m = tb.model
        n_vars_tie = m.getNVars()
        m.addCons(tb.t <= tau2, "keep_T")
        m.setObjective(tb.cost_expr, "minimize")
        tb.add_start(choice, t_star)
        tie_status, tie_s = tb.run(time_limit_s - solve_s)
        capped = capped or tie_status == CAPPED
        if m.getNSols() > 0:
            second = tb.choice(alive2)
            if _objective(second, edges, stage_ms) <= tau2:
                choice = second
    return pm.result(choice, edges, stage_ms, status, solve_s, tie_s, pm.build_s, gap, n_vars_tie, capped)
