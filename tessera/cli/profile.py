"""``tessera profile RECIPE``: time the recipe's tasks and overlapped pairs on its own Ray Train
workers and fill the profile cache (:mod:`tessera.train.job.profile`); ``--json FILE`` writes the
result. Afterwards ``planner.cost_source=profile`` plans on the measured times.

Connecting to Ray is as ``tessera train`` (``--address`` / ``RAY_ADDRESS``, or a local Ray this
command starts and stops). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tessera.cli.common import load_cli_recipe
from tessera.errors import ProgramError, TesseraConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML, e.g. recipes/tiny-qwen3-next.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. profile.reps=5")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS; none: a local Ray)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a local Ray (default: all cores)")
    p.add_argument("--ray-temp-dir", default=None, help="temp dir of a local Ray")
    p.add_argument("--check", action="store_true",
                   help="re-time one iteration and report each item's drift from the profile; above "
                        "profile.drift_threshold the profile is marked stale")
    p.add_argument("--json", metavar="FILE", default=None, help="write the profile result to FILE")
    p.add_argument("--no-progress", action="store_true", help="no console progress")


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tessera.cli.console import print_tables
    from tessera.train.job.preflight import local_cluster, preflight
    from tessera.train.job.profile import check_profile, run_profile
    from tessera.train.profile.setup import cached_result, prepare_profile
    from tessera.config.job_rules import check_socket_ifname_here
    from tessera.train.job.ray_setup import check_address, connect
    from tessera.train.job.trainer import uses_gpu

    t0 = time.perf_counter()
    try:
        recipe = load_cli_recipe(args)
        address = args.address or os.environ.get("RAY_ADDRESS")
        if address:  # the recipe's checks, then the address before the slow one (a second or two)
            preflight(recipe, None, before_build=lambda: check_address(address))
        else:
            preflight(recipe, local_cluster(args.num_cpus, gpu=uses_gpu(recipe)))
            check_socket_ifname_here(recipe.job, "this machine (the local cluster's workers run here)")
        setup = prepare_profile(recipe)
        if args.check and setup.missing == setup.needed:  # nothing to check against: no Ray
            print(f"tessera profile: error: no profile of this recipe in {setup.cache_path} to check; fix: run "
                  "`tessera profile` without --check first (same recipe and overrides)", file=sys.stderr)
            return 2
        if not args.check and not setup.missing:  # nothing to time: no Ray
            result = cached_result(setup, time.perf_counter() - t0)  # the command's own time (planning, lookup)
        else:
            owns = connect(address, args.num_cpus, args.ray_temp_dir)
            try:
                if args.check:
                    return _print_check(recipe, check_profile(recipe, progress=not args.no_progress, setup=setup), args)
                result = run_profile(recipe, progress=not args.no_progress, setup=setup)
            finally:
                if owns:
                    import ray

                    ray.shutdown()
    except (TesseraConfigError, ProgramError) as e:
        print(f"tessera profile: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    t = Table(title=f"tessera profile: {recipe.name}", show_header=False, title_justify="left")
    rows = [("cache", result.cache), ("profile", result.fingerprint[:16]),
            ("tasks", f"{result.tasks} tasks, {result.distinct_tasks} distinct items "
                      f"(dedup {result.tasks / max(1, result.distinct_tasks):.1f}x)"),
            ("pairs", f"{result.pairs_needed} candidate pairs ({result.candidate_pairs_distinct} distinct DAGs, "
                      f"{result.distinct_pairs} distinct pair items, {result.program_pairs} of them in the Program); "
                      f"{result.pairs_timed} timed co-executed (dedup {result.pair_dedup:.1f}x)"),
            ("overlap slowdown", "-" if result.overlap_slowdown is None
             else f"{result.overlap_slowdown:.2f} (fitted to the timed Program pairs)"),
            ("timed now", "none: every item was in the cache" if result.cache_hit
             else f"{result.timed_items} items, {result.iterations} timed iterations per pass (tasks, pairs)"),
            ("device", result.device or "(not re-timed: see the cache)"),
            ("not timed", ", ".join(result.missing[:8]) + (" ..." if len(result.missing) > 8 else "")
             if result.missing else "-"),
            ("wall time", f"{result.wall_s:.1f} s")]
    for kind, c in result.calibration.items():
        rows.append((f"analytic vs measured: {kind}",
                     f"mean err {c['mean_err']:.0%}, max {c['max_err']:.0%} ({c['n']} items); "
                     + " ".join(f"{ph} x{sc:.3g}" for ph, sc in c['scales'].items()) + "; "
                     f"fitted: mean err {c['mean_err_fit']:.0%}, max {c['max_err_fit']:.0%}"))
    for k, v in rows:
        t.add_row(k, v)
    print_tables(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0


def _print_check(recipe, rep, args) -> int:
    """The ``--check`` report: per-item drift, the median and the verdict; exit 2 without a profile."""
    from rich.table import Table

    from tessera.cli.console import print_tables

    if rep.missing_profile:
        print("tessera profile: error: no profile of this recipe to check; fix: run `tessera profile` without "
              "--check first (same recipe and overrides)", file=sys.stderr)
        return 2
    t = Table(title=f"tessera profile --check: {recipe.name}", title_justify="left")
    t.add_column("item")
    t.add_column("drift", justify="right")
    for k, v in sorted(rep.items.items(), key=lambda kv: -abs(kv[1])):
        t.add_row(k, f"{v:+.1%}")
    print_tables(t)
    verdict = "stale: marked in the cache; re-run `tessera profile`" if rep.stale else "fresh"
    print(f"median |drift| {rep.drift:.1%} over {len(rep.items)} items (profile.drift_threshold "
          f"{rep.threshold:.0%}): {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.to_dict(), f, indent=1)
    return 0
