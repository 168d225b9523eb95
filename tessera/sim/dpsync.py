"""When the simulator runs a rank's data-parallel collectives and optimizer step (times in ms).

The durations are the layers' :class:`~tessera.cost.types.LayerDP` (:mod:`tessera.cost.dp`),
summed over a chunk's extended layer range; a rank's collectives run one after another on its
own data-parallel link (its NIC, or NVLink when the group fits a node), beside compute and EP
communication (the approximation: no link or SM contention with the all-to-all).

``ModelCosts.dp_shard == "zero1"`` (Megatron-Core distributed optimizer with
``overlap_param_gather`` and ``overlap_grad_reduce``):

* a chunk's parameter all-gather is issued at the iteration start (the previous optimizer step
  dispatched it) in the order of the chunks' first forwards; the chunk's first forward (``F``,
  or the forward side of ``FB``) lasts until its gather has finished if that is later than its
  compute ("blocking");
* a chunk's gradient reduce-scatter is issued when the instruction holding the chunk's last
  weight gradients ends (``W``, ``B`` with W, ``FB`` with W), and runs behind later compute
  ("trailing"); ``reduce_grads`` waits until the rank's link is idle.

``"fsdp"`` (parameters sharded, FSDP2 defaults ``reshard_after_forward=True`` and a gradient
reduce-scatter after every backward): every ``F`` gathers its chunk, every ``B`` gathers its
chunk (dgrad needs the weights), blocking from the instruction's start (layer-by-layer prefetch
inside the instruction); every instruction with a chunk's weight gradients reduce-scatters that
chunk, trailing. A blocking collective waits for trailing ones still on the link.

``optimizer_step`` lasts the sum of the rank's layers' ``optimizer_ms``, times the rank's
compute factor (``ModelCosts.rank_scale``: the Adam step runs on the rank's own device); the
collectives are communication and keep their times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from tessera.cost.types import ModelCosts
from tessera.program.instructions import Instr, Op, Program
from tessera.sim.result import Collective

GATHER, REDUCE = "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class RankDP:
    """One rank's data-parallel work: ``blocking[i]`` / ``trailing[i]``: the ``(kind, chunk, ms)``
    collectives instruction ``i`` waits for / issues at its end; ``from_start``: blocking
    collectives may start at the iteration start (zero1) instead of the instruction's start;
    ``optimizer_ms`` the optimizer step."""

    blocking: Mapping[int, tuple[tuple[str, int, float], ...]] = field(default_factory=lambda: MappingProxyType({}))
    trailing: Mapping[int, tuple[tuple[str, int, float], ...]] = field(default_factory=lambda: MappingProxyType({}))
    from_start: bool = True
    optimizer_ms: float = 0.0


def _chunk_ms(prog: Program, costs: ModelCosts, attr: str) -> dict[int, float]:
    return {s.chunk: sum(getattr(costs.layer(l).dp, attr) for l in range(s.start, s.stop)) for s in prog.stages}


def _weights_of(ins: Instr) -> int:
    """The chunk whose weight gradients ``ins`` computes, or -1."""
    if ins.op == Op.W or (ins.op == Op.B and ins.with_w):
        return ins.chunk
    if ins.op == Op.FB and ins.with_w:
        return ins.chunk2
    return -1


def rank_dp(prog: Program, costs: ModelCosts) -> RankDP:
    """The data-parallel work of ``prog`` on ``costs`` (module docstring)."""
    gather, reduce = _chunk_ms(prog, costs, "gather_ms"), _chunk_ms(prog, costs, "reduce_ms")
    layers = {l for s in prog.stages for l in range(s.start, s.stop)}
    opt = sum(costs.layer(l).dp.optimizer_ms for l in layers) * costs.scale_of(prog.rank)
    blocking: dict[int, list] = {}
    trailing: dict[int, list] = {}
    fsdp = costs.dp_shard == "fsdp"
    first_f: dict[int, int] = {}
    last_w: dict[int, int] = {}
    for i, ins in enumerate(prog.instructions):
        fwd = ins.chunk if ins.op in (Op.F, Op.FB) else -1
        bwd = ins.chunk if ins.op == Op.B else ins.chunk2 if ins.op == Op.FB else -1
        w = _weights_of(ins)
        if fsdp:
            for c in (fwd, bwd):
                if c >= 0 and gather[c] > 0:
                    blocking.setdefault(i, []).append((GATHER, c, gather[c]))
            if w >= 0 and reduce[w] > 0:
                trailing.setdefault(i, []).append((REDUCE, w, reduce[w]))
        else:
            if fwd >= 0:
                first_f.setdefault(fwd, i)
            if w >= 0:
                last_w[w] = i
    for c, i in first_f.items():
        if gather[c] > 0:
            blocking.setdefault(i, []).append((GATHER, c, gather[c]))
    for c, i in last_w.items():
        if reduce[c] > 0:
            trailing.setdefault(i, []).append((REDUCE, c, reduce[c]))
    return RankDP(MappingProxyType({i: tuple(v) for i, v in blocking.items()}),
                  MappingProxyType({i: tuple(v) for i, v in trailing.items()}), not fsdp, opt)


def run(specs: tuple[tuple[str, int, float], ...], earliest: float, link_free: float, rank: int,
        instr: int) -> tuple[float, list[Collective]]:
    """Run ``specs`` one after another on a link free from ``link_free``, not before
    ``earliest``; returns (when the link is free again, the collectives)."""
    t = max(earliest, link_free)
    out = []
    for kind, chunk, ms in specs:
        out.append(Collective(rank, kind, chunk, instr, t, t + ms))
        t += ms
    return t, out


def around(rdp: RankDP, instr: int, rank: int, start: float, compute_end: float, link_free: float,
           out: list[Collective]) -> tuple[float, float, float]:
    """A compute instruction ``instr`` of ``rank`` that started at ``start`` and whose tasks end at
    ``compute_end``, with its data-parallel collectives (appended to ``out``). Returns (its end:
    the later of ``compute_end`` and its blocking collectives' end; when the link is free again
    after its trailing collectives; exposed ms = end - compute_end)."""
    end = compute_end
    blocking = rdp.blocking.get(instr)
    if blocking:
        link_free, cs = run(blocking, 0.0 if rdp.from_start else start, link_free, rank, instr)
        out += cs
        end = max(compute_end, link_free)
    trailing = rdp.trailing.get(instr)
    if trailing:
        link_free, cs = run(trailing, end, link_free, rank, instr)
        out += cs
    return end, link_free, end - compute_end
