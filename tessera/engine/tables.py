"""Tables the engine builds once from its Program: ``FB`` step sequences, each microbatch's
autograd segments and whether its W is deferred, the sends a compute instruction posts itself,
and the parameter split.

All depend only on the Program and the chunks (never on timing), so every rank of an EP group,
which runs the same Program, builds the same tables.
"""

from __future__ import annotations

from typing import Sequence

from tessera.engine.pairs import PairStep, pair_steps
from tessera.engine.values import EngineError
from tessera.program.instructions import Instr, Op, Program
from tessera.sched.chunkdag import fixed_order
from tessera.sched.structure import ModelStructure, order_ids, pair_structure


def check_fit(program: Program, chunks, groups) -> None:
    """The chunks and groups fit ``program`` (chunk count, layer ranges, pipeline rank).

    Raises:
        EngineError: naming the rank, the chunk or stage and both values.
    """
    p, g = program, groups
    if len(chunks) != p.vpp:
        raise EngineError(f"rank {p.rank}: Program has vpp={p.vpp} chunks, got {len(chunks)} modules")
    for s in p.stages:
        c = chunks[s.chunk]
        if (c.start, c.stop) != (s.start, s.stop):
            raise EngineError(f"rank {p.rank}: chunk {s.chunk} holds layers [{c.start},{c.stop}), the Program's "
                              f"stage S{s.stage} is [{s.start},{s.stop})")
    if g is None:
        if p.pp != 1:
            raise EngineError(f"rank {p.rank}: pp={p.pp} needs process groups")
    elif (g.layout.pp, g.pipeline_rank) != (p.pp, p.rank):
        raise EngineError(f"rank {g.rank} is pipeline rank {g.pipeline_rank} of pp={g.layout.pp}; the Program "
                          f"is for rank {p.rank} of pp={p.pp}")


def build_pairs(program: Program, chunks, stage_of, task_costs) -> dict[tuple[int, int, bool, int], tuple[PairStep, ...]]:
    """Per ``FB`` shape ``(chunk, chunk2, with_w, order)`` of ``program``, its one-thread step
    sequence (:func:`~tessera.engine.pairs.pair_steps`); ``stage_of(chunk)`` -> virtual stage.

    Raises:
        EngineError: a pair order that does not exist, is for other stages, or names tasks the
            chunks do not have; chunks without a model spec and no ``task_costs``.
    """
    fbs = {(i.chunk, i.chunk2, i.with_w, i.order) for i in program.instructions if i.op == Op.FB}
    if not fbs:
        return {}
    structure = _structure(program, chunks, task_costs)
    out = {}
    for fc, bc, with_w, order in sorted(fbs):
        f, b = chunks[fc], chunks[bc]
        try:
            dag = pair_structure(structure, (f.start, f.stop), (b.start, b.stop), with_w)
        except (ValueError, IndexError) as e:
            raise EngineError(f"rank {program.rank}: FB(c{fc} | c{bc}): {e}") from None
        if order < 0:
            seq = fixed_order(dag)
        else:
            if order >= len(program.pair_orders):
                raise EngineError(f"rank {program.rank}: FB uses pair order #{order}, the Program has "
                                  f"{len(program.pair_orders)}")
            po = program.pair_orders[order]
            if (po.f_stage, po.b_stage, po.with_w) != (stage_of(fc), stage_of(bc), with_w):
                raise EngineError(f"rank {program.rank}: pair order #{order} is for (F S{po.f_stage}, "
                                  f"B S{po.b_stage}, with_w={po.with_w}), used by FB(c{fc}, c{bc}, {with_w})")
            try:
                seq = order_ids(dag, po.order)
            except ValueError as e:
                raise EngineError(f"rank {program.rank}: pair order #{order}: {e}") from None
        try:
            out[(fc, bc, with_w, order)] = pair_steps(dag, seq, f.task_keys("F"), b.task_keys("B"),
                                                      b.task_keys("W"), with_w)
        except EngineError as e:
            raise EngineError(f"rank {program.rank}: FB(c{fc} | c{bc}) order {order}: {e}") from None
    return out


def build_runs(program: Program, chunks, pairs) -> dict:
    """Per ``(chunk, mb)``, the autograd segments of its backward (from the instruction that
    runs it: ``B`` or the B side of an ``FB``)."""
    out, pair_runs = {}, {}
    for ins in program.instructions:
        if ins.op == Op.B:
            out[(ins.chunk, ins.mb)] = chunks[ins.chunk].lone_runs()
        elif ins.op == Op.FB:
            key = (ins.chunk, ins.chunk2, ins.with_w, ins.order)
            if key not in pair_runs:
                pair_runs[key] = pair_b_runs(chunks[ins.chunk2], pairs[key])
            out[(ins.chunk2, ins.mb2)] = pair_runs[key]
    return out


def deferred_w(program: Program) -> dict[tuple[int, int], bool]:
    """Per ``(chunk, mb)``, whether the instruction running its backward defers weight gradients
    (``B`` with ``with_w=False``, every ``FB``: W runs as its own task), so its forward can run on
    the matching fast path (:func:`tessera.model.wgrad.forward_mode`)."""
    out = {}
    for ins in program.instructions:
        if ins.op == Op.B:
            out[(ins.chunk, ins.mb)] = not ins.with_w
        elif ins.op == Op.FB:
            out[(ins.chunk2, ins.mb2)] = True
    return out


def _structure(program: Program, chunks, task_costs) -> ModelStructure:
    if isinstance(task_costs, ModelStructure):
        return task_costs
    if task_costs is not None:
        return ModelStructure.of_costs(task_costs)
    spec = next((c.model_spec for c in chunks if getattr(c, "model_spec", None) is not None), None)
    if spec is None:
        raise EngineError(f"rank {program.rank}: FB instructions need the model's task structure: pass "
                          "task_costs (a ModelStructure) when the chunks carry no model_spec")
    return ModelStructure.of_specs(spec.layers)


def early_sends(instructions: Sequence[Instr]) -> tuple[dict[int, tuple[int | None, int | None]], frozenset[int]]:
    """Sends an instruction's producer posts itself: for each ``F`` / ``B`` / ``FB`` at index
    ``i``, the index of the ``send_act`` of its forward side and of the ``send_grad`` of its
    backward side among the instructions up to the next compute instruction (None where there is
    none); and the set of those send indices."""
    early: dict[int, tuple[int | None, int | None]] = {}
    for i, ins in enumerate(instructions):
        if ins.op not in (Op.F, Op.B, Op.FB):
            continue
        fwd = (ins.mb, ins.chunk) if ins.op in (Op.F, Op.FB) else None
        bwd = (ins.mb, ins.chunk) if ins.op == Op.B else (ins.mb2, ins.chunk2) if ins.op == Op.FB else None
        f_send = b_send = None
        for j in range(i + 1, len(instructions)):
            nxt = instructions[j]
            if nxt.op in (Op.F, Op.B, Op.FB, Op.W, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP):
                break
            if nxt.op == Op.SEND_ACT and (nxt.mb, nxt.chunk) == fwd and f_send is None:
                f_send = j
            elif nxt.op == Op.SEND_GRAD and (nxt.mb, nxt.chunk) == bwd and b_send is None:
                b_send = j
        if f_send is not None or b_send is not None:
            early[i] = (f_send, b_send)
    return early, frozenset(j for pair in early.values() for j in pair if j is not None)


def split_params(chunks) -> tuple[list, list]:
    """(dense, expert) parameters of the chunks, in module order (routed experts = expert)."""
    dense, experts = [], []
    for ch in chunks:
        module = getattr(ch, "module", None)
        if module is None:
            continue
        expert_ids = {id(p) for layer in module.layers if layer.moe is not None for p in layer.moe.experts.parameters()}
        for p in module.parameters():
            (experts if id(p) in expert_ids else dense).append(p)
    return dense, experts


def pair_b_runs(chunk, steps) -> tuple:
    """The autograd runs of the B side of one ``FB`` pair: the B tasks of ``steps`` (the pair's
    ``PairStep`` order) on ``chunk``, a run broken wherever an F task of the other microbatch is
    interleaved (``chunk.runs_for(order, breaks)``)."""
    order, breaks, gap = [], [], False
    for ps in steps:
        if ps.side == "F":
            gap = True
        elif ps.key.phase == "B":
            order.append(ps.key)
            breaks.append(gap)
            gap = False
    return chunk.runs_for(order, breaks)
