"""The planning half of the expert-parallel (EP) exchange, shared by both fronts.

Layout: the ``num_experts`` routed experts are split into contiguous blocks; group rank ``r`` owns
global experts ``[r * E_l, (r + 1) * E_l)`` with ``E_l = num_experts // ep``.

Row orders: a rank sends its rows sorted by (global expert, token), so its send buffer holds the
rows for rank 0's experts first. What an owner receives is *source-major* (source rank 0's rows,
then rank 1's, ...); :func:`expert_major` regroups it so each local expert sees one contiguous
block (expert 0's rows from source rank 0, then from rank 1, ..., then expert 1's ...), and
:func:`source_major` is the inverse. :func:`stack_rows` / :func:`unstack_rows` build the same
expert-major buffer in one process from the rows of every member of an EP group (what the
single-process reference does).

Planning one MoE layer for one microbatch (all ranks call it in the same order):

1. :func:`exchange_counts`: one ``all_to_all_single`` of int64 counts. Rank ``r`` sends rank ``d``
   the number of its routes to each of ``d``'s experts plus its local capacity; it receives
   ``recv_counts[s, e]`` (routes from source rank ``s`` to local expert ``e``) and agrees the
   capacity as the maximum over the group (DeepSpeed's no-drop rule: ``all_reduce(MAX)``).
2. :func:`plan_a2a`: the send/recv splits and the regroup permutation and its inverse
   (:class:`A2APlan`); :func:`plan_route` wraps it with the local (no EP) case (:class:`ExpertRoute`).

Host synchronisation (CUDA): the count exchange itself is a device all-to-all (the counts stay
on their device, NCCL), but the splits of ``all_to_all_single`` and the per-expert row splits of
the expert task are host ints, so :func:`plan_a2a` reads the received counts on the host
(``tolist``): one host sync per MoE layer and microbatch, after the router, also without EP
(:func:`plan_route`'s local counts). It stays as long as the all-to-alls have variable splits;
what does not need the counts on the host (the regroup permutation's ``cumsum``) could move to
the device, but the splits could not.

The row all-to-alls themselves are :func:`issue_all_to_all`, called by the two fronts:
:mod:`tessera.model.ep.sync` (autograd, blocking: the model's MoE layer) and
:mod:`tessera.model.ep.asynchronous` (start / wait handles, no autograd: the engine). All moves are
permutations or copies, so they are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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
        inverse: int64 ``[sum(recv_splits)]``: inverse of ``regroup`` (expert-major row for each
            source-major position).
        capacity: capacity agreed over the group (max of the ranks' local capacities).
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_counts: torch.Tensor
    local_counts: tuple[int, ...]
    regroup: torch.Tensor
    inverse: torch.Tensor
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
    """Exchange counts (:func:`exchange_counts`) and derive splits, the regroup permutation and
    its inverse.

    Args:
        counts: int64 ``[E]`` rows this rank sends per global expert; its send buffer must hold
            them sorted by global expert id (experts of rank 0 first).
        capacity: this rank's local capacity.
        group: the EP process group.
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
    regroup = regroup.to(counts.device)
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    local_counts = tuple(int(v) for v in recv_counts.sum(0).tolist())
    return A2APlan(send_splits, recv_splits, recv_counts, local_counts, regroup, inverse, agreed)


@dataclass(frozen=True, eq=False)
class ExpertRoute:
    """How one microbatch's rows of one MoE layer travel, with or without EP (:func:`plan_route`).

    Attributes:
        plan: the all-to-all plan of :func:`plan_a2a` (None without EP: the rows stay local).
        counts: rows per local expert (what the expert task splits by; ``[E]`` without EP).
        capacity: capacity agreed over the group (this rank's own without EP).
    """

    plan: A2APlan | None
    counts: tuple[int, ...]
    capacity: int


def plan_route(counts: torch.Tensor, capacity: int, group) -> ExpertRoute:
    """Exchange the route counts over the EP group (a small blocking all-to-all) and derive the
    splits; without EP (``group`` None or of size 1) the route is local.
    ``counts``: int64 ``[E]`` rows per global expert."""
    if ep_size(group) == 1:
        return ExpertRoute(None, tuple(int(c) for c in counts.tolist()), int(capacity))
    plan = plan_a2a(counts, capacity, group)
    return ExpertRoute(plan, plan.local_counts, plan.capacity)


def expert_major(received: torch.Tensor, plan: A2APlan | None) -> torch.Tensor:
    """Source-major rows ``[plan.num_recv, ...]`` (as received) -> expert-major rows (expert input
    order); ``plan`` None (no EP): ``received`` itself."""
    return received if plan is None else received.index_select(0, plan.regroup)


def source_major(y: torch.Tensor, plan: A2APlan | None) -> torch.Tensor:
    """Inverse of :func:`expert_major`: expert-major rows ``[plan.num_recv, ...]`` -> source-major
    (the order in which they travel back to their sources); ``plan`` None: ``y`` itself."""
    return y if plan is None else y.index_select(0, plan.inverse)


def issue_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group,
                     async_op: bool = False):
    """Variable-split ``all_to_all_single`` of rows ``x [sum(send_splits), ...]`` into a new
    buffer ``[sum(recv_splits), ...]``; returns ``(buffer, work)`` (``work`` None unless
    ``async_op``; the buffer is valid once ``work.wait()`` returned)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                                  group=group, async_op=async_op)
    return out, work


def stack_rows(rows: Sequence[torch.Tensor], counts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Single-process EP: the expert-major buffer the owners of an EP group see, over all experts.

    Args:
        rows: per group member (EP-rank order) its send rows ``[N_d, H]`` (sorted by expert).
        counts: per member int64 ``[E]`` rows per global expert.
    Returns:
        ``(x [sum N_d, H], rows per expert [E])``: expert 0's rows (member 0's, member 1's, ...),
        then expert 1's, ...
    """
    cnt = [c.tolist() for c in counts]
    parts = [torch.split(r, c, dim=0) for r, c in zip(rows, cnt)]
    num_experts = len(cnt[0])
    blocks = [parts[d][e] for e in range(num_experts) for d in range(len(rows))]
    per_expert = tuple(sum(c[e] for c in cnt) for e in range(num_experts))
    return torch.cat(blocks, dim=0), per_expert


def unstack_rows(y: torch.Tensor, counts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`stack_rows`: expert-major ``y`` -> per member its rows in send order."""
    cnt = [c.tolist() for c in counts]
    members, num_experts = len(cnt), len(cnt[0])
    blocks = torch.split(y, [cnt[d][e] for e in range(num_experts) for d in range(members)], dim=0)
    return [torch.cat([blocks[e * members + d] for e in range(num_experts)], dim=0) for d in range(members)]
