"""Communication times: expert-parallel all-to-all, pipeline point-to-point, TP collectives.

Bandwidths are per GPU per direction (``HardwareSpec.intra_node_gbs``/``inter_node_gbs``, GB/s =
1e9 B/s; H800: about 160 GB/s NVLink and 50 GB/s InfiniBand per the DeepSeek-V3 report and the
DeepEP README). All results in ms.

A2A model (balanced routing, DeepEP-style dispatch/combine without token de-duplication): a GPU
sends ``tokens*top_k*width*2`` bytes (BF16, width = hidden, or ``latent_dim`` for latent MoE) per
dispatch or combine; the fraction ``(ep-1)/ep`` leaves the GPU. Of the ``ep-1`` peers,
``m - 1`` share the node (NVLink), the rest are on other nodes (IB), where ``m`` is the EP group's
members on one node (:class:`tessera.spec.placement.GroupPlacement` ``local`` of the run's
placement: ``min(ep, gpus_per_node)`` under the ``ep-dp-pp`` rank order, 1 under ``pp-ep-dp``
once ``pp >= gpus_per_node``). The two link types work in parallel, so the time is
``max(intra/intra_bw, inter/inter_bw) + latency``.
That is the ``alltoall`` dispatcher (Megatron-Core's ``MoEAlltoAllTokenDispatcher`` permutes one
row per token-expert pair): every top-k copy crosses its link.

The ``deepep`` dispatcher (:func:`deepep_split`, DeepEP normal kernels: "intranode NVLink" and
"internode RDMA" dispatch/combine; DeepSeek-V3 report sec. 3.2: IB to the destination node, then
NVLink forwarding) sends a token once per destination *rank* inside the node and once per
destination *node* across the network (to the GPU of the same local index, which forwards it
over NVLink). Its byte counts use the expected number of distinct destination nodes and ranks of
a token's top-k experts under uniform routing (:func:`expected_distinct`), within the nodes
group-limited routing allows (``MoESpec.topk_groups``).
"""

from __future__ import annotations

import math
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


def a2a_split(total_bytes: float, ep: int, ep_local: int) -> A2ASplit:
    """Split a GPU's A2A payload by destination: ``1/ep`` stays local, ``(m-1)/ep`` goes to the
    ``m-1`` peers on the same node (``m = min(ep, ep_local)``, ``ep_local``: the EP group's members
    on this GPU's node, itself included), ``(ep-m)/ep`` to other nodes."""
    if ep <= 1:
        return A2ASplit(0.0, 0.0, float(total_bytes))
    m = min(ep, ep_local)
    per_peer = total_bytes / ep
    return A2ASplit(per_peer * (m - 1), per_peer * (ep - m), per_peer)


def a2a_ms(total_bytes: float, ep: int, hw: HardwareSpec, ep_local: int | None = None) -> float:
    """Time of one dispatch or combine, ms: ``max(intra/intra_bw, inter/inter_bw) + latency``;
    0 at ``ep == 1`` (no A2A is launched). ``ep_local`` (:func:`a2a_split`; None: the group packed
    onto nodes, ``min(ep, gpus_per_node)``)."""
    if ep <= 1:
        return 0.0
    return split_ms(a2a_split(total_bytes, ep, hw.gpus_per_node if ep_local is None else ep_local), hw)


def p2p_ms(nbytes: float, hw: HardwareSpec, same_node: bool = False) -> float:
    """Pipeline send of one activation (or its gradient), ms: ``bytes / bw + latency``, ``bw`` the
    network's (``inter_node_gbs``) unless every pipeline group of the placement lies inside one
    node (``same_node``: NVLink, ``intra_node_gbs``). A pipeline that spans nodes is priced on the
    network for every hop (one p2p time per run; the hops inside a node are the faster ones)."""
    gbs = hw.intra_node_gbs if same_node else hw.inter_node_gbs
    return nbytes / (gbs * 1e9) * 1e3 + hw.link_latency_us * 1e-3


def tp_collective_ms(nbytes: float, tp: int, hw: HardwareSpec) -> float:
    """One ring all-gather or reduce-scatter of a ``nbytes`` tensor over ``tp`` GPUs of one node
    (sequence parallelism, Korthikanti et al. 2022 sec. 4.2.2): each GPU moves
    ``nbytes*(tp-1)/tp`` over NVLink, ms; 0 at ``tp == 1``."""
    if tp <= 1:
        return 0.0
    return nbytes * (tp - 1) / tp / (hw.intra_node_gbs * 1e9) * 1e3 + hw.link_latency_us * 1e-3


def expected_distinct(bins: int, per_bin: int, k: int) -> float:
    """Expected number of distinct bins holding at least one of ``k`` distinct items drawn
    uniformly without replacement from ``bins * per_bin`` items, ``per_bin`` to a bin:
    ``bins * (1 - C(n - per_bin, k) / C(n, k))``, ``n = bins * per_bin`` (the top-k experts of a
    token are distinct). With replacement this is ``bins * (1 - (1 - 1/bins)^k)``."""
    n = bins * per_bin
    if bins <= 0 or k <= 0:
        return 0.0
    if k > n - per_bin:
        return float(bins)  # every bin is hit
    miss = math.prod((n - per_bin - i) / (n - i) for i in range(k))
    return bins * (1.0 - miss)


def deepep_split(tokens: float, top_k: int, width: int, ep: int, ep_local: int, num_experts: int,
                 num_groups: int = 1, topk_groups: int = 1, bytes_per_elem: int = BF16) -> A2ASplit:
    """Bytes one GPU sends in one DeepEP-style dispatch (or combine) of ``tokens`` tokens.

    ``m = min(ep, ep_local)`` ranks per node (``ep_local``: the EP group's members on a node), ``N = ep / m`` nodes, ``e = num_experts / ep``
    experts per rank. Group-limited routing (``topk_groups < num_groups``) lets a token reach at
    most ``R = min(N, topk_groups * max(1, group_size // (e*m)))`` nodes; else ``R = N``; its experts
    are taken as uniform over those ``R`` nodes. Per token (``row = width * bytes_per_elem``):

    * distinct nodes ``D = expected_distinct(R, e*m, top_k)``, of which ``D*(N-1)/N`` are remote:
      ``inter = row * D * (N-1)/N`` (one RDMA copy per remote node);
    * distinct ranks ``G = expected_distinct(R*m, e, top_k)``; each is reached over NVLink unless it
      is the receiving GPU itself (this GPU, or the RDMA entry GPU of its node: probability
      ``1/m``): ``intra = row * G * (m-1)/m``, ``local = row * G / m``.
    """
    row = float(tokens) * width * bytes_per_elem
    if ep <= 1:
        return A2ASplit(0.0, 0.0, row * top_k)
    m = min(ep, ep_local)
    nodes = max(1, ep // m)
    e = num_experts / ep
    reach = nodes
    if num_groups > 1 and topk_groups < num_groups:
        per_node = e * m
        reach = min(nodes, topk_groups * max(1, int(num_experts / num_groups // per_node)))
    d = expected_distinct(reach, round(e * m), top_k)
    g = expected_distinct(reach * m, round(e), top_k)
    return A2ASplit(row * g * (m - 1) / m, row * d * (nodes - 1) / nodes, row * g / m)


def split_ms(s: A2ASplit, hw: HardwareSpec) -> float:
    """Time of one A2A whose bytes are split as ``s``, ms: ``max(intra/intra_bw, inter/inter_bw)
    + latency`` (NVLink and the network run in parallel)."""
    intra_s = s.intra / (hw.intra_node_gbs * 1e9) if s.intra else 0.0
    inter_s = s.inter / (hw.inter_node_gbs * 1e9) if s.inter else 0.0
    return max(intra_s, inter_s) * 1e3 + hw.link_latency_us * 1e-3


def moe_a2a(tokens: float, moe, width: int, ep: int, hw: HardwareSpec, dispatcher: str = "alltoall",
            ep_local: int | None = None) -> tuple[float, float]:
    """(ms, bytes sent) of one dispatch or combine of a MoE layer (``moe``: a
    :class:`~tessera.spec.model.MoESpec`) for ``tokens`` tokens on one GPU, by ``dispatcher``
    (``"alltoall"``: :func:`a2a_bytes` / :func:`a2a_ms`; ``"deepep"``: :func:`deepep_split`);
    ``ep_local``: the EP group's members on a node (None: ``min(ep, gpus_per_node)``). At
    ``ep == 1``: ``(0.0, 0.0)``."""
    if ep <= 1:
        return 0.0, 0.0
    local = hw.gpus_per_node if ep_local is None else ep_local
    if dispatcher == "alltoall":
        b = a2a_bytes(tokens, moe.top_k, width)
        return a2a_ms(b, ep, hw, local), b
    if dispatcher == "deepep":
        s = deepep_split(tokens, moe.top_k, width, ep, local, moe.num_experts, moe.num_groups, moe.topk_groups)
        return split_ms(s, hw), s.total
    raise ValueError(f"unknown MoE dispatcher {dispatcher!r}; use alltoall or deepep")
