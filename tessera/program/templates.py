"""Pipeline templates: where each virtual stage lives and in which order a rank computes.

A template is pure data: :func:`compute_schedule` returns, per rank, the *compute* instructions
(``F``, ``B``, ``W``, ``FB``, plus ``register_w`` when W is split off) in execution order.
Communication is added later by the lowering pass in :mod:`tessera.program.compiler`.

Every fact of a template lives here, in one frozen :class:`Template` per template in the registry
:data:`TEMPLATES` (name -> Template; :func:`get_template` looks one up and rejects unknown names):
the chunks per rank it runs (``vpp``), its stage placement and inverse, its shape rules, its
schedule builder (the builders in :mod:`tessera.program.template_steps`, placements and shape
rules in :mod:`tessera.program.template_rules`), whether it overlaps F&B (``overlaps_fb``), whether
the backward inside its ``FB`` keeps W (``fb_keeps_w``, so W moves inside the overlapped pair)
and whether it needs W split off (``requires_split_w``). Callers ask the registry;
nothing outside this module compares template names. :func:`stage_of`, :func:`rank_chunk_of`,
:func:`check_shape`, :func:`compute_schedule` and :func:`co_executed_pairs` are lookups in it.

Templates (``pp`` ranks, ``vpp`` chunks per rank, ``M`` microbatches):

``1f1b``
    One chunk per rank (``stage == rank``). Megatron-LM's non-interleaved order: ``min(pp-rank-1, M)``
    warmup forwards, a steady state alternating one forward and one backward, a cooldown of
    backwards. ``M < pp`` is allowed (the pipeline is simply never full).
``interleaved-1f1b``
    ``vpp`` chunks per rank, ``stage = chunk * pp + rank`` (Narayanan et al. 2021). Megatron-LM's
    interleaved order: microbatches run in groups of ``pp`` per chunk (when ``pp`` does not divide
    ``M`` the last group takes the remainder, so any ``M >= pp`` works), ``(pp-rank-1)*2 +
    (vpp-1)*pp`` warmup forwards, then 1F1B over virtual microbatches; backward chunks in reverse
    chunk order. ``vpp == 1`` is ``1f1b``. See :func:`~tessera.program.template_steps._interleaved_steps`.
``dualpipe-v``
    Two chunks per rank in a V: chunk 0 is stage ``rank``, chunk 1 is stage ``2*pp-1-rank`` (the
    last stage is on rank 0). DeepSeek's DualPipeV 8-step order (``dualpipev.py``), see
    :func:`~tessera.program.template_steps._dualpipe_v_steps`.
``zb-h1``
    ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), sec. 3.1: one chunk per
    rank (``stage == rank``), 1f1b's forwards and backwards (same warmup, so 1F1B's peak
    activation memory) with every W split off and rank ``r`` running each W ``r`` backwards late;
    the ``r`` W's it holds back fill its cooldown, and the last rank's earlier last backward
    shortens the cooldown's backward chain. On uniform costs (``F``, ``B``, ``W`` per stage, no
    p2p time, ``M >= pp``) the bubble is ``(pp-1)*max(F+B-W, B)`` (the paper's ``(pp-1)(F+B-W)``;
    rank 0 cannot fill the wait for its first gradient, ``(pp-1)*B``, with W's it does not have
    yet) against 1f1b's ``(pp-1)*(F+B+W)``. Any ``M >= 1``. See
    :func:`~tessera.program.template_steps._zb_h1_steps`.
``zb-v``
    ZB-V of Qi et al. (sec. 6) with the placement of ``dualpipe-v`` (chunk 0 = stage ``rank``,
    chunk 1 = stage ``2*pp-1-rank``), in the order of torch.distributed.pipelining's
    ``ScheduleZBVZeroBubble``: ``2(pp-rank)-1`` chunk-0 warmup forwards, ``rank`` (F1, F0), then
    1F-1B-1W per chunk with W right after its backward, and a cooldown whose deferred W's fill
    the waits between backwards. Peak activation memory of 1F1B (``pp`` microbatches of a 1F1B
    stage on rank 0); on uniform costs with ``F == B == W`` per chunk the bubble is ``(pp-1)*F``
    (the last rank's wait for its first input) against interleaved-1f1b's ``2*(pp-1)*F`` with
    split W. Needs ``M >= 2*pp-1``. See :func:`~tessera.program.template_steps._zb_v_steps`.

zb-h1 and zb-v are defined by where they run the split-off W's: ``split_w=False`` is rejected
(:func:`compute_schedule` raises ``TesseraConfigError`` on ``planner.split_w``) rather than
silently running 1f1b or an unsplit V.

Overlap (``overlap=True``): in the steady state a forward and a backward of *different*
microbatches run as one ``FB`` instruction. Pairing the steady-state ``F_k`` with ``B_k`` would
deadlock (``B_k``'s gradient may need ``F_k``'s output to travel down and back), so 1f1b and
interleaved-1f1b run one more warmup forward and pair each steady-state backward with the *next*
forward, as Megatron-Core's combined 1F1B does; 1f1b (and zb-h1) also doubles its lead
(``2*(pp-rank-1)+1`` warmup forwards) or its ranks would run their ``FB`` steps one after another
(see :func:`~tessera.program.template_steps._one_f_one_b_steps`). zb-v pairs its steady-state
(F0 | B0) and (F1 | B1), which
are of different microbatches except F1/B1 on rank 0 (the last stage), left unpaired; it needs no
extra warmup. Deadlock freedom is checked by
:func:`tessera.program.validate.validate_programs` over a grid of shapes in the tests.

Split W (``split_w=True``): a backward runs with ``with_w=False`` and is followed by
``register_w`` (the W becomes movable) and, at its deadline, the ``W`` instruction. For 1f1b and
interleaved-1f1b the deadline is right after the backward in the steady state, and in the cooldown
just before the next backward (the W fills the wait for the next gradient; in the lowered Program
it sits before the next ``recv_grad``); the last W precedes ``reduce_grads``. That takes W off the
cooldown's critical path (1f1b's bubble drops from ``(pp-1)(F+B+W)`` to ``(pp-1)(F+B)`` on uniform
costs) but is not ZB-H1: zb-h1 also defers W's in the steady state (above).
For dualpipe-v W is split exactly where DualPipeV splits it (steps 3, 6, 7; FIFO order); for zb-h1
and zb-v as described in their builders.
``split_w=False``: every backward carries ``with_w=True`` and there are no ``W`` instructions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from tessera.errors import TesseraConfigError
from tessera.program.instructions import Instr, Op
from tessera.program.template_rules import (_chunk_major, _chunk_major_owner, _dualpipe_v_builder,
                                            _dualpipe_v_rules, _interleaved_rules, _one_f_one_b_builder,
                                            _one_f_one_b_rules, _v_owner, _v_placement, _zb_h1_builder, _zb_h1_rules,
                                            _zb_v_builder, _zb_v_rules)
from tessera.program.template_steps import _Step, _interleaved_steps, materialise

def stage_of(template: str, rank: int, chunk: int, pp: int, vpp: int) -> int:
    """Global virtual stage of local ``chunk`` on ``rank`` (``Template.placement``).

    1f1b, zb-h1: ``rank``; interleaved-1f1b: ``chunk * pp + rank``; dualpipe-v, zb-v: chunk 0 ->
    ``rank``, chunk 1 -> ``2*pp - 1 - rank``.
    """
    t = get_template(template)
    if not (0 <= rank < pp and 0 <= chunk < vpp):
        raise ValueError(f"rank {rank} / chunk {chunk} out of range for pp={pp}, vpp={vpp}")
    return t.placement(rank, chunk, pp)


def rank_chunk_of(template: str, stage: int, pp: int, vpp: int) -> tuple[int, int]:
    """Inverse of :func:`stage_of`: the (rank, chunk) that owns virtual ``stage`` (``Template.owner``)."""
    t = get_template(template)
    if not 0 <= stage < pp * vpp:
        raise ValueError(f"stage {stage} out of range for pp*vpp={pp * vpp}")
    return t.owner(stage, pp)


def _check_sizes(template: str, pp: int, vpp: int, num_microbatches: int) -> Template:
    """The shape rules that do not involve the model (see :func:`check_shape`); the template."""
    t = get_template(template)
    for name, v in (("parallel.pp", pp), ("parallel.vpp", vpp), ("parallel.num_microbatches", num_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise TesseraConfigError(name, v, "must be a positive integer", f"set {name} >= 1")
    t.shape_rules(pp, vpp, num_microbatches)
    return t


def check_shape(template: str, pp: int, vpp: int, num_microbatches: int, num_layers: int) -> None:
    """Reject pipeline shapes the template cannot run.

    Raises:
        TesseraConfigError: unknown template; a size <= 0; 1f1b or zb-h1 with ``vpp != 1``;
            dualpipe-v or zb-v with ``vpp != 2``; more virtual stages than layers; interleaving
            (``vpp > 1``) with ``num_microbatches < pp``; dualpipe-v with ``num_microbatches < 2*pp``;
            zb-v with ``num_microbatches < 2*pp-1``. 1f1b and zb-h1 with ``num_microbatches < pp``
            are allowed. (``split_w=False`` with zb-h1 / zb-v is rejected by :func:`compute_schedule`.)
    """
    _check_sizes(template, pp, vpp, num_microbatches)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
        raise TesseraConfigError("model.num_layers", num_layers, "must be a positive integer",
                                 "use a model with at least one decoder layer")
    if pp * vpp > num_layers:
        field, value = ("parallel.vpp", vpp) if vpp > 1 else ("parallel.pp", pp)
        raise TesseraConfigError(field, value, f"pp*vpp={pp * vpp} virtual stages need at least one layer each; "
                                 f"the model has {num_layers} layers",
                                 f"choose pp*vpp <= {num_layers}")


def compute_schedule(template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool,
                     split_w: bool) -> tuple[tuple[Instr, ...], ...]:
    """Per-rank compute instructions of ``template`` (no communication, no reduce/step).

    Args:
        template: a name in :data:`TEMPLATES`.
        pp, vpp, num_microbatches: pipeline shape (checked as in :func:`check_shape`, without
            the layer-count rule).
        overlap: emit steady-state ``FB`` pairs (otherwise ``F`` then ``B``).
        split_w: split W off backwards (``register_w`` + deferred ``W``).

    Returns:
        ``schedule[rank]`` = that rank's ``F``/``B``/``W``/``FB``/``register_w`` instructions in order.

    Raises:
        TesseraConfigError: a shape rule (:func:`check_shape`), or ``split_w=False`` for a template
            that requires split W (zb-h1, zb-v: ``Template.requires_split_w``).
    """
    t = _check_sizes(template, pp, vpp, num_microbatches)
    if t.requires_split_w and not split_w:
        plain = ", ".join(n for n, x in TEMPLATES.items() if not x.requires_split_w)
        raise TesseraConfigError("planner.split_w", split_w, f"template {t.name} fills its bubbles with deferred "
                                 "weight gradients (W) and needs them split off",
                                 f"set planner.split_w=true or use a template without split W ({plain})")
    return tuple(materialise(t.steps(pp, vpp, num_microbatches, r, overlap, split_w), overlap, split_w)
                 for r in range(pp))


def co_executed_pairs(template: str, pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[int, int, int], ...]:
    """Distinct ``(rank, f_stage, b_stage)`` of the ``FB`` instructions of ``template`` with
    ``overlap=True``, sorted: the chunk pairs whose overlapped cost the planner must know (none
    for a template that does not overlap F&B)."""
    t = _check_sizes(template, pp, vpp, num_microbatches)
    if not t.overlaps_fb:
        return ()
    sched = compute_schedule(template, pp, vpp, num_microbatches, overlap=True, split_w=t.requires_split_w)
    pairs = {(r, stage_of(template, r, i.chunk, pp, vpp), stage_of(template, r, i.chunk2, pp, vpp))
             for r, instrs in enumerate(sched) for i in instrs if i.op == Op.FB}
    return tuple(sorted(pairs))


# ---------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class Template:
    """A pipeline template: its facts and rules (module docstring). Look one up with
    :func:`get_template`; every field is a module-level function or a plain value.

    Attributes:
        name: the ``planner.template`` name.
        vpp: chunks per rank the template runs (1f1b, zb-h1: 1; dualpipe-v, zb-v: 2), or None for any
            ``vpp >= 1`` (interleaved-1f1b); :attr:`shape_rules` enforces it.
        overlaps_fb: with ``overlap=True`` its steady state runs a forward and a backward of
            different microbatches as one ``FB`` instruction.
        fb_keeps_w: the backward inside an ``FB`` keeps its W even with ``split_w`` (DualPipeV
            splits W only off its unpaired backwards), so W tasks move inside the overlapped
            pair; False: with ``split_w`` an ``FB``'s W is split off and deferred like any other.
        placement: ``(rank, chunk, pp) -> virtual stage``.
        owner: ``(stage, pp) -> (rank, chunk)``, the inverse of :attr:`placement`.
        shape_rules: ``(pp, vpp, num_microbatches) -> None`` for positive sizes; raises
            ``TesseraConfigError`` for a shape the template cannot run.
        steps: ``(pp, vpp, num_microbatches, rank, overlap, split_w) -> abstract steps`` of
            ``rank`` (the schedule builder; :func:`compute_schedule` materialises them).
        requires_split_w: the template is defined by where it runs the split-off W's (zb-h1,
            zb-v); :func:`compute_schedule` rejects ``split_w=False`` for it.
    """

    name: str
    vpp: int | None
    overlaps_fb: bool
    fb_keeps_w: bool
    placement: Callable[[int, int, int], int]
    owner: Callable[[int, int], tuple[int, int]]
    shape_rules: Callable[[int, int, int], None]
    steps: Callable[[int, int, int, int, bool, bool], list[_Step]]
    requires_split_w: bool = False

    def pair_with_w(self, split_w: bool) -> bool:
        """Whether the B side of an ``FB`` instruction carries its W tasks under ``split_w``."""
        return self.fb_keeps_w or not split_w


_REGISTERED = (
    Template("1f1b", vpp=1, overlaps_fb=True, fb_keeps_w=False, placement=_chunk_major, owner=_chunk_major_owner,
             shape_rules=_one_f_one_b_rules, steps=_one_f_one_b_builder),
    Template("interleaved-1f1b", vpp=None, overlaps_fb=True, fb_keeps_w=False, placement=_chunk_major,
             owner=_chunk_major_owner, shape_rules=_interleaved_rules, steps=_interleaved_steps),
    Template("dualpipe-v", vpp=2, overlaps_fb=True, fb_keeps_w=True, placement=_v_placement, owner=_v_owner,
             shape_rules=_dualpipe_v_rules, steps=_dualpipe_v_builder),
    Template("zb-h1", vpp=1, overlaps_fb=True, fb_keeps_w=False, placement=_chunk_major, owner=_chunk_major_owner,
             shape_rules=_zb_h1_rules, steps=_zb_h1_builder, requires_split_w=True),
    Template("zb-v", vpp=2, overlaps_fb=True, fb_keeps_w=False, placement=_v_placement, owner=_v_owner,
             shape_rules=_zb_v_rules, steps=_zb_v_builder, requires_split_w=True),
)

TEMPLATES: Mapping[str, Template] = MappingProxyType({t.name: t for t in _REGISTERED})
"""The registry: template name -> :class:`Template`, in the order error messages list them."""


def get_template(name: str) -> Template:
    """The registered template called ``name``.

    Raises:
        TesseraConfigError: an unknown name (``planner.template``), listing the known ones.
    """
    t = TEMPLATES.get(name) if isinstance(name, str) else None
    if t is None:
        raise TesseraConfigError("planner.template", name, "unknown pipeline template",
                                 f"use one of {', '.join(TEMPLATES)}")
    return t
