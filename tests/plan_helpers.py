"""Shared builders for the planner tests: a two-kind heterogeneous MoE model, brute force over
contiguous candidate choices, and the check of a template shape error."""

from __future__ import annotations

from tessera.cost.types import LayerCost, LayerMemory, ModelCosts, Phase, Resource, TaskCost, TaskKind

C, E = Resource.COMPUTE, Resource.EP_COMM
# (mixer ms, expert ms, one A2A ms): "A" compute heavy (attention-like), "M" communication heavy
KINDS = {"A": (2.0, 0.5, 0.2), "M": (0.3, 0.8, 2.0)}


def layer(i: int, code: str, mixer: float, expert: float, a2a: float, static: float = 1e9) -> LayerCost:
    """One MoE layer: mixer, dispatch, expert, combine forward; their backward; W of expert and
    mixer. Times in ms, ``static`` in bytes."""
    K = TaskKind
    tasks = (TaskCost(K.MIXER, Phase.F, C, mixer), TaskCost(K.DISPATCH, Phase.F, E, a2a, deps=(0,)),
             TaskCost(K.EXPERT, Phase.F, C, expert, deps=(1,)), TaskCost(K.COMBINE, Phase.F, E, a2a, deps=(2,)),
             TaskCost(K.COMBINE, Phase.B, E, a2a), TaskCost(K.EXPERT, Phase.B, C, expert, deps=(4,)),
             TaskCost(K.DISPATCH, Phase.B, E, a2a, deps=(5,)), TaskCost(K.MIXER, Phase.B, C, mixer, deps=(6,)),
             TaskCost(K.EXPERT, Phase.W, C, expert, deps=(5,)), TaskCost(K.MIXER, Phase.W, C, mixer, deps=(7,)))
    return LayerCost(i, code, tasks, LayerMemory(static, 0.0, 0.0, 1e8, 5e7))


def hetero_costs(pattern: str, p2p_ms: float = 0.0) -> ModelCosts:
    """A heterogeneous MoE model: one layer per letter of ``pattern`` (see ``KINDS``)."""
    n = len(pattern)
    empty = LayerMemory(0.0, 0.0, 0.0, 0.0)
    return ModelCosts("test", tuple(layer(i, c, *KINDS[c]) for i, c in enumerate(pattern)),
                      LayerCost(-1, "emb", (), empty), LayerCost(n, "head", (), empty), p2p_ms, 0.0, 1.0, 1e15, 80e9, 1)


def chains(cands):
    """Every contiguous choice of one candidate per stage (brute force)."""
    out = []

    def rec(s, prefix):
        if s == len(cands):
            out.append(tuple(prefix))
            return
        for c in cands[s]:
            if s == 0 or c.start == prefix[-1].stop:
                rec(s + 1, prefix + [c])

    rec(0, [])
    return out


def random_layout(rng):
    """A random small planning layout: (baseline partition, candidates, number of layers, stage
    ranks); 4-6 stages of 2-3 layers, radius 1-2, one or two stages per rank."""
    from tessera.plan.candidates import stage_candidates
    from tessera.program.plan import Partition

    n_stages, per = rng.randint(4, 6), rng.randint(2, 3)
    n_layers = n_stages * per
    base = Partition((-1,) + tuple(per * k for k in range(1, n_stages)) + (n_layers + 1,))
    cands = stage_candidates(base, rng.randint(1, 2), n_layers)
    pp = n_stages // 2 if n_stages % 2 == 0 and rng.random() < 0.6 else n_stages
    return base, cands, n_layers, tuple(s % pp for s in range(n_stages))


def assert_shape_error(args, needles):
    """``check_shape(*args)`` (template, pp, vpp, microbatches, layers) raises a one-line
    :class:`~tessera.errors.TesseraConfigError` with a fix, whose message holds every needle."""
    import pytest

    from tessera.errors import TesseraConfigError
    from tessera.program.templates import check_shape

    with pytest.raises(TesseraConfigError) as e:
        check_shape(*args)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg
    for n in needles:
        assert n in msg
