"""Pair scheduler vs the exact pair ILP over every distinct pair of the Qwen3-Next-80B plans.

Usage::

    python benchmarks/pair_gap.py --json FILE [--radius 1] [--with-w both|true|false]
        [--time-limit 60] [--workers 2] [--ilp-cache FILE.jsonl] [--resolve-not-optimal]
        [--configs ep8,ep32] [--limit N]

Configurations (``recipes/qwen3-next-80b.yaml``): Qwen3-Next-80B-A3B on H800, interleaved 1F1B,
pp 8, vpp 2, 16 microbatches of 1 x 4096 tokens, activation recompute, with ep 8 (dp 8) and
ep 32 (dp 32: EP is carved from dp * tp, so ep 32 needs dp >= 32; dp only changes the memory
columns, not the task times). For each: the serial-balanced partition
(:func:`tessera.plan.baseline.serial_balanced_partition`) -> :func:`stage_candidates` (``radius``)
-> :func:`overlap_edges` -> every candidate pair of every edge, deduplicated by layer content as
:func:`tessera.plan.overlap_graph.pair_costs` does. Each distinct pair DAG (``with_w`` False: W
runs as separate instructions, the recipes' ``split_w``; True: W tasks movable inside the pair)
is scheduled by :func:`schedule_pair` and solved by :func:`solve_pair_ilp` (SCIP, ``time_limit``
s per pair, in a pool of ``workers`` processes).

Writes one JSON object per (configuration, with_w) under ``"results"`` with the fields
``config, with_w, pairs_distinct, tasks_min, tasks_max, scheduler_vs_ilp_mean_gap,
scheduler_vs_ilp_max_gap, scheduler_optimal_pairs, fixed_order_vs_ilp_mean_gap,
fixed_order_vs_ilp_max_gap, scheduler_s_per_pair, scheduler_s_max, scheduler_cpu_s_per_pair,
ilp_s_per_pair, ilp_s_max, speedup, ilp_not_optimal, not_optimal_pairs, worst_pairs``. Gaps are relative (0.01 = 1%) and
computed over the pairs SCIP proved optimal; pairs it did not (time limit) are counted in
``ilp_not_optimal`` and listed in ``not_optimal_pairs`` with the scheduler's gap to SCIP's best
schedule and to its dual bound. ``speedup = ilp_s_per_pair / scheduler_s_per_pair`` (mean wall
seconds, each pair timed once in this process; the ILP's includes its default warm start, one
``schedule_pair`` call; the scheduler's is the median of 3 runs). Every scheduler result is
checked with :func:`check_schedule` and its order replayed with :func:`run_in_order` (same
makespan). On a shared machine wall times drift with the load, so ``paired_timing`` (``--timing-
sample N``) also times the scheduler and then the ILP (warm-started by it) back to back in the
pool workers on N evenly spaced pairs: mean wall and CPU seconds of each and their ratios.

``--ilp-cache`` keeps the ILP results (keyed by a hash of the DAG's task content) in a JSON-lines
file, so a rerun after a scheduler change solves only the pairs it has not seen; the ILP's
optimum does not depend on the scheduler version that warm-started it (its solve time and, on a
time-out, its best schedule do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from statistics import mean, median
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# tessera (and SCIP through it) is imported inside the functions that use it: ``--help`` answers without it
if TYPE_CHECKING:
    from tessera.cost.types import ModelCosts
    from tessera.sched.dag import TaskDAG, TaskSchedule

MODEL, HARDWARE, TEMPLATE = "qwen3-next-80b-a3b", "h800", "interleaved-1f1b"
PP, VPP, MICROBATCHES, MBS, SEQ = 8, 2, 16, 1, 4096
CONFIGS = {"ep8": 8, "ep32": 32}


def config_costs(ep: int) -> ModelCosts:
    """Analytic costs (ms) of the Qwen3-Next-80B-A3B recipe with expert parallelism ``ep``."""
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    par = ParallelConfig(pp=PP, vpp=VPP, ep=ep, dp=max(8, ep), num_microbatches=MICROBATCHES,
                         micro_batch_size=MBS, seq_length=SEQ)
    return analytic_costs(get_model(MODEL), get_hardware(HARDWARE), par, activation_recompute=True)


def distinct_pairs(costs: ModelCosts, radius: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(F range, B range) of one representative per distinct pair content, in first-seen order
    (:func:`tessera.plan.overlap_graph.distinct_pairs`: the enumeration and content key of
    :func:`tessera.plan.overlap_graph.pair_costs`)."""
    from tessera.plan.baseline import serial_balanced_partition
    from tessera.plan.candidates import stage_candidates
    from tessera.plan.overlap_graph import distinct_pairs as graph_distinct_pairs
    from tessera.plan.overlap_graph import overlap_edges

    base = serial_balanced_partition(costs, PP * VPP)
    cands = stage_candidates(base, radius, len(costs.layers))
    return graph_distinct_pairs(costs, cands, overlap_edges(TEMPLATE, PP, VPP, MICROBATCHES))


def dag_key(dag: TaskDAG) -> str:
    """Content hash of a DAG (names, resources, durations, dependencies, movability, deadlines)."""
    text = repr([(t.name, t.resource.value, repr(t.ms), t.deps, t.movable, t.deadline_ms) for t in dag.tasks])
    return hashlib.sha1(text.encode()).hexdigest()


def _solve(job: tuple[str, TaskDAG, float]) -> dict:
    """Pool worker: the ILP of one DAG; a JSON-able record."""
    from tessera.plan.pair_ilp import solve_pair_ilp
    from tessera.plan.pair_scheduler import check_schedule

    key, dag, limit = job
    r = solve_pair_ilp(dag, time_limit_s=limit)
    check_schedule(dag, r.schedule)
    return {"key": key, "tasks": len(dag.tasks), "ms": r.schedule.makespan, "optimal": r.optimal, "gap": r.gap,
            "lower_bound_ms": r.lower_bound_ms, "solve_s": r.solve_s, "binaries": r.num_binaries}


def timed_schedule(dag: TaskDAG, repeat: int = 3) -> tuple[TaskSchedule, float, float]:
    """``schedule_pair(dag)`` and its median wall and CPU seconds over ``repeat`` runs (the
    median drops the stalls a shared machine adds to a few-millisecond call)."""
    from tessera.plan.pair_scheduler import schedule_pair

    walls, cpus = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        s = schedule_pair(dag)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return s, median(walls), median(cpus)


def _paired(job: tuple[str, TaskDAG, float]) -> dict:
    """Pool worker: scheduler and ILP timed back to back on one DAG, wall and CPU seconds (the
    ILP warm-started by the scheduler's result, so its time excludes the scheduler)."""
    from tessera.plan.pair_ilp import solve_pair_ilp

    key, dag, limit = job
    s, wall, cpu = timed_schedule(dag)
    t0, c0 = time.perf_counter(), time.process_time()
    r = solve_pair_ilp(dag, time_limit_s=limit, warm_start=s)
    return {"key": key, "scheduler_wall_s": wall, "scheduler_cpu_s": cpu, "ilp_wall_s": time.perf_counter() - t0,
            "ilp_cpu_s": time.process_time() - c0, "ilp_optimal": r.optimal}


def paired_timing(dags: list[tuple[str, TaskDAG]], size: int, limit: float, workers: int) -> dict:
    """Scheduler vs ILP time on an evenly spaced sample of ``size`` DAGs, each timed in one pool
    worker under the same load: means and the ratios of the means."""
    step = max(1, len(dags) // size)
    jobs = [(k, d, limit) for k, d in dags[::step][:size]]
    with Pool(workers) as pool:
        recs = pool.map(_paired, jobs, chunksize=1)
    out = {"pairs": len(recs), "ilp_optimal": sum(r["ilp_optimal"] for r in recs)}
    for f in ("scheduler_wall_s", "scheduler_cpu_s", "ilp_wall_s", "ilp_cpu_s"):
        out[f] = mean(r[f] for r in recs)
    out["speedup_wall"] = out["ilp_wall_s"] / out["scheduler_wall_s"]
    out["speedup_cpu"] = out["ilp_cpu_s"] / out["scheduler_cpu_s"]
    return out


def _load_cache(path: Path | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if path is not None and path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["key"]] = rec
    return out


def solve_all(dags: dict[str, TaskDAG], limit: float, workers: int, cache_path: Path | None,
              resolve: bool = False) -> dict[str, dict]:
    """ILP record of every DAG (cached ones reused; new ones appended to the cache as they come;
    the last record of a key wins). ``resolve``: solve again the cached ones SCIP did not prove
    optimal (warm-started by the current scheduler)."""
    cache = _load_cache(cache_path)
    todo = [(k, d, limit) for k, d in dags.items() if k not in cache or (resolve and not cache[k]["optimal"])]
    todo.sort(key=lambda j: len(j[1].tasks))
    if todo:
        sink = cache_path.open("a") if cache_path is not None else None
        with Pool(workers) as pool:
            for n, rec in enumerate(pool.imap_unordered(_solve, todo), 1):
                cache[rec["key"]] = rec
                if sink is not None:
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                if n % 50 == 0:
                    print(f"  ILP {n}/{len(todo)}", file=sys.stderr, flush=True)
        if sink is not None:
            sink.close()
    return cache


def evaluate(name: str, with_w: bool, dags: list[tuple[tuple, TaskDAG, str]], ilp: dict[str, dict]) -> dict:
    """Scheduler, fixed order and ILP numbers of one (configuration, with_w)."""
    from tessera.plan.pair_scheduler import check_schedule
    from tessera.sched.chunkdag import fixed_order
    from tessera.sched.dag import run_in_order

    rows, cpu = [], []
    for ranges, dag, key in dags:
        s, dt, ct = timed_schedule(dag)
        cpu.append(ct)
        check_schedule(dag, s)  # a real schedule: never below the optimum
        assert abs(run_in_order(dag, s.order_dict()).makespan - s.makespan) <= 1e-9  # its order replays exactly
        rows.append((ranges, dag, s.makespan, dt, run_in_order(dag, fixed_order(dag)).makespan, ilp[key]))
    opt = [r for r in rows if r[5]["optimal"]]
    gaps = [r[2] / r[5]["ms"] - 1.0 for r in opt]
    fixed = [r[4] / r[5]["ms"] - 1.0 for r in opt]
    worst = sorted(((g, r) for g, r in zip(gaps, opt)), key=lambda x: -x[0])[:5]
    sched_s = mean(r[3] for r in rows)
    ilp_s = mean(r[5]["solve_s"] for r in rows)
    return {
        "config": name, "with_w": with_w, "pairs_distinct": len(rows),
        "tasks_min": min(len(r[1].tasks) for r in rows), "tasks_max": max(len(r[1].tasks) for r in rows),
        "scheduler_vs_ilp_mean_gap": mean(gaps) if gaps else None,
        "scheduler_vs_ilp_max_gap": max(gaps) if gaps else None,
        "scheduler_optimal_pairs": sum(1 for g in gaps if g <= 1e-9),
        "fixed_order_vs_ilp_mean_gap": mean(fixed) if fixed else None,
        "fixed_order_vs_ilp_max_gap": max(fixed) if fixed else None,
        "scheduler_s_per_pair": sched_s, "scheduler_s_max": max(r[3] for r in rows),
        "scheduler_cpu_s_per_pair": mean(cpu),
        "ilp_s_per_pair": ilp_s, "ilp_s_max": max(r[5]["solve_s"] for r in rows),
        "speedup": ilp_s / sched_s,
        "ilp_not_optimal": len(rows) - len(opt),
        "not_optimal_pairs": [{"f": r[0][0], "b": r[0][1], "tasks": len(r[1].tasks), "scheduler_ms": r[2],
                               "ilp_best_ms": r[5]["ms"], "ilp_lower_bound_ms": r[5]["lower_bound_ms"],
                               "gap_to_ilp_best": r[2] / r[5]["ms"] - 1.0,
                               "gap_to_lower_bound": r[2] / max(r[5]["lower_bound_ms"], 1e-12) - 1.0}
                              for r in rows if not r[5]["optimal"]],
        "worst_pairs": [{"f": r[0][0], "b": r[0][1], "tasks": len(r[1].tasks), "gap": g, "scheduler_ms": r[2],
                         "ilp_ms": r[5]["ms"]} for g, r in worst],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="output file")
    ap.add_argument("--radius", type=int, default=1)
    ap.add_argument("--with-w", choices=("false", "true", "both"), default="both")
    ap.add_argument("--time-limit", type=float, default=60.0, help="SCIP limit per pair, s")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ilp-cache", default=None, help="JSON-lines cache of ILP results")
    ap.add_argument("--configs", default="ep8,ep32")
    ap.add_argument("--limit", type=int, default=0, help="first N distinct pairs per configuration (0: all)")
    ap.add_argument("--timing-sample", type=int, default=80,
                    help="pairs timed scheduler-then-ILP in the pool under the same load (0: off)")
    ap.add_argument("--resolve-not-optimal", action="store_true",
                    help="solve cached pairs SCIP did not prove optimal again (current scheduler as warm start)")
    args = ap.parse_args(argv)
    from tessera.sched.chunkdag import pair_dag

    flags = {"false": (False,), "true": (True,), "both": (False, True)}[args.with_w]
    sets = []
    for name in args.configs.split(","):
        costs = config_costs(CONFIGS[name])
        pairs = distinct_pairs(costs, args.radius)
        if args.limit:
            pairs = pairs[:args.limit]
        for w in flags:
            dags = [(p, d, dag_key(d)) for p in pairs for d in (pair_dag(costs, p[0], p[1], w),)]
            sets.append((f"{MODEL}/{HARDWARE}/{name}", w, dags))
    all_dags = {k: d for _, _, dags in sets for _, d, k in dags}
    print(f"{len(all_dags)} distinct DAGs", file=sys.stderr, flush=True)
    cache = Path(args.ilp_cache) if args.ilp_cache else None
    ilp = solve_all(all_dags, args.time_limit, args.workers, cache, args.resolve_not_optimal)
    results = [evaluate(name, w, dags, ilp) for name, w, dags in sets]
    out = {"radius": args.radius, "time_limit_s": args.time_limit, "results": results}
    if args.timing_sample > 0:
        ordered = [(k, d) for _, _, dags in sets for _, d, k in dags]
        out["paired_timing"] = paired_timing(ordered, args.timing_sample, args.time_limit, args.workers)
    Path(args.json).write_text(json.dumps(out, indent=1))
    for r in results:
        pct = {k: 100 * (r[k] or 0.0) for k in ("scheduler_vs_ilp_mean_gap", "scheduler_vs_ilp_max_gap",
                                                 "fixed_order_vs_ilp_mean_gap")}
        print(f"{r['config']} with_w={r['with_w']}: {r['pairs_distinct']} pairs, gap mean "
              f"{pct['scheduler_vs_ilp_mean_gap']:.3f}% max {pct['scheduler_vs_ilp_max_gap']:.3f}%, fixed order "
              f"{pct['fixed_order_vs_ilp_mean_gap']:.2f}%, scheduler {1e3 * r['scheduler_s_per_pair']:.2f} ms, "
              f"ILP {r['ilp_s_per_pair']:.2f} s, x{r['speedup']:.0f}, not proven optimal {r['ilp_not_optimal']}")
    if "paired_timing" in out:
        t = out["paired_timing"]
        print(f"paired sample of {t['pairs']}: scheduler {1e3 * t['scheduler_wall_s']:.2f} ms wall / "
              f"{1e3 * t['scheduler_cpu_s']:.2f} ms CPU, ILP {t['ilp_wall_s']:.2f} s / {t['ilp_cpu_s']:.2f} s, "
              f"speedup x{t['speedup_wall']:.0f} wall, x{t['speedup_cpu']:.0f} CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
