"""The job's driver: a named Ray actor that plans, serves Programs and collects metrics.

One actor per run, named :func:`driver_name` ``(run name)`` in an explicit namespace (default
``tessera``), so a separate client finds it with ``ray.init(address=..., namespace="tessera")``
and ``ray.get_actor(name)``. It is owned by the launching process (it dies with the job) or
``detached`` (it outlives it; kill it with ``ray.kill``), and restarts up to ``max_restarts``
times.

At start-up it either recovers the plan, its version and the step from the newest complete
checkpoint of the run directory (a restarted driver, or a resumed run), or plans afresh:
analytic costs -> :func:`tessera.plan.planner.make_plan` -> Programs
(:func:`tessera.flow.compile_programs`, validated). When Ray restarts the actor it runs
``__init__`` again: the new incarnation recovers from the checkpoint, records a
``driver_restart`` event and starts a new record list; what lived only in the old one's memory
(records not yet read by the launcher, a pending or post-checkpoint plan upgrade, the attempt
count, claimed faults) is gone.

RPCs (every value is a plain dict/list/number, JSON-ready):

* ``get_program(rank)``: the Program of world rank ``rank`` under the current plan (with
  ``dbo.enabled`` slot-annotated, and its pipeline rank's DBO table under ``dbo``:
  :mod:`tessera.train.dbo_run`);
* ``status(history=50)``: step, plan (version, name, partition), pending upgrade, attempts,
  the last ``history`` metric records;
* ``report(rank, step, metrics)``: a rank reports one iteration's metrics;
* ``record_fatal(rank, error)`` / ``fatal_error()``: bad input a worker found (restarted workers
  fail fast with it; the launcher reports it as one line, exit code 2);
* ``request_upgrade(plan)``: store a new Plan (dict) as the next version; rank 0 applies it at
  the next iteration boundary through ``poll_plan(step)``. Only plans with the running partition
  are accepted for now (moving layers between ranks is not implemented);
* ``worker_group_started(step, removed_partial)``: rank 0 announces a (re)started worker group
  (and the partial checkpoints it deleted); returns the attempt number;
* ``records_since(i, incarnation)``: records from index ``i`` of this driver incarnation (the
  launcher's metrics pump; a restarted driver starts a new incarnation and a new record list),
  ``metrics_since(i)``: the same without the incarnation;
* ``claim_fault(key)``: True exactly once per key (fault-injection tests).
"""

from __future__ import annotations

import time
import uuid
import warnings

from tessera.errors import ProgramError, TesseraConfigError

NAMESPACE = "tessera"


def driver_name(run_name: str) -> str:
    """The actor name of run ``run_name``'s driver."""
    return f"tessera-driver-{run_name}"


def plan_programs(recipe, costs=None):
    """``(Plan, Programs)`` of ``recipe``: analytic costs (or ``costs``) -> overlap-aware plan ->
    compiled and validated Programs, slot-annotated with W slack under ``dbo.enabled`` (the
    driver's planning step, usable without Ray)."""
    from tessera.flow import build_costs, compile_programs, plan_recipe, resolve

    res = resolve(recipe)
    costs = build_costs(res) if costs is None else costs
    report = plan_recipe(res, costs)
    return report.tessera, compile_programs(report.tessera, costs if recipe.dbo.enabled else None)


class Driver:
    """The driver's state and RPCs (wrapped as a Ray actor by :func:`start_driver`).

    Args:
        recipe_dict: ``Recipe.to_dict()`` of the job.
        run_dir: the run directory (checkpoints are looked for there).
        run_name: the run's name.
        plan_dict: a plan already made for the recipe (``Plan.to_dict``; a profile run reuses its
            setup's), used instead of planning when no checkpoint holds one.
    """

    def __init__(self, recipe_dict: dict, run_dir: str, run_name: str, plan_dict: dict | None = None) -> None:
        from tessera.config.load import recipe_from_dict
        from tessera.engine.groups import Layout

        self.recipe = recipe_from_dict(recipe_dict)
        self.run_dir, self.run_name = run_dir, run_name
        p = self.recipe.parallel
        self.layout = Layout(p.pp, p.dp, p.ep)
        self.started = time.time()
        self.recovered_from: str | None = None
        self.step = 0
        self.plan = self.programs = None
        self.plan_version = 0
        self.costs = None  # the plan's costs, kept with dbo.enabled (slot annotations, DBO tables)
        self.dbo_tables: tuple = ()  # per pipeline rank, for self.programs (dbo.enabled)
        self.error: Exception | None = None  # a planning error, handed back by ready()
        self.fatal: tuple[int, Exception] | None = None  # bad input a worker found: (rank, error)
        t0 = time.perf_counter()
        try:
            self._load_or_plan(run_dir, plan_dict)
        except (TesseraConfigError, ProgramError) as e:
            self.error = e
        self.plan_s = time.perf_counter() - t0
        self.pending: tuple | None = None  # (version, plan, programs, dbo tables)
        self.records: list[dict] = []
        self.last_by_rank: dict[int, dict] = {}
        self.attempts = 0
        self.faults: set[str] = set()
        self.upgrades: list[dict] = []
        self.profiles: dict[int, dict] = {}  # profile runs: rank -> samples (report_profile)
        self.profile_state: tuple[int, int, str] = (0, 0, "(workers starting)")  # profile_progress
        self.incarnation = uuid.uuid4().hex
        self.restarted = _actor_restarted()
        if self.restarted and self.error is None:  # Ray restarted this actor: say what it recovered
            self.records.append({"event": "driver_restart", "recovered_from": self.recovered_from, "step": self.step,
                                 "plan_version": self.plan_version, "time": time.time()})

    def _load_or_plan(self, run_dir: str, plan_dict: dict | None = None) -> None:
        from tessera.flow import compile_programs
        from tessera.program.plan import Plan
        from tessera.train.checkpoint import latest_complete, load_plan

        ckpt = latest_complete(run_dir)
        if self.recipe.dbo.enabled:
            from tessera.flow import build_costs, resolve

            self.costs = build_costs(resolve(self.recipe))
        if ckpt is not None:
            plan_dict, self.plan_version, self.step = load_plan(ckpt.path)
            self.plan = Plan.from_dict(plan_dict)
            self.programs = compile_programs(self.plan, self.costs)
            self.recovered_from = ckpt.path
        elif plan_dict is not None:  # planned already by the caller (a profile run's setup)
            self.plan = Plan.from_dict(plan_dict)
            self.programs = compile_programs(self.plan, self.costs)
        else:
            self.plan, self.programs = plan_programs(self.recipe, self.costs)
        self.dbo_tables = self._tables(self.programs)

    def _tables(self, programs) -> tuple:
        """The DBO tables of ``programs`` (:func:`tessera.train.dbo_run.dbo_tables`; () without
        ``dbo.enabled``).

        Raises:
            TesseraConfigError: the recipe's token counts do not fit the Programs (``dbo.routing``)."""
        if not self.recipe.dbo.enabled:
            return ()
        from tessera.config.resolve import resolve_model
        from tessera.train.dbo_run import dbo_tables

        try:
            return dbo_tables(self.recipe, programs, self.costs, resolve_model(self.recipe))
        except ValueError as e:
            d = self.recipe.dbo
            field, value = ("dbo.counts_path", d.counts_path) if d.routing == "recorded" else ("dbo.routing", d.routing)
            raise TesseraConfigError(field, value, f"gives token counts the Programs cannot use: {e}",
                                     "record counts for this recipe (python -m tessera.train.route_counts RECIPE "
                                     "--out FILE) or use a skew model (dbo.routing=zipf)") from None

    # --- plan ---------------------------------------------------------------------------------
    def ready(self) -> dict:
        """Summary of the plan the job starts with (``{"error": exception}`` if planning failed;
        both error types pickle, so the caller gets the same type and fields)."""
        if self.error is not None:
            return {"error": self.error}
        return {"plan_version": self.plan_version, "plan": self.plan.name,
                "partition": self.plan.partition.describe(), "recovered_from": self.recovered_from,
                "step": self.step, "plan_s": self.plan_s}

    def plan_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "plan_version": self.plan_version}

    def get_program(self, rank: int) -> dict:
        """``{"plan_version", "program"}`` for world rank ``rank`` (``Program.to_dict`` form)."""
        if not self.layout.contains(rank):
            raise ValueError(f"rank {rank} is outside the job's {self.layout.world_size} ranks")
        p = self.layout.pipeline_rank(rank)
        out = {"plan_version": self.plan_version, "program": self.programs[p].to_dict()}
        if self.dbo_tables:
            from tessera.train.dbo_run import table_to_dict

            out["dbo"] = table_to_dict(self.dbo_tables[p])
        return out

    def request_upgrade(self, plan: dict) -> int:
        """Queue ``plan`` (``Plan.to_dict`` form) as the next version; returns that version.

        Raises:
            ValueError: another pipeline shape or partition.
            ProgramError: its Programs are invalid.
        """
        from tessera.flow import compile_programs
        from tessera.program.plan import Plan

        new = Plan.from_dict(plan)
        old = self.plan
        if (new.pp, new.vpp, new.num_microbatches, new.template) != (old.pp, old.vpp, old.num_microbatches,
                                                                     old.template):
            raise ValueError("the upgrade must keep pp, vpp, num_microbatches and the template")
        if new.partition != old.partition:
            raise ValueError(f"the upgrade moves layers ({new.partition.describe()} vs {old.partition.describe()}); "
                             "changing the partition of a running job is not supported yet")
        version = max(self.plan_version, self.pending[0] if self.pending else 0) + 1
        programs = compile_programs(new, self.costs)  # ProgramError (a ValueError) names the rank and instruction
        self.pending = (version, new, programs, self._tables(programs))
        return version

    def poll_plan(self, step: int) -> int:
        """Called by rank 0 before iteration ``step``: applies a pending upgrade; returns the
        plan version every rank must run from ``step`` on."""
        if self.pending is not None:
            self.plan_version, self.plan, self.programs, self.dbo_tables = self.pending
            self.pending = None
            self.upgrades.append({"plan_version": self.plan_version, "applied_at_step": step})
            self.records.append({"event": "plan_upgrade", "plan_version": self.plan_version, "step": step})
        return self.plan_version

    # --- progress and metrics -----------------------------------------------------------------
    def worker_group_started(self, step: int, removed_partial: list[str] | None = None) -> int:
        """Rank 0 of a (re)started worker group, resuming after ``step`` (having deleted the
        partial checkpoints ``removed_partial``); returns the attempt."""
        attempt = self.attempts
        self.attempts += 1
        self.step = step
        self.records.append({"event": "start", "attempt": attempt, "resume_step": step,
                             "removed_partial": list(removed_partial or []), "time": time.time()})
        return attempt

    def report(self, rank: int, step: int, metrics: dict) -> None:
        self.step = step
        self.last_by_rank[rank] = dict(metrics, step=step)
        if rank == 0:
            self.records.append(dict(metrics, step=step))

    def metrics_since(self, index: int) -> list[dict]:
        return self.records[index:]

    def records_since(self, index: int, incarnation: str | None = None) -> dict:
        """``{"incarnation", "records"}``: the records from ``index`` if ``incarnation`` is this
        driver's, else (the driver restarted since the caller's last read) all of them."""
        return {"incarnation": self.incarnation,
                "records": self.records[index if incarnation == self.incarnation else 0:]}

    def status(self, history: int = 50) -> dict:
        steps = [r for r in self.records if "event" not in r]
        return {
            "run": self.run_name, "step": self.step, "total_steps": self.recipe.train.steps,
            "plan_version": self.plan_version, "plan": self.plan.name,
            "partition": self.plan.partition.describe(),
            "pending_upgrade": self.pending[0] if self.pending else None, "upgrades": list(self.upgrades),
            "attempts": self.attempts, "recovered_from": self.recovered_from, "restarted": self.restarted,
            "incarnation": self.incarnation,
            "uptime_s": time.time() - self.started, "reports": len(steps),
            "last": steps[-1] if steps else None, "metrics": steps[-history:] if history > 0 else [],
        }

    def report_profile(self, rank: int, report: dict) -> None:
        """A profile run's samples from world rank ``rank`` (:func:`tessera.train.profiling.profile_loop`)."""
        self.profiles[rank] = report

    def profile_progress(self, done: int, total: int, phase: str) -> None:
        """Rank 0 of a profile run: ``done`` of ``total`` timed iterations, in ``phase``."""
        self.profile_state = (int(done), int(total), str(phase))

    def profile_progress_state(self) -> tuple[int, int, str]:
        """The last :meth:`profile_progress` (``(0, 0, "(workers starting)")`` before any)."""
        return self.profile_state

    def profile_reports(self) -> dict[int, dict]:
        """Every rank's profile report so far."""
        return dict(self.profiles)

    def record_fatal(self, rank: int, error: Exception) -> None:
        """A worker found bad input it cannot run with (``error``: a TesseraConfigError or
        ProgramError); the first one is kept, so restarted workers fail fast with it and the
        launcher reports it (:meth:`fatal_error`)."""
        if self.fatal is None:
            self.fatal = (rank, error)
            self.records.append({"event": "worker_error", "rank": rank, "error": str(error), "time": time.time()})

    def fatal_error(self) -> tuple[int, Exception] | None:
        """``(rank, error)`` recorded by :meth:`record_fatal`, or None."""
        return self.fatal

    def claim_fault(self, key: str) -> bool:
        if key in self.faults:
            return False
        self.faults.add(key)
        return True


def _actor_restarted() -> bool:
    """True inside a Ray actor that Ray has restarted (False outside actors and outside Ray).

    Raises:
        Whatever Ray raises when it cannot tell (e.g. the GCS does not answer): guessing "first
        start" would hide a restart and its recovery event.
    """
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    with warnings.catch_warnings():  # Ray's property reads a deprecated attribute inside
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def start_driver(recipe, run_dir: str, run_name: str, *, namespace: str = NAMESPACE, detached: bool = False,
                 max_restarts: int = 3, timeout_s: float = 600.0, plan=None):
    """Create the run's driver actor and wait until it has a plan (``plan``: a Plan already
    made, used instead of planning); returns ``(handle, ready())``.

    Raises:
        ValueError: an actor of that name already exists in ``namespace``.
        TesseraConfigError / ProgramError: planning failed (the actor is killed).
    """
    import ray

    cls = ray.remote(Driver)
    handle = cls.options(name=driver_name(run_name), namespace=namespace, lifetime="detached" if detached else None,
                         max_restarts=max_restarts, max_task_retries=-1, num_cpus=0).remote(
        recipe.to_dict(), run_dir, run_name, None if plan is None else plan.to_dict())
    ready = ray.get(handle.ready.remote(), timeout=timeout_s)
    if "error" in ready:
        ray.kill(handle)
        raise ready["error"]
    return handle, ready
