"""Rules of the recipe fields that say what the cost model assumes: ``planner.activation_recompute``
and ``recompute_modules``, ``parallel.moe_dispatcher``, ``dp_shard`` and ``rank_order``, ``train.precision``
and ``master_weights``, ``model.moe_routing`` and ``moe_max_over_mean`` (``docs/recipes.md``), and
:func:`cost_options`, the recipe's :class:`~tessera.cost.types.CostOptions`.

Each broken rule raises one :class:`~tessera.errors.TesseraConfigError` naming the field, the
value, the rule and the fix.
"""

from __future__ import annotations

import math

from tessera.cost.routing import ROUTINGS, load_factor
from tessera.cost.types import (DISPATCHERS, DP_SHARDS, PRECISIONS, RECOMPUTE_MODES, RECOMPUTE_MODULES,
                                CostOptions)
from tessera.config.auto import AUTO, resolve_precision
from tessera.config.suggest import one_of
from tessera.errors import TesseraConfigError
from tessera.spec.placement import RANK_ORDERS


def check_cost_fields(recipe) -> None:
    """Check the cost-model fields of ``recipe`` (module docstring).

    Raises:
        TesseraConfigError: an unknown recompute mode (booleans are accepted), module, dispatcher,
            data-parallel sharding or precision; ``selective`` with no module named;
            ``train.master_weights=false`` with a precision that resolves to ``fp32``.
    """
    pl, p = recipe.planner, recipe.parallel
    mode = pl.activation_recompute
    if not isinstance(mode, bool):
        one_of("planner.activation_recompute", mode, RECOMPUTE_MODES,
                "is not a recompute mode (true and false mean full and none)")
    mods = pl.recompute_modules
    if not isinstance(mods, (list, tuple)):
        raise TesseraConfigError("planner.recompute_modules", mods, "must be a list of module names",
                                 f"write e.g. planner.recompute_modules=[core_attn,moe_act] (names: "
                                 f"{', '.join(RECOMPUTE_MODULES)})")
    for m in mods:
        one_of("planner.recompute_modules", m, RECOMPUTE_MODULES, "names an unknown module")
    if CostOptions.recompute_mode(mode) == "selective" and not mods:
        raise TesseraConfigError("planner.recompute_modules", list(mods), "selective recompute needs at least one module",
                                 "name the modules, e.g. planner.recompute_modules=[core_attn], or use "
                                 "planner.activation_recompute=none")
    one_of("parallel.moe_dispatcher", p.moe_dispatcher, DISPATCHERS, "is not a known MoE dispatcher")
    one_of("parallel.dp_shard", p.dp_shard, DP_SHARDS, "is not a known data-parallel sharding")
    one_of("parallel.rank_order", p.rank_order, ("auto",) + RANK_ORDERS,
           "is not a rank order (which ranks share a node; docs/running.md, \"Multi-node: where the ranks go\")")
    one_of("train.precision", recipe.train.precision, (AUTO,) + PRECISIONS, "is not a compute precision")
    if not isinstance(recipe.train.master_weights, bool):
        raise TesseraConfigError("train.master_weights", recipe.train.master_weights, "must be true or false",
                                 "write train.master_weights=true (FP32 master weights and Adam state) or false "
                                 "(pure BF16)")
    one_of("model.moe_routing", recipe.model.moe_routing, ROUTINGS, "is not a MoE routing (docs/cost-model.md, "
           "\"Routing imbalance\")")
    mom = recipe.model.moe_max_over_mean
    if mom is not None:
        if recipe.model.moe_routing == "balanced":
            raise TesseraConfigError("model.moe_max_over_mean", mom, "is set with model.moe_routing=balanced "
                                     "(the busiest EP rank is the mean one)",
                                     "set model.moe_routing=dropless (or forced), or drop model.moe_max_over_mean")
        if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 1.0 <= mom < math.inf:
            raise TesseraConfigError("model.moe_max_over_mean", mom, "must be a finite number >= 1 (the busiest EP "
                                     "rank's tokens over the mean rank's)",
                                     "use e.g. model.moe_max_over_mean=1.3, or null for the routing's default")
    if recipe.train.master_weights is False and resolve_precision(recipe) == "fp32":
        prec = recipe.train.precision
        raise TesseraConfigError("train.master_weights", False, "pure BF16 state needs a BF16 compute precision, "
                                 f"train.precision={prec!r}" + (" is fp32 on the cpu preset" if prec == AUTO else ""),
                                 "set train.precision=bf16, or train.master_weights=true")


def cost_options(recipe) -> CostOptions:
    """The :class:`~tessera.cost.types.CostOptions` of a recipe whose rules passed."""
    pl, p = recipe.planner, recipe.parallel
    return CostOptions(recompute=CostOptions.recompute_mode(pl.activation_recompute),
                       recompute_modules=tuple(pl.recompute_modules), moe_dispatcher=p.moe_dispatcher,
                       dp_shard=p.dp_shard, precision=resolve_precision(recipe),
                       master_weights=recipe.train.master_weights,
                       moe_load=load_factor(recipe.model.moe_routing, recipe.model.moe_max_over_mean))
