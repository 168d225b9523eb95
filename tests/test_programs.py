"""Templates, compiler, validator and the serial-balanced baseline."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest

from tessera.cost.types import LayerCost, LayerMemory, Phase, Resource, TaskCost, TaskKind
from plan_helpers import assert_shape_error
from tessera.cost.uniform import uniform_costs
from tessera.errors import ProgramError, TesseraConfigError
from tessera.plan.baseline import baseline_plan, serial_balanced_partition, stage_serial_ms
from tessera.program.plan import Partition, Plan
from tessera.program.compiler import compile_plan, program_summary
from tessera.program.instructions import Instr, Op, PairOrder, Program
from tessera.program.templates import (TEMPLATES, Template, check_shape, co_executed_pairs, compute_schedule,
                                       get_template, rank_chunk_of, stage_of)
from tessera.plan.planner import pair_with_w
from tessera.program.validate import validate_programs


def _plan(template, pp, vpp, m, overlap=True, split_w=True, layers=None, pair_orders=()):
    n = layers or pp * vpp
    bounds = (-1, *[round(n * s / (pp * vpp)) for s in range(1, pp * vpp)], n + 1)
    return Plan("test", template, pp, vpp, m, Partition(bounds), overlap, split_w, pair_orders)


GRID_SIZE = sum(p - 1 + (2 * p + 1) * 4 + (p + 1) for p in range(1, 9))  # 1f1b M<pp, M in pp..3pp, dualpipe-v


def _grid():
    for pp in range(1, 9):
        for m in range(1, pp):  # 1f1b with fewer microbatches than ranks
            yield "1f1b", pp, 1, m
        for m in range(pp, 3 * pp + 1):
            yield "1f1b", pp, 1, m
            for vpp in (1, 2, 3):
                yield "interleaved-1f1b", pp, vpp, m
            if m >= 2 * pp:
                yield "dualpipe-v", pp, 2, m


# --- template registry -----------------------------------------------------------------------------

def test_registry_facts_of_each_template():
    assert list(TEMPLATES) == ["1f1b", "interleaved-1f1b", "dualpipe-v", "zb-h1", "zb-v"]  # message order
    facts = {n: (t.name, t.vpp, t.overlaps_fb, t.fb_keeps_w) for n, t in TEMPLATES.items()}
    assert facts == {"1f1b": ("1f1b", 1, True, False), "interleaved-1f1b": ("interleaved-1f1b", None, True, False),
                     "dualpipe-v": ("dualpipe-v", 2, True, True), "zb-h1": ("zb-h1", 1, True, False),
                     "zb-v": ("zb-v", 2, True, False)}
    for n, t in TEMPLATES.items():
        assert isinstance(t, Template) and get_template(n) is t
        assert [t.pair_with_w(sw) for sw in (False, True)] == [True, n == "dualpipe-v"]
        assert [pair_with_w(n, sw) for sw in (False, True)] == [True, n == "dualpipe-v"]
    with pytest.raises(TypeError):
        TEMPLATES["gpipe"] = TEMPLATES["1f1b"]  # read-only
    with pytest.raises(AttributeError):
        TEMPLATES["1f1b"].vpp = 2  # frozen


def test_registry_placement_and_vpp_rule():
    one, il, v = (TEMPLATES[n] for n in ("1f1b", "interleaved-1f1b", "dualpipe-v"))
    assert [one.placement(r, 0, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [il.placement(r, c, 4) for c in range(3) for r in range(4)] == list(range(12))
    assert [v.placement(r, c, 4) for c in range(2) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [v.owner(s, 4) for s in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [il.owner(s, 4) for s in (0, 5, 11)] == [(0, 0), (1, 1), (3, 2)]
    for n, t in TEMPLATES.items():  # the vpp fact is what the shape rules accept
        ok = [vpp for vpp in range(1, 5) if _accepts(n, 4, vpp, 16)]
        assert ok == ([t.vpp] if t.vpp is not None else [1, 2, 3, 4])
        # overlaps_fb: with overlap=True the schedule has FB instructions
        vpp = t.vpp or 2
        assert any(i.op == Op.FB for r in compute_schedule(n, 4, vpp, 16, True, t.requires_split_w)
                   for i in r) == t.overlaps_fb
        # fb_keeps_w: under split_w an FB's backward keeps its W exactly for such templates
        fbs = [i for r in compute_schedule(n, 4, vpp, 16, True, True) for i in r if i.op == Op.FB]
        assert fbs and {i.with_w for i in fbs} == {t.fb_keeps_w}


def _accepts(template, pp, vpp, m):
    try:
        check_shape(template, pp, vpp, m, 64)
    except TesseraConfigError:
        return False
    return True


@pytest.mark.parametrize("name", ["gpipe", "", "1F1B", 3, None])
def test_unknown_template_error_text(name):
    want = (f"planner.template={name!r}: unknown pipeline template; "
            "fix: use one of 1f1b, interleaved-1f1b, dualpipe-v, zb-h1, zb-v")
    for call in (lambda: get_template(name), lambda: stage_of(name, 0, 0, 1, 1),
                 lambda: rank_chunk_of(name, 0, 1, 1), lambda: check_shape(name, 1, 1, 1, 1),
                 lambda: compute_schedule(name, 1, 1, 1, True, True), lambda: co_executed_pairs(name, 1, 1, 1),
                 lambda: pair_with_w(name, True)):
        with pytest.raises(TesseraConfigError) as e:
            call()
        assert str(e.value) == want
        assert (e.value.field, e.value.value) == ("planner.template", name)


# --- stage mapping ---------------------------------------------------------------------------------

def test_stage_mapping_round_trips():
    assert [stage_of("interleaved-1f1b", r, c, 4, 2) for c in range(2) for r in range(4)] == list(range(8))
    assert [stage_of("dualpipe-v", r, 0, 4, 2) for r in range(4)] == [0, 1, 2, 3]
    assert [stage_of("dualpipe-v", r, 1, 4, 2) for r in range(4)] == [7, 6, 5, 4]
    assert rank_chunk_of("dualpipe-v", 7, 4, 2) == (0, 1)
    assert rank_chunk_of("interleaved-1f1b", 5, 4, 2) == (1, 1)
    for t, vpp in (("1f1b", 1), ("interleaved-1f1b", 3), ("dualpipe-v", 2)):
        for s in range(5 * vpp):
            assert stage_of(t, *rank_chunk_of(t, s, 5, vpp), 5, vpp) == s


# --- check_shape -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (("gpipe", 4, 1, 8, 32), ["gpipe", "1f1b, interleaved-1f1b, dualpipe-v"]),
    (("1f1b", 0, 1, 8, 32), ["parallel.pp=0", "positive"]),
    (("1f1b", 4, 1, -1, 32), ["parallel.num_microbatches=-1"]),
    (("1f1b", 4, 2, 8, 32), ["parallel.vpp=2", "vpp must be 1"]),
    (("dualpipe-v", 4, 3, 8, 32), ["parallel.vpp=3", "vpp must be 2"]),
    (("interleaved-1f1b", 4, 4, 8, 12), ["pp*vpp=16", "12 layers"]),
    (("interleaved-1f1b", 6, 2, 3, 48), ["interleaving needs num_microbatches >= pp; 3 < 6"]),
    (("dualpipe-v", 4, 2, 7, 48), ["num_microbatches >= 2*pp; 7 < 8"]),
])
def test_check_shape_errors(args, needles):
    assert_shape_error(args, needles)


def test_check_shape_accepts_small_1f1b_and_interleaved_vpp1():
    check_shape("1f1b", 8, 1, 3, 32)
    check_shape("interleaved-1f1b", 8, 1, 3, 32)
    check_shape("dualpipe-v", 4, 2, 8, 8)


def test_compile_rejects_partition_of_wrong_size():
    plan = replace(_plan("1f1b", 4, 1, 8, layers=16), partition=Partition((-1, 8, 17)))
    with pytest.raises(TesseraConfigError, match="has 2 stages"):
        compile_plan(plan)


# --- schedules -------------------------------------------------------------------------------------

def test_1f1b_order_matches_megatron():
    sched = compute_schedule("1f1b", 4, 1, 6, overlap=False, split_w=False)
    assert [str(i) for i in sched[0]] == ["F(mb0.c0)", "F(mb1.c0)", "F(mb2.c0)", "F(mb3.c0)", "B+W(mb0.c0)",
                                          "F(mb4.c0)", "B+W(mb1.c0)", "F(mb5.c0)", "B+W(mb2.c0)", "B+W(mb3.c0)",
                                          "B+W(mb4.c0)", "B+W(mb5.c0)"]
    assert [str(i) for i in sched[3][:3]] == ["F(mb0.c0)", "B+W(mb0.c0)", "F(mb1.c0)"]


def test_overlap_pairs_backward_with_next_forward():
    sched = compute_schedule("1f1b", 2, 1, 4, overlap=True, split_w=False)
    assert [str(i) for i in sched[1]] == ["F(mb0.c0)", "FB(F mb1.c0 | B+W mb0.c0)", "FB(F mb2.c0 | B+W mb1.c0)",
                                          "FB(F mb3.c0 | B+W mb2.c0)", "B+W(mb3.c0)"]
    # rank 0 leads by 2*(pp-rank-1)+1 = 3 forwards with overlap (pp-rank-1 = 1 without)
    assert [str(i) for i in sched[0]] == ["F(mb0.c0)", "F(mb1.c0)", "F(mb2.c0)", "FB(F mb3.c0 | B+W mb0.c0)",
                                          "B+W(mb1.c0)", "B+W(mb2.c0)", "B+W(mb3.c0)"]


def test_split_w_places_each_w_after_its_backward():
    sched = compute_schedule("1f1b", 2, 1, 3, overlap=False, split_w=True)
    assert [str(i) for i in sched[0]] == ["F(mb0.c0)", "F(mb1.c0)", "B(mb0.c0)", "register_w(mb0.c0)", "W(mb0.c0)",
                                          "F(mb2.c0)", "B(mb1.c0)", "register_w(mb1.c0)", "W(mb1.c0)",
                                          "B(mb2.c0)", "register_w(mb2.c0)", "W(mb2.c0)"]


def test_dualpipe_v_follows_the_eight_steps():
    pp, m = 4, 10
    sched = compute_schedule("dualpipe-v", pp, 2, m, overlap=True, split_w=True)
    r0 = [str(i) for i in sched[0]]
    # step 1: 6 x F0; step 2: (F0, F1); step 3: 3 x (B1 split, W, F1)
    assert r0[:6] == [f"F(mb{k}.c0)" for k in range(6)]
    assert r0[6:8] == ["F(mb6.c0)", "F(mb0.c1)"]
    assert r0[8:12] == ["B(mb0.c1)", "register_w(mb0.c1)", "W(mb0.c1)", "F(mb1.c1)"]
    # step 4 on rank 0: M - 2pp + 1 = 3 iterations of two FBs with unsplit backwards
    assert r0[20:22] == ["FB(F mb7.c0 | B+W mb3.c1)", "FB(F mb4.c1 | B+W mb0.c0)"]
    last = [str(i) for i in sched[pp - 1]]
    step4 = last.index("F(mb3.c1)") + 1  # after step 2 (no step 1/3 on the last rank)
    assert last[step4:step4 + 3] == ["F(mb4.c0)", "B+W(mb0.c1)", "FB(F mb4.c1 | B+W mb0.c0)"]
    for r in range(pp):
        n = Counter((i.op, i.chunk) for i in sched[r])
        fb = Counter((i.op, i.chunk2) for i in sched[r])
        for c in (0, 1):
            assert n[(Op.F, c)] + n[(Op.FB, c)] == m
            assert n[(Op.B, c)] + fb[(Op.FB, c)] == m
        assert n[(Op.W, 0)] + n[(Op.W, 1)] == sum(1 for i in sched[r] if i.op == Op.REGISTER_W)
    # split_w off: no W at all, every backward keeps it
    plain = compute_schedule("dualpipe-v", pp, 2, m, overlap=False, split_w=False)
    assert all(i.op in (Op.F, Op.B) and (i.op == Op.F or i.with_w) for r in plain for i in r)


def test_co_executed_pairs():
    assert co_executed_pairs("1f1b", 2, 1, 4) == ((0, 0, 0), (1, 1, 1))
    assert co_executed_pairs("interleaved-1f1b", 2, 2, 4) == (
        (0, 0, 2), (0, 2, 0), (0, 2, 2), (1, 1, 1), (1, 1, 3), (1, 3, 1), (1, 3, 3))
    assert set(co_executed_pairs("dualpipe-v", 2, 2, 4)) == {(0, 0, 3), (0, 3, 0), (1, 1, 2), (1, 2, 1)}
    assert co_executed_pairs("1f1b", 4, 1, 2) == ((3, 3, 3),)  # only the last rank reaches a steady state


# --- compiler + validator over the grid --------------------------------------------------------------

@pytest.mark.parametrize("overlap, split_w", list(itertools.product((False, True), (False, True))))
def test_grid_compiles_and_validates(overlap, split_w):
    n = 0
    for template, pp, vpp, m in _grid():
        progs = compile_plan(_plan(template, pp, vpp, m, overlap, split_w))
        validate_programs(progs)
        n += 1
        ops = Counter(i.op for p in progs for i in p.instructions)
        assert ops[Op.W] == ops[Op.REGISTER_W]
        assert ops[Op.F] + ops[Op.FB] == ops[Op.B] + ops[Op.FB] == pp * vpp * m
        assert (ops[Op.FB] > 0) == (overlap and bool(co_executed_pairs(template, pp, vpp, m)))
        if template != "dualpipe-v":
            assert ops[Op.W] == (pp * vpp * m if split_w else 0)
        elif not split_w:
            assert ops[Op.W] == 0
    assert n == GRID_SIZE


def test_1f1b_with_fewer_microbatches_than_ranks():
    for m in range(1, 8):
        progs = compile_plan(_plan("1f1b", 8, 1, m))
        validate_programs(progs)
        assert all(sum(1 for i in p.instructions if i.op in (Op.F, Op.FB)) == m for p in progs)


def test_compiled_communication_and_tail():
    progs = compile_plan(_plan("interleaved-1f1b", 2, 2, 4, overlap=True, split_w=True, layers=8))
    p0 = progs[0]
    assert [(s.chunk, s.stage, s.start, s.stop) for s in p0.stages] == [(0, 0, -1, 2), (1, 2, 4, 6)]
    assert [str(i) for i in p0.instructions[:6]] == ["F(mb0.c0)", "send_act(mb0.c0 -> r1)", "F(mb1.c0)",
                                                   "send_act(mb1.c0 -> r1)", "recv_act(mb0.c1 <- r1)", "F(mb0.c1)"]
    assert [i.op for i in p0.instructions[-2:]] == [Op.REDUCE_GRADS, Op.OPTIMIZER_STEP]
    k = next(j for j, i in enumerate(p0.instructions) if i.op == Op.FB)
    assert [str(i) for i in p0.instructions[k - 1:k + 3]] == [
        "recv_grad(mb0.c1 <- r1)", "FB(F mb3.c0 | B mb0.c1)", "send_act(mb3.c0 -> r1)", "send_grad(mb0.c1 -> r1)"]
    # dualpipe-v: the turn of the V (stage pp-1 -> pp) stays on the last rank, no self send
    dv = compile_plan(_plan("dualpipe-v", 2, 2, 4))
    assert all(i.peer != p.rank for p in dv for i in p.instructions if i.op in (Op.SEND_ACT, Op.RECV_ACT))
    summary = program_summary(dv).splitlines()
    assert summary[0] == "dualpipe-v plan=test pp=2 vpp=2 M=4 stages=4"
    assert summary[2].split()[:10] == ["0", "S0[-1,1)", "S3[3,5)", "37", "5", "5", "3", "3", "8", "8"]
    assert summary[-1] == "total compute instructions: 31"


def test_pair_orders_are_attached():
    po = PairOrder(2, 0, False, (("compute", ("F.L3.mixer", "B.L0.mixer")),))
    other = PairOrder(5, 5, True, ())
    progs = compile_plan(_plan("interleaved-1f1b", 2, 2, 4, pair_orders=(other, po), layers=8))
    assert progs[0].pair_orders == (po,) and progs[1].pair_orders == ()
    fbs = [i for i in progs[0].instructions if i.op == Op.FB]
    assert [(i.chunk, i.chunk2, i.order) for i in fbs] == [(0, 1, -1), (1, 1, -1), (1, 0, 0)]
    validate_programs(progs)
    wrong = replace(progs[0], pair_orders=(replace(po, b_stage=2),))
    with pytest.raises(ProgramError, match=r"rank 0, instruction \d+: FB\(F mb3.c1 \| B mb0.c0 order#0\): order #0 is "
                                           "not a pair order for F stage 2 / B stage 0"):
        validate_programs((wrong, progs[1]))


def test_json_round_trip_and_stable_hash():
    progs = compile_plan(_plan("dualpipe-v", 4, 2, 9, pair_orders=(PairOrder(1, 6, True, (("compute", ("B.L6.mixer", "F.L1.mixer")),)),)))
    for p in progs:
        q = Program.from_json(p.to_json())
        assert q == p and q.content_hash == p.content_hash
    again = compile_plan(_plan("dualpipe-v", 4, 2, 9, pair_orders=(PairOrder(1, 6, True, (("compute", ("B.L6.mixer", "F.L1.mixer")),)),)))
    assert [p.content_hash for p in again] == [p.content_hash for p in progs]
    assert len({p.content_hash for p in progs}) == 4
    assert replace(progs[0], instructions=progs[0].instructions[1:]).content_hash != progs[0].content_hash
    assert progs[1].pair_orders and any(i.order == 0 for i in progs[1].instructions)


# --- validator negatives ---------------------------------------------------------------------------

def _edit(progs, rank, instrs):
    return tuple(replace(p, instructions=tuple(instrs)) if p.rank == rank else p for p in progs)


def _base():
    return compile_plan(_plan("1f1b", 2, 1, 3, overlap=False, split_w=True))


def test_validator_catches_missing_recv():
    progs = _base()
    ins = [i for i in progs[1].instructions if not (i.op == Op.RECV_ACT and i.mb == 1)]
    with pytest.raises(ProgramError, match=r"rank 0, instruction 3: send_act\(mb1.c0 -> r1\) has no matching "
                                           r"recv_act on rank 1"):
        validate_programs(_edit(progs, 1, ins))


def test_validator_catches_duplicated_f():
    progs = _base()
    ins = list(progs[0].instructions)
    ins.insert(1, ins[0])
    with pytest.raises(ProgramError, match=r"rank 0, instruction 1: second F of mb0 at stage 0 \(first at "
                                           r"instruction 0\)"):
        validate_programs(_edit(progs, 0, ins))


def test_validator_catches_w_before_b():
    progs = _base()
    ins = list(progs[1].instructions)
    w = next(k for k, i in enumerate(ins) if i.op == Op.W and i.mb == 2)
    ins.insert(0, ins.pop(w))
    with pytest.raises(ProgramError, match=r"rank 1, instruction 0: W\(mb2.c0\): W of mb2 at stage 1 before its B"):
        validate_programs(_edit(progs, 1, ins))


def test_validator_catches_missing_w_and_register_after_w():
    progs = _base()
    ins = [i for i in progs[0].instructions if not (i.op == Op.W and i.mb == 1)]
    with pytest.raises(ProgramError, match="rank 0: W of mb1 at stage 0 is missing"):
        validate_programs(_edit(progs, 0, ins))
    ins = list(progs[0].instructions)
    k = next(j for j, i in enumerate(ins) if i.op == Op.REGISTER_W and i.mb == 0)
    ins[k], ins[k + 1] = ins[k + 1], ins[k]  # W before its register_w
    with pytest.raises(ProgramError, match=rf"rank 0, instruction {k + 1}: register_w\(mb0.c0\) must come after its B "
                                           "and before its W"):
        validate_programs(_edit(progs, 0, ins))


def test_validator_catches_deadlock_with_rank_and_index():
    # rank 1 waits for mb1's activation before it sends mb0's gradient; rank 0 waits for that gradient
    # before it sends mb1's activation (1f1b pp=2 M=2 with rank 0 doing no warmup beyond mb0).
    r0 = (Instr(Op.F, 0, 0), Instr(Op.SEND_ACT, 0, 0, peer=1), Instr(Op.RECV_GRAD, 0, 0, peer=1),
          Instr(Op.B, 0, 0, with_w=True), Instr(Op.F, 1, 0), Instr(Op.SEND_ACT, 1, 0, peer=1),
          Instr(Op.RECV_GRAD, 1, 0, peer=1), Instr(Op.B, 1, 0, with_w=True),
          Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
    r1 = (Instr(Op.RECV_ACT, 0, 0, peer=0), Instr(Op.F, 0, 0), Instr(Op.RECV_ACT, 1, 0, peer=0),
          Instr(Op.F, 1, 0), Instr(Op.B, 0, 0, with_w=True), Instr(Op.SEND_GRAD, 0, 0, peer=0),
          Instr(Op.B, 1, 0, with_w=True), Instr(Op.SEND_GRAD, 1, 0, peer=0),
          Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
    good = compile_plan(_plan("1f1b", 2, 1, 2, overlap=False, split_w=False))
    progs = _edit(_edit(good, 0, r0), 1, r1)
    with pytest.raises(ProgramError) as e:
        validate_programs(progs)
    msg = str(e.value)
    assert msg.startswith("rank 0, instruction 2: deadlock:")
    assert "rank 0 at instruction 2 recv_grad(mb0.c0 <- r1) waits for send_grad of mb0 S1->S0 from rank 1" in msg
    assert "rank 1 at instruction 2 recv_act(mb1.c0 <- r0) waits for send_act of mb1 S0->S1 from rank 0" in msg


def test_validator_catches_bad_peer_and_forward_without_input():
    progs = _base()
    ins = [replace(i, peer=1) if i.op == Op.SEND_GRAD and i.mb == 0 else i for i in progs[1].instructions]
    with pytest.raises(ProgramError, match=r"rank 1, instruction \d+: send_grad\(mb0.c0 -> r1\): stage 0 lives on "
                                           r"rank 0, not r1"):
        validate_programs(_edit(progs, 1, ins))
    # drop both ends of mb2's activation: the matching passes, the forward has no input
    no_act = _edit(_edit(progs, 0, [i for i in progs[0].instructions if not (i.op == Op.SEND_ACT and i.mb == 2)]),
                   1, [i for i in progs[1].instructions if not (i.op == Op.RECV_ACT and i.mb == 2)])
    with pytest.raises(ProgramError, match=r"rank 1, instruction \d+: F\(mb2.c0\): forward of mb2 at stage 1 has no "
                                           r"input"):
        validate_programs(no_act)


# --- baseline partition ----------------------------------------------------------------------------

def test_serial_balanced_uniform_30_layers_4_stages():
    part = serial_balanced_partition(uniform_costs(30, 1.0, 2.0, 1.0), 4)
    assert sorted(part.sizes()) == [7, 7, 8, 8]
    assert part.bounds[0] == -1 and part.bounds[-1] == 31
    covered = [i for s in range(4) for i in range(*part.stage_range(s))]
    assert covered == list(range(-1, 31))
    assert max(stage_serial_ms(uniform_costs(30, 1.0, 2.0, 1.0), part)) == pytest.approx(32.0)


def _nonuniform(ms, emb=0.0, head=0.0):
    def lc(i, t):
        return LayerCost(i, "X", (TaskCost(TaskKind.MIXER, Phase.F, Resource.COMPUTE, t),), LayerMemory(0, 0, 0, 0))
    base = uniform_costs(len(ms), 1, 1, 1)
    return replace(base, layers=tuple(lc(i, t) for i, t in enumerate(ms)), embed=lc(-1, emb), head=lc(len(ms), head))


def _brute(costs, k):
    n = len(costs.layers)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (-1, *cuts, n + 1)
        v = max(stage_serial_ms(costs, Partition(b)))
        best = v if best is None else min(best, v)
    return best


def test_serial_balanced_matches_brute_force():
    import random
    rng = random.Random(7)
    for trial in range(60):
        n = rng.randint(1, 9)
        ms = [rng.choice([0.5, 1.0, 2.0, 3.5, 7.0]) * rng.random() for _ in range(n)]
        costs = _nonuniform(ms, emb=rng.random() * 3, head=rng.random() * 5)
        for k in range(1, n + 1):
            part = serial_balanced_partition(costs, k)
            assert part.num_stages == k and part.bounds[0] == -1 and part.bounds[-1] == n + 1
            assert all(x >= 1 for x in part.sizes())
            assert max(stage_serial_ms(costs, part)) == pytest.approx(_brute(costs, k), rel=1e-12)


def test_serial_balanced_puts_heavy_head_alone_and_errors():
    costs = _nonuniform([1.0] * 6, head=10.0)
    part = serial_balanced_partition(costs, 3)
    assert part.bounds == (-1, 3, 5, 7)  # (3 layers, 2 layers, 1 layer + head 11): max 11, then spread
    with pytest.raises(TesseraConfigError, match="7"):
        serial_balanced_partition(costs, 7)


def test_baseline_plan():
    costs = uniform_costs(30, 1.0, 2.0, 1.0)
    plan = baseline_plan(costs, "interleaved-1f1b", 2, 2, 4)
    assert (plan.name, plan.pair_orders, plan.overlap, plan.split_w) == ("baseline", (), True, True)
    assert sorted(plan.partition.sizes()) == [7, 7, 8, 8]
    validate_programs(compile_plan(plan))
    with pytest.raises(TesseraConfigError, match="7 < 8"):
        baseline_plan(costs, "dualpipe-v", 4, 2, 7)
    assert set(TEMPLATES) == {"1f1b", "interleaved-1f1b", "dualpipe-v", "zb-h1", "zb-v"}
