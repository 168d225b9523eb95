"""Measured costs: the DeepSeek-V3 trace through the cost model, scheduler and simulator.

Usage::

    python benchmarks/profiling.py --json FILE [--trace PATH]

Three parts (the JSON holds every field; ``load_average``: the machine's load when it ended).

Workers part (skip with ``--no-workers``): ``tessera profile`` of ``recipes/tiny-qwen3-next.yaml``
(pp 2, vpp 2, dp 2, ep 2: 4 gloo Ray Train workers on a local Ray) into a fresh cache:
``distinct_tasks`` (items), ``tasks`` (task instances), ``pairs_needed`` (candidate pairs the
planner costs over every overlap edge), ``candidate_pairs_distinct`` (distinct DAGs among them),
``distinct_pairs`` (distinct pair items: signatures), ``program_pairs`` (those the Program
co-executes), ``pairs_timed`` (pair items timed co-executed on the workers) and ``pair_dedup``
(``pairs_needed / pairs_timed``), ``profile_wall_s``, ``cache_hit_wall_s`` (a second run: every
item cached, no worker), ``overlap_slowdown_fitted``, and per task kind
``<kind>_analytic_vs_measured_mean_err`` / ``_max_err`` (the analytic model as is),
``<kind>_calibration_scale_<phase>`` (measured / analytic, fitted per phase F/B/W) and ``<kind>_calibrated_mean_err`` /
``_max_err`` (the analytic time times that scale), with ``calibration_mean_err_before`` /
``_after`` over all kinds.

Sensitivity part (skip with ``--no-sensitivity``): the Tessera plan of
``recipes/qwen3-next-80b.yaml`` under ``--samples`` copies of its costs perturbed by
``+-spread`` (:func:`tessera.flow.plan_sensitivity`): ``sensitivity_partition_changed_share``,
``sensitivity_worst_loss``, ``sensitivity_mean_loss``.

Trace part (``--trace``, default ``benchmarks/data/deepseek-v3-h800-ep64-train-trace.json.gz``, a
gzip of ``../shared/data/deepseek-v3-h800-ep64-train-trace.json``: DeepSeek's PyTorch-profiler
trace of one DualPipe overlapped F&B chunk pair of four DeepSeek-V3 MoE layers, EP64 on H800):

* per layer (``trace_layers``, in issue order): ``trace_f_ms, trace_b_ms, trace_w_ms`` (GPU kernel
  time of ``attn`` + ``mlp`` in F, B and W), ``trace_dispatch_ms``, ``trace_combine_ms`` (F + B),
  attributed by launch correlation (:mod:`tessera.cost.trace`);
* ``trace_pair_measured_ms``: the pair's GPU window (first kernel start to last kernel end);
  ``trace_pair_replay_ms``: the traced durations in DeepSeek's own issue order through
  :func:`tessera.sched.dag.run_in_order` (the simulator's pair replay); ``trace_pair_scheduled_ms``:
  the pair scheduler's order for the same DAG (:func:`tessera.plan.pair_scheduler.schedule_pair`);
  ``trace_replay_error = replay / measured - 1``; ``trace_pair_analytic_ms``: the same DAG and
  order with the analytic model's per-layer times (below; compute slowed by ``overlap_slowdown``),
  ``analytic_replay_error`` against the measured window;
* ``trace_comm_sms`` (thread blocks of the DeepEP kernels = SMs held) and the resulting
  ``overlap_slowdown``;
* ``analytic_vs_trace``: per ``<op>(<phase>)`` the trace's mean per-layer time (compute divided
  by the slowdown it ran under), the analytic model's for ``recipes/deepseek-v3.yaml`` at FP8
  without recompute (the traced run's settings), and their ratio (> 1: analytic optimistic),
  with ``analytic_vs_trace_mean_err`` / ``_max_err`` (relative error of analytic vs trace) and
  the summed per-layer times of both.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

# rich and tessera are imported inside the functions that use them: ``--help`` answers without them

ROOT = Path(__file__).resolve().parent
TRACE = ROOT / "data" / "deepseek-v3-h800-ep64-train-trace.json.gz"
RECIPE = ROOT.parent / "recipes" / "deepseek-v3.yaml"


def trace_part(path: Path) -> dict:
    """The trace fields of the module docstring."""
    from tessera.config.load import load_recipe
    from tessera.cost.trace import load_kineto
    from tessera.cost.trace_costs import trace_costs
    from tessera.cost.types import Resource
    from tessera.flow import build_costs, resolve
    from tessera.plan.pair_scheduler import schedule_pair
    from tessera.sched.dag import TaskDAG, run_in_order
    from tessera.sched.tracedag import issue_order, trace_pair_dag

    t0 = time.perf_counter()
    tr = load_kineto(path)
    layers: dict[int, dict[str, float]] = {}
    for inst in tr.instances:
        row = layers.setdefault(inst.occurrence, {"layer": inst.occurrence, "trace_f_ms": 0.0, "trace_b_ms": 0.0,
                                                  "trace_w_ms": 0.0, "trace_dispatch_ms": 0.0,
                                                  "trace_combine_ms": 0.0})
        if inst.op in ("dispatch", "combine"):
            row[f"trace_{inst.op}_ms"] += inst.busy_ms()
        else:
            row[f"trace_{inst.phase.lower()}_ms"] += inst.busy_ms()
    dag = trace_pair_dag(tr)
    replay = run_in_order(dag, issue_order(tr, dag)).makespan
    scheduled = schedule_pair(dag).makespan
    res = resolve(load_recipe(str(RECIPE), ["train.precision=fp8", "planner.activation_recompute=none"]))
    _, rep = trace_costs(build_costs(res), tr, res.hardware)
    errs = {g: abs(rep.template_ms[g] / rep.trace_ms[g] - 1) for g in rep.trace_ms}
    # the same DAG and order with the analytic model's per-layer times (compute slowed by the overlap)
    analytic = TaskDAG(tuple(replace(t, ms=rep.template_ms[tr.instances[t.id].name] *
                                     (rep.overlap_slowdown if t.resource == Resource.COMPUTE else 1.0))
                             for t in dag.tasks))
    analytic_replay = run_in_order(analytic, issue_order(tr, analytic)).makespan
    return {
        "trace": str(path), "trace_device": tr.device, "trace_name": tr.trace_name,
        "trace_layers": [layers[k] for k in sorted(layers)],
        "trace_pair_measured_ms": tr.window_ms, "trace_pair_replay_ms": replay,
        "trace_pair_scheduled_ms": scheduled, "trace_replay_error": replay / tr.window_ms - 1,
        "trace_pair_analytic_ms": analytic_replay, "analytic_replay_error": analytic_replay / tr.window_ms - 1,
        "trace_comm_sms": rep.comm_blocks, "overlap_slowdown": rep.overlap_slowdown,
        "trace_totals_ms": tr.totals_ms(),
        "analytic_vs_trace": {g: {"trace_ms": rep.trace_ms[g], "analytic_ms": rep.template_ms[g],
                                  "trace_over_analytic": rep.factors[g]} for g in rep.trace_ms},
        "analytic_vs_trace_mean_err": sum(errs.values()) / len(errs), "analytic_vs_trace_max_err": max(errs.values()),
        "trace_layer_sum_ms": sum(rep.trace_ms.values()), "analytic_layer_sum_ms": sum(rep.template_ms.values()),
        "trace_wall_s": time.perf_counter() - t0,
    }


def workers_part(out_dir: str, reps: int) -> dict:
    """Profile the tiny recipe (pp=2, dp=2, ep=2: 4 gloo workers) on a local Ray into a fresh
    cache, then again (every item cached)."""
    import shutil

    from tessera.config.load import load_recipe
    from tessera.train.job.profile import run_profile
    from tessera.train.profile.setup import prepare_profile
    from tessera.train.job.ray_setup import connect

    shutil.rmtree(out_dir, ignore_errors=True)
    recipe = load_recipe(str(ROOT.parent / "recipes" / "tiny-qwen3-next.yaml"),
                         [f"logging.out_dir={out_dir}", f"profile.reps={reps}", "logging.wandb_mode=disabled"])
    owns = connect(None)
    try:
        first = run_profile(recipe, progress=True)
    finally:
        if owns:
            import ray

            ray.shutdown()
    t0 = time.perf_counter()
    setup = prepare_profile(recipe)
    second = run_profile(recipe, progress=False, setup=setup)
    assert second.cache_hit, "the second run should find every item in the cache"
    return {"workers_recipe": "tiny-qwen3-next pp2 vpp2 dp2 ep2 (4 gloo workers)",
            "distinct_tasks": first.distinct_tasks, "tasks": first.tasks, "task_dedup": first.tasks / first.distinct_tasks,
            "distinct_pairs": first.distinct_pairs, "program_pairs": first.program_pairs,
            "pairs_needed": first.pairs_needed, "candidate_pairs_distinct": first.candidate_pairs_distinct,
            "pairs_timed": first.pairs_timed, "pair_dedup": first.pair_dedup, "timed_items": first.timed_items,
            "not_timed": list(first.missing),
            "profile_wall_s": first.wall_s, "cache_hit_wall_s": time.perf_counter() - t0,
            "timed_iterations_per_pass": first.iterations, "overlap_slowdown_fitted": first.overlap_slowdown,
            "workers_device": first.device,
            **{f"{kind}_analytic_vs_measured_mean_err": c["mean_err"] for kind, c in first.calibration.items()},
            **{f"{kind}_analytic_vs_measured_max_err": c["max_err"] for kind, c in first.calibration.items()},
            **{f"{kind}_calibration_scale_{ph}": sc for kind, c in first.calibration.items()
               for ph, sc in c["scales"].items()},
            **{f"{kind}_calibrated_mean_err": c["mean_err_fit"] for kind, c in first.calibration.items()},
            **{f"{kind}_calibrated_max_err": c["max_err_fit"] for kind, c in first.calibration.items()},
            **_calibration_totals(first.calibration)}


def _calibration_totals(cal: dict) -> dict:
    """Item-weighted mean relative error over every task kind, before and after the fitted scale."""
    n = sum(c["n"] for c in cal.values()) or 1
    return {"calibration_mean_err_before": sum(c["mean_err"] * c["n"] for c in cal.values()) / n,
            "calibration_mean_err_after": sum(c["mean_err_fit"] * c["n"] for c in cal.values()) / n}


def sensitivity_part(spread: float, samples: int) -> dict:
    """Sensitivity of the Tessera plan of ``recipes/qwen3-next-80b.yaml`` (pp 8, vpp 2, ep 8,
    M 16) to a +-``spread`` perturbation of every task's time."""
    from tessera.config.load import load_recipe
    from tessera.flow import build_costs, plan_sensitivity, resolve

    t0 = time.perf_counter()
    res = resolve(load_recipe(str(RECIPE.with_name("qwen3-next-80b.yaml"))))
    costs = build_costs(res)
    from tessera.flow import plan_recipe

    report = plan_recipe(res, costs)
    s = plan_sensitivity(res, costs, report.tessera, spread=spread, samples=samples, search_time_s=6)
    return {"sensitivity_recipe": "qwen3-next-80b pp8 vpp2 ep8 M16", "sensitivity_spread": spread,
            "sensitivity_samples": samples, "sensitivity_partition_changed_share": s.partition_changed_share,
            "sensitivity_worst_loss": s.worst_loss, "sensitivity_mean_loss": s.mean_loss,
            "sensitivity_partitions": [[list(k), n] for k, n in s.partitions],
            "sensitivity_wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the results to FILE")
    ap.add_argument("--trace", default=str(TRACE), help="a Kineto trace of an overlapped F&B pair")
    ap.add_argument("--no-workers", action="store_true", help="skip profiling the tiny recipe on Ray workers")
    ap.add_argument("--workers-out", default="/tmp/tessera-profile-bench", help="out dir (cache) of the workers part")
    ap.add_argument("--reps", type=int, default=3, help="timed iterations per pass of the workers part")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity part")
    ap.add_argument("--spread", type=float, default=0.05, help="sensitivity perturbation (default 0.05)")
    ap.add_argument("--samples", type=int, default=10, help="sensitivity copies (default 10)")
    args = ap.parse_args(argv)
    from rich.table import Table

    from tessera.cli.console import print_tables

    out = trace_part(Path(args.trace))
    if not args.no_workers:
        out.update(workers_part(args.workers_out, args.reps))
    if not args.no_sensitivity:
        out.update(sensitivity_part(args.spread, args.samples))
    out["load_average"] = list(os.getloadavg())
    t = Table(title="DeepSeek-V3 pair trace (ms)")
    for c in ("layer", "F", "B", "W", "dispatch", "combine"):
        t.add_column(c, justify="right")
    for row in out["trace_layers"]:
        t.add_row(str(row["layer"]), *(f"{row[k]:.3f}" for k in ("trace_f_ms", "trace_b_ms", "trace_w_ms",
                                                                   "trace_dispatch_ms", "trace_combine_ms")))
    a = Table(title="analytic (FP8, no recompute) vs trace, mean per layer (ms)")
    for c in ("group", "trace", "analytic", "trace/analytic"):
        a.add_column(c, justify="right")
    for g, v in out["analytic_vs_trace"].items():
        a.add_row(g, f"{v['trace_ms']:.3f}", f"{v['analytic_ms']:.3f}", f"{v['trace_over_analytic']:.2f}")
    print_tables(t, a)
    if "pairs_timed" in out:
        print(f"tiny profile: {out['distinct_tasks']} task items, {out['pairs_timed']} of {out['distinct_pairs']} pair "
              f"items timed for {out['pairs_needed']} candidate pairs (dedup {out['pair_dedup']:.2f}x) in "
              f"{out['profile_wall_s']:.1f} s; calibration mean error {out['calibration_mean_err_before']:.1%} -> "
              f"{out['calibration_mean_err_after']:.1%} with the fitted per-phase scales")
    print(f"pair window {out['trace_pair_measured_ms']:.2f} ms, replay {out['trace_pair_replay_ms']:.2f} ms "
          f"({out['trace_replay_error']:+.1%}), pair scheduler {out['trace_pair_scheduled_ms']:.2f} ms, "
          f"analytic costs in the traced order {out['trace_pair_analytic_ms']:.2f} ms ({out['analytic_replay_error']:+.1%})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
