"""When every rank switches to an accepted plan version, agreed without a driver round trip on the
critical path.

* Rank 0 sends one ``pending_versions`` call to the driver as an iteration starts
  (:class:`PendingPoll`) and reads its answer at the iteration's end if it has arrived; it never
  waits for it.
* At the end of every iteration the ranks already gather each other's metrics (one all-gather,
  :func:`tessera.train.worker.metrics.aggregate`). Rank 0 puts one announcement in its row: the oldest
  accepted version not yet agreed and the step the driver announced for it
  (:meth:`UpgradeSchedule.announcement`); every rank reads rank 0's row.
* :meth:`UpgradeSchedule.agree` turns that into the same switch step on every rank: the driver's
  step, or the next iteration if that has passed, and always after the previous version's own
  switch. Rank 0 learning late only delays the switch; it never splits the ranks.
* Before iteration ``s`` every rank asks :meth:`UpgradeSchedule.due` ``(s)``: the version to
  switch to, at this iteration boundary (never mid-iteration), or None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpgradeSchedule:
    """The agreed switches, ``((version, step), ...)`` in order (versions and steps increasing),
    and ``base``: the version running before the first of them."""

    base: int
    switches: tuple[tuple[int, int], ...] = ()

    @property
    def last_version(self) -> int:
        return self.switches[-1][0] if self.switches else self.base

    def announcement(self, pending) -> tuple[int, int] | None:
        """Rank 0: the first of ``pending`` (``[[version, step], ...]`` from the driver) newer
        than every agreed version, as ``(version, step)``; None if there is none."""
        for version, step in sorted((int(v), int(s)) for v, s in pending or ()):
            if version > self.last_version:
                return version, step
        return None

    def agree(self, finished_step: int, announced: tuple[int, int] | None) -> "UpgradeSchedule":
        """This schedule with rank 0's ``announced`` ``(version, step)`` (gathered after iteration
        ``finished_step``) added: it switches at ``max(step, finished_step + 1, previous
        switch + 1)``. Unchanged when nothing new is announced."""
        if announced is None or announced[0] <= self.last_version:
            return self
        version, step = announced
        at = max(int(step), finished_step + 1, (self.switches[-1][1] + 1) if self.switches else 0)
        return UpgradeSchedule(self.base, self.switches + ((int(version), at),))

    def due(self, step: int) -> int | None:
        """The version every rank switches to before iteration ``step``, else None."""
        return next((v for v, s in self.switches if s == step), None)


class PendingPoll:
    """Rank 0's background question to the driver (``pending_versions``): :meth:`ask` sends it
    (at the start of an iteration, unless one is still in flight) and :meth:`latest` returns the
    newest answer that has arrived (at the iteration's end, so the driver had the whole iteration
    to answer), else the previous one; neither blocks. ``driver`` is a
    :class:`tessera.train.worker.links.DriverLink` (its ``submit``/``poll``); a driver without
    ``submit`` (one process, tests) is asked directly by :meth:`latest`."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.answer: list = []
        self._ref = None

    def ask(self) -> None:
        submit = getattr(self.driver, "submit", None)
        if submit is not None and self._ref is None:
            self._ref = submit("pending_versions")

    def latest(self) -> list:
        if getattr(self.driver, "submit", None) is None:
            return list(self.driver.call("pending_versions") or [])
        if self._ref is not None:
            done, value = self.driver.poll(self._ref)
            if done:
                self.answer, self._ref = list(value or []), None
        return self.answer
