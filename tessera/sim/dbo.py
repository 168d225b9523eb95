"""Simulating an iteration with routing skew, with and without the dynamic bubble optimizer.

:func:`simulate_dbo` runs annotated Programs (:func:`tessera.program.slots.annotate_slots`) like
:func:`tessera.sim.simulator.simulate` (same compute schedules, early sends, links and
data-parallel collectives; the same instructions, read the same way), with two additions:

* **EP ranks.** Every pipeline rank is ``ep`` EP ranks, each with its own clock and its own
  pool of movable W; EP rank ``e`` of one stage sends to EP rank ``e`` of the next. A compute
  instruction with MoE layers starts when the last EP rank reaches it (its first dispatch
  waits for every peer), and lasts its task schedule's makespan plus the routing delay of
  :func:`tessera.dbo.predict.instr_delay_ms` for its microbatch(es) (the slowest peer's extra
  expert time and the longest transfer); its sends leave that much later. ``reduce_grads``
  waits for every EP rank (the gradient reduction is a collective).
* **The optimizer** (``enabled=True``). The movable unit is part of a chunk's W
  (:mod:`tessera.dbo.units`, ``unit``: one layer's W, or by default a MoE layer's expert W
  apart from the rest of its W); one :class:`~tessera.dbo.joint.JointPool` per pipeline rank
  holds every EP rank's pending units and chooses at each annotated slot, for all EP ranks at
  once, what each runs in its predicted usable length (``joint``: the EP group's gain rule;
  False: each EP rank alone), the rule the engine's
  :class:`~tessera.engine.dbo_joint.JointDBOPolicy` runs. In an EP slot (``ep_*``) the chosen W
  run inside the next compute instruction's idle time (``idle_ms`` of the prediction; the part
  beyond it, if any, makes that EP rank's instruction longer); in a receive slot they run
  before the receive (the receive then ends at the later of the W's end and the arrival). A
  ``register_w`` that would make the pool hold more than ``pool_mem_gb`` runs the chunk's W at
  once; a ``W`` instruction runs what is left of its chunk's W (a forced deadline run).

The idle time the simulator gives an EP rank is the prediction's own formula on the same counts,
so the prediction is exact here (``margin`` only shortens the usable part); with uniform counts
every slot predicts 0 ms and nothing moves: the iteration equals the optimizer-off one and, with
``ep`` dividing the tokens evenly, :func:`~tessera.sim.simulator.simulate`'s. Not modelled:
the idle of the EP ranks other than the slowest inside an overlapped pair beyond the formula,
the pool's effect on activation memory (``pool_peak_gb`` reports what the pending W hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from tessera.cost.types import ModelCosts, Phase
from tessera.dbo.choice import SlotChoice, fill_rate
from tessera.dbo.counts import TokenCounts, skew_max_over_mean
from tessera.dbo.joint import JointPool
from tessera.dbo.predict import instr_delay_ms, rank_tables
from tessera.dbo.units import unit_table
from tessera.errors import ProgramError
from tessera.program.instructions import Instr, Op, Program
from tessera.sim.dpsync import around, rank_dp
from tessera.sim.simulator import _compute_dag, _deadlock, _produced, _recv_key, _stage


@dataclass(frozen=True)
class DBOSimResult:
    """One simulated iteration (times ms, memory GB).

    iteration_ms: the last EP rank's end; rank_end_ms: ``[pp rank][ep rank]`` end times;
    enabled: optimizer on; skew_max_over_mean: of the counts at ``ep``; slots: annotated slots
    reached (summed over EP ranks); annotated_ms: their predicted idle time; filled_ms: W time
    run in them; moved: W units run in a slot; at_once / forced: chunk W run at registration
    (memory cap) / with units left at their deadline; pool_peak_gb: most memory one EP rank's pending W held; static_pool_gb: the
    same with every W at its deadline (the plan's own; a ``pool_mem_gb`` below it runs W at
    registration whatever the routing); choices: the per-slot log (with ``log=True``)."""

    iteration_ms: float
    rank_end_ms: tuple[tuple[float, ...], ...]
    enabled: bool
    ep: int
    skew_max_over_mean: float
    slots: int
    annotated_ms: float
    filled_ms: float
    moved: int
    at_once: int
    forced: int
    pool_peak_gb: float
    static_pool_gb: float
    choices: tuple[SlotChoice, ...] = ()

    @property
    def bubble_fill_rate(self) -> float:
        """filled slot time / annotated slot time (0 without annotated time)."""
        return fill_rate(self.filled_ms, self.annotated_ms)


def _sides(ins: Instr) -> tuple[tuple[int, int, tuple[Phase, ...]], ...]:
    """(chunk, mb, phases) of each side of a compute instruction (``FB``: forward, backward)."""
    bw = (Phase.B, Phase.W) if ins.with_w else (Phase.B,)
    if ins.op == Op.F:
        return ((ins.chunk, ins.mb, (Phase.F,)),)
    if ins.op == Op.B:
        return ((ins.chunk, ins.mb, bw),)
    return ((ins.chunk, ins.mb, (Phase.F,)), (ins.chunk2, ins.mb2, bw))


def simulate_dbo(programs: Sequence[Program], costs: ModelCosts, counts: TokenCounts, ep: int, *,
                 enabled: bool = True, margin: float = 0.1, pool_mem_gb: float = math.inf,
                 log: bool = False, joint: bool = True, unit: str = "split") -> DBOSimResult:
    """One iteration of ``programs`` with routing ``counts`` over EP groups of ``ep`` (module doc).

    Args:
        programs: one annotated Program per pipeline rank, in rank order.
        costs: the model costs; counts: token counts (>= the Programs' microbatches, every MoE layer).
        ep: EP group size (divides the counts' experts); enabled: run the optimizer;
        margin: ``dbo.margin``; pool_mem_gb: ``dbo.pool_mem_gb``; log: keep the per-slot choices;
        joint: the EP group's joint rule (:class:`tessera.dbo.joint.JointPool`; False: each EP
        rank fills its slots alone); unit: the movable unit (:data:`tessera.dbo.units.GRANULARITIES`).

    Raises:
        ProgramError: as :func:`~tessera.sim.simulator.simulate` (a deadlock names the blocked ranks).
        ValueError: counts that do not cover the Programs (:func:`tessera.dbo.predict.rank_tables`),
            an unknown ``unit``.
    """
    pp = len(programs)
    for r, p in enumerate(programs):
        if p.rank != r:
            raise ProgramError(p.rank, None, f"programs[{r}] is for rank {p.rank}; pass them in rank order")
    tables = rank_tables(programs, costs, counts, ep, margin)
    cap = pool_mem_gb * 1e9
    slot_of = [{s.index: s for s in t.slots} for t in tables]
    task_of = [{(w.chunk, w.mb): w for w in t.tasks} for t in tables]
    pools = [JointPool(unit_table(t, p, costs, unit), cap if enabled else math.inf, joint=joint)
             for t, p in zip(tables, programs)]
    E = range(ep)
    pc = [0] * pp
    now = [[0.0] * ep for _ in range(pp)]
    fill = [[0.0] * ep for _ in range(pp)]  # W time run inside the next compute instruction's idle
    idle = [[0.0] * ep for _ in range(pp)]  # that idle (the EP slot's predicted idle)
    link_free: dict[tuple[int, int, int], float] = {}
    sent: dict[tuple, tuple[int, int, float]] = {}  # (kind, mb, stage, e) -> (src, dst, arrival)
    received: set[tuple] = set()
    produced: list[list[dict]] = [[{} for _ in E] for _ in range(pp)]
    dps = [rank_dp(p, costs) for p in programs]
    dp_free = [[0.0] * ep for _ in range(pp)]
    cache: dict = {}
    trash: list = []
    st = {"slots": 0, "annotated": 0.0, "filled": 0.0, "moved": 0, "at_once": 0, "forced": 0, "peak": 0.0}
    choices: list[SlotChoice] = []

    while True:
        progressed = False
        for r, prog in enumerate(programs):
            instrs = prog.instructions
            while pc[r] < len(instrs):
                i, ins = pc[r], instrs[pc[r]]
                t = now[r]
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = _recv_key(prog, ins, i)
                    if any(key + (e,) not in sent for e in E):
                        break
                    for e in E:
                        src, dst, arrive = sent[key + (e,)]
                        if dst != r or src != ins.peer:
                            raise ProgramError(r, i, f"{ins} matches the {key[0]} of mb {key[1]} from stage {key[2]} "
                                                     f"sent by rank {src} to rank {dst}")
                        received.add(key + (e,))
                        t[e] = max(t[e], arrive)
                elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    key = ("act" if ins.op == Op.SEND_ACT else "grad", ins.mb, _stage(prog, ins.chunk, i).stage)
                    for e in E:
                        issued = min(t[e], produced[r][e].get(key, t[e]))
                        if ins.peer == r:
                            arrive = issued
                        else:
                            start = max(issued, link_free.get((r, ins.peer, e), 0.0))
                            arrive = start + costs.p2p_ms
                            link_free[(r, ins.peer, e)] = arrive
                        sent[key + (e,)] = (r, ins.peer, arrive)
                elif ins.op in (Op.F, Op.B, Op.FB):
                    dag, sched = _compute_dag(prog, ins, costs, i, cache)
                    delay = instr_delay_ms(prog, i, costs, counts, ep)
                    routed = ep > 1 and any(l in counts.layers for c, _, _ in _sides(ins)
                                            for s in [_stage(prog, c, i)] for l in range(s.start, s.stop))
                    t0 = max(t) if routed else None
                    for e in E:
                        s0 = t0 if t0 is not None else t[e]
                        over = max(0.0, fill[r][e] - idle[r][e])
                        prod = _produced(prog, ins, i, dag, sched, s0)
                        produced[r][e] = {k: v + delay for k, v in prod.items()}
                        t[e], dp_free[r][e], _ = around(dps[r], i, r, s0, s0 + sched.makespan + delay + over,
                                                        dp_free[r][e], trash)
                        fill[r][e] = idle[r][e] = 0.0
                elif ins.op == Op.W:
                    dag, sched = _compute_dag(prog, ins, costs, i, cache)
                    k = (ins.chunk, ins.mb)
                    forced = pools[r].deadline(*k) if k in task_of[r] else None
                    for e in E:
                        if forced is None:  # a W without register_w
                            dur = sched.makespan
                        else:
                            st["forced"] += bool(forced[e])
                            dur = sum(u.ms[e] for u in forced[e])
                        produced[r][e] = {}
                        t[e], dp_free[r][e], _ = around(dps[r], i, r, t[e], t[e] + dur, dp_free[r][e], trash)
                elif ins.op == Op.REGISTER_W:
                    now_runs = pools[r].register(ins.chunk, ins.mb)
                    for e in E:
                        st["at_once"] += len({(u.chunk, u.mb) for u in now_runs[e]})
                        t[e] += sum(u.ms[e] for u in now_runs[e])
                elif ins.op == Op.SLOT and ins.cause and i in slot_of[r]:
                    pred = slot_of[r][i]
                    picked = pools[r].slot([pred.usable_ms(e) for e in E]) if enabled else None
                    for e in E:
                        st["slots"] += 1
                        st["annotated"] += pred.idle_ms[e]
                        if picked is None:
                            continue
                        chosen = picked[e]
                        filled = sum(u.ms[e] for u in chosen)
                        st["filled"] += filled
                        st["moved"] += len(chosen)
                        if log:
                            choices.append(SlotChoice(r, e, i, ins.cause, pred.idle_ms[e], pred.usable_ms(e),
                                                      tuple(u.key for u in chosen), filled))
                        if ins.resource == "ep_comm":
                            fill[r][e] += filled
                            idle[r][e] += pred.idle_ms[e]
                        else:
                            t[e] += filled
                elif ins.op == Op.REDUCE_GRADS:
                    end = max(max(t[e], dp_free[r][e]) for e in E)
                    for e in E:
                        t[e] = end
                elif ins.op == Op.OPTIMIZER_STEP:
                    for e in E:
                        t[e] += dps[r].optimizer_ms
                pc[r] += 1
                progressed = True
        if all(pc[r] >= len(p.instructions) for r, p in enumerate(programs)):
            break
        if not progressed:
            raise _deadlock(programs, pc, {})
    if len(received) != len(sent):
        raise ProgramError(None, None, f"{len(sent) - len(received)} send(s) never received")
    ends = tuple(tuple(x) for x in now)
    return DBOSimResult(max((max(x) for x in now), default=0.0), ends, enabled, ep, skew_max_over_mean(counts, ep),
                        st["slots"], st["annotated"], st["filled"], st["moved"], st["at_once"], st["forced"],
                        max(p.peak for p in pools) / 1e9, max((t.static_pool_bytes for t in tables), default=0.0) / 1e9,
                        tuple(choices))


def recipe_counts(recipe, costs: ModelCosts, model) -> TokenCounts:
    """The token counts a recipe's ``dbo`` section asks for (``routing``, ``temperature``,
    ``skew_target``, ``seed``, ``counts_path``), for ``costs``' MoE layers, the recipe's
    microbatches and EP group (``ep * micro_batch_size * seq_length * top_k`` assignments per
    microbatch and layer).

    Raises:
        ValueError: as the count sources of :mod:`tessera.dbo.counts` (a bad file, a skew
            target with ``ep`` < 2).
    """
    from tessera.dbo.counts import counts_for_skew, recorded_counts, skewed_counts, uniform_counts
    from tessera.dbo.predict import moe_layers

    d, p = recipe.dbo, recipe.parallel
    moe = next((l.mlp for l in model.layers if getattr(l.mlp, "kind", None) == "moe"), None)
    layers = moe_layers(costs)
    if d.routing == "recorded":
        return recorded_counts(d.counts_path)
    if moe is None:
        return uniform_counts(p.num_microbatches, (), 1, 1)
    n, e = p.num_microbatches, moe.num_experts
    tokens = p.ep * p.micro_batch_size * p.seq_length * moe.top_k
    if d.routing == "uniform":
        return uniform_counts(n, layers, e, tokens)
    if d.skew_target > 0:
        return counts_for_skew(d.skew_target, p.ep, n, layers, e, tokens, dist=d.routing, seed=d.seed)
    return skewed_counts(n, layers, e, tokens, dist=d.routing, temperature=d.temperature, seed=d.seed)
