"""``tessera train`` (and ``python -m tessera.launch``): arguments, pre-flight checks before Ray
starts, connecting to Ray (or starting a local Ray), the job (:func:`tessera.train.job.run.run_job`)
and its summary.

Flow: load the recipe (its overrides, then the job flags :data:`JOB_FLAGS` as ``job.*``
overrides: ``--max-failures 0`` is ``job.max_failures=0``) -> pre-flight checks
(:mod:`tessera.train.job.preflight`: value rules, training rules, data, memory, and the resources of
the local Ray about to start; with ``--address`` / ``RAY_ADDRESS`` the address check
(:func:`tessera.train.job.ray_setup.check_address`) comes after the recipe's checks and before
the slow one that imports the model code, so an unreachable cluster or a missing
``RAY_AUTH_MODE`` is reported within a second or two) -> connect or start Ray -> the job ->
summary table. Bad input is one line on stderr and exit
code 2; a failed job one line and exit code 1; a local Ray this command started is shut down
either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tessera.cli.common import load_cli_recipe
from tessera.errors import ProgramError, TesseraConfigError
from tessera.train.job.run import JobFailed, JobResult, run_job

JOB_FLAGS: tuple[tuple[str, str], ...] = (
    ("run_name", "--run-name"), ("namespace", "--namespace"), ("max_failures", "--max-failures"),
    ("cpus_per_worker", "--cpus-per-worker"), ("detached_driver", "--detached-driver"),
    ("keep_driver", "--keep-driver"), ("oversubscribe", "--oversubscribe"),
)
"""``(job field, flag)``: the flags that are spellings of ``job.<field>`` overrides."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m tessera.launch`` and ``tessera train``. The job flags
    (:data:`JOB_FLAGS`) default to None: unset, they leave the recipe's ``job`` section alone."""
    p.add_argument("recipe", metavar="RECIPE", nargs="?", default="default",
                   help="recipe YAML (e.g. recipes/tiny-qwen3-next.yaml); 'default' or omitted: the shipped recipes/tiny-qwen3-next.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.steps=50")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS; none: start a local Ray for this job)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a local Ray (default: all cores)")
    p.add_argument("--ray-temp-dir", default=None, help="temp dir of a local Ray")
    p.add_argument("--run-name", default=None, help="job.run_name: run name (default: <recipe name>-<time>)")
    p.add_argument("--namespace", default=None,
                   help="job.namespace: Ray namespace of the driver actor (default tessera)")
    p.add_argument("--max-failures", type=int, default=None,
                   help="job.max_failures: worker-group restarts before failing (default 3; -1: no limit)")
    p.add_argument("--cpus-per-worker", type=float, default=None,
                   help="job.cpus_per_worker: CPUs per worker (default: the cluster's CPUs shared evenly, at most 1)")
    p.add_argument("--detached-driver", action="store_true", default=None,
                   help="job.detached_driver=true: the driver actor outlives the job")
    p.add_argument("--keep-driver", action="store_true", default=None,
                   help="job.keep_driver=true: do not kill the driver actor at the end")
    p.add_argument("--oversubscribe", action="store_true", default=None,
                   help="job.oversubscribe=true: start CPU workers even beyond 4 busy threads per CPU of the cluster")
    p.add_argument("--no-progress", action="store_true", help="no console progress")
    p.add_argument("--plan", default=None, metavar="PLAN_JSON",
                   help="with train.resume: continue the run from its newest checkpoint on this plan (a plan.json "
                        "of `tessera plan`), as a new plan version; checked as `tessera upgrade` checks it")


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The ``job.<field>=value`` overrides the job flags given in ``args`` stand for (strings
    quoted, so a run named ``true`` or ``1e3`` stays that string), in :data:`JOB_FLAGS` order."""
    out = []
    for name, _flag in JOB_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)  # a YAML double-quoted string
        else:
            text = repr(value)
        out.append(f"job.{name}={text}")
    return out


def load_train_recipe(args: argparse.Namespace):
    """The recipe ``args`` name, with their overrides and then the job flags' overrides applied
    (a flag wins over an override of the same field).

    Raises:
        TesseraConfigError: as :func:`tessera.config.load.load_recipe`.
    """
    return load_cli_recipe(argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *job_overrides(args)]}))


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job ``args`` describe (``tessera train`` and ``python -m tessera.launch``): the
    pre-flight checks first (:mod:`tessera.train.job.preflight`, before Ray starts), then the job.

    Returns:
        0 on success, also when SIGTERM stopped the job at a step boundary (one line
        ``tessera train: stopped at step N (SIGTERM)`` after the summary).

    Raises:
        TesseraConfigError / ProgramError: bad input, found before Ray starts or in the driver or
            a worker (exit code 2).
        JobFailed: the workers failed more often than ``job.max_failures`` (exit code 1).
    """
    from tessera.train.job.preflight import local_cluster, preflight
    from tessera.config.job_rules import check_socket_ifname_here
    from tessera.train.job.ray_setup import check_address, connect
    from tessera.train.job.trainer import uses_gpu

    recipe = load_train_recipe(args)
    restart_plan = read_plan_file(args.plan) if getattr(args, "plan", None) else None
    if recipe.job.run_name:  # a clash is bad input too: refused before Ray starts
        from tessera.train.job.outputs import out_root
        from tessera.train.job.run import choose_run

        choose_run(recipe, out_root(recipe))
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:  # the recipe's checks, then the address before the slow one (a second or two); the cluster once connected
        preflight(recipe, None, before_build=lambda: check_address(address))
    else:
        preflight(recipe, local_cluster(args.num_cpus, gpu=uses_gpu(recipe)))
        check_socket_ifname_here(recipe.job, "this machine (the local cluster's workers run here)")
    owns_ray = connect(address, args.num_cpus, args.ray_temp_dir)
    try:
        result = run_job(recipe, progress=not args.no_progress, restart_plan=restart_plan)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    print_summary(result)
    if result.stopped is not None:  # SIGTERM (ray job stop, kill): the workers ended at a step boundary
        print(f"tessera train: stopped at step {result.steps} ({result.stopped})"
              + (f"; resume with train.resume=true job.run_name={result.run_name}" if result.checkpoint else ""),
              flush=True)
    return 0


def read_plan_file(path: str):
    """The Plan in the JSON file ``path`` (``tessera plan``'s ``plan.json`` or a ``Plan.to_dict``).

    Raises:
        TesseraConfigError: unreadable, or no plan in it (field ``--plan``).
    """
    from tessera.errors import UpgradeRefused
    from tessera.program.plan import Plan
    from tessera.train.upgrade.versions import plan_from_json

    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TesseraConfigError("--plan", path, f"cannot be read: {e.strerror}", "pass a plan.json of `tessera plan`")
    try:
        return Plan.from_dict(plan_from_json(text))
    except UpgradeRefused as e:
        raise TesseraConfigError("--plan", path, e.rule, e.fix) from None
    except (KeyError, TypeError, ValueError) as e:
        raise TesseraConfigError("--plan", path, f"is not a plan: {e}", "pass a plan.json of `tessera plan`") from None


def print_summary(result: JobResult) -> None:
    """The job's summary table (full paths, never elided)."""
    from rich.table import Table

    from tessera.cli.console import print_tables

    t = Table(title=f"tessera train: {result.run_name}", show_header=False, title_justify="left")
    for k, v in (("run directory", result.run_dir), ("metrics", result.metrics_path), ("steps", str(result.steps)),
                 ("final loss", f"{result.final_loss:.4f}" if result.final_loss is not None else "-"),
                 ("worker-group starts", str(result.attempts)), ("resumed from", result.resumed_from or "-"),
                 ("latest checkpoint", result.checkpoint or "-"), ("wall time", f"{result.wall_s:.1f} s")):
        t.add_row(k, v)
    print_tables(t)


def run(args: argparse.Namespace) -> int:
    """:func:`run_from_args` with its errors as one line on stderr: bad input exit code 2, a
    failed job exit code 1 (``tessera train`` and ``python -m tessera.launch``)."""
    try:
        return run_from_args(args)
    except (TesseraConfigError, ProgramError) as e:
        print(f"tessera train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"tessera train: error: {e}", file=sys.stderr)
        return 1

