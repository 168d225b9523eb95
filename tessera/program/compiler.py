"""Compiler: Plan -> one Program per pipeline rank.

``compile_plan`` is a chain of pure functions:

1. :func:`tessera.program.templates.check_shape` rejects shapes the template cannot run;
2. :func:`tessera.program.templates.compute_schedule` gives each rank's compute instructions
   (a synthesized plan brings its own, ``Plan.schedule``, checked by :func:`check_schedule`);
3. :func:`lower_communication` inserts the point-to-point communication around them:
   ``recv_act`` before a forward of stage ``s > 0`` (peer: the rank of ``s-1``), ``send_act``
   after a forward of stage ``s < last`` (peer: the rank of ``s+1``), ``recv_grad`` before a
   backward of stage ``s < last``, ``send_grad`` after a backward of stage ``s > 0``; an ``FB``
   gets the receives of both sides before it and the sends of both sides after it (forward side
   first). A neighbour stage on the *same* rank (dualpipe-v's turn of the V, ``pp == 1``) gets
   no send/recv: the activation or gradient stays on the device, and program order guarantees
   the producing instruction ran earlier (the validator checks it);
   :func:`order_sends_fifo` then makes every link first-in-first-out (NCCL matches a link's
   messages in posting order): the receives stay where they are, and a send whose receiver
   takes it after a message the rank produces later moves down to right after that message's
   send (e.g. dualpipe-v, and interleaved-1f1b at ``pp = 2``, where activations and gradients
   share the link). A receive then never waits longer than for its link's previous message, so
   deadlock freedom and the receivers' timing are kept;
4. ``reduce_grads`` and ``optimizer_step`` end every Program;
5. ``FB`` instructions point at the plan's :class:`PairOrder` for their (f_stage, b_stage,
   with_w), copied into the rank's ``Program.pair_orders`` in order of first use (-1 if none).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from tessera.errors import TesseraConfigError
from tessera.program.exchanges import link_batches
from tessera.program.plan import Partition, Plan
from tessera.program.instructions import COMPUTE_OPS, Instr, Op, PairOrder, Program, StageRef
from tessera.program.templates import check_shape, compute_schedule, rank_chunk_of, stage_of


def _check_partition(partition: Partition, num_stages: int) -> None:
    """Raise TesseraConfigError if the partition does not fit ``num_stages`` stages."""
    b = partition.bounds
    if len(b) != num_stages + 1:
        raise TesseraConfigError("plan.partition", b, f"has {len(b) - 1} stages, the pipeline has pp*vpp={num_stages}",
                                 "build the partition for pp*vpp stages")
    if b[0] != -1 or any(b2 <= b1 for b1, b2 in zip(b, b[1:])):
        raise TesseraConfigError("plan.partition", b, "bounds must start at -1 (embedding) and strictly increase",
                                 "use serial_balanced_partition or the planner")


def check_schedule(plan: Plan) -> None:
    """Reject a ``Plan.schedule`` that is not one list of compute instructions per rank.

    The deeper rules (every forward and backward once, inputs before use, no deadlock, FIFO
    links) are the validator's, on the compiled Programs
    (:func:`tessera.program.validate.validate_programs`).

    Raises:
        TesseraConfigError: ``plan.schedule`` with a number of ranks other than ``pp``, an
            instruction that is not ``F``/``B``/``W``/``FB``/``register_w``, or a chunk outside
            ``0..vpp-1``.
    """
    if len(plan.schedule) != plan.pp:
        raise TesseraConfigError("plan.schedule", f"{len(plan.schedule)} ranks", f"needs one list per rank (pp={plan.pp})",
                                 "plan again with `tessera plan`")
    allowed = COMPUTE_OPS | {Op.REGISTER_W}
    for r, instrs in enumerate(plan.schedule):
        for ins in instrs:
            chunks = (ins.chunk, ins.chunk2) if ins.op == Op.FB else (ins.chunk,)
            if ins.op not in allowed or not all(0 <= c < plan.vpp for c in chunks):
                raise TesseraConfigError("plan.schedule", f"rank {r}: {ins}",
                                         f"holds compute instructions on chunks 0..{plan.vpp - 1} only",
                                         "plan again with `tessera plan`")


def lower_communication(template: str, rank: int, pp: int, vpp: int,
                        compute: tuple[Instr, ...]) -> tuple[Instr, ...]:
    """Insert send/recv instructions around ``rank``'s compute instructions (see module docstring)."""
    # owner[s + 1] is the rank of stage s; the sentinels -1 / pp*vpp map to this rank (no comm)
    owner = [rank] + [rank_chunk_of(template, s, pp, vpp)[0] for s in range(pp * vpp)] + [rank]
    stage = [stage_of(template, rank, c, pp, vpp) for c in range(vpp)]

    def fwd_comm(mb: int, c: int) -> tuple[list[Instr], list[Instr]]:
        prev, nxt = owner[stage[c]], owner[stage[c] + 2]
        pre = [Instr(Op.RECV_ACT, mb=mb, chunk=c, peer=prev)] if prev != rank else []
        post = [Instr(Op.SEND_ACT, mb=mb, chunk=c, peer=nxt)] if nxt != rank else []
        return pre, post

    def bwd_comm(mb: int, c: int) -> tuple[list[Instr], list[Instr]]:
        prev, nxt = owner[stage[c]], owner[stage[c] + 2]
        pre = [Instr(Op.RECV_GRAD, mb=mb, chunk=c, peer=nxt)] if nxt != rank else []
        post = [Instr(Op.SEND_GRAD, mb=mb, chunk=c, peer=prev)] if prev != rank else []
        return pre, post

    out: list[Instr] = []
    for ins in compute:
        if ins.op == Op.F:
            pre, post = fwd_comm(ins.mb, ins.chunk)
        elif ins.op == Op.B:
            pre, post = bwd_comm(ins.mb, ins.chunk)
        elif ins.op == Op.FB:
            fpre, fpost = fwd_comm(ins.mb, ins.chunk)
            bpre, bpost = bwd_comm(ins.mb2, ins.chunk2)
            pre, post = fpre + bpre, fpost + bpost
        else:
            pre, post = [], []
        out += [*pre, ins, *post]
    return tuple(out)


_SEND_OPS = (Op.SEND_ACT, Op.SEND_GRAD)


def _message(ins: Instr, stage: int) -> tuple[str, int, int]:
    """(kind, mb, sender stage) of a send / receive of a chunk at virtual stage ``stage``."""
    kind = "act" if ins.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad"
    shift = {Op.RECV_ACT: -1, Op.RECV_GRAD: +1}.get(ins.op, 0)
    return kind, ins.mb, stage + shift


def order_sends_fifo(lowered: tuple[tuple[Instr, ...], ...],
                     stages: tuple[tuple[int, ...], ...]) -> tuple[tuple[Instr, ...], ...]:
    """Re-place the sends of every rank so each directed link is first-in-first-out.

    Args:
        lowered: per rank, its instructions with communication (:func:`lower_communication`):
            every send right after the instruction producing it.
        stages: per rank, the virtual stage of each chunk.

    Returns the same instructions per rank; receives and compute keep their order. On each link
    ``r -> q`` the sends follow the order in which ``q`` receives: a send goes right after the
    later of its producer and the previous send of the link. Sends placed after the same
    instruction keep their relative order across links (forward side first), and within a link
    take the receiver's order.
    """
    recv_order: dict[tuple[int, int], list[tuple]] = {}
    for q, instrs in enumerate(lowered):
        for ins in instrs:
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                recv_order.setdefault((ins.peer, q), []).append(_message(ins, stages[q][ins.chunk]))
    out = []
    for r, instrs in enumerate(lowered):
        base: list[Instr] = []
        anchor: dict[tuple, int] = {}  # (peer, message) -> index in base of the instruction it follows
        send_of: dict[tuple, tuple[int, Instr]] = {}  # (peer, message) -> (original position, send)
        for pos, ins in enumerate(instrs):
            if ins.op in _SEND_OPS:
                k = (ins.peer, _message(ins, stages[r][ins.chunk]))
                anchor[k], send_of[k] = len(base) - 1, (pos, ins)
            else:
                base.append(ins)
        rank_in_link: dict[tuple, int] = {}
        for (src, dst), msgs in recv_order.items():
            if src != r:
                continue
            t = -1
            for n, m in enumerate(msgs):
                k = (dst, m)
                if k in anchor:
                    t = anchor[k] = max(t, anchor[k])
                    rank_in_link[k] = n
        at: dict[int, list[tuple]] = {}
        for k in sorted(anchor, key=lambda k: send_of[k][0]):
            at.setdefault(anchor[k], []).append(k)
        placed: dict[int, list[Instr]] = {}
        for t, ks in at.items():
            slots = list(ks)  # slots in original order; each link's slots refilled in receiver order
            for peer in {k[0] for k in ks}:
                idx = [i for i, k in enumerate(slots) if k[0] == peer]
                for i, k in zip(idx, sorted((slots[i] for i in idx), key=lambda k: rank_in_link.get(k, 0))):
                    slots[i] = k
            placed[t] = [send_of[k][1] for k in slots]
        seq = list(placed.get(-1, []))
        for i, ins in enumerate(base):
            seq.append(ins)
            seq += placed.get(i, [])
        out.append(tuple(seq))
    return tuple(out)


def _attach_pair_orders(template: str, rank: int, pp: int, vpp: int, instrs: tuple[Instr, ...],
                        plan_orders: tuple[PairOrder, ...]) -> tuple[tuple[Instr, ...], tuple[PairOrder, ...]]:
    """Set ``FB.order`` to an index into the returned (rank-local) pair-order tuple."""
    by_key = {}
    for po in plan_orders:
        by_key.setdefault((po.f_stage, po.b_stage, po.with_w), po)
    if not by_key:
        return instrs, ()
    stage = [stage_of(template, rank, c, pp, vpp) for c in range(vpp)]
    used: list[PairOrder] = []
    index: dict[tuple[int, int, bool], int] = {}
    out = []
    for ins in instrs:
        if ins.op == Op.FB:
            key = (stage[ins.chunk], stage[ins.chunk2], ins.with_w)
            if key in by_key and key not in index:
                index[key] = len(used)
                used.append(by_key[key])
            ins = replace(ins, order=index.get(key, -1))
        out.append(ins)
    return tuple(out), tuple(used)


def compile_plan(plan: Plan, cache: dict | None = None) -> tuple[Program, ...]:
    """Compile ``plan`` into one :class:`Program` per pipeline rank (index = rank).

    ``cache``: a dict the caller keeps across calls (the planner's iteration search compiles
    hundreds of partitions of one shape); it holds each rank's lowered instructions by shape
    (template, pp, vpp, microbatches, overlap, split W, and a synthesized plan's schedule), which
    do not depend on the partition or the pair orders. ``None``: nothing is kept.

    Raises:
        TesseraConfigError: the shape does not fit the template or the partition does not fit
            the shape. A stage may hold no decoder layer: stage 0 only the embedding (``[-1, 0)``)
            or the last stage only the head (``[L, L+1)``), the only ranges without one that
            strictly increasing bounds allow.
    """
    check_shape(plan.template, plan.pp, plan.vpp, plan.num_microbatches, plan.partition.bounds[-1] - 1)
    num_stages = plan.pp * plan.vpp
    _check_partition(plan.partition, num_stages)
    shape = (plan.template, plan.pp, plan.vpp, plan.num_microbatches, plan.overlap, plan.split_w)
    if plan.schedule:  # a synthesized order: keyed by its content
        check_schedule(plan)
        shape = shape + (plan.schedule,)
    kept = {} if cache is None else cache
    if shape not in kept:
        sched = plan.schedule or compute_schedule(*shape)
        lowered = tuple(lower_communication(plan.template, r, plan.pp, plan.vpp, sched[r]) for r in range(plan.pp))
        stages = tuple(tuple(stage_of(plan.template, r, c, plan.pp, plan.vpp) for c in range(plan.vpp))
                       for r in range(plan.pp))
        kept[shape] = order_sends_fifo(lowered, stages)
    programs = []
    for r in range(plan.pp):
        stages = tuple(StageRef(c, s, *plan.partition.stage_range(s))
                       for c, s in ((c, stage_of(plan.template, r, c, plan.pp, plan.vpp)) for c in range(plan.vpp)))
        lowered = kept[shape][r]
        instrs, orders = _attach_pair_orders(plan.template, r, plan.pp, plan.vpp, lowered, plan.pair_orders)
        instrs += (Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
        programs.append(Program(rank=r, pp=plan.pp, vpp=plan.vpp, num_microbatches=plan.num_microbatches,
                                num_stages=num_stages, stages=stages, instructions=instrs, pair_orders=orders,
                                template=plan.template, plan_name=plan.name))
    batches = kept.get(("p2p_batches", shape))  # they depend on the shape alone, like the lowering
    if batches is None:
        batches = kept[("p2p_batches", shape)] = link_batches(programs)
    return tuple(replace(p, p2p_batches=b) for p, b in zip(programs, batches))


def program_summary(programs: tuple[Program, ...] | list[Program]) -> str:
    """A short table: per rank its stages and layer ranges, and instruction counts by op."""
    if not programs:
        return "(no programs)"
    p0 = programs[0]
    lines = [f"{p0.template or '?'} plan={p0.plan_name or '?'} pp={p0.pp} vpp={p0.vpp} "
             f"M={p0.num_microbatches} stages={p0.num_stages}",
             f"{'rank':>4}  {'stages':<32} {'instrs':>6} {'F':>4} {'B':>4} {'W':>4} {'FB':>4} "
             f"{'send':>5} {'recv':>5} {'orders':>6}  hash"]
    for p in programs:
        n = Counter(i.op for i in p.instructions)
        st = " ".join(f"S{s.stage}[{s.start},{s.stop})" for s in p.stages)
        lines.append(f"{p.rank:>4}  {st:<32} {len(p.instructions):>6} {n[Op.F]:>4} {n[Op.B]:>4} {n[Op.W]:>4} "
                     f"{n[Op.FB]:>4} {n[Op.SEND_ACT] + n[Op.SEND_GRAD]:>5} {n[Op.RECV_ACT] + n[Op.RECV_GRAD]:>5} "
                     f"{len(p.pair_orders):>6}  {p.content_hash}")
    compute = sum(1 for p in programs for i in p.instructions if i.op in COMPUTE_OPS)
    lines.append(f"total compute instructions: {compute}")
    return "\n".join(lines)
