"""Benchmark the overlap-aware planner against the baseline on the real-model recipes.

Usage::

    python benchmarks/planner.py --json FILE [--ilp-pairs N] [--ilp-pairs-other N] [--radius R]
        [--ilp-time-limit S] [--workers W] [--ilp-cache FILE.jsonl] [--only NAME,...]

Configurations (recipes under ``recipes/`` with overrides; H800, activation recompute):

==========================  ======================================================================
qwen3-next-80b-ep8          Qwen3-Next-80B-A3B, interleaved 1F1B, pp 8, vpp 2, ep 8 (dp 8), M 16
qwen3-next-80b-ep8-m64      the same with 64 microbatches
qwen3-next-80b-ep8-s32k     the same with seq_length 32768: the longest power of two that fits
                            (at 65536 the head rank needs 82.5 GB of 81.2 even with FSDP; at
                            131072, 143 GB, of which the FP32 vocab softmax is 79.6 GB)
qwen3-next-80b-ep32         the same as the first with ep 32 (dp 32: EP is carved from dp * tp)
qwen3-next-80b-ep8-dualpipe the first with DualPipe-V
qwen3-next-80b-ep8-auto     the first with ``planner.template=auto`` and ``parallel.vpp=auto``
                            (baseline: the fastest baseline over every template and vpp)
qwen3-235b                  Qwen3-235B-A22B, interleaved 1F1B, pp 8, vpp 2, ep 8, dp 16
deepseek-v3                 DeepSeek-V3, DualPipe-V, pp 16 (x2 chunks), ep 64
nemotron-3-super            Nemotron 3 Super 120B-A12B (Mamba-2 / LatentMoE / attention), pp 8, vpp 2
kimi-k2                     Kimi K2 (1.04T parameters), interleaved 1F1B, pp 16, vpp 2, ep 64
==========================  ======================================================================

For each: recipe -> analytic costs -> :func:`tessera.plan.planner.make_plan` (the same call as
``tessera plan``: memory capacity, radius, pruning, SCIP) -> both plans compiled, validated
(Programs and the memory rule) and simulated. Then the pair scheduler is checked against the exact
pair ILP (:func:`tessera.plan.pair_ilp.solve_pair_ilp`, SCIP) on the distinct pair DAGs of the
configuration's candidate pairs (deduplicated by layer content as
:func:`tessera.plan.overlap_graph.pair_costs` does; ``with_w`` as the template runs them):
all of them (``--ilp-pairs 0``) or an evenly spaced, deterministic sample of N for the two
Qwen3-Next-80B configurations (``--ilp-pairs``, default 30), and a sample for the others
(``--ilp-pairs-other``, default 30; 0: all). The ILP runs and the gap statistics come from
``benchmarks/pair_gap.py`` (``solve_all``, ``evaluate``, ``dag_key``) when it is importable.

One JSON record per configuration with the fields ``preset, pp, vpp, ep, baseline_bottleneck_ms,
tessera_bottleneck_ms, baseline_iteration_ms, tessera_iteration_ms, milp_s, pairs_before_pruning,
pairs_after_pruning, scheduler_vs_ilp_mean_gap, scheduler_vs_ilp_max_gap, scheduler_s_per_pair,
ilp_s_per_pair``, the iteration fields ``lower_bound_ms`` (the Tessera plan's proven lower bound,
:func:`tessera.sim.bound.iteration_lower_bound`), ``baseline_lower_bound_ms``,
``baseline_efficiency, tessera_efficiency`` (bound / simulated iteration, each plan's own bound),
``iteration_ratio`` (baseline / Tessera simulated iteration), ``template_chosen, vpp_chosen``,
``plan_s`` (wall seconds of planning, iteration search included), ``partition_lower_bound_ms``
(the least iteration *any* partition of the layout can reach under the cost model,
:func:`tessera.flow.partition_bound`; SCIP's bound after ``partition_bound_nodes`` nodes and
``partition_bound_s`` seconds, exact when ``partition_bound_optimal``) and ``max_iteration_ratio``
(baseline iteration / that bound: no Tessera plan of the layout can beat it), ``plan_hash``
(``plan.json``'s content hash, as ``tessera plan`` prints it: equal on every machine unless
``caps_hit`` names a phase a wall-clock cap stopped), ``search_max_evals`` (the search's
evaluation budget), ``fallback`` (the planner kept
the baseline partition), ``alone_candidates`` (the MILP's candidates included the embedding alone
and the head alone, ``PlanReport.alone``), and the extras ``recipe, milp_vars_before, milp_vars_after, milp_size_before,
milp_size_after, milp_shrink, bottleneck_ratio, iteration_ratio, ilp_pairs_checked, wall_s`` and
more (see :func:`bench_config`). The schedule synthesis (``planner.synthesis``, on by default)
adds ``synthesized`` (the Tessera plan runs its own rank orders), ``synthesis_template``,
``synthesis_policy``, ``synthesis_start_ms`` (the template's order on the searched partition)
and ``synthesis_iteration_ms``, ``synthesis_evaluations`` / ``synthesis_max_evals``,
``synthesis_joint_evaluations`` / ``synthesis_joint_moves`` (the boundary search under the
winning policy), ``synthesis_s``, and per rank ``warmup_template`` / ``warmup_synthesized``
(forwards before the first backward), ``inflight_*``, ``fb_pairs_*``, ``moved_pairs`` and
``deferred_w`` (``ws_moved``: their sum) (:func:`synthesis_fields`). ``pairs_after_pruning``: candidate pairs left by pruning (cost at
most the threshold, both candidates surviving); ``pair_terms_after``: those still carrying a cost
term in the bottleneck MILP (the rest lie on edges that cannot bind, below
``milp_lower_bound_ms``); ``milp_size_*``: variables + constraints of the bottleneck MILP without
and with pruning, ``milp_shrink`` their ratio (the paper's "problem size"). Times in ms
except the ``*_s`` fields (s); gaps relative (0.01 = 1%), over the pairs SCIP proved optimal
(``ilp_optimal`` of ``ilp_pairs_checked``; ``ilp_pairs`` lists every checked pair with its flag).
``milp_s`` is SCIP's solving time over both phases (bottleneck, then tie-break);
``milp_build_s`` the memory checks, pruning and model construction before it;
``milp_call_wall_s`` / ``milp_call_cpu_s`` the wall and CPU seconds of the whole
``solve_partition`` call; ``milp_other_solvers`` (first configuration): the same MILP solved
again through cvxpy with SCIP and with HiGHS (bottleneck, solve seconds, partition), beside
SCIP's ``milp_scip_bottleneck_ms`` and ``milp_s`` (CPU time is what a machine not shared with other jobs would take).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# rich and tessera (SCIP with it) are imported inside the functions that use them: ``--help``
# answers without them; pair_gap.py imports tessera lazily too
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from tessera.cost.types import ModelCosts
    from tessera.plan.planner import PlanReport

try:  # the pair-gap benchmark's ILP runner (pool + cache) and statistics
    from pair_gap import dag_key, evaluate, solve_all  # noqa: E402
except ImportError:  # pragma: no cover - only without benchmarks/pair_gap.py
    dag_key = evaluate = solve_all = None

_MILP_CLOCK: dict[str, float] = {}


def _clocked_solve_partition(*args, **kwargs):
    """``solve_partition`` as ``make_plan`` calls it, with its wall and CPU seconds recorded
    (SCIP is single-threaded and in-process, so CPU time is what a quiet machine would take)."""
    w, c = time.perf_counter(), time.process_time()
    try:
        return _SOLVE_PARTITION(*args, **kwargs)
    finally:
        _MILP_CLOCK.update(wall=time.perf_counter() - w, cpu=time.process_time() - c)
        _MILP_CALL.update(args=args, kwargs=kwargs)


_MILP_CALL: dict = {}


def other_solvers() -> dict:
    """The last partition MILP solved again through cvxpy with SCIP and with HiGHS (same model,
    pruning and warm start): objective and solve seconds per solver (``planner.solver``)."""
    from tessera.errors import TesseraConfigError

    out = {}
    args, kwargs = _MILP_CALL.get("args"), dict(_MILP_CALL.get("kwargs") or {})
    if args is None:
        return out
    for solver in ("cvxpy-scip", "cvxpy-highs"):
        kwargs["solver"] = solver
        try:
            r = _SOLVE_PARTITION(*args, **kwargs)
        except TesseraConfigError as e:  # e.g. highspy not installed
            out[solver] = {"error": str(e)}
            continue
        out[solver] = {"bottleneck_ms": r.bottleneck_ms,
                       "solve_s": r.solve_s, "status": r.status, "bounds": list(r.partition.bounds)}
    return out


_SOLVE_PARTITION = None
"""``tessera.plan.planner.solve_partition`` itself, once :func:`_clock_planner` has wrapped it."""


def _clock_planner() -> None:
    """Route ``make_plan``'s ``solve_partition`` calls through :func:`_clocked_solve_partition`
    (once; done at the first configuration, not at import, so ``--help`` needs no tessera)."""
    global _SOLVE_PARTITION
    import tessera.plan.planner as _planner

    if _SOLVE_PARTITION is None:
        _SOLVE_PARTITION = _planner.solve_partition
        _planner.solve_partition = _clocked_solve_partition

FIELDS = ("preset", "pp", "vpp", "ep", "baseline_bottleneck_ms", "tessera_bottleneck_ms", "baseline_iteration_ms",
          "tessera_iteration_ms", "milp_s", "pairs_before_pruning", "pairs_after_pruning",
          "scheduler_vs_ilp_mean_gap", "scheduler_vs_ilp_max_gap", "scheduler_s_per_pair", "ilp_s_per_pair",
          "lower_bound_ms", "baseline_efficiency", "tessera_efficiency", "iteration_ratio", "template_chosen",
          "vpp_chosen", "plan_s", "partition_lower_bound_ms", "max_iteration_ratio")
EXTRAS = ("recipe", "milp_vars_before", "milp_vars_after", "milp_size_before", "milp_size_after", "milp_shrink",
          "bottleneck_ratio", "iteration_ratio",
          "ilp_pairs_checked", "wall_s")


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: a recipe file and its overrides."""

    name: str
    recipe: str
    overrides: tuple[str, ...]
    qwen_next: bool = False


_QN8 = ("parallel.pp=8", "parallel.vpp=2", "parallel.ep=8", "parallel.dp=8")
CONFIGS = (
    Config("qwen3-next-80b-ep8", "qwen3-next-80b.yaml", _QN8, True),
    Config("qwen3-next-80b-ep8-m64", "qwen3-next-80b.yaml", _QN8 + ("parallel.num_microbatches=64",), True),
    Config("qwen3-next-80b-ep8-s32k", "qwen3-next-80b.yaml", _QN8 + ("parallel.seq_length=32768",), True),
    Config("qwen3-next-80b-ep32", "qwen3-next-80b.yaml", ("parallel.pp=8", "parallel.vpp=2", "parallel.ep=32",
                                                          "parallel.dp=32"), True),
    Config("qwen3-next-80b-ep8-dualpipe", "qwen3-next-80b.yaml", _QN8 + ("planner.template=dualpipe-v",), True),
    Config("qwen3-next-80b-ep8-auto", "qwen3-next-80b.yaml", _QN8[:1] + _QN8[2:] + (
        "planner.template=auto", "parallel.vpp=auto"), True),
    Config("qwen3-235b", "qwen3-235b.yaml", ("parallel.pp=8",)),
    Config("deepseek-v3", "deepseek-v3.yaml", ("parallel.pp=16",)),
    Config("nemotron-3-super", "nemotron-3-super.yaml", ("parallel.pp=8",)),
    Config("kimi-k2", "kimi-k2.yaml", ("parallel.vpp=2",)),
)


def distinct_pair_ranges(costs: ModelCosts, report: PlanReport, radius: int) -> list[tuple[tuple[int, int],
                                                                                          tuple[int, int]]]:
    """(F range, B range) of one representative per distinct candidate-pair content of the plan
    (:func:`tessera.plan.overlap_graph.distinct_pairs`), in first-seen order."""
    from tessera.plan.candidates import stage_candidates
    from tessera.plan.overlap_graph import distinct_pairs, overlap_edges

    b = report.baseline
    if not b.overlap:
        return []
    cands = stage_candidates(b.partition, radius, len(costs.layers))
    return distinct_pairs(costs, cands, overlap_edges(b.template, b.pp, b.vpp, b.num_microbatches))


def sample(items: list, n: int) -> list:
    """``n`` evenly spaced items (all when ``n <= 0`` or ``n >= len(items)``), order kept."""
    if n <= 0 or n >= len(items):
        return list(items)
    if n == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _ilp_check(costs: ModelCosts, ranges: list, with_w: bool, limit_s: float, workers: int,
               cache: Path | None, name: str) -> dict:
    """Scheduler vs ILP over the given pairs: the statistics of ``pair_gap.evaluate`` plus the
    per-pair ILP optimality flags."""
    from tessera.sched.chunkdag import pair_dag

    if evaluate is None:
        raise RuntimeError("benchmarks/pair_gap.py (solve_all, evaluate, dag_key) is needed for the ILP check")
    dags = [(r, d, dag_key(d)) for r in ranges for d in (pair_dag(costs, r[0], r[1], with_w),)]
    ilp = solve_all({k: d for _, d, k in dags}, limit_s, workers, cache)
    ev = evaluate(name, with_w, dags, ilp)
    ev["ilp_pairs"] = [{"f": r[0], "b": r[1], "tasks": len(d.tasks), "ilp_ms": ilp[k]["ms"],
                        "optimal": ilp[k]["optimal"]} for r, d, k in dags]
    return ev


def bench_config(cfg: Config, *, radius: int | None, ilp_pairs: int, ilp_time_limit: float, workers: int,
                 cache: Path | None, console: Console) -> dict:
    """One record: both plans, the MILP's size and time, and the scheduler vs ILP check."""
    from dataclasses import replace

    from tessera.cli.plan import _run_plan, plan_document
    from tessera.config.load import load_recipe
    from tessera.flow import build_costs, partition_bound, plan_recipe, resolve
    from tessera.plan.planner import pair_with_w

    _clock_planner()
    t0 = time.perf_counter()
    overrides = list(cfg.overrides) + ([f"planner.candidate_radius={radius}"] if radius is not None else [])
    recipe = load_recipe(str(ROOT / "recipes" / cfg.recipe), overrides)
    res = resolve(recipe)
    costs = build_costs(res)
    p, pl = recipe.parallel, recipe.planner
    report = plan_recipe(res, costs)
    plan_s = time.perf_counter() - t0
    pb = partition_bound(res, costs)  # the least iteration any partition can reach (timed apart)
    base = _run_plan(recipe, res.hardware, costs, report.baseline)
    tess = _run_plan(recipe, res.hardware, costs, report.tessera)
    report = replace(report, partition_bound=pb)
    plan_hash = plan_document(recipe, {"baseline": base, "tessera": tess}, report)["content_hash"]
    base_eff, tess_eff = base.efficiency, tess.efficiency
    console.print(f"[{cfg.name}] planned in {plan_s:.1f} s ({report.milp.summary()})", highlight=False, markup=False)
    with_w = pair_with_w(report.tessera.template, report.tessera.split_w)
    ranges = distinct_pair_ranges(costs, report, report.radius)
    checked = sample(ranges, ilp_pairs)
    t1 = time.perf_counter()
    ev = _ilp_check(costs, checked, with_w, ilp_time_limit, workers, cache, cfg.name)
    console.print(f"[{cfg.name}] ILP check of {len(checked)} of {len(ranges)} distinct pairs in "
                  f"{time.perf_counter() - t1:.0f} s", highlight=False, markup=False)
    m = report.milp
    br, bi = base.result, tess.result
    rec = {
        "recipe": recipe.name, "config": cfg.name, "overrides": overrides, "preset": recipe.model.preset,
        "pp": p.pp, "vpp": report.tessera.vpp, "ep": p.ep, "dp": p.dp, "template": pl.template,
        "template_chosen": report.tessera.template, "vpp_chosen": report.tessera.vpp,
        "overlap_chosen": report.tessera.overlap, "split_w_chosen": report.tessera.split_w,
        "radius_chosen": report.radius, "radii_tried": list(report.radii_tried), "widen_s": report.widen_s,
        "alone_candidates": report.alone,
        "baseline_template": report.baseline.template, "baseline_vpp": report.baseline.vpp,
        "seq_length": p.seq_length,
        "num_microbatches": p.num_microbatches, "radius": pl.candidate_radius, "with_w": with_w,
        "baseline_bottleneck_ms": report.baseline_bottleneck_ms, "tessera_bottleneck_ms": report.tessera_bottleneck_ms,
        "bottleneck_ratio": report.baseline_bottleneck_ms / report.tessera_bottleneck_ms,
        "baseline_iteration_ms": br.iteration_ms, "tessera_iteration_ms": bi.iteration_ms,
        "iteration_ratio": br.iteration_ms / bi.iteration_ms,
        "lower_bound_ms": tess_eff.bound.ms, "baseline_lower_bound_ms": base_eff.bound.ms,
        "baseline_efficiency": base_eff.efficiency, "tessera_efficiency": tess_eff.efficiency,
        "partition_lower_bound_ms": pb.ms, "partition_bound_optimal": pb.optimal, "partition_bound_s": pb.solve_s,
        "max_iteration_ratio": br.iteration_ms / pb.ms if pb.ms > 0 else None,
        "objective": report.objective, "fallback": report.fallback,
        "search_evaluations": report.search.evaluations if report.search else 0,
        "search_moves": report.search.moves if report.search else 0,
        "search_s": report.search.search_s if report.search else 0.0,
        "search_max_evals": report.search.max_evals if report.search else 0,
        "partition_bound_nodes": pb.nodes, "caps_hit": list(report.cap_hit), "plan_hash": plan_hash,
        "alternatives": [list(a) for a in report.alternatives],
        "baseline_bubble_ratio": br.bubble_ratio, "tessera_bubble_ratio": bi.bubble_ratio,
        "baseline_exposed_a2a_ratio": br.exposed_a2a_ratio, "tessera_exposed_a2a_ratio": bi.exposed_a2a_ratio,
        "baseline_peak_mem_gb": br.peak_mem_gb, "tessera_peak_mem_gb": bi.peak_mem_gb,
        "baseline_partition": list(report.baseline.partition.sizes()),
        "tessera_partition": list(report.tessera.partition.sizes()),
        "pruning_threshold_ms": report.pruning_threshold_ms, "baseline_own_ms": report.baseline_own_ms,
        "milp_status": m.status, "milp_s": m.solve_s, "milp_tie_break_s": m.tie_break_s, "milp_build_s": m.build_s,
        "milp_call_wall_s": _MILP_CLOCK.get("wall"), "milp_call_cpu_s": _MILP_CLOCK.get("cpu"),
        "milp_other_solvers": other_solvers() if cfg.name == "qwen3-next-80b-ep8" else {},
        "milp_scip_bottleneck_ms": m.bottleneck_ms,
        "milp_vars_before": m.n_vars_before, "milp_vars_after": m.n_vars_after,
        "milp_conss_before": m.n_conss_before, "milp_conss_after": m.n_conss_after,
        "milp_vars_tie_break": m.n_vars_tie_break,
        "pairs_before_pruning": m.pairs_before_pruning, "pairs_after_pruning": m.pairs_after_pruning,
        "candidates_before": m.candidates_before, "candidates_after": m.candidates_after,
        "pair_terms_after": m.pair_terms_after, "milp_lower_bound_ms": m.lower_bound_ms,
        "milp_size_before": m.size_before, "milp_size_after": m.size_after, "milp_shrink": m.shrink,
        "vars_shrink": m.n_vars_before / max(m.n_vars_after, 1),
        "pairs_shrink": m.pairs_before_pruning / m.pairs_after_pruning if m.pairs_after_pruning else None,
        "pairs_distinct": report.pairs_distinct, "pair_cost_s": report.pair_cost_s, "plan_s": plan_s,
        "scheduler_vs_ilp_mean_gap": ev["scheduler_vs_ilp_mean_gap"],
        "scheduler_vs_ilp_max_gap": ev["scheduler_vs_ilp_max_gap"],
        "scheduler_optimal_pairs": ev["scheduler_optimal_pairs"],
        "fixed_order_vs_ilp_mean_gap": ev["fixed_order_vs_ilp_mean_gap"],
        "scheduler_s_per_pair": ev["scheduler_s_per_pair"], "ilp_s_per_pair": ev["ilp_s_per_pair"],
        "ilp_speedup": ev["speedup"], "ilp_time_limit_s": ilp_time_limit,
        "ilp_pairs_checked": len(checked), "ilp_pairs_distinct": len(ranges),
        "ilp_optimal": len(checked) - ev["ilp_not_optimal"], "ilp_tasks_max": ev["tasks_max"],
        "ilp_worst_pairs": ev["worst_pairs"], "ilp_not_optimal_pairs": ev["not_optimal_pairs"],
        "ilp_pairs": ev["ilp_pairs"],
        "wall_s": time.perf_counter() - t0,
    }
    rec.update(synthesis_fields(report))
    return rec


def synthesis_fields(report: PlanReport) -> dict:
    """The ``synthesis_*`` fields of a record: whether the Tessera plan runs a synthesized rank
    order, the template it started from, its policy, the iteration before (the template's order
    on the searched partition) and after, the budget, and per rank the warm-up depth (template ->
    synthesized), microbatch-chunks in flight, W's deferred and FB pairs moved."""
    syn = report.synthesis
    if syn is None:
        return {"synthesized": False}
    ch = syn.changes
    return {
        "synthesized": report.tessera.synthesized, "synthesis_template": syn.start.template,
        "synthesis_policy": syn.policy.label() if syn.policy is not None else None,
        "synthesis_start_ms": syn.start_ms, "synthesis_iteration_ms": syn.iteration_ms,
        "synthesis_evaluations": syn.evaluations, "synthesis_max_evals": syn.max_evals,
        "synthesis_orders_written": syn.written,
        "synthesis_joint_evaluations": syn.joint_evaluations, "synthesis_joint_moves": syn.joint_moves,
        "synthesis_s": syn.search_s, "synthesis_cap_hit": syn.cap_hit,
        "warmup_template": [c.warmup_template for c in ch], "warmup_synthesized": [c.warmup for c in ch],
        "inflight_template": [c.inflight_template for c in ch], "inflight_synthesized": [c.inflight for c in ch],
        "fb_pairs_template": [c.fb_template for c in ch], "fb_pairs_synthesized": [c.fb for c in ch],
        "moved_pairs": [c.moved_pairs for c in ch], "deferred_w": [c.deferred_w for c in ch],
        "ws_moved": sum(c.deferred_w for c in ch),
    }


def render(records: list[dict]) -> Table:
    from rich.table import Table

    t = Table(title="tessera planner: baseline vs Tessera (analytic costs, H800)", title_justify="left")
    cols = [("config", "config", str), ("pp/vpp/ep", None, None), ("bottleneck ms base -> tess", None, None),
            ("ratio", "bottleneck_ratio", lambda v: f"{v:.3f}x"), ("iteration ms base -> tess", None, None),
            ("iter ratio", "iteration_ratio", lambda v: f"{v:.3f}x"),
            ("max ratio", "max_iteration_ratio", lambda v: "-" if v is None else f"{v:.3f}x"),
            ("eff base / tess", None, None),
            ("template, vpp", None, None), ("order (warm-up r0, Ws moved)", None, None),
            ("plan s", "plan_s", lambda v: f"{v:.0f}"),
            ("MILP s (cpu)", None, None),
            ("pairs before -> after", None, None), ("MILP vars+conss before -> after", None, None),
            ("sched vs ILP mean / max", None, None), ("checked (optimal)", None, None),
            ("sched ms / ILP s per pair", None, None), ("wall s", "wall_s", lambda v: f"{v:.0f}")]
    for c, *_ in cols:
        t.add_column(c, justify="left" if c == "config" else "right")

    def pct(v):
        return "-" if v is None else f"{100 * v:.2f}%"

    for r in records:
        derived = {
            "pp/vpp/ep": f"{r['pp']}/{r['vpp']}/{r['ep']}",
            "eff base / tess": f"{r['baseline_efficiency']:.3f} / {r['tessera_efficiency']:.3f}",
            "template, vpp": f"{r['template_chosen']}, {r['vpp_chosen']}" + (" (fallback)" if r["fallback"] else ""),
            "order (warm-up r0, Ws moved)": (f"synthesized ({r['warmup_template'][0]} -> {r['warmup_synthesized'][0]}, "
                                             f"{r['ws_moved']})" if r.get("synthesized") else "template"),
            "bottleneck ms base -> tess": f"{r['baseline_bottleneck_ms']:.2f} -> {r['tessera_bottleneck_ms']:.2f}",
            "iteration ms base -> tess": f"{r['baseline_iteration_ms']:.1f} -> {r['tessera_iteration_ms']:.1f}",
            "MILP s (cpu)": f"{r['milp_s']:.2f} ({r['milp_call_cpu_s']:.2f})",
            "pairs before -> after": f"{r['pairs_before_pruning']} -> {r['pairs_after_pruning']}",
            "MILP vars+conss before -> after": (f"{r['milp_size_before']} -> {r['milp_size_after']} "
                                               f"({r['milp_shrink']:.1f}x)"),
            "sched vs ILP mean / max": f"{pct(r['scheduler_vs_ilp_mean_gap'])} / {pct(r['scheduler_vs_ilp_max_gap'])}",
            "checked (optimal)": f"{r['ilp_pairs_checked']}/{r['ilp_pairs_distinct']} ({r['ilp_optimal']})",
            "sched ms / ILP s per pair": f"{1e3 * r['scheduler_s_per_pair']:.2f} / {r['ilp_s_per_pair']:.2f}",
        }
        t.add_row(*[derived[c] if key is None else fmt(r[key]) for c, key, fmt in cols])
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the records as a JSON list to FILE")
    ap.add_argument("--ilp-pairs", type=int, default=30,
                    help="distinct pairs checked against the ILP per Qwen3-Next-80B configuration (0: all)")
    ap.add_argument("--ilp-pairs-other", type=int, default=30,
                    help="distinct pairs checked per other configuration (0: all)")
    ap.add_argument("--radius", type=int, default=None, help="planner.candidate_radius (default: the recipe's)")
    ap.add_argument("--ilp-time-limit", type=float, default=60.0, help="SCIP time limit per pair ILP, s")
    ap.add_argument("--workers", type=int, default=1, help="processes solving pair ILPs")
    ap.add_argument("--ilp-cache", default=None, metavar="FILE.jsonl",
                    help="JSON-lines cache of pair ILP results (pair_gap.py's format), read and appended")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    args = ap.parse_args(argv)
    from rich.console import Console

    from tessera.errors import ProgramError, TesseraConfigError

    _clock_planner()
    console = Console(stderr=True)
    names = set(args.only.split(",")) if args.only else None
    unknown = (names or set()) - {c.name for c in CONFIGS}
    if unknown:
        print(f"benchmark: error: unknown configuration(s) {sorted(unknown)}; known: "
              f"{', '.join(c.name for c in CONFIGS)}", file=sys.stderr)
        return 2
    cache = Path(args.ilp_cache) if args.ilp_cache else None
    records, failed = [], False
    for cfg in CONFIGS:
        if names is not None and cfg.name not in names:
            continue
        try:
            records.append(bench_config(cfg, radius=args.radius,
                                        ilp_pairs=args.ilp_pairs if cfg.qwen_next else args.ilp_pairs_other,
                                        ilp_time_limit=args.ilp_time_limit, workers=args.workers, cache=cache,
                                        console=console))
        except (TesseraConfigError, ProgramError) as e:  # recorded; the other configurations still run
            print(f"benchmark: error: {cfg.name}: {e}", file=sys.stderr)
            records.append({"config": cfg.name, "error": str(e)})
            failed = True
        if args.json:  # keep what is done so far
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    Console(width=240).print(render([r for r in records if "error" not in r]))
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
