"""The list scheduler of the schedule synthesis: one rank order per pipeline rank, written by
playing the iteration forward in time (:mod:`tessera.plan.synthesis` searches its policies).

Whenever a rank gets free it chooses, from the forwards whose input has arrived and the
backwards whose output gradient has arrived, a forward and a backward together as an ``FB``
(the pair's own task order, :func:`tessera.plan.pair_cost.best_pair`), or one of them alone, or
a deferred W, or it waits (``docs/planner.md``, "Schedule synthesis"):

* per chunk the forwards, the backwards and the W's run in microbatch order, as in every
  template, so each weight gradient accumulates its microbatches in the template's order and the
  engine's losses and gradients stay bitwise those of the template (``tests/test_synthesis.py``);
* memory: a rank starts a forward only while its live activations stay under its capacity
  (the Program memory rule, :mod:`tessera.program.memory`) and its microbatch-chunks in flight
  under a cap (the template's peak plus :attr:`Policy.extra`; one forward of the rank's
  deepest chunk may pass it when none of that chunk is in flight, as it leads to the backwards
  that free memory);
* a :class:`Policy` sets the choices the greedy rule leaves open.

Durations are the simulator's own (:mod:`tessera.sim.simulator`: each instruction's task DAG in
its stored order), times each rank's factor (``ModelCosts.rank_scale``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from tessera.cost.types import ModelCosts
from tessera.plan.pair_cost import Scheduler, best_pair
from tessera.program.instructions import Instr, Op, PairOrder
from tessera.program.plan import Plan
from tessera.program.templates import compute_schedule, get_template, stage_of
from tessera.sched.chunkdag import chunk_dag, replay_pair
from tessera.sched.dag import run_in_order

F_FIRST = ("breadth", "depth", "mb")
"""Which ready forward a rank runs first: ``breadth`` the lowest stage (fill the pipeline),
``depth`` the highest stage (bring the first backward sooner), ``mb`` the oldest microbatch."""
B_FIRST = ("depth", "mb")
"""Which ready backward first: ``depth`` the highest stage (the longest chain of backwards still
ahead of it), ``mb`` the oldest microbatch."""


@dataclass(frozen=True)
class Policy:
    """One setting of the list scheduler (module docstring).

    Attributes:
        f_first, b_first: priority among ready forwards / backwards (:data:`F_FIRST`, :data:`B_FIRST`).
        defer_w: with split W, a W waits until its rank has nothing else ready (or needs the
            memory back) instead of running right after its backward.
        extra: per rank, microbatch-chunks in flight allowed beyond the template's peak (the
            template's warm-up depth); empty: 0 on every rank.
        pair_wait: per rank, a rank with only forwards (backwards) ready waits for a gradient
            (an activation) already on its way when it arrives within this share of the ready
            instruction's time, to run the two as one ``FB``; empty: 0 on every rank.
    """

    f_first: str = "breadth"
    b_first: str = "depth"
    defer_w: bool = False
    extra: tuple[int, ...] = ()
    pair_wait: tuple[float, ...] = ()

    def label(self) -> str:
        def per_rank(xs) -> str:
            return "0" if not any(xs) else (f"{xs[0]:g}" if len(set(xs)) == 1 else ",".join(f"{x:g}" for x in xs))

        return (f"F {self.f_first}, B {self.b_first}, W {'deferred' if self.defer_w else 'after B'}, "
                f"extra warm-up {per_rank(self.extra)}, pair wait {per_rank(self.pair_wait)}")


@dataclass(frozen=True)
class RankChange:
    """What synthesis changed on one rank against the template's order.

    Attributes:
        rank: pipeline rank.
        warmup_template, warmup: forwards run before the rank's first backward (template / synthesized).
        inflight_template, inflight: most microbatch-chunks whose activations are live at once.
        deferred_w: W instructions not right after their backward (in the synthesized order).
        moved_pairs: ``FB`` instructions whose (forward, backward) the template does not pair.
        fb_template, fb: ``FB`` instructions (template / synthesized).
    """

    rank: int
    warmup_template: int
    warmup: int
    inflight_template: int
    inflight: int
    deferred_w: int
    moved_pairs: int
    fb_template: int
    fb: int


class _Times:
    """Durations the list scheduler plans with, ms: the simulator's own (the task DAG of each
    instruction run in its stored order, :mod:`tessera.sim.simulator`), per virtual stage and per
    (forward stage, backward stage) pair, memoised by layer ranges in ``cache``."""

    def __init__(self, costs: ModelCosts, plan: Plan, scheduler: Scheduler, cache: dict):
        self.costs, self.plan, self.scheduler, self.cache = costs, plan, scheduler, cache
        self.with_w_fb = get_template(plan.template).pair_with_w(plan.split_w)
        self.orders = {(o.f_stage, o.b_stage, o.with_w): o for o in plan.pair_orders}
        self.new_orders: dict[tuple[int, int, bool], PairOrder] = {}

    def chunk(self, stage: int, phases: str) -> float:
        a, b = self.plan.partition.stage_range(stage)
        key = ("chunk", a, b, phases)
        if key not in self.cache:
            dag = chunk_dag(self.costs, a, b, phases)
            self.cache[key] = run_in_order(dag, dag.default_order()).makespan
        return self.cache[key]

    def pair(self, fs: int, bs: int) -> tuple[float, float, float]:
        """(makespan, end of the forward side, end of the backward side's B tasks) of ``FB(F fs, B bs)``."""
        w = self.with_w_fb
        fr, br = self.plan.partition.stage_range(fs), self.plan.partition.stage_range(bs)
        po = self.orders.get((fs, bs, w))
        if po is None:
            key = ("best", fr, br, w)
            if key not in self.cache:
                self.cache[key] = best_pair(self.costs, fr, br, w, self.scheduler)
            po = self.cache[key].pair_order(fs, bs, w)
            self.new_orders[(fs, bs, w)] = po
        key = ("pair", fr, br, w, po.order, po.overlapped)
        if key not in self.cache:
            dag, sched = replay_pair(self.costs, fr, br, w, po.order, po.overlapped)
            f_end = max((sched.end[x.id] for x in dag.tasks if x.side == "F"), default=sched.makespan)
            b_end = max((sched.end[x.id] for x in dag.tasks if x.side == "B" and not x.movable),
                        default=sched.makespan)
            self.cache[key] = (sched.makespan, f_end, b_end)
        return self.cache[key]

    def memory(self, stage: int) -> tuple[float, float]:
        a, b = self.plan.partition.stage_range(stage)
        mems = [self.costs.layer(i).memory for i in range(a, b)]
        return sum(m.activation for m in mems), sum(m.w_activation for m in mems)


def template_inflight(instrs: Sequence[Instr]) -> tuple[int, int]:
    """(warm-up depth, most microbatch-chunks in flight) of one rank's compute instructions: the
    forwards before its first backward, and the peak of forwards started minus backwards ended."""
    warm, first_b, live, peak = 0, False, 0, 0
    for ins in instrs:
        if ins.op in (Op.F, Op.FB):
            live += 1
            peak = max(peak, live)
            if not first_b:
                warm += 1
        if ins.op in (Op.B, Op.FB):
            if not first_b and ins.op == Op.FB:
                warm -= 1  # the FB's forward runs with the first backward, not before it
            first_b = True
            live -= 1
    return warm, peak


def list_schedule(costs: ModelCosts, plan: Plan, policy: Policy, *, scheduler: Scheduler,
                  avail_bytes: Sequence[float] | None = None, cache: dict | None = None
                  ) -> tuple[tuple[tuple[Instr, ...], ...], tuple[PairOrder, ...], float]:
    """One rank order per pipeline rank, written by the list scheduler under ``policy``.

    Args:
        costs: the cost model (durations and per-layer memory); a rank's ``F``/``B``/``W``/``FB``
            durations are times its factor (``ModelCosts.rank_scale``).
        plan: the plan whose placement (``template``), partition, shape and pair orders it uses.
        policy: the choices the greedy rule leaves open (:class:`Policy`).
        scheduler: the pair scheduler that orders the tasks of an ``FB`` the plan has no order for.
        avail_bytes: per rank, the bytes its live activations may take (capacity less its static
            and transient bytes); ``None``: no memory limit beyond the in-flight cap.
        cache: a dict kept across calls with the same costs (durations by layer ranges).

    Returns:
        ``(schedule, new_orders, makespan_ms)``: per rank its compute instructions (``F``, ``B``,
        ``W``, ``FB``, ``register_w``), the pair orders of ``FB`` pairs ``plan`` has none for,
        and the iteration the list scheduler predicts (no data-parallel terms), ms; ``math.inf``
        with an empty schedule when it gets stuck (a cap too tight to let any rank progress).
    """
    pp, vpp, m = plan.pp, plan.vpp, plan.num_microbatches
    S = pp * vpp
    times = _Times(costs, plan, scheduler, {} if cache is None else cache)
    split = plan.split_w
    fb_w = times.with_w_fb
    t = get_template(plan.template)
    owner = [t.owner(s, pp) for s in range(S)]
    stage = [[stage_of(plan.template, r, c, pp, vpp) for c in range(vpp)] for r in range(pp)]
    base = compute_schedule(plan.template, pp, vpp, m, plan.overlap, split)
    extra = policy.extra or (0,) * pp
    wait = policy.pair_wait or (0.0,) * pp
    cap = [template_inflight(base[r])[1] + extra[r] for r in range(pp)]
    avail = list(avail_bytes) if avail_bytes is not None else [math.inf] * pp
    p2p = costs.p2p_ms
    scale = [costs.scale_of(owner[s][0]) for s in range(S)]  # the stage's rank's factor (ModelCosts.rank_scale)
    f_ms = [times.chunk(s, "F") * scale[s] for s in range(S)]
    b_ms = [times.chunk(s, "B" if split else "BW") * scale[s] for s in range(S)]
    w_ms = [times.chunk(s, "W") * scale[s] if split else 0.0 for s in range(S)]
    mem = [times.memory(s) for s in range(S)]

    act: dict[tuple[int, int], float] = {}  # (mb, stage) -> when the forward's input is on its rank
    grad: dict[tuple[int, int], float] = {}  # (mb, stage) -> when the backward's output gradient is
    f_end: dict[tuple[int, int], float] = {}
    f_next = [[0] * vpp for _ in range(pp)]
    b_next = [[0] * vpp for _ in range(pp)]
    pend_w: list[deque] = [deque() for _ in range(pp)]
    live, live_bytes = [0] * pp, [0.0] * pp
    free_at = [0.0] * pp
    out: list[list[Instr]] = [[] for _ in range(pp)]
    left = [2 * m * vpp + (m * vpp if split else 0)] * pp  # F, B (and W) still to place
    heap = [(0.0, r) for r in range(pp)]
    heapq.heapify(heap)

    def deliver(table: dict, key: tuple[int, int], at: float, src: int) -> None:
        s = key[1]
        if not 0 <= s < S:
            return
        dst = owner[s][0]
        arrive = at if dst == src else at + p2p
        table[key] = arrive
        heapq.heappush(heap, (arrive, dst))

    def ready_f(r: int, now: float) -> list[tuple[int, int]]:
        out_ = []
        for c in range(vpp):
            mb, s = f_next[r][c], stage[r][c]
            if mb < m and (s == 0 or act.get((mb, s), math.inf) <= now):
                out_.append((mb, c))
        return out_

    def ready_b(r: int, now: float) -> list[tuple[int, int]]:
        out_ = []
        for c in range(vpp):
            mb, s = b_next[r][c], stage[r][c]
            if mb < f_next[r][c] and f_end.get((mb, s), math.inf) <= now and grad.get((mb, s), math.inf) <= now:
                out_.append((mb, c))
        return out_

    def f_key(r: int, x: tuple[int, int]):
        mb, c = x
        s = stage[r][c]
        return {"breadth": (s, mb), "depth": (-s, mb), "mb": (mb, -s)}[policy.f_first]

    def b_key(r: int, x: tuple[int, int]):
        mb, c = x
        s = stage[r][c]
        return {"depth": (-s, mb), "mb": (mb, -s)}[policy.b_first]

    deepest = [max(range(vpp), key=lambda c: stage[r][c]) for r in range(pp)]

    def fits(r: int, c: int) -> bool:
        """A forward of chunk ``c`` may start: its activation fits the rank's bytes and the
        microbatch-chunks in flight stay under the cap, except for one forward of the rank's
        deepest chunk when none of that chunk is in flight (it leads to the backwards that free
        memory: without it shallow forwards can fill the cap and stall the rank, e.g.
        breadth-first at M=64)."""
        unstall = c == deepest[r] and f_next[r][c] == b_next[r][c]
        return (live[r] < cap[r] or unstall) and live_bytes[r] + mem[stage[r][c]][0] <= avail[r]

    def b_growth(r: int, c: int) -> float:
        """Bytes a split backward of chunk ``c`` adds (under recompute a backward may keep more
        for its deferred W, ``w_activation``, than it frees); 0 when W runs inside it."""
        a, wa = mem[stage[r][c]]
        return max(0.0, wa - a) if split else 0.0

    def b_fits(r: int, c: int) -> bool:
        return live_bytes[r] + b_growth(r, c) <= avail[r]

    def after_b(r: int, mb: int, c: int, with_w: bool, now: float) -> float:
        """Register / run the backward's W; returns the time the rank is free."""
        s = stage[r][c]
        a, wa = mem[s]
        live[r] -= 1
        live_bytes[r] -= a if with_w else a - wa
        if with_w:
            return now
        out[r].append(Instr(Op.REGISTER_W, mb=mb, chunk=c))
        pend_w[r].append((mb, c))
        if policy.defer_w:
            return now
        return run_w(r, now)

    def run_w(r: int, now: float) -> float:
        mb, c = pend_w[r].popleft()
        out[r].append(Instr(Op.W, mb=mb, chunk=c))
        live_bytes[r] -= mem[stage[r][c]][1]
        left[r] -= 1
        return now + w_ms[stage[r][c]]

    def decide(r: int, now: float) -> float | None:
        """Run the next instruction(s) of rank ``r`` at ``now``; the time it is free, or None (waits)."""
        fs = [x for x in ready_f(r, now) if fits(r, x[1])]
        ready = ready_b(r, now)
        bs = [x for x in ready if b_fits(r, x[1])]
        if ready and not bs and pend_w[r]:  # a backward that keeps more for its W than it frees
            return run_w(r, now)
        if fs and bs and plan.overlap and not (
                live_bytes[r] + mem[stage[r][min(fs, key=lambda x: f_key(r, x))[1]]][0]
                + b_growth(r, min(bs, key=lambda x: b_key(r, x))[1]) > avail[r] and pend_w[r]):
            (fm, fc), (bm, bc) = min(fs, key=lambda x: f_key(r, x)), min(bs, key=lambda x: b_key(r, x))
            if split and fb_w and any(c == bc for _, c in pend_w[r]):
                # the pair runs its W inside (DualPipeV): the chunk's pending W's go first, so its
                # W's keep microbatch order (the bitwise rule)
                return run_w(r, now)
            sf, sb = stage[r][fc], stage[r][bc]
            span, fe, be = (x * scale[sf] for x in times.pair(sf, sb))
            out[r].append(Instr(Op.FB, mb=fm, chunk=fc, mb2=bm, chunk2=bc, with_w=fb_w))
            f_next[r][fc] += 1
            b_next[r][bc] += 1
            live[r] += 1
            live_bytes[r] += mem[sf][0]
            f_end[(fm, sf)] = now + fe
            deliver(act, (fm, sf + 1), now + fe, r)
            if sf == S - 1:
                grad[(fm, sf)] = now + fe
            deliver(grad, (bm, sb - 1), now + be, r)
            left[r] -= 2 + (1 if split and fb_w else 0)
            return after_b(r, bm, bc, fb_w or not split, now + span)
        if bs:
            bm, bc = min(bs, key=lambda x: b_key(r, x))
            sb = stage[r][bc]
            if wait[r] > 0 and plan.overlap:  # an activation on its way: wait to pair it
                soon = [act[(f_next[r][c], stage[r][c])] for c in range(vpp)
                        if f_next[r][c] < m and (f_next[r][c], stage[r][c]) in act and fits(r, c)]
                ta = min(soon, default=math.inf)
                if now < ta <= now + wait[r] * b_ms[sb]:
                    heapq.heappush(heap, (ta, r))
                    return None
            out[r].append(Instr(Op.B, mb=bm, chunk=bc, with_w=not split))
            b_next[r][bc] += 1
            end = now + b_ms[sb]
            deliver(grad, (bm, sb - 1), end, r)
            left[r] -= 1
            return after_b(r, bm, bc, not split, end)
        if fs:
            if wait[r] > 0 and plan.overlap:
                fm, fc = min(fs, key=lambda x: f_key(r, x))
                soon = [grad[(b_next[r][c], stage[r][c])] for c in range(vpp)
                        if b_next[r][c] < f_next[r][c] and (b_next[r][c], stage[r][c]) in grad]
                ta = min(soon, default=math.inf)
                if now < ta <= now + wait[r] * f_ms[stage[r][fc]]:
                    heapq.heappush(heap, (ta, r))
                    return None
            fm, fc = min(fs, key=lambda x: f_key(r, x))
            sf = stage[r][fc]
            out[r].append(Instr(Op.F, mb=fm, chunk=fc))
            f_next[r][fc] += 1
            live[r] += 1
            live_bytes[r] += mem[sf][0]
            end = now + f_ms[sf]
            f_end[(fm, sf)] = end
            deliver(act, (fm, sf + 1), end, r)
            if sf == S - 1:
                grad[(fm, sf)] = end
                heapq.heappush(heap, (end, r))
            left[r] -= 1
            return end
        if pend_w[r]:
            return run_w(r, now)
        return None

    while heap:
        now, r = heapq.heappop(heap)
        if left[r] == 0 or now < free_at[r] - 1e-12:
            continue
        now = max(now, free_at[r])
        end = decide(r, now)
        if end is not None:
            free_at[r] = end
            heapq.heappush(heap, (end, r))
    if any(left):
        return (), (), math.inf
    return tuple(tuple(x) for x in out), tuple(times.new_orders.values()), max(free_at)


def rank_changes(plan: Plan, schedule: Sequence[Sequence[Instr]]) -> tuple[RankChange, ...]:
    """Per rank, what ``schedule`` changes against ``plan``'s template order (:class:`RankChange`)."""
    base = compute_schedule(plan.template, plan.pp, plan.vpp, plan.num_microbatches, plan.overlap, plan.split_w)
    out = []
    for r, (b, s) in enumerate(zip(base, schedule)):
        wt, it = template_inflight(b)
        ws, is_ = template_inflight(s)
        pairs_t = {(i.mb, i.chunk, i.mb2, i.chunk2) for i in b if i.op == Op.FB}
        pairs_s = [(i.mb, i.chunk, i.mb2, i.chunk2) for i in s if i.op == Op.FB]
        deferred = 0
        for k, ins in enumerate(s):
            if ins.op == Op.W and not (k >= 1 and s[k - 1].op == Op.REGISTER_W
                                       and (s[k - 1].mb, s[k - 1].chunk) == (ins.mb, ins.chunk)):
                deferred += 1
        out.append(RankChange(r, wt, ws, it, is_, deferred, sum(p not in pairs_t for p in pairs_s),
                              len(pairs_t), len(pairs_s)))
    return tuple(out)
