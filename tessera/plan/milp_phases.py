"""The solver-independent phases of the partition MILP, shared by both solvers.

:func:`_pruned_model` builds the first phase (bottleneck) model after pruning, :func:`_tie_break_model`
the second (sum of costs at the optimal bottleneck), each with a ``build`` callable of the solver's
own (:mod:`tessera.plan.milp`'s PySCIPOpt model, :mod:`tessera.plan.milp_cvxpy`'s cvxpy one);
:class:`MilpResult` is what either solve returns. The formulation is :mod:`tessera.plan.milp`'s
docstring.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Mapping, Sequence, TypeVar

from tessera.errors import TesseraConfigError
from tessera.plan.candidates import Candidate, CandidateMemory, partition_of
from tessera.plan.milp_memory import check_memory
from tessera.plan.milp_reduce import Edges, _allowed, _lower_bound, _objective, _propagation_bound, _reduce, _sum_cost, \
    _threshold
from tessera.program.plan import Partition


@dataclass(frozen=True)
class MilpResult:
    """Outcome of :func:`solve_partition`.

    Attributes:
        partition: the chosen partition.
        choice: the chosen candidate of every stage.
        bottleneck_ms: largest cost over the selected pairs (and unpaired stages), ms.
        status: solver status of the (first-phase) solve in SCIP's words, e.g. ``"optimal"``,
            ``"timelimit"`` (``solver="cvxpy-highs"`` maps HiGHS's onto them);
            ``"+unpruned"`` is appended when pruning left no feasible choice and the unpruned
            problem was solved instead.
        solve_s: the solver's own solving time of all phases (SCIP's or HiGHS's), s;
            tie_break_s: of the second phase alone, s.
        build_s: memory checks, pruning and model construction, s.
        gap: relative MIP gap of the first phase (0 when optimal).
        n_vars_before/after, n_conss_before/after: model size without / with pruning.
        pairs_before_pruning / pairs_after_pruning: candidate pairs over all edges, and those
            left by pruning (cost at most the threshold, both candidates surviving).
        pair_terms_after: pairs that still carry a cost term (a ``y`` variable or a self-edge
            term) in the pruned bottleneck model; the others are on slack edges (see
            :func:`_build`).
        candidates_before / candidates_after: candidates over all stages.
        sum_ms: sum of the selected edge costs (and unpaired stage costs), ms (phase-2 objective).
        n_vars_tie_break: variables of the tie-break model (all edges, pairs above the optimal
            bottleneck pruned); 0 when no tie-break ran.
        lower_bound_ms: the lower bound used to leave out slack edges (the largest per-edge
            minimum and :func:`propagation_bound`), ms; 0.0 without pruning. When it equals the
            pruning threshold, the warm start is proven optimal before SCIP runs.
        cap_hit: the wall-clock safety cap (``time_limit_s``) stopped a phase (the solver's
            status ``timelimit``) before its deterministic limit
            (:data:`~tessera.plan.milp_memory.NODE_LIMIT` nodes) or the optimum: the choice may
            depend on the machine's speed and load.
    """

    partition: Partition
    choice: tuple[Candidate, ...]
    bottleneck_ms: float
    status: str
    solve_s: float
    tie_break_s: float
    build_s: float
    gap: float
    n_vars_before: int
    n_vars_after: int
    n_conss_before: int
    n_conss_after: int
    pairs_before_pruning: int
    pairs_after_pruning: int
    candidates_before: int
    candidates_after: int
    sum_ms: float
    n_vars_tie_break: int = 0
    lower_bound_ms: float = 0.0
    pair_terms_after: int = 0
    cap_hit: bool = False

    @property
    def size_before(self) -> int:
        """Variables + constraints of the bottleneck model without pruning."""
        return self.n_vars_before + self.n_conss_before

    @property
    def size_after(self) -> int:
        """Variables + constraints of the bottleneck model with pruning."""
        return self.n_vars_after + self.n_conss_after

    @property
    def shrink(self) -> float:
        """How many times smaller pruning made the bottleneck model (``size_before / size_after``)."""
        return self.size_before / max(self.size_after, 1)

    def summary(self) -> str:
        return (f"MILP {self.status}: bottleneck {self.bottleneck_ms:.3f} ms; vars {self.n_vars_before}->"
                f"{self.n_vars_after} (tie-break {self.n_vars_tie_break}), conss {self.n_conss_before}->{self.n_conss_after}, pairs "
                f"{self.pairs_before_pruning}->{self.pairs_after_pruning} ({self.pair_terms_after} with a cost term), candidates {self.candidates_before}->"
                f"{self.candidates_after}, lower bound {self.lower_bound_ms:.3f} ms; build {self.build_s:.2f} s, solve {self.solve_s:.2f} s (tie-break "
                f"{self.tie_break_s:.2f} s)")


M = TypeVar("M")  # a bottleneck model: milp's _Built or milp_cvxpy's _Lp

CAPPED = "timelimit"
"""The solver status of a run its wall-clock cap stopped (SCIP's word; HiGHS's ``kTimeLimit``);
the deterministic limit of every phase is :data:`~tessera.plan.milp_memory.NODE_LIMIT` nodes."""


@dataclass(frozen=True)
class _Pruned(Generic[M]):
    """The first-phase model of a solve and what pruning did to it (:func:`_pruned_model`; shared
    by the PySCIPOpt and cvxpy solvers; private).

    Attributes:
        before: the unpruned model (every candidate, every pair, every edge).
        model: the model to solve: the pruned one, or ``before`` without pruning or when pruning
            left some stage no candidate.
        full / alive: per stage, all candidates / the candidates of ``model``.
        tau: the pruning threshold, ms (``inf``: no cost pruning).
        lb: the lower bound that left out slack edges (``_build``'s ``slack_lb``), ms; 0.0 when
            ``model`` is ``before``.
        suffix: ``"+unpruned"`` when pruning was asked for but ``model`` is ``before``, else ``""``.
        build_s: memory checks, pruning and model construction, s.
        n_vars_before / n_conss_before / pairs_before: size and pair terms of ``before``.
        n_vars_after / n_conss_after: size of ``model``; pairs_after: pairs left by pruning;
            terms_after: pairs with a cost term in ``model``.
    """

    before: M
    model: M
    full: list[set[Candidate]]
    alive: list[set[Candidate]]
    tau: float
    lb: float
    suffix: str
    build_s: float
    n_vars_before: int
    n_conss_before: int
    pairs_before: int
    n_vars_after: int
    n_conss_after: int
    pairs_after: int
    terms_after: int

    def unpruned(self) -> _Pruned[M]:
        """The fallback when the pruned model has no solution: ``before`` over every candidate,
        with ``suffix="+unpruned"`` and the unpruned sizes as the "after" ones."""
        return replace(self, model=self.before, alive=self.full, suffix="+unpruned", lb=0.0,
                       n_vars_after=self.n_vars_before, n_conss_after=self.n_conss_before,
                       pairs_after=self.pairs_before, terms_after=self.pairs_before)

    def result(self, choice: Sequence[Candidate], edges: Edges, stage_ms: Mapping[Candidate, float], status: str,
               solve_s: float, tie_s: float, build_s: float, gap: float, n_vars_tie: int,
               cap_hit: bool = False) -> MilpResult:
        """The :class:`MilpResult` of ``choice``: ``status`` (first phase; ``suffix`` is appended),
        ``solve_s`` (first phase, s; ``tie_s``, the tie-break's, is added), ``build_s`` (s),
        ``gap``, ``n_vars_tie`` and ``cap_hit`` as the fields of those names; sizes and bound
        from here."""
        return MilpResult(partition_of(choice), tuple(choice), _objective(choice, edges, stage_ms),
                          status + self.suffix, solve_s + tie_s, tie_s, build_s, gap, self.n_vars_before,
                          self.n_vars_after, self.n_conss_before, self.n_conss_after, self.pairs_before,
                          self.pairs_after, sum(len(s) for s in self.full), sum(len(a) for a in self.alive),
                          _sum_cost(choice, edges, stage_ms), n_vars_tie, self.lb, self.terms_after, cap_hit)


def _pruned_model(candidates: Sequence[Sequence[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
                  memory: CandidateMemory | None, capacity_bytes: float | None, time_limit_s: float, prune: bool,
                  baseline_bottleneck_ms: float | None, build: Callable[..., M],
                  size: Callable[[M], tuple[int, int, int]]) -> _Pruned[M]:
    """The first phase's model, built as :func:`solve_partition` prescribes, by either solver.

    Memory pre-checks (:func:`~tessera.plan.milp_memory.check_memory`, ``time_limit_s`` s), the
    unpruned model, and with ``prune`` the threshold (``baseline_bottleneck_ms``, ms; ``None``: no
    cost pruning), :func:`_reduce`, the lower bound (:func:`_lower_bound`,
    :func:`_propagation_bound`) and the pruned model with that bound; if the reduction leaves some
    stage no candidate, the unpruned model with ``suffix="+unpruned"``.

    ``build(alive, edges, stage_ms, memory, capacity, tau, slack_lb=None)`` builds a model
    (:func:`_build`'s arguments); ``size(model)`` is its (variables, constraints, pairs with a cost
    term).

    Raises:
        TesseraConfigError: memory makes the problem infeasible (from ``check_memory``).
    """
    t0 = time.perf_counter()
    check_memory(candidates, memory, capacity_bytes, time_limit_s)
    full = [set(s) for s in candidates]
    before = build(full, edges, stage_ms, memory, capacity_bytes, math.inf)
    n_vars_b, n_conss_b, pairs_b = size(before)
    tau = math.inf
    if prune and baseline_bottleneck_ms is not None:
        tau = _threshold(baseline_bottleneck_ms)
    built, alive, suffix = before, full, ""
    lb, pairs_a = 0.0, pairs_b
    if prune:
        alive = _reduce(candidates, edges, stage_ms, memory, capacity_bytes, tau)
        if all(alive):
            allowed = _allowed(edges, alive, tau)
            pairs_a = sum(len(v) for v in allowed.values())
            paired = {s for e in edges for s in e}
            lb = max(_lower_bound(allowed, edges, alive, stage_ms, paired),
                     _propagation_bound([sorted(a) for a in alive], edges, stage_ms, memory, capacity_bytes, tau))
            built = build(alive, edges, stage_ms, memory, capacity_bytes, tau, slack_lb=lb)
        else:
            alive, suffix, lb = full, "+unpruned", 0.0
    build_s = time.perf_counter() - t0
    n_vars_a, n_conss_a, terms_a = size(built)
    return _Pruned(before, built, full, alive, tau, lb, suffix, build_s, n_vars_b, n_conss_b, pairs_b,
                   n_vars_a, n_conss_a, pairs_a, terms_a)


def _no_solution(time_limit_s: float, solver_label: str, status: str) -> TesseraConfigError:
    """The error of a first phase that found no solution within its limits
    (:data:`~tessera.plan.milp_memory.NODE_LIMIT` nodes, ``time_limit_s`` s): field
    ``planner.time_limit_s``, naming the solver (``"SCIP"``, ``"HiGHS"``) and its ``status``."""
    return TesseraConfigError("planner.time_limit_s", time_limit_s,
                              f"partition MILP found no solution ({solver_label} status {status})",
                              "raise the time limit or check the candidates tile the layers")


def _tie_break_model(candidates: Sequence[Sequence[Candidate]], edges: Edges, stage_ms: Mapping[Candidate, float],
                     memory: CandidateMemory | None, capacity_bytes: float | None, prune: bool,
                     choice: Sequence[Candidate],
                     build: Callable[..., M]) -> tuple[float, float, list[set[Candidate]], M]:
    """The second phase's model, for either solver: ``(t_star, tau2, alive2, model)``.

    ``t_star`` is the bottleneck of the first phase's ``choice``, ms, and ``tau2`` it up to float
    noise, ms (the caller adds ``T <= tau2``); every edge is kept (the sum ranks all of them) and,
    with ``prune``, the pairs above ``tau2`` are pruned (they cannot be selected at ``T*``) and
    :func:`_reduce` at ``tau2`` gives ``alive2`` (every candidate if it leaves a stage none).
    ``build`` as in :func:`_pruned_model`.
    """
    t_star = _objective(choice, edges, stage_ms)
    tau2 = t_star * (1 + 1e-7) + 1e-9
    full = [set(s) for s in candidates]
    alive2 = _reduce(candidates, edges, stage_ms, memory, capacity_bytes, tau2) if prune else full
    if not all(alive2):
        alive2 = full
    return t_star, tau2, alive2, build(alive2, edges, stage_ms, memory, capacity_bytes, tau2 if prune else math.inf)
