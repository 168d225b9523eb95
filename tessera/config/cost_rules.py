"""Rules of the recipe fields that say what the cost model assumes: ``planner.activation_recompute``
and ``recompute_modules``, ``parallel.moe_dispatcher``, ``dp_shard`` and ``rank_order``, ``train.precision``,
``master_weights`` and ``fp8_recipe``, ``model.moe_routing`` and ``moe_max_over_mean``, ``train.cuda_graphs``
(``docs/recipes.md``), :func:`check_cuda_graph_layers` (the scopes against the model's layers),
:func:`cost_options`, the recipe's :class:`~tessera.cost.types.CostOptions`, and
:func:`cost_settings`, what ``tessera simulate`` and ``tessera plan`` show of them.

Each broken rule raises one :class:`~tessera.errors.TesseraConfigError` naming the field, the
value, the rule and the fix.
"""

from __future__ import annotations

import math

from tessera.cost.routing import ROUTINGS, load_factor
from tessera.cost.types import (CUDA_GRAPH_SCOPES, DISPATCHERS, DP_SHARDS, FP8_RECIPES, PRECISIONS,
                                RECOMPUTE_MODES, RECOMPUTE_MODULES, CostOptions)
from tessera.config.auto import AUTO, resolve_precision
from tessera.config.resolve import model_source
from tessera.config.suggest import one_of
from tessera.errors import TesseraConfigError
from tessera.spec.model import DenseMLPSpec, Mamba2Spec, MoESpec
from tessera.spec.placement import RANK_ORDERS

DEFAULT_FP8_RECIPE = FP8_RECIPES[0]
"""``train.fp8_recipe``'s default (``tensorwise``), the only value accepted without ``precision=fp8``."""


def cuda_graph_scopes(recipe) -> tuple[str, ...]:
    """``train.cuda_graphs`` as a tuple of scopes: ``none`` (or null, or an empty list) is ``()``,
    one scope name a 1-tuple, a list the tuple of its names (repeats dropped)."""
    v = recipe.train.cuda_graphs
    if v is None or v == "none":
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(dict.fromkeys(str(x) for x in v))


def check_cuda_graphs(recipe) -> None:
    """Rules of ``train.cuda_graphs`` (Megatron-Core ``docs/user-guide/features/cuda_graph.md``).

    Raises:
        TesseraConfigError: a value that is not ``none``, a scope name or a list of them; several
            scopes in one string (``attn,moe_router``: the fix is the list form); an unknown scope;
            a scope named twice; ``full_iteration`` with other scopes (it captures everything);
            ``moe_preprocess`` without ``moe_router`` (Megatron-Core pairs them); ``moe`` unless
            ``model.moe_routing=forced`` (a whole MoE layer is capturable only with drop-and-pad
            routing: static shapes, no host synchronisation); any scope on the ``cpu`` preset.
            Scopes the model has no layer for: :func:`check_cuda_graph_layers`.
    """
    v = recipe.train.cuda_graphs
    names = ", ".join(CUDA_GRAPH_SCOPES)
    if not (v is None or isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))):
        raise TesseraConfigError("train.cuda_graphs", v, "must be none or a list of CUDA graph scopes",
                                 f"write e.g. train.cuda_graphs=[attn,moe_router,moe_preprocess] (scopes: {names})")
    if isinstance(v, str) and v not in CUDA_GRAPH_SCOPES and len(v.replace(",", " ").split()) > 1:
        parts = v.replace(",", " ").split()
        raise TesseraConfigError("train.cuda_graphs", v, "is one string, not a list of CUDA graph scopes",
                                 f"write the list form, train.cuda_graphs=[{','.join(parts)}]")
    if isinstance(v, (list, tuple)):
        twice = [x for i, x in enumerate(v) if x in v[:i]]
        if twice:
            raise TesseraConfigError("train.cuda_graphs", list(v), f"names the scope {twice[0]!r} twice",
                                     f"write each scope once, train.cuda_graphs=[{','.join(dict.fromkeys(v))}]")
    scopes = cuda_graph_scopes(recipe)
    for x in scopes:
        one_of("train.cuda_graphs", x, CUDA_GRAPH_SCOPES, "names an unknown CUDA graph scope")
    if "full_iteration" in scopes and len(scopes) > 1:
        raise TesseraConfigError("train.cuda_graphs", list(scopes), "full_iteration captures the whole iteration, "
                                 "so it takes no other scope", "write train.cuda_graphs=[full_iteration] alone")
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        raise TesseraConfigError("train.cuda_graphs", list(scopes), "moe_preprocess is captured with moe_router "
                                 "(Megatron-Core pairs them)", "add moe_router to train.cuda_graphs")
    if "moe" in scopes and recipe.model.moe_routing != "forced":
        raise TesseraConfigError("train.cuda_graphs", list(scopes), "a whole MoE layer is capturable only with "
                                 f"drop-and-pad routing (static shapes), not model.moe_routing={recipe.model.moe_routing}",
                                 "set model.moe_routing=forced, or capture moe_router and moe_preprocess instead of moe")
    if scopes and recipe.hardware.preset == "cpu":
        raise TesseraConfigError("train.cuda_graphs", list(scopes), "CUDA graphs need a GPU; the cpu preset's host "
                                 "time is its compute", "write train.cuda_graphs=none")


_SCOPE_LAYERS = (
    ("attn", "attention, MLA or Gated DeltaNet mixer",
     lambda layer: layer.mixer is not None and not isinstance(layer.mixer, Mamba2Spec)),
    ("mamba", "Mamba-2 mixer", lambda layer: isinstance(layer.mixer, Mamba2Spec)),
    ("mlp", "dense MLP", lambda layer: isinstance(layer.mlp, DenseMLPSpec)),
    ("moe_router", "MoE router", lambda layer: isinstance(layer.mlp, MoESpec)),
    ("moe_preprocess", "MoE token permutation", lambda layer: isinstance(layer.mlp, MoESpec)),
    ("moe", "MoE layer", lambda layer: isinstance(layer.mlp, MoESpec)),
)
"""The ``train.cuda_graphs`` scopes that capture one kind of layer part
(:func:`tessera.cost.efficiency.captured`): (scope, the part in words, whether a layer has it)."""


def check_cuda_graph_layers(recipe, model) -> None:
    """Every scope of ``train.cuda_graphs`` captures a part some layer of ``model`` (the resolved
    ModelSpec, after ``model.num_layers``) has: a scope with nothing to capture would change no
    cost (``full_iteration`` always has).

    Raises:
        TesseraConfigError: ``attn`` on a model without an attention, MLA or Gated DeltaNet
            mixer, ``mamba`` without a Mamba-2 mixer, ``mlp`` without a dense MLP layer,
            ``moe_router`` / ``moe_preprocess`` / ``moe`` without a MoE layer; naming the model
            and its source (e.g. ``preset qwen3-next-80b-a3b``).
    """
    scopes = cuda_graph_scopes(recipe)
    for scope, part, has in _SCOPE_LAYERS:
        if scope in scopes and not any(has(layer) for layer in model.layers):
            src = model_source(recipe)
            notes = ([] if src == f"preset {model.name}" else [src]) + (
                [f"its first {model.num_layers} layers"] if recipe.model.num_layers > 0 else [])
            who = (src if src == f"preset {model.name}" else model.name) + (f" ({', '.join(notes)})" if notes else "")
            kept = [x for x in scopes if x != scope]
            raise TesseraConfigError("train.cuda_graphs", list(scopes), f"{scope} captures every {part}, and model "
                                     f"{who} has none",
                                     f"drop {scope}: train.cuda_graphs=" + (f"[{','.join(kept)}]" if kept else "none"))


def check_cost_fields(recipe) -> None:
    """Check the cost-model fields of ``recipe`` (module docstring).

    Raises:
        TesseraConfigError: an unknown recompute mode (booleans are accepted), module, dispatcher,
            data-parallel sharding or precision; ``selective`` with no module named;
            ``train.master_weights=false`` with a precision that resolves to ``fp32``; a
            ``train.fp8_recipe`` other than ``tensorwise`` (the default) with a precision that does
            not resolve to ``fp8`` (it would change nothing); a broken ``train.cuda_graphs`` rule
            (:func:`check_cuda_graphs`).
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
    one_of("train.fp8_recipe", recipe.train.fp8_recipe, FP8_RECIPES, "is not an FP8 recipe (Megatron-Core "
           "--fp8-recipe names; docs/cost-model.md, \"FP8\")")
    if recipe.train.fp8_recipe != DEFAULT_FP8_RECIPE and resolve_precision(recipe) != "fp8":
        raise TesseraConfigError("train.fp8_recipe", recipe.train.fp8_recipe, "is read only under train.precision=fp8, "
                                 f"and train.precision={recipe.train.precision!r} computes in "
                                 f"{resolve_precision(recipe)}", "set train.precision=fp8 or drop train.fp8_recipe")
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
    check_cuda_graphs(recipe)
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
                       master_weights=recipe.train.master_weights, fp8_recipe=recipe.train.fp8_recipe,
                       moe_load=load_factor(recipe.model.moe_routing, recipe.model.moe_max_over_mean),
                       cuda_graphs=cuda_graph_scopes(recipe))


def cost_settings(recipe) -> dict:
    """What the cost model assumes of a recipe whose rules passed, beyond the layout, as plain
    JSON values (``tessera simulate --json``, the "cost options" rows of ``tessera simulate`` and
    ``tessera plan``): ``precision`` (resolved: ``bf16``, ``fp8`` or ``fp32``), ``fp8_recipe``
    (null unless ``precision`` is ``fp8``), ``cuda_graphs`` (the captured scopes, a list; empty:
    eager), ``moe_routing`` and ``moe_max_over_mean`` (the busiest EP rank's load over the mean
    the cost model gives every MoE layer, the routing's default filled in,
    :func:`tessera.cost.routing.load_factor`)."""
    prec = resolve_precision(recipe)
    return {"precision": prec, "fp8_recipe": recipe.train.fp8_recipe if prec == "fp8" else None,
            "cuda_graphs": list(cuda_graph_scopes(recipe)), "moe_routing": recipe.model.moe_routing,
            "moe_max_over_mean": load_factor(recipe.model.moe_routing, recipe.model.moe_max_over_mean)}
