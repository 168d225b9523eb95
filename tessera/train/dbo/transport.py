"""Token-count transport: every EP peer's per-expert token counts, shared before the slot.

The dynamic bubble optimizer (:mod:`tessera.engine.dbo`) predicts a slot from the per-expert
token counts of every rank of the EP group, known after routing and before dispatch. A
:class:`CountTransport` moves them: each EP rank calls :meth:`~CountTransport.exchange` with its
own counts (int64, shape ``(n,)``, the same ``n`` on every peer, the same order of calls on every
peer) and gets every peer's counts, shape ``(ep, n)``, row ``r`` from EP rank ``r`` (the rank in
the EP process group; :func:`tessera.engine.groups.make_groups` lists EP ranks in ascending order).
``exchange`` and :meth:`~CountTransport.close` are collective over the EP group.

Two implementations:

* :class:`AllGatherTransport`: one ``torch.distributed`` all-gather over the EP group (gloo on
  CPU, NCCL on GPUs; on NCCL the counts go through the current CUDA device).
* :class:`tessera.train.dbo.graph_transport.CompiledGraphTransport`: a Ray compiled graph over
  the Train workers' own actor handles, built and driven by EP rank 0's worker (it falls back to
  the all-gather, losing no exchange, when a graph step fails or hangs).

:func:`tessera.train.dbo.factory.make_transport` picks one by name (the recipe's transport kind:
:data:`KINDS`) and guards the compiled-graph path by a version/feature check
(:func:`tessera.train.dbo.graph.graph_support`); whenever the graph cannot be used it logs one
warning (logger :data:`LOG`, ``tessera.train.dbo.transport``) and returns the all-gather. It
never raises for an unavailable or failing graph and never waits without a timeout.

:func:`measure_latency` gives the median time of one exchange (µs), for ``benchmarks/dbo.py``.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Protocol, runtime_checkable

import numpy as np

LOG = logging.getLogger(__name__)

KINDS = ("auto", "compiled_graph", "allgather")
AUTO_KIND = "allgather"
"""What ``auto`` means: the transport measured faster at ep=2, and the one that costs nothing
between exchanges. :func:`measure_latency` medians, 64 int64 counts, Ray 2.60, gloo, a shared
2-core CPU machine at load average 4-21, several runs: 2 ranks all-gather 0.72-1.6 ms vs compiled
graph 1.4-4.4 ms; 4 ranks 2.5-4.8 ms vs 2.8-3.8 ms (either faster, run to run). Ray 2.60's channel
reads busy-wait: each EP rank > 0 of an idle graph kept about 0.7 of a core busy (the subject of
ray-project/ray PR 55128)."""


@runtime_checkable
class CountTransport(Protocol):
    """Moves the EP group's per-expert token counts (module docstring)."""

    kind: str

    def exchange(self, local: np.ndarray) -> np.ndarray:
        """Every EP peer's counts, shape ``(ep, n)`` int64, row ``r`` from EP rank ``r``
        (collective; ``local``: this rank's counts, shape ``(n,)``)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (collective; idempotent)."""
        ...


def as_counts(local) -> np.ndarray:
    """``local`` as a contiguous int64 array of shape ``(n,)``, ``n >= 1`` (a copy: the caller may
    reuse its buffer).

    Raises:
        ValueError: not one-dimensional, empty, not integer, or holding a negative count.
    """
    arr = np.asarray(local)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"token counts must have shape (n,) with n >= 1, got shape {arr.shape}; pass one row of "
                         "per-expert counts")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token counts must be integers, got dtype {arr.dtype}; pass counts as int64")
    if (arr < 0).any():
        raise ValueError(f"token counts must be >= 0, got {arr.tolist()}; pass the tokens routed to each expert")
    return np.array(arr, dtype=np.int64, copy=True, order="C")


class AllGatherTransport:
    """Counts over a ``torch.distributed`` all-gather on ``group`` (``None``: the default group).

    Args:
        group: the EP process group (this rank must be in it).
        device: where the gathered tensor lives (``"cpu"`` for gloo; a CUDA device for NCCL).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or this rank is not in ``group``.
    """

    kind = "allgather"

    def __init__(self, group=None, device: str = "cpu") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("AllGatherTransport needs torch.distributed.init_process_group first")
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise RuntimeError("AllGatherTransport: this rank is not in the given process group")
        self.size = dist.get_world_size(group)
        self.closed = False

    def exchange(self, local) -> np.ndarray:
        """See :meth:`CountTransport.exchange`.

        Raises:
            ValueError: bad ``local`` (:func:`as_counts`).
            RuntimeError: the transport is closed, or the collective failed.
        """
        import torch
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError("AllGatherTransport.exchange after close(); make a new transport")
        arr = as_counts(local)
        mine = torch.from_numpy(arr).to(self.device)
        out = torch.empty(self.size * arr.size, dtype=torch.int64, device=self.device)  # flat: as gloo wants
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
        gather(out, mine, group=self.group)
        return out.cpu().numpy().reshape(self.size, arr.size).copy()

    def close(self) -> None:
        self.closed = True


def measure_latency(transport: CountTransport, n: int = 64, reps: int = 200, warmup: int = 10) -> float:
    """Median wall time of one :meth:`~CountTransport.exchange` of ``n`` int64 counts, in µs,
    over ``reps`` exchanges after ``warmup`` (collective: every peer calls it with the same
    arguments; each gets its own median). Measure the all-gather with no compiled graph open:
    an idle graph's execution loops busy-wait (:mod:`tessera.train.dbo.graph`) and slow
    everything else on a small machine.

    Raises:
        ValueError: ``n`` or ``reps`` below 1.
        RuntimeError: an exchange returned the wrong shape.
    """
    if n < 1 or reps < 1:
        raise ValueError(f"measure_latency: n={n}, reps={reps} must be >= 1")
    times = []
    for i in range(warmup + reps):
        local = np.full(n, i, dtype=np.int64)
        t0 = time.perf_counter()
        out = transport.exchange(local)
        dt = time.perf_counter() - t0
        if out.ndim != 2 or out.shape[1] != n:
            raise RuntimeError(f"measure_latency: exchange returned shape {out.shape}, expected (ep, {n})")
        if i >= warmup:
            times.append(dt)
    return statistics.median(times) * 1e6
