"""Hardware presets, per GPU; every number names its public source.

Sources:

- NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): 989 TFLOP/s dense BF16 (the
  datasheet's 1,979 is with 2:4 sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
  bidirectional. NVIDIA H100 architecture whitepaper: 132 SMs on H100 SXM5.
- Measured NVLink peer-to-peer on H100 SXM, about 375 GB/s per direction (of the nominal 450):
  what one GPU pair reaches in practice; used as ``intra_node_gbs``.
- InfiniBand: one 400 Gb/s NDR NIC per GPU in DGX/HGX H100 nodes, about 50 GB/s per direction.
- H800: the China-market H100 with NVLink cut to 400 GB/s bidirectional. DeepSeek-V3 technical
  report (section 3.2): about 160 GB/s achievable NVLink and 50 GB/s InfiniBand per GPU, 20 of
  132 SMs reserved for communication; DeepEP README: 153-158 GB/s intranode, 43-58 GB/s internode.
- NVIDIA H200 datasheet: H100 compute with 141 GB HBM3e at 4.8 TB/s; same NVLink 4 as H100 SXM.
- ``comm_sms`` = 20 on every GPU preset: the DeepSeek-V3 report's reservation for its
  dispatch/combine kernels (H800, same 132-SM die as H100/H200).
- FP8 (``peak_tflops_fp8``): NVIDIA H100 and H200 datasheets, 1,979 TFLOP/s dense FP8 on SXM (the
  datasheets' 3,958 is with sparsity); H800 has H100 SXM compute.
- FP32 GEMMs (``peak_tflops_fp32``, TF32 tensor cores): NVIDIA H100 architecture whitepaper
  (H100 SXM5: 494.7 TFLOP/s dense TF32, half its 989.4 dense BF16; the datasheet's 989 TF32 is
  with sparsity); H800 and H200 have H100 SXM compute (H200 datasheet: 989 TF32 with sparsity).
  B200: DGX/HGX B200 datasheets, 18 PFLOP/s TF32 with sparsity for 8 GPUs, so 1,125 TFLOP/s dense
  per GPU (half its dense BF16).
- NVIDIA DGX/HGX B200 datasheet, per GPU: 2.25 PFLOP/s dense BF16 and 4.5 PFLOP/s dense FP8 (the
  datasheet's 4.5 / 9 are with sparsity), 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s
  bidirectional (900 GB/s per direction), one 400 Gb/s ConnectX-7 NIC per GPU (about 50 GB/s);
  148 SMs (2 dies of 74). ``mxfp8`` = true on B200 only: Transformer Engine runs MXFP8
  (1x32 block-scaled FP8) GEMMs from compute capability 10.0 (B200) on
  (``transformer_engine/pytorch/quantization.py`` ``_compute_mxfp8_support``, release_v2.16).
- ``mem_gb``: the device memory a process can allocate, in GB (1e9 B), as ``nvidia-smi`` reports
  it: 81,559 MiB = 85.52 GB on H100 SXM and H800 ("80 GB" in the datasheets is GiB), 143,771 MiB
  = 150.76 GB on H200 ("141 GB"), 183,359 MiB = 192.27 GB on B200 ("180 GB"). The memory rule
  keeps ``planner.memory_margin`` of it free for the CUDA context, NCCL buffers and fragmentation.

Efficiency fields (the analytic cost model's calibration constants, ``docs/cost-model.md``):

- ``mfu_efficiency`` (0.6) keeps the :class:`HardwareSpec` default: a planning assumption for the
  ceiling of large GEMMs in training, not a datasheet number (isolated matmuls reach 0.80 of the
  BF16 peak on H100 SXM and 0.78 on B200: ml-engineering "Maximum Achievable Matmul FLOPS" table,
  792-794.5 of 989 and 1745 of 2250 TFLOP/s).
- ``fp8_efficiency_ratio``: the same table's FP8 over BF16 efficiency, 73.4 % / 80.3 % = 0.91 on
  Hopper (H200 FP8 MAMF 1453.4 of 1979) and 76.3 % / 77.6 % = 0.98 on B200 (3432.5 of 4500).
- ``gemm_mn_half`` = 160, ``gemm_k_half`` = 250 (Hopper): least-squares fit (log error, 15 % rms
  over 28 shapes) of ``eff = e * M/(M+mn) * N/(N+mn) * K/(K+k)`` with the memory roofline at
  ``mem_bw_efficiency`` = 0.8 to the DeepGEMM README's FP8 H800 tables (normal GEMMs M = 64-4096,
  contiguous and masked grouped GEMMs 256-8192 rows per group; fitted e = 0.73, mn = 160,
  k = 500 for FP8, so 250 for BF16 at half the math rate). B200: both doubled (an assumption: twice
  the per-SM math rate of Hopper and 2-SM 256-wide UMMA tiles; not fitted to B200 data).
- ``mem_bw_efficiency`` = 0.8: the best memory-bound rows of the same DeepGEMM table reach 2.6-2.7
  of 3.35 TB/s (M = 64/128, N = 7168, K = 16384); vLLM's H100 BF16 GEMM benchmark (PR 17126,
  M = 128, N = 6144, K = 4096: 308 TFLOP/s) implies 2.5 TB/s.
- ``kernel_launch_us`` = 2 (an assumption): about 1 us between back-to-back kernels when the host
  keeps ahead (NVIDIA, "Getting Started with CUDA Graphs", 2019: 3.8 us per 2.9 us kernel) plus
  about 1 us of ramp-up and tail per kernel, on the device; the host's own issue time is
  ``host_kernel_us`` / ``host_gemm_us`` (below).
- ``link_latency_us`` (10) keeps the default: a planning assumption.
- ``host_kernel_us`` = 5 and ``host_gemm_us`` = 13.5 (GPU presets; their x86 hosts): the host
  time of one kernel, and of one GEMM call, issued from PyTorch eager mode (``docs/cost-model.md``,
  "Host time and CUDA graphs"). 13.5 us: Transformer Engine issue 2053 measured
  ``torch.nn.Linear`` forward (BF16, hidden 2048, 8192 tokens) at 13.48 us of CPU time per call on
  a DGX H100 (Xeon Platinum 8480C). 5 us: an ATen op with autograd recording costs 2.5 us of
  host time in the forward and 3.3 us per autograd node in the backward, measured on this
  project's build host (``benchmarks/host_dispatch.py``, ``benchmarks/results/host_dispatch-cpu.json``:
  AMD EPYC, torch 2.13, one thread), plus ``cuLaunchKernel``, 1.3 us (meta-pytorch/tritonbench
  pull request 1016) to 3.0 us (pull request 1017, GB200): 2.9 + 2.2 rounded. B200 keeps the
  Hopper values (DGX B200 has an x86 host too; an assumption). ``cpu``: 0 (its host time is the
  compute the preset already prices).
- Kernels without a GEMM shape (``docs/cost-model.md``, "Attention and the gated delta rule"),
  achieved fractions of the BF16 peak in the FLOPs their kernels execute. Attention: cuDNN fused
  attention, the backend Transformer Engine picks on Hopper and Blackwell
  (``get_attention_backend``: "FusedAttention preference on Hopper+"). NVIDIA/cudnn-frontend
  ``benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/llama3.1_20260227_034703.csv``
  (commit df73764a, cuDNN 9.19, H200, BF16, causal, seq 4096, 64 heads, head dim 128): 591 TFLOP/s
  forward, 474 backward (FLOPs ``4*s^2*d*heads/2`` and 2.5 times that), so
  ``attention_fwd_efficiency`` 0.60 and ``attention_bwd_efficiency`` 0.48 of 989 (H200 has H100
  compute; attention is compute-bound). Head dim 256 (``_hd256``) 0.56 / 0.45: those times the
  cuDNN forward's head-dim-256 over 128 ratio on H100 SXM5, causal, seq 4k, 483 / 518 (the
  FlashAttention-3 paper, arXiv 2407.08608, Figure 5 (d)/(f), Dao-AILab/flash-attention
  ``assets/flash3_fp16_fwd.png`` at 7ef24848); no head-dim-256 backward is published, it takes
  the same ratio. B200: the same repository's GB200 rows (cuDNN 9.22, ``results/llama3.1/gb200``
  and ``results/qwen35/gb200``, causal, seq 4096): 1408 / 1148 TFLOP/s at head dim 128, 1441
  forward at head dim 256, as fractions of GB200's 2,500 dense: 0.56 / 0.46, 0.58 / 0.47 (the
  backward at the forward's ratio); the same fraction of B200's own peak (assumption).
  Gated delta rule: flash-linear-attention's ``chunk_gated_delta_rule`` (B 1, T 8192, 96 heads,
  head dim 128) on H800: 2.033 ms forward (PaddlePaddle/flash-attention pull request 133: FLA's
  kernels under FLA's benchmark registry); less its in-kernel q/k L2 norm at the memory roofline
  (0.30 ms), 1.73 ms for 1.439e11 executed FLOPs: 83 TFLOP/s, ``delta_rule_fwd_efficiency``
  0.084; ``delta_rule_bwd_efficiency`` 0.083: that times the backward's over the forward's rate
  on GB200 at the same shape, 0.994 (flash-linear-attention README at 87ff243e: 1.265 ms
  forward, 4.738 ms forward + backward, less the L2 norms: 126 TFLOP/s each). B200: those 126
  TFLOP/s, 0.056 of 2,250 (the kernels run near the memory roofline and B200 has GB200's 8 TB/s).
  ``cpu``: 0, i.e. ``mfu_efficiency``.

``cpu`` is a nominal small CPU device for tests and CPU runs (torch + gloo on one host). Its
numbers are round placeholders, not a measured or datasheet value; MFU on CPU is reported
against a peak measured at run time, not against ``peak_tflops``. It has no FP8 and no shape
curve (``gemm_mn_half = gemm_k_half = 0``, ``mem_bw_efficiency = 1``, ``kernel_launch_us = 0``):
its costs stay the plain roofline of the placeholder peaks. It has one peak for every dtype
(``peak_tflops_fp32 = 0``: ``train.precision=fp32``, its default, runs at ``peak_tflops``). Its
one measured field is ``deferred_w_us`` = 0.8, in the preset's own time scale: a deferred weight-gradient GEMM costs the
engine 149 us of host time on top of the same GEMM inside the backward, and this host runs the
tiny model 178 times slower than the preset says (``benchmarks/vs_torch_pp.py`` fields
``deferred_w_us``, ``cpu_time_scale``, ``deferred_w_us_cpu``: the tiny preset, one thread, 2-core
x86 host, paired medians at load 7), so ``planner.split_w: auto`` sees split W cost about a
fifth of a CPU iteration, as measured, and not 178 times that. ``pair_task_us`` = 0.6 likewise:
an overlapped F&B pair, run task by task, costs 117 us of host time per compute task over the
same chunks run one autograd segment per side, at a time scale of 190 (fields ``pair_task_us``,
``pair_cpu_time_scale``, ``pair_task_us_cpu``; load 2-4), so ``planner.overlap: auto`` turns
overlap off where it hides less than that.

``deferred_w_us`` = ``pair_task_us`` = 0 on the GPU presets (an assumption): the recording and the separate call are
host work that runs ahead of the device, and the weight-gradient GEMM itself is the same kernel
fused or deferred; a host-bound run is what a profile's calibration shows.
"""

from __future__ import annotations

import difflib
from types import MappingProxyType

from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec

_HOST_SOURCE = (
    "host issue time 13.5 us per GEMM call (TransformerEngine issue 2053) and 5 us per kernel "
    "(benchmarks/host_dispatch.py measurement plus cuLaunchKernel)"
)
_EFFICIENCY_SOURCE = (
    "GEMM efficiency curve fitted to the DeepGEMM README H800 tables; FP8/BF16 efficiency and matmul "
    "ceilings from the ml-engineering MAMF table; 2 us per kernel launch assumed; attention rates from the "
    "NVIDIA/cudnn-frontend SDPA benchmark CSVs @df73764a (H200), head dim 256 from the FlashAttention-3 paper "
    "Fig. 5; gated delta rule from PaddlePaddle/flash-attention PR 133 and the flash-linear-attention README "
    "@87ff243e; " + _HOST_SOURCE
)

# Efficiency fields of the Hopper presets (module docstring: where each comes from).
_HOPPER_EFFICIENCY = MappingProxyType(dict(peak_tflops_fp8=1979.0, peak_tflops_fp32=494.7, fp8_efficiency_ratio=0.91,
                                           gemm_mn_half=160.0,
                                           gemm_k_half=250.0, mem_bw_efficiency=0.8, kernel_launch_us=2.0))
# Achieved fractions of kernels without a GEMM shape (module docstring): cuDNN fused attention
# (cudnn-frontend H200 benchmark, FlashAttention-3 paper Figure 5) and FLA's chunked gated delta rule (H800).
_HOPPER_KERNELS = MappingProxyType(dict(attention_fwd_efficiency=0.60, attention_bwd_efficiency=0.48,
                                        attention_fwd_efficiency_hd256=0.56, attention_bwd_efficiency_hd256=0.45,
                                        delta_rule_fwd_efficiency=0.084, delta_rule_bwd_efficiency=0.083))
# Host time of PyTorch eager dispatch per kernel and per GEMM call (module docstring), GPU presets.
_HOST_EAGER = MappingProxyType(dict(host_kernel_us=5.0, host_gemm_us=13.5))

_H100_SOURCE = (
    "NVIDIA H100 datasheet (SXM: 989 TFLOP/s dense BF16, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s "
    "bidirectional); measured NVLink p2p ~375 GB/s per direction; 400 Gb/s IB NIC per GPU (~50 GB/s); "
    "H100 whitepaper (132 SMs, 494.7 TFLOP/s dense TF32); DeepSeek-V3 report (20 communication SMs); "
    "1979 TFLOP/s dense FP8; "
    + _EFFICIENCY_SOURCE
)


def h100_sxm() -> HardwareSpec:
    """NVIDIA H100 SXM5 80 GB in an 8-GPU HGX node."""
    return HardwareSpec(
        name="h100-sxm", peak_tflops=989.0, mem_gb=85.52, mem_bw_tbs=3.35,
        intra_node_gbs=375.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=_H100_SOURCE, **_HOPPER_EFFICIENCY, **_HOPPER_KERNELS, **_HOST_EAGER,
    )


def h800() -> HardwareSpec:
    """NVIDIA H800 SXM 80 GB (H100 compute and memory, NVLink cut to 400 GB/s bidirectional)."""
    return HardwareSpec(
        name="h800", peak_tflops=989.0, mem_gb=85.52, mem_bw_tbs=3.35,
        intra_node_gbs=160.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=("H100 datasheet compute and memory; DeepSeek-V3 report section 3.2 (NVLink ~160 GB/s "
                "achievable, IB ~50 GB/s per GPU, 20 of 132 SMs for communication); DeepEP README "
                "(153-158 GB/s intranode, 43-58 GB/s internode); " + _EFFICIENCY_SOURCE),
        **_HOPPER_EFFICIENCY, **_HOPPER_KERNELS, **_HOST_EAGER,
    )


def h200() -> HardwareSpec:
    """NVIDIA H200 SXM 141 GB in an 8-GPU HGX node."""
    return HardwareSpec(
        name="h200", peak_tflops=989.0, mem_gb=150.76, mem_bw_tbs=4.8,
        intra_node_gbs=375.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=("NVIDIA H200 datasheet (989 TFLOP/s dense BF16, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s "
                "bidirectional, 1979 dense FP8, 989 TF32 with sparsity: 494.7 dense); NVLink p2p, IB, SMs and "
                "communication SMs as H100 SXM; "
                + _EFFICIENCY_SOURCE),
        **_HOPPER_EFFICIENCY, **_HOPPER_KERNELS, **_HOST_EAGER,
    )


def b200() -> HardwareSpec:
    """NVIDIA B200 180 GB in an 8-GPU HGX/DGX B200 node."""
    return HardwareSpec(
        name="b200", peak_tflops=2250.0, mem_gb=192.27, mem_bw_tbs=8.0,
        intra_node_gbs=750.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=148, comm_sms=20,
        peak_tflops_fp8=4500.0, peak_tflops_fp32=1125.0, fp8_efficiency_ratio=0.98, gemm_mn_half=320.0,
        gemm_k_half=500.0, mem_bw_efficiency=0.8, kernel_launch_us=2.0,
        attention_fwd_efficiency=0.56, attention_bwd_efficiency=0.46, attention_fwd_efficiency_hd256=0.58,
        attention_bwd_efficiency_hd256=0.47, delta_rule_fwd_efficiency=0.056, delta_rule_bwd_efficiency=0.056,
        mxfp8=True, **_HOST_EAGER,
        source=("NVIDIA DGX B200 / HGX B200 datasheets (per GPU 2.25 PFLOP/s dense BF16, 4.5 PFLOP/s dense "
                "FP8, 18 PFLOP/s TF32 with sparsity per 8 GPUs: 1.125 dense per GPU, 180 GB HBM3e, 8 TB/s, "
                "NVLink 5 1.8 TB/s bidirectional, 400 Gb/s ConnectX-7 per GPU); "
                "148 SMs; NVLink achievable ~750 GB/s per direction (assumed: H100's measured 375/450 "
                "fraction); 20 communication SMs as on Hopper (assumed); ml-engineering MAMF table "
                "(FP8/BF16 efficiency 76.3/77.6 %); GEMM curve halves: Hopper fit doubled (assumed); attention "
                "rates from the NVIDIA/cudnn-frontend SDPA benchmark CSVs (GB200 rows); gated delta rule from the "
                "flash-linear-attention README @87ff243e (GB200); " + _HOST_SOURCE + " as on Hopper"),
    )


def cpu() -> HardwareSpec:
    """Nominal small CPU device: 1 TFLOP/s, 64 GB at 0.1 TB/s, 10 GB/s between processes on the
    host, 1.25 GB/s (10 GbE) between hosts. Placeholders; MFU on CPU uses a measured peak."""
    return HardwareSpec(
        name="cpu", peak_tflops=1.0, mem_gb=64.0, mem_bw_tbs=0.1,
        intra_node_gbs=10.0, inter_node_gbs=1.25, gpus_per_node=1, num_sms=0, comm_sms=0,
        peak_tflops_fp8=0.0, gemm_mn_half=0.0, gemm_k_half=0.0, mem_bw_efficiency=1.0, kernel_launch_us=0.0,
        deferred_w_us=0.8, pair_task_us=0.6,
        source=("nominal placeholder numbers (not measured, no datasheet); MFU on CPU is computed "
                "against a peak measured at run time; deferred_w_us and pair_task_us measured by benchmarks/vs_torch_pp.py"),
    )


# Frozen values (HardwareSpec is immutable), keyed by preset name.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {f().name: f() for f in (h100_sxm, h800, h200, b200, cpu)}


def get_hardware(name: str) -> HardwareSpec:
    """The preset called ``name``.

    Raises:
        TesseraConfigError: unknown name (with the closest known name, a prefix match first, and
            the known ones).
    """
    try:
        return HARDWARE_PRESETS[name]
    except (KeyError, TypeError):
        close = [k for k in HARDWARE_PRESETS if str(name) and k.startswith(str(name))][:1] or \
            difflib.get_close_matches(str(name), list(HARDWARE_PRESETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TesseraConfigError("hardware.preset", name, "unknown preset",
                                 hint + "use one of: " + ", ".join(HARDWARE_PRESETS)) from None
