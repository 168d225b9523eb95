"""FP8 as Transformer Engine runs it (``train.fp8_recipe``, :func:`tessera.cost.fp8.fp8_quant`):
the quantization bytes, kernels and amax all-reduces per recipe, computed by hand from the kernels
TE 2.16 launches (docs/cost-model.md, "FP8"), and their path to the task times and the recipe."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.config.cost_rules import check_cost_fields, cost_options
from tessera.config.load import recipe_from_dict
from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs, fp8_run, ops_ms
from tessera.cost.efficiency import op_seconds
from tessera.cost.flops import GemmShape, gemm, layer_ops
from tessera.cost.fp8 import FP8Run, QuantCost, fp8_quant
from tessera.cost.types import CostOptions, TaskKind
from tessera.errors import TesseraConfigError
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import AttentionSpec, LayerSpec, ModelSpec, MoESpec

H800 = get_hardware("h800")
B200 = get_hardware("b200")
M, K, N = 4096, 2048, 1024
TW, DELAYED, MX, BLOCK = (FP8Run(r) for r in ("tensorwise", "delayed", "mxfp8", "blockwise"))


def test_current_scaling_reads_the_input_twice_in_three_kernels():
    s = GemmShape(M, K, N)
    x, dy = M * K, M * N
    # amax pass (read 2 B) + scale + cast-transpose (read 2 B, write FP8 X and X^T): 6 B/elem
    assert fp8_quant(s, 0, TW) == QuantCost(6.0 * x, 3, 0)
    assert fp8_quant(s, 1, TW) == QuantCost(6.0 * dy, 3, 0)
    assert fp8_quant(s, 2, TW) == QuantCost()  # the wgrad reuses X^T and dY^T
    # LayerNormLinear: the norm kernel writes the amax, so no amax pass
    assert fp8_quant(replace(s, fp8_in="norm"), 0, TW) == QuantCost(4.0 * x, 2, 0)
    assert fp8_quant(replace(s, fp8_in="norm"), 1, TW) == QuantCost(6.0 * dy, 3, 0)
    # the second GEMM of one linear_qkv: nothing in F; its dY bytes in the first one's kernels
    assert fp8_quant(replace(s, fp8_in="shared"), 0, TW) == QuantCost()
    assert fp8_quant(replace(s, fp8_in="shared"), 1, TW) == QuantCost(6.0 * dy, 0, 0)
    assert fp8_quant(replace(s, fp8=False), 0, TW) == QuantCost()  # router, output head


def test_other_recipes_cast_once_without_an_amax_pass():
    s = GemmShape(M, K, N)
    x = M * K
    assert fp8_quant(s, 0, DELAYED) == QuantCost(4.0 * x, 1, 0)
    # MXFP8: one E8M0 scale per 32 elements in each direction; blockwise: FP32 per 1x128 block, twice
    assert fp8_quant(s, 0, MX) == QuantCost(x * (4.0 + 2 / 32), 1, 0)
    assert fp8_quant(s, 0, BLOCK) == QuantCost(x * (4.0 + 8 / 128), 1, 0)
    # the norm fusion of the amax only matters to current scaling
    assert fp8_quant(replace(s, fp8_in="norm"), 0, MX) == fp8_quant(s, 0, MX)


def test_grouped_gemms_quantize_per_expert_and_pad_under_alltoall():
    g = GemmShape(32768, K, 1536, groups=16, fp8_pad="in")
    x = 32768 * K
    assert fp8_quant(g, 0, TW) == QuantCost(6.0 * x, 3 * 16, 0)  # split_quantize: 3 kernels per expert
    assert fp8_quant(g, 0, MX) == QuantCost(x * (4.0 + 2 / 32), 16, 0)
    assert fp8_quant(g, 0, DELAYED) == QuantCost(4.0 * x, 1, 0)  # fused multi-tensor cast-transpose
    # Fp8Padding: the input copied into the padded buffer (read + write BF16), hidden states and probs
    padded = FP8Run("tensorwise", pad_experts=True)
    assert fp8_quant(g, 0, padded) == QuantCost(10.0 * x, 3 * 16 + 2, 0)
    assert fp8_quant(g, 1, padded).bytes == 6.0 * 32768 * 1536 + 4.0 * x  # B: dY cast, dX unpadded
    fc2 = GemmShape(32768, 768, K, groups=16, split="k", fp8_pad="out")
    assert fp8_quant(fc2, 0, padded) == QuantCost(6.0 * 32768 * 768 + 4.0 * 32768 * K, 3 * 16 + 1, 0)
    # the routed experts carry the padding, the shared expert and the dense MLP do not
    spec = LayerSpec(0, AttentionSpec(16, 4, 128), MoESpec(128, 8, 768, shared_expert_ffn=768))
    ops = {o.name: o for lst in layer_ops(spec, 2048, 4096, 4096, 1, 8).values() for o in lst}
    assert (ops["expert_fc1"].gemm.fp8_pad, ops["expert_fc2"].gemm.fp8_pad, ops["shared_fc1"].gemm.fp8_pad) == (
        "in", "out", "")
    assert (ops["q_proj"].gemm.fp8_in, ops["kv_proj"].gemm.fp8_in, ops["o_proj"].gemm.fp8_in) == (
        "norm", "shared", "cast")


def test_sequence_parallel_gathers_rowwise_fp8_and_transposes_in_the_backward():
    col = gemm("fc1", M, K, N).scaled(0.5).gemm  # column-parallel under tp 2: X all-gathered
    row = gemm("fc2", M, N, K, split="k").scaled(0.5).gemm  # row-parallel: dY all-gathered in B
    assert (col.tp, col.n, row.tp, row.k) == (2.0, N / 2, 2.0, N / 2)
    local = M / 2 * K
    # F: amax + cast of the local rows, row-wise only (1 B out), amax all-reduced over the TP group
    assert fp8_quant(col, 0, TW) == QuantCost(local * (2 + 2 + 1), 3, 1)
    # B: dY cast as usual, and the transpose of the re-gathered FP8 X (read + write 1 B, all rows)
    assert fp8_quant(col, 1, TW) == QuantCost(6.0 * M * N / 2 + 2.0 * M * K, 4, 0)
    assert fp8_quant(row, 0, TW) == QuantCost(6.0 * M * N / 2, 3, 0)
    assert fp8_quant(row, 1, TW) == QuantCost(M / 2 * K * 5.0 + 2.0 * M * K, 4, 1)
    # MXFP8 gathers both usages: no transposes, no all-reduce
    assert fp8_quant(col, 0, MX) == QuantCost(local * (4 + 2 / 32), 1, 0)
    assert fp8_quant(col, 1, MX) == fp8_quant(replace(col, tp=1.0), 1, MX)


def test_op_time_adds_bytes_launches_and_allreduce_latency():
    op = gemm("fc1", M, K, N).scaled(0.5)
    bw = 3.35e12 * 0.8
    base = op_seconds(op, 0, replace(H800, link_latency_us=0.0, kernel_launch_us=0.0), True, TW)
    with_latency = op_seconds(op, 0, replace(H800, kernel_launch_us=0.0), True, TW)
    assert with_latency - base == pytest.approx(10e-6, rel=1e-9)  # one amax all-reduce
    q = fp8_quant(op.gemm, 0, TW)
    no_quant = op_seconds(op, 0, replace(H800, link_latency_us=0.0, kernel_launch_us=0.0), True,
                          FP8Run("delayed"))
    assert base - no_quant == pytest.approx((q.bytes - fp8_quant(op.gemm, 0, DELAYED).bytes) / bw, rel=1e-9)
    assert op_seconds(op, 0, H800, False, TW) == op_seconds(op, 0, H800)  # BF16 runs no quantization


def test_recipe_reaches_the_cost_model():
    assert fp8_run(CostOptions(precision="fp8", fp8_recipe="mxfp8")) == FP8Run("mxfp8", pad_experts=True)
    assert fp8_run(CostOptions(moe_dispatcher="deepep")).pad_experts is False
    with pytest.raises(ValueError, match="fp8_recipe"):
        CostOptions(fp8_recipe="mx")
    base = {"name": "r", "model": {"preset": "qwen3-30b-a3b"}, "hardware": {"preset": "b200"},
            "train": {"precision": "fp8", "fp8_recipe": "mxfp8"}}
    recipe = recipe_from_dict(base)
    check_cost_fields(recipe)
    assert cost_options(recipe).fp8_recipe == "mxfp8"
    assert cost_options(recipe_from_dict({**base, "train": {"precision": "fp8"}})).fp8_recipe == "tensorwise"
    with pytest.raises(TesseraConfigError, match=r"^train\.fp8_recipe='mx'"):
        check_cost_fields(recipe_from_dict({**base, "train": {"precision": "fp8", "fp8_recipe": "mx"}}))


def test_mxfp8_needs_blackwell_and_current_scaling_costs_more_than_delayed():
    m = ModelSpec("moe", 2048, 1000, (LayerSpec(0, AttentionSpec(16, 4, 128), MoESpec(128, 8, 768)),))
    p = ParallelConfig(ep=8, dp=8, seq_length=4096)
    with pytest.raises(TesseraConfigError, match=r"^train\.fp8_recipe='mxfp8'.*MXFP8"):
        analytic_costs(m, H800, p, options=CostOptions(precision="fp8", fp8_recipe="mxfp8"))
    analytic_costs(m, B200, p, options=CostOptions(precision="fp8", fp8_recipe="mxfp8"))
    # the expert task's device time: fc1 and fc2 inputs of 16 local experts; current scaling adds an
    # amax pass (2 B/elem) and two kernels per expert and tensor to the one fused multi-tensor
    # cast-transpose of delayed scaling
    ops = layer_ops(m.layers[0], 2048, 4096, 4096, 1, 8)[TaskKind.EXPERT]
    tw, delayed = (ops_ms(ops, 0, H800, "fp8", FP8Run(r)) for r in ("tensorwise", "delayed"))
    a = 4096 * 8
    assert tw - delayed == pytest.approx((2 * a * (2048 + 768) / (3.35e12 * 0.8) + 2 * (3 * 16 - 1) * 2e-6) * 1e3,
                                         rel=1e-9)
    assert ops_ms(ops, 0, H800, "bf16", FP8Run("tensorwise")) == ops_ms(ops, 0, H800)
