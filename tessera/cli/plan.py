"""``tessera plan``: the overlap-aware plan of a recipe, optionally side by side with the baseline.

Flow: recipe -> costs -> :func:`tessera.plan.planner.make_plan` -> compile + validate + simulate
both plans -> table, ``plan.json`` (the Tessera Plan and its per-rank Programs, plus the baseline,
and its content hash, :func:`plan_content_hash`), and a Chrome trace and PNG timeline per plan
under ``<out>/baseline`` and ``<out>/tessera``; with ``--export-schedule FILE`` the Tessera plan's
Programs as a torch.distributed.pipelining schedule CSV (:mod:`tessera.program.torch_schedule`).
``--slowdown-from FILE`` plans for the measured per-rank slowdown a running job wrote
(:mod:`tessera.cost.slowdown`). ``<out>`` defaults to ``logging.out_dir/<recipe
name>`` (``<recipe name>-<cost source>`` for measured costs, :func:`plan_output_dir`); a
``plan.json`` there that holds another plan is not replaced without ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass

from tessera.cli.common import add_recipe_arguments, cost_options_line, load_cli_recipe
from tessera.errors import TesseraConfigError
from tessera.plan.planner import PlanReport
from tessera.program.instructions import Program
from tessera.program.plan import Plan
from tessera.sim.bound import PlanEfficiency
from tessera.sim.result import SimResult


@dataclass(frozen=True)
class PlannedRun:
    """One plan compiled, validated and simulated; ``efficiency``: its proven lower bound over
    the simulated iteration (:func:`tessera.sim.bound.plan_efficiency`)."""

    plan: Plan
    programs: tuple[Program, ...]
    result: SimResult
    efficiency: PlanEfficiency


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera plan``."""
    add_recipe_arguments(p)
    p.add_argument("--compare", action="store_true", help="show the baseline and the Tessera plan side by side")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: logging.out_dir/<recipe name>, or <recipe name>-<cost source> "
                        "for planner.cost_source=profile or trace)")
    p.add_argument("--force", action="store_true",
                   help="replace a plan.json in the output directory that holds another plan")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--bound-time", type=float, default=None, metavar="S",
                   help="wall-clock cap of the lower bound over every partition, s (default 120; SCIP stops after "
                        "a fixed node count first; 0: skip it)")
    p.add_argument("--export-schedule", metavar="FILE", default=None,
                   help="also write the Tessera plan's per-rank actions as a torch.distributed.pipelining schedule "
                        "CSV (tessera.program.torch_schedule)")
    p.add_argument("--export-format", choices=("compute_comms", "compute_only"), default=None,
                   help="compute_comms (default): every action, sends and receives in Tessera's posting order, read "
                        "with _load_csv(FILE, format='compute_comms'); compute_only: F/I/B/W/OVERLAP_F_B, torch adds "
                        "the communication (torchtitan's pipeline_parallel_schedule_csv)")
    p.add_argument("--slowdown-from", metavar="FILE", default=None,
                   help="plan for measured per-rank slowdown: a slowdown.json of a run directory "
                        "({\"rank_slowdown\": [...], \"ep_slowdown\": [...]}, tessera.cost.slowdown), applied as "
                        "the planner.rank_slowdown / planner.ep_slowdown overrides")
    from tessera.cli.sensitivity import add_sensitivity_arguments

    add_sensitivity_arguments(p)


def _run_plan(recipe, hw, costs, plan: Plan) -> PlannedRun:
    from tessera.config.validate import validate_memory
    from tessera.flow import compile_programs
    from tessera.sim.simulator import simulate

    from tessera.sim.bound import plan_efficiency

    programs = compile_programs(plan)
    validate_memory(recipe, hw, programs, costs)
    result = simulate(programs, costs)
    return PlannedRun(plan, programs, result, plan_efficiency(programs, costs, result))


TIMING_FIELDS = (("milp", "solve_s"), ("search", "search_s"), ("partition_bound", "solve_s"), ("synthesis", "search_s"))
"""The wall-time fields of ``plan.json`` (section, key): left out of :func:`plan_content_hash`,
as they differ from run to run while the plan does not."""


def plan_content_hash(doc: dict) -> str:
    """SHA-256 (hex) of ``plan.json``'s content without its :data:`TIMING_FIELDS` and without
    ``content_hash`` itself: the canonical JSON (sorted keys, no spaces, floats as Python writes
    them), so two runs of the same recipe on the same costs give the same hash on any machine
    at any load, unless a wall-clock cap stopped a phase (``caps_hit``)."""
    d = {k: v for k, v in doc.items() if k != "content_hash"}
    for section, key in TIMING_FIELDS:
        if isinstance(d.get(section), dict):
            d[section] = {k: v for k, v in d[section].items() if k != key}
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def plan_output_dir(args: argparse.Namespace, recipe) -> str:
    """``--out`` if given, else ``logging.out_dir/<recipe name>`` for analytic costs and
    ``logging.out_dir/<recipe name>-<cost source>`` for ``profile`` or ``trace``, so a plan on
    measured costs does not land on the analytic plan's files. An object-store ``logging.out_dir``
    stands for a local directory of this machine here (:func:`tessera.config.storage_rules.local_dir`):
    these files are for a person and for ``--plan`` to read."""
    from tessera.config.storage_rules import local_dir

    if args.out:
        return args.out
    src = recipe.planner.cost_source
    return os.path.join(local_dir(recipe.logging.out_dir), recipe.name + ("" if src == "analytic" else f"-{src}"))


def _another_plan(out: str, path: str, old: dict, why: str) -> TesseraConfigError:
    rec = old.get("recipe") if isinstance(old.get("recipe"), dict) else {}
    src = (rec.get("planner") or {}).get("cost_source", "?") if isinstance(rec.get("planner"), dict) else "?"
    return TesseraConfigError("--out", out, f"{path} holds another plan (recipe {rec.get('name', '?')}, cost source "
                                            f"{src}, content hash {str(old.get('content_hash', '?'))[:12]}; {why})",
                              "pass --out DIR for a directory of its own, or --force to replace it")


def _read_plan_json(path: str) -> dict | None:
    """The JSON object in ``path``; ``None`` when there is none; ``{}`` when it is not one."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def check_out_before_planning(out: str, recipe, force: bool) -> None:
    """Refuse at once, before planning, when ``out/plan.json`` holds the plan of another recipe
    (other overrides or cost source) and ``force`` is not set.

    Raises:
        TesseraConfigError: field ``--out``, naming the recipe, cost source and hash it holds.
    """
    path = os.path.join(out, "plan.json")
    old = _read_plan_json(path)
    if force or old is None or old.get("recipe") == json.loads(json.dumps(recipe.to_dict())):
        return
    raise _another_plan(out, path, old, "this recipe differs")


def check_out_before_writing(out: str, doc: dict, force: bool) -> None:
    """Refuse, before anything is written, when ``out/plan.json`` holds a plan whose content hash
    differs from ``doc``'s (:func:`plan_content_hash`) and ``force`` is not set; the same plan
    again is written over (nothing is lost).

    Raises:
        TesseraConfigError: field ``--out``, naming both hashes.
    """
    path = os.path.join(out, "plan.json")
    old = _read_plan_json(path)
    if force or old is None or plan_content_hash(old) == doc["content_hash"]:
        return
    raise _another_plan(out, path, old, f"this plan's is {doc['content_hash'][:12]}")


def check_export_path(path: str) -> None:
    """Refuse at once, before planning, a ``--export-schedule`` path that cannot be a new file.

    Raises:
        TesseraConfigError: field ``--export-schedule``: the path is a directory, or its
            directory does not exist or is not writable.
    """
    where = os.path.dirname(os.path.abspath(path))
    rule = ("is a directory" if os.path.isdir(path) else f"directory {where} does not exist"
            if not os.path.isdir(where) else f"directory {where} is not writable" if not os.access(where, os.W_OK)
            else "")
    if rule:
        raise TesseraConfigError("--export-schedule", path, rule, "pass a file path in an existing, writable directory")


def export_schedule(path: str, programs, format: str) -> str:
    """Write ``programs`` to ``path`` as a torch schedule CSV
    (:func:`tessera.program.torch_schedule.write_csv`); returns its one-line summary.

    Raises:
        TesseraConfigError: field ``--export-schedule``: the file cannot be written.
    """
    from tessera.program.torch_schedule import write_csv

    try:
        return write_csv(path, programs, format).line()
    except OSError as e:
        raise TesseraConfigError("--export-schedule", path, f"cannot be written ({e.strerror or e})",
                                 "pass a file path in an existing, writable directory") from e


def _placement(recipe):
    """The recipe's rank placement on its hardware's nodes (:func:`tessera.spec.placement.placement_of`)."""
    from tessera.config.resolve import resolve_hardware
    from tessera.spec.placement import placement_of

    return placement_of(recipe.parallel, resolve_hardware(recipe).gpus_per_node)


def synthesis_document(report: PlanReport) -> dict | None:
    """``plan.json``'s ``synthesis`` section (``None`` when it did not run): the template it
    started from, the policy of the winning order (``null``: the template's order kept), the
    iteration before and after, the budget and, per rank, what changed
    (:class:`tessera.plan.synthesis.RankChange`)."""
    from dataclasses import asdict

    syn = report.synthesis
    if syn is None:
        return None
    return {"template": syn.start.template, "synthesized": syn.policy is not None,
            "policy": None if syn.policy is None else asdict(syn.policy),
            "start_ms": syn.start_ms, "iteration_ms": syn.iteration_ms, "evaluations": syn.evaluations,
            "max_evals": syn.max_evals, "written": syn.written, "joint_evaluations": syn.joint_evaluations, "joint_moves": syn.joint_moves,
            "search_s": syn.search_s, "cap_hit": syn.cap_hit, "ranks": [asdict(c) for c in syn.changes]}


def synthesis_line(report: PlanReport) -> str:
    """The planner table's "schedule synthesis" row."""
    syn = report.synthesis
    spent = (f"{syn.written} orders written, {syn.evaluations} plans simulated (budget {syn.max_evals}; joint boundary search "
             f"{syn.joint_evaluations}, {syn.joint_moves} move{'' if syn.joint_moves == 1 else 's'}), "
             f"{syn.search_s:.1f} s")
    if syn.policy is None:
        return f"{syn.start.template}'s order kept (no synthesized order beat {syn.start_ms:.2f} ms): {spent}"
    return (f"from {syn.start.template}: {syn.start_ms:.2f} -> {syn.iteration_ms:.2f} ms "
            f"({syn.start_ms / syn.iteration_ms:.3f}x); {syn.policy.label()}; {spent}")


def synthesis_table(report: PlanReport):
    """Per rank, what the synthesized order changed against the template's (``None`` when the
    plan runs the template's order): warm-up forwards before the first backward, most
    microbatch-chunks in flight, overlapped F&B pairs, pairs the template does not form, and W's
    not run right after their backward."""
    from rich.table import Table

    syn = report.synthesis
    if syn is None or syn.policy is None or not report.tessera.synthesized:
        return None
    t = Table(title=f"synthesized rank orders vs {syn.start.template}", title_justify="left")
    for c in ("rank", "warm-up F", "in flight", "FB pairs", "moved pairs", "deferred W"):
        t.add_column(c, justify="right")
    for c in syn.changes:
        t.add_row(str(c.rank), f"{c.warmup_template} -> {c.warmup}", f"{c.inflight_template} -> {c.inflight}",
                  f"{c.fb_template} -> {c.fb}", str(c.moved_pairs), str(c.deferred_w))
    return t


def plan_document(recipe, runs: dict[str, PlannedRun], report: PlanReport) -> dict:
    """The content of ``plan.json`` (plain JSON values), ``content_hash`` included
    (:func:`plan_content_hash`; ``docs/planner.md``, "The plan command", lists the fields)."""
    t = runs["tessera"]
    pb = report.partition_bound
    doc = {
        "recipe": recipe.to_dict(),
        "plan": t.plan.to_dict(),
        "programs": [p.to_dict() for p in t.programs],
        "program_hashes": [p.content_hash for p in t.programs],
        "baseline": {"plan": report.baseline.to_dict(), "bottleneck_ms": report.baseline_bottleneck_ms,
                     "iteration_ms": runs["baseline"].result.iteration_ms if "baseline" in runs else None,
                     "efficiency": runs["baseline"].efficiency.efficiency if "baseline" in runs else None},
        "tessera": {"bottleneck_ms": report.tessera_bottleneck_ms, "iteration_ms": t.result.iteration_ms,
                    "lower_bound_ms": t.efficiency.bound.ms, "efficiency": t.efficiency.efficiency},
        "partition_bound": None if pb is None else {
            "ms": pb.ms, "optimal": pb.optimal, "solve_s": pb.solve_s, "nodes": pb.nodes, "cap_hit": pb.cap_hit,
            "max_iteration_ratio": (runs["baseline"].result.iteration_ms if "baseline" in runs else
                                    report.baseline_iteration_ms or 0.0) / pb.ms if pb.ms > 0 else None},
        "objective": report.objective, "fallback": report.fallback,
        "search": None if report.search is None else {
            "evaluations": report.search.evaluations, "max_evals": report.search.max_evals,
            "moves": report.search.moves, "search_s": report.search.search_s,
            "start_ms": list(report.search.start_ms), "fixed_orders": report.search.fixed_orders,
            "cap_hit": report.search.cap_hit},
        "alternatives": [{"template": a[0], "vpp": a[1], "baseline_iteration_ms": a[2], "tessera_iteration_ms": a[3],
                          "overlap": a[4], "split_w": a[5]} for a in report.alternatives],
        "milp": {"status": report.milp.status, "solve_s": report.milp.solve_s, "cap_hit": report.milp.cap_hit,
                 "pairs_before_pruning": report.milp.pairs_before_pruning,
                 "pairs_after_pruning": report.milp.pairs_after_pruning,
                 "pair_terms_after": report.milp.pair_terms_after,
                 "vars_before": report.milp.n_vars_before, "vars_after": report.milp.n_vars_after,
                 "conss_before": report.milp.n_conss_before, "conss_after": report.milp.n_conss_after,
                 "lower_bound_ms": report.milp.lower_bound_ms,
                 "pruning_threshold_ms": report.pruning_threshold_ms},
        "caps_hit": list(report.cap_hit),
        "synthesis": synthesis_document(report),
        "placement": _placement(recipe).to_dict(),
    }
    doc = json.loads(json.dumps(doc))  # as plan.json reads back (tuples as lists)
    doc["content_hash"] = plan_content_hash(doc)
    return doc


def _write_outputs(recipe, out: str, runs: dict[str, PlannedRun], report: PlanReport, costs,
                   nominal_hw: str = "", doc: dict | None = None) -> list[str]:
    """Write plan.json (``doc``, default :func:`plan_document`) and, as ``recipe.logging`` allows,
    per plan a Chrome trace, the bottleneck pair's trace and a PNG timeline (its title says
    ``nominal <nominal_hw> costs`` when given); returns the paths written."""
    from tessera.plan.planner import plan_pair_schedule
    from tessera.sim.timeline import write_timeline_png
    from tessera.sim.trace import write_chrome_trace, write_pair_trace

    doc = plan_document(recipe, runs, report) if doc is None else doc
    os.makedirs(out, exist_ok=True)
    files = []
    for name, run in runs.items():
        d = os.path.join(out, name)
        if recipe.logging.trace:
            files.append(str(write_chrome_trace(run.result, os.path.join(d, "trace.json"))))
            edges = report.baseline_edges if name == "baseline" else report.tessera_edges
            if edges:  # the per-task schedule of the plan's bottleneck pair
                e = max(edges, key=lambda x: x.ms)
                dag, sched = plan_pair_schedule(costs, run.plan, e.f_stage, e.b_stage)
                title = f"{name}: rank {e.rank}, F S{e.f_stage} | B S{e.b_stage}"
                files.append(str(write_pair_trace(dag, sched, os.path.join(d, "bottleneck_pair.json"), title)))
        if recipe.logging.png:
            p = recipe.parallel
            title = (f"{recipe.name}: {name} {run.plan.template} pp={p.pp} vpp={run.plan.vpp} ep={p.ep} "
                     f"M={p.num_microbatches}" + (f", nominal {nominal_hw} costs" if nominal_hw else ""))
            files.append(str(write_timeline_png(run.result, os.path.join(d, "timeline.png"), title)))
    path = os.path.join(out, "plan.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return [path] + files


def cost_source_line(res, costs, report: PlanReport) -> str:
    """What the plan was costed on, for the planner table: ``analytic``, ``trace <file>`` or, for
    ``profile``, the profile's digest with the tasks measured and fallen back to the analytic
    model and the candidate pair items measured and composed from task times."""
    pl = res.recipe.planner
    if pl.cost_source == "trace":
        return f"trace {pl.trace} (MoE layers from the trace, the rest analytic)"
    if pl.cost_source != "profile":
        return pl.cost_source
    from tessera.config.cost_rules import cost_options
    from tessera.config.profile_rules import load_profile_costs
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.types import ParallelShape
    from tessera.train.profile.pairs import candidate_pairs

    first = res.layouts[0]
    analytic = analytic_costs(res.model, res.hardware, ParallelShape.of(first.parallel), options=cost_options(first))
    got = load_profile_costs(first, res.model, res.hardware, analytic)
    items = set(candidate_pairs(costs, report))
    measured = {k for k, w, _ in costs.measured_pairs if w == report.with_w}
    return (f"profile: {got.fallback_note()}; candidate pair items: {len(items & measured)} of {len(items)} measured, "
            f"{len(items - measured)} composed from task times (analytic overlap model)")


def slowdown_note(planner) -> str:
    """``"; slowdown: rank 3 x1.3, expert tasks x1.1 (slowest EP rank)"`` for the planner table's
    cost row where ``planner.rank_slowdown`` / ``ep_slowdown`` scale anything (only factors not
    1.0 listed), else ``""``."""
    parts = [f"rank {r} x{f:g}" for r, f in enumerate(planner.rank_slowdown) if f != 1.0]
    ep = max(planner.ep_slowdown, default=1.0)
    if ep != 1.0:
        parts.append(f"expert tasks x{ep:g} (slowest EP rank)")
    return f"; slowdown: {', '.join(parts)}" if parts else ""


def mfu_note(hw, cost_source: str) -> tuple[str, ...]:
    """With measured costs on a nominal hardware preset (``cpu``): MFU still divides by the
    preset's placeholder peak, so it is nominal though the times are measured (one line); ``()``
    otherwise (the analytic path's note covers it: :func:`tessera.cli.console.nominal_cost_note`)."""
    from tessera.cli.console import NOMINAL_PRESETS

    if hw is None or hw.name not in NOMINAL_PRESETS or cost_source == "analytic":
        return ()
    return (f"MFU is nominal: the times are measured, but the peak is the {hw.name} preset's placeholder "
            f"{hw.peak_tflops:g} TFLOP/s (not measured, no datasheet)",)


def cap_line(report: PlanReport, recipe) -> str:
    """The planner table's "wall cap hit" row: which phases a wall-clock safety cap stopped and
    what to raise (``""`` when none: the plan depends on the recipe and the costs only)."""
    if not report.cap_hit:
        return ""
    pl = recipe.planner
    knobs = {"milp": f"planner.time_limit_s={pl.time_limit_s:g}",
             "search": f"planner.search_time_s={pl.search_time_s:g}",
             "synthesis": f"planner.search_time_s={pl.search_time_s:g}", "partition bound": "--bound-time"}
    raise_ = sorted({v for k, v in knobs.items() if any(c.startswith(k) for c in report.cap_hit)})
    return (f"{', '.join(report.cap_hit)}: stopped by a wall-clock safety cap before its deterministic budget, so "
            f"this plan depends on the machine's load; raise {' / '.join(raise_)}")


def render(report: PlanReport, runs: dict[str, PlannedRun], recipe, files, hw=None, cost_line: str = "",
           content_hash: str = ""):
    """Rich tables: the comparison, the planner summary and the per-edge pair costs (ms).

    ``hw`` (the resolved HardwareSpec): with a nominal preset (``cpu``) the iteration and MFU rows
    are marked nominal and a note row explains why (:func:`tessera.cli.console.nominal_cost_note`;
    with measured costs the MFU row alone: :func:`mfu_note`); ``cost_line``: the cost source row
    (:func:`cost_source_line`); the "cost options" row: precision, FP8 recipe, CUDA graphs, MoE
    routing (:func:`tessera.cli.common.cost_options_line`); ``content_hash``: the "plan hash" row
    (``plan.json``'s ``content_hash``); a "wall cap hit" row when a cap stopped a phase (:func:`cap_line`).
    """
    from rich.markup import escape
    from rich.table import Table

    from tessera.cli.console import nominal_cost_note
    from tessera.config.cost_rules import cost_settings

    names = list(runs)
    t = Table(title=f"tessera plan: {recipe.name}", title_justify="left")
    t.add_column("")
    for n in names:
        t.add_column(n)
    edges = {"baseline": report.baseline_edges, "tessera": report.tessera_edges}
    bott = {"baseline": report.baseline_bottleneck_ms, "tessera": report.tessera_bottleneck_ms}

    def row(label, fn):
        t.add_row(label, *[escape(fn(n)) for n in names])

    row("template, vpp", lambda n: f"{runs[n].plan.template}, {runs[n].plan.vpp}")
    row("rank order", lambda n: f"synthesized (from {runs[n].plan.template})" if runs[n].plan.synthesized
        else "the template's")
    row("overlap, split W", lambda n: f"{_on(runs[n].plan.overlap)}, {_on(runs[n].plan.split_w)}")
    row("partition (layers/stage)", lambda n: " ".join(map(str, runs[n].plan.partition.sizes())))
    row("stages", lambda n: runs[n].plan.partition.describe())
    row("bottleneck pair", lambda n: _bottleneck(edges[n], bott[n]))
    note = nominal_cost_note(hw, recipe.planner.cost_source) if hw is not None else ()
    nominal = " (nominal, see note)" if note else ""
    row("iteration", lambda n: f"{runs[n].result.iteration_ms:.2f} ms{nominal}")
    row("lower bound, efficiency", lambda n: f"{runs[n].efficiency.bound.ms:.2f} ms, "
                                             f"{100 * runs[n].efficiency.efficiency:.1f}%")
    if "baseline" in runs:
        row("iteration ratio", lambda n: f"{runs['baseline'].result.iteration_ms / runs[n].result.iteration_ms:.3f}x")
    row("bubble ratio", lambda n: f"{100 * runs[n].result.bubble_ratio:.1f}%")
    row("exposed A2A share", lambda n: f"{100 * runs[n].result.exposed_a2a_ratio:.1f}%")
    row("peak memory per rank (GB)", lambda n: " ".join(f"{m.peak_mem_gb:.1f}" for m in runs[n].result.ranks))
    mfu_only = mfu_note(hw, recipe.planner.cost_source)
    note = note + mfu_only
    row("MFU", lambda n: f"{100 * runs[n].result.mfu:.1f}%" + (nominal or (" (nominal, see note)" if mfu_only else "")))
    m = report.milp
    s = Table(title="planner", show_header=False, title_justify="left")
    s.add_column("", style="bold")
    s.add_column("")
    for k, v in [
        *([("cost source", cost_line)] if cost_line else []),
        ("placement", _placement(recipe).describe()),
        ("cost options", cost_options_line(cost_settings(recipe))),
        ("candidates", f"{report.candidates} over {report.baseline.partition.num_stages} stages"),
        ("pairs", f"{report.pairs_total} over {len(report.tessera_edges)} edges, {report.pairs_distinct} distinct, "
                  f"costed in {report.pair_cost_s:.2f} s"),
        ("pruning threshold", f"{report.pruning_threshold_ms:.3f} ms (lower bound {m.lower_bound_ms:.3f} ms over the "
                              "MILP's candidates; the iteration search may leave them)"),
        ("MILP size", f"vars {m.n_vars_before} -> {m.n_vars_after}, constraints {m.n_conss_before} -> "
                      f"{m.n_conss_after} ({m.shrink:.1f}x smaller), pairs {m.pairs_before_pruning} -> {m.pairs_after_pruning} "
                      f"({m.pair_terms_after} with a cost term)"),
        ("MILP solve", f"{m.status}, {m.solve_s:.2f} s"),
        ("objective", report.objective + ("" if report.search is None else
                                          f": {report.search.evaluations} plans simulated (budget "
                                          f"{report.search.max_evals}), {report.search.moves} "
                                          f"boundary move{'' if report.search.moves == 1 else 's'}, "
                                          f"{report.search.search_s:.1f} s")),
        *([("schedule synthesis", synthesis_line(report))] if report.synthesis is not None else []),
        *([("fallback", report.fallback)] if report.fallback else []),
        *[("layout tried" if i == 0 else "", f"{a[0]} vpp={a[1]} overlap={_on(a[4])} split_w={_on(a[5])}: "
                                              f"baseline {a[2]:.2f} ms, tessera {a[3]:.2f} ms")
          for i, a in enumerate(report.alternatives)],
        *([("partition lower bound", _partition_bound(report))] if report.partition_bound is not None else []),
        ("bottleneck ratio", f"{report.baseline_bottleneck_ms / report.tessera_bottleneck_ms:.3f}x"
         if report.tessera_bottleneck_ms > 0 else "-"),
        *([("wall cap hit", cap_line(report, recipe))] if report.cap_hit else []),
        *([("plan hash", content_hash)] if content_hash else []),
    ] + [("note" if i == 0 else "", line) for i, line in enumerate(note)] + [("output", f) for f in files]:
        s.add_row(escape(k), escape(v))
    same = report.baseline.template == report.tessera.template and report.baseline.vpp == report.tessera.vpp
    e = Table(title="overlapped pair costs (ms) per edge: rank, F stage | B stage", title_justify="left")
    e.add_column("rank")
    e.add_column("F | B")
    for n in (names if same else ["tessera"]):
        e.add_column(n, justify="right")
    if "baseline" in runs and same:
        for b, x in zip(report.baseline_edges, report.tessera_edges):
            e.add_row(str(b.rank), f"S{b.f_stage} | S{b.b_stage}", f"{b.ms:.2f}",
                      f"{x.ms:.2f}" + ("" if x.overlapped else " (serial)"))
    else:
        for x in report.tessera_edges:
            e.add_row(str(x.rank), f"S{x.f_stage} | S{x.b_stage}", f"{x.ms:.2f}" + ("" if x.overlapped else " (serial)"))
    return t, s, e


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _partition_bound(report: PlanReport) -> str:
    """e.g. ``"1250.90 ms for any partition (SCIP bound after 50 nodes, 9.8 s): iteration ratio
    at most 1.326x"``."""
    pb = report.partition_bound
    how = ("optimal" if pb.optimal else f"SCIP bound after {pb.nodes} nodes" if not pb.cap_hit
           else "SCIP bound at the wall-clock cap")
    ratio = (f": iteration ratio at most {report.baseline_iteration_ms / pb.ms:.3f}x"
             if pb.ms > 0 and report.baseline_iteration_ms else "")
    return f"{pb.ms:.2f} ms for any partition ({how}, {pb.solve_s:.1f} s){ratio}"


def _bottleneck(edges, value: float) -> str:
    worst = max(edges, key=lambda e: e.ms, default=None)
    if worst is None or worst.ms < value:
        return f"{value:.2f} ms (a stage running alone)"
    return f"{worst.ms:.2f} ms (rank {worst.rank}: F S{worst.f_stage} | B S{worst.b_stage})"


def run(args: argparse.Namespace) -> int:
    """``tessera plan``: make the overlap-aware plan, simulate it (and the baseline), write outputs."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.cli.console import console as make_console, nominal_cost_note, print_tables
    from dataclasses import replace

    from tessera.flow import BOUND_TIME_S, build_costs, partition_bound, plan_recipe, resolve

    recipe = load_cli_recipe(args)
    if args.slowdown_from:
        from tessera.cost.slowdown import read_slowdown

        recipe = recipe.with_overrides(read_slowdown(args.slowdown_from).as_overrides())
    res = resolve(recipe)
    out = plan_output_dir(args, recipe)
    check_out_before_planning(out, recipe, args.force)
    if args.export_schedule:
        check_export_path(args.export_schedule)
    elif args.export_format is not None:
        raise TesseraConfigError("--export-format", args.export_format, "only says how --export-schedule writes its file",
                                 "add --export-schedule FILE, or leave --export-format out")
    costs = build_costs(res)
    console = make_console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=args.no_progress or not console.is_terminal,
                  transient=True) as bar:
        tasks = {"pairs": bar.add_task("scheduling pairs", total=None),
                 "milp": bar.add_task("solving partition MILP (SCIP)", total=1),
                 "search": bar.add_task("simulating plans (iteration search)", total=1),
                 "synthesis": bar.add_task("synthesising rank orders", total=1)}

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(tasks[phase], completed=done, total=total)

        report = plan_recipe(res, costs, progress)
    bound_s = BOUND_TIME_S if args.bound_time is None else args.bound_time
    if bound_s > 0:
        report = replace(report, partition_bound=partition_bound(res, costs, bound_s))
    # plan.json always holds the baseline's iteration and efficiency, so its content hash is the
    # same with and without --compare (which only adds the baseline to the tables and outputs)
    both = {"baseline": _run_plan(recipe, res.hardware, costs, report.baseline),
            "tessera": _run_plan(recipe, res.hardware, costs, report.tessera)}
    runs = both if args.compare else {"tessera": both["tessera"]}
    nominal_hw = res.hardware.name if nominal_cost_note(res.hardware, recipe.planner.cost_source) else ""
    doc = plan_document(recipe, both, report)
    check_out_before_writing(out, doc, args.force)
    files = _write_outputs(recipe, out, runs, report, costs, nominal_hw, doc)
    schedule = export_schedule(args.export_schedule, runs["tessera"].programs, args.export_format or "compute_comms") \
        if args.export_schedule else ""
    print_tables(*render(report, runs, recipe, files, res.hardware,
                         cost_source_line(res, costs, report) + slowdown_note(recipe.planner), doc["content_hash"]))
    changes = synthesis_table(report)
    if changes is not None:
        print_tables(changes)
    if args.sensitivity:
        from tessera.cli.sensitivity import sensitivity_table

        print_tables(sensitivity_table(res, costs, report, args))
    if schedule:
        print(schedule)
    return 0
