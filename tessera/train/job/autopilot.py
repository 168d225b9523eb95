"""The autopilot on the driver (mixed into :class:`tessera.train.job.driver.Driver`;
``docs/operations.md``, "Autopilot").

Rank 0's report of every iteration feeds :meth:`AutopilotRPCs._autopilot_report`:

1. **Iteration times.** Ordinary iterations (not a check step, which runs on the slower
   profiling engine; not the iteration a switch happened before) keep their ``iteration_ms``
   (the last ones: the "before" of a switch).
2. **Estimates.** A check step's record carries that check's per-rank slowdown and routing skew
   (:mod:`tessera.train.worker.straggler`); the driver keeps a :class:`StragglerWindow` of the last
   ``autopilot.checks`` and records its medians as an ``autopilot_estimate`` event, and writes
   them to the run directory's ``slowdown.json`` (:data:`tessera.cost.slowdown.SLOWDOWN_FILE`,
   what ``tessera plan --slowdown-from`` reads).
3. **Decisions.** Once the window is full and the medians have moved past a threshold from the
   conditions the running plan was made for (:func:`tessera.train.upgrade.autopilot.moved`), and
   nothing holds it back (:func:`~tessera.train.upgrade.autopilot.gate`: off, verifying, hold-off,
   hourly cap; recorded as a ``skip`` decision), the options are evaluated in a background
   thread of the actor (:func:`evaluate_options`: re-plan with the observed factors as
   ``planner.rank_slowdown`` / ``planner.ep_slowdown``, :meth:`tessera.cost.slowdown.Slowdown.as_overrides`,
   under ``autopilot.replan_time_s``; simulate it, the running version and, with expert
   parallelism and a measured skew, the running plan with the bubble optimizer toggled, all under
   the observed conditions), so the actor keeps answering and the workers keep stepping. The
   next report picks the result up: :func:`~tessera.train.upgrade.autopilot.choose` switches (a
   new version of source ``autopilot``, through the same checks as every upgrade) or keeps; either
   way an ``autopilot_decision`` event with every option's prediction.
4. **Verification.** After a switch took effect, ``autopilot.verify_steps`` ordinary iterations
   are compared with as many before the decision (:func:`~tessera.train.upgrade.autopilot.verify`);
   a switch that made the job slower beyond noise is rolled back (:meth:`rollback` to the version
   it replaced) and its (plan hash, rounded conditions) is never switched to again; an
   ``autopilot_verify`` event either way.

``set_autopilot(on)`` (``tessera upgrade --autopilot on|off``) pauses and resumes the decisions
(an ``autopilot_toggled`` event); a switch already made is still verified. A restarted driver
starts with an empty window and no verification in progress, and re-reads the rolled-back
switches, the counts and the last toggle from its records.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace

from tessera.errors import TesseraConfigError, UpgradeRefused
from tessera.train import storage
from tessera.train.upgrade.autopilot import (AutopilotState, Conditions, Decision, Option, Pending, choose, gate, moved,
                                             verify)
from tessera.train.worker.straggler import CheckEstimate, StragglerWindow

EVENT_ESTIMATE = "autopilot_estimate"
EVENT_DECISION = "autopilot_decision"
EVENT_VERIFY = "autopilot_verify"
EVENT_TOGGLED = "autopilot_toggled"
SOURCE = "autopilot"
"""The version source of an autopilot switch."""


@dataclass(frozen=True)
class Evaluation:
    """The options of one re-plan (:func:`evaluate_options`): the running version's
    :class:`Option`, the others, the observed conditions they were simulated under, the wall
    time it took (s) and notes (an option that could not be made, and why)."""

    current: Option
    options: tuple[Option, ...]
    conditions: Conditions
    replan_s: float
    notes: tuple[str, ...] = ()


def scaled_recipe(recipe, conditions: Conditions, dbo: bool):
    """``recipe`` planned for ``conditions``: the factors as ``planner.rank_slowdown`` /
    ``planner.ep_slowdown`` (:meth:`tessera.cost.slowdown.Slowdown.as_overrides`), with expert
    parallelism a skew above 1 as ``dbo.routing=zipf`` + ``dbo.skew_target`` (the simulator's
    token counts), ``dbo.enabled`` as the running version has it, and the planner's wall-clock
    caps at most ``autopilot.replan_time_s``."""
    from tessera.cost.slowdown import Slowdown

    cap = recipe.autopilot.replan_time_s
    over = Slowdown(conditions.rank_slowdown, conditions.ep_slowdown).as_overrides()
    over += [f"planner.search_time_s={min(recipe.planner.search_time_s, cap)}",
             f"planner.time_limit_s={min(recipe.planner.time_limit_s, cap)}", f"dbo.enabled={str(bool(dbo)).lower()}"]
    if recipe.parallel.ep > 1 and conditions.routing_skew > 1.0:
        over += ["dbo.routing=zipf", f"dbo.skew_target={max(1.0, conditions.routing_skew)}"]
    return recipe.with_overrides(over)


def evaluate_options(recipe, plan: dict, dbo: bool, conditions: Conditions) -> Evaluation:
    """Simulate the running version (``plan``, ``dbo``) and the options under ``conditions``
    (module docstring, item 3): ``replan`` (the planner on :func:`scaled_recipe`) and, at
    ``ep > 1`` with a skew above 1, the running plan with the bubble optimizer toggled
    (``dbo_on`` splits W where the plan keeps it inside B, as ``upgrade_dbo`` does). With a
    modelled skew every option is simulated with the bubble optimizer's simulator on skewed
    counts (:func:`tessera.sim.dbo.simulate_dbo`, the optimizer on or off as the option runs),
    else with :func:`tessera.sim.simulator.simulated_iteration_ms`; ``inf`` for an option that
    does not compile. Needs no driver state (it runs in a background thread)."""
    from tessera.flow import build_costs, compile_programs, plan_recipe, resolve
    from tessera.program.plan import Plan, with_split_w
    from tessera.program.templates import get_template
    from tessera.sim.dbo import recipe_counts, simulate_dbo
    from tessera.sim.simulator import simulated_iteration_ms
    from tessera.train.upgrade.versions import plan_sha256

    t0 = time.perf_counter()
    scaled = scaled_recipe(recipe, conditions, dbo)
    res = resolve(scaled)
    costs = build_costs(res)
    ep = scaled.parallel.ep
    counts = recipe_counts(scaled, costs, res.model) if ep > 1 and conditions.routing_skew > 1.0 else None

    def runnable(plan_dict: dict, on: bool) -> dict:
        if on and not plan_dict.get("split_w", True):
            p = Plan.from_dict(plan_dict)
            return with_split_w(p, get_template(p.template).fb_keeps_w).to_dict()
        return plan_dict

    def predict(plan_dict: dict, on: bool) -> float:
        try:
            programs = compile_programs(Plan.from_dict(plan_dict), costs if on else None)
            if counts is not None:
                d = scaled.dbo
                return simulate_dbo(programs, costs, counts, ep, enabled=on, margin=d.margin,
                                    pool_mem_gb=d.pool_mem_gb).iteration_ms
            return simulated_iteration_ms(programs, costs)
        except (TesseraConfigError, ValueError):
            return math.inf

    def option(name: str, plan_dict: dict, on: bool) -> Option:
        return Option(name, plan_sha256(plan_dict, on), predict(plan_dict, on), bool(on), plan_dict)

    current = option("running", plan, dbo)
    options, notes = [], []
    try:
        options.append(option("replan", plan_recipe(res, costs).tessera.to_dict(), dbo))
    except (TesseraConfigError, ValueError) as e:
        notes.append(f"replan: {' '.join(str(e).split())}")
    if counts is not None:
        options.append(option("dbo_off" if dbo else "dbo_on", runnable(plan, not dbo), not dbo))
    return Evaluation(current, tuple(options), conditions, time.perf_counter() - t0, tuple(notes))


def _observed(estimate) -> Conditions:
    return Conditions(tuple(estimate.rank_slowdown), tuple(estimate.ep_slowdown), float(estimate.routing_skew))


class AutopilotRPCs:
    """The autopilot's state and RPCs (needs the Driver's ``recipe``, ``history``, ``step``,
    ``run_dir``, ``records``, ``_record``, ``_accept`` and ``rollback``)."""

    def _autopilot_init(self) -> None:
        """Fresh state (the recipe's ``autopilot`` section); the switches a former incarnation
        rolled back, and the counts, from the records it left."""
        a = self.recipe.autopilot
        state = AutopilotState(bool(a.enabled), Conditions.of_recipe(self.recipe))
        rejected, switches, rollbacks = set(), 0, 0
        for r in self.records:
            if r.get("event") == EVENT_DECISION and r.get("action") == "switch" and r.get("plan_version") is not None:
                switches += 1
            elif r.get("event") == EVENT_VERIFY and r.get("action") == "rollback":
                rollbacks += 1
                rejected.add((r.get("sha256"), Conditions.from_dict(r["conditions"]).key()))
            elif r.get("event") == EVENT_TOGGLED:
                state = replace(state, enabled=bool(r["enabled"]))
        self.autopilot = replace(state, rejected=frozenset(rejected), switches=switches, rollbacks=rollbacks)
        self.straggler = StragglerWindow(a.checks)
        self.autopilot_estimate = None  # the window's medians (straggler.Estimate), once a check came
        self.autopilot_decision: dict | None = None
        self.autopilot_verdict: dict | None = None
        self._replan = None  # (Future, step it started) of the evaluation in flight
        self._executor = None

    # --- RPCs ----------------------------------------------------------------------------------
    def set_autopilot(self, on: bool) -> dict:
        """Pause (``on`` false) or resume the autopilot's decisions (``tessera upgrade --autopilot
        on|off``), recorded as an ``autopilot_toggled`` event; a switch already made is still
        verified. Returns ``{"enabled", "step"}``.

        Raises:
            UpgradeRefused: it is already so; or ``on`` in a job whose workers run no checks
                (started with ``autopilot.enabled=false``): there is nothing to decide from.
        """
        on = bool(on)
        word = "on" if on else "off"
        try:
            if on == self.autopilot.enabled:
                raise UpgradeRefused("autopilot", word, f"is already {word}", "nothing to do")
            if on and not self._checks_run():
                raise UpgradeRefused("autopilot", word, "has no estimates to act on: the job started with "
                                     "autopilot.enabled=false, so its workers run no checks",
                                     "start the job with autopilot.enabled=true (tessera upgrade --autopilot off|on "
                                     "then pauses and resumes it)")
        except UpgradeRefused as e:
            self._record({"event": "plan_refused", "request": "set_autopilot", "field": e.field, "reason": str(e),
                          "step": self.step, "time": time.time()})
            raise
        self.autopilot = replace(self.autopilot, enabled=on)
        self._record({"event": EVENT_TOGGLED, "enabled": on, "step": self.step, "time": time.time()})
        return {"enabled": on, "step": self.step}

    def autopilot_status(self) -> dict:
        """What the autopilot saw and did (``tessera status``): ``enabled``, ``planned_for``
        (the conditions the running plan was made for), ``estimate`` (the window's medians, or
        None), ``checks`` (in the window), ``replanning`` (an evaluation in flight),
        ``last_decision``, ``verifying`` (the switch being verified), ``last_verdict``,
        ``switches``, ``rollbacks``."""
        s = self.autopilot
        return {"enabled": s.enabled, "planned_for": s.planned.to_dict(),
                "estimate": self.autopilot_estimate.to_dict() if self.autopilot_estimate else None,
                "checks": len(self.straggler.entries), "replanning": self._replan is not None,
                "last_decision": self.autopilot_decision, "verifying": s.pending.to_dict() if s.pending else None,
                "last_verdict": self.autopilot_verdict, "switches": s.switches, "rollbacks": s.rollbacks}

    def autopilot_join(self, timeout_s: float | None = None) -> dict | None:
        """Wait (at most ``timeout_s``) for the evaluation in flight and decide on it now; returns
        the decision event, or None when none was in flight (tests and scripts; a report does
        the same without waiting)."""
        if self._replan is None:
            return None
        self._replan[0].result(timeout=timeout_s)
        return self._autopilot_decide()

    # --- the report hook -----------------------------------------------------------------------
    def _checks_run(self) -> bool:
        """Whether the workers run the autopilot's checks (the job started with
        ``autopilot.enabled``; validation made ``profile.check_every`` > 0 then)."""
        return bool(self.recipe.autopilot.enabled) and self.recipe.profile.check_every > 0

    def _ordinary(self, step: int, metrics: dict) -> bool:
        """Whether iteration ``step`` ran on the ordinary engine (not a check or drift-check step,
        not the iteration of a switch) and has a finite time."""
        r = self.recipe
        timed = r.autopilot.enabled or r.planner.cost_source == "profile"
        every = r.profile.check_every if timed else 0
        ms = metrics.get("iteration_ms")
        return not (every > 0 and step % every == 0) and metrics.get("plan_switch_from") is None \
            and isinstance(ms, (int, float)) and math.isfinite(ms)

    def _autopilot_report(self, step: int, metrics: dict) -> None:
        """Rank 0's report of iteration ``step`` (module docstring, items 1-4)."""
        s = self.autopilot
        if self._ordinary(step, metrics):
            keep = max(2 * self.recipe.autopilot.verify_steps, 8)
            self.autopilot = s = replace(s, recent_ms=(s.recent_ms + ((step, float(metrics["iteration_ms"])),))[-keep:])
            if s.pending is not None and self.history.running().version == s.pending.plan_version \
                    and step > self.history.running().effective_step:
                self.autopilot = replace(s, pending=replace(s.pending, after_ms=s.pending.after_ms
                                                            + (float(metrics["iteration_ms"]),)))
        self._autopilot_verify(step)
        if self._replan is not None and self._replan[0].done():
            self._autopilot_decide()
        check = CheckEstimate.from_metrics(dict(metrics, step=step))
        if check is not None:
            self._autopilot_check(step, check)

    def _autopilot_check(self, step: int, check: CheckEstimate) -> None:
        """A check: into the window, its medians recorded and written to ``slowdown.json``; when
        the window is full and the conditions moved, a decision is started (or skipped)."""
        from tessera.cost.slowdown import SLOWDOWN_FILE

        self.straggler = self.straggler.add(check)
        est = self.autopilot_estimate = self.straggler.estimate()
        self._record(dict({"event": EVENT_ESTIMATE, **est.to_dict(), "full": self.straggler.full}, step=step,
                          time=time.time()))
        try:
            storage.write_text(storage.join(self.run_dir, SLOWDOWN_FILE), json.dumps(est.slowdown().to_dict()) + "\n")
        except (OSError, ValueError) as e:  # the estimate is in the records still
            self._record({"event": "autopilot_error", "error": f"{SLOWDOWN_FILE}: {e}", "step": step,
                          "time": time.time()})
        if not self.straggler.full or self._replan is not None:
            return
        a, s = self.recipe.autopilot, self.autopilot
        observed = _observed(est)
        reasons = moved(observed, s.planned, a.slowdown_threshold, a.skew_threshold)
        if not reasons:
            return
        why = gate(s, step, time.time(), a.holdoff_steps, a.max_switches_per_hour)
        if why is not None:
            if s.enabled:  # a paused autopilot records nothing
                self._decision_event(Decision("skip", why), step, reasons, observed)
            return
        latest = self.history.latest
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-autopilot")
        future = self._executor.submit(evaluate_options, self.recipe, latest.plan, latest.dbo, observed)
        self._replan = (future, step, reasons)

    def _decision_event(self, d: Decision, step: int, reasons, observed: Conditions, **extra) -> dict:
        event = {"event": EVENT_DECISION, **d.to_dict(), "trigger": list(reasons), "conditions": observed.to_dict(),
                 "rank_slowdown_max": max(observed.rank_slowdown, default=1.0), "routing_skew": observed.routing_skew,
                 "step": step, **extra, "time": time.time()}
        self._record(event)
        self.autopilot_decision = event
        return event

    def _autopilot_decide(self) -> dict:
        """The evaluation in flight is done: choose, switch or keep, record the decision."""
        future, started, reasons = self._replan
        self._replan = None
        s, a = self.autopilot, self.recipe.autopilot
        try:
            ev: Evaluation = future.result()
        except Exception as e:  # noqa: BLE001 - a failed re-plan is a decision not taken, not a dead driver
            return self._decision_event(Decision("keep", f"re-plan failed: {' '.join(str(e).split())}"), self.step,
                                        reasons, s.planned, started_step=started)
        extra = {"started_step": started, "replan_s": ev.replan_s, "notes": list(ev.notes)}
        self.autopilot = s = replace(s, last_decision_step=self.step)
        if self.history.latest.sha256 != ev.current.sha256:
            return self._decision_event(Decision("skip", "the running plan changed while re-planning"), self.step,
                                        reasons, ev.conditions, **extra)
        d = choose(ev.current, ev.options, a.margin, s.rejected, ev.conditions)
        if d.action != "switch":
            self.autopilot = replace(s, planned=ev.conditions)  # the running plan is the one for them
            return self._decision_event(d, self.step, reasons, ev.conditions, **extra)
        if a.max_switches_per_hour <= 0:
            return self._decision_event(replace(d, action="keep", reason=d.reason + "; autopilot.max_switches_per_hour=0"),
                                        self.step, reasons, ev.conditions, **extra)
        running = self.history.running().version
        try:
            answer = self._accept(d.option.plan, d.option.dbo, SOURCE)
        except (UpgradeRefused, TesseraConfigError) as e:
            self.autopilot = replace(s, planned=ev.conditions)
            return self._decision_event(replace(d, action="keep", reason=f"refused: {e}"), self.step, reasons,
                                        ev.conditions, **extra)
        if answer.get("no_change"):
            self.autopilot = replace(s, planned=ev.conditions)
            return self._decision_event(replace(d, action="keep", reason="runs what the current version runs"),
                                        self.step, reasons, ev.conditions, **extra)
        before = tuple(ms for _, ms in s.recent_ms[-a.verify_steps:])
        pending = Pending(answer["version"], running, self.step, answer["effective_step"],
                          d.option.predicted_ms / d.current_ms, before, (d.option.sha256, ev.conditions.key()),
                          ev.conditions, s.planned)
        self.autopilot = replace(s, pending=pending, planned=ev.conditions, switches=s.switches + 1,
                                 switch_times=s.switch_times + (time.time(),))
        return self._decision_event(d, self.step, reasons, ev.conditions, plan_version=answer["version"],
                                    effective_step=answer["effective_step"], sha256=d.option.sha256, **extra)

    def _autopilot_verify(self, step: int) -> None:
        """The switch being verified: dropped when another version superseded it; judged once
        ``autopilot.verify_steps`` ordinary iterations ran on it; rolled back when slower."""
        s, a = self.autopilot, self.recipe.autopilot
        p = s.pending
        if p is None:
            return
        base = {"event": EVENT_VERIFY, "plan_version": p.plan_version, "from_version": p.from_version,
                "sha256": p.key[0], "conditions": p.planned.to_dict(), "step": step}
        if self.history.latest.version != p.plan_version:  # an upgrade or rollback came in meanwhile
            self.autopilot = replace(s, pending=None)
            self._record(dict(base, action="superseded", latest_version=self.history.latest.version, time=time.time()))
            return
        if len(p.after_ms) < a.verify_steps:
            return
        if not p.before_ms:
            self.autopilot = replace(s, pending=None)
            self.autopilot_verdict = dict(base, action="keep", reason="no iteration times before the switch",
                                          time=time.time())
            self._record(self.autopilot_verdict)
            return
        v = verify(p.plan_version, p.before_ms, p.after_ms, p.predicted_ratio)
        event = dict(base, **v.to_dict())
        self.autopilot = s = replace(s, pending=None, last_decision_step=step)
        if v.action == "rollback":
            try:
                back = self.rollback(to=p.from_version)
                event.update(rollback_version=back.get("version"), effective_step=back.get("effective_step"))
            except UpgradeRefused as e:  # recorded as plan_refused by rollback itself
                event.update(action="keep", reason=f"rollback refused: {e}")
            else:
                self.autopilot = replace(s, rejected=s.rejected | {p.key}, planned=p.previous,
                                         rollbacks=s.rollbacks + 1)
        event["time"] = time.time()
        self.autopilot_verdict = event
        self._record(event)
