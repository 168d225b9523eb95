"""The dynamic bubble optimizer's per-step metrics through the metrics sink and ``tessera report``,
from a real engine run: one 4-rank gloo launch (pp=2 x dp=2, ep=2) trains tiny-qwen3-next cut to
4 layers for 2 steps with :class:`~tessera.engine.dbo.DBOPolicy` on slot-annotated Programs
(skewed counts, W given slack, as in tests/test_dbo_engine.py). Each rank's
:func:`~tessera.engine.dbo.iteration_summary` is combined by
:func:`~tessera.train.worker.metrics.with_dbo`, written by :class:`~tessera.train.worker.metrics.MetricsSink`
and rendered by ``tessera report``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tessera.cli.main import main
from tessera.config.load import load_recipe
from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.dbo import counts_for_skew, moe_layers, rank_tables
from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.engine.dbo import DBOPolicy, iteration_summary
from tessera.model import StageModule
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.slots import annotate_slots
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.testing import run_local
from tessera.train.worker.metrics import MetricsSink, iteration_flops, measure_matmul_flops, summarize, with_dbo
from tessera.train.report.panels import ALL_PANELS, AUTOPILOT_PANELS, DBO_PANELS, read_metrics, series
from tessera.train.worker.step import StepMetrics

pytestmark = pytest.mark.xdist_group("report_dbo")  # module fixtures built once (tests/conftest.py)

SEED, WORLD, M, STEPS, TIMEOUT_S = 7, 4, 4, 2, 200
PARALLEL = ParallelConfig(pp=2, vpp=1, ep=2, dp=2, num_microbatches=M, micro_batch_size=1, seq_length=16)

# the nominal cpu device without its measured host cost of deferring W (120 us per GEMM, which
# dwarfs its placeholder compute times): these tests are about slots, not about that cost
NOMINAL_CPU = dataclasses.replace(get_hardware("cpu"), deferred_w_us=0.0)


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def world(rank: int, world_size: int) -> list[dict]:
    groups = make_groups(Layout(2, 2, 2))
    costs = analytic_costs(model_spec(), NOMINAL_CPU, PARALLEL)
    progs = annotate_slots(compile_plan(baseline_plan(costs, "1f1b", 2, 1, M, overlap=True, split_w=True)),
                           moe_layers(costs), defer_w=True)
    counts = counts_for_skew(1.3, 2, M, moe_layers(costs), 8, 2 * 16 * 2, seed=1)
    table = rank_tables(progs, costs, counts, 2, 0.1)[groups.pipeline_rank]
    prog = progs[groups.pipeline_rank]
    mods = [StageModule(model_spec(), (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=3e-3, foreach=False)
    policy = DBOPolicy(table, groups.ep_rank)
    engine = Engine(prog, mods, groups, opt, slot_policy=policy)
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        ids = [torch.randint(0, 256, (M, 1, 17), generator=g) for _ in range(2)][groups.replica]
        policy.reset()
        res = engine.run_iteration(Batch.from_tokens(ids))
        out.append({"stats": policy.stats(), "result": res,
                    "summary": iteration_summary(policy.stats(), slot_ms=res.slot_ms, idle_ms=res.idle_ms)})
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    ranks = run_local(world, WORLD, TIMEOUT_S)
    path = tmp_path_factory.mktemp("dbo-run")
    recipe = load_recipe(None, ["logging.wandb_mode=disabled", f"train.steps={STEPS}"])
    sink = MetricsSink(recipe, str(path), "dbo-run", progress=False)
    flops, peak = iteration_flops(model_spec(), PARALLEL), measure_matmul_flops() * WORLD
    for step in range(STEPS):
        per_rank = [r[step] for r in ranks]
        steps = [StepMetrics(loss=p["result"].loss, wall_ms=p["result"].wall_ms, idle_ms=p["result"].idle_ms,
                             slot_fill_ms=p["result"].slot_ms, exposed_a2a_ms=p["result"].a2a_wait_ms)
                 for p in per_rank]
        m = summarize(steps, step=step + 1, flops=flops, peak_flops=peak, tokens=M * 16 * 2, plan_version=0,
                      data_position=2 * step)
        sink.write(with_dbo(m, [p["summary"] for p in per_rank]).to_dict())
    sink.close()
    return path, ranks


def test_dbo_fields_in_metrics_jsonl_are_the_policy_counters(run_dir):
    path, ranks = run_dir
    records = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    moved = 0
    for step, rec in enumerate(records):
        stats = [r[step]["stats"] for r in ranks]
        res = [r[step]["result"] for r in ranks]
        assert rec["dbo_slots"] == sum(s.slots for s in stats) > 0
        assert rec["dbo_tasks_moved"] == sum(s.moved for s in stats)
        assert rec["dbo_forced_deadline_runs"] == sum(s.forced for s in stats)
        assert rec["dbo_pool_mem_peak_gb"] == max(s.pool_peak_bytes for s in stats) / 1e9 > 0
        annotated, filled = sum(s.annotated_ms for s in stats), sum(s.filled_ms for s in stats)
        assert rec["dbo_pred_fill_rate"] == pytest.approx(filled / annotated)
        assert 0 < rec["dbo_pred_fill_rate"] <= 1
        measured = sum(r.slot_ms + r.idle_ms for r in res)
        assert rec["dbo_slot_pred_err"] == pytest.approx((annotated - measured) / measured)
        assert rec["dbo_overhead_ms"] == max(s.overhead_ms for s in stats) > 0
        # every W ran exactly once: in a slot, at registration (no cap here: none) or at its deadline
        assert all(s.at_once == 0 for s in stats)
        fill = sum(r.slot_ms for r in res)
        assert rec["bubble_fill_rate"] == pytest.approx(fill / (fill + sum(r.idle_ms for r in res)))
        moved += rec["dbo_tasks_moved"]
    assert moved > 0 and records[0]["bubble_fill_rate"] > 0


def test_report_renders_every_panel_of_the_dbo_run(run_dir, tmp_path, capsys):
    path, ranks = run_dir  # per rank, per step: the engine's own results
    out = tmp_path / "png"
    assert main(["report", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    expected = [str(out / f"{p.name}.png") for p in ALL_PANELS] + [str(out / "overview.png")]
    assert printed == expected
    for f in expected:
        data = open(f, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000
    records = read_metrics(str(path / "metrics.jsonl"))
    logged = {p.key for p in ALL_PANELS if series(records, p)[0]}
    assert {p.key for p in DBO_PANELS} <= logged
    # no profile to drift from here, and no learning rate: the worker loop logs it, this run drives the engine;
    # no autopilot checks either
    assert logged == {p.key for p in ALL_PANELS} - {"profile_drift", "lr"} - {p.key for p in AUTOPILOT_PANELS}
    # the exposed all-to-all is every rank's wait on its EP all-to-alls (ep=2 here): the job's is the largest
    for step, rec in enumerate(records):
        waits = [r[step]["result"].a2a_wait_ms for r in ranks]
        assert all(w is not None and 0 <= w < r[step]["result"].wall_ms for w, r in zip(waits, ranks))
        assert rec["exposed_a2a_ms"] == max(waits)
