"""The dynamic bubble optimizer with layer-level W and the EP group's joint choice.

:class:`JointDBOPolicy` is a :class:`~tessera.engine.dbo.DBOPolicy` whose movable unit is a part
of a chunk's W (one layer's W, or its expert W and the rest apart: :mod:`tessera.dbo.units`) and
whose choice at a slot is the joint rule of :class:`tessera.dbo.joint.JointPool`: every EP peer
runs the same Program on the same token counts, so each process replays its peers' pools too and
takes its own part of a choice they all agree on, with no communication. The engine runs a
chosen :class:`~tessera.engine.pool.MovableUnit` through the chunk's ``run_w(mb, key)`` for each
of its W task keys (accumulation per parameter stays in microbatch order:
:meth:`~tessera.engine.pool.MovablePool.unit_eligible`); the memory cap and the deadline still
run a chunk's whole remaining W (:meth:`~tessera.engine.pool.MovablePool.due`).

The joint pool's state starts again when a ``register_w`` comes a second time (a new
iteration), and at :meth:`reset`. Counters: ``moved`` counts units run in slots, ``at_once``
and ``forced`` chunk W (as :class:`~tessera.engine.dbo.DBOPolicy`). ``overhead_ms`` is the
decisions' CPU time on the calling thread (``time.thread_time``): on a host shared by many
emulated ranks, wall time would count the time the process waits for a core.
"""

from __future__ import annotations

import math
import time

from tessera.dbo.choice import SlotChoice
from tessera.dbo.joint import JointPool
from tessera.dbo.predict import RankTable
from tessera.dbo.units import UnitTable
from tessera.engine.dbo import DBOPolicy
from tessera.engine.pool import MovablePool, MovableTask, MovableUnit
from tessera.program.instructions import Instr


class JointDBOPolicy(DBOPolicy):
    """Layer-level W, chosen jointly by the EP group (module doc).

    Args:
        table: the rank's predictions (:func:`tessera.dbo.predict.rank_tables`).
        units: its units (:func:`tessera.dbo.units.unit_table` of ``table`` and the rank's Program).
        ep_rank, pool_mem_gb, log, live: as :class:`~tessera.engine.dbo.DBOPolicy`.
        joint: the gain rule (False: each EP rank fills alone; the result per rank is the same
            rule the simulator runs with ``joint=False``).

    Raises:
        ValueError: as :class:`~tessera.engine.dbo.DBOPolicy`; ``units`` of another rank or EP size.
    """

    def __init__(self, table: RankTable, units: UnitTable, ep_rank: int = 0, pool_mem_gb: float = math.inf,
                 log: bool = False, live=None, joint: bool = True) -> None:
        super().__init__(table, ep_rank, pool_mem_gb=pool_mem_gb, log=log, live=live)
        if (units.rank, units.ep) != (table.rank, table.ep):
            raise ValueError(f"units of rank {units.rank} (ep={units.ep}) for the table of rank {table.rank} "
                             f"(ep={table.ep}); build them with unit_table(table, program, costs)")
        self.prior_units = units
        self.joint_pool = JointPool(units, self.cap_bytes, joint)
        self._movable: dict[tuple, MovableUnit] = {}  # unit key -> the engine's unit (values, built once)

    def reset(self) -> None:
        super().reset()
        self.joint_pool.set_units(self.prior_units)
        self.joint_pool.reset()

    def update(self, loads) -> None:
        before = self.table
        super().update(loads)
        if self.table is not before:
            t0 = time.thread_time()
            self.joint_pool.set_units(self.prior_units.with_table(self.table))
            self._add(overhead_ms=(time.thread_time() - t0) * 1e3)

    def select(self, slot: Instr, pool: MovablePool) -> tuple[MovableUnit, ...]:
        """The units to run at ``slot``, in run order; () for a slot without a cause."""
        if not slot.cause:
            return ()
        pred = self.prediction(slot)
        t0 = time.thread_time()
        e = self.ep_rank
        mine = self.joint_pool.slot([pred.usable_ms(x) for x in range(self.table.ep)])[e]
        filled = sum(u.ms[e] for u in mine)
        if self.keep_log:
            self.log.append(SlotChoice(self.table.rank, e, pred.index, slot.cause, pred.idle_ms[e],
                                       pred.usable_ms(e), tuple(u.key for u in mine), filled))
        mv = self._movable
        out = tuple(mv.get(u.key) or mv.setdefault(u.key, MovableUnit(u.chunk, u.mb, u.layer, u.kinds)) for u in mine)
        self._add(slots=1, annotated_ms=pred.idle_ms[e], filled_ms=filled, moved=len(mine),
                  overhead_ms=(time.thread_time() - t0) * 1e3)
        return out

    def on_register(self, task: MovableTask, pool: MovablePool) -> tuple[MovableTask, ...]:
        """After ``task`` joined the pool: its chunk's W to run at once (the memory cap), else ()."""
        t0 = time.thread_time()
        jp = self.joint_pool
        if (task.chunk, task.mb) in jp.seen:  # a new iteration
            jp.reset()
        now = jp.register(task.chunk, task.mb)[self.ep_rank]
        due = pool.due(task) if now else ()
        self._add(peak=jp.peaks[self.ep_rank], at_once=len(due), overhead_ms=(time.thread_time() - t0) * 1e3)
        return due

    def on_deadline(self, task: MovableTask, pending: bool) -> None:
        """The ``W`` instruction of ``task``: every EP rank's pending units of its chunk up to
        its microbatch run (counted as forced on this rank when it had any)."""
        t0 = time.thread_time()
        self.joint_pool.deadline(task.chunk, task.mb)
        self._add(forced=int(pending), overhead_ms=(time.thread_time() - t0) * 1e3)
