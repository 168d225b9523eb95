"""Synchronous (autograd) front of the EP exchange: what the model's MoE layer calls.

Dispatch of one MoE layer on each rank (all ranks call it in the same order), after
:func:`~tessera.model.ep.plan.plan_a2a` planned it:

1. :func:`dispatch_tokens`: ``all_to_all_single`` of the token rows with split sizes from the
   counts (rows sorted by destination expert), then the permutation from source-major to
   expert-major order (:func:`~tessera.model.ep.plan.expert_major`).
2. :func:`combine_tokens` (after the experts): the inverse permutation and the reverse all-to-all.

Both all-to-alls are autograd Functions whose backward is the reverse all-to-all, so gradients
flow back to the source ranks; each call blocks until its rows have arrived. With ``group=None``
or a group of size 1 nothing is communicated. A rank whose experts receive no rows still takes
part in every collective (with empty tensors), in forward and backward, so nothing hangs. Works
with gloo (CPU) and NCCL.
"""

from __future__ import annotations

import torch

from tessera.model.ep.plan import A2APlan, ep_size, expert_major, issue_all_to_all, source_major


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all of rows; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out, _ = issue_all_to_all(x, send_splits, recv_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of rows ``x [sum(send_splits), ...]`` ->
    ``[sum(recv_splits), ...]``; identity when the group has one rank."""
    if ep_size(group) == 1:
        return x
    return _AllToAll.apply(x, tuple(send_splits), tuple(recv_splits), group)


def dispatch_tokens(rows: torch.Tensor, plan: A2APlan, group) -> torch.Tensor:
    """Send rows ``[N_send, H]`` (sorted by global expert) to the expert owners.

    Returns ``[plan.num_recv, H]`` in expert-major order: local expert 0's rows (source rank 0's,
    then rank 1's, ...), then local expert 1's, ...
    """
    recv = all_to_all(rows, plan.send_splits, plan.recv_splits, group)
    if ep_size(group) == 1:
        return recv
    return expert_major(recv, plan)


def combine_tokens(out: torch.Tensor, plan: A2APlan, group) -> torch.Tensor:
    """Inverse of :func:`dispatch_tokens`: expert outputs ``[plan.num_recv, H]`` (expert-major)
    back to the source ranks; returns ``[N_send, H]`` in this rank's original send order."""
    if ep_size(group) == 1:
        return out
    return all_to_all(source_major(out, plan), plan.recv_splits, plan.send_splits, group)
