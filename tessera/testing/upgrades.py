"""Test-only worker hook that asks the job's driver for plan upgrades at given steps, so a test
knows which request came when (:mod:`tessera.train.worker.hooks`; the hook is structural and does not
import ``tessera.train``).

``requests_at(actions=[[step, method, argument], ...])``: after iteration ``step`` was reported,
world rank 0 calls the driver RPC ``method`` (``upgrade_plan`` with a plan's JSON text,
``upgrade_dbo`` with true/false, ``rollback`` with null, ``autopilot_join`` with a timeout in
seconds: the autopilot's re-plan in flight, if any, is decided at that step, so a test knows where
its switch lands) and keeps the answer (or the refusal's message) in :attr:`RequestsAt.answers`.
Each request is made once per run (``loop.claim_once``), also when the worker group restarts.
The switch itself happens as for any client's request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import TesseraConfigError

METHODS = ("upgrade_plan", "upgrade_dbo", "upgrade_recipe", "rollback", "autopilot_join")


@dataclass
class RequestsAt:
    """The hook (see the module docstring)."""

    actions: tuple[tuple[int, str, object], ...]
    answers: list = field(default_factory=list)

    def after_step(self, loop, step: int) -> None:
        if loop.rank != 0:
            return
        for i, (at, method, arg) in enumerate(self.actions):
            if at == step and loop.claim_once(f"upgrade-request-{i}"):
                args = () if arg is None else (arg,)
                try:
                    self.answers.append(loop.driver.call(method, *args))
                except Exception as e:  # noqa: BLE001 - a refusal is an answer the test reads from the records
                    self.answers.append({"refused": str(e).splitlines()[0]})

    def die_before_marker(self, loop, step: int) -> bool:
        return False


def requests_at(actions) -> RequestsAt:
    """The :class:`RequestsAt` hook of ``actions`` (``[[step, method, argument], ...]``).

    Raises:
        TesseraConfigError: an unknown method or a step < 1.
    """
    out = []
    for at, method, arg in actions:
        if method not in METHODS:
            raise TesseraConfigError("actions.method", method, f"must be one of {METHODS}", "use upgrade_plan")
        if int(at) < 1:
            raise TesseraConfigError("actions.step", at, "must be >= 1", "use a step of the run")
        out.append((int(at), method, arg))
    return RequestsAt(tuple(out))
