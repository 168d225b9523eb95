"""benchmarks/gpu_check.py where there is no GPU: one line, exit 0, ``{"skipped": ...}`` in the
JSON; and its whole code path as a CPU dry run (``--smoke-cpu``: every self-check a CPU can
evaluate runs and passes, the two that need CUDA are reported skipped with their reason). On a
GPU machine the first test is skipped: there the script measures (run it directly)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.cost.analytic import analytic_costs
from tessera.cost.types import ParallelShape
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: gpu_check measures there (run it directly)")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines == ["gpu_check: no GPU: torch.cuda.is_available() is False, nothing measured "
                     "(benchmarks/gpu_check.py needs CUDA)"]
    assert json.loads(out.read_text()) == {"skipped": lines[0].removeprefix("gpu_check: ")}


def test_cpu_dry_run_passes_its_own_checks(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke-cpu", "--iters", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    # exactly these checks ran on CPU, and passed; the two that need CUDA are skipped, with why
    assert res["smoke"] is True and res["ok"] is True
    assert res["checks"] == {"bf16_autocast": True, "losses_finite_and_falling": True, "every_task_timed": True,
                             "tasks_within_iteration": True, "mfu_in_range": True, "within_budget": True}
    assert res["checks_skipped"] == {
        "cuda_events": "CPU smoke run: no CUDA events, the engine times with the host clock (timer HostTimer)",
        "side_streams": "CPU smoke run: no CUDA side streams and no NCCL (comm_stream skipped)"}
    assert res["timer"] == "HostTimer" and res["comm_stream"] == {"skipped": "smoke run on CPU: no NCCL"}
    # the model FLOPs are the analytic model's for this shape (tiny-qwen3-next, 2 microbatches of 1 x 32)
    m, mbs, seq = res["num_microbatches"], res["micro_batch_size"], res["seq_length"]
    assert (m, mbs, seq) == (2, 1, 32)
    costs = analytic_costs(get_model("tiny-qwen3-next"), get_hardware("cpu"),
                           ParallelShape(pp=1, num_microbatches=m, micro_batch_size=mbs, seq_length=seq))
    flops = m * sum(t.flops for lc in (costs.embed, *costs.layers, costs.head) for t in lc.tasks)
    assert res["model_flops_per_iteration"] == pytest.approx(flops, rel=1e-12) and flops > 0
    # MFU: those FLOPs over the median iteration time x the bf16 peak measured on this CPU (not the
    # cpu preset's 1 TFLOP/s placeholder), and in (0, 1) (mfu_in_range above)
    assert res["peak_source"].startswith("measured on this CPU: bf16 matmul")
    assert 0 < res["peak_tflops_bf16"] != get_hardware("cpu").peak_tflops
    wall_s = res["iteration_ms_median"] / 1e3
    assert res["iteration_ms_median"] == statistics.median(res["iteration_ms"])
    assert res["mfu"] == pytest.approx(flops / (wall_s * res["peak_tflops_bf16"] * 1e12), rel=1e-9)
    assert 0 < res["mfu"] < 1
    assert res["tokens_per_s"] == pytest.approx(m * mbs * seq / wall_s, rel=1e-9)
    kinds = {(r["kind"], r["phase"]) for r in res["tasks"]}
    assert {("mixer", "F"), ("expert", "B"), ("expert", "W"), ("head", "F")} <= kinds
    assert all(r["analytic_ms"] > 0 for r in res["tasks"] if r["kind"] in ("mixer", "expert", "head"))
