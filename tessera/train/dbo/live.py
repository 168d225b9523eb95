"""Live token counts for the dynamic bubble optimizer (``dbo.routing: router``, docs/dbo.md).

Every rank of an EP group routes its own tokens of a microbatch; after each router task the
engine's chunk calls :meth:`LiveCounts.routed` with the rank's per-expert ``requested`` counts
(int64 ``[E]``, :attr:`tessera.engine.tasks.TorchChunk.on_route`), known before the layer's
dispatch. :class:`LiveCounts` is also the :class:`~tessera.engine.dbo.DBOPolicy`'s ``live``
source: at every annotated slot the policy calls it with the (mb, layer) keys the slot's
prediction names, and when one of them is still pending, every count recorded since the last
exchange (the microbatches and MoE layers whose routers ran in between, in Program order, the
same on every EP peer) goes over the count transport (:mod:`tessera.train.dbo.transport`) in
one exchange of ``k * E`` int64 values (a slot that needs none of them exchanges nothing, on
every peer alike, so the pending counts of several instructions travel together). The transport
is built over the EP *counts* group (:class:`tessera.engine.groups.RankGroups` ``ep_counts``, a
communicator of its own: on NCCL an exchange never queues behind a row all-to-all of the EP
group). Recorded counts stay where the router made them (a device tensor) until the exchange
reads all of them on the host at once: one host synchronisation per exchange, none per router.
Summed over the EP group each row is the (mb, layer)'s per-expert counts (the
:class:`~tessera.dbo.counts.TokenCounts` convention); the policy re-predicts the slots and W still
ahead from the EP ranks' loads (contiguous expert blocks, as
:mod:`tessera.model.ep` places them). A slot reached before its microbatch's routers ran (the
``ep_f`` slot in front of its own ``F``) keeps the prior prediction; a slot whose cause lies on
another pipeline rank (a receive's sender) keeps the sender's part.

Counts still pending at the end of an iteration (routers after the last slot) are dropped on every
peer alike (:meth:`reset`, at the next iteration's start). Per iteration :meth:`summary` gives
``dbo_count_exchange_ms`` (wall time in exchanges, ms), ``dbo_count_exchanges``,
``dbo_count_rows`` ((mb, layer) rows received), ``dbo_count_tokens`` (sum of every received
count) and ``dbo_count_digest`` (a hash of everything received, in order, below 2**31: equal on
every EP peer when they received the same counts).
"""

from __future__ import annotations

import time

import numpy as np

_MOD = 2 ** 31 - 1
_MUL = 1_000_003


def digest(values, start: int = 0) -> int:
    """Polynomial hash of the int64 ``values`` (in order) continuing from ``start``, mod 2**31 - 1
    (exact in float64, so it survives the metrics' float gather)."""
    d = int(start)
    for x in np.asarray(values, dtype=np.int64).ravel().tolist():
        d = (d * _MUL + int(x)) % _MOD
    return d


class LiveCounts:
    """The EP group's router counts of the running iteration (module docstring).

    Args:
        transport: a :class:`~tessera.train.dbo.transport.CountTransport` over the EP group, or
            None without EP (``ep == 1``: the rank's own counts are the group's).
        ep: EP group size (the transport's peers).

    Calling the object (``needed``: the (mb, layer) keys the caller predicts from; None: any)
    exchanges what was recorded since the last exchange when a needed key is among it and
    returns ``{(mb, layer): (tokens of EP rank 0's experts, ...)}`` for all of it (empty when
    no needed key is pending: then no exchange runs, on any peer).

    Raises:
        ValueError: ``ep`` < 1, or (when called) an expert count not divisible by ``ep``.
    """

    def __init__(self, transport, ep: int) -> None:
        if ep < 1:
            raise ValueError(f"LiveCounts: ep={ep} must be >= 1")
        self.transport, self.ep = transport, ep
        self._pending: list[tuple[int, int, object]] = []  # counts: a tensor or an int64 array
        self._clock = None  # host time unless use_clock
        self.reset()

    def use_clock(self, clock) -> None:
        """Time the exchanges with ``clock`` (anything with ``mark()``, ``add(start, stop)``,
        ``ms`` and ``reset()``: the engine's :class:`~tessera.engine.timing.SpanTotal`), so that
        ``dbo_count_exchange_ms`` is on the clock of the engine's slot times it is subtracted from
        (CUDA events on a GPU, not host time); default: host time."""
        self._clock = clock
        clock.reset()

    def reset(self) -> None:
        """Drop pending counts and the iteration's counters (every peer at the same point)."""
        self._pending = []
        self._ms, self._exchanges, self._rows, self._tokens, self._digest = 0.0, 0, 0, 0, 0
        if getattr(self, "_clock", None) is not None:
            self._clock.reset()

    def routed(self, mb: int, layer: int, requested) -> None:
        """Record this rank's per-expert counts of (``mb``, ``layer``) (a tensor or array ``[E]``;
        a tensor is kept as it is, not read on the host until the exchange)."""
        if hasattr(requested, "detach"):
            requested = requested.detach().reshape(-1)
        else:
            requested = np.asarray(requested, dtype=np.int64).ravel().copy()
        self._pending.append((int(mb), int(layer), requested))

    def __call__(self, needed=None) -> dict[tuple[int, int], tuple[int, ...]]:
        if not self._pending:
            return {}
        if needed is not None:
            needed = set(needed)
            if not any((mb, layer) in needed for mb, layer, _ in self._pending):
                return {}
        pending, self._pending = _on_host(self._pending), []
        e = pending[0][2].size
        if e % self.ep or any(c.size != e for _, _, c in pending):
            raise ValueError(f"LiveCounts: {e} experts per layer must be divisible by ep={self.ep}, the same for every "
                             "MoE layer")
        flat = np.concatenate([c for _, _, c in pending])
        t0 = time.perf_counter() if self._clock is None else self._clock.mark()
        rows = self.transport.exchange(flat) if self.transport is not None else flat[None, :]
        if self._clock is None:
            self._ms += (time.perf_counter() - t0) * 1e3
        else:
            self._clock.add(t0, self._clock.mark())
        if rows.shape != (self.ep, flat.size):
            raise RuntimeError(f"LiveCounts: the transport returned shape {rows.shape}, expected ({self.ep}, "
                               f"{flat.size})")
        self._exchanges += 1
        self._rows += len(pending)
        self._tokens += int(rows.sum())
        self._digest = digest(rows, self._digest)
        group = rows.sum(axis=0).reshape(len(pending), self.ep, e // self.ep).sum(axis=2)  # [k, ep] loads
        return {(mb, layer): tuple(int(x) for x in group[i]) for i, (mb, layer, _) in enumerate(pending)}

    def summary(self) -> dict:
        """The iteration's exchange counters, keyed as in ``metrics.jsonl`` (module docstring)."""
        ms = self._ms if self._clock is None else self._clock.ms
        return {"dbo_count_exchange_ms": ms, "dbo_count_exchanges": self._exchanges,
                "dbo_count_rows": self._rows, "dbo_count_tokens": self._tokens, "dbo_count_digest": self._digest}

    def close(self) -> None:
        """Close the transport (collective over the EP group; idempotent)."""
        if self.transport is not None:
            self.transport.close()


def _on_host(pending: list) -> list[tuple[int, int, np.ndarray]]:
    """``pending`` with every count as an int64 array; the tensors among them are read on the
    host together (one ``torch.cat(...).cpu()`` per device: one synchronisation)."""
    import torch

    by_device: dict = {}
    for i, (_, _, c) in enumerate(pending):
        if isinstance(c, torch.Tensor):
            by_device.setdefault(c.device, []).append(i)
    host = {}
    for idx in by_device.values():
        flat = torch.cat([pending[i][2].to(torch.int64) for i in idx]).cpu().numpy()
        offsets = np.cumsum([0] + [pending[i][2].numel() for i in idx])
        host.update({i: flat[offsets[k]:offsets[k + 1]] for k, i in enumerate(idx)})
    return [(mb, layer, host.get(i, c)) for i, (mb, layer, c) in enumerate(pending)]


def make_live(recipe, groups, device: str = "cpu", logger=None) -> LiveCounts | None:
    """The rank's :class:`LiveCounts` when ``dbo.enabled`` and ``dbo.routing: router``, else None.
    With EP (``parallel.ep`` > 1) every rank of the EP group must call it (the transport is built
    collectively over the EP counts group, ``groups.ep_counts``, else ``groups.ep``:
    ``dbo.transport``, ``dbo.count_timeout_s``); without EP no transport is built.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised (EP only).
    """
    d = recipe.dbo
    if not d.enabled or d.routing != "router":
        return None
    ep = recipe.parallel.ep
    if ep == 1 or groups is None or groups.ep is None:
        return LiveCounts(None, 1)
    from tessera.train.dbo.factory import make_transport

    dev = device if device.startswith("cuda") else "cpu"
    group = groups.ep_counts if getattr(groups, "ep_counts", None) is not None else groups.ep
    return LiveCounts(make_transport(d.transport, group, device=dev, timeout_s=d.count_timeout_s, logger=logger), ep)
