"""The Program memory rule: each rank's peak memory under its Program, from the cost model's
per-layer memory (no timing needed: the order of a rank's instructions fixes the peak).

The recipe-facing check (capacity, margin, fixes in recipe terms) is
:func:`tessera.config.validate.validate_memory`; the planner's exact memory rows
(:mod:`tessera.plan.candidates`) follow the same accounting.
"""

from __future__ import annotations

from typing import Sequence

from tessera.cost.types import ModelCosts
from tessera.program.instructions import Op, Program


def rank_memory_bytes(programs: Sequence[Program], costs: ModelCosts) -> tuple[float, ...]:
    """Peak memory of each rank under its Program, bytes.

    Static memory (parameters, gradients, optimizer state) of every extended layer on the rank
    plus the peak of live activations, with the simulator's accounting
    (:mod:`tessera.sim.simulator`): ``F`` allocates the chunk's activation at its start, ``B``
    frees ``activation - w_activation`` at its end (everything with ``with_w``), ``W`` frees
    ``w_activation``; ``FB`` does both. The peak is taken at every instruction boundary, so a
    backward that keeps more for its deferred W than it frees (``w_activation > activation`` under
    activation recompute) counts too. The order of a rank's instructions fixes the peak, so no
    timing is needed.
    """
    out = []
    for prog in programs:
        chunk_mem = {}
        static = 0.0
        for st in prog.stages:
            mems = [costs.layer(i).memory for i in range(st.start, st.stop)]
            chunk_mem[st.chunk] = (sum(m.activation for m in mems), sum(m.w_activation for m in mems))
            static += sum(m.static for m in mems)
        cur = peak = 0.0
        for ins in prog.instructions:
            if ins.op in (Op.F, Op.FB):
                cur += chunk_mem[ins.chunk][0]  # allocated at the instruction's start
                peak = max(peak, cur)
            if ins.op in (Op.B, Op.FB):
                act, w = chunk_mem[ins.chunk if ins.op == Op.B else ins.chunk2]
                cur -= act if ins.with_w else act - w  # negative when recompute keeps more for W
            elif ins.op == Op.W:
                cur -= chunk_mem[ins.chunk][1]
            peak = max(peak, cur)
        out.append(static + peak)
    return tuple(out)
