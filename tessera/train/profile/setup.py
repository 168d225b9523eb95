"""What a profile run needs before any worker starts, and what it returns (no Ray needed).

:func:`prepare_profile` plans the recipe on the analytic costs (the Programs the workers will
run), lists the items they and the planner's candidate pairs need (:mod:`tessera.train.profile.fit`,
:mod:`tessera.train.profile.pairs`) and looks them up in the profile cache;
:func:`profile_complete` says whether a ``planner.cost_source=profile`` job can plan at once.
The run on the workers is :mod:`tessera.train.job.profile`; its results are
:class:`ProfileResult` and, for ``tessera profile --check``, :class:`DriftReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.train.profile.fit import calibration, profile_items

__all__ = ["ProfileResult", "ProfileSetup", "DriftReport", "prepare_profile", "profile_complete", "cached_result",
           "pairs_timed"]


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
            (:func:`~tessera.train.profile.fit.overlap_fits`), or None without pairs.
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
    :class:`~tessera.train.profile.pairs.PairSpec`); ``with_w``: the pairs carry their W tasks."""

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
    from tessera.train.profile.pairs import candidate_pair_specs

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


def pairs_timed(have: dict) -> int:
    from tessera.cost.profile_costs import PAIR_PREFIX

    return sum(1 for k in have if k.startswith(PAIR_PREFIX))


def cached_result(setup: ProfileSetup, wall_s: float = 0.0) -> ProfileResult:
    """The result of a run that found every item in the cache (no worker started)."""
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import OVERLAP_ITEM

    have = {k: v.median_ms for k, v in ProfileCache(setup.cache_path).get(setup.fingerprint).items()}
    return ProfileResult(**setup.common, timed_items=0, missing=(), cache_hit=True, wall_s=wall_s,
                         calibration=calibration(setup.costs, have), overlap_slowdown=have.get(OVERLAP_ITEM),
                         pairs_timed=pairs_timed(have))


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
