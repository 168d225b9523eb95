"""What a hot plan upgrade that moves layers costs, against stopping and resuming from a checkpoint.

Usage::

    python benchmarks/upgrade.py --json FILE [--steps 8] [--at 2] [--rounds 1] [--num-cpus 4]

Case: the shipped tiny recipe (``recipes/tiny-qwen3-next.yaml``: 8 layers, 4 gloo workers, pp=2
x dp=2, ep=2, vpp=2, 4 microbatches of 2 x 64 tokens) on a local Ray, W&B off. The new plan is
the driver's first plan with the stage bounds moved by one layer (so layers, the embedding or the
head change pipeline rank).

* **Live upgrade** (``--rounds`` times per reshard method, ``job.reshard_method`` ``p2p`` and
  ``dcp`` alternating): a job of ``--steps`` iterations; after step ``--at`` a worker hook asks the
  driver for the new plan (:mod:`tessera.testing.upgrades`), which the ranks switch to at the
  boundary announced ``job.upgrade_lead_steps`` ahead. ``upgrade_pause_s``: the wall time between
  the switching iteration's metric record and the one before it (rank 0's ``time`` field: the
  switch and the iteration) minus the median of that interval over the other iterations after
  step 2; ``moved_bytes``: parameters and optimizer state the ranks sent each other
  (``plan_switch_moved_bytes``); ``switch_s``: the slowest rank's switch time (``plan_switch_s``).
* **Restart from a checkpoint** (the alternative): a job of ``--at`` steps that checkpoints at its
  end, then the same run resumed on the new plan for one more step (``run_job(...,
  restart_plan=...)``). ``restart_from_checkpoint_s``: the resumed job's wall time (driver, worker
  group, restore under the new partition, one iteration) minus one median iteration, plus the
  first job's time from its last metric record to its return (the stop).
* ``pause_ratio = upgrade_pause_s / restart_from_checkpoint_s`` with the faster method's pause;
  ``default_method``: that method. Target: ``pause_ratio <= 0.2``.

The machine is shared: ``load_1min`` (``os.getloadavg``) is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # benchmarks/ holds scripts, not modules

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
JOB = ("job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120", "logging.wandb_mode=disabled")


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _moved_plan(plan: dict) -> dict:
    b = list(plan["partition"]["bounds"])
    inner = [x + (1 if i % 2 else -1) for i, x in enumerate(b[1:-1])]  # every inner bound one layer over
    bounds = [b[0]] + inner + [b[-1]]
    if any(x >= y for x, y in zip(bounds, bounds[1:])):
        bounds = [b[0]] + [x + 1 for x in b[1:-1]] + [b[-1]]
    return dict(plan, partition={"bounds": bounds}, pair_orders=[])


def live_upgrade(base, out: Path, name: str, method: str, plan_b: dict, steps: int, at: int) -> dict:
    from tessera.train.worker.hooks import HookSpec
    from tessera.train.job.run import run_job

    recipe = base.with_overrides([f"train.steps={steps}", f"job.run_name={name}", f"job.reshard_method={method}",
                                  "train.checkpoint_every=0"])
    hook = HookSpec("tessera.testing.upgrades:requests_at", {"actions": [[at, "upgrade_plan", json.dumps(plan_b)]]})
    result = run_job(recipe, progress=False, hooks=(hook,))
    records = _records(result.metrics_path)
    rows = [r for r in records if "event" not in r]
    switch = [r for r in rows if r.get("plan_switch_from") is not None]
    if not switch:
        raise RuntimeError(f"{name}: the upgrade did not take effect within {steps} steps")
    s = switch[0]["step"]
    t = {r["step"]: r["time"] for r in rows}
    gaps = [t[k] - t[k - 1] for k in range(3, steps + 1) if k != s and k - 1 in t]
    return {"method": method, "switch_step": s, "upgrade_pause_s": (t[s] - t[s - 1]) - statistics.median(gaps),
            "normal_step_s": statistics.median(gaps), "moved_bytes": switch[0]["plan_switch_moved_bytes"],
            "switch_s": switch[0]["plan_switch_s"],
            "losses": [r["loss"] for r in rows]}


def restart(base, out: Path, name: str, plan_b: dict, at: int) -> dict:
    from tessera.program.plan import Plan
    from tessera.train.job.run import run_job

    first = run_job(base.with_overrides([f"train.steps={at}", f"job.run_name={name}", "train.checkpoint_every=100"]),
                    progress=False)
    ended = time.time()
    rows = [r for r in _records(first.metrics_path) if "event" not in r]
    stop_s = ended - rows[-1]["time"]
    iteration_s = statistics.median(r["iteration_ms"] for r in rows[1:]) / 1e3
    resumed = run_job(base.with_overrides([f"train.steps={at + 1}", f"job.run_name={name}", "train.resume=true",
                                           "train.checkpoint_every=100"]), progress=False,
                      restart_plan=Plan.from_dict(plan_b))
    return {"restart_from_checkpoint_s": resumed.wall_s - iteration_s + stop_s, "resume_wall_s": resumed.wall_s,
            "stop_s": stop_s, "iteration_s": iteration_s}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--at", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-cpus", type=float, default=4)
    args = ap.parse_args(argv)
    import ray

    from tessera.config.load import load_recipe
    from tessera.train.job.driver import Driver

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    load_before = os.getloadavg()[0]
    out = Path(tempfile.mkdtemp(prefix="tsr-upgrade-"))
    base = load_recipe(TINY, [*JOB, f"logging.out_dir={out}"])
    plan_a = Driver(base.to_dict(), str(out / "probe"), "probe").plan_dict()["plan"]
    plan_b = _moved_plan(plan_a)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, logging_level="ERROR")
    try:
        lives = []
        for k in range(args.rounds):
            for method in (("p2p", "dcp") if k % 2 == 0 else ("dcp", "p2p")):
                lives.append(live_upgrade(base, out, f"live-{method}-{k}", method, plan_b, args.steps, args.at))
                print(f"live {method}: pause {lives[-1]['upgrade_pause_s']:.3f} s, moved "
                      f"{lives[-1]['moved_bytes']} B", flush=True)
        rs = restart(base, out, "restart", plan_b, args.at)
        print(f"restart: {rs['restart_from_checkpoint_s']:.2f} s", flush=True)
    finally:
        ray.shutdown()
    by = {m: statistics.median(x["upgrade_pause_s"] for x in lives if x["method"] == m) for m in ("p2p", "dcp")}
    best = min(by, key=by.get)
    doc = {"case": "tiny-qwen3-next pp2 dp2 ep2 vpp2, 4 gloo workers", "plan_a_bounds": plan_a["partition"]["bounds"],
           "plan_b_bounds": plan_b["partition"]["bounds"], "steps": args.steps, "request_after_step": args.at,
           "upgrade_pause_s_p2p": by["p2p"], "upgrade_pause_s_dcp": by["dcp"], "default_method": best,
           "upgrade_pause_s": by[best], "moved_bytes": lives[0]["moved_bytes"],
           "switch_s": {m: [x["switch_s"] for x in lives if x["method"] == m] for m in ("p2p", "dcp")},
           "losses_equal_across_methods": len({tuple(x["losses"]) for x in lives}) == 1,
           **rs, "pause_ratio": by[best] / rs["restart_from_checkpoint_s"], "rounds": lives,
           "load_1min": [load_before, os.getloadavg()[0]]}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
