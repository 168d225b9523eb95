"""``logging.out_dir=s3://...``: run directories on object storage, against a real S3-compatible server.

The server is moto's (``moto[server]``), started here on a free port of 127.0.0.1 and reached over
HTTP by pyarrow's ``S3FileSystem`` (credentials and endpoint from ``AWS_*`` variables, as a user
sets them) in this process, the Ray workers, the driver actor, Ray Train's controller and the local
ranks. Unit level (no Ray): :mod:`tessera.train.storage` gives the same results on the server and
on local disk; the checkpoint completeness check, the clean-up of partial checkpoints and
``train.resume``'s search for the newest run with a complete checkpoint on both; the
``logging.out_dir`` rule; the metrics file of a run on the store.

One Ray job (on the run's shared Ray head, tests/conftest.py; the tiny recipe cut as in
tests/test_upgrade_ray.py: 4 layers, pp=2, one replica) writes its run directory into the bucket:
4 steps, checkpoints at steps 2 and 4, a hot upgrade (the bubble optimizer switched on after step
1, :mod:`tessera.testing.upgrades`) whose plan history lands in the bucket, ``tessera status`` on
its driver, and ``tessera export`` of the bucket's run. ``train.resume`` then finds that run in the
bucket and continues it for 2 steps (the same worker loop on local gloo ranks, tests/local_job.py,
with the driver's recovery from the bucket): no step lost or repeated, and every step's loss and
the final parameters bitwise equal to one uninterrupted 6-step run on local disk (the optimizer
moves W tasks, never a value).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.testing.launch_local import free_port
from tessera.train import storage as st
from tessera.train.worker import checkpoint as ckpt

pytestmark = pytest.mark.xdist_group("ray-storage")  # one moto server; the Ray job on the shared head

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
BUCKET = "tessera-runs"
SMALL = ("model.num_layers=4", "parallel.seq_length=32", "parallel.dp=1", "parallel.ep=1", "planner.overlap=false",
         "planner.split_w=false")
JOB = ("job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120", "logging.wandb_mode=disabled")
GLOBAL_BATCH = 1 * 4 * 2  # dp * num_microbatches * micro_batch_size


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with the bucket :data:`BUCKET`; this process's environment
    names it (``AWS_ENDPOINT_URL``, test credentials; ``XDG_CACHE_HOME`` in a temp dir for the
    local stand-ins) until the module ends."""
    moto_server = pytest.importorskip("moto.server")
    import logging

    import pyarrow.fs

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "tessera-test", "AWS_SECRET_ACCESS_KEY": "tessera-test", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true",
           "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        store = pyarrow.fs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], allow_bucket_creation=True)
        store.create_dir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- unit level, no Ray


def _exercise(base: str, scratch: Path) -> list:
    """Every operation of :mod:`tessera.train.storage` under ``base``; what each one gave."""
    out = [("fresh", st.exists(base), st.is_dir(base), st.list_dir(base), st.entries(base), st.mtime(base))]
    a, f, log = st.join(base, "a"), st.join(base, "a", "x.txt"), st.join(base, "a", "log.jsonl")
    st.write_text(f, "one")
    st.write_text(f, "two")  # replaced whole
    st.append_text(log, '{"k": 1}\n')
    st.append_text(log, '{"k": 2}\n')
    blob = bytes(range(256)) * 4100  # > 1 MiB: more than one read block
    st.write_bytes(st.join(base, "a", "b.bin"), blob)
    st.makedirs(st.join(base, "d", "e"))
    out.append(("read", st.read_text(f), st.read_text(log), st.read_bytes(st.join(base, "a", "b.bin")) == blob,
                ckpt._digest(st.join(base, "a", "b.bin"))[0]))
    out.append(("entries", [(e.name, e.is_dir, e.size) for e in st.entries(a)], st.list_dir(base),
                st.list_dir(st.join(base, "d"))))
    out.append(("kinds", st.is_dir(a), st.is_file(f), st.is_file(a), st.is_dir(f), st.exists(st.join(base, "no")),
                st.entries(f), st.basename(f)))
    newest = st.mtime(base)
    out.append(("mtime", newest is not None and abs(newest - time.time()) < 120))
    tree = scratch / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "one.txt").write_text("1")
    (tree / "sub" / "two.txt").write_text("22")
    st.upload(str(tree), st.join(base, "up"))
    st.download(st.join(base, "up"), str(scratch / "back"))
    out.append(("tree", st.list_dir(st.join(base, "up")), st.list_dir(st.join(base, "up", "sub")),
                (scratch / "back" / "sub" / "two.txt").read_text(), sorted(os.listdir(scratch / "back"))))
    st.remove_tree(a)
    out.append(("removed", st.exists(a), st.exists(f), st.list_dir(base)))
    for missing in (f, st.join(base, "up", "none.txt")):
        with pytest.raises(FileNotFoundError):
            st.read_bytes(missing)
    return out


def test_storage_operations_agree_on_s3_and_local_disk(s3, tmp_path):
    on_s3 = _exercise(f"{s3}/unit/ops", tmp_path / "s3")
    on_disk = _exercise(str(tmp_path / "disk" / "ops"), tmp_path / "disk-scratch")
    assert on_s3 == on_disk
    assert on_s3[0] == ("fresh", False, False, [], (), None)
    assert on_s3[1] == ("read", "two", '{"k": 1}\n{"k": 2}\n', True, 256 * 4100)
    assert on_s3[2] == ("entries", [("b.bin", False, 256 * 4100), ("log.jsonl", False, 18), ("x.txt", False, 3)],
                        ["a", "d"], ["e"])
    assert on_s3[-1] == ("removed", False, False, ["d", "up"])


def _part(directory: str, rank: int, step: int, world: int = 2) -> None:
    ckpt.write_part(directory, rank=rank, world_size=world, layout=(2, 1, 1), step=step, plan_version=0,
                    data_position=8 * step, state={"w": torch.full((3,), float(step + rank))},
                    plan={"template": "1f1b"} if rank == 0 else None)


def _checkpoints(root: str) -> dict:
    """Runs under ``root``: A (oldest; complete at steps 2 and 4, a part without its marker at 6,
    a part cut short at 8), C (newer, complete at step 2, a name that sorts before A's), B (newest,
    only a partial checkpoint); what the completeness check, ``train.resume`` and the clean-up
    find there."""
    a, b, c = (st.join(root, f"tiny-qwen3-next-{t}") for t in ("20260105-000000", "20260109-000000",
                                                                  "20260101-000000"))
    for step in (2, 4, 8):
        for rank in range(2):
            _part(st.join(a, ckpt.dir_name(step)), rank, step)
    _part(st.join(a, ckpt.dir_name(6)), 0, 6)  # rank 1 died before its marker
    cut = st.join(a, ckpt.dir_name(8), ckpt.part_name(1))
    st.write_bytes(cut, st.read_bytes(cut)[:-7])  # an upload cut short: size differs from the marker
    time.sleep(1.1 if st.is_remote(root) else 0.05)  # S3 keeps whole seconds: C newer than A
    for rank in range(2):
        _part(st.join(c, ckpt.dir_name(2)), rank, 2)
    _part(st.join(b, ckpt.dir_name(2)), 1, 2)
    latest = ckpt.latest_complete(a)
    base = load_recipe(TINY, [f"logging.out_dir={root}", "train.resume=true"])
    from tessera.train.job.run import choose_run

    chosen = choose_run(base, root)
    with pytest.raises(TesseraConfigError) as clash:
        choose_run(base.with_overrides(["train.resume=false", f"job.run_name={st.basename(a)}"]), root)
    removed = ckpt.cleanup_partial(a)
    return {"latest": (st.basename(latest.path), latest.step, latest.world_size, latest.layout, latest.data_position),
            "step6": ckpt.check_complete(st.join(a, ckpt.dir_name(6))),
            "step8": ckpt.check_complete(st.join(a, ckpt.dir_name(8))),
            "step8_unhashed": ckpt.check_complete(st.join(a, ckpt.dir_name(8)), verify_hash=False),
            "chosen": chosen, "clash": (clash.value.field, clash.value.rule.startswith("already exists under")),
            "removed": [st.basename(p) for p in removed], "left": st.list_dir(a),
            "plan": ckpt.load_plan(latest.path), "part": ckpt.load_part(latest.path, 1)["state"]["w"].tolist(),
            "fresh": choose_run(base, st.join(root, "nothing-here")).startswith("tiny-qwen3-next-")}


def test_completeness_check_and_newest_run_search_on_s3(s3, tmp_path):
    on_s3 = _checkpoints(f"{s3}/unit/runs")
    assert on_s3 == _checkpoints(str(tmp_path / "runs"))
    assert on_s3["latest"] == (ckpt.dir_name(4), 4, 2, (2, 1, 1), 32)
    assert on_s3["step6"] is None and on_s3["step8"] is None and on_s3["step8_unhashed"] is None
    assert on_s3["chosen"] == "tiny-qwen3-next-20260101-000000"  # the newest run with a complete checkpoint
    assert on_s3["clash"] == ("job.run_name", True)
    assert on_s3["removed"] == [ckpt.dir_name(8), ckpt.dir_name(6)]
    assert on_s3["left"] == [ckpt.dir_name(2), ckpt.dir_name(4)]
    assert on_s3["plan"] == ({"template": "1f1b"}, 0, 4) and on_s3["part"] == [5.0, 5.0, 5.0]
    assert on_s3["fresh"]


def test_out_dir_rule_accepts_object_stores_and_names_a_bad_scheme(s3):
    from tessera.config.resolve import resolve_model
    from tessera.config.storage_rules import local_dir
    from tessera.config.validate import validate_recipe
    from tessera.train.job.outputs import out_root
    from tessera.train.job.trainer import worker_env

    def validated(out_dir):
        recipe = load_recipe(TINY, [f"logging.out_dir={out_dir}"])
        validate_recipe(recipe, resolve_model(recipe))
        return recipe

    for good in ("s3://bucket/runs", "gs://bucket", "s3://bucket/runs/", "S3://bucket//a/./b"):
        assert out_root(validated(good)) == {"s3://bucket/runs/": "s3://bucket/runs",
                                             "S3://bucket//a/./b": "s3://bucket/a/b"}.get(good, good)
    for bad, rule in (("hdfs://namenode/runs", "URI scheme hdfs://"), ("s3:///runs", "names no bucket"),
                      ("s3://bucket/../runs", "'..' segment")):
        with pytest.raises(TesseraConfigError) as e:
            validated(bad)
        msg = str(e.value)
        assert e.value.field == "logging.out_dir" and e.value.value == bad and rule in e.value.rule, msg
        assert msg.startswith(f"logging.out_dir={bad!r}: ") and "; fix: " in msg and "\n" not in msg
    from tessera.train.job.preflight import check_storage

    check_storage(load_recipe(TINY, [f"logging.out_dir={s3}/preflight"]))  # the bucket answers
    with pytest.raises(TesseraConfigError) as e:  # no such bucket: one line before Ray starts
        check_storage(load_recipe(TINY, ["logging.out_dir=s3://no-such-bucket/runs"]))
    assert e.value.field == "logging.out_dir" and "no-such-bucket" in e.value.rule and "\n" not in str(e.value)
    recipe = load_recipe(TINY, ["logging.out_dir=s3://bucket/runs"])
    assert local_dir("s3://bucket/runs/r1") == os.path.join(os.environ["XDG_CACHE_HOME"], "tessera", "s3", "bucket",
                                                            "runs", "r1")
    assert local_dir("out/r1") == "out/r1"
    env = worker_env(recipe, 1)  # the workers get the launcher's endpoint and credentials
    assert env["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL"] and env["AWS_ACCESS_KEY_ID"] == "tessera-test"
    assert not any(k.startswith("AWS_") for k in worker_env(load_recipe(TINY, []), 1))  # a local out_dir: none
    path, fs = st.ray_storage(f"{s3}/unit/ray")
    assert path == f"{BUCKET}/unit/ray" and fs.type_name == "s3"
    with fs.open_output_stream(f"{path}/probe") as f:  # Ray Train's own file system reaches the server
        f.write(b"ok")
    assert st.read_text(f"{s3}/unit/ray/probe") == "ok" and st.ray_storage("/tmp/runs") == ("/tmp/runs", None)


def test_metrics_of_a_run_on_s3_are_uploaded_and_a_resumed_run_appends(s3):
    from tessera.config.storage_rules import local_dir
    from tessera.train.report.panels import read_metrics
    from tessera.train.worker.metrics import MetricsSink

    recipe = load_recipe(TINY, ["logging.wandb_mode=disabled", "train.steps=3"])
    run = f"{s3}/unit/metrics/run"

    def rec(step):
        return {"step": step, "loss": 5.0 - step, "tokens_per_s": 1.0, "mfu": 0.0, "bubble_ratio": 0.0}

    sink = MetricsSink(recipe, run, "run", progress=False)
    assert sink.path == f"{run}/metrics.jsonl" and not st.exists(sink.path)  # uploaded now and then, and at the end
    sink.write(rec(1))
    sink.write({"event": "start", "attempt": 0})
    sink.write(rec(2))
    sink.close()
    assert [json.loads(line).get("step") for line in st.read_text(sink.path).splitlines()] == [1, None, 2]
    os.remove(os.path.join(local_dir(run), "metrics.jsonl"))  # another machine resumes the run
    again = MetricsSink(recipe, run, "run", progress=False)
    again.write(rec(3))
    again.close()
    assert [r["step"] for r in read_metrics(sink.path)] == [1, 2, 3]  # tessera report reads it from the store


def test_the_run_tokenizer_is_kept_in_the_bucket_and_read_back(s3, tmp_path, monkeypatch):
    import huggingface_hub.constants
    from transformers import AutoTokenizer

    from test_tokenized_data import SENTENCES, _bpe, _ids
    from tessera.train.worker.tokenizer import run_tokenizer, save_run_tokenizer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tok = _bpe(tmp_path / "tok.json")
    recipe = load_recipe(TINY, [f"train.tokenizer={tok}"])
    run = f"{s3}/unit/tokenizer/run"
    assert save_run_tokenizer(recipe, run) == run_tokenizer(run) == f"{run}/tokenizer"  # what run_job does
    assert "tokenizer.json" in st.list_dir(f"{run}/tokenizer")
    st.download(run_tokenizer(run), str(tmp_path / "back"))  # what tessera export does before reading it
    back = AutoTokenizer.from_pretrained(str(tmp_path / "back"), local_files_only=True)
    assert back(SENTENCES[0])["input_ids"] == _ids(tok, SENTENCES[0])
    assert save_run_tokenizer(recipe.with_overrides(["train.tokenizer=bytes"]), run) is None  # resumed on bytes
    assert run_tokenizer(run) is None and not st.exists(f"{run}/tokenizer")


# --------------------------------------------------------------------------- one Ray job


def _jsonl(location: str) -> list[dict]:
    return [json.loads(line) for line in st.read_text(location).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def s3_run(s3, ray_cluster, tmp_path_factory):
    """The Ray job on ``s3://BUCKET/runs`` (4 steps, the optimizer switched on after step 1, the
    driver kept for ``tessera status``), its resumption by ``train.resume`` (2 more steps on local
    gloo ranks) and one uninterrupted 6-step run on local disk."""
    from local_job import run_local_job
    from tessera.train.job.driver import Driver, kill_driver
    from tessera.train.job.outputs import out_root
    from tessera.train.job.run import choose_run, run_job
    from tessera.train.worker.hooks import HookSpec

    base = load_recipe(TINY, [*SMALL, *JOB, f"logging.out_dir={s3}/runs", "train.checkpoint_every=2"])
    t0 = time.perf_counter()
    kept = ["job.detached_driver=true", "job.keep_driver=true"]  # for tessera status after the job
    live = run_job(base.with_overrides(["train.steps=4", *kept]), progress=False,
                   hooks=(HookSpec("tessera.testing.upgrades:requests_at", {"actions": [[1, "upgrade_dbo", True]]}),))
    job_s = time.perf_counter() - t0
    import ray

    handle = ray.get_actor(f"tessera-driver-{live.run_name}", namespace=base.job.namespace)
    try:
        from tessera.cli.main import main

        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            status_rc = main(["status", "--job", live.run_name])
    finally:
        kill_driver(handle, live.run_name, base.job.namespace)
    records = _jsonl(live.metrics_path)
    driver_records = _jsonl(st.join(live.run_dir, "driver_records.jsonl"))  # before a new driver starts it afresh
    listing = st.list_dir(live.run_dir)
    history = Driver(base.to_dict(), live.run_dir, live.run_name).history  # read back from the bucket
    # train.resume: the newest run of the recipe with a complete checkpoint, found in the bucket
    resumed = base.with_overrides(["train.steps=6", "train.resume=true"])
    chosen = choose_run(resumed, out_root(resumed))
    driver = Driver(resumed.to_dict(), st.join(out_root(resumed), chosen), chosen)
    t0 = time.perf_counter()
    rows = run_local_job(resumed, driver.run_dir, driver)
    resume_s = time.perf_counter() - t0
    ref_dir = str(tmp_path_factory.mktemp("local-disk") / "reference")
    ref = base.with_overrides(["train.steps=6", "dbo.enabled=false", f"logging.out_dir={Path(ref_dir).parent}"])
    t0 = time.perf_counter()
    reference = run_local_job(ref, ref_dir, Driver(ref.to_dict(), ref_dir, "reference", plan_dict=history.at(0).plan))
    ref_s = time.perf_counter() - t0
    return {"live": live, "records": records, "driver_records": driver_records, "listing": listing, "history": history, "status": (status_rc,
            buf.getvalue()), "chosen": chosen, "driver": driver, "rows": rows, "reference": reference,
            "ref_dir": ref_dir, "times": (job_s, resume_s, ref_s)}


def test_a_job_on_s3_trains_checkpoints_and_upgrades_into_the_bucket(s3_run, s3):
    live, records = s3_run["live"], s3_run["records"]
    assert live.run_dir == f"{s3}/runs/{live.run_name}" and live.metrics_path == f"{live.run_dir}/metrics.jsonl"
    assert live.checkpoint == f"{live.run_dir}/{ckpt.dir_name(4)}" and live.steps == 4
    rows = [r for r in records if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH * k for k in range(4)]
    switches = [r for r in records if r.get("event") == "plan_switch"]
    at = switches[0]["step"] if switches else None  # announced 2 steps ahead of the step the driver has seen
    assert [(s["from_version"], s["plan_version"]) for s in switches] == [(0, 1)] and at in (3, 4)
    assert [r["plan_version"] for r in rows] == [0 if r["step"] < at else 1 for r in rows]
    for name in ("metrics.jsonl", "plan_history.json", "driver_records.jsonl", "ray_address", ckpt.dir_name(2),
                 ckpt.dir_name(4)):
        assert name in s3_run["listing"], (name, s3_run["listing"])
    h = s3_run["history"]  # the plan history in the bucket: the hot upgrade, applied where it switched
    assert [(v.version, v.source, v.effective_step, v.applied, v.dbo) for v in h.versions] == [
        (0, "initial", 1, True, False), (1, "dbo", at, True, True)]
    info = ckpt.check_complete(live.checkpoint)  # the job's last checkpoint (the resumed run adds step 6)
    assert (info.path, info.step, info.plan_version, info.layout) == (live.checkpoint, 4, 1, (2, 1, 1))
    assert ckpt.load_history(info.path) == h and ckpt.check_complete(f"{live.run_dir}/{ckpt.dir_name(2)}").step == 2
    events = [r["event"] for r in s3_run["driver_records"] if "event" in r]  # appended to the object one by one
    assert {"start", "plan_accepted", "plan_switch"} <= set(events), events
    assert [r["step"] for r in s3_run["driver_records"] if "event" not in r] == [1, 2, 3, 4]
    rc, out = s3_run["status"]  # tessera status of the run, from its driver kept after the job
    assert rc == 0 and f"tessera status: {live.run_name}" in out and "4 / 4" in out, out
    assert "initial" in out and "dbo" in out and "plan versions" in out


def test_train_resume_continues_the_s3_run_bitwise(s3_run, tmp_path, capsys):
    live, driver, rows = s3_run["live"], s3_run["driver"], s3_run["rows"]
    assert s3_run["chosen"] == live.run_name  # found in the bucket by train.resume
    assert driver.recovered_from == live.checkpoint and driver.step == 4 and driver.plan_version == 1
    assert [r["step"] for r in rows] == [5, 6]  # none lost, none repeated
    assert [r["data_position"] for r in rows] == [GLOBAL_BATCH * 4, GLOBAL_BATCH * 5]
    live_rows = [r for r in s3_run["records"] if "event" not in r]
    ref = s3_run["reference"]
    assert [r["step"] for r in ref] == list(range(1, 7))
    assert [r["loss"] for r in live_rows + rows] == [r["loss"] for r in ref]  # bitwise, as on local disk
    a, b = ckpt.latest_complete(live.run_dir), ckpt.latest_complete(s3_run["ref_dir"])
    assert a.path == f"{live.run_dir}/{ckpt.dir_name(6)}" and a.step == b.step == 6
    for rank in range(2):
        x, y = ckpt.load_part(a.path, rank)["state"], ckpt.load_part(b.path, rank)["state"]
        for mx, my in zip(x["modules"], y["modules"]):
            assert mx.keys() == my.keys() and all(torch.equal(mx[k], my[k]) for k in mx)
    from tessera.cli.main import main

    assert main(["export", live.run_dir, "--to", str(tmp_path / "hf")]) == 0  # tessera export from the bucket
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"tessera export: {live.run_dir} step 6 -> ") and "model.safetensors" in line
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "hf"))
    print("object storage: Ray job {:.1f} s, resumed leg {:.1f} s, local-disk reference {:.1f} s".format(
        *s3_run["times"]))
