"""The job's options and the worker side without Ray: the recipe's ``job`` section (defaults,
rules), the ``tessera train`` flags as ``job.*`` overrides, worker-hook specs (resolution and
their one-line errors, the fault-injection hooks), and :class:`tessera.train.worker.loop.WorkerLoop`'s
methods on a fake driver and session (real data, metrics and checkpoint files); its plan switch on
two local gloo ranks (``run_local``) with real step runners, moving a layer between them. The
same loop under Ray Train is ``tests/test_train_ray.py``."""

from __future__ import annotations

import os
import pickle
import statistics
from pathlib import Path

import pytest
import torch

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError
from tessera.train.worker import checkpoint as ckpt
from tessera.train.worker.step import StepMetrics

pytestmark = pytest.mark.xdist_group("train_job")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
ONE_RANK = ["parallel.pp=1", "parallel.vpp=1", "parallel.dp=1", "parallel.ep=1", "planner.template=1f1b"]


# --------------------------------------------------------------------------- the job section


def test_job_section_defaults_and_round_trip():
    from tessera.config.schema import JobConfig
    from tessera.train.job.driver import NAMESPACE

    job = load_recipe(TINY).job
    assert job == JobConfig()
    assert (job.run_name, job.namespace, job.max_failures, job.cpus_per_worker, job.threads) == (
        None, "tessera", 3, None, None)
    assert (job.detached_driver, job.keep_driver, job.pg_timeout_s, job.num_to_keep) == (False, False, 300.0, 3)
    assert job.namespace == NAMESPACE  # the driver's default namespace
    r = load_recipe(TINY, ["job.max_failures=-1", "job.cpus_per_worker=0.25", "job.num_to_keep=null"])
    assert r.to_dict()["job"] == {"run_name": None, "namespace": "tessera", "max_failures": -1, "cpus_per_worker": 0.25,
                                  "threads": None, "detached_driver": False, "keep_driver": False,
                                  "pg_timeout_s": 300.0, "num_to_keep": None, "upgrade_lead_steps": 2,
                                  "reshard_method": "p2p", "socket_ifname": None, "oversubscribe": False,
                                  "resources_per_worker": None}
    assert r.with_overrides([]) == r and pickle.loads(pickle.dumps(r)).job == r.job


def test_job_section_from_a_recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(Path(TINY).read_text() + "job:\n  run_name: mine\n  threads: 2\n  pg_timeout_s: 60\n")
    job = load_recipe(str(p)).job
    assert (job.run_name, job.threads, job.pg_timeout_s, job.max_failures) == ("mine", 2, 60.0, 3)


JOB_RULES = [
    ("job.run_name=a/b", "job.run_name='a/b'", "plain directory name"),
    ("job.run_name=..", "job.run_name='..'", "plain directory name"),
    ("job.namespace=' '", "job.namespace=' '", "must not be empty"),
    ("job.max_failures=-2", "job.max_failures=-2", "must be >= -1"),
    ("job.cpus_per_worker=0", "job.cpus_per_worker=0.0", "must be null or a finite number > 0"),
    ("job.cpus_per_worker=inf", "job.cpus_per_worker=inf", "finite number > 0"),
    ("job.threads=0", "job.threads=0", "must be null or >= 1"),
    ("job.pg_timeout_s=0.5", "job.pg_timeout_s=0.5", "must be a finite number >= 1"),
    ("job.num_to_keep=0", "job.num_to_keep=0", "must be null or >= 1"),
    ("job.socket_ifname=''", "job.socket_ifname=''", "interface names separated by commas"),
    ("job.socket_ifname=eth0,", "job.socket_ifname='eth0,'", "interface names separated by commas"),
    ("job.socket_ifname='eth 0'", "job.socket_ifname='eth 0'", "interface names separated by commas"),
    ("job.socket_ifname==eth0", "job.socket_ifname='=eth0'", "NCCL's '^' and '=' prefixes are not gloo's"),
    ("job.socket_ifname=a_very_long_name0", "job.socket_ifname='a_very_long_name0'", "each 1-15 letters"),
    ("job.resources_per_worker.trainer=-1", "job.resources_per_worker.trainer=-1", "must be a finite number > 0"),
    ("job.resources_per_worker.trainer=many", "job.resources_per_worker.trainer='many'", "finite number > 0"),
    ("job.resources_per_worker={trainer: true}", "job.resources_per_worker.trainer=True", "finite number > 0"),
    ("job.resources_per_worker.GPU=1", "job.resources_per_worker.GPU=1", "GPU is not an extra resource"),
    ("job.resources_per_worker.CPU=0.5", "job.resources_per_worker.CPU=0.5", "job.cpus_per_worker"),
]


@pytest.mark.parametrize("override,start,rule", JOB_RULES, ids=[o for o, _, _ in JOB_RULES])
def test_job_rules_are_one_line_naming_the_field(override, start, rule):
    from tessera.flow import resolve

    with pytest.raises(TesseraConfigError) as e:
        resolve(load_recipe(TINY, [override]))
    msg = str(e.value)
    assert msg.startswith(f"{start}: ") and rule in msg and "; fix: " in msg and "\n" not in msg, msg


def test_job_rules_accept_their_edge_values():
    from tessera.flow import resolve

    r = load_recipe(TINY, ["job.max_failures=-1", "job.cpus_per_worker=0.01", "job.threads=1", "job.pg_timeout_s=1",
                           "job.num_to_keep=1", "job.run_name=r-1.x"])
    assert resolve(r).recipe.job.max_failures == -1
    for ifname in ("eth0", "enp5s0f1,ib0", "bond0.100", "eth0:1", "x" * 15):
        assert resolve(load_recipe(TINY, [f"job.socket_ifname={ifname}"])).recipe.job.socket_ifname == ifname


def test_socket_ifname_must_name_interfaces_of_the_machine_that_checks():
    from tessera.config.job_rules import check_socket_ifname_here

    job = load_recipe(TINY, ["job.socket_ifname=eth1,ib0"]).job
    check_socket_ifname_here(job, have=["lo", "eth1", "ib0"])
    check_socket_ifname_here(load_recipe(TINY).job, have=[])  # null: nothing to check
    with pytest.raises(TesseraConfigError) as e:
        check_socket_ifname_here(job, "node n1 (worker rank 3)", have=["lo", "eth0"])
    assert str(e.value) == ("job.socket_ifname='eth1,ib0': names interface(s) eth1, ib0 that node n1 (worker rank 3) "
                            "does not have (it has eth0, lo); fix: use e.g. job.socket_ifname=eth0 (`ip -o link` "
                            "lists a node's interfaces), or null to let gloo and NCCL choose")
    check_socket_ifname_here(load_recipe(TINY, ["job.socket_ifname=lo"]).job)  # this machine's own list


def test_trainer_values_come_from_the_job_section():
    from tessera.train.job.trainer import worker_resources, worker_threads

    r = load_recipe(TINY)  # 4 CPU workers
    assert worker_resources(r, {"CPU": 2.0}) == {"CPU": 0.5}
    assert worker_resources(r, {"CPU": 16.0}) == {"CPU": 1.0}
    assert worker_resources(r.with_overrides(["job.cpus_per_worker=0.25"]), {"CPU": 2.0}) == {"CPU": 0.25}
    gpu = r.with_overrides(["hardware.preset=h800", "job.cpus_per_worker=4"])
    assert worker_resources(gpu, {}) == {"GPU": 1.0, "CPU": 4.0}
    assert worker_threads(r, {"CPU": 2.5}) == 2 and worker_threads(r, {"CPU": 0.25}) == 1
    assert worker_threads(r.with_overrides(["job.threads=3"]), {"CPU": 0.25}) == 3
    pinned = ["job.resources_per_worker={trainer: 1, 'accelerator_type:H100': 0.5}"]
    assert worker_resources(r.with_overrides(pinned), {"CPU": 2.0}) == {"CPU": 0.5, "trainer": 1.0,
                                                                       "accelerator_type:H100": 0.5}
    assert worker_resources(gpu.with_overrides(pinned), {}) == {"GPU": 1.0, "CPU": 4.0, "trainer": 1.0,
                                                               "accelerator_type:H100": 0.5}


def test_cluster_error_names_the_job_field():
    from tessera.train.job.preflight import check_cluster

    with pytest.raises(TesseraConfigError) as e:
        check_cluster(load_recipe(TINY, ["job.cpus_per_worker=2"]), {"CPU": 2.0})
    assert str(e.value).startswith("job.cpus_per_worker=2.0: 4 workers (pp*dp = 2*2) x 2 CPU = 8 CPU exceed")
    assert "use job.cpus_per_worker <= 0.5 (--cpus-per-worker)" in str(e.value)
    pinned = load_recipe(TINY, ["job.resources_per_worker.trainer=1"])
    assert check_cluster(pinned, {"CPU": 2.0, "trainer": 4.0}) == {"CPU": 0.5, "trainer": 1.0}
    with pytest.raises(TesseraConfigError) as e:  # Ray would wait for the fourth worker's node forever
        check_cluster(pinned, {"CPU": 2.0, "trainer": 3.0})
    assert str(e.value).startswith("job.resources_per_worker.trainer=1: 4 workers (pp*dp = 2*2) x 1 trainer = 4 "
                                   "trainer exceed the cluster's 3 trainer")
    assert "ray start --resources '{\"trainer\": N}'" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- flags -> job.*


def _train_args(*argv: str):
    from tessera.cli.main import build_parser

    return build_parser(only="train").parse_args(["train", *argv])


def test_job_flags_are_job_overrides():
    from tessera.cli.train import job_overrides, load_train_recipe

    args = _train_args(TINY, "train.steps=3", "--run-name", "true", "--namespace", "ns", "--max-failures", "0",
                       "--cpus-per-worker", "0.25", "--detached-driver", "--keep-driver")
    assert job_overrides(args) == ['job.run_name="true"', 'job.namespace="ns"', "job.max_failures=0",
                                   "job.cpus_per_worker=0.25", "job.detached_driver=true", "job.keep_driver=true"]
    r = load_train_recipe(args)
    assert r.train.steps == 3
    assert (r.job.run_name, r.job.namespace, r.job.max_failures, r.job.cpus_per_worker) == ("true", "ns", 0, 0.25)
    assert r.job.detached_driver and r.job.keep_driver


def test_unset_flags_leave_the_recipe_and_a_flag_wins_over_an_override():
    from tessera.cli.train import job_overrides, load_train_recipe

    plain = _train_args(TINY, "job.max_failures=5", "job.run_name=r")
    assert job_overrides(plain) == []
    assert (load_train_recipe(plain).job.max_failures, load_train_recipe(plain).job.run_name) == (5, "r")
    flag = _train_args(TINY, "job.max_failures=5", "--max-failures", "1")
    assert load_train_recipe(flag).job.max_failures == 1
    no_recipe = _train_args("train.steps=2", "--run-name", "1e3")  # the recipe argument is an override
    r = load_train_recipe(no_recipe)
    assert (r.name, r.train.steps, r.job.run_name) == ("tiny-qwen3-next", 2, "1e3")


def test_a_bad_flag_value_is_the_job_rule(capsys):
    from tessera.cli.main import main

    rc = main(["train", TINY, "--max-failures", "-5", "--address", "127.0.0.1:1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("tessera train: error: job.max_failures=-5: must be >= -1 (worker-group restarts; "
                             "-1: no limit); fix: ")


# --------------------------------------------------------------------------- hooks


def test_fault_hooks_from_the_environment():
    from tessera.testing import faults
    from tessera.train.worker.hooks import ENV_HOOKS, HookSpec, hooks_from_env, resolve_hooks

    assert list(ENV_HOOKS) == [faults.FAULT_ENV, faults.CKPT_FAULT_ENV, "TESSERA_SLOW_RANK"]
    specs = hooks_from_env({faults.FAULT_ENV: "1:7", faults.CKPT_FAULT_ENV: "2:4", "OTHER": "x"})
    assert specs == (HookSpec("tessera.testing.faults:kill_after_step", {"text": "1:7"}, faults.FAULT_ENV),
                     HookSpec("tessera.testing.faults:kill_in_checkpoint", {"text": "2:4"}, faults.CKPT_FAULT_ENV))
    assert resolve_hooks(specs) == (faults.KillAfterStep(1, 7), faults.KillInCheckpoint(2, 4))
    assert hooks_from_env({faults.FAULT_ENV: ""}) == () and hooks_from_env({}) == ()
    with pytest.raises(TesseraConfigError, match=r"^TESSERA_FAULT_AT='7': must be RANK:STEP; fix: e.g. "):
        resolve_hooks(hooks_from_env({faults.FAULT_ENV: "7"}))


BAD_HOOKS = [
    ("nocolon", "hook='nocolon': must be an import path module:factory"),
    ("no_such_module_x:f", "hook='no_such_module_x:f': module 'no_such_module_x' cannot be imported "
                           "(ModuleNotFoundError: No module named 'no_such_module_x'); fix: give an installed module"),
    ("tessera.testing.faults:kill_after_stp", "has no callable 'kill_after_stp'; fix: did you mean "
                                              "tessera.testing.faults:kill_after_step?"),
    ("builtins:dict", "hook='builtins:dict': returned a dict without after_step, die_before_marker"),
]


@pytest.mark.parametrize("path,needle", BAD_HOOKS, ids=[p for p, _ in BAD_HOOKS])
def test_a_bad_hook_spec_is_one_line(path, needle):
    from tessera.train.worker.hooks import HookSpec, resolve_hook

    with pytest.raises(TesseraConfigError) as e:
        resolve_hook(HookSpec(path))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_hook_factory_rejecting_its_arguments():
    from tessera.train.worker.hooks import HookSpec, resolve_hook

    with pytest.raises(TesseraConfigError, match=r"the factory failed with arguments \{'rank': 1\} \(TypeError: "):
        resolve_hook(HookSpec("tessera.testing.faults:kill_after_step", {"rank": 1}, origin="hooks[0]"))


def test_worker_config_carries_hooks_as_plain_values():
    from tessera.train.worker.hooks import HookSpec
    from tessera.train.worker.loop import WorkerConfig

    cfg = WorkerConfig({"name": "x"}, "run", "/tmp/run", "tessera-driver-run", threads=2,
                       hooks=(HookSpec("m:f", {"text": "1:2"}, "ENV"),))
    d = pickle.loads(pickle.dumps(cfg.to_dict()))
    assert d["hooks"] == [{"path": "m:f", "kwargs": {"text": "1:2"}, "origin": "ENV"}]
    assert WorkerConfig.from_dict(d) == cfg


# --------------------------------------------------------------------------- WorkerLoop without Ray


class FakeDriver:
    """The driver's answers for one rank; ``upgrade_at``: version 1 is pending, announced for that step."""

    def __init__(self, program: dict, upgrade_at: int | None = None, plan_shape: dict | None = None):
        self.program, self.upgrade_at, self.plan_shape = program, upgrade_at, plan_shape
        self.calls: list[tuple] = []
        self.claimed: set[str] = set()

    def call(self, method, *args):
        self.calls.append((method, *args))
        if method == "worker_group_started":
            return 5
        if method == "pending_versions":
            return [[1, self.upgrade_at]] if self.upgrade_at is not None else []
        if method == "get_program":
            got = {"plan_version": 1, "program": self.program}
            return got if self.plan_shape is None else {**got, "plan_shape": self.plan_shape}
        if method == "plan_dict":
            return {"plan": {"name": "p"}, "plan_version": 0}
        if method == "claim_fault":
            new = args[0] not in self.claimed
            self.claimed.add(args[0])
            return new
        return None

    def send(self, method, *args):
        self.calls.append(("send " + method, *args))


class LocalSession:
    """One process: broadcast is the identity; saves write the real checkpoint files."""

    def __init__(self, run_dir: str, ray_checkpoint: str | None = None):
        self.run_dir, self.ray_checkpoint = run_dir, ray_checkpoint
        self.saved: list[tuple] = []
        self.barriers = 0

    def broadcast(self, obj, rank):
        return obj

    def checkpoint_path(self):
        return self.ray_checkpoint

    def save(self, step, metrics, *, die_before_marker=False, **part):
        self.saved.append((step, metrics, die_before_marker))
        ckpt.write_part(os.path.join(self.run_dir, ckpt.dir_name(step)), step=step, **part)

    def barrier(self):
        self.barriers += 1

    def reduce_switch(self, moved_bytes, seconds):
        return moved_bytes, seconds


class FakeRunner:
    def __init__(self):
        self.w = torch.zeros(2)
        self.programs: list = []
        self.batches: list[torch.Tensor] = []

    def run(self, tokens):
        self.batches.append(tokens)
        self.w += 1
        return StepMetrics(loss=2.0, wall_ms=10.0, idle_ms=2.5)

    def state_dict(self):
        return {"w": self.w.clone()}

    def load_state_dict(self, state):
        self.w = state["w"].clone()

    def holds_stages_of(self, state):
        return True

    def set_program(self, program, *args):
        self.programs.append(program)


@pytest.fixture(scope="module")
def one_rank():
    """The one-rank tiny recipe (3 steps, checkpoints every 2) and its baseline Program."""
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve

    recipe = load_recipe(TINY, [*ONE_RANK, "train.steps=3", "train.checkpoint_every=2"])
    res = resolve(recipe)
    program = compile_programs(build_baseline(res, build_costs(res)))[0]
    return recipe, res.model, program


def _loop(one_rank, run_dir, hooks=(), upgrade_at=None, runner=None):
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    recipe, model, program = one_rank
    cfg = WorkerConfig(recipe.to_dict(), "r", str(run_dir), "tessera-driver-r")
    return WorkerLoop(cfg, recipe, rank=0, world=1, device="cpu", driver=FakeDriver(program.to_dict(), upgrade_at),
                      runner=runner or FakeRunner(), data=shard_for(recipe, 0), model=model, version=0, hooks=hooks,
                      session=LocalSession(str(run_dir)))


def test_worker_loop_runs_reports_and_checkpoints_in_order(one_rank, tmp_path):
    from tessera.testing.faults import KillInCheckpoint

    loop = _loop(one_rank, tmp_path / "run", hooks=(KillInCheckpoint(0, 2),))
    loop.run()
    calls = [c[0] for c in loop.driver.calls]
    assert calls == ["worker_group_started", "pending_versions", "send report", "pending_versions", "send report",
                     "plan_dict", "claim_fault", "pending_versions", "send report", "plan_dict", "ready"]
    assert loop.driver.calls[0] == ("worker_group_started", 0, [])
    assert loop.attempt == 5 and loop.session.barriers == 1
    reports = [c for c in loop.driver.calls if c[0] == "send report"]
    per_step = 1 * 4 * 2  # dp * num_microbatches * micro_batch_size sequences
    assert [(r[1], r[2], r[3]["data_position"], r[3]["attempt"]) for r in reports] == [
        (0, s, (s - 1) * per_step, 5) for s in (1, 2, 3)]
    first = reports[0][3]
    assert first["loss"] == 2.0 and first["iteration_ms"] == 10.0 and first["bubble_ratio"] == 0.25
    assert first["tokens"] == per_step * 64 and first["mfu"] > 0 and first["plan_version"] == 0
    # step 2 (every 2) and step 3 (the last); the hook asked to die at step 2 exactly once
    assert [(s, m["step"], die) for s, m, die in loop.session.saved] == [(2, 2, True), (3, 3, False)]
    info = ckpt.check_complete(str(tmp_path / "run" / ckpt.dir_name(3)))
    assert (info.step, info.world_size, info.layout, info.data_position) == (3, 1, (1, 1, 1), 3 * per_step)
    assert torch.equal(ckpt.load_part(info.path, 0)["state"]["w"], torch.full((2,), 3.0))
    assert ckpt.load_plan(info.path) == ({"name": "p"}, 0, 3)
    assert len(loop.runner.batches) == 3 and loop.runner.batches[0].shape == (4, 2, 65)


class StoppingDriver(FakeDriver):
    """:class:`FakeDriver` with :class:`~tessera.train.worker.links.DriverLink`'s ``submit`` /
    ``poll`` (answered at once); the launcher's stop request (SIGTERM) is there from the
    ``stop_at``-th question on."""

    def __init__(self, program: dict, stop_at: int):
        super().__init__(program)
        self.stop_at, self.asked = stop_at, 0

    def submit(self, method, *args):
        if method == "stop_requested":
            self.asked += 1
            return "SIGTERM" if self.asked >= self.stop_at else None
        return self.call(method, *args)

    def poll(self, ref):
        return True, ref


@pytest.mark.parametrize("stop_at,last,saved", [(1, 1, []), (2, 2, [2])])
def test_worker_loop_stops_at_a_step_boundary_when_asked(one_rank, tmp_path, stop_at, last, saved):
    """A stop request (asked at the start of an iteration, read at its end): the loop ends after
    that iteration, whose checkpoint is written when due (every 2 steps of 3 here), then finishes
    as after the last step (the driver has every report, the barrier)."""
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    recipe, model, program = one_rank
    cfg = WorkerConfig(recipe.to_dict(), "r", str(tmp_path / "run"), "tessera-driver-r")
    loop = WorkerLoop(cfg, recipe, rank=0, world=1, device="cpu", driver=StoppingDriver(program.to_dict(), stop_at),
                      runner=FakeRunner(), data=shard_for(recipe, 0), model=model, version=0,
                      session=LocalSession(str(tmp_path / "run")))
    loop.run()
    assert [c[2] for c in loop.driver.calls if c[0] == "send report"] == list(range(1, last + 1))
    assert len(loop.runner.batches) == last and loop.driver.asked == last
    assert [step for step, _, _ in loop.session.saved] == saved
    assert loop.driver.calls[-1] == ("ready",) and loop.session.barriers == 1


def test_worker_loop_restores_the_newest_complete_checkpoint(one_rank, tmp_path):
    run = tmp_path / "run"
    _loop(one_rank, run).run()
    os.makedirs(run / ckpt.dir_name(9))  # partial: no markers
    again = _loop(one_rank, run)
    assert again.restore() == 3
    assert again.driver.calls == [("worker_group_started", 3, [ckpt.dir_name(9)])]
    assert torch.equal(again.runner.w, torch.full((2,), 3.0)) and again.data.position == 3 * 8
    assert not (run / ckpt.dir_name(9)).exists()
    wrong = _loop(one_rank, run)
    wrong.layout = (2, 2, 2)  # as a recipe of another layout would have it
    with pytest.raises(RuntimeError, match=r"has layout \(pp, dp, ep\) = \(1, 1, 1\), the recipe \(2, 2, 2\)"):
        wrong.restore()


class DistSession(LocalSession):
    """:class:`LocalSession` over the ranks of a ``run_local`` world: broadcast and the switch's
    reduction are the real worker session's collectives (no Ray: no Ray checkpoint)."""

    def __init__(self, run_dir: str):
        from tessera.train.worker.links import RaySession

        super().__init__(run_dir)
        self.ray = RaySession()

    def broadcast(self, obj, rank):
        return self.ray.broadcast(obj, rank)

    def reduce_switch(self, moved_bytes, seconds):
        return self.ray.reduce_switch(moved_bytes, seconds)


# two pipeline ranks of the tiny model, small iterations
TWO_STAGES = ["parallel.pp=2", "parallel.vpp=1", "parallel.dp=1", "parallel.ep=1", "planner.template=1f1b",
              "parallel.num_microbatches=2", "parallel.micro_batch_size=1", "parallel.seq_length=16"]


def _switch_world(rank: int, world: int, run_dir: str) -> dict:
    """One rank of :func:`test_worker_loop_switches_program_on_an_upgrade`: a real step runner
    (engine, stages, AdamW) on the baseline partition; version 1 moves the last decoder layer of
    rank 0 to rank 1."""
    import dataclasses

    from tessera.engine.groups import Layout, make_groups
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve
    from tessera.program.plan import Partition
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop
    from tessera.train.worker.step import RankInfo, make_step_runner

    from tessera.testing.slow import SleepAfterCompute, SlowRank

    recipe = load_recipe(TINY, TWO_STAGES + ["autopilot.enabled=true", "profile.check_every=2"])  # step 2: a check
    res = resolve(recipe)
    plan0 = build_baseline(res, build_costs(res))
    lo, cut, hi = plan0.partition.bounds
    moved = cut - 1  # rank 0's last decoder layer
    assert lo == -1 and 0 <= moved, plan0.partition
    plan1 = dataclasses.replace(plan0, partition=Partition((lo, moved, hi)))
    progs0, progs1 = compile_programs(plan0), compile_programs(plan1)

    def shape(plan):
        return {"bounds": list(plan.partition.bounds), "vpp": plan.vpp, "split_w": plan.split_w}

    groups = make_groups(Layout(2, 1, 1))
    runner = make_step_runner(recipe, progs0[rank], RankInfo(rank, world, groups.pipeline_rank, groups.replica,
                                                             groups.ep_rank, 0, "cpu"), groups, model=res.model)
    cfg = WorkerConfig(recipe.to_dict(), "r", run_dir, "tessera-driver-r")
    loop = WorkerLoop(cfg, recipe, rank=rank, world=world, device="cpu",
                      driver=FakeDriver(progs1[rank].to_dict(), upgrade_at=3, plan_shape=shape(plan1)),
                      runner=runner, data=shard_for(recipe, 0), model=res.model, version=0,
                      session=DistSession(run_dir), groups=groups, plan_shape=shape(plan0))
    out: dict = {"moved_layer": moved, "cut": cut}
    loop.restore()
    out["early"] = loop.maybe_upgrade(1)
    loop.step(1)  # rank 0 announces version 1 for step 3 in the step's gather: agreed on both ranks
    out["switches"] = loop.schedule.switches
    out["not_due"] = loop.maybe_upgrade(2)
    SlowRank(1, 2, 2.0).after_step(loop, 1)  # the test-only straggler: rank 1 computes twice as long from step 2
    it = loop.step(2)  # the autopilot's check: every rank's task times, compared on rank 0
    out["check"] = (it.rank_slowdown, it.rank_slowdown_max, it.routing_skew, it.ep_load)
    out["slept_ms"] = sum(h.slept_ms for h in runner.engine_hooks if isinstance(h, SleepAfterCompute))
    # what the switch has to move: the moved layer's parameters and their AdamW state (two steps
    # taken), all held by rank 0, as the tensors' own sizes
    held = [m for m in runner.modules if m.start <= moved < m.stop]
    if held:
        params = list(held[0].layer(moved).parameters())
        state = [t for q in params for t in runner.optimizer.state[q].values() if torch.is_tensor(t)]
        assert len(state) == 3 * len(params)  # exp_avg, exp_avg_sq, step
        out["layer_bytes"] = sum(t.numel() * t.element_size() for t in params + state)
        out["layer"] = {k: v.clone() for k, v in held[0].layer(moved).state_dict().items()}
    out["switched"] = loop.maybe_upgrade(3)
    out["version"] = loop.version
    out["stages"] = [(m.start, m.stop) for m in runner.modules]
    new = [m for m in runner.modules if m.start <= moved < m.stop]
    if new:  # the new owner holds the layer as rank 0 had it
        out["layer_after"] = {k: v.clone() for k, v in new[0].layer(moved).state_dict().items()}
    it = loop.step(3)
    out["metrics"] = (it.plan_version, it.plan_switch_from, it.plan_switch_moved_bytes)
    out["loss"] = it.loss
    out["again"] = loop.maybe_upgrade(4)  # still version 1: no second switch
    out["calls"] = [c[0] for c in loop.driver.calls]
    out["get_program"] = [c for c in loop.driver.calls if c[0] == "get_program"]
    return out


def test_worker_loop_switches_program_on_an_upgrade(tmp_path):
    """Two pipeline ranks (``run_local``, gloo) with real step runners: version 1 moves a decoder
    layer from rank 0 to rank 1, so the switch rebuilds the stages and sends that layer's
    parameters and AdamW state over the pipeline group; the switch's moved bytes are their sizes."""
    import functools

    from tessera.testing import run_local

    r0, r1 = run_local(functools.partial(_switch_world, run_dir=str(tmp_path / "run")), 2, 300)
    moved, cut = r0["moved_layer"], r0["cut"]
    for rank, r in enumerate((r0, r1)):
        assert (r["early"], r["not_due"], r["switched"], r["again"]) == (False, False, True, False)
        assert r["switches"] == ((1, 3),) and r["version"] == 1
        # the switch's bytes, summed over the ranks: exactly the moved layer's parameters and
        # optimizer state (rank 0 held it; a bug that moved nothing, moved every layer, dropped the
        # optimizer state or counted local copies would change it)
        assert r["metrics"] == (1, 0, r0["layer_bytes"]), (r["metrics"], r0["layer_bytes"])
        assert r["get_program"] == [("get_program", rank, 1)]
    assert r0["layer_bytes"] > 0 and "layer_bytes" not in r1  # rank 1 did not hold it
    assert r0["stages"] == [(-1, moved)] and r1["stages"][0][0] == moved and cut == moved + 1
    assert "layer_after" not in r0 and r0["layer"].keys() == r1["layer_after"].keys()
    assert all(torch.equal(r0["layer"][k], r1["layer_after"][k]) for k in r0["layer"])
    assert r0["loss"] == r1["loss"] and torch.isfinite(torch.tensor(r0["loss"]))
    # the check at step 2: rank 1 (slowed 2x by tessera.testing.slow) against rank 0 on the same
    # task items; rank 0 is the reference of nearly every item; no EP: no routing skew
    (fast, slow), worst, skew, load = r0["check"]
    assert 0.9 < fast <= 1.1 and slow > 1.5 and worst == slow and skew is None and load is None, r0["check"]
    assert r1["check"] == (None, None, None, None)  # only rank 0 reports
    assert r1["slept_ms"] > 0 and r0["slept_ms"] == 0
    # the only driver call on the way is each rank's Program, fetched at the switch
    assert r0["calls"] == ["worker_group_started", "pending_versions", "pending_versions", "get_program",
                           "pending_versions"]
    assert r1["calls"] == ["get_program"]


def test_a_late_announcement_switches_at_the_next_boundary_on_every_rank():
    from tessera.train.upgrade.schedule import UpgradeSchedule

    s = UpgradeSchedule(0)
    assert s.announcement([[2, 9], [1, 4]]) == (1, 4)  # the oldest pending version first
    s = s.agree(6, (1, 4))  # learned after step 6, announced for 4: switch before step 7
    assert s.switches == ((1, 7),) and s.due(7) == 1 and s.due(6) is None
    assert s.announcement([[1, 4], [2, 7]]) == (2, 7)
    s = s.agree(6, (2, 7))  # the same boundary is taken: one step later
    assert s.switches == ((1, 7), (2, 8))
    assert s.agree(7, (2, 8)) == s and s.agree(7, None) == s  # nothing new


def test_kill_after_step_fires_once_on_its_rank(one_rank, tmp_path, monkeypatch):
    from tessera.testing import faults

    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    loop = _loop(one_rank, tmp_path / "run")
    hook = faults.KillAfterStep(0, 2)
    for step in (1, 2, 2):
        hook.after_step(loop, step)
    faults.KillAfterStep(1, 2).after_step(loop, 2)  # another rank's fault
    assert killed == [(os.getpid(), faults.signal.SIGKILL)]
    assert loop.driver.calls == [("claim_fault", "r:0:2"), ("claim_fault", "r:0:2")]
    assert hook.die_before_marker(loop, 2) is False


def test_drift_check_compares_the_engines_own_task_times_with_the_profile(one_rank, tmp_path):
    """The drift check (tessera.train.worker.drift) on a real one-rank engine: no reference, no drift;
    a reference at twice this run's own task times gives a drift near 50%; only tasks that wait
    on no all-to-all are compared."""
    from tessera.config.resolve import resolve_hardware
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.profile_costs import task_signatures
    from tessera.cost.types import ParallelShape
    from tessera.train.worker.data import shard_for
    from tessera.train.worker.drift import DriftCheck
    from tessera.train.worker.step import RankInfo, make_step_runner
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    recipe, model, program = one_rank
    recipe = recipe.with_overrides(["profile.check_every=1"])
    runner = make_step_runner(recipe, program, RankInfo(0, 1, 0, 0, 0), None, model=model)
    plain = _loop(one_rank, tmp_path, runner=runner)
    assert plain.drift is None and plain.step(1).profile_drift is None
    assert runner.last_timings == []  # no drift check: the fast path, no per-task times
    runner.run(shard_for(recipe, 0).next_batch(), timed=True)  # a timed iteration (profiling engine)
    sig = task_signatures(analytic_costs(model, resolve_hardware(recipe), ParallelShape.of(recipe.parallel)))
    own: dict[str, list[float]] = {}
    for key, ms in runner.last_timings:
        own.setdefault(sig[str(key)], []).append(ms)
    reference = {item: 2 * statistics.median(v) for item, v in own.items()}
    check = DriftCheck(reference, sig, every=1)
    assert check.drift(runner.last_timings) == pytest.approx(0.5, abs=1e-9)  # the same timings
    assert check.drift([(k, ms) for k, ms in runner.last_timings if str(k).split(".")[2] in ("dispatch", "expert")
                        and str(k)[0] != "W"]) is None  # nothing comparable
    cfg = WorkerConfig(recipe.to_dict(), "r", str(tmp_path), "tessera-driver-r", profile_reference=reference)
    loop = WorkerLoop(cfg, recipe, rank=0, world=1, device="cpu", driver=FakeDriver(program.to_dict()), runner=runner,
                      data=shard_for(recipe, 0), model=model, version=0, session=LocalSession(str(tmp_path)))
    drift = loop.step(2).profile_drift  # a new iteration: its own times against twice the first's
    # the step's drift is the check on that step's own task times (load-independent: not a timing bound)
    assert drift is not None and drift == pytest.approx(check.drift(runner.last_timings), rel=1e-12), drift
    assert drift > 0


def test_metrics_sink_turns_drift_above_the_threshold_into_an_event(tmp_path, capsys):
    import json

    from tessera.train.worker.metrics import MetricsSink

    recipe = load_recipe(TINY, ["logging.wandb_mode=disabled", "profile.drift_threshold=0.1"])
    sink = MetricsSink(recipe, str(tmp_path), "r", progress=False)
    base = {"loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "bubble_ratio": 0.0, "time": 1.0}
    sink.write({**base, "step": 1, "profile_drift": None})
    sink.write({**base, "step": 2, "profile_drift": 0.05})
    sink.write({**base, "step": 3, "profile_drift": 0.25})
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("event") for x in lines] == [None, None, None, "profile_drift"]
    assert lines[-1] == {"event": "profile_drift", "step": 3, "drift": 0.25, "threshold": 0.1, "time": 1.0}
    assert sink.drifted == 0.25
    assert "drifted 25% from the profile" in capsys.readouterr().err
