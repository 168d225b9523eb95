"""``tessera upgrade --job JOB (--plan FILE | --recipe FILE [KEY=VALUE ...] | --dbo on|off)``:
hand a running job's driver a new plan version (:mod:`tessera.train.job.client`); rank 0 switches
every rank to it at an iteration boundary.

* ``--plan FILE``: the ``plan.json`` of ``tessera plan`` (its ``plan``) or a bare ``Plan.to_dict()``;
* ``--recipe FILE [KEY=VALUE ...]``: the recipe is loaded and its value rules checked here (bad
  input is the usual one line, before the driver is asked); the driver re-plans for it;
* ``--dbo on|off``: switch the bubble optimizer live.

Prints one line, ``tessera upgrade: RUN: plan version V takes effect at step S (WHAT)``; a
refusal (:class:`~tessera.errors.UpgradeRefused`) is one line on stderr and exit code 2, the
running job untouched.
"""

from __future__ import annotations

import argparse

from tessera.cli.common import EXIT_OK
from tessera.cli.status import add_job_arguments, driver_client
from tessera.errors import TesseraConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera upgrade``."""
    add_job_arguments(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", metavar="FILE", help="a plan JSON (the plan.json of tessera plan)")
    what.add_argument("--recipe", metavar="FILE", help="a recipe YAML to re-plan for on the driver (KEY=VALUE "
                                                        "overrides after it)")
    what.add_argument("--dbo", choices=("on", "off"), help="switch the bubble optimizer on or off")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of --recipe, e.g. parallel.vpp=2")


def done_line(verb: str, run: str, answer: dict, what: str) -> str:
    """The one success line: ``tessera VERB: RUN: plan version V takes effect at step S (WHAT)``."""
    return (f"tessera {verb}: {run}: plan version {answer.get('version')} takes effect at step "
            f"{answer.get('effective_step')} ({what})")


def _recipe_dict(args: argparse.Namespace) -> dict:
    """``Recipe.to_dict()`` of ``--recipe`` with the overrides, its value rules checked.

    Raises:
        TesseraConfigError: as :func:`tessera.config.load.load_recipe` and :func:`tessera.flow.resolve`.
    """
    from tessera.cli.common import load_cli_recipe
    from tessera.flow import resolve

    recipe = load_cli_recipe(argparse.Namespace(recipe=args.recipe, overrides=list(args.overrides or ())))
    resolve(recipe)  # the value rules, here rather than on the driver
    return recipe.to_dict()


def run(args: argparse.Namespace) -> int:
    if args.overrides and args.recipe is None:
        raise TesseraConfigError("KEY=VALUE", " ".join(args.overrides), "overrides apply to --recipe only",
                                 "give --recipe FILE before them, or drop them")
    if args.plan is not None:
        from tessera.train.job.client import read_plan_file

        plan = read_plan_file(args.plan)  # a broken file fails here, before connecting
        with driver_client(args) as client:
            answer, what = client.upgrade_plan(plan), f"plan {args.plan}"
    elif args.recipe is not None:
        recipe = _recipe_dict(args)
        with driver_client(args) as client:
            answer = client.upgrade_recipe(recipe)
        what = "recipe " + " ".join([args.recipe, *(args.overrides or ())])
    else:
        with driver_client(args) as client:
            answer, what = client.upgrade_dbo(args.dbo == "on"), f"bubble optimizer {args.dbo}"
    print(done_line("upgrade", client.ref.run, answer, what))
    return EXIT_OK
