"""The memory model: static bytes per data-parallel sharding, selective recompute, FP8
activations, and the in-flight microbatch of an overlapped F&B pair (docs/cost-model.md, Memory)."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.memory import (ALL_OPS, ParamSplit, fsdp_transient_bytes, layer_activation, layer_params,
                                 recompute_ops, static_bytes)
from tessera.cost.types import CostOptions, ModelCosts, Phase, TaskKind
from tessera.flow import compile_programs
from tessera.plan.baseline import baseline_plan
from tessera.plan.candidates import (candidates_of, exact_candidate_memory, fixed_order_pair_peaks,
                                     stage_candidates)
from tessera.program.instructions import Op
from tessera.program.memory import fb_peak_bytes, fb_schedule, pair_peak_bytes, rank_memory_bytes
from tessera.sched.chunkdag import pair_dag, serial_order
from tessera.sched.dag import run_in_order
from tessera.sim.simulator import simulate
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

T = 4096  # tokens of one microbatch (mbs 1, seq 4096)
DSV3 = get_model("deepseek-v3")
QWEN = get_model("qwen3-next-80b-a3b")


def _act(layer, model, **opts):
    return layer_activation(layer, model.hidden, T, options=CostOptions(**opts))


# ---------------------------------------------------------------------------------------------
# static bytes


def test_static_bytes_zero1_and_fsdp_by_hand():
    p = ParamSplit(dense=1e9, expert=8e9)  # tp 2 -> 0.5e9 dense, ep 4 -> 2e9 expert; edp = 8*2//4 = 4
    assert static_bytes(p, tp=2, ep=4, dp=8) == pytest.approx((5e9, 10e9, 12 * (0.5e9 / 8 + 2e9 / 4)))
    shard = 0.5e9 / 8 + 2e9 / 4
    assert static_bytes(p, tp=2, ep=4, dp=8, dp_shard="fsdp") == pytest.approx((2 * shard, 4 * shard, 12 * shard))
    assert fsdp_transient_bytes(p, tp=2, ep=4, dp_shard="fsdp") == pytest.approx(8 * 2.5e9)
    assert fsdp_transient_bytes(p, tp=2, ep=4) == 0.0
    with pytest.raises(ValueError):
        static_bytes(p, tp=1, ep=1, dp=1, dp_shard="zero3")


def test_fsdp_layer_memory_of_a_deepseek_layer():
    # DeepSeek-V3 layer 3 (MLA + MoE) at ep 64, dp 64, tp 1: experts shard over edp = 1, dense over 64
    par = ParallelConfig(pp=16, vpp=2, ep=64, tp=1, dp=64, num_microbatches=32)
    hw = get_hardware("h800")
    z = analytic_costs(DSV3, hw, par).layers[3].memory
    f = analytic_costs(DSV3, hw, par, options=CostOptions(dp_shard="fsdp")).layers[3].memory
    lp = layer_params(DSV3.layers[3], DSV3.hidden)
    local, shard = lp.dense + lp.expert / 64, lp.dense / 64 + lp.expert / 64
    assert (z.params, z.grads, z.optimizer, z.transient) == pytest.approx((2 * local, 4 * local, 12 * shard, 0.0))
    assert (f.params, f.grads, f.optimizer, f.transient) == pytest.approx((2 * shard, 4 * shard, 12 * shard, 8 * local))
    assert f.activation == z.activation


# ---------------------------------------------------------------------------------------------
# selective recompute


def test_selective_modules_save_the_expected_bytes():
    mla_moe = DSV3.layers[3]
    h, nh, dqk, dv = DSV3.hidden, 128, 128 + 64, 128
    moe = mla_moe.mlp
    base = _act(mla_moe, DSV3)
    saved = {m: base.stored - _act(mla_moe, DSV3, recompute="selective", recompute_modules=(m,)).stored
             for m in ("core_attn", "mla_up_proj", "layernorm", "moe_act", "shared_experts", "moe", "mlp")}
    assert saved["core_attn"] == 4 * T * nh  # FlashAttention: only the FP32 LSE
    assert saved["mla_up_proj"] == 2 * T * nh * (2 * dqk + dv)  # Q, K, V of the core
    assert saved["layernorm"] == 2 * (2 * T * h)  # input-norm and pre-MLP-norm outputs
    assert saved["moe_act"] == 2 * T * moe.top_k * moe.expert_ffn  # expert fc2 inputs
    assert saved["shared_experts"] == 2 * T * 3 * moe.shared_expert_ffn  # fc1 out (2 ffn) + act out
    a = T * moe.top_k
    # probs, then expert inputs, fc1 outputs and fc2 inputs (the probabilities are applied in the
    # activation, so the expert outputs are not stored)
    assert saved["moe"] == 4 * T * moe.num_experts + 2 * a * (h + 2 * moe.expert_ffn + moe.expert_ffn) \
        + saved["shared_experts"]
    assert saved["mlp"] == 0  # no dense MLP in this layer
    both = _act(mla_moe, DSV3, recompute="selective", recompute_modules=("mla_up_proj", "moe_act"))
    assert base.stored - both.stored == saved["mla_up_proj"] + saved["moe_act"]
    # what W reads after B does not shrink (B rebuilds it)
    assert both.gemm_inputs == base.gemm_inputs
    full = _act(mla_moe, DSV3, recompute="full")
    assert full.stored == 2 * T * h and full.gemm_inputs == base.gemm_inputs


def test_gated_attention_core_attn_keeps_o_for_the_gate():
    attn = QWEN.layers[3]  # gated attention + MoE: O feeds the gate, only the LSE goes
    base = _act(attn, QWEN)
    core = _act(attn, QWEN, recompute="selective", recompute_modules=("core_attn",))
    assert base.stored - core.stored == 4 * T * attn.mixer.num_heads
    delta = QWEN.layers[0]  # DeltaNet: no attention core
    assert _act(delta, QWEN, recompute="selective", recompute_modules=("core_attn",)) == _act(delta, QWEN)


def test_recompute_ops_and_their_backward_time():
    opts = CostOptions(recompute="selective", recompute_modules=("mla_up_proj", "moe_act", "moe"))
    ops = recompute_ops(DSV3.layers[3], opts)
    assert ops[TaskKind.MIXER] == {"q_up", "kv_up", "rope"}
    assert ops[TaskKind.EXPERT] == ALL_OPS and ops[TaskKind.DISPATCH] == ALL_OPS
    assert ops[TaskKind.ROUTER] == {"router", "softmax_topk", "latent_down"}
    assert recompute_ops(DSV3.layers[3], CostOptions()) == {}
    assert set(recompute_ops(DSV3.layers[0], CostOptions(recompute="full"))) == {TaskKind.MIXER, TaskKind.MLP}

    from tessera.cost.analytic import ops_ms
    from tessera.cost.flops import layer_ops

    par = ParallelConfig(pp=16, vpp=2, ep=64, tp=1, dp=64, num_microbatches=32)
    hw = get_hardware("h800")
    plain = analytic_costs(DSV3, hw, par).layers[3]
    sel = analytic_costs(DSV3, hw, par, options=CostOptions(recompute="selective",
                                                             recompute_modules=("mla_up_proj",))).layers[3]
    mixer_ops = layer_ops(DSV3.layers[3], DSV3.hidden, T, T, 1, 64)[TaskKind.MIXER]
    extra = ops_ms(tuple(o for o in mixer_ops if o.name in ("q_up", "kv_up", "rope")), 0, hw)
    for a, b in zip(plain.tasks, sel.tasks):
        want = extra if (a.kind, a.phase) == (TaskKind.MIXER, Phase.B) else 0.0
        assert b.ms - a.ms == pytest.approx(want, abs=1e-12) and a.flops == b.flops
    assert extra > 0


# ---------------------------------------------------------------------------------------------
# FP8 activations


def test_fp8_halves_the_gemm_inputs():
    dense = DSV3.layers[0]  # MLA + dense MLP: every GEMM is an FP8 linear
    bf, f8 = _act(dense, DSV3), _act(dense, DSV3, precision="fp8")
    assert f8.gemm_inputs == bf.gemm_inputs / 2
    m, h = dense.mixer, DSV3.hidden
    only_gemm = T * h + T * (m.q_lora_rank + m.kv_lora_rank) + T * h + T * dense.mlp.ffn  # 2 B -> 1 B
    attn_out = T * m.num_heads * m.v_head_dim  # flash-attn keeps the BF16 O, o_proj adds an FP8 copy
    assert bf.stored - f8.stored == only_gemm - attn_out
    # the MoE router input stays BF16 (router GEMM) and the shared expert's FP8 copy comes on top
    moe = DSV3.layers[3]
    bf, f8 = _act(moe, DSV3), _act(moe, DSV3, precision="fp8")
    assert f8.gemm_inputs < bf.gemm_inputs and f8.stored < bf.stored


# ---------------------------------------------------------------------------------------------
# the in-flight microbatch of F&B overlap


def _qwen(n: int, **opts) -> ModelCosts:
    par = ParallelConfig(pp=2, vpp=2, ep=8, tp=1, dp=8, num_microbatches=4)
    c = analytic_costs(QWEN, get_hardware("h800"), par, options=CostOptions(**opts))
    return dataclasses.replace(c, layers=c.layers[:n], head=dataclasses.replace(c.head, index=n))


def _old_rule(programs, costs) -> list[float]:
    """The older accounting: an FB allocates its forward's whole activation at its start."""
    out = []
    for prog in programs:
        mem = {st.chunk: (sum(costs.layer(i).memory.activation for i in range(st.start, st.stop)),
                          sum(costs.layer(i).memory.w_activation for i in range(st.start, st.stop)))
               for st in prog.stages}
        static = sum(costs.layer(i).memory.static for st in prog.stages for i in range(st.start, st.stop))
        cur = peak = 0.0
        for ins in prog.instructions:
            if ins.op in (Op.F, Op.FB):
                cur += mem[ins.chunk][0]
                peak = max(peak, cur)
            if ins.op in (Op.B, Op.FB):
                a, w = mem[ins.chunk if ins.op == Op.B else ins.chunk2]
                cur -= a if ins.with_w else a - w
            elif ins.op == Op.W:
                cur -= mem[ins.chunk][1]
            peak = max(peak, cur)
        out.append(static + peak)
    return out


def test_pair_peak_is_the_forward_only_when_run_back_to_back():
    costs = _qwen(8)
    dag = pair_dag(costs, (0, 2), (4, 6), True, slowdown=1.0)
    serial = run_in_order(dag, serial_order(dag))
    act_f = sum(costs.layer(i).memory.activation for i in (0, 1))
    assert pair_peak_bytes(costs, dag, serial, (0, 2), (4, 6), True) == pytest.approx(act_f)
    from tessera.sched.chunkdag import fixed_order
    over = pair_dag(costs, (0, 2), (4, 6), True)
    fixed = run_in_order(over, fixed_order(over))
    inner = pair_peak_bytes(costs, over, fixed, (0, 2), (4, 6), True)
    # layer step j: F layer j allocates, then B layer j frees: at most one layer ahead
    assert inner < act_f and inner == pytest.approx(costs.layer(0).memory.activation)


@pytest.mark.parametrize("template,pp,vpp,m,opts", [
    ("interleaved-1f1b", 2, 2, 4, {}),
    ("1f1b", 2, 1, 4, {}),
    ("dualpipe-v", 2, 2, 4, {"recompute": "selective", "recompute_modules": ("moe_act", "layernorm")}),
    ("interleaved-1f1b", 2, 2, 4, {"dp_shard": "fsdp", "precision": "fp8"}),
])
def test_fb_peak_is_lower_and_the_three_accountings_agree(template, pp, vpp, m, opts):
    costs = _qwen(8, **opts)
    plan = baseline_plan(costs, template, pp, vpp, m)
    programs = compile_programs(plan)
    new = rank_memory_bytes(programs, costs)
    sim = [r.peak_mem_gb * 1e9 for r in simulate(programs, costs).ranks]
    assert sim == pytest.approx(list(new), rel=1e-12)
    transient = [max(costs.layer(i).memory.transient for st in p.stages for i in range(st.start, st.stop))
                 for p in programs]
    old = [o + t for o, t in zip(_old_rule(programs, costs), transient)]
    assert all(n <= o * (1 + 1e-12) for n, o in zip(new, old))
    assert any(n < o - 1e8 for n, o in zip(new, old))  # the overlapped pairs free early
    cands = stage_candidates(plan.partition, 1, len(costs.layers))
    peaks = fixed_order_pair_peaks(costs, cands, template, pp, vpp, m)
    mem = exact_candidate_memory(costs, cands, template, pp, vpp, m, pair_peak=peaks)
    got = mem.peak(candidates_of(plan.partition))
    assert [got[r] for r in range(pp)] == pytest.approx(list(new), rel=1e-12)
    # each FB's own peak never exceeds its forward's whole activation
    for prog in programs:
        for ins in prog.instructions:
            if ins.op == Op.FB:
                st = next(s for s in prog.stages if s.chunk == ins.chunk)
                act_f = sum(costs.layer(i).memory.activation for i in range(st.start, st.stop))
                assert fb_peak_bytes(prog, ins, costs, *fb_schedule(prog, ins, costs)) <= act_f * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_milp_with_pair_memory_terms_equals_brute_force(seed):
    # memory rows whose FB points carry pair terms (x_f * x_b): the MILP (pruned or not) finds the
    # brute-force optimum over the choices whose exact peak fits
    import random

    from plan_helpers import chains, random_layout
    from tessera.plan.candidates import CandidateMemory
    from tessera.plan.milp import solve_partition

    rng = random.Random(seed)
    base, cands, n_layers, ranks = random_layout(rng)
    gb = [rng.uniform(1, 4) for _ in range(n_layers + 2)]
    size = {c: 1e9 * sum(gb[i + 1] for i in range(c.start, c.stop)) for s in cands for c in s}
    edges = [(f, b) for f in range(len(cands)) for b in range(len(cands)) if f != b and ranks[f] == ranks[b]]
    if not edges:
        edges = [(0, 0)]
    ec = {(cf, cb): float(rng.randint(10, 60)) for f, b in edges for cf in cands[f]
          for cb in (cands[b] if f != b else (cf,))}
    rows, terms = [], []
    for r in sorted(set(ranks)):
        mine = [c for s, st in enumerate(cands) if ranks[s] == r for c in st]
        rows.append((r, {c: size[c] for c in mine}))
        terms.append({})
        for f, b in edges:
            if ranks[f] == r and f != b:
                rows.append((r, {c: size[c] for c in mine}))
                terms.append({(cf, cb): 1e9 * rng.uniform(0, 6) for cf in cands[f] for cb in cands[b]})
    mem = CandidateMemory(ranks, dict(size), tuple(rows), tuple(terms))
    peaks = sorted(max(mem.peak(ch).values()) for ch in chains(cands))
    cap = peaks[len(peaks) // 3]
    fits = [ch for ch in chains(cands) if max(mem.peak(ch).values()) <= cap * (1 + 1e-9)]
    edge_set = {(cf.stage, cb.stage) for cf, cb in ec}
    want = min(max(ec[(ch[f], ch[b])] for f, b in edge_set) for ch in fits)
    paired = {s for e in edge_set for s in e}
    stage_ms = {c: 0.0 for s in range(len(cands)) if s not in paired for c in cands[s]}
    for prune in (False, True):
        res = solve_partition(cands, ec, mem, cap, baseline_bottleneck_ms=60.0, prune=prune, stage_ms=stage_ms,
                              time_limit_s=30)
        assert res.bottleneck_ms == pytest.approx(want, abs=1e-9)
        assert max(mem.peak(res.choice).values()) <= cap * (1 + 1e-9)
