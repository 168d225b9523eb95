"""The partition MILP of :mod:`tessera.plan.milp`, formulated with cvxpy and solved by SCIP or HiGHS.

``solve_partition(..., solver="cvxpy-scip" | "cvxpy-highs")`` lands here
(:func:`solve_partition_cvxpy`). The model is the PySCIPOpt one row for row (``docs/planner.md``,
"Partition MILP" and "Solvers"): one binary ``x`` per candidate, the tiling rows, per edge the
marginal rows of its ``y`` and its ``T`` row, the ``T`` rows of stages in no edge, the memory
rows with their pair terms (``y`` where the edge has it, else ``z >= x_f + x_b - 1``), and for
edges that cannot be the bottleneck the conflict rows instead; the same pruning, lower bound,
unpruned fallback and tie-break phase, through the same helpers of :mod:`tessera.plan.milp`. So
the two formulations have the same variables and rows (``n_vars_*``, ``n_conss_*`` agree).
cvxpy sees it as two vector variables, the binaries ``x`` and the continuous ``w = (T, y, z)``
with bounds, and two sparse row blocks (``A_x x + A_w w == b``, ``<= b``).

Solver settings: SCIP gets the PySCIPOpt path's settings (separation off, the same node limit and
time cap); HiGHS gets the node limit (``mip_max_nodes``), the time cap, ``mip_rel_gap=0`` (SCIP's
default ``limits/gap`` is 0; HiGHS's default 1e-4 could stop short of the optimum) and no output.

Warm start: cvxpy gives neither interface a user's starting point (its SCIP interface has none,
its HiGHS interface only reuses the solution of an earlier solve of the same ``Problem``). So
``warm_start`` is checked against the model's rows instead; if it satisfies them, the solve gets
the cutoff row ``T <= its bottleneck`` (the tie-break phase: ``sum <= its sum``), which keeps the
optimum and gives the solver the incumbent's bound (what most of SCIP's ``addSol`` is worth here:
Qwen3-Next-80B ep 32 at radius 2, unpruned, HiGHS takes 17.8 s without it and 0.27 s with it;
``docs/planner.md``, "Solvers"), and the start is the
result when the solver returns no solution or a worse one (a time limit), so the result is never
worse than a feasible warm start, as with ``addSol``. The solver's heuristics do not start from
the point itself.

The memory pre-checks (:func:`tessera.plan.milp_memory.check_memory`) stay on PySCIPOpt for
every solver: they are diagnostics, and their errors are the same whichever solver is chosen.

``MilpResult`` is filled as on the PySCIPOpt path: ``status`` in SCIP's words (HiGHS's
``kOptimal``, ``kTimeLimit``, ... become ``optimal``, ``timelimit``, ...); ``solve_s`` the solver's
own solving time of all phases (SCIP's ``getSolvingTime``, HiGHS's ``getRunTime``); ``build_s``
adds to the checks, pruning and model construction cvxpy's compilation of the bottleneck model and
its interface's hand-over to the solver (everything of the first phase but the solver's own time).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from tessera.errors import TesseraConfigError
from tessera.plan.candidates import Candidate, CandidateMemory
from tessera.plan.milp_phases import CAPPED, MilpResult, _no_solution, _pruned_model, _tie_break_model
from tessera.plan.milp_reduce import Edges, Pair, _edge_split, _objective, _problem, _sum_cost
from tessera.plan.milp_memory import GB, NODE_LIMIT, binding_pair_terms

try:
    import cvxpy as cp
    import scipy.sparse as sp
except ImportError:  # cvxpy is a dependency; require_backend names the fix when it is missing
    cp = sp = None


@dataclass(frozen=True)
class Backend:
    """A MILP solver cvxpy calls: its cvxpy name, its own name and the Python package it needs."""

    cvxpy_name: str
    label: str
    package: str


BACKENDS: dict[str, Backend] = {
    "cvxpy-scip": Backend("SCIP", "SCIP", "pyscipopt"),
    "cvxpy-highs": Backend("HIGHS", "HiGHS", "highspy"),
}
"""``planner.solver`` value -> the solver cvxpy is asked for."""

_HIGHS_STATUS = {"kOptimal": "optimal", "kTimeLimit": "timelimit", "kInfeasible": "infeasible",
                 "kUnbounded": "unbounded", "kUnboundedOrInfeasible": "inforunbd"}
_HIGHS_FEASIBLE = 2  # HighsInfo.primal_solution_status: kSolutionStatusFeasible


def require_backend(solver: str) -> Backend:
    """The backend of ``solver`` (a key of :data:`BACKENDS`), checked to be installed.

    Raises:
        TesseraConfigError: field ``planner.solver``: cvxpy is not installed, or cvxpy does not
            find the solver (``cp.installed_solvers()``); the fix names the package to install.
    """
    b = BACKENDS[solver]
    if cp is None:
        raise TesseraConfigError("planner.solver", solver, "needs cvxpy, which is not installed",
                                 "pip install cvxpy or use planner.solver=scip")
    if b.cvxpy_name not in cp.installed_solvers():
        raise TesseraConfigError("planner.solver", solver,
                                 f"{b.label} is not installed ({b.package}), so cvxpy cannot solve the partition "
                                 f"MILP with it", f"pip install {b.package} or use planner.solver=scip")
    return b


_SCIP_SEPARATING_OFF: dict[str, object] = {}


def _scip_separating_off() -> dict[str, object]:
    """The SCIP parameters ``setSeparating(SCIP_PARAMSETTING.OFF)`` changes (what the PySCIPOpt
    path's ``_tune`` sets), as a parameter dict cvxpy can pass on."""
    if not _SCIP_SEPARATING_OFF:
        from pyscipopt import SCIP_PARAMSETTING, Model

        m = Model()
        default = m.getParams()
        m.setSeparating(SCIP_PARAMSETTING.OFF)
        _SCIP_SEPARATING_OFF.update({k: v for k, v in m.getParams().items() if default[k] != v})
    return dict(_SCIP_SEPARATING_OFF)


_HIGHS_QUIET: list[bool] = []


def _quiet_highs_banner() -> None:
    """Create the process's first ``highspy.Highs`` with file descriptor 1 on ``/dev/null``.

    HiGHS prints its banner to stdout when the first instance of a process is constructed, before
    any option can be set (cvxpy constructs one before passing ``output_flag``); on stdout it
    would corrupt ``tessera plan --json``. Later instances print nothing."""
    if _HIGHS_QUIET:
        return
    import ctypes
    import os
    import sys

    import highspy

    _HIGHS_QUIET.append(True)
    try:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        highspy.Highs()
        return
    try:
        os.dup2(null, 1)
        highspy.Highs()
        ctypes.CDLL(None).fflush(None)  # the C library's stdout buffer, before fd 1 is restored
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _solver_opts(b: Backend, limit_s: float) -> dict[str, object]:
    limit = max(limit_s, 1.0)
    if b.cvxpy_name == "SCIP":
        return {"scip_params": {**_scip_separating_off(), "limits/totalnodes": NODE_LIMIT, "limits/time": limit}}
    _quiet_highs_banner()
    return {"time_limit": limit, "mip_max_nodes": NODE_LIMIT, "mip_rel_gap": 0.0, "output_flag": False}


@dataclass
class _Outcome:
    """One solve: the solver's status (SCIP's words), solving time, gap and the ``x`` values."""

    status: str
    solve_s: float
    gap: float
    overhead_s: float
    x: np.ndarray | None


def _read(b: Backend, raw: dict) -> tuple[str, float, float, bool]:
    """(status, solving time s, gap, has a solution) of a raw solver result."""
    if b.cvxpy_name == "SCIP":
        model = raw["model"]
        status = raw["scip_status"]
        has = model.getNSols() > 0
        return status, float(raw["solve_time"]), (0.0 if status == "optimal" or not has else model.getGap()), has
    info = raw["info"]
    name = raw["model_status"]
    status = _HIGHS_STATUS.get(name, name[1:].lower() if name.startswith("k") else name)
    has = info.primal_solution_status == _HIGHS_FEASIBLE
    return status, float(raw["run_time"]), (0.0 if status == "optimal" or not has else float(info.mip_gap)), has


Terms = list[tuple[int, float]]  # (column, coefficient)


@dataclass
class _Lp:
    """A partition MILP as sparse rows over binaries ``x`` (one per candidate) and continuous ``w``
    (``T``, ``y``, ``z``) with bounds (mutable by nature; private)."""

    x: dict[Candidate, int] = field(default_factory=dict)
    w_lb: list[float] = field(default_factory=list)
    w_ub: list[float] = field(default_factory=list)
    y: dict[Pair, int] = field(default_factory=dict)  # y and z: the product variables, columns of w
    rows: list[tuple[Terms, Terms, bool, float]] = field(default_factory=list)  # x terms, w terms, equality, rhs
    t: int = -1
    cost_x: Terms = field(default_factory=list)  # the sum of the edge costs (phase-2 objective)
    cost_w: Terms = field(default_factory=list)
    n_pairs: int = 0

    def add_w(self, lb: float, ub: float) -> int:
        self.w_lb.append(lb)
        self.w_ub.append(ub)
        return len(self.w_lb) - 1

    def row(self, xs: Terms, ws: Terms, eq: bool, rhs: float) -> None:
        self.rows.append((xs, ws, eq, rhs))

    @property
    def n_vars(self) -> int:
        return len(self.x) + len(self.w_lb)

    @property
    def n_conss(self) -> int:
        return len(self.rows)

    def point(self, choice: Sequence[Candidate], t: float) -> tuple[np.ndarray, np.ndarray] | None:
        """``choice`` with objective ``t`` as values of ``(x, w)``; ``None`` if not in the model."""
        if not all(c in self.x for c in choice):
            return None
        chosen = set(choice)
        x = np.zeros(len(self.x))
        x[[self.x[c] for c in chosen]] = 1.0
        w = np.zeros(len(self.w_lb))
        for (cf, cb), j in self.y.items():
            w[j] = 1.0 if cf in chosen and cb in chosen else 0.0
        w[self.t] = max(t, self.w_lb[self.t])
        return x, w

    def admits(self, choice: Sequence[Candidate], t: float, extra: Sequence[tuple[Terms, Terms, bool, float]] = ()) -> bool:
        """Whether ``choice`` (objective ``t``) satisfies every row (what SCIP checks of a start)."""
        pt = self.point(choice, t)
        if pt is None:
            return False
        x, w = pt
        for xs, ws, eq, rhs in list(self.rows) + list(extra):
            v = sum(a * x[j] for j, a in xs) + sum(a * w[j] for j, a in ws)
            tol = 1e-6 * max(1.0, abs(rhs))
            if (abs(v - rhs) if eq else v - rhs) > tol:
                return False
        return True

    def solve(self, b: Backend, limit_s: float, objective: tuple[Terms, Terms],
              extra: Sequence[tuple[Terms, Terms, bool, float]] = ()) -> _Outcome:
        """Minimise ``objective`` (x terms, w terms) over the rows and ``extra`` rows with ``b``."""
        t0 = time.perf_counter()
        nx, nw = len(self.x), len(self.w_lb)
        rows = list(self.rows) + list(extra)
        x = cp.Variable(nx, boolean=True, name="x")
        w = cp.Variable(nw, name="w", bounds=[np.array(self.w_lb), np.array(self.w_ub)])
        cons = []
        for eq in (True, False):
            sel = [r for r in rows if r[2] == eq]
            if not sel:
                continue
            ax, aw = _matrix(sel, 0, nx), _matrix(sel, 1, nw)
            rhs = np.array([r[3] for r in sel])
            lhs = ax @ x + aw @ w
            cons.append(lhs == rhs if eq else lhs <= rhs)
        cx, cw = np.zeros(nx), np.zeros(nw)
        for j, a in objective[0]:
            cx[j] += a
        for j, a in objective[1]:
            cw[j] += a
        prob = cp.Problem(cp.Minimize(cx @ x + cw @ w), cons)
        data, chain, inverse = prob.get_problem_data(b.cvxpy_name)
        raw = chain.solve_via_data(prob, data, warm_start=False, verbose=False, solver_opts=_solver_opts(b, limit_s))
        status, solve_s, gap, has = _read(b, raw)
        values = None
        if has:
            with warnings.catch_warnings():  # SCIP's time limit reads as "optimal_inaccurate" in cvxpy
                warnings.simplefilter("ignore")
                prob.unpack_results(raw, chain, inverse)
            values = None if x.value is None else np.asarray(x.value, dtype=float)
        overhead = max(time.perf_counter() - t0 - solve_s, 0.0)
        return _Outcome(status, solve_s, gap, overhead, values)

    def choice(self, alive: Sequence[set[Candidate]], xval: np.ndarray) -> tuple[Candidate, ...]:
        return tuple(max(sorted(a), key=lambda c: xval[self.x[c]]) for a in alive)


def _matrix(rows: Sequence[tuple[Terms, Terms, bool, float]], k: int, n: int):
    r, c, v = [], [], []
    for i, row in enumerate(rows):
        for j, a in row[k]:
            r.append(i)
            c.append(j)
            v.append(a)
    return sp.csr_matrix((v, (r, c)), shape=(len(rows), n))  # duplicates are summed


def _build(alive: Sequence[set[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
           memory: CandidateMemory | None, capacity: float | None, tau: float,
           slack_lb: float | None = None) -> _Lp:
    """:func:`tessera.plan.milp._build` (with :func:`tessera.plan.milp_memory.tiling_model` and
    :func:`~tessera.plan.milp_memory.rank_memory`) as rows of an :class:`_Lp`, in the same order."""
    lp = _Lp()
    cands = [sorted(a) for a in alive]
    for stage in cands:
        for c in stage:
            lp.x[c] = len(lp.x)
    x = lp.x
    for s, stage in enumerate(cands):
        lp.row([(x[c], 1.0) for c in stage], [], True, 1.0)
        if s + 1 < len(cands):
            for v in sorted({c.stop for c in stage} | {c.start for c in cands[s + 1]}):
                lp.row([(x[c], 1.0) for c in stage if c.stop == v]
                       + [(x[c], -1.0) for c in cands[s + 1] if c.start == v], [], True, 0.0)
    lp.t = lp.add_w(max(slack_lb or 0.0, 0.0), math.inf)
    paired = {s for e in edges for s in e}
    for (f, b), pairs, banned in _edge_split(edges, alive, tau, slack_lb):
        if banned is not None:
            for cf, cbs in banned:
                if f == b:
                    lp.row([(x[cf], 1.0)], [], False, 0.0)
                else:
                    lp.row([(x[cf], 1.0)] + [(x[cb], 1.0) for cb in cbs], [], False, 1.0)
            continue
        lp.n_pairs += len(pairs)
        if f == b:
            xs = [(x[p[0]], edges[(f, b)][p]) for p in pairs]
            lp.row(xs, [(lp.t, -1.0)], False, 0.0)
            lp.cost_x += xs
        else:
            y = {p: lp.add_w(0.0, 1.0) for p in pairs}
            lp.y.update(y)
            for cf in sorted(alive[f]):
                lp.row([(x[cf], -1.0)], [(y[p], 1.0) for p in pairs if p[0] == cf], True, 0.0)
            for cb in sorted(alive[b]):
                lp.row([(x[cb], -1.0)], [(y[p], 1.0) for p in pairs if p[1] == cb], True, 0.0)
            ws = [(y[p], edges[(f, b)][p]) for p in pairs]
            lp.row([], ws + [(lp.t, -1.0)], False, 0.0)
            lp.cost_w += ws
    for s, a in enumerate(alive):
        if s not in paired and any(c in stage_ms for c in a):
            xs = [(x[c], stage_ms.get(c, 0.0)) for c in a]
            lp.row(xs, [(lp.t, -1.0)], False, 0.0)
            lp.cost_x += xs
    if memory is not None and capacity is not None:
        _memory_rows(lp, memory, capacity)
    return lp


def _memory_rows(lp: _Lp, memory: CandidateMemory, capacity: float) -> None:
    """:func:`tessera.plan.milp_memory.rank_memory` plus ``<= capacity``: one row per memory row,
    GB; a pair term uses the edge's ``y`` or a new ``z >= x_f + x_b - 1`` (kept in ``lp.y``), and
    a row that cannot exceed the capacity keeps only its linear part."""
    x = lp.x

    def product(p: Pair) -> int:
        if p not in lp.y:
            cf, cb = p
            z = lp.add_w(0.0, 1.0)
            lp.row([(x[cf], 1.0), (x[cb], 1.0)], [(z, -1.0)], False, 1.0)
            lp.y[p] = z
        return lp.y[p]

    for _, row, terms in memory.exact_rows():
        xs = [(x[c], b / GB) for c, b in sorted(row.items()) if c in x]
        ws = [(product(p), b / GB) for p, b in binding_pair_terms(row, terms, x, capacity)]
        lp.row(xs, ws, False, capacity / GB)


def _lp_size(lp: _Lp) -> tuple[int, int, int]:
    """(variables, constraints, pairs with a cost term) of an :class:`_Lp`."""
    return lp.n_vars, lp.n_conss, lp.n_pairs


@dataclass
class _Run:
    status: str
    solve_s: float
    gap: float
    overhead_s: float
    choice: tuple[Candidate, ...] | None


def _run(lp: _Lp, b: Backend, limit_s: float, alive: Sequence[set[Candidate]], objective: tuple[Terms, Terms],
         start: Sequence[Candidate] | None, t_start: float, value: Callable[[Sequence[Candidate]], float],
         extra: Sequence[tuple[Terms, Terms, bool, float]] = ()) -> _Run:
    """Minimise ``objective`` over ``lp`` and ``extra`` rows, with ``start`` (objective ``t_start``
    in ``T``) in place of a warm start: if it satisfies the rows, the solve gets the cutoff row
    ``objective <= value(start)`` (the start is feasible, so the optimum stays; not counted in the
    model's size), and the start is the result when the solver returns no solution or a worse one
    (``value``: the phase's objective of a choice, ms)."""
    ok = start is not None and lp.admits(start, t_start, extra)
    cut = list(extra)
    if ok:
        cut.append((objective[0], objective[1], False, value(start) * (1 + 1e-9) + 1e-9))
    out = lp.solve(b, limit_s, objective, cut)
    choice = lp.choice(alive, out.x) if out.x is not None else None
    if ok and (choice is None or value(choice) > value(start) * (1 + 1e-9) + 1e-12):
        choice = tuple(start)
    return _Run(out.status, out.solve_s, out.gap, out.overhead_s, choice)


def solve_partition_cvxpy(candidates: Sequence[Sequence[Candidate]], edge_costs: Mapping[Pair, float],
                          memory: CandidateMemory | None, capacity_bytes: float | None,
                          baseline_bottleneck_ms: float | None = None, prune: bool = True, time_limit_s: float = 60.0,
                          *, stage_ms: Mapping[Candidate, float] | None = None, tie_break: bool = True,
                          warm_start: Sequence[Candidate] | None = None, solver: str = "cvxpy-highs") -> MilpResult:
    """:func:`tessera.plan.milp.solve_partition` with cvxpy and ``solver`` (a key of
    :data:`BACKENDS`); same arguments and result (module docstring for what differs: the warm
    start, ``status`` wording, ``build_s``).

    Raises:
        TesseraConfigError: ``planner.solver``: the solver or cvxpy is not installed; memory makes
            the problem infeasible; no solution within the time limit.
    """
    b = require_backend(solver)
    edges, stage_ms = _problem(candidates, edge_costs, stage_ms)
    pm = _pruned_model(candidates, edges, stage_ms, memory, capacity_bytes, time_limit_s, prune,
                       baseline_bottleneck_ms, _build, _lp_size)

    def bottleneck(ch: Sequence[Candidate]) -> float:
        return _objective(ch, edges, stage_ms)

    start = tuple(warm_start) if warm_start is not None else None
    t_start = bottleneck(start) if start is not None else 0.0
    built = pm.model
    first = _run(built, b, time_limit_s, pm.alive, ([], [(built.t, 1.0)]), start, t_start, bottleneck)
    status, solve_s, build_s = first.status, first.solve_s, pm.build_s + first.overhead_s
    capped = status == CAPPED
    if first.choice is None and built is not pm.before:  # pruned problem infeasible: solve unpruned
        pm = pm.unpruned()
        built = pm.model
        first = _run(built, b, time_limit_s - solve_s, pm.alive, ([], [(built.t, 1.0)]), start, t_start, bottleneck)
        status, solve_s, build_s = first.status, solve_s + first.solve_s, build_s + first.overhead_s
        capped = capped or status == CAPPED
    if first.choice is None:
        raise _no_solution(time_limit_s, b.label, status)
    gap = 0.0 if status == "optimal" else first.gap
    choice = first.choice
    tie_s, n_vars_tie = 0.0, 0
    if tie_break and len(pm.alive) > 1:
        t_star, tau2, alive2, tb = _tie_break_model(candidates, edges, stage_ms, memory, capacity_bytes, prune,
                                                    choice, _build)
        n_vars_tie = tb.n_vars
        keep_t = [([], [(tb.t, 1.0)], False, tau2)]

        def total(ch: Sequence[Candidate]) -> float:
            return _sum_cost(ch, edges, stage_ms)

        second = _run(tb, b, time_limit_s - solve_s, alive2, (tb.cost_x, tb.cost_w), choice, t_star, total, keep_t)
        tie_s = second.solve_s
        capped = capped or second.status == CAPPED
        if second.choice is not None and bottleneck(second.choice) <= tau2:
            choice = second.choice
    return pm.result(choice, edges, stage_ms, status, solve_s, tie_s, build_s, gap, n_vars_tie, capped)
