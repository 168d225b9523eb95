"""Kernels without a GEMM shape in the analytic cost model: the chunked gated delta rule as
flash-linear-attention runs it, fused attention, and their measured achieved rates
(``HardwareSpec.kernel_efficiency``), against values computed by hand from the sourced
constants (tessera/spec/hardware_presets.py, docs/cost-model.md "Attention and the gated delta
rule")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.config.resolve import check_hardware
from tessera.cost.efficiency import op_seconds
from tessera.cost.flops import (BF16, attention_core, delta_rule, delta_rule_bytes, delta_rule_macs, mixer_ops,
                                ssd_scan)
from tessera.errors import TesseraConfigError
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import DeltaNetSpec, Mamba2Spec

H100 = get_hardware("h100-sxm")
B200 = get_hardware("b200")
CPU = get_hardware("cpu")
# Qwen3-Next-80B-A3B's Gated DeltaNet: 16 key heads, 32 value heads, head dims 128, conv 4, chunk 64
QWEN3_NEXT_GDN = DeltaNetSpec(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                              conv_kernel=4, chunk_size=64)
T = 4096


def test_delta_rule_work_bytes_and_kernels_by_hand():
    f_macs, b_macs = delta_rule_macs(128, 128, 64)
    assert f_macs == pytest.approx(3 * 128 * 128 + 64 * (3 * 128 + 2 * 128) + 64 * 64 / 3)  # 91477.3
    assert b_macs == 8 * 128 * 128 + 64 * (10 * 128 + 5 * 128) + 2 * 64 * 64 == 262144
    assert delta_rule_bytes(128, 128, 64) == (14 * 128 + 12 * 128 + 14 * 64 + 4 * 256 + 28,
                                              46 * 128 + 30 * 128 + 4 * 64 + 8 * 256 + 76) == (5276, 12108)
    op = delta_rule("delta_rule", T, QWEN3_NEXT_GDN)
    th = T * 32  # token-heads
    f = 2 * th * f_macs
    assert op.flops == pytest.approx((f, 2 * f, 0.0))  # model FLOPs: B = 2F (MFU convention)
    assert op.kernel_flops == pytest.approx((f, 2 * th * 262144, 0.0))  # the backward kernels do 2.87x F
    assert op.bytes == (th * 5276, th * 12108, 0.0)
    assert op.kernels == (7, 10, 0) and op.rate_class == "delta_rule"
    # TP keeps the kernel FLOPs in step with the model FLOPs
    half = op.scaled(0.5)
    assert half.kernel_flops == pytest.approx(tuple(x / 2 for x in op.kernel_flops))
    assert (half.rate_class, half.head_dim) == (op.rate_class, op.head_dim)


def test_delta_rule_time_at_the_measured_fla_rate():
    op = delta_rule("delta_rule", T, QWEN3_NEXT_GDN)
    th = T * 32
    bw = 3.35e12 * 0.8
    # F: 1.2e10 FLOPs at 0.084 * 989 TFLOP/s = 83 TFLOP/s (0.289 ms) against 0.69 GB at 2.68 TB/s (0.258 ms)
    f_s = max(op.kernel_flops[0] / (989e12 * 0.084), th * 5276 / bw) + 7 * 2e-6
    b_s = max(2 * th * 262144 / (989e12 * 0.083), th * 12108 / bw) + 10 * 2e-6
    assert op_seconds(op, 0, H100) == pytest.approx(f_s, rel=1e-12)
    assert op_seconds(op, 1, H100) == pytest.approx(b_s, rel=1e-12)
    assert op_seconds(op, 0, H100) * 1e3 == pytest.approx(0.303, abs=0.001)
    assert op_seconds(op, 1, H100) * 1e3 == pytest.approx(0.857, abs=0.001)
    # B200: 0.056 of 2250 (126 TFLOP/s, FLA's GB200 row)
    assert op_seconds(op, 1, B200) == pytest.approx(
        max(2 * th * 262144 / (2250e12 * 0.056), th * 12108 / 6.4e12) + 10 * 2e-6, rel=1e-12)


def test_attention_rates_by_head_dim():
    assert H100.kernel_efficiency("attention", 0, 128) == 0.60  # cuDNN 591 TFLOP/s on H200, causal, s 4096
    assert H100.kernel_efficiency("attention", 1, 128) == 0.48  # 474
    assert H100.kernel_efficiency("attention", 0, 256) == pytest.approx(0.56)
    assert H100.kernel_efficiency("attention", 1, 256) == pytest.approx(0.45)
    # MLA (q/k 192, v 128): head dim 160, a quarter of the way from 128 to 256
    assert H100.kernel_efficiency("attention", 0, 160) == pytest.approx(0.60 - 0.04 / 4)
    assert H100.kernel_efficiency("attention", 1, 64) == 0.48  # clamped below 128
    # Qwen3-Next gated attention: 16 heads, 2 KV groups, head dim 256
    op = attention_core("attn", T, T, 16, 2, 256, 256)
    f = T * 16 * T * 512
    assert op.flops == (f, 2 * f, 0.0) and op.kernel_flops == (f, 2.5 * f, 0.0) and op.head_dim == 256
    qkvo = BF16 * T * (16 * 256 + 2 * 512 + 16 * 256) + 4 * T * 16
    assert op_seconds(op, 0, H100) == pytest.approx(f / (989e12 * 0.56) + 1 * 2e-6, rel=1e-12)
    assert op_seconds(op, 1, H100) == pytest.approx(max(2.5 * f / (989e12 * 0.45), 2 * qkvo / 2.68e12) + 3 * 2e-6,
                                                    rel=1e-12)


def test_cpu_and_unmeasured_classes_keep_the_mfu_rate():
    gdn = delta_rule("delta_rule", T, QWEN3_NEXT_GDN)
    att = attention_core("attn", T, T, 16, 2, 256, 256)
    ssd = ssd_scan("ssd", T, Mamba2Spec(num_heads=64, head_dim=64, state_size=128, n_groups=8, conv_kernel=4,
                                         chunk_size=128))
    for op in (gdn, att, ssd):
        assert CPU.kernel_efficiency(op.rate_class, 1, op.head_dim) == 0.0
        for ph in range(3):  # cpu: model FLOPs at peak * mfu_efficiency (no curve, no launches)
            want = max(op.flops[ph] / (CPU.peak_tflops * 1e12 * CPU.mfu_efficiency), op.bytes[ph] / 0.1e12)
            assert op_seconds(op, ph, CPU) == pytest.approx(want, rel=1e-12)
    # the SSD scan has no measured rate on the GPU presets either
    assert H100.kernel_efficiency("ssd", 0) == 0.0
    assert op_seconds(ssd, 0, H100) == pytest.approx(
        max(ssd.flops[0] / (989e12 * 0.6), ssd.bytes[0] / 2.68e12) + 5 * 2e-6, rel=1e-12)
    # an unset field means "not measured", not a zero rate
    no_rate = replace(H100, delta_rule_bwd_efficiency=0.0)
    assert op_seconds(gdn, 1, no_rate) == pytest.approx(
        max(gdn.flops[1] / (989e12 * 0.6), gdn.bytes[1] / 2.68e12) + 10 * 2e-6, rel=1e-12)


def test_deltanet_mixer_glue_as_megatron_runs_it():
    ops = {o.name: o for o in mixer_ops(QWEN3_NEXT_GDN, 2048, T, T)}
    assert list(ops) == ["input_norm", "in_proj", "conv_in_layout", "conv", "qkv_layout", "qk_l2norm", "qk_repeat",
                         "gate_decay", "delta_rule", "out_norm", "out_gate", "out_proj", "mixer_residual"]
    qk, v = 16 * 128, 32 * 128
    assert ops["conv_in_layout"].bytes == (4 * T * (2 * qk + v),) * 2 + (0.0,)
    assert ops["qk_repeat"].bytes[0] == 2 * 2 * T * qk * 3  # read q, k; write them at 2x the heads
    assert ops["conv"].rate_class == "conv" and ops["delta_rule"].rate_class == "delta_rule"
    # two sequences per microbatch: the output goes back to sequence-first with a copy
    assert "out_layout" in [o.name for o in mixer_ops(QWEN3_NEXT_GDN, 2048, 2 * T, T)]


def test_kernel_fractions_are_range_checked():
    with pytest.raises(TesseraConfigError, match=r"hardware.inline.delta_rule_bwd_efficiency=1.5: must be in \[0, 1\]"):
        check_hardware(replace(H100, delta_rule_bwd_efficiency=1.5), {"delta_rule_bwd_efficiency"})
    check_hardware(replace(H100, attention_fwd_efficiency=0.0), {"attention_fwd_efficiency"})  # 0: not measured
