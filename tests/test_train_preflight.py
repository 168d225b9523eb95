"""``tessera train`` / ``python -m tessera.launch`` reject bad input before Ray starts.

Every case runs the real entry point with ``--ray-temp-dir`` pointing at a folder that must not
exist afterwards (no local Ray was started); each must end with exit code 2 and exactly one stderr
line ``tessera train: error: <field>=<value>: <rule>; fix: <fix>``. Cases marked ``process`` run
``python -m tessera train`` / ``python -m tessera.launch`` (the ``ray job submit`` entrypoint)
as a subprocess (the exit code of the process, nothing else printed at import); the others call
the same command line in this process (:func:`tessera.cli.main.main`, whose return value is that
exit code), which costs no interpreter start.
Also: the address checks (nothing listening), the run directory under ``ray job submit`` and
the stop notice there, the data checks, the CPU oversubscription rule, and how worker failures are reported (:func:`tessera.train.job.run.job_error` on Ray
Train's own exception types).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.config.load import load_recipe
from tessera.errors import ProgramError, TesseraConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")


def _train(tmp_path, *args: str, module: bool = False, process: bool = False):
    """``tessera train ARGS`` (``module``: ``python -m tessera.launch ARGS``, in a subprocess) run
    in ``tmp_path``; ``(returncode, stdout, stderr)`` as a ``CompletedProcess`` has them."""
    ray_dir = tmp_path / "ray"
    argv = [*args, "--ray-temp-dir", str(ray_dir), "--no-progress"]
    if module or process:
        entry = [sys.executable, "-m", "tessera.launch"] if module else [sys.executable, "-m", "tessera", "train"]
        p = subprocess.run([*entry, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    else:
        from contextlib import chdir, redirect_stderr, redirect_stdout

        from tessera.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        with chdir(tmp_path), redirect_stdout(out), redirect_stderr(err):
            rc = main(["train", *argv])
        p = SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())
    assert not ray_dir.exists(), "a local Ray was started for bad input"
    return p


def _one_line(p: subprocess.CompletedProcess, code: int = 2) -> str:
    assert p.returncode == code, (p.returncode, p.stdout[-800:], p.stderr[-800:])
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tessera train: error: "), lines[0]
    return lines[0]


REPRODUCTIONS = [
    (("parallel.pp=0",), "process", ("parallel.pp=0", "must be >= 1")),
    (("parallel.ep=3",), "module", ("parallel.ep=3", "8 experts")),
    (("parallel.tp=2", "parallel.ep=1", "train.steps=1"), "in-process",
     ("parallel.tp=2", "no tensor parallelism", "set parallel.tp=1")),
    (("hardware.preset=h800", "train.steps=1"), "in-process",
     ("hardware.preset='h800'", "4 GPUs needed, the cluster has 0", "hardware.preset=cpu")),
    (("--cpus-per-worker", "2", "--num-cpus", "2", "train.steps=1"), "in-process",
     ("job.cpus_per_worker=2.0", "8 CPU exceed the cluster's 2 CPU", "job.cpus_per_worker <= 0.5")),
    (("parallel.seq_length=1000000", "train.steps=1"), "in-process", ("parallel.seq_length",)),
    (("train.data=no-such-file.txt", "train.steps=1"), "in-process", ("train.data='no-such-file.txt'", "train.data=pydoc")),
    (("train.tokenizer=gpt2", "train.steps=1"), "in-process", ("train.tokenizer='gpt2'", "never from the Hugging Face Hub")),
    (("dbo.enabled=true", "dbo.routing=recorded", "dbo.counts_path=no-such.json", "train.steps=1"), "in-process",
     ("dbo.counts_path='no-such.json'", "FileNotFoundError", "tessera.train.profile.routes")),
    # 16 workers on 2 cores (about 40 s a step): refused unless asked for
    (("parallel.dp=8", "--num-cpus", "2", "train.steps=1"), "in-process",
     ("parallel.dp=8: 16 CPU workers (pp*dp = 2*8) x 1 thread on the cluster's 2 CPUs are 8 busy threads per CPU, "
      "more than 4", "keep pp*dp x threads <= 8", "job.oversubscribe=true (--oversubscribe)")),
]


@pytest.mark.parametrize("args,how,needles", REPRODUCTIONS, ids=[" ".join(a) for a, _, _ in REPRODUCTIONS])
def test_issue_reproductions_exit_2_before_ray_starts(tmp_path, args, how, needles):
    line = _one_line(_train(tmp_path, *args, module=how == "module", process=how == "process"))
    for n in needles:
        assert n in line, (n, line)


def test_recipe_file_errors_and_model_kinds_the_engine_does_not_build(tmp_path):
    line = _one_line(_train(tmp_path, "recipes/nope.yaml"))
    assert "recipe='recipes/nope.yaml'" in line and "does not exist" in line
    # an MTP module is planned and costed but not built: refused before Ray, not trained without
    line = _one_line(_train(tmp_path, "model.preset=tiny-deepseek-v3", "model.mtp_layers=1", "parallel.ep=1",
                            "parallel.dp=1", "train.steps=1"))
    assert "model.mtp_layers=1" in line and "not built" in line and "mtp_layers=0" in line


def test_address_with_nothing_listening_is_one_line_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    line = _one_line(_train(tmp_path, "--address", f"127.0.0.1:{port}", "train.steps=1"))
    assert f"--address='127.0.0.1:{port}'" in line and "nothing accepts connections" in line
    line = _one_line(_train(tmp_path, "--address", "not an address", "train.steps=1"))
    assert "HOST:PORT" in line
    # bad input is still reported first: the recipe is checked before the address
    line = _one_line(_train(tmp_path, "--address", f"127.0.0.1:{port}", "parallel.pp=0"))
    assert "parallel.pp=0" in line


# --------------------------------------------------------------------------- in-process checks


def test_oversubscription_is_refused_unless_asked_for():
    """CPU recipes: at most MAX_THREADS_PER_CPU busy threads (workers x threads) per cluster CPU;
    job.oversubscribe (--oversubscribe) lifts it; GPU recipes are not checked."""
    from tessera.cli.train import load_train_recipe
    from tessera.train.job.preflight import MAX_THREADS_PER_CPU, check_cluster, check_oversubscription, preflight

    def check(overrides, cpus, gpus=0):
        recipe = load_recipe(TINY, overrides)
        cluster = {"CPU": float(cpus), "GPU": float(gpus)}
        check_oversubscription(recipe, cluster, check_cluster(recipe, cluster))

    assert MAX_THREADS_PER_CPU == 4
    check(["parallel.dp=4"], 2)  # 8 workers on 2 CPUs: 4 per CPU, the limit
    with pytest.raises(TesseraConfigError, match=r"^parallel\.dp=8: 16 CPU workers .* 8 busy threads per CPU, more "
                                                 r"than 4 .*; fix: keep pp\*dp x threads <= 8"):
        check(["parallel.dp=8"], 2)
    with pytest.raises(TesseraConfigError, match=r"^parallel\.pp=4: 4 CPU workers .* 0\.5 CPUs are 8 busy threads per CPU"):
        check(["parallel.pp=4", "parallel.dp=1", "parallel.ep=1"], 0.5)
    with pytest.raises(TesseraConfigError, match=r"^job\.threads=3: 4 CPU workers \(pp\*dp = 2\*2\) x 3 threads on "
                                                 r"the cluster's 2 CPUs are 6 busy threads per CPU"):
        check(["job.threads=3"], 2)
    check(["parallel.dp=8", "job.oversubscribe=true"], 2)
    check(["parallel.dp=8", "hardware.preset=h800", "job.cpus_per_worker=0.1"], 2, gpus=16)  # GPU workers: not checked
    flag = _train_args(TINY, "parallel.dp=8", "--oversubscribe")
    assert load_train_recipe(flag).job.oversubscribe is True
    checked = preflight(load_recipe(TINY, ["parallel.dp=8", "job.oversubscribe=true", "train.steps=1"]),
                        {"CPU": 2.0, "memory": 64e9})  # the whole pre-flight passes when asked for
    assert checked.resources == {"CPU": 0.12}


def _train_args(*argv: str):
    from tessera.cli.main import build_parser

    return build_parser(only="train").parse_args(["train", *argv])


def test_data_must_hold_one_global_batch(tmp_path):
    from tessera.train.job.preflight import check_data

    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * (15 * 64 + 1))  # 15 sequences of the tiny recipe's 65 bytes
    recipe = load_recipe(TINY, [f"train.data={short}"])
    with pytest.raises(TesseraConfigError, match=r"holds 15 sequences .* fewer than one global batch .* = 16; "
                                                 r"fix: use a corpus of at least 1025 bytes"):
        check_data(recipe)
    enough = tmp_path / "enough.txt"
    enough.write_bytes(b"x" * (16 * 64 + 1))
    assert check_data(load_recipe(TINY, [f"train.data={enough}"])) == 16
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(TesseraConfigError, match="line 2 is not JSON"):
        check_data(load_recipe(TINY, [f"train.data={bad}"]))
    with pytest.raises(TesseraConfigError, match="neither 'pydoc' nor an existing file"):
        check_data(load_recipe(TINY, [f"train.data={tmp_path}"]))  # a directory
    assert check_data(load_recipe(TINY)) == 466273 // 64 - (1 if 466273 % 64 == 0 else 0)


def test_preflight_reports_what_it_checked():
    from tessera.train.job.preflight import local_cluster, preflight

    checked = preflight(load_recipe(TINY), {"CPU": 2.0})
    assert checked.resources == {"CPU": 0.5}  # 4 workers share 2 CPUs
    assert len(checked.memory_gb) == 2 and all(0 < m < 1 for m in checked.memory_gb)
    assert checked.resolved.model.name == "tiny-qwen3-next"
    assert local_cluster(3)["CPU"] == 3.0 and "GPU" not in local_cluster(3)
    assert local_cluster()["CPU"] == float(len(os.sched_getaffinity(0)))


def test_run_directory_under_a_ray_job_is_durable(tmp_path):
    from tessera.train.job.outputs import JOB_OUT_BASE, out_root, submission_id

    job_env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"metadata": {"job_submission_id": "raysubmit_42"}})}
    assert submission_id(job_env) == "raysubmit_42" and submission_id({}) is None
    recipe = load_recipe(TINY)  # logging.out_dir: out (relative)
    assert out_root(recipe, {}) == os.path.abspath("out")
    assert out_root(recipe, job_env) == os.path.join(os.path.expanduser(JOB_OUT_BASE), "out")
    absolute = recipe.with_overrides([f"logging.out_dir={tmp_path}"])
    assert out_root(absolute, job_env) == str(tmp_path)


def test_stop_notice_says_how_long_ray_job_stop_waits():
    """Under ``ray job submit`` the SIGTERM notice names ``RAY_JOB_STOP_WAIT_TIME_S`` while it is
    under 30 s (Ray's default: 3), with the submit option that raises it; elsewhere nothing."""
    from tessera.train.job.run import _stop_wait_hint

    job_env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"metadata": {"job_submission_id": "raysubmit_42"}})}
    hint = _stop_wait_hint(job_env)
    assert "kills the job 3 s after its SIGTERM (RAY_JOB_STOP_WAIT_TIME_S)" in hint
    assert json.loads(hint.split("--runtime-env-json '")[1].split("'")[0]) == {
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}
    assert "10 s" in _stop_wait_hint({**job_env, "RAY_JOB_STOP_WAIT_TIME_S": "10"})
    assert _stop_wait_hint({**job_env, "RAY_JOB_STOP_WAIT_TIME_S": "120"}) == "" and _stop_wait_hint({}) == ""


def test_worker_failures_become_one_line():
    from ray.train import ControllerError, WorkerGroupError

    from tessera.train.job.run import JobFailed, job_error

    bad = TesseraConfigError("train.data", "/data/x.txt", "is neither 'pydoc' nor an existing file", "copy it")
    err = job_error(WorkerGroupError("rank 3 failed", {1: RuntimeError("collateral"), 3: bad}))
    assert isinstance(err, TesseraConfigError)
    assert str(err) == ("train.data='/data/x.txt': is neither 'pydoc' nor an existing file (raised on worker rank 3); "
                        "fix: copy it")
    perr = ProgramError(2, 5, "receive without a send")
    assert job_error(WorkerGroupError("x", {0: RuntimeError("a"), 2: perr})) is perr
    from ray.exceptions import ActorDiedError

    died = job_error(WorkerGroupError("x", {0: RuntimeError("gloo: connection reset by peer"), 1: ActorDiedError()}))
    assert str(died).startswith("the job failed on worker rank 1: ActorDiedError: ")
    crash = job_error(WorkerGroupError("x", {2: RuntimeError("CUDA error: out of\nmemory")}))
    assert isinstance(crash, JobFailed)
    assert str(crash).startswith("the job failed on worker rank 2: RuntimeError: CUDA error: out of memory")
    assert "\n" not in str(crash)
    ctrl = job_error(ControllerError(ValueError("placement group timed out")))
    assert isinstance(ctrl, JobFailed) and "placement group timed out" in str(ctrl)
    other = KeyboardInterrupt()
    assert job_error(other) is other


def test_driver_records_the_first_worker_error(tmp_path):
    from tessera.train.job.driver import Driver

    driver = Driver(load_recipe(TINY).to_dict(), str(tmp_path / "run"), "r")
    assert driver.fatal_error() is None
    first = TesseraConfigError("train.data", "x", "missing", "fix it")
    driver.record_fatal(2, first)
    driver.record_fatal(0, TesseraConfigError("train.data", "y", "missing", "fix it"))
    assert driver.fatal_error() == (2, first)
    assert [r["event"] for r in driver.records] == ["worker_error"] and driver.records[0]["rank"] == 2


def test_cpu_workers_must_fit_host_memory():
    from tessera.train.job.preflight import WORKER_OVERHEAD_GB, check_host_memory

    recipe = load_recipe(TINY)  # pp=2, dp=2: 4 workers
    peaks = (0.25, 0.5)
    need = 2 * sum(peaks) + 4 * WORKER_OVERHEAD_GB  # 3.5 GB
    check_host_memory(recipe, peaks, {"memory": need * 1e9 + 1})
    with pytest.raises(TesseraConfigError, match=r"= 3\.5 GB, the cluster has 3\.4 GB"):
        check_host_memory(recipe, peaks, {"memory": 3.4e9})
    check_host_memory(recipe, peaks, {})  # the cluster does not say: nothing to check
    check_host_memory(recipe.with_overrides(["hardware.preset=h800"]), peaks, {"memory": 1.0})  # GPUs hold it


def test_an_80b_model_on_cpu_workers_is_refused_before_ray(tmp_path):
    line = _one_line(_train(tmp_path, str(ROOT / "recipes" / "qwen3-next-80b.yaml"), "hardware.preset=cpu",
                            "parallel.seq_length=2048", "train.steps=1"))
    assert "hardware.preset='cpu'" in line and "host memory" in line and "model.preset=tiny-qwen3-next" in line


def test_reused_run_name_is_refused_before_ray(tmp_path):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    line = _one_line(_train(tmp_path, f"logging.out_dir={tmp_path / 'runs'}", "train.steps=1", "--run-name", "taken"))
    assert "job.run_name='taken'" in line and "already exists" in line and "train.resume=true" in line


def test_dbo_enabled_is_a_training_option():
    """The job runs the dynamic bubble optimizer (tests/test_dbo_train.py): the training rules
    accept it, and the pre-flight checks the Programs it runs (slot-annotated, W deferred)."""
    from tessera.flow import resolve
    from tessera.program.instructions import Op
    from tessera.train.job.preflight import check_memory, check_training_rules

    r = load_recipe(TINY, ["dbo.enabled=true", "dbo.routing=zipf", "dbo.skew_target=1.3"])
    res = resolve(r)
    check_training_rules(r, res.model)
    assert len(check_memory(res)) == 2
    from tessera.flow import plan_programs

    _, programs = plan_programs(r)
    assert any(i.op == Op.SLOT and i.cause for p in programs for i in p.instructions)
