"""The driver's plan-upgrade RPCs (mixed into :class:`tessera.train.job.driver.Driver`).

A request is validated against the plan it will replace (the newest accepted version, pending
or running: the *current* version; :mod:`tessera.train.upgrade.check`); one that runs what the
current version runs (the same Programs and bubble optimizer) adds no version and is answered
"no change". Otherwise it is appended to the job's
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
from tessera.program.plan import Plan, with_split_w
from tessera.program.templates import get_template


def _same_run(a: tuple, b: tuple) -> bool:
    """Whether two ``(Programs, dbo)`` run the same: the same bubble-optimizer switch and every
    rank's Program equal as data (``Program.to_dict``), but for ``plan_name`` (the plan's
    provenance, ``baseline`` or ``tessera``, which changes nothing the workers do)."""
    (pa, da), (pb, db) = a, b

    def body(programs) -> list[dict]:
        return [{k: v for k, v in p.to_dict().items() if k != "plan_name"} for p in programs]

    return bool(da) == bool(db) and len(pa) == len(pb) and body(pa) == body(pb)


def _recorded(fn):
    """Keep a refusal in the driver's records (``{"event": "plan_refused", ...}``, so
    ``metrics.jsonl`` shows it) before it reaches the caller."""
    import functools

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except UpgradeRefused as e:
            self._record({"event": "plan_refused", "request": fn.__name__, "field": e.field,
                                 "reason": str(e), "step": self.step, "time": time.time()})
            raise

    return call


class UpgradeRPCs:
    """Upgrade requests, versions and per-version Programs (needs the Driver's ``recipe``,
    ``costs``, ``history``, ``run_dir``, ``step``, ``records``, ``_record`` and ``_programs_of``)."""

    # --- requests ------------------------------------------------------------------------------
    @_recorded
    def upgrade_plan(self, plan_json: str) -> dict:
        """Accept the plan in ``plan_json`` (``Plan.to_dict`` JSON, or a ``tessera plan`` output
        file) as the next version, with the bubble optimizer as the newest version has it.

        Returns:
            ``{"version", "effective_step"}`` of the new version; ``{"version", "effective_step",
            "no_change": True, "running"}`` of the current one (nothing added) when the plan runs
            what it runs (:meth:`_accept`).

        Raises:
            UpgradeRefused: not a plan, or a check of :func:`tessera.train.upgrade.check.check_upgrade` fails.
        """
        from tessera.train.upgrade.versions import plan_from_json

        return self._accept(plan_from_json(plan_json), self.history.latest.dbo, "plan")

    @_recorded
    def upgrade_recipe(self, recipe_json: str) -> dict:
        """Re-plan with the recipe in ``recipe_json`` (``Recipe.to_dict`` JSON: e.g. other planner
        settings or costs) and accept that plan, with the recipe's ``dbo.enabled``. The recipe is
        compared with the running job's field by field
        (:func:`tessera.train.upgrade.check.recipe_upgrade`): fields a running job cannot change
        (the model, the worker group, the batch, the precision) must be the job's; fields that
        cannot change a plan (steps, checkpoint interval, logging, ...) are ignored and reported.

        Returns:
            as :meth:`upgrade_plan`, with ``"ignored"``: ``["field: running=X new=Y", ...]``.

        Raises:
            UpgradeRefused: not a recipe, a field the running job cannot change differs (every
                such field named with both values), planning failed, or a check fails.
        """
        from tessera.config.load import recipe_from_dict
        from tessera.flow import plan_programs
        from tessera.train.upgrade.check import recipe_upgrade

        try:
            new = recipe_from_dict(json.loads(recipe_json))
        except (TypeError, ValueError) as e:
            raise UpgradeRefused("recipe", "(unreadable)", f"is not a recipe: {' '.join(str(e).split())}",
                                 "pass a recipe YAML that `tessera train` accepts") from None
        up = recipe_upgrade(self.recipe, new)
        try:
            plan, _ = plan_programs(up.recipe)
        except (TesseraConfigError, ValueError) as e:
            raise UpgradeRefused("recipe", new.name, f"cannot be planned: {' '.join(str(e).split())}",
                                 "fix the recipe; `tessera plan` shows the same error") from None
        answer = self._accept(plan.to_dict(), bool(up.recipe.dbo.enabled), "recipe")
        return dict(answer, ignored=[c.describe() for c in up.ignored])

    @_recorded
    def upgrade_dbo(self, on: bool) -> dict:
        """The newest version's plan with the bubble optimizer switched ``on`` (or off). Switched on
        where that plan keeps W inside B (``split_w`` false: the planner found no time to win by
        deferring W, e.g. the cpu preset's host cost per deferred W GEMM on a tiny model), the new
        version splits W (same partition, template and orders), so the optimizer has W to move;
        the workers rebuild their stages at the switch (:meth:`WorkerLoop.maybe_upgrade`).

        Raises:
            UpgradeRefused: it is already so.
        """
        latest = self.history.latest
        if bool(on) == latest.dbo:
            raise UpgradeRefused("dbo", "on" if on else "off", f"is already {'on' if on else 'off'} in version "
                                 f"{latest.version}", "nothing to do")
        plan = latest.plan
        if on and not plan.get("split_w", True):
            p = Plan.from_dict(plan)
            plan = with_split_w(p, get_template(p.template).fb_keeps_w).to_dict()
        return self._accept(plan, bool(on), "dbo")

    @_recorded
    def rollback(self, to: int | None = None) -> dict:
        """Go back along the job's versions (docs/operations.md, Versions): re-apply, as a new
        version (source ``rollback``) through the same checks, the predecessor of the current
        version (:meth:`~tessera.train.upgrade.versions.History.lineage`: the version whose plan
        the current one replaced; the nearest one back whose Programs or bubble optimizer differ
        from the current one's), or with ``to`` version ``to``. Rollbacks in a row walk back one
        version each; an upgrade after them continues from where they led.

        Returns:
            as :meth:`upgrade_plan` (``"no_change"`` when ``to`` runs what the current version
            runs), with ``"rollback_of"``: the version re-applied.

        Raises:
            UpgradeRefused: no version to go back to, or ``to`` is no version of the job.
        """
        h = self.history
        if to is None:
            current = self._programs_of(h.latest.version)[0], h.latest.dbo
            target = next((v for v in h.lineage()[1:]
                           if not _same_run(current, (self._programs_of(v)[0], h.at(v).dbo))), None)
            if target is None:
                path, cur = h.lineage(), h.latest.version
                what = f"version {cur}" + (f" re-applies v{path[0]}" if path[0] != cur else "")
                raise UpgradeRefused("rollback", cur, "has no earlier version with another plan to go back to "
                                     f"({what}; the path back: {' -> '.join(f'v{v}' for v in path)})",
                                     "upgrade first, or name a version with --to VERSION (tessera status lists them)")
        else:
            try:
                target = h.origin(int(to))
            except KeyError as e:
                raise UpgradeRefused("rollback --to", to, str(e.args[0]), "give a version tessera status lists") from None
        v = h.at(target)
        return dict(self._accept(v.plan, v.dbo, "rollback", rollback_of=target), rollback_of=target)

    # --- versions ------------------------------------------------------------------------------
    def _accept(self, plan: dict, dbo: bool, source: str, rollback_of: int | None = None) -> dict:
        """Check ``plan`` and append it as the next version; when it runs exactly what the
        current (newest accepted) version runs (the same Programs, the same bubble optimizer),
        add nothing and answer ``{"version", "effective_step", "no_change": True, "running"}``
        with the current version (``running``: the workers run it already)."""
        from tessera.train.upgrade.check import check_upgrade
        from tessera.train.upgrade.versions import save_history

        checked = check_upgrade(self.recipe, plan, self.costs, dbo)
        latest = self.history.latest
        if _same_run((checked.programs, dbo), (self._programs_of(latest.version)[0], latest.dbo)):
            self._record({"event": "plan_unchanged", "source": source, "plan_version": latest.version,
                                 "step": self.step, "time": time.time()})
            return {"version": latest.version, "effective_step": latest.effective_step, "no_change": True,
                    "running": latest.applied}
        lead = self.recipe.job.upgrade_lead_steps
        # the newest reported step is k: k + 1 is running, and the ranks can agree no earlier than
        # at the end of k + 2 (rank 0 asks as an iteration starts): k + 1 + lead is exact for lead >= 2
        new = self.history.accept(checked.plan.to_dict(), dbo, source, self.step + 1 + max(1, lead), rollback_of)
        v = new.latest
        self._store_programs(v.version, checked.programs, dbo)  # the tables may refuse (dbo.routing)
        self.history = new
        save_history(self.run_dir, new)
        self._record({"event": "plan_accepted", "plan_version": v.version, "source": source,
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
            self._record(dict({"event": "plan_switch", "step": int(step), "from_version": before,
                                      "plan_version": int(version), "time": time.time()}, **(switch or {})))
            self.upgrades.append({"plan_version": int(version), "applied_at_step": int(step), **(switch or {})})

    def versions(self) -> list[dict]:
        """Every version's summary (:meth:`tessera.train.upgrade.versions.PlanVersion.summary`)."""
        return [v.summary() for v in self.history.versions]
