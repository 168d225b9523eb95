"""Expert-parallel (EP) dispatch and combine over a ``torch.distributed`` group.

Layout: the ``num_experts`` routed experts are split into contiguous blocks; group rank ``r`` owns
global experts ``[r * E_l, (r + 1) * E_l)`` with ``E_l = num_experts // ep``.

Dispatch of one MoE layer on each rank (all ranks call it in the same order):

1. ``exchange_counts``: one ``all_to_all_single`` of int64 counts. Rank ``r`` sends rank ``d``
   the number of its routes to each of ``d``'s experts plus its local capacity; it receives
   ``recv_counts[s, e]`` (routes from source rank ``s`` to local expert ``e``) and agrees the
   capacity as the maximum over the group (DeepSpeed's no-drop rule: ``all_reduce(MAX)``).
2. ``dispatch_tokens``: ``all_to_all_single`` of the token rows with split sizes from the counts
   (rows sorted by destination expert), then a permutation from source-major to expert-major
   order, so each local expert sees one contiguous block: source rank 0's rows, then rank 1's, ...
3. ``combine_tokens`` (after the experts): the inverse permutation and the reverse all-to-all.

Both all-to-alls are autograd Functions whose backward is the reverse all-to-all, so gradients
flow back to the source ranks. With ``group=None`` or a group of size 1 nothing is communicated.
A rank whose experts receive no rows still takes part in every collective (with empty tensors),
in forward and backward, so nothing hangs. Works with gloo (CPU) and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def ep_size(group) -> int:
    """Number of ranks in the EP group (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def ep_rank(group) -> int:
    """This process's rank inside the EP group (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True, eq=False)
class A2APlan:
    """How one microbatch's routes travel for one MoE layer (from :func:`plan_a2a`).

    Attributes:
        send_splits: rows sent to each group rank (``[ep]``), in rank order.
        recv_splits: rows received from each group rank (``[ep]``).
        recv_counts: int64 ``[ep, E_l]``: rows from source rank ``s`` for local expert ``e`` (what
            the dynamic bubble optimizer reads to predict expert time).
        local_counts: rows per local expert, summed over sources (``[E_l]``).
        regroup: int64 ``[sum(recv_splits)]``: received (source-major) row for each expert-major row.
        capacity: capacity agreed over the group (max of the ranks' local capacities).
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_counts: torch.Tensor
    local_counts: tuple[int, ...]
    regroup: torch.Tensor
    capacity: int

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)


def exchange_counts(counts: torch.Tensor, capacity: int, group) -> tuple[torch.Tensor, int]:
    """Send each rank the route counts for its experts; agree the capacity (max over ranks).

    Args:
        counts: int64 ``[E]`` routes this rank sends to each global expert.
        capacity: this rank's local capacity.
        group: the EP process group (``None``: no communication).
    Returns:
        ``(recv_counts [ep, E_l] int64, agreed_capacity)``.
    """
    ep = ep_size(group)
    num_experts = counts.numel()
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep}")
    e_local = num_experts // ep
    counts = counts.to(torch.int64).reshape(ep, e_local)
    if ep == 1:
        return counts.clone(), int(capacity)
    cap = torch.full((ep, 1), int(capacity), dtype=torch.int64, device=counts.device)
    send = torch.cat([counts, cap], dim=1).contiguous()  # on the counts' device (NCCL: CUDA)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv[:, :e_local], int(recv[:, e_local].max())


def plan_a2a(counts: torch.Tensor, capacity: int, group) -> A2APlan:
    """Exchange counts (:func:`exchange_counts`) and derive splits and the regroup permutation.

    Args:
        counts: int64 ``[E]`` rows this rank sends per global expert; its send buffer must hold
            them sorted by global expert id (experts of rank 0 first).
    """
    ep = ep_size(group)
    recv_counts, agreed = exchange_counts(counts, capacity, group)
    e_local = recv_counts.shape[1]
    send_splits = tuple(int(v) for v in counts.to(torch.int64).reshape(ep, e_local).sum(1).tolist())
    recv_splits = tuple(int(v) for v in recv_counts.sum(1).tolist())
    # source-major offsets of every (source, expert) block, then read them expert-major
    flat = recv_counts.reshape(-1).cpu()
    starts = torch.cumsum(flat, 0) - flat
    blocks = [
        torch.arange(int(starts[s * e_local + e]), int(starts[s * e_local + e] + flat[s * e_local + e]))
        for e in range(e_local)
        for s in range(ep)
    ]
    regroup = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
    local_counts = tuple(int(v) for v in recv_counts.sum(0).tolist())
    return A2APlan(send_splits, recv_splits, recv_counts, local_counts, regroup.to(counts.device), agreed)


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all of rows; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=group)
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
    return recv.index_select(0, plan.regroup)


def combine_tokens(out: torch.Tensor, plan: A2APlan, group) -> torch.Tensor:
    """Inverse of :func:`dispatch_tokens`: expert outputs ``[plan.num_recv, H]`` (expert-major)
    back to the source ranks; returns ``[N_send, H]`` in this rank's original send order."""
    if ep_size(group) == 1:
        return out
    inverse = torch.empty_like(plan.regroup)
    inverse[plan.regroup] = torch.arange(plan.regroup.numel(), device=plan.regroup.device)
    return all_to_all(out.index_select(0, inverse), plan.recv_splits, plan.send_splits, group)
