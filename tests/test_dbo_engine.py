"""The dynamic bubble optimizer in the engine, on real CPU compute: one 4-rank gloo launch
(pp=2 x dp=2, ep=2; deterministic algorithms) trains tiny-qwen3-next cut to 4 layers for 2 steps
three times from the same initial weights, on the same slot-annotated Programs (W given slack):
optimizer off, on, and on with a pool memory cap below one W (each runs at registration), and
the layer-level joint policy (:class:`tessera.engine.dbo_joint.JointDBOPolicy`: one layer's W,
or its expert W apart from the rest, moved alone) with and without that cap. Gradients and
parameters must be bitwise equal; every W runs once, never after its deadline; the cap holds."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.dbo import counts_for_skew, moe_layers, rank_tables
from tessera.engine import Batch, Engine, Hooks, Layout, MovableTask, make_groups
from tessera.dbo.units import unit_table
from tessera.engine.dbo import DBOPolicy
from tessera.engine.dbo_joint import JointDBOPolicy
from tessera.model import StageModule
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.program.slots import annotate_slots
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.testing import global_state_dict, run_local

pytestmark = pytest.mark.xdist_group("dbo_engine")  # module fixtures built once (tests/conftest.py)

SEED, WORLD, M, STEPS, TIMEOUT_S = 7, 4, 4, 2, 200

# the nominal cpu device without its measured host cost of deferring W (120 us per GEMM, which
# dwarfs its placeholder compute times): these tests are about slots, not about that cost
NOMINAL_CPU = dataclasses.replace(get_hardware("cpu"), deferred_w_us=0.0)


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def setup():
    costs = analytic_costs(model_spec(), NOMINAL_CPU, ParallelConfig(
        pp=2, vpp=1, ep=2, dp=2, num_microbatches=M, micro_batch_size=1, seq_length=16))
    progs = annotate_slots(compile_plan(baseline_plan(costs, "1f1b", 2, 1, M, overlap=True, split_w=True)),
                           moe_layers(costs), defer_w=True)
    counts = counts_for_skew(1.3, 2, M, moe_layers(costs), 8, 2 * 16 * 2, seed=1)
    tables = rank_tables(progs, costs, counts, 2, 0.1)
    return progs, tables, tuple(unit_table(t, p, costs, "split") for t, p in zip(tables, progs))


class WRuns(Hooks):
    """Instruction index of every W instruction's step, and whether its task was still pending
    (in the pool or the chunk's deferred store) right after it: a W past its deadline."""

    def __init__(self) -> None:
        self.w, self.late, self.engine = [], [], None

    def step_done(self, record) -> None:
        if record.op == "W":
            self.w.append((record.index, record.task))
            e = self.engine
            if MovableTask(record.chunk, record.mb) in e.pool or e.chunks[record.chunk].w_pending(record.mb):
                self.late.append(record.task)


def run(rank: int, groups, progs, tables, units, mode: str) -> dict:
    prog = progs[groups.pipeline_rank]
    mods = [StageModule(model_spec(), (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=3e-3, weight_decay=0.01, foreach=False)
    table = tables[groups.pipeline_rank]
    cap = 0.5 * table.tasks[0].mem_bytes / 1e9 if mode.endswith("capped") else math.inf
    if mode.startswith("joint"):
        policy = JointDBOPolicy(table, units[groups.pipeline_rank], groups.ep_rank, pool_mem_gb=cap, log=True)
    else:
        policy = None if mode == "off" else DBOPolicy(table, groups.ep_rank, pool_mem_gb=cap, log=True)
    hook = WRuns()
    engine = Engine(prog, mods, groups, opt, slot_policy=policy, hooks=hook)
    hook.engine = engine
    g = torch.Generator().manual_seed(SEED)
    grads = []
    for _ in range(STEPS):
        ids = [torch.randint(0, 256, (M, 1, 17), generator=g) for _ in range(2)][groups.replica]  # per dp replica
        engine.begin(Batch.from_tokens(ids))
        while (rec := engine.advance()) is not None:
            if rec.op == "reduce_grads":
                grads.append({n: p.grad.clone() for m in mods for n, p in m.named_parameters()
                              if p.grad is not None})
    out = {"state": {k: v for m in mods for k, v in global_state_dict(m).items()}, "grads": grads,
           "w_runs": hook.w, "late": hook.late, "rank": groups.pipeline_rank}
    if policy is not None:
        out["stats"] = policy.stats()
        out["log"] = policy.log
        out["cap_bytes"] = cap * 1e9
    return out


def world(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    groups = make_groups(Layout(2, 2, 2))
    progs, tables, units = setup()
    return {mode: run(rank, groups, progs, tables, units, mode) for mode in ("off", "on", "capped", "joint",
                                                                            "joint_capped")}


@pytest.fixture(scope="module")
def results():
    return run_local(world, WORLD, TIMEOUT_S)


def test_bitwise_equal_with_the_optimizer_on_and_off(results):
    moved = joint = partial = 0
    for res in results:
        for mode in ("on", "capped", "joint", "joint_capped"):
            assert res[mode]["state"].keys() == res["off"]["state"].keys()
            bad = [k for k, v in res["off"]["state"].items() if not torch.equal(v, res[mode]["state"][k])]
            assert not bad, f"{mode}: {len(bad)} parameters differ, e.g. {bad[:3]}"
            for g_off, g_on in zip(res["off"]["grads"], res[mode]["grads"], strict=True):
                assert all(torch.equal(v, g_on[k]) for k, v in g_off.items())
        moved += res["on"]["stats"].moved
        joint += res["joint"]["stats"].moved
        units = setup()[2][res["on"]["rank"]].units
        for ch in res["joint"]["log"]:  # slots that ran part of a chunk's W (the rest later)
            for w in {u[:2] for u in ch.tasks}:
                partial += sum(u[:2] == w for u in ch.tasks) < sum((x.chunk, x.mb) == w for x in units)
    assert moved > 0 and joint > 0  # the optimizers did move W into slots
    assert partial > 0


def test_no_task_runs_after_its_deadline_and_every_w_runs_once(results):
    progs, tables, units = setup()
    for res in results:
        table = tables[res["on"]["rank"]]
        st = res["on"]["stats"]
        assert st.moved + st.at_once + st.forced == STEPS * len(table.tasks)
        assert st.forced < STEPS * len(table.tasks)  # some W ran before their W instruction
        assert res["on"]["late"] == [] and res["capped"]["late"] == []
        assert len(res["on"]["w_runs"]) == STEPS * len(table.tasks)
        for index, task in res["on"]["w_runs"]:
            w = next(t for t in table.tasks if str(task) == f"W(mb{t.mb}.c{t.chunk})")
            assert index == w.deadline
        for ch in res["on"]["log"]:
            assert ch.filled_ms <= ch.usable_ms
            for chunk, mb in ch.tasks:
                w = table.task(chunk, mb)
                assert w.register < ch.index < w.deadline
        assert progs[res["on"]["rank"]].instructions[table.slots[0].index].op == Op.SLOT
        for mode in ("joint", "joint_capped"):
            assert res[mode]["late"] == []
            assert [i for i, _ in res[mode]["w_runs"]] == [i for i, _ in res["on"]["w_runs"]]
            ran = collections.Counter(u for ch in res[mode]["log"] for u in ch.tasks)
            assert max(ran.values(), default=0) <= STEPS  # a unit at most once per step
            for ch in res[mode]["log"]:
                assert ch.filled_ms <= ch.usable_ms + 1e-12
                for chunk, mb, _, _ in ch.tasks:
                    w = table.task(chunk, mb)
                    assert w.register < ch.index < w.deadline


def test_memory_cap_holds_in_the_engine(results):
    at_once = 0
    for res in results:
        for mode in ("capped", "joint_capped"):
            st = res[mode]["stats"]
            assert st.pool_peak_bytes <= res[mode]["cap_bytes"]
            at_once += st.at_once
        assert res["on"]["stats"].pool_peak_bytes > res["capped"]["cap_bytes"]
    assert at_once > 0
