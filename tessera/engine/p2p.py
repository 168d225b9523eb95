"""Asynchronous pipeline point-to-point transfers of activations and gradients, as NCCL requires.

A message is identified as in the Program semantics by ``(kind, mb, sender virtual stage)``:
the ``send_act`` of stage ``s`` matches the ``recv_act`` of stage ``s+1``, the ``send_grad`` of
stage ``s`` the ``recv_grad`` of stage ``s-1``. Every message carries a distinct tag derived
from that identity (:func:`message_tag`); gloo matches by source and tag, but NCCL ignores tags,
matches the messages between two ranks in the order they are posted and runs one communicator's
operations one after another (``../shared/design/NCCL-RULES.md``).

So :class:`PipeComm` posts every send and receive of the rank, of all its peers, in one fixed
order, the Program's (:attr:`~tessera.program.instructions.Program.p2p_batches`, computed by the
compiler from every rank's Program: :mod:`tessera.program.exchanges`), each batch as one
``torch.distributed.batch_isend_irecv`` on the replica's pipeline process group (never the
default group, never a lone ``isend`` / ``irecv``: ProcessGroupNCCL would run a lone operation on
a private communicator of the two ranks, where the batched one of the other end never arrives).
Both ends of a link group every exchange the same way and post it in the same relative order, and
the validator proves that this order cannot hang when each communicator runs one batch after
another. A batch of receives is posted as soon as every earlier batch is (not when its
instruction nears: a receive may be needed behind it); a batch with sends once their data exists
(:meth:`PipeComm.send`); nothing overtakes. A Program without batches (built by hand, not
compiled) is posted in instruction order, one operation per batch, which only gloo forgives: the
engine refuses it on NCCL.

Receives are waited separately from posting: the engine waits where the data is first used.
Sends never block; their buffers stay referenced until :meth:`PipeComm.finish` (end of the
iteration). :attr:`PipeComm.wait_ms` sums the time blocked in :meth:`~PipeComm.wait_recv` over the
iteration: the rank's pipeline idle time (bubble), wherever the engine waits. It is timed by the
engine's timer (:mod:`tessera.engine.timing`): host time on CPU (a gloo wait blocks the thread),
on CUDA the compute stream's time between events recorded just before and just after the wait
(an NCCL wait blocks the stream, not the host). On CUDA the transfers are issued from a side
stream (``stream``, :class:`~tessera.model.streams.CommStream`): it waits for the compute stream
before a batch is posted (the sends' data is ready), and a receive's buffer reaches the compute
stream through an event after its transfer; on CPU nothing changes. Every message of an iteration
has the same shape ``[micro_batch_size, seq_length, hidden]``, agreed at the iteration's start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

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


Op1 = tuple[int, bool, Key]  # (peer, is_send, key)


def program_order(program: Program) -> tuple[tuple[Op1, ...], ...]:
    """The rank's point-to-point batches in posting order, as ``(peer, is_send, key)`` per
    operation: the Program's ``p2p_batches``, or, for a Program compiled without them, every
    operation alone in instruction order (gloo only; module docstring)."""
    ops = {(op.kind, op.mb, op.sender_stage): op for seq in link_ops(program).values() for op in seq}
    if not program.p2p_batches:
        return tuple(((o.peer, o.send, k),) for k, o in sorted(ops.items(), key=lambda kv: kv[1].index))
    return tuple(tuple((ops[k].peer, ops[k].send, k) for k in (tuple(x) for x in batch)) for batch in program.p2p_batches)


def program_links(program: Program) -> dict[int, tuple[tuple[bool, Key], ...]]:
    """Peer -> the Program's sends to and receives from it in instruction order, as
    ``(is_send, (kind, mb, sender_stage))``."""
    return {peer: tuple((op.send, (op.kind, op.mb, op.sender_stage)) for op in ops)
            for peer, ops in link_ops(program).items()}


@dataclass(frozen=True)
class MessageShape:
    """Shape, dtype and device of every activation / gradient message of an iteration."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class PipeComm:
    """Point-to-point transfers of one rank with its pipeline neighbours (module docstring).

    Args:
        global_rank_of: pipeline rank -> global rank (of this rank's replica).
        num_stages, num_microbatches: the Program's shape (for the tags).
        order: the rank's batches in posting order (:func:`program_order`); every operation the
            engine asks for must be in it.
        group: the replica's pipeline process group (None: the default group, a single-replica
            test world only).
        timer: times the receive waits (:mod:`tessera.engine.timing`; default host time).
        stream: the side stream the transfers are issued from (default none: CPU / gloo).
    """

    def __init__(self, global_rank_of: Callable[[int], int], num_stages: int, num_microbatches: int,
                 order: Sequence[Sequence[Op1]], group=None, timer: Timer | None = None,
                 stream: CommStream = NO_STREAM) -> None:
        self._peer, self._group = global_rank_of, group
        self._timer, self._stream = HostTimer() if timer is None else timer, stream
        self._wait = SpanTotal(self._timer)
        self._stages, self._mbs = num_stages, num_microbatches
        self._order = tuple(tuple(batch) for batch in order)
        self._where = {(peer, send, key): k for k, batch in enumerate(self._order) for peer, send, key in batch}
        self._msg: MessageShape | None = None
        self._recvs: dict[Key, tuple[object, torch.Tensor]] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._data: dict[Key, torch.Tensor] = {}  # sends given, not posted yet
        self._head = 0  # first batch of the order not posted yet
        self.sends_posted = 0  # isends of the current iteration
        self.batches_posted = 0  # batch_isend_irecv calls this iteration
        self.post_log: list[tuple[int, tuple[Op1, ...]]] = []  # this iteration's posts:
        # (sends posted before, ((peer, is_send, key), ...)) per batch, in posting order

    @property
    def wait_ms(self) -> float:
        """Time blocked in :meth:`wait_recv` this iteration (the rank's pipeline idle time), ms;
        on CUDA reading it synchronizes once (the events of the waits so far)."""
        return self._wait.ms

    def begin(self, msg: MessageShape) -> None:
        """Start an iteration whose messages have shape ``msg`` (drops leftovers of a failed one)
        and post the leading batches of receives."""
        self._msg = msg
        self._recvs.clear()
        self._sends.clear()
        self._data.clear()
        self._head = 0
        self.sends_posted = self.batches_posted = 0
        self.post_log = []
        self._wait.reset()
        self.flush()

    def _tag(self, kind: str, mb: int, sender_stage: int) -> int:
        return message_tag(kind, mb, sender_stage, self._stages, self._mbs)

    def posted(self, kind: str, mb: int, sender_stage: int) -> bool:
        """The receive of ``(kind, mb, sender_stage)`` has been posted."""
        return (kind, mb, sender_stage) in self._recvs

    def post_recv(self, kind: str, mb: int, sender_stage: int, peer: int, flush: bool = True) -> None:
        """Check that the order holds this receive (receives are posted in order, as soon as every
        earlier batch is: module docstring); ``flush``: post what can be posted now.

        Raises:
            EngineError: the Program's order lacks this receive.
        """
        self._require()
        self._check_known(peer, False, (kind, mb, sender_stage))
        if flush:
            self.flush()

    def blocked_by(self, kind: str, mb: int, sender_stage: int) -> Key | None:
        """The send whose missing data holds back the receive of ``(kind, mb, sender_stage)`` (an
        earlier batch of the order), or None when the receive is posted or nothing holds it."""
        if self.posted(kind, mb, sender_stage) or self._head >= len(self._order):
            return None
        for peer, send, key in self._order[self._head]:
            if send and key not in self._data:
                return key
        return None

    def wait_recv(self, kind: str, mb: int, sender_stage: int) -> torch.Tensor:
        """Wait for a receive; returns its buffer ``[mbs, S, H]``.

        Raises:
            EngineError: the receive is not in the Program's order, or is still held behind a
                batch whose send has no data yet (the engine forces such sends first).
        """
        self.flush()
        key = (kind, mb, sender_stage)
        if key not in self._recvs:
            held = self.blocked_by(*key)
            if held is not None:
                raise EngineError(f"{kind} receive of mb {mb} from stage {sender_stage} is held behind the send of "
                                  f"{held} (batch {self._head} of this rank's p2p order), whose data does not "
                                  "exist yet: the Program's p2p order needs that send first")
            raise EngineError(f"no {kind} receive posted for mb {mb} from stage {sender_stage}: "
                              "the Program needs a recv instruction before the data is used")
        work, buf = self._recvs.pop(key)
        t0 = self._timer.mark()
        self._stream.land(work, buf)
        self._wait.add(t0, self._timer.mark())
        return buf

    def send(self, kind: str, mb: int, sender_stage: int, peer: int, tensor: torch.Tensor) -> None:
        """Give the data of the send of ``(kind, mb, sender_stage)`` to pipeline rank ``peer``
        (detached, contiguous); it is posted once every earlier batch of the order is (at once
        when they are); never blocks.

        Raises:
            EngineError: ``tensor`` does not have the iteration's message shape / dtype, or the
                Program's order lacks this send.
        """
        m = self._require()
        if tuple(tensor.shape) != m.shape or tensor.dtype != m.dtype:
            raise EngineError(f"{kind} of mb {mb} from stage {sender_stage} has shape {tuple(tensor.shape)} "
                              f"{tensor.dtype}; this iteration's messages are {m.shape} {m.dtype}")
        key = (kind, mb, sender_stage)
        self._check_known(peer, True, key)
        self._data[key] = tensor.detach().contiguous()
        self.flush()

    def _check_known(self, peer: int, is_send: bool, key: Key) -> None:
        if (peer, is_send, key) not in self._where:
            raise EngineError(f"{'send' if is_send else 'receive'} of {key} with rank {peer} is not among the "
                              "Program's messages on that link")

    def flush(self) -> None:
        """Post, in order, every batch whose sends have their data (a batch of receives at once),
        each as one ``batch_isend_irecv`` on the pipeline group."""
        if self._msg is None:
            return
        m = self._msg
        while self._head < len(self._order):
            batch = self._order[self._head]
            if any(send and key not in self._data for _, send, key in batch):
                return
            self._head += 1
            data = [self._data.pop(key) for _, send, key in batch if send]
            ops = []
            with self._stream.issue(*data):  # receive buffers on its stream
                it = iter(data)
                for peer, send, key in batch:
                    t = next(it) if send else torch.empty(m.shape, dtype=m.dtype, device=m.device)
                    ops.append(dist.P2POp(dist.isend if send else dist.irecv, t, self._peer(peer), self._group,
                                          tag=self._tag(*key)))
                works = dist.batch_isend_irecv(ops)
            self.batches_posted += 1
            self.post_log.append((self.sends_posted, batch))
            if len(works) != len(ops):  # a coalesced batch (NCCL): one work completes all of it
                works = [works[-1]] * len(ops)
            if self._sends and self._sends[0][0].is_completed():
                self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]
            for (peer, send, key), op, work in zip(batch, ops, works):
                if send:
                    self.sends_posted += 1
                    self._sends.append((work, op.tensor))
                else:
                    self._recvs[key] = (work, op.tensor)

    def finish(self) -> None:
        """Wait for every send of the iteration.

        Raises:
            EngineError: a posted receive was never consumed, or a batch was never posted (a send
                never given its data).
        """
        self.flush()
        for work, _ in self._sends:
            self._stream.land(work)
        self._sends.clear()
        if self._head < len(self._order):
            left = [key for batch in self._order[self._head:] for _, send, key in batch if send]
            self._head = len(self._order)
            self._data.clear()
            raise EngineError(f"messages never posted (a send never given its data holds them back): {left}")
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
    return None without communicating (a profile's ``p2p`` item, the engine benchmark). Each
    transfer is a batch of one on the pipeline group, posted in the same order on both ends (the
    module docstring's rules)."""
    import statistics

    if groups is None or groups.layout.pp < 2 or groups.pipeline_rank > 1:
        return None
    peer = groups.peer(1 - groups.pipeline_rank)

    def one(op) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, peer, groups.pipeline)]):
            work.wait()

    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for op in ((dist.isend, dist.irecv) if groups.pipeline_rank == 0 else (dist.irecv, dist.isend)):
            one(op)
        if x.is_cuda:  # NCCL's waits block the stream, not the host
            torch.cuda.synchronize(x.device)
        ts.append((time.perf_counter() - t0) * 1e3 / 2)
    return statistics.median(ts)
