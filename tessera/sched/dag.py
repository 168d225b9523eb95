"""Task DAGs and their execution in a fixed per-resource order.

A :class:`TaskDAG` is what the overlap graph gives for one chunk or one overlapped F&B pair;
:func:`run_in_order` executes it on one rank's resources (one compute stream, one EP
communication stream, one PP communication stream), each resource running its tasks strictly in
the given order, every task starting when its resource is free and its dependencies are done.
The pair scheduler chooses orders; the simulator and the engine replay them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tessera.spec.tasks import Phase, Resource, TaskKind


@dataclass(frozen=True)
class Task:
    """One node of a TaskDAG.

    Attributes:
        id: position in ``TaskDAG.tasks``.
        name: readable id, e.g. ``"F.L12.dispatch"``; unique within a DAG of
            :mod:`tessera.sched.chunkdag` (a repeated kind of a layer gets ``"#1"``, ``"#2"``, ...).
        kind, phase, resource: see :mod:`tessera.spec.tasks`.
        ms: duration, milliseconds.
        deps: ids of tasks that must finish first.
        layer: decoder layer index (-1 embedding, num_layers head).
        side: ``"F"`` or ``"B"``: which chunk of a pair the task belongs to (W tasks: ``"B"``).
        movable: a W task; nothing waits for it, it may run in any gap before ``deadline_ms``.
        deadline_ms: latest finish for a movable task (``None``: the DAG's makespan).
        mem_bytes: memory held from the end of this task's B counterpart until it runs (W tasks).
        flops: model FLOPs of the task.
    """

    id: int
    name: str
    kind: TaskKind
    phase: Phase
    resource: Resource
    ms: float
    deps: tuple[int, ...] = ()
    layer: int = 0
    side: str = "F"
    movable: bool = False
    deadline_ms: float | None = None
    mem_bytes: float = 0.0
    flops: float = 0.0


@dataclass(frozen=True)
class TaskDAG:
    """An immutable DAG of tasks; ``tasks[i].id == i`` and deps point to smaller or larger ids
    freely (use :meth:`topo_order`)."""

    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def successors(self) -> tuple[tuple[int, ...], ...]:
        succ: list[list[int]] = [[] for _ in self.tasks]
        for t in self.tasks:
            for d in t.deps:
                succ[d].append(t.id)
        return tuple(tuple(s) for s in succ)

    def topo_order(self) -> tuple[int, ...]:
        """Kahn's algorithm, ties broken by id. Raises ValueError on a cycle."""
        indeg = [len(t.deps) for t in self.tasks]
        succ = self.successors()
        ready = sorted(i for i, d in enumerate(indeg) if d == 0)
        out: list[int] = []
        import heapq

        heapq.heapify(ready)
        while ready:
            i = heapq.heappop(ready)
            out.append(i)
            for s in succ[i]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(ready, s)
        if len(out) != len(self.tasks):
            raise ValueError("task DAG has a cycle")
        return tuple(out)

    def tail_lengths(self) -> tuple[float, ...]:
        """Longest path from each task's start to the end of the DAG (its own ``ms`` included), ms.
        The backbone (critical path) priority of list scheduling."""
        succ = self.successors()
        tail = [0.0] * len(self.tasks)
        for i in reversed(self.topo_order()):
            tail[i] = self.tasks[i].ms + max((tail[s] for s in succ[i]), default=0.0)
        return tuple(tail)

    def critical_path_ms(self) -> float:
        """Length of the longest dependency chain (a lower bound on any schedule's makespan), ms."""
        return max(self.tail_lengths(), default=0.0)

    def resource_load_ms(self, resource: Resource) -> float:
        """Sum of durations on ``resource`` (another makespan lower bound), ms."""
        return sum(t.ms for t in self.tasks if t.resource == resource)

    def default_order(self) -> dict[Resource, tuple[int, ...]]:
        """Per-resource order following the topological order (ids as tie-break)."""
        order: dict[Resource, list[int]] = {}
        for i in self.topo_order():
            order.setdefault(self.tasks[i].resource, []).append(i)
        return {r: tuple(v) for r, v in order.items()}


@dataclass(frozen=True)
class TaskSchedule:
    """Start and end time of every task of a DAG (ms from the DAG's start), and the makespan."""

    start: tuple[float, ...]
    end: tuple[float, ...]
    makespan: float
    order: tuple[tuple[Resource, tuple[int, ...]], ...]

    def order_dict(self) -> dict[Resource, tuple[int, ...]]:
        return dict(self.order)


def run_in_order(dag: TaskDAG, order: Mapping[Resource, Sequence[int]]) -> TaskSchedule:
    """Execute ``dag`` with each resource running exactly the tasks in ``order[resource]`` in that
    sequence, every task as early as its resource and dependencies allow.

    Args:
        dag: the tasks.
        order: per resource, a permutation of that resource's task ids.

    Returns:
        TaskSchedule with times in ms.

    Raises:
        ValueError: if ``order`` misses or repeats a task, puts a task on the wrong resource, or
            is inconsistent with the dependencies (a task waits for one queued behind it).
    """
    n = len(dag.tasks)
    seen = [False] * n
    for r, seq in order.items():
        for i in seq:
            if seen[i]:
                raise ValueError(f"task {dag.tasks[i].name} appears twice in the order")
            if dag.tasks[i].resource != r:
                raise ValueError(f"task {dag.tasks[i].name} runs on {dag.tasks[i].resource.value}, ordered on {r.value}")
            seen[i] = True
    if not all(seen):
        missing = [dag.tasks[i].name for i in range(n) if not seen[i]]
        raise ValueError(f"order misses tasks {missing[:5]}")
    start = [0.0] * n
    end = [-1.0] * n
    queues = {r: list(seq) for r, seq in order.items()}
    pos = {r: 0 for r in queues}
    free = {r: 0.0 for r in queues}
    done = 0
    while done < n:
        progressed = False
        for r, seq in queues.items():
            while pos[r] < len(seq):
                i = seq[pos[r]]
                t = dag.tasks[i]
                if any(end[d] < 0 for d in t.deps):
                    break
                s = max([free[r]] + [end[d] for d in t.deps])
                start[i], end[i] = s, s + t.ms
                free[r] = end[i]
                pos[r] += 1
                done += 1
                progressed = True
        if not progressed:
            stuck = {r.value: dag.tasks[seq[pos[r]]].name for r, seq in queues.items() if pos[r] < len(seq)}
            raise ValueError(f"order contradicts dependencies; blocked heads: {stuck}")
    makespan = max(end, default=0.0)
    return TaskSchedule(tuple(start), tuple(end), makespan, tuple((r, tuple(s)) for r, s in order.items()))
