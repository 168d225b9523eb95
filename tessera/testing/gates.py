"""Test-only worker hook that holds every rank after given steps until a file appears, so a test
acts on a running job at a known step (a client's request, a kill of the driver actor) instead of
racing its iterations (:mod:`tessera.train.worker.hooks`; the hook is structural and does not
import ``tessera.train``).

``wait_for_files(gates=[[step, path], ...], timeout_s=...)``: after iteration ``step`` was
reported, before its checkpoint, every rank waits until ``path`` exists (the test creates it when
it is done; ranks and test on one host, or ``path`` on storage they all see). A gate still closed
after ``timeout_s`` seconds fails the rank with a ``TimeoutError`` naming step and path (a hang
guard, not a time budget). Every rank waits, so no collective is left pending while the job is held.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tessera.errors import TesseraConfigError

POLL_S = 0.05  # how often a held rank looks for its file


@dataclass(frozen=True)
class WaitForFiles:
    """The hook (see the module docstring): ``gates`` ``((step, path), ...)``, ``timeout_s`` per gate."""

    gates: tuple[tuple[int, str], ...]
    timeout_s: float

    def after_step(self, loop, step: int) -> None:
        for at, path in self.gates:
            if at != step:
                continue
            deadline = time.monotonic() + self.timeout_s
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {loop.rank}: the gate after step {step} ({path}) stayed closed for "
                                       f"{self.timeout_s:.0f} s")
                time.sleep(POLL_S)

    def die_before_marker(self, loop, step: int) -> bool:
        return False


def wait_for_files(gates, timeout_s: float = 600.0) -> WaitForFiles:
    """The :class:`WaitForFiles` hook of ``gates`` (``[[step, path], ...]``) and ``timeout_s`` (seconds).

    Raises:
        TesseraConfigError: a step < 1, an empty path, or ``timeout_s`` <= 0.
    """
    out = []
    for at, path in gates:
        if int(at) < 1:
            raise TesseraConfigError("gates.step", at, "must be >= 1", "use a step of the run")
        if not str(path):
            raise TesseraConfigError("gates.path", path, "must name a file", "give the file the test creates")
        out.append((int(at), str(path)))
    if not float(timeout_s) > 0:
        raise TesseraConfigError("timeout_s", timeout_s, "must be > 0", "e.g. 600")
    return WaitForFiles(tuple(out), float(timeout_s))
