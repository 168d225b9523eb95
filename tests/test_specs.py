"""Model presets, Hugging Face config reading, parameter counts and hardware presets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tessera.errors import TesseraConfigError
from tessera.spec.hardware_presets import HARDWARE_PRESETS, get_hardware
from tessera.spec.hf import model_from_hf_config
from tessera.spec.model import AttentionSpec, DeltaNetSpec, DenseMLPSpec, Mamba2Spec, ModelSpec, MoESpec
from tessera.spec.params import ParamCount, count_params
from tessera.spec.presets import (
    MODEL_PRESETS,
    NEMOTRON_3_NANO_PATTERN,
    NEMOTRON_3_SUPER_PATTERN,
    from_pattern,
    get_model,
)

pytestmark = pytest.mark.xdist_group("specs")  # module fixtures built once (tests/conftest.py)

REAL = ["qwen3-next-80b-a3b", "qwen3-235b-a22b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2-1t",
        "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b"]
TINY = ["tiny-qwen3-next", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-nemotron-h"]


# --- presets --------------------------------------------------------------------------------


def test_preset_names():
    assert list(MODEL_PRESETS) == REAL + TINY


@pytest.mark.parametrize("name", REAL + TINY)
def test_preset_is_well_formed_and_round_trips(name):
    m = get_model(name)
    assert m.name == name
    assert [l.index for l in m.layers] == list(range(m.num_layers))
    assert all(l.mixer is not None or l.mlp is not None for l in m.layers)
    assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_unknown_preset_lists_names():
    with pytest.raises(TesseraConfigError) as e:
        get_model("llama-3-8b")
    assert e.value.field == "model.preset" and e.value.value == "llama-3-8b"
    assert "qwen3-next-80b-a3b" in str(e.value) and "tiny-nemotron-h" in str(e.value)


def test_qwen3_next_layout():
    m = get_model("qwen3-next-80b-a3b")
    assert m.num_layers == 48 and m.hidden == 2048 and m.vocab == 151936 and not m.tie_embeddings
    codes = [l.code for l in m.layers]
    assert codes == ["AE" if (i + 1) % 4 == 0 else "DE" for i in range(48)]
    assert codes.count("AE") == 12 and codes.count("DE") == 36
    attn, dn = m.layers[3].mixer, m.layers[0].mixer
    assert attn == AttentionSpec(16, 2, 256, gated=True, rotary_fraction=0.25)
    assert dn == DeltaNetSpec(16, 32, 128, 128, conv_kernel=4)
    assert m.moe == MoESpec(512, 10, 512, shared_expert_ffn=512)


def test_deepseek_and_kimi_layout():
    ds, kimi = get_model("deepseek-v3"), get_model("kimi-k2-1t")
    assert ds.kinds.split()[:4] == ["LF", "LF", "LF", "LE"] and ds.num_layers == 61 and ds.mtp_layers == 1
    assert ds.layers[0].mlp == DenseMLPSpec(18432)
    mla = ds.layers[0].mixer
    assert (mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (128, 1536, 512, 128, 64, 128)
    assert (ds.moe.num_experts, ds.moe.top_k, ds.moe.expert_ffn, ds.moe.shared_expert_ffn) == (256, 8, 2048, 2048)
    assert kimi.kinds.split()[:2] == ["LF", "LE"] and kimi.vocab == 163840 and kimi.mtp_layers == 0
    assert kimi.layers[0].mixer.num_heads == 64 and kimi.moe.num_experts == 384


def test_nemotron_patterns():
    nano, sup = get_model("nemotron-3-nano-30b-a3b"), get_model("nemotron-3-super-120b-a12b")
    assert nano.num_layers == len(NEMOTRON_3_NANO_PATTERN) == 52
    assert sup.num_layers == 88
    codes = [l.code for l in sup.layers]
    assert (codes.count("M-"), codes.count("-E"), codes.count("A-")) == (40, 40, 8)
    assert "".join({"M-": "M", "-E": "E", "A-": "*"}[c] for c in codes) == NEMOTRON_3_SUPER_PATTERN
    assert sup.moe.latent_dim == 1024 and sup.moe.top_k == 22 and not sup.moe.gated
    assert nano.layers[0].mixer == Mamba2Spec(64, 64, 128, 8, conv_kernel=4, chunk_size=128)


def test_from_pattern_and_errors():
    attn, mamba = AttentionSpec(4, 2, 16), Mamba2Spec(8, 16, 16, 2)
    moe, dense = MoESpec(4, 2, 32), DenseMLPSpec(64, gated=False)
    m = from_pattern("p", "M*E-", 64, 256, attn, mamba, moe, dense)
    assert m.kinds == "M- A- -E -F"
    with pytest.raises(TesseraConfigError) as e:
        from_pattern("p", "M*X", 64, 256, attn, mamba, moe)
    assert e.value.field == "model.pattern" and "'X' at position 2" in str(e.value)
    with pytest.raises(TesseraConfigError) as e:
        from_pattern("p", "ME-", 64, 256, attn, mamba, moe)  # '-' without a dense spec
    assert e.value.field == "model.dense"
    with pytest.raises(TesseraConfigError):
        from_pattern("p", "", 64, 256, attn, mamba, moe)


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_are_small(name):
    m = get_model(name)
    assert 64 <= m.hidden <= 128 and m.vocab == 256 and 4 <= m.num_layers <= 8
    assert 2 <= m.moe.top_k < m.moe.num_experts <= 16
    assert count_params(m).total < 2_000_000


def test_tiny_layouts():
    assert get_model("tiny-qwen3-next").kinds == "DE DE DE AE DE DE DE AE"
    assert get_model("tiny-deepseek-v3").kinds == "LF LE LE LE"
    assert get_model("tiny-nemotron-h").kinds == "M- -E M- A- -E M- -F -E"
    assert get_model("tiny-qwen3-moe").kinds == "AE AE AE AE"


# --- Hugging Face configs -------------------------------------------------------------------


def _hf_configs():
    """transformers config objects written with each preset's public numbers (test-side copy)."""
    tr = pytest.importorskip("transformers")
    nano = dict(num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_head_dim=64, ssm_state_size=128,
                n_groups=8, conv_kernel=4, chunk_size=128, vocab_size=131072)
    return {
        "qwen3-next-80b-a3b": tr.Qwen3NextConfig(
            hidden_size=2048, num_hidden_layers=48, vocab_size=151936, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
            num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            rope_theta=1e7, max_position_embeddings=262144),
        "qwen3-235b-a22b": tr.Qwen3MoeConfig(
            hidden_size=4096, num_hidden_layers=94, vocab_size=151936, num_attention_heads=64, num_key_value_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, rope_theta=1e6,
            max_position_embeddings=40960),
        "qwen3-30b-a3b": tr.Qwen3MoeConfig(
            hidden_size=2048, num_hidden_layers=48, vocab_size=151936, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rope_theta=1e6,
            max_position_embeddings=40960),
        "deepseek-v3": tr.DeepseekV3Config(
            hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
            moe_intermediate_size=2048, vocab_size=129280, num_mtp_layers=1, rope_theta=10000.0,
            max_position_embeddings=163840),
        "kimi-k2-1t": tr.DeepseekV3Config(
            hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=1, intermediate_size=18432,
            num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1,
            moe_intermediate_size=2048, vocab_size=163840, num_mtp_layers=0, rope_theta=50000.0,
            max_position_embeddings=131072, n_group=1, topk_group=1,  # released config: no group limit
            routed_scaling_factor=2.827),
        "nemotron-3-nano-30b-a3b": tr.NemotronHConfig(
            hybrid_override_pattern=NEMOTRON_3_NANO_PATTERN, hidden_size=2688, mamba_num_heads=64,
            n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, max_position_embeddings=262144, **nano),
        "nemotron-3-super-120b-a12b": tr.NemotronHConfig(
            hybrid_override_pattern=NEMOTRON_3_SUPER_PATTERN, hidden_size=4096, mamba_num_heads=128,
            n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
            moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, num_nextn_predict_layers=2,
            max_position_embeddings=262144, **nano),
        "tiny-qwen3-next": tr.Qwen3NextConfig(
            hidden_size=64, num_hidden_layers=8, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64),
        "tiny-qwen3-moe": tr.Qwen3MoeConfig(
            hidden_size=64, num_hidden_layers=4, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
        "tiny-deepseek-v3": tr.DeepseekV3Config(
            hidden_size=64, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=128, num_attention_heads=4,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, n_group=4,
            topk_group=2, vocab_size=256, num_mtp_layers=0),
        "tiny-nemotron-h": tr.NemotronHConfig(
            hybrid_override_pattern="MEM*EM-E", hidden_size=64, vocab_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
            chunk_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=64, intermediate_size=128),
    }


@pytest.fixture(scope="module")
def hf_configs():
    return _hf_configs()


@pytest.mark.parametrize("name", REAL + TINY)
def test_hf_config_round_trip(hf_configs, tmp_path, name):
    path = tmp_path / "config.json"
    hf_configs[name].to_json_file(str(path))
    assert model_from_hf_config(path, name=name) == get_model(name)
    assert model_from_hf_config(tmp_path, name=name) == get_model(name)  # folder holding config.json
    d = json.loads(path.read_text())
    assert model_from_hf_config(d).name == d["model_type"]


def _dict(hf_configs, tmp_path, name):
    path = tmp_path / f"{name}.json"
    hf_configs[name].to_json_file(str(path))
    return json.loads(path.read_text())


def test_hf_released_config_spellings(hf_configs, tmp_path):
    # Qwen3-Next release: full_attention_interval, top-level partial_rotary_factor and rope_theta.
    d = _dict(hf_configs, tmp_path, "qwen3-next-80b-a3b")
    del d["layer_types"], d["rope_parameters"]
    d.update(full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10000000)
    assert model_from_hf_config(d, name="qwen3-next-80b-a3b") == get_model("qwen3-next-80b-a3b")
    # Qwen3-MoE release spells the expert count num_experts.
    d = _dict(hf_configs, tmp_path, "qwen3-235b-a22b")
    d["num_experts"] = d.pop("num_local_experts")
    assert model_from_hf_config(d, name="qwen3-235b-a22b") == get_model("qwen3-235b-a22b")
    # Nemotron-H releases: hybrid_override_pattern string, or legacy block names.
    d = _dict(hf_configs, tmp_path, "nemotron-3-nano-30b-a3b")
    legacy = dict(d, layers_block_type=[{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t)
                                        for t in d["layers_block_type"]])
    del d["layers_block_type"]
    d["hybrid_override_pattern"] = NEMOTRON_3_NANO_PATTERN
    assert model_from_hf_config(d, name="nemotron-3-nano-30b-a3b") == get_model("nemotron-3-nano-30b-a3b")
    assert model_from_hf_config(legacy, name="nemotron-3-nano-30b-a3b") == get_model("nemotron-3-nano-30b-a3b")
    # Kimi K2's config.json may name its own model_type; the fields are DeepSeek-V3's.
    d = dict(_dict(hf_configs, tmp_path, "kimi-k2-1t"), model_type="kimi_k2")
    assert model_from_hf_config(d, name="kimi-k2-1t") == get_model("kimi-k2-1t")


@pytest.mark.parametrize("name,field", [
    ("qwen3-next-80b-a3b", "linear_num_key_heads"), ("qwen3-235b-a22b", "moe_intermediate_size"),
    ("deepseek-v3", "first_k_dense_replace"), ("nemotron-3-super-120b-a12b", "mamba_num_heads"),
    ("tiny-nemotron-h", "intermediate_size"),
])
def test_hf_missing_field_is_named(hf_configs, tmp_path, name, field):
    d = _dict(hf_configs, tmp_path, name)
    del d[field]
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config(d)
    assert e.value.field == f"hf_config.{field}" and "missing" in e.value.rule


def test_hf_bad_inputs(hf_configs, tmp_path):
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config({"model_type": "llama", "hidden_size": 4096})
    assert e.value.field == "hf_config.model_type" and "qwen3_next" in str(e.value)
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config(tmp_path / "absent.json")
    assert e.value.field == "model.hf_config"
    d = _dict(hf_configs, tmp_path, "qwen3-next-80b-a3b")
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config(dict(d, num_experts=512.0))
    assert e.value.field == "hf_config.num_experts"
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config(dict(d, layer_types=["full_attention"] * 47))
    assert e.value.field == "hf_config.layer_types"
    d = _dict(hf_configs, tmp_path, "tiny-nemotron-h")
    del d["layers_block_type"]
    with pytest.raises(TesseraConfigError) as e:
        model_from_hf_config(dict(d, hybrid_override_pattern="MEX"))
    assert e.value.field == "hf_config.hybrid_override_pattern"


def test_hf_dense_qwen_layers(hf_configs, tmp_path):
    d = dict(_dict(hf_configs, tmp_path, "tiny-qwen3-moe"), mlp_only_layers=[0], intermediate_size=96)
    assert model_from_hf_config(d).kinds == "AF AE AE AE"
    assert model_from_hf_config(d).layers[0].mlp == DenseMLPSpec(96)


# --- parameter counts -----------------------------------------------------------------------


def _near(x: float, target: float, rel: float) -> bool:
    return abs(x - target) <= rel * target


def test_param_counts_match_public_figures():
    qn = count_params(get_model("qwen3-next-80b-a3b"))
    assert _near(qn.total, 80e9, 0.03)
    # Qwen's "3B activated" leaves out embedding and head (3.25B); with them 3.88B.
    assert _near(qn.active - qn.embedding, 3e9, 0.15) and _near(qn.active, 3.875e9, 0.001)
    q235 = count_params(get_model("qwen3-235b-a22b"))
    assert _near(q235.total, 235e9, 0.03) and _near(q235.active, 22e9, 0.10)
    q30 = count_params(get_model("qwen3-30b-a3b"))  # model card: 30.5B total, 3.3B activated
    assert _near(q30.total, 30.5e9, 0.01) and _near(q30.active, 3.3e9, 0.03)
    ds = count_params(get_model("deepseek-v3"), include_mtp=False)  # "671B" is the main model only
    assert _near(ds.total, 671e9, 0.03) and _near(ds.active, 37e9, 0.10)
    ds_mtp = count_params(get_model("deepseek-v3"))
    # HF card: 685B = 671B main + 14B MTP module, which stores its own embedding and head copy.
    assert _near(ds_mtp.total + ds_mtp.embedding, 685e9, 0.01)
    kimi = count_params(get_model("kimi-k2-1t"))
    assert kimi.total >= 1.0e12 and _near(kimi.total, 1.04e12, 0.03) and _near(kimi.active, 32e9, 0.10)
    nano = count_params(get_model("nemotron-3-nano-30b-a3b"))  # model card: 31.6B total, 3.6B active
    assert _near(nano.total, 31.6e9, 0.01) and _near(nano.active, 3.6e9, 0.05)
    sup = count_params(get_model("nemotron-3-super-120b-a12b"), include_mtp=False)
    assert _near(sup.total, 120e9, 0.03) and _near(sup.active, 12e9, 0.10)


def test_param_count_small_by_hand():
    attn = AttentionSpec(2, 1, 4)  # q 8x8, k/v 8x4 each, o 8x8 -> 192
    moe = MoESpec(4, 1, 2, shared_expert_ffn=2)  # experts 4*48, shared 48, router 32
    m = from_pattern("m", "*E", hidden=8, vocab=10, attention=attn, mamba=None, moe=moe)
    emb, norms = 2 * 80, 3 * 8
    assert count_params(m) == ParamCount(emb + norms + 192 + 32 + 48 + 4 * 48, emb + norms + 192 + 32 + 48 + 48, emb)
    tied = dataclasses.replace(m, tie_embeddings=True)
    assert count_params(tied).total == count_params(m).total - 80


@pytest.mark.parametrize("name", REAL + TINY)
def test_param_count_equals_transformers(hf_configs, name):
    """Exact against the transformers model built on the meta device, apart from the documented
    omissions: Qwen3 q/k norms (2 x head_dim per attention layer) and the Qwen3-Next shared-expert
    gate (hidden per MoE layer). transformers builds no MTP layer."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_configs[name])
    n_hf = sum(p.numel() for p in hf.parameters())
    m = get_model(name)
    omitted = 0
    if name.startswith(("qwen3", "tiny-qwen3")):
        omitted += sum(2 * l.mixer.head_dim for l in m.layers if isinstance(l.mixer, AttentionSpec))
    if "next" in name:
        omitted += m.hidden * sum(l.is_moe for l in m.layers)
    assert count_params(m, include_mtp=False).total + omitted == n_hf


# --- hardware -------------------------------------------------------------------------------


def test_hardware_presets():
    assert list(HARDWARE_PRESETS) == ["h100-sxm", "h800", "h200", "b200", "cpu"]
    h100, h800, h200, b200, cpu = (get_hardware(n) for n in HARDWARE_PRESETS)
    assert (h100.peak_tflops, h100.mem_gb, h100.mem_bw_tbs, h100.intra_node_gbs, h100.inter_node_gbs) == (
        989.0, 85.52, 3.35, 375.0, 50.0)  # 81,559 MiB as nvidia-smi reports the "80 GB" part
    assert (h100.gpus_per_node, h100.num_sms, h100.comm_sms) == (8, 132, 20)
    assert h800.intra_node_gbs == 160.0 and h800.peak_tflops == h100.peak_tflops and h800.mem_gb == 85.52
    assert h800.overlap_slowdown == pytest.approx(132 / 112)
    assert (h200.mem_gb, h200.mem_bw_tbs, h200.peak_tflops) == (150.76, 4.8, 989.0)
    assert (cpu.gpus_per_node, cpu.num_sms, cpu.overlap_slowdown) == (1, 0, 1.0)
    # FP8 dense peaks (datasheets, no sparsity); B200 datasheet: 2.25 PFLOP/s BF16, 4.5 FP8, 8 TB/s
    assert (h100.peak_tflops_fp8, h800.peak_tflops_fp8, h200.peak_tflops_fp8, cpu.peak_tflops_fp8) == (
        1979.0, 1979.0, 1979.0, 0.0)
    assert (b200.peak_tflops, b200.peak_tflops_fp8, b200.mem_gb, b200.mem_bw_tbs, b200.num_sms) == (
        2250.0, 4500.0, 192.27, 8.0, 148)
    assert (h100.gemm_mn_half, h100.gemm_k_half, h100.mem_bw_efficiency, h100.kernel_launch_us) == (
        160.0, 250.0, 0.8, 2.0)
    assert (cpu.gemm_mn_half, cpu.gemm_k_half, cpu.mem_bw_efficiency, cpu.kernel_launch_us) == (0.0, 0.0, 1.0, 0.0)
    # host issue time per kernel / per GEMM call in PyTorch eager mode (GPU presets); none on cpu
    assert {(hw.host_kernel_us, hw.host_gemm_us) for hw in (h100, h800, h200, b200)} == {(5.0, 13.5)}
    assert (cpu.host_kernel_us, cpu.host_gemm_us) == (0.0, 0.0)
    assert "nominal" in cpu.source and "measured" in cpu.source
    assert "datasheet" in h100.source and "DeepSeek-V3" in h800.source and "H200" in h200.source
    assert all(hw.name == n for n, hw in HARDWARE_PRESETS.items())


def test_unknown_hardware_lists_names():
    with pytest.raises(TesseraConfigError) as e:
        get_hardware("a100")
    assert e.value.field == "hardware.preset" and "h100-sxm, h800, h200, b200, cpu" in str(e.value)
