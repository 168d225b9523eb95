"""A side CUDA stream for communication (the expert all-to-alls, the pipeline p2p), or none.

ProcessGroupNCCL runs a collective on its own internal stream, which first waits for the stream
*current* at the call. Issued from the compute stream, the collective (and the buffer
allocations, copies and waits around it) sit in the compute stream's order. :class:`CommStream`
issues them from a side stream instead, with explicit events:

* :meth:`CommStream.issue` (a context): the side stream waits for an event recorded on the
  compute stream (the inputs are ready), the inputs are marked as used by the side stream
  (``Tensor.record_stream``: the caching allocator does not hand their memory to the compute
  stream again before the side stream's work on them is done), and the block issues on the side
  stream (buffers allocated inside belong to it);
* :meth:`CommStream.land`: the side stream waits for the work (``Work.wait()`` under it: a stream
  wait, the host does not block), the compute stream waits for an event recorded on the side
  stream after that (the consumer waits for completion), and the outputs are marked as used by
  the compute stream (they were allocated on the side stream).

Without CUDA (``device`` not a CUDA device: CPU, gloo) there is no stream: :meth:`issue` is a
null context and :meth:`land` is ``work.wait()``, exactly the code path without this class.
One instance per kind of traffic (the engine keeps one for all-to-alls and one for p2p), so a
receive that waits long for a pipeline peer never holds up an expert all-to-all.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


class CommStream:
    """A CUDA side stream on ``device`` for communication (module docstring); no stream on
    other devices (None: CPU)."""

    __slots__ = ("stream",)

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device("cpu" if device is None else device)
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @property
    def active(self) -> bool:
        """Whether communication goes to a side stream (a CUDA device)."""
        return self.stream is not None

    def issue(self, *inputs: torch.Tensor) -> ContextManager:
        """Context to issue a collective reading ``inputs`` on the side stream (after it waits
        for the compute stream's work so far); a null context without a stream."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # an event on the compute stream
        for t in inputs:
            t.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    def land(self, work, *outputs: torch.Tensor) -> None:
        """Wait for ``work`` (a ``torch.distributed`` Work) before the compute stream reads
        ``outputs``; without a stream, ``work.wait()``."""
        if self.stream is None:
            work.wait()
            return
        with torch.cuda.stream(self.stream):
            work.wait()  # NCCL: the side stream waits for the collective's end event
        done = torch.cuda.Event()
        done.record(self.stream)
        compute = torch.cuda.current_stream(self.stream.device)
        compute.wait_event(done)
        for t in outputs:
            t.record_stream(compute)


NO_STREAM = CommStream(None)
"""The CPU / gloo case: issue and land on the calling thread's stream (no side stream)."""
