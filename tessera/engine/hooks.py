"""Engine hooks: code that observes (or later steers) an iteration at the engine's seams.

:meth:`tessera.engine.Engine.advance` calls, on the Program's rank, in this order:

* :meth:`Hooks.iteration_start` once, on the first ``advance()`` after ``begin()``;
* :meth:`Hooks.slot` when it reaches a ``slot`` instruction, before the slot policy runs there;
* :meth:`Hooks.step_done` after every step (a task, or a whole non-compute instruction), with
  its :class:`~tessera.engine.values.StepRecord` (``ms``: the step's wall time);
* :meth:`Hooks.iteration_end` once, when the Program is exhausted (``advance()`` returns None).

:class:`Hooks` does nothing; subclass it and override what you need. :class:`HookList` calls
several hooks in the given order. A hook that raises fails the step like a failed task. Hooks
hold their own state (the engine keeps none for them); the dynamic bubble optimizer is a
:class:`~tessera.engine.pool.SlotPolicy` (:class:`tessera.engine.dbo.DBOPolicy`), and a hook
can read its per-slot log at ``iteration_end``.
"""

from __future__ import annotations

from typing import Sequence

from tessera.engine.values import StepRecord
from tessera.program.instructions import Instr, Program


class Hooks:
    """No-op hooks (the default); every method returns None."""

    def iteration_start(self, program: Program) -> None:
        """An iteration of ``program`` starts (first ``advance()`` after ``begin()``)."""

    def slot(self, index: int, ins: Instr) -> None:
        """Instruction ``index`` of the Program, the ``slot`` ``ins``, is reached."""

    def step_done(self, record: StepRecord) -> None:
        """A step finished: ``record`` (instruction index, op, step name, mb, chunk, ms)."""

    def iteration_end(self, program: Program) -> None:
        """The iteration of ``program`` ended (its last instruction ran)."""


class HookList(Hooks):
    """Several hooks, each called in order for every event."""

    def __init__(self, hooks: Sequence[Hooks]) -> None:
        self.hooks = tuple(hooks)

    def iteration_start(self, program: Program) -> None:
        for h in self.hooks:
            h.iteration_start(program)

    def slot(self, index: int, ins: Instr) -> None:
        for h in self.hooks:
            h.slot(index, ins)

    def step_done(self, record: StepRecord) -> None:
        for h in self.hooks:
            h.step_done(record)

    def iteration_end(self, program: Program) -> None:
        for h in self.hooks:
            h.iteration_end(program)


def as_hooks(hooks: Hooks | Sequence[Hooks] | None) -> Hooks:
    """One :class:`Hooks` from None (no-op), a hook, or a sequence of hooks (a :class:`HookList`).

    Raises:
        TypeError: something else."""
    if hooks is None:
        return Hooks()
    if isinstance(hooks, Hooks):
        return hooks
    if isinstance(hooks, (list, tuple)) and all(isinstance(h, Hooks) for h in hooks):
        return hooks[0] if len(hooks) == 1 else HookList(hooks)
    raise TypeError(f"hooks must be a tessera.engine.hooks.Hooks or a list of them, got {type(hooks).__name__}")
