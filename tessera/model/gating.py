"""Dropless top-k routing where DeepSpeed is not installed, with DeepSpeed's numbers.

:mod:`tessera.model.moe` routes with DeepSpeed's ``TopKGate`` when ``deepspeed`` imports. A
machine with only torch and transformers (the one-GPU check of ``benchmarks/gpu_check.py``) routes
with :class:`Router` instead, for the routing every recipe uses: dropless, deterministic (no noisy
gate policy, no random token selection, no sampled second expert). For that routing the outputs
Tessera reads are bitwise DeepSpeed's (``tests/test_gating.py`` compares them, and their
gradients, for top-1, top-2 and top-k); anything else is refused at construction, naming the field.

The routing, for logits ``z [T, E]`` (FP32) and ``p = softmax(z)`` per token:

* top-1 (Switch Transformer, Fedus et al. 2021, eq. 4-6): the expert ``argmax p``, its gate
  ``p`` unnormalised; aux loss ``E * sum_e f_e P_e`` with ``f_e`` the fraction of tokens whose
  choice is ``e`` and ``P_e`` the mean probability of ``e``;
* top-2 (GShard, Lepikhin et al. 2020, Algorithm 1): the first expert ``argmax p``, the second
  ``argmax`` of the logits without the first; both gates renormalised by their sum; aux loss
  ``E^2 * mean_e f_e P_e`` over the first choices;
* top-k, k > 2: the k largest ``p``, renormalised by their sum; aux loss ``E^2 / k * mean_e f_e P_e``
  with ``f_e`` over all k choices.

Renormalising sums are clamped below at FP32's machine epsilon. Dropless: every route is kept, so
the capacity is the largest expert count (top-1: also at most ``T``). These are the conventions of
DeepSpeed 0.19's ``deepspeed/moe/sharded_moe.py`` (read, not copied), which is what makes the
numbers equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import TesseraConfigError

SOURCE = "tessera.model.gating"
"""The routing's source when this module routes (:data:`tessera.model.moe.GATING_SOURCE`)."""

_FIX = "install deepspeed (pip install deepspeed) for this option, or leave it at the default"


class Router(nn.Module):
    """A dropless, deterministic top-k gate: the parameter ``wg`` (``nn.Linear(hidden, E,
    bias=False)``, drawn as DeepSpeed's ``TopKGate.wg`` is, so weights and state-dict names are the
    same whichever class built the gate) and the attributes :func:`tessera.model.moe.gate_routes`
    reads.

    Args:
        model_dim: hidden size H.
        num_experts: E.
        k: experts per token, ``1 <= k <= E``.
        capacity_factor, eval_capacity_factor, min_capacity: kept for the same attributes; a
            dropless gate does not use them.
        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling: must be the
            deterministic dropless choice (None, False, False, False).

    Raises:
        TesseraConfigError: an option this gate does not implement (one line: the field, its
            value, the rule, the fix).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = False, use_rts: bool = False, top2_2nd_expert_sampling: bool = False,
                 **_ignored) -> None:
        super().__init__()
        refused = {"moe.drop_tokens": drop_tokens, "moe.noisy_gate_policy": noisy_gate_policy,
                   "moe.use_rts": use_rts and k == 1, "moe.top2_2nd_expert_sampling": top2_2nd_expert_sampling and k == 2}
        for field, value in refused.items():
            if value:
                raise TesseraConfigError(field, value, "routing without DeepSpeed is dropless and deterministic", _FIX)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.min_capacity, self.noisy_gate_policy = k, min_capacity, noisy_gate_policy
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling


def dropless_routes(logits: torch.Tensor, k: int):
    """Route ``logits [T, E]`` (FP32) to their top ``k`` experts, keeping every route.

    Returns the sparse-route tuple :func:`tessera.model.moe.gate_routes` returns: ``(aux_loss``
    (0-d FP32), ``capacity`` (0-d int64: the largest expert count), ``E``, ``indices [k, T]`` int32,
    ``None`` (no slot locations: Tessera sorts its routes itself), ``gates [k, T]`` FP32,
    ``counts [E]`` int64 ``)``; row ``j`` of ``indices``/``gates`` is every token's ``j``-th choice.
    Formulas: module docstring.
    """
    t, e = logits.shape
    probs = F.softmax(logits, dim=1)
    mean_prob = probs.mean(dim=0)
    if k == 1:
        first = probs.argmax(dim=1)
        chosen = F.one_hot(first, e)
        aux = (mean_prob * chosen.float().mean(dim=0)).sum() * e
        counts = chosen.sum(dim=0)
        capacity = torch.minimum(counts.max(), torch.tensor(t, device=counts.device))
        return aux, capacity, e, first.to(torch.int32).unsqueeze(0), None, probs.gather(1, first[:, None]).t(), counts
    if k == 2:
        first = probs.argmax(dim=1)
        first_mask = F.one_hot(first, e)
        second = logits.masked_fill(first_mask.bool(), float("-inf")).argmax(dim=1)
        aux = (mean_prob * first_mask.float().mean(dim=0)).mean() * e * e
        counts = (first_mask + F.one_hot(second, e)).sum(dim=0)
        g1, g2 = probs.gather(1, first[:, None])[:, 0], probs.gather(1, second[:, None])[:, 0]
        norm = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        return (aux, counts.max(), e, torch.stack([first, second]).to(torch.int32), None,
                torch.stack([g1 / norm, g2 / norm]), counts)
    top, index = torch.topk(probs, k=k, dim=1)
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, index, True)
    aux = (mean_prob * mask.float().mean(dim=0)).mean() * e * e / k
    counts = mask.sum(dim=0)
    kept = probs * mask
    norm = torch.clamp(kept.sum(dim=-1, keepdim=True), min=torch.finfo(kept.dtype).eps)
    gates = (kept / norm).gather(1, index)
    return aux, counts.max(), e, index.t().contiguous().to(torch.int32), None, gates.t().contiguous(), counts
