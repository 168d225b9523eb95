"""A Ray cluster of several nodes emulated on this machine, and the tiny job run across it on gloo.

The cluster (:func:`cluster`): a head of its own (``ray start --head --block``, 1 CPU, no worker
slot; this process joins the cluster through one of the raylets, which share one IP, so Ray may
pick the head's or a node's: Ray Train's controller runs on that node and the driver actor is
pinned to it softly; the watcher kills neither that node nor the one the driver actor is on) and three nodes joined to it (``ray start --address HEAD --resources '{"tsr_node": 2}'
--block``, each in a process group of its own, so that killing the group removes the node as a
lost machine would). Each node stands for a machine of
``hardware.gpus_per_node = 2`` workers: the job asks every worker for one ``tsr_node``
(``job.resources_per_worker``), so its 4 workers run 2 per node on two of the nodes and the third
is the spare Ray Train restarts the group onto. It is not the run's shared head
(tests/conftest.py): nodes that offer CPUs there would take other modules' workers too, and
killing one would kill them. Nor is it
``ray.cluster_utils.Cluster``: that writes its address to the machine-wide default that
``ray.init()`` reads (``/tmp/ray/ray_current_cluster``), where other processes on this shared
machine would find it; every ``ray start`` here keeps to temp directories of its own.

One job (:func:`job`: the tiny recipe, pp=2 x dp=2, ep=2, cut to 4 layers and 32-token sequences,
with ``hardware.inline.gpus_per_node=2``, so the rank order is ``ep-dp-pp``: each EP group on one
node, the pipeline across nodes), with a watcher thread beside it that

1. once step 1 is reported, upgrades the plan with ``tessera upgrade --job RUN --plan FILE``
   (1F1B, one stage per rank, layers moved between the pipeline ranks: between nodes), and
2. once a complete checkpoint holds the upgraded plan, kills one node that holds workers.

Tests, all on that job's records (``metrics.jsonl``) and Ray's own (node table, placement groups):
the workers sit as planned (the ``placement`` event, the Ray node ids the workers report, and the
nodes Ray gave their placement group agree); after the node loss the group restarts on the spare
node from the last complete checkpoint, every step once in order with replayed steps giving the
same loss, and a second ``placement`` event; the upgrade took effect at one step on every rank,
and the loss falls across the upgrade and the restart. A placement Ray cannot give as planned (3
workers on one node, 1 on another) is refused in one line by the driver's node check: checked
in-process on :meth:`tessera.train.job.driver.Driver.place_ranks` with the real node ids, as a
second Ray job to be refused would cost a cluster start of workers for one line. The local
remap of interleaved nodes: tests/test_placement_job.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.config.load import load_recipe
from tessera.train.worker import checkpoint as ckpt

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.xdist_group("ray-multinode")  # a cluster of its own (module docstring)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
RAY_BIN = str(Path(sys.executable).with_name("ray"))
SLOT = "tsr_node"  # the custom resource of an emulated node: one unit per worker it runs
GPUS_PER_NODE = 2
NODES = 3  # two for the job, one spare
RUN = "multinode"
STEPS, EVERY = 16, 2  # the kill lands between the upgraded checkpoint (step 4) and the end: 12 steps of room
GLOBAL_BATCH = 2 * 4 * 2  # dp * num_microbatches * micro_batch_size
CUT = ("model.num_layers=4", "parallel.seq_length=32", "planner.overlap=false", "planner.split_w=false")
JOB = (f"hardware.inline.gpus_per_node={GPUS_PER_NODE}", f"job.resources_per_worker.{SLOT}=1",
       "job.cpus_per_worker=0.25", "job.max_failures=2", "job.pg_timeout_s=60", "logging.wandb_mode=disabled",
       f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", f"job.run_name={RUN}")
NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port", "metrics-export-port")
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port")
# a lost node is declared dead after 10 missed health checks 1 s apart (Ray's default: 5 x 3 s);
# 3 was too few on the loaded 2-core machine: a raylet lagging 3 s is declared dead, and runs
# beside the whole suite lost the job's driver actor mid-run
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 10}
HANG_GUARD_S = 900  # the cluster is torn down after this: a hang guard, not a time budget


# --------------------------------------------------------------------------- the emulated cluster


def _die_with_parent() -> None:
    """In a ``ray start`` child before it runs: SIGTERM to it when this test process ends (Linux's
    parent-death signal), so a test run that is killed leaves no cluster behind."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(temp: str, name: str, env: dict, args: list[str]) -> tuple[subprocess.Popen, int]:
    """``ray start --block ARGS`` in a session (and process group) of its own, with its own temp
    dir ``temp/name`` and free ports; returns the process and its node manager port (how Ray's node
    table names it)."""
    from tessera.testing.launch_local import free_ports

    ports = dict(zip(NODE_PORTS, free_ports(len(NODE_PORTS))))
    node_temp = os.path.join(temp, name)
    os.makedirs(node_temp)
    cmd = [RAY_BIN, "start", "--block", "--temp-dir", node_temp, "--disable-usage-stats", "--include-log-monitor",
           "false", "--object-store-memory", str(80 * 1024 * 1024), *args]  # no log monitor: no log goes to the driver
    cmd += [x for key, port in ports.items() for x in (f"--{key}", str(port))]
    with open(os.path.join(temp, f"{name}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
    return proc, ports["node-manager-port"]


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """``sig`` to the process group of one ``ray start --block`` (SIGTERM: it stops its Ray
    processes), then SIGKILL to what is left of it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _log_tail(temp: str, name: str) -> str:
    path = os.path.join(temp, f"{name}.log")
    return Path(path).read_text()[-3000:] if os.path.exists(path) else ""


@pytest.fixture(scope="module")
def cluster():
    """The emulated cluster (module docstring), this process connected to it: ``address``,
    ``head`` (its node id), ``nodes`` (name -> node id of the ``tsr_node`` nodes), ``name_of``
    (node id -> name), ``kill(name)`` (SIGKILL to that node's process group: the node is lost)."""
    t0 = time.perf_counter()
    temp = tempfile.mkdtemp(prefix="tsr-mn-", dir="/tmp")
    env = dict(os.environ, RAY_TRAIN_ENABLE_PRINT_PATCH="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("RAY_ADDRESS", None)
    if (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"  # nodes join a head with token authentication (Ray 2.60's default)
    from tessera.testing.launch_local import free_ports

    procs: dict[str, subprocess.Popen] = {}
    saved = {k: os.environ.get(k) for k in ("RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_ADDRESS")}
    guard = threading.Timer(HANG_GUARD_S, lambda: [_stop(p, signal.SIGKILL) for p in list(procs.values())])
    guard.daemon = True
    guard.start()
    try:
        head_ports = [x for key, port in zip(HEAD_PORTS, free_ports(len(HEAD_PORTS))) for x in (f"--{key}", str(port))]
        procs["head"], head_port = _start(temp, "head", env, [
            "--head", "--num-cpus", "1", "--include-dashboard", "false", "--system-config", json.dumps(SYSTEM_CONFIG),
            *head_ports])
        current = Path(temp, "head", "ray_current_cluster")
        deadline = time.monotonic() + 180
        while not current.exists():
            assert procs["head"].poll() is None and time.monotonic() < deadline, _log_tail(temp, "head")
            time.sleep(0.2)
        address = current.read_text().strip()
        ports = {"head": head_port}
        node_args = ["--address", address, "--num-cpus", "1", "--resources", json.dumps({SLOT: GPUS_PER_NODE})]
        tries: Counter = Counter()
        for i in range(NODES):  # each in a temp dir of its own: started together, their sockets cannot clash
            procs[f"node{i}"], ports[f"node{i}"] = _start(temp, f"node{i}", env, node_args)
        os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
        os.environ.pop("RAY_ADDRESS", None)
        ray.init(address="auto", _temp_dir=os.path.join(temp, "head"), logging_level="ERROR", log_to_driver=False)
        assert ray.get_runtime_context().gcs_address == address
        by_port: dict[int, str] = {}
        while not set(ports.values()) <= set(by_port):
            by_port = {n["NodeManagerPort"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert procs["head"].poll() is None, _log_tail(temp, "head")
            for name, proc in list(procs.items()):
                # a node that gave up registering (Ray waits 30 s; a loaded machine can take longer) starts again
                if proc.poll() is not None and ports[name] not in by_port:
                    tries[name] += 1
                    assert tries[name] <= 2, (name, _log_tail(temp, f"{name}-{tries[name] - 1}" if tries[name] > 1
                                                          else name))
                    procs[name], ports[name] = _start(temp, f"{name}-{tries[name]}", env, node_args)
            assert time.monotonic() < deadline, ("nodes missing", by_port, ports)
            time.sleep(0.2)
        ids = {name: by_port[port] for name, port in ports.items()}
        print(f"emulated cluster of {NODES} nodes + head up in {time.perf_counter() - t0:.1f} s")
        yield SimpleNamespace(address=address, head=ids["head"], temp=temp,
                              nodes={n: i for n, i in ids.items() if n != "head"},
                              name_of={i: n for n, i in ids.items()},
                              kill=lambda name: _stop(procs[name], signal.SIGKILL))
    finally:
        guard.cancel()
        ray.shutdown()
        for proc in procs.values():  # all at once, then each waited for
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- the job


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _rows(records) -> list[dict]:
    return [r for r in records if "event" not in r]


def _worker_groups() -> dict[str, dict]:
    """Ray's placement groups of the job's worker groups (bundles asking for ``tsr_node``), by id:
    ``{"nodes": [node id of each bundle, None while unplaced], "state"}``."""
    out = {}
    for pg_id, pg in ray.util.placement_group_table().items():
        if pg["bundles"] and all(SLOT in b for b in pg["bundles"].values()):
            out[pg_id] = {"nodes": [pg["bundles_to_node_id"].get(i) for i in sorted(pg["bundles"])],
                          "state": pg["state"]}
    return out


def _actor_node(name: str) -> str | None:
    """The node id of the live actor named ``name`` (Ray's actor table in the GCS; the state API
    needs the dashboard, which this cluster runs without), None if there is none."""
    from ray._private import state

    return next((a["Address"]["NodeID"] for a in state.actors().values()
                 if a.get("Name") == name and a.get("State") == "ALIVE"), None)


def _watch(cluster, run_dir: Path, plan_file: Path, seen: dict) -> threading.Thread:
    """The watcher (module docstring): upgrade once step 1 is reported, kill a node holding
    workers once a complete checkpoint holds the upgraded plan; what it saw goes to ``seen``."""
    from tessera.cli.main import main
    from tessera.train.job.driver import NAMESPACE, driver_name

    def run():
        deadline = time.monotonic() + HANG_GUARD_S
        try:
            while True:
                try:
                    actor = ray.get_actor(driver_name(RUN), namespace=NAMESPACE)
                    break
                except ValueError:  # not created yet
                    assert time.monotonic() < deadline, "the driver never started"
                    time.sleep(0.2)
            while ray.get(actor.status.remote(history=0), timeout=60)["step"] < 1:
                assert time.monotonic() < deadline, "no step reported"
                time.sleep(0.2)
            plan = ray.get(actor.plan_dict.remote(), timeout=60)["plan"]
            # 1F1B, one stage per rank: layer 1 moves to pipeline rank 0, layer 2 to rank 1 (another node)
            plan = {k: v for k, v in plan.items() if k != "schedule"}  # a synthesized order is for its own shape
            plan_file.write_text(json.dumps({"plan": dict(plan, template="1f1b", vpp=1, partition={"bounds": [-1, 1, 5]},
                                                          pair_orders=[])}))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                seen["upgrade_rc"] = main(["upgrade", "--job", RUN, "--plan", str(plan_file)])
            seen["upgrade_out"] = out.getvalue().splitlines()
            seen["status"] = ray.get(actor.status.remote(history=0), timeout=60)
            while True:
                info = ckpt.latest_complete(str(run_dir)) if run_dir.is_dir() else None
                if info is not None and info.plan_version == 1:
                    break
                assert time.monotonic() < deadline, "no checkpoint of the upgraded plan"
                time.sleep(0.05)
            live = [g for g in _worker_groups().values() if g["state"] == "CREATED"]
            while len(live) != 1:  # a group being created or removed under load: wait for the one
                assert time.monotonic() < deadline, ("worker groups", _worker_groups())
                time.sleep(0.05)
                live = [g for g in _worker_groups().values() if g["state"] == "CREATED"]
            # neither the launcher's node (Ray Train's controller runs there, and this process may
            # have joined a node's raylet instead of the head's: they share an IP) nor the driver
            # actor's (pinned there softly; a restarted driver counts its attempts afresh)
            keep = {ray.get_runtime_context().get_node_id(), _actor_node(driver_name(RUN))}
            seen["kept_nodes"] = sorted(n for n in keep if n)
            victim = cluster.name_of[next(n for n in live[0]["nodes"] if n not in keep)]
            seen["checkpoint"], seen["first_group"], seen["killed"] = info, live[0]["nodes"], victim
            cluster.kill(victim)
            # the restarted group, once it has started (the driver counts worker-group starts)
            while ray.get(actor.status.remote(history=0), timeout=60)["attempts"] < 2:
                assert time.monotonic() < deadline, "the worker group did not restart"
                time.sleep(0.1)
            seen["second_group"] = [g["nodes"] for g in _worker_groups().values() if g["state"] == "CREATED"]
        except Exception:  # noqa: BLE001 - reported by the tests' assertions, where it was raised
            seen["error"] = traceback.format_exc(limit=2) + f" (seen so far: {sorted(seen)})"

    t = threading.Thread(target=run, name="multinode-watcher", daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    """The job of the module docstring on :func:`cluster`, with its watcher; its result, records,
    what the watcher saw (Ray's placement groups of both worker groups among it), and Ray's node
    table after it."""
    from tessera.train.job.run import run_job

    out = tmp_path_factory.mktemp("multinode")
    recipe = load_recipe(TINY, [*CUT, *JOB, f"logging.out_dir={out}"])
    seen: dict = {}
    watcher = _watch(cluster, out / RUN, out / "plan.json", seen)
    t0 = time.perf_counter()
    result = run_job(recipe, progress=False)
    watcher.join(timeout=120)
    print(f"multinode job: {time.perf_counter() - t0:.1f} s wall, planning {result.plan_s:.1f} s")
    assert "error" not in seen, seen["error"]
    assert "killed" in seen, {k: v for k, v in seen.items() if k != "upgrade_out"}
    return SimpleNamespace(result=result, records=_records(result.metrics_path), seen=seen, recipe=recipe,
                           alive={n["NodeID"]: n["Alive"] for n in ray.nodes()}, plan_file=out / "plan.json")


def _placements(records) -> list[dict]:
    return [r for r in records if r.get("event") == "placement"]


def test_workers_sit_as_planned_two_per_node(job, cluster):
    """EP groups inside a node, the pipeline across nodes, 2 workers on each of 2 emulated nodes;
    the node ids the workers reported and the nodes Ray gave their placement group agree."""
    from tessera.spec.placement import place

    first = _placements(job.records)[0]
    assert "error" not in first, first
    assert (first["order"], first["nodes"], first["ranks"], first["remapped"]) == ("ep-dp-pp", [0, 0, 1, 1], [], False)
    groups = first["placement"]["groups"]
    assert groups["ep"]["nodes"] == 1 and groups["ep"]["local"] == 2  # each EP group: one node's two workers
    assert groups["pipeline"]["nodes"] == 2 and groups["pipeline"]["crosses_nodes"]
    assert first["placement"]["crossing"] == ["pipeline"] and first["placement"]["num_nodes"] == 2
    assert first["placement"] == place(2, 2, 2, GPUS_PER_NODE).to_dict()  # what the plan assumed, exactly
    ids = first["node_ids"]
    assert ids[0] == ids[1] != ids[2] == ids[3], ids
    assert set(ids) <= set(cluster.nodes.values()) and cluster.head not in ids  # only on tsr_node nodes
    # Ray's own record of where it put the worker group: the same two nodes, two workers each
    assert Counter(job.seen["first_group"]) == Counter(ids) == Counter({ids[0]: 2, ids[2]: 2})
    assert cluster.name_of[ids[0]] != cluster.name_of[ids[2]]


def test_a_lost_node_restarts_the_group_on_the_spare_from_the_last_checkpoint(job, cluster):
    """The node killed after a checkpoint: Ray declares it dead, the worker group restarts on the
    survivor and the spare node from the newest complete checkpoint, steps replayed from there
    give the same losses, and the job ends with every step and a complete final checkpoint."""
    seen, records = job.seen, job.records
    killed = cluster.nodes[seen["killed"]]
    assert job.alive[killed] is False  # Ray's node table
    starts = [r for r in records if r.get("event") == "start"]
    assert [s["attempt"] for s in starts] == [0, 1], starts
    resume = starts[1]["resume_step"]
    assert resume >= seen["checkpoint"].step and resume % EVERY == 0  # the newest complete one when it restarted
    assert not [r for r in records if r.get("event") == "driver_restart"]  # the driver, on the head, lived on

    rows = _rows(records)
    by_attempt = [[r for r in rows if r["attempt"] == k] for k in (0, 1)]
    first, second = ([r["step"] for r in rs] for rs in by_attempt)
    assert first == list(range(1, len(first) + 1)) and second == list(range(resume + 1, STEPS + 1))
    assert resume <= first[-1] < STEPS  # nothing lost: the restart picks up at or before the last step run
    assert all(r["data_position"] == (r["step"] - 1) * GLOBAL_BATCH for r in rows)
    before = {r["step"]: r["loss"] for r in by_attempt[0]}
    for r in by_attempt[1]:  # a replayed step reads the same data from the same state
        if r["step"] in before:
            assert r["loss"] == pytest.approx(before[r["step"]], rel=1e-4, abs=1e-4), r["step"]

    # the second group: again 2 per node, the EP groups inside a node, now on the survivor and the spare
    again = _placements(records)[1]
    assert (again["nodes"], again["remapped"]) == ([0, 0, 1, 1], False)
    assert again["placement"]["groups"]["ep"]["nodes"] == 1
    survivor = (set(seen["first_group"]) - {killed}).pop()
    spare = (set(cluster.nodes.values()) - set(seen["first_group"])).pop()
    assert killed not in again["node_ids"] and Counter(again["node_ids"]) == Counter({survivor: 2, spare: 2})
    assert [Counter(g) for g in seen["second_group"]] == [Counter(again["node_ids"])]  # Ray's record of it

    final = ckpt.latest_complete(job.result.run_dir)
    assert final.step == STEPS and final.world_size == 4 and final.data_position == STEPS * GLOBAL_BATCH
    assert job.result.steps == STEPS and job.result.attempts == 2 and job.result.checkpoint == final.path


def test_a_hot_upgrade_moves_layers_across_nodes_and_training_goes_on(job):
    """``tessera upgrade --plan`` on the running job: one switch, at the step it announced, on
    every rank; layers moved between the pipeline ranks (on different nodes); the restarted group
    runs the upgraded plan; the loss falls across the switch and the restart."""
    seen, rows = job.seen, _rows(job.records)
    assert seen["upgrade_rc"] == 0, seen["upgrade_out"]
    announced = [ln for ln in seen["upgrade_out"] if ln.startswith(f"tessera upgrade: {RUN}: plan version 1 takes "
                                                                    "effect at step ")]
    assert len(announced) == 1 and announced[0].endswith(f"(plan {job.plan_file})"), seen["upgrade_out"]
    at = int(announced[0].split("takes effect at step ")[1].split()[0])
    switches = [r for r in job.records if r.get("event") == "plan_switch"]
    assert [(s["from_version"], s["plan_version"], s["step"]) for s in switches] == [(0, 1, at)]
    assert [r["plan_version"] for r in rows] == [0 if r["step"] < at else 1 for r in rows]
    by_step = {r["step"]: r for r in rows if r["attempt"] == 0}
    assert by_step[at]["plan_switch_from"] == 0 and by_step[at]["plan_switch_moved_bytes"] > 0
    assert seen["status"]["placement"]["nodes"] == [0, 0, 1, 1]  # the driver's status says where the ranks run
    assert ckpt.latest_complete(job.result.run_dir).plan_version == 1
    losses = [r["loss"] for r in sorted(rows, key=lambda r: (r["step"], r["attempt"]))]
    assert all(math.isfinite(x) for x in losses) and abs(losses[0] - math.log(256)) < 0.5
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_a_placement_ray_cannot_give_as_planned_is_refused_in_one_line(cluster, tmp_path):
    """The driver's node check on the emulated nodes' real ids: 3 workers on one node and 1 on
    another (nodes of 3 slots) is refused before training in one line naming the group that would
    cross nodes, kept as the job's fatal error and recorded; workers dealt round-robin over two
    nodes are mapped instead."""
    from tessera.errors import TesseraConfigError
    from tessera.train.job.driver import Driver

    recipe = load_recipe(TINY, [*CUT, *JOB, f"logging.out_dir={tmp_path}"])
    a, b, _ = sorted(cluster.nodes.values())
    driver = Driver(recipe.to_dict(), str(tmp_path / "run"), "refused")
    got = driver.place_ranks([a, a, a, b])
    err = got["error"]
    assert isinstance(err, TesseraConfigError) and "\n" not in str(err)
    assert str(err).startswith("parallel.rank_order='ep-dp-pp': the workers' nodes put ep groups across 2 nodes")
    assert "(3, 1 workers on 2 nodes, hardware.gpus_per_node=2)" in str(err)
    assert "give every node 2 workers (one per GPU)" in str(err)
    assert driver.fatal_error() == (0, err)  # restarted workers fail fast with it (a restart cannot help)
    recorded = [r for r in _records(tmp_path / "run" / "driver_records.jsonl") if r.get("event") == "placement"]
    assert [r["error"] for r in recorded] == [str(err)]
    assert driver.status()["placement"] is None

    mapped = driver.place_ranks([a, b, a, b])
    assert (mapped["remapped"], mapped["ranks"], mapped["nodes"]) == (True, [0, 2, 1, 3], [0, 1, 0, 1])
    assert driver.status()["placement"]["node_ids"] == [a, b, a, b]
