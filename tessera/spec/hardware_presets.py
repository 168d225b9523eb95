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

``mfu_efficiency`` (0.6) and ``link_latency_us`` (10) keep the :class:`HardwareSpec` defaults:
planning assumptions of the analytic cost model, not datasheet numbers.

``cpu`` is a nominal small CPU device for tests and CPU runs (torch + gloo on one host). Its
numbers are round placeholders, not a measured or datasheet value; MFU on CPU is reported
against a peak measured at run time, not against ``peak_tflops``.
"""

from __future__ import annotations

import difflib

from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec

_H100_SOURCE = (
    "NVIDIA H100 datasheet (SXM: 989 TFLOP/s dense BF16, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s "
    "bidirectional); measured NVLink p2p ~375 GB/s per direction; 400 Gb/s IB NIC per GPU (~50 GB/s); "
    "H100 whitepaper (132 SMs); DeepSeek-V3 report (20 communication SMs)"
)


def h100_sxm() -> HardwareSpec:
    """NVIDIA H100 SXM5 80 GB in an 8-GPU HGX node."""
    return HardwareSpec(
        name="h100-sxm", peak_tflops=989.0, mem_gb=80.0, mem_bw_tbs=3.35,
        intra_node_gbs=375.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=_H100_SOURCE,
    )


def h800() -> HardwareSpec:
    """NVIDIA H800 SXM 80 GB (H100 compute and memory, NVLink cut to 400 GB/s bidirectional)."""
    return HardwareSpec(
        name="h800", peak_tflops=989.0, mem_gb=80.0, mem_bw_tbs=3.35,
        intra_node_gbs=160.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=("H100 datasheet compute and memory; DeepSeek-V3 report section 3.2 (NVLink ~160 GB/s "
                "achievable, IB ~50 GB/s per GPU, 20 of 132 SMs for communication); DeepEP README "
                "(153-158 GB/s intranode, 43-58 GB/s internode)"),
    )


def h200() -> HardwareSpec:
    """NVIDIA H200 SXM 141 GB in an 8-GPU HGX node."""
    return HardwareSpec(
        name="h200", peak_tflops=989.0, mem_gb=141.0, mem_bw_tbs=4.8,
        intra_node_gbs=375.0, inter_node_gbs=50.0, gpus_per_node=8, num_sms=132, comm_sms=20,
        source=("NVIDIA H200 datasheet (989 TFLOP/s dense BF16, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s "
                "bidirectional); NVLink p2p, IB, SMs and communication SMs as H100 SXM"),
    )


def cpu() -> HardwareSpec:
    """Nominal small CPU device: 1 TFLOP/s, 64 GB at 0.1 TB/s, 10 GB/s between processes on the
    host, 1.25 GB/s (10 GbE) between hosts. Placeholders; MFU on CPU uses a measured peak."""
    return HardwareSpec(
        name="cpu", peak_tflops=1.0, mem_gb=64.0, mem_bw_tbs=0.1,
        intra_node_gbs=10.0, inter_node_gbs=1.25, gpus_per_node=1, num_sms=0, comm_sms=0,
        source=("nominal placeholder numbers (not measured, no datasheet); MFU on CPU is computed "
                "against a peak measured at run time"),
    )


# Frozen values (HardwareSpec is immutable), keyed by preset name.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {f().name: f() for f in (h100_sxm, h800, h200, cpu)}


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
