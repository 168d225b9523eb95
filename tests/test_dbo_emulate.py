"""Emulated devices (:mod:`tessera.engine.emulate`) with the dynamic bubble optimizer: one 4-rank
gloo launch (pp=2 x dp=2, ep=2) runs tiny-qwen3-next (4 layers, analytic cpu costs, 1f1b with W
slack, 4 microbatches) on emulated chunks (cost-model sleeps at a small scale, real sends and
EP all-to-alls), with skewed routing (optimizer off, on, on under a pool cap below one W) and
uniform routing (off, on). Structure only (which W ran where, counts), never timings."""

from __future__ import annotations

import dataclasses
import math

import time

import pytest
import torch
import torch.distributed as dist

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.types import LayerDP
from tessera.dbo import counts_for_skew, moe_layers, rank_tables, uniform_counts
from tessera.dbo.units import unit_table
from tessera.engine import Batch, Engine, Hooks, Layout, MovableTask, make_groups
from tessera.engine.dbo_joint import JointDBOPolicy
from tessera.engine.emulate import EmulatedChunk, EmulatedDevice, emulated_chunks
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.slots import annotate_slots
from tessera.sim.dbo import simulate_dbo
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.testing import run_local

pytestmark = pytest.mark.xdist_group("dbo_emulate")  # module fixtures built once (tests/conftest.py)

M, WORLD, TIMEOUT_S, SCALE = 4, 4, 200, 0.05


def _short_w(layer):
    """W tasks at a thousandth of their cost (the tiny model's W, embedding and head included,
    dwarf its slots; margin 0); no data-parallel costs (the emulation runs a real one-float
    all-reduce, not the modelled collectives)."""
    return dataclasses.replace(layer, dp=LayerDP(), tasks=tuple(
        dataclasses.replace(t, ms=t.ms / 1000, deferred_ms=t.deferred_ms / 1000) if t.phase.value == "W" else t
        for t in layer.tasks))


def setup():
    m = get_model("tiny-qwen3-next")
    costs = analytic_costs(dataclasses.replace(m, layers=m.layers[:4]), get_hardware("cpu"), ParallelConfig(
        pp=2, vpp=1, ep=2, dp=2, num_microbatches=M, micro_batch_size=2, seq_length=64))
    costs = dataclasses.replace(costs, layers=tuple(_short_w(x) for x in costs.layers), embed=_short_w(costs.embed),
                                head=_short_w(costs.head))
    progs = annotate_slots(compile_plan(baseline_plan(costs, "1f1b", 2, 1, M, overlap=False, split_w=True)),
                           moe_layers(costs), defer_w=True)
    E = m.layers[0].mlp.num_experts
    skewed = counts_for_skew(1.5, 2, M, moe_layers(costs), E, 2 * 2 * 64 * m.layers[0].mlp.top_k, seed=1)
    uniform = uniform_counts(M, moe_layers(costs), E, 2 * 2 * 64 * m.layers[0].mlp.top_k)
    return costs, progs, {"skewed": skewed, "uniform": uniform}


class WRuns(Hooks):
    """Each W instruction reached: (index, task, was it still pending in the pool), and every
    step's (op, task) in order."""

    def __init__(self) -> None:
        self.w, self.late, self.steps, self.engine = [], [], [], None

    def step_done(self, record) -> None:
        self.steps.append((record.op, record.task))
        if record.op == "W":
            e = self.engine
            self.w.append((record.index, record.task))
            if MovableTask(record.chunk, record.mb) in e.pool or e.chunks[record.chunk].w_pending(record.mb):
                self.late.append(record.task)


def run_mode(groups, costs, progs, counts, mode: str) -> dict:
    prog = progs[groups.pipeline_rank]
    table = rank_tables(progs, costs, counts, 2, 0.0)[groups.pipeline_rank]
    dev = EmulatedDevice(SCALE, groups.ep, groups.ep_rank, 2, counts)
    chunks = emulated_chunks(prog, costs, dev)
    cap = {"off": math.inf, "on": math.inf, "capped": 0.5 * table.tasks[0].mem_bytes / 1e9}[mode]
    policy = None if mode == "off" else JointDBOPolicy(table, unit_table(table, prog, costs), groups.ep_rank,
                                                       pool_mem_gb=cap, log=True)
    hook = WRuns()
    engine = Engine(prog, chunks, groups, slot_policy=policy, hooks=[dev, hook])
    hook.engine = engine
    ids = torch.zeros((M, 1, 1), dtype=torch.int64)
    t = torch.tensor([time.monotonic() + 0.05], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dev.start_at(float(t))  # one start instant for every rank: the clocks then depend on the costs only
    res = engine.run_iteration(Batch(ids, ids))
    order = [(c, mb, (k.layer, k.kind)) for c, ch in enumerate(chunks) for mb, k in ch.last_w_log]
    out = {"w_runs": hook.w, "late": hook.late, "order": order, "steps": res.steps, "cap_bytes": cap * 1e9,
           "rank": groups.pipeline_rank, "ep_rank": groups.ep_rank, "bg_left": dev.bg_ms,
           "clock_ms": dev.iteration_ms,
           "w_ms": {(c, mb): ch.w_ms(mb) for c, ch in enumerate(chunks) for mb in range(M)}}
    if policy is not None:
        out["stats"], out["log"] = policy.stats(), policy.log
    return out


def world(rank: int, world_size: int) -> dict:
    groups = make_groups(Layout(2, 2, 2))
    costs, progs, counts = setup()
    out = {f"skewed_{m}": run_mode(groups, costs, progs, counts["skewed"], m) for m in ("off", "on", "capped")}
    out.update({f"uniform_{m}": run_mode(groups, costs, progs, counts["uniform"], m) for m in ("off", "on")})
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(world, WORLD, TIMEOUT_S)


def test_emulated_w_durations_are_the_predictions():
    costs, progs, counts = setup()
    tables = rank_tables(progs, costs, counts["skewed"], 2, 0.0)
    for p, table in zip(progs, tables):
        for e in range(2):
            dev = EmulatedDevice(SCALE, None, e, 2, counts["skewed"])
            chunks = emulated_chunks(p, costs, dev)
            for t in table.tasks:
                assert chunks[t.chunk].w_ms(t.mb) == pytest.approx(t.ms[e], rel=1e-12)


def test_emulated_chunk_task_lists_follow_the_costs():
    costs, progs, _ = setup()
    ch = EmulatedChunk(costs, -1, 2, EmulatedDevice(1.0))
    assert ch.task_keys("F")[0].kind == "embed" and ch.task_keys("B")[-1].kind == "embed"
    assert [k.layer for k in ch.task_keys("F")] == sorted(k.layer for k in ch.task_keys("F"))
    assert len(ch.task_keys("W")) == sum(1 for l in (-1, 0, 1) for t in costs.layer(l).tasks if t.phase.value == "W")
    with pytest.raises(ValueError, match="scale"):
        EmulatedDevice(0.0)


def test_no_task_runs_after_its_deadline(results):
    costs, progs, counts = setup()
    moved = 0
    for res in results:
        table = rank_tables(progs, costs, counts["skewed"], 2, 0.0)[res["skewed_on"]["rank"]]
        for mode in ("skewed_on", "skewed_capped", "uniform_on"):
            r = res[mode]
            assert r["late"] == []
            ran = sorted({(c, mb) for c, mb, _ in r["order"]})
            assert ran == sorted((t.chunk, t.mb) for t in table.tasks)  # every deferred W ran
            assert len(set(r["order"])) == len(r["order"])  # each W task once
            assert [i for i, _ in r["w_runs"]] == sorted(t.deadline for t in table.tasks)
            assert r["bg_left"] == 0.0
        st = res["skewed_on"]["stats"]
        assert st.at_once + st.forced <= len(table.tasks)
        for ch in res["skewed_on"]["log"]:
            assert ch.filled_ms <= ch.usable_ms + 1e-12
            for chunk, mb, _, _ in ch.tasks:  # layer-level units
                w = table.task(chunk, mb)
                assert w.register < ch.index < w.deadline
        moved += st.moved
    assert moved == sum(len(ch.tasks) for res in results for ch in res["skewed_on"]["log"]) > 0


def test_memory_cap_holds(results):
    at_once = 0
    for res in results:
        st = res["skewed_capped"]["stats"]
        assert st.pool_peak_bytes <= res["skewed_capped"]["cap_bytes"]
        at_once += st.at_once
    assert at_once > 0


def test_w_order_per_parameter_set_is_by_microbatch_whatever_moves(results):
    for res in results:
        for mode in ("skewed_off", "skewed_on", "skewed_capped", "uniform_off", "uniform_on"):
            order = res[mode]["order"]
            for c, task in {(c, k) for c, _, k in order}:  # each W task of a chunk: one parameter set
                assert [mb for cc, mb, k in order if (cc, k) == (c, task)] == list(range(M))


def test_uniform_routing_changes_nothing(results):
    for res in results:
        on, off = res["uniform_on"], res["uniform_off"]
        assert on["stats"].moved == 0 and on["stats"].at_once == 0 and on["stats"].filled_ms == 0.0
        assert on["stats"].forced == len(off["w_runs"])
        assert on["order"] == off["order"]
        assert on["w_runs"] == off["w_runs"] and on["steps"] == off["steps"]


def test_emulated_clock_is_the_simulated_iteration(results):
    """The ranks' emulated clocks (cost-model time, independent of the host's speed: every rank
    starts at one instant, the clock never reads the host) end where
    :func:`tessera.sim.dbo.simulate_dbo` ends on the same Programs, costs and counts, with the
    optimizer off and on, skewed and balanced (up to the float64 resolution of the
    ``time.monotonic()`` stamps at this small scale), and the same number of W moved."""
    costs, progs, counts = setup()
    got = {}
    for mode in ("skewed_off", "skewed_on", "uniform_off", "uniform_on"):  # (the capped run's cap differs per rank)
        kind, opt = mode.split("_")
        sim = simulate_dbo(progs, costs, counts[kind], 2, enabled=opt == "on", margin=0.0)
        got[mode] = (max(r[mode]["clock_ms"] for r in results), sim.iteration_ms, sim.moved,
                     sum(r[mode]["stats"].moved for r in results) if opt == "on" else 0)
    for mode, (clock, sim_ms, _, _) in got.items():
        assert clock == pytest.approx(sim_ms, rel=1e-5), (mode, got)
    assert got["skewed_on"][3] == got["skewed_on"][2] > 0, got  # the same W moved as in the simulator
