"""What-if: stage boundaries between a decoder layer's mixer and its MoE (half-layer granularity).

Usage::

    python benchmarks/half_layer.py --json FILE [--budget S] [--start B0,B1,...] [KEY=VALUE ...]

Recipe ``recipes/qwen3-next-80b.yaml`` with the overrides (default: pp 8, vpp 2, ep 8, dp 8).
Each decoder layer's :class:`~tessera.cost.types.LayerCost` is split into two cost layers, its
mixer tasks and the rest (router, dispatch, expert, shared expert, combine), with in-layer
dependencies kept inside each half; a dependency across the halves becomes the layer-to-layer
one of :func:`tessera.sched.chunkdag.chunk_dag` (every entry task of a layer waits for the exits of
the previous one), which is the same dependency here, so a whole-layer partition simulates to the
same iteration on both. Static memory, W activations and data-parallel costs are split by the
halves' share of W time, activations evenly (no memory limit is applied to either search).
Then :func:`tessera.plan.refine.refine` (the planner's iteration search) runs on whole layers and on
half-layers from the same starts (``--start``, whole-layer bounds, and the baseline) with the same
budget, and the two iteration times are compared (ms). Record: ``whole_ms, half_ms,
baseline_ms, half_partition, inner_cuts`` (boundaries inside a layer), ``evaluations``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# tessera is imported inside the functions that use it: ``--help`` answers without it
if TYPE_CHECKING:
    from tessera.cost.types import LayerCost, ModelCosts
    from tessera.program.plan import Partition

DEFAULT = ("parallel.pp=8", "parallel.vpp=2", "parallel.ep=8", "parallel.dp=8")
# the best whole-layer plan the planner found for the default configuration (1538.3 ms)
START = "-1,1,3,5,8,11,14,17,21,25,29,33,37,41,44,47,49"


def split_layer(lc: LayerCost) -> list[LayerCost]:
    """A decoder layer as two cost layers: its mixer tasks, then the rest (module docstring)."""
    from tessera.cost.types import LayerCost, LayerDP, LayerMemory

    halves = ([i for i, t in enumerate(lc.tasks) if t.kind.value == "mixer"],
              [i for i, t in enumerate(lc.tasks) if t.kind.value != "mixer"])
    w_all = sum(t.ms for t in lc.tasks if t.phase.value == "W") or 1.0
    out = []
    for h, ids in enumerate(halves):
        new = {old: k for k, old in enumerate(ids)}
        tasks = tuple(replace(lc.tasks[i], deps=tuple(new[d] for d in lc.tasks[i].deps if d in new)) for i in ids)
        f = sum(lc.tasks[i].ms for i in ids if lc.tasks[i].phase.value == "W") / w_all
        m, d = lc.memory, lc.dp
        out.append(LayerCost(2 * lc.index + h, lc.code, tasks,
                             LayerMemory(m.params * f, m.grads * f, m.optimizer * f, m.activation / 2,
                                         m.w_activation * f, m.transient * f),
                             LayerDP(d.gather_ms * f, d.reduce_ms * f, d.optimizer_ms * f)))
    return out


def half_costs(costs: ModelCosts) -> ModelCosts:
    """``costs`` with every decoder layer split in two (:func:`split_layer`)."""
    layers = tuple(h for lc in costs.layers for h in split_layer(lc))
    return replace(costs, layers=layers, head=replace(costs.head, index=len(layers)))


def search(costs: ModelCosts, recipe, start: Partition, budget_s: float) -> tuple[float, float, Partition, int]:
    """(baseline ms, best ms, best partition, evaluations) of the iteration search from ``start``
    and the baseline."""
    from tessera.flow import iteration_evaluator
    from tessera.plan.baseline import baseline_plan
    from tessera.plan.overlap_graph import overlap_edges
    from tessera.plan.pair_cost import best_pair
    from tessera.plan.pair_scheduler import schedule_pair
    from tessera.plan.planner import pair_with_w
    from tessera.plan.refine import refine, with_scheduled_orders
    from tessera.program.templates import get_template

    p, pl = recipe.parallel, recipe.planner
    evaluate = iteration_evaluator(costs, None)
    base = baseline_plan(costs, pl.template, p.pp, p.vpp, p.num_microbatches, overlap=pl.overlap, split_w=pl.split_w)
    with_w = pair_with_w(pl.template, pl.split_w)
    edges = overlap_edges(pl.template, p.pp, p.vpp, p.num_microbatches) if pl.overlap else ()
    memo: dict = {}

    def choose(f, b):
        if (f, b) not in memo:
            memo[(f, b)] = best_pair(costs, f, b, with_w, schedule_pair)
        return memo[(f, b)]

    first = with_scheduled_orders(replace(base, name="tessera", partition=start), edges, with_w, choose)
    owner = get_template(pl.template).owner
    ranks = [owner(s, p.pp)[0] for s in range(base.partition.num_stages)]
    r = refine(costs, (first, replace(base, name="tessera")), evaluate, edges, with_w, schedule_pair,
               time_budget_s=budget_s, stage_rank=ranks)
    return r.start_ms[1], r.iteration_ms, r.plan.partition, r.evaluations


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the record to FILE")
    ap.add_argument("--budget", type=float, default=40.0, help="search seconds per granularity")
    ap.add_argument("--start", default=START, help="whole-layer bounds to start from")
    ap.add_argument("overrides", nargs="*", default=list(DEFAULT))
    args = ap.parse_args(argv)
    from tessera.config.load import load_recipe
    from tessera.flow import build_costs, resolve
    from tessera.program.plan import Partition

    recipe = load_recipe(str(ROOT / "recipes" / "qwen3-next-80b.yaml"), args.overrides)
    costs = build_costs(resolve(recipe))
    start = Partition(tuple(int(x) for x in args.start.split(",")))
    L = len(costs.layers)
    half_start = Partition(tuple(-1 if b == -1 else 2 * b for b in start.bounds[:-1]) + (2 * L + 1,))
    base_ms, whole_ms, whole_part, whole_n = search(costs, recipe, start, args.budget)
    _, half_ms, half_part, half_n = search(half_costs(costs), recipe, half_start, args.budget)
    rec = {"overrides": args.overrides, "budget_s": args.budget, "baseline_ms": base_ms, "whole_ms": whole_ms,
           "half_ms": half_ms, "whole_partition": list(whole_part.bounds), "half_partition": list(half_part.bounds),
           "inner_cuts": sum(1 for b in half_part.bounds[1:-1] if b % 2), "evaluations": [whole_n, half_n],
           "whole_ratio": base_ms / whole_ms, "half_ratio": base_ms / half_ms}
    print(json.dumps(rec, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
