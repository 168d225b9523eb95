"""``planner.template: auto`` and ``parallel.vpp: auto``: the concrete layouts a recipe allows.

A recipe may leave the pipeline template, the chunks per rank, or both to the planner. Its
*layout options* are the concrete recipes (``planner.template`` and ``parallel.vpp`` set) that
pass every value rule (:func:`tessera.config.validate.validate_recipe`), in registry order:

* ``planner.template: auto``: every registered template (:data:`tessera.program.templates.TEMPLATES`);
  with a numeric ``parallel.vpp``, the templates that run that many chunks per rank; with
  ``planner.split_w: false``, not the templates that need W split off (zero-bubble);
* ``parallel.vpp: auto``: a template's own chunk count where it fixes one (1f1b: 1, V-shaped: 2),
  else (interleaved) ``2 .. VPP_AUTO_MAX`` with ``pp * vpp <= num_layers`` (``vpp = 1`` is the
  plain ``1f1b`` order, listed under that template when the template is auto too).

Which option fits memory and which is fastest is the planner's question
(:func:`tessera.flow.plan_recipe` plans each and keeps the fastest simulated iteration). A
recipe whose every option breaks a rule is refused with the error of its first option.
"""

from __future__ import annotations

from tessera.errors import TesseraConfigError

AUTO = "auto"
VPP_AUTO_MAX = 4
"""Largest ``vpp`` tried for interleaved templates under ``parallel.vpp: auto`` (Megatron-LM's
published interleaved runs use 2-8; more chunks shrink the bubble but add p2p and memory)."""


def is_auto(recipe) -> bool:
    """The recipe leaves the template or vpp to the planner."""
    return recipe.planner.template == AUTO or recipe.parallel.vpp == AUTO


def check_vpp(recipe) -> None:
    """``parallel.vpp`` is an integer >= 1 or ``auto``.

    Raises:
        TesseraConfigError: any other value.
    """
    v = recipe.parallel.vpp
    if v == AUTO:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise TesseraConfigError("parallel.vpp", v, "must be an integer >= 1 or auto",
                                 "write e.g. parallel.vpp=2, or parallel.vpp=auto to let the planner choose")


def _vpp_choices(template, recipe, num_layers: int) -> tuple[int, ...]:
    v = recipe.parallel.vpp
    if v != AUTO:
        return (v,) if template.vpp in (None, v) else ()
    if template.vpp is not None:
        return (template.vpp,)
    lo = 2 if recipe.planner.template == AUTO else 1
    return tuple(k for k in range(lo, VPP_AUTO_MAX + 1) if recipe.parallel.pp * k <= num_layers)


def candidate_layouts(recipe, num_layers: int) -> tuple[tuple[str, int], ...]:
    """``(template, vpp)`` pairs the recipe's auto fields allow, before the value rules."""
    from tessera.program.templates import TEMPLATES, get_template

    names = tuple(TEMPLATES) if recipe.planner.template == AUTO else (recipe.planner.template,)
    out = []
    for name in names:
        t = TEMPLATES.get(name) or get_template(name)  # an unknown name raises the registry's error
        if recipe.planner.template == AUTO and t.requires_split_w and not recipe.planner.split_w:
            continue  # zero-bubble templates fill their bubbles with split-off W
        out += [(name, v) for v in _vpp_choices(t, recipe, num_layers)]
    return tuple(out)


def layout_options(recipe, model) -> tuple:
    """The concrete recipes of ``recipe`` (module docstring); ``(recipe,)`` when nothing is auto.

    Raises:
        TesseraConfigError: no option passes the value rules (the first option's error, its rule
            prefixed with the auto field), or the auto fields allow no layout at all.
    """
    from tessera.config.validate import validate_recipe

    if not is_auto(recipe):
        return (recipe,)
    pairs = candidate_layouts(recipe, model.num_layers)
    if not pairs:
        raise TesseraConfigError("planner.template", recipe.planner.template,
                                 f"no template runs parallel.vpp={recipe.parallel.vpp} chunks per rank",
                                 "set parallel.vpp=auto or a template that runs that vpp")
    options, first = [], None
    for name, v in pairs:
        option = recipe.with_overrides([f"planner.template={name}", f"parallel.vpp={v}"])
        try:
            validate_recipe(option, model)
        except TesseraConfigError as e:
            first = first or e
            continue
        options.append(option)
    if not options:
        raise TesseraConfigError(first.field, first.value, f"no layout of the auto template/vpp passes: {first.rule}",
                                 first.fix)
    return tuple(options)
