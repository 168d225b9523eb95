"""The partition MILP through cvxpy (:mod:`tessera.plan.milp_cvxpy`, ``planner.solver=cvxpy-scip |
cvxpy-highs``) against the PySCIPOpt model (``planner.solver=scip``): same optimum, same model
size, on planner instances built as ``make_plan`` builds them and on random ones checked by brute
force; and the one-line errors for an unknown or missing solver."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import cvxpy as cp
import pytest

from plan_helpers import chains, hetero_costs
from test_milp import brute, random_instance
from tessera.config.load import load_recipe
from tessera.config.resolve import resolve_model
from tessera.config.schema import ParallelConfig
from tessera.config.validate import MILP_SOLVERS, validate_recipe
from tessera.cost.analytic import analytic_costs
from tessera.errors import TesseraConfigError
from tessera.flow import compile_programs
from tessera.plan.baseline import baseline_plan
from tessera.plan.candidates import Candidate, CandidateMemory, candidates_of, exact_candidate_memory, stage_candidates
from tessera.plan.incumbent import local_search
from tessera.plan.milp import SOLVERS, check_solver, solve_partition
from tessera.plan.milp_reduce import _edge_table
from tessera.plan.overlap_graph import bottleneck_ms, overlap_edges, pair_costs
from tessera.plan import milp_cvxpy
from tessera.plan.pair_scheduler import schedule_pair
from tessera.plan.planner import pair_with_w
from tessera.program.memory import rank_memory_bytes
from tessera.program.plan import Partition
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

pytestmark = pytest.mark.xdist_group("milp_cvxpy")  # module fixtures built once (tests/conftest.py)

QWEN = str(Path(__file__).resolve().parents[1] / "recipes" / "qwen3-next-80b.yaml")
REL = 1e-6
CVXPY_SOLVERS = ("cvxpy-scip", "cvxpy-highs")


def _need(solver: str) -> None:
    """Skip the HiGHS case where highspy is missing (cvxpy and PySCIPOpt are dependencies)."""
    if solver == "cvxpy-highs":
        pytest.importorskip("highspy")


# ---------------------------------------------------------------------------------------------
# planner instances, built as make_plan builds them


def _tiny_costs():
    par = ParallelConfig(pp=2, vpp=2, ep=2, tp=1, dp=2, num_microbatches=4, micro_batch_size=2, seq_length=64)
    return analytic_costs(get_model("tiny-qwen3-next"), get_hardware("cpu"), par)


def _qwen3_next_costs(n_layers: int):
    import dataclasses

    par = ParallelConfig(pp=8, vpp=2, ep=8, tp=1, dp=8, num_microbatches=16, micro_batch_size=1, seq_length=4096)
    costs = analytic_costs(get_model("qwen3-next-80b-a3b"), get_hardware("h800"), par, activation_recompute=True)
    return dataclasses.replace(costs, layers=costs.layers[:n_layers],
                               head=dataclasses.replace(costs.head, index=n_layers))


# name -> (costs factory, template, pp, vpp, microbatches)
SHAPES = {
    "tiny-qwen3-next-interleaved": (_tiny_costs, "interleaved-1f1b", 2, 2, 4),
    "qwen3next12-interleaved": (lambda: _qwen3_next_costs(12), "interleaved-1f1b", 2, 2, 4),
    "hetero-dualpipe-v": (lambda: hetero_costs("MAMMAAMA", p2p_ms=0.05), "dualpipe-v", 2, 2, 4),
}


@pytest.fixture(scope="module")
def instances():
    """name -> the inputs ``make_plan`` gives the MILP: candidates (radius 1), pair costs, exact
    memory rows (with the pair terms of the FB peaks) at the baseline Programs' largest peak (so
    memory binds), the baseline's bottleneck and the local-search incumbent."""
    out = {}
    for name, (make, template, pp, vpp, m) in SHAPES.items():
        costs = make()
        base = baseline_plan(costs, template, pp, vpp, m, overlap=True, split_w=True)
        cands = stage_candidates(base.partition, 1, len(costs.layers))
        pc = pair_costs(costs, cands, overlap_edges(template, pp, vpp, m), schedule_pair, pair_with_w(template, True),
                        serial_fallback=True)
        cap = max(rank_memory_bytes(compile_programs(base), costs))
        mem = exact_candidate_memory(costs, cands, template, pp, vpp, m, True, True, pair_peak=pc.pair_peak)
        base_choice = candidates_of(base.partition)
        inc, inc_ms = local_search(cands, pc, base_choice, mem, cap)
        out[name] = dict(cands=cands, pc=pc, mem=mem, cap=cap, tau=bottleneck_ms(pc, base_choice), inc=inc,
                         inc_ms=inc_ms)
    return out


# (prune, memory, warm start): unpruned, with memory rows, pruned at the incumbent with its warm start
CASES = {"unpruned": (False, False, False), "unpruned-memory": (False, True, False),
         "pruned": (True, False, True), "pruned-memory": (True, True, True)}
_SCIP: dict[tuple[str, str], object] = {}


def _solve(I, case: str, solver: str):
    prune, with_mem, ws = CASES[case]
    return solve_partition(I["cands"], I["pc"].pair_ms, I["mem"] if with_mem else None, I["cap"] if with_mem else None,
                           min(I["tau"], I["inc_ms"]) if prune else None, prune, 60,
                           stage_ms=I["pc"].unpaired_stage_ms(), warm_start=I["inc"] if ws else None, solver=solver)


def _same(res, ref, pc=None, memory=None, cap=None):
    """``res`` reaches ``ref``'s optimum with the same model."""
    assert res.status == ref.status == "optimal"
    assert res.bottleneck_ms == pytest.approx(ref.bottleneck_ms, rel=REL)
    assert res.sum_ms == pytest.approx(ref.sum_ms, rel=REL)  # the tie-break optimum too
    if pc is not None:  # the partition's own bottleneck, recomputed from the pair costs
        assert bottleneck_ms(pc, res.choice) == pytest.approx(bottleneck_ms(pc, ref.choice), rel=REL)
        assert bottleneck_ms(pc, res.choice) == pytest.approx(res.bottleneck_ms, rel=1e-12)
    assert (res.n_vars_before, res.n_vars_after, res.n_conss_before, res.n_conss_after) == \
           (ref.n_vars_before, ref.n_vars_after, ref.n_conss_before, ref.n_conss_after)
    assert (res.pairs_before_pruning, res.pairs_after_pruning, res.pair_terms_after) == \
           (ref.pairs_before_pruning, ref.pairs_after_pruning, ref.pair_terms_after)
    assert (res.candidates_after, res.n_vars_tie_break) == (ref.candidates_after, ref.n_vars_tie_break)
    assert res.lower_bound_ms == ref.lower_bound_ms
    assert res.solve_s >= res.tie_break_s >= 0.0 and res.build_s > 0.0 and res.gap == 0.0
    if memory is not None:
        peak = memory.peak(res.choice)
        assert max(peak.values()) <= cap * (1 + 1e-9)


@pytest.mark.parametrize("solver", CVXPY_SOLVERS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_cvxpy_reaches_the_scip_optimum_on_planner_instances(instances, name, case, solver):
    _need(solver)
    I = instances[name]
    if (name, case) not in _SCIP:
        _SCIP[(name, case)] = _solve(I, case, "scip")
    ref = _SCIP[(name, case)]
    res = _solve(I, case, solver)
    with_mem = CASES[case][1]
    _same(res, ref, I["pc"], I["mem"] if with_mem else None, I["cap"])
    assert res.choice in set(chains(I["cands"]))


def test_memory_binds_and_pruning_shrinks_on_the_planner_instances(instances):
    # the cases above are not vacuous: memory changes the optimum of one instance, pruning
    # shrinks every model, and the memory rows carry pair terms (FB peaks)
    I = instances["qwen3next12-interleaved"]
    free, tight = _solve(I, "unpruned", "scip"), _solve(I, "unpruned-memory", "scip")
    assert tight.bottleneck_ms > free.bottleneck_ms * (1 + 1e-3)
    for I in instances.values():
        res = _solve(I, "pruned-memory", "scip")
        assert res.size_after < res.size_before
        assert any(t for t in I["mem"].pair_terms)


@pytest.mark.parametrize("solver", CVXPY_SOLVERS)
@pytest.mark.parametrize("seed", range(8))
def test_cvxpy_equals_brute_force_on_random_instances(seed, solver):
    _need(solver)
    base, cands, ec, stage_ms, memory, cap = random_instance(seed, with_memory=seed % 2 == 1)
    opt = brute(cands, ec, stage_ms, memory, cap)
    edges = {(cf.stage, cb.stage) for cf, cb in ec}
    bc = candidates_of(base)
    tau = max([ec[(bc[f], bc[b])] for f, b in edges] + [stage_ms[c] for c in bc if c in stage_ms])
    for prune in (False, True):
        kw = dict(baseline_bottleneck_ms=tau, prune=prune, stage_ms=stage_ms, time_limit_s=30)
        ref = solve_partition(cands, ec, memory, cap, **kw)
        res = solve_partition(cands, ec, memory, cap, solver=solver, **kw)
        assert res.bottleneck_ms == pytest.approx(opt, abs=1e-9)
        assert res.status == ref.status and res.status.startswith("optimal")
        assert res.sum_ms == pytest.approx(ref.sum_ms, rel=REL)
        assert (res.size_before, res.size_after) == (ref.size_before, ref.size_after)
        if memory is not None:
            for r in set(memory.stage_rank):
                assert sum(memory.bytes[c] for c in res.choice if memory.stage_rank[c.stage] == r) <= cap * (1 + 1e-9)


@pytest.mark.parametrize("solver", CVXPY_SOLVERS)
def test_cvxpy_pruning_falls_back_when_the_baseline_does_not_fit(solver):
    _need(solver)
    cands = stage_candidates(Partition((-1, 3, 7)), 1, 6)
    base_pair = (Candidate(0, -1, 3), Candidate(1, 3, 7))
    ec = {(f, b): (10.0 if (f, b) == base_pair else 20.0 + f.stop + b.start) for f in cands[0] for b in cands[1]}
    memory = CandidateMemory((0, 1), {c: (10e9 * (c.stop + 1) if c.stage == 0 else 0.0) for s in cands for c in s})
    res = solve_partition(cands, ec, memory, 35e9, baseline_bottleneck_ms=10.0, solver=solver,
                          warm_start=base_pair)  # the warm start does not fit: it must not come back
    assert res.status == "optimal+unpruned"
    assert res.partition.bounds == (-1, 2, 7) and res.bottleneck_ms == 24.0
    assert res.n_vars_after == res.n_vars_before


@pytest.mark.parametrize("solver", CVXPY_SOLVERS)
def test_cvxpy_memory_errors_are_the_scip_ones(solver):
    _need(solver)
    cands = stage_candidates(Partition((-1, 3, 7)), 0, 6)
    ec = {(f, b): 1.0 for f in cands[0] for b in cands[1]}
    memory = CandidateMemory((0, 1), {c: 40e9 for s in cands for c in s})
    msgs = []
    for s in ("scip", solver):
        with pytest.raises(TesseraConfigError) as err:
            solve_partition(cands, ec, memory, 30e9, solver=s)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1] and "rank 0 needs 40.0 GB, capacity 30.0 GB" in msgs[0]


def test_warm_start_is_checked_against_the_rows():
    # what replaces SCIP's addSol: a start is used (cutoff row, fallback result) only if it
    # satisfies every row of the model, as SCIP checks a given solution
    base, cands, ec, stage_ms, memory, cap = random_instance(1, with_memory=True)
    edges = _edge_table(cands, ec)
    lp = milp_cvxpy._build([set(s) for s in cands], edges, stage_ms, memory, cap, math.inf)
    fits = [ch for ch in chains(cands) if max(memory.peak(ch).values()) <= cap * (1 + 1e-9)]
    over = [ch for ch in chains(cands) if max(memory.peak(ch).values()) > cap * (1 + 1e-6)]
    assert fits and over
    for ch in fits[:20]:
        t = max([ec[(ch[f], ch[b])] for f, b in edges] + [stage_ms[c] for c in ch if c in stage_ms])
        assert lp.admits(ch, t)
        assert not lp.admits(ch, t - 1.0)  # below a selected cost: a T row is violated
    assert not any(lp.admits(ch, 1e9) for ch in over[:20])
    valid = set(chains(cands))
    not_chain = next(ch for ch in itertools.product(*cands) if ch not in valid)  # ranges that do not tile
    assert not lp.admits(not_chain, 1e9)


# ---------------------------------------------------------------------------------------------
# errors: unknown and missing solvers


def _small():
    cands = stage_candidates(Partition((-1, 3, 7)), 1, 6)
    return cands, {(f, b): float(f.stop + b.start) for f in cands[0] for b in cands[1]}


def test_missing_solver_names_the_field_the_package_and_the_fix(monkeypatch):
    # the seam: the solver cvxpy is asked for; a name cvxpy does not have is what a machine
    # without highspy reports (cvxpy leaves HIGHS out of installed_solvers())
    assert "NO_SUCH_SOLVER" not in cp.installed_solvers()
    monkeypatch.setitem(milp_cvxpy.BACKENDS, "cvxpy-highs", milp_cvxpy.Backend("NO_SUCH_SOLVER", "HiGHS", "highspy"))
    cands, ec = _small()
    with pytest.raises(TesseraConfigError) as err:
        solve_partition(cands, ec, None, None, solver="cvxpy-highs")
    e = err.value
    assert e.field == "planner.solver" and e.value == "cvxpy-highs"
    msg = str(e)
    assert msg.startswith("planner.solver='cvxpy-highs': HiGHS is not installed (highspy)")
    assert "fix: pip install highspy or use planner.solver=scip" in msg and "\n" not in msg
    with pytest.raises(TesseraConfigError, match="HiGHS is not installed"):
        check_solver("cvxpy-highs")  # what the planner can call before the pair costs
    # the other solvers are untouched
    check_solver("cvxpy-scip")
    assert solve_partition(cands, ec, None, None, solver="cvxpy-scip").status == "optimal"


def test_unknown_solver_lists_the_known_ones():
    cands, ec = _small()
    with pytest.raises(TesseraConfigError) as err:
        solve_partition(cands, ec, None, None, solver="gurobi")
    assert err.value.field == "planner.solver"
    assert str(err.value) == ("planner.solver='gurobi': is not a known MILP solver; fix: use one of: scip, cvxpy-scip, "
                              "cvxpy-highs")


def test_recipe_field_is_checked_and_matches_the_planner():
    assert MILP_SOLVERS == SOLVERS
    for s in SOLVERS:
        r = load_recipe(QWEN, [f"planner.solver={s}"])
        assert r.planner.solver == s
        validate_recipe(r, resolve_model(r))
    assert load_recipe(QWEN).planner.solver == "scip"
    r = load_recipe(QWEN, ["planner.solver=cvxpy-higs"])
    with pytest.raises(TesseraConfigError) as err:
        validate_recipe(r, resolve_model(r))
    msg = str(err.value)
    assert msg.startswith("planner.solver='cvxpy-higs': is not a known partition MILP solver")
    assert "did you mean 'cvxpy-highs'?" in msg and "\n" not in msg


def test_highs_prints_nothing_on_stdout():
    # HiGHS prints a banner when a process creates its first instance; stdout carries
    # `tessera plan --json`, so the cvxpy-highs path must leave it clean
    pytest.importorskip("highspy")
    import subprocess
    import sys

    code = ("from tessera.plan.candidates import stage_candidates\n"
            "from tessera.plan.milp import solve_partition\n"
            "from tessera.program.plan import Partition\n"
            "c = stage_candidates(Partition((-1, 3, 7)), 1, 6)\n"
            "ec = {(f, b): float(f.stop + b.start) for f in c[0] for b in c[1]}\n"
            "print(solve_partition(c, ec, None, None, solver='cvxpy-highs').status)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == "optimal\n"
