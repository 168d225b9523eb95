"""Autograd segments: which B tasks of a microbatch run as one backward call.

A chunk's B tasks run in the order an instruction gives them (``B``: the chunk's task list;
``FB``: the pair order's one-thread issue order). A *run* is a maximal sequence of consecutive B
tasks of that order with nothing the Program interleaves between them (a task of the pair's
other microbatch) and no communication the schedule overlaps inside it (under EP: the
all-to-all a ``combine`` issues and the ones ``expert`` and ``router`` wait for). W tasks between
them do not break a run (a W reads only gradients recorded by earlier B tasks). Each run is one
autograd segment: the forward connects the tensors of tasks in the same run and cuts (detached
leaves) between runs, and the first B step of a run makes one backward call for all its tasks.

:class:`BackwardRuns` is computed once per instruction shape when the engine is built (the
Program is fixed), so the hot path only looks a task up in a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tessera.cost.types import TaskKey

LEAF, LEAF_OPT, LAZY, GIVEN = 0, 1, 2, 3
"""How a run's root gets its gradient: a detached leaf's ``.grad`` (zeros when absent), the same
or skipped when absent, a :class:`~tessera.engine.lazy.Lazy` (received or in flight), or given
(``None``: the loss, seed 1)."""

WAITS_FOR_COMM = frozenset({"expert", "router"})  # under EP: their B waits for an all-to-all
ISSUES_COMM = frozenset({"combine"})  # under EP: its B issues the all-to-all the next tasks overlap


@dataclass(frozen=True, eq=False)
class BackwardRuns:
    """The runs of one microbatch's backward: ``run_of[key]`` (0, 1, ... in execution order)
    for every B task; ``members[r]`` the tasks of run ``r`` in execution order."""

    run_of: Mapping[TaskKey, int]
    members: tuple[tuple[TaskKey, ...], ...]
    linears: dict = field(default_factory=dict, compare=False)  # per run: the chunk's capture groups

    @property
    def count(self) -> int:
        return len(self.members)


def backward_runs(order: Sequence[TaskKey], breaks_before: Sequence[bool], comm: bool,
                  split_all: bool = False) -> BackwardRuns:
    """Runs of the B tasks ``order`` (execution order); ``breaks_before[i]``: something the
    Program interleaves runs between ``order[i-1]`` and ``order[i]``; ``comm``: the chunk's MoE
    layers exchange rows over an EP group (all-to-alls cut runs, see the module docstring);
    ``split_all``: one run per task (profiling: per-task times).

    Raises:
        ValueError: ``order`` and ``breaks_before`` differ in length or ``order`` repeats a task.
    """
    if len(order) != len(breaks_before):
        raise ValueError(f"{len(order)} B tasks but {len(breaks_before)} break flags")
    if len(set(order)) != len(order):
        raise ValueError("a B task appears twice in the order")
    members: list[list[TaskKey]] = []
    prev: TaskKey | None = None
    for key, brk in zip(order, breaks_before):
        new = (not members or brk or split_all
               or (comm and (key.kind in WAITS_FOR_COMM or (prev is not None and prev.kind in ISSUES_COMM))))
        if new:
            members.append([])
        members[-1].append(key)
        prev = key
    run_of = {k: r for r, keys in enumerate(members) for k in keys}
    return BackwardRuns(run_of, tuple(tuple(m) for m in members))
