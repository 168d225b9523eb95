"""Task DAGs with costs for one chunk (F, B, W of a layer range) and for an overlapped F&B pair.

Both are built by :func:`tessera.sched.structure.build_dag`, the builder of the cost-free task
structure (:func:`~tessera.sched.structure.pair_structure`), with a cost model's per-layer task
lists and durations: ids, names and dependencies are the structure's (see that module for the
canonical id order). A Program's ``PairOrder`` names these tasks (``"F.L3.dispatch"``), so the
simulator, the planner and the engine agree on them without sharing objects or a cost model.

The embedding (layer -1) and head (layer ``num_layers``) are part of a chunk when the range
includes them: a stage's layer range is ``[start, stop)`` over *extended* indices, where -1 is the
embedding and ``num_layers`` is the head.
"""

from __future__ import annotations

from typing import Iterable

from tessera.cost.types import ModelCosts
from tessera.sched.dag import TaskDAG, TaskSchedule, run_in_order
from tessera.sched.structure import Timing, build_dag, order_ids
from tessera.spec.tasks import Phase, Resource


def stage_layers(start: int, stop: int) -> tuple[int, ...]:
    """Extended layer indices of a stage, in forward order (-1 = embedding, L = head)."""
    return tuple(range(start, stop))


def _timing(costs: ModelCosts, slowdown: float, deferred: bool = False, task_extra: float = 0.0) -> Timing:
    """Durations from ``costs``: compute tasks slowed by ``slowdown`` plus ``task_extra`` ms each
    (an overlapped pair's ``ModelCosts.pair_task_ms``); with ``deferred`` (W run as its own
    instruction, split W) a W task also pays its ``TaskCost.deferred_ms``; W memory is the layer's
    ``LayerMemory.w_activation``, bytes."""
    def timing(layer: int, t) -> tuple[float, float, float]:
        ms = t.ms * slowdown + task_extra if t.resource == Resource.COMPUTE else t.ms
        if deferred and t.phase == Phase.W:
            ms += t.deferred_ms
        return (ms, t.flops, costs.layer(layer).memory.w_activation)
    return timing


def _tasks_of(costs: ModelCosts):
    return lambda layer: costs.layer(layer).tasks


def chunk_dag(costs: ModelCosts, start: int, stop: int, phases: str) -> TaskDAG:
    """DAG of one chunk running alone (no overlap, no slowdown).

    Args:
        costs: model costs.
        start, stop: extended layer range ``[start, stop)``.
        phases: ``"F"``, ``"B"``, ``"W"`` (deferred W: each W task pays its
            ``TaskCost.deferred_ms``) or ``"BW"`` (full backward, W fused).
    """
    rng = stage_layers(start, stop)
    return build_dag(_tasks_of(costs), *(rng if p in phases else () for p in "FBW"),
                     timing=_timing(costs, 1.0, deferred=phases == "W"))


def pair_slowdown(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool) -> float:
    """The compute slowdown of an overlapped F&B pair: ``1 + (1 - 1/s) * min(K, E) / K`` for
    ``s = costs.overlap_slowdown``, ``K`` the pair's compute ms and ``E`` its communication ms
    (dispatch and combine tasks of the forward of ``f_range`` and the backward, with its W when
    ``with_w``, of ``b_range``); ``s`` itself when ``s <= 1`` or there is no compute.

    Why: communication kernels hold their SMs only while they run (DeepEP's reserved SMs, NCCL's
    channel blocks), and compute runs at ``1/s`` of its speed only beside them. At most
    ``min(K, E)`` ms of compute run beside communication, and each such ms does ``1/s`` ms of
    work, so the pair's compute takes at most ``K + (1 - 1/s) min(K, E)``; a pair with no
    communication (``ep = 1``) runs at full speed. In [1, 2 - 1/s].
    """
    s = costs.overlap_slowdown
    if s <= 1.0:
        return s
    comp = comm = 0.0
    for layers, phases in ((stage_layers(*f_range), (Phase.F,)),
                           (stage_layers(*b_range), (Phase.B, Phase.W) if with_w else (Phase.B,))):
        for layer in layers:
            for t in costs.layer(layer).tasks:
                if t.phase in phases:
                    if t.resource == Resource.COMPUTE:
                        comp += t.ms
                    else:
                        comm += t.ms
    if comp <= 0.0:
        return s
    return 1.0 + (1.0 - 1.0 / s) * min(comp, comm) / comp


def pair_dag(costs: ModelCosts, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool,
             slowdown: float | None = None) -> TaskDAG:
    """DAG of an overlapped F&B pair: the forward of chunk ``f_range`` for one microbatch
    co-executing with the backward of chunk ``b_range`` for another.

    The two chains are independent; compute tasks are slowed by ``slowdown`` (default
    :func:`pair_slowdown`: communication kernels hold part of the SMs while they run beside the
    pair's compute), and, overlapped (``slowdown`` None), each pays ``costs.pair_task_ms`` of host time (the
    engine interleaves the pair task by task; ``slowdown=1.0`` is the back-to-back pair, one
    segment per side).
    With ``with_w`` the W tasks of the backward chunk are included as movable tasks whose
    deadline is the end of the pair. The structure (durations aside) is
    :func:`tessera.sched.structure.pair_structure` of the same layers.
    """
    s = pair_slowdown(costs, f_range, b_range, with_w) if slowdown is None else slowdown
    extra = costs.pair_task_ms if slowdown is None else 0.0
    b = stage_layers(*b_range)
    return build_dag(_tasks_of(costs), stage_layers(*f_range), b, b if with_w else (), _timing(costs, s, task_extra=extra))


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
                order: Iterable[tuple[str, Iterable[str]]] | None = None,
                overlapped: bool = True) -> tuple[TaskDAG, TaskSchedule]:
    """The pair DAG (:func:`pair_dag`) and its schedule, ms, under a stored task order: ``order``
    as a Program's ``PairOrder.order`` (per resource, task names; ``None``: :func:`fixed_order`),
    ``overlapped=False`` without the overlap slowdown (the chunks back to back at full speed).
    What the simulator runs for an ``FB`` instruction and what the planner reports per pair.
    Where ``costs.measured_pairs`` has the pair's measured time (a profile), the schedule is
    stretched uniformly to it (every start and end times ``measured / makespan``), so the
    simulator and the planner's reports agree with the planner's pair costs
    (:func:`tessera.plan.pair_cost.best_pair`).

    Raises:
        ValueError: ``order`` names a task the DAG does not have
            (:func:`tessera.sched.structure.order_ids`), misses or repeats a task, or contradicts
            a dependency (:func:`tessera.sched.dag.run_in_order`).
    """
    dag = pair_dag(costs, f_range, b_range, with_w, **({} if overlapped else {"slowdown": 1.0}))
    seq = fixed_order(dag) if order is None else order_ids(dag, order)
    sched = run_in_order(dag, seq)
    if not costs.measured_pairs:
        return dag, sched
    from tessera.cost.profile_costs import measured_pair_ms  # profile costs only: the engine's imports stay cost-free

    ms = measured_pair_ms(costs, f_range, b_range, with_w)
    if ms is None or sched.makespan <= 0:
        return dag, sched
    k = ms / sched.makespan
    return dag, TaskSchedule(tuple(t * k for t in sched.start), tuple(t * k for t in sched.end), ms, sched.order)
