"""benchmarks/gpu_check.py where there is no GPU: one line, exit 0, ``{"skipped": ...}`` in the
JSON; and its whole code path as a CPU dry run (``--smoke-cpu``: every self-check passes). On a
GPU machine the first test is skipped: there the script measures (run it directly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    assert res["smoke"] is True and res["ok"] is True and all(res["checks"].values()), res["checks"]
    assert res["timer"] == "HostTimer" and res["comm_stream"] == {"skipped": "smoke run on CPU: no NCCL"}
    assert res["model_flops_per_iteration"] > 0 and res["tokens_per_s"] > 0
    kinds = {(r["kind"], r["phase"]) for r in res["tasks"]}
    assert {("mixer", "F"), ("expert", "B"), ("expert", "W"), ("head", "F")} <= kinds
    assert all(r["analytic_ms"] > 0 for r in res["tasks"] if r["kind"] in ("mixer", "expert", "head"))
