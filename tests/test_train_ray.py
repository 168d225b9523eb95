"""The Ray Train job end to end on the tiny recipe (gloo workers, W&B offline or off).

On the run's shared Ray head (tests/conftest.py: ``ray start --head``, as on a cluster; this
process joins it; other modules' jobs may run on it at the same time). Tests: checkpoint
completeness rules and run choice (no Ray); a job submitted with ``ray job submit --working-dir .``
and stopped with ``ray job stop`` (a clean stop, metrics file, and ``tessera report`` on it); bad input under ``ray job submit`` and without ``RAY_AUTH_MODE``; a worker failure
beyond ``--max-failures``; one job through ``tessera.train.job.run.run_job`` (metrics, checkpoints,
W&B files) whose driver actor a separate client process queries and upgrades, and which is then
killed mid-run (Ray restarts it; it recovers plan version and step from the checkpoint); a job
through ``tessera train`` where one worker is killed while writing its checkpoint part and later
another kills itself after a step (each time the job resumes from the last complete checkpoint);
``tessera profile`` on the workers filling the profile cache, and the driver planning on it.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.train.worker import checkpoint as ckpt

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.xdist_group("ray-train")  # on the run's shared Ray head (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
HARD_TIMEOUT_S = 1200  # a thread's wait for a running job: a hang guard only
GLOBAL_BATCH = 2 * 4 * 2  # dp * num_microbatches * micro_batch_size of the tiny recipe
SMALL = ("parallel.dp=1", "parallel.ep=1", "model.num_layers=4", "parallel.seq_length=32")
"""One replica of the tiny recipe cut to 4 layers and 32-token sequences (2 workers, quick to plan):
where the full recipe proves nothing more than the launcher's or the restart's path."""
GLOBAL_BATCH_1 = 1 * 4 * 2  # the same with dp=1
RAY_BIN = str(Path(sys.executable).with_name("ray"))
JOB = ("job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120")  # the in-process jobs' options

CLIENT = r"""
import json, sys, time, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[5])
while True:  # started with the job: wait until its driver has reported step MIN_STEP
    try:
        driver = ray.get_actor(sys.argv[3])
        if ray.get(driver.status.remote(history=0), timeout=30)["step"] >= int(sys.argv[4]):
            break
    except (ValueError, ray.exceptions.GetTimeoutError):  # not created yet, or slow to answer: ask again
        pass
    if time.monotonic() > deadline:
        sys.exit(f"the driver {sys.argv[3]} did not report step {sys.argv[4]} within {sys.argv[5]} s")
    time.sleep(0.2)
status = ray.get(driver.status.remote(history=3), timeout=60)
plan = ray.get(driver.plan_dict.remote(), timeout=60)["plan"]
# the same partition without the pair scheduler's orders (other Programs, no layer moves): a new version
version = ray.get(driver.upgrade_plan.remote(json.dumps(dict(plan, pair_orders=[]))), timeout=60)["version"]
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
    from tessera.testing.faults import parse_fault
    from tessera.train.job.run import choose_run

    recipe = load_recipe(TINY)
    old, newer = tmp_path / "tiny-qwen3-next-a", tmp_path / "tiny-qwen3-next-b"
    _write(old / ckpt.dir_name(4), 0, world=1)
    newer.mkdir()  # newer, but without a complete checkpoint
    fresh = choose_run(recipe, str(tmp_path))
    assert fresh.startswith("tiny-qwen3-next-2") and not (tmp_path / fresh).exists()
    assert choose_run(recipe.with_overrides(["train.resume=true"]), str(tmp_path)) == "tiny-qwen3-next-a"
    with pytest.raises(TesseraConfigError, match="train.resume=true"):
        choose_run(recipe.with_overrides(["job.run_name=tiny-qwen3-next-a"]), str(tmp_path))
    assert parse_fault("1:7") == (1, 7) and parse_fault("") is None
    with pytest.raises(TesseraConfigError, match="RANK:STEP"):
        parse_fault("7")


def test_driver_hands_back_planning_errors(ray_head, tmp_path):
    """The planning error as Ray carries it; started as the job's actor, the driver is gone when
    :func:`start_driver` raises it (as on every failure to start)."""
    from tessera.train.job.driver import NAMESPACE, Driver, driver_name, start_driver

    recipe = load_recipe(TINY, ["hardware.inline={mem_gb: 0.0001}"])
    with pytest.raises(TesseraConfigError, match="rank 0 needs"):
        start_driver(recipe, str(tmp_path / "actor-run"), "plan-fails")
    with pytest.raises(ValueError):  # no actor of that name left behind
        ray.get_actor(driver_name("plan-fails"), namespace=NAMESPACE)
    ready = Driver(recipe.to_dict(), str(tmp_path / "run"), "r").ready()
    err = pickle.loads(pickle.dumps(ready["error"]))  # as Ray carries it to the launcher
    assert isinstance(err, TesseraConfigError) and str(err) == str(ready["error"])
    field, _value, rule, fix = err.field, err.value, err.rule, err.fix
    assert field == "parallel.pp" and _value == recipe.parallel.pp
    assert "rank 0 needs" in rule and "capacity 0.0 GB" in rule and "planner.memory_margin" in rule
    assert "raise parallel.pp" in fix and "planner.candidate_radius" in fix


# --------------------------------------------------------------------------- Ray jobs


@pytest.fixture(scope="module")
def ray_head(ray_cluster):
    """The run's shared Ray head (tests/conftest.py): ``address``, ``dashboard``, ``temp``, ``cli_env``."""
    return ray_cluster


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _steps(records):
    return [r for r in records if "event" not in r]


def _client_when_running(address: str, namespace: str, name: str, out: dict, min_step: int = 2,
                         done: Path | None = None) -> threading.Thread:
    """A thread that runs :data:`CLIENT` in a separate process at once (it connects while the job
    starts, waits until the driver reports ``min_step``, then asks) and stores its JSON answer (or
    the error) in ``out``; at the end, whatever happened, it creates the file ``done`` (where
    given: the job's gate after ``min_step``)."""

    def run():
        wait_s = HARD_TIMEOUT_S / 2
        try:
            p = subprocess.run([sys.executable, "-c", CLIENT, address, namespace, name, str(min_step), str(wait_s)],
                               capture_output=True, text=True, timeout=wait_s + 300)
            out["rc"], out["stderr"] = p.returncode, p.stderr[-2000:]
            out["stdout"] = p.stdout[-2000:]
            answer = [ln for ln in p.stdout.splitlines() if ln.startswith('{"status"')]  # Ray may print lines too
            out["answer"] = json.loads(answer[-1]) if p.returncode == 0 and answer else None
        except Exception as e:  # noqa: BLE001 - reported by the test's assertions
            out["error"] = repr(e)
        finally:
            if done is not None:
                done.touch()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _check_iteration_fields(rows, global_batch: int = GLOBAL_BATCH, seq: int = 64, ep: bool = True) -> None:
    for r in rows:
        for key in ("mfu", "bubble_ratio"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        # the compiler emits no slot annotations yet (no bubble optimizer): nothing can fill one;
        # the rate's computation is tested on constructed timings in the metrics tests
        assert r["bubble_fill_rate"] == 0.0, r
        assert r["mfu"] > 0 and r["tokens"] == global_batch * seq and r["tokens_per_s"] > 0
        assert r["iteration_ms"] > 0 and math.isfinite(r["loss"])
        if ep:  # the largest wait of any rank on its expert-parallel all-to-alls
            assert 0 <= r["exposed_a2a_ms"] < r["iteration_ms"], r
        else:  # no all-to-all to wait for
            assert r["exposed_a2a_ms"] is None, r


def _submit(ray_head, sid: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """``ray job submit ... -- python -m tessera.launch ARGS``; returns the submit process and the
    job's final status text (a job left running, e.g. on a timeout, is stopped)."""
    env = ray_head.cli_env  # with RAY_AUTH_MODE=token
    submit = [RAY_BIN, "job", "submit", "--address", ray_head.dashboard, "--submission-id", sid, "--working-dir", ".",
              "--", "python", "-m", "tessera.launch", *args]
    ray_head.wait_for_job_agent()
    try:
        job = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    finally:
        status = subprocess.run([RAY_BIN, "job", "status", "--address", ray_head.dashboard, sid], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        if "RUNNING" in status.stdout + status.stderr or "PENDING" in status.stdout + status.stderr:
            subprocess.run([RAY_BIN, "job", "stop", "--address", ray_head.dashboard, sid], env=env,
                           capture_output=True, timeout=60)
    return job, status.stdout + status.stderr


def _submit_then_stop(ray_head, sid: str, metrics: Path, min_step: int, *args: str,
                      while_running=None) -> tuple[str, str, str]:
    """``ray job submit --no-wait ... -- python -m tessera.launch ARGS`` (with 300 s between
    ``ray job stop``'s SIGTERM and its SIGKILL), then, once ``metrics`` holds step ``min_step``,
    ``while_running()`` (where given) and ``ray job stop``; returns the submit command's output,
    the job's log and its final status."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    env, where = ray_head.cli_env, ["--address", ray_head.dashboard]  # with RAY_AUTH_MODE=token
    submit = [RAY_BIN, "job", "submit", *where, "--submission-id", sid, "--working-dir", ".", "--no-wait",
              "--runtime-env-json", json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}}),
              "--", "python", "-m", "tessera.launch", *args]
    ray_head.wait_for_job_agent()
    sub = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-2000:]
    jobs = JobSubmissionClient(ray_head.dashboard)
    try:
        deadline = time.monotonic() + HARD_TIMEOUT_S
        while jobs.get_job_status(sid) in (JobStatus.PENDING, JobStatus.RUNNING) and time.monotonic() < deadline:
            text = metrics.read_text() if metrics.exists() else ""
            lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines only
            if any(json.loads(ln).get("step", 0) >= min_step for ln in lines if '"event"' not in ln):
                break
            time.sleep(0.5)
        if while_running is not None:
            while_running()
    finally:
        stop = subprocess.run([RAY_BIN, "job", "stop", *where, sid], env=env, capture_output=True, text=True,
                              timeout=600)
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    return sub.stdout + sub.stderr, jobs.get_job_logs(sid), str(jobs.get_job_status(sid))


def test_ray_job_submit_runs_the_launcher_and_writes_metrics(ray_head, tmp_path, capsys):
    """``ray job submit --working-dir . -- python -m tessera.launch ...`` against the head, then
    ``ray job stop`` once it has run 5 steps: it stops cleanly at a step boundary (one line naming
    the step, the W&B run finished, no traceback; the checkpoint of a stop step where one is due:
    ``test_worker_loop_stops_at_a_step_boundary_when_asked``) and its metrics file has every step,
    a falling loss, the learning rate, MFU and bubble fields; ``tessera report`` draws them
    (:func:`_check_report`). Before the stop, ``tessera status`` and ``rollback`` find the job's
    driver given its submission id or its Ray job id (:func:`_check_job_given_by_id`); after it,
    ``tessera status`` says no driver of that job is left."""
    from tessera.cli.main import main

    t0 = time.perf_counter()
    run_dir = tmp_path / "submitted"
    sid = f"tessera-test-{os.getpid()}"
    submitted, logs, status = _submit_then_stop(
        ray_head, sid, run_dir / "metrics.jsonl", 5, "recipes/tiny-qwen3-next.yaml",
        *SMALL, "train.steps=1000", f"logging.out_dir={tmp_path}",
        "logging.wandb_mode=offline", "--run-name", "submitted", "--no-progress",
        while_running=lambda: _check_job_given_by_id(ray_head.dashboard, sid, "submitted", capsys))
    capsys.readouterr()
    rc = main(["status", "--job", sid])  # its driver ended with it
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and ("no live tessera driver" in err[0] or "running drivers" in err[0]), err
    print(f"ray job submit, ray job stop: {time.perf_counter() - t0:.1f} s")
    assert "stopped" in status.lower(), (status, logs[-4000:])
    assert "tessera train: submitted" in logs  # the launcher's summary, from the job's log
    assert f"outputs (metrics, W&B, checkpoints) in {tmp_path / 'submitted'}\n" in logs  # in full
    assert ".rayignore" in submitted  # Ray honoured the repo's upload exclusions

    records = _records(tmp_path / "submitted" / "metrics.jsonl")
    # the workers' nodes checked first (one node: the cpu preset's pp-ep-dp order, nothing re-mapped), then the start
    assert records[0]["event"] == "placement" and records[0]["order"] == "pp-ep-dp" and not records[0]["remapped"]
    assert records[1]["event"] == "start" and records[1]["resume_step"] == 0
    rows = _steps(records)
    steps = rows[-1]["step"]
    # ray job stop: SIGTERM to the launcher (and to every process below it); the workers end after
    # the step in progress or the next one, and W&B is finished
    stopped = [ln for ln in logs.splitlines() if "stopped at step" in ln]
    assert stopped == [f"tessera train: stopped at step {steps} (SIGTERM)"], logs[-4000:]
    for noise in ("Traceback", "ConnectionResetError", "SIGTERM received"):  # Python, W&B, Ray's C++ stack dump
        assert noise not in logs, (noise, logs[-4000:])
    requested = [r for r in records if r.get("event") == "stop_requested"]
    assert len(requested) == 1 and requested[0]["reason"] == "SIGTERM" and 5 <= requested[0]["step"] <= steps
    assert steps - requested[0]["step"] <= 2, (requested, steps)  # the step in progress, or the next one
    wandb_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and "stream: all finished" in (wandb_runs[0] / "logs" / "debug-internal.log").read_text()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH_1 * k for k in range(steps)]
    _check_iteration_fields(rows, GLOBAL_BATCH_1, seq=32, ep=False)
    losses = [r["loss"] for r in rows]
    assert abs(losses[0] - math.log(256)) < 0.5
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    _check_report(tmp_path / "submitted", tmp_path / "report", rows)


def _check_job_given_by_id(dashboard: str, sid: str, run: str, capsys) -> None:
    """``tessera status | rollback --job`` of a running ``ray job submit`` job given its submission
    id ``sid`` (or its Ray job id) find the driver of run ``run``: through the State API, and by
    asking the drivers (the lookup without it); a rollback of its only version is one line, exit 2."""
    from ray.job_submission import JobSubmissionClient

    from tessera.cli.main import main
    from tessera.train.job.client import _driver_with_submission_id, find_driver
    from tessera.train.job.driver import NAMESPACE

    capsys.readouterr()
    rc = main(["status", "--job", sid, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(out)
    assert (s["run"], s["submission_id"], s["plan_version"]) == (run, sid, 0)
    ref = find_driver(sid)
    job_id = JobSubmissionClient(dashboard).get_job_info(sid).job_id
    assert (ref.run, ref.namespace, ref.job_id, ref.found_by) == (run, NAMESPACE, job_id, "submission id")
    assert find_driver(job_id).found_by == "job id"
    assert _driver_with_submission_id(sid).run == run
    rc = main(["rollback", "--job", sid])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "rollback=0: has no earlier version" in err[0], err


def _check_report(run_dir: Path, out: Path, rows: list[dict]) -> None:
    """``tessera report`` on a CPU run: loss and learning-rate panels from the run's own records
    (the learning rate is the optimizer's, the recipe's ``train.lr``), MFU against the peak the
    workers measured, titled nominal in the PNG itself."""
    from PIL import Image

    from tessera.cli.main import main
    from tessera.config.resolve import resolve_model
    from tessera.train.report.panels import CPU_MFU_TITLE, PANELS, series
    from tessera.train.worker.metrics import iteration_flops

    recipe = load_recipe(TINY, list(SMALL))
    assert [r["lr"] for r in rows] == [recipe.train.lr] * len(rows)
    flops = iteration_flops(resolve_model(recipe), recipe.parallel)
    for r in rows:  # the CPU peak is the start-up benchmark's; MFU divides by it
        assert r["device"] == "cpu" and r["peak_tflops"] > 0
        assert r["mfu"] == pytest.approx(flops / (r["iteration_ms"] / 1e3 * r["peak_tflops"] * 1e12), rel=1e-9)
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    by_key = {p.key: p for p in PANELS}
    assert series(rows, by_key["loss"]) == ([r["step"] for r in rows], [r["loss"] for r in rows])
    titles = {k: Image.open(out / f"{by_key[k].name}.png").text["Title"] for k in ("loss", "lr", "mfu")}
    peak = rows[-1]["peak_tflops"] * 1e3
    assert titles["loss"] == "loss" and titles["lr"] == "learning rate"
    assert titles["mfu"].startswith(CPU_MFU_TITLE + "\n(") and f"{round(peak, 1):g}" in titles["mfu"], titles


def test_ray_job_with_bad_input_fails_with_the_one_line(ray_head, tmp_path):
    """Bad input under ``ray job submit``: the entrypoint exits 2 before starting any worker, the
    job ends FAILED, and its log holds the same one line as ``tessera train``."""
    job, status = _submit(ray_head, f"tessera-bad-{os.getpid()}", "recipes/tiny-qwen3-next.yaml", "parallel.ep=3",
                          f"logging.out_dir={tmp_path}", "--no-progress")
    logs = job.stdout + job.stderr
    assert job.returncode != 0 and "failed" in status.lower(), (status, logs[-2000:])
    errors = [ln for ln in logs.splitlines() if ln.startswith("tessera train: error: ")]
    # the streamed log and the job's status message both carry it
    assert errors and len(set(errors)) == 1, logs[-2000:]
    assert "parallel.ep=3" in errors[0] and "8 experts" in errors[0]
    assert "exit code 2" in logs
    assert "Traceback" not in logs and not any(tmp_path.iterdir())  # no run directory was made


TIMED_MAIN = ("import sys, time; from tessera.cli.main import main; t = time.perf_counter(); rc = main(sys.argv[1:]); "
              "print(f'{time.perf_counter() - t:.2f}', 'transformers' in sys.modules); sys.exit(rc)")
"""``tessera ARGS`` in a fresh interpreter, printing the command's seconds (without the interpreter's
start) and whether it imported the model code's transformers (pre-flight's slow check)."""


def test_address_without_token_mode_fails_at_once_with_the_fix(ray_head, tmp_path):
    """``--address`` to a token-authenticated cluster without ``RAY_AUTH_MODE``: one line naming
    the variable, instead of Ray's 20 s of retries and a ConnectionError traceback, within a
    second or two: after the recipe's checks, before the pre-flight check that imports the model
    code (it took 24 s on a loaded machine when it came after it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    token = Path.home() / ".ray" / "auth_token"
    if not token.exists():
        pytest.skip("the head runs without token authentication")
    p = subprocess.run([sys.executable, "-c", TIMED_MAIN, "train", "--address", ray_head.address, "train.steps=1",
                        f"logging.out_dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 2, (p.stdout[-1000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tessera train: error: --address='{ray_head.address}'"), lines
    assert "requires token authentication" in lines[0] and "RAY_AUTH_MODE=token" in lines[0]
    seconds, model_code_imported = p.stdout.split()
    assert model_code_imported == "False" and float(seconds) < 10, p.stdout  # 1.7 s on an idle 2-core machine


@pytest.mark.xdist_group("ray-train-faults")  # a job of its own: may run beside this module's others
def test_worker_failure_beyond_max_failures_is_one_line_exit_1(ray_head, tmp_path, monkeypatch, capsys):
    """A worker that dies with ``--max-failures 0``: ``tessera train`` returns 1 and its last line
    names the rank and the error; the driver actor is gone."""
    from tessera.cli.main import main
    from tessera.testing.faults import FAULT_ENV
    from tessera.train.job.driver import NAMESPACE, driver_name

    monkeypatch.setenv(FAULT_ENV, "1:1")
    rc = main(["train", TINY, *SMALL, "train.steps=3", f"logging.out_dir={tmp_path}",
               "logging.wandb_mode=disabled", "--run-name", "dies", "--cpus-per-worker", "0.25", "--max-failures", "0",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err[-20:]
    assert err[-1].startswith("tessera train: error: the job failed on worker rank 1: "), err[-20:]
    assert "--max-failures" in err[-1]
    # gone when the command returns (ray.kill only sends the request: the launcher waits for it)
    with pytest.raises(ValueError):
        ray.get_actor(driver_name("dies"), namespace=NAMESPACE)
    assert driver_name("dies") not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def _kill_driver_when_checkpointed(namespace: str, name: str, run_dir: Path, version: int, out: dict,
                                   done: Path | None = None) -> threading.Thread:
    """A thread that waits for a complete checkpoint holding plan ``version`` and until the
    launcher has written the driver's newest record, kills the driver actor so that Ray restarts
    it, and stores what the restarted driver says; at the end, whatever happened, it creates the
    file ``done`` (where given: the job's gate)."""

    def run():
        deadline = time.monotonic() + HARD_TIMEOUT_S
        try:
            while True:
                try:
                    actor = ray.get_actor(name, namespace=namespace)
                    break
                except ValueError:
                    assert time.monotonic() < deadline, "the driver never started"
                    time.sleep(0.2)
            while time.monotonic() < deadline:
                info = ckpt.latest_complete(str(run_dir)) if run_dir.is_dir() else None
                if info is not None and info.plan_version == version:
                    try:
                        status = ray.get(actor.status.remote(history=0), timeout=30)
                    except ray.exceptions.GetTimeoutError:  # slow to answer on a loaded machine: ask again
                        continue
                    written = {r.get("step") for r in _records(run_dir / "metrics.jsonl") if "event" not in r}
                    if status["last"] and status["last"]["step"] in written:
                        break
                time.sleep(0.05)
            out["checkpoint"], out["before"] = info, status
            ray.kill(actor, no_restart=False)
            while time.monotonic() < deadline:
                try:
                    after = ray.get(actor.status.remote(history=0), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # still restarting
                    time.sleep(0.2)
                    continue
                if after["incarnation"] != status["incarnation"]:
                    out["after"] = after
                    break
        except Exception as e:  # noqa: BLE001 - reported by the test's assertions
            out["error"] = repr(e)
        finally:
            if done is not None:
                done.touch()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.xdist_group("ray-train-job")  # a job of its own: may run beside this module's others
def test_job_answers_a_client_upgrades_and_survives_its_driver_being_killed(ray_head, tmp_path):
    """One job through :func:`tessera.train.job.run.run_job` (the tiny recipe, 4 workers, W&B
    offline): a separate client process queries the driver at step 2 and upgrades the plan (the
    same partition without its pair orders: version 1, applied at one iteration boundary on every rank); once a complete
    checkpoint holds version 1 the driver actor is killed, Ray restarts it and it recovers plan
    version and step from that checkpoint while training goes on; a driver built again on the run
    directory at the end recovers the final checkpoint.

    The workers wait at two gates (:mod:`tessera.testing.gates`), so neither action races the
    iterations on a loaded machine: after step 2 until the client is done (its upgrade takes
    effect at step 5: the running step 3 plus ``job.upgrade_lead_steps``), and after step 7 until
    the driver, killed once checkpoint 6 (version 1) is complete, answers again."""
    from tessera.train.job.driver import NAMESPACE, Driver, driver_name
    from tessera.train.job.run import run_job
    from tessera.train.worker.hooks import HookSpec

    steps, every, held = 10, 2, 7  # the kill after step `held`; steps after it train with the restarted driver
    recipe = load_recipe(TINY, [f"train.steps={steps}", f"train.checkpoint_every={every}", f"logging.out_dir={tmp_path}",
                                "job.run_name=smoke", *JOB])
    gates = tmp_path / "gates"
    gates.mkdir()
    client: dict = {}
    seen: dict = {}
    thread = _client_when_running(ray_head.address, NAMESPACE, driver_name("smoke"), client, done=gates / "client")
    killer = _kill_driver_when_checkpointed(NAMESPACE, driver_name("smoke"), tmp_path / "smoke", 1, seen,
                                            done=gates / "killed")
    hold = HookSpec("tessera.testing.gates:wait_for_files",
                    {"gates": [[2, str(gates / "client")], [held, str(gates / "killed")]], "timeout_s": HARD_TIMEOUT_S / 2})
    result = run_job(recipe, progress=False, hooks=(hold,))
    thread.join(timeout=200)
    killer.join(timeout=120)
    print(f"job wall {result.wall_s:.1f} s, planning {result.plan_s:.1f} s")

    records = _records(result.metrics_path)
    rows = _steps(records)
    # every step once, in order, through the driver's restart; the same data as an uninterrupted run
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH * k for k in range(steps)]
    assert [r["event"] for r in records[:2]] == ["placement", "start"] and records[1]["resume_step"] == 0
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.5
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    _check_iteration_fields(rows)
    assert result.steps == steps and result.attempts == 1 and result.resumed_from is None  # no worker restart
    assert list(Path(result.run_dir, "wandb").glob("offline-run-*")), "W&B offline run directory missing"

    # the separate client saw the running job and queued a plan upgrade (same partition, next version),
    # applied at one iteration boundary on every rank
    assert client.get("answer"), client
    status = client["answer"]["status"]
    assert status["run"] == "smoke" and status["step"] >= 2 and status["plan_version"] == 0
    assert status["last"]["step"] >= 2 and status["partition"].startswith("S0[emb")
    assert client["answer"]["upgrade_version"] == 1
    switches = [r for r in records if r.get("event") == "plan_switch"]
    assert len(switches) == 1, switches
    at = switches[0]["step"]
    assert [r["plan_version"] for r in rows] == [0] * (at - 1) + [1] * (steps - at + 1)

    # the driver, killed after a checkpoint of version 1, was restarted by Ray (max_restarts) and
    # recovered plan version and step from the newest complete checkpoint
    assert "error" not in seen and "after" in seen, seen
    info, before, after = seen["checkpoint"], seen["before"], seen["after"]
    killed_after = before["last"]["step"]
    assert killed_after < steps, "the job ended before the driver was killed"
    assert after["restarted"] and after["recovered_from"] is not None
    recovered_step = int(os.path.basename(after["recovered_from"])[len(ckpt.PREFIX):])
    assert info.step <= recovered_step <= killed_after + 1
    assert after["plan_version"] == 1 and after["plan"] == before["plan"] and after["step"] >= recovered_step
    restarts = [r for r in records if r.get("event") == "driver_restart"]
    assert len(restarts) == 1 and restarts[0]["recovered_from"] == after["recovered_from"]
    assert restarts[0]["plan_version"] == 1 and restarts[0]["step"] == recovered_step

    final = ckpt.latest_complete(result.run_dir)
    assert final.step == steps and final.plan_version == 1 and final.world_size == 4
    assert final.data_position == steps * GLOBAL_BATCH and result.checkpoint == final.path
    done = sorted(int(n[len(ckpt.PREFIX):]) for n in os.listdir(result.run_dir) if n.startswith(ckpt.PREFIX))
    assert done[-1] == steps and all(s % every == 0 for s in done), done
    # a restarted (or resumed) driver recovers plan, version and step from the newest checkpoint
    again = Driver(recipe.to_dict(), result.run_dir, "smoke")
    assert again.recovered_from == final.path and again.step == steps and again.plan_version == 1
    assert again.get_program(3)["program"]["rank"] == 1


@pytest.mark.xdist_group("ray-train-faults")  # a job of its own: may run beside this module's others
def test_workers_killed_mid_run_and_mid_checkpoint_resume_from_the_last_complete_one(ray_head, tmp_path, monkeypatch):
    """One job, two worker deaths (through ``tessera train``, the code path of
    ``python -m tessera.launch``):

    1. rank 1 dies while writing its part of checkpoint 4 (its ``.pt`` is in the run directory,
       its marker is not): the restarted group ignores and deletes that partial checkpoint,
       resumes from checkpoint 2 (the previous complete one) and replays steps 3..;
    2. rank 0 kills itself after step 7, between checkpoints: the group resumes from checkpoint 6.

    One replica of the tiny recipe cut to 4 layers (:data:`SMALL`): more would prove nothing more here.

    Every replayed step reads the same data as an uninterrupted run and gives the same loss."""
    from tessera.cli.main import main
    from tessera.testing.faults import CKPT_FAULT_ENV, FAULT_ENV

    steps, every, broken, killed = 8, 2, 4, 7
    monkeypatch.setenv(CKPT_FAULT_ENV, f"1:{broken}")
    monkeypatch.setenv(FAULT_ENV, f"0:{killed}")
    rc = main(["train", TINY, *SMALL, f"train.steps={steps}", f"train.checkpoint_every={every}",
               f"logging.out_dir={tmp_path}", "logging.wandb_mode=disabled", "--run-name", "faults",
               "--cpus-per-worker", "0.25", "--max-failures", "2", "--no-progress"])
    assert rc == 0
    run_dir = tmp_path / "faults"
    records = _records(run_dir / "metrics.jsonl")
    starts = [r for r in records if r.get("event") == "start"]
    assert [(s["attempt"], s["resume_step"], s["removed_partial"]) for s in starts] == [
        (0, 0, []),
        (1, broken - every, [ckpt.dir_name(broken)]),  # checkpoint 4 was partial: deleted, 2 used
        (2, killed - 1, []),
    ]
    rows = _steps(records)
    by_attempt = [[r for r in rows if r["attempt"] == k] for k in range(3)]
    assert [[r["step"] for r in rs] for rs in by_attempt] == [
        list(range(1, broken + 1)), list(range(broken - every + 1, killed + 1)), list(range(killed, steps + 1))]
    # the same data positions as an uninterrupted run; replayed steps give the same loss
    assert all(r["data_position"] == (r["step"] - 1) * GLOBAL_BATCH_1 for r in rows)
    for earlier, later in zip(by_attempt, by_attempt[1:]):
        first_loss = {r["step"]: r["loss"] for r in earlier}
        replayed = [r for r in later if r["step"] in first_loss]
        assert replayed, "no step was replayed"
        for r in replayed:
            assert r["loss"] == pytest.approx(first_loss[r["step"]], rel=1e-4, abs=1e-4), r["step"]
    # checkpoint 4 was written again, complete (Ray keeps the newest 3: 4, 6, 8), and the job
    # ended with a complete final checkpoint
    assert ckpt.check_complete(str(run_dir / ckpt.dir_name(broken))) is not None
    assert ckpt.latest_complete(str(run_dir)).step == steps


@pytest.mark.xdist_group("ray-train-profile")  # a job of its own: may run beside this module's others
def test_profile_on_the_workers_then_the_driver_plans_on_it(ray_head, tmp_path):
    """``tessera profile`` of the tiny recipe through Ray Train workers (gloo, 4 ranks): every
    distinct task and pair is timed and cached; a second run finds nothing missing; the driver of
    a ``planner.cost_source=profile`` job plans on the measured times. (The job's drift check is
    tested on a real one-rank engine in test_train_job.py.)"""
    from tessera.config.profile_rules import profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import OVERLAP_ITEM, is_factor_item, task_signatures
    from tessera.flow import build_costs, resolve
    from tessera.train.job.driver import Driver
    from tessera.train.job.profile import run_profile
    from tessera.train.profile.setup import prepare_profile

    recipe = load_recipe(TINY, [f"logging.out_dir={tmp_path}", "profile.reps=1", "profile.warmup=0",
                                "profile.budget_s=0", "planner.search_time_s=2", "logging.wandb_mode=disabled", *JOB])
    setup = prepare_profile(recipe)
    assert setup.missing == setup.needed and "p2p" in setup.needed
    result = run_profile(recipe, progress=False, setup=setup)
    assert not result.cache_hit and result.missing == ()
    assert (result.tasks, result.distinct_tasks) == (134, 38)  # 8 layers of two kinds, embedding, head
    assert result.pairs_needed >= result.candidate_pairs_distinct >= result.distinct_pairs > result.program_pairs >= 1
    assert len(setup.pair_specs) == result.distinct_pairs - result.program_pairs  # every other candidate pair
    assert result.pairs_timed == result.distinct_pairs  # each signature timed once, co-executed
    assert result.pair_dedup == result.pairs_needed / result.distinct_pairs
    assert result.iterations == 1 and result.device.startswith("cpu")
    assert result.timed_items == len(setup.needed)  # the fitted factors are stored beside them
    assert set(result.calibration) >= {"mixer", "expert", "dispatch", "combine", "head", "embed"}
    for c in result.calibration.values():  # the per-phase scales never fit worse than none (L1 fit)
        assert min(c["scales"].values()) > 0 and c["n"] >= 1 and c["mean_err_fit"] <= c["mean_err"] + 1e-12
    assert [p.name for p in tmp_path.iterdir() if "-profile-" in p.name] == []  # no run directory left behind

    cache = ProfileCache(result.cache)
    res = resolve(recipe)
    fp = profile_fingerprint(recipe, res.model, res.hardware)
    items = cache.get(fp)
    assert set(setup.needed) <= set(items) and prepare_profile(recipe).missing == ()  # reused: nothing left
    for it in items.values():
        assert it.p25_ms <= it.median_ms <= it.p75_ms and (it.median_ms > 0 or is_factor_item(it.name)), it

    measured = recipe.with_overrides(["planner.cost_source=profile"])
    costs = build_costs(resolve(measured))
    sig = task_signatures(costs)
    assert costs.source == "profile" and costs.p2p_ms == items["p2p"].median_ms
    assert costs.layers[3].tasks[0].ms == items[sig["F.L3.mixer"]].median_ms
    if OVERLAP_ITEM in items:
        assert costs.overlap_slowdown == max(1.0, items[OVERLAP_ITEM].median_ms)
    spec = setup.pair_specs[0]  # a candidate pair outside the Program: the planner prices it at its measured time
    assert (spec.item, spec.with_w, items[spec.item].median_ms) in costs.measured_pairs
    assert len(costs.measured_pairs) == result.distinct_pairs
    driver = Driver(measured.to_dict(), str(tmp_path / "run"), "prof")  # the driver actor's planning, in-process
    assert driver.error is None and driver.ready()["plan"] == "tessera"
    assert driver.get_program(0)["program"]["rank"] == 0
