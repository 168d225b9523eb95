"""The steps an instruction expands into: what :meth:`Engine.advance` runs one at a time.

A :class:`Step` is one bound call (a task, a send, a slot, ...) with the names its
:class:`~tessera.engine.values.StepRecord` carries; :func:`lone_steps` expands a lone ``F`` or
``B`` instruction: one step where the chunk fuses it (:mod:`tessera.engine.fused`), else one per
task of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tessera.program.instructions import Instr


@dataclass(frozen=True)
class Step:
    name: str
    mb: int
    chunk: int
    fn: Callable[[], None]
    index: int | None = None  # an early send: the send instruction it carries out (None: the current one)
    op: str | None = None


def bind(fn, *args) -> Callable[[], None]:
    """``fn(*args)`` as a call without arguments."""
    return lambda: fn(*args)


def lone_steps(ins: Instr, chunk, phase: str) -> list[Step]:
    """The steps of the lone ``phase`` (``"F"`` or ``"B"``) instruction ``ins`` on ``chunk`` (its
    ``begin_forward`` / ``begin_backward`` already called): one where ``chunk.fuses(ins.mb)``,
    else one per key of ``chunk.task_keys(phase)``."""
    mb = ins.mb
    if chunk.fuses(mb):
        run = chunk.run_forward if phase == "F" else chunk.run_backward
        return [Step(str(ins), mb, ins.chunk, bind(run, mb))]
    return [Step(str(k), mb, ins.chunk, bind(chunk.run, k, mb)) for k in chunk.task_keys(phase)]
