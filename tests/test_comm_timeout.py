"""Timeouts and interfaces of the process groups (issue #31 part 4).

One real 2-rank gloo launch (``run_local``): groups made without a timeout get the default
group's (``run_local``'s ``timeout_s``); groups made with one get it, and their name as torch's
``group_desc``; the ranks see the caller's ``GLOO_SOCKET_IFNAME`` (set after the fork server may
have started). Then a compiled 1F1B pp=2 Program whose rank 0 lacks one ``send_act`` (never
validated: the validator would refuse it) runs with a 3 s group timeout: rank 1's receive never
gets its send, rank 0's gradient receive never gets its send either, and a rank ends after about
the timeout in one :class:`~tessera.engine.groups.CommTimeout` line naming the rank, the
instruction it waited in and the group (on gloo the first timed-out wait closes the link, so the
peer may fail on the closed link first: collateral). A collective that one rank calls alone ends the same way
(the group found from torch's ``group`` argument). Without launches: the job's error line prefers
that line over its collateral, it survives pickling, timeouts convert and are checked, and
``job.socket_ifname`` reaches the workers' runtime environment as both variables.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import re
import time

import pytest
import torch

from tessera.config.job_rules import SOCKET_IFNAME_ENV
from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.engine.groups import CommTimeout, as_timeout
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.program.plan import Partition, Plan
from tessera.spec.presets import get_model
from tessera.testing import run_local

pytestmark = pytest.mark.xdist_group("comm_timeout")

T = 3.0  # the groups' timeout in the hang, seconds
RUN_TIMEOUT_S = 120  # run_local's wall limit, also its default group's timeout
M = 4
LINE = re.compile(r"rank (\d+), instruction (\d+) (\S.*?): (.+?) on the (\w+) group \(ranks ([\d, ]+)\) "
                  r"timed out after ([\d.]+) s")


def _model():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def _program(rank: int):
    """Rank ``rank``'s 1F1B pp=2 Program; rank 0 without its first ``send_act`` (and that
    message out of its p2p batches, so rank 0 itself never waits for it)."""
    prog = compile_plan(Plan("hang", "1f1b", 2, 1, M, Partition((-1, 2, 5)), overlap=True, split_w=False))[rank]
    if rank != 0:
        return prog
    drop = next(i for i, ins in enumerate(prog.instructions) if ins.op is Op.SEND_ACT)
    key = ("act", prog.instructions[drop].mb, 0)
    changes = {"instructions": prog.instructions[:drop] + prog.instructions[drop + 1:]}
    if getattr(prog, "p2p_batches", ()):
        changes["p2p_batches"] = tuple(b for b in (tuple(k for k in batch if tuple(k) != key)
                                                   for batch in prog.p2p_batches) if b)
    return dataclasses.replace(prog, **changes)


def _hang_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from tessera.engine.groups import group_timeout, reduce_gradients
    from tessera.model import StageModule

    torch.set_num_threads(1)
    out = {"env": {name: os.environ.get(name) for name in SOCKET_IFNAME_ENV}}
    inherited = make_groups(Layout(2, 1, 1))
    out["inherited_s"] = group_timeout(inherited.pipeline).total_seconds()
    groups = make_groups(Layout(2, 1, 1), timeout=T)
    out["timeout_s"] = group_timeout(groups.pipeline).total_seconds()
    out["desc"] = groups.pipeline.group_desc
    prog = _program(groups.pipeline_rank)
    mods = [StageModule(_model(), (s.start, s.stop), ep_group=groups.ep, seed=5) for s in prog.stages]
    engine = Engine(prog, mods, groups)  # not validated: the validator refuses a receive without its send
    batch = Batch.from_tokens(torch.randint(0, 256, (M, 1, 17), generator=torch.Generator().manual_seed(5)))
    t0 = time.monotonic()
    try:
        engine.run_iteration(batch)
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = (type(e).__name__, str(e), time.monotonic() - t0, type(e.__cause__).__name__)
    # stay up until the peer's wait ended by its own timeout (an ended process would close the link)
    time.sleep(max(0.0, t0 + 2 * T + 1 - time.monotonic()))
    lone = make_groups(Layout(2, 1, 1), timeout=T)  # a fresh group: rank 0 all-reduces on it alone
    if rank == 0:
        from tessera.engine.groups import comm_timeout

        w = torch.nn.Parameter(torch.zeros(2))
        t1 = time.monotonic()
        try:
            reduce_gradients([w], lone.pipeline, 1.0)
            out["lone"] = None
        except RuntimeError as e:
            out["lone"] = (comm_timeout(e, lone), time.monotonic() - t1)
    else:
        time.sleep(2 * T + 1)
    out["world"] = dist.get_world_size()
    return out


@pytest.fixture(scope="module")
def hang():
    """The launch (module docstring), with ``GLOO_SOCKET_IFNAME=lo`` set in this process only."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GLOO_SOCKET_IFNAME", "lo")
    try:
        return run_local(_hang_world, 2, RUN_TIMEOUT_S)
    finally:
        mp.undo()


def test_groups_get_the_default_groups_timeout_or_their_own_and_their_name(hang):
    for r in hang:
        assert r["inherited_s"] == RUN_TIMEOUT_S  # made without a timeout: run_local's default group's
        assert r["timeout_s"] == T and r["desc"] == "pipeline"


def test_run_local_ranks_get_the_callers_socket_interface(hang):
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in hang] == ["lo", "lo"]


def test_a_receive_without_its_send_ends_in_one_line_naming_rank_instruction_and_group(hang):
    """Rank 1 waits first (for mb 0's activation, from its first F on), so its wait times out
    first; on gloo the timed-out wait closes the link, and rank 0, waiting for mb 0's gradient,
    then fails on the closed link (collateral) unless its own timeout came first."""
    timed_out = {}
    for rank, r in enumerate(hang):
        name, msg, waited, cause = r["error"]
        if name != "CommTimeout":
            assert name == "RuntimeError" and "Connection closed by peer" in msg and rank == 0, msg
            continue
        print(msg)
        assert cause == "RuntimeError" and "\n" not in msg, msg
        m = LINE.fullmatch(msg)
        assert m is not None, msg
        timed_out[rank] = m.groups()
        assert int(m.group(1)) == rank and m.group(4) == "a recv" and m.group(5) == "pipeline"
        assert m.group(6) == "0, 1" and float(m.group(7)) == T
        assert str(_program(rank).instructions[int(m.group(2))]) == m.group(3)
        assert T * 0.9 <= waited <= 2 * T + 10, (rank, waited)  # the timeout, plus a few seconds
    assert 1 in timed_out, hang
    assert timed_out[1][2].startswith(("F(mb0", "recv_act(mb0"))  # where the activation of mb 0 is waited
    if 0 in timed_out:
        assert "mb0" in timed_out[0][2]  # the gradient of mb 0, never sent


def test_a_collective_one_rank_calls_alone_times_out_on_its_named_group(hang):
    what, waited = hang[0]["lone"]
    assert what == f"all_reduce on the pipeline group (ranks 0, 1) timed out after {T:g} s"
    assert T * 0.9 <= waited <= 2 * T + 10


def test_the_jobs_error_line_is_the_timeout_not_its_collateral():
    from ray.train import WorkerGroupError

    from tessera.train.job.run import JobFailed, job_error

    line = "rank 1, instruction 1 F(mb0.c0): a recv on the pipeline group (ranks 0, 1) timed out after 3 s"
    carried = pickle.loads(pickle.dumps(CommTimeout(line)))  # as Ray carries it
    assert isinstance(carried, CommTimeout) and str(carried) == line
    err = job_error(WorkerGroupError("x", {0: RuntimeError("Connection closed by peer [127.0.0.1]:1"), 1: carried}))
    assert isinstance(err, JobFailed) and "\n" not in str(err)
    assert str(err).startswith(f"the job failed on worker rank 1: CommTimeout: {line} (")


def test_timeouts_are_seconds_or_timedeltas():
    two = datetime.timedelta(seconds=2)
    assert as_timeout(2) == as_timeout(2.0) == as_timeout(two) == two
    for bad in (0, -1, float("inf"), float("nan"), True, "5", None):
        with pytest.raises(ValueError, match="process-group timeout"):
            as_timeout(bad)


def test_socket_ifname_reaches_the_workers_runtime_env():
    from tessera.config.load import load_recipe
    from tessera.train.job.trainer import build_trainer, worker_env
    from tessera.train.worker.loop import WorkerConfig

    tiny = load_recipe(os.path.join(os.path.dirname(__file__), "..", "recipes", "tiny-qwen3-next.yaml"))
    mine = tiny.with_overrides(["job.socket_ifname=eth1,eth2"])
    trainer = build_trainer(mine, WorkerConfig(mine.to_dict(), "run", "/tmp/run", "driver"), "/tmp/store",
                            {"CPU": 0.5})
    env = trainer.run_config.worker_runtime_env["env_vars"]
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth1,eth2"
    launcher = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "^docker"}
    assert worker_env(mine, 1, launcher)["NCCL_SOCKET_IFNAME"] == "eth1,eth2"  # the field wins
    got = worker_env(tiny, 1, launcher)  # null: the launcher's own values pass on, as they are
    assert (got["GLOO_SOCKET_IFNAME"], got["NCCL_SOCKET_IFNAME"]) == ("ib0", "^docker")
    assert not set(SOCKET_IFNAME_ENV) & set(worker_env(tiny, 1, {}))  # nothing set: nothing passed
