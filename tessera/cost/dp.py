"""Data-parallel collectives and the optimizer step of one layer on its rank (ms).

Groups (Megatron-Core rank order ``tp-cp-ep-dp-pp``, experts ``tp-ep-dp-pp`` with expert-TP 1):
dense parameters are replicated over the ``dp`` ranks of their data-parallel group (members
``tp`` ranks apart); routed experts over the expert-data-parallel group of
``max(1, dp*tp // ep)`` ranks (``ep`` apart; EP is carved from ``dp*tp``).

Collectives are rings (NCCL's ring all-gather / reduce-scatter; Thakur et al. 2005): a GPU moves
``bytes*(n-1)/n`` in ``n-1`` steps, ``ms = bytes*(n-1)/n / bw + (n-1)*latency``
(:func:`ring_ms`), one collective per layer and group (Megatron buckets, FSDP units). ``bw``
(:func:`group_gbs`): NVLink when the group lies inside one node; across nodes NCCL runs one ring
per NIC and each ring leaves a node once, so a group with ``g`` members per node moves its bytes
at ``g`` NICs' bandwidth, ``min(intra_node_gbs, g * inter_node_gbs)``. Where each group lies is the
run's placement (:func:`tessera.spec.placement.place`: ``nodes`` and ``local`` of the ``dense_dp``
and ``expert_dp`` groups under ``parallel.rank_order``): under ``ep-dp-pp`` the dense group of
``dp`` ranks ``tp`` apart has ``g = gpus_per_node // tp`` members per node, the expert group
(``ep`` apart) ``gpus_per_node // ep``, at least 1; under ``pp-ep-dp`` both are ``pp * tp``
further apart.

* Parameter all-gather: BF16 (2 B) local parameters (Megatron distributed optimizer's
  param all-gather; FSDP's unshard).
* Gradient reduce-scatter: FP32 (4 B) (Megatron-LM sets ``accumulate_allreduce_grads_in_fp32``
  for BF16 training; FSDP2 ``MixedPrecisionPolicy(reduce_dtype=float32)`` as torchtitan does).
* Optimizer step (Adam with FP32 master weights, memory-bound): per parameter of the local shard
  (dense ``/dp``, experts ``/edp``) it reads the FP32 grad (4 B), reads and writes the FP32
  master, m and v (24 B) and writes the BF16 parameter (2 B): :data:`ADAM_BYTES` = 30 B,
  ``ms = shard * 30 / mem_bw``. Pure BF16 (``train.master_weights=false``): it reads the BF16
  grad (2 B) and reads and writes the BF16 parameter, m and v (12 B): :data:`BF16_ADAM_BYTES`
  = 14 B.

When each runs (once per iteration for ``zero1``, around every forward and backward for
``fsdp``) is the simulator's part (:mod:`tessera.sim.dpsync`); docs/cost-model.md lists both.
"""

from __future__ import annotations

from tessera.cost.flops import BF16, FP32
from tessera.cost.memory import ParamSplit
from tessera.cost.types import LayerDP, ParallelShape
from tessera.spec.hardware import HardwareSpec
from tessera.spec.placement import GroupPlacement, placement_of

GATHER_BYTES = BF16  # parameters are all-gathered in BF16
REDUCE_BYTES = FP32  # gradients are reduce-scattered in FP32
ADAM_BYTES = FP32 + 6 * FP32 + BF16  # grad read; master, m, v read + written; BF16 param written
BF16_ADAM_BYTES = BF16 + 6 * BF16  # pure BF16: grad read; param, m, v read + written


def ring_ms(nbytes: float, n: int, gbs: float, latency_us: float) -> float:
    """One ring all-gather or reduce-scatter of ``nbytes`` (the full, unsharded tensor) over ``n``
    GPUs at ``gbs`` GB/s per GPU, ms: ``nbytes*(n-1)/n / bw + (n-1)*latency``; 0 for ``n <= 1``
    or nothing to move."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * (n - 1) / n / (gbs * 1e9) * 1e3 + (n - 1) * latency_us * 1e-3


def dp_groups(p: ParallelShape) -> tuple[int, int]:
    """(dense data-parallel group size ``dp``, expert-data-parallel group size ``max(1, dp*tp // ep)``)."""
    return p.dp, max(1, (p.dp * p.tp) // p.ep)


def group_gbs(g: GroupPlacement, hw: HardwareSpec) -> float:
    """Ring bandwidth per GPU of the groups ``g`` (a :class:`~tessera.spec.placement.GroupPlacement`),
    GB/s: NVLink if a group lies inside one node (or has one member), else
    ``min(intra, local * inter)`` with ``local`` members on a node (module docstring)."""
    if g.size <= 1 or not g.crosses_nodes:
        return hw.intra_node_gbs
    return min(hw.intra_node_gbs, g.local * hw.inter_node_gbs)


def dp_link_gbs(p: ParallelShape, hw: HardwareSpec) -> tuple[float, float]:
    """(dense, expert) data-parallel ring bandwidths, GB/s, of ``p``'s placement on ``hw``'s nodes
    (:func:`tessera.spec.placement.placement_of`, :func:`group_gbs`)."""
    pl = placement_of(p, hw.gpus_per_node)
    return group_gbs(pl.group("dense_dp"), hw), group_gbs(pl.group("expert_dp"), hw)


def optimizer_ms(shard_params: float, hw: HardwareSpec, master_weights: bool = True) -> float:
    """Adam step over ``shard_params`` parameters, ms: ``shard * ADAM_BYTES / mem_bw``
    (:data:`BF16_ADAM_BYTES` without master weights)."""
    per = ADAM_BYTES if master_weights else BF16_ADAM_BYTES
    return shard_params * per / (hw.mem_bw_tbs * 1e12) * 1e3


def layer_dp(params: ParamSplit, p: ParallelShape, hw: HardwareSpec, master_weights: bool = True) -> LayerDP:
    """Data-parallel costs of a layer with ``params`` on its rank: local dense ``dense/tp``,
    local experts ``expert/ep``; one gather and one reduce-scatter per group (module docstring);
    ``master_weights``: the optimizer step's bytes (:func:`optimizer_ms`)."""
    dense, expert = params.dense / p.tp, params.expert / p.ep
    n_dense, n_expert = dp_groups(p)
    (bw_d, bw_e), lat = dp_link_gbs(p, hw), hw.link_latency_us
    gather = ring_ms(GATHER_BYTES * dense, n_dense, bw_d, lat) + ring_ms(GATHER_BYTES * expert, n_expert, bw_e, lat)
    reduce = ring_ms(REDUCE_BYTES * dense, n_dense, bw_d, lat) + ring_ms(REDUCE_BYTES * expert, n_expert, bw_e, lat)
    return LayerDP(gather, reduce, optimizer_ms(dense / n_dense + expert / n_expert, hw, master_weights))
