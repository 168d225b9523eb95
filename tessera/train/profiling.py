"""``tessera profile``: time every distinct task and overlapped pair on the job's own Ray Train workers.

:func:`run_profile` runs one Ray Train ``TorchTrainer`` (the same workers, process groups and
Programs as ``tessera train``: gloo on CPU, NCCL on GPUs) whose per-worker function is
:func:`profile_loop`. Each rank builds its stages from the driver's Program (planned on the
analytic costs) and runs the whole Program, with no optimizer step (the weights never change):

1. **Tasks** (``eager_comm``: every all-to-all is waited inside its own task, so a dispatch or
   combine task's time is the real all-to-all over the EP group at the real message size):
   ``profile.warmup`` untimed iterations, then up to ``profile.reps`` timed ones; every task of
   every microbatch is one sample of its item (:func:`tessera.cost.profile_costs.task_signature`:
   layers of one kind share an item).
2. **Pairs** (all-to-alls asynchronous, as in training): each ``FB`` instruction's wall time is
   one sample of ``"pair:<F chunk signature>|<B chunk signature>"`` — the pair co-executed in the
   order the plan stores (the pair scheduler's).
3. **p2p**: a ping-pong of one activation between pipeline ranks 0 and 1 of every replica
   (:func:`tessera.engine.p2p.ping_pong_ms`).

Rank 0 decides after each iteration whether the budget (``profile.budget_s``) allows another and
tells every rank (a broadcast, so ranks stop together); what was never timed is absent from the
profile and falls back to the analytic model when planning (:func:`tessera.cost.profile_costs.profiled_costs`).
Each rank hands its samples to the driver actor; the job side merges them
(:func:`tessera.cost.profile_costs.summarise_samples`: median, p25, p75), stores the items in the
profile cache under the recipe's fingerprint (:mod:`tessera.config.profile_rules`) and writes the
calibration report (analytic vs measured per task kind). Items the cache already holds are not
profiled again: when nothing is missing, no worker starts (``cache_hit``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

__all__ = ["ProfileResult", "ProfileSetup", "DriftReport", "run_profile", "prepare_profile", "cached_result",
           "check_profile", "profile_loop", "calibration", "profile_items", "overlap_fits"]


@dataclass(frozen=True)
class ProfileResult:
    """What a profile run did.

    Attributes:
        cache: the cache file; fingerprint: the profile's digest.
        distinct_tasks: items the model's tasks need; tasks: task instances they stand for
            (``dedup = tasks / distinct_tasks``).
        distinct_pairs: distinct pair items the Program co-executes (these are timed);
            pairs_needed: candidate pairs the planner costs over all overlap edges;
            candidate_pairs_distinct: distinct DAGs among them (the planner's own dedup). Candidate
            pairs outside the Program are composed by the pair scheduler from the measured task
            times and the fitted ``overlap_slowdown``.
        timed_items: task, pair and p2p items this run stored (the fitted ``overlap_slowdown`` item
            is stored beside them); missing: items still without a time (budget).
        overlap_slowdown: the compute slowdown fitted to the measured pairs (:func:`overlap_fits`),
            or None without pairs.
        cache_hit: nothing was missing, no worker started.
        wall_s: the whole run, seconds; iterations: timed iterations run (tasks + pairs passes).
        device: the workers' device name.
        calibration: per task kind ``{"mean_err", "max_err", "n"}`` of analytic vs measured
            (relative error ``|analytic - measured| / measured``).
    """

    cache: str
    fingerprint: str
    distinct_tasks: int
    tasks: int
    distinct_pairs: int
    pairs_needed: int
    candidate_pairs_distinct: int
    timed_items: int
    missing: tuple[str, ...]
    cache_hit: bool
    wall_s: float
    iterations: int = 0
    device: str = ""
    calibration: dict = field(default_factory=dict)
    overlap_slowdown: float | None = None

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def profile_items(costs, programs) -> tuple[dict[str, str], dict[str, int]]:
    """``(tasks -> item, pair item -> count)`` the Programs need (module docstring)."""
    from tessera.cost.profile_costs import task_signatures

    return task_signatures(costs), _pair_counts(costs, programs)


def _pair_items(costs, program) -> dict[int, str]:
    """Instruction index -> pair item of every ``FB`` instruction of ``program``."""
    from tessera.cost.profile_costs import chunk_signature
    from tessera.program.instructions import Op

    rng = {s.chunk: (s.start, s.stop) for s in program.stages}
    out = {}
    for i, ins in enumerate(program.instructions):
        if ins.op == Op.FB:
            out[i] = f"pair:{chunk_signature(costs, *rng[ins.chunk])}|{chunk_signature(costs, *rng[ins.chunk2])}"
    return out


def _pair_counts(costs, programs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for prog in programs:
        for item in _pair_items(costs, prog).values():
            counts[item] = counts.get(item, 0) + 1
    return counts


# --- on the workers ----------------------------------------------------------------------------
def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def profile_loop(config: dict) -> None:
    """Ray Train's per-worker function of a profile run (module docstring); ``config`` is a
    :meth:`~tessera.train.worker.WorkerConfig.to_dict`."""
    from tessera.config.resolve import resolve_hardware
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.profile_costs import task_signature
    from tessera.cost.types import ParallelShape
    from tessera.engine import Batch, Engine
    from tessera.engine.p2p import ping_pong_ms
    from tessera.train.worker import WorkerConfig, WorkerLoop

    loop = WorkerLoop.setup(WorkerConfig.from_dict(config))
    recipe, runner, rank = loop.recipe, loop.runner, loop.rank
    prof = recipe.profile
    costs = analytic_costs(loop.model, resolve_hardware(recipe), ParallelShape.of(recipe.parallel))
    pair_item = _pair_items(costs, runner.program)
    samples: dict[str, list[float]] = {}
    modules, groups, program = runner.modules, runner.groups, runner.program
    t_start = time.perf_counter()
    iterations = 0

    def go_on(done: int) -> bool:
        """Rank 0's decision, broadcast: another timed iteration within reps and budget."""
        ok = done < prof.reps and (prof.budget_s <= 0 or time.perf_counter() - t_start < prof.budget_s)
        return bool(loop.session.broadcast(ok if rank == 0 else None, rank))

    for eager in (True, False):  # tasks alone, then pairs as in training
        engine = Engine(program, modules, groups, None, profile=True, eager_comm=eager)
        done = 0
        for it in range(prof.warmup + prof.reps):
            timed = it >= prof.warmup
            if timed and not go_on(done):
                break
            result = engine.run_iteration(Batch.from_tokens(loop.data.next_batch().to(runner.device)))
            for m in modules:
                m.zero_grad(set_to_none=True)
            for chunk in engine.chunks:
                timings = getattr(chunk, "timings", [])
                if timed and eager:
                    for key, ms in timings:
                        samples.setdefault(task_signature(costs, key), []).append(float(ms))
                timings.clear()
            if timed and not eager:
                per_instr: dict[int, float] = {}
                for rec in result.profile:
                    if rec.index in pair_item:
                        per_instr[rec.index] = per_instr.get(rec.index, 0.0) + rec.ms
                for i, ms in per_instr.items():
                    samples.setdefault(pair_item[i], []).append(ms)
            if timed:
                done += 1
                if rank == 0:
                    loop.driver.send("profile_progress", (0 if eager else prof.reps) + done, 2 * prof.reps,
                                     "tasks" if eager else "pairs")
        iterations = done if eager else min(iterations, done)
        loop.session.barrier()
    p = recipe.parallel
    p2p = ping_pong_ms(groups, torch.zeros(p.micro_batch_size, p.seq_length, loop.model.hidden, device=runner.device))
    if p2p is not None:
        samples["p2p"] = [p2p]
    loop.driver.call("report_profile", rank, {"samples": samples, "iterations": iterations,
                                              "device": _device_name(loop.device)})
    loop.session.barrier()


# --- on the job side ---------------------------------------------------------------------------
def overlap_fits(costs, programs, medians: dict[str, float]) -> list[float]:
    """Per measured ``FB`` pair, the compute slowdown ``s`` at which the pair's replay
    (:func:`tessera.sched.chunkdag.replay_pair`, the plan's stored order) on the profiled task
    times matches the pair's measured median: the interference of co-executed communication on
    compute, calibrated from measurement (bisection on ``s`` in [0.25, 8]; the makespan grows
    with ``s``). Pairs whose measured time lies outside the replay's range at the bounds are
    left out."""
    from dataclasses import replace

    from tessera.cost.profile_costs import profiled_costs
    from tessera.program.instructions import Op
    from tessera.sched.chunkdag import replay_pair

    timed, _ = profiled_costs(costs, medians)
    out = []
    for prog in programs:
        rng = {s.chunk: (s.start, s.stop) for s in prog.stages}
        items = _pair_items(costs, prog)
        for i, ins in enumerate(prog.instructions):
            if ins.op != Op.FB or items[i] not in medians:
                continue
            order = prog.pair_orders[ins.order].order if ins.order >= 0 else None

            def makespan(s: float) -> float:
                return replay_pair(replace(timed, overlap_slowdown=s), rng[ins.chunk], rng[ins.chunk2], ins.with_w,
                                   order)[1].makespan

            want, lo, hi = medians[items[i]], 0.25, 8.0
            if not makespan(lo) <= want <= makespan(hi):
                continue
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if makespan(mid) < want else (lo, mid)
            out.append((lo + hi) / 2)
    return out


def calibration(costs, medians: dict[str, float]) -> dict[str, dict]:
    """Analytic vs measured per task kind: for every item with a time, the relative error of the
    analytic median task time of that item, grouped by the item's kind (the last name part, e.g.
    ``"expert"``): ``{"mean_err", "max_err", "n"}``."""
    from tessera.cost.profile_costs import task_signatures
    from tessera.cost.types import TaskKey

    sig = task_signatures(costs)
    analytic: dict[str, list[float]] = {}
    for lc in (costs.embed, *costs.layers, costs.head):
        for t in lc.tasks:
            analytic.setdefault(sig[str(TaskKey(t.phase.value, lc.index, t.kind.value))], []).append(t.ms)
    by_kind: dict[str, list[float]] = {}
    for item, ms in medians.items():
        if item in analytic and ms > 0:
            err = abs(statistics.median(analytic[item]) - ms) / ms
            by_kind.setdefault(item.rsplit(".", 1)[-1], []).append(err)
    return {k: {"mean_err": sum(v) / len(v), "max_err": max(v), "n": len(v)} for k, v in sorted(by_kind.items())}


@dataclass(frozen=True)
class ProfileSetup:
    """What a profile run of a recipe needs before any worker starts (:func:`prepare_profile`):
    the analytic recipe, its costs and Programs, the items needed and those the cache lacks."""

    analytic: object
    costs: object
    programs: tuple
    fingerprint: object
    cache_path: str
    needed: tuple[str, ...]
    missing: tuple[str, ...]
    common: dict


def prepare_profile(recipe) -> ProfileSetup:
    """Plan ``recipe`` on the analytic costs (the Programs the workers will run), list the items
    they need and look them up in the cache (no Ray needed); every item counts as missing when
    the profile is marked stale, so re-running ``tessera profile`` refreshes it."""
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache
    from tessera.flow import build_costs, compile_programs, plan_recipe, resolve

    analytic = recipe.with_overrides(["planner.cost_source=analytic"])
    res = resolve(analytic)
    costs = build_costs(res)
    fp = profile_fingerprint(recipe, res.model, res.hardware)
    path = profile_cache_path(recipe)
    report = plan_recipe(res, costs)
    programs = tuple(compile_programs(report.tessera))
    tasks, pairs = profile_items(costs, programs)
    needed = tuple(sorted(set(tasks.values())) + sorted(pairs) + (["p2p"] if recipe.parallel.pp > 1 else []))
    common = dict(cache=path, fingerprint=fp.digest, distinct_tasks=len(set(tasks.values())), tasks=len(tasks),
                  distinct_pairs=len(pairs), pairs_needed=report.pairs_total,
                  candidate_pairs_distinct=report.pairs_distinct)
    cache = ProfileCache(path)
    stale = cache.status(fp).stale  # a stale profile is re-timed whole (and the mark cleared by the new items)
    return ProfileSetup(analytic, costs, programs, fp, path, needed,
                        needed if stale else tuple(cache.missing(fp, needed)), common)


def cached_result(setup: ProfileSetup, wall_s: float = 0.0) -> ProfileResult:
    """The result of a run that found every item in the cache (no worker started)."""
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import OVERLAP_ITEM

    have = {k: v.median_ms for k, v in ProfileCache(setup.cache_path).get(setup.fingerprint).items()}
    return ProfileResult(**setup.common, timed_items=0, missing=(), cache_hit=True, wall_s=wall_s,
                         calibration=calibration(setup.costs, have), overlap_slowdown=have.get(OVERLAP_ITEM))


class _ProgressBar:
    """A console bar of the timed iterations (tasks pass, then pairs pass) with an ETA, fed by
    polling the driver's ``profile_progress`` from a background thread (rich)."""

    def __init__(self, driver, total: int, enabled: bool = True, period_s: float = 1.0) -> None:
        self.driver, self.total, self.enabled, self.period_s = driver, total, enabled, period_s

    def __enter__(self):
        import threading

        if not self.enabled:
            return self
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("profiling {task.fields[phase]}"), BarColumn(),
                             TextColumn("{task.completed}/{task.total} timed iterations"), TimeElapsedColumn(),
                             TextColumn("ETA"), TimeRemainingColumn())
        self._task = self._bar.add_task("profile", total=self.total, phase="(workers starting)")
        self._bar.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tessera-profile-progress", daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        import ray

        while not self._stop.wait(self.period_s):
            try:
                done, total, phase = ray.get(self.driver.profile_progress_state.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a slow driver only delays the bar
                continue
            self._bar.update(self._task, completed=done, total=total or self.total, phase=phase)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=15)
            self._bar.stop()


def _time_on_workers(recipe, setup: ProfileSetup, progress: bool, reps: int) -> tuple[dict, int, str]:
    """Run :func:`profile_loop` on the job's workers; ``(item -> samples, timed iterations per
    pass, device name)``."""
    import ray

    from tessera.train.driver import driver_name, start_driver
    from tessera.train.job import out_root
    from tessera.train.preflight import preflight
    from tessera.train.trainer import build_trainer, worker_threads
    from tessera.train.worker import WorkerConfig

    analytic = setup.analytic.with_overrides([f"profile.reps={reps}"])
    resources = preflight(analytic, ray.cluster_resources()).resources
    root = out_root(analytic)
    run_name = f"{recipe.name}-profile-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(root, run_name)
    driver, _ = start_driver(analytic, run_dir, run_name, namespace=recipe.job.namespace)
    try:
        wcfg = WorkerConfig(analytic.to_dict(), run_name, run_dir, driver_name(run_name),
                            threads=worker_threads(analytic, resources))
        if progress:
            print(f"tessera profile: {len(setup.missing)} of {len(setup.needed)} items without a time; timing on "
                  f"{recipe.parallel.pp * recipe.parallel.dp} workers ({recipe.profile.warmup} warm-up + up to "
                  f"{reps} timed iterations per pass, budget {recipe.profile.budget_s:g} s)", flush=True)
        with _ProgressBar(driver, 2 * reps, enabled=progress):
            build_trainer(analytic, wcfg, root, resources, loop=profile_loop).fit()
        reports = ray.get(driver.profile_reports.remote(), timeout=60)
    finally:
        ray.kill(driver)
    merged: dict[str, list[float]] = {}
    for rep in reports.values():
        for item, vals in rep["samples"].items():
            merged.setdefault(item, []).extend(vals)
    iterations = max((r["iterations"] for r in reports.values()), default=0)
    device = next(iter(reports.values()))["device"] if reports else ""
    return merged, iterations, device


def run_profile(recipe, *, progress: bool = True, setup: ProfileSetup | None = None) -> ProfileResult:
    """Profile ``recipe`` on the connected Ray cluster (module docstring) and fill the cache with
    the items it lacks (``setup``: a :func:`prepare_profile` already made).

    Raises:
        TesseraConfigError / ProgramError: a pre-flight or planning error (as ``tessera train``).
    """
    from tessera.cost.profile_cache import ProfileCache, ProfileItem
    from tessera.cost.profile_costs import OVERLAP_ITEM, summarise_samples

    t0 = time.perf_counter()
    setup = setup or prepare_profile(recipe)
    if not setup.missing:
        return cached_result(setup, time.perf_counter() - t0)
    merged, iterations, device = _time_on_workers(recipe, setup, progress, recipe.profile.reps)
    stats = summarise_samples(merged)
    warmup = recipe.profile.warmup
    items = [ProfileItem(k, m, a, b, n, warmup) for k, (m, a, b, n) in stats.items() if k in set(setup.missing)]
    fits = overlap_fits(setup.costs, setup.programs, {k: v[0] for k, v in stats.items()})
    if fits:
        m, a, b, n = summarise_samples({OVERLAP_ITEM: fits})[OVERLAP_ITEM]
        items.append(ProfileItem(OVERLAP_ITEM, m, a, b, n, warmup))
    cache = ProfileCache(setup.cache_path)
    cache.put(setup.fingerprint, items)
    have = {k: v.median_ms for k, v in cache.get(setup.fingerprint).items()}
    return ProfileResult(**setup.common, timed_items=len(items) - (1 if fits else 0),
                         missing=tuple(cache.missing(setup.fingerprint, setup.needed)), cache_hit=False,
                         wall_s=time.perf_counter() - t0, iterations=iterations, device=device,
                         calibration=calibration(setup.costs, have), overlap_slowdown=have.get(OVERLAP_ITEM))


@dataclass(frozen=True)
class DriftReport:
    """``tessera profile --check``: per item the relative drift ``measured / profiled - 1`` of a
    re-timed sample, their median ``|drift|`` (``drift``), the ``threshold`` and whether the
    profile is now marked ``stale``; ``missing_profile``: the cache had no profile to check."""

    items: dict
    drift: float
    threshold: float
    stale: bool
    missing_profile: bool = False
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def check_profile(recipe, *, progress: bool = True, setup: ProfileSetup | None = None) -> DriftReport:
    """Re-time one iteration of the recipe's tasks on its workers and compare with its profile;
    above ``profile.drift_threshold`` the profile is marked stale (``tessera plan`` warns)."""
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import summarise_samples

    t0 = time.perf_counter()
    setup = setup or prepare_profile(recipe)
    cache = ProfileCache(setup.cache_path)
    ref = {k: v.median_ms for k, v in cache.get(setup.fingerprint).items()}
    th = recipe.profile.drift_threshold
    if not ref:
        return DriftReport({}, 0.0, th, False, missing_profile=True, wall_s=time.perf_counter() - t0)
    merged, _, _ = _time_on_workers(recipe, setup, progress, 1)
    now = {k: v[0] for k, v in summarise_samples(merged).items()}
    items = {k: now[k] / ref[k] - 1 for k in sorted(now) if ref.get(k, 0) > 0 and not k.startswith("overlap")}
    drift = statistics.median(abs(v) for v in items.values()) if items else 0.0
    stale = drift > th
    if stale:
        cache.mark_stale(setup.fingerprint, drift)
    return DriftReport(items, drift, th, stale, wall_s=time.perf_counter() - t0)
