"""Asynchronous pipeline point-to-point transfers of activations and gradients.

A message is identified as in the Program semantics by ``(kind, mb, sender virtual stage)``:
the ``send_act`` of stage ``s`` matches the ``recv_act`` of stage ``s+1``, the ``send_grad`` of
stage ``s`` the ``recv_grad`` of stage ``s-1``. Every message carries a distinct tag derived
from that identity (:func:`message_tag`); gloo matches by source and tag, but NCCL ignores tags
and matches the messages between two ranks in the order they are posted.

So :class:`PipeComm` posts in Program order per peer. Given ``links`` (peer -> this rank's sends
to and receives from it in instruction order, :func:`tessera.program.link_order.link_ops`), an
operation becomes *due* when the engine asks for it (a receive: posted ahead of its
instruction; a send: its data is ready) and is *posted* only once every earlier operation with
the same peer is posted: receives never overtake receives of the same link, sends never
overtake sends, and neither overtakes an earlier operation in the other direction (NCCL runs the
operations with one peer on one stream, in posting order, so a receive posted before an earlier
send could block that send). Whatever becomes postable at one point (a send together with the
receives held behind it) is posted in one ``torch.distributed.batch_isend_irecv`` (one NCCL
group), so two ranks that send to each other and then receive cannot deadlock; with gloo the
batch is plain ``isend`` / ``irecv`` calls, as before. The validator's first-in-first-out check
(docs/programs.md) makes the two sides' orders agree.

Receives are waited separately from posting: the engine posts them ahead of their instruction
and waits where the data is first used. Sends never block; their buffers stay referenced until
:meth:`PipeComm.finish` (end of the iteration). :attr:`PipeComm.wait_ms` sums the time blocked in
:meth:`~PipeComm.wait_recv` over the iteration: the rank's pipeline idle time (bubble), wherever
the engine waits. It is timed by the engine's timer (:mod:`tessera.engine.timing`): host time on
CPU (a gloo wait blocks the thread), on CUDA the compute stream's time between events recorded
just before and just after the wait (an NCCL wait blocks the stream, not the host). On CUDA the
transfers are issued from a side stream (``stream``, :class:`~tessera.model.streams.CommStream`):
it waits for the compute stream before a batch is posted (the sends' data is ready), and a
receive's buffer reaches the compute stream through an event after its transfer; on CPU nothing
changes. Every message of an iteration has the same shape
``[micro_batch_size, seq_length, hidden]``, agreed at the iteration's start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from tessera.engine.timing import HostTimer, SpanTotal, Timer
from tessera.engine.values import EngineError
from tessera.model.streams import NO_STREAM, CommStream
from tessera.program.instructions import Program
from tessera.program.link_order import link_ops

ACT, GRAD = "act", "grad"

Key = tuple[str, int, int]  # (kind, mb, sender stage)


def message_tag(kind: str, mb: int, sender_stage: int, num_stages: int, num_microbatches: int) -> int:
    """Tag of message ``(kind, mb, sender_stage)``: unique within an iteration, ``>= 0``."""
    return ((0 if kind == ACT else 1) * num_stages + sender_stage) * num_microbatches + mb


def program_links(program: Program) -> dict[int, tuple[tuple[bool, Key], ...]]:
    """Peer -> the Program's sends to and receives from it in instruction order, as
    ``(is_send, (kind, mb, sender_stage))``: the ``links`` (posting order) of :class:`PipeComm`."""
    return {peer: tuple((op.send, (op.kind, op.mb, op.sender_stage)) for op in ops)
            for peer, ops in link_ops(program).items()}


@dataclass(frozen=True)
class MessageShape:
    """Shape, dtype and device of every activation / gradient message of an iteration."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class PipeComm:
    """Point-to-point transfers of one rank with its pipeline neighbours.

    Args:
        global_rank_of: pipeline rank -> global rank (of this rank's replica).
        num_stages, num_microbatches: the Program's shape (for the tags).
        links: pipeline peer -> ``(is_send, (kind, mb, sender_stage))`` of every send to / receive
            from that peer, in Program order (the posting order, module docstring). None: every
            operation is posted as soon as it is due (tag matching only: gloo).
        timer: times the receive waits (:mod:`tessera.engine.timing`; default host time).
        stream: the side stream the transfers are issued from (default none: CPU / gloo).
    """

    def __init__(self, global_rank_of: Callable[[int], int], num_stages: int, num_microbatches: int,
                 links: Mapping[int, Sequence[tuple[bool, Key]]] | None = None, timer: Timer | None = None,
                 stream: CommStream = NO_STREAM) -> None:
        self._peer = global_rank_of
        self._timer, self._stream = HostTimer() if timer is None else timer, stream
        self._wait = SpanTotal(self._timer)
        self._stages, self._mbs = num_stages, num_microbatches
        self._links = None if links is None else {p: tuple(ops) for p, ops in links.items()}
        self._known = None if links is None else {(p, op) for p, ops in self._links.items() for op in ops}
        self._msg: MessageShape | None = None
        self._recvs: dict[Key, tuple[object, torch.Tensor]] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._next: dict[int, int] = {}  # peer -> position of its first operation not yet posted
        self._due_recv: dict[Key, int] = {}  # asked for, held behind an earlier operation: key -> peer
        self._due_send: dict[Key, tuple[int, torch.Tensor]] = {}  # ready, held: key -> (peer, tensor)
        self._batch: list[tuple[int, bool, Key, torch.Tensor | None]] = []  # postable, not posted yet
        self.sends_posted = 0  # isends of the current iteration
        self.batches_posted = 0  # batch_isend_irecv calls (two or more operations) this iteration
        self.post_log: list[tuple[int, tuple[tuple[int, bool, Key], ...]]] = []  # this iteration's posts:
        # (sends posted before, ((peer, is_send, key), ...)) per flush, in posting order

    @property
    def wait_ms(self) -> float:
        """Time blocked in :meth:`wait_recv` this iteration (the rank's pipeline idle time), ms;
        on CUDA reading it synchronizes once (the events of the waits so far)."""
        return self._wait.ms

    def begin(self, msg: MessageShape) -> None:
        """Start an iteration whose messages have shape ``msg``; drops leftovers of a failed one."""
        self._msg = msg
        self._recvs.clear()
        self._sends.clear()
        self._next.clear()
        self._due_recv.clear()
        self._due_send.clear()
        self._batch.clear()
        self.sends_posted = self.batches_posted = 0
        self.post_log = []
        self._wait.reset()

    def _tag(self, kind: str, mb: int, sender_stage: int) -> int:
        return message_tag(kind, mb, sender_stage, self._stages, self._mbs)

    def posted(self, kind: str, mb: int, sender_stage: int) -> bool:
        """The receive was asked for (posted, or held behind an earlier operation of its link)."""
        key = (kind, mb, sender_stage)
        return key in self._recvs or key in self._due_recv or any(k == key for _, _, k, _ in self._batch)

    def post_recv(self, kind: str, mb: int, sender_stage: int, peer: int, flush: bool = True) -> None:
        """Ask for the receive of ``(kind, mb, sender_stage)`` from pipeline rank ``peer``
        (idempotent); it is posted once the earlier operations with ``peer`` are. ``flush=False``:
        leave it for the next :meth:`flush` (the engine asks for several, then posts them at once).

        Raises:
            EngineError: ``links`` lacks this receive.
        """
        key = (kind, mb, sender_stage)
        if self.posted(kind, mb, sender_stage):
            return
        self._require()
        self._check_known(peer, False, key)
        self._due_recv[key] = peer
        self._release(peer)
        if flush:
            self.flush()

    def wait_recv(self, kind: str, mb: int, sender_stage: int) -> torch.Tensor:
        """Wait for a posted receive; returns its buffer ``[mbs, S, H]``.

        Raises:
            EngineError: the receive was never posted (the Program lacks its ``recv_*``), or it is
                still held behind an operation of its link that never became due.
        """
        self.flush()
        key = (kind, mb, sender_stage)
        if key in self._due_recv:
            peer = self._due_recv[key]
            held = self._links[peer][self._next.get(peer, 0)]
            raise EngineError(f"{kind} receive of mb {mb} from stage {sender_stage} waits behind the "
                              f"{'send' if held[0] else 'receive'} of {held[1]} on the link with rank {peer}, "
                              "which was never posted: the Program orders that link's messages differently")
        try:
            work, buf = self._recvs.pop(key)
        except KeyError:
            raise EngineError(f"no {kind} receive posted for mb {mb} from stage {sender_stage}: "
                              "the Program needs a recv instruction before the data is used") from None
        t0 = self._timer.mark()
        self._stream.land(work, buf)
        self._wait.add(t0, self._timer.mark())
        return buf

    def send(self, kind: str, mb: int, sender_stage: int, peer: int, tensor: torch.Tensor) -> None:
        """``isend`` ``tensor`` (detached, contiguous) to pipeline rank ``peer`` once the earlier
        operations with ``peer`` are posted (at once when they are); never blocks.

        Raises:
            EngineError: ``tensor`` does not have the iteration's message shape / dtype, or
                ``links`` lacks this send.
        """
        m = self._require()
        if tuple(tensor.shape) != m.shape or tensor.dtype != m.dtype:
            raise EngineError(f"{kind} of mb {mb} from stage {sender_stage} has shape {tuple(tensor.shape)} "
                              f"{tensor.dtype}; this iteration's messages are {m.shape} {m.dtype}")
        key = (kind, mb, sender_stage)
        self._check_known(peer, True, key)
        self._due_send[key] = (peer, tensor.detach().contiguous())
        self._release(peer)
        self.flush()

    def _check_known(self, peer: int, is_send: bool, key: Key) -> None:
        if self._known is not None and (peer, (is_send, key)) not in self._known:
            raise EngineError(f"{'send' if is_send else 'receive'} of {key} with rank {peer} is not among the "
                              "Program's messages on that link")

    def _release(self, peer: int) -> None:
        """Move the due operations with ``peer`` that are next in its order to the batch."""
        if self._links is None:
            for key, p in [(k, p) for k, p in self._due_recv.items() if p == peer]:
                del self._due_recv[key]
                self._batch.append((peer, False, key, None))
            for key, (p, t) in [(k, v) for k, v in self._due_send.items() if v[0] == peer]:
                del self._due_send[key]
                self._batch.append((peer, True, key, t))
            return
        order, pos = self._links.get(peer, ()), self._next.get(peer, 0)
        while pos < len(order):
            is_send, key = order[pos]
            if is_send and key in self._due_send:
                self._batch.append((peer, True, key, self._due_send.pop(key)[1]))
            elif not is_send and key in self._due_recv:
                del self._due_recv[key]
                self._batch.append((peer, False, key, None))
            else:
                break
            pos += 1
        self._next[peer] = pos

    def flush(self) -> None:
        """Post every operation released since the last flush: one ``batch_isend_irecv`` when
        there are several (NCCL: one group, so a send and a receive with the same peer progress
        together), a plain ``isend`` / ``irecv`` for one."""
        if not self._batch:
            return
        m = self._require()
        batch, self._batch = self._batch, []
        ops = []
        with self._stream.issue(*(t for _, is_send, _, t in batch if is_send)):  # receive buffers on its stream
            for peer, is_send, key, t in batch:
                if not is_send:
                    t = torch.empty(m.shape, dtype=m.dtype, device=m.device)
                ops.append(dist.P2POp(dist.isend if is_send else dist.irecv, t, self._peer(peer), tag=self._tag(*key)))
            if len(ops) == 1:
                op = ops[0]
                works = [op.op(op.tensor, op.peer, tag=op.tag)]
            else:
                works = dist.batch_isend_irecv(ops)
                self.batches_posted += 1
        self.post_log.append((self.sends_posted, tuple((peer, is_send, key) for peer, is_send, key, _ in batch)))
        if len(works) != len(ops):  # a coalesced batch (NCCL): one work completes all of it
            works = [works[-1]] * len(ops)
        if self._sends and self._sends[0][0].is_completed():
            self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]
        for (peer, is_send, key, _), op, work in zip(batch, ops, works):
            if is_send:
                self.sends_posted += 1
                self._sends.append((work, op.tensor))
            else:
                self._recvs[key] = (work, op.tensor)

    def finish(self) -> None:
        """Wait for every send of the iteration.

        Raises:
            EngineError: a posted receive was never consumed, or an operation was never posted
                (held behind one of its link that never became due).
        """
        self.flush()
        held = sorted(self._due_send) + sorted(self._due_recv)
        for work, _ in self._sends:
            self._stream.land(work)
        self._sends.clear()
        if held:
            self._due_send.clear()
            self._due_recv.clear()
            raise EngineError(f"messages never posted (held behind an earlier operation of their link): {held}")
        if self._recvs:
            left = sorted(self._recvs)
            self._recvs.clear()
            raise EngineError(f"receives posted but never used: {left}")

    def _require(self) -> MessageShape:
        if self._msg is None:
            raise EngineError("PipeComm used outside an iteration (call begin first)")
        return self._msg


def ping_pong_ms(groups, x: torch.Tensor, reps: int = 10) -> float | None:
    """One-way time of the tensor ``x`` (e.g. one activation ``[mbs, S, H]``) between pipeline
    ranks 0 and 1 of this rank's replica, ms: the median over ``reps`` round trips, halved. Every
    replica measures on its own ranks 0 and 1 at once; other ranks, and layouts with ``pp < 2``,
    return None without communicating (a profile's ``p2p`` item, the engine benchmark)."""
    import statistics

    if groups is None or groups.layout.pp < 2 or groups.pipeline_rank > 1:
        return None
    peer = groups.peer(1 - groups.pipeline_rank)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if groups.pipeline_rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        if x.is_cuda:  # NCCL's blocking calls block the stream, not the host
            torch.cuda.synchronize(x.device)
        ts.append((time.perf_counter() - t0) * 1e3 / 2)
    return statistics.median(ts)
