"""Simulator, metrics, Chrome trace and PNG timeline on hand-built Programs with hand-computed times."""

from __future__ import annotations

import json

import pytest

from tessera.cost.uniform import uniform_costs
from tessera.errors import ProgramError
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Instr, Op, PairOrder, Program, StageRef
from tessera.sched.chunkdag import fixed_order, pair_dag
from tessera.sched.structure import named_order
from tessera.sim.simulator import simulate
from tessera.sim.timeline import write_timeline_png
from tessera.sim.trace import chrome_trace, write_chrome_trace

I = Instr


def two_rank_programs() -> tuple[Program, Program]:
    """1F1B, pp=2, M=2, 2 decoder layers: rank 0 = stage 0 = [emb, L0], rank 1 = stage 1 = [L1, head]."""
    s0 = (StageRef(0, 0, -1, 1),)
    s1 = (StageRef(0, 1, 1, 3),)
    r0 = (I(Op.F, 0, 0), I(Op.SEND_ACT, 0, 0, peer=1), I(Op.F, 1, 0), I(Op.SEND_ACT, 1, 0, peer=1),
          I(Op.RECV_GRAD, 0, 0, peer=1), I(Op.B, 0, 0, with_w=True),
          I(Op.RECV_GRAD, 1, 0, peer=1), I(Op.B, 1, 0, with_w=True))
    r1 = (I(Op.RECV_ACT, 0, 0, peer=0), I(Op.F, 0, 0), I(Op.B, 0, 0, with_w=True), I(Op.SEND_GRAD, 0, 0, peer=0),
          I(Op.RECV_ACT, 1, 0, peer=0), I(Op.F, 1, 0), I(Op.B, 1, 0, with_w=True), I(Op.SEND_GRAD, 1, 0, peer=0))
    return (Program(0, 2, 1, 2, 2, s0, r0, template="1f1b"), Program(1, 2, 1, 2, 2, s1, r1, template="1f1b"))


def one_rank(instrs, num_layers: int) -> Program:
    return Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, num_layers + 1),), tuple(instrs))


# F = 1, B = 2, W = 1 ms per layer (one layer per rank; embedding and head cost nothing), p2p 0.5 ms.
COSTS = uniform_costs(2, 1.0, 2.0, 1.0, p2p_ms=0.5, act_bytes=0.5e9, static_bytes=1e9, flops_per_layer=3e12)


def test_two_rank_times_by_hand():
    res = simulate(two_rank_programs(), COSTS)
    # rank 0: F0 [0,1]; send_act0 at 1 -> link (0,1) [1,1.5]; F1 [1,2]; send_act1 at 2 -> [2,2.5];
    #         recv_grad0 waits from 2 until rank 1's send_grad0 arrives (5.5 + 0.5 = 6);
    #         B+W0 [6,9] (B 2 + W 1); recv_grad1 waits 9 -> 10; B+W1 [10,13].
    # rank 1: recv_act0 0 -> 1.5; F0 [1.5,2.5]; B+W0 [2.5,5.5]; send_grad0 at 5.5 -> [5.5,6];
    #         recv_act1 (arrived 2.5) at 5.5; F1 [5.5,6.5]; B+W1 [6.5,9.5]; send_grad1 at 9.5 -> [9.5,10].
    starts0 = [0, 1, 1, 2, 2, 6, 9, 10]
    ends0 = [1, 1, 2, 2, 6, 9, 10, 13]
    starts1 = [0, 1.5, 2.5, 5.5, 5.5, 5.5, 6.5, 9.5]
    ends1 = [1.5, 2.5, 5.5, 5.5, 5.5, 6.5, 9.5, 9.5]
    assert [s.start_ms for s in res.rank_spans(0)] == pytest.approx(starts0)
    assert [s.end_ms for s in res.rank_spans(0)] == pytest.approx(ends0)
    assert [s.start_ms for s in res.rank_spans(1)] == pytest.approx(starts1)
    assert [s.end_ms for s in res.rank_spans(1)] == pytest.approx(ends1)
    assert res.iteration_ms == pytest.approx(13.0)
    # busy = 2 * F + 2 * (B + W) = 8 on both ranks; idle = 13 - 8 = 5.
    assert [m.busy_ms for m in res.ranks] == pytest.approx([8.0, 8.0])
    assert [m.idle_ms for m in res.ranks] == pytest.approx([5.0, 5.0])
    assert [m.end_ms for m in res.ranks] == pytest.approx([13.0, 9.5])
    assert res.bubble_ratio == pytest.approx(10.0 / 26.0)
    assert res.exposed_a2a_ratio == 0.0
    # 2 mb x 2 layers x 3e12 FLOPs over 2 ranks x 13 ms x 1e15 FLOP/s.
    assert res.mfu == pytest.approx(12e12 / (2 * 0.013 * 1e15))
    assert [(t.kind, t.mb, t.src, t.start_ms, t.end_ms) for t in res.transfers] == [
        ("act", 0, 0, 1.0, 1.5), ("act", 1, 0, 2.0, 2.5), ("grad", 0, 1, 5.5, 6.0), ("grad", 1, 1, 9.5, 10.0)]
    # task intervals: rank 0's B+W of mb 1 = B.L0 [10,12] then W.L0 [12,13]
    bw = [(e.name, e.phase, e.start_ms, e.end_ms) for e in res.rank_events(0) if e.mb == 1 and e.phase != "F"]
    assert bw == [("B.L0.mixer", "B", 10.0, 12.0), ("W.L0.mixer", "W", 12.0, 13.0)]
    json.dumps(res.to_dict())


def test_two_rank_peak_memory_by_hand():
    res = simulate(two_rank_programs(), COSTS)
    # static 1 GB per layer (emb/head: 0); activation 0.5 GB per layer per microbatch.
    # rank 0 holds mb0 and mb1 after F1 (1F1B warm-up on stage 0): 1 + 2 * 0.5 = 2.0 GB.
    # rank 1 frees mb0 (B+W frees all) before F1: 1 + 0.5 = 1.5 GB.
    assert [m.static_mem_gb for m in res.ranks] == pytest.approx([1.0, 1.0])
    assert [m.peak_mem_gb for m in res.ranks] == pytest.approx([2.0, 1.5])


def test_split_w_memory_keeps_w_activation():
    costs = uniform_costs(1, 1.0, 1.0, 1.0, act_bytes=1e9)  # w_activation = act / 2
    prog = one_rank([I(Op.F, 0, 0), I(Op.B, 0, 0), I(Op.F, 1, 0), I(Op.W, 0, 0), I(Op.B, 1, 0), I(Op.W, 1, 0)], 1)
    res = simulate([prog], costs)
    # F0: 1.0; B0 frees 0.5 -> 0.5; F1: 1.5 (peak); W0 -> 1.0; B1 -> 0.5; W1 -> 0.
    assert res.ranks[0].peak_mem_gb == pytest.approx(1.5)
    assert res.iteration_ms == pytest.approx(6.0)
    assert res.bubble_ratio == pytest.approx(0.0)


def test_links_serialise_transfers():
    costs = uniform_costs(2, 1.0, 1.0, 1.0, p2p_ms=1.5)
    s0, s1 = (StageRef(0, 0, -1, 1),), (StageRef(0, 1, 1, 3),)
    r0 = (I(Op.F, 0, 0), I(Op.SEND_ACT, 0, 0, peer=1), I(Op.F, 1, 0), I(Op.SEND_ACT, 1, 0, peer=1))
    r1 = (I(Op.RECV_ACT, 0, 0, peer=0), I(Op.F, 0, 0), I(Op.RECV_ACT, 1, 0, peer=0), I(Op.F, 1, 0))
    res = simulate([Program(0, 2, 1, 2, 2, s0, r0), Program(1, 2, 1, 2, 2, s1, r1)], costs)
    # send0 at 1 -> [1, 2.5]; send1 issued at 2 waits for the link -> [2.5, 4].
    # rank 1: F0 [2.5, 3.5], recv1 until 4, F1 [4, 5].
    assert [(t.issue_ms, t.start_ms, t.end_ms) for t in res.transfers] == [(1.0, 1.0, 2.5), (2.0, 2.5, 4.0)]
    assert [s.start_ms for s in res.rank_spans(1)] == pytest.approx([0.0, 2.5, 3.5, 4.0])
    assert res.iteration_ms == pytest.approx(5.0)


def test_exposed_a2a_single_rank_forward():
    # a2a 0.5 ms: each layer's F = mixer(1) -> dispatch(0.5) -> expert(1) -> combine(0.5), all serial.
    costs = uniform_costs(3, 2.0, 2.0, 1.0, a2a_ms=0.5)
    res = simulate([one_rank([I(Op.F, 0, 0)], 3)], costs)
    assert res.iteration_ms == pytest.approx(3 * (2.0 + 2 * 0.5))
    assert res.ranks[0].exposed_a2a_ms == pytest.approx(3 * 2 * 0.5)
    assert res.exposed_a2a_ratio == pytest.approx(3.0 / 9.0)
    ep = [e for e in res.events if e.resource == "ep_comm"]
    assert [(e.kind, e.start_ms) for e in ep[:2]] == [("dispatch", 1.0), ("combine", 2.5)]


def test_fb_pair_uses_pair_order_and_fixed_order():
    costs = uniform_costs(2, 2.0, 2.0, 1.0, a2a_ms=0.5)
    dag = pair_dag(costs, (0, 1), (1, 2), True)
    po = PairOrder(0, 1, True, named_order(dag, fixed_order(dag)))
    assert po.order[0] == ("compute", ("F.L0.mixer", "B.L1.expert", "W.L1.expert", "F.L0.expert", "B.L1.mixer",
                                       "W.L1.mixer"))
    stages = (StageRef(0, 0, 0, 1), StageRef(1, 1, 1, 2))

    def run(order: int):
        instrs = (I(Op.F, 0, 1), I(Op.FB, 1, 0, 0, 1, with_w=True, order=order))
        return simulate([Program(0, 1, 2, 2, 2, stages, instrs, (po,))], costs)

    a, b = run(-1), run(0)
    # F of chunk 1 alone: 1 + 0.5 + 1 + 0.5 = 3 ms; then the pair (F L0 | B+W L1).
    assert a.rank_spans(0)[1].start_ms == pytest.approx(3.0)
    assert a.iteration_ms == pytest.approx(b.iteration_ms)
    # fixed order: compute F.mixer [0,1], B.expert [1,2] (after B.combine [0,0.5]), W.expert [2,2.5],
    # F.expert (after F.dispatch [1,1.5]) [2.5,3.5], B.mixer (after B.dispatch [2,2.5]) [3.5,4.5],
    # W.mixer [4.5,5]; comm F.combine [3.5,4]. Makespan 5, so the pair covers [3, 8].
    assert a.iteration_ms == pytest.approx(8.0)
    # compute is busy through all of [3, 8] (B.combine [3,3.5] runs under F.mixer), so only the lone
    # forward chunk's two A2As are exposed: 2 x 0.5 = 1 ms.
    assert a.ranks[0].exposed_a2a_ms == pytest.approx(1.0)
    fb = [e for e in a.events if e.instr == 1]
    assert {(e.mb, e.chunk) for e in fb if e.phase == "F"} == {(1, 0)}
    assert {(e.mb, e.chunk) for e in fb if e.phase != "F"} == {(0, 1)}
    bad = PairOrder(1, 0, True, po.order)
    with pytest.raises(ProgramError, match="pair order #0"):
        simulate([Program(0, 1, 2, 2, 2, stages, (I(Op.F, 0, 1), I(Op.FB, 1, 0, 0, 1, with_w=True, order=0)),
                          (bad,))], costs)


def test_deadlock_names_ranks_and_indices():
    s0, s1 = (StageRef(0, 0, -1, 1),), (StageRef(0, 1, 1, 3),)
    r0 = (I(Op.F, 0, 0), I(Op.RECV_GRAD, 0, 0, peer=1), I(Op.SEND_ACT, 0, 0, peer=1))
    r1 = (I(Op.RECV_ACT, 0, 0, peer=0), I(Op.F, 0, 0), I(Op.SEND_GRAD, 0, 0, peer=0))
    with pytest.raises(ProgramError) as ei:
        simulate([Program(0, 2, 1, 1, 2, s0, r0), Program(1, 2, 1, 1, 2, s1, r1)], COSTS)
    msg = str(ei.value)
    assert "deadlock" in msg
    assert "rank 0 instruction 1 recv_grad(mb0.c0 <- r1)" in msg
    assert "rank 1 instruction 0 recv_act(mb0.c0 <- r0)" in msg
    assert (ei.value.rank, ei.value.index) == (0, 1)


def test_unreceived_send_and_wrong_peer_are_errors():
    s0, s1 = (StageRef(0, 0, -1, 1),), (StageRef(0, 1, 1, 3),)
    r0 = (I(Op.F, 0, 0), I(Op.SEND_ACT, 0, 0, peer=1))
    with pytest.raises(ProgramError, match="never received"):
        simulate([Program(0, 2, 1, 1, 2, s0, r0), Program(1, 2, 1, 1, 2, s1, ())], COSTS)
    r1 = (I(Op.RECV_ACT, 0, 0, peer=1),)
    with pytest.raises(ProgramError, match="rank 1, instruction 0"):
        simulate([Program(0, 2, 1, 1, 2, s0, r0), Program(1, 2, 1, 1, 2, s1, r1)], COSTS)


def test_chrome_trace_and_png(tmp_path):
    res = simulate(two_rank_programs(), COSTS)
    p = write_chrome_trace(res, tmp_path / "t" / "trace.json")
    data = json.loads(p.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    tasks = [e for e in xs if e["cat"] == "task"]
    assert len(tasks) == len(res.events) == 2 * (2 * 1 + 2 * 2)  # per rank: 2 F + 2 x (B, W)
    w1 = next(e for e in tasks if e["pid"] == 0 and e["name"] == "W.L0.mixer" and e["args"]["mb"] == 1)
    assert (w1["ts"], w1["dur"], w1["tid"]) == (12000.0, 1000.0, 0)
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "ep_comm", "pp_comm"} <= threads
    assert len([e for e in xs if e["cat"] == "p2p"]) == 4
    assert chrome_trace(res) == data
    png = write_timeline_png(res, tmp_path / "timeline.png", title="1F1B pp=2 M=2")
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000


def test_png_with_a2a_tasks(tmp_path):
    costs = uniform_costs(2, 2.0, 2.0, 1.0, a2a_ms=0.5)
    prog = one_rank([I(Op.F, 0, 0), I(Op.B, 0, 0), I(Op.W, 0, 0)], 2)
    png = write_timeline_png(simulate([prog], costs), tmp_path / "a2a.png")
    assert png.stat().st_size > 5000


# ---------------------------------------------------------------------------------------------
# Published bubble formulas on uniform costs (p2p 0, baseline plans compiled by the compiler).
# F, b, w: per-layer forward, dgrad and wgrad ms; B_full = b + w.

def _sim(template: str, pp: int, vpp: int, m: int, f: float, b: float, w: float, *, layers_per_stage: int = 2,
         overlap: bool = False, split_w: bool = False):
    costs = uniform_costs(pp * vpp * layers_per_stage, f, b, w)
    return simulate(compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=overlap, split_w=split_w)), costs)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (2, 7), (3, 3), (4, 4), (4, 13), (8, 9)])
def test_1f1b_matches_closed_form(pp, m):
    res = _sim("1f1b", pp, 1, m, 1.0, 2.0, 0.5)
    f_st, b_st = 2 * 1.0, 2 * (2.0 + 0.5)  # per stage: 2 layers
    # iteration = M (F + B_full) + (p-1)(F + B_full); every rank idles (p-1)(F + B_full)
    assert res.iteration_ms == pytest.approx(m * (f_st + b_st) + (pp - 1) * (f_st + b_st))
    assert [r.idle_ms for r in res.ranks] == pytest.approx([(pp - 1) * (f_st + b_st)] * pp)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 3, 4), (3, 2, 6), (3, 3, 9), (4, 2, 8), (4, 3, 4)])
def test_interleaved_1f1b_matches_closed_form(pp, vpp, m):
    res = _sim("interleaved-1f1b", pp, vpp, m, 1.0, 2.0, 0.5)
    f_rank, b_rank = vpp * 2 * 1.0, vpp * 2 * (2.0 + 0.5)  # per-rank totals over the vpp chunks
    bubble = (pp - 1) * (f_rank + b_rank) / vpp
    assert [r.idle_ms for r in res.ranks] == pytest.approx([bubble] * pp)
    assert res.iteration_ms == pytest.approx(m * (f_rank + b_rank) + bubble)


# DualPipeV. DeepSeek's README gives DualPipe's bubble as (PP/2-1)(F&B + B - 3W) (B = a *full*
# backward chunk); for DualPipeV on pp ranks that reads (pp-1)(F&B + B - 3W) with per-chunk times.
# Measured here (all ranks idle the same; independent of M; checked for pp in 2..8, M in 2pp..5pp,
# 1-2 layers per chunk), with F, B = B_full, W per chunk:
# * overlap=False, split_w=False (no F&B pairs, no W split off):
#       idle = 2(pp-1)B - F      (for B >= pp/(pp-1) F; below that it becomes max((pp-1)(F+B), 2(pp-1)F))
#   The README formula read for this case (F&B = F + B serial, no W split: W = 0) gives
#   (pp-1)(F + 2B), i.e. the measured bubble is smaller by pp*F: without atomic FB pairs each
#   forward runs as soon as its input is there instead of waiting for its backward partner.
# * overlap=True, split_w=True (DualPipeV proper; F&B = F + B since uniform costs have no A2A):
#       idle = (pp-1)(F&B + B - 3W) - F - (pp-1)min(W, F)    (for dgrad >= 1.5 F): the README
#   formula minus one F, and minus min(W, F) per hop because a pair's activation leaves when the
#   pair's forward side ends (early sends, as the engine posts them), not after the pair's W.
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11), (6, 12), (8, 20)])
@pytest.mark.parametrize("f,b,w", [(1.0, 2.0, 0.5), (1.0, 3.0, 1.5), (0.5, 1.0, 0.25)])
def test_dualpipe_v_bubble_no_overlap_no_split(pp, m, f, b, w):
    res = _sim("dualpipe-v", pp, 2, m, f, b, w, layers_per_stage=1)
    F, B = f, b + w
    bubble = 2 * (pp - 1) * B - F
    assert [r.idle_ms for r in res.ranks] == pytest.approx([bubble] * pp)
    assert res.iteration_ms == pytest.approx(2 * m * (F + B) + bubble)
    readme = (pp - 1) * ((F + B) + B - 3 * 0.0)
    assert readme - bubble == pytest.approx(pp * F)


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 7), (4, 8), (5, 13), (8, 16)])
@pytest.mark.parametrize("f,b,w", [(1.0, 2.0, 0.5), (1.0, 2.0, 2.0), (1.0, 3.0, 0.5)])
def test_dualpipe_v_bubble_overlap_split_w(pp, m, f, b, w):
    res = _sim("dualpipe-v", pp, 2, m, f, b, w, layers_per_stage=1, overlap=True, split_w=True)
    F, B, W = f, b + w, w
    readme = (pp - 1) * ((F + B) + B - 3 * W)
    bubble = readme - F - (pp - 1) * min(W, F)
    assert [r.idle_ms for r in res.ranks] == pytest.approx([bubble] * pp)
    assert res.iteration_ms == pytest.approx(2 * m * (F + B) + bubble)


@pytest.mark.parametrize("template,pp,vpp", [("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1),
                                             ("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 4, 2),
                                             ("interleaved-1f1b", 4, 3), ("dualpipe-v", 2, 2), ("dualpipe-v", 4, 2)])
@pytest.mark.parametrize("m_per_pp", [1, 2, 4, 10])
@pytest.mark.parametrize("split_w", [False, True])
def test_overlap_never_slower_when_compute_and_comm_are_independent(template, pp, vpp, m_per_pp, split_w):
    """With the all-to-all on its own resource and no SM slowdown, running F and B of two
    microbatches as one FB can only hide work; the 1f1b template once serialised the pipeline
    with it (each step waited for the next rank's whole FB: 42.7% bubble against 7.3%)."""
    m = max(m_per_pp * pp, 2 * pp if template == "dualpipe-v" else 1)
    costs = uniform_costs(pp * vpp * 2, f_ms=1.0, b_ms=2.0, w_ms=1.0, a2a_ms=0.4, p2p_ms=0.05,
                          overlap_slowdown=1.0)
    on = simulate(compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=True, split_w=split_w)), costs)
    off = simulate(compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=False, split_w=split_w)), costs)
    assert on.iteration_ms <= off.iteration_ms * (1 + 1e-9), (on.iteration_ms, off.iteration_ms)
    if m >= 4 * pp:  # a steady state long enough to hide all-to-alls
        assert on.iteration_ms < off.iteration_ms
