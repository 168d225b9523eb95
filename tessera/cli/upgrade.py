"""``tessera upgrade --job JOB (--plan FILE | --recipe FILE [KEY=VALUE ...] | --dbo on|off | --autopilot on|off)``:
hand a running job's driver a new plan version (:mod:`tessera.train.job.client`); rank 0 switches
every rank to it at an iteration boundary.

* ``--plan FILE``: the ``plan.json`` of ``tessera plan`` (its ``plan``) or a bare ``Plan.to_dict()``;
* ``--recipe FILE [KEY=VALUE ...]``: the recipe is loaded and its value rules checked here (bad
  input is the usual one line, before the driver is asked); the driver compares it with the
  running job's recipe field by field and re-plans for it
  (:func:`tessera.train.upgrade.check.recipe_upgrade`: a field the running job cannot change is
  refused, naming every such field with both values; fields that cannot change a plan, such as
  ``train.steps``, are kept as the job has them and reported);
* ``--dbo on|off``: switch the bubble optimizer live;
* ``--autopilot on|off``: resume or pause the autopilot's decisions (``docs/operations.md``,
  "Autopilot"; no version: prints ``tessera upgrade: RUN: autopilot on|off from step S``).

Prints one line, ``tessera upgrade: RUN: plan version V takes effect at step S (WHAT)``, or, when
the request runs exactly what the current version runs (the same Programs and bubble optimizer),
``tessera upgrade: RUN: no change: plan equals running version N (WHAT)`` (``version N
(pending, takes effect at step S)`` while N is not running yet), exit code 0 and no version
added. ``--recipe`` adds a second line when fields were ignored, ``tessera upgrade: RUN: ignored
by the upgrade (apply at the next start): FIELD: running=X new=Y; ...``. A refusal
(:class:`~tessera.errors.UpgradeRefused`) is one line on stderr and exit code 2, the running job
untouched.
"""

from __future__ import annotations

import argparse

from tessera.cli.common import EXIT_OK
from tessera.cli.status import add_job_arguments, driver_client
from tessera.errors import TesseraConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera upgrade``."""
    add_job_arguments(p)
    p.epilog = ("A request that runs exactly what the current version runs (the same Programs and bubble optimizer) "
                "adds no version: it prints 'no change: plan equals running version N' and exits 0.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", metavar="FILE", help="a plan JSON (the plan.json of tessera plan)")
    what.add_argument("--recipe", metavar="FILE", help="a recipe YAML to re-plan for on the driver (KEY=VALUE "
                                                        "overrides after it); compared with the running job's "
                                                        "recipe: planner.*, hardware.*, parallel.vpp, dbo.enabled "
                                                        "and profile.cache may differ; fields that cannot change a "
                                                        "plan (train.steps, checkpoint interval, logging, job, ...) "
                                                        "are ignored and reported; the rest must be the job's")
    what.add_argument("--dbo", choices=("on", "off"), help="switch the bubble optimizer on or off")
    what.add_argument("--autopilot", choices=("on", "off"),
                      help="resume or pause the autopilot (re-planning on stragglers and routing skew; the job must "
                           "have started with autopilot.enabled=true)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of --recipe, e.g. parallel.vpp=2")


def done_line(verb: str, run: str, answer: dict, what: str) -> str:
    """The one success line: ``tessera VERB: RUN: plan version V takes effect at step S (WHAT)``,
    or for an answer with ``no_change`` ``tessera VERB: RUN: no change: plan equals running
    version N (WHAT)`` (``version N (pending, takes effect at step S)`` when it is not running yet)."""
    v, step = answer.get("version"), answer.get("effective_step")
    if answer.get("no_change"):
        where = f"running version {v}" if answer.get("running") else f"version {v} (pending, takes effect at step {step})"
        return f"tessera {verb}: {run}: no change: plan equals {where} ({what})"
    return f"tessera {verb}: {run}: plan version {v} takes effect at step {step} ({what})"


def _recipe_dict(args: argparse.Namespace) -> dict:
    """``Recipe.to_dict()`` of ``--recipe`` with the overrides, its value rules checked, the
    files its planning reads absolute as the launcher gives the job's to the driver
    (:func:`tessera.train.worker.corpus.absolute_plan_inputs`).

    Raises:
        TesseraConfigError: as :func:`tessera.config.load.load_recipe` and :func:`tessera.flow.resolve`.
    """
    from tessera.cli.common import load_cli_recipe
    from tessera.flow import resolve
    from tessera.train.worker.corpus import absolute_plan_inputs

    recipe = load_cli_recipe(argparse.Namespace(recipe=args.recipe, overrides=list(args.overrides or ())))
    resolve(recipe)  # the value rules, here rather than on the driver
    return absolute_plan_inputs(recipe).to_dict()  # the driver reads them in another working directory


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
    elif args.autopilot is not None:
        with driver_client(args) as client:
            answer = client.set_autopilot(args.autopilot == "on")
        print(f"tessera upgrade: {client.ref.run}: autopilot {args.autopilot} from step {answer.get('step')}")
        return EXIT_OK
    else:
        with driver_client(args) as client:
            answer, what = client.upgrade_dbo(args.dbo == "on"), f"bubble optimizer {args.dbo}"
    print(done_line("upgrade", client.ref.run, answer, what))
    if answer.get("ignored"):
        print(f"tessera upgrade: {client.ref.run}: ignored by the upgrade (apply at the next start): "
              + "; ".join(answer["ignored"]))
    return EXIT_OK
