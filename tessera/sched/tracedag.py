"""The task DAG of a traced F&B pair (:mod:`tessera.cost.trace`), for replay and rescheduling.

Each annotation instance becomes one :class:`~tessera.sched.dag.Task` on the resource of its op
(``attn``/``mlp`` compute, ``dispatch``/``combine`` EP communication), lasting the union of its
kernels' GPU intervals (a task split over the compute and an auxiliary stream occupies the
compute resource for that span). Dependencies are the layer chains of the two microbatches of
an overlapped pair, as DeepSeek-V3's MoE layer computes (DeepSeek-V3 report sec. 3.2.1; the
task split of :mod:`tessera.spec.tasks`), with ``k`` the ``occurrence`` (layer position in issue
order):

* forward: ``attn(F)_k -> dispatch(F)_k -> mlp(F)_k -> combine(F)_k -> attn(F)_{k+1}``;
* backward: ``combine(B)_k -> mlp(B)_k -> dispatch(B)_k -> attn(B)_k -> combine(B)_{k+1}``;
* weight gradients: ``mlp(W)_k`` after ``mlp(B)_k``, ``attn(W)_k`` after ``attn(B)_k``.

:func:`issue_order` is the per-resource order the trace's host issued (instances by host start
time), so :func:`tessera.sched.dag.run_in_order` replays DeepSeek's own schedule with the traced
durations; the pair scheduler may choose another order for the same DAG.
"""

from __future__ import annotations

from tessera.cost.trace import OP_ROLES, KinetoTrace
from tessera.sched.dag import Task, TaskDAG
from tessera.spec.tasks import Phase, Resource, TaskKind

__all__ = ["trace_pair_dag", "issue_order", "KIND_OF_OP"]

KIND_OF_OP = {"attn": TaskKind.MIXER, "mlp": TaskKind.EXPERT, "dispatch": TaskKind.DISPATCH,
              "combine": TaskKind.COMBINE}
"""Trace op -> the task kind it stands for (``attn`` includes the router, ``mlp`` the shared
expert: DeepSeek's annotations cover attention + gate and routed + shared experts)."""

_F_CHAIN = ("attn", "dispatch", "mlp", "combine")
_B_CHAIN = ("combine", "mlp", "dispatch", "attn")


def trace_pair_dag(trace: KinetoTrace) -> TaskDAG:
    """The pair's TaskDAG, task ``i`` = ``trace.instances[i]`` (module docstring).

    Raises:
        ValueError: an op outside :data:`KIND_OF_OP`, or a chain with a missing instance (e.g.
            ``mlp(F)`` of a layer whose ``dispatch(F)`` is absent).
    """
    by_key = {(i.op, i.phase, i.occurrence): i.index for i in trace.instances}
    tasks = []
    for inst in trace.instances:
        if inst.op not in KIND_OF_OP:
            raise ValueError(f"trace annotation {inst.name!r}: op {inst.op!r} is not one of {sorted(KIND_OF_OP)}")
        tasks.append(Task(id=inst.index, name=f"{inst.name}#{inst.occurrence}", kind=KIND_OF_OP[inst.op],
                          phase=Phase(inst.phase),
                          resource=Resource.EP_COMM if OP_ROLES[inst.op] == "comm" else Resource.COMPUTE,
                          ms=inst.span_ms(), deps=_deps(inst.op, inst.phase, inst.occurrence, by_key),
                          layer=inst.occurrence, side="F" if inst.phase == "F" else "B",
                          movable=inst.phase == "W"))
    return TaskDAG(tuple(tasks))


def _deps(op: str, phase: str, k: int, by_key: dict) -> tuple[int, ...]:
    def need(o: str, ph: str, kk: int) -> int:
        if (o, ph, kk) not in by_key:
            raise ValueError(f"trace has {op}({phase}) #{k} but no {o}({ph}) #{kk} before it")
        return by_key[(o, ph, kk)]

    if phase == "W":
        return (need(op, "B", k),)
    chain = _F_CHAIN if phase == "F" else _B_CHAIN
    pos = chain.index(op)
    if pos > 0:
        return (need(chain[pos - 1], phase, k),)
    return (need(chain[-1], phase, k - 1),) if k > 0 else ()


def issue_order(trace: KinetoTrace, dag: TaskDAG) -> dict[Resource, tuple[int, ...]]:
    """Per resource, the task ids in the order the trace's host issued them."""
    order: dict[Resource, list[int]] = {}
    for inst in sorted(trace.instances, key=lambda i: i.host_start_us):
        order.setdefault(dag.tasks[inst.index].resource, []).append(inst.index)
    return {r: tuple(v) for r, v in order.items()}
