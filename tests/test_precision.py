"""``train.precision`` (``auto | bf16 | fp8 | fp32``): its resolution, the cost model's peak per
dtype and the MFU peak (pure functions; the engine's BF16 is ``tests/test_bf16.py``).

Datasheet numbers asserted: H100 SXM / H800 / H200 TF32 dense 494.7 TFLOP/s (H100 whitepaper;
half the 989.4 BF16), B200 1,125 (DGX B200: 18 PFLOP/s TF32 with sparsity for 8 GPUs). The
``cpu`` preset has one native peak, so a CPU recipe's costs under its default ``fp32`` are those
it had under ``bf16``, number for number.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config.auto import resolve_precision
from tessera.config.cost_rules import check_cost_fields, cost_options
from tessera.config.load import load_recipe
from tessera.config.profile_rules import profile_fingerprint
from tessera.config.resolve import resolve_hardware, resolve_model
from tessera.config.schema import ParallelConfig, TrainConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.efficiency import precision_view
from tessera.cost.types import CostOptions
from tessera.errors import TesseraConfigError
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.train.worker.metrics import device_peak_tflops, job_peak_flops, measure_matmul_flops

TINY, QWEN = "recipes/tiny-qwen3-next.yaml", "recipes/qwen3-next-80b.yaml"
H800, CPU, B200 = get_hardware("h800"), get_hardware("cpu"), get_hardware("b200")


class MatmulLog(TorchDispatchMode):
    """Records every ``aten.mm`` run under it (shapes, dtype, perf_counter before and after it) and
    runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.mms: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = []
        self.times: list[tuple[float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.mm.default:
            return func(*args, **(kwargs or {}))
        a, b = args[0], args[1]
        assert a.dtype == b.dtype
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times.append((start, time.perf_counter()))
        self.mms.append((tuple(a.shape), tuple(b.shape), a.dtype))
        return out


def check_benchmark(call, n: int, dtype: torch.dtype, min_time_s: float) -> None:
    """``call()`` (a matmul benchmark returning FLOP/s) issues only ``n x n`` matmuls in ``dtype``, a
    warm-up and then rounds of 8, and returns the FLOPs of all but the warm-up (2 n^3 each) over
    the time from the warm-up's end to the last one's end: at least ``min_time_s``, within the
    times seen around them here (the host clock; exact bounds, whatever the machine's load)."""
    with MatmulLog() as log:
        rate = call()
        end = time.perf_counter()
    assert set(log.mms) == {((n, n), (n, n), dtype)}, (dtype, set(log.mms))
    assert len(log.mms) >= 9 and (len(log.mms) - 1) % 8 == 0, len(log.mms)
    timed = 2 * n ** 3 * (len(log.mms) - 1)
    warm_end, first_start, last_end = log.times[0][1], log.times[1][0], log.times[-1][1]
    shortest, longest = max(min_time_s, last_end - first_start), end - warm_end
    assert timed / longest <= rate <= timed / shortest, (dtype, rate, timed, shortest, longest)


def test_auto_resolves_by_hardware():
    assert TrainConfig().precision == "auto"
    tiny, qwen = load_recipe(TINY), load_recipe(QWEN)
    assert (tiny.train.precision, qwen.train.precision) == ("auto", "auto")
    assert resolve_precision(tiny) == "fp32" and resolve_precision(qwen) == "bf16"
    # auto stays auto in the recipe, so a later hardware override re-resolves it
    assert resolve_precision(tiny.with_overrides(["hardware.preset=h800"])) == "bf16"
    for p in ("bf16", "fp8", "fp32"):
        assert resolve_precision(load_recipe(TINY, [f"train.precision={p}"])) == p
    assert cost_options(tiny).precision == "fp32" and cost_options(qwen).precision == "bf16"


def test_unknown_precision_refused():
    with pytest.raises(TesseraConfigError) as e:
        check_cost_fields(load_recipe(TINY, ["train.precision=fp16"]))
    assert str(e.value).startswith("train.precision='fp16'") and "auto, bf16, fp8, fp32" in str(e.value)


def test_peaks_per_dtype():
    for name in ("h100-sxm", "h800", "h200"):
        hw = get_hardware(name)
        assert (hw.peak_for("bf16"), hw.peak_for("fp32"), hw.peak_for("fp8")) == (989.0, 494.7, 1979.0)
    assert (B200.peak_for("bf16"), B200.peak_for("fp32"), B200.peak_for("fp8")) == (2250.0, 1125.0, 4500.0)
    assert CPU.peak_tflops_fp32 == 0.0 and CPU.peak_for("fp32") == CPU.peak_tflops == 1.0
    with pytest.raises(ValueError, match="auto"):
        H800.peak_for("auto")


def test_mfu_peak_is_the_dtype_used():
    assert device_peak_tflops(H800, "fp32") == 494.7
    assert device_peak_tflops(H800, "bf16") == 989.0
    assert device_peak_tflops(H800, "fp8") == 1979.0  # the cost model's FP8 GEMM peak
    # on a GPU device the job peak is the per-device peak x world size (1 here), no benchmark
    assert job_peak_flops(H800, "cuda:0", precision="fp32") == pytest.approx(494.7e12)
    assert job_peak_flops(B200, "cuda:0", precision="bf16") == pytest.approx(2250e12)
    # on CPU the benchmark runs in the compute dtype: its FLOP/s is that of the matmuls it ran
    for dtype in (torch.bfloat16, torch.float32):
        check_benchmark(lambda: measure_matmul_flops(n=64, min_time_s=0.05, dtype=dtype), 64, dtype, 0.05)
    # job_peak_flops on CPU (no process group: one rank) is that benchmark in train.precision's dtype
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        check_benchmark(lambda: job_peak_flops(CPU, "cpu", precision=precision), 256, dtype, 0.25)


def test_cpu_costs_unchanged_under_fp32():
    tiny = load_recipe(TINY)
    model, hw = resolve_model(tiny), resolve_hardware(tiny)
    assert precision_view(hw, "fp32") is hw
    p = ParallelConfig(pp=2, vpp=2, num_microbatches=4, micro_batch_size=1, seq_length=64)
    assert analytic_costs(model, hw, p, options=CostOptions(precision="fp32")) == \
        analytic_costs(model, hw, p, options=CostOptions(precision="bf16"))


def test_gpu_fp32_at_the_tf32_peak():
    view = precision_view(H800, "fp32")
    assert view.peak_tflops == 494.7 and view.gemm_k_half == pytest.approx(250.0 * 494.7 / 989.0)
    model = get_model("qwen3-next-80b-a3b")
    p = ParallelConfig(pp=8, ep=8, dp=8, num_microbatches=16, micro_batch_size=1, seq_length=4096)
    bf = analytic_costs(model, H800, p, options=CostOptions(precision="bf16"))
    f32 = analytic_costs(model, H800, p, options=CostOptions(precision="fp32"))
    ratios = [b.ms / a.ms for la, lb in zip(bf.layers, f32.layers) for a, b in zip(la.tasks, lb.tasks) if a.ms > 0.1]
    assert ratios and all(1.0 <= r <= 2.0 + 1e-9 for r in ratios), ratios  # compute-bound work at half the rate
    assert max(ratios) > 1.5
    assert bf.layers[0].memory == f32.layers[0].memory  # bytes are counted as for BF16


def test_profile_dtype_follows_the_precision():
    tiny, qwen = load_recipe(TINY), load_recipe(QWEN)
    fp = lambda r: profile_fingerprint(r, resolve_model(r), resolve_hardware(r))  # noqa: E731
    assert fp(tiny).as_dict()["dtype"] == "float32"  # the CPU preset's fingerprints are unchanged
    assert fp(qwen).as_dict()["dtype"] == "bf16"
    assert fp(qwen.with_overrides(["train.precision=fp32"])).as_dict()["dtype"] == "float32"
    assert fp(qwen.with_overrides(["train.master_weights=false"])).as_dict()["dtype"] == "bf16-pure"  # BF16 stages


def test_job_peak_without_a_precision_is_what_auto_resolves_to():
    assert job_peak_flops(H800, "cuda:0") == pytest.approx(989e12)  # bf16 on a GPU
