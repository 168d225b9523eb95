"""Chrome trace (``chrome://tracing`` / Perfetto) export of a simulated iteration.

One process per rank (``pid`` = rank, named ``"rank r"``), one thread per resource (``tid`` 0
compute, 1 EP comm, 2 PP comm, 3 instructions, 4 DP comm), one complete ("X") event per task with
``ts`` and ``dur`` in microseconds. Point-to-point transfers appear on the sender's PP-comm thread
with category ``"p2p"``; instruction spans on the instruction thread with category ``"instr"``;
data-parallel collectives on the DP-comm thread with category ``"dp"``.
:func:`pair_trace` exports the per-task schedule of one overlapped F&B pair the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tessera.sched.dag import TaskDAG, TaskSchedule
from tessera.sim.result import SimResult
from tessera.spec.tasks import Resource

_TIDS = {Resource.COMPUTE.value: 0, Resource.EP_COMM.value: 1, Resource.PP_COMM.value: 2}
_INSTR_TID = 3
_DP_TID = 4


def chrome_trace(result: SimResult) -> dict:
    """The trace as a dict ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Task events have ``cat == "task"`` (exactly one per ``result.events`` entry)."""
    ev: list[dict] = []
    for r in range(result.pp):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for res, tid in _TIDS.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": res}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": _INSTR_TID, "args": {"name": "instructions"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": _DP_TID, "args": {"name": "dp_comm"}})
    for e in result.events:
        ev.append({"ph": "X", "cat": "task", "name": e.name, "pid": e.rank, "tid": _TIDS.get(e.resource, 0),
                   "ts": e.start_ms * 1e3, "dur": (e.end_ms - e.start_ms) * 1e3,
                   "args": {"kind": e.kind, "phase": e.phase, "mb": e.mb, "chunk": e.chunk, "instr": e.instr}})
    for t in result.transfers:
        ev.append({"ph": "X", "cat": "p2p", "name": f"send_{t.kind} mb{t.mb} S{t.src_stage}->r{t.dst}",
                   "pid": t.src, "tid": _TIDS[Resource.PP_COMM.value], "ts": t.start_ms * 1e3,
                   "dur": (t.end_ms - t.start_ms) * 1e3, "args": {"issue_ms": t.issue_ms, "dst": t.dst}})
    for c in result.collectives:
        ev.append({"ph": "X", "cat": "dp", "name": f"{c.kind} c{c.chunk}", "pid": c.rank, "tid": _DP_TID,
                   "ts": c.start_ms * 1e3, "dur": (c.end_ms - c.start_ms) * 1e3, "args": {"instr": c.instr}})
    for s in result.spans:
        ev.append({"ph": "X", "cat": "instr", "name": s.text, "pid": s.rank, "tid": _INSTR_TID,
                   "ts": s.start_ms * 1e3, "dur": (s.end_ms - s.start_ms) * 1e3, "args": {"index": s.index}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"iteration_ms": result.iteration_ms, "bubble_ratio": result.bubble_ratio,
                          "template": result.template, "plan_name": result.plan_name}}


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` (parent folders created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace(result)))
    return p


def pair_trace(dag: TaskDAG, schedule: TaskSchedule, title: str = "pair") -> dict:
    """Chrome trace of one scheduled F&B pair (:func:`tessera.plan.pair_scheduler.schedule_pair`
    or any ``run_in_order`` result): one process named ``title``, one thread per resource its
    tasks use (ids as :func:`chrome_trace`), one complete event per task (``ts``/``dur`` in microseconds, ``args``:
    kind, phase, layer, side (``"F"``/``"B"``), movable, deadline_ms).

    Raises:
        ValueError: ``schedule`` does not time every task of ``dag``.
    """
    if len(schedule.start) != len(dag.tasks) or len(schedule.end) != len(dag.tasks):
        raise ValueError(f"schedule times {len(schedule.start)} tasks, the DAG has {len(dag.tasks)}")
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": title}}]
    used = {t.resource.value for t in dag.tasks}
    for res, tid in _TIDS.items():
        if res in used:
            ev.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": res}})
    for t in dag.tasks:
        ev.append({"ph": "X", "cat": "task", "name": t.name, "pid": 0, "tid": _TIDS.get(t.resource.value, 0),
                   "ts": schedule.start[t.id] * 1e3, "dur": (schedule.end[t.id] - schedule.start[t.id]) * 1e3,
                   "args": {"kind": t.kind.value, "phase": t.phase.value, "layer": t.layer, "side": t.side,
                            "movable": t.movable, "deadline_ms": t.deadline_ms}})
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"makespan_ms": schedule.makespan, "title": title}}


def write_pair_trace(dag: TaskDAG, schedule: TaskSchedule, path: str | Path, title: str = "pair") -> Path:
    """Write :func:`pair_trace` as JSON to ``path`` (parent folders created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(pair_trace(dag, schedule, title)))
    return p
