"""Slot prediction: how long each annotated slot leaves a rank's compute stream idle.

From the token counts (:class:`~tessera.dbo.counts.TokenCounts`) and a cost model
(:class:`~tessera.cost.types.ModelCosts`: analytic, or measured when a profile exists, whatever
``tessera.flow.build_costs`` returns), for EP rank ``e`` of a pipeline rank, in ms. The cost
model's task times hold for balanced routing (every EP rank gets the mean load), so with loads
``n_e`` (tokens of rank ``e``'s experts), ``n_max`` and ``n_mean`` per microbatch and MoE layer:

* an EP rank's expert task lasts ``expert_ms * n_e / n_mean`` (expert time is linear in tokens);
* a dispatch or combine lasts as long as its largest receive: ``a2a_ms * n_max / n_mean``;
* the layer's combine completes when the slowest peer is done, so rank ``e`` idles
  ``expert_ms * (n_max - n_e) / n_mean + a2a_ms * (n_max / n_mean - 1)`` (the slot of causes
  ``ep_f`` / ``ep_b`` / ``ep_fb``, summed over the instruction's MoE layers and phases);
* the whole EP group finishes a layer ``(expert_ms + a2a_ms) * (n_max / n_mean - 1)`` late
  (:func:`group_delay_ms`; an instruction's delay, :func:`instr_delay_ms`, sums its layers and
  sides), so a receive waits the delay of the sender's instruction producing the tensor less the
  receiver's own delay on its previous compute instruction (both assumed on plan before them;
  at least 0): slots ``recv_act`` / ``recv_grad``.

A task fits a slot when its duration is at most the *usable* length ``idle / (1 + margin)``
(``dbo.margin``, the safety margin against prediction error). A movable W of (chunk, mb) lasts
the chunk's W tasks, its expert part scaled by ``n_e / n_mean``; it holds the chunk's
``LayerMemory.w_activation`` bytes until it runs.

Live counts (``dbo.routing: router``): every prediction of a rank's own MoE layers is linear in
the loads of (microbatch, layer), so :func:`rank_tables` keeps, per slot and movable W, its
:class:`LoadTerm` list (the cost model's ms per layer) and the table keeps the loads it was
predicted from (:attr:`RankTable.loads`). :meth:`RankTable.with_loads` re-predicts from loads
that arrive while the iteration runs (the EP group's router counts, exchanged after routing);
the part from another pipeline rank's layers (the sender's delay of a receive slot) stays as
predicted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

from tessera.cost.routing import relative_loads
from tessera.cost.types import ModelCosts, Phase, TaskKind
from tessera.dbo.counts import TokenCounts
from tessera.program.instructions import Instr, Op, Program

_A2A = (TaskKind.DISPATCH, TaskKind.COMBINE)


def moe_layers(costs: ModelCosts) -> tuple[int, ...]:
    """Decoder layers whose cost has an ``expert`` task (the routed MoE layers)."""
    return tuple(l.index for l in costs.layers if any(t.kind == TaskKind.EXPERT for t in l.tasks))


@dataclass(frozen=True)
class LoadTerm:
    """One MoE layer's part of a prediction: layer ``layer`` of microbatch ``mb``, whose expert
    tasks take ``expert_ms`` and all-to-alls ``a2a_ms`` (cost model, balanced routing, ms)."""

    mb: int
    layer: int
    expert_ms: float
    a2a_ms: float


@dataclass(frozen=True)
class SlotPrediction:
    """One annotated slot of a rank's Program.

    index: instruction index; instr: the ``slot`` instruction; idle_ms: predicted idle time of the
    compute stream per EP rank, ms; margin: ``dbo.margin``. For :meth:`RankTable.with_loads`:
    ``kind`` ``"ep"`` (``idle_e = sum expert_ms (mx - own_e) + a2a_ms (mx - 1)`` over ``terms``)
    or ``"recv"`` (``idle = max(0, base_ms - sum (expert_ms + a2a_ms) (mx - 1))``: the sender's
    delay less the rank's own on its previous compute instruction); ``""``: fixed."""

    index: int
    instr: Instr
    idle_ms: tuple[float, ...]
    margin: float
    kind: str = ""
    base_ms: float = 0.0
    terms: tuple[LoadTerm, ...] = ()

    def repredicted(self, rel) -> "SlotPrediction":
        """This slot predicted from ``rel`` (``(mb, layer) -> relative_loads``), which must hold
        every term's key."""
        ep = len(self.idle_ms)
        if self.kind == "ep":
            out = [0.0] * ep
            for t in self.terms:
                own, mx = rel[(t.mb, t.layer)]
                for e in range(ep):
                    out[e] += t.expert_ms * (mx - own[e]) + t.a2a_ms * (mx - 1.0)
            return replace(self, idle_ms=tuple(out))
        if self.kind == "recv":
            own = sum((t.expert_ms + t.a2a_ms) * (rel[(t.mb, t.layer)][1] - 1.0) for t in self.terms)
            return replace(self, idle_ms=(max(0.0, self.base_ms - own),) * ep)
        return self

    def usable_ms(self, ep_rank: int) -> float:
        """What a task may take to fit, ms: ``idle / (1 + margin)``."""
        return self.idle_ms[ep_rank] / (1.0 + self.margin)


@dataclass(frozen=True)
class WTask:
    """A movable W of local ``chunk``, microbatch ``mb``: ``ms`` per EP rank (ms), ``mem_bytes``
    held until it runs, ``register`` and ``deadline`` (the ``register_w`` and ``W`` instruction
    indices)."""

    chunk: int
    mb: int
    ms: tuple[float, ...]
    mem_bytes: float
    register: int
    deadline: int
    base_ms: float = 0.0
    terms: tuple[LoadTerm, ...] = ()

    def repredicted(self, rel) -> "WTask":
        """This W's duration from ``rel`` (as :meth:`SlotPrediction.repredicted`):
        ``ms_e = base_ms + sum expert_ms * own_e`` over ``terms``."""
        out = [self.base_ms] * len(self.ms)
        for t in self.terms:
            own = rel[(t.mb, t.layer)][0]
            for e in range(len(out)):
                out[e] += t.expert_ms * own[e]
        return replace(self, ms=tuple(out))


@dataclass(frozen=True)
class RankTable:
    """Everything the optimizer of one pipeline rank knows ahead of the iteration: its slots and
    movable tasks (:func:`rank_tables`)."""

    rank: int
    ep: int
    slots: tuple[SlotPrediction, ...]
    tasks: tuple[WTask, ...]
    loads: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    """``(mb, layer, EP ranks' token loads)`` the terms were predicted from."""

    def with_loads(self, live) -> "RankTable":
        """The table re-predicted with ``live`` loads (``{(mb, layer): EP ranks' tokens}``, e.g.
        from the router counts of the running iteration) in place of those it holds: only slots
        and W whose terms name a key of ``live`` change (module doc).

        Raises:
            ValueError: a load vector of ``live`` does not have ``ep`` entries.
        """
        if not live:
            return self
        merged = {(mb, l): tuple(v) for mb, l, v in self.loads}
        for key, v in live.items():
            if len(v) != self.ep:
                raise ValueError(f"rank {self.rank}: loads of mb{key[0]} layer {key[1]} have {len(v)} entries, the "
                                 f"EP group has {self.ep}")
            merged[(int(key[0]), int(key[1]))] = tuple(int(x) for x in v)
        rel = {k: relative_loads(v) for k, v in merged.items()}
        hit = set(live)

        def touched(terms) -> bool:
            return any((t.mb, t.layer) in hit for t in terms)

        slots = tuple(s.repredicted(rel) if s.kind and touched(s.terms) else s for s in self.slots)
        tasks = tuple(t.repredicted(rel) if touched(t.terms) else t for t in self.tasks)
        return replace(self, slots=slots, tasks=tasks, loads=tuple((mb, l, v) for (mb, l), v in sorted(merged.items())))

    @property
    def static_pool_bytes(self) -> float:
        """Most memory the registered W hold when each runs at its deadline (the plan's own
        holding, bytes): a ``dbo.pool_mem_gb`` below it makes W run at registration even where
        no slot is filled."""
        events = sorted([(t.register, t.mem_bytes) for t in self.tasks] + [(t.deadline, -t.mem_bytes)
                                                                           for t in self.tasks])
        held = peak = 0.0
        for _, d in events:
            held += d
            peak = max(peak, held)
        return peak

    @cached_property
    def _index(self) -> tuple[dict[Instr, SlotPrediction], dict[tuple[int, int], WTask]]:
        """Slots by instruction (the first of equal ones) and W by (chunk, mb): built once per
        table (a re-predicted table is a new one), so :meth:`slot` and :meth:`task` are O(1)."""
        slots: dict[Instr, SlotPrediction] = {}
        for x in self.slots:
            slots.setdefault(x.instr, x)
        tasks: dict[tuple[int, int], WTask] = {}
        for t in self.tasks:
            tasks.setdefault((t.chunk, t.mb), t)
        return slots, tasks

    def slot(self, ins: Instr) -> SlotPrediction:
        """The prediction of slot ``ins``.

        Raises:
            KeyError: ``ins`` is not an annotated slot of this rank's Program."""
        s = self._index[0].get(ins)
        if s is None:
            raise KeyError(f"rank {self.rank}: {ins} is not an annotated slot of the Program the table was built for")
        return s

    def task(self, chunk: int, mb: int) -> WTask:
        """The movable W of (``chunk``, ``mb``).

        Raises:
            KeyError: no such W was registered in this rank's Program."""
        t = self._index[1].get((chunk, mb))
        if t is None:
            raise KeyError(f"rank {self.rank}: no registered W of mb{mb}.c{chunk}")
        return t


def _loads(counts: TokenCounts, mb: int, layer: int, ep: int) -> tuple[tuple[float, ...], float]:
    """(``n_e / n_mean`` per EP rank, ``n_max / n_mean``); all 1 when no token is routed
    (:func:`tessera.cost.routing.relative_loads`, the cost model's definition)."""
    return relative_loads(counts.rank_loads(mb, layer, ep))


def _ms(costs: ModelCosts, layer: int, phases: tuple[Phase, ...], kinds) -> float:
    return sum(t.ms for t in costs.layer(layer).tasks if t.phase in phases and t.kind in kinds)


def _idle(costs, counts, ep, mb, rng, phases, moe) -> tuple[float, ...]:
    out = [0.0] * ep
    for l in range(rng[0], rng[1]):
        if l not in moe:
            continue
        own, mx = _loads(counts, mb, l, ep)
        ex, a2a = _ms(costs, l, phases, (TaskKind.EXPERT,)), _ms(costs, l, phases, _A2A)
        for e in range(ep):
            out[e] += ex * (mx - own[e]) + a2a * (mx - 1.0)
    return tuple(out)


def group_delay_ms(costs: ModelCosts, counts: TokenCounts, ep: int, mb: int, rng: tuple[int, int],
                   phases: tuple[Phase, ...]) -> float:
    """How much later the EP group finishes ``phases`` of layers ``[rng)`` for ``mb`` than with
    balanced routing, ms (module doc)."""
    moe = set(counts.layers)
    total = 0.0
    for l in range(rng[0], rng[1]):
        if l in moe:
            _, mx = _loads(counts, mb, l, ep)
            total += (_ms(costs, l, phases, (TaskKind.EXPERT,)) + _ms(costs, l, phases, _A2A)) * (mx - 1.0)
    return total


def instr_delay_ms(program: Program, index: int, costs: ModelCosts, counts: TokenCounts, ep: int) -> float:
    """Routing delay of compute instruction ``index`` (``F``, ``B``, ``FB``; 0 for others): the
    sum of :func:`group_delay_ms` over its sides (``B`` with ``with_w``: its W phases too), ms."""
    ins = program.instructions[index]
    if ins.op not in (Op.F, Op.B, Op.FB):
        return 0.0
    rng = {s.chunk: (s.start, s.stop) for s in program.stages}
    bw = (Phase.B, Phase.W) if ins.with_w else (Phase.B,)
    sides = {Op.F: ((ins.chunk, ins.mb, (Phase.F,)),), Op.B: ((ins.chunk, ins.mb, bw),),
             Op.FB: ((ins.chunk, ins.mb, (Phase.F,)), (ins.chunk2, ins.mb2, bw))}[ins.op]
    return sum(group_delay_ms(costs, counts, ep, mb, rng[c], ph) for c, mb, ph in sides)


def deferred_w_parts(tasks) -> tuple[float, float]:
    """``(rest_ms, expert_ms)`` of W tasks run deferred: the non-expert tasks' ms plus every task's
    ``TaskCost.deferred_ms`` (a per-GEMM host cost, not scaled by routing), and the expert tasks'
    ms (scaled by a rank's load by the caller)."""
    tasks = tuple(tasks)
    return (sum(t.ms * (t.kind != TaskKind.EXPERT) + t.deferred_ms for t in tasks),
            sum(t.ms for t in tasks if t.kind == TaskKind.EXPERT))


def w_ms(costs: ModelCosts, counts: TokenCounts, ep: int, mb: int, rng: tuple[int, int]) -> tuple[float, ...]:
    """A chunk's W duration per EP rank for ``mb``, ms, run deferred (expert W scaled by the
    rank's load; every W task's ``TaskCost.deferred_ms`` added unscaled: a per-GEMM host cost)."""
    moe = set(counts.layers)
    out = [0.0] * ep
    for l in range(rng[0], rng[1]):
        rest, ex = deferred_w_parts(t for t in costs.layer(l).tasks if t.phase == Phase.W)
        own = _loads(counts, mb, l, ep)[0] if l in moe else (1.0,) * ep
        for e in range(ep):
            out[e] += rest + ex * own[e]
    return tuple(out)


def _check_counts(programs: Sequence[Program], costs: ModelCosts, counts: TokenCounts, ep: int) -> None:
    missing = sorted(set(moe_layers(costs)) - set(counts.layers))
    if missing:
        raise ValueError(f"token counts ({counts.source}) have no counts for MoE layers {missing}; record or draw "
                         f"counts for layers {moe_layers(costs)}")
    m = programs[0].num_microbatches if programs else 0
    if counts.num_microbatches < m:
        raise ValueError(f"token counts ({counts.source}) hold {counts.num_microbatches} microbatches, the Programs "
                         f"run {m}; draw or record counts for at least {m}")
    if ep < 1 or counts.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the counts' num_experts={counts.num_experts} (experts per EP rank)")


def rank_tables(programs: Sequence[Program], costs: ModelCosts, counts: TokenCounts, ep: int,
                margin: float) -> tuple[RankTable, ...]:
    """Per pipeline rank: the predicted idle time of every annotated slot (module doc) and the
    movable W tasks (duration, memory, register and deadline index).

    Args:
        programs: one Program per rank, annotated (:func:`tessera.program.slots.annotate_slots`).
        costs: the cost model the Programs were planned with (or a measured one).
        counts: the iteration's token counts (microbatches >= the Programs').
        ep: EP group size; margin: ``dbo.margin`` (>= 0).

    Raises:
        ValueError: counts missing a MoE layer or microbatches, ``ep`` not dividing the experts,
            ``margin`` < 0.
    """
    if not margin >= 0:
        raise ValueError(f"dbo.margin={margin} must be >= 0 (usable slot = idle / (1 + margin))")
    _check_counts(programs, costs, counts, ep)
    moe = set(counts.layers)
    made: dict[tuple[bool, int, int], float] = {}  # (activation?, mb, stage) -> its instruction's delay
    for p in programs:
        st = {s.chunk: s.stage for s in p.stages}
        for i, ins in enumerate(p.instructions):
            if ins.op in (Op.F, Op.B, Op.FB):
                d = instr_delay_ms(p, i, costs, counts, ep)
                if ins.op in (Op.F, Op.FB):
                    made[(True, ins.mb, st[ins.chunk])] = d
                if ins.op == Op.B:
                    made[(False, ins.mb, st[ins.chunk])] = d
                if ins.op == Op.FB:
                    made[(False, ins.mb2, st[ins.chunk2])] = d

    def producer_delay(mb: int, stage: int, act: bool) -> float:
        return made.get((act, mb, stage), 0.0)

    out = []
    for p in programs:
        rng = {s.chunk: (s.start, s.stop) for s in p.stages}
        stage = {s.chunk: s.stage for s in p.stages}
        slots, regs, deadlines = [], {}, {}
        for i, ins in enumerate(p.instructions):
            if ins.op == Op.SLOT and ins.cause:
                idle = _slot_idle(p, ins, i, rng, stage, producer_delay, costs, counts, ep, moe)
                slots.append(SlotPrediction(i, ins, idle, margin, *_slot_terms(p, ins, i, rng, stage,
                                                                               producer_delay, costs, moe)))
            elif ins.op == Op.REGISTER_W:
                regs[(ins.chunk, ins.mb)] = i
            elif ins.op == Op.W:
                deadlines[(ins.chunk, ins.mb)] = i
        tasks = tuple(WTask(c, mb, w_ms(costs, counts, ep, mb, rng[c]),
                            sum(costs.layer(l).memory.w_activation for l in range(*rng[c])), i, deadlines[(c, mb)],
                            *_w_terms(costs, mb, rng[c], moe))
                      for (c, mb), i in sorted(regs.items()) if (c, mb) in deadlines)
        keys = sorted({(t.mb, t.layer) for x in (*slots, *tasks) for t in x.terms})
        loads = tuple((mb, l, counts.rank_loads(mb, l, ep)) for mb, l in keys)
        out.append(RankTable(p.rank, ep, tuple(slots), tasks, loads))
    return tuple(out)


def _terms(costs, mb, rng, phases, moe) -> tuple[LoadTerm, ...]:
    return tuple(LoadTerm(mb, l, _ms(costs, l, phases, (TaskKind.EXPERT,)), _ms(costs, l, phases, _A2A))
                 for l in range(rng[0], rng[1]) if l in moe)


def _w_terms(costs, mb, rng, moe) -> tuple[float, tuple[LoadTerm, ...]]:
    """(``base_ms``, terms) of a chunk's W (as :func:`w_ms`)."""
    base, terms = 0.0, []
    for l in range(rng[0], rng[1]):
        base += sum(t.ms * (t.kind != TaskKind.EXPERT) + t.deferred_ms for t in costs.layer(l).tasks
                    if t.phase == Phase.W)
        ex = _ms(costs, l, (Phase.W,), (TaskKind.EXPERT,))
        if l in moe:
            terms.append(LoadTerm(mb, l, ex, 0.0))
        else:
            base += ex
    return base, tuple(terms)


def _instr_terms(program: Program, index: int, costs, moe) -> tuple[LoadTerm, ...]:
    """The terms of :func:`instr_delay_ms` (its sides' MoE layers)."""
    ins = program.instructions[index]
    if ins.op not in (Op.F, Op.B, Op.FB):
        return ()
    rng = {s.chunk: (s.start, s.stop) for s in program.stages}
    bw = (Phase.B, Phase.W) if ins.with_w else (Phase.B,)
    sides = {Op.F: ((ins.chunk, ins.mb, (Phase.F,)),), Op.B: ((ins.chunk, ins.mb, bw),),
             Op.FB: ((ins.chunk, ins.mb, (Phase.F,)), (ins.chunk2, ins.mb2, bw))}[ins.op]
    return tuple(t for c, mb, ph in sides for t in _terms(costs, mb, rng[c], ph, moe))


def _slot_idle(p, ins, i, rng, stage, producer_delay, costs, counts, ep, moe) -> tuple[float, ...]:
    F, B, W = (Phase.F,), (Phase.B,), (Phase.B, Phase.W)
    if ins.cause in ("recv_act", "recv_grad"):
        sender = stage[ins.chunk] + (-1 if ins.cause == "recv_act" else 1)
        late = producer_delay(ins.mb, sender, ins.cause == "recv_act")
        prev = next((j for j in range(i - 1, -1, -1) if p.instructions[j].op in (Op.F, Op.B, Op.FB)), None)
        own = instr_delay_ms(p, prev, costs, counts, ep) if prev is not None else 0.0
        return (max(0.0, late - own),) * ep
    nxt = p.instructions[i + 1] if i + 1 < len(p.instructions) else None
    with_w = bool(nxt is not None and nxt.with_w)
    if ins.cause == "ep_f":
        return _idle(costs, counts, ep, ins.mb, rng[ins.chunk], F, moe)
    if ins.cause == "ep_b":
        return _idle(costs, counts, ep, ins.mb, rng[ins.chunk], W if with_w else B, moe)
    if ins.cause == "ep_fb":
        a = _idle(costs, counts, ep, ins.mb, rng[ins.chunk], F, moe)
        b = _idle(costs, counts, ep, ins.mb2, rng[ins.chunk2], W if with_w else B, moe)
        return tuple(x + y for x, y in zip(a, b))
    raise ValueError(f"rank {p.rank}, instruction {i}: slot cause {ins.cause!r} is not one of "
                     "ep_f, ep_b, ep_fb, recv_act, recv_grad")


def _slot_terms(p, ins, i, rng, stage, producer_delay, costs, moe) -> tuple[str, float, tuple[LoadTerm, ...]]:
    """(``kind``, ``base_ms``, terms) of a slot (:class:`SlotPrediction`), as :func:`_slot_idle`."""
    F, B, W = (Phase.F,), (Phase.B,), (Phase.B, Phase.W)
    if ins.cause in ("recv_act", "recv_grad"):
        sender = stage[ins.chunk] + (-1 if ins.cause == "recv_act" else 1)
        late = producer_delay(ins.mb, sender, ins.cause == "recv_act")
        prev = next((j for j in range(i - 1, -1, -1) if p.instructions[j].op in (Op.F, Op.B, Op.FB)), None)
        return "recv", late, (_instr_terms(p, prev, costs, moe) if prev is not None else ())
    nxt = p.instructions[i + 1] if i + 1 < len(p.instructions) else None
    bw = W if nxt is not None and nxt.with_w else B
    if ins.cause == "ep_f":
        return "ep", 0.0, _terms(costs, ins.mb, rng[ins.chunk], F, moe)
    if ins.cause == "ep_b":
        return "ep", 0.0, _terms(costs, ins.mb, rng[ins.chunk], bw, moe)
    return "ep", 0.0, _terms(costs, ins.mb, rng[ins.chunk], F, moe) + _terms(costs, ins.mb2, rng[ins.chunk2], bw, moe)
