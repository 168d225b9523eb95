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
and pays the memory-bound quantization of its activation input that Transformer Engine runs
under the run's FP8 recipe (:func:`tessera.cost.fp8.fp8_quant`: amax pass, cast, transposed
copy, per-expert launches, expert padding, amax all-reduce under sequence parallelism).
Operators without a GEMM shape (fused attention,
chunked scans, convolutions, norms, permutes) run the FLOPs their kernels execute at the achieved
fraction of ``peak_tflops`` of their kernel class (``OpCost.rate_class``:
``HardwareSpec.kernel_efficiency``, measured attention and gated-delta-rule rates; the others,
and every class on a device without a measured rate such as ``cpu``, their model FLOPs at
``peak_tflops * mfu_efficiency``; BF16 also under FP8) or their bytes.

Under FP32 (``train.precision=fp32``, :func:`precision_view`) every operator computes at
``peak_for("fp32")`` (TF32 tensor cores on GPUs) instead of ``peak_tflops``, with ``k_half``
scaled by the same ratio (the fixed time per tile at half the math rate); a device with one
native peak (``cpu``: ``peak_tflops_fp32 = 0``) is unchanged.

Launches: a grouped expert GEMM is one GEMM per local expert (:func:`tessera.cost.flops.gemm`),
issued round-robin on :data:`GROUPED_GEMM_STREAMS` streams, so its ``kernel_launch_us`` gaps on
the device are ``ceil(groups / streams)`` per phase (:func:`device_launches`; the other streams'
GEMMs run in a stream's gap). Host time (:func:`op_host_seconds`): what the host spends issuing
an operator's kernels from PyTorch eager mode, ``host_gemm_us`` per GEMM call (per expert of a
grouped GEMM) and ``host_kernel_us`` per other kernel (FP8 quantization kernels and amax
all-reduces included), none for an operator inside a captured CUDA graph (:func:`captured`,
``train.cuda_graphs``); :mod:`tessera.cost.analytic` sets it against the device time.

The constants are :class:`~tessera.spec.hardware.HardwareSpec` fields per preset, fitted to the
DeepGEMM README's H800 tables and the ml-engineering MAMF table (sources in
:mod:`tessera.spec.hardware_presets` and ``docs/cost-model.md``). Pure functions of their
arguments; no state.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from tessera.cost.flops import OpCost, gemm_bytes
from tessera.cost.fp8 import FP8Run, fp8_quant
from tessera.spec.hardware import HardwareSpec
from tessera.spec.tasks import TaskKind


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


def op_seconds(op: OpCost, phase: int, hw: HardwareSpec, fp8: bool = False, run: FP8Run = FP8Run()) -> float:
    """Time of one operator in phase 0/1/2 (F/B/W), seconds (module docstring): roofline of its
    FLOPs at the shape-dependent GEMM rate (operators without a GEMM shape: the FLOPs their kernels
    execute, :meth:`~tessera.cost.flops.OpCost.work`, at ``peak_tflops`` times the measured
    :meth:`~tessera.spec.hardware.HardwareSpec.kernel_efficiency` of their ``rate_class``, or where
    none is measured their model FLOPs at ``peak_tflops * mfu_efficiency``) and of its bytes at ``mem_bw_tbs * mem_bw_efficiency``, plus
    ``op.kernels[phase] * kernel_launch_us``; ``fp8``: FP8 GEMMs (those with ``gemm.fp8``) at the
    FP8 rate with FP8 input bytes, plus the quantization work of ``run``'s recipe
    (:func:`tessera.cost.fp8.fp8_quant`): its bytes at the memory rate, its kernels at
    ``kernel_launch_us`` each and its amax all-reduces at ``link_latency_us`` each."""
    bw = hw.mem_bw_tbs * 1e12 * hw.mem_bw_efficiency
    launch = hw.kernel_launch_us * 1e-6
    flops = op.flops[phase]
    g = op.gemm
    if g is None:  # executed FLOPs at the measured rate of the operator's kernel class, else model FLOPs at mfu
        eff = hw.kernel_efficiency(op.rate_class, phase, op.head_dim)
        work = (op.work(phase) if eff > 0 else flops) if flops else 0.0
        compute = work / (hw.peak_tflops * 1e12 * (eff if eff > 0 else hw.mfu_efficiency)) if work else 0.0
        return max(compute, op.bytes[phase] / bw) + op.kernels[phase] * launch
    use8 = fp8 and g.fp8
    if use8 and hw.peak_tflops_fp8 <= 0:
        raise ValueError(f"hardware {hw.name!r} has no FP8 peak (peak_tflops_fp8={hw.peak_tflops_fp8})")
    compute = flops / gemm_rate(*g.phase_mnk(phase), hw, use8) if flops else 0.0
    t = max(compute, gemm_bytes(g, phase, use8) / bw) + device_launches(op, phase) * launch
    if use8:
        q = fp8_quant(g, phase, run)
        t += q.bytes / bw + q.kernels * launch + q.allreduces * hw.link_latency_us * 1e-6
    return t


GROUPED_GEMM_STREAMS = 4
"""CUDA streams a grouped expert GEMM's per-expert GEMMs are issued on, round-robin: Transformer
Engine ``multi_stream_cublas_gemm`` (``get_num_compute_streams()`` = 4,
``transformer_engine/common/util/multi_stream.cpp`` @ d0067d0d) and the ``grouped_gemm`` package's
``CublasGroupedGemm`` (``NUM_STREAM`` 4, fanshiqing/grouped_gemm ``csrc/grouped_gemm.cu`` @ 15721c6)."""


def device_launches(op: OpCost, phase: int) -> float:
    """Kernel launch gaps ``op`` puts on the device's critical path in phase 0/1/2 (F/B/W):
    ``op.kernels[phase]``, but ``ceil(kernels / GROUPED_GEMM_STREAMS)`` for a grouped expert GEMM
    (``gemm.groups > 1``), whose per-expert GEMMs run on :data:`GROUPED_GEMM_STREAMS` streams."""
    k = op.kernels[phase]
    if op.gemm is not None and op.gemm.groups > 1:
        return float(math.ceil(k / GROUPED_GEMM_STREAMS))
    return float(k)


_ROUTER_SCOPE = frozenset({"mlp_norm", "router", "softmax_topk"})
"""Router-task operators Megatron-Core's ``moe_router`` graph holds (``MoELayer.route``: the
pre-MLP norm, the router GEMM, the score / top-k / aux-loss kernels)."""
_PREPROCESS_SCOPE = frozenset({"permute", "latent_down"})
"""Router-task operators of the ``moe_preprocess`` graph (``MoELayer.preprocess``: the latent
down-projection and the dispatcher's ``dispatch_preprocess``, the token permutation)."""


def captured(scopes: tuple[str, ...], kind: TaskKind, op_name: str, mamba: bool = False) -> bool:
    """Whether operator ``op_name`` of a ``kind`` task runs inside a captured CUDA graph under
    ``scopes`` (:data:`tessera.cost.types.CUDA_GRAPH_SCOPES`, Megatron-Core
    ``--cuda-graph-modules``, ``docs/user-guide/features/cuda_graph.md``): ``attn`` the token mixer
    task (``TransformerLayer._forward_attention``: input norm, mixer, residual; Gated DeltaNet and
    MLA included) unless it is Mamba (``mamba``: the Mamba mixer); ``mlp`` the dense MLP task;
    ``moe_router`` the router task's norm, router GEMM and score kernels and the shared expert;
    ``moe_preprocess`` the router task's permutation (and latent down-projection); ``moe`` the
    router, expert, shared, dispatch and combine tasks (``_forward_mlp`` of a MoE layer, its
    residual add included); ``full_iteration`` everything. The router task's residual add is
    outside ``moe_router`` and ``moe_preprocess``."""
    if not scopes:
        return False
    if "full_iteration" in scopes:
        return True
    if kind == TaskKind.MIXER:
        return ("mamba" if mamba else "attn") in scopes
    if kind == TaskKind.MLP:
        return "mlp" in scopes
    if "moe" in scopes and kind in (TaskKind.ROUTER, TaskKind.EXPERT, TaskKind.SHARED, TaskKind.DISPATCH,
                                    TaskKind.COMBINE):
        return True
    if kind == TaskKind.SHARED:
        return "moe_router" in scopes
    if kind == TaskKind.ROUTER:
        return ("moe_router" in scopes and op_name in _ROUTER_SCOPE) or (
            "moe_preprocess" in scopes and op_name in _PREPROCESS_SCOPE)
    return False


def op_host_seconds(op: OpCost, phase: int, hw: HardwareSpec, fp8: bool = False, run: FP8Run = FP8Run()) -> float:
    """Host time to issue ``op``'s kernels in phase 0/1/2 (F/B/W) from PyTorch eager mode, seconds:
    ``op.kernels[phase]`` GEMM calls at ``hw.host_gemm_us`` for a GEMM operator (one per local
    expert of a grouped GEMM) or kernels at ``hw.host_kernel_us`` otherwise; ``fp8``: an FP8 GEMM's
    quantization kernels and amax all-reduces (:func:`tessera.cost.fp8.fp8_quant`) at
    ``host_kernel_us`` each. The caller leaves out operators inside a CUDA graph (:func:`captured`)."""
    g = op.gemm
    if g is None:
        return op.kernels[phase] * hw.host_kernel_us * 1e-6
    t = op.kernels[phase] * hw.host_gemm_us
    if fp8 and g.fp8:
        q = fp8_quant(g, phase, run)
        t += (q.kernels + q.allreduces) * hw.host_kernel_us
    return t * 1e-6
