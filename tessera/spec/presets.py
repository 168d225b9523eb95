"""Model presets: real public architectures and tiny CPU-sized members of the same families.

Every number of a real preset comes from a public config; the source is named next to it:

- ``qwen3-next-80b-a3b``: Qwen/Qwen3-Next-80B-A3B config.json and the transformers
  ``Qwen3NextConfig`` defaults (``models/qwen3_next/configuration_qwen3_next.py``); model card
  "12 x (3 x (Gated DeltaNet -> MoE) -> 1 x (Gated Attention -> MoE))".
- ``qwen3-235b-a22b``: Qwen/Qwen3-235B-A22B config.json (model_type ``qwen3_moe``).
- ``qwen3-30b-a3b``: Qwen/Qwen3-30B-A3B config.json (model_type ``qwen3_moe``: 48 layers,
  hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8, ``moe_intermediate_size`` 768,
  vocab 151936, untied, rope_theta 1e6, max_position_embeddings 40960); Megatron-Bridge
  ``Qwen3MoEModelProvider30B_A3B`` has the same values.
- ``deepseek-v3``: deepseek-ai/DeepSeek-V3 ``inference/configs/config_671B.json`` and
  config.json; aux-loss coefficient 1e-4 from the DeepSeek-V3 technical report (sequence-wise
  balance loss alpha).
- ``kimi-k2-1t``: moonshotai/Kimi-K2-Instruct config.json (model_type ``deepseek_v3``).
- ``nemotron-3-nano-30b-a3b`` / ``nemotron-3-super-120b-a12b``: NVIDIA Megatron-Bridge
  ``nemotron_h_provider.py`` (``Nemotron3NanoProvider`` / ``Nemotron3SuperProvider``) and the
  transformers ``NemotronHConfig``; experts and dense MLPs are squared-ReLU two-matrix MLPs
  (``gated=False``), attention layers have no rotary embedding (transformers
  ``modeling_nemotron_h.py``), aux-loss coefficient 1e-4 (Megatron-Bridge ``moe_aux_loss_coeff``).

Tiny presets (``tiny-*``) keep each family's layer pattern and mixer kinds at hidden 64 with a
byte-level vocabulary of 256 so that they train on CPU in seconds; their dims are our choice.
Their ``rope_theta`` / ``max_positions`` are the transformers config-class defaults of the family
(10000; 32768 for Qwen3-Next / Qwen3-MoE, 4096 for DeepSeek-V3 / Nemotron-H).
"""

from __future__ import annotations

import difflib
from typing import Callable

from tessera.errors import TesseraConfigError
from tessera.spec.model import (
    AttentionSpec,
    DeltaNetSpec,
    DenseMLPSpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    MixerSpec,
    MlpSpec,
    ModelSpec,
    MoESpec,
)

# Nemotron-H pattern characters (Megatron-Bridge ``hybrid_layer_pattern``).
PATTERN_CHARS = {"M": "mamba2", "E": "moe", "*": "attention", "-": "dense"}

NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_3_SUPER_PATTERN = (
    "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
)


def build_model(
    name: str,
    hidden: int,
    vocab: int,
    blocks: list[tuple[MixerSpec | None, MlpSpec | None]],
    *,
    tie_embeddings: bool = False,
    mtp_layers: int = 0,
    rope_theta: float = 10000.0,
    max_positions: int = 32768,
) -> ModelSpec:
    """A :class:`ModelSpec` from ``(mixer, mlp)`` pairs, numbering the layers 0, 1, ...
    (``rope_theta``, ``max_positions``: see :class:`ModelSpec`)."""
    layers = tuple(LayerSpec(i, mixer, mlp) for i, (mixer, mlp) in enumerate(blocks))
    return ModelSpec(name, hidden, vocab, layers, tie_embeddings=tie_embeddings, mtp_layers=mtp_layers,
                     rope_theta=float(rope_theta), max_positions=int(max_positions))


def from_pattern(
    name: str,
    pattern: str,
    hidden: int,
    vocab: int,
    attention: AttentionSpec | None,
    mamba: Mamba2Spec | None,
    moe: MoESpec | None,
    dense: DenseMLPSpec | None = None,
    *,
    tie_embeddings: bool = False,
    mtp_layers: int = 0,
    rope_theta: float = 10000.0,
    max_positions: int = 32768,
) -> ModelSpec:
    """A Nemotron-H style model from its pattern string, one character per layer.

    ``M`` = Mamba-2 only, ``E`` = MoE only, ``*`` = attention only, ``-`` = dense MLP only.
    Raises :class:`TesseraConfigError` for an empty pattern, an unknown character, or a
    character whose spec argument is ``None``.
    """
    if not pattern:
        raise TesseraConfigError("model.pattern", pattern, "must not be empty", "give one character per layer")
    specs = {"M": mamba, "E": moe, "*": attention, "-": dense}
    blocks: list[tuple[MixerSpec | None, MlpSpec | None]] = []
    for pos, ch in enumerate(pattern):
        if ch not in specs:
            raise TesseraConfigError(
                "model.pattern", pattern, f"unknown layer character {ch!r} at position {pos}",
                "use only M (Mamba-2), E (MoE), * (attention), - (dense MLP)",
            )
        spec = specs[ch]
        if spec is None:
            arg = {"M": "mamba", "E": "moe", "*": "attention", "-": "dense"}[ch]
            raise TesseraConfigError(
                f"model.{arg}", None, f"pattern has {ch!r} layers but no {arg} spec was given",
                f"pass {arg}=... or remove {ch!r} from the pattern",
            )
        blocks.append((spec, None) if ch in "M*" else (None, spec))
    return build_model(name, hidden, vocab, blocks, tie_embeddings=tie_embeddings, mtp_layers=mtp_layers,
                       rope_theta=rope_theta, max_positions=max_positions)


def qwen3_next_layers(
    num_layers: int,
    attention: AttentionSpec,
    deltanet: DeltaNetSpec,
    moe: MoESpec,
    full_attention_interval: int = 4,
) -> list[tuple[MixerSpec, MlpSpec]]:
    """Qwen3-Next blocks: layer i is gated attention when ``(i + 1) % interval == 0``, else
    Gated DeltaNet; every layer's MLP is the MoE (transformers ``Qwen3NextConfig.layer_types``)."""
    return [
        (attention if (i + 1) % full_attention_interval == 0 else deltanet, moe) for i in range(num_layers)
    ]


def deepseek_layers(num_layers: int, first_dense: int, mla: MLASpec, dense: DenseMLPSpec, moe: MoESpec):
    """DeepSeek-V3 blocks: MLA everywhere, dense FFN in the first ``first_dense`` layers
    (``first_k_dense_replace``), MoE after."""
    return [(mla, dense if i < first_dense else moe) for i in range(num_layers)]


# --- real presets ---------------------------------------------------------------------------


def qwen3_next_80b_a3b() -> ModelSpec:
    """Qwen3-Next-80B-A3B: 48 layers (36 Gated DeltaNet + 12 gated attention), all MoE."""
    attention = AttentionSpec(num_heads=16, num_kv_heads=2, head_dim=256, gated=True, rotary_fraction=0.25)
    deltanet = DeltaNetSpec(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4)
    moe = MoESpec(num_experts=512, top_k=10, expert_ffn=512, shared_expert_ffn=512, aux_loss_coef=0.001)
    return build_model("qwen3-next-80b-a3b", 2048, 151936, qwen3_next_layers(48, attention, deltanet, moe),
                       rope_theta=1e7, max_positions=262144)  # config.json rope_theta, max_position_embeddings


def qwen3_235b_a22b() -> ModelSpec:
    """Qwen3-235B-A22B: 94 GQA attention + MoE layers, no shared expert."""
    attention = AttentionSpec(num_heads=64, num_kv_heads=4, head_dim=128)
    moe = MoESpec(num_experts=128, top_k=8, expert_ffn=1536, shared_expert_ffn=0, aux_loss_coef=0.001)
    return build_model("qwen3-235b-a22b", 4096, 151936, [(attention, moe)] * 94,
                       rope_theta=1e6, max_positions=40960)  # config.json rope_theta, max_position_embeddings


def qwen3_30b_a3b() -> ModelSpec:
    """Qwen3-30B-A3B: 48 GQA attention + MoE layers, no shared expert (small experts: ffn 768)."""
    attention = AttentionSpec(num_heads=32, num_kv_heads=4, head_dim=128)
    moe = MoESpec(num_experts=128, top_k=8, expert_ffn=768, shared_expert_ffn=0, aux_loss_coef=0.001)
    return build_model("qwen3-30b-a3b", 2048, 151936, [(attention, moe)] * 48,
                       rope_theta=1e6, max_positions=40960)  # config.json rope_theta, max_position_embeddings


def deepseek_v3() -> ModelSpec:
    """DeepSeek-V3 (671B total, 37B active): 61 MLA layers, first 3 dense, then MoE; 1 MTP layer."""
    mla = MLASpec(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128)
    moe = MoESpec(num_experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, aux_loss_coef=0.0001,
                  num_groups=8, topk_groups=4,  # config.json n_group, topk_group
                  router="sigmoid", routed_scaling=2.5, shared_expert_gate=False,  # routed_scaling_factor
                  bias_update_rate=0.001)  # report sec. 4.2: gamma 0.001 for the first 14.3T tokens
    blocks = deepseek_layers(61, 3, mla, DenseMLPSpec(18432), moe)
    # config.json: rope_theta 10000, max_position_embeddings 163840 (YaRN factor 40 over 4096)
    return build_model("deepseek-v3", 7168, 129280, blocks, mtp_layers=1, rope_theta=10000.0, max_positions=163840)


def kimi_k2_1t() -> ModelSpec:
    """Moonshot Kimi K2 (1.04T total, 32B active): DeepSeek-V3 architecture with 64 MLA heads,
    384 routed experts, 1 dense layer, vocab 163840, no MTP layer (``num_nextn_predict_layers`` 0)."""
    mla = MLASpec(num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128)
    moe = MoESpec(num_experts=384, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, aux_loss_coef=0.0001,
                  router="sigmoid", routed_scaling=2.827, shared_expert_gate=False,  # routed_scaling_factor
                  bias_update_rate=0.001)  # DeepSeek-V3's gamma (Kimi K2 publishes none; the architecture's)
    blocks = deepseek_layers(61, 1, mla, DenseMLPSpec(18432), moe)
    # config.json: rope_theta 50000, max_position_embeddings 131072 (YaRN factor 32 over 4096)
    return build_model("kimi-k2-1t", 7168, 163840, blocks, rope_theta=50000.0, max_positions=131072)


def nemotron_3_nano_30b_a3b() -> ModelSpec:
    """Nemotron 3 Nano 30B-A3B: 52 layers (23 Mamba-2, 23 MoE, 6 attention)."""
    return from_pattern(
        "nemotron-3-nano-30b-a3b", NEMOTRON_3_NANO_PATTERN, hidden=2688, vocab=131072,
        attention=AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128, rotary_fraction=0.0),
        mamba=Mamba2Spec(num_heads=64, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128),
        moe=MoESpec(num_experts=128, top_k=6, expert_ffn=1856, shared_expert_ffn=3712, aux_loss_coef=0.0001,
                    gated=False, router="sigmoid", shared_expert_gate=False),  # NemotronHTopkRouter
        max_positions=262144,  # Megatron-Bridge Nemotron3NanoProvider.seq_length; no RoPE (rope_theta unused)
    )


def nemotron_3_super_120b_a12b() -> ModelSpec:
    """Nemotron 3 Super 120B-A12B: 88 layers (40 Mamba-2, 40 LatentMoE, 8 attention), 2 MTP layers
    (Megatron-Bridge ``mtp_num_layers=2``; costed as extra layers of the last layer's kind)."""
    return from_pattern(
        "nemotron-3-super-120b-a12b", NEMOTRON_3_SUPER_PATTERN, hidden=4096, vocab=131072,
        attention=AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128, rotary_fraction=0.0),
        mamba=Mamba2Spec(num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4, chunk_size=128),
        moe=MoESpec(num_experts=512, top_k=22, expert_ffn=2688, shared_expert_ffn=5376, latent_dim=1024,
                    aux_loss_coef=0.0001, gated=False, router="sigmoid", shared_expert_gate=False),
        mtp_layers=2,
        max_positions=262144,  # Megatron-Bridge Nemotron3SuperProvider.seq_length; no RoPE (rope_theta unused)
    )


# --- tiny CPU presets (dims are ours; patterns follow the families) --------------------------

TINY_VOCAB = 256  # byte-level text


def tiny_qwen3_next() -> ModelSpec:
    """8 layers ``DDDA DDDA`` (Gated DeltaNet x3 then gated attention), all MoE, hidden 64."""
    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, gated=True, rotary_fraction=0.25)
    deltanet = DeltaNetSpec(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, conv_kernel=4)
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn=64, shared_expert_ffn=64, aux_loss_coef=0.001)
    return build_model("tiny-qwen3-next", 64, TINY_VOCAB, qwen3_next_layers(8, attention, deltanet, moe))


def tiny_qwen3_moe() -> ModelSpec:
    """4 GQA attention + MoE layers, no shared expert, hidden 64."""
    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn=64, aux_loss_coef=0.001)
    return build_model("tiny-qwen3-moe", 64, TINY_VOCAB, [(attention, moe)] * 4)


def tiny_deepseek_v3() -> ModelSpec:
    """4 MLA layers, the first dense (FFN 128), then MoE with 8 experts top-2 + 1 ungated shared,
    DeepSeek-V3 routing (sigmoid, correction bias, 4 groups of which 2 may be chosen, scaling 2.5);
    no MTP layer (not built: :mod:`tessera.model` has no MTP head)."""
    mla = MLASpec(num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16)
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, aux_loss_coef=0.0001,
                  num_groups=4, topk_groups=2, router="sigmoid", routed_scaling=2.5, shared_expert_gate=False,
                  bias_update_rate=0.001)
    return build_model("tiny-deepseek-v3", 64, TINY_VOCAB, deepseek_layers(4, 1, mla, DenseMLPSpec(128), moe),
                       max_positions=4096)  # transformers DeepseekV3Config default max_position_embeddings


TINY_NEMOTRON_PATTERN = "MEM*EM-E"


def tiny_nemotron_h() -> ModelSpec:
    """8 single-block layers ``MEM*EM-E`` (Mamba-2, MoE, attention, dense squared-ReLU MLP)."""
    return from_pattern(
        "tiny-nemotron-h", TINY_NEMOTRON_PATTERN, hidden=64, vocab=TINY_VOCAB,
        attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, rotary_fraction=0.0),
        mamba=Mamba2Spec(num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4, chunk_size=32),
        moe=MoESpec(num_experts=8, top_k=2, expert_ffn=64, shared_expert_ffn=64, aux_loss_coef=0.0001, gated=False,
                    router="sigmoid", shared_expert_gate=False),
        dense=DenseMLPSpec(ffn=128, gated=False),
        max_positions=4096,  # transformers NemotronHConfig default max_position_embeddings
    )


MODEL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "qwen3-235b-a22b": qwen3_235b_a22b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-v3": deepseek_v3,
    "kimi-k2-1t": kimi_k2_1t,
    "nemotron-3-nano-30b-a3b": nemotron_3_nano_30b_a3b,
    "nemotron-3-super-120b-a12b": nemotron_3_super_120b_a12b,
    "tiny-qwen3-next": tiny_qwen3_next,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-deepseek-v3": tiny_deepseek_v3,
    "tiny-nemotron-h": tiny_nemotron_h,
}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``.

    Raises:
        TesseraConfigError: unknown name (with the closest known name, a prefix match first, and
            the known ones).
    """
    try:
        factory = MODEL_PRESETS[name]
    except (KeyError, TypeError):
        close = [k for k in MODEL_PRESETS if str(name) and k.startswith(str(name))][:1] or \
            difflib.get_close_matches(str(name), list(MODEL_PRESETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TesseraConfigError("model.preset", name, "unknown preset",
                                 hint + "use one of: " + ", ".join(MODEL_PRESETS)) from None
    return factory()
