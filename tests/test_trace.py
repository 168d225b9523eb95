"""Kineto trace import (tessera.cost.trace), the traced pair's DAG (tessera.sched.tracedag) and
trace-derived costs (tessera.cost.trace_costs, planner.cost_source=trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.config.load import load_recipe
from tessera.cost.trace import load_kineto, parse_kineto
from tessera.cost.trace_costs import check_trace_matches, trace_costs, trace_layout
from tessera.cost.types import ParallelShape, TaskKind
from tessera.errors import TesseraConfigError
from tessera.flow import build_costs, resolve
from tessera.plan.pair_scheduler import schedule_pair
from tessera.sched.dag import run_in_order
from tessera.sched.tracedag import issue_order, trace_pair_dag

pytestmark = pytest.mark.xdist_group("trace")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
DSV3 = ROOT / "benchmarks" / "data" / "deepseek-v3-h800-ep64-train-trace.json.gz"
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="module")
def dsv3():
    return load_kineto(DSV3)


def test_dsv3_per_annotation_totals_pinned(dsv3):
    # GPU kernel time per annotation, summed over the four layers and every stream (ms), from
    # launch correlation; pinned from the public trace.
    want = {"attn(F)": 17.479, "attn(B)": 37.363, "attn(W)": 9.554, "mlp(F)": 18.415, "mlp(B)": 21.224,
            "mlp(W)": 25.513, "dispatch(F)": 26.761, "dispatch(B)": 29.947, "combine(F)": 34.736,
            "combine(B)": 23.077}
    got = dsv3.totals_ms()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=5e-4), k
    assert len(dsv3.instances) == 40 and all(i.occurrence < 4 for i in dsv3.instances)
    assert dsv3.unattributed_us == 0.0
    assert dsv3.device == "NVIDIA H800" and dsv3.world_size == 64
    assert dsv3.window_ms == pytest.approx(129.012, abs=1e-3)
    # roles: one compute stream, DeepEP on another, part of mlp(W) on a third
    assert dsv3.compute_stream == 7 and dsv3.comm_streams == {27} and dsv3.aux_streams == {23}
    assert dsv3.stream_busy_ms(23) == pytest.approx(11.355, abs=1e-3)
    assert dsv3.comm_blocks() == 20  # DeepEP's 20 SMs (DeepSeek-V3 report sec. 3.2.2)
    assert trace_layout(dsv3) == {"ep": 64, "tp": 1, "hidden": 7168, "seqlen": 4096}


def test_host_annotation_durations_are_not_used(dsv3):
    # dispatch(F) #1 blocks the host for about 20 ms; its GPU work is a fraction of that
    inst = next(i for i in dsv3.instances if i.name == "dispatch(F)" and i.occurrence == 1)
    assert inst.host_dur_us > 20_000
    assert inst.busy_ms() < 8.0


def test_replay_of_deepseeks_order_lands_within_5pct_of_the_window(dsv3):
    dag = trace_pair_dag(dsv3)
    replay = run_in_order(dag, issue_order(dsv3, dag)).makespan
    assert abs(replay / dsv3.window_ms - 1) < 0.05
    assert replay <= dsv3.window_ms  # launch gaps are not in the DAG: the replay is a little shorter
    # the pair scheduler's order of the same DAG is no slower than DeepSeek's
    assert schedule_pair(dag).makespan <= replay + 1e-6
    # no schedule beats the busier resource
    assert replay >= max(dag.resource_load_ms(r) for r in issue_order(dsv3, dag)) - 1e-6


def _kineto(events):
    return {"traceEvents": events, "traceName": "t", "deviceProperties": [{"name": "NVIDIA H800"}]}


def test_kernels_attributed_by_launch_correlation_not_by_time():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "attn(F)", "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "mlp(F)", "ts": 20, "dur": 10, "tid": 1},
        # launched inside attn(F) from another host thread, runs on the GPU long after it ended
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1, "tid": 2,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 25, "dur": 4, "tid": 7,
         "args": {"correlation": 7, "stream": 7, "grid": [132, 1, 1]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 21, "dur": 1, "tid": 1,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "act", "ts": 30, "dur": 2, "tid": 7,
         "args": {"correlation": 8, "stream": 7}},
        # launched outside every annotation: reported, not dropped silently
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 1, "tid": 1,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "other", "ts": 60, "dur": 3, "tid": 7,
         "args": {"correlation": 9, "stream": 7}},
    ]
    tr = parse_kineto(_kineto(ev))
    assert [(i.name, [k.name for k in i.kernels]) for i in tr.instances] == [("attn(F)", ["gemm"]), ("mlp(F)", ["act"])]
    assert tr.instances[0].kernels[0].blocks == 132
    assert tr.unattributed_us == 3.0
    assert tr.window_us == 38.0  # 25 .. 63


@pytest.mark.parametrize("data, words", [
    ({"foo": 1}, "traceEvents"),
    (_kineto([]), "no GPU activity"),
    (_kineto([{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1, "args": {"correlation": 1}}]),
     "annotations"),
])
def test_bad_traces_are_refused_with_the_field(data, words):
    with pytest.raises(TesseraConfigError) as e:
        parse_kineto(data, "x.json")
    assert e.value.field == "planner.trace" and words in str(e.value)


def test_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(TesseraConfigError, match="cannot read"):
        load_kineto(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TesseraConfigError, match="not JSON"):
        load_kineto(bad)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(_kineto([])))
    with pytest.raises(TesseraConfigError, match="no GPU activity"):
        load_kineto(plain)


def _dsv3_costs(*over):
    recipe = load_recipe(str(RECIPES / "deepseek-v3.yaml"), ["planner.activation_recompute=none", *over])
    res = resolve(recipe)
    return recipe, res, build_costs(res)


def test_trace_costs_replace_moe_layers_and_keep_the_rest(dsv3):
    recipe, res, analytic = _dsv3_costs("train.precision=fp8")
    costs, rep = trace_costs(analytic, dsv3, res.hardware)
    assert costs.source == "trace"
    moe = [lc.index for lc in analytic.layers if any(t.kind == TaskKind.DISPATCH for t in lc.tasks)]
    assert rep.traced_layers == tuple(moe) and len(moe) == 58
    assert rep.template_layers == (0, 1, 2, "embed", "head")
    for i in (0, 1, 2):  # dense layers untouched
        assert costs.layers[i] == analytic.layers[i]
    assert costs.embed == analytic.embed and costs.head == analytic.head
    assert rep.comm_blocks == 20 and costs.overlap_slowdown == pytest.approx(132 / 112)
    # each group's mean over the MoE layers now equals the trace's per-layer mean
    for g, want in rep.trace_ms.items():
        op, ph = g[:-3], g[-2]
        kinds = [k for k, o in {TaskKind.MIXER: "attn", TaskKind.ROUTER: "attn", TaskKind.EXPERT: "mlp",
                                TaskKind.SHARED: "mlp", TaskKind.DISPATCH: "dispatch",
                                TaskKind.COMBINE: "combine"}.items() if o == op]
        got = sum(t.ms for i in moe for t in costs.layers[i].tasks if t.kind in kinds and t.phase.value == ph) / len(moe)
        assert got == pytest.approx(want, rel=1e-9), g
    # traced compute is divided by the slowdown it ran under; communication is not
    assert rep.trace_ms["dispatch(F)"] == pytest.approx(26.761 / 4, rel=1e-3)
    assert rep.trace_ms["mlp(F)"] == pytest.approx(18.415 / 4 / (132 / 112), rel=1e-3)
    # the analytic FP8 model is within a factor 1.6 of the measurement for every group
    assert all(0.6 < f < 1.6 for f in rep.factors.values()), rep.factors


def test_trace_of_another_layout_is_refused(dsv3):
    recipe, res, _ = _dsv3_costs()
    check_trace_matches(dsv3, res.model, res.hardware, ParallelShape.of(recipe.parallel))  # matches
    other = load_recipe(str(RECIPES / "qwen3-next-80b.yaml"))
    ores = resolve(other)
    with pytest.raises(TesseraConfigError) as e:
        check_trace_matches(dsv3, ores.model, ores.hardware, ParallelShape.of(other.parallel))
    assert e.value.field == "planner.trace" and "hidden 7168 (recipe 2048)" in str(e.value)


def test_cost_source_trace_through_the_flow():
    with pytest.raises(TesseraConfigError) as e:
        _dsv3_costs("planner.cost_source=trace")
    assert e.value.field == "planner.trace"
    _, _, costs = _dsv3_costs("planner.cost_source=trace", f"planner.trace={DSV3}")
    assert costs.source == "trace"
