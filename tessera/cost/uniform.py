"""Synthetic uniform costs: every layer the same, for checking schedules against closed forms."""

from __future__ import annotations

from tessera.cost.types import LayerCost, LayerMemory, ModelCosts, TaskCost
from tessera.spec.tasks import Phase, Resource, TaskKind


def uniform_costs(num_layers: int, f_ms: float, b_ms: float, w_ms: float, *, a2a_ms: float = 0.0,
                  p2p_ms: float = 0.0, act_bytes: float = 0.0, static_bytes: float = 0.0,
                  overlap_slowdown: float = 1.0, flops_per_layer: float = 0.0,
                  peak_flops: float = 1e15, device_mem_bytes: float = 80e9) -> ModelCosts:
    """ModelCosts in which every decoder layer costs the same and embedding/head cost nothing.

    Each layer has one compute task per phase (F: ``f_ms``, B: ``b_ms``, W: ``w_ms``); with
    ``a2a_ms > 0`` F is ``mixer -> dispatch -> expert -> combine`` with the compute split in
    halves and two A2As of ``a2a_ms`` each (B mirrors it). Times in ms, memory in bytes.
    ``flops_per_layer`` is split over F:B:W as 1:1:1.
    """
    fl = flops_per_layer / 3.0

    def tasks() -> tuple[TaskCost, ...]:
        C, E = Resource.COMPUTE, Resource.EP_COMM
        if a2a_ms <= 0:
            return (TaskCost(TaskKind.MIXER, Phase.F, C, f_ms, fl),
                    TaskCost(TaskKind.MIXER, Phase.B, C, b_ms, fl),
                    TaskCost(TaskKind.MIXER, Phase.W, C, w_ms, fl, deps=(1,)))
        return (
            TaskCost(TaskKind.MIXER, Phase.F, C, f_ms / 2, fl / 2),
            TaskCost(TaskKind.DISPATCH, Phase.F, E, a2a_ms, deps=(0,)),
            TaskCost(TaskKind.EXPERT, Phase.F, C, f_ms / 2, fl / 2, deps=(1,)),
            TaskCost(TaskKind.COMBINE, Phase.F, E, a2a_ms, deps=(2,)),
            TaskCost(TaskKind.COMBINE, Phase.B, E, a2a_ms),
            TaskCost(TaskKind.EXPERT, Phase.B, C, b_ms / 2, fl / 2, deps=(4,)),
            TaskCost(TaskKind.DISPATCH, Phase.B, E, a2a_ms, deps=(5,)),
            TaskCost(TaskKind.MIXER, Phase.B, C, b_ms / 2, fl / 2, deps=(6,)),
            TaskCost(TaskKind.EXPERT, Phase.W, C, w_ms / 2, fl / 2, deps=(5,)),
            TaskCost(TaskKind.MIXER, Phase.W, C, w_ms / 2, fl / 2, deps=(7,)),
        )

    mem = LayerMemory(static_bytes, 0.0, 0.0, act_bytes, act_bytes / 2)
    layers = tuple(LayerCost(i, "U", tasks(), mem) for i in range(num_layers))
    empty = LayerCost(-1, "emb", (), LayerMemory(0, 0, 0, 0))
    head = LayerCost(num_layers, "head", (), LayerMemory(0, 0, 0, 0))
    return ModelCosts("uniform", layers, empty, head, p2p_ms, 0.0, overlap_slowdown, peak_flops,
                      device_mem_bytes, 1)
