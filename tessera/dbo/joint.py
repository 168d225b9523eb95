"""The EP group's joint choice of layer-level W (:mod:`tessera.dbo.units`) at each slot.

Every EP peer of a pipeline rank runs the same Program and knows the same token counts, so each
can compute, with no communication, what every peer has pending and what every peer will choose:
a :class:`JointPool` holds the pending units of *all* EP ranks of one pipeline rank and replays
the same events (``register_w``, annotated slots, ``W`` deadlines) in Program order. The
simulator (:mod:`tessera.sim.dbo`) runs one per pipeline rank; the engine's policy runs one per
process and takes its own EP rank's part, and the peers' parts it computes agree with what the
peers do.

Why joint: a compute instruction with MoE layers starts when the *last* EP rank reaches it, so
the group waits, after a deadline, for the EP rank with the most W still pending there (its
experts hold the most tokens, so its expert W are the longest). A W moved into idle time on any
other rank shortens nothing. The group's cost of the W forced at the deadlines before a sync
point ``s`` (:func:`tessera.dbo.units.sync_points`) is ``max_e L_e(s)``, ``L_e(s)`` the pending W
time of rank ``e`` due there, and a chain moved into a slot (inside the slot's idle, so it costs
nothing) changes it by the chain's *gain*
``sum_s max_e' L_e'(s) - max(L_e(s) - chain_e(s), max_{e' != e} L_e'(s))``.

The rule at a slot, given each EP rank's usable length (``idle / (1 + margin)``):

1. **Gain first.** Repeatedly, over every EP rank and every chain that fits its usable time
   left, take the largest gain (then the longest chain, the earliest deadline, the lowest EP
   rank, the lowest (chunk, mb, layer)); stop when no fitting chain gains.
2. **Then fill.** On each EP rank, the rule of :func:`tessera.dbo.choice.choose` (best fit, then
   earliest deadline) on what is left: a move inside idle time is free, and W run early cannot
   be waited for later.

A chain: running the unit of (chunk, mb, layer) first runs the pending units of (chunk, mb',
layer), ``mb' < mb``, in microbatch order (one layer's parameters accumulate in microbatch
order, so results are bitwise the same whatever runs where); a chain may start only at a unit
whose chunk has every earlier microbatch registered. At a ``W`` instruction every pending unit
of the chunk with ``mb' <= mb`` runs (the deadline); at a ``register_w`` whose W would make the
pending units of an EP rank hold more than the cap, those units run at once on that rank (the
memory rule, :func:`tessera.dbo.choice.over_cap`).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from tessera.dbo.choice import over_cap
from tessera.dbo.units import UnitTable, WUnit

_EPS = 1e-9


class JointPool:
    """Pending layer-level W of every EP rank of one pipeline rank (module doc).

    Args:
        units: the rank's units (:func:`tessera.dbo.units.unit_table`).
        cap_bytes: the memory cap per EP rank (``dbo.pool_mem_gb * 1e9``; inf: none).
        joint: use the gain rule (step 1); False: each EP rank fills alone (step 2 only).
    """

    def __init__(self, units: UnitTable, cap_bytes: float = math.inf, joint: bool = True) -> None:
        self.ep, self.cap, self.joint = units.ep, cap_bytes, joint
        self.reset()
        self.set_units(units)

    def set_units(self, units: UnitTable) -> None:
        """Use re-predicted durations (same units, e.g. from live loads); the pending units take
        them too (the loads already counted keep the durations they were added with)."""
        self.units = units
        self._by = units.by_key()
        self._of: dict[tuple[int, int], list[WUnit]] = {}
        for u in units.units:
            self._of.setdefault((u.chunk, u.mb), []).append(u)
        for pend in self.pending:
            for lst in pend.values():
                lst[:] = [self._by[u.key] for u in lst]

    def reset(self) -> None:
        """Start of an iteration: nothing pending."""
        E = range(self.ep)
        self.pending: list[dict[tuple, list[WUnit]]] = [{} for _ in E]  # chain -> its units, by mb
        self.load: list[dict[int, float]] = [{} for _ in E]  # sync index -> pending ms due before it
        self.held = [0.0] * self.ep
        self.peaks = [0.0] * self.ep  # most memory each EP rank's pending units held, bytes
        self.seen: set[tuple[int, int]] = set()  # (chunk, mb) registered this iteration
        self._next: dict[int, int] = {}  # chunk -> first microbatch not registered

    @property
    def peak(self) -> float:
        """Most memory one EP rank's pending units held, bytes."""
        return max(self.peaks)

    # --- events --------------------------------------------------------------------------------
    def register(self, chunk: int, mb: int) -> tuple[tuple[WUnit, ...], ...]:
        """``register_w`` of (chunk, mb): its units join every EP rank's pool; returns per EP
        rank the units run at once (memory cap), in run order."""
        units = self._of.get((chunk, mb), [])
        self.seen.add((chunk, mb))
        n = self._next.get(chunk, 0)
        while (chunk, n) in self.seen:
            n += 1
        self._next[chunk] = n
        mem = sum(u.mem_bytes for u in units)
        out = []
        for e in range(self.ep):
            before = self.held[e]
            self._add(e, units)
            if over_cap(before, mem, self.cap) and mb < n:
                self.peaks[e] = max(self.peaks[e], before)
                out.append(self._run_due(e, chunk, mb))
            else:
                self.peaks[e] = max(self.peaks[e], self.held[e])
                out.append(())
        return tuple(out)

    def deadline(self, chunk: int, mb: int) -> tuple[tuple[WUnit, ...], ...]:
        """``W`` of (chunk, mb): per EP rank the units still pending of the chunk with
        ``mb' <= mb`` (they run now, in microbatch order)."""
        return tuple(self._run_due(e, chunk, mb) for e in range(self.ep))

    def slot(self, usable: Sequence[float]) -> tuple[tuple[WUnit, ...], ...]:
        """The units each EP rank runs in a slot with ``usable[e]`` ms usable (module doc), in
        run order; they are removed from the pools."""
        E = range(self.ep)
        budget = [float(x) for x in usable]
        if not any(b > _EPS and p for b, p in zip(budget, self.pending)):
            return tuple(() for _ in E)  # nothing to run, nowhere to run it
        out: list[list[WUnit]] = [[] for _ in E]
        cands: list[list] = [[] for _ in E]
        for e in E:
            if budget[e] <= _EPS or not self.pending[e]:
                continue
            every = self._cands(e, math.inf)
            longest: dict = {}
            for c in every:  # a rank whose usable time holds all it may run takes it all
                longest[c[1]] = c
            if longest and sum(c[0] for c in longest.values()) <= budget[e] + _EPS:
                for c in longest.values():
                    chain = _chain(c)
                    self._take(e, chain)
                    out[e] += chain
                budget[e] = 0.0
            else:
                lim = budget[e] + _EPS
                cands[e] = [c for c in every if c[0] <= lim]
        # one sync point among the candidates: each rank moving all it can is what shortens the
        # group's wait there (step 2); the gain decides between sync points
        if self.joint and self.ep > 1 and _several_syncs(cands):
            while True:
                best = None
                top = self._top2()
                for e in E:
                    lim = budget[e] + _EPS
                    for c in cands[e]:
                        d = c[0]
                        if d > lim:
                            continue
                        g = self._gain(e, _parts(c, e), top)
                        if g <= _EPS:
                            continue
                        lst = c[3]
                        key = (-g, -d, lst[0].deadline, e, lst[c[2] - 1].key)
                        if best is None or key < best[0]:
                            best = (key, e, c)
                if best is None:
                    break
                _, e, c = best
                self._run_chain(e, c, out, budget, cands)
        for e in E:
            while budget[e] > _EPS and cands[e]:
                best = None
                lim = budget[e] + _EPS
                for c in cands[e]:
                    if c[0] > lim:
                        continue
                    lst = c[3]
                    key = (-c[0], lst[0].deadline, lst[c[2] - 1].key)
                    if best is None or key < best[0]:
                        best = (key, c)
                if best is None:
                    break
                self._run_chain(e, best[1], out, budget, cands)
        return tuple(tuple(x) for x in out)

    def _run_chain(self, e: int, c: tuple, out: list, budget: list, cands: list) -> None:
        """Run candidate ``c`` on EP rank ``e`` in a slot: out of the pool, into ``out[e]``, off
        ``budget[e]``, and ``cands[e]`` refreshed."""
        chain = _chain(c)
        self._take(e, chain)
        out[e] += chain
        budget[e] -= c[0]
        cands[e] = self._refresh(e, cands[e], c[1], budget[e])

    # --- internals -----------------------------------------------------------------------------
    def _add(self, e: int, units: Sequence[WUnit]) -> None:
        pend, load = self.pending[e], self.load[e]
        for u in units:
            lst = pend.setdefault(u.chain, [])
            if lst and lst[-1].mb > u.mb:
                bisect.insort(lst, u, key=_mb)
            else:
                lst.append(u)
            load[u.sync] = load.get(u.sync, 0.0) + u.ms[e]
            self.held[e] += u.mem_bytes

    def _take(self, e: int, chain: Sequence[WUnit]) -> None:
        pend, load = self.pending[e], self.load[e]
        for u in chain:
            lst = pend[u.chain]
            lst.remove(u)
            if not lst:
                del pend[u.chain]
            load[u.sync] -= u.ms[e]
            self.held[e] -= u.mem_bytes

    def _run_due(self, e: int, chunk: int, mb: int) -> tuple[WUnit, ...]:
        due = []
        for ck, lst in self.pending[e].items():
            if ck[0] == chunk:
                for u in lst:
                    if u.mb > mb:
                        break
                    due.append(u)
        due.sort(key=_order)
        units = tuple(due)
        self._take(e, units)
        return units

    def _refresh(self, e: int, cands: list, ck: tuple, budget: float) -> list:
        """``cands`` after a chain of ``ck`` ran: that (chunk, layer, kinds)'s chains again, the
        others kept where they still fit ``budget``."""
        lim = budget + _EPS
        return [c for c in cands if c[1] != ck and c[0] <= lim] + self._cands(e, budget, ck)

    def _cands(self, e: int, budget: float, only: tuple | None = None) -> list:
        """Every eligible chain of EP rank ``e`` lasting (0, budget] ms on it, as ``(duration,
        (chunk, layer, kind), length, pending units of that (chunk, layer, kind))``: a chain is
        a prefix of the pending microbatches of one (chunk, layer, kind), so its first unit has
        the earliest deadline (:func:`_chain` builds it, :func:`_parts` its time per sync
        point, only for the chains that need them)."""
        out = []
        lim = budget + _EPS
        nxt_of = self._next
        pend = self.pending[e]
        items = pend.items() if only is None else ((only, pend.get(only, ())),)
        for ck, lst in items:
            nxt = nxt_of.get(ck[0], 0)
            d = 0.0
            n = 0
            for u in lst:
                if u.mb >= nxt:
                    break
                d += u.ms[e]
                if d > lim:
                    break
                n += 1
                if d > _EPS:
                    out.append((d, ck, n, lst))
        return out

    def _top2(self) -> dict[int, tuple[float, int, float]]:
        """Per sync index: (largest pending load, its EP rank, the second largest)."""
        out: dict[int, tuple[float, int, float]] = {}
        for e, load in enumerate(self.load):
            for s, x in load.items():
                m1, a, m2 = out.get(s, (0.0, -1, 0.0))
                out[s] = (x, e, m1) if x > m1 else (m1, a, max(m2, x))
        return out

    def _gain(self, e: int, parts: dict[int, float], top: dict[int, tuple[float, int, float]]) -> float:
        """How much moving a chain with ``parts`` ({sync: ms}) off EP rank ``e`` shortens the
        group's waits at the sync points (module doc)."""
        g = 0.0
        for s, x in parts.items():
            m1, a, m2 = top[s]
            if a != e:  # e is not the slowest there: no gain
                continue
            g += m1 - max(m1 - x, m2)
        return g


def _mb(u: WUnit) -> int:
    return u.mb


def _order(u: WUnit) -> tuple:
    return (u.mb, u.layer, u.kinds)


def _chain(c: tuple) -> tuple[WUnit, ...]:
    """The units of candidate ``c`` (:meth:`JointPool._cands`), in run order."""
    return tuple(c[3][:c[2]])


def _parts(c: tuple, e: int) -> dict[int, float]:
    """Candidate ``c``'s duration on EP rank ``e`` per sync index, ms."""
    parts: dict[int, float] = {}
    for u in c[3][:c[2]]:
        parts[u.sync] = parts.get(u.sync, 0.0) + u.ms[e]
    return parts


def _several_syncs(cands: list) -> bool:
    """Whether the candidates (per EP rank, as :meth:`JointPool._cands`) are due before more
    than one sync point."""
    first = None
    for c in cands:
        for cand in c:
            for u in cand[3][:cand[2]]:
                if first is None:
                    first = u.sync
                elif u.sync != first:
                    return True
    return False
