"""Pipeline templates: where each virtual stage lives and in which order a rank computes.

A template is pure data: :func:`compute_schedule` returns, per rank, the *compute* instructions
(``F``, ``B``, ``W``, ``FB``, plus ``register_w`` when W is split off) in execution order.
Communication is added later by the lowering pass in :mod:`tessera.program.compiler`.

Every fact of a template lives here, in one frozen :class:`Template` per template in the registry
:data:`TEMPLATES` (name -> Template; :func:`get_template` looks one up and rejects unknown names):
the chunks per rank it runs (``vpp``), its stage placement and inverse, its shape rules, its
schedule builder, whether it overlaps F&B (``overlaps_fb``) and whether the backward inside its
``FB`` keeps W (``fb_keeps_w``, so W moves inside the overlapped pair) and whether it needs W split
off (``requires_split_w``). Callers ask the registry;
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
    chunk order. ``vpp == 1`` is ``1f1b``. See :func:`_interleaved_steps`.
``dualpipe-v``
    Two chunks per rank in a V: chunk 0 is stage ``rank``, chunk 1 is stage ``2*pp-1-rank`` (the
    last stage is on rank 0). DeepSeek's DualPipeV 8-step order (``dualpipev.py``), see
    :func:`_dualpipe_v_steps`.
``zb-h1``
    ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), sec. 3.1: one chunk per
    rank (``stage == rank``), 1f1b's forwards and backwards (same warmup, so 1F1B's peak
    activation memory) with every W split off and rank ``r`` running each W ``r`` backwards late;
    the ``r`` W's it holds back fill its cooldown, and the last rank's earlier last backward
    shortens the cooldown's backward chain. On uniform costs (``F``, ``B``, ``W`` per stage, no
    p2p time, ``M >= pp``) the bubble is ``(pp-1)*max(F+B-W, B)`` (the paper's ``(pp-1)(F+B-W)``;
    rank 0 cannot fill the wait for its first gradient, ``(pp-1)*B``, with W's it does not have
    yet) against 1f1b's ``(pp-1)*(F+B+W)``. Any ``M >= 1``. See :func:`_zb_h1_steps`.
``zb-v``
    ZB-V of Qi et al. (sec. 6) with the placement of ``dualpipe-v`` (chunk 0 = stage ``rank``,
    chunk 1 = stage ``2*pp-1-rank``), in the order of torch.distributed.pipelining's
    ``ScheduleZBVZeroBubble``: ``2(pp-rank)-1`` chunk-0 warmup forwards, ``rank`` (F1, F0), then
    1F-1B-1W per chunk with W right after its backward, and a cooldown whose deferred W's fill
    the waits between backwards. Peak activation memory of 1F1B (``pp`` microbatches of a 1F1B
    stage on rank 0); on uniform costs with ``F == B == W`` per chunk the bubble is ``(pp-1)*F``
    (the last rank's wait for its first input) against interleaved-1f1b's ``2*(pp-1)*F`` with
    split W. Needs ``M >= 2*pp-1``. See :func:`_zb_v_steps`.

zb-h1 and zb-v are defined by where they run the split-off W's: ``split_w=False`` is rejected
(:func:`compute_schedule` raises ``TesseraConfigError`` on ``planner.split_w``) rather than
silently running 1f1b or an unsplit V.

Overlap (``overlap=True``): in the steady state a forward and a backward of *different*
microbatches run as one ``FB`` instruction. Pairing the steady-state ``F_k`` with ``B_k`` would
deadlock (``B_k``'s gradient may need ``F_k``'s output to travel down and back), so 1f1b and
interleaved-1f1b run one more warmup forward and pair each steady-state backward with the *next*
forward, as Megatron-Core's combined 1F1B does; 1f1b (and zb-h1) also doubles its lead
(``2*(pp-rank-1)+1`` warmup forwards) or its ranks would run their ``FB`` steps one after another
(see :func:`_one_f_one_b_steps`). zb-v pairs its steady-state (F0 | B0) and (F1 | B1), which
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

from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from tessera.errors import TesseraConfigError
from tessera.program.instructions import Instr, Op

# Abstract steps, before materialisation into Instr:
#   ("F", mb, chunk) | ("B", mb, chunk, split) | ("FB", mb, chunk, mb2, chunk2, split) | ("W",) | ("W", chunk)
# ``split``: W may be split off this backward; ("W",) runs the oldest split-off W (FIFO), ("W", chunk)
# the oldest split-off W of that chunk.
_Step = tuple


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


# ---------------------------------------------------------------------------------------------
# schedule generators (abstract steps)


def _one_f_one_b_order(total: int, lead: Callable[[int], int], fwd: Callable[[int], tuple[int, int]],
                       bwd: Callable[[int], tuple[int, int]], overlap: bool, split: bool,
                       w_lag: int = 0) -> list[_Step]:
    """Generic 1F1B over ``total`` virtual microbatches.

    Backward ``k`` runs once ``min(total, k + lead(k) + 1)`` forwards have been issued: with a
    constant lead ``w`` that is ``w`` warmup forwards, then forward ``k+w`` followed by backward
    ``k`` (one ``FB`` when ``overlap``: the last forward issued for backward ``k`` is paired with it),
    then the remaining backwards. With ``split`` the W of backward ``k - w_lag`` follows backward
    ``k`` (``w_lag = 0``: every backward's W follows it, its deadline; see the module docstring)
    and the last ``min(w_lag, total)`` W's follow the last backward.
    """
    steps: list[_Step] = []
    issued = 0
    for k in range(total):
        need = min(total, k + lead(k) + 1)
        new = [fwd(j) for j in range(issued, max(issued, need))]
        issued = max(issued, need)
        if overlap and new and need == k + lead(k) + 1:  # steady state: pair with forward k + lead(k)
            steps += [("F", *f) for f in new[:-1]] + [("FB", *new[-1], *bwd(k), split)]
        else:
            steps += [("F", *f) for f in new] + [("B", *bwd(k), split)]
        if split and k >= w_lag:
            steps.append(("W",))
    if split:
        steps += [("W",)] * min(w_lag, total)
    return steps


def _one_f_one_b_steps(pp: int, m: int, rank: int, overlap: bool, split: bool, w_lag: int = 0) -> list[_Step]:
    """Megatron non-interleaved 1F1B on ``rank``: ``pp-rank-1`` warmup forwards; with ``overlap``
    ``2*(pp-rank-1) + 1``; with ``split`` each W ``w_lag`` backwards late (0 for 1f1b, see
    :func:`_zb_h1_steps`).

    Why twice the lead with overlap: the backward ``B_k`` of an ``FB`` step waits for ``B_k`` on
    the next rank, which sits inside that rank's ``FB`` of the same step, whose forward waits for
    this rank's output of an earlier step. With Megatron's ``pp-rank-1 (+1)`` lead that output is
    produced one step earlier, so each step waits for the full ``FB`` of the next rank and the
    ranks run one after another (measured on ``recipes/qwen3-235b.yaml`` with 1f1b, pp 8, M 80:
    42.7% bubble against 7.3% without overlap). A lead growing by two per rank (the interleaved
    template's ``(pp-rank-1)*2`` base, here with one chunk) gives the forward a step of slack,
    at the price of up to ``2*pp - 1`` microbatches in flight on rank 0 instead of ``pp``.
    """
    w = 2 * (pp - rank - 1) + 1 if overlap else pp - rank - 1
    return _one_f_one_b_order(m, lambda k: w, lambda k: (k, 0), lambda k: (k, 0), overlap, split, w_lag)


def _interleaved_steps(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    """Megatron interleaved 1F1B on ``rank``.

    Virtual microbatch ``k`` follows Megatron's schedule table: microbatches in groups, within a
    group chunk 0 for all its microbatches, then chunk 1, ...; backward ``k`` uses the same table
    with chunks reversed. Groups hold ``pp`` microbatches; when ``pp`` does not divide ``M`` the
    last group absorbs the remainder (``pp..2pp-1`` microbatches: Megatron-Core rejects final
    groups smaller than ``pp`` because they create dependency bubbles, and they deadlock under
    blocking receives). The lead of forwards over backwards is Megatron's
    ``(pp-rank-1)*2 + (vpp-1)*N`` (+1 with ``overlap``) where ``N`` is the size of the group the
    backward belongs to, so the lead grows by ``(vpp-1)*(N_last-pp)`` when the last group starts.
    """
    if vpp == 1:
        return _one_f_one_b_steps(pp, m, rank, overlap, split)
    bounds = list(range(0, max(m - m % pp, pp), pp)) + [m]
    table, group_of = [], []
    for g, (a, b) in enumerate(zip(bounds, bounds[1:])):
        table += [(mb, c) for c in range(vpp) for mb in range(a, b)]
        group_of += [b - a] * (vpp * (b - a))
    base = (pp - rank - 1) * 2 + int(overlap)
    return _one_f_one_b_order(m * vpp, lambda k: base + (vpp - 1) * group_of[k], lambda k: table[k],
                              lambda k: (table[k][0], vpp - 1 - table[k][1]), overlap, split)


def _dualpipe_v_steps(pp: int, m: int, rank: int) -> list[_Step]:
    """DeepSeek DualPipeV on ``rank`` (chunk 0 = stage ``rank``, chunk 1 = stage ``2pp-1-rank``).

    1. ``2(pp-rank-1)`` x F0;  2. ``rank+1`` x (F0, F1);  3. ``pp-rank-1`` x (B1 split, W, F1);
    4. ``M-2pp+rank+1`` x (FB(F0|B1), FB(F1|B0)), the last rank's first F0/B1 not overlapped;
    5. ``pp-rank-1`` x (B1, FB(F1|B0));  6. ``rank+1`` x (B1, B0), W split from halfway on
    (from iteration ``(rank+1)//2``: odd ranks from its B1, even ranks from its B0);
    7. ``pp-rank-1`` x (W, B0 split);  8. ``rank+1`` x W.
    Microbatch ids count per chunk in order; W's run oldest first. Backwards inside FB keep W
    (DualPipeV runs them unsplit).
    """
    f, b = [0, 0], [0, 0]
    steps: list[_Step] = []

    def fw(c: int) -> None:
        steps.append(("F", f[c], c))
        f[c] += 1

    def bw(c: int, split: bool) -> None:
        steps.append(("B", b[c], c, split))
        b[c] += 1

    def fb(cf: int, cb: int) -> None:
        steps.append(("FB", f[cf], cf, b[cb], cb, False))
        f[cf] += 1
        b[cb] += 1

    for _ in range(2 * (pp - rank - 1)):
        fw(0)
    for _ in range(rank + 1):
        fw(0)
        fw(1)
    for _ in range(pp - rank - 1):
        bw(1, True)
        steps.append(("W",))
        fw(1)
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            fw(0)
            bw(1, False)
        else:
            fb(0, 1)
        fb(1, 0)
    for _ in range(pp - rank - 1):
        bw(1, False)
        fb(1, 0)
    n6, split = rank + 1, False
    for i in range(n6):
        if i == n6 // 2 and rank % 2 == 1:
            split = True
        bw(1, split)
        if i == n6 // 2 and rank % 2 == 0:
            split = True
        bw(0, split)
    for _ in range(pp - rank - 1):
        steps.append(("W",))
        bw(0, True)
    steps += [("W",)] * (rank + 1)
    return steps


def _zb_h1_steps(pp: int, m: int, rank: int, overlap: bool) -> list[_Step]:
    """ZB-H1 (Qi et al. 2024, sec. 3.1) on ``rank``: 1F1B's forwards and backwards, every W split
    off and run ``rank`` backwards late.

    Forwards and backwards are exactly :func:`_one_f_one_b_steps`' (``pp-rank-1`` warmup forwards,
    ``2*(pp-rank-1)+1`` with ``overlap``), so the forward activations in flight are 1F1B's. The W
    of backward ``k`` runs after backward ``k + rank``; the last ``rank`` W's after the last
    backward. Why the lag grows towards the last stage: the last microbatches' gradients travel
    down a chain of backwards from the last rank to rank 0, and a W a rank runs before its last
    backward delays that chain. With a lag of ``r`` the last rank's last backward, the chain's
    start, comes ``(pp-1)*W`` earlier than in 1F1B, and each rank down the chain has one W fewer
    to run before its backward: the gradient arrives as the rank gets free, and the held-back
    W's run in the waits after it. Rank ``r`` holds ``pp-r`` microbatches' activations plus at
    most ``r`` W's (``LayerMemory.w_activation`` each), never more than rank 0's ``pp`` (1F1B's
    peak). Measured closed form: module docstring.
    """
    return _one_f_one_b_steps(pp, m, rank, overlap, True, w_lag=rank)


def _zb_v_steps(pp: int, m: int, rank: int, overlap: bool) -> list[_Step]:
    """ZB-V (Qi et al. 2024, sec. 6) on ``rank`` (chunk 0 = stage ``rank``, chunk 1 = stage
    ``2pp-1-rank``), in the order of torch.distributed.pipelining's ``ScheduleZBVZeroBubble``:

    1. ``2(pp-rank)-1`` x F0;  2. ``rank`` x (F1, F0);  3. ``pp-rank`` x (F1, B1, W);
    4. steady state until every forward ran: (F0 while any is left, B0, W, F1, B1, W);
    5. ``rank`` x (B0, B1);  6. ``pp-rank`` x (B0, W of chunk 0);  7. the chunk-1 W's, then the
    chunk-0 W's. Needs ``M >= 2pp-1`` (step 1 on rank 0).

    W runs right after its backward until the cooldown (5-7), where the deferred W's fill the
    waits between backwards; "W of chunk c" is the oldest pending W of that chunk. Rank 0 holds
    ``2pp-1`` chunk-0 and one chunk-1 activation at its first backward: ``2pp`` chunks of half a
    1F1B stage, the ``pp`` stage activations of 1F1B's rank 0 (every rank peaks there, see
    tests/test_zb_templates.py). With ``overlap`` step 4
    runs (F0 | B0) and (F1 | B1) as ``FB`` pairs of different microbatches; on rank 0 chunk 1 is
    the last stage, where F1 and B1 of step 4 are the same microbatch, so they stay unpaired.
    """
    f, b = [0, 0], [0, 0]
    steps: list[_Step] = []

    def fw(c: int) -> None:
        steps.append(("F", f[c], c))
        f[c] += 1

    def bw(c: int) -> None:
        steps.append(("B", b[c], c, True))
        b[c] += 1

    def fb(c: int) -> None:
        if overlap and (c == 0 or rank > 0):
            steps.append(("FB", f[c], c, b[c], c, True))
            f[c] += 1
            b[c] += 1
        else:
            fw(c)
            bw(c)

    for _ in range(2 * (pp - rank) - 1):
        fw(0)
    for _ in range(rank):
        fw(1)
        fw(0)
    for _ in range(pp - rank):
        fw(1)
        bw(1)
        steps.append(("W",))
    while f[1] < m:
        if f[0] < m:
            fb(0)
        else:
            bw(0)
        steps.append(("W",))
        fb(1)
        steps.append(("W",))
    for _ in range(rank):
        bw(0)
        bw(1)
    for _ in range(pp - rank):
        bw(0)
        steps.append(("W", 0))
    steps += [("W", 1)] * rank + [("W", 0)] * rank
    return steps


def _materialise(steps: list[_Step], overlap: bool, split_w: bool) -> tuple[Instr, ...]:
    """Turn abstract steps into Instr: FB -> F then B without ``overlap``; split backwards get
    ``with_w=False`` + ``register_w`` and a FIFO ``W`` at each ("W",) step when ``split_w``
    (("W", c): the oldest pending W of chunk ``c``)."""
    out: list[Instr] = []
    pending: deque[tuple[int, int]] = deque()

    def after_backward(mb: int, c: int, split: bool) -> None:
        if split:
            out.append(Instr(Op.REGISTER_W, mb=mb, chunk=c))
            pending.append((mb, c))

    for st in steps:
        kind = st[0]
        if kind == "F":
            out.append(Instr(Op.F, mb=st[1], chunk=st[2]))
        elif kind == "B":
            split = split_w and st[3]
            out.append(Instr(Op.B, mb=st[1], chunk=st[2], with_w=not split))
            after_backward(st[1], st[2], split)
        elif kind == "FB":
            split = split_w and st[5]
            if overlap:
                out.append(Instr(Op.FB, mb=st[1], chunk=st[2], mb2=st[3], chunk2=st[4], with_w=not split))
            else:
                out += [Instr(Op.F, mb=st[1], chunk=st[2]), Instr(Op.B, mb=st[3], chunk=st[4], with_w=not split)]
            after_backward(st[3], st[4], split)
        elif len(st) > 1:  # ("W", chunk)
            mb, c = next((x for x in pending if x[1] == st[1]), (-1, -1))
            if c >= 0:
                pending.remove((mb, c))
                out.append(Instr(Op.W, mb=mb, chunk=c))
        elif pending:  # ("W",)
            mb, c = pending.popleft()
            out.append(Instr(Op.W, mb=mb, chunk=c))
    if pending:  # every template balances its W's; keep the invariant even if one did not
        out += [Instr(Op.W, mb=mb, chunk=c) for mb, c in pending]
    return tuple(out)


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
    return tuple(_materialise(t.steps(pp, vpp, num_microbatches, r, overlap, split_w), overlap, split_w)
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


def _chunk_major(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def _chunk_major_owner(stage: int, pp: int) -> tuple[int, int]:
    return stage % pp, stage // pp


def _v_placement(rank: int, chunk: int, pp: int) -> int:
    return rank if chunk == 0 else 2 * pp - 1 - rank


def _v_owner(stage: int, pp: int) -> tuple[int, int]:
    return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)


def _one_f_one_b_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 1:
        raise TesseraConfigError("parallel.vpp", vpp, "template 1f1b runs one model chunk per rank (vpp must be 1)",
                                 "set parallel.vpp=1 or planner.template=interleaved-1f1b")


def _interleaved_rules(pp: int, vpp: int, m: int) -> None:
    if vpp > 1 and m < pp:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"interleaving needs num_microbatches >= pp; {m} < {pp}",
                                 f"set parallel.num_microbatches >= {pp} or parallel.vpp=1")


def _dualpipe_v_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 2:
        raise TesseraConfigError("parallel.vpp", vpp, "template dualpipe-v places exactly two chunks per rank in a V "
                                 f"(vpp must be 2, got {vpp})", "set parallel.vpp=2")
    if m < 2 * pp:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"dualpipe-v needs num_microbatches >= 2*pp; {m} < {2 * pp}",
                                 f"set parallel.num_microbatches >= {2 * pp} or use another template")


def _zb_h1_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 1:
        raise TesseraConfigError("parallel.vpp", vpp, "template zb-h1 runs one model chunk per rank (vpp must be 1)",
                                 "set parallel.vpp=1 or planner.template=zb-v (vpp=2)")


def _zb_v_rules(pp: int, vpp: int, m: int) -> None:
    if vpp != 2:
        raise TesseraConfigError("parallel.vpp", vpp, "template zb-v places exactly two chunks per rank in a V "
                                 f"(vpp must be 2, got {vpp})", "set parallel.vpp=2")
    if m < 2 * pp - 1:
        raise TesseraConfigError("parallel.num_microbatches", m,
                                 f"zb-v needs num_microbatches >= 2*pp-1 (rank 0's warm-up forwards); "
                                 f"{m} < {2 * pp - 1}",
                                 f"set parallel.num_microbatches >= {2 * pp - 1} or use another template")


def _one_f_one_b_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _one_f_one_b_steps(pp, m, rank, overlap, split)


def _dualpipe_v_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _dualpipe_v_steps(pp, m, rank)  # FB -> F, B and W splits are applied by _materialise


def _zb_h1_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _zb_h1_steps(pp, m, rank, overlap)  # split_w=False is rejected by compute_schedule


def _zb_v_builder(pp: int, vpp: int, m: int, rank: int, overlap: bool, split: bool) -> list[_Step]:
    return _zb_v_steps(pp, m, rank, overlap)


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
