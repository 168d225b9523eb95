"""The driver's plan-upgrade RPCs (mixed into :class:`tessera.train.job.driver.Driver`).

A request is validated against the plan it will replace (the newest accepted version, pending
or running: :mod:`tessera.train.upgrade.check`), then appended to the job's
:class:`~tessera.train.upgrade.versions.History` with an announced effective step, ``job.upgrade_lead_steps``
after the iteration that runs when the request arrives (the newest step the driver has seen, plus
one), and after every earlier version's own step. The
history is written to the run directory at once. Ray runs one call of this actor at a time, so
two simultaneous requests are serialised: the second is validated against the first and takes
effect one step or more after it.

Workers learn of pending versions without a driver round trip on the critical path: rank 0 keeps
one :meth:`UpgradeRPCs.pending_versions` call in flight and reads its answer when it has
arrived; the ranks agree on the switch step in the collective that gathers every iteration's
metrics (:mod:`tessera.train.upgrade.schedule`). Rank 0's metric reports then confirm the step each
version really took effect at (:meth:`UpgradeRPCs.confirm_version`).

Every RPC takes and returns JSON-ready values; plans and recipes arrive as JSON text.
"""

from __future__ import annotations

import json
import time

from tessera.errors import TesseraConfigError, UpgradeRefused



def _recorded(fn):
    """Keep a refusal in the driver's records (``{"event": "plan_refused", ...}``, so
    ``metrics.jsonl`` shows it) before it reaches the caller."""
    import functools

    @functools.wraps(fn)
    def call(self, *args):
        try:
            return fn(self, *args)
        except UpgradeRefused as e:
            self.records.append({"event": "plan_refused", "request": fn.__name__, "field": e.field,
                                 "reason": str(e), "step": self.step, "time": time.time()})
            raise

    return call


class UpgradeRPCs:
    """Upgrade requests, versions and per-version Programs (needs the Driver's ``recipe``,
    ``costs``, ``history``, ``run_dir``, ``step``, ``records`` and ``_programs_of``)."""

    # --- requests ------------------------------------------------------------------------------
    @_recorded
    def upgrade_plan(self, plan_json: str) -> dict:
        """Accept the plan in ``plan_json`` (``Plan.to_dict`` JSON, or a ``tessera plan`` output
        file) as the next version, with the bubble optimizer as the newest version has it.

        Returns:
            ``{"version", "effective_step"}``.

        Raises:
            UpgradeRefused: not a plan, or a check of :func:`tessera.train.upgrade.check.check_upgrade` fails.
        """
        from tessera.train.upgrade.versions import plan_from_json

        return self._accept(plan_from_json(plan_json), self.history.latest.dbo, "plan")

    @_recorded
    def upgrade_recipe(self, recipe_json: str) -> dict:
        """Re-plan with the recipe in ``recipe_json`` (``Recipe.to_dict`` JSON: e.g. other planner
        settings or costs) and accept that plan, with the recipe's ``dbo.enabled``. The model,
        the training data and every ``parallel`` field but ``vpp`` must be the job's.

        Raises:
            UpgradeRefused: not a recipe, another model or layout, planning failed, or a check fails.
        """
        from tessera.config.load import recipe_from_dict
        from tessera.flow import plan_programs

        try:
            new = recipe_from_dict(json.loads(recipe_json))
        except (TypeError, ValueError) as e:
            raise UpgradeRefused("recipe", "(unreadable)", f"is not a recipe: {' '.join(str(e).split())}",
                                 "pass a recipe YAML that `tessera train` accepts") from None
        old = self.recipe
        for section in ("model", "train", "data"):
            if getattr(new, section, None) != getattr(old, section, None):
                raise UpgradeRefused(f"recipe.{section}", "(changed)", "must be the running job's",
                                     f"change only planner, hardware or dbo settings (keep {section})")
        a, b = new.parallel, old.parallel
        for name in ("pp", "dp", "ep", "tp", "num_microbatches", "micro_batch_size", "seq_length", "moe_dispatcher",
                     "dp_shard"):
            if getattr(a, name) != getattr(b, name):
                raise UpgradeRefused(f"recipe.parallel.{name}", getattr(a, name), f"must be the job's {getattr(b, name)!r}",
                                     f"set parallel.{name}={getattr(b, name)}")
        try:
            plan, _ = plan_programs(new)
        except (TesseraConfigError, ValueError) as e:
            raise UpgradeRefused("recipe", new.name, f"cannot be planned: {' '.join(str(e).split())}",
                                 "fix the recipe; `tessera plan` shows the same error") from None
        return self._accept(plan.to_dict(), bool(new.dbo.enabled), "recipe")

    @_recorded
    def upgrade_dbo(self, on: bool) -> dict:
        """The newest version's plan with the bubble optimizer switched ``on`` (or off).

        Raises:
            UpgradeRefused: it is already so.
        """
        latest = self.history.latest
        if bool(on) == latest.dbo:
            raise UpgradeRefused("dbo", "on" if on else "off", f"is already {'on' if on else 'off'} in version "
                                 f"{latest.version}", "nothing to do")
        return self._accept(latest.plan, bool(on), "dbo")

    @_recorded
    def rollback(self) -> dict:
        """Re-apply the version before the newest one (as a new version, through the same checks).

        Raises:
            UpgradeRefused: the job has only its first version.
        """
        h = self.history
        if len(h.versions) < 2:
            raise UpgradeRefused("rollback", 0, "needs a version before the newest; the job runs its first plan",
                                 "upgrade first")
        prev = h.versions[-2]
        return self._accept(prev.plan, prev.dbo, "rollback", rollback_of=prev.version)

    # --- versions ------------------------------------------------------------------------------
    def _accept(self, plan: dict, dbo: bool, source: str, rollback_of: int | None = None) -> dict:
        from tessera.train.upgrade.check import check_upgrade
        from tessera.train.upgrade.versions import save_history

        checked = check_upgrade(self.recipe, plan, self.costs, dbo)
        lead = self.recipe.job.upgrade_lead_steps
        # the newest reported step is k: k + 1 is running, and the ranks can agree no earlier than
        # at the end of k + 2 (rank 0 asks as an iteration starts): k + 1 + lead is exact for lead >= 2
        new = self.history.accept(checked.plan.to_dict(), dbo, source, self.step + 1 + max(1, lead), rollback_of)
        v = new.latest
        self._store_programs(v.version, checked.programs, dbo)  # the tables may refuse (dbo.routing)
        self.history = new
        save_history(self.run_dir, new)
        self.records.append({"event": "plan_accepted", "plan_version": v.version, "source": source,
                             "effective_step": v.effective_step, "sha256": v.sha256, "time": time.time()})
        return {"version": v.version, "effective_step": v.effective_step}

    def pending_versions(self) -> list[list[int]]:
        """``[[version, effective step], ...]`` of the accepted versions not yet running (rank 0's
        background poll)."""
        return [[v.version, v.effective_step] for v in self.history.pending()]

    def confirm_version(self, version: int, step: int, switch: dict | None = None) -> None:
        """Rank 0: ``version`` took effect at iteration ``step`` (``switch``: what the switch
        cost, ``{"from", "moved_bytes", "switch_s"}``); recorded and saved."""
        from tessera.train.upgrade.versions import save_history

        before = self.history.running().version
        self.history = self.history.applied(int(version), int(step))
        if self.history.running().version != before:
            save_history(self.run_dir, self.history)
            self.records.append(dict({"event": "plan_switch", "step": int(step), "from_version": before,
                                      "plan_version": int(version), "time": time.time()}, **(switch or {})))
            self.upgrades.append({"plan_version": int(version), "applied_at_step": int(step), **(switch or {})})

    def versions(self) -> list[dict]:
        """Every version's summary (:meth:`tessera.train.upgrade.versions.PlanVersion.summary`)."""
        return [v.summary() for v in self.history.versions]
