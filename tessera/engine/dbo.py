"""The dynamic bubble optimizer in the engine: a :class:`~tessera.engine.pool.SlotPolicy`.

:class:`DBOPolicy` is given the rank's :class:`~tessera.dbo.predict.RankTable` (slot predictions
and movable tasks, from the token counts and the cost model) and its EP rank. At each annotated
``slot`` it runs what :func:`tessera.dbo.choice.choose` picks for the predicted usable length; when
a ``register_w`` would make the pending W hold more than ``pool_mem_gb`` it runs that W at once
(:meth:`on_register`); a W still pending at its ``W`` instruction runs there (the engine's
deadline rule), counted as a forced deadline run. The choice per slot is kept in :attr:`log`
when ``log=True``; :meth:`stats` sums what happened since construction or :meth:`reset`.
Its movable unit is a chunk's whole W; :class:`tessera.engine.dbo_joint.JointDBOPolicy` (a
subclass) moves parts of it (one layer's W, or its expert W apart from the rest) and chooses
jointly with the EP peers (docs/dbo.md, "Layer-level W and the EP group's joint choice").

Live counts: with ``live`` (a callable given the (mb, layer) keys of the slot's prediction and
returning ``{(mb, layer): EP ranks' token loads}`` that arrived since its last answer, e.g.
:class:`tessera.train.dbo.live.LiveCounts`, which exchanges the EP group's router counts), every
slot first asks it and re-predicts the table
(:meth:`~tessera.dbo.predict.RankTable.with_loads`) before choosing; :meth:`reset` goes back to
the table given at construction (the prior), so each iteration predicts from its own counts.
``live`` is called at every annotated slot on every EP rank in Program order with keys taken
from the table alone (never from the pool, whose content differs between EP peers), so every
peer makes the same calls with the same keys: it may run a collective.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

from tessera.dbo.choice import SlotChoice, choose, fill_rate, over_cap
from tessera.dbo.predict import RankTable
from tessera.engine.pool import MovablePool, MovableTask
from tessera.engine.values import EngineError
from tessera.program.instructions import Instr


@dataclass(frozen=True)
class DBOStats:
    """Counters of a :class:`DBOPolicy` (times predicted, ms; memory, bytes).

    slots: annotated slots reached; annotated_ms: their predicted idle time; filled_ms: predicted
    duration of the tasks run in them; moved: W run in a slot; at_once: W run at registration
    (memory cap); forced: W still pending at their deadline; pool_peak_bytes: most memory the
    pending W held; overhead_ms: wall time of the policy's own decisions (:meth:`select`,
    :meth:`on_register`, re-predictions; the W it picks run afterwards, in the engine, and the
    ``live`` call's own time is not in it); live_loads: (mb, layer) loads received from ``live``."""

    slots: int = 0
    annotated_ms: float = 0.0
    filled_ms: float = 0.0
    moved: int = 0
    at_once: int = 0
    forced: int = 0
    pool_peak_bytes: float = 0.0
    overhead_ms: float = 0.0
    live_loads: int = 0

    @property
    def bubble_fill_rate(self) -> float:
        """filled slot time / annotated slot time (0 without annotated time)."""
        return fill_rate(self.filled_ms, self.annotated_ms)


class DBOPolicy:
    """Best-fit slot filling from predictions (module doc).

    Args:
        table: the rank's predictions and movable tasks (:func:`tessera.dbo.predict.rank_tables`).
        ep_rank: this process's rank in its EP group (0 without EP).
        pool_mem_gb: cap on the memory the pending W hold, GB (``dbo.pool_mem_gb``; inf: none).
        log: keep a :class:`~tessera.dbo.choice.SlotChoice` per slot in :attr:`log`.
        live: source of live loads, called at each annotated slot (module doc; None: the table's
            predictions only).

    Raises:
        ValueError: ``ep_rank`` outside the table's EP group, ``pool_mem_gb`` < 0.
    """

    def __init__(self, table: RankTable, ep_rank: int = 0, pool_mem_gb: float = math.inf, log: bool = False,
                 live: Callable[[set], Mapping] | None = None) -> None:
        if not 0 <= ep_rank < table.ep:
            raise ValueError(f"ep_rank={ep_rank} is not a rank of the table's EP group (ep={table.ep})")
        if not pool_mem_gb >= 0:
            raise ValueError(f"dbo.pool_mem_gb={pool_mem_gb} must be >= 0")
        self.table, self.ep_rank, self.cap_bytes, self.keep_log = table, ep_rank, pool_mem_gb * 1e9, log
        self.prior, self.live = table, live
        self.log: list[SlotChoice] = []
        self._counts = asdict(DBOStats())  # the DBOStats fields, summed in place (stats() freezes them)

    def reset(self) -> None:
        """Forget the log, the counters and the live loads (back to the prior table)."""
        self.log, self._counts, self.table = [], asdict(DBOStats()), self.prior

    def update(self, loads: Mapping) -> None:
        """Re-predict from ``loads`` (``{(mb, layer): EP ranks' tokens}``;
        :meth:`~tessera.dbo.predict.RankTable.with_loads`).

        Raises:
            EngineError: a load vector of the wrong length."""
        if not loads:
            return
        t0 = time.perf_counter()
        try:
            self.table = self.table.with_loads(loads)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._add(live_loads=len(loads), overhead_ms=(time.perf_counter() - t0) * 1e3)

    def stats(self) -> DBOStats:
        """The counters since construction or :meth:`reset`."""
        return DBOStats(**self._counts)

    def _held(self, pool: MovablePool, but: MovableTask | None = None) -> float:
        return sum(self.table.task(t.chunk, t.mb).mem_bytes for t in pool.pending() if t != but)

    def _add(self, peak: float | None = None, **inc) -> None:
        c = self._counts
        for k, v in inc.items():
            c[k] += v
        if peak is not None:
            c["pool_peak_bytes"] = max(c["pool_peak_bytes"], peak)

    def prediction(self, slot: Instr):
        """The table's prediction of ``slot``, re-predicted first from the live counts its terms
        need (``live``).

        Raises:
            EngineError: the table has no prediction for ``slot``.
        """
        try:
            pred = self.table.slot(slot)
        except KeyError as e:
            raise EngineError(str(e.args[0])) from None
        if self.live is not None:
            self.update(self.live({(t.mb, t.layer) for t in pred.terms}))
            pred = self.table.slot(slot)
        return pred

    def select(self, slot: Instr, pool: MovablePool) -> tuple[MovableTask, ...]:
        """The W to run at ``slot`` (each chain in microbatch order); () for a slot without a cause."""
        if not slot.cause:
            return ()
        pred = self.prediction(slot)
        t0 = time.perf_counter()
        pending = [(t.chunk, t.mb) for t in pool.pending()]
        tasks = {k: self.table.task(*k) for k in pending}
        usable = pred.usable_ms(self.ep_rank)
        chosen = choose(pending, lambda k: pool.eligible(MovableTask(*k)), {k: t.ms[self.ep_rank] for k, t in
                                                                            tasks.items()},
                        {k: t.deadline for k, t in tasks.items()}, usable)
        filled = sum(tasks[k].ms[self.ep_rank] for k in chosen)
        if self.keep_log:
            self.log.append(SlotChoice(self.table.rank, self.ep_rank, pred.index, slot.cause,
                                       pred.idle_ms[self.ep_rank], usable, chosen, filled))
        self._add(slots=1, annotated_ms=pred.idle_ms[self.ep_rank], filled_ms=filled, moved=len(chosen),
                  overhead_ms=(time.perf_counter() - t0) * 1e3)
        return tuple(MovableTask(*k) for k in chosen)

    def on_register(self, task: MovableTask, pool: MovablePool) -> tuple[MovableTask, ...]:
        """After ``task`` joined the pool: what to run at once (the memory cap), else ()."""
        t0 = time.perf_counter()
        held = self._held(pool, but=task)
        mem = self.table.task(task.chunk, task.mb).mem_bytes
        if over_cap(held, mem, self.cap_bytes) and pool.eligible(task):
            due = pool.due(task)
            self._add(peak=held, at_once=len(due), overhead_ms=(time.perf_counter() - t0) * 1e3)
            return due
        self._add(peak=held + mem, overhead_ms=(time.perf_counter() - t0) * 1e3)
        return ()

    def on_deadline(self, task: MovableTask, pending: bool) -> None:
        """The ``W`` instruction of ``task`` is reached; ``pending``: it had not run yet."""
        if pending:
            self._add(forced=1)


def iteration_summary(stats: DBOStats, *, slot_ms: float, idle_ms: float, a2a_wait_ms: float | None = None) -> dict:
    """One rank's DBO metrics of one iteration, keyed as in ``metrics.jsonl``
    (:func:`tessera.train.worker.metrics.with_dbo` combines the ranks').

    Args:
        stats: the policy's counters over exactly that iteration (:meth:`DBOPolicy.reset` at
            its start, :meth:`DBOPolicy.stats` at its end).
        slot_ms: measured run time of the W the policy moved into slots, ms (``IterationResult.slot_ms``).
        idle_ms: measured pipeline-receive wait of the iteration, ms (``IterationResult.idle_ms``).
        a2a_wait_ms: measured wait on EP all-to-alls, ms (``IterationResult.a2a_wait_ms``; None without EP).

    Returns: ``dbo_slots``, ``dbo_tasks_moved`` (W run in a slot), ``dbo_forced_deadline_runs``,
    ``dbo_pool_mem_peak_gb`` (GB = 1e9 bytes), ``dbo_overhead_ms``, ``dbo_annotated_ms`` and
    ``dbo_filled_ms`` (predicted, ms), ``dbo_live_loads`` ((mb, layer) loads received live),
    ``dbo_measured_slot_ms = slot_ms + idle_ms + a2a_wait_ms`` (the bubble the rank saw: filled
    plus still waiting on pipeline receives and EP all-to-alls) and ``dbo_slot_pred_err =
    (annotated - measured) / measured`` (signed; -1 when the table predicted no idle time at all,
    e.g. uniform routing without live counts; None when nothing was measured).
    """
    measured = slot_ms + idle_ms + (a2a_wait_ms or 0.0)
    return {"dbo_slots": stats.slots, "dbo_tasks_moved": stats.moved, "dbo_forced_deadline_runs": stats.forced,
            "dbo_pool_mem_peak_gb": stats.pool_peak_bytes / 1e9, "dbo_overhead_ms": stats.overhead_ms,
            "dbo_annotated_ms": stats.annotated_ms, "dbo_filled_ms": stats.filled_ms,
            "dbo_measured_slot_ms": measured, "dbo_live_loads": stats.live_loads,
            "dbo_slot_pred_err": (stats.annotated_ms - measured) / measured if measured > 0 else None}
