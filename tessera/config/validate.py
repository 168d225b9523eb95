"""Value rules of a recipe, checked before any planning, and the per-rank memory rule, checked once
the baseline plan's Programs exist.

Every broken rule raises one :class:`~tessera.errors.TesseraConfigError` whose one-line message
names the field, the value, the rule (with the numbers involved) and a fix; the CLI prints it and
exits with code 2. Fixes that propose layout values are checked against the same rules
(:mod:`tessera.config.suggest`), so following one never leads into another of these errors.
Rules, in order (see ``docs/recipes.md``):

* knobs: ``model.num_layers`` >= 0, planner/dbo/train/logging values in range;
  ``dbo.routing`` a token-count source (``recorded`` with a ``dbo.counts_path``; ``router``),
  ``dbo.transport`` a count transport, ``dbo.count_timeout_s`` > 0,
  ``dbo.temperature`` >= 0, ``dbo.skew_target`` 0 or >= 1 (``dbo.enabled`` is allowed: the engine
  the simulator and the training job run the optimizer);
  ``planner.cost_source`` a known cost source; ``planner.solver`` a known MILP solver (whether
  it is installed is checked by :func:`tessera.plan.milp.check_solver`); ``logging.wandb_mode`` a
  W&B mode; ``logging.out_dir`` a directory or an ``s3://`` / ``gs://`` prefix
  (:func:`tessera.config.storage_rules.check_out_dir`);
* the cost-model fields (:func:`tessera.config.cost_rules.check_cost_fields`: recompute mode and
  modules, MoE dispatcher, data-parallel sharding, precision, FP8 recipe, MoE routing, CUDA graphs);
* the ``job`` section (:func:`tessera.config.job_rules.check_job`: run name, namespace, restarts,
  CPUs and threads per worker, process-group timeout, checkpoints kept);
* the ``autopilot`` section (:func:`tessera.config.autopilot_rules.check_autopilot`: thresholds,
  margin, steps, and ``profile.check_every`` > 0 when it is enabled);
* ``train.init_from`` (:func:`tessera.config.train_rules.check_init_from`): null or a Hugging
  Face directory (config.json + *.safetensors); ``train.data`` a path / glob / list,
  ``train.tokenizer`` ``bytes`` or an existing tokenizer file or directory
  (:func:`~tessera.config.train_rules.check_train_data`);
* the model's sizes (:func:`tessera.config.model_checks.check_model`; inline and HF models), and
  ``train.cuda_graphs`` against its layers (:func:`tessera.config.cost_rules.check_cuda_graph_layers`:
  no scope the model has nothing for);
* the layout (:mod:`tessera.config.layout_rules`): ``parallel.*`` >= 1 and within their limits
  (:mod:`tessera.config.limits`), a known ``planner.template``, ``pp*vpp <= num_layers`` (layers need
  not split evenly), work bounds, ``ep`` divides the routed experts and ``dp*tp``, ``tp`` divides
  every dim the cost model splits over tp, and the template's own shape rules
  (:func:`tessera.program.templates.check_shape`);
* per-rank slowdown (:func:`check_slowdown`): ``planner.rank_slowdown`` has ``parallel.pp``
  factors and ``planner.ep_slowdown`` ``parallel.ep`` (or none), each finite and > 0;
* memory: every rank's peak memory under the baseline Programs fits the device
  (:func:`validate_memory`, after planning).
"""

from __future__ import annotations

import math
from typing import Sequence

from tessera.config.auto import AUTO, candidate_layouts, check_vpp, is_auto, mode_choices
from tessera.config.autopilot_rules import check_autopilot
from tessera.config.cost_rules import check_cost_fields, check_cuda_graph_layers
from tessera.config.job_rules import check_job
from tessera.config.layout_rules import Layout, ModelFacts, first_broken
from tessera.config.limits import CANDIDATE_RADIUS, SEARCH_EVALS, TIME_LIMIT_S
from tessera.config.model_checks import check_model
from tessera.config.storage_rules import check_out_dir
from tessera.config.suggest import fix_for, one_of
from tessera.config.train_rules import check_init_from, check_train_data
from tessera.cost.types import CostOptions, ModelCosts
from tessera.errors import TesseraConfigError
from tessera.program.instructions import Program
from tessera.program.memory import rank_memory_bytes
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import ModelSpec

COST_SOURCES = ("analytic", "profile", "trace")
"""Cost sources implemented so far (``planner.cost_source``)."""

OBJECTIVES = ("iteration", "bottleneck")
"""``planner.objective`` values (:func:`tessera.plan.planner.make_plan`)."""

MILP_SOLVERS = ("scip", "cvxpy-scip", "cvxpy-highs")
"""``planner.solver`` values (:data:`tessera.plan.milp.SOLVERS`; config sits below plan, so the
list is repeated here and a test keeps the two equal)."""

WANDB_MODES = ("offline", "online", "disabled")
"""``logging.wandb_mode`` values (:mod:`tessera.train.worker.metrics`)."""

DBO_ROUTING = ("uniform", "zipf", "dirichlet", "recorded", "router")
"""``dbo.routing`` values: the token-count sources of :mod:`tessera.dbo.counts`, and ``router``
(the training job's live router counts, :mod:`tessera.train.dbo.live`)."""

DBO_TRANSPORTS = ("auto", "compiled_graph", "allgather")
"""``dbo.transport`` values (:data:`tessera.train.dbo.transport.KINDS`; config sits below
train, so the list is repeated here and a test keeps the two equal)."""


def _check_knobs(recipe) -> None:
    pl, dbo, tr, lg = recipe.planner, recipe.dbo, recipe.train, recipe.logging
    nl = recipe.model.num_layers
    checks = (
        ("model.num_layers", nl, nl >= 0, "must be >= 0", "use 0 for all layers or a positive count"),
        ("planner.candidate_radius", pl.candidate_radius, pl.candidate_radius >= 0, "must be >= 0",
         f"use 0..{CANDIDATE_RADIUS.value} (default 1)"),
        ("planner.candidate_radius", pl.candidate_radius, pl.candidate_radius <= CANDIDATE_RADIUS.value,
         f"must be <= {CANDIDATE_RADIUS.value} ({CANDIDATE_RADIUS.reason})",
         f"use 0..{CANDIDATE_RADIUS.value} (default 1)"),
        ("planner.time_limit_s", pl.time_limit_s, 0 < pl.time_limit_s <= TIME_LIMIT_S.value,
         f"must be in (0, {TIME_LIMIT_S.value}] seconds ({TIME_LIMIT_S.reason})", "use e.g. 60"),
        ("planner.memory_margin", pl.memory_margin, 0 <= pl.memory_margin < 1, "must be in [0, 1)", "use e.g. 0.05"),
        ("planner.search_time_s", pl.search_time_s, 0 <= pl.search_time_s <= TIME_LIMIT_S.value,
         f"must be in [0, {TIME_LIMIT_S.value}] seconds ({TIME_LIMIT_S.reason})", "use e.g. 300"),
        ("planner.search_evals", pl.search_evals, pl.search_evals is None or 0 <= pl.search_evals <= SEARCH_EVALS.value,
         f"must be in [0, {SEARCH_EVALS.value}] ({SEARCH_EVALS.reason})",
         "use e.g. 400 (0: the starts only; null: scaled to the model)"),
        ("planner.synthesis_evals", pl.synthesis_evals,
         pl.synthesis_evals is None or 0 <= pl.synthesis_evals <= SEARCH_EVALS.value,
         f"must be in [0, {SEARCH_EVALS.value}] ({SEARCH_EVALS.reason})",
         "use e.g. 400 (0: the template's order; null: the search's budget)"),
        ("dbo.pool_mem_gb", dbo.pool_mem_gb, 0 <= dbo.pool_mem_gb < math.inf, "must be a finite number >= 0",
         "use e.g. 4.0"),
        ("dbo.margin", dbo.margin, 0 <= dbo.margin < math.inf, "must be a finite number >= 0", "use e.g. 0.1"),
        ("dbo.routing", dbo.routing, dbo.routing in DBO_ROUTING, f"must be one of {DBO_ROUTING}", "use uniform"),
        ("dbo.counts_path", dbo.counts_path, dbo.routing != "recorded" or bool(dbo.counts_path),
         "must name the recorded token-count table (JSON) when dbo.routing=recorded",
         "set dbo.counts_path=PATH or dbo.routing=zipf"),
        ("dbo.transport", dbo.transport, dbo.transport in DBO_TRANSPORTS, f"must be one of {DBO_TRANSPORTS}",
         "use auto"),
        ("dbo.count_timeout_s", dbo.count_timeout_s, 0 < dbo.count_timeout_s < math.inf,
         "must be a finite number > 0 seconds", "use e.g. 5.0"),
        ("dbo.temperature", dbo.temperature, 0 <= dbo.temperature < math.inf, "must be a finite number >= 0",
         "use e.g. 1.0"),
        ("dbo.skew_target", dbo.skew_target, dbo.skew_target == 0 or 1 <= dbo.skew_target < math.inf,
         "must be 0 (use dbo.temperature) or >= 1 (busiest EP rank's tokens over the mean rank's)",
         "use e.g. 1.3"),
        ("profile.warmup", recipe.profile.warmup, recipe.profile.warmup >= 0, "must be >= 0", "use e.g. 1"),
        ("profile.reps", recipe.profile.reps, recipe.profile.reps >= 1, "must be >= 1 (timed iterations)",
         "use e.g. 3"),
        ("profile.budget_s", recipe.profile.budget_s, 0 <= recipe.profile.budget_s < math.inf,
         "must be a finite number >= 0 seconds", "use e.g. 300 (0: no budget)"),
        ("profile.drift_threshold", recipe.profile.drift_threshold, 0 < recipe.profile.drift_threshold < math.inf,
         "must be a finite number > 0 (relative drift)", "use e.g. 0.1"),
        ("profile.check_every", recipe.profile.check_every, recipe.profile.check_every >= 0, "must be >= 0",
         "use e.g. 10 (0: never)"),
        ("profile.cache", recipe.profile.cache, bool(recipe.profile.cache), "must name a file",
         "use e.g. profiles.sqlite"),
        ("train.steps", tr.steps, tr.steps >= 0, "must be >= 0", "use e.g. 50"),
        ("train.lr", tr.lr, 0 < tr.lr < math.inf, "must be a finite number > 0", "use e.g. 3e-3"),
        ("train.weight_decay", tr.weight_decay, 0 <= tr.weight_decay < math.inf,
         "must be a finite number >= 0 (AdamW)", "use 0.0 or e.g. 0.1"),
        ("train.checkpoint_every", tr.checkpoint_every, tr.checkpoint_every >= 0, "must be >= 0",
         "use 0 (never) or a step count"),
    )
    for field, value, ok, rule, fix in checks:
        if not ok:
            raise TesseraConfigError(field, value, rule, fix)
    one_of("planner.cost_source", pl.cost_source, COST_SOURCES, "unknown or not yet implemented cost source")
    if pl.cost_source == "trace" and not pl.trace:
        raise TesseraConfigError("planner.trace", pl.trace, "planner.cost_source=trace needs a trace file",
                                 "set planner.trace=PATH (a PyTorch-profiler Chrome trace of an overlapped F&B pair)")
    one_of("planner.solver", pl.solver, MILP_SOLVERS, "is not a known partition MILP solver")
    one_of("logging.wandb_mode", lg.wandb_mode, WANDB_MODES, "unknown W&B mode")
    one_of("planner.objective", pl.objective, OBJECTIVES, "is not a planner objective")
    check_out_dir(lg.out_dir)  # a directory, or an s3:// / gs:// prefix


def _model_field(recipe) -> str:
    from tessera.config.sources import sources_set

    src = sources_set(recipe.model)
    return f"model.{src[0]}" if src else "model"


def validate_recipe(recipe, model: ModelSpec) -> None:
    """Check every value rule of ``recipe`` for ``model`` (the resolved ModelSpec), in constant
    time per rule (module docstring).

    Args:
        recipe: a :class:`tessera.config.load.Recipe`.
        model: the recipe's model after ``model.num_layers`` truncation.

    Raises:
        TesseraConfigError: the first broken rule, as one line naming field, value, rule and a fix
            whose proposed values pass every layout rule.
    """
    check_vpp(recipe)
    if is_auto(recipe):
        layout_options(recipe, model)  # every option is checked by this function; one must pass
        return
    _check_knobs(recipe)
    check_cost_fields(recipe)
    check_job(recipe.job)
    check_autopilot(recipe)
    check_init_from(recipe.train)
    check_train_data(recipe.train)
    check_model(model, _model_field(recipe))
    check_cuda_graph_layers(recipe, model)
    lay, facts = Layout.of(recipe), ModelFacts.of(model)
    b = first_broken(lay, facts)
    if b is not None:
        raise TesseraConfigError(b.field, b.value, b.rule, fix_for(b, lay, facts))
    check_slowdown(recipe)


def check_slowdown(recipe) -> None:
    """``planner.rank_slowdown`` has ``parallel.pp`` factors and ``planner.ep_slowdown``
    ``parallel.ep`` (or none), each finite and > 0 (docs/recipes.md, ``planner``).

    Raises:
        TesseraConfigError: a wrong count or a bad factor, naming the field and a fix.
    """
    p, pl = recipe.parallel, recipe.planner
    for field, value, n, what in (("planner.rank_slowdown", pl.rank_slowdown, p.pp, "pp"),
                                  ("planner.ep_slowdown", pl.ep_slowdown, p.ep, "ep")):
        got = list(value)
        if got and len(got) != n:
            raise TesseraConfigError(field, got, f"must have one factor per rank, parallel.{what}={n}, or none "
                                                 f"(all 1.0); it has {len(got)}",
                                     f"give {n} factors, e.g. {field}=[{','.join(['1.0'] * n)}], or {field}=[]")
        bad = [i for i, f in enumerate(got) if not 0 < f < math.inf]
        if bad:
            raise TesseraConfigError(field, got, f"every factor must be a finite number > 0 (rank {bad[0]}: "
                                                 f"{got[bad[0]]!r})",
                                     "use e.g. 1.3 for a rank whose compute runs 30% slower than modelled, 1.0 "
                                     "for one at the modelled speed")


def layout_options(recipe, model) -> tuple:
    """The concrete recipes of ``recipe`` that pass every value rule (:mod:`tessera.config.auto`'s
    docstring); ``(recipe,)`` when nothing is auto.

    Raises:
        TesseraConfigError: no option passes the value rules (the first option's error, its rule
            prefixed with the auto field), or the auto fields allow no layout at all.
    """
    if not is_auto(recipe):
        return (recipe,)
    pairs = candidate_layouts(recipe, model.num_layers)
    if not pairs:
        raise TesseraConfigError("planner.template", recipe.planner.template,
                                 f"no template runs parallel.vpp={recipe.parallel.vpp} chunks per rank",
                                 "set parallel.vpp=auto or a template that runs that vpp")
    options, first = [], None
    for name, v, ov, sw in ((n, v, o, w) for n, v in pairs for o, w in mode_choices(recipe, n)):
        option = recipe.with_overrides([f"planner.template={name}", f"parallel.vpp={v}",
                                        f"planner.overlap={str(ov).lower()}", f"planner.split_w={str(sw).lower()}"])
        try:
            validate_recipe(option, model)
        except TesseraConfigError as e:
            first = first or e
            continue
        options.append(option)
    if not options:
        layout = recipe.planner.template == AUTO or recipe.parallel.vpp == AUTO
        if not layout:  # only overlap / split_w are auto: the rule is about the recipe itself
            raise first
        raise TesseraConfigError(first.field, first.value, f"no layout of the auto template/vpp passes: {first.rule}",
                                 first.fix)
    return tuple(options)


def validate_memory(recipe, hw: HardwareSpec, programs: Sequence[Program], costs: ModelCosts) -> tuple[float, ...]:
    """Check that every rank's peak memory fits ``hw.mem_gb * (1 - planner.memory_margin)``.

    Returns:
        Per-rank peak memory, GB.

    Raises:
        TesseraConfigError: "rank r needs X GB, capacity Y GB (hw)" for the worst rank, with fixes.
    """
    need = tuple(b / 1e9 for b in rank_memory_bytes(programs, costs))
    cap = capacity_gb(recipe, hw)
    worst = max(range(len(need)), key=lambda r: need[r], default=None)
    if worst is not None and need[worst] > cap:
        raise TesseraConfigError(
            "parallel.pp", recipe.parallel.pp,
            f"rank {worst} needs {need[worst]:.1f} GB, capacity {cap:.1f} GB ({capacity_note(recipe, hw)})",
            memory_fixes(recipe))
    return need


def capacity_gb(recipe, hw: HardwareSpec) -> float:
    """Usable memory per device, GB: ``hw.mem_gb * (1 - planner.memory_margin)``."""
    return hw.mem_gb * (1.0 - recipe.planner.memory_margin)


def capacity_note(recipe, hw: HardwareSpec) -> str:
    """Where :func:`capacity_gb` comes from, for error messages, e.g. ``h800: 80 GB less
    planner.memory_margin=0.05``."""
    return f"{hw.name}: {hw.mem_gb:g} GB less planner.memory_margin={recipe.planner.memory_margin:g}"


def memory_fixes(recipe, planner: bool = False) -> str:
    """The overrides that lower a rank's memory, as one phrase for a ``TesseraConfigError`` fix
    (``planner``: also a wider candidate radius, for the planner's memory errors)."""
    p = recipe.parallel
    mode = CostOptions.recompute_mode(recipe.planner.activation_recompute)
    fixes = []  # the cheapest first: selective recompute costs the least time, full recompute more
    if mode == "none":
        # core_attn (the default module) saves little under FlashAttention; these save the most
        fixes.append("set planner.activation_recompute=selective with planner.recompute_modules=[moe_act,layernorm] "
                     "or =full (cheaper in time first)")
    elif mode == "selective":
        fixes.append("set planner.activation_recompute=full")
    if p.dp_shard != "fsdp" and p.dp > 1:
        fixes.append("set parallel.dp_shard=fsdp (shards parameters and gradients too)")
    fixes += [f"raise parallel.pp (now {p.pp})", f"raise parallel.ep (now {p.ep})",
              f"raise parallel.dp (now {p.dp}; shards optimizer state)"]
    if planner and recipe.planner.candidate_radius < CANDIDATE_RADIUS.value:
        fixes.append(f"widen planner.candidate_radius (now {recipe.planner.candidate_radius}) up to "
                     f"{CANDIDATE_RADIUS.value}")
    fixes.append(f"lower the in-flight microbatches (parallel.num_microbatches={p.num_microbatches}, "
                 f"parallel.micro_batch_size={p.micro_batch_size}, parallel.seq_length={p.seq_length})")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]
