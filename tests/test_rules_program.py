"""Rules of the Program validator and the compiler (issue 9, items E1, E4, E7).

E1: coverage counts every microbatch, the last one included (a Program set that drops the last
microbatch on every rank would train on M-1 microbatches scaled by 1/M).
E4: a stage without a decoder layer is the embedding or the head alone, which compiles and validates.
E7: an unmatched receive is named as such, not left to the deadlock check.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.errors import ProgramError
from tessera.program.plan import Partition, Plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.program.validate import validate_programs


def _plan(template: str, pp: int, vpp: int, m: int, bounds: tuple[int, ...], overlap: bool = False) -> Plan:
    return Plan("rules", template, pp, vpp, m, Partition(bounds), overlap, True, ())


def _drop(progs, rank: int, keep) -> tuple:
    out = list(progs)
    out[rank] = replace(progs[rank], instructions=tuple(i for i in progs[rank].instructions if keep(i)))
    return tuple(out)


def _index(prog, op: Op, mb: int) -> int:
    return next(k for k, i in enumerate(prog.instructions) if i.op == op and i.mb == mb)


@pytest.mark.parametrize("template,pp,vpp,bounds", [("1f1b", 2, 1, (-1, 4, 9)),
                                                    ("interleaved-1f1b", 2, 2, (-1, 2, 4, 6, 9))])
def test_validator_rejects_programs_without_the_last_microbatch(template, pp, vpp, bounds):
    m = 4
    progs = compile_plan(_plan(template, pp, vpp, m, bounds))
    validate_programs(progs)
    last = m - 1
    short = progs
    for r in range(pp):  # every rank drops every instruction of the last microbatch: matching still holds
        short = _drop(short, r, lambda i: i.op in (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP) or i.mb != last)
    assert all(p.num_microbatches == m for p in short)
    assert not any(i.mb == last and i.op not in (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP)
                   for p in short for i in p.instructions)
    with pytest.raises(ProgramError, match=rf"^rank 0: F of mb{last} at stage 0 is missing$"):
        validate_programs(short)
    # only the last microbatch's W missing on the last rank: still caught
    w_short = _drop(progs, pp - 1, lambda i: not (i.op == Op.W and i.mb == last))
    with pytest.raises(ProgramError, match=rf"W of mb{last} at stage \d+ is missing"):
        validate_programs(w_short)


def test_validator_names_an_unmatched_receive():
    progs = compile_plan(_plan("1f1b", 2, 1, 3, (-1, 4, 9)))
    no_send = _drop(progs, 0, lambda i: not (i.op == Op.SEND_ACT and i.mb == 1))
    k = _index(progs[1], Op.RECV_ACT, 1)
    with pytest.raises(ProgramError) as e:
        validate_programs(no_send)
    assert str(e.value) == (f"rank 1, instruction {k}: receive of the activation of mb1 S0->S1 from rank 0 has no "
                            "matching send (recv_act(mb1.c0 <- r0); rank 0 has no send_act of mb1 S0->S1)")
    assert (e.value.rank, e.value.index) == (1, k)
    no_grad = _drop(progs, 1, lambda i: not (i.op == Op.SEND_GRAD and i.mb == 2))
    k = _index(progs[0], Op.RECV_GRAD, 2)
    with pytest.raises(ProgramError, match=rf"^rank 0, instruction {k}: receive of the gradient of mb2 S1->S0 from "
                                           r"rank 1 has no matching send"):
        validate_programs(no_grad)


@pytest.mark.parametrize("bounds,stage,what", [((-1, 0, 5, 10, 17), 0, "S0[emb]"), ((-1, 5, 10, 16, 17), 3, "S3[head]")])
def test_compile_runs_a_stage_of_the_embedding_or_the_head_alone(bounds, stage, what):
    plan = _plan("interleaved-1f1b", 2, 2, 4, bounds)
    progs = compile_plan(plan)
    validate_programs(progs)
    assert plan.partition.describe().split()[stage] == what and plan.partition.sizes()[stage] == 0
    assert [(s.start, s.stop) for p in progs for s in p.stages if s.stage == stage] == [bounds[stage:stage + 2]]
