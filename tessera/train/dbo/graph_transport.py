"""The compiled-graph :class:`~tessera.train.dbo.transport.CountTransport` and its collective
build, on the graph of :mod:`tessera.train.dbo.graph`.

EP rank 0's Train worker builds, drives and tears down its EP group's graph (the process that
compiles a graph is the only one that may execute it, and driving it from the training thread
that needs the counts keeps the graph idle between exchanges; a graph per EP group, because an
actor drives one graph at a time). The graph lives and dies with the worker group: a restarted
group builds a new one over its new actor handles.

:func:`build_graph_transport` (collective over the EP group): every peer checks
:func:`~tessera.train.dbo.graph.graph_support`, opens its slot and sends EP rank 0 its own
actor handle (``ray.get_runtime_context().current_actor``); EP rank 0 compiles. The outcome is
agreed over the group, so either every peer gets the graph or every peer gets the all-gather
(one warning each).

An exchange: peers > 0 offer their counts in their slot; EP rank 0 executes the graph with its
own counts and reads every output with a timeout. When the graph fails (:func:`decide` says so,
EP rank 0's read fails, a peer hears nothing within ``2 * timeout_s + grace_s`` s and can still
withdraw its counts, so the graph fails that exchange for everyone), every peer exchanges those
counts over the all-gather, and every later exchange too (one warning logged). Left: a peer
whose counts the graph took but who hears nothing, or EP rank 0 when a read fails after
``timeout_s + grace_s`` s (``grace_s``: :data:`GRACE_S` unless given), falls back alone (an actor died or hangs: the job is failing then anyway).
Compiling has no timeout of its own (Ray's).
"""

from __future__ import annotations

import logging
import uuid

import numpy as np

from tessera.train.dbo.graph import close_slot, compile_graph, decide, graph_support, open_slot
from tessera.train.dbo.transport import AllGatherTransport, as_counts

GRACE_S = 10.0
"""Seconds a graph read or a peer's wait allows beyond the graph step's own timeout: room for a
loaded host to schedule the graph's actors before an exchange is given up on."""


class CompiledGraphTransport:
    """Counts over the EP group's compiled graph; made by :func:`build_graph_transport`.

    Attributes:
        fallen_back: the graph failed; exchanges go over ``fallback``.
        reason: why it fell back ("" while the graph is in use).
        teardown_error: after :meth:`close` on EP rank 0, what tearing the graph down raised ("").
    """

    kind = "compiled_graph"

    def __init__(self, fallback: AllGatherTransport, key: str, dag, timeout_s: float, logger: logging.Logger,
                 fail_steps: frozenset[int] = frozenset(), grace_s: float = GRACE_S) -> None:
        self.fallback, self.key, self.dag, self.timeout_s, self.log = fallback, key, dag, timeout_s, logger
        self.grace_s = grace_s
        self.slot = open_slot(key)
        self.fail_steps = fail_steps
        self.seq, self.fallen_back, self.reason, self.closed, self.teardown_error = 0, False, "", False, ""

    def exchange(self, local) -> np.ndarray:
        """See :class:`~tessera.train.dbo.transport.CountTransport`.

        Raises:
            ValueError: bad ``local`` (:func:`~tessera.train.dbo.transport.as_counts`).
            RuntimeError: the transport is closed.
        """
        if self.closed:
            raise RuntimeError("CompiledGraphTransport.exchange after close(); make a new transport")
        arr = as_counts(local)
        if not self.fallen_back:
            seq, self.seq = self.seq, self.seq + 1
            error = f"injected failure of graph step for exchange {seq}" if seq in self.fail_steps else None
            result, why = self._lead(seq, arr, error) if self.fallback.rank == 0 else self._follow(seq, arr, error)
            if result is not None:
                return result
            self.fallen_back, self.reason = True, why
            self.log.warning("token counts: compiled-graph exchange %d failed (%s); using the all-gather from now on",
                             seq, why)
        return self.fallback.exchange(arr)

    def _lead(self, seq: int, arr: np.ndarray, error: str | None) -> tuple[np.ndarray | None, str]:
        """EP rank 0: one graph step; every output read with a timeout, the rows copied."""
        try:
            refs = self.dag.execute((seq, None if error else arr, error))
            outs = [ref.get(timeout=self.timeout_s + self.grace_s) for ref in refs]
        except Exception as e:  # noqa: BLE001 - the graph broke: fall back
            return None, f"graph step: {type(e).__name__}: {e}"
        _, result, why = decide([(seq, arr, error)] + outs[:self.fallback.size - 1])
        return result, why or ""

    def _follow(self, seq: int, arr: np.ndarray, error: str | None) -> tuple[np.ndarray | None, str]:
        """EP ranks > 0: offer the counts, wait for the graph's decision."""
        self.slot.offer(seq, arr, error)
        wait_s = 2 * self.timeout_s + self.grace_s
        got = self.slot.wait(seq, wait_s)
        if got is None and not self.slot.retract(seq):  # taken: the decision is on its way
            got = self.slot.wait(seq, wait_s)
        if got is None:
            return None, f"no answer from the compiled graph within {wait_s:.0f} s"
        return got[0], got[1] or ""

    def close(self) -> None:
        """Collective: wait until every peer is past its last exchange, tear the graph down (EP
        rank 0), forget this process's slot, close the all-gather. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.fallback.exchange(np.zeros(1, dtype=np.int64))  # a barrier that works on gloo and NCCL
        if self.dag is not None:
            try:
                self.dag.teardown()
            except Exception as e:  # noqa: BLE001 - reported, not raised: the all-gather still works
                self.teardown_error = f"{type(e).__name__}: {e}"
            self.dag = None
        close_slot(self.key)
        self.fallback.close()


def build_graph_transport(fallback: AllGatherTransport, *, timeout_s: float = 5.0, logger: logging.Logger,
                          fail_steps: frozenset[int] = frozenset(), grace_s: float = GRACE_S):
    """Collective over ``fallback``'s group (module docstring): a :class:`CompiledGraphTransport`,
    or ``fallback`` with one warning logged when any peer cannot take part or compiling fails.
    ``timeout_s``: how long (s) a graph step waits for a peer's counts; ``grace_s``: the slack
    beyond it (module docstring); ``fail_steps``: exchange numbers whose graph step fails on this
    rank (fault-injection tests only)."""
    import ray
    import torch.distributed as dist

    group, rank, size = fallback.group, fallback.rank, fallback.size

    def agree(why: str | None) -> str | None:  # the first peer's reason, or None when all can go on
        reasons: list = [None] * size
        dist.all_gather_object(reasons, why, group=group)
        return next((f"EP rank {r}: {w}" for r, w in enumerate(reasons) if w), None)

    why = agree(graph_support())
    if why is not None:
        logger.warning("token counts: the compiled-graph transport is unavailable (%s); using the all-gather", why)
        return fallback
    if size < 2:
        return fallback  # nobody to exchange with: the all-gather is a copy
    box = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    key = box[0]
    open_slot(key)
    handles: list = [None] * size
    dist.all_gather_object(handles, None if rank == 0 else ray.get_runtime_context().current_actor, group=group)
    dag, why = None, None
    if rank == 0:
        try:
            dag = compile_graph(handles[1:], key, timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure falls back to the all-gather
            why = f"compiling the graph failed: {type(e).__name__}: {e}"
    why = agree(why)
    if why is None:
        return CompiledGraphTransport(fallback, key, dag, timeout_s, logger, fail_steps, grace_s)
    close_slot(key)
    logger.warning("token counts: the compiled-graph transport is unavailable (%s); using the all-gather", why)
    return fallback
