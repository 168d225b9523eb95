"""Asynchronous front of the EP exchange: start / wait handles, no autograd (what the engine runs).

The synchronous front (:mod:`tessera.model.ep.sync`) wraps the all-to-all in autograd (blocking,
backward = reverse all-to-all). The engine cuts every MoE layer at the all-to-alls instead (each
task has detached inputs), so it moves rows and their gradients explicitly and can overlap them:
``torch.distributed.all_to_all_single(..., async_op=True)`` is issued in the dispatch / combine
task (``start_*``, returning an :class:`InFlight`) and waited by the first task that needs the rows
(:meth:`InFlight.result`).

Plans, routes and row orders are the shared ones of :mod:`tessera.model.ep.plan`
(:func:`~tessera.model.ep.plan.plan_route`, :func:`~tessera.model.ep.plan.expert_major`): the same
ops on the same tensors as the synchronous front, so both are bitwise equal. All moves are
permutations or copies, so they are exact; only their forms differ (forward:
``index_select(regroup)``, gradient: ``index_select(inverse)``).

``stream`` (a :class:`~tessera.model.streams.CommStream`, default none): on CUDA the
all-to-all is issued from that side stream after an event of the compute stream, and
:meth:`InFlight.result` makes the compute stream wait for its completion (the stream module
docstring); on CPU / gloo it changes nothing.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from tessera.model.ep.plan import ExpertRoute, ep_size, issue_all_to_all, source_major
from tessera.model.streams import NO_STREAM, CommStream


class InFlight:
    """A started all-to-all (or a local hand-over when ``work`` is None); :meth:`result` waits once.

    ``wait_ms`` is the host time spent blocked in :meth:`result` (0 for local or finished
    transfers; on CUDA about 0: the wait is a stream wait). ``span``, when given, is anything
    with ``mark()`` and ``add(start, stop)`` (the engine's
    :class:`~tessera.engine.timing.SpanTotal`): the wait is added to it as a span of its timer
    (CUDA events on a GPU, so the stream wait is what it measures). ``group``: the process group
    the transfer runs on, kept so that a wait that times out names it
    (:func:`tessera.engine.groups.comm_timeout` reads it from the failing frame).
    """

    __slots__ = ("_work", "_out", "_stream", "_span", "_group", "wait_ms")

    def __init__(self, out: torch.Tensor, work=None, stream: CommStream = NO_STREAM, span=None, group=None) -> None:
        self._out, self._work, self._stream, self._span, self.wait_ms = out, work, stream, span, 0.0
        self._group = group

    def done(self) -> bool:
        """Whether :meth:`result` would return without blocking."""
        return self._work is None or self._work.is_completed()

    def result(self) -> torch.Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            m0 = self._span.mark() if self._span is not None else None
            self._stream.land(self._work, self._out)
            if self._span is not None:
                self._span.add(m0, self._span.mark())
            self.wait_ms = (time.perf_counter() - t0) * 1e3
            self._work = None
        return self._out


def start_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group,
                     stream: CommStream = NO_STREAM, span=None) -> InFlight:
    """Issue a variable-split ``all_to_all_single`` of rows ``x [sum(send_splits), ...]``
    asynchronously (on ``stream``, module docstring); the result has ``sum(recv_splits)`` rows.
    ``group`` of size 1 / None: ``x``. ``span``: where the wait is added (:class:`InFlight`)."""
    if ep_size(group) == 1:
        return InFlight(x)
    with stream.issue(x):
        out, work = issue_all_to_all(x, send_splits, recv_splits, group, async_op=True)
    return InFlight(out, work, stream, span, group)


def start_dispatch(rows: torch.Tensor, route: ExpertRoute, group, stream: CommStream = NO_STREAM,
                   span=None) -> InFlight:
    """Send rows ``[N_send, H]`` (send order) to the expert owners; ``result()`` is the received,
    still source-major buffer ``[N_recv, H]`` (apply :func:`~tessera.model.ep.plan.expert_major`
    with ``route.plan``)."""
    if route.plan is None:
        return InFlight(rows)
    return start_all_to_all(rows, route.plan.send_splits, route.plan.recv_splits, group, stream, span)


def start_combine(y: torch.Tensor, route: ExpertRoute, group, stream: CommStream = NO_STREAM, span=None) -> InFlight:
    """Expert outputs ``[N_recv, H]`` (expert-major) back to their sources; ``result()`` is
    ``[N_send, H]`` in the source's send order. Also the backward of dispatch (gradients of the
    expert inputs back to the rows' sources)."""
    if route.plan is None:
        return InFlight(y)
    return start_all_to_all(source_major(y, route.plan), route.plan.recv_splits, route.plan.send_splits, group,
                            stream, span)


def start_combine_grad(g_rows: torch.Tensor, route: ExpertRoute, group, stream: CommStream = NO_STREAM,
                       span=None) -> InFlight:
    """Backward of combine: gradients of the returned rows ``[N_send, H]`` to the expert owners;
    ``result()`` is source-major ``[N_recv, H]`` (apply :func:`~tessera.model.ep.plan.expert_major`)."""
    return start_dispatch(g_rows, route, group, stream, span)
