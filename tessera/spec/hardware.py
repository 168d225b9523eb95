"""Hardware specification of one device and its links (per GPU).

Presets live in :mod:`tessera.spec.hardware_presets`; every number there names its public source.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator type and the links each device sees.

    Attributes:
        name: preset name, e.g. ``"h800"``.
        peak_tflops: dense BF16 peak, TFLOP/s (datasheet; no sparsity).
        mem_gb: device memory capacity, GB (1e9 bytes).
        mem_bw_tbs: device memory bandwidth, TB/s.
        intra_node_gbs: achievable intra-node (NVLink) bandwidth per GPU per direction, GB/s.
        inter_node_gbs: achievable inter-node (InfiniBand/RoCE) bandwidth per GPU per direction, GB/s.
        gpus_per_node: devices per node (the NVLink domain).
        num_sms: streaming multiprocessors (0 for CPUs).
        comm_sms: SMs reserved by communication kernels while they run (DeepSeek-V3 report: 20 of
            132); compute that overlaps communication runs on ``num_sms - comm_sms``.
        mfu_efficiency: fraction of the dense BF16 peak that an (asymptotically) large GEMM
            reaches in training: the ceiling of the GEMM efficiency curve
            (:mod:`tessera.cost.efficiency`), and the rate of the other compute-bound kernels
            where no measured rate is set (:meth:`kernel_efficiency`: the Mamba-2 scan,
            convolutions; every class on ``cpu``). A planning assumption (calibration
            constant); isolated-kernel benchmarks reach 0.80 on H100 (ml-engineering MAMF table).
        link_latency_us: fixed latency per collective or point-to-point transfer, microseconds.
        peak_tflops_fp8: dense FP8 peak, TFLOP/s (datasheet; no sparsity); 0: no FP8 tensor cores
            (``train.precision=fp8`` is refused).
        peak_tflops_fp32: dense FP32 peak of GEMMs, TFLOP/s: TF32 tensor cores on NVIDIA GPUs
            (datasheet, no sparsity; half the BF16 peak on Hopper and Blackwell); what
            ``train.precision=fp32`` runs at. 0: the device has one peak for every dtype
            (``peak_tflops``; the ``cpu`` preset), see :meth:`peak_for`.
        fp8_efficiency_ratio: achieved fraction of the FP8 peak relative to the BF16 one (FP8 GEMM
            ceiling = ``mfu_efficiency * fp8_efficiency_ratio``): the ratio of the measured
            maximum-achievable-matmul efficiencies, FP8 / BF16 (ml-engineering MAMF table).
        gemm_mn_half: output-dimension half-saturation of the GEMM efficiency curve, elements: a
            GEMM whose M (or N) equals it runs at half the rate of an infinitely large one in that
            dimension (tile quantization and occupancy). Fitted to DeepGEMM's H800 table.
        gemm_k_half: reduction-dimension half-saturation for BF16 GEMMs, elements (fixed prologue
            and epilogue per output tile); FP8 uses ``gemm_k_half * peak_tflops_fp8 / peak_tflops``
            (the same fixed time per tile at twice the math rate). Fitted to DeepGEMM's H800 table.
        mem_bw_efficiency: achieved fraction of ``mem_bw_tbs`` for memory-bound kernels (norms,
            activations, permutes, memory-bound GEMMs).
        kernel_launch_us: fixed cost per kernel launch on the compute stream, microseconds (launch
            gap and ramp-up/tail; counted per operator kernel by the analytic cost model).
        deferred_w_us: host time one *deferred* weight-gradient GEMM costs on top of the same GEMM
            run inside the backward (split W, zero-bubble style: recording its inputs at F and B,
            the separate call and the accumulation at W), microseconds per GEMM (per local expert
            of a grouped expert GEMM: the engine runs one per expert). Charged only to W tasks
            that run as their own instruction (:attr:`tessera.cost.types.TaskCost.deferred_ms`).
        pair_task_us: host time each compute task of an overlapped F&B pair costs on top of the
            same work run as one autograd segment per chunk, microseconds
            (:attr:`tessera.cost.types.ModelCosts.pair_task_ms`).
        source: where the numbers come from.
        attention_fwd_efficiency: achieved fraction of ``peak_tflops`` of the fused attention
            forward (causal, head dim 128), counted in FLOPs ``4*s^2*d*heads/2`` per sequence
            (:func:`tessera.cost.flops.attention_core`); 0: not measured (:meth:`kernel_efficiency`).
        attention_bwd_efficiency: the same for the attention backward, in the FLOPs its kernels
            execute (2.5x the forward's: the score matrix is recomputed); 0: not measured.
        attention_fwd_efficiency_hd256: the forward's fraction at head dim 256 (between 128 and
            256 interpolated linearly in the head dim, outside clamped); 0: the head-dim-128 value.
        attention_bwd_efficiency_hd256: the backward's fraction at head dim 256; 0: the head-dim-128 value.
        delta_rule_fwd_efficiency: achieved fraction of ``peak_tflops`` of flash-linear-attention's
            chunked gated delta rule forward, in the FLOPs its kernels execute
            (:func:`tessera.cost.flops.delta_rule`); 0: not measured.
        delta_rule_bwd_efficiency: the same for its backward; 0: not measured.
        host_kernel_us: host time to issue one kernel that is not a GEMM from PyTorch eager mode
            (Python, the ATen dispatcher with autograd recording, ``cudaLaunchKernel``),
            microseconds; 0: the host is never the bottleneck (the ``cpu`` preset, whose host time
            is the compute). Kernels inside a captured CUDA graph cost none
            (``train.cuda_graphs``, :func:`tessera.cost.efficiency.op_host_seconds`).
        host_gemm_us: host time of one GEMM call from PyTorch eager mode (a module call and the
            cuBLAS host path), microseconds; each local expert's GEMM of a grouped expert GEMM
            is one call; 0 as ``host_kernel_us``.
        mxfp8: the tensor cores take MXFP8 operands (1x32 blocks with E8M0 scales: Blackwell);
            ``train.fp8_recipe=mxfp8`` is refused without it (Transformer Engine's
            ``check_mxfp8_support`` asks for compute capability 10.0).

    The efficiency fields (``mfu_efficiency``, ``fp8_efficiency_ratio``, ``gemm_mn_half``,
    ``gemm_k_half``, ``mem_bw_efficiency``, ``kernel_launch_us``) are what the analytic cost model
    is calibrated with; their defaults are the Hopper values of
    :mod:`tessera.spec.hardware_presets` (sources there and in ``docs/cost-model.md``).
    """

    name: str
    peak_tflops: float
    mem_gb: float
    mem_bw_tbs: float
    intra_node_gbs: float
    inter_node_gbs: float
    gpus_per_node: int
    num_sms: int = 0
    comm_sms: int = 0
    mfu_efficiency: float = 0.6
    link_latency_us: float = 10.0
    source: str = ""
    peak_tflops_fp8: float = 0.0
    fp8_efficiency_ratio: float = 0.91
    gemm_mn_half: float = 160.0
    gemm_k_half: float = 250.0
    mem_bw_efficiency: float = 0.8
    kernel_launch_us: float = 2.0
    deferred_w_us: float = 0.0
    pair_task_us: float = 0.0
    peak_tflops_fp32: float = 0.0
    attention_fwd_efficiency: float = 0.0
    attention_bwd_efficiency: float = 0.0
    attention_fwd_efficiency_hd256: float = 0.0
    attention_bwd_efficiency_hd256: float = 0.0
    delta_rule_fwd_efficiency: float = 0.0
    delta_rule_bwd_efficiency: float = 0.0
    mxfp8: bool = False
    host_kernel_us: float = 0.0
    host_gemm_us: float = 0.0

    def peak_for(self, precision: str) -> float:
        """Dense peak of ``precision``'s GEMMs, TFLOP/s: ``bf16`` -> ``peak_tflops``, ``fp8`` ->
        ``peak_tflops_fp8`` (0 without FP8), ``fp32`` -> ``peak_tflops_fp32`` (``peak_tflops``
        when that is 0: one native peak).

        Raises:
            ValueError: another precision.
        """
        if precision == "bf16":
            return self.peak_tflops
        if precision == "fp8":
            return self.peak_tflops_fp8
        if precision == "fp32":
            return self.peak_tflops_fp32 if self.peak_tflops_fp32 > 0 else self.peak_tflops
        raise ValueError(f"HardwareSpec.peak_for: precision={precision!r}; use bf16, fp8 or fp32")

    def kernel_efficiency(self, rate_class: str, phase: int, head_dim: float = 0.0) -> float:
        """Measured achieved fraction of ``peak_tflops`` of an operator without a GEMM shape
        (:attr:`tessera.cost.flops.OpCost.rate_class`) in phase 0/1/2 (F/B/W, W as B), in the
        FLOPs its kernels execute: ``attention`` (its head-dim-128 fields, and linear in
        ``head_dim`` up to the head-dim-256 fields where those are set; clamped outside 128-256),
        ``delta_rule``. 0.0 where this device has no measured rate for the class (every other
        class, a field left 0, the ``cpu`` preset): the operator then runs its model FLOPs at
        ``mfu_efficiency`` (:func:`tessera.cost.efficiency.op_seconds`)."""
        bwd = phase > 0
        if rate_class == "delta_rule":
            return self.delta_rule_bwd_efficiency if bwd else self.delta_rule_fwd_efficiency
        if rate_class != "attention":
            return 0.0
        e128 = self.attention_bwd_efficiency if bwd else self.attention_fwd_efficiency
        e256 = self.attention_bwd_efficiency_hd256 if bwd else self.attention_fwd_efficiency_hd256
        if e128 <= 0 or e256 <= 0:
            return max(e128, 0.0)
        x = min(max((head_dim - 128.0) / 128.0, 0.0), 1.0)
        return e128 + (e256 - e128) * x

    @property
    def overlap_slowdown(self) -> float:
        """Factor (>= 1) by which compute slows while communication kernels hold ``comm_sms``."""
        if self.num_sms <= 0 or self.comm_sms <= 0:
            return 1.0
        return self.num_sms / (self.num_sms - self.comm_sms)
