"""Validation of a plan upgrade before the driver accepts it (nothing of the running job changes
until every check passes).

:func:`check_upgrade` runs, in order:

1. **Format**: the plan dict parses into a :class:`~tessera.program.plan.Plan` (every field there,
   of the right type).
2. **Layout**: the same pipeline ranks (``pp``) as the job (dp and ep are the job's and not in a
   plan); the template is one the compiler knows.
3. **Layers**: the partition places the embedding, every decoder layer and the head exactly once
   (bounds strictly increasing up to L+1 here; from -1 and ``pp * vpp`` stages: the compiler's
   own partition check, its error passed on with its field).
4. **Global batch**: ``num_microbatches`` is the job's (the micro-batch size is the recipe's, so a
   different count would change the global batch; vpp and the template may change).
5. **Programs**: compiled and validated (:func:`tessera.flow.compile_programs`: matching sends and
   receives, no deadlock, every task once), slot-annotated when the bubble optimizer runs; a
   synthesized plan's own rank orders (``plan.schedule``) are checked there too, and a failure
   they cause is named ``plan.schedule``.
6. **Memory**: every rank's peak under its Program (:func:`tessera.program.memory.rank_memory_bytes`,
   the planner's own rows) fits ``hardware.mem_gb * (1 - planner.memory_margin)``.

Each failure raises :class:`~tessera.errors.UpgradeRefused` naming the field, the value, the rule
and a fix.

:func:`recipe_upgrade` checks a ``tessera upgrade --recipe`` against the running job's recipe
(the driver's: the job's YAML with its overrides and every default filled in), field by field of
:mod:`tessera.config.schema`, each field in one of three roles (:data:`FIELD_ROLES`):

* ``fixed``: the running job cannot change it and it changes a plan or what the workers run:
  ``model.*``; ``parallel.*`` but ``vpp`` (the worker group, the global batch, the sequence);
  ``train.precision``, ``train.fp8_recipe`` and ``train.master_weights`` (the cost and memory
  models and the engine's dtype); ``train.cuda_graphs`` (how the run issues its kernels, in the cost model). Any
  difference refuses the request, naming every such field with both values.
* ``replanned``: the inputs of the plan the driver makes: ``planner.*``, ``hardware.*`` (the cost
  model's device numbers), ``parallel.vpp``, ``dbo.enabled`` (the new version's bubble optimizer)
  and ``profile.cache`` (the costs under ``planner.cost_source=profile``).
* ``ignored``: fields that cannot change a plan, taken from the running job and reported "ignored
  by the upgrade (apply at the next start)": ``name``; ``train.*`` but the four above (steps,
  learning rate, weight decay, seed, data, checkpoint interval, resume, determinism,
  ``init_from``); ``logging.*`` (output directory, W&B, trace, PNG); ``job.*`` (the Ray job, run
  name, restarts, upgrade lead); ``profile.*`` but ``cache`` (a profile run's own settings);
  ``dbo.*`` but ``enabled`` (the bubble optimizer's tables are built from the job's recipe);
  ``autopilot.*`` (``tessera upgrade --autopilot on|off`` switches it live).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from tessera.errors import ProgramError, TesseraConfigError, UpgradeRefused

FIXED, REPLANNED, IGNORED = "fixed", "replanned", "ignored"

FIELD_ROLES: dict[str, str] = {
    "name": IGNORED,
    "model": FIXED,
    "parallel": FIXED, "parallel.vpp": REPLANNED,
    "hardware": REPLANNED,
    "planner": REPLANNED,
    "dbo": IGNORED, "dbo.enabled": REPLANNED,
    "profile": IGNORED, "profile.cache": REPLANNED,
    "train.steps": IGNORED, "train.lr": IGNORED, "train.weight_decay": IGNORED, "train.seed": IGNORED,
    "train.data": IGNORED, "train.data_field": IGNORED, "train.tokenizer": IGNORED, "train.data_cache": IGNORED,
    "train.checkpoint_every": IGNORED, "train.resume": IGNORED,
    "train.deterministic": IGNORED, "train.init_from": IGNORED,
    "train.precision": FIXED, "train.fp8_recipe": FIXED, "train.master_weights": FIXED,
    "train.cuda_graphs": FIXED,
    "logging": IGNORED,
    "job": IGNORED,
    "autopilot": IGNORED,
}
"""Recipe field (or whole section) -> its role in ``upgrade --recipe`` (module docstring); the
longest matching entry decides (``parallel.vpp`` before ``parallel``). ``train`` is listed field
by field, so that a new training field gets a role of its own; a field no entry matches counts as
``fixed``."""


def field_role(field: str) -> str:
    """The role of dotted recipe ``field`` (e.g. ``"hardware.inline.mem_gb"``) in :data:`FIELD_ROLES`."""
    parts = field.split(".")
    for n in range(len(parts), 0, -1):
        role = FIELD_ROLES.get(".".join(parts[:n]))
        if role is not None:
            return role
    return FIXED


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 60, 60, 6, 4


@dataclass(frozen=True)
class FieldChange:
    """One recipe field that differs: its dotted name, the running job's value and the new one
    (JSON values; a field one side does not have is None)."""

    field: str
    running: Any
    new: Any

    def describe(self) -> str:
        """``field: running=X new=Y`` (values as Python reprs, long ones shortened)."""
        return f"{self.field}: running={_SHORT.repr(self.running)} new={_SHORT.repr(self.new)}"


@dataclass(frozen=True)
class RecipeUpgrade:
    """What :func:`recipe_upgrade` makes of a new recipe.

    Attributes:
        recipe: the recipe to plan with: the running job's, with the new recipe's ``replanned``
            fields.
        replanned: the ``replanned`` fields that differ (the plan is made with the new values).
        ignored: the ``ignored`` fields that differ (the running job's values are kept).
    """

    recipe: object
    replanned: tuple[FieldChange, ...]
    ignored: tuple[FieldChange, ...]


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf paths of nested dicts (lists and other values are leaves)."""
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def recipe_changes(running, new) -> tuple[FieldChange, ...]:
    """Every leaf field where ``new`` differs from ``running`` (two Recipes, compared as their
    ``to_dict()``; a dict-valued field such as ``hardware.inline`` is compared key by key), in the
    running recipe's field order."""
    a, b = _leaves(running.to_dict()), _leaves(new.to_dict())
    rank = {k: i for i, k in enumerate(a)}
    keys = list(a) + [k for k in b if k not in a]  # a key only ``new`` has goes where its parent field is
    keys.sort(key=lambda k: next((rank[p] for p in (k, *_parents(k)) if p in rank), len(rank)))
    return tuple(FieldChange(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k))


def _parents(key: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b", "a"]``."""
    parts = key.split(".")
    return [".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)]


def recipe_upgrade(running, new) -> RecipeUpgrade:
    """Check ``new`` (a Recipe) for an upgrade of the job running ``running`` (module docstring):
    refuse ``fixed`` fields that differ, plan with the ``replanned`` ones, keep and report the
    ``ignored`` ones.

    Raises:
        UpgradeRefused: a ``fixed`` field differs (field ``recipe.<first such field>``; the rule
            lists every one as ``field: running=X new=Y``).
    """
    from tessera.config.load import SECTIONS, recipe_from_dict

    changes = recipe_changes(running, new)
    by_role: dict[str, list[FieldChange]] = {FIXED: [], REPLANNED: [], IGNORED: []}
    for c in changes:
        by_role[field_role(c.field)].append(c)
    fixed = by_role[FIXED]
    if fixed:
        keep = " ".join(f"{c.field}={c.running}" for c in fixed[:4]) + (" ..." if len(fixed) > 4 else "")
        raise UpgradeRefused(f"recipe.{fixed[0].field}", fixed[0].new,
                             "differs from the running job's, and a running job cannot change "
                             f"{'it' if len(fixed) == 1 else 'these'}: {'; '.join(c.describe() for c in fixed)}",
                             f"keep the job's values ({keep}); an upgrade may change planner.*, hardware.*, "
                             "parallel.vpp, dbo.enabled and profile.cache (the rest needs a stop and a resume)")
    merged = running.to_dict()
    fresh = new.to_dict()
    for sec in SECTIONS:
        for name in merged[sec]:
            if field_role(f"{sec}.{name}") == REPLANNED:
                merged[sec][name] = fresh[sec][name]
    return RecipeUpgrade(recipe_from_dict(merged), tuple(by_role[REPLANNED]), tuple(by_role[IGNORED]))


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that passed :func:`check_upgrade`: the Plan, its Programs (per pipeline rank) and
    every rank's peak memory, bytes."""

    plan: object
    programs: tuple
    peak_bytes: tuple[float, ...]


def _parse(plan_dict):
    from tessera.program.plan import Plan

    if not isinstance(plan_dict, dict):
        raise UpgradeRefused("plan", type(plan_dict).__name__, "must be a JSON object (Plan.to_dict form)",
                             "pass a plan.json written by `tessera plan`")
    try:
        return Plan.from_dict(plan_dict)
    except (KeyError, TypeError, ValueError) as e:
        raise UpgradeRefused("plan", "(malformed)", f"is not a plan: {type(e).__name__}: {e}",
                             "pass a plan.json written by `tessera plan`") from None


def _check_shape(recipe, plan, model_layers: int) -> None:
    from tessera.program.templates import TEMPLATES

    p = recipe.parallel
    if plan.pp != p.pp:
        raise UpgradeRefused("plan.pp", plan.pp, f"must equal the job's parallel.pp={p.pp} (the worker group is fixed)",
                             f"plan with parallel.pp={p.pp}")
    if plan.template not in TEMPLATES:
        raise UpgradeRefused("plan.template", plan.template, f"must be one of {sorted(TEMPLATES)}",
                             "plan with a known template")
    if plan.num_microbatches != p.num_microbatches:
        raise UpgradeRefused("plan.num_microbatches", plan.num_microbatches,
                             f"must equal the job's {p.num_microbatches} (parallel.micro_batch_size is the job's, so "
                             "another count changes the global batch)", f"plan with parallel.num_microbatches="
                             f"{p.num_microbatches}")
    b = plan.partition.bounds  # the count of stages and their order: the compiler's own check (check_upgrade)
    if b[-1] != model_layers + 1 or any(x >= y for x, y in zip(b, b[1:])):
        raise UpgradeRefused("plan.partition", list(b), f"must place the embedding, layers 0-{model_layers - 1} and "
                             f"the head exactly once (bounds strictly increasing from -1 to {model_layers + 1})",
                             "plan with `tessera plan` for this recipe")


def check_upgrade(recipe, plan_dict: dict, costs, dbo: bool) -> CheckedPlan:
    """Validate ``plan_dict`` for the running job of ``recipe`` (module docstring).

    Args:
        recipe: the job's Recipe; plan_dict: the new plan (``Plan.to_dict`` form).
        costs: the job's ModelCosts (memory rows, slot annotation).
        dbo: whether the bubble optimizer runs under the new version (slot-annotated Programs).

    Raises:
        UpgradeRefused: the first check that fails.
    """
    from tessera.config.resolve import resolve_hardware
    from tessera.config.validate import capacity_gb, capacity_note
    from tessera.flow import compile_programs
    from tessera.program.memory import rank_memory_bytes

    plan = _parse(plan_dict)
    _check_shape(recipe, plan, len(costs.layers))
    try:
        programs = compile_programs(plan, costs if dbo else None)
    except UpgradeRefused:
        raise
    except TesseraConfigError as e:  # the compiler's partition and template rules, with their field
        raise UpgradeRefused(e.field, e.value, e.rule, e.fix) from None
    except ProgramError as e:
        if plan.synthesized:  # a template's order lowers to valid Programs: the plan's own order broke them
            raise UpgradeRefused("plan.schedule", f"{len(plan.schedule)} rank orders",
                                 f"compiles to invalid Programs: {e}",
                                 "plan again with `tessera plan` (it writes valid rank orders)") from None
        raise UpgradeRefused("plan", plan.partition.describe(), f"compiles to invalid Programs: {e}",
                             "plan with `tessera plan` for this recipe") from None
    except (KeyError, ValueError) as e:
        raise UpgradeRefused("plan", plan.partition.describe(), f"cannot be compiled: {e}",
                             "plan with `tessera plan` for this recipe") from None
    peaks = rank_memory_bytes(programs, costs)
    hw = resolve_hardware(recipe)
    cap = capacity_gb(recipe, hw) * 1e9
    worst = max(range(len(peaks)), key=lambda r: peaks[r])
    if peaks[worst] > cap:
        raise UpgradeRefused("plan.partition", plan.partition.describe(),
                             f"needs {peaks[worst] / 1e9:.3f} GB on pipeline rank {worst}, over the capacity "
                             f"{cap / 1e9:.3f} GB ({capacity_note(recipe, hw)})",
                             "move layers off that rank, or plan with `tessera plan` (it keeps memory rows)")
    return CheckedPlan(plan, programs, tuple(peaks))
