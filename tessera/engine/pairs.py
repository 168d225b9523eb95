"""``FB`` instructions: the single-thread task sequence of an overlapped F&B pair.

A pair order (``Program.pair_orders[i]``, whose task names the engine turns into ids of
:func:`tessera.sched.structure.pair_structure`, or :func:`tessera.sched.chunkdag.fixed_order`)
lists, per resource, task ids of the pair's structure DAG. One host thread issues the
tasks; communication tasks only *start* an asynchronous all-to-all, so issuing them early is what
overlaps them with compute. :func:`linearize` merges the per-resource sequences: each round it
issues every communication head whose dependencies have been issued, then one compute head. The
result depends only on the DAG and the order (never on timing), so the ranks of an EP group,
which run the same Program, issue their collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tessera.cost.types import TaskKey
from tessera.engine.values import EngineError
from tessera.sched.dag import TaskDAG, run_in_order
from tessera.spec.tasks import Resource


@dataclass(frozen=True)
class PairStep:
    """One task of an FB instruction: ``side`` ``"F"`` (the forward microbatch) or ``"B"``
    (the backward microbatch, including its W tasks)."""

    side: str
    key: TaskKey


def linearize(dag: TaskDAG, order: Mapping[Resource, Sequence[int]]) -> tuple[int, ...]:
    """Issue order of ``dag``'s tasks on one thread (see the module docstring).

    Raises:
        EngineError: the order is not a permutation of the DAG per resource or contradicts its
            dependencies.
    """
    try:
        run_in_order(dag, order)
    except ValueError as e:
        raise EngineError(f"invalid pair order: {e}") from None
    queues = {r: list(seq) for r, seq in order.items()}
    pos = {r: 0 for r in queues}
    comm = [r for r in queues if r != Resource.COMPUTE]
    issued = [False] * len(dag.tasks)
    out: list[int] = []

    def head(r: Resource) -> int | None:
        if pos[r] >= len(queues[r]):
            return None
        i = queues[r][pos[r]]
        return i if all(issued[d] for d in dag.tasks[i].deps) else None

    def issue(r: Resource, i: int) -> None:
        issued[i] = True
        pos[r] += 1
        out.append(i)

    while len(out) < len(dag.tasks):
        progressed = False
        for r in comm:
            while (i := head(r)) is not None:
                issue(r, i)
                progressed = True
        if Resource.COMPUTE in queues and (i := head(Resource.COMPUTE)) is not None:
            issue(Resource.COMPUTE, i)
            progressed = True
        if not progressed:  # unreachable after run_in_order succeeded; kept as a guard
            raise EngineError("pair order cannot be issued on one thread")
    return tuple(out)


def pair_steps(dag: TaskDAG, order: Mapping[Resource, Sequence[int]], f_keys: Sequence[TaskKey],
               b_keys: Sequence[TaskKey], w_keys: Sequence[TaskKey], with_w: bool) -> tuple[PairStep, ...]:
    """The FB step sequence for the forward chunk's ``f_keys`` and the backward chunk's
    ``b_keys`` (+ ``w_keys`` when ``with_w``).

    Raises:
        EngineError: the DAG's tasks are not exactly the chunks' tasks (the DAG was built from
            costs of another model, or from costs that split one task kind of a layer in
            several tasks, which the engine runs as one), or the order is invalid.
    """
    want = {("F", k) for k in f_keys} | {("B", k) for k in b_keys} | ({("B", k) for k in w_keys} if with_w else set())
    have = {(t.side, TaskKey(t.phase.value, t.layer, t.kind.value)) for t in dag.tasks}
    if len(have) != len(dag.tasks):
        seen: set = set()
        dup = next(t.name for t in dag.tasks
                   if (k := (t.side, t.phase, t.layer, t.kind)) in seen or seen.add(k))
        raise EngineError(f"pair DAG has several tasks of one kind in one layer (e.g. {dup}); the engine runs one "
                          "task per (phase, layer, kind): build the DAG from costs with one task per kind")
    if want != have:
        missing = sorted(f"{s}:{k}" for s, k in want - have)[:4]
        extra = sorted(f"{s}:{k}" for s, k in have - want)[:4]
        raise EngineError(f"pair DAG does not match the chunks' tasks (missing {missing}, unexpected {extra}): "
                          "build it from costs of the same model")
    return tuple(PairStep(dag.tasks[i].side, TaskKey(dag.tasks[i].phase.value, dag.tasks[i].layer,
                                                     dag.tasks[i].kind.value)) for i in linearize(dag, order))
