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
  148 SMs (2 dies of 74).
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
  about 1 us of ramp-up and tail per kernel; host-bound runs (PyTorch eager dispatch of several us
  per op) need more, which is what calibration against measured runs sets.
- ``link_latency_us`` (10) keeps the default: a planning assumption.

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

_EFFICIENCY_SOURCE = (
    "GEMM efficiency curve fitted to the DeepGEMM README H800 tables; FP8/BF16 efficiency and matmul "
    "ceilings from the ml-engineering MAMF table; 2 us per kernel launch assumed (see hardware_presets)"
)

# Efficiency fields of the Hopper presets (module docstring: where each comes from).
_HOPPER_EFFICIENCY = MappingProxyType(dict(peak_tflops_fp8=1979.0, peak_tflops_fp32=494.7, fp8_efficiency_ratio=0.91,
                                           gemm_mn_half=160.0,
                                           gemm_k_half=250.0, mem_bw_efficiency=0.8, kernel_launch_us=2.0))

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
        source=_H100_SOURCE, **_HOPPER_EFFICIENCY,
    )


def h800() -> HardwareSpec:
    """NVIDIA H800 SXM 80 GB (H100 compute and memory, NVLink cut to 400 GB/s bidirectional)."""
    return HardwareSpec(
        name="h800", peak_tflops=989.0, mem_gb=85.52, mem_bw_tbs=3.35,
        intra_node_gbs=160.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=("H100 datasheet compute and memory; DeepSeek-V3 report section 3.2 (NVLink ~160 GB/s "
                "achievable, IB ~50 GB/s per GPU, 20 of 132 SMs for communication); DeepEP README "
                "(153-158 GB/s intranode, 43-58 GB/s internode); " + _EFFICIENCY_SOURCE),
        **_HOPPER_EFFICIENCY,
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
        **_HOPPER_EFFICIENCY,
    )


def b200() -> HardwareSpec:
    """NVIDIA B200 180 GB in an 8-GPU HGX/DGX B200 node."""
    return HardwareSpec(
        name="b200", peak_tflops=2250.0, mem_gb=192.27, mem_bw_tbs=8.0,
        intra_node_gbs=750.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=148, comm_sms=20,
        peak_tflops_fp8=4500.0, peak_tflops_fp32=1125.0, fp8_efficiency_ratio=0.98, gemm_mn_half=320.0,
        gemm_k_half=500.0, mem_bw_efficiency=0.8, kernel_launch_us=2.0,
        source=("NVIDIA DGX B200 / HGX B200 datasheets (per GPU 2.25 PFLOP/s dense BF16, 4.5 PFLOP/s dense "
                "FP8, 18 PFLOP/s TF32 with sparsity per 8 GPUs: 1.125 dense per GPU, 180 GB HBM3e, 8 TB/s, "
                "NVLink 5 1.8 TB/s bidirectional, 400 Gb/s ConnectX-7 per GPU); "
                "148 SMs; NVLink achievable ~750 GB/s per direction (assumed: H100's measured 375/450 "
                "fraction); 20 communication SMs as on Hopper (assumed); ml-engineering MAMF table "
                "(FP8/BF16 efficiency 76.3/77.6 %); GEMM curve halves: Hopper fit doubled (assumed)"),
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
