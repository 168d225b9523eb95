"""Process-group layout of a training run and the gradient reduction over it.

Ranks (tp = 1): ``world = pp * dp`` global ranks. Pipeline rank ``p`` of replica ``d`` sits at
slot ``tessera.spec.placement.world_rank(order, pp, dp, 1, p, d)`` (``order``: the run's concrete
``parallel.rank_order``; ``pp-ep-dp``: slot ``d * pp + p``, ``ep-dp-pp``: slot ``p * dp + d``), and
slot ``s`` is global rank ``base + s``, or ``ranks[s]`` where the job maps slots to the ranks its
launcher gave each node (:class:`Layout` ``ranks``). The cost model prices the groups below on the
same placement (:func:`tessera.spec.placement.place`). Groups:

* **pipeline** ``d``: the ``pp`` ranks of replica ``d`` (activations and gradients travel here);
* **EP** ``(p, g)``: pipeline rank ``p`` of the ``ep`` consecutive replicas ``g*ep .. g*ep+ep-1``
  (the routed experts of a layer are spread over them; EP rank = ``d % ep``, which is the rank's
  place in the group: a group's global ranks ascend with ``d``, :class:`Layout` checks it);
* **EP counts** ``(p, g)``: the same ranks as EP group ``(p, g)``, in the same order, on a
  communicator of their own: the MoE layers' route counts (:mod:`tessera.model.ep.plan`) and the
  bubble optimizer's live counts travel here, so they never queue behind a row all-to-all of the
  EP group (NCCL runs one communicator's operations in issue order);
* **dense DP** ``p``: pipeline rank ``p`` of every replica (gradients of non-expert parameters);
* **expert DP** ``(p, j)``: pipeline rank ``p`` of the replicas at EP position ``j``
  (``d % ep == j``): the ranks holding the same experts (gradients of expert parameters).

:func:`make_groups` creates every group of the layout in one fixed order on every rank of the
default group (``torch.distributed.new_group`` is collective), so all ranks must call it, also
ranks outside the layout. Groups of one rank are not created (``None``: nothing to communicate).

Timeouts: every group gets the job's timeout (``make_groups(timeout=...)``, the recipe's
``job.pg_timeout_s`` on a Ray Train worker; default: the default group's own), and its name as
torch's ``group_desc`` (NCCL's watchdog logs name it). A wait that exceeds it fails, on gloo, in
the engine step that waited; :func:`comm_timeout` turns that error into one line naming the
group (:class:`CommTimeout`, raised by ``Engine.advance`` with the rank and instruction).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Sequence

import torch
import torch.distributed as dist

from tessera.engine.values import EngineError
from tessera.errors import TesseraConfigError
from tessera.spec.placement import RANK_ORDERS, position, world_rank


@dataclass(frozen=True)
class Layout:
    """Shape of a run: ``pp`` pipeline ranks x ``dp`` replicas, EP groups of ``ep`` replicas, placed
    on global ranks by ``order`` (a concrete :data:`tessera.spec.placement.RANK_ORDERS` entry) from
    ``base``, or through ``ranks`` (slot -> global rank, module docstring; empty: ``base + slot``).

    Raises:
        TesseraConfigError: a size < 1, ``ep`` does not divide ``dp``, an unknown order, ``ranks``
            not ``pp*dp`` distinct ranks >= 0, or ranks under which a group's global ranks do not
            ascend with the replica index (torch numbers a group's members by global rank, and the
            EP rank and the ordered gradient sums take that number).
    """

    pp: int
    dp: int
    ep: int = 1
    base: int = 0
    order: str = "pp-ep-dp"
    ranks: tuple[int, ...] = ()

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
        if self.order not in RANK_ORDERS:
            raise TesseraConfigError("parallel.rank_order", self.order, f"must be one of {', '.join(RANK_ORDERS)} "
                                     "(resolved; auto is resolved by tessera.spec.placement.resolve_order)",
                                     "resolve the order before building the layout")
        if self.ranks:
            object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
            if len(self.ranks) != self.world_size or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
                raise TesseraConfigError("layout.ranks", self.ranks, f"must be {self.world_size} distinct ranks >= 0 "
                                         "(one per slot)", "map every slot of the layout to its own global rank")
            for name, members in _all_group_ranks(self):
                if list(members) != sorted(members):
                    raise TesseraConfigError("layout.ranks", self.ranks, f"puts {name} group {members} out of "
                                             "ascending rank order", "map slots to ranks so that every node's "
                                             "ranks ascend with the slots (the driver's node map does)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @cached_property
    def _slot_of(self) -> dict[int, int]:
        return {r: s for s, r in enumerate(self.ranks)}

    def _slot(self, rank: int) -> int:
        return self._slot_of.get(rank, -1) if self.ranks else rank - self.base

    def contains(self, rank: int) -> bool:
        return 0 <= self._slot(rank) < self.world_size

    def pipeline_rank(self, rank: int) -> int:
        return position(self.order, self.pp, self.dp, 1, self._slot(rank))[0]

    def replica(self, rank: int) -> int:
        return position(self.order, self.pp, self.dp, 1, self._slot(rank))[1]

    def position(self, rank: int) -> int:
        """``replica * pp + pipeline_rank`` of global rank ``rank``: the number of its part of a
        checkpoint and its Program with the driver, the same under every rank order and map."""
        p, d = position(self.order, self.pp, self.dp, 1, self._slot(rank))
        return d * self.pp + p

    def global_rank(self, pipeline_rank: int, replica: int) -> int:
        slot = world_rank(self.order, self.pp, self.dp, 1, pipeline_rank, replica)
        return self.ranks[slot] if self.ranks else self.base + slot

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
        ep_counts: the EP counts group (module docstring; None where ``ep`` is None, and in a
            :class:`RankGroups` built without it: users then take ``ep``).
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
    ep_counts: object | None = None

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
    out += [("ep_counts", ranks) for name, ranks in out if name == "ep"]
    out += [("dense_dp", layout.dense_dp_ranks(p)) for p in range(layout.pp)]
    out += [("expert_dp", layout.expert_dp_ranks(p, j)) for p in range(layout.pp) for j in range(layout.ep)]
    return out


def make_groups(layout: Layout, timeout: datetime.timedelta | float | None = None) -> RankGroups | None:
    """Create the process groups of ``layout`` (collective over the default group).

    Args:
        layout: the run's layout.
        timeout: how long a wait on any of the groups may take before it fails (a
            ``datetime.timedelta`` or seconds); None: the default group's own timeout
            (:func:`default_group_timeout`), so groups made under
            :func:`tessera.testing.launch_local.run_local` get its ``timeout_s``.

    Returns this rank's :class:`RankGroups`, or ``None`` when the rank is outside the layout.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: ``timeout`` is not a positive, finite duration.
        TesseraConfigError: the layout needs more ranks than the world has.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_groups needs torch.distributed.init_process_group first")
    timeout = default_group_timeout() if timeout is None else as_timeout(timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.base + layout.world_size > world:
        raise TesseraConfigError("layout", layout, f"needs ranks {layout.base}..{layout.base + layout.world_size - 1}; "
                                 f"the world has {world}", "launch pp*dp ranks")
    mine: dict[str, object] = {}
    # NCCL: each group's communicator created now, in this order on every rank (device_id: eager
    # init), not lazily by its first operation, where a lone p2p op would get a private
    # communicator of its two ranks and the first batched op must include every rank
    # (NCCL-RULES.md rule 2; torch docs of init_process_group / new_group, device_id)
    device_id = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for name, ranks in _all_group_ranks(layout):
        if len(ranks) == 1:
            continue
        group = dist.new_group(list(ranks), timeout=timeout, group_desc=name, device_id=device_id)
        if rank in ranks:
            mine[name] = group
    host = dist.new_group(backend="gloo", timeout=timeout, group_desc="host") \
        if dist.get_backend() != "gloo" else None  # every rank: a collective
    if not layout.contains(rank):
        return None
    return RankGroups(layout, rank, mine.get("pipeline"), mine.get("ep"), mine.get("dense_dp"), mine.get("expert_dp"),
                      host, mine.get("ep_counts"))


def agree_shape(groups: RankGroups, mbs: int, seq: int, device) -> None:
    """Agree the batch shape ``(micro_batch_size, seq_length)`` over the pipeline group (one
    ``all_reduce(MAX)`` of ``[mbs, seq, -mbs, -seq]``; nothing without a pipeline group).

    Raises:
        EngineError: another pipeline rank has another shape (both ranges named).
        CommTimeout: the pipeline group's timeout passed (a peer never joined).
    """
    g = groups.pipeline
    if g is None:
        return
    t = torch.tensor([mbs, seq, -mbs, -seq], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    except RuntimeError as e:
        what = comm_timeout(e, groups)
        if what is None:
            raise
        raise CommTimeout(f"rank {groups.rank}, iteration start (batch shape): {what}") from e
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


# --- timeouts ----------------------------------------------------------------------------------
TORCH_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""torch's default process-group timeout for gloo (``torch.distributed.constants.default_pg_timeout``;
NCCL's is 10 minutes, ``default_pg_nccl_timeout``): what :func:`default_group_timeout` falls back
to when torch does not expose the default group's own timeout."""


def as_timeout(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """``timeout`` (a ``timedelta`` or seconds) as a ``timedelta``.

    Raises:
        ValueError: not a positive, finite duration.
    """
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"process-group timeout {timeout!r}: must be a datetime.timedelta or seconds")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"process-group timeout {timeout!r}: must be a positive, finite number of seconds")
    return datetime.timedelta(seconds=seconds)


def group_timeout(group) -> datetime.timedelta | None:
    """The timeout ``group`` (a process group; None: the default group) was created with, as its
    backends report it (gloo and NCCL both do); None when torch does not expose it."""
    pg = dist.group.WORLD if group is None else group
    for device in getattr(pg, "_device_types", ()):
        try:
            t = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(t, datetime.timedelta):
            return t
    return None


def default_group_timeout() -> datetime.timedelta:
    """The default group's own timeout (what ``init_process_group(timeout=...)`` got: Ray Train's
    ``TorchConfig(timeout_s)``, ``run_local``'s ``timeout_s``); where torch does not expose it,
    torch's default for the default group's backend (NCCL 10 min, others 30 min:
    ``torch.distributed.constants``, :data:`TORCH_DEFAULT_TIMEOUT`).

    Raises:
        RuntimeError: the default process group is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("default_group_timeout needs torch.distributed.init_process_group first")
    t = group_timeout(None)
    if t is not None:
        return t
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if dist.get_backend() == "nccl" and isinstance(nccl, datetime.timedelta):
        return nccl
    return getattr(constants, "default_pg_timeout", TORCH_DEFAULT_TIMEOUT)


class CommTimeout(EngineError):
    """A wait on a process group outlived the group's timeout: a peer never sent, never joined a
    collective, or hangs. One line: ``rank R, instruction I <instr>: <what> on the <name> group
    (ranks ...) timed out after S s``. Not bad input: a restartable failure (Ray Train restarts the
    worker group from the newest checkpoint under ``job.max_failures``)."""


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_GLOO_MS = re.compile(r"waiting (\d+)\s*ms", re.IGNORECASE)
_GLOO_OP = re.compile(r"for (\w+) operation", re.IGNORECASE)


def group_name(groups: RankGroups | None, group) -> str:
    """The name of process group ``group`` for this rank: the :class:`RankGroups` field holding
    it (``pipeline``, ``ep``, ``dense_dp``, ``expert_dp``, ``host``, and any group field added
    later), ``default`` for the default group, else the group's ``group_desc``, else ``unnamed``."""
    if groups is not None:
        for f in fields(groups):
            if f.name not in ("layout", "rank") and getattr(groups, f.name) is group:
                return f.name
    if group is dist.group.WORLD:
        return "default"
    desc = getattr(group, "group_desc", None)
    return desc if desc and desc != "undefined" else "unnamed"


def _is_group(value) -> bool:
    return isinstance(value, dist.ProcessGroup)


def _groups_near(value) -> list:
    """Process groups held by ``value``, an object of a Tessera class, in one of its attributes
    (not :class:`RankGroups`, which holds all of them and so says nothing about which one waited)."""
    if isinstance(value, RankGroups) or not type(value).__module__.startswith("tessera."):
        return []
    try:
        attrs = list(vars(value).values())
    except TypeError:  # no __dict__: __slots__ only
        attrs = [getattr(value, n, None) for n in getattr(type(value), "__slots__", ())]
    return [a for a in attrs if _is_group(a)]


def waiting_group(error: BaseException) -> tuple[list, str | None]:
    """The process group(s) a failed wait was on, from ``error``'s traceback, and the
    ``torch.distributed`` call that failed (None: a wait on an asynchronous operation).

    Innermost frame first: a ``torch.distributed`` function's ``group`` argument (None there is
    the default group), a process group in a frame's local variables, or one held by a local
    Tessera object (one attribute level: the ``PipeComm`` or chunk that owns the operation). When no
    frame references a group, the operation was issued without ``group=``, which torch runs on
    the default group. Whoever waits keeps its group reachable this way so a timeout names it.
    """
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        local = frame.f_locals
        if frame.f_globals.get("__name__", "").startswith("torch.distributed") and "group" in local:
            g = local["group"]
            return [dist.group.WORLD if g is None else g], frame.f_code.co_name
        found = [v for v in local.values() if _is_group(v)]
        if not found:
            found = [g for v in local.values() for g in _groups_near(v)]
        if found:
            unique = []
            for g in found:
                if all(g is not u for u in unique):
                    unique.append(g)
            return unique, None
    return [dist.group.WORLD], None


def comm_timeout(error: BaseException, groups: RankGroups | None) -> str | None:
    """``"<what> on the <name> group (ranks ...) timed out after S s"`` when ``error`` is a
    communication timeout (a ``RuntimeError`` from ``torch.distributed`` or a gloo wait saying it
    timed out), else None. The group is :func:`waiting_group`'s, named by :func:`group_name`;
    ``S`` is the timeout the error reports (gloo: ``Timed out waiting <ms>ms``), else the group's
    (:func:`group_timeout`)."""
    if not isinstance(error, RuntimeError) or isinstance(error, EngineError):
        return None
    text = str(error)
    if not _TIMED_OUT.search(text):
        return None
    found, call = waiting_group(error)
    names = " or ".join(group_name(groups, g) for g in found)
    ranks = sorted({r for g in found for r in _ranks(g)})
    if call is None:
        op = _GLOO_OP.search(text)
        call = f"a {op.group(1)}" if op else "a wait"
    ms = _GLOO_MS.search(text)
    if ms is not None:
        seconds = int(ms.group(1)) / 1000
    else:
        t = group_timeout(found[0])
        seconds = t.total_seconds() if t is not None else None
    after = f" after {seconds:g} s" if seconds is not None else ""
    return f"{call} on the {names} group (ranks {', '.join(map(str, ranks))}) timed out{after}"


def _ranks(group) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return []
