"""The rules of a parallel layout (``parallel.*`` and ``planner.template``) for one model.

:func:`first_broken` returns the first broken rule as a :class:`Broken` (field, value, rule text,
kind) without building any fix, so that :mod:`tessera.config.suggest` can test candidate fixes
against exactly these rules. Every rule takes constant time. In order:

1. sizes: every ``parallel.*`` value >= 1 and <= its limit (:mod:`tessera.config.limits`);
2. ``planner.template`` is a known template;
3. ``pp*vpp <= num_layers`` (each virtual stage holds at least one decoder layer);
4. work: ``num_layers*num_microbatches``, ``micro_batch_size*seq_length`` and ``pp*dp*tp``
   within their limits;
5. ``ep``: 1 for a model without MoE layers, else it divides the routed experts and ``dp*tp``
   (EP is carved from the data- and tensor-parallel ranks, as in Megatron-Core);
6. ``tp`` divides every dim the cost model splits over tp
   (:func:`tessera.config.model_checks.tp_split_dims`) and ``seq_length`` (sequence parallelism);
7. the template's shape rules (:func:`tessera.program.templates.check_shape`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from tessera.config.limits import GPUS, LAYER_MICROBATCHES, PARALLEL, TOKENS_PER_MICROBATCH
from tessera.config.model_checks import tp_split_dims
from tessera.errors import TesseraConfigError
from tessera.spec.model import ModelSpec


@dataclass(frozen=True)
class Layout:
    """The values the layout rules read: ``recipe.parallel`` fields and ``planner.template``."""

    pp: int
    vpp: int
    ep: int
    tp: int
    dp: int
    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    template: str

    @staticmethod
    def of(recipe) -> "Layout":
        """The layout of a :class:`~tessera.config.load.Recipe`."""
        p = recipe.parallel
        return Layout(p.pp, p.vpp, p.ep, p.tp, p.dp, p.num_microbatches, p.micro_batch_size, p.seq_length,
                      recipe.planner.template)


@dataclass(frozen=True)
class ModelFacts:
    """What the layout rules need of a model, computed once: name, layer count, routed experts
    (0: no MoE) and the dims split over tp with their gcd."""

    name: str
    num_layers: int
    num_experts: int
    tp_dims: tuple[tuple[str, int], ...]
    tp_gcd: int

    @staticmethod
    def of(model: ModelSpec) -> "ModelFacts":
        """Facts of a model that passed :func:`tessera.config.model_checks.check_model`."""
        dims = tp_split_dims(model)
        moe = model.moe
        return ModelFacts(model.name, model.num_layers, moe.num_experts if moe is not None else 0, dims,
                          reduce(math.gcd, (v for _, v in dims), 0))


@dataclass(frozen=True)
class Broken:
    """A broken rule: ``field`` (dotted), its ``value``, the ``rule`` text and the rule's ``kind``
    (which fixes :mod:`tessera.config.suggest` tries)."""

    field: str
    value: object
    rule: str
    kind: str


def _sizes(lay: Layout) -> Broken | None:
    for name, lim in PARALLEL.items():
        v = getattr(lay, name)
        if v < 1:
            return Broken(f"parallel.{name}", v, "must be >= 1", "size")
        if v > lim.value:
            return Broken(f"parallel.{name}", v, f"must be <= {lim.value} ({lim.reason})", "size")
    return None


def _stages(lay: Layout, m: ModelFacts) -> Broken | None:
    n, s = m.num_layers, lay.pp * lay.vpp
    if s <= n:
        return None
    blame_pp = lay.pp > n or lay.vpp == 1
    return Broken("parallel.pp" if blame_pp else "parallel.vpp", lay.pp if blame_pp else lay.vpp,
                  f"pp*vpp = {lay.pp}*{lay.vpp} = {s} virtual stages exceed the {n} layers of {m.name} "
                  f"(each stage needs at least one layer)", "stages")


def _work(lay: Layout, m: ModelFacts) -> Broken | None:
    n, mb = m.num_layers, lay.num_microbatches
    if n * mb > LAYER_MICROBATCHES.value:
        return Broken("parallel.num_microbatches", mb, f"num_layers*num_microbatches = {n}*{mb} = {n * mb} exceeds "
                      f"{LAYER_MICROBATCHES.value} ({LAYER_MICROBATCHES.reason})", "size")
    t = lay.micro_batch_size * lay.seq_length
    if t > TOKENS_PER_MICROBATCH.value:
        return Broken("parallel.micro_batch_size", lay.micro_batch_size,
                      f"micro_batch_size*seq_length = {lay.micro_batch_size}*{lay.seq_length} = {t} tokens per "
                      f"microbatch exceed {TOKENS_PER_MICROBATCH.value} ({TOKENS_PER_MICROBATCH.reason})", "tokens")
    g = lay.pp * lay.dp * lay.tp
    if g > GPUS.value:
        return Broken("parallel.dp", lay.dp, f"pp*dp*tp = {lay.pp}*{lay.dp}*{lay.tp} = {g} GPUs exceed {GPUS.value} "
                      f"({GPUS.reason})", "size")
    return None


def _ep(lay: Layout, m: ModelFacts) -> Broken | None:
    ep, e = lay.ep, m.num_experts
    if e == 0:
        return Broken("parallel.ep", ep, f"{m.name} has no MoE layers to shard over experts", "ep") if ep > 1 else None
    if e % ep:
        return Broken("parallel.ep", ep, f"must divide the {e} experts of {m.name}", "ep")
    if (lay.dp * lay.tp) % ep:
        return Broken("parallel.ep", ep, f"must divide dp*tp = {lay.dp}*{lay.tp} = {lay.dp * lay.tp} (expert-parallel "
                      f"groups are carved from the data- and tensor-parallel ranks, as in Megatron-Core)", "ep_dp")
    return None


def _tp(lay: Layout, m: ModelFacts) -> Broken | None:
    tp = lay.tp
    bad = [f"{v} {what}" for what, v in m.tp_dims if v % tp]
    if bad:
        also = f", and also the {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''}" if len(bad) > 1 else ""
        return Broken("parallel.tp", tp, f"must divide the {bad[0]} of {m.name}{also} (the cost model splits "
                      f"heads, shared-expert and dense FFN widths and the vocabulary over the tp ranks)", "tp")
    if lay.seq_length % tp:
        return Broken("parallel.tp", tp, f"must divide parallel.seq_length={lay.seq_length} (sequence parallelism "
                      f"splits each sequence over the tp ranks)", "tp")
    return None


def _shape(lay: Layout, m: ModelFacts) -> Broken | None:
    from tessera.program.templates import check_shape

    try:
        check_shape(lay.template, lay.pp, lay.vpp, lay.num_microbatches, m.num_layers)
    except TesseraConfigError as e:
        return Broken(e.field, e.value, e.rule, "shape")
    return None


def first_broken(lay: Layout, m: ModelFacts) -> Broken | None:
    """The first broken layout rule (module docstring), or None when the layout is valid."""
    from tessera.program.templates import TEMPLATES

    b = _sizes(lay)
    if b is None and lay.template not in TEMPLATES:
        b = Broken("planner.template", lay.template, f"unknown template (known: {', '.join(TEMPLATES)})", "template")
    for rule in (_stages, _work, _ep, _tp, _shape):
        if b is not None:
            return b
        b = rule(lay, m)
    return b
