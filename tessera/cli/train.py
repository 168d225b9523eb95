"""``tessera train`` (and ``python -m tessera.launch``): arguments, pre-flight checks before Ray
starts, connecting to Ray (or starting a local Ray), the job (:func:`tessera.train.job.run_job`)
and its summary.

Flow: load the recipe -> pre-flight checks (:mod:`tessera.train.preflight`: value rules,
training rules, data, memory, and the resources of the local Ray about to start) -> with
``--address`` / ``RAY_ADDRESS`` the address check (:func:`tessera.train.ray_setup.check_address`)
-> connect or start Ray -> the job -> summary table. Bad input is one line on stderr and exit
code 2; a failed job one line and exit code 1; a local Ray this command started is shut down
either way.
"""

from __future__ import annotations

import argparse
import os
import sys

from tessera.cli.common import load_cli_recipe
from tessera.errors import ProgramError, TesseraConfigError
from tessera.train.driver import NAMESPACE
from tessera.train.job import JobFailed, JobResult, LaunchOptions, run_job


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m tessera.launch`` and ``tessera train``."""
    p.add_argument("recipe", metavar="RECIPE", nargs="?", default="default",
                   help="recipe YAML (e.g. recipes/tiny-qwen3-next.yaml); 'default' or omitted: the embedded default")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.steps=50")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS; none: start a local Ray for this job)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a local Ray (default: all cores)")
    p.add_argument("--ray-temp-dir", default=None, help="temp dir of a local Ray")
    p.add_argument("--run-name", default=None, help="run name (default: <recipe name>-<time>)")
    p.add_argument("--namespace", default=NAMESPACE, help=f"Ray namespace of the driver actor (default {NAMESPACE})")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts before failing (default 3)")
    p.add_argument("--cpus-per-worker", type=float, default=None,
                   help="CPUs per worker on CPU recipes (default: the cluster's CPUs shared evenly, at most 1)")
    p.add_argument("--detached-driver", action="store_true", help="the driver actor outlives the job")
    p.add_argument("--keep-driver", action="store_true", help="do not kill the driver actor at the end")
    p.add_argument("--no-progress", action="store_true", help="no console progress")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the job ``args`` describe (``tessera train`` and ``python -m tessera.launch``): the
    pre-flight checks first (:mod:`tessera.train.preflight`, before Ray starts), then the job.

    Returns:
        0 on success.

    Raises:
        TesseraConfigError / ProgramError: bad input, found before Ray starts or in the driver or
            a worker (exit code 2).
        JobFailed: the workers failed more often than ``--max-failures`` (exit code 1).
    """
    from tessera.train.preflight import local_cluster, preflight
    from tessera.train.ray_setup import check_address, connect
    from tessera.train.trainer import uses_gpu

    recipe = load_cli_recipe(args)
    if args.run_name:  # a clash is bad input too: refused before Ray starts
        from tessera.train.job import choose_run, out_root

        choose_run(recipe, out_root(recipe), args.run_name)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        preflight(recipe, None, args.cpus_per_worker)  # the cluster is checked once connected
        check_address(address)
    else:
        preflight(recipe, local_cluster(args.num_cpus, gpu=uses_gpu(recipe)), args.cpus_per_worker)
    owns_ray = connect(address, args.num_cpus, args.ray_temp_dir)
    try:
        opts = LaunchOptions(run_name=args.run_name, namespace=args.namespace, max_failures=args.max_failures,
                             cpus_per_worker=args.cpus_per_worker, detached_driver=args.detached_driver,
                             keep_driver=args.keep_driver, progress=not args.no_progress)
        result = run_job(recipe, opts)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    print_summary(result)
    return 0


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

