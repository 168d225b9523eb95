"""Value rules of a recipe, checked before any planning, and the per-rank memory rule, checked once
the baseline plan's Programs exist.

Every broken rule raises one :class:`~tessera.errors.TesseraConfigError` whose one-line message
names the field, the value, the rule (with the numbers involved) and a fix; the CLI prints it and
exits with code 2. Rules (see ``docs/recipes.md``):

* sizes: ``parallel.*`` >= 1, ``model.num_layers`` >= 0, planner/dbo/train knobs in range;
* ``planner.template`` is a known template, ``planner.cost_source`` a known cost source;
* ``pp * vpp <= num_layers`` (each virtual stage holds at least one decoder layer; layers need not
  split evenly: 30 layers on pp=4 is fine and places each layer exactly once);
* ``ep`` divides the number of routed experts and ``dp * tp`` (EP is carved from the data- and
  tensor-parallel ranks as in Megatron-Core); ``ep > 1`` needs a MoE model;
* the template's own shape rules (e.g. interleaved 1F1B needs ``num_microbatches >= pp``):
  delegated to :func:`tessera.program.templates.check_shape`;
* memory: every rank's peak memory under the baseline Programs fits the device
  (:func:`validate_memory`).
"""

from __future__ import annotations

from typing import Sequence

from tessera.cost.types import ModelCosts
from tessera.errors import TesseraConfigError
from tessera.program.instructions import Op, Program
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import ModelSpec

COST_SOURCES = ("analytic",)
"""Cost sources implemented so far (``planner.cost_source``)."""


def _divisors(n: int, limit: int = 8) -> str:
    """``"1, 2, 4, 8, ..."``: the first ``limit`` divisors of ``n``."""
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:limit])) + (", ..." if len(ds) > limit else "")


def _check_sizes(recipe) -> None:
    p = recipe.parallel
    for name in ("pp", "vpp", "ep", "tp", "dp", "num_microbatches", "micro_batch_size", "seq_length"):
        v = getattr(p, name)
        if v <= 0:
            raise TesseraConfigError(f"parallel.{name}", v, "must be >= 1", f"set parallel.{name} to a positive integer")
    pl, dbo, tr = recipe.planner, recipe.dbo, recipe.train
    checks = (
        ("planner.candidate_radius", pl.candidate_radius, pl.candidate_radius >= 0, "must be >= 0", "use 0..4"),
        ("planner.time_limit_s", pl.time_limit_s, pl.time_limit_s > 0, "must be > 0", "use e.g. 60"),
        ("planner.memory_margin", pl.memory_margin, 0 <= pl.memory_margin < 1, "must be in [0, 1)", "use e.g. 0.05"),
        ("dbo.pool_mem_gb", dbo.pool_mem_gb, dbo.pool_mem_gb >= 0, "must be >= 0", "use e.g. 4.0"),
        ("dbo.margin", dbo.margin, dbo.margin >= 0, "must be >= 0", "use e.g. 0.1"),
        ("train.steps", tr.steps, tr.steps >= 0, "must be >= 0", "use e.g. 50"),
        ("train.lr", tr.lr, tr.lr > 0, "must be > 0", "use e.g. 3e-3"),
        ("train.checkpoint_every", tr.checkpoint_every, tr.checkpoint_every >= 0, "must be >= 0",
         "use 0 (never) or a step count"),
        ("model.num_layers", recipe.model.num_layers, recipe.model.num_layers >= 0, "must be >= 0",
         "use 0 for all layers or a positive count"),
    )
    for field, value, ok, rule, fix in checks:
        if not ok:
            raise TesseraConfigError(field, value, rule, fix)


def _check_planner(recipe) -> None:
    from tessera.program.templates import TEMPLATES

    t = recipe.planner.template
    if t not in TEMPLATES:
        raise TesseraConfigError("planner.template", t, "unknown template", "use one of: " + ", ".join(TEMPLATES))
    cs = recipe.planner.cost_source
    if cs not in COST_SOURCES:
        raise TesseraConfigError("planner.cost_source", cs, "unknown or not yet implemented cost source",
                                 "use one of: " + ", ".join(COST_SOURCES))


def _check_layout(recipe, model: ModelSpec) -> None:
    p = recipe.parallel
    n = model.num_layers
    stages = p.pp * p.vpp
    if stages > n:
        field, value = ("parallel.vpp", p.vpp) if p.vpp > 1 else ("parallel.pp", p.pp)
        raise TesseraConfigError(
            field, value,
            f"pp*vpp = {p.pp}*{p.vpp} = {stages} virtual stages exceed the {n} layers of {model.name} "
            f"(each stage needs at least one layer)",
            f"use pp*vpp <= {n}" + (f", e.g. vpp={max(1, n // p.pp)}" if p.vpp > 1 and n >= p.pp else
                                    f", e.g. pp={n}" if p.pp > n else ""))
    moe = model.moe
    if moe is None:
        if p.ep > 1:
            raise TesseraConfigError("parallel.ep", p.ep, f"{model.name} has no MoE layers to shard over experts",
                                     "use ep=1")
        return
    e = moe.num_experts
    if e % p.ep:
        raise TesseraConfigError("parallel.ep", p.ep, f"must divide the {e} experts of {model.name}",
                                 f"use ep={_divisors(e)}")
    if (p.dp * p.tp) % p.ep:
        raise TesseraConfigError(
            "parallel.ep", p.ep,
            f"must divide dp*tp = {p.dp}*{p.tp} = {p.dp * p.tp} (expert-parallel groups are carved from the "
            f"data- and tensor-parallel ranks, as in Megatron-Core)",
            f"set parallel.dp to a multiple of {p.ep} (e.g. dp={p.ep}) or use ep={_divisors(p.dp * p.tp)}")


def validate_recipe(recipe, model: ModelSpec) -> None:
    """Check every value rule of ``recipe`` for ``model`` (the resolved ModelSpec).

    Args:
        recipe: a :class:`tessera.config.load.Recipe`.
        model: the recipe's model after ``model.num_layers`` truncation.

    Raises:
        TesseraConfigError: the first broken rule, as one line naming field, value, rule and fix.
    """
    from tessera.program.templates import check_shape

    _check_sizes(recipe)
    _check_planner(recipe)
    _check_layout(recipe, model)
    p = recipe.parallel
    check_shape(recipe.planner.template, p.pp, p.vpp, p.num_microbatches, model.num_layers)


def rank_memory_bytes(programs: Sequence[Program], costs: ModelCosts) -> tuple[float, ...]:
    """Peak memory of each rank under its Program, bytes.

    Static memory (parameters, gradients, optimizer state) of every extended layer on the rank
    plus the peak of live activations, with the simulator's accounting
    (:mod:`tessera.sim.simulator`): ``F`` allocates the chunk's activation at its start, ``B``
    frees ``activation - w_activation`` at its end (everything with ``with_w``), ``W`` frees
    ``w_activation``; ``FB`` does both. The peak is taken at every instruction boundary, so a
    backward that keeps more for its deferred W than it frees (``w_activation > activation`` under
    activation recompute) counts too. The order of a rank's instructions fixes the peak, so no
    timing is needed.
    """
    out = []
    for prog in programs:
        chunk_mem = {}
        static = 0.0
        for st in prog.stages:
            mems = [costs.layer(i).memory for i in range(st.start, st.stop)]
            chunk_mem[st.chunk] = (sum(m.activation for m in mems), sum(m.w_activation for m in mems))
            static += sum(m.static for m in mems)
        cur = peak = 0.0
        for ins in prog.instructions:
            if ins.op in (Op.F, Op.FB):
                cur += chunk_mem[ins.chunk][0]  # allocated at the instruction's start
                peak = max(peak, cur)
            if ins.op in (Op.B, Op.FB):
                act, w = chunk_mem[ins.chunk if ins.op == Op.B else ins.chunk2]
                cur -= act if ins.with_w else act - w  # negative when recompute keeps more for W
            elif ins.op == Op.W:
                cur -= chunk_mem[ins.chunk][1]
            peak = max(peak, cur)
        out.append(static + peak)
    return tuple(out)


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
    fixes = [f"raise parallel.pp (now {p.pp})", f"raise parallel.ep (now {p.ep})",
             f"raise parallel.dp (now {p.dp}; shards optimizer state)"]
    if not recipe.planner.activation_recompute:
        fixes.append("set planner.activation_recompute=true")
    if planner:
        fixes.append(f"widen planner.candidate_radius (now {recipe.planner.candidate_radius})")
    fixes.append(f"lower the in-flight microbatches (parallel.num_microbatches={p.num_microbatches}, "
                 f"parallel.micro_batch_size={p.micro_batch_size}, parallel.seq_length={p.seq_length})")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]
