"""The ``tessera`` command line (also ``python -m tessera``).

Subcommands live in :data:`SUBCOMMANDS`: a name maps to a :class:`Subcommand` holding its help
text and the module that implements it (``tessera.cli.<verb>``, imported only when that verb
runs). Each verb module has ``add_arguments(parser)`` and ``run(args) -> exit code``. Adding a
command means adding one module and one entry.

Bad input (:class:`~tessera.errors.TesseraConfigError`) and invalid Programs
(:class:`~tessera.errors.ProgramError`) print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

from tessera.cli.common import EXIT_USAGE
from tessera.errors import ProgramError, TesseraConfigError


@dataclass(frozen=True)
class Subcommand:
    """One ``tessera`` subcommand: its help line and the module implementing it."""

    help: str
    module: str

    def load(self):
        """The verb's module (``add_arguments``, ``run``)."""
        return importlib.import_module(self.module)


SUBCOMMANDS: dict[str, Subcommand] = {
    "simulate": Subcommand("simulate the baseline plan of a recipe: table, Chrome trace, PNG timeline",
                           "tessera.cli.simulate"),
    "plan": Subcommand("overlap-aware plan (candidates, pair scheduler, SCIP MILP); --compare with the baseline",
                       "tessera.cli.plan"),
    "profile": Subcommand("time the recipe's tasks and overlapped pairs on its Ray Train workers; fill the "
                          "profile cache (planner.cost_source=profile)", "tessera.cli.profile"),
    "train": Subcommand("train a recipe on Ray Train (local Ray unless --address / RAY_ADDRESS): metrics, W&B, "
                        "checkpoints", "tessera.cli.train"),
    "report": Subcommand("render a run's standard panels (loss, learning rate, MFU, bubble, ...) as PNG files from its "
                         "metrics.jsonl", "tessera.cli.report"),
    "status": Subcommand("a running job's step, plan version, partition, last metrics and plan version history, "
                         "from its driver actor", "tessera.cli.status"),
    "upgrade": Subcommand("hand a running job a new plan version (--plan FILE, --recipe FILE, --dbo on|off); it "
                          "takes effect at an iteration boundary; --autopilot on|off pauses and resumes the "
                          "autopilot", "tessera.cli.upgrade"),
    "rollback": Subcommand("switch a running job back one plan version (again: one further back), or to "
                           "--to VERSION", "tessera.cli.rollback"),
    "export": Subcommand("write a run's newest complete checkpoint as a Hugging Face directory of its family "
                         "(config.json + model.safetensors + the run's tokenizer)", "tessera.cli.export"),
}
"""Subcommand name -> :class:`Subcommand`. Add new commands (``profile``, ``status``, ``upgrade``,
...) here, each in its own module."""


def build_parser(subcommands: dict[str, Subcommand] = SUBCOMMANDS, only: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser with one sub-parser per entry of ``subcommands`` (``only``: import and
    set up the arguments of that verb alone; the others get a bare sub-parser for ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="tessera", description="Pipeline-parallel training for heterogeneous MoE models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, sc in subcommands.items():
        sp = sub.add_parser(name, help=sc.help, description=sc.help)
        if only is None or only == name:
            mod = sc.load()
            mod.add_arguments(sp)
            sp.set_defaults(_run=mod.run)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that ``KEY=VALUE`` overrides may come anywhere, also
    after a flag (``tessera plan RECIPE --compare planner.cost_source=profile``): words argparse
    leaves over that look like overrides join the verb's ``overrides``; anything else left over
    is argparse's usual error (exit code 2)."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    if not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra):
        return parser.parse_args(argv)  # argparse's own message for the first unknown word
    args.overrides = list(args.overrides or []) + extra
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    args = parse_args(build_parser(only=verb if verb in SUBCOMMANDS else None), argv)
    try:
        return args._run(args)
    except (TesseraConfigError, ProgramError) as e:
        msg = " ".join(str(e).split())
        print(f"tessera {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
