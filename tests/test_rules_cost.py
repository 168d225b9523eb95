"""Rules of the cost model and the partition MILP (issue 9, items E5 and E6).

E5: under tensor parallelism (with sequence parallelism) the shared expert is split over ``tp``
GPUs (FLOPs and bytes / tp) and pays an all-gather before and a reduce-scatter after it in F and
in B (none in W) — computed here by hand from the documented formulas.
E6: the MILP's second, tie-break phase (least sum of selected costs) must keep the optimal
bottleneck of the first phase.
"""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.comm import tp_collective_ms
from tessera.cost.efficiency import gemm_rate
from tessera.cost.types import Phase, TaskKind
from tessera.plan.candidates import Candidate, stage_candidates
from tessera.plan.milp import solve_partition
from tessera.program.plan import Partition
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import LayerSpec, ModelSpec, MoESpec

H800 = get_hardware("h800")


def _shared_by_hand(t: int, h: int, fs: int, tp: int) -> tuple[list[float], list[float]]:
    """(FLOPs, ms) of the shared SwiGLU expert in F, B, W on one of ``tp`` GPUs, ``t`` tokens:
    GEMMs at the shape-dependent rate (tessera.cost.efficiency) of their per-phase (M, N, K),
    memory at mem_bw * mem_bw_efficiency, plus kernel_launch_us per kernel."""
    bw = H800.mem_bw_tbs * 1e12 * H800.mem_bw_efficiency
    launch = H800.kernel_launch_us * 1e-6
    gemms = [(t, h, 2 * fs / tp), (t, fs / tp, h)]  # fc1 (gate + up) column-parallel, fc2 row-parallel
    flops, ms = [], []
    for ph in range(3):
        f_total, sec = 0.0, 0.0
        for m, k, n in gemms:
            f = 2.0 * m * k * n
            act = 2.0 * m * (k + n)  # the TP-unsplit activation is read whole
            by = act + (2.0 * k * n if ph < 2 else 8.0 * k * n)  # W: FP32 main-grad read+write
            mnk = [(m, n, k), (m, k, n), (k, n, m)][ph]  # F, dgrad, wgrad (reduces over tokens)
            f_total += f
            sec += max(f / gemm_rate(*mnk, H800), by / bw) + launch
        act_in, act_out = t * 2 * fs, t * fs  # SwiGLU activation: 0 FLOPs, bytes only (none in W)
        sec += [2.0 * (act_in + act_out), 2.0 * (2 * act_in + act_out), 0.0][ph] / tp / bw
        sec += launch if ph < 2 else 0.0
        if ph < 2 and tp > 1:  # SP all-gather in, reduce-scatter out: BF16 [t, h], (tp-1)/tp of it over NVLink
            sec += 2 * (2.0 * t * h * (tp - 1) / tp / (H800.intra_node_gbs * 1e9) + H800.link_latency_us * 1e-6)
        flops.append(f_total)
        ms.append(sec * 1e3)
    return flops, ms


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shared_expert_flops_and_collectives_by_hand(tp):
    h, fs, t = 1024, 512, 4096
    model = ModelSpec("shared", h, 1000, (LayerSpec(0, None, MoESpec(num_experts=8, top_k=2, expert_ffn=256,
                                                                      shared_expert_ffn=fs)),))
    # the device's time (this small MoE layer is host-bound in eager mode: host time 0 here)
    device = dataclasses.replace(H800, host_kernel_us=0.0, host_gemm_us=0.0)
    lc = analytic_costs(model, device, ParallelConfig(tp=tp, dp=2, seq_length=t)).layers[0]
    flops, ms = _shared_by_hand(t, h, fs, tp)
    for ph, phase in enumerate((Phase.F, Phase.B, Phase.W)):
        (task,) = [x for x in lc.tasks if x.kind == TaskKind.SHARED and x.phase == phase]
        assert task.flops == flops[ph] == 6.0 * t * h * fs / tp
        assert task.ms == pytest.approx(ms[ph], rel=1e-12), phase


def test_tp_collective_by_hand():
    assert tp_collective_ms(8e6, 1, H800) == 0.0
    assert tp_collective_ms(8e6, 4, H800) == pytest.approx(8e6 * 3 / 4 / 160e9 * 1e3 + 0.01, rel=1e-12)


# --- E6: the tie-break keeps the bottleneck ---------------------------------------------------


def _two_stage_instance():
    """Two stages, cuts after layer 2, 3 or 4 (6 layers); each stage is its own edge (f == b).
    Stage costs per cut: 2 -> (20, 20), 3 -> (20, 15), 4 -> (1, 25): the least bottleneck is 20
    (cuts 2 and 3, sums 40 and 35), the least sum is cut 4's 26 at a worse bottleneck of 25."""
    cands = stage_candidates(Partition((-1, 3, 7)), 1, 6)
    cost = {2: (20.0, 20.0), 3: (20.0, 15.0), 4: (1.0, 25.0)}
    ec = {}
    for c in cands[0]:
        ec[(c, c)] = cost[c.stop][0]
    for c in cands[1]:
        ec[(c, c)] = cost[c.start][1]
    return cands, ec


@pytest.mark.parametrize("prune", [False, True])
def test_tie_break_keeps_the_optimal_bottleneck(prune):
    cands, ec = _two_stage_instance()
    assert [c.stop for c in cands[0]] == [2, 3, 4] and [c.start for c in cands[1]] == [2, 3, 4]
    first = solve_partition(cands, ec, None, None, prune=prune, tie_break=False)
    assert first.bottleneck_ms == 20.0
    res = solve_partition(cands, ec, None, None, prune=prune, tie_break=True)
    assert res.bottleneck_ms == first.bottleneck_ms == 20.0
    assert res.partition.bounds == (-1, 3, 7) and res.sum_ms == 35.0
    assert res.choice == (Candidate(0, -1, 3), Candidate(1, 3, 7))


def test_cuda_graphs_knob_reaches_cost_options_and_its_rules():
    from tessera.config.cost_rules import check_cost_fields, cost_options
    from tessera.config.load import load_recipe
    from tessera.errors import TesseraConfigError

    qwen = "recipes/qwen3-next-80b.yaml"
    r = load_recipe(qwen)
    assert r.train.cuda_graphs == "none" and cost_options(r).cuda_graphs == ()  # default: eager, as the engine
    r = load_recipe(qwen, ["train.cuda_graphs=[attn,moe_router,moe_preprocess]"])
    check_cost_fields(r)
    assert cost_options(r).cuda_graphs == ("attn", "moe_router", "moe_preprocess")
    for over, words in ((["train.cuda_graphs=[attn,mlp_fused]"], ["'mlp_fused'", "unknown CUDA graph scope"]),
                        (["train.cuda_graphs=[moe_preprocess]"], ["add moe_router"]),
                        (["train.cuda_graphs=[full_iteration,attn]"], ["full_iteration", "alone"]),
                        (["train.cuda_graphs=[moe]"], ["drop-and-pad", "model.moe_routing=forced"]),
                        (["train.cuda_graphs=[attn]", "hardware.preset=cpu"], ["need a GPU", "cuda_graphs=none"]),
                        # a repeated scope would change nothing: refused, the fix is the list without it
                        (["train.cuda_graphs=[attn,moe_router,attn]"],
                         ["'attn' twice", "fix: write each scope once, train.cuda_graphs=[attn,moe_router]"]),
                        # several scopes without brackets are one string: the fix is the list form, not a
                        # "did you mean" of one of them
                        (["train.cuda_graphs=attn,moe_router"],
                         ["'attn,moe_router'", "one string", "fix: write the list form, "
                          "train.cuda_graphs=[attn,moe_router]"]),
                        (["train.cuda_graphs=ATTN"], ["did you mean 'attn'?"])):
        with pytest.raises(TesseraConfigError) as e:
            check_cost_fields(load_recipe(qwen, over))
        msg = str(e.value)
        assert msg.startswith("train.cuda_graphs=") and "\n" not in msg, msg
        for w in words:
            assert w in msg, (w, msg)
        assert "moe_router'?" not in msg, msg
    check_cost_fields(load_recipe(qwen, ["train.cuda_graphs=[moe]", "model.moe_routing=forced"]))


def test_cuda_graph_scopes_need_a_layer_of_their_kind():
    """A scope that names a layer part the model has none of would change no cost: refused by
    ``validate_recipe`` (which knows the resolved model), naming the model preset and the fix."""
    from tessera.config.load import load_recipe
    from tessera.config.resolve import resolve_model
    from tessera.config.validate import validate_recipe
    from tessera.errors import TesseraConfigError

    def check(path, over):
        r = load_recipe(path, over)
        validate_recipe(r, resolve_model(r))

    qwen, nemo, dsv3 = "recipes/qwen3-next-80b.yaml", "recipes/tiny-nemotron-h.yaml", "recipes/deepseek-v3.yaml"
    # Qwen3-Next (Gated DeltaNet and gated attention mixers, MoE in every layer): no Mamba-2, no dense MLP
    for over, scope, part, fix in (
            (["train.cuda_graphs=[attn,mamba]"], "mamba", "Mamba-2 mixer", "train.cuda_graphs=[attn]"),
            (["train.cuda_graphs=[mlp]"], "mlp", "dense MLP", "train.cuda_graphs=none")):
        with pytest.raises(TesseraConfigError) as e:
            check(qwen, over)
        msg = str(e.value)
        assert msg.startswith("train.cuda_graphs=") and "\n" not in msg, msg
        assert f"{scope} captures every {part}, and model preset qwen3-next-80b-a3b has none" in msg, msg
        assert msg.endswith(f"fix: drop {scope}: {fix}"), msg
    # DeepSeek-V3 cut to its first 2 layers (dense MLP layers): moe_router has nothing to capture
    with pytest.raises(TesseraConfigError, match=r"^train\.cuda_graphs=\['mlp', 'moe_router'\]: moe_router captures "
                       r"every MoE router, and model deepseek-v3\[:2\] \(preset deepseek-v3, its first 2 layers\) "
                       r"has none; fix: drop moe_router: train\.cuda_graphs=\[mlp\]$"):
        check(dsv3, ["train.cuda_graphs=[mlp,moe_router]", "model.num_layers=2", "parallel.pp=1", "parallel.vpp=1"])
    # every scope with a layer of its kind passes: Nemotron-H has Mamba-2, attention, dense MLP and MoE layers
    check(nemo, ["hardware.preset=h800", "train.cuda_graphs=[attn,mamba,mlp,moe_router,moe_preprocess]"])
    check(qwen, ["train.cuda_graphs=[attn,moe_router,moe_preprocess]"])
    check(qwen, ["train.cuda_graphs=[full_iteration]"])


def test_fp8_recipe_needs_fp8_and_gets_a_case_blind_suggestion():
    from tessera.config.cost_rules import check_cost_fields, cost_options
    from tessera.config.load import load_recipe
    from tessera.errors import TesseraConfigError

    qwen = "recipes/qwen3-next-80b.yaml"
    for over, prec in ((["train.fp8_recipe=mxfp8"], "'auto' computes in bf16"),
                       (["train.fp8_recipe=delayed", "train.precision=bf16"], "'bf16' computes in bf16"),
                       (["train.fp8_recipe=blockwise", "hardware.preset=cpu"], "'auto' computes in fp32")):
        with pytest.raises(TesseraConfigError) as e:
            check_cost_fields(load_recipe(qwen, over))
        msg = str(e.value)
        assert msg.startswith("train.fp8_recipe=") and "\n" not in msg, msg
        assert "is read only under train.precision=fp8" in msg and prec in msg, msg
        assert msg.endswith("fix: set train.precision=fp8 or drop train.fp8_recipe"), msg
    # the default passes under any precision; any recipe under fp8
    check_cost_fields(load_recipe(qwen, ["train.precision=bf16"]))
    r = load_recipe(qwen, ["train.precision=fp8", "train.fp8_recipe=delayed"])
    check_cost_fields(r)
    assert cost_options(r).fp8_recipe == "delayed"
    with pytest.raises(TesseraConfigError) as e:
        check_cost_fields(load_recipe(qwen, ["train.precision=fp8", "train.fp8_recipe=MXFP8"]))
    assert str(e.value).startswith("train.fp8_recipe='MXFP8': is not an FP8 recipe")
    assert "fix: did you mean 'mxfp8'? use one of: tensorwise, delayed, mxfp8, blockwise" in str(e.value)
