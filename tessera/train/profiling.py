"""``tessera profile``: time every distinct task and candidate F&B pair on the job's own Ray Train workers.

:func:`run_profile` runs one Ray Train ``TorchTrainer`` (the same workers, process groups and
Programs as ``tessera train``: gloo on CPU, NCCL on GPUs) whose per-worker function is
:func:`tessera.train.profile_worker.profile_loop`: the Program's tasks (all-to-alls waited in
their own task), the Program's overlapped pairs, every other distinct candidate pair the planner
costs (:mod:`tessera.train.profile_pairs`: co-executed in the pair scheduler's order, real
all-to-alls over the EP group) and the p2p transfer. ``profile.budget_s`` stops the timing
cleanly; what was never timed is absent from the profile and falls back to the analytic model
when planning (tasks: times the calibration scale of their kind; pairs: composed from the task
times by the pair scheduler), counted in ``tessera plan``'s output.

Each rank hands its samples to the driver actor; the job side merges them
(:func:`tessera.cost.profile_costs.summarise_samples`: median, p25, p75), fits the overlap
slowdown and the per-phase calibration scales (:mod:`tessera.train.profile_fit`), stores the
items in the profile cache under the recipe's fingerprint (:mod:`tessera.config.profile_rules`)
and reports the calibration (analytic vs measured per task kind, before and after the scale).
Items the cache already holds are not profiled again: when nothing is missing, no worker starts
(``cache_hit``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from tessera.train.profile_fit import calibration, calibration_scales, overlap_fits, profile_items
from tessera.train.profile_worker import profile_loop

__all__ = ["ProfileResult", "ProfileSetup", "DriftReport", "run_profile", "prepare_profile", "profile_complete",
           "cached_result",
           "check_profile", "profile_loop", "calibration", "calibration_scales", "profile_items", "overlap_fits"]


@dataclass(frozen=True)
class ProfileResult:
    """What a profile run did.

    Attributes:
        cache: the cache file; fingerprint: the profile's digest.
        distinct_tasks: items the model's tasks need; tasks: task instances they stand for
            (``dedup = tasks / distinct_tasks``).
        distinct_pairs: distinct pair items needed (the candidate pairs' and the Program's);
            program_pairs: those the Program co-executes; pairs_needed: candidate pairs the planner
            costs over all overlap edges; candidate_pairs_distinct: distinct DAGs among them (the
            planner's own dedup); pairs_timed: pair items with a time after this run;
            pair_dedup: ``pairs_needed / pairs_timed`` (each signature timed once).
        timed_items: task, pair and p2p items this run stored (the fitted factors are stored
            beside them); missing: items still without a time (budget): they fall back to the
            analytic model when planning.
        overlap_slowdown: the compute slowdown fitted to the measured Program pairs
            (:func:`~tessera.train.profile_fit.overlap_fits`), or None without pairs.
        cache_hit: nothing was missing, no worker started.
        wall_s: the whole run, seconds; iterations: timed iterations run (tasks + pairs passes).
        device: the workers' device name.
        calibration: per task kind ``{"mean_err", "max_err", "n", "scales", "mean_err_fit",
            "max_err_fit"}`` of analytic vs measured (relative error ``|analytic - measured| /
            measured``; ``scales``: phase -> fitted scale; ``_fit``: the analytic time times its
            phase's scale).
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
    program_pairs: int = 0
    pairs_timed: int = 0

    @property
    def pair_dedup(self) -> float:
        return self.pairs_needed / self.pairs_timed if self.pairs_timed else 0.0

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "pair_dedup": self.pair_dedup}


@dataclass(frozen=True)
class ProfileSetup:
    """What a profile run of a recipe needs before any worker starts (:func:`prepare_profile`):
    the analytic recipe, its costs and Programs, the items needed and those the cache lacks, and
    the candidate pairs outside the Program still to time (``pair_specs``,
    :class:`~tessera.train.profile_pairs.PairSpec`); ``with_w``: the pairs carry their W tasks."""

    analytic: object
    costs: object
    programs: tuple
    fingerprint: object
    cache_path: str
    needed: tuple[str, ...]
    missing: tuple[str, ...]
    common: dict
    pair_specs: tuple = ()
    with_w: bool = True
    plan: object = None
    stale: bool = False


def prepare_profile(recipe) -> ProfileSetup:
    """Plan ``recipe`` on the analytic costs (the Programs the workers will run), list the items
    they and the planner's candidate pairs need and look them up in the cache (no Ray needed);
    every item counts as missing when the profile is marked stale, so re-running
    ``tessera profile`` refreshes it."""
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache
    from tessera.flow import build_costs, compile_programs, plan_recipe, resolve
    from tessera.train.profile_pairs import candidate_pair_specs

    analytic = recipe.with_overrides(["planner.cost_source=analytic"])
    res = resolve(analytic)
    costs = build_costs(res)
    fp = profile_fingerprint(recipe, res.model, res.hardware)
    path = profile_cache_path(recipe)
    report = plan_recipe(res, costs)
    programs = tuple(compile_programs(report.tessera))
    tasks, pairs = profile_items(costs, programs)
    specs = candidate_pair_specs(costs, report)
    pair_names = sorted(set(pairs) | {s.item for s in specs})
    needed = tuple(sorted(set(tasks.values())) + pair_names + (["p2p"] if recipe.parallel.pp > 1 else []))
    common = dict(cache=path, fingerprint=fp.digest, distinct_tasks=len(set(tasks.values())), tasks=len(tasks),
                  distinct_pairs=len(pair_names), program_pairs=len(pairs), pairs_needed=report.pairs_total,
                  candidate_pairs_distinct=report.pairs_distinct)
    cache = ProfileCache(path)
    stale = cache.status(fp).stale  # a stale profile is re-timed whole (and the mark cleared by the new items)
    missing = needed if stale else tuple(cache.missing(fp, needed))
    todo = tuple(s for s in specs if s.item in set(missing) and s.item not in pairs)
    return ProfileSetup(analytic, costs, programs, fp, path, needed, missing, common, todo, report.with_w,
                        report.tessera, stale)


def profile_complete(recipe) -> bool:
    """Whether the cache holds a fresh profile of ``recipe`` with every task item, the p2p item
    (pp > 1) and timed pairs, decided without planning (a ``planner.cost_source=profile`` job
    then plans once, on the profile; pair items the profile lacks are composed from task times
    and counted by ``tessera plan``)."""
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import PAIR_PREFIX, task_signatures
    from tessera.flow import build_costs, resolve

    res = resolve(recipe.with_overrides(["planner.cost_source=analytic"]))
    fp = profile_fingerprint(recipe, res.model, res.hardware)
    cache = ProfileCache(profile_cache_path(recipe))
    status = cache.status(fp)
    if not status.exists or status.stale:
        return False
    have = set(cache.get(fp))
    need = set(task_signatures(build_costs(res)).values()) | ({"p2p"} if recipe.parallel.pp > 1 else set())
    return need <= have and any(k.startswith(PAIR_PREFIX) for k in have)


def _pairs_timed(have: dict) -> int:
    from tessera.cost.profile_costs import PAIR_PREFIX

    return sum(1 for k in have if k.startswith(PAIR_PREFIX))


def cached_result(setup: ProfileSetup, wall_s: float = 0.0) -> ProfileResult:
    """The result of a run that found every item in the cache (no worker started)."""
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import OVERLAP_ITEM

    have = {k: v.median_ms for k, v in ProfileCache(setup.cache_path).get(setup.fingerprint).items()}
    return ProfileResult(**setup.common, timed_items=0, missing=(), cache_hit=True, wall_s=wall_s,
                         calibration=calibration(setup.costs, have), overlap_slowdown=have.get(OVERLAP_ITEM),
                         pairs_timed=_pairs_timed(have))


def _time_on_workers(recipe, setup: ProfileSetup, progress: bool, reps: int, pairs: bool = True) -> tuple[dict, int, str]:
    """Run :func:`~tessera.train.profile_worker.profile_loop` on the job's workers (``pairs``:
    with the setup's candidate pairs); ``(item -> samples, timed iterations per pass, device
    name)``. The run's own directory (Ray Train's storage, nothing worth keeping) is removed
    afterwards."""
    import shutil

    import ray

    from tessera.train.driver import driver_name, start_driver
    from tessera.train.job import out_root
    from tessera.train.preflight import preflight
    from tessera.train.profile_progress import ProfileProgressBar
    from tessera.train.profile_worker import PAIRS_KEY
    from tessera.train.trainer import build_trainer, worker_threads
    from tessera.train.worker import WorkerConfig

    analytic = setup.analytic.with_overrides([f"profile.reps={reps}"])
    resources = preflight(analytic, ray.cluster_resources()).resources
    root = out_root(analytic)
    run_name = f"{recipe.name}-profile-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(root, run_name)
    specs = setup.pair_specs if pairs else ()
    driver, _ = start_driver(analytic, run_dir, run_name, namespace=recipe.job.namespace, plan=setup.plan)
    try:
        wcfg = _PairsConfig(WorkerConfig(analytic.to_dict(), run_name, run_dir, driver_name(run_name),
                                         threads=worker_threads(analytic, resources)), specs, PAIRS_KEY)
        if progress:
            what = (f"checking drift: re-timing the Program's {len(setup.needed) - len(setup.pair_specs)} task and "
                    "pair items" if not pairs else
                    f"the profile is marked stale: re-timing all {len(setup.needed)} items" if setup.stale else
                    f"{len(setup.missing)} of {len(setup.needed)} items without a time")
            print(f"tessera profile: {what}; timing on "
                  f"{recipe.parallel.pp * recipe.parallel.dp} workers ({recipe.profile.warmup} warm-up + up to "
                  f"{reps} timed iterations per pass, then {len(specs)} candidate pairs outside the Program; "
                  f"budget {recipe.profile.budget_s:g} s)", flush=True)
        rounds = -(-len(specs) // recipe.parallel.pp)
        with ProfileProgressBar(driver, 2 * reps + rounds, enabled=progress):
            build_trainer(analytic, wcfg, root, resources, loop=profile_loop).fit()
        reports = ray.get(driver.profile_reports.remote(), timeout=60)
    finally:
        ray.kill(driver)
        shutil.rmtree(run_dir, ignore_errors=True)
    merged: dict[str, list[float]] = {}
    for rep in reports.values():
        for item, vals in rep["samples"].items():
            merged.setdefault(item, []).extend(vals)
    iterations = max((r["iterations"] for r in reports.values()), default=0)
    device = next(iter(reports.values()))["device"] if reports else ""
    return merged, iterations, device


@dataclass(frozen=True)
class _PairsConfig:
    """A :class:`~tessera.train.worker.WorkerConfig` whose dict also carries the candidate pairs
    (``key``: :data:`~tessera.train.profile_worker.PAIRS_KEY`)."""

    config: object
    specs: tuple
    key: str

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def run_name(self) -> str:
        return self.config.run_name

    def to_dict(self) -> dict:
        return {**self.config.to_dict(), self.key: [s.to_dict() for s in self.specs]}


def run_profile(recipe, *, progress: bool = True, setup: ProfileSetup | None = None) -> ProfileResult:
    """Profile ``recipe`` on the connected Ray cluster (module docstring) and fill the cache with
    the items it lacks (``setup``: a :func:`prepare_profile` already made).

    Raises:
        TesseraConfigError / ProgramError: a pre-flight or planning error (as ``tessera train``).
    """
    from tessera.cost.profile_cache import ProfileCache, ProfileItem
    from tessera.cost.profile_costs import CALIB_PREFIX, OVERLAP_ITEM, PAIR_WITH_W_ITEM, summarise_samples

    t0 = time.perf_counter()
    setup = setup or prepare_profile(recipe)
    if not setup.missing:
        return cached_result(setup, time.perf_counter() - t0)
    merged, iterations, device = _time_on_workers(recipe, setup, progress, recipe.profile.reps)
    stats = summarise_samples(merged)
    warmup = recipe.profile.warmup
    missing = set(setup.missing)
    items = [ProfileItem(k, m, a, b, n, warmup) for k, (m, a, b, n) in stats.items() if k in missing]
    timed = len(items)
    cache = ProfileCache(setup.cache_path)
    have = {k: v.median_ms for k, v in cache.get(setup.fingerprint).items()}
    have.update({k: v[0] for k, v in stats.items()})
    fits = overlap_fits(setup.costs, setup.programs, have)
    if fits:
        m, a, b, n = summarise_samples({OVERLAP_ITEM: fits})[OVERLAP_ITEM]
        items.append(ProfileItem(OVERLAP_ITEM, m, a, b, n, warmup))
    w = 1.0 if setup.with_w else 0.0
    items.append(ProfileItem(PAIR_WITH_W_ITEM, w, w, w, 1, warmup))
    scales = calibration_scales(setup.costs, have)
    items += [ProfileItem(f"{CALIB_PREFIX}{k}", s, s, s, 1, warmup) for k, s in scales.items()]
    cache.put(setup.fingerprint, items)
    have = {k: v.median_ms for k, v in cache.get(setup.fingerprint).items()}
    return ProfileResult(**setup.common, timed_items=timed,
                         missing=tuple(cache.missing(setup.fingerprint, setup.needed)), cache_hit=False,
                         wall_s=time.perf_counter() - t0, iterations=iterations, device=device,
                         calibration=calibration(setup.costs, have, scales), overlap_slowdown=have.get(OVERLAP_ITEM),
                         pairs_timed=_pairs_timed(have))


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
    from tessera.cost.profile_costs import is_factor_item, summarise_samples

    t0 = time.perf_counter()
    setup = setup or prepare_profile(recipe)
    cache = ProfileCache(setup.cache_path)
    ref = {k: v.median_ms for k, v in cache.get(setup.fingerprint).items()}
    th = recipe.profile.drift_threshold
    if not ref:
        return DriftReport({}, 0.0, th, False, missing_profile=True, wall_s=time.perf_counter() - t0)
    merged, _, _ = _time_on_workers(recipe, setup, progress, 1, pairs=False)
    now = {k: v[0] for k, v in summarise_samples(merged).items()}
    items = {k: now[k] / ref[k] - 1 for k in sorted(now) if ref.get(k, 0) > 0 and not is_factor_item(k)}
    drift = statistics.median(abs(v) for v in items.values()) if items else 0.0
    stale = drift > th
    if stale:
        cache.mark_stale(setup.fingerprint, drift)
    return DriftReport(items, drift, th, stale, wall_s=time.perf_counter() - t0)
