"""Timers for the engine's measurements: task times, receive waits, step and iteration times.

On CPU every span is host time (``time.perf_counter``): a task runs on the calling thread and a
gloo ``Work.wait()`` blocks it, so host time is what the work took. On CUDA neither holds: a task
only *launches* kernels, and an NCCL ``Work.wait()`` makes the current stream wait, not the host.
So there the spans are CUDA events (``torch.cuda.Event(enable_timing=True)``) recorded on the
current (compute) stream: a task's span is the stream time between the events before and after
its launches, and a receive wait's span is the time the compute stream stood still at the wait
(an event recorded just before ``wait()``, one just after). Event spans are resolved once, at
the end of the iteration, with one ``torch.cuda.synchronize`` for all of them, never per task.

:func:`make_timer` picks by device: :class:`CudaEventTimer` for a CUDA device, else
:class:`HostTimer`. Both have the same interface: ``mark()`` (a host time in s, or a recorded
event), ``ms(start, stop)`` (the span in ms; a CUDA timer synchronizes first if events are
unresolved), ``known_ms(start, stop)`` (the span if known without waiting, else NaN), ``resolve()`` (synchronize once: after it, ``ms`` of every mark so far is free) and
``device_time`` (whether spans must wait for :meth:`resolve`). :class:`SpanTotal` (a sum, e.g.
the receive wait) and :class:`SpanLog` (``(key, ms)`` in order, e.g. per-task times) collect
spans and resolve them only when read.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch


class HostTimer:
    """Host time: ``mark()`` is ``time.perf_counter()`` (s); ``ms(a, b) = (b - a) * 1e3``."""

    device_time = False

    def mark(self) -> float:
        return time.perf_counter()

    def ms(self, start: float, stop: float) -> float:
        return (stop - start) * 1e3

    def known_ms(self, start: float, stop: float) -> float:
        """The span now, without waiting: :meth:`ms`."""
        return (stop - start) * 1e3

    def resolve(self) -> None:
        """Nothing to wait for."""


class CudaEventTimer:
    """Stream time on ``device``: ``mark()`` records a timing event on the current stream of
    ``device`` (the compute stream); ``ms(a, b)`` is ``a.elapsed_time(b)`` (ms, event resolution
    about 0.5 us per CUDA's ``cudaEventElapsedTime``) once :meth:`resolve` ran.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    device_time = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaEventTimer device={self.device}: must be a CUDA device; use HostTimer "
                             "(or make_timer(device)) elsewhere")
        self._pending = False

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._pending = True
        return event

    def ms(self, start: torch.cuda.Event, stop: torch.cuda.Event) -> float:
        self.resolve()
        return start.elapsed_time(stop)

    def known_ms(self, start, stop) -> float:
        """The span now, without waiting: NaN (known only after :meth:`resolve`)."""
        return float("nan")

    def resolve(self) -> None:
        """One ``torch.cuda.synchronize(device)`` if events were recorded since the last call."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            self._pending = False


Timer = HostTimer | CudaEventTimer


def make_timer(device: torch.device | str | None) -> Timer:
    """:class:`CudaEventTimer` on a CUDA ``device``, :class:`HostTimer` otherwise (None: CPU)."""
    device = torch.device("cpu" if device is None else device)
    return CudaEventTimer(device) if device.type == "cuda" else HostTimer()


def first_device(chunks: Sequence) -> torch.device:
    """The device of the first parameter of ``chunks`` (modules, or executors with ``module``);
    CPU when none has parameters."""
    for c in chunks:
        module = c if isinstance(c, torch.nn.Module) else getattr(c, "module", None)
        if module is not None:
            for p in module.parameters():
                return p.device
    return torch.device("cpu")


class SpanTotal:
    """A sum of spans of ``timer``, ms (:attr:`ms`); host spans are added at once, device spans
    kept as event pairs and summed when :attr:`ms` is read (one synchronize for all of them)."""

    __slots__ = ("_timer", "_ms", "_open")

    def __init__(self, timer: Timer) -> None:
        self._timer, self._ms, self._open = timer, 0.0, []

    def mark(self):
        """A mark of this total's timer (:meth:`add` takes two of them)."""
        return self._timer.mark()

    def add(self, start, stop) -> None:
        if self._timer.device_time:
            self._open.append((start, stop))
        else:
            self._ms += self._timer.ms(start, stop)

    @property
    def ms(self) -> float:
        if self._open:
            self._timer.resolve()
            for a, b in self._open:
                self._ms += self._timer.ms(a, b)
            self._open.clear()
        return self._ms

    def reset(self) -> None:
        self._ms = 0.0
        self._open.clear()


class SpanLog:
    """``(key, ms)`` of spans of ``timer`` in the order added; iterating, :func:`len` and
    :meth:`items` resolve device spans first (one synchronize), :meth:`clear` empties it."""

    __slots__ = ("_timer", "_done", "_open")

    def __init__(self, timer: Timer) -> None:
        self._timer, self._done, self._open = timer, [], []

    def add(self, key, start, stop) -> None:
        if self._timer.device_time:
            self._open.append((key, start, stop))
        else:
            self._done.append((key, self._timer.ms(start, stop)))

    def items(self) -> list:
        if self._open:
            self._timer.resolve()
            self._done.extend((k, self._timer.ms(a, b)) for k, a, b in self._open)
            self._open.clear()
        return self._done

    def __iter__(self) -> Iterator:
        return iter(self.items())

    def __len__(self) -> int:
        return len(self.items())

    def clear(self) -> None:
        self._done.clear()
        self._open.clear()
