"""Task structure of chunks and overlapped pairs from the layer specs alone: no cost model.

The structure of a DAG is its tasks' names, kinds, phases, resources, layers, sides and
dependencies; durations are absent (0). It depends only on the model's layer kinds, so the engine
learns what a Program's pair orders name without building a cost model, and a Program (format 2)
names its tasks: ``PairOrder.order`` lists, per resource, task *names* of this structure (e.g.
``"F.L3.dispatch"``, ``"B.L7.expert"``, ``"W.L7.expert"``).

The per-layer tasks are the spec's task split (:func:`tessera.spec.tasks.layer_shapes` and
:func:`~tessera.spec.tasks.block_shapes`, the one definition every cost source attaches its
durations to). One builder makes every DAG: :func:`build_dag` walks the layers of a chunk or pair
and names, chains and numbers the tasks; :func:`tessera.sched.chunkdag.pair_dag` calls it with a
cost model's per-layer tasks and durations, :func:`pair_structure` with the spec's task shapes
and zero durations. So ids, names and dependencies of a cost-carrying DAG and of the structure
agree (the analytic model's task lists are ``layer_shapes``; ``tests/test_program_format.py``
checks every preset).

Task ids are canonical: F tasks of the forward chunk in layer order, then B tasks of the backward
chunk in reverse layer order, then W tasks in reverse layer order; inside a layer, in the order of
its task list. Extended layer indices: -1 the embedding, ``num_layers`` the head.

Code that runs Programs (the engine) imports ``Phase``, ``Resource`` and ``TaskKind`` from
:mod:`tessera.spec.tasks`, not from the cost package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from tessera.sched.dag import Task, TaskDAG
from tessera.spec.tasks import Phase, Resource, TaskKind, TaskShape, block_shapes, layer_shapes

__all__ = ["ModelStructure", "build_dag", "pair_structure", "chunk_structure", "named_order", "order_ids"]

FIXES = "re-run `tessera plan` to write the plan again"


@dataclass(frozen=True)
class ModelStructure:
    """Per extended layer, its task shapes: ``layers[i]`` of decoder layer ``i``, ``embed``
    (index -1) and ``head`` (index ``len(layers)``)."""

    layers: tuple[tuple[TaskShape, ...], ...]
    embed: tuple[TaskShape, ...]
    head: tuple[TaskShape, ...]

    @staticmethod
    def of_specs(layers: Sequence) -> "ModelStructure":
        """From a model's decoder :class:`~tessera.spec.model.LayerSpec` s (``ModelSpec.layers``)."""
        return ModelStructure(tuple(layer_shapes(l) for l in layers), block_shapes(TaskKind.EMBED),
                              block_shapes(TaskKind.HEAD))

    @staticmethod
    def of_costs(costs) -> "ModelStructure":
        """From any cost model's task lists (``ModelCosts``: ``layers``, ``embed``, ``head``, each
        with ``.tasks``), durations dropped."""
        def shapes(lc) -> tuple[TaskShape, ...]:
            return tuple(TaskShape(t.kind, t.phase, t.resource, tuple(t.deps)) for t in lc.tasks)
        return ModelStructure(tuple(shapes(l) for l in costs.layers), shapes(costs.embed), shapes(costs.head))

    def tasks(self, index: int) -> tuple[TaskShape, ...]:
        """Task shapes of extended layer ``index``.

        Raises:
            ValueError: ``index`` outside ``-1..len(layers)``."""
        if index == -1:
            return self.embed
        if index == len(self.layers):
            return self.head
        if not 0 <= index < len(self.layers):
            raise ValueError(f"layer {index} is outside the model's extended layers -1..{len(self.layers)}")
        return self.layers[index]


Timing = Callable[[int, object], tuple[float, float, float]]  # (layer, task) -> (ms, flops, W memory bytes)


def _no_cost(layer: int, task) -> tuple[float, float, float]:
    return 0.0, 0.0, 0.0


def _name(phase: Phase, layer: int, kind: str, seen: dict[str, int]) -> str:
    """``"{phase}.L{layer}.{kind}"``, ``"#k"`` appended for the k-th (k >= 1) repeat of the same
    (phase, layer, kind), so names are unique within a DAG (``seen`` counts them)."""
    base = f"{phase.value}.L{layer}.{kind}"
    k = seen.get(base, 0)
    seen[base] = k + 1
    return base if k == 0 else f"{base}#{k}"


def _add_phase(out: list[Task], tasks_of, layers: Iterable[int], phase: Phase, side: str, timing: Timing,
               seen: dict[str, int]) -> dict[tuple[int, int], int]:
    """Append the ``phase`` tasks of ``layers`` (in that order) chained layer to layer: a layer's
    entry tasks depend on the previous layer's exits. Returns (layer, index in its task list) -> id."""
    ids: dict[tuple[int, int], int] = {}
    prev_exits: list[int] = []
    for layer in layers:
        lt = tasks_of(layer)
        idx = [j for j, t in enumerate(lt) if t.phase == phase]
        if not idx:
            continue
        local: dict[int, int] = {}
        has_succ = {d for j in idx for d in lt[j].deps if lt[d].phase == phase}
        for j in idx:
            t = lt[j]
            deps_in = [local[d] for d in t.deps if lt[d].phase == phase]
            ms, flops, _ = timing(layer, t)
            tid = len(out)
            out.append(Task(tid, _name(phase, layer, t.kind.value, seen), t.kind, phase, t.resource, ms,
                            tuple(deps_in) if deps_in else tuple(prev_exits), layer, side, flops=flops))
            local[j] = ids[(layer, j)] = tid
        prev_exits = [local[j] for j in idx if j not in has_succ]
    return ids


def _add_w(out: list[Task], tasks_of, layers: Iterable[int], b_ids: dict[tuple[int, int], int], timing: Timing,
           seen: dict[str, int]) -> None:
    """Append the W tasks of ``layers``: each depends on the B tasks its ``deps`` name; without
    such deps, on the last B task of its kind in the layer."""
    for layer in layers:
        lt = tasks_of(layer)
        for j, t in enumerate(lt):
            if t.phase != Phase.W:
                continue
            deps = tuple(b_ids[(layer, d)] for d in t.deps if (layer, d) in b_ids)
            if not deps:
                same = [b_ids[(layer, i)] for i, u in enumerate(lt)
                        if u.phase == Phase.B and u.kind == t.kind and (layer, i) in b_ids]
                deps = (same[-1],) if same else ()
            ms, flops, mem = timing(layer, t)
            out.append(Task(len(out), _name(Phase.W, layer, t.kind.value, seen), t.kind, Phase.W, t.resource, ms,
                            deps, layer, "B", movable=True, mem_bytes=mem, flops=flops))


def build_dag(tasks_of: Callable[[int], Sequence], f_layers: Sequence[int], b_layers: Sequence[int],
              w_layers: Sequence[int] = (), timing: Timing = _no_cost) -> TaskDAG:
    """The one DAG builder: F tasks of ``f_layers``, then B tasks of ``b_layers`` in reverse
    layer order, then W tasks of ``w_layers`` in reverse layer order (movable, ``deadline_ms``
    None, each after its B task when ``b_layers`` holds its layer).

    Args:
        tasks_of: extended layer -> its tasks (anything with ``kind``, ``phase``, ``resource``,
            ``deps``: :class:`TaskShape` or ``TaskCost``).
        f_layers, b_layers, w_layers: extended layer indices, in forward order.
        timing: ``(layer, task) -> (ms, flops, W memory bytes)`` (default: all 0, the structure).
    """
    out: list[Task] = []
    seen: dict[str, int] = {}
    _add_phase(out, tasks_of, f_layers, Phase.F, "F", timing, seen)
    b_ids = _add_phase(out, tasks_of, tuple(reversed(b_layers)), Phase.B, "B", timing, seen)
    _add_w(out, tasks_of, tuple(reversed(w_layers)), b_ids, timing, seen)
    return TaskDAG(tuple(out))


def _structure(layers) -> ModelStructure:
    return layers if isinstance(layers, ModelStructure) else ModelStructure.of_specs(layers)


def pair_structure(layers, f_range: tuple[int, int], b_range: tuple[int, int], with_w: bool) -> TaskDAG:
    """The structure (durations 0) of the overlapped pair F ``f_range`` | B ``b_range``: the same
    ids, names and dependencies as :func:`tessera.sched.chunkdag.pair_dag` of the model's costs.

    Args:
        layers: the model's decoder ``LayerSpec`` s (``ModelSpec.layers``) or a :class:`ModelStructure`.
        f_range, b_range: extended layer ranges ``[start, stop)``.
        with_w: include the W tasks of the backward chunk.

    Raises:
        ValueError: a range outside the model's extended layers.
    """
    st = _structure(layers)
    b = range(*b_range)
    return build_dag(st.tasks, range(*f_range), b, b if with_w else ())


def chunk_structure(layers, start: int, stop: int, phases: str) -> TaskDAG:
    """The structure of one chunk alone, as :func:`tessera.sched.chunkdag.chunk_dag` (``phases``
    ``"F"``, ``"B"``, ``"W"``, ``"BW"``). Raises ValueError for a range outside the model."""
    rng = range(start, stop)
    return build_dag(_structure(layers).tasks, *(rng if p in phases else () for p in "FBW"))


def named_order(dag: TaskDAG, order: Mapping[Resource, Sequence[int]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A per-resource order of task ids as a ``PairOrder.order``: resource values and task names,
    resources in ``order``'s iteration order."""
    return tuple((Resource(r).value, tuple(dag.tasks[i].name for i in ids)) for r, ids in order.items())


def order_ids(dag: TaskDAG, order: Iterable[tuple[str, Iterable[str]]]) -> dict[Resource, tuple[int, ...]]:
    """A ``PairOrder.order`` (resource value, task names) as task ids of ``dag``.

    Raises:
        ValueError: an unknown resource, a task id where a name belongs (a format-1 order), or a
            name ``dag`` does not have (the order is for another model or partition).
    """
    ids = {t.name: t.id for t in dag.tasks}
    out: dict[Resource, tuple[int, ...]] = {}
    for r, names in order:
        try:
            res = Resource(r)
        except ValueError:
            raise ValueError(f"pair order names resource {r!r}; known: {[x.value for x in Resource]}") from None
        seq = []
        for n in names:
            if not isinstance(n, str):
                raise ValueError(f"pair order lists task id {n!r}, not a task name (Program format 1); {FIXES}")
            if n not in ids:
                raise ValueError(f"pair order names task {n!r}, which the pair DAG does not have (it has "
                                 f"{len(ids)} tasks): the order is for another model or partition")
            seq.append(ids[n])
        out[res] = tuple(seq)
    return out
