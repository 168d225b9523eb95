"""Test-only straggler injection for the Ray Train job, as a worker hook
(:mod:`tessera.train.worker.hooks`): one rank computes slower from a given step on, so tests and
benchmarks of the autopilot (``docs/operations.md``, "Autopilot") have a straggler to find.

``TESSERA_SLOW_RANK=RANK:STEP:FACTOR`` in the launcher's environment (the job turns it into a
hook spec naming :func:`slow_rank`, :data:`tessera.train.worker.hooks.ENV_HOOKS`): world rank
RANK runs every iteration from STEP on about FACTOR times as long as it would:

* after every compute step (``F``, ``B``, ``W``, ``FB`` instructions) its engine sleeps
  ``(FACTOR - 1)`` times that step's wall time (:class:`SleepAfterCompute`, an engine hook), so
  its iterations really take longer and the other ranks wait for it;
* the sleep lies between the engine's timed task spans, so the rank's per-task times of check
  steps are reported times FACTOR (:meth:`tessera.train.worker.step.EngineStepRunner.add_engine_hook`):
  what a device FACTOR times slower would time.

Installed by the hook's ``after_step`` of iteration STEP - 1 (or the first iteration a restarted
worker group runs past it), on the rank's step runner, and kept through plan switches. The sleep
is host time: on CPU workers the rank is FACTOR times slower; on GPUs the host sleeps while
queued kernels may still run, so the slowdown is smaller than FACTOR. This module does not import
``tessera.train`` (the hook is structural).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tessera.engine.hooks import Hooks
from tessera.errors import TesseraConfigError

SLOW_ENV = "TESSERA_SLOW_RANK"

COMPUTE = frozenset({"F", "B", "W", "FB"})
"""The :class:`~tessera.engine.values.StepRecord` ops a slowed rank sleeps after (compute
instructions; waits and sends are not the rank's own compute)."""


def parse_slow(text: str | None, env: str = SLOW_ENV) -> tuple[int, int, float] | None:
    """``"RANK:STEP:FACTOR"`` -> ``(rank, step, factor)``; None/empty -> None.

    Raises:
        TesseraConfigError: not two integers and a number separated by ``:``, a rank or step
            below 0/1, or a factor that is not finite and >= 1 (names ``env``).
    """
    if not text:
        return None
    fix = f"e.g. {env}=1:20:1.3 (world rank 1 computes 1.3 times slower from step 20 on)"
    try:
        rank, step, factor = text.split(":")
        rank, step, factor = int(rank), int(step), float(factor)
    except ValueError:
        raise TesseraConfigError(env, text, "must be RANK:STEP:FACTOR", fix) from None
    if rank < 0 or step < 1 or not 1.0 <= factor < math.inf:
        raise TesseraConfigError(env, text, "needs RANK >= 0, STEP >= 1 and a finite FACTOR >= 1", fix)
    return rank, step, factor


class SleepAfterCompute(Hooks):
    """Engine hook: after every compute step sleep ``(factor - 1)`` times its wall time;
    ``slept_ms`` adds up the sleeps."""

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self.slept_ms = 0.0

    def step_done(self, record) -> None:
        if record.op in COMPUTE and record.ms > 0:
            ms = (self.factor - 1.0) * record.ms
            time.sleep(ms / 1e3)
            self.slept_ms += ms


@dataclass(frozen=True)
class SlowRank:
    """World rank ``rank`` computes ``factor`` times slower from iteration ``step`` on (module
    docstring)."""

    rank: int
    step: int
    factor: float

    def after_step(self, loop, step: int) -> None:
        runner = loop.runner
        if loop.rank != self.rank or step < self.step - 1 or not hasattr(runner, "add_engine_hook"):
            return
        if any(isinstance(h, SleepAfterCompute) for h in runner.engine_hooks):
            return
        print(f"tessera: straggler injection: rank {loop.rank} computes {self.factor:g}x slower from step {step + 1}",
              flush=True)
        runner.add_engine_hook(SleepAfterCompute(self.factor), time_scale=self.factor)

    def die_before_marker(self, loop, step: int) -> bool:
        return False


def slow_rank(text: str) -> SlowRank:
    """The hook of ``TESSERA_SLOW_RANK=text`` (``RANK:STEP:FACTOR``).

    Raises:
        TesseraConfigError: as :func:`parse_slow`.
    """
    rank, step, factor = parse_slow(text) or (-1, 1, 1.0)
    return SlowRank(rank, step, factor)
