"""``tessera simulate --json FILE``: every figure of the tables as JSON, the same numbers as the
in-process flow, and the throughput identities that a script comparing runs relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.config.load import load_recipe
from tessera.flow import simulate_recipe

ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "recipes" / "qwen3-next-80b.yaml")
NO_FILES = ["logging.png=false", "logging.trace=false"]


def test_simulate_json_has_every_table_figure(tmp_path, capsys):
    out = tmp_path / "deep" / "sim.json"
    assert main(["simulate", QWEN, "parallel.pp=8", "parallel.vpp=2", *NO_FILES, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    run = simulate_recipe(load_recipe(QWEN, ["parallel.pp=8", "parallel.vpp=2"]))
    r = run.result
    # the numbers are the simulator's, unrounded
    assert d["iteration_ms"] == pytest.approx(r.iteration_ms, rel=1e-12)
    assert d["iteration_ms"] == pytest.approx(1838.9925, abs=1e-3)  # README / planner benchmark baseline
    assert (d["bubble_ratio"], d["exposed_a2a_ratio"], d["mfu"]) == (r.bubble_ratio, r.exposed_a2a_ratio, r.mfu)
    assert d["peak_mem_gb"] == [m.peak_mem_gb for m in r.ranks] and len(d["peak_mem_gb"]) == 8
    assert d["peak_mem_gb_max"] == max(d["peak_mem_gb"])
    # 64 GPUs = pp 8 x dp 8 (tp 1); 16 microbatches of 1 x 4096 tokens per replica
    assert (d["gpus"], d["pp"], d["dp"], d["tp"], d["ep"]) == (64, 8, 8, 1, 8)
    # where the ranks sit (the GPU default: EP groups inside an 8-GPU node, the pipeline across 8 nodes)
    assert d["rank_order"] == "ep-dp-pp" and d["placement"]["crossing"] == ["pipeline"]
    assert d["placement"]["groups"]["ep"]["nodes"] == 1 and d["placement"]["num_nodes"] == 8
    assert "ep-dp-pp, 8 nodes x 8 GPUs; across nodes: pipeline" in text
    assert d["tokens_per_s_per_gpu"] == pytest.approx(16 * 4096 / (r.iteration_ms / 1e3) / 8, rel=1e-12)
    assert d["tflops_per_gpu"] == pytest.approx(r.mfu * run.costs.peak_flops / 1e12, rel=1e-12)
    assert d["layers_per_stage"] == list(run.plan.partition.sizes()) and sum(d["layers_per_stage"]) > 0
    # the table shows the same throughput, and names the file
    assert f"{d['tokens_per_s_per_gpu']:.0f} tokens/s/GPU" in text and str(out) in text
    # what the cost model assumed beyond the layout: the GPU default (auto: bf16), eager, even routing
    assert (d["precision"], d["fp8_recipe"], d["cuda_graphs"]) == ("bf16", None, [])
    assert (d["moe_routing"], d["moe_max_over_mean"]) == ("balanced", 1.0)
    (row,) = [ln for ln in text.splitlines() if ln.startswith("│ cost options ")]
    assert row.split("│")[2].strip() == "bf16; cuda graphs: none; routing: balanced"


def test_simulate_shows_precision_cuda_graphs_and_routing(tmp_path, capsys):
    out = tmp_path / "sim.json"
    settings = ["train.precision=fp8", "train.fp8_recipe=delayed", "train.cuda_graphs=[attn,moe_router]",
                "model.moe_routing=dropless"]
    assert main(["simulate", QWEN, *settings, *NO_FILES, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert (d["precision"], d["fp8_recipe"], d["cuda_graphs"]) == ("fp8", "delayed", ["attn", "moe_router"])
    # dropless without model.moe_max_over_mean: the documented default, 1.30 (tessera.cost.routing)
    assert (d["moe_routing"], d["moe_max_over_mean"]) == ("dropless", 1.3)
    (row,) = [ln for ln in text.splitlines() if ln.startswith("│ cost options ")]
    assert row.split("│")[2].strip() == "fp8 (delayed); cuda graphs: attn, moe_router; routing: dropless 1.30"
    # the settings change what is simulated (FP8 GEMMs, fewer host launches, the busiest EP rank's load)
    assert d["iteration_ms"] != pytest.approx(1838.9925, abs=1e-3)
