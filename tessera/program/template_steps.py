"""Schedule builders of the pipeline templates: per rank, the abstract steps in execution order.

Each builder returns a rank's steps (``("F", mb, chunk)``, ``("B", mb, chunk, split)``,
``("FB", mb, chunk, mb2, chunk2, split)``, ``("W",)``, ``("W", chunk)``); :func:`materialise`
turns them into :class:`~tessera.program.instructions.Instr`. Which template uses which builder,
and every other fact of a template, is in the registry of :mod:`tessera.program.templates`
(whose module docstring describes each order and its sources).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from tessera.program.instructions import Instr, Op

# Abstract steps, before materialisation into Instr:
#   ("F", mb, chunk) | ("B", mb, chunk, split) | ("FB", mb, chunk, mb2, chunk2, split) | ("W",) | ("W", chunk)
# ``split``: W may be split off this backward; ("W",) runs the oldest split-off W (FIFO), ("W", chunk)
# the oldest split-off W of that chunk.
_Step = tuple


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


def materialise(steps: list[_Step], overlap: bool, split_w: bool) -> tuple[Instr, ...]:
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


