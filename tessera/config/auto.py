"""``planner.template``, ``parallel.vpp``, ``planner.overlap``, ``planner.split_w: auto``: the
concrete layouts a recipe allows.

A recipe may leave the pipeline template, the chunks per rank, whether F&B pairs overlap and
whether W is split off (or any of them) to the planner. Its *layout options* are the concrete
recipes (those fields set) that pass every value rule, in registry order
(:func:`tessera.config.validate.layout_options`; this module lists the candidates, below the
value rules that check them):

* ``planner.template: auto``: every registered template (:data:`tessera.program.templates.TEMPLATES`);
  with a numeric ``parallel.vpp``, the templates that run that many chunks per rank; with
  ``planner.split_w: false``, not the templates that need W split off (zero-bubble);
* ``parallel.vpp: auto``: a template's own chunk count where it fixes one (1f1b: 1, V-shaped: 2),
  else (interleaved) ``2 .. VPP_AUTO_MAX`` with ``pp * vpp <= num_layers`` (``vpp = 1`` is the
  plain ``1f1b`` order, listed under that template when the template is auto too);
* ``planner.overlap: auto`` / ``planner.split_w: auto`` (issue #13 part 3: overlap and split W
  only where they pay): each layout above with ``false`` and with ``true`` (``false`` first, so a
  tie goes to the cheaper engine path: one autograd segment per chunk run, no deferred W to
  record); ``split_w: false`` is not offered to a template that needs W
  split off nor with ``dbo.enabled`` (the bubble optimizer fills slots with deferred W), and ``overlap: false`` not to one that does not overlap F&B (it would be the same
  Programs).

Which option fits memory and which is fastest is the planner's question
(:func:`tessera.flow.plan_recipe` plans each and keeps the fastest simulated iteration, so the
choice is never slower than the fixed one it replaces). A recipe whose every option breaks a rule
is refused with the error of its first option.
"""

from __future__ import annotations

from tessera.errors import TesseraConfigError

AUTO = "auto"
VPP_AUTO_MAX = 4
"""Largest ``vpp`` tried for interleaved templates under ``parallel.vpp: auto`` (Megatron-LM's
published interleaved runs use 2-8; more chunks shrink the bubble but add p2p and memory)."""


def resolve_precision(recipe) -> str:
    """``train.precision`` as the cost model and the engine use it: the recipe's value, or for
    ``auto`` ``fp32`` on the ``cpu`` hardware preset (the engine runs on the CPU there, where
    FP32 is the native matmul dtype) and ``bf16`` on a GPU preset. The field is checked by
    :func:`tessera.config.cost_rules.check_cost_fields`."""
    p = recipe.train.precision
    if p != AUTO:
        return p
    return "fp32" if recipe.hardware.preset == "cpu" else "bf16"


MODE_FIELDS = ("overlap", "split_w")
"""The boolean planner fields that may be ``auto`` (``planner.<field>``)."""


def is_auto(recipe) -> bool:
    """The recipe leaves the template, vpp, overlap or split W to the planner."""
    pl = recipe.planner
    return pl.template == AUTO or recipe.parallel.vpp == AUTO or any(getattr(pl, f) == AUTO for f in MODE_FIELDS)


def check_vpp(recipe) -> None:
    """The fields that may be ``auto`` hold a value of their kind: ``parallel.vpp`` an integer
    >= 1 or ``auto``; ``planner.overlap`` and ``planner.split_w`` true, false or ``auto``.

    Raises:
        TesseraConfigError: any other value.
    """
    for f in MODE_FIELDS:
        x = getattr(recipe.planner, f)
        if x != AUTO and not isinstance(x, bool):
            raise TesseraConfigError(f"planner.{f}", x, "must be a bool (true or false) or auto",
                                     f"write planner.{f}=true, planner.{f}=false, or planner.{f}=auto to let the "
                                     "planner choose by simulated iteration time")
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
        if recipe.planner.template == AUTO and t.requires_split_w and recipe.planner.split_w is False:
            continue  # zero-bubble templates fill their bubbles with split-off W
        out += [(name, v) for v in _vpp_choices(t, recipe, num_layers)]
    return tuple(out)


def mode_choices(recipe, template: str) -> tuple[tuple[bool, bool], ...]:
    """``(overlap, split_w)`` pairs the recipe's mode fields allow for ``template`` (module
    docstring): the fixed values, or ``(False, True)`` for an ``auto`` field."""
    from tessera.program.templates import get_template

    t = get_template(template)
    pl = recipe.planner
    ov = (False, True) if pl.overlap == AUTO and t.overlaps_fb else (True,) if pl.overlap == AUTO else (pl.overlap,)
    needs_w = t.requires_split_w or recipe.dbo.enabled  # the bubble optimizer moves deferred W
    sw = (False, True) if pl.split_w == AUTO and not needs_w else (True,) if pl.split_w == AUTO \
        else (pl.split_w,)
    return tuple((o, w) for o in ov for w in sw)
