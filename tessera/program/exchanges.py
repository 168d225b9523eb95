"""Point-to-point exchanges: the order and grouping in which every rank posts its messages (NCCL).

NCCL runs the point-to-point operations of one communicator in the order they are posted, one
``batch_isend_irecv`` (an NCCL group) after another; a send completes only once its receive is
running on the other end, and it is undefined for two ranks to group one exchange differently
(nccl issue 1279; ``../shared/design/NCCL-RULES.md`` rules 1-3). Gloo forgives both. So the order
is part of the Program, computed once from every rank's Program by the compiler, and every rank
posts its sends and receives on its replica's pipeline group in that order, each exchange grouped
the same way on both ends.

**The order** (:func:`link_batches`): the validator's zero-duration run (sends buffered,
receives blocking, ranks in turn) sends every message at some point; numbering the messages in
the order they are sent gives one order for the whole pipeline. Each rank posts its operations,
sends and receives, of all its links, in that order. A message's *batch* (one
``batch_isend_irecv`` call) is the message alone today, so both ends group every exchange the
same way by construction.

**Why it cannot hang** (checked by :func:`check_exchanges`): in the zero-duration run the send of
message ``k`` happened after every receive its sender waited for, all of which were sent earlier
(lower numbers); so when each rank's operations start one after the other in number order (NCCL,
one communicator), message ``k`` has both ends' earlier operations done, its sender has its data
and its receiver has it posted. The engine (:class:`tessera.engine.p2p.PipeComm`) posts a receive
as soon as every earlier operation of its rank is posted (not when its instruction nears) and a
send once its data exists, and never out of that order, so what NCCL sees is this order whatever
the timing. Unlike posting in each rank's own instruction order, a rank whose link crosses
(rank ``a`` sends then receives while rank ``b`` sends then receives, 1F1B's steady state) takes
the first-sent message first on both ends, instead of both waiting in their sends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from tessera.errors import ProgramError
from tessera.program.instructions import Program
from tessera.program.link_order import LinkOp, link_ops

STALE = ("if the instructions changed after compiling, derive the order again "
         "(tessera.program.exchanges.with_exchanges)")

Key = tuple[str, int, int]
"""A message of an iteration: ``(kind, mb, sender stage)``, kind ``"act"`` or ``"grad"``."""


def _key(op: LinkOp) -> Key:
    return (op.kind, op.mb, op.sender_stage)


def _point(ops: Sequence[LinkOp]) -> int:
    """The instruction that makes a batch postable: its last send, else its first receive."""
    sends = [o.index for o in ops if o.send]
    return max(sends) if sends else min(o.index for o in ops)


def send_order(programs: Sequence[Program]) -> dict[Key, int]:
    """Every message's number in the order the validator's zero-duration run sends it (module
    docstring): ranks in turn, each running until it blocks on a receive not yet sent.

    Raises:
        ProgramError: a rank blocks for good (the Programs deadlock under blocking semantics;
            the validator's check 7 names the ranks first).
    """
    ops = [{o.index: o for seq in link_ops(p).values() for o in seq} for p in programs]
    pc = [0] * len(programs)
    order: dict[Key, int] = {}
    moved = True
    while moved:
        moved = False
        for r, p in enumerate(programs):
            while pc[r] < len(p.instructions):
                o = ops[r].get(pc[r])
                if o is not None:
                    if not o.send and _key(o) not in order:
                        break
                    if o.send:
                        order[_key(o)] = len(order)
                pc[r] += 1
                moved = True
    stuck = [r for r, p in enumerate(programs) if pc[r] < len(p.instructions)]
    if stuck:
        raise ProgramError(stuck[0], pc[stuck[0]], "the Programs deadlock (a receive whose message is never sent "
                           "before it); the validator names every blocked rank")
    return order


def link_batches(programs: Sequence[Program]) -> tuple[tuple[tuple[Key, ...], ...], ...]:
    """Per rank, its point-to-point batches in posting order (module docstring): every send and
    receive of the rank, each a batch of its own, sorted by :func:`send_order`.

    Args:
        programs: one Program per rank (index = rank), matched, first-in-first-out per link and
            deadlock-free (the validator's checks 3, 4 and 7).

    Raises:
        ProgramError: the Programs deadlock (:func:`send_order`).
    """
    order = send_order(programs)
    out = []
    for p in programs:
        keys = sorted((_key(o) for seq in link_ops(p).values() for o in seq), key=lambda k: order[k])
        out.append(tuple((k,) for k in keys))
    return tuple(out)


def with_exchanges(programs: Sequence[Program]) -> tuple[Program, ...]:
    """``programs`` with :attr:`Program.p2p_batches` set from :func:`link_batches`."""
    return tuple(replace(p, p2p_batches=b) for p, b in zip(programs, link_batches(programs)))


def check_exchanges(programs: Sequence[Program]) -> None:
    """Check 8 of :func:`tessera.program.validate.validate_programs` (module docstring): the
    Programs' ``p2p_batches`` pair up on every link and their posting order cannot hang under
    NCCL's one-group-after-another semantics (a run where each rank's batches start one after the
    other, a batch completes once it has started on both ends, sends never block and a receive
    blocks at its instruction until its batch completed, ends with every rank finished). Programs
    without batches (none of them annotated) pass: their engines post in instruction order, which
    only gloo forgives.

    Raises:
        ProgramError: a rank's batches miss or repeat a message, mix peers or list a message out
            of instruction order; the two ends of a link group their messages differently; a
            batch receives, before its last send, a message that send needs; or the order hangs
            (every blocked rank named, with its instruction and the batch it waits for).
    """
    if not any(p.p2p_batches for p in programs):
        return
    ops = [link_ops(p) for p in programs]
    by_key = [{_key(o): o for seq in o_by_peer.values() for o in seq} for o_by_peer in ops]
    batches: list[list[tuple[int, tuple[LinkOp, ...]]]] = []  # per rank: (peer, ops) in posting order
    for r, p in enumerate(programs):
        mine, seen = [], set()
        for k, keys in enumerate(p.p2p_batches):
            got = [by_key[r].get(tuple(key)) for key in keys]
            if not keys or None in got:
                raise ProgramError(r, None, f"p2p batch {k} {list(keys)} names a message the Program does not send or "
                                   "receive; recompile the plan (tessera.program.exchanges.with_exchanges)")
            peers = {o.peer for o in got}
            idx = [o.index for o in got]
            if len(peers) != 1 or idx != sorted(idx) or seen & set(idx):
                raise ProgramError(r, idx[0], f"p2p batch {k} mixes peers {sorted(peers)}, lists its messages out of "
                                   "instruction order or repeats one; a batch is one link's messages in order")
            seen |= set(idx)
            first_recv = min((o.index for o in got if not o.send), default=None)
            if first_recv is not None and first_recv < _point(got):
                raise ProgramError(r, first_recv, f"p2p batch {k} with rank {got[0].peer} receives at instruction "
                                   f"{first_recv} before its send at instruction {_point(got)}: the batch cannot be "
                                   "posted before the data it waits for; split it")
            mine.append((got[0].peer, tuple(got)))
        missing = sorted(o.index for o in by_key[r].values() if o.index not in seen)
        if missing:
            raise ProgramError(r, missing[0], f"p2p batches leave instructions {missing} out; every send and receive "
                               "belongs to exactly one batch")
        batches.append(mine)
    for r, mine in enumerate(batches):
        for peer in sorted({q for q, _ in mine}):
            here = [tuple(_key(o) for o in b) for q, b in mine if q == peer]
            there = [tuple(_key(o) for o in b) for q, b in batches[peer] if q == r]
            for k, (x, y) in enumerate(zip(here, there)):
                if set(x) != set(y):
                    raise ProgramError(r, None, f"link r{r}<->r{peer}: batch {k} holds {list(x)} on rank {r} but "
                                       f"{list(y)} on rank {peer}; both ends must group an exchange the same way "
                                       f"(NCCL); {STALE}")
            if len(here) != len(there):
                raise ProgramError(r, None, f"link r{r}<->r{peer}: {len(here)} batches on rank {r}, {len(there)} on "
                                   f"rank {peer}")
    _check_streams(programs, batches)


def _check_streams(programs: Sequence[Program], batches: list[list[tuple[int, tuple[LinkOp, ...]]]]) -> None:
    """The no-hang run of :func:`check_exchanges`: each rank posts its batches in order, a batch of
    receives at once, a batch with sends once the rank is past its last send instruction (the data
    exists); they start one after the other (NCCL, one communicator); sends never block the rank;
    a receive blocks at its instruction until its batch has completed."""
    n = len(programs)
    post_at = [[_point(b) + 1 if any(o.send for o in b) else 0 for _, b in mine] for mine in batches]
    batch_of = [{_key(o): k for k, (_, b) in enumerate(mine) for o in b} for mine in batches]
    partner = [[(0, 0)] * len(mine) for mine in batches]  # (peer, the same batch's position there)
    for r, mine in enumerate(batches):
        for peer in {q for q, _ in mine}:
            here = [k for k, (q, _) in enumerate(mine) if q == peer]
            there = [k for k, (q, _) in enumerate(batches[peer]) if q == r]
            for k, j in zip(here, there):
                partner[r][k] = (peer, j)
    pc, posted, done = [0] * n, [0] * n, [0] * n  # done: batches completed, a prefix (one after the other)
    recv_at = [{o.index: _key(o) for _, b in mine for o in b if not o.send} for mine in batches]
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while posted[r] < len(post_at[r]) and post_at[r][posted[r]] <= pc[r]:
                posted[r] += 1
                moved = True
        for r in range(n):  # the batch running on a rank completes once it runs on the other end too
            k = done[r]
            if k < posted[r]:
                q, j = partner[r][k]
                if done[q] == j and j < posted[q]:
                    done[r] += 1
                    done[q] += 1
                    moved = True
        for r, p in enumerate(programs):
            while pc[r] < len(p.instructions):
                key = recv_at[r].get(pc[r])
                if key is not None and batch_of[r][key] >= done[r]:
                    break
                pc[r] += 1
                moved = True
                if posted[r] < len(post_at[r]) and post_at[r][posted[r]] <= pc[r]:
                    break  # post before going on
    blocked = [r for r, p in enumerate(programs) if pc[r] < len(p.instructions) or done[r] < len(batches[r])]
    if not blocked:
        return
    parts = []
    for r in blocked:
        p = programs[r]
        if pc[r] < len(p.instructions):
            k = batch_of[r][recv_at[r][pc[r]]]
            where = f"rank {r} at instruction {pc[r]} {p.instructions[pc[r]]}"
        else:
            k, where = done[r], f"rank {r} at its end"
        q, j = partner[r][k]
        parts.append(f"{where} waits for p2p batch {k} with rank {q} ({len(batches[r][k][1])} messages; rank {q} "
                     f"has completed {done[q]} of its batches, posted {posted[q]})")
    raise ProgramError(blocked[0], pc[blocked[0]] if pc[blocked[0]] < len(programs[blocked[0]].instructions) else None,
                       "p2p batches would hang under NCCL (one group after another per communicator): "
                       + "; ".join(parts) + f"; {STALE}")
