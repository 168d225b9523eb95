"""A proven lower bound on the iteration time of a set of Programs, and the efficiency figure.

``iteration_lower_bound(programs, costs) -> LowerBound`` returns a time (ms) that no execution
of ``programs`` can beat under the simulator's cost semantics (:mod:`tessera.sim.simulator`):
not the Programs' own instruction order, and not any other order of each rank's instruction list
that :func:`tessera.program.validate.validate_programs` accepts (``tests/test_bound.py`` checks
it against the exact optimum over all orders on small instances). ``efficiency(bound_ms,
simulated_ms)`` is ``bound / simulated`` in ``(0, 1]``; :func:`plan_efficiency` does both for a
simulated plan (what ``tessera plan`` reports).

What the bound sees (all times ms). The *jobs* are the compute instructions (``F``, ``B``,
``W``, ``FB``) of every rank, ``j = (rank, index)``, each with

* ``d_j``: its duration, the makespan of its task DAG in its stored order, exactly what the
  simulator charges (``FB``: the pair at its overlapped cost, :func:`tessera.sched.chunkdag.replay_pair`;
  exposed EP communication is inside it; on its rank's costs, ``ModelCosts.on_rank``, so a slowed
  rank's jobs and optimizer step are as long as the simulator makes them). Under ``dp_shard="fsdp"`` at least the sum of the
  parameter all-gathers it blocks on (they start at the instruction's start, one after another);
* ``h_j``: a *head*, the earliest it can start: the longest path to it in the data-dependency DAG
  of instructions, ``F(m, s-1) -> F(m, s)``, ``F(m, s) -> B(m, s)``, ``B(m, s+1) -> B(m, s)``,
  ``B(m, s) -> W(m, s)`` (``(m, s)``: microbatch and virtual stage; each arc goes from the
  instruction holding one side to the one holding the other; on the same rank the successor
  starts after the whole instruction, across ranks ``costs.p2p_ms`` after the producing side's
  last task (sends are posted when their data is produced: inside an ``FB`` the forward side's
  or the backward side's last B task, :func:`tessera.sim.simulator.side_ends`; else the
  instruction's end)); the path length counts every instruction on it at ``d``. Under ``zero1`` an
  instruction with the forward of chunk ``c`` ends no earlier than ``c``'s parameter all-gather
  (issued at time 0): a successor on the same rank starts no earlier than ``gather_c``; its sends
  do not wait for the gather (the simulator posts them when their data is produced), so a
  successor on another rank gets no such term;
* ``q_j``: a *tail*, the least time from its end to the end of the iteration: the longest path
  from it to a sink, plus the rank's ``optimizer_step`` (always after every compute instruction)
  and, for an instruction holding the weight gradients of chunk ``c``, the chunk's gradient
  reduce-scatter before it (``reduce_grads`` waits for it).

Per rank ``r`` (a rank runs one instruction at a time), Carlier's one-machine bound::

    rank_ms[r] = max over job subsets J of rank r:  min_{j in J} h_j + sum_{j in J} d_j + min_{j in J} q_j

(the first job of ``J`` to start starts after its head; the jobs of ``J`` do not overlap; the last
to end still has its tail ahead). ``J`` = all of the rank's jobs gives the familiar
``fill_ms[r] + work_ms[r] + drain_ms[r]``; a single job gives the critical path through it, so
``critical_path_ms = max_j h_j + d_j + q_j`` (one microbatch forward through every stage and
back, with its p2p transfers) never exceeds the largest ``rank_ms``. Per rank also the
data-parallel link: the gradient reduce-scatters run one at a time, each after the instruction
that issues it, and ``reduce_grads`` then ``optimizer_step`` follow; ``dp_ms[r]`` is Jackson's
bound over them (release: the earliest end of the chunk's weight-gradient instructions).
``ms = max_r max(rank_ms[r], dp_ms[r])``.

Why each term is a true lower bound for every valid order: the validator requires every forward
to have its input (a preceding ``recv_act`` or a local forward earlier on the rank), every
backward its gradient and its own forward, every ``W`` its ``B``, and a send to follow the
computation it sends; a receive blocks until its transfer arrived, which is at least
``p2p_ms`` after the send was issued; ``reduce_grads`` and ``optimizer_step`` end every Program.
So every arc of the DAG holds in every execution, durations are never shorter than ``d_j``,
and a rank's instructions never overlap. What it ignores (each only makes executions slower, so
leaving it out keeps the bound valid and makes it looser): p2p link queueing (transfers of one
link serialise), the zero1 gathers beyond ``gather_c`` (gathers queue on the link) and the
FSDP gathers' waits for the link, data-parallel collectives of other chunks competing with the
reduce-scatter, and any order-dependent delay. A rank's W tasks are not movable into its idle
time beyond what its ``W`` instructions already are.

Shapes: ``work_ms``, ``fill_ms``, ``drain_ms``, ``rank_ms``, ``dp_ms`` hold one value per rank
(index = rank). Cost: one task-DAG evaluation per distinct compute instruction (as the
simulator does) and an ``O(n^2)`` pass per rank over its ``n`` compute instructions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tessera.cost.types import ModelCosts
from tessera.program.instructions import COMPUTE_OPS, Instr, Op, Program
from tessera.sim.dpsync import rank_dp
from tessera.sim.result import SimResult
from tessera.sim.simulator import _compute_dag, side_ends, simulate  # the simulator's own expansion of an instruction

_TOL = 1e-9  # relative: a bound above the simulated time by more than this is a bug


@dataclass(frozen=True)
class LowerBound:
    """A lower bound on one iteration's time, ms (module docstring).

    Attributes:
        ms: the bound, ``max(rank_ms + dp_ms)``.
        busiest_rank: the rank whose bound is ``ms`` (the lowest such rank).
        work_ms: per rank, the sum of its compute instructions' durations.
        fill_ms: per rank, the earliest any of its compute instructions can start.
        drain_ms: per rank, the least time from the end of any of its compute instructions to the
            iteration's end (the optimizer step included).
        rank_ms: per rank, the one-machine bound over subsets of its compute instructions (at
            least ``fill + work + drain``).
        dp_ms: per rank, the data-parallel link bound (reduce-scatters, then the optimizer step;
            0 when the costs model no data parallelism).
        critical_path_ms: the longest chain of dependent instructions, its transfers and its tail.
    """

    ms: float
    busiest_rank: int
    work_ms: tuple[float, ...]
    fill_ms: tuple[float, ...]
    drain_ms: tuple[float, ...]
    rank_ms: tuple[float, ...]
    dp_ms: tuple[float, ...]
    critical_path_ms: float

    @property
    def simple_ms(self) -> float:
        """``max_r fill_ms[r] + work_ms[r] + drain_ms[r]`` (the bound without the subset search)."""
        return max((f + w + d for f, w, d in zip(self.fill_ms, self.work_ms, self.drain_ms)), default=0.0)

    def describe(self) -> str:
        """One line, e.g. ``"1543.3 ms (rank 1: work 1435 + unavoidable wait 108.37)"`` (5
        significant digits; the wait is the fill, drain and subset terms of the busiest rank)."""
        if not self.work_ms:
            return f"{self.ms:.5g} ms"
        r = self.busiest_rank
        wait = self.ms - self.work_ms[r]
        return f"{self.ms:.5g} ms (rank {r}: work {self.work_ms[r]:.5g} + unavoidable wait {wait:.5g})"


@dataclass(frozen=True)
class PlanEfficiency:
    """A simulated plan against its lower bound: ``efficiency = bound.ms / simulated_ms``."""

    bound: LowerBound
    simulated_ms: float
    efficiency: float

    def describe(self) -> str:
        """One line for the command line, e.g. ``"lower bound 1543.3 ms (rank 1: ...), efficiency 93.0%"``."""
        return f"lower bound {self.bound.describe()}, efficiency {self.efficiency:.1%}"


def _durations(programs: Sequence[Program], costs: ModelCosts) -> tuple[list[dict[int, float]],
                                                                          list[dict[int, tuple[float, float]]]]:
    """Per rank: compute instruction index -> duration lower bound, ms (module docstring); and
    -> (forward side, backward side) ends from its start (what its sends wait for: the
    simulator's :func:`~tessera.sim.simulator.side_ends` for ``FB``, the duration otherwise)."""
    cache: dict = {}
    out, ends = [], []
    for prog in programs:
        rdp = rank_dp(prog, costs)
        dur, side = {}, {}
        for i, ins in enumerate(prog.instructions):
            if ins.op in COMPUTE_OPS:
                dag, sched = _compute_dag(prog, ins, costs, i, cache)
                d = sched.makespan
                if not rdp.from_start:  # fsdp: the blocking gathers start at the instruction's start
                    d = max(d, sum(ms for _, _, ms in rdp.blocking.get(i, ())))
                dur[i] = d
                side[i] = side_ends(dag, sched) if ins.op == Op.FB else (sched.makespan, sched.makespan)
        out.append(dur)
        ends.append(side)
    return out, ends


def _sides(prog: Program, ins: Instr) -> tuple[tuple | None, tuple | None, tuple | None]:
    """(mb, stage) of the forward, backward and weight-gradient work ``ins`` holds (None: none)."""
    st = prog.stages
    f = (ins.mb, st[ins.chunk].stage) if ins.op in (Op.F, Op.FB) else None
    b = ((ins.mb, st[ins.chunk].stage) if ins.op == Op.B else
         (ins.mb2, st[ins.chunk2].stage) if ins.op == Op.FB else None)
    w = (ins.mb, st[ins.chunk].stage) if ins.op == Op.W else b if ins.with_w else None
    return f, b, w


def _one_machine(head: np.ndarray, dur: np.ndarray, tail: np.ndarray) -> float:
    """``max over subsets J: min head + sum dur + min tail`` (Carlier): for thresholds ``(a, b)``
    the best J is every job with ``head >= a`` and ``tail >= b``; per ``b``, one pass over the
    jobs by decreasing head."""
    best = 0.0
    for b in np.unique(tail):
        sel = tail >= b
        h, dd = head[sel], dur[sel]
        by = np.argsort(-h, kind="stable")
        best = max(best, float((h[by] + np.cumsum(dd[by])).max() + b))
    return best


def _jackson(release: list[float], dur: list[float]) -> float:
    """Least end of one-at-a-time jobs with release times (``max_a a + sum(dur: release >= a)``)."""
    return max((a + sum(d for r, d in zip(release, dur) if r >= a) for a in release), default=0.0)


def iteration_lower_bound(programs: Sequence[Program], costs: ModelCosts) -> LowerBound:
    """A lower bound on the simulated iteration time of ``programs`` under any valid order of each
    rank's instructions (module docstring for the formula).

    Args:
        programs: one Program per rank (index = rank), valid (``validate_programs``).
        costs: the costs their stage ranges refer to.

    Returns:
        :class:`LowerBound`, ms.

    Raises:
        ValueError: a microbatch's forward or backward is missing or the data dependencies form a
            cycle (Programs the validator rejects).
        ProgramError: an instruction the simulator cannot expand (unknown chunk or pair order).
    """
    pp = len(programs)
    dur, ends = _durations(programs, costs)
    owner = {s.stage: p.rank for p in programs for s in p.stages}
    jobs: list[tuple[int, int]] = [(r, i) for r in range(pp) for i in sorted(dur[r])]
    index = {j: k for k, j in enumerate(jobs)}
    n = len(jobs)
    d = np.array([dur[r][i] for r, i in jobs], dtype=float)
    f_at: dict[tuple, int] = {}
    b_at: dict[tuple, int] = {}
    w_at: dict[tuple, int] = {}
    gather_end = np.zeros(n)  # zero1: an instruction with chunk c's forward ends after c's gather
    terminal = np.zeros(n)  # time after the instruction that its rank still needs for sure
    dps = [rank_dp(p, costs) for p in programs]
    reduce_of: list[dict[int, float]] = []
    for r, prog in enumerate(programs):
        gather = {s.chunk: sum(costs.layer(l).dp.gather_ms for l in range(s.start, s.stop)) for s in prog.stages}
        reduce_of.append({s.chunk: sum(costs.layer(l).dp.reduce_ms for l in range(s.start, s.stop))
                          for s in prog.stages})
        for i in sorted(dur[r]):
            k, ins = index[(r, i)], prog.instructions[i]
            f, b, w = _sides(prog, ins)
            for table, key in ((f_at, f), (b_at, b), (w_at, w)):
                if key is not None:
                    table[key] = k
            if f is not None and dps[r].from_start:
                gather_end[k] = gather[ins.chunk]
            terminal[k] = dps[r].optimizer_ms
            wc = ins.chunk2 if ins.op == Op.FB else ins.chunk
            if w is not None and reduce_of[r][wc] > 0:
                terminal[k] += reduce_of[r][wc]
    last = len(owner) - 1
    p2p = costs.p2p_ms
    succ: list[list[tuple[int, float]]] = [[] for _ in range(n)]

    def arc(u_key: tuple, u_table: dict, v: int, s_u: int, s_v: int, side: int) -> None:
        """``v`` starts at least ``w`` after ``u`` starts: on another rank when ``u``'s side has
        produced the data plus the transfer (early sends), on the same rank after ``u``."""
        if u_key not in u_table:
            raise ValueError(f"mb{u_key[0]} at stage {u_key[1]} has no instruction computing it")
        u = u_table[u_key]
        remote = owner[s_u] != owner[s_v]
        succ[u].append((v, ends[jobs[u][0]][jobs[u][1]][side] + p2p if remote else d[u], not remote))

    for (m, s), k in f_at.items():
        if s > 0:
            arc((m, s - 1), f_at, k, s - 1, s, 0)
    for (m, s), k in b_at.items():
        arc((m, s), f_at, k, s, s, 0)
        if s < last:
            arc((m, s + 1), b_at, k, s + 1, s, 1)
    for (m, s), k in w_at.items():
        if b_at.get((m, s)) != k:
            arc((m, s), b_at, k, s, s, 1)
    indeg = [0] * n
    for u in range(n):
        for v, _, _ in succ[u]:
            indeg[v] += 1
    topo = [u for u in range(n) if indeg[u] == 0]
    for u in topo:  # Kahn's algorithm; the list grows while it is read
        for v, _, _ in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                topo.append(v)
    if len(topo) != n:
        raise ValueError("the Programs' data dependencies form a cycle (the validator rejects them)")
    head = np.zeros(n)
    for u in topo:
        # the gather delays the instruction's end, not its start nor its sends (the simulator
        # posts a send when its data is produced): only a successor on the same rank waits for it
        for v, w, local in succ[u]:
            head[v] = max(head[v], max(head[u] + w, gather_end[u]) if local else head[u] + w)
    tail = terminal.copy()
    for u in reversed(topo):
        for v, w, _ in succ[u]:
            tail[u] = max(tail[u], w - d[u] + d[v] + tail[v])
    work, fill, drain, rank_ms, dp_ms = [], [], [], [], []
    for r in range(pp):
        ks = np.array([index[(r, i)] for i in sorted(dur[r])], dtype=int)
        opt = dps[r].optimizer_ms
        if len(ks) == 0:  # no compute (the validator rejects it): only the optimizer step
            work.append(0.0)
            fill.append(0.0)
            drain.append(opt)
            rank_ms.append(opt)
            dp_ms.append(opt)
            continue
        work.append(float(d[ks].sum()))
        fill.append(float(head[ks].min()))
        drain.append(float(tail[ks].min()))
        rank_ms.append(_one_machine(head[ks], d[ks], tail[ks]))
        # the data-parallel link: one reduce-scatter per chunk (zero1, after its last W
        # instruction) or per W instruction (fsdp), one at a time, then the optimizer step
        release: dict = {}
        for k in ks:
            ins = programs[r].instructions[jobs[k][1]]
            if _sides(programs[r], ins)[2] is None:
                continue
            c = ins.chunk2 if ins.op == Op.FB else ins.chunk
            if reduce_of[r][c] > 0:
                key = c if dps[r].from_start else (c, int(k))
                release[key] = max(release.get(key, 0.0), float(head[k] + d[k]))
        keys = list(release)
        link = _jackson([release[k] for k in keys], [reduce_of[r][k if dps[r].from_start else k[0]] for k in keys])
        dp_ms.append(link + opt)
    per_rank = [max(a, b) for a, b in zip(rank_ms, dp_ms)]
    ms = max(per_rank, default=0.0)
    critical = float((head + d + tail).max()) if n else 0.0
    return LowerBound(ms, per_rank.index(ms) if per_rank else 0, tuple(work), tuple(fill), tuple(drain),
                      tuple(rank_ms), tuple(dp_ms), critical)


def efficiency(bound_ms: float, simulated_ms: float) -> float:
    """``bound_ms / simulated_ms``, in ``(0, 1]`` (1: the schedule is provably optimal for its
    instructions).

    Raises:
        ValueError: ``simulated_ms <= 0``, ``bound_ms <= 0``, or the bound exceeds the simulated
            time by more than a relative 1e-9 (not a lower bound: a bug).
    """
    if simulated_ms <= 0 or bound_ms <= 0:
        raise ValueError(f"efficiency needs positive times (bound {bound_ms} ms, simulated {simulated_ms} ms)")
    if bound_ms > simulated_ms * (1 + _TOL):
        raise ValueError(f"lower bound {bound_ms} ms exceeds the simulated iteration {simulated_ms} ms")
    return min(1.0, bound_ms / simulated_ms)


def plan_efficiency(programs: Sequence[Program], costs: ModelCosts, result: SimResult | None = None) -> PlanEfficiency:
    """The lower bound of ``programs`` on ``costs`` and the efficiency of their simulated iteration
    (``result``, from :func:`tessera.sim.simulator.simulate`; simulated here when None)."""
    if result is None:
        result = simulate(programs, costs)
    lb = iteration_lower_bound(programs, costs)
    return PlanEfficiency(lb, result.iteration_ms, efficiency(lb.ms, result.iteration_ms))
