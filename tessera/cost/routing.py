"""Routing imbalance: how unevenly a MoE layer's tokens land on the EP ranks, as one load factor.

Real MoE training does not route evenly. Every MoE layer's combine waits for the slowest member
of the EP group, and that member is the one whose experts received the most tokens: with
``n_e`` the tokens (token-expert assignments) EP rank ``e`` receives in one MoE layer and
microbatch, the layer's expert compute and its dispatch / combine last ``n_max / n_mean`` times
their balanced time (expert time is linear in tokens; an all-to-all lasts as long as its largest
receive). :func:`relative_loads` is that ratio, the one definition the cost model, the bubble
optimizer's slot prediction (:mod:`tessera.dbo.predict`) and the routing skew a running job
measures (:func:`tessera.dbo.counts.skew_ratio`) share.

The recipe's ``model.moe_routing`` picks the factor the cost model gives every MoE layer
(:func:`load_factor`; ``CostOptions.moe_load``, applied in :func:`tessera.cost.analytic.layer_cost`):

* ``balanced`` (the default): 1.0, every EP rank gets the mean load (the cost model as before).
* ``dropless``: no capacity, no token dropped (Megatron-Core's default: ``moe_expert_capacity_factor``
  None "means no token will be dropped", NeMo ``docs/source/features/moe.rst``, NVIDIA-NeMo/Speech PR 10077); the busiest
  EP rank gets ``model.moe_max_over_mean`` times the mean, default
  :data:`DROPLESS_MAX_OVER_MEAN`.
* ``forced``: tokens dropped above a per-expert capacity of ``capacity_factor`` times the mean and
  the experts' inputs padded up to it, so every EP rank computes and receives exactly
  ``capacity_factor`` times the mean (Megatron-Bridge ``apply_moe_token_drop``:
  ``moe_expert_capacity_factor=1.0``, ``moe_pad_expert_input_to_capacity=True``); the factor is
  ``model.moe_max_over_mean`` (the capacity factor), default :data:`FORCED_CAPACITY_FACTOR`.

What the factor ``f`` scales (docs/cost-model.md, "Routing imbalance"): the ``expert`` compute
tasks (F, B and W; not their FLOPs, model FLOPs stay model FLOPs, nor the per-GEMM host cost
``deferred_ms``) and the ``dispatch`` / ``combine`` tasks of every MoE decoder layer
(:data:`ROUTED_KINDS`), and the busiest rank's receive buffers: the saved tensors sized by the
token-expert assignments a rank receives (``expert_in``, ``expert_fc1_out``, ``expert_act_out``,
:func:`tessera.cost.memory.layer_tensors`) are ``f`` times their balanced size.
"""

from __future__ import annotations

import math
from typing import Sequence

from tessera.spec.tasks import TaskKind

ROUTINGS = ("balanced", "dropless", "forced")
"""``model.moe_routing`` values (module docstring)."""

ROUTED_KINDS = (TaskKind.EXPERT, TaskKind.DISPATCH, TaskKind.COMBINE)
"""The task kinds of a MoE layer that the busiest EP rank gates (scaled by the load factor)."""

DROPLESS_MAX_OVER_MEAN = 1.30
"""Busiest EP rank's tokens over the mean rank's under dropless routing without a balancer:
the low end of the "inter-rank imbalance from 1.30-4.01" that Wei et al., "UltraEP: Unleash MoE
Training and Inference on Rack-Scale Nodes with Near-Optimal Load Balancing" (arXiv 2606.04101,
abstract) measure across MoE models of 106B to 671B parameters in training and prefill without
rebalancing (their balancer brings it to 1.01-1.04). The low end, because the models that train
with a load-balancing loss or bias sit at the balanced end of that range; a measured value
(``routing_skew`` of a running job, docs/operations.md) goes in ``model.moe_max_over_mean``."""

FORCED_CAPACITY_FACTOR = 1.0
"""Capacity factor of ``forced`` routing when none is given: Megatron-Bridge's token-drop default
(``apply_moe_token_drop(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)``,
``bridge.training.utils.moe_token_drop``): every expert padded to the mean load, so the compute is
the balanced one."""


def relative_loads(loads: Sequence[float]) -> tuple[tuple[float, ...], float]:
    """(``n_e / n_mean`` per EP rank, ``n_max / n_mean``) of the EP ranks' token ``loads`` (one
    MoE layer, one microbatch); all 1 when no token is routed (module docstring)."""
    ep = len(loads)
    mean = sum(loads) / ep
    if mean <= 0:
        return (1.0,) * ep, 1.0
    return tuple(x / mean for x in loads), max(loads) / mean


def load_factor(routing: str, max_over_mean: float | None = None) -> float:
    """The busiest EP rank's load over the mean rank's that the cost model gives every MoE layer
    under ``routing`` (module docstring): ``balanced`` 1.0; ``dropless`` ``max_over_mean`` or
    :data:`DROPLESS_MAX_OVER_MEAN`; ``forced`` ``max_over_mean`` (the capacity factor) or
    :data:`FORCED_CAPACITY_FACTOR`.

    Raises:
        ValueError: an unknown ``routing``, ``max_over_mean`` with ``balanced``, or one that is
            not a finite number >= 1 (the recipe rules give the one-line config error first:
            :func:`tessera.config.cost_rules.check_cost_fields`).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"moe_routing={routing!r}: use one of {', '.join(ROUTINGS)}")
    if max_over_mean is not None:
        if routing == "balanced":
            raise ValueError("moe_max_over_mean is set with moe_routing='balanced' (1.0 by definition)")
        if isinstance(max_over_mean, bool) or not 1.0 <= max_over_mean < math.inf:
            raise ValueError(f"moe_max_over_mean={max_over_mean!r}: must be a finite number >= 1")
        return float(max_over_mean)
    return {"balanced": 1.0, "dropless": DROPLESS_MAX_OVER_MEAN, "forced": FORCED_CAPACITY_FACTOR}[routing]


def expert_gate(routed: float, ep_factor: float) -> float:
    """The factor on top of routing imbalance ``routed`` (:func:`load_factor`, already in the
    expert tasks) that ``planner.ep_slowdown``'s largest factor ``ep_factor`` adds to them
    (:meth:`tessera.cost.slowdown.Slowdown.apply`).

    Both describe the one thing that gates a MoE layer, its slowest EP member: routing the uneven
    tokens it receives, ``ep_slowdown`` a member's measured expert time over the modelled one (a
    slow device, or the systematic part of the same uneven routing: what a running job writes,
    :mod:`tessera.train.worker.straggler`). The layer lasts the larger of the two, not their
    product (which would count the same uneven tokens twice): ``max(ep_factor, routed) / routed``.
    With balanced routing (``routed`` 1.0) it is ``ep_factor`` itself, as before.
    """
    if routed == 1.0:
        return ep_factor
    return max(ep_factor, routed) / routed
