"""Communication times: expert-parallel all-to-all, pipeline point-to-point, TP collectives.

Bandwidths are per GPU per direction (``HardwareSpec.intra_node_gbs``/``inter_node_gbs``, GB/s =
1e9 B/s; H800: about 160 GB/s NVLink and 50 GB/s InfiniBand per the DeepSeek-V3 report and the
DeepEP README). All results in ms.

A2A model (balanced routing, DeepEP-style dispatch/combine without token de-duplication): a GPU
sends ``tokens*top_k*width*2`` bytes (BF16, width = hidden, or ``latent_dim`` for latent MoE) per
dispatch or combine; the fraction ``(ep-1)/ep`` leaves the GPU. Of the ``ep-1`` peers,
``min(ep, gpus_per_node) - 1`` share the node (NVLink), the rest are on other nodes (IB). The two
link types work in parallel, so the time is ``max(intra/intra_bw, inter/inter_bw) + latency``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost.flops import BF16
from tessera.spec.hardware import HardwareSpec


@dataclass(frozen=True)
class A2ASplit:
    """Bytes one GPU sends in one A2A: ``intra`` over NVLink, ``inter`` over the network, and
    ``local`` that stays on the GPU. ``total = intra + inter + local``."""

    intra: float
    inter: float
    local: float

    @property
    def total(self) -> float:
        return self.intra + self.inter + self.local


def a2a_bytes(tokens: float, top_k: int, width: int, bytes_per_elem: int = BF16) -> float:
    """Payload one GPU sends in one dispatch (or combine): tokens * top_k * width * bytes."""
    return float(tokens) * top_k * width * bytes_per_elem


def a2a_split(total_bytes: float, ep: int, gpus_per_node: int) -> A2ASplit:
    """Split a GPU's A2A payload by destination: ``1/ep`` stays local, ``(m-1)/ep`` goes to the
    ``m-1`` peers on the same node (``m = min(ep, gpus_per_node)``), ``(ep-m)/ep`` to other nodes.
    Assumes EP groups are packed onto whole nodes (consecutive ranks)."""
    if ep <= 1:
        return A2ASplit(0.0, 0.0, float(total_bytes))
    m = min(ep, gpus_per_node)
    per_peer = total_bytes / ep
    return A2ASplit(per_peer * (m - 1), per_peer * (ep - m), per_peer)


def a2a_ms(total_bytes: float, ep: int, hw: HardwareSpec) -> float:
    """Time of one dispatch or combine, ms: ``max(intra/intra_bw, inter/inter_bw) + latency``;
    0 at ``ep == 1`` (no A2A is launched)."""
    if ep <= 1:
        return 0.0
    s = a2a_split(total_bytes, ep, hw.gpus_per_node)
    intra_s = s.intra / (hw.intra_node_gbs * 1e9) if s.intra else 0.0
    inter_s = s.inter / (hw.inter_node_gbs * 1e9) if s.inter else 0.0
    return max(intra_s, inter_s) * 1e3 + hw.link_latency_us * 1e-3


def p2p_ms(nbytes: float, hw: HardwareSpec) -> float:
    """Pipeline send of one activation (or its gradient), ms: stages sit on different nodes, so
    ``bytes / inter_node_bw + latency``."""
    return nbytes / (hw.inter_node_gbs * 1e9) * 1e3 + hw.link_latency_us * 1e-3


def tp_collective_ms(nbytes: float, tp: int, hw: HardwareSpec) -> float:
    """One ring all-gather or reduce-scatter of a ``nbytes`` tensor over ``tp`` GPUs of one node
    (sequence parallelism, Korthikanti et al. 2022 sec. 4.2.2): each GPU moves
    ``nbytes*(tp-1)/tp`` over NVLink, ms; 0 at ``tp == 1``."""
    if tp <= 1:
        return 0.0
    return nbytes * (tp - 1) / tp / (hw.intra_node_gbs * 1e9) * 1e3 + hw.link_latency_us * 1e-3
