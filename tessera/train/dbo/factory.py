"""Choosing the count transport by name: the factory above both transports.

:func:`make_transport` returns the all-gather of :mod:`tessera.train.dbo.transport` or the
compiled graph of :mod:`tessera.train.dbo.graph_transport`; it sits above both so that neither
transport module imports the other.
"""

from __future__ import annotations

import logging

from tessera.train.dbo.graph_transport import build_graph_transport
from tessera.train.dbo.transport import AUTO_KIND, KINDS, LOG, AllGatherTransport, CountTransport


def make_transport(kind: str, group=None, *, device: str = "cpu", timeout_s: float = 5.0,
                   logger: logging.Logger | None = None) -> CountTransport:
    """The transport ``kind`` names (collective over ``group``, the EP process group).

    ``auto`` is :data:`AUTO_KIND`; ``compiled_graph`` builds a
    :class:`~tessera.train.dbo.graph_transport.CompiledGraphTransport` (``timeout_s``: how long
    a graph step waits for a silent peer before that exchange goes over the all-gather). When the
    graph is unsupported (:func:`~tessera.train.dbo.graph.graph_support`: Ray version, missing
    ``ray.dag``/``experimental_compile``, not inside a Ray actor) on any peer, or compiling it
    fails, every peer gets an :class:`AllGatherTransport` and one warning is logged (``logger``,
    default :data:`tessera.train.dbo.transport.LOG`).

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if kind not in KINDS:
        raise ValueError(f"dbo.transport={kind!r}: must be one of {', '.join(KINDS)}; use auto unless measuring")
    fallback = AllGatherTransport(group, device)
    if kind == "auto":
        kind = AUTO_KIND
    if kind == "allgather":
        return fallback
    return build_graph_transport(fallback, timeout_s=timeout_s, logger=logger or LOG)
