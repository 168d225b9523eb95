"""The README's first command, measured: ``tessera train`` on its embedded default recipe.

Usage::

    python benchmarks/train.py --json FILE [--steps 50] [--rounds 1]

Runs ``python -m tessera train`` (the console script's entry point, as the README's first command
does after installing) on the shipped default recipe (``recipes/tiny-qwen3-next.yaml``: 8 layers,
4 gloo workers, pp=2 x dp=2, ep=2, vpp=2) for ``--steps`` steps, W&B off, outputs in a temporary
directory, and records per round:

* ``command_s``: the whole command's wall time (interpreter start, imports, pre-flight, a local
  Ray, the driver's planning, the job, Ray's shutdown);
* ``job_s``: the job's own wall time as its summary reports it (from pre-flight on the cluster to
  ``fit()`` returning);
* ``iterations_s``: the sum of the steps' ``iteration_ms`` (``metrics.jsonl``);
* ``loss_first`` / ``loss_last``: the loss of step 1 and of the last step; ``losses``: every step's;
* ``exposed_a2a_ms_median``, ``bubble_ratio_median``, ``mfu_median`` over the steps.

Across rounds the losses must be equal (the run is deterministic: ``losses_equal``). The machine
is shared: ``load_1min`` (``os.getloadavg``) before and after, and ``cpus``, are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # benchmarks/ holds scripts, not modules

ROOT = Path(__file__).resolve().parents[1]


def one_round(steps: int, out_dir: str, name: str) -> dict:
    """One ``tessera train`` run of ``steps`` steps; the round's fields (module docstring).

    Raises:
        RuntimeError: the command failed (its last output lines in the message).
    """
    cmd = [sys.executable, "-m", "tessera", "train", f"train.steps={steps}", f"logging.out_dir={out_dir}",
           "logging.wandb_mode=disabled", "--run-name", name, "--no-progress"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    command_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"tessera train exited {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "event" not in r]
    wall = re.search(r"wall time\W+([0-9.]+) s", p.stdout)
    med = lambda key: statistics.median(r[key] for r in rows) if all(r.get(key) is not None for r in rows) else None
    return {"command_s": command_s, "job_s": float(wall.group(1)) if wall else None,
            "iterations_s": sum(r["iteration_ms"] for r in rows) / 1e3, "steps": len(rows),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"], "losses": [r["loss"] for r in rows],
            "exposed_a2a_ms_median": med("exposed_a2a_ms"), "bubble_ratio_median": med("bubble_ratio"),
            "mfu_median": med("mfu")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Time the README's first command (tessera train on the default recipe).")
    ap.add_argument("--json", required=True, metavar="FILE", help="where to write the results")
    ap.add_argument("--steps", type=int, default=50, help="training steps per round (the README's run: 50)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of the command (losses must agree)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tsr-train-bench-") as out:
        for k in range(args.rounds):
            rounds.append(one_round(args.steps, out, f"bench-{k}"))
            print(f"round {k}: command {rounds[-1]['command_s']:.1f} s, job {rounds[-1]['job_s']} s, iterations "
                  f"{rounds[-1]['iterations_s']:.1f} s, loss {rounds[-1]['loss_first']:.2f} -> "
                  f"{rounds[-1]['loss_last']:.2f}", flush=True)
    out = {"recipe": "recipes/tiny-qwen3-next.yaml", "steps": args.steps, "rounds": rounds,
           "losses_equal": all(r["losses"] == rounds[0]["losses"] for r in rounds),
           "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0], "cpus": os.cpu_count()}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
