"""Counting host synchronisations: the places where the host reads a device value.

``tensor.tolist()``, ``.item()``, ``int(t)``, ``.cpu()`` of a CUDA tensor (and ops whose output
size depends on the data, such as ``nonzero``) block the host until every kernel queued before
them on that stream has run; a read after a collective waits for the collective. Each one lets
the GPU run dry while the host cannot queue further work, so Tessera keeps them few and counts
them (docs: ``/work/shared/design/NCCL-RULES.md`` rule 5).

:class:`HostSyncs` is the counter. The code that reads device values (the expert-parallel plan,
:func:`tessera.model.ep.plan.plan_route`) adds one per read; the engine passes one counter to all
its chunks, resets it at each iteration's start and reports it as
:attr:`tessera.engine.values.IterationResult.host_syncs`. On CPU nothing synchronises, but the
same reads are counted, so a CPU run reports what a GPU run of the same Program would make.
"""

from __future__ import annotations


class HostSyncs:
    """A count of host synchronisations (module docstring); ``count`` is an ``int``, starting at 0."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int = 1) -> None:
        """Count ``n`` more synchronisations."""
        self.count += n

    def reset(self) -> int:
        """Set the count to 0; returns what it was."""
        n, self.count = self.count, 0
        return n

    def __repr__(self) -> str:
        return f"HostSyncs(count={self.count})"


def count(syncs: HostSyncs | None, n: int = 1) -> None:
    """Add ``n`` to ``syncs`` (nothing when it is None)."""
    if syncs is not None:
        syncs.count += n
