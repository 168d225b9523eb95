"""``tessera simulate``: the baseline plan of a recipe -> Programs -> simulated iteration; a summary
table, a per-rank table, a Chrome trace and a PNG timeline with the critical path marked
(:mod:`tessera.sim.critical`; ``--json`` writes it too)."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Sequence

from tessera.cli.common import EXIT_OK, add_recipe_arguments, cost_options_line, load_cli_recipe, output_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_arguments(p)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory for trace.json and timeline.png (default: logging.out_dir/<recipe name>)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write every figure of the tables (iteration_ms, bubble_ratio, exposed_a2a_ratio, mfu, "
                        "tflops_per_gpu, tokens_per_s_per_gpu, peak_mem_gb per rank, ...; the cost options precision, "
                        "fp8_recipe, cuda_graphs, moe_routing, moe_max_over_mean) and the critical path "
                        "(critical_path: its tasks and transfers in time order) to FILE as one JSON object")


def _kinds_summary(model) -> str:
    counts = Counter(l.code for l in model.layers)
    return " ".join(f"{n}x{code}" for code, n in counts.most_common())


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _critical_row(path, iteration_ms: float) -> str:
    """The critical path in one line: its share of the iteration per rank (largest first) and what it holds."""
    from tessera.sim.critical import critical_ms_by_rank

    by_rank = sorted(critical_ms_by_rank(path).items(), key=lambda kv: (-kv[1], kv[0]))
    shares = ", ".join(f"r{r} {ms / iteration_ms:.0%}" for r, ms in by_rank if iteration_ms > 0)
    counts = Counter(s.kind for s in path)
    return (f"{shares} of the iteration ({counts['task']} tasks, {counts['transfer']} transfers, "
            f"{counts['instruction']} instruction waits; red in the timeline)")


def render_summary(run, out_files: Sequence[str] = (), path=None):
    """Rich renderables (summary table, per-rank table) for a :class:`~tessera.flow.SimulationRun`;
    times in ms, memory in GB. With a nominal hardware preset (``cpu``) a note row says so and the
    iteration and MFU rows are marked nominal (:func:`tessera.cli.console.nominal_cost_note`).
    ``path``: the run's critical path (:func:`tessera.sim.critical.critical_path`; default: computed)."""
    from rich.markup import escape
    from rich.table import Table

    from tessera.config.cost_rules import cost_settings
    from tessera.config.resolve import model_source
    from tessera.config.validate import capacity_gb
    from tessera.cli.console import nominal_cost_note
    from tessera.sim.critical import critical_path

    res, r = run.resolved, run.result
    rec, model, hw, plan = res.recipe, res.model, res.hardware, run.plan
    summary = run.summary()
    p = rec.parallel
    cap = capacity_gb(rec, hw)
    worst = max(r.ranks, key=lambda m: m.peak_mem_gb)
    note = nominal_cost_note(hw, rec.planner.cost_source)  # () unless the preset is nominal (cpu), analytic costs
    nominal = " (nominal, see note)" if note else ""
    t = Table(title=f"tessera simulate: {rec.name} ({plan.name} plan)", show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value")
    rows = [
        ("model", f"{model.name}: {model.num_layers} layers ({_kinds_summary(model)}), from {model_source(rec)}"),
        ("hardware", f"{hw.name}: {hw.peak_tflops:g} TFLOP/s, {hw.mem_gb:g} GB"),
        *[("note" if i == 0 else "", line) for i, line in enumerate(note)],
        ("layout", f"pp={p.pp} vpp={plan.vpp} ep={p.ep} tp={p.tp} dp={p.dp}; "
                   f"{p.num_microbatches} microbatches x {p.micro_batch_size} x {p.seq_length} tokens"),
        ("placement", run.placement.describe()),
        ("cost options", cost_options_line(cost_settings(rec))),
        ("plan", f"{plan.name}, template {plan.template}, overlap={'on' if plan.overlap else 'off'}, "
                 f"split_w={'on' if plan.split_w else 'off'}"),
        ("partition", "layers per stage " + " ".join(map(str, plan.partition.sizes()))),
        ("", plan.partition.describe()),
        ("iteration", f"{r.iteration_ms:.2f} ms{nominal}"),
        ("critical path", _critical_row(critical_path(r) if path is None else path, r.iteration_ms)),
        ("bubble ratio", _pct(r.bubble_ratio)),
        ("exposed A2A share", _pct(r.exposed_a2a_ratio)),
        ("data parallel", f"{p.dp_shard}: exposed collectives up to {max(m.dp_exposed_ms for m in r.ranks):.1f} ms, "
                          f"optimizer step up to {max(m.optimizer_ms for m in r.ranks):.1f} ms per rank"),
        ("peak memory (max)", f"{worst.peak_mem_gb:.2f} GB on rank {worst.rank} (capacity {cap:.1f} GB)"),
        ("peak memory per rank", " ".join(f"{m.peak_mem_gb:.1f}" for m in r.ranks) + " GB"),
        ("MFU", _pct(r.mfu) + nominal),
        ("throughput", f"{summary['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, {summary['tflops_per_gpu']:.1f} "
                       f"TFLOP/s/GPU on {summary['gpus']} GPUs{nominal}"),
        ("simulation wall time", f"{run.timing('simulate'):.2f} s (all steps {run.wall_s:.2f} s)"),
    ]
    rows += [("output", f) for f in out_files]
    for k, v in rows:
        t.add_row(escape(k), escape(v))
    pr = Table(title="per rank", title_justify="left")
    for col in ("rank", "stages", "layers", "peak GB", "static GB", "busy ms", "idle ms", "exposed A2A ms",
                "exposed DP ms", "optimizer ms"):
        pr.add_column(col, justify="right")
    for m, prog in zip(r.ranks, run.programs):
        stages = ",".join(f"S{s.stage}" for s in prog.stages)
        layers = sum(plan.partition.num_decoder_layers(s.stage) for s in prog.stages)
        pr.add_row(str(m.rank), stages, str(layers), f"{m.peak_mem_gb:.2f}", f"{m.static_mem_gb:.2f}",
                   f"{m.busy_ms:.1f}", f"{m.idle_ms:.1f}", f"{m.exposed_a2a_ms:.1f}", f"{m.dp_exposed_ms:.1f}",
                   f"{m.optimizer_ms:.1f}")
    return t, pr


def run(args: argparse.Namespace) -> int:
    """``tessera simulate``: baseline plan -> Programs -> simulated iteration; table + trace + PNG."""
    from tessera.cli.console import nominal_cost_note, print_tables
    from tessera.flow import simulate_recipe

    from tessera.sim.critical import critical_path

    recipe = load_cli_recipe(args)
    run = simulate_recipe(recipe)
    path = critical_path(run.result)
    out = output_dir(args, recipe)
    files = []  # the writers create ``out`` when they write
    if recipe.logging.trace:
        from tessera.sim.trace import write_chrome_trace

        files.append(str(write_chrome_trace(run.result, os.path.join(out, "trace.json"))))
    if recipe.logging.png:
        from tessera.sim.timeline import write_timeline_png

        p = recipe.parallel
        title = f"{recipe.name}: {run.plan.name} {run.plan.template} pp={p.pp} vpp={run.plan.vpp} ep={p.ep} M={p.num_microbatches}"
        if nominal_cost_note(run.resolved.hardware, recipe.planner.cost_source):
            title += f", nominal {run.resolved.hardware.name} costs"
        files.append(str(write_timeline_png(run.result, os.path.join(out, "timeline.png"), title, critical=path)))
    if args.json:
        import json
        from pathlib import Path

        target = Path(args.json)
        target.parent.mkdir(parents=True, exist_ok=True)
        from tessera.config.cost_rules import cost_settings

        doc = {**run.summary(), **cost_settings(recipe), "critical_path": [s.to_dict() for s in path]}
        target.write_text(json.dumps(doc, indent=1) + "\n")
        files.append(str(target))
    print_tables(*render_summary(run, files, path))  # full rows off a terminal, never an elided number
    return EXIT_OK
