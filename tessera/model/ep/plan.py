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

Planning one MoE layer for one microbatch (all ranks of the group call it in the same order):

1. :func:`exchange_counts`: one ``all_to_all_single`` of int64 counts, on the *counts group*
   (a communicator of its own with the EP group's ranks, :class:`tessera.engine.groups.RankGroups`
   ``ep_counts``; default the EP group itself). Rank ``r`` sends rank ``d`` the number of its
   routes to each of ``d``'s experts plus its local capacity; it receives ``recv_counts[s, e]``
   (routes from source rank ``s`` to local expert ``e``) and agrees the capacity as the maximum
   over the group (DeepSpeed's no-drop rule: ``all_reduce(MAX)``). NCCL runs one communicator's
   operations in issue order, so on the EP group itself the count exchange would queue behind the
   row all-to-alls still in flight on the side stream; on its own communicator it does not.
2. :func:`plan_a2a`: the send/recv splits and the regroup permutation and its inverse
   (:class:`A2APlan`); :func:`plan_route` wraps it with the local (no EP) case (:class:`ExpertRoute`),
   in two halves a caller may separate: :func:`exchange_route_counts` (the exchange, device only:
   the engine issues it in the router task) and :func:`read_route` (the host read and the
   permutation: the engine's dispatch task).

Host synchronisation (CUDA): exactly one per MoE layer and microbatch, with or without EP. The
counts and the capacity stay on their device through the exchange; what the host needs (the
send splits, the receive splits, the rows per local expert and the agreed capacity) is gathered
into one small int64 tensor and read with a single ``tolist()`` (counted on ``syncs``, a
:class:`~tessera.model.hostsync.HostSyncs`). That read remains because ``all_to_all_single``
with variable splits takes its split sizes as host ints (and sizes its output from them), and
the expert task splits its rows per expert by host ints. It waits for what the compute stream
queued before it (the router, the count exchange), not for row all-to-alls still in flight on the
EP group (another communicator, a side stream). Without EP the same read gives the per-expert
counts. (The router itself reads nothing, :mod:`tessera.model.moe`, except DeepSpeed's top-1
gating in dropless mode. A capacity agreed ahead, with all-to-alls padded to it, could drop this
read too; Tessera's all-to-alls carry only the kept rows.) The regroup permutation and its
inverse are built on the device from the received counts (:func:`regroup_permutation`:
``cumsum`` for the block starts, ``repeat_interleave`` with the size known from that read): no
loop over experts, no host copy.

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

from tessera.model.determinism import empty_overwritten
from tessera.model.hostsync import HostSyncs, count


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
        recv_counts: int64 ``[ep, E_l]`` on the counts' device: rows from source rank ``s`` for
            local expert ``e`` (what the dynamic bubble optimizer reads to predict expert time).
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

    @property
    def num_send(self) -> int:
        """Rows this rank sends, ``sum(send_splits)``."""
        return sum(self.send_splits)


def _capacity_tensor(capacity, device: torch.device) -> torch.Tensor:
    """``capacity`` (an int, or a 0-d integer tensor) as a 0-d int64 tensor on ``device`` without
    a host read of a device value: a device tensor stays where it is; a host value (an int, a CPU
    tensor: DeepSpeed's drop-mode capacity) is read on the host, which costs no synchronisation."""
    if isinstance(capacity, torch.Tensor):
        if capacity.device == device:
            return capacity.reshape(()).to(torch.int64)
        if capacity.device.type != "cpu":
            raise ValueError(f"the capacity is on {capacity.device}, the counts on {device}")
        capacity = int(capacity)  # a CPU tensor: no device synchronisation
    return torch.full((), int(capacity), dtype=torch.int64, device=device)


def exchange_counts(counts: torch.Tensor, capacity, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each rank the route counts for its experts; agree the capacity (max over ranks).
    Everything stays on the counts' device: no host synchronisation.

    Args:
        counts: int64 ``[E]`` routes this rank sends to each global expert.
        capacity: this rank's local capacity (an int or a 0-d integer tensor on the counts'
            device or the CPU).
        group: the process group the counts travel on: the EP group's counts group (same ranks
            in the same order as the EP group; ``None``: no communication).
    Returns:
        ``(recv_counts [ep, E_l] int64, agreed capacity: 0-d int64)``, both on the counts' device.

    Raises:
        ValueError: ``E`` is not divisible by the group size, or the capacity is on another
            accelerator than the counts.
    """
    ep = ep_size(group)
    num_experts = counts.numel()
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep}")
    e_local = num_experts // ep
    counts = counts.to(torch.int64).reshape(ep, e_local)
    cap = _capacity_tensor(capacity, counts.device)
    if ep == 1:
        return counts.clone(), cap
    send = torch.cat([counts, cap.expand(ep, 1)], dim=1).contiguous()  # on the counts' device (NCCL: CUDA)
    recv = empty_overwritten(send.shape, dtype=send.dtype, device=send.device)  # the exchange writes all of it
    dist.all_to_all_single(recv, send, group=group)
    return recv[:, :e_local], recv[:, e_local].max()


def regroup_permutation(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The regroup permutation (source-major row of each expert-major row) and its inverse, built
    on ``recv_counts``' device with vectorised ops (no loop over experts, no host read).

    Args:
        recv_counts: int64 ``[ep, E_l]``: rows from source rank ``s`` for local expert ``e``.
        total: ``recv_counts.sum()`` as a host int (the number of received rows).
    Returns:
        ``(regroup [total], inverse [total])`` int64: the received buffer's block ``(s, e)``
        starts at the exclusive prefix sum of ``recv_counts`` in source-major order and at the
        one in expert-major order in the regrouped buffer; row ``j`` of an expert-major block
        reads source-major row ``j + (its source-major start - its expert-major start)``.
    """
    ep, e_local = recv_counts.shape
    sizes_se = recv_counts.reshape(-1)  # block sizes in (source, expert) order: as received
    sizes_es = recv_counts.t().reshape(-1)  # block sizes in (expert, source) order: as regrouped
    start_se = torch.cumsum(sizes_se, 0) - sizes_se
    start_es = torch.cumsum(sizes_es, 0) - sizes_es
    shift = start_se.reshape(ep, e_local).t().reshape(-1) - start_es  # per block, (expert, source) order
    pos = torch.arange(total, dtype=torch.int64, device=recv_counts.device)
    regroup = pos + torch.repeat_interleave(shift, sizes_es, output_size=total)
    inverse = pos - torch.repeat_interleave(shift.reshape(e_local, ep).t().reshape(-1), sizes_se, output_size=total)
    return regroup, inverse


def _a2a_plan(counts: torch.Tensor, recv_counts: torch.Tensor, agreed: torch.Tensor,
              syncs: HostSyncs | None) -> A2APlan:
    """The plan from exchanged counts: one host read (module docstring), counted on ``syncs``."""
    ep, e_local = recv_counts.shape
    send_splits = counts.to(torch.int64).reshape(ep, e_local).sum(1)
    host = torch.cat([send_splits, recv_counts.sum(1), recv_counts.sum(0), agreed.reshape(1)]).tolist()
    count(syncs)
    send, recv, local, cap = host[:ep], host[ep:2 * ep], host[2 * ep:2 * ep + e_local], host[-1]
    regroup, inverse = regroup_permutation(recv_counts, sum(recv))
    return A2APlan(tuple(send), tuple(recv), recv_counts, tuple(local), regroup, inverse, cap)


def plan_a2a(counts: torch.Tensor, capacity, group, counts_group=None, syncs: HostSyncs | None = None) -> A2APlan:
    """Exchange counts (:func:`exchange_counts`, on ``counts_group``) and derive splits, the
    regroup permutation and its inverse; one host read (module docstring), counted on ``syncs``.

    Args:
        counts: int64 ``[E]`` rows this rank sends per global expert; its send buffer must hold
            them sorted by global expert id (experts of rank 0 first).
        capacity: this rank's local capacity (int or 0-d integer tensor).
        group: the EP process group (the rows' all-to-alls).
        counts_group: the group the counts travel on (same ranks as ``group``; None: ``group``).
        syncs: where the host read is counted (None: not counted).

    Raises:
        ValueError: as :func:`exchange_counts`.
    """
    recv_counts, agreed = exchange_counts(counts, capacity, group if counts_group is None else counts_group)
    return _a2a_plan(counts, recv_counts, agreed, syncs)


@dataclass(frozen=True, eq=False)
class RouteCounts:
    """One MoE layer's route counts of one microbatch once exchanged, nothing read on the host yet
    (:func:`exchange_route_counts`; :func:`read_route` makes the plan).

    Attributes:
        counts: int64 ``[E]`` this rank's kept routes per global expert.
        recv_counts: int64 ``[ep, E_l]`` received from the group (None without EP).
        capacity: 0-d int64 capacity, agreed over the group (this rank's own without EP).
    """

    counts: torch.Tensor
    recv_counts: torch.Tensor | None
    capacity: torch.Tensor


@dataclass(frozen=True, eq=False)
class ExpertRoute:
    """How one microbatch's rows of one MoE layer travel, with or without EP (:func:`plan_route`).

    Attributes:
        plan: the all-to-all plan of :func:`plan_a2a` (None without EP: the rows stay local).
        counts: rows per local expert (what the expert task splits by; ``[E]`` without EP).
        capacity: capacity agreed over the group (this rank's own without EP).
        num_send: rows this rank sends (its kept routes: the rows dispatch gathers).
    """

    plan: A2APlan | None
    counts: tuple[int, ...]
    capacity: int
    num_send: int


def exchange_route_counts(counts: torch.Tensor, capacity, group, counts_group=None) -> RouteCounts:
    """The device half of :func:`plan_route`: exchange the counts and the capacity on the counts
    group (:func:`exchange_counts`; nothing without EP). No host read: callers issue it as soon as
    the router output exists and read it (:func:`read_route`) where the rows are needed.

    Args:
        counts: int64 ``[E]`` rows per global expert (this rank's kept routes).
        capacity: this rank's capacity (int or 0-d integer tensor).
        group: the EP process group (None or size 1: no EP).
        counts_group: the group the counts travel on (same ranks as ``group``; None: ``group``).

    Raises:
        ValueError: as :func:`exchange_counts`.
    """
    counts = counts.to(torch.int64).reshape(-1)
    if ep_size(group) == 1:
        return RouteCounts(counts, None, _capacity_tensor(capacity, counts.device))
    recv_counts, agreed = exchange_counts(counts, capacity, group if counts_group is None else counts_group)
    return RouteCounts(counts, recv_counts, agreed)


def read_route(exchanged: RouteCounts, syncs: HostSyncs | None = None) -> ExpertRoute:
    """The host half of :func:`plan_route`: one host read of everything the host needs (counted
    on ``syncs``), then the regroup permutation on the device (:func:`regroup_permutation`)."""
    if exchanged.recv_counts is None:
        host = torch.cat([exchanged.counts, exchanged.capacity.reshape(1)]).tolist()
        count(syncs)
        return ExpertRoute(None, tuple(host[:-1]), host[-1], sum(host[:-1]))
    plan = _a2a_plan(exchanged.counts, exchanged.recv_counts, exchanged.capacity, syncs)
    return ExpertRoute(plan, plan.local_counts, plan.capacity, plan.num_send)


def plan_route(counts: torch.Tensor, capacity, group, counts_group=None, syncs: HostSyncs | None = None) -> ExpertRoute:
    """Exchange the route counts over the counts group (a small blocking all-to-all; default the
    EP group ``group``) and derive the splits; without EP (``group`` None or of size 1) the route
    is local. One host read either way (module docstring), counted on ``syncs``:
    ``read_route(exchange_route_counts(...), syncs)``.

    Args:
        counts: int64 ``[E]`` rows per global expert (this rank's kept routes).
        capacity: this rank's capacity (int or 0-d integer tensor).
        group, counts_group, syncs: as :func:`plan_a2a`.

    Raises:
        ValueError: as :func:`exchange_counts`.
    """
    return read_route(exchange_route_counts(counts, capacity, group, counts_group), syncs)


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
    ``async_op``; the buffer is valid once ``work.wait()`` returned). The all-to-all writes every
    row of the buffer, so it is allocated without deterministic mode's fill
    (:func:`~tessera.model.determinism.empty_overwritten`)."""
    x = x.contiguous()
    out = empty_overwritten((sum(recv_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)  # written whole
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
