"""DeepSeek-V3 in transformers' ``DeepseekV3ForCausalLM`` format (transformers 5.x
``models/deepseek_v3``: ``DeepseekV3Config``, ``modeling_deepseek_v3.py``; Kimi K2 checkpoints
have the same tensors).

Names (Tessera global name -> HF)::

    embed.weight                                  model.embed_tokens.weight
    layers.<i>.input_layernorm.weight             model.layers.<i>.input_layernorm.weight
    layers.<i>.attn.<p>                  (MLA)    model.layers.<i>.self_attn.<p>
    layers.<i>.post_attention_layernorm.weight    model.layers.<i>.post_attention_layernorm.weight
    layers.<i>.mlp_module.<p>    (dense SwiGLU)   model.layers.<i>.mlp.<p>
    layers.<i>.moe.gate.wg.weight  [E, H]         model.layers.<i>.mlp.gate.weight
    layers.<i>.moe.gate.e_score_correction_bias   model.layers.<i>.mlp.gate.e_score_correction_bias  [E] FP32
    layers.<i>.moe.experts.<l>.<p> (EP-local l)   model.layers.<i>.mlp.experts.<offset + l>.<p>
    layers.<i>.moe.shared_expert.<p>              model.layers.<i>.mlp.shared_experts.<p>
    head.norm.weight                              model.norm.weight
    head.output.weight                            lm_head.weight

MLA parameters keep ``DeepseekV3Attention``'s names (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj`` without query compression, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``): Tessera builds that module.

Numerics: ``DeepseekV3RMSNorm`` (``w * x``) with ``eps`` 1e-6, SiLU, MLA with interleaved
default RoPE (``rope_interleave=True``, ``rope_type='default'``, the model's ``rope_theta``), no
attention bias, untied head; routing (:class:`~tessera.model.gating.SigmoidRouter`, as
``DeepseekV3TopkRouter``): sigmoid affinities, correction bias, ``n_group`` / ``topk_group``,
gates normalised (``norm_topk_prob=True``) times ``routed_scaling_factor``, dropless; shared
experts added ungated, ``n_shared_experts = shared_expert_ffn / expert_ffn``.

Supported: MLA layers; dense SwiGLU layers first (``first_k_dense_replace``), then sigmoid-routed
MoE layers with shared experts; one shape per kind. Exported with ``num_nextn_predict_layers=0``
(no MTP module). Skipped on import: DeepSeek's multi-token-prediction layer, stored after the
last decoder layer (``model.layers.<L>.*``, ``L >= num_layers``; transformers skips
``model.layers.61.*`` of DeepSeek-V3 too, ``_keys_to_ignore_on_load_unexpected``).
"""

from __future__ import annotations

import re

from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

from tessera.model.hf.common import Family, Names, check_alike, first_of
from tessera.model.mixers import NORM_EPS
from tessera.spec.model import DenseMLPSpec, MLASpec, ModelSpec, MoESpec

NAMES = Names(mixers=(("mla", "self_attn"),), shared="shared_experts")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_supported(model: ModelSpec) -> None:
    """Raise unless every layer of ``model`` is a DeepSeek-V3 layer (module docstring, Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    dense_done = False
    for layer in model.layers:
        m, mlp = layer.mixer, layer.mlp
        if not isinstance(m, MLASpec):
            raise FAMILY.refuse(layer.index, "mixer", None if m is None else m.kind,
                                "DeepSeek-V3 layers have multi-head latent attention (mla)")
        if mlp is None or not mlp.gated:
            raise FAMILY.refuse(layer.index, "mlp", None if mlp is None else f"{mlp.kind} (gated=False)",
                                "DeepSeek-V3 layers end in a SwiGLU MoE or dense MLP")
        if isinstance(mlp, MoESpec):
            if mlp.router != "sigmoid" or mlp.latent_dim or mlp.shared_expert_gate:
                raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "DeepSeek-V3 MoE layers route by sigmoid "
                                    "affinities to full-width experts and add their shared experts ungated "
                                    "(router='sigmoid', latent_dim=0, shared_expert_gate=False)")
            if mlp.shared_expert_ffn <= 0 or mlp.shared_expert_ffn % mlp.expert_ffn:
                raise FAMILY.refuse(layer.index, "mlp.shared_expert_ffn", mlp.shared_expert_ffn,
                                    f"DeepSeek-V3 has n_shared_experts >= 1 experts of the routed width, so it "
                                    f"must be a positive multiple of expert_ffn={mlp.expert_ffn}")
            dense_done = True
        elif dense_done:
            raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "DeepSeek-V3 has its dense layers first "
                                "(first_k_dense_replace), every later layer MoE")
    check_alike(FAMILY, model)


def fields(model: ModelSpec) -> dict:
    """The ``DeepseekV3Config`` fields of a checked ``model``, for ``FAMILY.config`` (module
    docstring; ``first_k_dense_replace`` = the leading dense layers, ``intermediate_size`` their
    width, MoE fields from the MoE layers, the class defaults where the model has none)."""
    mla = first_of(model, MLASpec)
    dense_layers = sum(isinstance(l.mlp, DenseMLPSpec) for l in model.layers)
    kw: dict = dict(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.num_layers,
                    num_attention_heads=mla.num_heads, num_key_value_heads=mla.num_heads,
                    q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
                    qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                    v_head_dim=mla.v_head_dim, hidden_act="silu", rms_norm_eps=NORM_EPS["deepseek_v3"],
                    max_position_embeddings=model.max_positions, tie_word_embeddings=False, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta)},
                    rope_interleave=True, first_k_dense_replace=dense_layers, num_mtp_layers=0)
    moe = model.moe
    if moe is not None:
        kw.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_ffn,
                  n_shared_experts=moe.shared_expert_ffn // moe.expert_ffn, n_group=moe.num_groups,
                  topk_group=moe.topk_groups, routed_scaling_factor=moe.routed_scaling, norm_topk_prob=True)
    return kw


def ignored(model: ModelSpec, name: str) -> bool:
    """DeepSeek's multi-token-prediction layer: ``model.layers.<L>.*`` with ``L >= num_layers``."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= model.num_layers


FAMILY = Family(name="deepseek_v3", label="DeepSeek-V3", architecture="DeepseekV3ForCausalLM",
                model_types=("deepseek_v3", "kimi_k2"), preset="tiny-deepseek-v3", names=NAMES,
                check=check_supported, fields=fields, config_class=DeepseekV3Config,
                keys=(("hidden_act",), ("rms_norm_eps",), ("attention_bias",), ("rope_interleave",)),
                moe_keys=(("norm_topk_prob",), ("routed_scaling_factor",), ("n_group",), ("topk_group",)),
                rope=True, ignored=ignored)
