"""The task split of the layer specs: which tasks each decoder layer, the embedding and the head run.

A fact of the spec, with no cost: every cost source attaches durations and memory to exactly
these tasks (:func:`tessera.cost.analytic.layer_cost` iterates :func:`layer_shapes`), and the
cost-free task structure of chunks and pairs (:mod:`tessera.sched.structure`, which Program pair
orders name) is built from them, so the two cannot drift apart.

Tasks of one decoder layer (:func:`layer_shapes`; ``deps`` are indices into the layer's task
tuple, the ``LayerCost.tasks`` convention), in this order:

* F: ``mixer -> router -> dispatch -> expert -> combine``; ``shared`` (shared expert) depends on
  ``router`` and runs beside ``dispatch``; dense: ``mixer -> mlp``. A missing mixer or MLP (the
  single-block layers of hybrid models) drops its tasks.
* B (input gradient, "dgrad"): ``combine -> expert -> dispatch -> router -> mixer`` (``combine``
  and ``dispatch`` of phase B are the A2As carrying gradients); ``shared`` depends on nothing
  inside the layer (it starts from the layer's output gradient, like ``combine``) and ``router``
  waits for both ``dispatch`` and ``shared`` (the pre-MLP norm backward in ``router`` sums both
  gradient paths). Dense: ``mlp -> mixer``.
* W (weight gradient, "wgrad"): one task per kind with weights (:data:`WEIGHTED`: mixer, router,
  expert, shared, mlp), each depending on the B task of the same kind; nothing depends on W
  tasks (they are movable).

The embedding and the head (:func:`block_shapes`) are single-kind blocks: F, B, and W after B.

:class:`Phase`, :class:`Resource` and :class:`TaskKind` are defined here (pure enums);
:mod:`tessera.cost.types` re-exports them beside ``TaskCost``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Phase", "Resource", "TaskKind", "TaskShape", "WEIGHTED", "layer_shapes", "block_shapes"]


class Phase(str, Enum):
    F = "F"  # forward
    B = "B"  # backward for inputs (dgrad)
    W = "W"  # backward for weights (wgrad)


class Resource(str, Enum):
    COMPUTE = "compute"  # the device's compute stream(s)
    EP_COMM = "ep_comm"  # expert-parallel all-to-all (dispatch/combine)
    PP_COMM = "pp_comm"  # pipeline point-to-point sends/receives


class TaskKind(str, Enum):
    EMBED = "embed"
    MIXER = "mixer"  # attention / MLA / DeltaNet / Mamba-2, including its norm
    ROUTER = "router"
    DISPATCH = "dispatch"
    EXPERT = "expert"
    SHARED = "shared"  # shared expert
    COMBINE = "combine"
    MLP = "mlp"  # dense MLP
    HEAD = "head"  # final norm, output projection and loss


@dataclass(frozen=True)
class TaskShape:
    """One task of one layer without its cost: ``kind``, ``phase``, ``resource`` and ``deps``
    (indices into the layer's task tuple, as ``TaskCost.deps``)."""

    kind: TaskKind
    phase: Phase
    resource: Resource
    deps: tuple[int, ...] = ()


# Kinds with weights, in the order of their W tasks.
WEIGHTED = (TaskKind.MIXER, TaskKind.ROUTER, TaskKind.EXPERT, TaskKind.SHARED, TaskKind.MLP)


def layer_shapes(layer) -> tuple[TaskShape, ...]:
    """Tasks of one decoder layer (a :class:`tessera.spec.model.LayerSpec`), in order (module
    docstring): F, then B, then W; ``TaskKind.DISPATCH``/``COMBINE`` on ``Resource.EP_COMM``,
    every other task on ``Resource.COMPUTE``."""
    C, E = Resource.COMPUTE, Resource.EP_COMM
    moe = getattr(layer.mlp, "kind", None) == "moe"
    dense = getattr(layer.mlp, "kind", None) == "dense"
    mixer = layer.mixer is not None
    shared = moe and layer.mlp.shared_expert_ffn > 0
    tasks: list[TaskShape] = []
    idx: dict[tuple[Phase, TaskKind], int] = {}

    def add(kind: TaskKind, phase: Phase, res: Resource, deps: tuple[int, ...]) -> int:
        idx[(phase, kind)] = len(tasks)
        tasks.append(TaskShape(kind, phase, res, deps))
        return len(tasks) - 1

    prev: tuple[int, ...] = ()
    if mixer:
        prev = (add(TaskKind.MIXER, Phase.F, C, ()),)
    if moe:
        r = add(TaskKind.ROUTER, Phase.F, C, prev)
        e = add(TaskKind.EXPERT, Phase.F, C, (add(TaskKind.DISPATCH, Phase.F, E, (r,)),))
        add(TaskKind.COMBINE, Phase.F, E, (e,))
        if shared:
            add(TaskKind.SHARED, Phase.F, C, (r,))
    elif dense:
        add(TaskKind.MLP, Phase.F, C, prev)
    prev = ()
    if moe:
        e = add(TaskKind.EXPERT, Phase.B, C, (add(TaskKind.COMBINE, Phase.B, E, ()),))
        rdeps = (add(TaskKind.DISPATCH, Phase.B, E, (e,)),)
        if shared:
            rdeps = (rdeps[0], add(TaskKind.SHARED, Phase.B, C, ()))
        prev = (add(TaskKind.ROUTER, Phase.B, C, rdeps),)
    elif dense:
        prev = (add(TaskKind.MLP, Phase.B, C, ()),)
    if mixer:
        add(TaskKind.MIXER, Phase.B, C, prev)
    for kind in WEIGHTED:
        if (Phase.B, kind) in idx:
            add(kind, Phase.W, C, (idx[(Phase.B, kind)],))
    return tuple(tasks)


def block_shapes(kind: TaskKind) -> tuple[TaskShape, ...]:
    """Tasks of a single-kind block (``TaskKind.EMBED``: the embedding, ``TaskKind.HEAD``: the
    head): F, B and W on compute, W depending on B (index 1)."""
    C = Resource.COMPUTE
    return (TaskShape(kind, Phase.F, C), TaskShape(kind, Phase.B, C), TaskShape(kind, Phase.W, C, (1,)))
