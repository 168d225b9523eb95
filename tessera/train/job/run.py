"""The training job: pre-flight, run directory, driver actor, metrics pump, ``TorchTrainer.fit()``.

:func:`run_job` runs one job on a connected Ray cluster. Flow: pre-flight checks on the cluster
(:mod:`tessera.train.job.preflight`) -> choose the run (a fresh ``<name>-<time>`` directory under
:func:`out_root`, or with ``train.resume=true`` the newest run of the recipe that has a complete
checkpoint) -> with ``planner.cost_source=profile``, profile what the cache lacks on the job's workers
(:mod:`tessera.train.job.profile`) -> start the driver actor (plan + Programs) -> start the metrics pump (the driver's
records -> ``metrics.jsonl``, W&B, console) -> ``TorchTrainer.fit()`` -> :class:`JobResult`.
The command line around it (arguments, connecting to Ray, the summary) is
:mod:`tessera.cli.train`.

The job's options are the recipe's ``job`` section (:class:`tessera.config.schema.JobConfig`:
run name, driver namespace, restarts, CPUs and threads per worker, the driver's lifetime,
process-group timeout, checkpoints kept); what is derived when it starts (the run, the driver's
name, threads, worker hooks) goes to the workers as a :class:`~tessera.train.worker.loop.WorkerConfig`.

Worker hooks (:mod:`tessera.train.worker.hooks`) are given to :func:`run_job` or added by the launcher's
environment (:func:`tessera.train.worker.hooks.hooks_from_env`: the test-only fault injection
``TESSERA_FAULT_AT`` / ``TESSERA_FAULT_IN_CHECKPOINT`` of :mod:`tessera.testing.faults`); each is
resolved once here, before the driver starts, so a bad one is one line at once.

Errors: bad input found in the driver's planning or raised by a worker is re-raised as itself
(one line, exit code 2 at the command line); workers that fail more often than
``job.max_failures`` for another reason raise :class:`JobFailed` (:func:`job_error`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from tessera.errors import ProgramError, TesseraConfigError
from tessera.train import storage
from tessera.train.job.outputs import out_root, submission_id
from tessera.train.worker.hooks import HookSpec


@dataclass(frozen=True)
class JobResult:
    """What a finished job left: its run, metric file, steps, final loss, worker-group starts,
    newest complete checkpoint, the checkpoint it resumed from, wall and planning seconds, and
    ``stopped``: the signal (``"SIGTERM"``) that stopped it before ``train.steps``, else None."""

    run_name: str
    run_dir: str
    metrics_path: str
    steps: int
    final_loss: float | None
    attempts: int
    checkpoint: str | None
    resumed_from: str | None
    wall_s: float
    plan_s: float = 0.0
    stopped: str | None = None


def choose_run(recipe, out_root: str) -> str:
    """The run name: ``job.run_name`` when set, else chosen (see the module docstring).
    ``out_root`` is a local directory or an object-store prefix (:mod:`tessera.train.storage`);
    with ``train.resume`` the runs are tried newest first by :func:`tessera.train.storage.mtime`
    (on an object store: a run's newest object), then by name.

    Raises:
        TesseraConfigError: ``job.run_name`` names an existing run but ``train.resume`` is false.
    """
    from tessera.train.worker.checkpoint import latest_complete

    run_name = recipe.job.run_name
    if run_name:
        if storage.is_dir(storage.join(out_root, run_name)) and not recipe.train.resume:
            raise TesseraConfigError("job.run_name", run_name, f"already exists under {out_root}",
                                     "set train.resume=true to continue it, or choose another name")
        return run_name
    if recipe.train.resume:
        prefix = f"{recipe.name}-"
        runs = [e.name for e in storage.entries(out_root) if e.is_dir and e.name.startswith(prefix)]
        newest = {n: storage.mtime(storage.join(out_root, n)) or 0.0 for n in runs}
        for name in sorted(runs, key=lambda n: (newest[n], n), reverse=True):
            if latest_complete(storage.join(out_root, name)) is not None:
                return name
        print(f"tessera: train.resume=true but no run of {recipe.name!r} under {out_root} has a complete "
              "checkpoint; starting a fresh run", file=sys.stderr)
    name = f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    k = 1
    while storage.exists(storage.join(out_root, name)):
        name = f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}-{k}"
        k += 1
    return name


class MetricsPump:
    """Copies the driver's records into a :class:`~tessera.train.worker.metrics.MetricsSink` from a
    background thread (every ``period_s``) and once more in :meth:`stop`. When Ray restarts the
    driver (a new incarnation, whose list starts with the old one's records, read back from the
    run directory's ``driver_records.jsonl``) it reads the new list from its start and writes
    each record it has not written yet, so a record the old driver had not handed out is not lost
    and none is written twice.

    Failed reads (a restarting driver) are retried; the first failure of a streak is printed
    once. After ``give_up_s`` of failures in a row the pump stops polling and keeps the error in
    :attr:`error`; :meth:`stop` reads once more and says so when records may be missing.
    """

    def __init__(self, driver, sink, period_s: float = 0.5, give_up_s: float = 120.0) -> None:
        self.driver, self.sink, self.period_s, self.give_up_s = driver, sink, period_s, give_up_s
        self.count = 0
        self.incarnation: str | None = None
        self.records: list[dict] = []
        self._written: set[str] = set()  # each record once, also when a restarted driver hands it out again
        self.error: BaseException | None = None
        self._failing_since: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tessera-metrics", daemon=True)
        self._thread.start()

    def _drain(self) -> bool:
        """One read; False when it failed."""
        import ray

        with self._lock:
            try:
                got = ray.get(self.driver.records_since.remote(self.count, self.incarnation), timeout=30)
            except Exception as e:  # noqa: BLE001 - a restarting driver: retried, bounded by give_up_s
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                    print(f"tessera: metrics pump: {type(e).__name__}: {e}; retrying", file=sys.stderr)
                if now - self._failing_since >= self.give_up_s:
                    self.error = e
                return False
            self._failing_since = None
            if got["incarnation"] != self.incarnation:  # first read, or the driver restarted
                self.incarnation, self.count = got["incarnation"], 0
            got_records = got["records"]
            self.count += len(got_records)
            new = []
            for rec in got_records:
                key = json.dumps(rec, sort_keys=True, default=str)
                if key not in self._written:
                    self._written.add(key)
                    new.append(rec)
            for rec in new:
                self.sink.write(rec)
            self.records.extend(new)
            return True

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            if not self._drain() and self.error is not None:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        if not self._drain():
            print(f"tessera: metrics pump: the driver did not answer at the end; {self.sink.path} may miss records",
                  file=sys.stderr)


def run_job(recipe, *, progress: bool = True, hooks: Sequence[HookSpec] = (), restart_plan=None) -> JobResult:
    """Run the training job of ``recipe`` on the connected Ray cluster (``ray.init`` done), with
    the options of its ``job`` section.

    Args:
        recipe: the job's :class:`~tessera.config.load.Recipe`.
        progress: console progress.
        hooks: worker hooks to run on every rank, before those the environment adds
            (:func:`tessera.train.worker.hooks.hooks_from_env`).
        restart_plan: a Plan a resumed run (``train.resume``) continues on from its newest
            checkpoint, as a new plan version (``tessera train --plan FILE``; checked as an upgrade).

    Raises:
        TesseraConfigError / ProgramError: a pre-flight check (:mod:`tessera.train.job.preflight`)
            on the connected cluster, a run-name clash, a bad worker hook, a planning error in the
            driver, or bad input a worker found (with its rank).
        JobFailed: the workers failed more than ``job.max_failures`` times for another reason.
    """
    import ray

    from tessera.train.worker.checkpoint import latest_complete
    from tessera.train.job.driver import driver_name, kill_driver, start_driver
    from tessera.train.worker.hooks import hooks_from_env, resolve_hooks
    from tessera.train.worker.metrics import MetricsSink
    from tessera.train.job.preflight import preflight
    from tessera.train.job.trainer import build_trainer, worker_threads
    from tessera.train.worker.loop import WorkerConfig
    from tessera.train.worker.corpus import absolute_data_paths, absolute_plan_inputs
    from tessera.train.worker.tokenizer import save_run_tokenizer

    job = recipe.job
    t0 = time.perf_counter()
    resources = preflight(recipe, ray.cluster_resources()).resources  # again: the cluster
    root = out_root(recipe)
    run_name = choose_run(recipe, root)
    run_dir = storage.join(root, run_name)  # a local path, or an s3:// / gs:// URI
    save_run_tokenizer(recipe, run_dir)  # what tessera export writes beside the weights
    specs = tuple(hooks) + hooks_from_env()
    resolve_hooks(specs)  # a bad hook is one line now, not on every worker
    if recipe.planner.cost_source == "profile":  # profile what the cache lacks, then the driver plans on it
        from tessera.train.job.profile import run_profile
        from tessera.train.profile.setup import prepare_profile, profile_complete

        if not profile_complete(recipe):  # a complete, fresh profile: the driver's plan is the only one
            setup = prepare_profile(recipe)
            if setup.missing:
                run_profile(recipe, progress=progress, setup=setup)
    with StopOnSignal() as stop, WandbService(recipe) as wandb_service:
        driver, ready = start_driver(absolute_plan_inputs(recipe), run_dir, run_name, namespace=job.namespace,
                                     detached=job.detached_driver, restart_plan=restart_plan,
                                     submission_id=submission_id())
        try:
            stop.attach(driver)
            print(f"tessera: run {run_name}: plan {ready['plan']} v{ready['plan_version']} {ready['partition']}"
                  + (f", resuming after step {ready['step']}" if ready["recovered_from"] else ""), flush=True)
            print(f"tessera: outputs (metrics, W&B, checkpoints) in {run_dir}", flush=True)
            _announce_address(run_dir, run_name)
            reference, fp = _profile_reference(recipe)
            wandb_service.activate()
            sink = MetricsSink(recipe, run_dir, run_name, progress=progress)
            pump = MetricsPump(driver, sink)
            try:
                if stop.reason is None:  # a stop asked for while the driver planned: no worker starts
                    wcfg = WorkerConfig(absolute_data_paths(recipe, root).to_dict(), run_name, run_dir,
                                        driver_name(run_name),
                                        threads=worker_threads(recipe, resources), hooks=specs,
                                        profile_reference=reference)
                    trainer = build_trainer(recipe, wcfg, root, resources)
                    try:
                        trainer.fit()
                    except Exception as e:
                        raise job_error(e, driver) from e
            finally:
                pump.stop()
                sink.close()
                if sink.drifted is not None and fp is not None:
                    _mark_stale(recipe, fp, sink.drifted)
        finally:  # every way out, a failure or an interrupt too: no driver is left behind
            if not job.keep_driver and not kill_driver(driver, run_name, job.namespace):
                print(f"tessera: the driver actor {driver_name(run_name)} (namespace {job.namespace}) was still "
                      "listed 60 s after it was killed; check with `ray list actors`", file=sys.stderr)
    steps = [r for r in pump.records if "event" not in r]
    attempts = sum(1 for r in pump.records if r.get("event") == "start")  # survives driver restarts
    last = latest_complete(run_dir)
    last_step = steps[-1]["step"] if steps else ready["step"]
    return JobResult(run_name, run_dir, sink.path, last_step,
                     steps[-1]["loss"] if steps else None, attempts, last.path if last else None,
                     ready["recovered_from"], time.perf_counter() - t0, ready["plan_s"],
                     stop.reason if stop.reason is not None and last_step < recipe.train.steps else None)


class StopOnSignal:
    """While the job runs (a context manager around it, in the main thread): SIGTERM, which
    ``ray job stop`` and ``kill`` send, asks the job to stop instead of ending the launcher at
    once. The first one is passed to the driver (``request_stop``, from a thread of its own, at
    once or when :meth:`attach` gives the driver); the workers end after the step they are in,
    or the next one (:class:`tessera.train.worker.loop.StopPoll`), writing that step's checkpoint
    when one is due, and the launcher finishes as after the last step (metrics, W&B, summary).
    A second SIGTERM ends the launcher at once (``SystemExit(143)``: the ``finally`` blocks still
    kill the driver). Replacing the handler also drops Ray's own (its C++ stack dump and
    ``sys.exit``); the previous handler is back on exit. Outside the main thread it does nothing.

    :attr:`reason`: the signal's name (``"SIGTERM"``) once one came, else None.
    """

    SIGNALS = (signal.SIGTERM,)

    def __init__(self) -> None:
        self.reason: str | None = None
        self.driver = None
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def attach(self, driver) -> None:
        """The driver to pass a stop request to (one that came before is passed now)."""
        self.driver = driver
        if self.reason is not None:
            threading.Thread(target=self._forward, name="tessera-stop", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            raise SystemExit(128 + signum)
        self.reason = signal.Signals(signum).name
        threading.Thread(target=self._notice, name="tessera-stop", daemon=True).start()

    def _notice(self) -> None:
        print(f"tessera: {self.reason}: the job stops after the step in progress or the next one (its checkpoint "
              f"is written if one is due; a second {self.reason} ends it at once){_stop_wait_hint()}", flush=True)
        self._forward()

    def _forward(self) -> None:
        import ray

        driver = self.driver
        if driver is None:
            return
        try:
            ray.get(driver.request_stop.remote(self.reason), timeout=60)
        except Exception as e:  # noqa: BLE001 - the driver is gone or restarting: the job ends without it
            print(f"tessera: could not pass the stop request to the driver ({type(e).__name__})", file=sys.stderr,
                  flush=True)


STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
"""How long ``ray job stop`` waits after its SIGTERM before it sends SIGKILL (Ray's job supervisor
reads it from its environment, the job's ``runtime_env`` ``env_vars``; default 3 s)."""


def _stop_wait_hint(env: dict | None = None) -> str:
    """Under ``ray job submit`` with a short :data:`STOP_WAIT_ENV`: how to give a stop more time."""
    env = os.environ if env is None else env
    if submission_id(env) is None:
        return ""
    try:
        wait = float(env.get(STOP_WAIT_ENV, "3"))
    except ValueError:
        wait = 3.0
    if wait >= 30:
        return ""
    return (f"; ray job stop kills the job {wait:g} s after its SIGTERM ({STOP_WAIT_ENV}): submit with --runtime-env-json "
            f"'{{\"env_vars\": {{\"{STOP_WAIT_ENV}\": \"120\"}}}}' to leave it the time")


class WandbService:
    """Under ``ray job submit`` with W&B on: a detached W&B service (``wandb beta core start``)
    for the launcher's W&B run instead of one W&B starts as a child of this process. ``ray job
    stop`` sends SIGTERM to the entrypoint and to every process below it: a child service would
    end at once and the W&B run with it (``ConnectionResetError`` tracebacks, an unfinished run)
    while the launcher still stops the job cleanly. The service starts when the context is
    entered (alongside the driver's planning); :meth:`activate` waits for it and puts its address
    in ``WANDB_SERVICE`` until the context ends; it ends by itself 60 s after its last client
    left. Elsewhere (``tessera train``: SIGTERM reaches only the launcher; W&B disabled, or a
    ``WANDB_SERVICE`` already set) it does nothing; when the service cannot be started, W&B
    starts its own as before (one line says the consequence)."""

    def __init__(self, recipe) -> None:
        self.enabled = (submission_id() is not None and recipe.logging.wandb_mode != "disabled"
                        and not os.environ.get("WANDB_SERVICE"))
        self.proc = None
        self.token: str | None = None

    def __enter__(self) -> "WandbService":
        import subprocess

        if self.enabled:
            try:
                self.proc = subprocess.Popen([sys.executable, "-m", "wandb", "beta", "core", "start", "--idle-timeout",
                                              "60s"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self.proc = None
        return self

    def activate(self) -> None:
        """Wait for the service (at most 120 s) and point W&B at it (``WANDB_SERVICE``)."""
        import subprocess

        if not self.enabled:
            return
        lines: list[str] = []
        if self.proc is not None:
            try:
                out, _ = self.proc.communicate(timeout=120)
                lines = out.strip().splitlines() if self.proc.returncode == 0 else []
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        self.token = lines[-1].strip() if lines else None
        if self.token is None:
            print("tessera: could not start a detached W&B service; ray job stop may leave the W&B run unfinished",
                  file=sys.stderr, flush=True)
            return
        os.environ["WANDB_SERVICE"] = self.token

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        if self.token is not None and os.environ.get("WANDB_SERVICE") == self.token:
            del os.environ["WANDB_SERVICE"]


def _announce_address(run_dir: str, run_name: str) -> None:
    """Print the Ray cluster's GCS address with the ``tessera status`` line that reaches this run,
    and keep it in ``<run dir>/ray_address`` (with several Ray clusters on a machine, ``auto``
    may find another one)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    storage.write_text(storage.join(run_dir, "ray_address"), address + "\n")
    print(f"tessera: Ray cluster at {address}: RAY_AUTH_MODE=token tessera status --job {run_name} --address {address}",
          flush=True)


def _profile_reference(recipe):
    """``(item -> median ms, Fingerprint)`` of the profile a ``planner.cost_source=profile`` run
    was planned on, for the workers' drift check; ``({}, None)`` otherwise."""
    if recipe.planner.cost_source != "profile" or recipe.profile.check_every <= 0:
        return {}, None
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.config.resolve import resolve_hardware, resolve_model
    from tessera.cost.profile_cache import ProfileCache

    fp = profile_fingerprint(recipe, resolve_model(recipe), resolve_hardware(recipe))
    items = ProfileCache(profile_cache_path(recipe)).get(fp)
    return {k: v.median_ms for k, v in items.items()}, fp


def _mark_stale(recipe, fp, drift: float) -> None:
    from tessera.config.profile_rules import profile_cache_path
    from tessera.cost.profile_cache import ProfileCache

    path = profile_cache_path(recipe)
    ProfileCache(path).mark_stale(fp, drift)
    print(f"tessera: profile {fp.digest[:12]} in {path} marked stale (drift {drift:.0%}); re-run `tessera profile`",
          file=sys.stderr)


class JobFailed(RuntimeError):
    """The workers failed more often than ``job.max_failures`` allows, for a reason other than bad
    input; the message is one line naming the rank and its error (exit code 1)."""


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}" if text else type(e).__name__


def job_error(e: BaseException, driver=None) -> BaseException:
    """The error to report for an exception of ``trainer.fit()``.

    A :class:`~tessera.errors.TesseraConfigError` or :class:`~tessera.errors.ProgramError` that
    a worker raised (first by rank; or the one a worker recorded with the driver) is returned
    as it is, with the rank added to its rule: bad input, exit code 2. Any other worker failure
    becomes a one-line :class:`JobFailed` naming a worker that died or stopped answering (an
    error raised by Ray itself, e.g. its health check) if one did, since the other ranks then
    fail in their collectives, else the lowest rank whose wait timed out
    (:class:`~tessera.engine.groups.CommTimeout`: its line names the rank, the instruction and the
    group), else the lowest rank. Either is restartable: Ray Train restarted the worker group
    from the newest checkpoint up to ``job.max_failures`` times before this.
    Exceptions that are not Ray Train failures are returned unchanged.
    """
    try:
        from ray.train import TrainingFailedError, WorkerGroupError
    except ImportError:  # pragma: no cover - Ray is a dependency
        return e
    if not isinstance(e, TrainingFailedError):
        return e
    failures = sorted(getattr(e, "worker_failures", {}).items()) if isinstance(e, WorkerGroupError) else []
    recorded = None
    if driver is not None:
        import ray

        try:
            recorded = ray.get(driver.fatal_error.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the driver is gone: the workers' errors still tell
            recorded = None
    if recorded is not None:
        failures = [recorded] + failures
    for rank, err in failures:
        if isinstance(err, TesseraConfigError):
            return TesseraConfigError(err.field, err.value, f"{err.rule} (raised on worker rank {rank})", err.fix)
        if isinstance(err, ProgramError):
            return err
    if failures:
        # a worker that died or stopped answering (an error Ray itself raised, e.g. its health
        # check) is the cause; the other ranks then fail in their collectives (collateral). Else a
        # wait that timed out (CommTimeout: one line naming rank, instruction and group) comes
        # before what it caused (a peer's "connection closed" once that rank's process ended).
        from tessera.engine.groups import CommTimeout

        rank, err = next(((r, x) for r, x in failures if type(x).__module__.startswith("ray.")),
                         next(((r, x) for r, x in failures if isinstance(x, CommTimeout)), failures[0]))
        return JobFailed(f"the job failed on worker rank {rank}: {_first_line(err)} (Ray's log above has the "
                         "traceback; raise job.max_failures (--max-failures) to retry more often)")
    return JobFailed(f"the job failed: {_first_line(e)}")
