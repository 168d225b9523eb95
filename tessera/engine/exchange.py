"""Expert-parallel row exchange run by the engine itself: asynchronous all-to-alls, no autograd.

The model's :mod:`tessera.model.ep` wraps the all-to-all in autograd (synchronous, backward =
reverse all-to-all). The engine cuts every MoE layer at the all-to-alls instead (each task has
detached inputs), so it moves rows and their gradients explicitly and can overlap them:
``torch.distributed.all_to_all_single(..., async_op=True)`` is issued in the dispatch / combine
task and waited by the first task that needs the rows.

Row orders are those of :mod:`tessera.model.ep`: a rank sends its rows sorted by (global expert,
token); the owner of experts ``[r*E_l, (r+1)*E_l)`` regroups what it receives (source-major) to
expert-major order, each local expert seeing source rank 0's rows, then rank 1's, ...
:func:`stack_rows` / :func:`unstack_rows` build the same expert-major buffer in one process from
the rows of every member of an EP group (what the single-process reference does).

All moves are permutations or copies, so they are exact; only their forms differ (forward:
``index_select(regroup)``, gradient: ``index_select(inverse)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tessera.model.ep import A2APlan, ep_size, plan_a2a


class InFlight:
    """A started all-to-all (or a local hand-over when ``work`` is None); :meth:`result` waits once.

    ``wait_ms`` is the time spent blocked in :meth:`result` (0 for local or finished transfers).
    """

    __slots__ = ("_work", "_out", "wait_ms")

    def __init__(self, out: torch.Tensor, work=None) -> None:
        self._out, self._work, self.wait_ms = out, work, 0.0

    def result(self) -> torch.Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            self.wait_ms = (time.perf_counter() - t0) * 1e3
            self._work = None
        return self._out


def start_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group) -> InFlight:
    """Issue a variable-split ``all_to_all_single`` of rows ``x [sum(send_splits), ...]``
    asynchronously; the result has ``sum(recv_splits)`` rows. ``group`` of size 1 / None: ``x``."""
    if ep_size(group) == 1:
        return InFlight(x)
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                                  group=group, async_op=True)
    return InFlight(out, work)


@dataclass(frozen=True, eq=False)
class ExpertRoute:
    """How one microbatch's rows of one MoE layer travel (forward and backward).

    Attributes:
        plan: the all-to-all plan of :func:`tessera.model.ep.plan_a2a` (None without EP).
        inverse: inverse of ``plan.regroup`` (expert-major row -> source-major position).
        counts: rows per local expert (what the expert task splits by).
        capacity: capacity agreed over the group.
    """

    plan: A2APlan | None
    inverse: torch.Tensor | None
    counts: tuple[int, ...]
    capacity: int


def plan_route(counts: torch.Tensor, capacity: int, group) -> ExpertRoute:
    """Exchange the route counts over the EP group (a small blocking all-to-all) and derive the
    splits; without EP the route is local. ``counts``: int64 ``[E]`` rows per global expert."""
    if ep_size(group) == 1:
        return ExpertRoute(None, None, tuple(int(c) for c in counts.tolist()), int(capacity))
    plan = plan_a2a(counts, capacity, group)
    inverse = torch.empty_like(plan.regroup)
    inverse[plan.regroup] = torch.arange(plan.regroup.numel(), device=plan.regroup.device)
    return ExpertRoute(plan, inverse, plan.local_counts, plan.capacity)


def start_dispatch(rows: torch.Tensor, route: ExpertRoute, group) -> InFlight:
    """Send rows ``[N_send, H]`` (send order) to the expert owners; ``result()`` is the received,
    still source-major buffer (see :func:`expert_major`)."""
    if route.plan is None:
        return InFlight(rows)
    return start_all_to_all(rows, route.plan.send_splits, route.plan.recv_splits, group)


def expert_major(received: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
    """Source-major rows (as received) -> expert-major rows (expert input order)."""
    return received if route.plan is None else received.index_select(0, route.plan.regroup)


def start_combine(y: torch.Tensor, route: ExpertRoute, group) -> InFlight:
    """Expert outputs ``[N_recv, H]`` (expert-major) back to their sources; ``result()`` is
    ``[N_send, H]`` in the source's send order. Also the backward of dispatch (gradients of the
    expert inputs back to the rows' sources)."""
    if route.plan is None:
        return InFlight(y)
    return start_all_to_all(y.index_select(0, route.inverse), route.plan.recv_splits, route.plan.send_splits, group)


def start_combine_grad(g_rows: torch.Tensor, route: ExpertRoute, group) -> InFlight:
    """Backward of combine: gradients of the returned rows ``[N_send, H]`` to the expert owners;
    ``result()`` is source-major (apply :func:`expert_major`)."""
    return start_dispatch(g_rows, route, group)


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
