"""The Ray Train job end to end on the tiny recipe (4 workers at 0.25 CPU, gloo, W&B offline).

One local Ray per module (own temp dir, 2 CPUs, shut down at the end; a hard timeout dumps the
stacks and exits if anything hangs). Tests: checkpoint completeness rules and run choice (no
Ray); a 20-step job through ``tessera.launch.run_job`` (metrics, checkpoints, W&B files) with the
driver actor queried and upgraded from a separate ``ray.init(address=..., namespace=...)`` client
process (and a driver built on its run directory recovers plan and step); and a job through
``tessera train`` (the code path of ``python -m tessera.launch``) where one worker kills itself
mid-run and the job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe
from tessera.train import checkpoint as ckpt

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
HARD_TIMEOUT_S = 900
GLOBAL_BATCH = 2 * 4 * 2  # dp * num_microbatches * micro_batch_size of the tiny recipe

CLIENT = r"""
import json, sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR", log_to_driver=False)
driver = ray.get_actor(sys.argv[3])
status = ray.get(driver.status.remote(history=3), timeout=60)
plan = ray.get(driver.plan_dict.remote(), timeout=60)["plan"]
version = ray.get(driver.request_upgrade.remote(plan), timeout=60)
print(json.dumps({"status": status, "upgrade_version": version}))
"""


# --------------------------------------------------------------------------- checkpoints (no Ray)


def _write(directory, rank, world=2, step=4, **kw):
    return ckpt.write_part(str(directory), rank=rank, world_size=world, layout=(2, 1, 1), step=step, plan_version=0,
                           data_position=step * 16, state={"w": torch.full((3,), float(rank))},
                           plan={"name": "p"} if rank == 0 else None, **kw)


def test_checkpoint_counts_only_when_every_part_is_complete(tmp_path):
    run = tmp_path / "run"
    done4, done8, partial12 = run / ckpt.dir_name(4), run / ckpt.dir_name(8), run / ckpt.dir_name(12)
    for r in range(2):
        _write(done4, r, step=4)
        _write(done8, r, step=8)
    _write(partial12, 0, step=12)  # rank 1 never finished
    info = ckpt.check_complete(str(done8))
    assert info is not None and (info.step, info.world_size, info.data_position, info.layout) == (8, 2, 128, (2, 1, 1))
    assert ckpt.check_complete(str(partial12)) is None
    assert ckpt.latest_complete(str(run)).step == 8
    assert torch.equal(ckpt.load_part(str(done8), 1)["state"]["w"], torch.ones(3))
    assert ckpt.load_plan(str(done8)) == ({"name": "p"}, 0, 8)
    # a part whose bytes differ from what its marker recorded does not count
    with open(done8 / ckpt.part_name(1), "ab") as f:
        f.write(b"x")
    assert ckpt.check_complete(str(done8)) is None
    assert ckpt.latest_complete(str(run)).step == 4
    removed = ckpt.cleanup_partial(str(run))
    assert sorted(os.path.basename(p) for p in removed) == [ckpt.dir_name(8), ckpt.dir_name(12)]
    assert sorted(os.listdir(run)) == [ckpt.dir_name(4)]


def test_choose_run_fresh_resume_and_clash(tmp_path):
    from tessera.errors import TesseraConfigError
    from tessera.launch import choose_run, parse_fault

    recipe = load_recipe(TINY)
    old, newer = tmp_path / "tiny-qwen3-next-a", tmp_path / "tiny-qwen3-next-b"
    _write(old / ckpt.dir_name(4), 0, world=1)
    newer.mkdir()  # newer, but without a complete checkpoint
    fresh = choose_run(recipe, str(tmp_path))
    assert fresh.startswith("tiny-qwen3-next-2") and not (tmp_path / fresh).exists()
    assert choose_run(recipe.with_overrides(["train.resume=true"]), str(tmp_path)) == "tiny-qwen3-next-a"
    with pytest.raises(TesseraConfigError, match="train.resume=true"):
        choose_run(recipe, str(tmp_path), "tiny-qwen3-next-a")
    assert parse_fault("1:7") == (1, 7) and parse_fault("") is None
    with pytest.raises(TesseraConfigError, match="RANK:STEP"):
        parse_fault("7")


def test_driver_hands_back_planning_errors(tmp_path):
    from tessera.train.driver import Driver

    recipe = load_recipe(TINY, ["hardware.inline={mem_gb: 0.0001}"])
    ready = Driver(recipe.to_dict(), str(tmp_path / "run"), "r").ready()
    kind, (field, _value, rule, fix) = ready["error"]
    assert kind == "config" and field == "memory" and "capacity" in rule and fix


# --------------------------------------------------------------------------- Ray jobs


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray (2 CPUs, own temp dir) for the module; always shut down."""
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True)
    temp = tempfile.mkdtemp(prefix="tsr-ray-", dir="/tmp")
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    ray.init(num_cpus=2, _temp_dir=temp, logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        faulthandler.cancel_dump_traceback_later()


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _steps(records):
    return [r for r in records if "event" not in r]


def _client_when_running(address: str, namespace: str, name: str, out: dict, min_step: int = 2) -> threading.Thread:
    """A thread that waits until the driver reports ``min_step``, then runs :data:`CLIENT` in a
    separate process and stores its JSON answer (or the error) in ``out``."""

    def run():
        deadline = time.monotonic() + HARD_TIMEOUT_S / 2
        try:
            while time.monotonic() < deadline:
                try:
                    actor = ray.get_actor(name, namespace=namespace)
                    if ray.get(actor.status.remote(history=0), timeout=30)["step"] >= min_step:
                        break
                except ValueError:  # not created yet
                    pass
                time.sleep(0.5)
            p = subprocess.run([sys.executable, "-c", CLIENT, address, namespace, name], capture_output=True,
                               text=True, timeout=180)
            out["rc"], out["stderr"] = p.returncode, p.stderr[-2000:]
            out["answer"] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
        except Exception as e:  # noqa: BLE001 - reported by the test's assertions
            out["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_job_trains_reports_and_answers_a_separate_client(ray_address, tmp_path):
    from tessera.launch import LaunchOptions, run_job
    from tessera.train.driver import NAMESPACE, driver_name

    steps = 20
    recipe = load_recipe(TINY, [f"train.steps={steps}", "train.checkpoint_every=10", f"logging.out_dir={tmp_path}"])
    client: dict = {}
    thread = _client_when_running(ray_address, NAMESPACE, driver_name("smoke"), client)
    result = run_job(recipe, LaunchOptions(run_name="smoke", cpus_per_worker=0.25, progress=False, max_failures=0,
                                           pg_timeout_s=120))
    thread.join(timeout=200)
    print(f"job wall {result.wall_s:.1f} s, planning {result.plan_s:.1f} s")

    records = _records(result.metrics_path)
    rows = _steps(records)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH * k for k in range(steps)]
    assert records[0]["event"] == "start" and records[0]["resume_step"] == 0
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.5
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    for r in rows:
        for key in ("mfu", "bubble_ratio", "bubble_fill_rate"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["mfu"] > 0 and r["tokens"] == GLOBAL_BATCH * 64 and r["tokens_per_s"] > 0
        assert "exposed_a2a_ms" in r
    assert result.steps == steps and result.attempts == 1 and result.resumed_from is None

    done = sorted(n for n in os.listdir(result.run_dir) if n.startswith(ckpt.PREFIX))
    assert done == [ckpt.dir_name(10), ckpt.dir_name(20)]
    info = ckpt.check_complete(os.path.join(result.run_dir, ckpt.dir_name(20)))
    assert info is not None and info.world_size == 4 and info.data_position == steps * GLOBAL_BATCH
    assert result.checkpoint == info.path
    assert list(Path(result.run_dir, "wandb").glob("offline-run-*")), "W&B offline run directory missing"

    # the separate client saw the running job and queued a plan upgrade (same plan, next version)
    assert client.get("answer"), client
    status = client["answer"]["status"]
    assert status["run"] == "smoke" and status["step"] >= 2 and status["plan_version"] == 0
    assert status["last"]["step"] >= 2 and status["partition"].startswith("S0[emb")
    assert client["answer"]["upgrade_version"] == 1
    upgrades = [r for r in records if r.get("event") == "plan_upgrade"]
    if upgrades:  # applied at one iteration boundary on every rank
        at = upgrades[0]["step"]
        assert [r["plan_version"] for r in rows] == [0] * (at - 1) + [1] * (steps - at + 1)
    else:
        assert status["step"] >= steps - 1, "the upgrade was queued early but never applied"

    # a restarted (or resumed) driver recovers plan, version and step from the newest checkpoint
    from tessera.train.driver import Driver

    again = Driver(recipe.to_dict(), result.run_dir, "smoke")
    assert again.recovered_from == info.path and again.step == steps
    assert again.plan_version == (1 if upgrades else 0)
    assert again.get_program(3)["program"]["rank"] == 1


def test_worker_killed_mid_run_resumes_from_last_checkpoint(ray_address, tmp_path, monkeypatch):
    from tessera.cli import main
    from tessera.launch import FAULT_ENV

    steps, every, kill_step = 8, 3, 5
    monkeypatch.setenv(FAULT_ENV, f"1:{kill_step}")
    rc = main(["train", TINY, f"train.steps={steps}", f"train.checkpoint_every={every}", f"logging.out_dir={tmp_path}",
               "--run-name", "fault", "--cpus-per-worker", "0.25", "--max-failures", "2", "--no-progress"])
    assert rc == 0
    run_dir = tmp_path / "fault"
    records = _records(run_dir / "metrics.jsonl")
    starts = [r for r in records if r.get("event") == "start"]
    assert [(s["attempt"], s["resume_step"]) for s in starts] == [(0, 0), (1, every)]
    rows = _steps(records)
    first = [r for r in rows if r["attempt"] == 0]
    second = [r for r in rows if r["attempt"] == 1]
    assert [r["step"] for r in first] == list(range(1, kill_step + 1))
    assert [r["step"] for r in second] == list(range(every + 1, steps + 1))
    # the replayed steps read the same data and, from the restored state, give the same loss
    for a, b in zip(first[every:], second):
        assert a["step"] == b["step"] and a["data_position"] == b["data_position"] == (a["step"] - 1) * GLOBAL_BATCH
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-4)
    assert ckpt.latest_complete(str(run_dir)).step == steps
