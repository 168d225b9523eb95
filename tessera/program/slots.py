"""Slot annotations: where MoE routing can leave a rank's compute stream idle.

:func:`annotate_slots` is a pass over compiled Programs (one per pipeline rank) that inserts a
``slot`` instruction before every place where the wait depends on routing, so the dynamic bubble
optimizer (:mod:`tessera.dbo`) can predict the idle time there and fill it with movable W tasks:

==============  ============  =================================================================
cause           resource      where (the slot is inserted just before the instruction)
==============  ============  =================================================================
``ep_f``        ``ep_comm``   ``F`` of a chunk with MoE layers: its dispatch/combine waits for
                              the EP peer holding the most tokens
``ep_b``        ``ep_comm``   ``B`` of such a chunk (the backward's dispatch/combine)
``ep_fb``       ``ep_comm``   ``FB`` with MoE layers on either side (``mb2``/``chunk2``: the B side)
``recv_act``    ``pp_comm``   ``recv_act`` from a stage with MoE layers (its skewed experts delay
                              the activation); ``peer``: the sending rank
``recv_grad``   ``pp_comm``   ``recv_grad`` from such a stage
==============  ============  =================================================================

``defer_w=True`` also gives the movable W tasks slack to fill slots with: each ``W`` instruction
moves past the next compute instruction (``F``, ``B`` or ``FB``) and the sends and ``register_w``
right behind it, or to just before ``reduce_grads``, so its W can fill that instruction's slots.
W keep their relative order (per chunk: microbatch order), so results are unchanged; a rank
holds the activations of a deferred W over one more instruction (the memory rule,
:mod:`tessera.program.memory`, counts it).

A Program the pass never saw is unchanged; the pass is idempotent (existing slots are dropped
and re-derived).
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

from tessera.program.instructions import Instr, Op, Program

CAUSES = ("ep_f", "ep_b", "ep_fb", "recv_act", "recv_grad")
"""Slot causes written by :func:`annotate_slots` (the table above)."""


def _has_moe(rng: tuple[int, int], moe_layers: Collection[int]) -> bool:
    return any(rng[0] <= l < rng[1] for l in moe_layers)


_TRAILING = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.REGISTER_W, Op.W})  # stay right behind their compute


def _defer_w(instrs: list[Instr]) -> list[Instr]:
    out: list[Instr] = []
    waiting: list[Instr] = []  # W waiting for the next compute instruction
    armed: list[Instr] = []  # W placed once that instruction's sends and register_w are out
    for ins in instrs:
        if ins.op not in _TRAILING:
            out += armed
            armed = []
        if ins.op == Op.W:
            waiting.append(ins)
            continue
        if ins.op == Op.REDUCE_GRADS:
            out += waiting
            waiting = []
        out.append(ins)
        if ins.op in (Op.F, Op.B, Op.FB):
            armed += waiting
            waiting = []
    if waiting or armed:
        raise ValueError(f"defer_w: {len(waiting) + len(armed)} W instruction(s) without a later reduce_grads; "
                         "the Program must end with reduce_grads, optimizer_step")
    return out


def annotate_slots(programs: Sequence[Program], moe_layers: Collection[int], *, defer_w: bool = False
                   ) -> tuple[Program, ...]:
    """Insert ``slot`` instructions (resource, cause) into every Program.

    Args:
        programs: one Program per rank, in rank order (the receive slots need the sender's stage).
        moe_layers: decoder layer indices with a routed MoE (e.g. the layers whose cost has an
            ``expert`` task).
        defer_w: also move each ``W`` deadline to the chunk's next backward (see the module doc).

    Returns:
        New Programs (same rank, stages, pair orders; instructions with slots).

    Raises:
        ValueError: ``programs`` out of rank order, or ``defer_w`` on a Program without
            ``reduce_grads``.
    """
    ranges = {}
    for r, p in enumerate(programs):
        if p.rank != r:
            raise ValueError(f"annotate_slots: programs[{r}] is for rank {p.rank}; pass them in rank order")
        for s in p.stages:
            ranges[s.stage] = (s.start, s.stop)
    moe = frozenset(moe_layers)
    out = []
    for p in programs:
        stage = {s.chunk: s.stage for s in p.stages}
        instrs = [i for i in p.instructions if i.op != Op.SLOT]
        if defer_w:
            instrs = _defer_w(instrs)
        new: list[Instr] = []
        for ins in instrs:
            slot = _slot_for(ins, stage, ranges, moe)
            if slot is not None:
                new.append(slot)
            new.append(ins)
        out.append(dataclasses.replace(p, instructions=tuple(new)))
    return tuple(out)


def _slot_for(ins: Instr, stage: dict[int, int], ranges: dict[int, tuple[int, int]], moe: frozenset) -> Instr | None:
    if ins.op in (Op.F, Op.B) and _has_moe(ranges[stage[ins.chunk]], moe):
        return Instr(Op.SLOT, ins.mb, ins.chunk, resource="ep_comm", cause="ep_f" if ins.op == Op.F else "ep_b")
    if ins.op == Op.FB and (_has_moe(ranges[stage[ins.chunk]], moe) or _has_moe(ranges[stage[ins.chunk2]], moe)):
        return Instr(Op.SLOT, ins.mb, ins.chunk, ins.mb2, ins.chunk2, resource="ep_comm", cause="ep_fb")
    if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
        sender = stage[ins.chunk] + (-1 if ins.op == Op.RECV_ACT else 1)
        if sender in ranges and _has_moe(ranges[sender], moe):
            return Instr(Op.SLOT, ins.mb, ins.chunk, peer=ins.peer, resource="pp_comm", cause=ins.op.value)
    return None


def slot_sender_stage(program: Program, slot: Instr) -> int | None:
    """For a receive slot, the virtual stage whose output it waits for (None for EP slots)."""
    st = next(s.stage for s in program.stages if s.chunk == slot.chunk)
    return st - 1 if slot.cause == "recv_act" else st + 1 if slot.cause == "recv_grad" else None
