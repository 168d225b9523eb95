"""Zero-bubble templates zb-h1 and zb-v (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
shape rules, schedule structure, validator over a grid, simulator closed forms and peak memory."""

from __future__ import annotations

from collections import Counter

import pytest

from plan_helpers import assert_shape_error
from tessera.cost.uniform import uniform_costs
from tessera.errors import TesseraConfigError
from tessera.plan.baseline import baseline_plan
from tessera.plan.overlap_graph import overlap_edges
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.program.memory import rank_memory_bytes
from tessera.program.templates import TEMPLATES, check_shape, co_executed_pairs, compute_schedule, stage_of
from tessera.program.validate import validate_programs
from tessera.sim.simulator import simulate

ZB = (("zb-h1", 1), ("zb-v", 2))


def _min_m(template: str, pp: int) -> int:
    return 2 * pp - 1 if template == "zb-v" else 1


def _programs(template, pp, vpp, m, costs, overlap=False, split_w=True):
    return compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=overlap, split_w=split_w))


def _sim(template, pp, vpp, m, f, b, w, *, layers_per_stage=1, overlap=False, split_w=True, **kw):
    costs = uniform_costs(pp * vpp * layers_per_stage, f, b, w, **kw)
    return simulate(_programs(template, pp, vpp, m, costs, overlap, split_w), costs)


# --- registry and shape rules ----------------------------------------------------------------------

def test_registry_facts():
    h1, v = TEMPLATES["zb-h1"], TEMPLATES["zb-v"]
    assert (h1.vpp, h1.overlaps_fb, h1.fb_keeps_w, h1.requires_split_w) == (1, True, False, True)
    assert (v.vpp, v.overlaps_fb, v.fb_keeps_w, v.requires_split_w) == (2, True, False, True)
    assert not any(TEMPLATES[n].requires_split_w for n in ("1f1b", "interleaved-1f1b", "dualpipe-v"))
    assert [stage_of("zb-h1", r, 0, 4, 1) for r in range(4)] == [0, 1, 2, 3]
    assert [stage_of("zb-v", r, c, 4, 2) for c in range(2) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]


@pytest.mark.parametrize("args, needles", [
    (("zb-h1", 4, 2, 8, 32), ["parallel.vpp=2", "zb-h1", "vpp must be 1"]),
    (("zb-v", 4, 1, 8, 32), ["parallel.vpp=1", "zb-v", "vpp must be 2"]),
    (("zb-v", 4, 3, 8, 32), ["parallel.vpp=3", "vpp must be 2"]),
    (("zb-v", 4, 2, 6, 32), ["parallel.num_microbatches=6", "num_microbatches >= 2*pp-1", "6 < 7"]),
    (("zb-v", 4, 2, 8, 6), ["pp*vpp=8", "6 layers"]),
])
def test_shape_errors(args, needles):
    assert_shape_error(args, needles)


def test_shapes_accepted():
    check_shape("zb-h1", 8, 1, 3, 8)  # fewer microbatches than ranks, as 1f1b
    check_shape("zb-v", 4, 2, 7, 8)
    check_shape("zb-v", 1, 2, 1, 2)


@pytest.mark.parametrize("template, vpp", ZB)
def test_split_w_off_is_rejected(template, vpp):
    with pytest.raises(TesseraConfigError) as e:
        compute_schedule(template, 2, vpp, 4, overlap=False, split_w=False)
    msg = str(e.value)
    assert (e.value.field, e.value.value) == ("planner.split_w", False)
    assert "\n" not in msg and "set planner.split_w=true" in msg and "1f1b" in msg
    costs = uniform_costs(2 * vpp, 1.0, 1.0, 1.0)
    with pytest.raises(TesseraConfigError, match="planner.split_w=False"):
        _programs(template, 2, vpp, 4, costs, split_w=False)
    assert co_executed_pairs(template, 2, vpp, 4)  # the overlap graph does not trip over the rule


# --- schedule structure ----------------------------------------------------------------------------

def _fb_order(instrs):
    """(op, mb, chunk) of the forwards and backwards, FB split into its F then its B."""
    out = []
    for i in instrs:
        if i.op == Op.FB:
            out += [("F", i.mb, i.chunk), ("B", i.mb2, i.chunk2)]
        elif i.op in (Op.F, Op.B):
            out.append((i.op.value, i.mb, i.chunk))
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pp, m", [(2, 5), (4, 4), (4, 9), (5, 3)])
def test_zb_h1_is_1f1b_with_w_lagging_rank_backwards(pp, m, overlap):
    zb = compute_schedule("zb-h1", pp, 1, m, overlap, True)
    one = compute_schedule("1f1b", pp, 1, m, overlap, True)
    for r in range(pp):
        assert [str(i) for i in zb[r] if i.op != Op.W] == [str(i) for i in one[r] if i.op != Op.W]
        assert _fb_order(zb[r]) == _fb_order(one[r])
        seq = [(i.op, i.mb2 if i.op == Op.FB else i.mb) for i in zb[r] if i.op in (Op.B, Op.FB, Op.W)]
        for k in range(m):  # W of mb k right after backward k + r (the last r W's after the last backward)
            at = seq.index((Op.W, k))
            prev = [x for x in seq[:at] if x[0] != Op.W]
            assert prev[-1][1] == min(k + r, m - 1)
            assert sum(1 for x in seq[:at] if x[0] == Op.W) == k  # oldest first
    if m >= pp:  # the last rank ends with pp W's: the last backward's lag of pp-1 plus its own
        assert [str(i) for i in zb[pp - 1][-pp:]] == [f"W(mb{k}.c0)" for k in range(m - pp, m)]


def test_zb_v_phases():
    pp, m = 4, 9
    sched = compute_schedule("zb-v", pp, 2, m, overlap=False, split_w=True)
    for r in range(pp):
        s = [str(i) for i in sched[r] if i.op != Op.REGISTER_W]
        n1 = 2 * (pp - r) - 1
        assert s[:n1] == [f"F(mb{k}.c0)" for k in range(n1)]
        step2 = [x for k in range(r) for x in (f"F(mb{k}.c1)", f"F(mb{n1 + k}.c0)")]
        assert s[n1:n1 + 2 * r] == step2
        step3 = [x for k in range(r, pp) for x in (f"F(mb{k}.c1)", f"B(mb{k - r}.c1)", f"W(mb{k - r}.c1)")]
        assert s[n1 + 2 * r:n1 + 2 * r + 3 * (pp - r)] == step3
        # the cooldown: r x (B0, B1), pp-r x (B0, oldest chunk-0 W), then the chunk-1 W's, then chunk 0's
        tail = s[-(2 * r + 2 * (pp - r) + 2 * r):]
        assert tail[:2 * r] == [x for k in range(r) for x in (f"B(mb{m - pp + k}.c0)", f"B(mb{m - r + k}.c1)")]
        b0 = [f"B(mb{k}.c0)" for k in range(m - pp + r, m)]
        assert tail[2 * r::2][:pp - r] == b0
        w0 = [f"W(mb{k}.c0)" for k in range(m - pp, m)]
        assert tail[2 * r + 1:2 * pp:2] == w0[:pp - r]
        assert tail[2 * pp:] == [f"W(mb{k}.c1)" for k in range(m - r, m)] + w0[pp - r:]
        n = Counter((i.op, i.chunk) for i in sched[r])
        assert all(n[(op, c)] == m for op in (Op.F, Op.B, Op.W) for c in (0, 1))
        assert all(not i.with_w for i in sched[r] if i.op == Op.B)


def test_zb_v_overlap_pairs_different_microbatches():
    pp, m = 3, 8
    sched = compute_schedule("zb-v", pp, 2, m, overlap=True, split_w=True)
    for r in range(pp):
        fbs = [i for i in sched[r] if i.op == Op.FB]
        assert fbs and all(i.chunk == i.chunk2 and i.mb != i.mb2 and not i.with_w for i in fbs)
        assert {i.chunk for i in fbs} == ({0} if r == 0 else {0, 1})  # rank 0's chunk 1 is the last stage
        assert _fb_order(sched[r]) == _fb_order(compute_schedule("zb-v", pp, 2, m, False, True)[r])
    assert co_executed_pairs("zb-v", 2, 2, 4) == ((0, 0, 0), (1, 1, 1), (1, 2, 2))
    assert co_executed_pairs("zb-h1", 2, 1, 4) == co_executed_pairs("1f1b", 2, 1, 4)
    assert [(e.rank, e.f_stage, e.b_stage) for e in overlap_edges("zb-v", 2, 2, 4)] == [(0, 0, 0), (1, 1, 1),
                                                                                          (1, 2, 2)]


# --- validator over a grid -------------------------------------------------------------------------

def _grid():
    for pp in range(1, 5):
        for template, vpp in ZB:
            for m in range(_min_m(template, pp), 3 * pp + 1):
                yield template, pp, vpp, m


@pytest.mark.parametrize("overlap", [False, True])
def test_grid_compiles_and_validates(overlap):
    n = 0
    for template, pp, vpp, m in _grid():
        costs = uniform_costs(pp * vpp * 2, 1.0, 2.0, 1.0)
        progs = _programs(template, pp, vpp, m, costs, overlap)
        validate_programs(progs)
        ops = Counter(i.op for p in progs for i in p.instructions)
        assert ops[Op.F] + ops[Op.FB] == ops[Op.B] + ops[Op.FB] == ops[Op.W] == ops[Op.REGISTER_W] == pp * vpp * m
        assert (ops[Op.FB] > 0) == (overlap and bool(co_executed_pairs(template, pp, vpp, m)))
        assert not any(i.with_w for p in progs for i in p.instructions if i.op in (Op.B, Op.FB))
        n += 1
    assert n == sum(3 * pp - _min_m(t, pp) + 1 for pp in range(1, 5) for t, _ in ZB)


# --- simulator: closed forms on uniform costs (p2p 0) ----------------------------------------------

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 2.0)]


@pytest.mark.parametrize("f, b, w", COSTS)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_closed_form(pp, f, b, w):
    """ZB-H1 on uniform costs, per stage F, B, W (2 layers per stage), M >= pp:
    iteration = M(F+B+W) + (pp-1) max(F+B-W, B), every rank idles the same.

    (pp-1)(F+B-W) is the paper's bubble: the last rank defers pp-1 W's, so the cooldown's chain of
    backwards starts (pp-1)W earlier than 1F1B's and every rank runs its remaining W's in the waits
    of that chain. Rank 0 also waits (pp-1)B for its first gradient after its pp warmup forwards,
    with no W to fill it yet, hence the max (the bound binds when W > F)."""
    F, B, W = 2 * f, 2 * b, 2 * w
    bubble = (pp - 1) * max(F + B - W, B)
    for m in (pp, pp + 1, 2 * pp, 3 * pp):
        res = _sim("zb-h1", pp, 1, m, f, b, w, layers_per_stage=2)
        assert res.iteration_ms == pytest.approx(m * (F + B + W) + bubble)
        assert [r.idle_ms for r in res.ranks] == pytest.approx([bubble] * pp)
        # 1f1b: (pp-1)(F+B+W) without split W, (pp-1)(F+B) with W right after its backward
        plain = _sim("1f1b", pp, 1, m, f, b, w, layers_per_stage=2, split_w=False)
        split = _sim("1f1b", pp, 1, m, f, b, w, layers_per_stage=2, split_w=True)
        assert plain.iteration_ms == pytest.approx(m * (F + B + W) + (pp - 1) * (F + B + W))
        assert split.iteration_ms == pytest.approx(m * (F + B + W) + (pp - 1) * (F + B))
        assert res.iteration_ms < split.iteration_ms < plain.iteration_ms


def test_zb_h1_unit_costs_third_of_1f1b():
    """F = B = W = 1 ms per stage: 1f1b idles 3(pp-1), zb-h1 (pp-1) (the paper's "one third")."""
    for pp in (2, 4, 6):
        m = 2 * pp
        zb = _sim("zb-h1", pp, 1, m, 1.0, 1.0, 1.0)
        one = _sim("1f1b", pp, 1, m, 1.0, 1.0, 1.0, split_w=False)
        assert zb.iteration_ms == pytest.approx(3 * m + (pp - 1))
        assert one.iteration_ms - 3 * m == pytest.approx(3 * (zb.iteration_ms - 3 * m))


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zb_v_closed_form_equal_costs(pp):
    """ZB-V with F = B = W per chunk: the only bubble is the last rank's wait for its first input,
    (pp-1)F; after it every rank runs without a gap (the cooldown's waits hold deferred W's), so
    iteration = 2M(F+B+W) + (pp-1)F and every rank idles (pp-1)F."""
    for t in (1.0, 0.5):
        for m in (2 * pp - 1, 2 * pp, 3 * pp):
            res = _sim("zb-v", pp, 2, m, t, t, t)
            assert res.iteration_ms == pytest.approx(2 * m * 3 * t + (pp - 1) * t)
            assert [r.idle_ms for r in res.ranks] == pytest.approx([(pp - 1) * t] * pp)


@pytest.mark.parametrize("f, b, w", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0), (1.0, 1.0, 2.0)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zb_v_bubble_below_interleaved_and_1f1b(pp, f, b, w):
    """Same model (2*pp layers), same M, no overlap: zb-v idles less than interleaved-1f1b (vpp=2,
    with or without split W), 1f1b (with or without) and dualpipe-v without split W. (DualPipeV
    with split W is as good or better on some of these costs: its cooldown order is tuned for it.)"""
    for m in (2 * pp, 3 * pp):
        zb = _sim("zb-v", pp, 2, m, f, b, w)
        others = [_sim("interleaved-1f1b", pp, 2, m, f, b, w, split_w=True),
                  _sim("interleaved-1f1b", pp, 2, m, f, b, w, split_w=False),
                  _sim("1f1b", pp, 1, m, f, b, w, layers_per_stage=2, split_w=True),
                  _sim("1f1b", pp, 1, m, f, b, w, layers_per_stage=2, split_w=False),
                  _sim("dualpipe-v", pp, 2, m, f, b, w, split_w=False)]
        for o in others:
            assert max(r.idle_ms for r in zb.ranks) < min(r.idle_ms for r in o.ranks)
            assert zb.iteration_ms < o.iteration_ms


# --- peak activation memory ------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zb_h1_peak_memory_equals_1f1b(pp, overlap):
    """Rank r holds 1F1B's pp-r forward activations plus at most r deferred W's (w_activation,
    half an activation in uniform costs): the largest rank peak is 1F1B's (rank 0's). With
    overlap both are compared with split W: there 1f1b's own split W already costs rank 0 one
    w_activation (an FB's W runs after the pair whose forward has allocated)."""
    costs = uniform_costs(2 * pp, 1.0, 2.0, 1.0, act_bytes=1e9, static_bytes=0.5e9)
    for m in (max(1, pp - 1), pp, 3 * pp):
        zb = _programs("zb-h1", pp, 1, m, costs, overlap)
        for split_w in ((True,) if overlap else (False, True)):
            one = _programs("1f1b", pp, 1, m, costs, overlap, split_w)
            assert max(rank_memory_bytes(zb, costs)) == pytest.approx(max(rank_memory_bytes(one, costs)))
            assert simulate(zb, costs).peak_mem_gb == pytest.approx(simulate(one, costs).peak_mem_gb)
        assert rank_memory_bytes(zb, costs)[0] == pytest.approx(rank_memory_bytes(one, costs)[0])


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_zb_v_peak_memory_equals_1f1b(pp):
    """Rank 0 holds 2pp-1 chunk-0 and one chunk-1 activation (half a 1F1B stage each) at its first
    backward: 1F1B's peak, on every rank, with or without overlap (1f1b's overlap needs more)."""
    costs = uniform_costs(2 * pp, 1.0, 2.0, 1.0, act_bytes=1e9, static_bytes=0.5e9)
    for m in (2 * pp - 1, 3 * pp):
        one = max(rank_memory_bytes(_programs("1f1b", pp, 1, m, costs, False, False), costs))
        for overlap in (False, True):
            zb = _programs("zb-v", pp, 2, m, costs, overlap)
            assert rank_memory_bytes(zb, costs) == pytest.approx((one,) * pp)
            assert simulate(zb, costs).peak_mem_gb == pytest.approx(one / 1e9)


# --- overlap ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, vpp", ZB)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m_per_pp", [1, 2, 4])
def test_overlap_never_slower_when_compute_and_comm_are_independent(template, vpp, pp, m_per_pp):
    m = max(m_per_pp * pp, _min_m(template, pp))
    costs = uniform_costs(pp * vpp * 2, f_ms=1.0, b_ms=2.0, w_ms=1.0, a2a_ms=0.4, p2p_ms=0.05,
                          overlap_slowdown=1.0)
    on = simulate(_programs(template, pp, vpp, m, costs, overlap=True), costs)
    off = simulate(_programs(template, pp, vpp, m, costs, overlap=False), costs)
    assert on.iteration_ms < off.iteration_ms
