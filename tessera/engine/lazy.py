"""Values the engine's chunks compute or receive on first use: :class:`Lazy`.

A received buffer, another local chunk's output, or an all-to-all's landing is wrapped in a
:class:`Lazy` and evaluated by the first task that needs it, so a wait happens where the data is
used and compute issued before it overlaps the transfer.
"""

from __future__ import annotations

from typing import Callable


class Lazy:
    """A value computed on first :meth:`get` (then cached); ``flight`` (an
    :class:`~tessera.model.ep.InFlight` it waits for) answers :meth:`ready`."""

    __slots__ = ("_fn", "_value", "_flight")

    def __init__(self, fn: Callable[[], object] | None, flight=None) -> None:
        self._fn, self._value, self._flight = fn, None, flight

    def ready(self) -> bool:
        """Whether :meth:`get` would not wait (computed, or its transfer has finished)."""
        return self._fn is None or self._flight is None or self._flight.done()

    @staticmethod
    def of(value) -> "Lazy":
        """An already computed value."""
        lazy = Lazy(None)
        lazy._value = value
        return lazy

    def get(self):
        """The value (computing it, and waiting for its transfer, on the first call)."""
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value


def get(v):
    """``v.get()`` for a :class:`Lazy`, else ``v`` itself."""
    return v.get() if type(v) is Lazy else v
