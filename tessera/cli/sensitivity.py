"""``tessera plan --sensitivity``: the chosen partition under perturbed costs
(:func:`tessera.flow.plan_sensitivity`, :mod:`tessera.plan.sensitivity`)."""

from __future__ import annotations

import argparse


def add_sensitivity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sensitivity", action="store_true",
                   help="re-plan on perturbed copies of the costs: how often the partition changes and how much "
                        "slower the chosen plan is than the best re-planned one")
    p.add_argument("--sensitivity-spread", type=float, default=0.05, metavar="X",
                   help="relative perturbation of every task's time, uniform in [-X, X] (default 0.05)")
    p.add_argument("--sensitivity-samples", type=int, default=10, metavar="N", help="perturbed copies (default 10)")
    p.add_argument("--sensitivity-seed", type=int, default=0, metavar="S", help="random seed (default 0)")


def sensitivity_table(res, costs, report, args):
    """The sensitivity of ``report.tessera`` as a rich Table (each copy is planned with a search
    of a fifth of the recipe's evaluation budget, :func:`tessera.flow.search_evals`, at least 1,
    capped at a fifth of ``planner.search_time_s``, at least 1 s)."""
    from rich.table import Table

    from tessera.errors import TesseraConfigError
    from tessera.flow import plan_sensitivity, search_evals

    if not 0 <= args.sensitivity_spread < 1:
        raise TesseraConfigError("--sensitivity-spread", args.sensitivity_spread, "must be in [0, 1)", "use e.g. 0.05")
    if args.sensitivity_samples < 1:
        raise TesseraConfigError("--sensitivity-samples", args.sensitivity_samples, "must be >= 1", "use e.g. 10")
    search = max(1.0, res.recipe.planner.search_time_s / 5)
    s = plan_sensitivity(res, costs, report.tessera, spread=args.sensitivity_spread, samples=args.sensitivity_samples,
                         seed=args.sensitivity_seed, search_time_s=search,
                         search_evals=max(1, search_evals(res, costs) // 5))
    t = Table(title=f"sensitivity: every task's time x (1 +- {s.spread:g}), {s.samples} copies, seed {s.seed}",
              show_header=False, title_justify="left")
    t.add_row("partition changed", f"{s.partition_changed_share:.0%} of copies")
    t.add_row("loss of the chosen plan", f"worst {s.worst_loss:.1%}, mean {s.mean_loss:.1%} (vs the plan re-made on "
                                         f"each copy, simulated iteration)")
    for sizes, n in s.partitions[:5]:
        t.add_row("re-planned partition", f"{' '.join(map(str, sizes))}  ({n}x)")
    if len(s.partitions) > 5:
        rest = s.partitions[5:]
        t.add_row("", f"and {len(rest)} more partition{'s' if len(rest) > 1 else ''} "
                      f"({sum(n for _, n in rest)} of {s.samples} copies)")
    return t
