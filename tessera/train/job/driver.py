"""The job's driver: a named Ray actor that plans, serves Programs and collects metrics.

One actor per run, named :func:`driver_name` ``(run name)`` in an explicit namespace (default
``tessera``), so a separate client finds it with ``ray.init(address=..., namespace="tessera")``
and ``ray.get_actor(name)``. It is owned by the launching process (it dies with the job) or
``detached`` (it outlives it; kill it with ``ray.kill``), and restarts up to ``max_restarts``
times.

At start-up it recovers the run's plan history (:mod:`tessera.train.upgrade.versions`) from the run
directory's ``plan_history.json`` (written after every accepted upgrade and every switch), else
from the newest complete checkpoint, or plans afresh: analytic costs ->
:func:`tessera.plan.planner.make_plan` -> Programs (:func:`tessera.flow.compile_programs`,
validated). Every record (a step's metrics, an event) is also appended to the run directory's
``driver_records.jsonl`` as it arrives. When Ray restarts the actor it runs ``__init__`` again:
the new incarnation comes back on the version the workers run (also one applied after the
newest checkpoint), starts its record list with the old incarnation's records from that file
(so a record the launcher had not read yet is not lost; the launcher writes each record once,
:class:`tessera.train.job.run.MetricsPump`) and records a ``driver_restart`` event; what lived
only in the old one's memory (the attempt count, claimed faults) is gone.

RPCs (every value is a plain dict/list/number, JSON-ready):

* ``get_program(rank, version=None)``: the Program of world rank ``rank`` under a version (the
  running one by default; slot-annotated, with its pipeline rank's DBO table under ``dbo``, when
  that version runs the bubble optimizer: :mod:`tessera.train.dbo.table`);
* ``plan_dict(version=None)``: a version's plan and the whole history (checkpoints keep both);
* ``status(history=50)``: step, plan (version, name, partition), pending upgrade, version
  history, attempts, the last ``history`` metric records;
* ``report(rank, step, metrics)``: a rank reports one iteration's metrics;
* ``record_fatal(rank, error)`` / ``fatal_error()``: bad input a worker found (restarted workers
  fail fast with it; the launcher reports it as one line, exit code 2);
* ``upgrade_plan(plan_json)``, ``upgrade_recipe(recipe_json)``, ``upgrade_dbo(on)``,
  ``rollback(to=None)``, ``pending_versions()``, ``confirm_version(version, step, switch)``,
  ``versions()``: plan upgrades (:mod:`tessera.train.upgrade.rpc`);
* ``set_autopilot(on)``, ``autopilot_status()``, ``autopilot_join(timeout_s)``: the autopilot,
  which rank 0's reports feed (:mod:`tessera.train.job.autopilot`);
* ``worker_group_started(step, removed_partial)``: rank 0 announces a (re)started worker group
  (and the partial checkpoints it deleted); returns the attempt number;
* ``records_since(i, incarnation)``: records from index ``i`` of this driver incarnation (the
  launcher's metrics pump; a restarted driver starts a new incarnation and a new record list),
  ``metrics_since(i)``: the same without the incarnation;
* ``place_ranks(node_ids, record)``: the workers' Ray nodes checked against the planned rank
  placement, the slot -> rank map or a one-line refusal (a ``placement`` event;
  :mod:`tessera.train.worker.placement`);
* ``claim_fault(key)``: True exactly once per key (fault-injection tests);
* ``request_stop(reason)`` / ``stop_requested()``: the launcher asks the job to stop (on SIGTERM,
  e.g. from ``ray job stop``); the workers end after the step they are in
  (:meth:`tessera.train.worker.loop.WorkerLoop.stop_due`).
"""

from __future__ import annotations

import json
import time
import uuid
import warnings

from tessera.errors import ProgramError, TesseraConfigError
from tessera.train import storage
from tessera.train.job.autopilot import AutopilotRPCs
from tessera.train.upgrade.rpc import UpgradeRPCs

NAMESPACE = "tessera"
RECORDS_FILE = "driver_records.jsonl"
"""The driver's records, one JSON line each, in the run directory (read back by a restarted driver)."""


def driver_name(run_name: str) -> str:
    """The actor name of run ``run_name``'s driver."""
    return f"tessera-driver-{run_name}"


class Driver(UpgradeRPCs, AutopilotRPCs):
    """The driver's state and RPCs (wrapped as a Ray actor by :func:`start_driver`; the upgrade
    RPCs are :class:`~tessera.train.upgrade.rpc.UpgradeRPCs`, the autopilot's
    :class:`~tessera.train.job.autopilot.AutopilotRPCs`).

    Args:
        recipe_dict: ``Recipe.to_dict()`` of the job.
        run_dir: the run directory (checkpoints and ``plan_history.json`` are looked for there): a
            local path or an object-store URI (:mod:`tessera.train.storage`).
        run_name: the run's name.
        plan_dict: a plan already made for the recipe (``Plan.to_dict``; a profile run reuses its
            setup's), used instead of planning when the run has no plan yet.
        restart_plan: a plan for a resumed run (``Plan.to_dict``): the run continues from its
            newest checkpoint on this plan with the recipe's ``dbo.enabled``, as a new version
            (source ``restart``; checked like an upgrade). A run without a checkpoint starts on
            it (checked the same way).
        submission_id: the Ray job submission id when the job came from ``ray job submit``
            (``tessera status --job`` finds the driver by it).
    """

    def __init__(self, recipe_dict: dict, run_dir: str, run_name: str, plan_dict: dict | None = None,
                 restart_plan: dict | None = None, submission_id: str | None = None) -> None:
        from tessera.config.load import recipe_from_dict
        from tessera.engine.groups import Layout

        self.recipe = recipe_from_dict(recipe_dict)
        self.run_dir, self.run_name, self.submission_id = run_dir, run_name, submission_id
        p = self.recipe.parallel
        self.layout = Layout(p.pp, p.dp, p.ep)
        self.started = time.time()
        self.recovered_from: str | None = None
        self.step = 0
        self.history = None  # tessera.train.upgrade.versions.History, once planned
        self.costs = None  # the job's ModelCosts (plans, memory checks, slot annotations, DBO tables)
        self.compiled: dict[int, tuple] = {}  # version -> (Programs, DBO tables or ())
        self.error: Exception | None = None  # a planning error, handed back by ready()
        self.fatal: tuple[int, Exception] | None = None  # bad input a worker found: (rank, error)
        self.stop: str | None = None  # why the launcher asked the job to stop (request_stop)
        self.records: list[dict] = []
        self._records_path = storage.join(run_dir, RECORDS_FILE)  # run_dir: local, or s3:// / gs://
        restarted = _actor_restarted()
        if restarted and storage.exists(self._records_path):  # the old incarnation's records
            lines = storage.read_text(self._records_path).splitlines()
            self.records = [json.loads(line) for line in lines if line.strip().endswith("}")]
        else:  # a new job (or a resumed one): the launcher wrote the earlier records already
            storage.makedirs(run_dir)
            storage.write_text(self._records_path, "")
        t0 = time.perf_counter()
        try:
            self._load_or_plan(run_dir, plan_dict, restart_plan)
        except (TesseraConfigError, ProgramError) as e:
            self.error = e
        self.plan_s = time.perf_counter() - t0
        self.last_by_rank: dict[int, dict] = {}
        self.attempts = 0
        self.placement: dict | None = None  # the workers' nodes as checked by place_ranks
        self.faults: set[str] = set()
        self.upgrades: list[dict] = []
        self.profiles: dict[int, dict] = {}  # profile runs: rank -> samples (report_profile)
        self.profile_state: tuple[int, int, str] = (0, 0, "(workers starting)")  # profile_progress
        self.incarnation = uuid.uuid4().hex
        self.restarted = restarted
        self._autopilot_init()
        if self.restarted and self.error is None:  # Ray restarted this actor: say what it recovered
            self._record({"event": "driver_restart", "recovered_from": self.recovered_from, "step": self.step,
                                 "plan_version": self.plan_version, "time": time.time()})

    def _load_or_plan(self, run_dir: str, plan_dict: dict | None, restart_plan: dict | None) -> None:
        """The run's history: the run directory's ``plan_history.json`` (newest: it has every
        accepted upgrade), else the newest complete checkpoint's, else a fresh plan."""
        from tessera.flow import build_costs, plan_programs, resolve
        from tessera.train.worker.checkpoint import latest_complete, load_history, load_plan
        from tessera.train.upgrade.versions import History, load_history as load_run_history, save_history

        self.costs = build_costs(resolve(self.recipe))
        dbo = bool(self.recipe.dbo.enabled)
        ckpt = latest_complete(run_dir)
        history = load_run_history(run_dir)
        if ckpt is not None:
            self.recovered_from, self.step = ckpt.path, ckpt.step
            if history is None:
                history = load_history(ckpt.path)
            if history is None:  # a checkpoint without history: its plan is the first version
                plan, _, _ = load_plan(ckpt.path)
                history = History.start(plan, dbo, "initial", ckpt.step + 1)
        if history is None:
            if plan_dict is None and restart_plan is not None:  # a fresh run given its first plan
                from tessera.train.upgrade.check import check_upgrade

                plan_dict, restart_plan = check_upgrade(self.recipe, restart_plan, self.costs, dbo).plan.to_dict(), None
            if plan_dict is None:
                plan, _ = plan_programs(self.recipe, self.costs)
                plan_dict = plan.to_dict()
            history = History.start(plan_dict, dbo)
        self.history = history
        if restart_plan is not None and ckpt is not None:
            from tessera.train.upgrade.check import check_upgrade

            checked = check_upgrade(self.recipe, restart_plan, self.costs, dbo)
            new = history.accept(checked.plan.to_dict(), dbo, "restart", ckpt.step + 1)
            self.history = new.applied(new.latest.version, ckpt.step + 1)
        self._programs_of(self.history.running().version)  # compiles and checks the version the workers start on
        save_history(run_dir, self.history)

    def _store_programs(self, version: int, programs: tuple, dbo: bool) -> None:
        self.compiled[version] = (programs, self._tables(programs, dbo))

    def _programs_of(self, version: int) -> tuple:
        """``(Programs, DBO tables)`` of ``version`` (compiled once, kept)."""
        if version not in self.compiled:
            from tessera.flow import compile_programs
            from tessera.program.plan import Plan

            v = self.history.at(version)
            self._store_programs(version, compile_programs(Plan.from_dict(v.plan), self.costs if v.dbo else None),
                                 v.dbo)
        return self.compiled[version]

    def _tables(self, programs, dbo: bool) -> tuple:
        """The DBO tables of ``programs`` (:func:`tessera.train.dbo.table.dbo_tables`; () when the
        version runs without the bubble optimizer).

        Raises:
            TesseraConfigError: the recipe's token counts do not fit the Programs (``dbo.routing``)."""
        if not dbo:
            return ()
        from tessera.config.resolve import resolve_model
        from tessera.train.dbo.table import dbo_tables

        recipe = self.dbo_recipe
        try:
            return dbo_tables(recipe, programs, self.costs, resolve_model(recipe))
        except ValueError as e:
            d = recipe.dbo
            field, value = ("dbo.counts_path", d.counts_path) if d.routing == "recorded" else ("dbo.routing", d.routing)
            raise TesseraConfigError(field, value, f"gives token counts the Programs cannot use: {e}",
                                     "record counts for this recipe (python -m tessera.train.profile.routes RECIPE "
                                     "--out FILE) or use a skew model (dbo.routing=zipf)") from None

    @property
    def dbo_recipe(self):
        """The recipe a version with the bubble optimizer on runs it by: the job's own where it
        started with ``dbo.enabled``; else (switched on while the job runs) with ``dbo.enabled``
        and, at ep > 1, ``dbo.routing=router``: the policy re-predicts each slot from the live
        counts of the job's own router (:mod:`tessera.train.dbo.live`), its table's prior being
        uniform routing, since a job that did not plan for the optimizer has no counts of its own."""
        if self.recipe.dbo.enabled:
            return self.recipe
        live = ["dbo.routing=router"] if self.recipe.parallel.ep > 1 else []
        return self.recipe.with_overrides(["dbo.enabled=true", *live])

    # --- plan ---------------------------------------------------------------------------------
    @property
    def plan_version(self) -> int:
        """The version the workers run (the newest confirmed)."""
        return self.history.running().version

    @property
    def plan(self):
        from tessera.program.plan import Plan

        return Plan.from_dict(self.history.running().plan)

    @property
    def programs(self) -> tuple:
        return self._programs_of(self.plan_version)[0]

    @property
    def dbo_tables(self) -> tuple:
        return self._programs_of(self.plan_version)[1]

    def ready(self) -> dict:
        """Summary of the plan the job starts with (``{"error": exception}`` if planning failed;
        both error types pickle, so the caller gets the same type and fields)."""
        if self.error is not None:
            return {"error": self.error}
        return {"plan_version": self.plan_version, "plan": self.plan.name,
                "partition": self.plan.partition.describe(), "recovered_from": self.recovered_from,
                "step": self.step, "plan_s": self.plan_s}

    def plan_dict(self, version: int | None = None) -> dict:
        """``{"plan", "plan_version", "dbo", "history"}`` of ``version`` (None: the running one),
        with the whole history (a checkpoint keeps it)."""
        v = self.history.running() if version is None else self.history.at(int(version))
        return {"plan": v.plan, "plan_version": v.version, "dbo": v.dbo, "history": self.history.to_dict()}

    def get_program(self, rank: int, version: int | None = None) -> dict:
        """``{"plan_version", "program", "dbo_enabled", "plan_shape"}`` (plus ``"dbo"``, the rank's DBO table,
        and ``"dbo_routing"``, its count source (:attr:`dbo_recipe`), when that version runs the bubble optimizer) for ``rank``, the worker's position
        ``replica * pp + pipeline rank`` (:meth:`tessera.engine.groups.Layout.position`: the world
        rank under the ``pp-ep-dp`` order), under ``version`` (None: the running version). ``plan_shape`` (the partition bounds, vpp, whether W is
        split) is the same on every rank: where it changes, the ranks rebuild their stages.

        Raises:
            ValueError: a rank outside the job; KeyError: no such version.
        """
        from tessera.train.worker.step import program_splits_w

        if not self.layout.contains(rank):
            raise ValueError(f"rank {rank} is outside the job's {self.layout.world_size} ranks")
        version = self.plan_version if version is None else int(version)
        programs, tables = self._programs_of(version)
        p = self.layout.pipeline_rank(rank)
        plan = self.history.at(version).plan
        out = {"plan_version": version, "program": programs[p].to_dict(), "dbo_enabled": bool(tables),
               "plan_shape": {"bounds": list(plan["partition"]["bounds"]), "vpp": plan["vpp"],
                              "split_w": any(program_splits_w(pr) for pr in programs)}}
        if tables:
            from tessera.train.dbo.table import table_to_dict

            out["dbo"] = table_to_dict(tables[p])
            out["dbo_routing"] = self.dbo_recipe.dbo.routing
        return out

    # --- progress and metrics -----------------------------------------------------------------
    def worker_group_started(self, step: int, removed_partial: list[str] | None = None) -> int:
        """Rank 0 of a (re)started worker group, resuming after ``step`` (having deleted the
        partial checkpoints ``removed_partial``); returns the attempt."""
        attempt = self.attempts
        self.attempts += 1
        self.step = step
        self._record({"event": "start", "attempt": attempt, "resume_step": step,
                             "removed_partial": list(removed_partial or []), "time": time.time()})
        return attempt

    def _record(self, record: dict) -> None:
        """Keep ``record`` for the launcher and append it to ``driver_records.jsonl`` (one JSON
        line, written at once: it outlives this process; on an object store the object is
        rewritten, :func:`tessera.train.storage.append_text`)."""
        self.records.append(record)
        storage.append_text(self._records_path, json.dumps(record, default=str) + "\n")

    def report(self, rank: int, step: int, metrics: dict) -> None:
        """World rank ``rank``'s metrics of iteration ``step``; rank 0's are the job's: recorded,
        then the autopilot's (:meth:`~tessera.train.job.autopilot.AutopilotRPCs._autopilot_report`;
        a failure there is recorded as an ``autopilot_error`` event, never lost with the report)."""
        self.step = step
        self.last_by_rank[rank] = dict(metrics, step=step)
        if rank == 0:
            self._record(dict(metrics, step=step))
            if self.history is not None:
                try:
                    self._autopilot_report(step, metrics)
                except Exception as e:  # noqa: BLE001 - the autopilot must not cost the job its reports
                    self._record({"event": "autopilot_error", "error": f"{type(e).__name__}: {e}", "step": step,
                                  "time": time.time()})

    def metrics_since(self, index: int) -> list[dict]:
        return self.records[index:]

    def records_since(self, index: int, incarnation: str | None = None) -> dict:
        """``{"incarnation", "records"}``: the records from ``index`` if ``incarnation`` is this
        driver's, else (the driver restarted since the caller's last read) all of them."""
        return {"incarnation": self.incarnation,
                "records": self.records[index if incarnation == self.incarnation else 0:]}

    def status(self, history: int = 50) -> dict:
        """The job as ``tessera status`` shows it: step, running version and its plan, pending
        upgrades (the next one as ``{"version", "effective_step"}``), every version's summary,
        ``lineage`` (the path rollbacks walk back from the current version, newest first:
        :meth:`~tessera.train.upgrade.versions.History.lineage`), attempts, the autopilot
        (:meth:`~tessera.train.job.autopilot.AutopilotRPCs.autopilot_status`) and the last
        ``history`` metric records."""
        steps = [r for r in self.records if "event" not in r]
        pending = self.history.pending()
        plan = self.plan  # parsed once from the running version
        return {
            "run": self.run_name, "submission_id": self.submission_id, "step": self.step,
            "total_steps": self.recipe.train.steps, "plan_version": self.plan_version, "plan": plan.name,
            "template": plan.template, "vpp": plan.vpp, "partition": plan.partition.describe(),
            "dbo": self.history.running().dbo,
            "pending_upgrade": {"version": pending[0].version, "effective_step": pending[0].effective_step}
            if pending else None,
            "versions": self.versions(), "lineage": list(self.history.lineage()), "upgrades": list(self.upgrades),
            "attempts": self.attempts, "recovered_from": self.recovered_from, "restarted": self.restarted,
            "incarnation": self.incarnation, "placement": self.placement, "autopilot": self.autopilot_status(),
            "uptime_s": time.time() - self.started, "reports": len(steps),
            "last": steps[-1] if steps else None, "metrics": steps[-history:] if history > 0 else [],
        }

    def report_profile(self, rank: int, report: dict) -> None:
        """A profile run's samples from world rank ``rank`` (:func:`tessera.train.job.profile.profile_loop`)."""
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

    def place_ranks(self, node_ids: list, record: bool = True) -> dict:
        """Check the workers' nodes against the placement the plan assumed and map slots to ranks.

        ``node_ids[r]``: the Ray node id of world rank ``r`` (every worker of a starting group
        asks with the same list). The planned placement is
        :func:`tessera.spec.placement.place` of the recipe (``parallel.rank_order``,
        ``hardware.gpus_per_node``); :func:`tessera.spec.placement.check_nodes` finds the slot ->
        rank map that gives it (``[]``: Ray's own numbering does). ``record``: log the result as a
        ``placement`` event (the run's records, ``tessera status``; with ``node_ids``, the Ray node
        id of every world rank). Returns
        :func:`~tessera.spec.placement.check_nodes`' dict, or ``{"error": TesseraConfigError}`` when no map gives the planned placement (recorded as
        the job's fatal error: a restart on the same nodes cannot help)."""
        from tessera.config.resolve import resolve_hardware
        from tessera.spec.placement import check_nodes, place

        p = self.recipe.parallel
        planned = place(p.pp, p.dp, p.ep, resolve_hardware(self.recipe).gpus_per_node, p.rank_order)
        try:
            out = check_nodes(planned, node_ids)
        except TesseraConfigError as e:
            self.fatal = self.fatal or (0, e)
            if record:  # once per worker-group start (rank 0's call), not once per worker
                self._record({"event": "placement", "error": str(e), "time": time.time()})
            return {"error": e}
        self.placement = dict(out, node_ids=[str(n) for n in node_ids])  # which Ray node ran each world rank
        if record:
            self._record({"event": "placement", **self.placement, "time": time.time()})
        return out

    def record_fatal(self, rank: int, error: Exception) -> None:
        """A worker found bad input it cannot run with (``error``: a TesseraConfigError or
        ProgramError); the first one is kept, so restarted workers fail fast with it and the
        launcher reports it (:meth:`fatal_error`)."""
        if self.fatal is None:
            self.fatal = (rank, error)
            self._record({"event": "worker_error", "rank": rank, "error": str(error), "time": time.time()})

    def fatal_error(self) -> tuple[int, Exception] | None:
        """``(rank, error)`` recorded by :meth:`record_fatal`, or None."""
        return self.fatal

    def request_stop(self, reason: str) -> int:
        """The launcher asks the job to stop (``reason``, e.g. ``"SIGTERM"``): the workers learn
        it from :meth:`stop_requested` and end after the step they are in (writing its checkpoint
        when one is due); the first request is recorded as a ``stop_requested`` event. Returns
        the step reported last."""
        if self.stop is None:
            self.stop = str(reason)
            self._record({"event": "stop_requested", "reason": self.stop, "step": self.step,
                                 "time": time.time()})
        return self.step

    def stop_requested(self) -> str | None:
        """The reason of :meth:`request_stop`, or None while nobody asked the job to stop."""
        return self.stop

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
                 max_restarts: int = 3, timeout_s: float = 600.0, plan=None, restart_plan=None,
                 submission_id: str | None = None):
    """Create the run's driver actor and wait until it has a plan (``plan``: a Plan already
    made, used instead of planning; ``restart_plan``: a Plan a resumed run continues on, see
    :class:`Driver`; ``submission_id``: the Ray job submission id); returns ``(handle, ready())``.
    A ``run_dir`` on object storage (``s3://``, ``gs://``) gives the actor the launcher's storage
    variables (:func:`tessera.train.storage.storage_env`) in its runtime environment. The actor
    runs on the launcher's node (soft affinity, as Ray Train's controller): losing another node of
    the cluster does not restart it.

    Raises:
        ValueError: an actor of that name already exists in ``namespace``.
        TesseraConfigError / ProgramError: planning failed (the actor is killed, as on any other
            failure to start: :func:`kill_driver`).
    """
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(Driver)
    env = storage.storage_env(run_dir)  # an object-store run directory: the launcher's credentials and endpoint
    # on the launcher's node, as Ray Train puts its controller (else Ray places a 0-CPU actor on any
    # node, and losing a worker node would restart the driver too); soft: a restart may go elsewhere
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    handle = cls.options(name=driver_name(run_name), namespace=namespace, lifetime="detached" if detached else None,
                         max_restarts=max_restarts, max_task_retries=-1, num_cpus=0, scheduling_strategy=here,
                         **({"runtime_env": {"env_vars": env}} if env else {})).remote(
        recipe.to_dict(), run_dir, run_name, None if plan is None else plan.to_dict(),
        None if restart_plan is None else restart_plan.to_dict(), submission_id)
    try:
        ready = ray.get(handle.ready.remote(), timeout=timeout_s)
    except BaseException:  # no answer in time, the actor failed to start, or an interrupt: no driver is left
        kill_driver(handle, run_name, namespace)
        raise
    if "error" in ready:
        kill_driver(handle, run_name, namespace)
        raise ready["error"]
    return handle, ready


def kill_driver(handle, run_name: str, namespace: str = NAMESPACE, timeout_s: float = 60.0) -> bool:
    """Kill the driver actor ``handle`` of run ``run_name`` (no restart) and wait until Ray no
    longer finds an actor of that name with this actor's id in ``namespace``: ``ray.kill`` only
    sends the request, so without the wait a client (or the launcher's caller) may still find
    the driver for a while on a loaded cluster. Returns True once it is gone, False when Ray
    still lists it after ``timeout_s`` seconds or cannot be asked."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - an actor that is gone already: the look-up below tells
        pass
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = ray.get_actor(driver_name(run_name), namespace=namespace)
        except ValueError:  # no live actor of that name
            return True
        except Exception:  # noqa: BLE001 - Ray does not answer: the caller says the driver may be left
            return False
        if found._actor_id != handle._actor_id:  # the name belongs to another actor now
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
