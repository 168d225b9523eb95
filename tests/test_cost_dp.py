"""MoE dispatcher model (alltoall vs DeepEP), data-parallel collectives, the optimizer step and
the simulator's timing of reduce_grads / optimizer_step, against hand-computed values."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tessera.cost.analytic import analytic_costs
from tessera.cost.comm import a2a_bytes, a2a_ms, a2a_split, deepep_split, expected_distinct, moe_a2a
from tessera.cost.dp import ADAM_BYTES, dp_groups, dp_link_gbs, group_gbs, layer_dp, optimizer_ms, ring_ms
from tessera.cost.memory import ParamSplit
from tessera.cost.types import CostOptions, LayerDP, ParallelShape, Resource, TaskKind
from tessera.cost.uniform import uniform_costs
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Instr, Op, Program, StageRef
from tessera.sim.simulator import simulate
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import MoESpec
from tessera.spec.placement import place
from tessera.spec.presets import get_model

H800 = get_hardware("h800")
DSV3 = get_model("deepseek-v3")
ROW = 4096 * 7168 * 2  # one token copy of a 4096-token microbatch, DeepSeek-V3 hidden, BF16


def test_expected_distinct_known_values():
    # 8 nodes of 32 experts, top-8 without replacement: 8 * (1 - C(224, 8) / C(256, 8))
    assert expected_distinct(8, 32, 8) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert expected_distinct(8, 32, 8) == pytest.approx(5.2947, abs=1e-4)
    # with many experts per bin it tends to the with-replacement 8 * (1 - (7/8)^8) = 5.2511
    assert expected_distinct(8, 10**6, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8), rel=1e-5)
    assert expected_distinct(2, 1, 2) == 2.0  # two experts, one per bin, both chosen
    assert expected_distinct(4, 32, 8) == pytest.approx(3.6290, abs=1e-4)  # DeepSeek-V3: 4 reachable nodes
    assert expected_distinct(4, 3, 10) == 4.0  # more picks than fit outside one bin: all hit
    assert expected_distinct(1, 8, 3) == 1.0


def test_deepep_one_node_equals_alltoall_with_one_expert_per_rank():
    # ep = num_experts = 8, top-2: every copy goes to a distinct rank, nothing to de-duplicate
    s = deepep_split(1000, 2, 64, 8, 8, 8)
    a = a2a_split(a2a_bytes(1000, 2, 64), 8, 8)
    assert (s.intra, s.inter, s.local) == pytest.approx((a.intra, a.inter, a.local))


def test_deepep_vs_alltoall_ep8_one_node():
    moe = DSV3.moe
    s = deepep_split(4096, moe.top_k, 7168, 8, 8, moe.num_experts, moe.num_groups, moe.topk_groups)
    assert s.inter == 0.0
    # 32 experts per rank: a token reaches G = expected_distinct(8, 32, 8) ranks, 7/8 of them over NVLink
    assert s.intra == pytest.approx(ROW * expected_distinct(8, 32, 8) * 7 / 8)
    a_ms, a_b = moe_a2a(4096, moe, 7168, 8, H800, "alltoall")
    d_ms, d_b = moe_a2a(4096, moe, 7168, 8, H800, "deepep")
    assert a_ms == pytest.approx(a2a_ms(a2a_bytes(4096, 8, 7168), 8, H800))  # alltoall: the old formula
    assert a_ms == pytest.approx(ROW * 7 / 160e9 * 1e3 + 0.01)  # 7 copies over NVLink at 160 GB/s
    assert d_ms == pytest.approx(ROW * 4.6328 / 160e9 * 1e3 + 0.01, rel=1e-4)  # 5.29 * 7/8 copies
    assert 0.6 < d_ms / a_ms < 0.7 and d_b < a_b


def test_deepep_ep64_sends_one_copy_per_node_over_the_network():
    moe = DSV3.moe  # 256 experts, top-8, node-limited routing: at most 4 of 8 groups (= nodes at ep 64)
    s = deepep_split(4096, moe.top_k, 7168, 64, 8, moe.num_experts, moe.num_groups, moe.topk_groups)
    a = a2a_split(a2a_bytes(4096, 8, 7168), 64, 8)
    assert a.inter == pytest.approx(ROW * 7)  # alltoall: 56 of 64 ranks are remote -> 7 of 8 copies
    assert s.inter == pytest.approx(ROW * expected_distinct(4, 32, 8) * 7 / 8)  # 3.18 node copies
    assert s.inter < 0.5 * a.inter
    free = deepep_split(4096, 8, 7168, 64, 8, 256)  # no group limit: 5.29 nodes of 8
    assert free.inter == pytest.approx(ROW * expected_distinct(8, 32, 8) * 7 / 8)
    a_ms, _ = moe_a2a(4096, moe, 7168, 64, H800, "alltoall")
    d_ms, _ = moe_a2a(4096, moe, 7168, 64, H800, "deepep")
    assert a_ms == pytest.approx(ROW * 7 / 50e9 * 1e3 + 0.01)
    assert d_ms == pytest.approx(s.inter / 50e9 * 1e3 + 0.01)  # IB-bound
    assert d_ms / a_ms == pytest.approx(0.454, abs=0.005)


def test_analytic_dispatch_tasks_follow_the_dispatcher():
    p = ParallelShape(pp=16, vpp=2, ep=64, dp=64, num_microbatches=32)
    costs = {d: analytic_costs(DSV3, H800, p, options=CostOptions(moe_dispatcher=d)) for d in ("alltoall", "deepep")}
    lay = [c.layers[10] for c in costs.values()]
    disp = [next(t for t in lc.tasks if t.kind == TaskKind.DISPATCH and t.phase.value == "F") for lc in lay]
    assert disp[0].ms == pytest.approx(a2a_ms(a2a_bytes(4096, 8, 7168), 64, H800))
    assert disp[1].ms == pytest.approx(moe_a2a(4096, DSV3.moe, 7168, 64, H800, "deepep")[0])
    assert disp[1].ms < 0.5 * disp[0].ms
    # bytes moved: DeepEP forwards each node copy again over NVLink, so its total exceeds alltoall's
    s = deepep_split(4096, 8, 7168, 64, 8, 256, 8, 4)
    assert disp[0].bytes == a2a_bytes(4096, 8, 7168) and disp[1].bytes == pytest.approx(s.total)
    comp = [sum(t.ms for t in lc.tasks if t.resource == Resource.COMPUTE) for lc in lay]
    assert comp[0] == pytest.approx(comp[1])  # only the A2A changes


def test_ring_collective_ms_for_a_known_size():
    # 1 GB over 8 GPUs at 50 GB/s, 10 us per step: 1e9 * 7/8 / 50e9 s + 7 * 10 us
    assert ring_ms(1e9, 8, 50.0, 10.0) == pytest.approx(17.5 + 0.07)
    assert ring_ms(1e9, 1, 50.0, 10.0) == 0.0 and ring_ms(0.0, 8, 50.0, 10.0) == 0.0
    # the bandwidth term grows with (n-1)/n, the latency term with n-1
    assert ring_ms(1e9, 2, 50.0, 0.0) == pytest.approx(10.0)
    assert ring_ms(1e9, 64, 50.0, 0.0) == pytest.approx(20.0 * 63 / 64)
    assert ring_ms(1e9, 256, 50.0, 10.0) - ring_ms(1e9, 256, 50.0, 0.0) == pytest.approx(2.55)


def test_dp_groups_links_and_layer_costs():
    p = ParallelShape(pp=16, ep=64, dp=64)
    assert dp_groups(p) == (64, 1) and dp_groups(replace(p, dp=256)) == (256, 4)
    assert dp_link_gbs(ParallelShape(dp=8), H800) == (160.0, 160.0)  # one node: NVLink
    h = get_hardware("h100-sxm")  # 8 GPUs per node, one NIC each
    nv, nic = h.intra_node_gbs, h.inter_node_gbs
    dense = lambda dp, tp=1, order="ep-dp-pp", pp=1, ep=1: place(pp, dp, ep, 8, order, tp).group("dense_dp")  # noqa: E731
    assert group_gbs(dense(64), h) == min(nv, 8 * nic) == group_gbs(dense(16), h)  # 8 rings, one per NIC
    assert group_gbs(dense(32, tp=2), h) == min(nv, 4 * nic)  # tp 2: 4 members (NICs) per node
    assert group_gbs(place(1, 256, 64, 8, "ep-dp-pp").group("expert_dp"), h) == nic  # ep apart: one per node
    assert group_gbs(dense(4, tp=2), h) == nv  # 8 GPUs: one node
    assert group_gbs(dense(8, order="pp-ep-dp", pp=8, ep=8), h) == nic  # a node per pipeline: one DP member per node
    # DeepSeek-V3 layout on H800: dense 64 ranks, 8 per node -> min(160, 400); experts 1 rank
    assert dp_link_gbs(p, H800) == (160.0, 160.0) and dp_link_gbs(replace(p, dp=256), H800) == (160.0, 50.0)
    params = ParamSplit(dense=1e9, expert=64e9)  # 1e9 local dense, 1e9 local expert params at ep 64
    d = layer_dp(params, replace(p, dp=256), H800)  # dense over 256 ranks, experts over 4
    assert d.gather_ms == pytest.approx(ring_ms(2e9, 256, 160.0, 10.0) + ring_ms(2e9, 4, 50.0, 10.0))
    assert d.reduce_ms == pytest.approx(ring_ms(4e9, 256, 160.0, 10.0) + ring_ms(4e9, 4, 50.0, 10.0))
    assert d.reduce_ms == pytest.approx(4e9 * 255 / 256 / 160e9 * 1e3 + 2.55 + 4e9 * 3 / 4 / 50e9 * 1e3 + 0.03)
    assert d.optimizer_ms == pytest.approx((1e9 / 256 + 1e9 / 4) * 30 / 3.35e12 * 1e3)
    one = layer_dp(params, ParallelShape(ep=1, dp=1), H800)
    assert (one.gather_ms, one.reduce_ms) == (0.0, 0.0)  # nothing to reduce without data parallelism
    assert one.optimizer_ms == pytest.approx(optimizer_ms(65e9, H800)) and ADAM_BYTES == 30


def test_more_dp_smaller_optimizer_shard_longer_reduce():
    a = analytic_costs(DSV3, H800, ParallelShape(pp=16, vpp=2, ep=64, dp=64, num_microbatches=32))
    b = analytic_costs(DSV3, H800, ParallelShape(pp=16, vpp=2, ep=64, dp=256, num_microbatches=32))
    la, lb = a.layers[10].dp, b.layers[10].dp
    assert lb.optimizer_ms < la.optimizer_ms / 3  # experts sharded over 4 instead of 1
    assert lb.reduce_ms > la.reduce_ms  # (n-1)/n, more latency steps, and the expert reduce-scatter
    assert a.embed.dp.gather_ms > 0 and a.head.dp.reduce_ms > 0


def _two_rank(dp: LayerDP, dp_shard: str = "zero1"):
    """The 1F1B pp=2 M=2 Programs of tests/test_simulator.py with reduce_grads + optimizer_step,
    every decoder layer carrying ``dp``."""
    I = Instr
    tail = (I(Op.REDUCE_GRADS), I(Op.OPTIMIZER_STEP))
    r0 = (I(Op.F, 0, 0), I(Op.SEND_ACT, 0, 0, peer=1), I(Op.F, 1, 0), I(Op.SEND_ACT, 1, 0, peer=1),
          I(Op.RECV_GRAD, 0, 0, peer=1), I(Op.B, 0, 0, with_w=True),
          I(Op.RECV_GRAD, 1, 0, peer=1), I(Op.B, 1, 0, with_w=True)) + tail
    r1 = (I(Op.RECV_ACT, 0, 0, peer=0), I(Op.F, 0, 0), I(Op.B, 0, 0, with_w=True), I(Op.SEND_GRAD, 0, 0, peer=0),
          I(Op.RECV_ACT, 1, 0, peer=0), I(Op.F, 1, 0), I(Op.B, 1, 0, with_w=True), I(Op.SEND_GRAD, 1, 0, peer=0)) + tail
    progs = (Program(0, 2, 1, 2, 2, (StageRef(0, 0, -1, 1),), r0, template="1f1b"),
             Program(1, 2, 1, 2, 2, (StageRef(0, 1, 1, 3),), r1, template="1f1b"))
    base = uniform_costs(2, 1.0, 2.0, 1.0, p2p_ms=0.5)
    costs = replace(base, layers=tuple(replace(l, dp=dp) for l in base.layers), dp_shard=dp_shard)
    return progs, costs


def test_simulator_charges_reduce_grads_and_optimizer_step():
    # Without DP the ranks end at 13 (rank 0) and 9.5 (tests/test_simulator.py). zero1: rank 0's
    # reduce-scatter (2 ms) starts when its last B+W ends (13), reduce_grads waits until 15, the
    # optimizer runs 15 -> 15.25. The gathers (0.5 ms from t=0) hide behind the first forwards.
    progs, costs = _two_rank(LayerDP(gather_ms=0.5, reduce_ms=2.0, optimizer_ms=0.25))
    res = simulate(progs, costs)
    sp = res.rank_spans(0)
    assert (sp[-2].op, sp[-2].start_ms, sp[-2].end_ms) == ("reduce_grads", 13.0, 15.0)
    assert (sp[-1].op, sp[-1].start_ms, sp[-1].end_ms) == ("optimizer_step", 15.0, 15.25)
    assert res.iteration_ms == pytest.approx(15.25)
    m0, m1 = res.ranks
    assert (m0.busy_ms, m0.dp_exposed_ms, m0.optimizer_ms) == pytest.approx((8.0, 2.0, 0.25))
    assert m0.idle_ms == pytest.approx(15.25 - 8.0 - 2.0 - 0.25)  # the bubble excludes DP and optimizer time
    assert m1.dp_exposed_ms == pytest.approx(2.0) and m1.end_ms == pytest.approx(11.75)
    assert res.bubble_ratio == pytest.approx((m0.idle_ms + m1.idle_ms) / (2 * 15.25))
    kinds = [(c.rank, c.kind, c.start_ms, c.end_ms) for c in res.collectives]
    assert kinds == [(0, "all_gather", 0.0, 0.5), (0, "reduce_scatter", 13.0, 15.0),
                     (1, "all_gather", 0.0, 0.5), (1, "reduce_scatter", 9.5, 11.5)]


def test_a_gather_longer_than_the_first_forward_is_exposed():
    progs, costs = _two_rank(LayerDP(gather_ms=1.5))
    res = simulate(progs, costs)
    assert res.rank_spans(0)[0].end_ms == pytest.approx(1.5)  # F(mb0) computes 1 ms, waits for its gather
    assert res.ranks[0].dp_exposed_ms == pytest.approx(0.5)


def test_fsdp_gathers_around_every_forward_and_backward():
    dp = LayerDP(gather_ms=0.5, reduce_ms=2.0, optimizer_ms=0.25)
    zero1 = simulate(*_two_rank(dp, "zero1"))
    fsdp = simulate(*_two_rank(dp, "fsdp"))
    count = lambda res, r, k: sum(1 for c in res.collectives if c.rank == r and c.kind == k)  # noqa: E731
    assert [count(zero1, 0, "all_gather"), count(zero1, 0, "reduce_scatter")] == [1, 1]
    assert [count(fsdp, 0, "all_gather"), count(fsdp, 0, "reduce_scatter")] == [4, 2]  # 2 F + 2 B; 2 B+W
    # rank 1 under fsdp: F(mb0) [1.5, 2.5], B+W(mb0) [2.5, 5.5] then its reduce-scatter [5.5, 7.5];
    # F(mb1) starts at 5.5 but its gather waits for the link: [7.5, 8], so F(mb1) ends at 8, not 6.5
    g = [c for c in fsdp.collectives if c.rank == 1 and c.kind == "all_gather"]
    assert [(c.start_ms, c.end_ms) for c in g] == [(1.5, 2.0), (2.5, 3.0), (7.5, 8.0), (8.0, 8.5)]
    f1 = next(s for s in fsdp.rank_spans(1) if s.op == "F" and s.text == "F(mb1.c0)")
    assert (f1.start_ms, f1.end_ms) == (5.5, 8.0)
    assert fsdp.iteration_ms >= zero1.iteration_ms


def test_zero1_vs_fsdp_and_dp_scaling_on_a_real_recipe():
    model = get_model("qwen3-next-80b-a3b")

    def sim(dp: int, shard: str = "zero1"):
        p = ParallelShape(pp=8, vpp=2, ep=8, dp=dp, num_microbatches=16)
        costs = analytic_costs(model, H800, p, options=CostOptions(recompute="full", dp_shard=shard))
        return simulate(compile_plan(baseline_plan(costs, "interleaved-1f1b", 8, 2, 16)), costs)

    a, b, f = sim(8), sim(64), sim(64, "fsdp")  # dp 8: NVLink rings; dp 64: the network
    assert max(m.optimizer_ms for m in b.ranks) < max(m.optimizer_ms for m in a.ranks) / 4
    assert all(m.optimizer_ms > 0 and m.dp_exposed_ms > 0 for m in a.ranks)
    assert b.iteration_ms != a.iteration_ms  # data parallelism changes the simulated iteration
    assert f.iteration_ms > b.iteration_ms
    assert len(f.collectives) > 10 * len(b.collectives)
    for res in (a, b, f):
        for m in res.ranks:
            assert m.busy_ms + m.idle_ms + m.dp_exposed_ms + m.optimizer_ms == pytest.approx(res.iteration_ms)


def test_cost_options_reject_unknown_dispatcher():
    with pytest.raises(ValueError, match="moe_dispatcher"):
        CostOptions(moe_dispatcher="nccl")
    with pytest.raises(ValueError, match="dispatcher"):
        moe_a2a(10, MoESpec(num_experts=8, top_k=2, expert_ffn=8), 16, 8, H800, "nccl")
