"""Validator: do a set of Programs (one per rank) form a correct, deadlock-free iteration?

:func:`validate_programs` checks, in this order, and raises :class:`ProgramError` (rank,
instruction index, message) at the first violation:

1. *Shape*: one Program per rank 0..pp-1; all agree on pp, vpp, num_microbatches and
   num_stages == pp*vpp; every rank lists its vpp chunks in chunk order; every virtual stage is
   owned exactly once and the stage layer ranges tile the extended layers from -1 on.
2. *Fields*: chunks, microbatches and peers in range; a send/recv names the rank that owns the
   neighbouring stage; no activation into stage 0 or out of the last stage (gradients mirrored).
3. *Matching*: every send has exactly one receive on its peer and vice versa; the match key is
   (activation | gradient, mb, sender stage -> receiver stage). An unmatched receive is named as
   such (``receive of the activation of mb1 S0->S1 from rank 0 has no matching send``), before
   the deadlock check would only see a rank blocked on it.
4. *First in, first out per link* (:mod:`tessera.program.link_order`): for every directed link
   ``src rank -> dst rank`` the sends of ``src`` to ``dst`` in instruction order are the
   receives of ``dst`` from ``src`` in instruction order, activations and gradients together
   (NCCL matches a link's messages in posting order and ignores tags). The error names both
   ranks, the link, the first position where they differ and the two messages.
5. *Per rank, in program order*: each (mb, stage) has one F, one B and one W (``with_w`` counts
   as the W), F before B before W, ``register_w`` after its B and before its W; a forward has its
   input (a preceding ``recv_act``, or the previous stage's forward earlier on the same rank) and
   a backward its output gradient likewise; a send follows the computation it sends; the backward
   side of an ``FB`` does not consume its own forward side; an ``FB``'s ``order`` names a
   ``PairOrder`` of the same (f_stage, b_stage, with_w); everything precedes ``reduce_grads``, and
   ``optimizer_step`` is last.
6. *Coverage*: every (mb, stage) of the model has its F, B and W.
7. *Deadlock*: all Programs run with zero durations, sends buffered (never block), receives
   blocking. If no rank can move and some are unfinished, the error names every blocked rank, its
   instruction index and the message it waits for.
8. *Exchanges* (:mod:`tessera.program.exchanges`, Programs with ``p2p_batches``): both ends of
   every link group their messages into the same batches, and the ranks' posting orders cannot
   hang when each communicator runs one batch after another (NCCL).
"""

from __future__ import annotations

from typing import Sequence

from tessera.errors import ProgramError
from tessera.program.instructions import COMM_OPS, Instr, Op, Program
from tessera.program.exchanges import check_exchanges
from tessera.program.link_order import check_link_order

_SENDS = {Op.SEND_ACT: ("act", +1), Op.SEND_GRAD: ("grad", -1)}
_RECVS = {Op.RECV_ACT: ("act", -1), Op.RECV_GRAD: ("grad", +1)}
_NO_OPERAND = (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP)


def _check_shape(programs: Sequence[Program]) -> dict[int, int]:
    """Checks 1; returns stage -> owning rank."""
    if not programs:
        raise ProgramError(0, None, "no programs")
    p0 = programs[0]
    if len(programs) != p0.pp:
        raise ProgramError(p0.rank, None, f"{len(programs)} programs for pp={p0.pp}")
    owner: dict[int, int] = {}
    ranges: dict[int, tuple[int, int]] = {}
    for i, p in enumerate(programs):
        if p.rank != i:
            raise ProgramError(p.rank, None, f"program at position {i} has rank {p.rank}")
        for f in ("pp", "vpp", "num_microbatches", "num_stages"):
            if getattr(p, f) != getattr(p0, f):
                raise ProgramError(p.rank, None, f"{f}={getattr(p, f)} but rank 0 has {f}={getattr(p0, f)}")
        if p.num_stages != p.pp * p.vpp or p.num_microbatches <= 0:
            raise ProgramError(p.rank, None, f"num_stages={p.num_stages} != pp*vpp={p.pp * p.vpp} "
                               f"or num_microbatches={p.num_microbatches} <= 0")
        if len(p.stages) != p.vpp or any(s.chunk != c for c, s in enumerate(p.stages)):
            raise ProgramError(p.rank, None, f"stages must list chunks 0..{p.vpp - 1} in order")
        for s in p.stages:
            if not 0 <= s.stage < p.num_stages or s.stage in owner:
                raise ProgramError(p.rank, None, f"stage {s.stage} out of range or owned twice")
            owner[s.stage] = p.rank
            ranges[s.stage] = (s.start, s.stop)
    pos = -1
    for s in range(p0.num_stages):
        a, b = ranges[s]
        if a != pos or b <= a:
            raise ProgramError(owner[s], None, f"stage {s} holds [{a},{b}); it must start at {pos} and be non-empty "
                               "(stage ranges must tile the layers)")
        pos = b
    return owner


def _comm_key(p: Program, ins: Instr, owner: dict[int, int], idx: int) -> tuple[tuple, int]:
    """(match key, expected peer) of a send/recv; checks 2 for it."""
    s = p.stages[ins.chunk].stage
    kind, d = _SENDS[ins.op] if ins.op in _SENDS else _RECVS[ins.op]
    other = s + d
    if not 0 <= other < p.num_stages:
        raise ProgramError(p.rank, idx, f"{ins}: stage {s} has no neighbour stage {other}")
    if ins.peer != owner[other]:
        raise ProgramError(p.rank, idx, f"{ins}: stage {other} lives on rank {owner[other]}, not r{ins.peer}")
    src, dst = (s, other) if ins.op in _SENDS else (other, s)
    return (kind, ins.mb, src, dst), owner[other]


def _describe(key: tuple) -> str:
    kind, mb, src, dst = key
    return f"{'send_act' if kind == 'act' else 'send_grad'} of mb{mb} S{src}->S{dst}"


def _check_fields_and_match(programs: Sequence[Program], owner: dict[int, int]) -> dict[tuple[int, int], tuple]:
    """Checks 2 and 3; returns (rank, index) -> match key for every send/recv."""
    sends: dict[tuple, tuple[int, int]] = {}
    recvs: dict[tuple, tuple[int, int]] = {}
    keys: dict[tuple[int, int], tuple] = {}
    m, pp, vpp = programs[0].num_microbatches, programs[0].pp, programs[0].vpp
    for p in programs:
        for idx, ins in enumerate(p.instructions):
            if ins.op in _NO_OPERAND or ins.op == Op.SLOT:
                continue
            sides = [(ins.mb, ins.chunk)] + ([(ins.mb2, ins.chunk2)] if ins.op == Op.FB else [])
            for mb, c in sides:
                if not (0 <= mb < m and 0 <= c < vpp):
                    raise ProgramError(p.rank, idx, f"{ins}: microbatch or chunk out of range (M={m}, vpp={vpp})")
            if ins.op in COMM_OPS:
                if not 0 <= ins.peer < pp:
                    raise ProgramError(p.rank, idx, f"{ins}: peer out of range (pp={pp})")
                key, _ = _comm_key(p, ins, owner, idx)
                table = sends if ins.op in _SENDS else recvs
                if key in table:
                    raise ProgramError(p.rank, idx, f"{ins} duplicates instruction {table[key][1]} on rank "
                                       f"{table[key][0]} ({_describe(key)})")
                table[key] = (p.rank, idx)
                keys[(p.rank, idx)] = key
    for key, (r, idx) in sends.items():
        if key not in recvs:
            what = "recv_act" if key[0] == "act" else "recv_grad"
            raise ProgramError(r, idx, f"{programs[r].instructions[idx]} has no matching {what} on rank "
                               f"{owner[key[3]]} ({_describe(key)})")
    for key, (r, idx) in recvs.items():
        if key not in sends:
            kind, mb, src, dst = key
            what = f"{'the activation' if kind == 'act' else 'the gradient'} of mb{mb} S{src}->S{dst}"
            raise ProgramError(r, idx, f"receive of {what} from rank {owner[src]} has no matching send "
                               f"({programs[r].instructions[idx]}; rank {owner[src]} has no {_describe(key)})")
    return keys


def _check_rank(p: Program, owner: dict[int, int]) -> tuple[dict, dict, dict]:
    """Check 5 for one Program; returns the index of each (mb, stage)'s F, B and W."""
    last = p.num_stages - 1
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    w_at: dict[tuple[int, int], int] = {}
    reg_at: dict[tuple[int, int], int] = {}
    act_in: set[tuple[int, int]] = set()
    grad_in: set[tuple[int, int]] = set()
    reduce_at = step_at = None

    def fail(idx: int, msg: str) -> None:
        raise ProgramError(p.rank, idx, msg)

    def once(table: dict, key: tuple[int, int], idx: int, what: str) -> None:
        if key in table:
            fail(idx, f"second {what} of mb{key[0]} at stage {key[1]} (first at instruction {table[key]})")
        table[key] = idx

    def forward_ready(mb: int, s: int, idx: int, ins: Instr) -> None:
        local = s > 0 and owner[s - 1] == p.rank and (mb, s - 1) in f_at
        if s > 0 and (mb, s) not in act_in and not local:
            fail(idx, f"{ins}: forward of mb{mb} at stage {s} has no input (no recv_act and no local forward of "
                 f"stage {s - 1} before it)")

    def backward_ready(mb: int, s: int, idx: int, ins: Instr) -> None:
        if (mb, s) not in f_at:
            fail(idx, f"{ins}: backward of mb{mb} at stage {s} before its forward")
        local = s < last and owner[s + 1] == p.rank and (mb, s + 1) in b_at
        if s < last and (mb, s) not in grad_in and not local:
            fail(idx, f"{ins}: backward of mb{mb} at stage {s} has no output gradient (no recv_grad and no local "
                 f"backward of stage {s + 1} before it)")

    for idx, ins in enumerate(p.instructions):
        op = ins.op
        if op == Op.SLOT:  # annotation only
            continue
        if reduce_at is not None and op not in _NO_OPERAND:
            fail(idx, f"{ins} after reduce_grads (instruction {reduce_at})")
        if op in _NO_OPERAND:
            if op == Op.REDUCE_GRADS:
                if reduce_at is not None:
                    fail(idx, "second reduce_grads")
                reduce_at = idx
            else:
                step_at = idx
                if idx != len(p.instructions) - 1 or reduce_at is None:
                    fail(idx, "optimizer_step must be the last instruction, after reduce_grads")
            continue
        s = p.stages[ins.chunk].stage
        key = (ins.mb, s)
        if op == Op.RECV_ACT:
            act_in.add(key)
        elif op == Op.RECV_GRAD:
            grad_in.add(key)
        elif op == Op.SEND_ACT and key not in f_at:
            fail(idx, f"{ins} before the forward that produces it")
        elif op == Op.SEND_GRAD and key not in b_at:
            fail(idx, f"{ins} before the backward that produces it")
        elif op == Op.F:
            forward_ready(*key, idx, ins)
            once(f_at, key, idx, "F")
        elif op in (Op.B, Op.FB):
            bkey = key if op == Op.B else (ins.mb2, p.stages[ins.chunk2].stage)
            backward_ready(*bkey, idx, ins)  # before the FB's own forward side is recorded
            if op == Op.FB:
                forward_ready(*key, idx, ins)
                once(f_at, key, idx, "F")
            if op == Op.FB and ins.order >= 0:
                po = p.pair_orders[ins.order] if ins.order < len(p.pair_orders) else None
                if po is None or (po.f_stage, po.b_stage, po.with_w) != (s, bkey[1], ins.with_w):
                    fail(idx, f"{ins}: order #{ins.order} is not a pair order for F stage {s} / B stage {bkey[1]} "
                         f"with_w={ins.with_w}")
            once(b_at, bkey, idx, "B")
            if ins.with_w:
                once(w_at, bkey, idx, "W")
        elif op == Op.REGISTER_W:
            if key not in b_at or key in w_at:
                fail(idx, f"{ins} must come after its B and before its W")
            once(reg_at, key, idx, "register_w")
        elif op == Op.W:
            if key not in b_at:
                fail(idx, f"{ins}: W of mb{ins.mb} at stage {s} before its B")
            once(w_at, key, idx, "W")
    if reduce_at is None or step_at is None:
        raise ProgramError(p.rank, None, "program must end with reduce_grads, optimizer_step")
    return f_at, b_at, w_at


def _check_coverage(programs: Sequence[Program], owner: dict[int, int], done: dict[int, tuple]) -> None:
    """Check 6."""
    for s, r in sorted(owner.items()):
        for what, table in zip("FBW", done[r]):
            for mb in range(programs[0].num_microbatches):
                if (mb, s) not in table:
                    raise ProgramError(r, None, f"{what} of mb{mb} at stage {s} is missing")


def _check_deadlock(programs: Sequence[Program], owner: dict[int, int], keys: dict) -> None:
    """Check 7: zero-duration execution with buffered sends and blocking receives."""
    pc = [0] * len(programs)
    mailbox: set[tuple] = set()
    moved = True
    while moved:
        moved = False
        for p in programs:
            r, instrs = p.rank, p.instructions
            while pc[r] < len(instrs):
                op = instrs[pc[r]].op
                if op in _RECVS:
                    if keys[(r, pc[r])] not in mailbox:
                        break
                elif op in _SENDS:
                    mailbox.add(keys[(r, pc[r])])
                pc[r] += 1
                moved = True
    blocked = [p.rank for p in programs if pc[p.rank] < len(p.instructions)]
    if not blocked:
        return
    parts = []
    for r in blocked:
        key = keys[(r, pc[r])]
        src = owner[key[2]]
        state = (f"blocked at instruction {pc[src]} {programs[src].instructions[pc[src]]}"
                 if pc[src] < len(programs[src].instructions) else "finished")
        parts.append(f"rank {r} at instruction {pc[r]} {programs[r].instructions[pc[r]]} waits for "
                     f"{_describe(key)} from rank {src} ({state})")
    raise ProgramError(blocked[0], pc[blocked[0]], "deadlock: " + "; ".join(parts))


def validate_programs(programs: Sequence[Program]) -> None:
    """Validate one Program per rank (index = rank); return None or raise :class:`ProgramError`.

    See the module docstring for the checks. The deadlock check is exact for the blocking
    semantics of the instruction set: with buffered sends, any real timing reaches the same final
    state as the zero-duration run, so a schedule that passes cannot hang. With the FIFO check,
    matching messages by posting order per link (NCCL) pairs the same sends and receives as
    matching by tag (gloo), so the guarantee holds for both.
    """
    programs = tuple(programs)
    owner = _check_shape(programs)
    keys = _check_fields_and_match(programs, owner)
    check_link_order(programs, owner, keys)
    done = {p.rank: _check_rank(p, owner) for p in programs}
    _check_coverage(programs, owner, done)
    _check_deadlock(programs, owner, keys)
    check_exchanges(programs)
