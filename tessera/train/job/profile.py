"""``tessera profile``: time every distinct task and candidate F&B pair on the job's own Ray Train workers.

:func:`run_profile` runs one Ray Train ``TorchTrainer`` (the same workers, process groups and
Programs as ``tessera train``: gloo on CPU, NCCL on GPUs) whose per-worker function is
:func:`tessera.train.profile.loop.profile_loop`: the Program's tasks (all-to-alls waited in
their own task), the Program's overlapped pairs, every other distinct candidate pair the planner
costs (:mod:`tessera.train.profile.pairs`: co-executed in the pair scheduler's order, real
all-to-alls over the EP group) and the p2p transfer. ``profile.budget_s`` stops the timing
cleanly; what was never timed is absent from the profile and falls back to the analytic model
when planning (tasks: times the calibration scale of their kind; pairs: composed from the task
times by the pair scheduler), counted in ``tessera plan``'s output.

Each rank hands its samples to the driver actor; the job side merges them
(:func:`tessera.cost.profile_costs.summarise_samples`: median, p25, p75), fits the overlap
slowdown and the per-phase calibration scales (:mod:`tessera.train.profile.fit`), stores the
items in the profile cache under the recipe's fingerprint (:mod:`tessera.config.profile_rules`)
and reports the calibration (analytic vs measured per task kind, before and after the scale).
Items the cache already holds are not profiled again: when nothing is missing, no worker starts
(``cache_hit``). What a run needs before it starts and what it returns are
:mod:`tessera.train.profile.setup`'s (no Ray needed).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tessera.train.profile.fit import calibration, calibration_scales, overlap_fits
from tessera.train.profile.loop import profile_loop
from tessera.train.profile.setup import DriftReport, ProfileResult, ProfileSetup, cached_result, pairs_timed, \
    prepare_profile

__all__ = ["run_profile", "check_profile"]


def _time_on_workers(recipe, setup: ProfileSetup, progress: bool, reps: int, pairs: bool = True) -> tuple[dict, int, str]:
    """Run :func:`~tessera.train.profile.loop.profile_loop` on the job's workers (``pairs``:
    with the setup's candidate pairs); ``(item -> samples, timed iterations per pass, device
    name)``. The run's own directory (Ray Train's storage, nothing worth keeping) is removed
    afterwards."""
    import ray

    from tessera.train.job.driver import driver_name, kill_driver, start_driver
    from tessera.train import storage
    from tessera.train.job.outputs import out_root
    from tessera.train.job.preflight import preflight
    from tessera.train.profile.progress import ProfileProgressBar
    from tessera.train.profile.loop import PAIRS_KEY
    from tessera.train.job.trainer import build_trainer, worker_threads
    from tessera.train.worker.corpus import absolute_data_paths
    from tessera.train.worker.loop import WorkerConfig

    analytic = setup.analytic.with_overrides([f"profile.reps={reps}"])
    resources = preflight(analytic, ray.cluster_resources()).resources
    root = out_root(analytic)
    run_name = f"{recipe.name}-profile-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = storage.join(root, run_name)  # a local path, or an s3:// / gs:// URI
    specs = setup.pair_specs if pairs else ()
    driver, _ = start_driver(analytic, run_dir, run_name, namespace=recipe.job.namespace, plan=setup.plan)
    try:
        wcfg = _PairsConfig(WorkerConfig(absolute_data_paths(analytic, root).to_dict(), run_name, run_dir,
                                         driver_name(run_name),
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
        kill_driver(driver, run_name, recipe.job.namespace)
        try:
            storage.remove_tree(run_dir)
        except OSError:
            pass  # nothing worth keeping, nothing worth failing for
    merged: dict[str, list[float]] = {}
    for rep in reports.values():
        for item, vals in rep["samples"].items():
            merged.setdefault(item, []).extend(vals)
    iterations = max((r["iterations"] for r in reports.values()), default=0)
    device = next(iter(reports.values()))["device"] if reports else ""
    return merged, iterations, device


@dataclass(frozen=True)
class _PairsConfig:
    """A :class:`~tessera.train.worker.loop.WorkerConfig` whose dict also carries the candidate pairs
    (``key``: :data:`~tessera.train.profile.loop.PAIRS_KEY`)."""

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
                         pairs_timed=pairs_timed(have))


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
