"""The autopilot's decisions, as pure functions of frozen values (``docs/operations.md``,
"Autopilot"); the driver wires them (:mod:`tessera.train.job.autopilot`).

* **When to look again** (:func:`moved`): the running plan was made for some
  :class:`Conditions` (per pipeline rank slowdown, per EP rank slowdown, routing skew; the
  first plan for the recipe's, all 1.0 by default). When the estimate (medians over
  ``autopilot.checks`` checks, :mod:`tessera.train.worker.straggler`) puts a rank's slowdown
  ``autopilot.slowdown_threshold`` times above (or below) the one the plan was made for, or the
  routing skew ``autopilot.skew_threshold`` times, the conditions have moved and the autopilot
  re-plans; :func:`gate` holds it back while a switch is verified, within
  ``autopilot.holdoff_steps`` of the last decision, and (switches only) past
  ``autopilot.max_switches_per_hour``.
* **Whether to switch** (:func:`choose`): every :class:`Option` (the running version, the plan
  made for the observed conditions, the running plan with the bubble optimizer toggled) is
  simulated under the *same* observed conditions; the fastest is switched to when its predicted
  gain over the running version beats ``autopilot.margin`` and it was not rolled back before
  under the same conditions (:meth:`Conditions.key`: the scales rounded to :data:`ROUND`).
* **Whether it paid** (:func:`verify`): after the switch the median measured iteration time of
  ``autopilot.verify_steps`` iterations is compared with the median before the decision; a
  switch that made the job slower than the noise allows (:func:`tolerance`) is rolled back.

Every value is frozen and JSON-ready (``to_dict``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

ROUND = 0.05
"""Scales and skew are rounded to this step when conditions are compared for "tried before"."""

HOUR_S = 3600.0

MIN_TOLERANCE = 0.01
"""The smallest relative slowdown :func:`verify` counts as real (1 %)."""


def _r(x: float) -> float:
    return round(round(float(x) / ROUND) * ROUND, 6)


@dataclass(frozen=True)
class Conditions:
    """What a plan is made for, or what the job is measured to run under.

    Attributes:
        rank_slowdown: per pipeline rank, its compute time over the cost model's (1.0: as modelled).
        ep_slowdown: per EP rank, its routed-expert load over the mean rank's (empty: all 1.0).
        routing_skew: busiest EP rank's tokens over the mean rank's (1.0: balanced).
    """

    rank_slowdown: tuple[float, ...]
    ep_slowdown: tuple[float, ...] = ()
    routing_skew: float = 1.0

    @staticmethod
    def nominal(pp: int) -> "Conditions":
        return Conditions((1.0,) * pp)

    @staticmethod
    def of_recipe(recipe) -> "Conditions":
        """The conditions a recipe's plan is made for: ``planner.rank_slowdown`` /
        ``planner.ep_slowdown`` (empty: 1.0) and ``dbo.skew_target`` (0: 1.0)."""
        pl, pp = recipe.planner, recipe.parallel.pp
        ranks = tuple(float(f) for f in getattr(pl, "rank_slowdown", ())) or (1.0,) * pp
        return Conditions(ranks, tuple(float(f) for f in getattr(pl, "ep_slowdown", ())),
                          float(recipe.dbo.skew_target) if recipe.dbo.skew_target > 0 else 1.0)

    def key(self) -> tuple:
        """The conditions rounded to :data:`ROUND` (what "the same conditions" means)."""
        return (tuple(_r(x) for x in self.rank_slowdown), tuple(_r(x) for x in self.ep_slowdown),
                _r(self.routing_skew))

    def to_dict(self) -> dict:
        return {"rank_slowdown": list(self.rank_slowdown), "ep_slowdown": list(self.ep_slowdown),
                "routing_skew": self.routing_skew}

    @staticmethod
    def from_dict(d: dict) -> "Conditions":
        return Conditions(tuple(float(x) for x in d["rank_slowdown"]), tuple(float(x) for x in d.get("ep_slowdown", ())),
                          float(d.get("routing_skew", 1.0)))


def moved(observed: Conditions, planned: Conditions, slowdown_threshold: float, skew_threshold: float) -> tuple[str, ...]:
    """Why ``observed`` is no longer what ``planned`` was made for, one phrase per reason (empty:
    it is): a pipeline rank whose slowdown over the planned one is at least
    ``slowdown_threshold`` or at most its inverse; the routing skew likewise with
    ``skew_threshold``."""
    out = []
    for r, obs in enumerate(observed.rank_slowdown):
        was = planned.rank_slowdown[r] if r < len(planned.rank_slowdown) else 1.0
        ratio = obs / was if was > 0 else math.inf
        if ratio >= slowdown_threshold or ratio <= 1 / slowdown_threshold:
            out.append(f"rank {r} slowdown {obs:.2f} (plan made for {was:.2f})")
    ratio = observed.routing_skew / planned.routing_skew if planned.routing_skew > 0 else math.inf
    if ratio >= skew_threshold or ratio <= 1 / skew_threshold:
        out.append(f"routing skew {observed.routing_skew:.2f} (plan made for {planned.routing_skew:.2f})")
    return tuple(out)


@dataclass(frozen=True)
class Option:
    """One plan the autopilot could run, predicted under the observed conditions.

    Attributes:
        name: ``running`` (the running version), ``replan`` (planned for the observed
            conditions), ``dbo_on`` / ``dbo_off`` (the running plan with the bubble optimizer
            toggled).
        sha256: :func:`tessera.train.upgrade.versions.plan_sha256` of (plan, dbo).
        predicted_ms: simulated iteration time under the observed conditions, ms (inf: not runnable).
        dbo: whether the bubble optimizer runs with it.
        plan: the plan (``Plan.to_dict``; not in :meth:`to_dict`).
    """

    name: str
    sha256: str
    predicted_ms: float
    dbo: bool
    plan: dict = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "predicted_ms": self.predicted_ms, "dbo": self.dbo}


@dataclass(frozen=True)
class Decision:
    """What the autopilot decided.

    Attributes:
        action: ``switch`` (to :attr:`option`), ``keep`` (no option beats the margin) or
            ``skip`` (not evaluated now: :attr:`reason` says why).
        reason: one phrase.
        current_ms: the running version's predicted iteration time (None for ``skip``).
        option: the option switched to (``switch``) or the best other one (``keep``), else None.
        gain: its predicted gain over the running version, a fraction (None without one).
        options: every option evaluated.
    """

    action: str
    reason: str
    current_ms: float | None = None
    option: Option | None = None
    gain: float | None = None
    options: tuple[Option, ...] = ()

    def to_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "current_ms": self.current_ms,
                "option": self.option.name if self.option else None,
                "predicted_ms": self.option.predicted_ms if self.option else None, "predicted_gain": self.gain,
                "switch": self.action == "switch", "options": [o.to_dict() for o in self.options]}


def choose(current: Option, options: Sequence[Option], margin: float, rejected: frozenset = frozenset(),
           conditions: Conditions | None = None) -> Decision:
    """Switch to the fastest of ``options`` when its predicted gain over ``current``,
    ``(current - option) / current``, is above ``margin``; options that run what ``current``
    runs (same hash), that are not runnable (inf) or that were rolled back before under the same
    ``conditions`` (``(sha256, conditions.key())`` in ``rejected``) are not candidates."""
    key = conditions.key() if conditions is not None else None
    cands = [o for o in options if o.sha256 != current.sha256 and math.isfinite(o.predicted_ms)
             and (o.sha256, key) not in rejected]
    every = (current, *options)
    if not math.isfinite(current.predicted_ms) or current.predicted_ms <= 0:
        return Decision("keep", "the running version could not be simulated", None, None, None, every)
    if not cands:
        why = "rolled back before under these conditions" if any((o.sha256, key) in rejected for o in options) \
            else "no other plan"
        return Decision("keep", why, current.predicted_ms, None, None, every)
    best = min(cands, key=lambda o: o.predicted_ms)
    gain = (current.predicted_ms - best.predicted_ms) / current.predicted_ms
    if gain > margin:
        return Decision("switch", f"{best.name} predicted {gain:.1%} faster (> autopilot.margin {margin:.0%})",
                        current.predicted_ms, best, gain, every)
    return Decision("keep", f"best {best.name} predicted {gain:+.1%} (not above autopilot.margin {margin:.0%})",
                    current.predicted_ms, best, gain, every)


@dataclass(frozen=True)
class Pending:
    """A switch being verified.

    Attributes:
        plan_version: the version switched to; from_version: the one it replaced (rolled back to).
        decided_step: the step of the decision; effective_step: the step it was announced for.
        predicted_ratio: predicted iteration time of the new version over the running one.
        before_ms: measured iteration times before the decision (ms).
        after_ms: measured iteration times after the switch so far (ms).
        key: ``(sha256, conditions key)`` of the switch (rejected when it is rolled back).
        planned: the conditions the new version is made for; previous: the old version's.
    """

    plan_version: int
    from_version: int
    decided_step: int
    effective_step: int
    predicted_ratio: float
    before_ms: tuple[float, ...]
    key: tuple
    planned: Conditions
    previous: Conditions
    after_ms: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return {"plan_version": self.plan_version, "from_version": self.from_version,
                "decided_step": self.decided_step, "effective_step": self.effective_step,
                "predicted_ratio": self.predicted_ratio, "before_ms": list(self.before_ms),
                "after_ms": list(self.after_ms)}


@dataclass(frozen=True)
class Verdict:
    """Whether a switch paid.

    Attributes:
        plan_version: the version verified.
        before_ms / after_ms: median measured iteration time before the decision / after the switch.
        measured_ratio: ``after_ms / before_ms``; predicted_ratio: the simulator's.
        tolerance: relative slowdown within noise (:func:`tolerance`).
        action: ``keep`` or ``rollback`` (``measured_ratio > 1 + tolerance``).
    """

    plan_version: int
    before_ms: float
    after_ms: float
    measured_ratio: float
    predicted_ratio: float
    tolerance: float
    action: str

    def to_dict(self) -> dict:
        return {"plan_version": self.plan_version, "before_ms": self.before_ms, "after_ms": self.after_ms,
                "measured_ratio": self.measured_ratio, "predicted_ratio": self.predicted_ratio,
                "measured_gain": 1 - self.measured_ratio, "predicted_gain": 1 - self.predicted_ratio,
                "tolerance": self.tolerance, "action": self.action, "rollback": self.action == "rollback"}


def tolerance(before: Sequence[float], after_count: int) -> float:
    """The relative difference of two medians that noise alone can make: three standard errors
    of the difference of a median of ``before`` and a median of ``after_count`` samples, the
    step-to-step spread taken from ``before`` (1.4826 x the median absolute deviation over the
    median: a standard deviation robust to outliers; a median's standard error is ~1.2533
    sigma / sqrt(n)); at least :data:`MIN_TOLERANCE`."""
    if len(before) < 2 or after_count < 1:
        return MIN_TOLERANCE
    med = statistics.median(before)
    if med <= 0:
        return MIN_TOLERANCE
    sigma = 1.4826 * statistics.median(abs(x - med) for x in before) / med
    se = 1.2533 * sigma * math.sqrt(1 / len(before) + 1 / after_count)
    return max(MIN_TOLERANCE, 3 * se)


def verify(plan_version: int, before: Sequence[float], after: Sequence[float], predicted_ratio: float) -> Verdict:
    """The :class:`Verdict` of a switch: roll back when the median of ``after`` is above the
    median of ``before`` by more than :func:`tolerance`.

    Raises:
        ValueError: ``before`` or ``after`` is empty."""
    if not before or not after:
        raise ValueError("verify needs iteration times before and after the switch")
    b, a = statistics.median(before), statistics.median(after)
    tol = tolerance(before, len(after))
    ratio = a / b if b > 0 else math.inf
    return Verdict(plan_version, b, a, ratio, float(predicted_ratio), tol, "rollback" if ratio > 1 + tol else "keep")


@dataclass(frozen=True)
class AutopilotState:
    """What the driver's autopilot keeps between reports.

    Attributes:
        enabled: decisions on (``autopilot.enabled``, ``tessera upgrade --autopilot on|off``).
        planned: the conditions the running plan was made for.
        last_decision_step: the step of the last decision, switch or rollback (hold-off from it).
        switch_times: Unix times of the switches (the hourly cap).
        pending: the switch being verified, or None.
        rejected: ``(sha256, conditions key)`` of switches rolled back (never tried again).
        evaluated: ``(running sha256, conditions key)`` already decided ``keep`` (not re-planned
            again until the conditions or the running plan change).
        switches, rollbacks: counts.
        recent_ms: ``(step, iteration ms)`` of the last ordinary iterations (no check, no switch).
    """

    enabled: bool
    planned: Conditions
    last_decision_step: int = -(10 ** 9)
    switch_times: tuple[float, ...] = ()
    pending: Pending | None = None
    rejected: frozenset = frozenset()
    evaluated: frozenset = frozenset()
    switches: int = 0
    rollbacks: int = 0
    recent_ms: tuple[tuple[int, float], ...] = ()


def gate(state: AutopilotState, step: int, now: float, holdoff_steps: int, max_switches_per_hour: int) -> str | None:
    """Why no decision may be taken at ``step`` (Unix time ``now``), or None: off, a switch being
    verified, within the hold-off, or the hourly switch cap reached."""
    if not state.enabled:
        return "autopilot off"
    if state.pending is not None:
        return f"verifying version {state.pending.plan_version}"
    if step < state.last_decision_step + holdoff_steps:
        return f"hold-off until step {state.last_decision_step + holdoff_steps} (autopilot.holdoff_steps)"
    recent = [t for t in state.switch_times if now - t < HOUR_S]
    if len(recent) >= max_switches_per_hour:
        return f"{len(recent)} switches in the last hour (autopilot.max_switches_per_hour={max_switches_per_hour})"
    return None
