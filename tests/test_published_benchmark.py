"""``benchmarks/published.py``: published runs become recipes with their own settings, and the
predicted throughput is the simulated step over the run's tokens (the fields the issue names)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from tessera.config.load import recipe_from_dict
from tessera.flow import simulate_recipe

pytestmark = pytest.mark.xdist_group("published_benchmark")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("published_bench", ROOT / "benchmarks" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs():
    return {r["id"]: r for r in yaml.safe_load((ROOT / "benchmarks" / "published_runs.yaml").read_text())}


def test_every_run_names_its_source_and_set(runs):
    assert len(runs) >= 20
    assert sum(r["set"] == "calibration" for r in runs.values()) == 6
    for r in runs.values():
        assert r["set"] in ("calibration", "validation") and r["source"], r["id"]
        assert r["gpus"] == r["tp"] * r["pp"] * (r.get("cp") or 1) * r["dp"], r["id"]


def test_runs_map_to_their_own_settings(bench, runs):
    recipe, passes = bench.recipe_of(runs["am-dsv3-h100-1024-bf16"])
    p, pl = recipe.parallel, recipe.planner
    # AutoModel: 4 gradient-accumulation passes of local batch 8 / micro batch 1
    assert passes == 4 and p.num_microbatches == 8
    assert (p.pp, p.vpp, p.ep, p.dp, p.moe_dispatcher, p.dp_shard) == (4, 8, 64, 256, "deepep", "fsdp")
    assert (pl.template, pl.activation_recompute, pl.split_w, pl.overlap) == ("interleaved-1f1b", "full", False, False)
    assert recipe.model.mtp_layers == 0 and recipe.hardware.preset == "h100-sxm"
    assert recipe.train.cuda_graphs == "none"  # AutoModel: no CUDA graphs
    recipe, passes = bench.recipe_of(runs["mb-260401-nemotron3-nano-h100-16-fp8"])
    # Megatron: one pass of global_batch / (dp * micro_batch) microbatches; FP8; selective modules
    assert passes == 1 and recipe.parallel.num_microbatches == 1024 // 16
    assert recipe.train.precision == "fp8" and recipe.planner.activation_recompute == "selective"
    assert recipe.train.fp8_recipe == "tensorwise"  # "fp8 current scaling (per-tensor)"
    assert bench.recipe_of(runs["mb-260401-qwen3-30b-b200-8-mxfp8"])[0].train.fp8_recipe == "mxfp8"
    assert bench._fp8_recipe({"precision": runs["dsv3-report-h800-2048-fp8"]["precision"]}) == "blockwise"
    assert set(recipe.planner.recompute_modules) == {"moe", "layernorm", "core_attn", "moe_act"}
    assert tuple(recipe.train.cuda_graphs) == ("mamba",)  # the record's scopes (its recipe's cuda_graph_scope)
    assert all("cuda_graphs" in r for r in runs.values())  # every record states its CUDA graphs (or null)
    with pytest.raises(bench.Skip, match="no model preset"):
        bench.recipe_of(runs["mb-260401-gptoss120b-h100-64-bf16"])


def test_record_fields_and_throughput_identity(bench, runs, tmp_path):
    out = tmp_path / "pub.json"
    assert bench.main(["--json", str(out), "--only", "am-qwen3-30b-h100-8-bf16,mb-260401-gptoss120b-h100-64-bf16"]) == 0
    d = json.loads(out.read_text())
    rec, skipped = d["records"]
    for f in ("model", "gpus", "hardware", "precision", "layout", "published_tokens_per_s_per_gpu",
              "predicted_tokens_per_s_per_gpu", "ratio", "memory_accepted", "source", "set"):
        assert f in rec, f
    assert rec["predicted_tokens_per_s_per_gpu"] == pytest.approx(512 * 4096 / (rec["step_ms"] / 1e3) / 8, rel=1e-12)
    assert rec["ratio"] == pytest.approx(rec["predicted_tokens_per_s_per_gpu"] / 12040, rel=1e-12)
    # the run's own settings, written out here from its record (8 H100, pp=1 ep=8 dp=8, micro batch 4
    # of 4096 tokens, global batch 512: 512 / (8 * 4) = 16 microbatches in one pass; full
    # recompute, DeepEP, FSDP, BF16 without FP32 master weights: AutoModel), are the recipe it ran
    recipe = recipe_from_dict({
        "name": "am-qwen3-30b-h100-8-bf16", "model": {"preset": "qwen3-30b-a3b"}, "hardware": {"preset": "h100-sxm"},
        "parallel": {"pp": 1, "vpp": 1, "ep": 8, "tp": 1, "dp": 8, "num_microbatches": 16, "micro_batch_size": 4,
                     "seq_length": 4096, "moe_dispatcher": "deepep", "dp_shard": "fsdp"},
        "planner": {"template": "1f1b", "activation_recompute": "full", "split_w": False, "overlap": False},
        "train": {"precision": "bf16", "master_weights": False}, "logging": {"trace": False, "png": False}})
    assert bench.recipe_of(runs["am-qwen3-30b-h100-8-bf16"]) == (recipe, 1)
    # ... and its step is that recipe's iteration as `tessera simulate` gives it (one pass: no
    # optimizer step to take off), so the ratio is the cost model's, to float rounding
    sim = simulate_recipe(recipe)
    assert rec["step_ms"] == pytest.approx(sim.result.iteration_ms, rel=1e-12)
    assert rec["ratio"] == pytest.approx(512 * 4096 / (sim.result.iteration_ms / 1e3) / 8 / 12040, rel=1e-12)
    assert rec["peak_mem_gb"] == pytest.approx(sim.result.peak_mem_gb, rel=1e-12) and rec["memory_accepted"] is True
    assert 0.5 < rec["ratio"] < 2.0  # and within a factor of two of the measured 12,040 tokens/s/GPU
    assert "skipped" in skipped and "GPT-OSS" in skipped["skipped"]
    s = d["summary"]
    assert s["simulated"] == 1 and s["skipped"] == 1
    assert s["mape_calibration"] == pytest.approx(abs(rec["ratio"] - 1), rel=1e-12) and s["mape_validation"] is None


def test_spearman_of_ranks(bench):
    assert bench._spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench._spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert bench._spearman([1, 2], [1, 2]) is None


def test_pairs_differ_in_one_setting_that_reaches_its_recipe_knob():
    """``benchmarks/published_pairs.yaml``: the two runs of a pair differ in its one setting (and the
    fields that follow from it) and nothing else, and their recipes differ in exactly the setting's
    knob, or, where it has none, not at all (the cost model cannot tell the two runs apart)."""
    spec = importlib.util.spec_from_file_location("relative_bench", ROOT / "benchmarks" / "relative.py")
    rel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rel)
    pairs, runs = rel.load()
    assert len(pairs) >= 5
    for p in pairs:
        a, b = runs[p["a"]], runs[p["b"]]
        declared = {p["setting"], *p.get("follows", []), *p.get("also_changes", [])}
        assert rel.changed_settings(a, b) == sorted(declared), p["id"]
        assert a["source"] and b["source"] and p["source"], p["id"]
        (ra, na), (rb, nb) = rel._published_module().recipe_of(a), rel._published_module().recipe_of(b)
        changes = rel.recipe_changes(ra, rb, na, nb)
        assert set(changes) - {"passes"} == set(p["knob"] or []), (p["id"], changes)
    # one pair changes a second setting with the first, and says so
    assert [p["id"] for p in pairs if p.get("also_changes")] == ["dsv3-am-h100-1024-vs-256"]
    by_id = {p["id"]: p for p in pairs}
    (ra, na), (rb, nb) = (rel._published_module().recipe_of(runs[by_id["dsv3-am-h100-1024-vs-256"][s]]) for s in "ab")
    assert rel.recipe_changes(ra, rb, na, nb) == {"parallel.dp": [64, 256], "passes": [1, 4]}
    # the DeepSeek-V3 proxy: the preset's first 14 layers, its MTP layer, pp 4 x vpp 2, 256 / 16 microbatches
    recipe, passes = rel._published_module().recipe_of(runs["mlm6311-dsv3-14l-h100-64-bf16-plain"])
    assert (recipe.model.num_layers, recipe.model.mtp_layers, recipe.parallel.vpp, recipe.parallel.num_microbatches,
            recipe.parallel.seq_length, passes) == (14, 1, 2, 16, 2048, 1)
