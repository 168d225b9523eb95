"""Discrete-event simulator of Programs: predicts one iteration's timeline and metrics.

Semantics (times in ms, memory in bytes internally, GB in the result):

* Each rank runs its instructions strictly in order; an instruction starts when the previous one
  on the rank ended.
* Compute instructions expand to task DAGs (:mod:`tessera.sched.chunkdag`) over the rank's
  ``Program.stages[chunk]`` layer range: ``F`` -> ``chunk_dag(.., "F")``, ``B`` -> ``"B"`` (``"BW"``
  with ``with_w``), ``W`` -> ``"W"``; each runs in the DAG's default (topological) per-resource
  order. ``FB`` -> ``pair_dag(costs, f_range, b_range, with_w)`` run with
  ``Program.pair_orders[order]``, whose task names are looked up in that DAG
  (:func:`~tessera.sched.structure.order_ids`; ``order == -1``:
  :func:`~tessera.sched.chunkdag.fixed_order`; a pair order with ``overlapped=False`` uses
  ``slowdown=1.0``: no SMs reserved). A name the DAG lacks is a ProgramError.
  The instruction lasts the DAG's makespan; every task interval is kept. Rank ``r`` runs its
  DAGs on ``costs.on_rank(r)`` (:meth:`~tessera.cost.types.ModelCosts.on_rank`: its compute tasks
  ``ModelCosts.rank_scale[r]`` times longer, communication tasks as they are; a straggler rank).
* ``send_act``/``send_grad`` are asynchronous and take no time on the rank: the transfer starts
  when issued (or when the directed link ``(src, dst)`` is free: transfers on one link serialise),
  and a send is issued when the task producing its data ends, as the engine posts it: a
  ``send_act`` / ``send_grad`` that follows the ``F`` / ``B`` / ``FB`` producing it with no compute
  instruction in between is issued at the end of that side's last task (inside an ``FB``: the
  forward side's last task for the activation, the backward side's last B task for the
  gradient, not the pair's end); other sends when reached;
  occupies the link for ``costs.p2p_ms`` and arrives at its end. A send to the sending rank itself
  (``peer == rank``) is local and arrives at once.
* ``recv_act``/``recv_grad`` block until the matching transfer has arrived. Sends and receives
  match by (kind, mb, sender virtual stage): ``recv_act`` of stage s waits for the ``send_act`` of
  stage s-1, ``recv_grad`` of stage s for the ``send_grad`` of stage s+1.
* ``register_w`` and ``slot`` take no time (recorded as marks); the registered W runs at its
  ``W`` instruction (the deadline), as a DBO-less engine would.
* Data parallelism (:mod:`tessera.sim.dpsync`, durations from ``LayerCost.dp``): each rank's
  parameter all-gathers and gradient reduce-scatters run one after another on its own
  data-parallel link. A compute instruction that must wait for an all-gather (``zero1``: a
  chunk's first forward, the gather issued at the iteration start; ``fsdp``: every F and B, from
  the instruction's start) lasts until the later of its tasks' makespan and the gather; the
  excess is the rank's ``dp_exposed_ms``. Reduce-scatters are issued at the end of the
  instruction holding a chunk's weight gradients (``zero1``: its last one) and run behind later
  work. ``reduce_grads`` waits until the rank's link is idle (exposed too); ``optimizer_step``
  lasts the rank's ``optimizer_ms``. Both count as neither busy nor idle: ``idle_ms`` (the
  bubble) is ``iteration - busy - dp_exposed - optimizer``.
* Memory per rank: the Program memory rule (:mod:`tessera.program.memory`): static bytes
  (``LayerMemory.static``) of every extended layer of the rank's stages and the largest
  ``LayerMemory.transient`` among them, plus live activations: ``F`` of a chunk allocates the
  chunk's ``activation`` at the instruction's start; ``B`` frees ``activation - w_activation`` at
  its end (all of it with ``with_w``); ``W`` frees ``w_activation`` at its end. Inside an ``FB``
  each forward layer allocates at its first F task's start and each backward layer frees at its
  last B (and W) task's end, at the times of the pair's schedule
  (:func:`tessera.program.memory.pair_peak_bytes`).

If no rank can progress before all have finished, :class:`~tessera.errors.ProgramError` names
every blocked rank, its instruction index and what it waits for.
"""

from __future__ import annotations

from typing import Sequence

from tessera.cost.types import ModelCosts
from tessera.errors import ProgramError
from tessera.program.instructions import Instr, Op, Program, StageRef
from tessera.program.memory import fb_peak_bytes, rank_static_bytes
from tessera.sched.chunkdag import chunk_dag, replay_pair
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order
from tessera.sim.dpsync import around, rank_dp
from tessera.sim.result import Collective, InstrSpan, RankMetrics, SimResult, SlotMark, TaskEvent, Transfer
from tessera.spec.tasks import Resource

_Key = tuple[str, int, int]  # (kind, mb, sender stage)


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of intervals (zero-length ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(x for x in iv if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length_minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of ``union(a) \\ union(b)``, ms."""
    a, b = _merge(a), _merge(b)
    total, j = 0.0, 0
    for s, e in a:
        covered = 0.0
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
        total += (e - s) - covered
    return total


def _stage(prog: Program, chunk: int, index: int) -> StageRef:
    for s in prog.stages:
        if s.chunk == chunk:
            return s
    raise ProgramError(prog.rank, index, f"chunk {chunk} is not one of the rank's stages "
                                         f"{[s.chunk for s in prog.stages]}")


def _chunk_mem(costs: ModelCosts, st: StageRef) -> tuple[float, float]:
    """(activation, w_activation) bytes of one microbatch of a chunk."""
    mems = [costs.layer(l).memory for l in range(st.start, st.stop)]
    return sum(m.activation for m in mems), sum(m.w_activation for m in mems)


def rank_costs(costs: ModelCosts, rank: int, cache: dict) -> tuple[ModelCosts, float]:
    """``(costs as rank runs them, its factor)``: :meth:`~tessera.cost.types.ModelCosts.on_rank`,
    memoised in ``cache`` by factor (``costs`` itself when no rank is scaled)."""
    if not costs.rank_scale:
        return costs, 1.0
    scale = costs.scale_of(rank)
    key = ("rank_costs", scale)
    if key not in cache:
        cache[key] = costs.on_rank(rank)
    return cache[key], scale


def _compute_dag(prog: Program, ins: Instr, costs: ModelCosts, index: int, cache: dict) -> tuple[TaskDAG, TaskSchedule]:
    """Task DAG and its schedule (relative times) for one compute instruction, on the costs of the
    rank that runs it (``ModelCosts.rank_scale``; the cache keys carry the rank's factor)."""
    costs, scale = rank_costs(costs, prog.rank, cache)
    if ins.op == Op.FB:
        fs, bs = _stage(prog, ins.chunk, index), _stage(prog, ins.chunk2, index)
        order, overlapped = None, True
        if ins.order >= 0:
            if ins.order >= len(prog.pair_orders):
                raise ProgramError(prog.rank, index, f"pair order #{ins.order} does not exist "
                                                     f"({len(prog.pair_orders)} pair orders)")
            po = prog.pair_orders[ins.order]
            if (po.f_stage, po.b_stage, po.with_w) != (fs.stage, bs.stage, ins.with_w):
                raise ProgramError(prog.rank, index, f"pair order #{ins.order} is for (F S{po.f_stage}, "
                                                     f"B S{po.b_stage}, with_w={po.with_w}), instruction is "
                                                     f"(F S{fs.stage}, B S{bs.stage}, with_w={ins.with_w})")
            order, overlapped = po.order, po.overlapped
        # keyed by content (layer ranges and the order itself), so a cache can serve many plans
        key = (("FB", fs.start, fs.stop, bs.start, bs.stop, ins.with_w, order, overlapped)
               + ((scale,) if scale != 1.0 else ()))
        if key not in cache:
            try:
                cache[key] = replay_pair(costs, (fs.start, fs.stop), (bs.start, bs.stop), ins.with_w, order,
                                         overlapped)
            except ValueError as e:
                raise ProgramError(prog.rank, index, f"{ins}: {e}") from None
        return cache[key]
    st = _stage(prog, ins.chunk, index)
    phases = {Op.F: "F", Op.B: "BW" if ins.with_w else "B", Op.W: "W"}[ins.op]
    key = (phases, st.start, st.stop) + ((scale,) if scale != 1.0 else ())
    if key not in cache:
        dag = chunk_dag(costs, st.start, st.stop, phases)
        cache[key] = (dag, run_in_order(dag, dag.default_order()))
    return cache[key]


def _mem_delta(prog: Program, ins: Instr, costs: ModelCosts, index: int) -> tuple[float, float]:
    """(bytes allocated at the instruction's start, bytes freed at its end)."""
    alloc = free = 0.0
    if ins.op in (Op.F, Op.FB):
        alloc = _chunk_mem(costs, _stage(prog, ins.chunk, index))[0]
    if ins.op in (Op.B, Op.FB):
        a, w = _chunk_mem(costs, _stage(prog, ins.chunk if ins.op == Op.B else ins.chunk2, index))
        free = a if ins.with_w else a - w
    if ins.op == Op.W:
        free = _chunk_mem(costs, _stage(prog, ins.chunk, index))[1]
    return alloc, free


def _produced(prog: Program, ins: Instr, index: int, dag: TaskDAG, sched: TaskSchedule, t: float) -> dict[_Key, float]:
    """When a compute instruction started at ``t`` produces the data its sends carry: ``F`` the
    activation and ``B`` the input gradient at its end; ``FB`` each side at its last task's end
    (the backward side's last B task: W tasks produce nothing to send). ``W``: nothing."""
    if ins.op == Op.F:
        return {("act", ins.mb, _stage(prog, ins.chunk, index).stage): t + sched.makespan}
    if ins.op == Op.B:
        return {("grad", ins.mb, _stage(prog, ins.chunk, index).stage): t + sched.makespan}
    if ins.op != Op.FB:
        return {}
    f_end, b_end = side_ends(dag, sched)
    return {("act", ins.mb, _stage(prog, ins.chunk, index).stage): t + f_end,
            ("grad", ins.mb2, _stage(prog, ins.chunk2, index).stage): t + b_end}


def side_ends(dag: TaskDAG, sched: TaskSchedule) -> tuple[float, float]:
    """(end of the last forward-side task, end of the last backward-side B task) of a compute
    instruction's schedule, ms from its start: when its activation / input gradient can be sent
    (W tasks produce nothing to send; a side without tasks: the makespan)."""
    f_end = max((sched.end[x.id] for x in dag.tasks if x.side == "F"), default=sched.makespan)
    b_end = max((sched.end[x.id] for x in dag.tasks if x.side == "B" and not x.movable), default=sched.makespan)
    return f_end, b_end


def _recv_key(prog: Program, ins: Instr, index: int) -> _Key:
    s = _stage(prog, ins.chunk, index).stage
    return ("act", ins.mb, s - 1) if ins.op == Op.RECV_ACT else ("grad", ins.mb, s + 1)


def simulated_iteration_ms(programs: Sequence[Program], costs: ModelCosts, cache: dict | None = None) -> float:
    """The ``iteration_ms`` :func:`simulate` reports for ``programs``, without recording events,
    spans or memory (what the planner's iteration search needs, several times faster).

    ``cache``: a dict the caller keeps across calls *with the same costs* to reuse the compute
    instructions' task schedules (keyed by layer ranges, pair order content and the rank's
    ``rank_scale`` factor); ``None``: a
    fresh one per call, as :func:`simulate` uses.

    Raises:
        ProgramError: as :func:`simulate`.
    """
    return _run(programs, costs, record=False, cache=cache)[0]


def simulate(programs: Sequence[Program], costs: ModelCosts) -> SimResult:
    """Simulate one iteration of ``programs`` (one per rank) on ``costs``.

    Args:
        programs: one Program per rank; ``programs[r].rank`` must be ``r``.
        costs: the model costs the Programs' stage ranges refer to.

    Returns:
        SimResult with times in ms and memory in GB.

    Raises:
        ProgramError: ranks out of order, unknown chunk or pair order, duplicated or unreceived
            sends, mismatched peers, or a deadlock (every blocked rank is named).
    """
    _, state = _run(programs, costs, record=True)
    return _result(programs, costs, *state)


def _run(programs: Sequence[Program], costs: ModelCosts, record: bool, cache: dict | None = None):
    """The event loop of :func:`simulate`: ``(iteration_ms, state)``, ``state`` the arguments of
    :func:`_result` after ``programs, costs`` (events, spans, marks and memory only with ``record``)."""
    pp = len(programs)
    for r, p in enumerate(programs):
        if p.rank != r:
            raise ProgramError(p.rank, None, f"programs[{r}] is for rank {p.rank}; pass them in rank order")
    pc = [0] * pp
    now = [0.0] * pp
    busy = [0.0] * pp
    mem_cur = [0.0] * pp
    mem_peak = [0.0] * pp
    link_free: dict[tuple[int, int], float] = {}
    sent: dict[_Key, Transfer] = {}
    received: set[_Key] = set()
    events: list[TaskEvent] = []
    spans: list[InstrSpan] = []
    marks: list[SlotMark] = []
    cache = {} if cache is None else cache
    dps = [rank_dp(p, costs) for p in programs]  # data-parallel collectives and optimizer (dpsync)
    dp_free, dp_exposed = [0.0] * pp, [0.0] * pp
    collectives: list[Collective] = []
    produced: list[dict[_Key, float]] = [{} for _ in range(pp)]  # data of the rank's last compute instruction

    while True:
        progressed = False
        for r, prog in enumerate(programs):
            instrs = prog.instructions
            while pc[r] < len(instrs):
                i, ins, t = pc[r], instrs[pc[r]], now[r]
                end = t
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = _recv_key(prog, ins, i)
                    tr = sent.get(key)
                    if tr is None:
                        break
                    if tr.dst != r or tr.src != ins.peer:
                        raise ProgramError(r, i, f"{ins} matches the {key[0]} of mb {key[1]} from stage {key[2]} "
                                                 f"sent by rank {tr.src} to rank {tr.dst}")
                    if key in received:
                        raise ProgramError(r, i, f"{ins}: {key[0]} of mb {key[1]} from stage {key[2]} received twice")
                    received.add(key)
                    end = max(t, tr.end_ms)
                elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    kind = "act" if ins.op == Op.SEND_ACT else "grad"
                    key = (kind, ins.mb, _stage(prog, ins.chunk, i).stage)
                    if key in sent:
                        raise ProgramError(r, i, f"{ins}: {kind} of mb {ins.mb} from stage {key[2]} sent twice")
                    if not 0 <= ins.peer < pp:
                        raise ProgramError(r, i, f"{ins}: peer {ins.peer} is not a rank (pp={pp})")
                    issued = min(t, produced[r].get(key, t))  # posted by its producer
                    if ins.peer == r:
                        start = arrive = issued
                    else:
                        start = max(issued, link_free.get((r, ins.peer), 0.0))
                        arrive = start + costs.p2p_ms
                        link_free[(r, ins.peer)] = arrive
                    sent[key] = Transfer(kind, ins.mb, key[2], r, ins.peer, issued, start, arrive)
                elif ins.op in (Op.F, Op.B, Op.W, Op.FB):
                    dag, sched = _compute_dag(prog, ins, costs, i, cache)
                    if record:
                        alloc, free = _mem_delta(prog, ins, costs, i)
                        if ins.op == Op.FB:  # the pair's own peak, at its schedule's times
                            mem_peak[r] = max(mem_peak[r], mem_cur[r] + fb_peak_bytes(prog, ins, costs, dag, sched))
                        mem_cur[r] += alloc
                        if ins.op != Op.FB:
                            mem_peak[r] = max(mem_peak[r], mem_cur[r])
                        for task in dag.tasks:
                            fside = ins.op != Op.FB or task.side == "F"
                            events.append(TaskEvent(
                                r, task.resource.value, task.name, task.kind.value, task.phase.value,
                                ins.mb if fside else ins.mb2, ins.chunk if fside else ins.chunk2,
                                t + sched.start[task.id], t + sched.end[task.id], i, task.flops))
                    busy[r] += sched.makespan
                    produced[r] = _produced(prog, ins, i, dag, sched, t)
                    end, dp_free[r], exposed = around(dps[r], i, r, t, t + sched.makespan, dp_free[r], collectives)
                    dp_exposed[r] += exposed
                    if record:
                        mem_cur[r] -= free
                        mem_peak[r] = max(mem_peak[r], mem_cur[r])  # a B that keeps more for W than it frees
                elif ins.op in (Op.SLOT, Op.REGISTER_W):
                    if record:
                        marks.append(SlotMark(r, i, ins.op.value, ins.mb, ins.chunk, t))
                elif ins.op == Op.REDUCE_GRADS:  # waits for the rank's gradient reduce-scatters
                    end = max(t, dp_free[r])
                    dp_exposed[r] += end - t
                elif ins.op == Op.OPTIMIZER_STEP:
                    end = t + dps[r].optimizer_ms
                if record:
                    spans.append(InstrSpan(r, i, ins.op.value, str(ins), t, end))
                now[r] = end
                pc[r] += 1
                progressed = True
        if all(pc[r] >= len(p.instructions) for r, p in enumerate(programs)):
            break
        if not progressed:
            raise _deadlock(programs, pc, sent)

    unreceived = [tr for k, tr in sent.items() if k not in received]
    if unreceived:
        tr = unreceived[0]
        raise ProgramError(tr.src, None, f"{len(unreceived)} send(s) never received, e.g. {tr.kind} of mb {tr.mb} "
                                         f"from stage {tr.src_stage} to rank {tr.dst}")
    return max(now, default=0.0), (now, busy, mem_peak, events, spans, sent, marks,
                                   (dp_exposed, [d.optimizer_ms for d in dps], collectives))


def _deadlock(programs: Sequence[Program], pc: list[int], sent: dict[_Key, Transfer]) -> ProgramError:
    blocked = []
    for r, prog in enumerate(programs):
        if pc[r] >= len(prog.instructions):
            continue
        ins = prog.instructions[pc[r]]
        kind, mb, stage = _recv_key(prog, ins, pc[r])
        blocked.append((r, pc[r], f"rank {r} instruction {pc[r]} {ins} waits for the {kind} of mb {mb} "
                                  f"from stage {stage} (rank {ins.peer})"))
    r0, i0, _ = blocked[0]
    return ProgramError(r0, i0, "deadlock, no rank can progress: " + "; ".join(b[2] for b in blocked))


def _result(programs: Sequence[Program], costs: ModelCosts, now: list[float], busy: list[float],
            mem_peak: list[float], events: list[TaskEvent], spans: list[InstrSpan], sent: dict[_Key, Transfer],
            marks: list[SlotMark], dp: tuple[list[float], list[float], list[Collective]]) -> SimResult:
    pp = len(programs)
    dp_exposed, opt_ms, collectives = dp
    iteration = max(now, default=0.0)
    events.sort(key=lambda e: (e.rank, e.start_ms, e.end_ms, e.instr))
    ranks = []
    total_flops = 0.0
    for r, prog in enumerate(programs):
        ev = [e for e in events if e.rank == r]
        comm = [(e.start_ms, e.end_ms) for e in ev if e.resource == Resource.EP_COMM.value]
        comp = [(e.start_ms, e.end_ms) for e in ev if e.resource == Resource.COMPUTE.value]
        static, transient = rank_static_bytes(prog, costs)
        flops = sum(e.flops for e in ev)
        total_flops += flops
        idle = iteration - busy[r] - dp_exposed[r] - opt_ms[r]  # the pipeline bubble: DP/optimizer time is neither
        ranks.append(RankMetrics(r, now[r], busy[r], idle, _length_minus(comm, comp),
                                 (static + transient + mem_peak[r]) / 1e9, static / 1e9, flops,
                                 dp_exposed[r], opt_ms[r]))
    denom = pp * iteration
    return SimResult(
        pp=pp, iteration_ms=iteration, ranks=tuple(ranks),
        bubble_ratio=sum(m.idle_ms for m in ranks) / denom if denom > 0 else 0.0,
        exposed_a2a_ratio=sum(m.exposed_a2a_ms for m in ranks) / denom if denom > 0 else 0.0,
        mfu=total_flops / (denom / 1e3 * costs.peak_flops) if denom > 0 and costs.peak_flops > 0 else 0.0,
        events=tuple(events), spans=tuple(sorted(spans, key=lambda s: (s.rank, s.index))),
        transfers=tuple(sorted(sent.values(), key=lambda x: (x.src, x.start_ms, x.dst))),
        marks=tuple(marks), collectives=tuple(sorted(collectives, key=lambda c: (c.rank, c.start_ms))),
        template=programs[0].template if programs else "", plan_name=programs[0].plan_name if programs else "",
    )
