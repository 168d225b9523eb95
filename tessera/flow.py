"""The one-way flow from a recipe to a simulated baseline iteration.

``Recipe -> (ModelSpec, HardwareSpec) -> ModelCosts -> baseline Plan -> Programs -> validate ->
simulate``. Each step is a pure function of the previous step's values, so other commands (for
example ``tessera plan``) can reuse the first steps and replace the planning step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, TypeVar

from tessera.config.load import Recipe
from tessera.config.resolve import resolve_hardware, resolve_model
from tessera.config.validate import validate_memory, validate_recipe
from tessera.cost.types import ModelCosts, ParallelShape
from tessera.program.instructions import Program
from tessera.program.plan import Plan
from tessera.sim.result import SimResult
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import ModelSpec

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved:
    """A recipe with its model and hardware resolved and every value rule checked."""

    recipe: Recipe
    model: ModelSpec
    hardware: HardwareSpec

    @cached_property
    def layouts(self) -> tuple[Recipe, ...]:
        """The recipe's concrete layouts (:func:`tessera.config.validate.layout_options`; the recipe
        itself when neither template nor vpp is ``auto``), computed once."""
        from tessera.config.validate import layout_options

        return layout_options(self.recipe, self.model)


@dataclass(frozen=True)
class SimulationRun:
    """Everything one ``tessera simulate`` produced.

    Attributes:
        resolved: recipe, model and hardware.
        costs: the cost model's output.
        plan: the baseline plan.
        programs: one Program per pipeline rank (validated).
        memory_gb: per-rank peak memory from the memory rule (equals the simulator's).
        result: the simulated iteration.
        timings: ``(step, wall seconds)`` for resolve, costs, plan, compile, simulate.
    """

    resolved: Resolved
    costs: ModelCosts
    plan: Plan
    programs: tuple[Program, ...]
    memory_gb: tuple[float, ...]
    result: SimResult
    timings: tuple[tuple[str, float], ...] = field(default=())

    @property
    def wall_s(self) -> float:
        """Total wall time of all steps, seconds."""
        return sum(t for _, t in self.timings)

    def timing(self, step: str) -> float:
        """Wall seconds of one step (0.0 if it was not timed)."""
        return dict(self.timings).get(step, 0.0)

    def summary(self) -> dict:
        """Every figure ``tessera simulate`` shows, as plain JSON values (``--json FILE``).

        Units: ms, GB, ratios in [0, 1]. ``gpus = pp * tp * dp`` (ep is carved from ``dp * tp``);
        ``tokens_per_s_per_gpu = dp * M * micro_batch_size * seq_length / (iteration_s * gpus)``,
        i.e. ``M * mbs * seq / (iteration_s * pp * tp)``; ``tflops_per_gpu`` is the model FLOPs
        the simulated tasks executed (``ModelCosts`` task FLOPs: 6 * params-per-token style
        counts of :mod:`tessera.cost.flops`) per GPU per second, ``mfu * peak``.
        """
        rec, res, plan = self.resolved.recipe, self.result, self.plan
        p = rec.parallel
        gpus = p.pp * p.tp * p.dp
        it_s = res.iteration_ms / 1e3
        tokens = p.dp * p.num_microbatches * p.micro_batch_size * p.seq_length
        return {
            "recipe": rec.name, "model": self.resolved.model.name, "hardware": self.resolved.hardware.name,
            "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "tp": p.tp, "dp": p.dp, "gpus": gpus,
            "num_microbatches": p.num_microbatches, "micro_batch_size": p.micro_batch_size,
            "seq_length": p.seq_length, "plan": plan.name, "template": plan.template,
            "overlap": plan.overlap, "split_w": plan.split_w, "layers_per_stage": list(plan.partition.sizes()),
            "iteration_ms": res.iteration_ms, "bubble_ratio": res.bubble_ratio,
            "exposed_a2a_ratio": res.exposed_a2a_ratio, "mfu": res.mfu,
            "tflops_per_gpu": res.mfu * self.costs.peak_flops / 1e12,
            "tokens_per_s_per_gpu": tokens / (it_s * gpus) if it_s > 0 else 0.0,
            "peak_mem_gb": [m.peak_mem_gb for m in res.ranks], "peak_mem_gb_max": res.peak_mem_gb,
            "static_mem_gb": [m.static_mem_gb for m in res.ranks],
            "busy_ms": [m.busy_ms for m in res.ranks], "idle_ms": [m.idle_ms for m in res.ranks],
            "exposed_a2a_ms": [m.exposed_a2a_ms for m in res.ranks],
            "dp_exposed_ms": [m.dp_exposed_ms for m in res.ranks], "optimizer_ms": [m.optimizer_ms for m in res.ranks],
            "wall_s": self.wall_s, "rank_order": self.placement.order, "placement": self.placement.to_dict(),
        }

    @property
    def placement(self):
        """Where the run's ranks sit (:func:`tessera.spec.placement.placement_of` of the recipe's
        layout on the hardware's nodes): what the cost model priced."""
        from tessera.spec.placement import placement_of

        return placement_of(self.resolved.recipe.parallel, self.resolved.hardware.gpus_per_node)


def resolve(recipe: Recipe) -> Resolved:
    """Resolve the recipe's model and hardware and check every value rule.

    Raises:
        TesseraConfigError: unknown preset, bad layout, template shape, ...
    """
    model = resolve_model(recipe)
    validate_recipe(recipe, model)
    hw = resolve_hardware(recipe)
    return Resolved(recipe, model, hw)


def build_costs(res: Resolved) -> ModelCosts:
    """Per-task costs of the model on the hardware under the recipe's parallel layout and cost
    options (:func:`tessera.config.cost_rules.cost_options`): analytic, or with
    ``planner.cost_source=trace`` the MoE layers' times from ``planner.trace``
    (:func:`tessera.cost.trace_costs.trace_costs`). Whatever the source, the recipe's
    ``planner.rank_slowdown`` becomes ``ModelCosts.rank_scale`` and the largest
    ``planner.ep_slowdown`` factor scales every expert task (:meth:`tessera.cost.slowdown.Slowdown.apply`;
    with ``model.moe_routing`` imbalance, which the analytic costs carry, the larger of the two:
    :func:`tessera.cost.routing.expert_gate`).

    Raises:
        TesseraConfigError: an unreadable trace, or one of another layout (``planner.trace``)."""
    from tessera.config.cost_rules import cost_options
    from tessera.cost.analytic import analytic_costs

    first = res.layouts[0]  # per-task costs do not depend on template or vpp
    shape = ParallelShape.of(first.parallel)
    options = cost_options(first)
    costs = analytic_costs(res.model, res.hardware, shape, options=options)
    if first.planner.cost_source == "trace":
        from tessera.cost.trace import load_kineto
        from tessera.cost.trace_costs import check_trace_matches, trace_costs

        trace = load_kineto(first.planner.trace)
        check_trace_matches(trace, res.model, res.hardware, shape)
        costs, _ = trace_costs(costs, trace, res.hardware)
    elif first.planner.cost_source == "profile":
        costs = _profiled(res, first, costs)
    from tessera.cost.slowdown import Slowdown

    return Slowdown.of(first.planner).apply(costs, routed=options.moe_load if shape.ep > 1 else 1.0)


class ProfileWarning(UserWarning):
    """Planning on a profile that is stale or lacks items (the message says which)."""


def _profiled(res: Resolved, recipe, analytic: ModelCosts) -> ModelCosts:
    """``analytic`` with the times of the recipe's profile (:func:`tessera.cost.profile_costs.profiled_costs`);
    a stale profile or tasks without a time are a :class:`ProfileWarning`.

    Raises:
        TesseraConfigError: the cache has no profile of this layout (``tessera profile`` first).
    """
    import warnings

    from tessera.config.profile_rules import load_profile_costs

    got = load_profile_costs(recipe, res.model, res.hardware, analytic)
    report = got.report
    if got.stale:
        warnings.warn(f"profile {got.digest[:12]} in {got.path} is stale (drift {got.drift or 0:.0%} above "
                      f"profile.drift_threshold); re-run `tessera profile`", ProfileWarning, stacklevel=2)
    if report.fallback:
        warnings.warn(f"{len(report.fallback)} of {len(report.fallback) + len(report.measured)} tasks have no "
                      f"profiled time and use the analytic model (e.g. {', '.join(report.fallback[:3])})",
                      ProfileWarning, stacklevel=2)
    return got.costs


def build_baseline(res: Resolved, costs: ModelCosts) -> Plan:
    """The baseline plan: serial-balanced partition and the template's fixed pair orders. With
    ``planner.template`` or ``parallel.vpp`` ``auto``: the fastest simulated baseline over the
    recipe's layout options that fit memory (:mod:`tessera.config.auto`).

    Raises:
        TesseraConfigError: under ``auto``, no option fits memory (the first option's memory error).
    """
    from tessera.config.validate import capacity_gb
    from tessera.plan.baseline import baseline_plan

    def one(recipe) -> Plan:
        p, pl = recipe.parallel, recipe.planner
        return baseline_plan(costs, pl.template, p.pp, p.vpp, p.num_microbatches, overlap=pl.overlap,
                             split_w=pl.split_w)

    options = res.layouts
    if len(options) == 1:
        return one(options[0])
    evaluate = iteration_evaluator(costs, capacity_gb(res.recipe, res.hardware) * 1e9)
    scored = [(evaluate(plan), i, plan) for i, plan in enumerate(one(o) for o in options)]
    ms, _, plan = min(scored)
    if ms == math.inf:
        validate_memory(res.recipe, res.hardware, compile_programs(scored[0][2]), costs)
    return plan


def plan_recipe(res: Resolved, costs: ModelCosts, progress=None):
    """The overlap-aware plan of a resolved recipe (:func:`tessera.plan.planner.make_plan` with the
    recipe's planner settings and memory capacity ``hardware.mem_gb * (1 - planner.memory_margin)``).

    Args:
        res, costs: the resolved recipe and its costs (:func:`resolve`, :func:`build_costs`).
        progress: ``progress(phase, done, total)`` for the pair-scheduling and MILP phases.

    Returns:
        :class:`tessera.plan.planner.PlanReport`.

    Raises:
        TesseraConfigError: no candidate partition fits memory ("parallel.pp=P: rank r needs X
            GB, capacity Y GB (...)", with the recipe's overrides that lower memory), or the MILP
            found no solution in time.
    """
    from tessera.config.limits import CANDIDATE_RADIUS
    from tessera.config.validate import capacity_gb, capacity_note, memory_fixes
    from tessera.errors import TesseraConfigError
    from tessera.plan.planner import make_plan

    recipe, hw = res.recipe, res.hardware
    cap = capacity_gb(recipe, hw) * 1e9
    options = res.layouts
    evaluate = iteration_evaluator(costs, cap)
    screen = iteration_evaluator(costs, cap, validate=False)

    def one(option, search_evals: int, search_s: float, synthesis_evals: int | None = None):
        p, pl = option.parallel, option.planner
        try:
            return make_plan(costs, template=pl.template, pp=p.pp, vpp=p.vpp, num_microbatches=p.num_microbatches,
                             overlap=pl.overlap, split_w=pl.split_w, radius=pl.candidate_radius, prune=pl.prune,
                             time_limit_s=pl.time_limit_s, capacity_bytes=cap, progress=progress,
                             objective=pl.objective, evaluate=evaluate, search_time_s=search_s,
                             search_evals=search_evals, solver=pl.solver, max_radius=CANDIDATE_RADIUS.value,
                             synthesis=pl.synthesis, screen=screen,
                             synthesis_evals=synthesis_evals if synthesis_evals is not None else pl.synthesis_evals)
        except TesseraConfigError as e:
            if e.field != "memory":
                raise
            raise TesseraConfigError("parallel.pp", p.pp, f"{e.rule}; {capacity_note(option, hw)}",
                                     memory_fixes(option, planner=True)) from None

    pl = recipe.planner
    evals = search_evals(res, costs)
    if len(options) == 1:
        return one(options[0], evals, pl.search_time_s)
    syn_evals = (evals if pl.synthesis_evals is None else pl.synthesis_evals) if pl.synthesis else 0
    return _best_of_layouts(options, one, evals, pl.search_time_s, costs, evaluate, syn_evals, cap, screen)


def search_evals(res: Resolved, costs: ModelCosts) -> int:
    """The iteration search's budget of ``res``'s recipe, simulated plans: ``planner.search_evals``,
    or where it is null (the default) :func:`tessera.plan.planner.search_budget` of the model's
    tasks and ``parallel.num_microbatches``."""
    from tessera.plan.planner import search_budget

    n = res.recipe.planner.search_evals
    return search_budget(costs, res.recipe.parallel.num_microbatches) if n is None else n


BOUND_TIME_S = 120.0
"""Wall-clock safety cap of :func:`partition_bound` (``tessera plan --bound-time``,
``benchmarks/planner.py``), s, over all layouts under ``auto`` (at least :data:`BOUND_MIN_S` per
layout); its deterministic limit is a node count
(:data:`tessera.plan.partition_bound.BOUND_WORK`)."""
BOUND_MIN_S = 4.0


def partition_bound(res: Resolved, costs: ModelCosts, time_s: float = BOUND_TIME_S):
    """The least iteration time any partition can reach under the cost model, over the recipe's
    layouts (:func:`tessera.plan.partition_bound.partition_lower_bound` per layout; the smallest
    is returned, so under ``auto`` it bounds every layout tried), ms. The deterministic limit:
    :data:`~tessera.plan.partition_bound.BOUND_WORK` split evenly over the layouts (each gets
    its share divided by its rows in nodes, at least 1).

    Args:
        time_s: wall-clock safety cap over all layouts, s (each layout gets what the ones before
            it left, at least :data:`BOUND_MIN_S`).

    Returns:
        :class:`tessera.plan.partition_bound.PartitionBound` of the layout with the least bound,
        with ``solve_s`` the wall time of all layouts and ``cap_hit`` set when the cap stopped any.
    """
    from dataclasses import replace

    from tessera.plan.partition_bound import BOUND_WORK, partition_lower_bound

    options = res.layouts
    best, spent, capped = None, 0.0, False
    for o in options:
        p, pl = o.parallel, o.planner
        pb = partition_lower_bound(costs, template=pl.template, pp=p.pp, vpp=p.vpp,
                                   num_microbatches=p.num_microbatches, overlap=pl.overlap, split_w=pl.split_w,
                                   time_limit_s=max(BOUND_MIN_S, time_s - spent), work=BOUND_WORK // len(options))
        spent += pb.solve_s
        capped = capped or pb.cap_hit
        if best is None or pb.ms < best.ms:
            best = pb
    return replace(best, solve_s=spent, cap_hit=capped)


EXPLORE_SHARE = 0.3
"""Under ``auto``: the share of ``planner.search_evals`` split evenly over the layouts (a short
search each); the rest goes to the fastest one (:func:`tessera.plan.planner.continue_search`)."""


def _layout_label(option) -> str:
    """``"zb-v vpp 2"`` (with ``", no overlap"`` / ``", W in B"`` where they are off): which
    layout a wall-clock cap stopped, in ``PlanReport.caps_hit``."""
    pl = option.planner
    return (f"{pl.template} vpp {option.parallel.vpp}" + ("" if pl.overlap else ", no overlap")
            + ("" if pl.split_w else ", W in B"))


def _best_of_layouts(options, one, search_evals: int, search_time_s: float, costs: ModelCosts, evaluate,
                     synthesis_evals: int = 0, capacity_bytes: float | None = None, screen=None):
    """Plan every layout option (:data:`EXPLORE_SHARE` of the ``search_evals`` evaluations split
    evenly), keep the fastest simulated Tessera plan and spend the rest of the evaluations refining
    it (and the schedule synthesis likewise: ``synthesis_evals``, memory ``capacity_bytes``, its
    screening evaluator ``screen``);
    ``search_time_s`` is the wall-clock safety cap of all the searches together (the report's
    ``caps_hit`` names the layouts it stopped). The report's baseline is the fastest baseline
    over all options, so the plan
    beats (or equals) the best layout a user could pick by hand. ``alternatives`` lists every
    option tried: ``(template, vpp, baseline_iteration_ms, tessera_iteration_ms, overlap,
    split_w)`` (``inf``: it did not fit memory). Options tie to the first (``false`` before ``true`` for
    ``overlap`` / ``split_w`` under ``auto``: the cheaper engine path wins a tie).

    Raises:
        TesseraConfigError: no option fits memory (the first option's error).
    """
    from dataclasses import replace

    from tessera.errors import TesseraConfigError
    from tessera.plan.planner import continue_search

    def searched(attr: str):
        return sum(getattr(r.search, attr) for r in reports.values() if r.search is not None)

    reports, first = {}, None  # option index -> its report
    share = int(EXPLORE_SHARE * search_evals) // len(options)  # a short search per layout ...
    syn_share = int(EXPLORE_SHARE * synthesis_evals) // len(options)
    for i, option in enumerate(options):
        try:
            reports[i] = one(option, share, max(0.0, search_time_s - searched("search_s")), syn_share)
        except TesseraConfigError as e:
            first = first or e
    if not reports:
        raise first
    k = min(reports, key=lambda i: reports[i].tessera_iteration_ms)
    if reports[k].search is not None:  # ... then the rest of the budget on the fastest one
        spent = sum(r.synthesis.evaluations for r in reports.values() if r.synthesis is not None)
        reports[k] = continue_search(reports[k], costs, evaluate, max(0, search_evals - searched("evaluations")),
                                     max(0.0, search_time_s - searched("search_s")),
                                     max(0, synthesis_evals - spent), capacity_bytes, screen)
    caps = tuple(f"{c} ({_layout_label(options[i])})" for i, r in reports.items() for c in r.caps_hit)
    best = replace(reports[k], caps_hit=caps)
    base = min(reports.values(), key=lambda r: r.baseline_iteration_ms)
    alternatives = [(o.planner.template, o.parallel.vpp) + ((reports[i].baseline_iteration_ms,
                                                              reports[i].tessera_iteration_ms)
                                                             if i in reports else (math.inf, math.inf))
                    + (o.planner.overlap, o.planner.split_w) for i, o in enumerate(options)]
    return replace(best, baseline=base.baseline, baseline_edges=base.baseline_edges,
                   baseline_bottleneck_ms=base.baseline_bottleneck_ms, baseline_own_ms=base.baseline_own_ms,
                   baseline_iteration_ms=base.baseline_iteration_ms, alternatives=tuple(alternatives))


def iteration_evaluator(costs: ModelCosts, capacity_bytes: float | None = None,
                        validate: bool = True) -> Callable[[Plan], float]:
    """``evaluate(plan) -> ms`` for the planner's iteration objective and never-slower rule: the
    plan compiled, validated and simulated (its ``iteration_ms``); ``inf`` when the Programs are
    invalid or a rank's peak memory exceeds ``capacity_bytes`` (``None``: no memory limit).
    ``validate=False``: without :func:`tessera.program.validate.validate_programs` (the
    simulator still rejects a deadlock or a lost message): the schedule synthesis' screen, whose
    winner the validating evaluator confirms (:func:`tessera.plan.synthesis.synthesize`)."""
    from tessera.errors import ProgramError, TesseraConfigError
    from tessera.program.compiler import compile_plan
    from tessera.program.memory import rank_memory_bytes
    from tessera.program.validate import validate_programs
    from tessera.sim.simulator import simulated_iteration_ms

    schedules: dict = {}  # compute schedules shared by the evaluations (same costs)
    lowered: dict = {}  # each shape's lowered instructions (compile_plan's cache)
    peaks: dict = {}  # FB pair peaks by content (rank_memory_bytes' cache)

    def evaluate(plan: Plan) -> float:
        try:
            programs = compile_plan(plan, lowered)
            if validate:
                validate_programs(programs)
        except (ProgramError, TesseraConfigError, ValueError):
            return math.inf
        if capacity_bytes is not None and max(rank_memory_bytes(programs, costs, peaks), default=0.0) > capacity_bytes:
            return math.inf
        try:
            return simulated_iteration_ms(programs, costs, schedules)
        except ProgramError:  # only without the validator: a deadlock or a lost message
            if validate:
                raise
            return math.inf

    return evaluate


def plan_sensitivity(res: Resolved, costs: ModelCosts, chosen: Plan, *, spread: float = 0.05, samples: int = 10,
                     seed: int = 0, search_time_s: float | None = None, search_evals: int | None = None):
    """:func:`tessera.plan.sensitivity.sensitivity` of ``chosen`` under the recipe's planner
    settings: every perturbed copy is planned as :func:`plan_recipe` plans (its iteration search
    limited to ``search_evals`` evaluations and capped at ``search_time_s`` s, defaults the
    recipe's: :func:`search_evals` and ``planner.search_time_s``) and both plans are evaluated
    by the simulated iteration on that copy (:func:`iteration_evaluator`).

    Returns:
        :class:`tessera.plan.sensitivity.SensitivityReport`.
    """
    from dataclasses import replace as dc_replace

    from tessera.config.validate import capacity_gb
    from tessera.plan.sensitivity import sensitivity

    cap = capacity_gb(res.recipe, res.hardware) * 1e9
    budget = res.recipe.planner.search_time_s if search_time_s is None else search_time_s
    evals = [] if search_evals is None else [f"planner.search_evals={search_evals}"]
    quick = dc_replace(res, recipe=res.recipe.with_overrides([f"planner.search_time_s={budget}"] + evals))

    def plan_fn(c: ModelCosts) -> Plan:
        return plan_recipe(quick, c).tessera

    def evaluate_fn(c: ModelCosts, plan: Plan) -> float:
        return iteration_evaluator(c, cap)(plan)

    return sensitivity(costs, chosen, plan_fn, evaluate_fn, spread=spread, samples=samples, seed=seed)


def compile_programs(plan: Plan, dbo_costs: ModelCosts | None = None) -> tuple[Program, ...]:
    """Compile ``plan`` to one Program per rank and validate them.

    ``dbo_costs``: with ``dbo.enabled``, the costs whose MoE layers get slot annotations and
    whose W get slack (:func:`tessera.program.slots.annotate_slots`, ``defer_w=True``); None:
    the Programs as compiled.

    Raises:
        ProgramError: a send without its receive, a deadlock, a W that runs twice, ...
    """
    from tessera.program.compiler import compile_plan
    from tessera.program.validate import validate_programs

    programs = tuple(compile_plan(plan))
    if dbo_costs is not None:
        from tessera.dbo.predict import moe_layers
        from tessera.program.slots import annotate_slots

        programs = annotate_slots(programs, moe_layers(dbo_costs), defer_w=True)
    validate_programs(programs)
    return programs


def plan_programs(recipe, costs=None):
    """``(Plan, Programs)`` of ``recipe``: analytic costs (or ``costs``) -> overlap-aware plan ->
    compiled and validated Programs, slot-annotated with W slack under ``dbo.enabled`` (the
    driver's planning step, usable without Ray)."""
    res = resolve(recipe)
    costs = build_costs(res) if costs is None else costs
    report = plan_recipe(res, costs)
    return report.tessera, compile_programs(report.tessera, costs if recipe.dbo.enabled else None)


def _timed(timings: list[tuple[str, float]], step: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    out = fn()
    timings.append((step, time.perf_counter() - t0))
    return out


def run_plan(recipe: Recipe, planner: Callable[[Resolved, ModelCosts], Plan] = build_baseline) -> SimulationRun:
    """Run the whole flow for ``recipe`` with ``planner`` choosing the plan (default: baseline).

    The memory rule is checked after the Programs exist and before simulating.

    Raises:
        TesseraConfigError: a value rule or the memory rule is broken.
        ProgramError: the compiled Programs are invalid.
    """
    from tessera.sim.simulator import simulate

    timings: list[tuple[str, float]] = []
    res = _timed(timings, "resolve", lambda: resolve(recipe))
    costs = _timed(timings, "costs", lambda: build_costs(res))
    plan = _timed(timings, "plan", lambda: planner(res, costs))
    programs = _timed(timings, "compile", lambda: compile_programs(plan, costs if recipe.dbo.enabled else None))
    memory = validate_memory(recipe, res.hardware, programs, costs)
    result = _timed(timings, "simulate", lambda: simulate(programs, costs))
    return SimulationRun(res, costs, plan, programs, memory, result, tuple(timings))


def simulate_recipe(recipe: Recipe) -> SimulationRun:
    """The baseline plan of ``recipe``, compiled, validated and simulated."""
    return run_plan(recipe, build_baseline)
