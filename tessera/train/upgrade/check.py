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
   receives, no deadlock, every task once), slot-annotated when the bubble optimizer runs.
6. **Memory**: every rank's peak under its Program (:func:`tessera.program.memory.rank_memory_bytes`,
   the planner's own rows) fits ``hardware.mem_gb * (1 - planner.memory_margin)``.

Each failure raises :class:`~tessera.errors.UpgradeRefused` naming the field, the value, the rule
and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ProgramError, TesseraConfigError, UpgradeRefused


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
