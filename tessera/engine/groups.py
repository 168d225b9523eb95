"""Process-group layout of a training run and the gradient reduction over it.

Ranks (tp = 1): ``world = pp * dp`` consecutive global ranks starting at ``base`` (normally 0).
Pipeline rank ``p = (rank - base) % pp``, replica ``d = (rank - base) // pp``. Groups:

* **pipeline** ``d``: the ``pp`` ranks of replica ``d`` (activations and gradients travel here);
* **EP** ``(p, g)``: pipeline rank ``p`` of the ``ep`` consecutive replicas ``g*ep .. g*ep+ep-1``
  (the routed experts of a layer are spread over them; EP rank = ``d % ep``);
* **dense DP** ``p``: pipeline rank ``p`` of every replica (gradients of non-expert parameters);
* **expert DP** ``(p, j)``: pipeline rank ``p`` of the replicas at EP position ``j``
  (``d % ep == j``): the ranks holding the same experts (gradients of expert parameters).

:func:`make_groups` creates every group of the layout in one fixed order on every rank of the
default group (``torch.distributed.new_group`` is collective), so all ranks must call it, also
ranks outside the layout. Groups of one rank are not created (``None``: nothing to communicate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tessera.engine.values import EngineError
from tessera.errors import TesseraConfigError


@dataclass(frozen=True)
class Layout:
    """Shape of a run: ``pp`` pipeline ranks x ``dp`` replicas, EP groups of ``ep`` replicas.

    Raises:
        TesseraConfigError: a size < 1, or ``ep`` does not divide ``dp``.
    """

    pp: int
    dp: int
    ep: int = 1
    base: int = 0

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise TesseraConfigError(f"parallel.{name}", v, "must be a positive integer",
                                         f"set parallel.{name} >= 1")
        if self.dp % self.ep:
            raise TesseraConfigError("parallel.ep", self.ep, f"must divide dp={self.dp} (EP groups are carved from "
                                     "the data-parallel replicas)", "choose ep among the divisors of dp")
        if self.base < 0:
            raise TesseraConfigError("layout.base", self.base, "must be >= 0", "use base=0")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def contains(self, rank: int) -> bool:
        return self.base <= rank < self.base + self.world_size

    def pipeline_rank(self, rank: int) -> int:
        return (rank - self.base) % self.pp

    def replica(self, rank: int) -> int:
        return (rank - self.base) // self.pp

    def global_rank(self, pipeline_rank: int, replica: int) -> int:
        return self.base + replica * self.pp + pipeline_rank

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """Global ranks of replica ``replica``'s pipeline, in pipeline order."""
        return tuple(self.global_rank(p, replica) for p in range(self.pp))

    def ep_ranks(self, pipeline_rank: int, replica: int) -> tuple[int, ...]:
        """Global ranks of the EP group holding ``(pipeline_rank, replica)``, in EP-rank order."""
        g = replica // self.ep
        return tuple(self.global_rank(pipeline_rank, d) for d in range(g * self.ep, (g + 1) * self.ep))

    def dense_dp_ranks(self, pipeline_rank: int) -> tuple[int, ...]:
        return tuple(self.global_rank(pipeline_rank, d) for d in range(self.dp))

    def expert_dp_ranks(self, pipeline_rank: int, replica: int) -> tuple[int, ...]:
        j = replica % self.ep
        return tuple(self.global_rank(pipeline_rank, d) for d in range(j, self.dp, self.ep))


@dataclass(frozen=True, eq=False)
class RankGroups:
    """The groups one rank belongs to (``None`` for groups of size one).

    Attributes:
        layout: the run's layout.
        rank: this process's global rank.
        pipeline, ep, dense_dp, expert_dp: ``torch.distributed`` process groups.
        host: a gloo group over the whole world for host-side values (metrics, plan-switch
            announcements, object collectives) when the default backend is not gloo (NCCL works
            on device tensors only); None: the default group serves them.
    """

    layout: Layout
    rank: int
    pipeline: object | None
    ep: object | None
    dense_dp: object | None
    expert_dp: object | None
    host: object | None = None

    @property
    def pipeline_rank(self) -> int:
        return self.layout.pipeline_rank(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.replica % self.layout.ep

    def peer(self, pipeline_rank: int) -> int:
        """Global rank of pipeline rank ``pipeline_rank`` in this rank's replica."""
        return self.layout.global_rank(pipeline_rank, self.replica)


def _all_group_ranks(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    """Every group of the layout, in the creation order all ranks share."""
    out = [("pipeline", layout.pipeline_ranks(d)) for d in range(layout.dp)]
    out += [("ep", layout.ep_ranks(p, g * layout.ep)) for p in range(layout.pp) for g in range(layout.dp // layout.ep)]
    out += [("dense_dp", layout.dense_dp_ranks(p)) for p in range(layout.pp)]
    out += [("expert_dp", layout.expert_dp_ranks(p, j)) for p in range(layout.pp) for j in range(layout.ep)]
    return out


def make_groups(layout: Layout) -> RankGroups | None:
    """Create the process groups of ``layout`` (collective over the default group).

    Returns this rank's :class:`RankGroups`, or ``None`` when the rank is outside the layout.

    Raises:
        RuntimeError: the default process group is not initialised.
        TesseraConfigError: the layout needs more ranks than the world has.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_groups needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.base + layout.world_size > world:
        raise TesseraConfigError("layout", layout, f"needs ranks {layout.base}..{layout.base + layout.world_size - 1}; "
                                 f"the world has {world}", "launch pp*dp ranks")
    mine: dict[str, object] = {}
    for name, ranks in _all_group_ranks(layout):
        if len(ranks) == 1:
            continue
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine[name] = group
    host = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None  # every rank: a collective
    if not layout.contains(rank):
        return None
    return RankGroups(layout, rank, mine.get("pipeline"), mine.get("ep"), mine.get("dense_dp"), mine.get("expert_dp"),
                      host)


def agree_shape(groups: RankGroups, mbs: int, seq: int, device) -> None:
    """Agree the batch shape ``(micro_batch_size, seq_length)`` over the pipeline group (one
    ``all_reduce(MAX)`` of ``[mbs, seq, -mbs, -seq]``; nothing without a pipeline group).

    Raises:
        EngineError: another pipeline rank has another shape (both ranges named).
    """
    g = groups.pipeline
    if g is None:
        return
    t = torch.tensor([mbs, seq, -mbs, -seq], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    hi_mbs, hi_seq, lo_mbs, lo_seq = t.tolist()
    if (hi_mbs, hi_seq, -lo_mbs, -lo_seq) != (mbs, seq, mbs, seq):
        raise EngineError(f"rank {groups.rank}: batch shape (micro_batch_size={mbs}, seq_length={seq}) "
                          f"differs across the pipeline (micro_batch_size {-lo_mbs}..{hi_mbs}, "
                          f"seq_length {-lo_seq}..{hi_seq})")


def reduce_gradients(params: Sequence[torch.nn.Parameter], group, scale: float, ordered: bool = False) -> None:
    """Sum the gradients of ``params`` over ``group``, then multiply by ``scale`` (in place).

    A missing gradient counts as zeros (and is created), so every rank takes part with the same
    buffer. All gradients travel in one flat buffer per dtype. ``ordered=False`` uses
    ``all_reduce``; with two ranks that is bitwise ``g0 + g1``. ``ordered=True`` all-gathers and
    sums in group-rank order (``((g0 + g1) + g2) + ...``): bitwise reproducible for any size, at
    ``size`` times the memory. ``group=None``: only the scaling.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:  # nothing to sum: scale in place (the same elementwise product as on the flat buffer)
        if scale != 1.0:
            for ps in by_dtype.values():
                torch._foreach_mul_([p.grad for p in ps], scale)
        return
    for ps in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        if size > 1 and ordered and size > 2:
            parts = [torch.empty_like(flat) for _ in range(size)]
            dist.all_gather(parts, flat, group=group)
            flat = parts[0]
            for part in parts[1:]:
                flat = flat + part
        elif size > 1:
            dist.all_reduce(flat, group=group)
        flat.mul_(scale)
        offset = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
