"""Smoke test of ``benchmarks/dbo.py`` at a tiny size: tiny-qwen3-next (analytic cpu costs),
interleaved-1f1b pp=2 vpp=2, ep=2 (4 local gloo ranks), 4 microbatches, one round, a small
scale, run as a script, without the Ray job that times the count transports (``--no-transports``). Checks the fields and what does not depend on the host's speed (the emulated clocks
against the simulator, counts); no wall-time assertion."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "dbo.py"
FIELDS = ("skew_max_over_mean", "iteration_ms_off", "iteration_ms_on", "reduction", "bubble_fill_rate",
          "monitor_overhead_ratio", "peak_mem_increase_points", "slot_prediction_mean_err", "sim_iteration_ms_off",
          "sim_iteration_ms_on", "count_latency_us_compiled_graph", "count_latency_us_allgather",
          "clock_iteration_ms_off", "clock_iteration_ms_on")


def test_benchmark_runs_at_a_tiny_size(tmp_path):
    out_file = tmp_path / "dbo.json"
    subprocess.run([sys.executable, str(BENCH), "--json", str(out_file), "--model", "tiny-qwen3-next", "--hardware",
                    "cpu", "--pp", "2", "--vpp", "2", "--ep", "2", "--m", "4", "--seq", "64", "--scale", "0.2",
                    "--rounds", "1", "--skew", "1.3", "--no-transports"], check=True, timeout=400, capture_output=True)
    out = json.loads(out_file.read_text())
    for f in FIELDS:
        assert f in out
    assert out["skew_max_over_mean"] == pytest.approx(1.3, abs=0.011)
    assert out["clock_iteration_ms_off"] == pytest.approx(out["sim_iteration_ms_off"], rel=1e-5)
    assert out["clock_iteration_ms_on"] == pytest.approx(out["sim_iteration_ms_on"], rel=1e-5)
    assert out["moved"] == out["sim_moved"]
    assert out["case"]["pp"] == 2 and out["case"]["rounds"] == 1 and len(out["iteration_ms_off_rounds"]) == 1
    # the fill rate (predicted W time run in slots / predicted slot idle, every rank's policy in the
    # last on-iteration) is the simulator's for the same Programs, costs and counts: the same slots
    # reached and the same units chosen; W moved here, so it is not the trivial 0
    assert out["bubble_fill_rate"] == pytest.approx(out["sim_bubble_fill_rate"], rel=1e-9, abs=0)
    assert 0 < out["sim_bubble_fill_rate"] <= 1 and out["moved"] > 0
    assert math.isfinite(out["peak_mem_increase_points"])
    assert out["count_latency_us_compiled_graph"] is None and "--no-transports" in out["count_latency_note"]
    assert out["count_latency_us_allgather_in_emulation"] > 0
