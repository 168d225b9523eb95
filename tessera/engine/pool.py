"""The movable-task pool: deferred weight-gradient (W) tasks waiting to run.

A ``register_w`` instruction hands the W of ``(mb, chunk)`` to the pool; it may then run early,
in an idle slot chosen by a :class:`SlotPolicy` (the dynamic bubble optimizer's hook), and runs
at the latest at its ``W`` instruction (its deadline). Accumulation order must never depend on the
schedule, so the W tasks of one chunk (one set of parameters) run in microbatch order: running a
task first runs every pending task of the same chunk with a smaller microbatch
(:meth:`MovablePool.due`), and a policy may only pick :meth:`MovablePool.eligible` tasks (no
earlier microbatch of the chunk still to be registered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from tessera.program.instructions import Instr


@dataclass(frozen=True, order=True)
class MovableTask:
    """The deferred W of microbatch ``mb`` of local chunk ``chunk``."""

    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"W(mb{self.mb}.c{self.chunk})"


@dataclass(frozen=True, order=True)
class MovableUnit:
    """Part of the deferred W of (``chunk``, ``mb``): the W tasks of decoder ``layer`` (``-1`` the
    embedding), only those of the task kinds ``kinds`` when given (``()``: all of the layer's). Its
    parameters accumulate in microbatch order, so it may run only after the same unit of every
    earlier microbatch of the chunk (:meth:`MovablePool.unit_eligible`); the engine runs the
    chunk's ``run_w(mb, key)`` for each of its W task keys."""

    chunk: int
    mb: int
    layer: int
    kinds: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"W(mb{self.mb}.c{self.chunk}.l{self.layer}{''.join('.' + k for k in self.kinds)})"

    @property
    def task(self) -> MovableTask:
        return MovableTask(self.chunk, self.mb)


class MovablePool:
    """Pending movable tasks of one iteration (per chunk, kept in microbatch order).

    Args:
        max_pending: cap on pending tasks (each holds activations until it runs); None: no cap.
    """

    def __init__(self, max_pending: int | None = None) -> None:
        self.max_pending = max_pending
        self._pending: set[MovableTask] = set()
        self._done: set[MovableTask] = set()
        self._units: set[MovableUnit] = set()  # units run of still pending tasks

    def reset(self) -> None:
        """Forget everything (start of an iteration)."""
        self._pending.clear()
        self._done.clear()
        self._units.clear()

    def register(self, task: MovableTask) -> None:
        """Add ``task``.

        Raises:
            ValueError: registered twice in the iteration, or the cap is reached.
        """
        if task in self._pending or task in self._done:
            raise ValueError(f"{task} registered twice in one iteration")
        if self.max_pending is not None and len(self._pending) >= self.max_pending:
            raise ValueError(f"movable pool full ({self.max_pending} pending) when registering {task}")
        self._pending.add(task)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, task: MovableTask) -> bool:
        return task in self._pending

    def pending(self) -> tuple[MovableTask, ...]:
        """Pending tasks, sorted by (chunk, mb)."""
        return tuple(sorted(self._pending))

    def eligible(self, task: MovableTask) -> bool:
        """``task`` is pending and every earlier microbatch of its chunk is registered or done."""
        if task not in self._pending:
            return False
        seen = self._pending | self._done
        return all(MovableTask(task.chunk, mb) in seen for mb in range(task.mb))

    def due(self, task: MovableTask) -> tuple[MovableTask, ...]:
        """What must run, in order, to run ``task`` now: the pending tasks of its chunk with
        ``mb <= task.mb`` (microbatch order); empty if ``task`` is not pending."""
        if task not in self._pending:
            return ()
        return tuple(t for t in sorted(self._pending) if t.chunk == task.chunk and t.mb <= task.mb)

    def mark_done(self, task: MovableTask) -> None:
        self._pending.discard(task)
        self._done.add(task)

    def _unit_ran(self, u: MovableUnit) -> bool:
        return u.task in self._done or u in self._units or MovableUnit(u.chunk, u.mb, u.layer) in self._units

    def unit_eligible(self, u: MovableUnit) -> bool:
        """``u``'s task is eligible, ``u`` has not run, and the same unit of every earlier
        microbatch of the chunk has (or its whole W has)."""
        return self.eligible(u.task) and not self._unit_ran(u) and all(
            self._unit_ran(MovableUnit(u.chunk, m, u.layer, u.kinds)) for m in range(u.mb))

    def unit_done(self, u: MovableUnit, whole: bool) -> None:
        """``u`` ran; ``whole``: nothing of its task is left (the task is done)."""
        self._units.add(u)
        if whole:
            self.mark_done(u.task)


class SlotPolicy(Protocol):
    """Chooses movable tasks to run at a ``slot`` instruction (an idle slot the plan foresaw).

    Two optional methods, called by the engine when a policy has them (the dynamic bubble
    optimizer, :class:`tessera.engine.dbo.DBOPolicy`, does):

    * ``on_register(task, pool) -> Sequence[MovableTask]``: right after ``task`` joined the pool
      (``register_w``), the tasks to run at once (e.g. the pool's memory cap is exceeded);
    * ``on_deadline(task, pending: bool) -> None``: the ``W`` instruction of ``task`` is reached
      (``pending``: it had not run yet and runs there, in the main stream).
    """

    def select(self, slot: Instr, pool: MovablePool) -> Sequence[MovableTask]:
        """Tasks to run now (each run with its :meth:`MovablePool.due` predecessors)."""
        ...


@dataclass(frozen=True)
class OldestFirst:
    """A simple policy: up to ``max_tasks`` eligible tasks, oldest microbatch first."""

    max_tasks: int = 1

    def select(self, slot: Instr, pool: MovablePool) -> Sequence[MovableTask]:
        ready = sorted((t for t in pool.pending() if pool.eligible(t)), key=lambda t: (t.mb, t.chunk))
        return tuple(ready[: self.max_tasks])
