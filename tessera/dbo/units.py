"""Layer-level movable W: the unit the optimizer moves (docs/dbo.md, "Layer-level W").

A chunk's W (the :class:`~tessera.dbo.predict.WTask` of (chunk, mb)) is the W tasks of its
layers; at skew 1.1-1.5 it is longer than most predicted slots, and on the EP rank that holds
the most tokens longer than all of them. The engine's deferred-W store keys its thunks by
``(mb, layer)`` (:meth:`tessera.model.wgrad.DeferredWGrad.run`,
:meth:`tessera.engine.tasks.TorchChunk.run_w` with a ``key``), so one layer's W of one
microbatch can run on its own, and its thunks are tagged by task kind
(:meth:`~tessera.model.wgrad.DeferredWGrad.run` ``tag``), so a part of it too: a
:class:`WUnit` is the W tasks of one layer of one microbatch of kinds ``kinds`` (``()``: all).
:func:`unit_table` cuts a chunk's W by ``granularity``: ``layer`` (one unit per layer), ``split``
(the default: a MoE layer's expert W, its longest part and the one that grows with the rank's
load, apart from the rest of its W) or ``task`` (one per W task). On the benchmark case
(``benchmarks/dbo.py``: qwen3-next-80b-a3b, h800, pp=4 vpp=4 ep=2, skew 1.45) the simulated
iteration gets 2.6 % (``layer``), 4.7 % (``split``) and 4.9 % (``task``) shorter, for a choice
time of about 4, 8 and 12 ms per pipeline rank and iteration (2 shared CPU cores).

A unit of ``(chunk, mb, layer)`` lasts, on EP rank ``e``, ``rest_ms + expert_ms * n_e / n_mean``
(ms): ``rest_ms`` the layer's non-expert W tasks plus every W task's ``TaskCost.deferred_ms`` (a
per-GEMM host cost of running W deferred), ``expert_ms`` its expert W at balanced routing, scaled
by the rank's load of that microbatch and layer (the formula of
:func:`tessera.dbo.predict.w_ms`, per layer; a chunk's units sum to its ``WTask.ms``). It holds
the layer's ``LayerMemory.w_activation`` bytes until it runs (a part: that share of them in
proportion to its balanced W time, an estimate: the cost model keeps one figure per layer).

Accumulation order: one parameter takes its W in microbatch order, so the unit of (chunk, mb,
layer, kinds) may run only after the same unit of every ``mb' < mb``
(:mod:`tessera.dbo.joint` runs them as a chain).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

from tessera.cost.types import ModelCosts, Phase, TaskKind
from tessera.dbo.predict import RankTable, deferred_w_parts, moe_layers, relative_loads
from tessera.program.instructions import Op, Program

Unit = tuple[int, int, int, tuple[str, ...]]  # (chunk, mb, layer, task kinds; () all)
GRANULARITIES = ("layer", "split", "task")
"""``layer``: one unit per layer; ``split``: the expert W and the rest (two per MoE layer);
``task``: one per W task."""


@dataclass(frozen=True)
class WUnit:
    """One layer's deferred W of one microbatch, or its tasks of ``kinds`` (module doc).

    chunk, mb, layer: the unit; ms: duration per EP rank, ms; rest_ms, expert_ms: its parts at
    balanced routing, ms (``ms[e] = rest_ms + expert_ms * n_e / n_mean``); mem_bytes: held until
    it runs; register, deadline: the chunk W's ``register_w`` and ``W`` instruction indices;
    sync: index of the first instruction after the deadline where the EP group waits for its
    last rank (a compute instruction with MoE layers, or ``reduce_grads``; :func:`sync_points`)."""

    chunk: int
    mb: int
    layer: int
    ms: tuple[float, ...]
    rest_ms: float
    expert_ms: float
    mem_bytes: float
    register: int
    deadline: int
    sync: int
    kinds: tuple[str, ...] = ()

    @cached_property
    def key(self) -> Unit:
        return (self.chunk, self.mb, self.layer, self.kinds)

    @cached_property
    def chain(self) -> tuple[int, int, tuple[str, ...]]:
        """(chunk, layer, kinds): the parameters whose W accumulate in microbatch order (built
        once per unit: the joint choice asks for it at every step)."""
        return (self.chunk, self.layer, self.kinds)


@dataclass(frozen=True)
class UnitTable:
    """The movable units of one pipeline rank, in (chunk, mb, layer) order, and the chunk layers
    (``layers[chunk]``: the chunk's extended layer range, ``-1`` the embedding)."""

    rank: int
    ep: int
    units: tuple[WUnit, ...]
    layers: Mapping[int, tuple[int, ...]]

    def by_key(self) -> dict[Unit, WUnit]:
        return {u.key: u for u in self.units}

    def with_table(self, table: RankTable) -> "UnitTable":
        """The units re-predicted from ``table``'s loads (e.g. after
        :meth:`~tessera.dbo.predict.RankTable.with_loads`)."""
        rel = _own_loads(table)
        return UnitTable(self.rank, self.ep, tuple(_with_ms(u, rel.get((u.mb, u.layer)), self.ep) for u in self.units),
                         self.layers)


def _own_loads(table: RankTable) -> dict[tuple[int, int], tuple[float, ...]]:
    """``(mb, layer) -> n_e / n_mean`` per EP rank, from the loads ``table`` was predicted with."""
    return {(mb, l): relative_loads(v)[0] for mb, l, v in table.loads}


def _with_ms(u: WUnit, own, ep: int) -> WUnit:
    ms = tuple(u.rest_ms + u.expert_ms * (1.0 if own is None else own[e]) for e in range(ep))
    return u if ms == u.ms else WUnit(u.chunk, u.mb, u.layer, ms, u.rest_ms, u.expert_ms, u.mem_bytes, u.register,
                                      u.deadline, u.sync, u.kinds)


def routed(program: Program, index: int, moe) -> bool:
    """Whether compute instruction ``index`` has MoE layers on a side (its start waits for the
    EP group's last rank)."""
    ins = program.instructions[index]
    if ins.op not in (Op.F, Op.B, Op.FB):
        return False
    rng = {s.chunk: (s.start, s.stop) for s in program.stages}
    sides = (ins.chunk,) if ins.op != Op.FB else (ins.chunk, ins.chunk2)
    return any(l in moe for c in sides for l in range(*rng[c]))


def sync_points(program: Program, moe) -> tuple[int, ...]:
    """Per instruction index ``i``: the first index ``> i`` of a routed compute instruction or
    ``reduce_grads`` (``len(instructions)`` when none): where the EP group next waits for its
    slowest rank."""
    n = len(program.instructions)
    out = [n] * n
    nxt = n
    for i in range(n - 1, -1, -1):
        out[i] = nxt
        ins = program.instructions[i]
        if ins.op == Op.REDUCE_GRADS or routed(program, i, moe):
            nxt = i
    return tuple(out)


def unit_table(table: RankTable, program: Program, costs: ModelCosts, granularity: str = "split") -> UnitTable:
    """The layer-level units of ``table``'s W tasks (module doc) on ``program`` (the Program the
    table was predicted for).

    Args:
        granularity: one of :data:`GRANULARITIES` (the default ``split``: a MoE layer's expert W,
            the longest part and the one that scales with the rank's load, moves apart from the
            rest).

    Raises:
        ValueError: ``program`` is not the table's rank, an unknown ``granularity``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unit granularity={granularity!r} must be one of {GRANULARITIES}")
    if program.rank != table.rank:
        raise ValueError(f"unit_table: program of rank {program.rank}, table of rank {table.rank}; pass the "
                         "table's own Program")
    moe = set(moe_layers(costs))
    sync = sync_points(program, moe)
    rng = {s.chunk: tuple(range(s.start, s.stop)) for s in program.stages}
    parts: dict[int, list] = {}
    for layers in rng.values():
        for l in layers:
            w = [t for t in costs.layer(l).tasks if t.phase == Phase.W]
            ex = [t for t in w if t.kind == TaskKind.EXPERT]
            groups = {"layer": [w], "task": [[t] for t in w],
                      "split": [ex, [t for t in w if t.kind != TaskKind.EXPERT]] if ex else [w]}[granularity]
            mem = costs.layer(l).memory.w_activation
            tot = sum(t.ms for t in w) or 1.0
            parts[l] = [(tuple(t.kind.value for t in g) if len(groups) > 1 else (), *deferred_w_parts(g),
                         mem * (sum(t.ms for t in g) / tot if len(groups) > 1 else 1.0)) for g in groups if g]
    rel = _own_loads(table)
    units = []
    for w in table.tasks:
        for l in rng[w.chunk]:
            for kinds, rest, ex, mem in parts[l]:
                if l not in moe:
                    rest, ex = rest + ex, 0.0
                units.append(_with_ms(WUnit(w.chunk, w.mb, l, (), rest, ex, mem, w.register, w.deadline,
                                            sync[w.deadline], kinds), rel.get((w.mb, l)), table.ep))
    units.sort(key=lambda u: u.key)
    return UnitTable(table.rank, table.ep, tuple(units), rng)
