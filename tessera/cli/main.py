"""The ``tessera`` command line (also ``python -m tessera``).

Subcommands live in :data:`SUBCOMMANDS`: a name maps to a :class:`Subcommand` holding its help
text, a function that adds its arguments to an argparse sub-parser, and the function that runs it
(returns the exit code). Adding a command means adding one entry.

Bad input (:class:`~tessera.errors.TesseraConfigError`) and invalid Programs
(:class:`~tessera.errors.ProgramError`) print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from tessera.errors import ProgramError, TesseraConfigError

EXIT_OK, EXIT_USAGE = 0, 2


@dataclass(frozen=True)
class Subcommand:
    """One ``tessera`` subcommand: help line, argument setup and runner."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """``RECIPE [overrides...]``: shared by subcommands that take a recipe."""
    p.add_argument("recipe", metavar="RECIPE", nargs="?", default="default",
                   help="recipe YAML (e.g. recipes/qwen3-next-80b.yaml); 'default' or omitted: the embedded default")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="omegaconf dotlist overrides, e.g. parallel.pp=8 parallel.vpp=2")


def load_cli_recipe(args: argparse.Namespace):
    """The Recipe named by ``args.recipe`` with ``args.overrides`` applied."""
    from tessera.config.load import load_recipe

    recipe, overrides = args.recipe, list(args.overrides)
    if "=" in recipe and not os.path.exists(recipe):  # `tessera simulate parallel.pp=2`: no recipe given
        recipe, overrides = "default", [recipe] + overrides
    return load_recipe(None if recipe == "default" else recipe, overrides)


def output_dir(args: argparse.Namespace, recipe) -> str:
    """``--out`` if given, else ``logging.out_dir/<recipe name>``."""
    return args.out or os.path.join(recipe.logging.out_dir, recipe.name)


# --------------------------------------------------------------------------- simulate


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    _add_recipe_arguments(p)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory for trace.json and timeline.png (default: logging.out_dir/<recipe name>)")


def _kinds_summary(model) -> str:
    counts = Counter(l.code for l in model.layers)
    return " ".join(f"{n}x{code}" for code, n in counts.most_common())


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def render_summary(run, out_files: Sequence[str] = ()):
    """Rich renderables (summary table, per-rank table) for a :class:`~tessera.pipeline.SimulationRun`;
    times in ms, memory in GB. With a nominal hardware preset (``cpu``) a note row says so and the
    iteration and MFU rows are marked nominal (:func:`tessera.console.nominal_cost_note`)."""
    from rich.markup import escape
    from rich.table import Table

    from tessera.config.resolve import model_source
    from tessera.config.validate import capacity_gb
    from tessera.console import nominal_cost_note

    res, r = run.resolved, run.result
    rec, model, hw, plan = res.recipe, res.model, res.hardware, run.plan
    p = rec.parallel
    cap = capacity_gb(rec, hw)
    worst = max(r.ranks, key=lambda m: m.peak_mem_gb)
    note = nominal_cost_note(hw)  # () unless the hardware preset is nominal (cpu)
    nominal = " (nominal, see note)" if note else ""
    t = Table(title=f"tessera simulate: {rec.name} ({plan.name} plan)", show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value")
    rows = [
        ("model", f"{model.name}: {model.num_layers} layers ({_kinds_summary(model)}), from {model_source(rec)}"),
        ("hardware", f"{hw.name}: {hw.peak_tflops:g} TFLOP/s, {hw.mem_gb:g} GB"),
        *[("note" if i == 0 else "", line) for i, line in enumerate(note)],
        ("layout", f"pp={p.pp} vpp={p.vpp} ep={p.ep} tp={p.tp} dp={p.dp}; "
                   f"{p.num_microbatches} microbatches x {p.micro_batch_size} x {p.seq_length} tokens"),
        ("plan", f"{plan.name}, template {plan.template}, overlap={'on' if plan.overlap else 'off'}, "
                 f"split_w={'on' if plan.split_w else 'off'}"),
        ("partition", "layers per stage " + " ".join(map(str, plan.partition.sizes()))),
        ("", plan.partition.describe()),
        ("iteration", f"{r.iteration_ms:.2f} ms{nominal}"),
        ("bubble ratio", _pct(r.bubble_ratio)),
        ("exposed A2A share", _pct(r.exposed_a2a_ratio)),
        ("peak memory (max)", f"{worst.peak_mem_gb:.2f} GB on rank {worst.rank} (capacity {cap:.1f} GB)"),
        ("peak memory per rank", " ".join(f"{m.peak_mem_gb:.1f}" for m in r.ranks) + " GB"),
        ("MFU", _pct(r.mfu) + nominal),
        ("simulation wall time", f"{run.timing('simulate'):.2f} s (all steps {run.wall_s:.2f} s)"),
    ]
    rows += [("output", f) for f in out_files]
    for k, v in rows:
        t.add_row(escape(k), escape(v))
    pr = Table(title="per rank", title_justify="left")
    for col in ("rank", "stages", "layers", "peak GB", "static GB", "busy ms", "idle ms", "exposed A2A ms"):
        pr.add_column(col, justify="right")
    for m, prog in zip(r.ranks, run.programs):
        stages = ",".join(f"S{s.stage}" for s in prog.stages)
        layers = sum(plan.partition.num_decoder_layers(s.stage) for s in prog.stages)
        pr.add_row(str(m.rank), stages, str(layers), f"{m.peak_mem_gb:.2f}", f"{m.static_mem_gb:.2f}",
                   f"{m.busy_ms:.1f}", f"{m.idle_ms:.1f}", f"{m.exposed_a2a_ms:.1f}")
    return t, pr


def cmd_simulate(args: argparse.Namespace) -> int:
    """``tessera simulate``: baseline plan -> Programs -> simulated iteration; table + trace + PNG."""
    from tessera.console import nominal_cost_note, print_tables
    from tessera.pipeline import simulate_recipe

    recipe = load_cli_recipe(args)
    run = simulate_recipe(recipe)
    out = output_dir(args, recipe)
    files = []  # the writers create ``out`` when they write
    if recipe.logging.trace:
        from tessera.sim.trace import write_chrome_trace

        files.append(str(write_chrome_trace(run.result, os.path.join(out, "trace.json"))))
    if recipe.logging.png:
        from tessera.sim.timeline import write_timeline_png

        p = recipe.parallel
        title = f"{recipe.name}: {run.plan.name} {run.plan.template} pp={p.pp} vpp={p.vpp} ep={p.ep} M={p.num_microbatches}"
        if nominal_cost_note(run.resolved.hardware):
            title += f", nominal {run.resolved.hardware.name} costs"
        files.append(str(write_timeline_png(run.result, os.path.join(out, "timeline.png"), title)))
    print_tables(*render_summary(run, files))  # full rows off a terminal, never an elided number
    return EXIT_OK


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from tessera.plan_command import plan_arguments

    plan_arguments(p)


def cmd_plan(args: argparse.Namespace) -> int:
    """``tessera plan``: see :mod:`tessera.plan_command`."""
    from tessera.plan_command import cmd_plan as run

    return run(args)


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from tessera.launch import add_arguments

    add_arguments(p)


def cmd_train(args: argparse.Namespace) -> int:
    """``tessera train``: the same code path as ``python -m tessera.launch`` (a local Ray is
    started when no cluster address is given)."""
    from tessera.launch import run_and_report

    return run_and_report(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "simulate": Subcommand("simulate the baseline plan of a recipe: table, Chrome trace, PNG timeline",
                           _simulate_arguments, cmd_simulate),
    "plan": Subcommand("overlap-aware plan (candidates, pair scheduler, SCIP MILP); --compare with the baseline",
                       _plan_arguments, cmd_plan),
    "train": Subcommand("train a recipe on Ray Train (local Ray unless --address / RAY_ADDRESS): metrics, W&B, "
                        "checkpoints", _train_arguments, cmd_train),
}
"""Subcommand name -> :class:`Subcommand`. Add new commands (``plan``, ``train``, ...) here."""


def build_parser(subcommands: dict[str, Subcommand] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The argparse parser with one sub-parser per entry of ``subcommands``."""
    parser = argparse.ArgumentParser(
        prog="tessera", description="Pipeline-parallel training for heterogeneous MoE models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, sc in subcommands.items():
        sp = sub.add_parser(name, help=sc.help, description=sc.help)
        sc.add_arguments(sp)
        sp.set_defaults(_run=sc.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except (TesseraConfigError, ProgramError) as e:
        msg = " ".join(str(e).split())
        print(f"tessera {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
