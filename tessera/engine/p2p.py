"""Asynchronous pipeline point-to-point transfers of activations and gradients.

A message is identified as in the Program semantics by ``(kind, mb, sender virtual stage)``:
the ``send_act`` of stage ``s`` matches the ``recv_act`` of stage ``s+1``, the ``send_grad`` of
stage ``s`` the ``recv_grad`` of stage ``s-1``. Every message carries a distinct tag derived
from that identity (:func:`message_tag`), so receives may be posted in any order and as early as
wanted (gloo matches by source and tag). NCCL ignores tags and matches per link in issue order;
there the receives of one link must be posted in the order the peer sends.

Receives are posted (``irecv`` into a fresh buffer) and waited separately: the engine posts them
ahead of their instruction and waits where the data is first used. Sends are ``isend`` and never
block; their buffers stay referenced until :meth:`PipeComm.finish` (end of the iteration).
:attr:`PipeComm.wait_ms` sums the time blocked in :meth:`~PipeComm.wait_recv` over the
iteration: the rank's pipeline idle time (bubble), wherever the engine waits.
Every message of an iteration has the same shape ``[micro_batch_size, seq_length, hidden]``,
agreed at the iteration's start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tessera.engine.values import EngineError

ACT, GRAD = "act", "grad"


def message_tag(kind: str, mb: int, sender_stage: int, num_stages: int, num_microbatches: int) -> int:
    """Tag of message ``(kind, mb, sender_stage)``: unique within an iteration, ``>= 0``."""
    return ((0 if kind == ACT else 1) * num_stages + sender_stage) * num_microbatches + mb


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
    """

    def __init__(self, global_rank_of: Callable[[int], int], num_stages: int, num_microbatches: int) -> None:
        self._peer = global_rank_of
        self._stages, self._mbs = num_stages, num_microbatches
        self._msg: MessageShape | None = None
        self._recvs: dict[tuple[str, int, int], tuple[object, torch.Tensor]] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self.sends_posted = 0  # isends of the current iteration
        self.wait_ms = 0.0  # time blocked in wait_recv this iteration (the rank's pipeline idle time), ms

    def begin(self, msg: MessageShape) -> None:
        """Start an iteration whose messages have shape ``msg``; drops leftovers of a failed one."""
        self._msg = msg
        self._recvs.clear()
        self._sends.clear()
        self.sends_posted = 0
        self.wait_ms = 0.0

    def _tag(self, kind: str, mb: int, sender_stage: int) -> int:
        return message_tag(kind, mb, sender_stage, self._stages, self._mbs)

    def posted(self, kind: str, mb: int, sender_stage: int) -> bool:
        return (kind, mb, sender_stage) in self._recvs

    def post_recv(self, kind: str, mb: int, sender_stage: int, peer: int) -> None:
        """Post the receive of ``(kind, mb, sender_stage)`` from pipeline rank ``peer`` (idempotent)."""
        key = (kind, mb, sender_stage)
        if key in self._recvs:
            return
        m = self._require()
        buf = torch.empty(m.shape, dtype=m.dtype, device=m.device)
        work = dist.irecv(buf, src=self._peer(peer), tag=self._tag(kind, mb, sender_stage))
        self._recvs[key] = (work, buf)

    def wait_recv(self, kind: str, mb: int, sender_stage: int) -> torch.Tensor:
        """Wait for a posted receive; returns its buffer ``[mbs, S, H]``.

        Raises:
            EngineError: the receive was never posted (the Program lacks its ``recv_*``).
        """
        try:
            work, buf = self._recvs.pop((kind, mb, sender_stage))
        except KeyError:
            raise EngineError(f"no {kind} receive posted for mb {mb} from stage {sender_stage}: "
                              "the Program needs a recv instruction before the data is used") from None
        t0 = time.perf_counter()
        work.wait()
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        return buf

    def send(self, kind: str, mb: int, sender_stage: int, peer: int, tensor: torch.Tensor) -> None:
        """``isend`` ``tensor`` (detached, contiguous) to pipeline rank ``peer``; never blocks.

        Raises:
            EngineError: ``tensor`` does not have the iteration's message shape / dtype.
        """
        m = self._require()
        if tuple(tensor.shape) != m.shape or tensor.dtype != m.dtype:
            raise EngineError(f"{kind} of mb {mb} from stage {sender_stage} has shape {tuple(tensor.shape)} "
                              f"{tensor.dtype}; this iteration's messages are {m.shape} {m.dtype}")
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst=self._peer(peer), tag=self._tag(kind, mb, sender_stage))
        self.sends_posted += 1
        if self._sends and self._sends[0][0].is_completed():
            self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]
        self._sends.append((work, t))

    def finish(self) -> None:
        """Wait for every send of the iteration.

        Raises:
            EngineError: a posted receive was never consumed.
        """
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
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
        ts.append((time.perf_counter() - t0) * 1e3 / 2)
    return statistics.median(ts)
