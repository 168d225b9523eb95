"""The critical path of a simulated iteration: the chain of tasks, pipeline transfers and waits that
sets its makespan, and so tells which task made a rank late.

:func:`critical_path` walks back from the end of the iteration (the end of the rank that finishes
last) and at every step takes the predecessor that ended exactly when the current link started,
following the simulator's own rules (:mod:`tessera.sim.simulator`):

* inside a compute instruction (F, B, W, FB): the task of the same instruction that ended when
  this task started (a dependency in the task DAG, or the previous task on its resource); the
  instruction's first task leads to the rank's previous instruction, which ended when this one
  started (a rank runs its instructions in order);
* a receive that blocked: the transfer that arrived when it ended; a transfer that waited for its
  link: the transfer before it on that link; otherwise the task on the sending rank that produced
  its data (the end of the forward side's last task for an activation, of the backward side's last
  B task for a gradient), or the instruction the sender was running when it posted it;
* time inside an instruction that no task explains (a compute instruction waiting for a
  data-parallel all-gather, ``reduce_grads`` waiting for reduce-scatters, ``optimizer_step``): the
  instruction itself.

Ties (two tasks ending at the same instant) go to the longer task, then the compute resource,
then the name: any of them ends there, so the path stays a chain of real waits. The links are
contiguous: the first starts at 0, each starts where the one before it ended, the last ends at
``iteration_ms`` (within :data:`EPS_REL` of the iteration).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tessera.sim.result import InstrSpan, SimResult, TaskEvent, Transfer

COMPUTE_OPS = ("F", "B", "W", "FB")
RECV_OPS = {"recv_act": "act", "recv_grad": "grad"}
EPS_REL = 1e-9
"""Times closer than this fraction of the iteration (at least of 1 ms) count as equal."""
_RECV = re.compile(r"mb(\d+)\..*<- r(\d+)")


@dataclass(frozen=True)
class PathStep:
    """One link of the critical path.

    Attributes:
        kind: ``"task"`` (a :class:`~tessera.sim.result.TaskEvent`), ``"transfer"`` (a pipeline
            :class:`~tessera.sim.result.Transfer`) or ``"instruction"`` (time of an instruction
            that no task explains: a data-parallel wait, the optimizer step).
        rank: the rank it ran on (a transfer: the sender).
        start_ms, end_ms: its interval, ms from the iteration's start.
        name: the task's name (``"F.L3.dispatch"``), ``"act mb3"`` / ``"grad mb3"`` for a
            transfer, the instruction's text for an instruction.
        instr: index of the instruction on ``rank`` (-1 for a transfer).
        resource: ``"compute"``, ``"ep_comm"``, ``"pp_comm"`` (transfers) or ``""`` (instructions).
        phase: ``"F"``, ``"B"`` or ``"W"`` for a task, else ``""``.
        mb: the task's or transfer's microbatch (-1 for an instruction).
        peer: a transfer's receiving rank (-1 otherwise).
    """

    kind: str
    rank: int
    start_ms: float
    end_ms: float
    name: str
    instr: int = -1
    resource: str = ""
    phase: str = ""
    mb: int = -1
    peer: int = -1

    def to_dict(self) -> dict:
        return asdict(self)


def _task(e: TaskEvent) -> PathStep:
    return PathStep("task", e.rank, e.start_ms, e.end_ms, e.name, e.instr, e.resource, e.phase, e.mb)


def _transfer(t: Transfer) -> PathStep:
    return PathStep("transfer", t.src, t.start_ms, t.end_ms, f"{t.kind} mb{t.mb}", -1, "pp_comm", "", t.mb, t.dst)


def _instruction(s: InstrSpan, start: float, end: float) -> PathStep:
    return PathStep("instruction", s.rank, start, end, s.text, s.index)


def _tie_key(e: TaskEvent):
    return (-(e.end_ms - e.start_ms), e.resource != "compute", e.name)


def critical_path(result: SimResult) -> tuple[PathStep, ...]:
    """The critical path of ``result`` in time order (module docstring); empty for an empty result.

    Raises:
        RuntimeError: the walk does not reach the iteration's start (a result not made by
            :func:`tessera.sim.simulator.simulate`).
    """
    spans: dict[int, list[InstrSpan]] = {}
    for s in sorted(result.spans, key=lambda s: (s.rank, s.index)):
        spans.setdefault(s.rank, []).append(s)
    if not spans:
        return ()
    eps = EPS_REL * max(1.0, result.iteration_ms)
    tasks: dict[tuple[int, int], list[TaskEvent]] = {}
    for e in result.events:
        if e.end_ms > e.start_ms:
            tasks.setdefault((e.rank, e.instr), []).append(e)

    def running_at(rank: int, t: float) -> int:
        """Position of the rank's instruction running just before ``t`` (0 at the start)."""
        ss = spans[rank]
        for i in range(len(ss) - 1, -1, -1):
            if ss[i].start_ms < t - eps and ss[i].end_ms > ss[i].start_ms:
                return i
        return 0

    def arrived(span: InstrSpan) -> Transfer | None:
        kind = RECV_OPS[span.op]
        m = _RECV.search(span.text)
        cands = [t for t in result.transfers if t.dst == span.rank and t.kind == kind
                 and abs(t.end_ms - span.end_ms) <= eps]
        if m is not None:
            cands = [t for t in cands if (t.mb, t.src) == (int(m.group(1)), int(m.group(2)))] or cands
        return min(cands, key=lambda t: (t.src, t.start_ms), default=None)

    last = max(spans, key=lambda r: (spans[r][-1].end_ms, -r))
    rank, pos, t = last, len(spans[last]) - 1, spans[last][-1].end_ms
    path: list[PathStep] = []
    budget = 4 * (len(result.spans) + len(result.events) + len(result.transfers)) + 8
    while budget > 0:
        budget -= 1
        span = spans[rank][pos]
        if t <= span.start_ms + eps:  # nothing of this instruction before t: the rank's previous one
            if pos == 0:
                return tuple(reversed(path))
            pos -= 1
            continue
        if span.op in COMPUTE_OPS:
            ending = [e for e in tasks.get((rank, span.index), ()) if abs(e.end_ms - t) <= eps]
            if ending:
                e = min(ending, key=_tie_key)
                path.append(_task(e))
                t = e.start_ms
            else:  # no task ends here: a data-parallel wait (or a gap in the pair's schedule)
                path.append(_instruction(span, span.start_ms, t))
                t = span.start_ms
            continue
        if span.op in RECV_OPS:
            tr = arrived(span) if abs(t - span.end_ms) <= eps else None
            if tr is not None:
                path.append(_transfer(tr))
                while tr.start_ms > tr.issue_ms + eps:  # the link was busy: the transfer before it
                    prev = [x for x in result.transfers if (x.src, x.dst) == (tr.src, tr.dst)
                            and abs(x.end_ms - tr.start_ms) <= eps]
                    if not prev:
                        break
                    tr = min(prev, key=lambda x: (x.start_ms, x.kind, x.mb))
                    path.append(_transfer(tr))
                rank, t = tr.src, min(tr.start_ms, tr.issue_ms)
                pos = running_at(rank, t)
                continue
        path.append(_instruction(span, span.start_ms, t))
        t = span.start_ms
    raise RuntimeError(f"critical path: the walk back from the end of rank {last} did not reach the iteration's start "
                       f"(stuck at rank {rank} instruction {spans[rank][pos].index}, {t:.6f} ms); pass a SimResult "
                       "made by tessera.sim.simulator.simulate")


def critical_ms_by_rank(path: tuple[PathStep, ...]) -> dict[int, float]:
    """Time of the path on each rank's tasks and instructions, ms (transfers counted on neither end)."""
    out: dict[int, float] = {}
    for s in path:
        if s.kind != "transfer":
            out[s.rank] = out.get(s.rank, 0.0) + s.end_ms - s.start_ms
    return out
