"""Test-only fault injection for the Ray Train job, as worker hooks (:mod:`tessera.train.worker.hooks`).

Two hooks, each firing once per run (the driver actor keeps which faults fired, through
``loop.claim_once``, so a restarted worker group does not fire it again):

* :class:`KillAfterStep` (``TESSERA_FAULT_AT=RANK:STEP`` in the launcher's environment): world
  rank RANK kills its own process (SIGKILL) after iteration STEP was reported;
* :class:`KillInCheckpoint` (``TESSERA_FAULT_IN_CHECKPOINT=RANK:STEP``): world rank RANK kills
  itself while writing the checkpoint of step STEP, after its part's other files and before its
  completeness marker.

The job turns those variables into hook specs naming :func:`kill_after_step` and
:func:`kill_in_checkpoint` (:data:`tessera.train.worker.hooks.ENV_HOOKS`); this module does not import
``tessera.train`` (the hooks are structural).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from tessera.errors import TesseraConfigError

FAULT_ENV = "TESSERA_FAULT_AT"
CKPT_FAULT_ENV = "TESSERA_FAULT_IN_CHECKPOINT"


def parse_fault(text: str | None, env: str = FAULT_ENV) -> tuple[int, int] | None:
    """``"RANK:STEP"`` (the value of the variable ``env``) -> ``(rank, step)``; None/empty -> None.

    Raises:
        TesseraConfigError: not two integers separated by ``:`` (names ``env``).
    """
    if not text:
        return None
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise TesseraConfigError(env, text, "must be RANK:STEP", f"e.g. {env}=1:7") from None
    return rank, step


@dataclass(frozen=True)
class KillAfterStep:
    """World rank ``rank`` kills its own process after reporting step ``step`` (once per run)."""

    rank: int
    step: int

    def after_step(self, loop, step: int) -> None:
        if loop.rank == self.rank and step == self.step and loop.claim_once(f"{loop.run_name}:{loop.rank}:{step}"):
            print(f"tessera: fault injection: rank {loop.rank} kills itself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def die_before_marker(self, loop, step: int) -> bool:
        return False


@dataclass(frozen=True)
class KillInCheckpoint:
    """World rank ``rank`` kills its own process while writing the checkpoint of step ``step``,
    before its marker (once per run; the kill itself is :mod:`tessera.train.worker.checkpoint`'s)."""

    rank: int
    step: int

    def after_step(self, loop, step: int) -> None:
        return None

    def die_before_marker(self, loop, step: int) -> bool:
        return loop.rank == self.rank and step == self.step and loop.claim_once(
            f"{loop.run_name}:ckpt:{loop.rank}:{step}")


def kill_after_step(text: str) -> KillAfterStep:
    """The hook of ``TESSERA_FAULT_AT=text`` (``RANK:STEP``).

    Raises:
        TesseraConfigError: ``text`` is not ``RANK:STEP``.
    """
    rank, step = parse_fault(text, FAULT_ENV) or (-1, -1)
    return KillAfterStep(rank, step)


def kill_in_checkpoint(text: str) -> KillInCheckpoint:
    """The hook of ``TESSERA_FAULT_IN_CHECKPOINT=text`` (``RANK:STEP``).

    Raises:
        TesseraConfigError: ``text`` is not ``RANK:STEP``.
    """
    rank, step = parse_fault(text, CKPT_FAULT_ENV) or (-1, -1)
    return KillInCheckpoint(rank, step)
