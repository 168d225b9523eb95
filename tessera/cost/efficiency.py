"""Kernel efficiency by shape: the achieved rate of GEMMs and the roofline time of one operator.

A GEMM of one group ``C[M, N] = A[M, K] B[K, N]`` reaches the fraction

    eff(M, N, K) = ceiling * M/(M + mn_half) * N/(N + mn_half) * K/(K + k_half)

of the dense peak of its precision, with ``ceiling = mfu_efficiency`` (BF16) or
``mfu_efficiency * fp8_efficiency_ratio`` (FP8), ``mn_half = gemm_mn_half`` and
``k_half = gemm_k_half`` (BF16) or ``gemm_k_half * peak_tflops_fp8 / peak_tflops`` (FP8): the
same fixed prologue/epilogue time per output tile is worth twice the K at twice the math rate.
The output-dim factors stand for tile quantization and occupancy (a 128 x 128 tile computes
whole tiles; a short M fills few SMs), the K factor for the fixed cost per tile, so the curve is
a smooth saturating one in each dim that tends to ``ceiling`` for large GEMMs (an 8192^3 BF16
GEMM reaches 0.93 of it on the Hopper constants). No wave quantization (the curve stays smooth).

Grouped expert GEMMs (:class:`tessera.cost.flops.GemmShape` with ``groups`` local experts) are
evaluated per expert: ``M = tokens*top_k/groups`` rows in F and B (balanced routing), and in W the
reduction dim is that per-expert token count, so fine-grained experts with few tokens each are
slow in every phase.

An operator's time (:func:`op_seconds`) is the roofline
``max(flops / (peak * eff), bytes / (mem_bw_tbs * mem_bw_efficiency))`` plus
``kernels * kernel_launch_us``; under FP8 a GEMM reads FP8 inputs (:func:`tessera.cost.flops.gemm_bytes`)
and pays a memory-bound quantization kernel for its activation input
(:func:`tessera.cost.flops.fp8_cast_bytes`). Operators without a GEMM shape (FlashAttention,
chunked scans, convolutions, norms, permutes) run at ``peak_tflops * mfu_efficiency`` (BF16 also
under FP8) or their bytes.

Under FP32 (``train.precision=fp32``, :func:`precision_view`) every operator computes at
``peak_for("fp32")`` (TF32 tensor cores on GPUs) instead of ``peak_tflops``, with ``k_half``
scaled by the same ratio (the fixed time per tile at half the math rate); a device with one
native peak (``cpu``: ``peak_tflops_fp32 = 0``) is unchanged.

The constants are :class:`~tessera.spec.hardware.HardwareSpec` fields per preset, fitted to the
DeepGEMM README's H800 tables and the ml-engineering MAMF table (sources in
:mod:`tessera.spec.hardware_presets` and ``docs/cost-model.md``). Pure functions of their
arguments; no state.
"""

from __future__ import annotations

import dataclasses
import functools

from tessera.cost.flops import OpCost, fp8_cast_bytes, gemm_bytes
from tessera.spec.hardware import HardwareSpec


@functools.lru_cache(maxsize=64)
def precision_view(hw: HardwareSpec, precision: str) -> HardwareSpec:
    """``hw`` as the rate functions here see it under ``precision`` (module docstring): under
    ``fp32`` ``peak_tflops = hw.peak_for("fp32")`` and ``gemm_k_half`` scaled by
    ``peak_for("fp32") / peak_tflops``; ``hw`` itself otherwise (FP8 is chosen per GEMM, ``fp8``)
    and when the FP32 peak is the native one."""
    if precision != "fp32":
        return hw
    peak = hw.peak_for("fp32")
    if peak == hw.peak_tflops:
        return hw
    return dataclasses.replace(hw, peak_tflops=peak, gemm_k_half=hw.gemm_k_half * peak / hw.peak_tflops)


def saturation(x: float, half: float) -> float:
    """``x / (x + half)`` for ``x >= 0`` (``half <= 0``: 1, no size effect)."""
    if half <= 0:
        return 1.0
    return x / (x + half)


def gemm_efficiency(m: float, n: float, k: float, hw: HardwareSpec, fp8: bool = False) -> float:
    """Achieved fraction of the dense peak of its precision (BF16, or FP8 with ``fp8``) for one
    GEMM of ``m`` x ``n`` outputs reducing over ``k`` (elements; module docstring). In (0, ceiling]
    for positive dims, 0 when a dim is 0."""
    ceiling = hw.mfu_efficiency * (hw.fp8_efficiency_ratio if fp8 else 1.0)
    k_half = hw.gemm_k_half * (hw.peak_tflops_fp8 / hw.peak_tflops if fp8 else 1.0)
    return (ceiling * saturation(m, hw.gemm_mn_half) * saturation(n, hw.gemm_mn_half)
            * saturation(k, k_half))


def gemm_rate(m: float, n: float, k: float, hw: HardwareSpec, fp8: bool = False) -> float:
    """Achieved FLOP/s of that GEMM: ``peak * gemm_efficiency`` (peak: ``peak_tflops`` or
    ``peak_tflops_fp8``, TFLOP/s * 1e12)."""
    peak = hw.peak_tflops_fp8 if fp8 else hw.peak_tflops
    return peak * 1e12 * gemm_efficiency(m, n, k, hw, fp8)


def op_seconds(op: OpCost, phase: int, hw: HardwareSpec, fp8: bool = False) -> float:
    """Time of one operator in phase 0/1/2 (F/B/W), seconds (module docstring): roofline of its
    FLOPs at the shape-dependent GEMM rate (or ``peak_tflops * mfu_efficiency`` for operators
    without a GEMM shape) and of its bytes at ``mem_bw_tbs * mem_bw_efficiency``, plus
    ``op.kernels[phase] * kernel_launch_us``; ``fp8``: FP8 GEMMs (those with ``gemm.fp8``) at the
    FP8 rate with FP8 input bytes, plus their quantization kernel."""
    bw = hw.mem_bw_tbs * 1e12 * hw.mem_bw_efficiency
    launch = hw.kernel_launch_us * 1e-6
    flops = op.flops[phase]
    g = op.gemm
    if g is None:
        compute = flops / (hw.peak_tflops * 1e12 * hw.mfu_efficiency) if flops else 0.0
        return max(compute, op.bytes[phase] / bw) + op.kernels[phase] * launch
    use8 = fp8 and g.fp8
    if use8 and hw.peak_tflops_fp8 <= 0:
        raise ValueError(f"hardware {hw.name!r} has no FP8 peak (peak_tflops_fp8={hw.peak_tflops_fp8})")
    compute = flops / gemm_rate(*g.phase_mnk(phase), hw, use8) if flops else 0.0
    t = max(compute, gemm_bytes(g, phase, use8) / bw) + op.kernels[phase] * launch
    if use8:
        cast = fp8_cast_bytes(g, phase)
        if cast:
            t += cast / bw + launch
    return t
