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


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 routing (its report, sec. 2.1.2 and 2.3; transformers ``DeepseekV3TopkRouter``,
    the same rule as ``NemotronHTopkRouter``): sigmoid affinities ``s = sigmoid(z)``; each expert's
    choice score is ``s + b`` with ``b`` the correction bias (``e_score_correction_bias``, a
    buffer: it steers the choice only, never the gates); with ``num_groups > 1`` a group's score
    is the sum of its two best choice scores and only the ``topk_groups`` best groups are
    eligible; the top ``k`` eligible experts are chosen; their gates are the chosen ``s``
    normalised to sum 1 (plus 1e-20, as transformers), times ``routed_scaling``. Dropless.

    Aux loss (the report's complementary sequence-wise balance loss, eq. 17-20, without its
    ``alpha``, which is ``MoESpec.aux_loss_coef``): per sequence of ``S`` tokens,
    ``sum_e f_e P_e`` with ``f_e = E / (k S) * (tokens of the sequence choosing e)`` and ``P_e``
    the mean over the sequence of ``s_e / sum_j s_j``; averaged over the sequences.

    Aux-loss-free balancing (the report's sec. 2.1.2): with ``bias_update_rate`` ``gamma > 0``
    every routing in training adds its routes per expert to :attr:`load`, and after each optimizer
    step :func:`update_expert_bias` moves the bias by ``gamma * sign(mean load - load_e)`` on the
    load summed over all the ranks that hold this router (DeepSeek-V3: ``gamma = 0.001``, its
    sec. 4.2). A re-run of the router inside a backward (activation recompute) does not count.
    The bias is loaded from and exported to Hugging Face checkpoints.

    Raises:
        TesseraConfigError: ``drop_tokens`` or a noisy gate policy (not part of this routing).

    Attributes:
        wg: ``nn.Linear(H, E, bias=False)`` (the router weight; HF ``mlp.gate.weight``).
        e_score_correction_bias: FP32 ``[E]`` buffer (HF ``mlp.gate.e_score_correction_bias``).
        load: int64 ``[E]`` routes per expert since the last bias update (not saved).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int, num_groups: int = 1, topk_groups: int = 1,
                 routed_scaling: float = 1.0, min_capacity: int = 8, drop_tokens: bool = False,
                 noisy_gate_policy: str | None = None, bias_update_rate: float = 0.0, **_ignored) -> None:
        super().__init__()
        for field, value in {"moe.drop_tokens": drop_tokens, "moe.noisy_gate_policy": noisy_gate_policy}.items():
            if value:
                raise TesseraConfigError(field, value, "sigmoid (DeepSeek-V3) routing is dropless and deterministic",
                                         "leave it at the default, or use model.moe.router=softmax")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.bias_update_rate = float(bias_update_rate)
        self.k, self.num_groups, self.topk_groups = k, num_groups, topk_groups
        self.routed_scaling, self.min_capacity = float(routed_scaling), min_capacity
        self.capacity_factor = self.eval_capacity_factor = 1.0
        self.noisy_gate_policy, self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = None, False, False, False

    def routes(self, logits: torch.Tensor, seq_len: int):
        """Route ``logits [T, E]`` (FP32; ``T`` a whole number of sequences of ``seq_len`` tokens).
        Returns the tuple of :func:`dropless_routes` (``indices``/``gates`` ``[k, T]``)."""
        t, e = logits.shape
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = choice.detach().view(t, self.num_groups, e // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            eligible = group_mask.unsqueeze(-1).expand(-1, -1, e // self.num_groups).reshape(t, e).bool()
            choice = choice.masked_fill(~eligible, float("-inf"))
        index = torch.topk(choice.detach(), k=self.k, dim=-1, sorted=False)[1]
        top = scores.gather(1, index)
        gates = top / (top.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, True)
        counts = mask.sum(dim=0)
        if self.bias_update_rate and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.load.add_(counts)  # a training forward, not a recompute re-run inside a backward
        seqs = max(t // max(seq_len, 1), 1)
        frac = mask.float().view(seqs, -1, e).mean(dim=1) * (e / self.k)
        prob = (scores / scores.sum(dim=-1, keepdim=True)).view(seqs, -1, e).mean(dim=1)
        aux = (frac * prob).sum(dim=-1).mean()
        return aux, counts.max(), e, index.t().contiguous().to(torch.int32), None, gates.t().contiguous(), counts


def sigmoid_routers(modules) -> list[SigmoidRouter]:
    """The :class:`SigmoidRouter` s with a bias update rate in ``modules`` (nn.Modules), in
    module order (the order :func:`update_expert_bias` packs their loads in)."""
    return [r for m in modules for r in m.modules() if isinstance(r, SigmoidRouter) and r.bias_update_rate]


def update_expert_bias(routers, group=None) -> None:
    """One aux-loss-free bias step (:class:`SigmoidRouter`) for ``routers`` (the same list, in
    the same order, on every rank of ``group``): their loads are summed over ``group`` (one
    ``all_reduce`` of all loads in one int64 buffer; None: this process alone), each bias moves by
    ``rate * sign(mean(load) - load_e)``, and the loads restart at zero. Integer sums are exact,
    so every rank applies the same update."""
    if not routers:
        return
    flat = torch.cat([r.load for r in routers])
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(flat, group=group)
    offset = 0
    with torch.no_grad():
        for r in routers:
            n = r.load.numel()
            load = flat[offset:offset + n].to(torch.float32)
            offset += n
            r.e_score_correction_bias.add_(torch.sign(load.mean() - load) * r.bias_update_rate)
            r.load.zero_()


def reset_expert_load(routers) -> None:
    """Zero the routers' loads (the start of an iteration: what a profile run or a failed
    iteration routed does not count)."""
    for r in routers:
        r.load.zero_()
