"""Build task DAGs for one chunk (F, B, W of a layer range) and for an overlapped F&B pair.

Task ids are canonical: F tasks of the forward chunk in layer order, then B tasks of the
backward chunk in reverse layer order, then W tasks in reverse layer order; inside a layer, in
``LayerCost.tasks`` order. A PairOrder stored in a Program refers to these ids, so the simulator,
the planner and the engine agree on them without sharing objects.

The embedding (layer -1) and head (layer ``num_layers``) are part of a chunk when the range
includes them: a stage's layer range is ``[start, stop)`` over *extended* indices, where -1 is the
embedding and ``num_layers`` is the head.
"""

from __future__ import annotations

from typing import Iterable

from tessera.cost.types import ModelCosts, Phase, Resource
from tessera.sched.dag import Task, TaskDAG, TaskSchedule, run_in_order


def stage_layers(start: int, stop: int) -> tuple[int, ...]:
    """Extended layer indices of a stage, in forward order (-1 = embedding, L = head)."""
    return tuple(range(start, stop))


def _task_name(phase: Phase, layer: int, kind: str, seen: dict[str, int]) -> str:
    """``"{phase}.L{layer}.{kind}"``, with ``"#k"`` appended for the ``k``-th (k >= 1) repeat of
    the same (phase, layer, kind), so names are unique within a DAG (``seen`` counts them)."""
    base = f"{phase.value}.L{layer}.{kind}"
    k = seen.get(base, 0)
    seen[base] = k + 1
    return base if k == 0 else f"{base}#{k}"


def _add_phase(tasks: list[Task], costs: ModelCosts, layers: Iterable[int], phase: Phase, side: str,
               slowdown: float, prev_exits: list[int], seen: dict[str, int]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """Append the ``phase`` tasks of ``layers`` (in the given order) chained layer to layer.

    Returns the exits of the last layer and a map (layer, index in ``LayerCost.tasks``) -> task id."""
    ids: dict[tuple[int, int], int] = {}
    for layer in layers:
        lc = costs.layer(layer)
        idx = lc.phase_tasks(phase)
        if not idx:
            continue
        local = {}
        has_succ = set()
        for j in idx:
            t = lc.tasks[j]
            deps_in = [d for d in t.deps if lc.tasks[d].phase == phase]
            has_succ.update(deps_in)
        for j in idx:
            t = lc.tasks[j]
            deps_in = [local[d] for d in t.deps if lc.tasks[d].phase == phase]
            deps = tuple(deps_in) if deps_in else tuple(prev_exits)
            ms = t.ms * (slowdown if t.resource == Resource.COMPUTE else 1.0)
            tid = len(tasks)
            tasks.append(Task(tid, _task_name(phase, layer, t.kind.value, seen), t.kind, phase, t.resource, ms, deps,
                              layer, side, flops=t.flops))
            local[j] = tid
            ids[(layer, j)] = tid
        prev_exits = [local[j] for j in idx if j not in has_succ]
    return prev_exits, ids


def _add_w(tasks: list[Task], costs: ModelCosts, layers: Iterable[int], b_ids: dict[tuple[int, int], int],
           slowdown: float, deadline_ms: float | None, seen: dict[str, int]) -> None:
    """Append the W tasks of ``layers``; each depends on the B tasks its ``TaskCost.deps`` name
    (the convention: the B task of the same kind); without such deps, on the last B task of its
    kind in the layer."""
    for layer in layers:
        lc = costs.layer(layer)
        for j in lc.phase_tasks(Phase.W):
            t = lc.tasks[j]
            deps = tuple(b_ids[(layer, d)] for d in t.deps if (layer, d) in b_ids)
            if not deps:
                same = [b_ids[(layer, i)] for i in lc.phase_tasks(Phase.B)
                        if lc.tasks[i].kind == t.kind and (layer, i) in b_ids]
                deps = (same[-1],) if same else ()
            ms = t.ms * (slowdown if t.resource == Resource.COMPUTE else 1.0)
            tid = len(tasks)
            tasks.append(Task(tid, _task_name(Phase.W, layer, t.kind.value, seen), t.kind, Phase.W, t.resource, ms,
                              deps, layer, "B", movable=True, deadline_ms=deadline_ms, mem_bytes=lc.memory.w_activation,
                              flops=t.flops))


def chunk_dag(costs: ModelCosts, start: int, stop: int, phases: str) -> TaskDAG:
    """DAG of one chunk running alone (no overlap, no slowdown).

    Args:
        costs: model costs.
        start, stop: extended layer range ``[start, stop)``.
        phases: ``"F"``, ``"B"``, ``"W"`` or ``"BW"`` (full backward).
    """
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    layers = stage_layers(start, stop)
    if "F" in phases:
        _add_phase(tasks, costs, layers, Phase.F, "F", 1.0, [], seen)
    b_ids: dict[tuple[int, int], int] = {}
    if "B" in phases:
        _, b_ids = _add_phase(tasks, costs, reversed(layers), Phase.B, "B", 1.0, [], seen)
    if "W" in phases:
        _add_w(tasks, costs, reversed(layers), b_ids, 1.0, None, seen)
    return TaskDAG(tuple(tasks))


def pair_dag(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool,
             slowdown: float | None = None) -> TaskDAG:
    """DAG of an overlapped F&B pair: the forward of chunk ``f_range`` for one microbatch
    co-executing with the backward of chunk ``b_range`` for another.

    The two chains are independent; compute tasks are slowed by ``slowdown`` (default
    ``costs.overlap_slowdown``: communication kernels hold part of the SMs while the pair runs).
    With ``with_w`` the W tasks of the backward chunk are included as movable tasks whose
    deadline is the end of the pair.
    """
    s = costs.overlap_slowdown if slowdown is None else slowdown
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    _add_phase(tasks, costs, stage_layers(*f_range), Phase.F, "F", s, [], seen)
    _, b_ids = _add_phase(tasks, costs, reversed(stage_layers(*b_range)), Phase.B, "B", s, [], seen)
    if with_w:
        _add_w(tasks, costs, reversed(stage_layers(*b_range)), b_ids, s, None, seen)
    return TaskDAG(tuple(tasks))


def fixed_order(dag: TaskDAG) -> dict[Resource, tuple[int, ...]]:
    """The template's fixed overlap order for a pair DAG (the baseline).

    Layer step ``j`` pairs the ``j``-th forward layer with the ``j``-th backward layer (backward
    layers in reverse order). Within a step the compute stream runs F.mixer, F.router, B.expert,
    B.shared, F.expert, F.shared, B.router, B.mixer (dense: F.mlp before B.mlp), and the
    communication stream runs B.combine, F.dispatch, B.dispatch, F.combine — the order of
    Megatron-Core's combined 1F1B and DeepSeek's DualPipe overlap. W tasks run right after the
    B task they depend on (fused backward). Steps with no partner layer keep the same relative
    order; tasks of a kind the sequence does not name go last on their resource, in id order.

    Tasks are identified by their (unique) names, never by (side, layer, kind): a layer may hold
    several tasks of one kind (e.g. an expert W split in two), and each is placed in its kind's
    slot in DAG order, so the order of a layer's ``LayerCost.tasks`` list does not move other
    tasks. Every task appears exactly once.

    Raises:
        ValueError: two tasks of ``dag`` share a name.
    """
    names: dict[str, int] = {}
    for t in dag.tasks:
        if t.name in names:
            raise ValueError(f"task name {t.name!r} is used by tasks {names[t.name]} and {t.id}; names must be unique")
        names[t.name] = t.id
    f_layers: list[int] = []
    b_layers: list[int] = []
    group: dict[tuple[str, int, str], list[str]] = {}  # (side, layer, kind) -> task names, id order
    w_of: dict[int, list[int]] = {}  # B task id -> the W tasks depending on it
    for t in dag.tasks:
        if t.phase == Phase.W:
            for d in t.deps:
                w_of.setdefault(d, []).append(t.id)
            continue
        lst = f_layers if t.side == "F" else b_layers
        if not lst or lst[-1] != t.layer:
            lst.append(t.layer)
        group.setdefault((t.side, t.layer, t.kind.value), []).append(t.name)
    comp_seq = ("F:mixer", "F:mlp", "F:embed", "F:router", "B:head", "B:expert", "B:shared", "F:expert", "F:shared",
                "F:head", "B:mlp", "B:router", "B:mixer", "B:embed")
    comm_seq = ("B:combine", "F:dispatch", "B:dispatch", "F:combine")
    order: dict[Resource, list[int]] = {}
    listed: set[int] = set()

    def place(tid: int) -> None:
        order.setdefault(dag.tasks[tid].resource, []).append(tid)
        listed.add(tid)
        for w in w_of.get(tid, ()):
            if w not in listed and all(d in listed for d in dag.tasks[w].deps):
                place(w)

    steps = max(len(f_layers), len(b_layers))
    for j in range(steps):
        fl = f_layers[j] if j < len(f_layers) else None
        bl = b_layers[j] if j < len(b_layers) else None
        for seq in (comp_seq, comm_seq):
            for item in seq:
                side, kind = item.split(":")
                layer = fl if side == "F" else bl
                if layer is None:
                    continue
                for name in group.get((side, layer, kind), ()):
                    place(names[name])
    for t in dag.tasks:  # kinds the sequences do not name, and W tasks with no B dependency
        if t.id not in listed:
            order.setdefault(t.resource, []).append(t.id)
            listed.add(t.id)
    return {r: tuple(v) for r, v in order.items()}


def serial_order(dag: TaskDAG) -> dict[Resource, tuple[int, ...]]:
    """Order that runs a pair without overlap: every forward task, then every backward task, then
    the W tasks, each side in dependency order (the pair as two chunks back to back)."""
    rank = {"F": 0, "B": 1}
    topo = {t: k for k, t in enumerate(dag.topo_order())}
    ids = sorted(range(len(dag.tasks)), key=lambda i: (2 if dag.tasks[i].phase == Phase.W else rank[dag.tasks[i].side],
                                                       topo[i]))
    order: dict[Resource, list[int]] = {}
    for i in ids:
        order.setdefault(dag.tasks[i].resource, []).append(i)
    return {r: tuple(v) for r, v in order.items()}


def replay_pair(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool,
                order: Iterable[tuple[str | Resource, Iterable[int]]] | None = None,
                overlapped: bool = True) -> tuple[TaskDAG, TaskSchedule]:
    """The pair DAG (:func:`pair_dag`) and its schedule, ms, under a stored task order: ``order``
    as a Program's ``PairOrder.order`` (per resource, task ids; ``None``: :func:`fixed_order`),
    ``overlapped=False`` without the overlap slowdown (the chunks back to back at full speed).
    What the simulator runs for an ``FB`` instruction and what the planner reports per pair.

    Raises:
        ValueError: ``order`` misses or repeats a task, or contradicts a dependency
            (:func:`tessera.sched.dag.run_in_order`).
    """
    dag = pair_dag(costs, f_range, b_range, with_w, **({} if overlapped else {"slowdown": 1.0}))
    seq = fixed_order(dag) if order is None else {Resource(r): tuple(ids) for r, ids in order}
    return dag, run_in_order(dag, seq)
