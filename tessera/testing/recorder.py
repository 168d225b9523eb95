"""A recorder of the real ``torch.distributed`` calls of one process, and the communication rules
NCCL imposes (issue 31) checked over the records of every rank.

Gloo forgives what NCCL does not (a lone ``isend`` matched by a batched ``irecv``, p2p on the
default group, collectives of one group issued in different orders): a run on gloo passes while
the same run on NCCL would hang. The recorder makes those rules checkable on CPU.

**Recording.** :class:`CommRecorder` (a context manager, or :meth:`~CommRecorder.install` /
:meth:`~CommRecorder.uninstall`) replaces the functions of :data:`WRAPPED` in the
``torch.distributed`` module, and in ``torch.distributed.distributed_c10d`` where they come from,
by wrappers that append a :class:`CommRecord` and call the original with the same arguments,
returning its value (or raising its exception): behaviour is unchanged. Code must call them
through the module (``dist.isend``, as Tessera does), not through a name imported before the
install. A call made while another recorded call runs on the same thread is not recorded:
``batch_isend_irecv`` calls ``isend`` / ``irecv`` per operation on gloo, ``all_gather_object``
calls ``all_gather``, ``broadcast_object_list`` calls ``broadcast``; each is recorded once, as
the outer call. One recorder can be installed per process at a time. Install it after the
``P2POp`` objects of earlier calls are gone and before any new one is built (a ``P2POp`` holds
the ``isend`` / ``irecv`` it was built with; ``batch_isend_irecv`` tells sends from receives by
identity with the module's current ``isend``).

Each record holds: a sequence number (per recorder, in issue order), the calling rank, the kind
(:data:`P2P_BATCH`: one ``batch_isend_irecv``; :data:`P2P`: a lone ``isend`` / ``irecv`` /
``send`` / ``recv``; :data:`COLLECTIVE`: everything else, ``new_group`` included: it is
collective over the default group, or over the new group's members with
``use_local_synchronization``, and is recorded on that group), the function's name, the process
group as its global ranks in group order (``"WORLD"`` for the default group or ``None``) and its
torch name (``group_name``), for p2p each operation's direction, peer (global rank; None for a
receive from any source), shape, dtype and tag, for a collective the shape and dtype of the
tensor it contributes and the arguments every member must agree on (reduce op, root, ranks of a
new group), and the current CUDA stream of the call's tensors (``(device index, stream id)``;
None on CPU).

**Rules** (functions over the records of every rank, ``records[rank]`` = that rank's records
in issue order; each returns a list of :class:`Violation`, empty when the rule holds). A process
group is its ranks and its name: two groups of the same ranks are two communicators, each with
its own order (torch names groups in creation order, the same on every rank).

* :func:`check_p2p_batched` (a): every p2p operation is posted by ``batch_isend_irecv``
  (no lone ``isend`` / ``irecv`` / ``send`` / ``recv``), and no p2p runs on the default group.
* :func:`check_link_batches` (b): for each process group and each link (pair of ranks), each
  end's p2p calls on that group are projected onto the link (the operations with the other end,
  in order; calls with none are dropped); the k-th projection of one end and the k-th of the
  other hold matching operations: the sends of one, in order, are the receives of the other
  with the same shapes and dtypes, and both ends have the same number of projections.
* :func:`check_collective_order` (c): per process group, every member issued the same sequence
  of collectives (:attr:`CommRecord.signature`: name, shape, dtype and agreed arguments;
  all-to-alls with split sizes compare the trailing dimensions only, their first one varies by
  rank).

:func:`check_all` runs the three; :func:`format_violations` makes an assertion message.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

P2P_BATCH, P2P, COLLECTIVE = "p2p_batch", "p2p", "collective"
WORLD = "WORLD"
SEND, RECV = "send", "recv"

P2P_FUNCS = ("isend", "irecv", "send", "recv")
COLLECTIVE_FUNCS = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
                    "all_gather_single", "reduce_scatter_tensor", "reduce_scatter", "broadcast", "reduce", "gather",
                    "scatter", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
                    "gather_object", "scatter_object_list", "new_group")
WRAPPED = ("batch_isend_irecv",) + P2P_FUNCS + COLLECTIVE_FUNCS
"""The ``torch.distributed`` functions the recorder wraps (those this torch lacks are skipped)."""

@dataclass(frozen=True)
class P2PRecord:
    """One point-to-point operation: ``direction`` (:data:`SEND` / :data:`RECV`), ``peer`` (global
    rank; None: a receive from any source), the tensor's ``shape`` and ``dtype`` (e.g.
    ``"torch.float32"``) and the ``tag``."""

    direction: str
    peer: int | None
    shape: tuple[int, ...]
    dtype: str
    tag: int = 0

    def __str__(self) -> str:
        way = "to" if self.direction == SEND else "from"
        peer = "any rank" if self.peer is None else f"rank {self.peer}"
        return f"{self.direction} {way} {peer} {list(self.shape)} {_short(self.dtype)}"


@dataclass(frozen=True)
class CommRecord:
    """One recorded ``torch.distributed`` call (module docstring).

    Attributes:
        seq: position among this recorder's records (issue order, from 0).
        rank: global rank of the calling process.
        kind: :data:`P2P_BATCH`, :data:`P2P` or :data:`COLLECTIVE`.
        name: the function called (``"batch_isend_irecv"``, ``"isend"``, ``"all_reduce"``...).
        group: the process group's global ranks in group order, or :data:`WORLD` (the default
            group, or ``group=None``).
        ops: the p2p operations (one for a lone call), in the call's order; ``()`` for a collective.
        shape: a collective's contributed tensor shape (an object collective: ``(len(list),)``;
            ``all_to_all`` / ``reduce_scatter`` lists: ``(len(list), *first.shape)``); None for
            ``barrier`` and p2p.
        dtype: that tensor's dtype as text, else None.
        detail: the arguments every member must agree on, as ``(name, value)`` pairs (``op``,
            ``src``, ``dst`` as global ranks, ``ranks`` and ``backend`` of a ``new_group``,
            ``split``: split sizes given).
        uneven: the first dimension of ``shape`` may differ by rank (an all-to-all with split
            sizes, or a list all-to-all): not compared by :func:`check_collective_order`.
        stream: ``(device index, stream id)`` of the current CUDA stream when the call's tensors
            are on CUDA, else None.
        group_name: torch's name of the group (``ProcessGroup.group_name``: the same on every
            member, distinct for two groups of the same ranks); None for :data:`WORLD`.
    """

    seq: int
    rank: int
    kind: str
    name: str
    group: Any
    ops: tuple[P2PRecord, ...] = ()
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    detail: tuple[tuple[str, Any], ...] = ()
    uneven: bool = False
    stream: tuple[int, int] | None = None
    group_name: str | None = None

    @property
    def signature(self) -> tuple:
        """What every member of the group must issue identically: ``(name, shape, dtype,
        detail)``, the shape without its first dimension when :attr:`uneven`."""
        shape = self.shape
        if shape is not None and self.uneven:
            shape = ("*",) + tuple(shape[1:])
        return (self.name, shape, self.dtype, self.detail)

    def describe(self) -> str:
        """One readable line: ``all_reduce [4] int64 op=MAX on group (0, 1) (seq 12)``."""
        if self.kind == COLLECTIVE:
            what = self.name
            if self.shape is not None:
                shape = list(self.shape) if not self.uneven else ["*", *self.shape[1:]]
                what += f" {shape} {_short(self.dtype)}"
            what += "".join(f" {k}={v}" for k, v in self.detail)
        else:
            what = f"{self.name}({', '.join(str(o) for o in self.ops)})"
        return f"{what} on group {_group_text(self.group, self.group_name)} (seq {self.seq})"


@dataclass(frozen=True)
class Violation:
    """A broken rule: ``rule`` (``"unbatched-p2p"``, ``"p2p-on-default-group"``,
    ``"link-batches"``, ``"collective-order"``), the ``rank`` it was found on, the ``group``
    (global ranks or :data:`WORLD`), the ``position`` (index of the offending call among that
    rank's calls the rule looks at: p2p calls; batches of the link; collectives of the group) and
    a readable ``message`` (also ``str(violation)``)."""

    rule: str
    rank: int
    group: Any
    position: int | None
    message: str

    def __str__(self) -> str:
        return self.message


class RecorderError(RuntimeError):
    """A second recorder installed in one process, or an uninstall of one not installed."""


# --------------------------------------------------------------------------- recording

_ACTIVE: "CommRecorder | None" = None
_LOCAL = threading.local()  # .depth: recorded calls running on this thread


class CommRecorder:
    """Records every call of :data:`WRAPPED` made in this process while installed (module
    docstring).

    Use ``with CommRecorder() as rec: ...`` or ``rec.install()`` / ``rec.uninstall()``; read
    :attr:`records` (or :meth:`take` them, which also clears). :attr:`errors` lists calls the
    recorder could not describe (they ran unchanged; a test asserts it is empty).
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.errors: list[str] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Callable]] = []

    # -- install / uninstall
    def install(self) -> "CommRecorder":
        """Wrap the functions of :data:`WRAPPED` in ``torch.distributed`` (and in
        ``distributed_c10d``, which ``batch_isend_irecv`` and ``P2POp`` look them up in).

        Raises:
            RecorderError: a recorder is already installed in this process.
        """
        global _ACTIVE
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if _ACTIVE is not None:
            raise RecorderError("a CommRecorder is already installed in this process; uninstall it first")
        for name in WRAPPED:
            original = getattr(dist, name, None) or getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = _wrap(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapper)
        _ACTIVE = self
        return self

    def uninstall(self) -> None:
        """Put the original functions back.

        Raises:
            RecorderError: this recorder is not the installed one.
        """
        global _ACTIVE
        if _ACTIVE is not self:
            raise RecorderError("this CommRecorder is not installed")
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        _ACTIVE = None

    def __enter__(self) -> "CommRecorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def installed(self) -> bool:
        return _ACTIVE is self

    def take(self) -> list[CommRecord]:
        """The records so far, cleared from the recorder (sequence numbers keep counting)."""
        with self._lock:
            out, self.records = self.records, []
        return out

    def _add(self, make: Callable[[int], CommRecord]) -> None:
        with self._lock:
            self.records.append(make(self._seq))
            self._seq += 1


def _wrap(name: str, original: Callable) -> Callable:
    sig = inspect.signature(original)
    describe = _describe_batch if name == "batch_isend_irecv" else _describe_p2p if name in P2P_FUNCS else \
        _describe_collective

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        rec = _ACTIVE
        depth = getattr(_LOCAL, "depth", 0)
        if rec is not None and depth == 0:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                bound = None  # the original raises its own error
            if bound is not None:
                bound.apply_defaults()
                try:
                    fields = describe(name, bound.arguments)
                    rank = _rank()
                    rec._add(lambda seq: CommRecord(seq, rank, name=name, **fields))
                except Exception as e:  # never change behaviour: note it, run the call
                    rec.errors.append(f"{name}: {type(e).__name__}: {e}")
        _LOCAL.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _LOCAL.depth = depth

    wrapper.__tessera_recorded__ = original
    return wrapper


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else -1


def _is_world(group) -> bool:
    import torch.distributed.distributed_c10d as c10d

    if group is None or group is c10d.GroupMember.WORLD:
        return True
    return c10d.is_initialized() and group is c10d._get_default_group()


def _group_of(group) -> dict:
    """``group`` and ``group_name`` fields of a record of a call on ``group``."""
    import torch.distributed as dist

    if _is_world(group):
        return {"group": WORLD, "group_name": None}
    name = getattr(group, "group_name", None)
    return {"group": tuple(dist.get_process_group_ranks(group)), "group_name": None if name is None else str(name)}


def _global(group, rank: int | None, group_rank: int | None) -> int | None:
    """A peer or root as a global rank: ``rank`` is global already; ``group_rank`` is in ``group``."""
    import torch.distributed as dist

    if rank is not None:
        return int(rank)
    if group_rank is None:
        return None
    return int(group_rank) if _is_world(group) else dist.get_global_rank(group, group_rank)


def _stream(tensor) -> tuple[int, int] | None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        s = torch.cuda.current_stream(tensor.device)
        return (s.device_index, s.stream_id)
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype)


def _short(dtype: str | None) -> str:
    return "" if dtype is None else dtype.replace("torch.", "")


def _group_text(group, name: str | None = None) -> str:
    if group == WORLD:
        return WORLD
    return str(tuple(group)) + ("" if name is None else f" [pg {name}]")


def _describe_batch(name: str, a: dict) -> dict:
    ops = list(a["p2p_op_list"])
    recs = tuple(P2PRecord(SEND if getattr(op.op, "__name__", "") == "isend" else RECV, int(op.peer),
                           tuple(op.tensor.shape), _dtype(op.tensor), int(op.tag or 0)) for op in ops)
    group = ops[0].group if ops else None
    return {"kind": P2P_BATCH, **_group_of(group), "ops": recs,
            "stream": _stream(ops[0].tensor) if ops else None}


def _describe_p2p(name: str, a: dict) -> dict:
    t, group = a["tensor"], a.get("group")
    if name in ("isend", "send"):
        direction, peer = SEND, _global(group, a.get("dst"), a.get("group_dst"))
    else:
        direction, peer = RECV, _global(group, a.get("src"), a.get("group_src"))
    op = P2PRecord(direction, peer, tuple(t.shape), _dtype(t), int(a.get("tag") or 0))
    return {"kind": P2P, **_group_of(group), "ops": (op,), "stream": _stream(t)}


def _op_text(op) -> str:
    return getattr(op, "name", None) or str(op).split(".")[-1]


def _describe_collective(name: str, a: dict) -> dict:
    group = a.get("group")
    tensor, shape, detail, uneven = None, None, [], False
    if name == "new_group":
        ranks = a.get("ranks")
        detail = [("ranks", "all" if ranks is None else tuple(sorted(int(r) for r in ranks))),
                  ("backend", None if a.get("backend") is None else str(a["backend"]))]
        # collective over the default group, or only over its members with use_local_synchronization
        local = bool(a.get("use_local_synchronization")) and ranks is not None
        return {"kind": COLLECTIVE, "group": tuple(sorted(int(r) for r in ranks)) if local else WORLD,
                "detail": tuple(detail)}
    if name == "all_to_all_single":
        tensor = a["input"]
        given = a.get("input_split_sizes") is not None or a.get("output_split_sizes") is not None
        uneven = given
        detail.append(("split", given))
    elif name in ("all_to_all", "reduce_scatter"):
        parts = list(a["input_tensor_list" if name == "all_to_all" else "input_list"])
        tensor = parts[0] if parts else None
        shape = (len(parts), *(tensor.shape if tensor is not None else ()))
        uneven = name == "all_to_all"
    elif name in ("all_gather_into_tensor", "all_gather_single"):
        tensor = a["input_tensor"]
    elif name == "reduce_scatter_tensor":
        tensor = a["input"]
    elif name in ("all_reduce", "all_gather", "broadcast", "reduce", "gather", "scatter"):
        tensor = a["tensor"]
    elif name in ("broadcast_object_list", "all_gather_object"):
        shape = (len(a["object_list"]),)
    elif name == "scatter_object_list":
        shape = (len(a["scatter_object_output_list"]),)
    if name == "all_gather":
        detail.append(("parts", len(a["tensor_list"])))
    if "op" in a and name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"):
        detail.append(("op", _op_text(a["op"])))
    if name in ("broadcast", "scatter", "broadcast_object_list", "scatter_object_list"):
        detail.append(("src", _global(group, a.get("src"), a.get("group_src"))))
    if name in ("reduce", "gather", "gather_object"):
        detail.append(("dst", _global(group, a.get("dst"), a.get("group_dst"))))
    if tensor is not None and shape is None:
        shape = tuple(tensor.shape)
    return {"kind": COLLECTIVE, **_group_of(group), "shape": None if shape is None else tuple(shape),
            "dtype": None if tensor is None else _dtype(tensor), "detail": tuple(detail), "uneven": uneven,
            "stream": _stream(tensor)}


# --------------------------------------------------------------------------- rules

def _by_rank(records) -> dict[int, list[CommRecord]]:
    if isinstance(records, Mapping):
        return {int(r): list(v) for r, v in records.items()}
    return {r: list(v) for r, v in enumerate(records)}


def check_p2p_batched(records) -> list[Violation]:
    """Rule (a): every p2p operation goes through ``batch_isend_irecv`` (NCCL runs a lone
    ``isend`` / ``irecv`` on another communicator than a batched one: the two never match), and
    none runs on the default group (p2p belongs on the replica's pipeline group).

    Args:
        records: ``records[rank]`` (a sequence indexed by global rank, or a mapping), each rank's
            :class:`CommRecord` list in issue order.

    Returns:
        One :class:`Violation` per offending call (``position``: index among that rank's p2p
        calls); a lone call on the default group gives two.
    """
    out = []
    for rank, recs in sorted(_by_rank(records).items()):
        p2p = [r for r in recs if r.kind in (P2P, P2P_BATCH)]
        for i, r in enumerate(p2p):
            if r.kind == P2P:
                out.append(Violation("unbatched-p2p", rank, r.group, i,
                                     f"rank {rank}: p2p call #{i} is a lone {r.describe()}; every p2p operation must "
                                     "be posted by batch_isend_irecv"))
            if r.group == WORLD:
                out.append(Violation("p2p-on-default-group", rank, r.group, i,
                                     f"rank {rank}: p2p call #{i} runs on the default group: {r.describe()}; p2p "
                                     "must run on the replica's pipeline group"))
    return out


def _projections(recs: Sequence[CommRecord]) -> dict[tuple, list[tuple[CommRecord, list[P2PRecord]]]]:
    """(group, group name, peer) -> the rank's p2p calls on that group projected onto its link
    with ``peer``."""
    out: dict[tuple, list[tuple[CommRecord, list[P2PRecord]]]] = {}
    for r in recs:
        if r.kind not in (P2P, P2P_BATCH):
            continue
        by_peer: dict[int, list[P2PRecord]] = {}
        for op in r.ops:
            if op.peer is not None:
                by_peer.setdefault(op.peer, []).append(op)
        for peer, ops in by_peer.items():
            out.setdefault((r.group, r.group_name, peer), []).append((r, ops))
    return out


def _ops_text(ops: Iterable[P2PRecord]) -> str:
    return "{" + ", ".join(f"{o.direction} {list(o.shape)} {_short(o.dtype)}" for o in ops) + "}"


def _mismatch(a_ops: list[P2PRecord], b_ops: list[P2PRecord]) -> str | None:
    """Why two projections of one link do not pair up (None: they do)."""
    for way, back in ((SEND, RECV), (RECV, SEND)):
        mine = [(o.shape, o.dtype) for o in a_ops if o.direction == way]
        theirs = [(o.shape, o.dtype) for o in b_ops if o.direction == back]
        if mine != theirs:
            return f"{len(mine)} {way}(s) on one end against {len(theirs)} {back}(s) on the other" \
                if len(mine) != len(theirs) else f"the {way}s and {back}s differ in shape or dtype"
    return None


def check_link_batches(records) -> list[Violation]:
    """Rule (b): on each link, both ends group the exchange the same way.

    For each process group and each pair of ranks ``a < b``, each end's p2p calls on that group
    (batches, and lone calls as batches of one) are projected onto the link: the operations with
    the other end, in order; calls without any are dropped. The k-th projection of ``a`` and the
    k-th of ``b`` must hold matching operations: ``a``'s sends in order are ``b``'s receives in
    order with equal shapes and dtypes, and ``a``'s receives are ``b``'s sends likewise; both
    ends must have as many projections. A receive from any source (``src=None``) cannot be
    matched and is a violation itself.

    Args:
        records: ``records[rank]``, as :func:`check_p2p_batched`.

    Returns:
        Per link and group, the first batch position that does not match (``position`` = k,
        ``rank`` = the lower rank), with both ends' operations and how many later positions
        differ too, or the count mismatch.
    """
    by_rank = _by_rank(records)
    proj = {rank: _projections(recs) for rank, recs in by_rank.items()}
    out = []
    for rank, recs in sorted(by_rank.items()):
        for r in recs:
            for op in r.ops:
                if r.kind in (P2P, P2P_BATCH) and op.peer is None:
                    out.append(Violation("link-batches", rank, r.group, None,
                                         f"rank {rank}: {r.describe()} receives from any source; a link's operations "
                                         "must name their peer"))
    links = sorted({(g, name, min(rank, peer), max(rank, peer)) for rank, p in proj.items() for (g, name, peer) in p
                    if peer != rank}, key=lambda x: (str(x[0]), str(x[1]), x[2], x[3]))
    for group, name, a, b in links:
        if a not in proj or b not in proj:
            continue  # an end whose records were not given
        pa, pb = proj[a].get((group, name, b), []), proj[b].get((group, name, a), [])
        bad = [k for k in range(min(len(pa), len(pb))) if _mismatch(pa[k][1], pb[k][1])]
        where = f"link {a}-{b} on group {_group_text(group, name)}"
        if bad:
            k = bad[0]
            (ra, oa), (rb, ob) = pa[k], pb[k]
            more = f"; {len(bad) - 1} later batch(es) of the link differ too" if len(bad) > 1 else ""
            out.append(Violation(
                "link-batches", a, group, k,
                f"{where}: batch #{k} does not match ({_mismatch(oa, ob)}): rank {a} posts {_ops_text(oa)} "
                f"in {ra.name} (seq {ra.seq}, {len(ra.ops)} op(s) in all), rank {b} posts {_ops_text(ob)} in "
                f"{rb.name} (seq {rb.seq}, {len(rb.ops)} op(s) in all){more}"))
        if len(pa) != len(pb):
            longer, n_long, n_short = (a, pa, pb) if len(pa) > len(pb) else (b, pb, pa)
            extra_r, extra_ops = n_long[len(n_short)]
            out.append(Violation(
                "link-batches", a, group, len(n_short),
                f"{where}: rank {a} posts {len(pa)} batch(es) on the link, rank {b} {len(pb)}; rank {longer}'s "
                f"batch #{len(n_short)} {_ops_text(extra_ops)} ({extra_r.name}, seq {extra_r.seq}) has no partner"))
    return out


def check_collective_order(records) -> list[Violation]:
    """Rule (c): per process group, every member issues the same sequence of collectives.

    Compared per position: :attr:`CommRecord.signature` (name, shape, dtype and the agreed
    arguments; ``new_group`` counts on the default group). The members of :data:`WORLD` are the
    ranks given; a member whose records were not given is skipped. Each member is compared with
    the lowest member.

    Args:
        records: ``records[rank]``, as :func:`check_p2p_batched`.

    Returns:
        Per group and member, the first position that differs from the lowest member's (or the
        count, when one sequence is a prefix of the other), naming both calls.
    """
    by_rank = _by_rank(records)
    seqs: dict[tuple, dict[int, list[CommRecord]]] = {}
    for rank, recs in by_rank.items():
        for r in recs:
            if r.kind == COLLECTIVE:
                seqs.setdefault((r.group, r.group_name), {}).setdefault(rank, []).append(r)
    out = []
    for key in sorted(seqs, key=str):
        group, name = key
        members = sorted(by_rank) if group == WORLD else sorted(m for m in group if m in by_rank)
        if len(members) < 2:
            continue
        ref = members[0]
        want = seqs[key].get(ref, [])
        for m in members[1:]:
            got = seqs[key].get(m, [])
            diff = next((i for i, (x, y) in enumerate(zip(want, got)) if x.signature != y.signature), None)
            where = f"group {_group_text(group, name)}"
            if diff is not None:
                out.append(Violation(
                    "collective-order", m, group, diff,
                    f"{where}: collective #{diff} differs: rank {ref} issues {want[diff].describe()}, rank {m} "
                    f"issues {got[diff].describe()}"))
            elif len(want) != len(got):
                n = min(len(want), len(got))
                extra = (want if len(want) > n else got)[n]
                out.append(Violation(
                    "collective-order", m, group, n,
                    f"{where}: rank {ref} issues {len(want)} collective(s), rank {m} {len(got)}; the first without a "
                    f"partner is rank {extra.rank}'s #{n}: {extra.describe()}"))
    return out


def check_all(records) -> list[Violation]:
    """:func:`check_p2p_batched`, :func:`check_link_batches` and :func:`check_collective_order`."""
    return check_p2p_batched(records) + check_link_batches(records) + check_collective_order(records)


def format_violations(violations: Sequence[Violation], limit: int = 12, title: str = "") -> str:
    """The violations, one per line (at most ``limit``, then how many more), under ``title``."""
    lines = [f"{title}{': ' if title else ''}{len(violations)} violation(s)"]
    lines += [f"  [{v.rule}] {v.message}" for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"  ... and {len(violations) - limit} more")
    return "\n".join(lines)


__all__ = ["COLLECTIVE", "CommRecord", "CommRecorder", "P2P", "P2PRecord", "P2P_BATCH", "RECV", "RecorderError",
           "SEND", "Violation", "WORLD", "WRAPPED", "check_all", "check_collective_order", "check_link_batches",
           "check_p2p_batched", "format_violations"]
