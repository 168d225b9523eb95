"""benchmarks/gpu_check.py without a GPU: the no-GPU exit; its whole code path as a CPU dry run
(``--smoke-cpu``) in a process where only the GPU image's packages import (Ray, DeepSpeed,
PySCIPOpt, cvxpy, W&B and omegaconf blocked), every part it can evaluate passing with real
numbers and the others skipped with their reason; a budget too small for the parts; the committed
Programs file against the compiler; the comparison the bitwise checks rest on. On a GPU machine
the no-GPU test is skipped: there the script measures (run it directly)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.cost.analytic import analytic_costs
from tessera.cost.types import ParallelShape
from tessera.spec.hardware_presets import get_hardware

pytestmark = pytest.mark.xdist_group("gpu_check")  # the dry run's module fixture runs once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
DEVICE_ABSENT = ("ray", "deepspeed", "pyscipopt", "cvxpy", "wandb", "omegaconf")
"""Packages the GPU image does not have (omegaconf is carried there, but gpu_check must not need it)."""
# runs the script as __main__ in a process where the named packages are absent: sys.modules[name]
# = None makes `import name` raise ModuleNotFoundError and importlib.util.find_spec(name) return
# None, as for a package that is not installed
BLOCKED_RUN = ("import runpy, sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
               "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gc = _load_script()


def run(*args: str, blocked=(), timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(blocked), str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "smoke.json"
    proc = run("--smoke-cpu", "--json", str(out), blocked=DEVICE_ABSENT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: gpu_check measures there (run it directly)")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run("--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines == ["gpu_check: no GPU: torch.cuda.is_available() is False, nothing measured "
                     "(benchmarks/gpu_check.py needs CUDA)"]
    assert json.loads(out.read_text()) == {"skipped": lines[0].removeprefix("gpu_check: ")}


def test_dry_run_passes_with_only_the_device_packages(smoke):
    proc, res = smoke
    parts = res["parts"]
    assert res["smoke"] is True and res["ok"] is True and res["failed"] == [] and res["heavy_imported"] == []
    assert list(parts) == [p[0] for p in gc.PARTS]
    # one progress line per part, in order, with its status, time and the budget left
    lines = [l for l in proc.stdout.splitlines() if l.startswith("[gpu_check] part ")]
    assert [re.match(r"\[gpu_check\] part (\d)/7 (\w+): ", l).groups() for l in lines] == \
        [(str(i), p[0]) for i, p in enumerate(gc.PARTS)]
    assert all(re.search(r"\(\d+\.\d s, budget left \d+ s\)$", l) for l in lines)
    # what a CPU can evaluate passed; what it cannot is skipped with the reason
    assert {k: v["ok"] for k, v in parts.items()} == {
        "env": True, "nccl_eager": True, "programs": True, "memory": True, "task_timings": True, "overlap": True,
        "throughput": True, "deltanet_fla": None}
    assert res["skipped"] == {"deltanet_fla": "CPU: FLA's kernels are Triton kernels for CUDA"}
    assert "eager NCCL init (device_id) needs CUDA" in parts["nccl_eager"]["skipped"]
    assert parts["memory"]["skipped"].startswith("CPU: no allocator counters")
    assert parts["overlap"]["skipped"].startswith("CPU: no CUDA side stream")
    # the device's packages only: the blocked ones are absent, routing is DeepSpeed-free
    env = parts["env"]
    assert env["project_import_errors"] == {} and env["heavy_imported"] == []
    assert all(env["packages_present"][m] is False for m in DEVICE_ABSENT)
    assert env["gating_source"] == "tessera.model.gating"
    assert env["deltanet_kernel_transformers_picked"] == "torch" and env["fla_kernels_import"] is False
    # the same collectives ran on gloo and returned their input
    n = parts["nccl_eager"]
    assert n["backend"] == "gloo" and n["all_reduce_equal"] and n["new_group_all_reduce_equal"]


def test_programs_part_compares_real_gradients(smoke):
    p = smoke[1]["parts"]["programs"]
    committed = gc.load_programs()
    assert {k: v["hash"] for k, v in p["programs"].items()} == {
        name: committed[key].content_hash for name, key, _, _ in gc.VARIANTS}
    assert len(set(v["hash"] for v in p["programs"].values())) == 8  # recompute reuses the split-W Program
    fp32 = p["fp32"]
    assert fp32["bitwise"] is True and fp32["nondeterministic_ops"] == []
    assert fp32["loss"] == fp32["reference_loss"] and math.isfinite(fp32["loss"]) and fp32["loss"] > 0
    for name, c in fp32["vs_reference"].items():
        assert c["bitwise"] and c["tensors_differ"] == 0 and c["loss_equal"], name
    # plain autograd sums in another order: not bitwise, but within the stated tolerance
    for name, c in fp32["vs_plain"].items():
        assert not c["bitwise"] and c["tensors_differ"] > 0 and 0 < c["max_rel"] <= gc.FP32_PLAIN_TOL["grad_max_rel"]
        assert c["within"] and c["rel_l2"] <= gc.FP32_PLAIN_TOL["grad_rel_l2"], name
    bf16 = p["bf16"]
    assert bf16["within_tolerance"] and all(c["within"] for c in bf16["vs_plain"].values())
    assert all(0 < c["rel_l2"] and not c["bitwise"] for c in bf16["vs_fp32_reference"].values())  # reported
    assert bf16["loss"] != fp32["loss"]  # BF16 really ran
    # the bubble optimizer ran: a slot before each F and B of the MoE chunk, nothing to fill at pp=1
    assert p["dbo"]["slots"] == 2 * gc.CHECK_M and p["dbo"]["moved"] == 0 and p["dbo"]["annotated_ms"] == 0.0
    assert p["deltanet_calls"]["torch"] > 0


def test_compare_tells_equal_from_different_tensors():
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    same = gc.compare(a, {k: v.clone() for k, v in a.items()})
    assert same == {"bitwise": True, "tensors_differ": 0, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0,
                    "worst": None}
    b = {k: v.clone() for k, v in a.items()}
    b["w"][1, 2] = torch.nextafter(b["w"][1, 2], torch.tensor(math.inf))  # one ulp
    c = gc.compare(b, a)
    assert c["bitwise"] is False and c["tensors_differ"] == 1 and c["worst"] == "w"
    assert c["max_abs"] == pytest.approx(abs(float(b["w"][1, 2] - a["w"][1, 2])))
    assert 0 < c["max_rel"] < 1e-6 and 0 < c["rel_l2"] < c["max_rel"]
    assert gc.within(c, 0.0, gc.FP32_PLAIN_TOL)
    b["b"] = a["b"] * 1.01  # a 1 % error fails the FP32 tolerance, passes the BF16 one
    c = gc.compare(b, a)
    assert not gc.within(c, 0.0, gc.FP32_PLAIN_TOL) and gc.within(c, 0.0, gc.BF16_TOL)
    assert gc.compare({"w": a["w"]}, a)["bitwise"] is False  # a missing gradient is a difference
    assert gc.compare({"w": a["w"].double(), "b": a["b"]}, a)["bitwise"] is False  # so is another dtype


def test_timing_and_memory_tables(smoke):
    parts = smoke[1]["parts"]
    t = parts["task_timings"]
    assert t["hardware_preset"] == "cpu" and t["clock"] == "host perf_counter" and t["missing_tasks"] == []
    kinds = {(r["layer"], r["kind"], r["phase"]) for r in t["rows"]}
    for layer in ("deltanet+moe", "attention+moe"):
        for kind in ("mixer", "router", "expert", "shared"):
            assert {(layer, kind, ph) for ph in "FBW"} <= kinds
        assert {(layer, "dispatch", "F"), (layer, "combine", "B")} <= kinds
    assert {("head", "head", ph) for ph in "FBW"} <= kinds and ("embed", "embed", "F") in kinds
    for r in t["rows"]:
        assert r["measured_ms"] >= 0 and r["samples"] == gc.TIMING_M * t["profiled_iterations"]
        assert r["comparable"] == (r["kind"] not in ("dispatch", "combine"))
        if r["analytic_ms"]:
            assert r["ratio"] == pytest.approx(r["measured_ms"] / r["analytic_ms"], rel=1e-12)
    # the analytic side is the cost model's, for the same shape with all experts at ep=2
    costs = analytic_costs(gc.timing_spec("cpu", local=False), get_hardware("cpu"), ParallelShape(
        pp=1, ep=2, dp=2, num_microbatches=gc.TIMING_M, micro_batch_size=gc.TIMING_MBS, seq_length=64))
    want = {(lc.index, x.kind.value, x.phase.value): x.ms for lc in (costs.embed, *costs.layers, costs.head)
            for x in lc.tasks}
    for r in t["rows"]:
        assert r["analytic_ms"] == pytest.approx(want[(r["index"], r["kind"], r["phase"])], rel=1e-12)
        assert r["analytic_ms"] > 0
    by = {(r["kind"], r["phase"]): r for r in t["by_kind_phase"]}
    mixer_f = [r for r in t["rows"] if (r["kind"], r["phase"]) == ("mixer", "F")]
    assert by[("mixer", "F")]["measured_ms"] == pytest.approx(sum(r["measured_ms"] for r in mixer_f))
    row = smoke[1]["calibration_row"]["ratio_by_task"]
    assert set(row) == {f"{p}.{k}" for k, p in by if k not in ("dispatch", "combine")}
    # memory: every task of the profiled iteration measured; the model's bytes per kind and the ratios
    m = parts["memory"]
    assert m["missing_tasks"] == [] and m["saved_peak_bytes"] > 0 and m["iteration_peak_bytes"] is None
    f_rows = {(r["layer"], r["kind"]): r for r in m["rows"] if r["phase"] == "F"}
    for layer in ("deltanet+moe", "attention+moe"):
        for kind in ("mixer", "router", "dispatch", "expert", "shared"):
            r = f_rows[(layer, kind)]
            assert r["model_bytes"] > 0 and r["saved_bytes"] > 0 and r["allocated_bytes"] is None
            assert r["ratio_saved"] == pytest.approx(r["saved_bytes"] / r["model_bytes"], rel=1e-12)
    assert f_rows[("head", "head")]["model_bytes"] > 0
    # B tasks release what their F saved (the saved-tensor meter counts down)
    assert sum(r["saved_bytes"] for r in m["rows"] if r["phase"] == "B") < 0


def test_throughput_and_overlap(smoke):
    parts = smoke[1]["parts"]
    tp = parts["throughput"]
    costs = analytic_costs(gc.timing_spec("cpu", local=False), get_hardware("cpu"), ParallelShape(
        pp=1, ep=2, dp=2, num_microbatches=gc.TIMING_M, micro_batch_size=gc.TIMING_MBS, seq_length=64))
    flops = gc.TIMING_M * sum(x.flops for lc in (costs.embed, *costs.layers, costs.head) for x in lc.tasks)
    assert tp["model_flops_per_iteration"] == pytest.approx(flops, rel=1e-12) and flops > 0
    wall_s = tp["iteration_ms_median"] / 1e3
    assert tp["mfu"] == pytest.approx(flops / (wall_s * tp["peak_tflops_bf16"] * 1e12), rel=1e-9)
    assert 0 < tp["mfu"] < 1 and tp["peak_source"].startswith("measured on this CPU: bf16 matmul")
    assert tp["tokens_per_s"] == pytest.approx(gc.TIMING_M * 64 / wall_s, rel=1e-9)
    o = parts["overlap"]
    assert o["side_stream"] is False
    assert set(o["kinds"]) == {"h2d_copy", "nccl_all_to_all"}
    assert all(k["results_equal"] and k["gemm_ms"] > 0 and k["transfer_ms"] > 0 for k in o["kinds"].values())


def test_programs_file_is_what_the_compiler_writes_now():
    committed = json.loads(gc.PROGRAMS_FILE.read_text())
    assert committed == json.loads(json.dumps(gc.build_programs(), sort_keys=True)), \
        "run: python benchmarks/gpu_check.py --write-programs benchmarks/results/gpu-check-programs.json"
    progs = gc.load_programs()
    assert set(progs) == {n for n in gc.program_plans()}
    assert all(p.pp == 1 and p.rank == 0 for p in progs.values())
    for name in ("check/interleaved-vpp2", "check/dualpipe-v", "check/zb-v"):  # two chunks on the one rank
        assert progs[name].vpp == 2 and len(progs[name].stages) == 2
        assert not any(i.op.value.startswith(("send", "recv")) for i in progs[name].instructions)
    assert any(i.op.value == "slot" for i in progs["check/dbo"].instructions)
    assert any(i.op.value == "FB" for i in progs["check/1f1b-fb"].instructions)


def test_with_deepspeed_and_a_budget_too_small_for_the_parts(tmp_path):
    """Everything the image lacks blocked except DeepSpeed, and a budget of 0.5 s: part 0 (no
    budget needed) imports every project module the script uses and routing comes from
    DeepSpeed; every other part is skipped with the budget as its reason; the JSON is complete
    and the run is not a failure."""
    out = tmp_path / "budget.json"
    proc = run("--smoke-cpu", "--budget-s", "0.5", "--json", str(out),
               blocked=[m for m in DEVICE_ABSENT if m != "deepspeed"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    env = res["parts"]["env"]
    assert env["ok"] and env["project_import_errors"] == {} and env["gating_source"] == "deepspeed"
    assert env["project_modules"] == len(gc.PROJECT_MODULES)
    assert res["ok"] is True and res["failed"] == [] and list(res["parts"]) == [p[0] for p in gc.PARTS]
    assert set(res["skipped"]) == {p[0] for p in gc.PARTS} - {"env"}
    for name, why in res["skipped"].items():
        assert re.fullmatch(r"budget: -?\d+ s of --budget-s 0.5 left, the part needs about \d+ s", why), (name, why)
    assert len([l for l in proc.stdout.splitlines() if l.startswith("[gpu_check] part ")]) == len(gc.PARTS)


def test_the_deltanet_kernel_switch_routes_each_call_and_restores(monkeypatch):
    """``deltanet_kernel`` sends transformers' chunked gated delta rule to the torch path or to
    FLA's function (here a stand-in with FLA's signature that computes the torch path), counts the
    calls and puts transformers' function back after."""
    import inspect
    import types

    import transformers.models.qwen3_next.modeling_qwen3_next as q

    from tessera.model import StageModule

    before = q.torch_chunk_gated_delta_rule
    torch_fn = inspect.unwrap(before)
    seen = []

    def fla_like(q_, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, cu_seqlens=None, **kwargs):
        seen.append((use_qk_l2norm_in_kernel, cu_seqlens, kwargs))
        return torch_fn(q_, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fla_like
    spec = gc.check_spec()
    mod = StageModule(spec, (-1, spec.num_layers + 1), seed=0)
    layer = next(l for l in mod.layers if l.mixer_kind == "deltanet")
    hn = layer.input_layernorm(torch.randn(1, 16, spec.hidden, generator=torch.Generator().manual_seed(0)))
    calls: dict = __import__("collections").Counter()
    with torch.no_grad():
        with gc.deltanet_kernel(mod, "torch", calls):
            a = layer.attn(hn)
        with gc.deltanet_kernel(mod, "fla", calls):
            b = layer.attn(hn)
    assert dict(calls) == {"torch": 1, "fla": 1} and torch.equal(a, b)
    assert seen == [(True, None, {})]  # transformers' keywords reach FLA's by name
    assert q.torch_chunk_gated_delta_rule is before
