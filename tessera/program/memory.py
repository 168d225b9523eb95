"""The Program memory rule: each rank's peak memory under its Program, from the cost model's
per-layer memory (no simulation needed: the order of a rank's instructions, and inside an ``FB``
its pair's task order, fix the peak).

Accounting (bytes; the simulator, :mod:`tessera.sim.simulator`, and the planner's exact memory
rows, :func:`tessera.plan.candidates.exact_candidate_memory`, count the same):

* static: ``LayerMemory.static`` of every extended layer on the rank, plus the largest
  ``LayerMemory.transient`` among them (FSDP's all-gathered parameters and unsharded gradient of
  the layer being computed; 0 without FSDP);
* ``F`` allocates its chunk's ``activation`` at its start; ``B`` frees ``activation -
  w_activation`` at its end (everything with ``with_w``); ``W`` frees ``w_activation``;
* ``FB`` (an overlapped pair) holds, on top of what was live before it, the peak of
  :func:`pair_peak_bytes`: its forward allocates each layer's activation when that layer's first
  F task starts, its backward frees each layer's ``activation - w_activation`` when that layer's
  last B task ends and, with ``with_w``, the ``w_activation`` when its last W task ends, all at
  the times of the pair's schedule (the Program's pair order replayed, or the template's fixed
  order). That is never more than the older "F's whole activation at the FB's start" and less
  wherever the backward frees layers before the forward has allocated all of its own.

The peak is taken at every instruction boundary and inside every ``FB``, so a backward that keeps
more for its deferred W than it frees (``w_activation > activation`` under recompute) counts too.

The recipe-facing check (capacity, margin, fixes in recipe terms) is
:func:`tessera.config.validate.validate_memory`.
"""

from __future__ import annotations

from typing import Sequence

from tessera.cost.types import ModelCosts
from tessera.errors import ProgramError
from tessera.program.instructions import Instr, Op, Program, StageRef
from tessera.sched.chunkdag import replay_pair
from tessera.sched.dag import TaskDAG, TaskSchedule
from tessera.spec.tasks import Phase


def pair_peak_bytes(costs: ModelCosts, dag: TaskDAG, schedule: TaskSchedule, f_range: tuple[int, int],
                    b_range: tuple[int, int], with_w: bool) -> float:
    """The most activation bytes an overlapped F&B pair holds above what was live before it
    (module docstring), >= 0.

    Args:
        costs: per-layer ``LayerMemory`` (``activation``, ``w_activation``).
        dag, schedule: the pair DAG (:func:`tessera.sched.chunkdag.pair_dag`) and its schedule
            (task start/end times, ms).
        f_range, b_range: extended layer ranges of the forward and backward chunks.
        with_w: the backward chunk's W tasks run inside the pair (and free ``w_activation``).

    Events at equal times free before they allocate (a task's memory is released when it ends,
    before the next task on that stream starts). A forward layer with no task in the DAG
    allocates at the pair's start, a backward layer with none frees at its end (conservative).
    """
    f_start: dict[int, float] = {}
    b_end: dict[int, float] = {}
    w_end: dict[int, float] = {}
    for t in dag.tasks:
        s, e = schedule.start[t.id], schedule.end[t.id]
        if t.side == "F":
            f_start[t.layer] = min(f_start.get(t.layer, s), s)
        elif t.phase == Phase.W:
            w_end[t.layer] = max(w_end.get(t.layer, e), e)
        else:
            b_end[t.layer] = max(b_end.get(t.layer, e), e)
    events: list[tuple[float, int, float]] = []  # (time ms, 0 free / 1 allocate, +bytes)
    for layer in range(*f_range):
        events.append((f_start.get(layer, 0.0), 1, costs.layer(layer).memory.activation))
    for layer in range(*b_range):
        m = costs.layer(layer).memory
        tb = b_end.get(layer, schedule.makespan)
        events.append((tb, 0, -(m.activation - m.w_activation)))
        if with_w:
            events.append((w_end.get(layer, tb), 0, -m.w_activation))
    cur = peak = 0.0
    for _, _, delta in sorted(events, key=lambda ev: (ev[0], ev[1])):
        cur += delta
        peak = max(peak, cur)
    return peak


def _stage(prog: Program, chunk: int) -> StageRef:
    for s in prog.stages:
        if s.chunk == chunk:
            return s
    raise ProgramError(prog.rank, None, f"chunk {chunk} is not one of the rank's stages "
                                        f"{[s.chunk for s in prog.stages]}")


def fb_schedule(prog: Program, ins: Instr, costs: ModelCosts) -> tuple[TaskDAG, TaskSchedule]:
    """The pair DAG and schedule of an ``FB`` instruction, as the simulator runs it: the
    Program's ``pair_orders[ins.order]`` replayed (``order == -1``: the template's fixed order).

    Raises:
        ProgramError: an unknown chunk or pair order, or an order the DAG contradicts.
    """
    fs, bs = _stage(prog, ins.chunk), _stage(prog, ins.chunk2)
    order, overlapped = None, True
    if ins.order >= 0:
        if ins.order >= len(prog.pair_orders):
            raise ProgramError(prog.rank, None, f"{ins}: pair order #{ins.order} does not exist")
        po = prog.pair_orders[ins.order]
        order, overlapped = po.order, po.overlapped
    try:
        return replay_pair(costs, (fs.start, fs.stop), (bs.start, bs.stop), ins.with_w, order, overlapped)
    except ValueError as e:
        raise ProgramError(prog.rank, None, f"{ins}: {e}") from None


def fb_peak_bytes(prog: Program, ins: Instr, costs: ModelCosts, dag: TaskDAG, schedule: TaskSchedule) -> float:
    """:func:`pair_peak_bytes` of an ``FB`` instruction of ``prog`` under ``schedule``."""
    fs, bs = _stage(prog, ins.chunk), _stage(prog, ins.chunk2)
    return pair_peak_bytes(costs, dag, schedule, (fs.start, fs.stop), (bs.start, bs.stop), ins.with_w)


def _fb_peak(prog: Program, ins: Instr, costs: ModelCosts, shared: dict) -> float:
    """:func:`fb_peak_bytes` of an ``FB`` under its own schedule, memoised in ``shared`` by
    content: the two chunks' layer ranges, ``with_w`` and the pair order (or the fixed order), and
    the rank's compute factor (the schedule is the rank's, ``ModelCosts.on_rank``, as the
    simulator runs it)."""
    fs, bs = _stage(prog, ins.chunk), _stage(prog, ins.chunk2)
    po = prog.pair_orders[ins.order] if 0 <= ins.order < len(prog.pair_orders) else None
    scale = costs.scale_of(prog.rank)
    key = ((fs.start, fs.stop), (bs.start, bs.stop), ins.with_w, ins.order >= 0,
           None if po is None else (po.order, po.overlapped)) + ((scale,) if scale != 1.0 else ())
    if key not in shared:
        if costs.rank_scale and ("rank_costs", scale) not in shared:
            shared[("rank_costs", scale)] = costs.on_rank(prog.rank)
        rc = shared[("rank_costs", scale)] if costs.rank_scale else costs
        shared[key] = fb_peak_bytes(prog, ins, rc, *fb_schedule(prog, ins, rc))
    return shared[key]


def rank_static_bytes(prog: Program, costs: ModelCosts) -> tuple[float, float]:
    """(static, transient) bytes of a rank: ``LayerMemory.static`` summed over its extended
    layers, and the largest ``LayerMemory.transient`` among them."""
    mems = [costs.layer(i).memory for st in prog.stages for i in range(st.start, st.stop)]
    return sum(m.static for m in mems), max((m.transient for m in mems), default=0.0)


def rank_memory_bytes(programs: Sequence[Program], costs: ModelCosts, cache: dict | None = None) -> tuple[float, ...]:
    """Peak memory of each rank under its Program, bytes (module docstring): static memory and
    the largest transient of its layers plus the peak of live activations, exactly as the
    simulator counts it.

    ``cache``: a dict the caller keeps across calls with the *same* ``costs`` (the planner's
    iteration search), holding each ``FB``'s own peak by content (its two layer ranges, W, and
    its pair order), so a pair is replayed once; ``None``: nothing is kept.

    Raises:
        ProgramError: an ``FB`` names an unknown chunk or pair order.
    """
    shared: dict = {} if cache is None else cache
    out = []
    for prog in programs:
        chunk_mem = {}
        for st in prog.stages:
            mems = [costs.layer(i).memory for i in range(st.start, st.stop)]
            chunk_mem[st.chunk] = (sum(m.activation for m in mems), sum(m.w_activation for m in mems))
        static, transient = rank_static_bytes(prog, costs)
        inner: dict[tuple, float] = {}  # FB instruction shape -> pair peak (bytes)
        cur = peak = 0.0
        for ins in prog.instructions:
            if ins.op == Op.FB:
                key = (ins.chunk, ins.chunk2, ins.with_w, ins.order)
                if key not in inner:
                    inner[key] = _fb_peak(prog, ins, costs, shared)
                peak = max(peak, cur + inner[key])
                cur += chunk_mem[ins.chunk][0]
            elif ins.op == Op.F:
                cur += chunk_mem[ins.chunk][0]  # allocated at the instruction's start
                peak = max(peak, cur)
            if ins.op in (Op.B, Op.FB):
                act, w = chunk_mem[ins.chunk if ins.op == Op.B else ins.chunk2]
                cur -= act if ins.with_w else act - w  # negative when recompute keeps more for W
            elif ins.op == Op.W:
                cur -= chunk_mem[ins.chunk][1]
            peak = max(peak, cur)
        out.append(static + transient + peak)
    return tuple(out)
