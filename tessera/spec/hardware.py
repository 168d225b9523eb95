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
        mfu_efficiency: fraction of peak that large GEMMs reach in practice (used by the analytic
            cost model for compute durations).
        link_latency_us: fixed latency per collective or point-to-point transfer, microseconds.
        source: where the numbers come from.
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

    @property
    def overlap_slowdown(self) -> float:
        """Factor (>= 1) by which compute slows while communication kernels hold ``comm_sms``."""
        if self.num_sms <= 0 or self.comm_sms <= 0:
            return 1.0
        return self.num_sms / (self.num_sms - self.comm_sms)
