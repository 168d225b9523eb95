"""First-in-first-out order of point-to-point messages per link.

NCCL ignores point-to-point tags: between two ranks it matches sends and receives in the order
they are posted, per direction. A set of Programs is therefore only correct on NCCL when, for
every directed link ``src rank -> dst rank``, the sends of ``src`` to ``dst`` in ``src``'s
instruction order are the receives of ``dst`` from ``src`` in ``dst``'s instruction order,
message for message. Activations and gradients share the link (both are pipeline p2p on the same
pair of ranks), so one link's sequence mixes both kinds (``pp = 2``, ``vpp = 2``: rank 0 sends
the activation of S0->S1 and the gradient of S2->S1 to rank 1).

:func:`link_ops` lists one Program's messages per peer in instruction order (the engine posts in
this order); :func:`check_link_order` is check 4 of :func:`tessera.program.validate.validate_programs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tessera.errors import ProgramError
from tessera.program.instructions import Op, Program

SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})


@dataclass(frozen=True)
class LinkOp:
    """One send or receive of a Program, as the link sees it.

    index: the instruction's position in the Program; send: a send (else a receive);
    kind: ``"act"`` | ``"grad"``; mb: microbatch; sender_stage: the virtual stage that sends it
    (with ``kind`` and ``mb`` the message's identity in an iteration); peer: the other rank.
    """

    index: int
    send: bool
    kind: str
    mb: int
    sender_stage: int
    peer: int


def link_ops(program: Program) -> dict[int, tuple[LinkOp, ...]]:
    """Peer rank -> the Program's sends to and receives from it, in instruction order.

    The sender stage of ``send_act`` / ``send_grad`` of chunk ``c`` is ``c``'s stage; of
    ``recv_act`` it is the stage before, of ``recv_grad`` the stage after (the Program's
    matching rule, docs/programs.md). No check of the fields is made (the validator does it).
    """
    stage = {s.chunk: s.stage for s in program.stages}
    out: dict[int, list[LinkOp]] = {}
    for idx, ins in enumerate(program.instructions):
        if ins.op == Op.SEND_ACT or ins.op == Op.SEND_GRAD:
            op = LinkOp(idx, True, "act" if ins.op == Op.SEND_ACT else "grad", ins.mb, stage[ins.chunk], ins.peer)
        elif ins.op == Op.RECV_ACT:
            op = LinkOp(idx, False, "act", ins.mb, stage[ins.chunk] - 1, ins.peer)
        elif ins.op == Op.RECV_GRAD:
            op = LinkOp(idx, False, "grad", ins.mb, stage[ins.chunk] + 1, ins.peer)
        else:
            continue
        out.setdefault(ins.peer, []).append(op)
    return {peer: tuple(ops) for peer, ops in out.items()}


def _describe(key: tuple) -> str:
    kind, mb, src, dst = key
    return f"{'activation' if kind == 'act' else 'gradient'} of mb{mb} S{src}->S{dst}"


def check_link_order(programs: Sequence[Program], owner: Mapping[int, int],
                     keys: Mapping[tuple[int, int], tuple]) -> None:
    """Raise :class:`ProgramError` unless every directed link carries its messages first in,
    first out.

    Args:
        programs: one Program per rank, already shape- and match-checked (every send has its
            receive: the two sequences of a link hold the same messages).
        owner: virtual stage -> rank.
        keys: ``(rank, instruction index) -> (kind, mb, sender stage, receiver stage)`` for every
            send / receive.

    Raises:
        ProgramError: at the sender's instruction: the link, the first position where the sends
            and receives differ, and the two messages (with both instructions).
    """
    sent: dict[tuple[int, int], list[tuple[int, tuple]]] = {}
    received: dict[tuple[int, int], list[tuple[int, tuple]]] = {}
    for (rank, idx), key in sorted(keys.items()):
        if programs[rank].instructions[idx].op in SEND_OPS:
            sent.setdefault((rank, owner[key[3]]), []).append((idx, key))
        else:
            received.setdefault((owner[key[2]], rank), []).append((idx, key))
    for (src, dst), sends in sorted(sent.items()):
        recvs = received.get((src, dst), [])
        for pos, ((s_idx, s_key), (r_idx, r_key)) in enumerate(zip(sends, recvs)):
            if s_key != r_key:
                raise ProgramError(src, s_idx, f"link r{src}->r{dst} is not first-in-first-out: message #{pos} rank "
                                   f"{src} sends is the {_describe(s_key)} (instruction {s_idx} "
                                   f"{programs[src].instructions[s_idx]}) but message #{pos} rank {dst} receives is "
                                   f"the {_describe(r_key)} (instruction {r_idx} {programs[dst].instructions[r_idx]}); "
                                   "NCCL matches a link's messages in posting order (tags are ignored): order the "
                                   f"receives on rank {dst} as rank {src} sends")
