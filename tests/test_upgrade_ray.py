"""Hot plan upgrades in a real Ray Train job, checked against the same switches made offline.

On the run's shared Ray head (tests/conftest.py). The live job (the tiny recipe cut to 4 layers and 32-token
sequences, one replica: 2 gloo workers, pp=2, vpp=2; ``benchmarks/upgrade.py`` runs the whole
tiny recipe, pp=2 x dp=2, ep=2) runs 8 steps while a worker hook
(:mod:`tessera.testing.upgrades`) asks the driver, after step 1, for a plan with another template,
vpp and partition (interleaved-1f1b vpp=2 -> 1f1b vpp=1: layers move between the pipeline ranks), after step 3 at once to switch the bubble optimizer on and to roll
back (two requests pending together: both applied, in order, on consecutive boundaries), and after
step 5 for an invalid plan (a layer missing: refused while the job trains on).
The offline run stops before the first switch and resumes from that checkpoint on the plan it
switched to (the driver's restart with a new plan, as ``run_job(..., restart_plan=...)``), without
the bubble optimizer: the live run's switch of the optimizer on and its rollback move W tasks,
never a value, so they must leave the parameters bitwise equal to that plan alone. Its two legs run
the same worker loop on local gloo ranks (tests/local_job.py). Steps are consecutive, none lost or
repeated, data positions continue, and the parameters and optimizer state after the last step are
bitwise equal in both runs. A driver built again on the live run directory comes back on the plan
the job ran last.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tessera.config.load import load_recipe
from tessera.train.worker import checkpoint as ckpt

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.xdist_group("ray-upgrade")  # on the run's shared Ray head (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
SMALL = ("model.num_layers=4", "parallel.seq_length=32", "parallel.dp=1", "parallel.ep=1", "planner.overlap=false",
         "planner.split_w=false")
JOB = ("job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120", "logging.wandb_mode=disabled",
       "train.checkpoint_every=100")  # a checkpoint at the last step only
STEPS = 8
GLOBAL_BATCH = 1 * 4 * 2  # dp * num_microbatches * micro_batch_size


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _rows(records):
    return [r for r in records if "event" not in r]


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    from local_job import run_local_job
    from tessera.train.job.driver import Driver
    from tessera.train.job.run import run_job
    from tessera.train.worker.hooks import HookSpec

    out = tmp_path_factory.mktemp("upgrade")
    base = load_recipe(TINY, [*SMALL, *JOB, f"logging.out_dir={out}"])
    first = Driver(base.to_dict(), str(out / "probe"), "probe").plan_dict()["plan"]
    assert first["vpp"] == 2 and first["template"] == "interleaved-1f1b"
    # another template, vpp and partition: 1f1b, one stage per rank, the embedding and layer 0 on rank 0
    # in the template's order (the first plan's own rank orders, "schedule", are for vpp=2)
    plan_b = dict({k: v for k, v in first.items() if k != "schedule"}, template="1f1b", vpp=1,
                  partition={"bounds": [-1, 1, 5]}, pair_orders=[])
    broken = dict(first, partition={"bounds": [-1, 1, 2, 3, 4]}, pair_orders=[])  # the head is missing
    actions = [[1, "upgrade_plan", json.dumps(plan_b)], [3, "upgrade_dbo", True], [3, "rollback", None],
               [5, "upgrade_plan", json.dumps(broken)]]
    live = run_job(base.with_overrides([f"train.steps={STEPS}", "job.run_name=live"]), progress=False,
                   hooks=(HookSpec("tessera.testing.upgrades:requests_at", {"actions": actions}),))
    records = _records(live.metrics_path)
    switches = [r for r in records if r.get("event") == "plan_switch"]
    history = Driver(base.to_dict(), live.run_dir, "live").history
    # the same training offline: stop before the first switch, resume from that checkpoint on the
    # plan it switched to, without the bubble optimizer (it moves W tasks, never a value: the live
    # run's DBO switch and rollback to plan_b must leave the parameters bitwise as plan_b alone);
    # each leg is the same worker loop on local gloo ranks, the driver's restart logic in this
    # process (tests/local_job.py): Ray would prove nothing more here than the live job does
    at = switches[0]["step"] if switches else STEPS + 1
    off_dir = str(out / "offline")
    off = base.with_overrides(["job.run_name=offline", "dbo.enabled=false"])
    leg1 = off.with_overrides([f"train.steps={at - 1}"])
    rows = run_local_job(leg1, off_dir, Driver(leg1.to_dict(), off_dir, "offline", plan_dict=history.at(0).plan))
    leg2 = off.with_overrides([f"train.steps={STEPS}", "train.resume=true"])
    driver2 = Driver(leg2.to_dict(), off_dir, "offline", restart_plan=history.at(1).plan)
    assert driver2.recovered_from is not None and driver2.step == at - 1
    rows += run_local_job(leg2, off_dir, driver2)
    offline = {"rows": rows, "run_dir": off_dir}
    return {"live": live, "records": records, "switches": switches, "offline": offline, "plan_b": plan_b,
            "first": first, "history": history, "base": base}


def test_every_switch_lands_at_one_boundary_and_no_step_is_lost(runs):
    records, switches = runs["records"], runs["switches"]
    rows = _rows(records)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH * k for k in range(STEPS)]
    assert all(math.isfinite(r["loss"]) for r in rows)
    # three accepted versions (the plan, the DBO, the rollback), applied in order; the broken one refused
    assert [(s["from_version"], s["plan_version"]) for s in switches] == [(0, 1), (1, 2), (2, 3)]
    refused = [r for r in records if r.get("event") == "plan_refused"]
    assert len(refused) == 1 and refused[0]["field"] == "plan.partition" and "exactly once" in refused[0]["reason"]
    steps = [s["step"] for s in switches]
    assert steps == sorted(steps) and steps[0] >= 3 and steps[-1] <= STEPS  # announced 2 steps ahead
    assert steps[2] == steps[1] + 1  # the two requests of step 3: one boundary after the other
    for s in switches:  # every rank ran the new version from that step on (one version per step, in order)
        assert [r["plan_version"] for r in rows if r["step"] == s["step"]] == [s["plan_version"]]
    by_step = {r["step"]: r for r in rows}
    first = by_step[steps[0]]
    assert first["plan_switch_from"] == 0 and first["plan_switch_moved_bytes"] > 0 and first["plan_switch_s"] > 0
    assert by_step[steps[1]]["plan_switch_moved_bytes"] == 0  # the DBO switch moves no layer
    assert by_step[steps[1]]["dbo_slots"] is not None  # the optimizer ran from its switch on
    assert by_step[steps[2]]["dbo_slots"] is None and by_step[steps[2]]["plan_switch_moved_bytes"] == 0
    h = runs["history"]
    assert [v.source for v in h.versions] == ["initial", "plan", "dbo", "rollback"]
    assert [v.effective_step for v in h.versions[1:]] == steps and all(v.applied for v in h.versions)
    assert h.at(1).plan["partition"]["bounds"] == runs["plan_b"]["partition"]["bounds"]
    assert h.at(3).plan == h.at(1).plan and not h.at(3).dbo


def test_parameters_equal_the_same_switches_made_offline(runs):
    from local_job import assert_parts_equal

    live, offline = runs["live"], runs["offline"]
    live_rows = _rows(runs["records"])
    off_rows = offline["rows"]  # both legs' steps, in order
    steps = sorted({r["step"] for r in off_rows})
    assert steps == list(range(1, STEPS + 1))
    off_loss = {r["step"]: r["loss"] for r in off_rows}
    assert [r["loss"] for r in live_rows] == [off_loss[s] for s in range(1, STEPS + 1)]
    a, b = ckpt.latest_complete(live.run_dir), ckpt.latest_complete(offline["run_dir"])
    assert a.step == b.step == STEPS and a.data_position == b.data_position == STEPS * GLOBAL_BATCH
    assert_parts_equal(a.path, b.path, 2)


def test_a_restarted_driver_comes_back_on_the_last_plan(runs):
    from tessera.train.job.driver import Driver

    again = Driver(runs["base"].to_dict(), runs["live"].run_dir, "live")
    assert again.plan_version == 3 and again.plan.to_dict() == runs["history"].at(3).plan
    assert ckpt.load_history(ckpt.latest_complete(runs["live"].run_dir).path) == runs["history"]
