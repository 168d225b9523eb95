"""Qwen3-MoE in transformers' ``Qwen3MoeForCausalLM`` format (transformers 5.x
``models/qwen3_moe``: ``Qwen3MoeConfig``, ``modeling_qwen3_moe.py``).

Names: as Qwen3-Next (:mod:`tessera.model.hf.qwen3_next`) with every mixer under ``self_attn``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``) and no shared expert::

    layers.<i>.attn.<p>                           model.layers.<i>.self_attn.<p>
    layers.<i>.moe.gate.wg.weight  [E, H]         model.layers.<i>.mlp.gate.weight
    layers.<i>.moe.experts.<l>.<p> (EP-local l)   model.layers.<i>.mlp.experts.<offset + l>.<p>
    layers.<i>.mlp_module.<p>    (dense SwiGLU)   model.layers.<i>.mlp.<p>

Numerics: ``Qwen3MoeRMSNorm`` (``w * x``) with ``eps`` 1e-6, SiLU, full default RoPE with the
model's ``rope_theta``, no sliding window, untied head; softmax top-k routing renormalised for
k > 1 (``norm_topk_prob = top_k > 1``, as Qwen3-Next), dropless.

Supported: attention with full RoPE (``gated=False``, ``rotary_fraction=1``), then a
softmax-routed MoE without shared expert or a dense SwiGLU MLP (``mlp_only_layers``); one shape
per kind. Nothing is skipped on import.
"""

from __future__ import annotations

from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from tessera.model.hf.common import Family, Names, check_alike, first_of
from tessera.model.mixers import NORM_EPS
from tessera.spec.model import AttentionSpec, DenseMLPSpec, ModelSpec, MoESpec

NAMES = Names(mixers=(("attention", "self_attn"),))


def check_supported(model: ModelSpec) -> None:
    """Raise unless every layer of ``model`` is a Qwen3-MoE layer (module docstring, Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    for layer in model.layers:
        m, mlp = layer.mixer, layer.mlp
        if not isinstance(m, AttentionSpec) or m.gated or m.rotary_fraction != 1.0:
            raise FAMILY.refuse(layer.index, "mixer", None if m is None else m.kind, "Qwen3-MoE layers have "
                                "attention with full RoPE (gated=False, rotary_fraction=1.0)")
        if mlp is None or not mlp.gated:
            raise FAMILY.refuse(layer.index, "mlp", None if mlp is None else f"{mlp.kind} (gated=False)",
                                "Qwen3-MoE layers end in a SwiGLU MoE or dense MLP")
        if isinstance(mlp, MoESpec) and (mlp.latent_dim or mlp.shared_expert_ffn or mlp.router != "softmax"):
            raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "Qwen3-MoE MoE layers route by softmax to "
                                "full-width experts and have no shared expert (router='softmax', latent_dim=0, "
                                "shared_expert_ffn=0)")
    check_alike(FAMILY, model)


def fields(model: ModelSpec) -> dict:
    """The ``Qwen3MoeConfig`` fields of a checked ``model``, for ``FAMILY.config`` (module
    docstring; ``mlp_only_layers`` lists the dense layers, ``intermediate_size`` is their width,
    else the class default)."""
    att = first_of(model, AttentionSpec)
    kw: dict = dict(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.num_layers,
                    num_attention_heads=att.num_heads, num_key_value_heads=att.num_kv_heads, head_dim=att.head_dim,
                    rms_norm_eps=NORM_EPS["qwen3_moe"], hidden_act="silu", max_position_embeddings=model.max_positions,
                    tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta)},
                    decoder_sparse_step=1,
                    mlp_only_layers=[l.index for l in model.layers if isinstance(l.mlp, DenseMLPSpec)])
    moe = model.moe
    if moe is not None:
        kw.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_ffn,
                  norm_topk_prob=moe.top_k > 1, router_aux_loss_coef=moe.aux_loss_coef)
    else:
        kw.update(num_experts=0)
    return kw


def ignored(model: ModelSpec, name: str) -> bool:
    """Nothing: Qwen3-MoE checkpoints carry no multi-token-prediction heads."""
    return False


FAMILY = Family(name="qwen3_moe", label="Qwen3-MoE", architecture="Qwen3MoeForCausalLM",
                model_types=("qwen3_moe",), preset="tiny-qwen3-moe", names=NAMES, check=check_supported,
                fields=fields, config_class=Qwen3MoeConfig,
                keys=(("hidden_act",), ("rms_norm_eps",), ("attention_bias",), ("use_sliding_window",)),
                moe_keys=(("norm_topk_prob",),), rope=True, ignored=ignored)
