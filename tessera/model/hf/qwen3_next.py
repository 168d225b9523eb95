"""Qwen3-Next in transformers' ``Qwen3NextForCausalLM`` format (transformers 5.x
``models/qwen3_next``: ``Qwen3NextConfig``, ``modeling_qwen3_next.py``).

Names (Tessera global name -> HF)::

    embed.weight                                  model.embed_tokens.weight
    layers.<i>.input_layernorm.weight             model.layers.<i>.input_layernorm.weight
    layers.<i>.attn.<p>          (Gated DeltaNet) model.layers.<i>.linear_attn.<p>
    layers.<i>.attn.<p>          (gated attention) model.layers.<i>.self_attn.<p>
    layers.<i>.post_attention_layernorm.weight    model.layers.<i>.post_attention_layernorm.weight
    layers.<i>.mlp_module.<p>    (dense SwiGLU)   model.layers.<i>.mlp.<p>
    layers.<i>.moe.gate.wg.weight  [E, H]         model.layers.<i>.mlp.gate.weight
    layers.<i>.moe.experts.<l>.<p> (EP-local l)   model.layers.<i>.mlp.experts.<offset + l>.<p>
    layers.<i>.moe.shared_expert.<p>              model.layers.<i>.mlp.shared_expert.<p>
    layers.<i>.moe.shared_expert_gate.weight      model.layers.<i>.mlp.shared_expert_gate.weight
    head.norm.weight                              model.norm.weight
    head.output.weight                            lm_head.weight

Numerics that must agree for the same logits: RMSNorm ``eps`` 1e-6 with the ``(1 + weight)``
Qwen3-Next norm, SiLU, default RoPE with the model's ``rope_theta`` and the attention's
``rotary_fraction`` as ``partial_rotary_factor``, untied head. Routing: DeepSpeed's ``topkgating``
/ ``top2gating`` (Tessera) renormalise the top-k softmax probabilities, as HF's
``norm_topk_prob=True``; its ``top1gating`` does not, as ``norm_topk_prob=False``; so
``norm_topk_prob = top_k > 1``. Dropless routing only (``MoEOptions.drop_tokens=False``, the
default): HF has no capacity.

Supported: Gated DeltaNet or gated-attention layers, then a softmax-routed MoE with a gated
shared expert or a dense SwiGLU MLP; one shape per kind. Skipped on import: ``mtp.*``
(``Qwen3NextForCausalLM._keys_to_ignore_on_load_unexpected``).
"""

from __future__ import annotations

from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from tessera.model.hf.common import Family, Names, check_alike, first_of
from tessera.model.mixers import NORM_EPS
from tessera.spec.model import AttentionSpec, DeltaNetSpec, DenseMLPSpec, ModelSpec, MoESpec

NAMES = Names(mixers=(("deltanet", "linear_attn"), ("attention", "self_attn")), shared_gate="shared_expert_gate")


def check_supported(model: ModelSpec) -> None:
    """Raise unless every layer of ``model`` is a Qwen3-Next layer (module docstring, Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    for layer in model.layers:
        m, mlp = layer.mixer, layer.mlp
        if m is None or not isinstance(m, (AttentionSpec, DeltaNetSpec)):
            raise FAMILY.refuse(layer.index, "mixer", None if m is None else m.kind,
                                "Qwen3-Next layers have a Gated DeltaNet or gated-attention mixer")
        if isinstance(m, AttentionSpec) and not m.gated:
            raise FAMILY.refuse(layer.index, "mixer.gated", False, "Qwen3-Next attention is gated")
        if mlp is None or not mlp.gated:
            raise FAMILY.refuse(layer.index, "mlp", None if mlp is None else f"{mlp.kind} (gated=False)",
                                "Qwen3-Next layers end in a SwiGLU MoE or dense MLP")
        if isinstance(mlp, MoESpec) and (mlp.latent_dim or not mlp.shared_expert_ffn or mlp.router != "softmax"
                                         or not mlp.shared_expert_gate):
            raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "Qwen3-Next MoE layers route by softmax to "
                                "full-width experts (router='softmax', latent_dim=0) and have a gated shared "
                                "expert (shared_expert_ffn > 0, shared_expert_gate=True)")
    check_alike(FAMILY, model)


def fields(model: ModelSpec) -> dict:
    """The ``Qwen3NextConfig`` fields of a checked ``model``, for ``FAMILY.config`` (module
    docstring: eps, RoPE, routing normalisation; ``mlp_only_layers`` lists the dense layers;
    ``intermediate_size`` is the dense width, else the config class default)."""
    kw: dict = dict(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.num_layers,
                    rms_norm_eps=NORM_EPS["qwen3_next"], hidden_act="silu", max_position_embeddings=model.max_positions,
                    tie_word_embeddings=False, attention_bias=False, decoder_sparse_step=1,
                    layer_types=["full_attention" if isinstance(l.mixer, AttentionSpec) else "linear_attention"
                                 for l in model.layers],
                    mlp_only_layers=[l.index for l in model.layers if isinstance(l.mlp, DenseMLPSpec)])
    att = first_of(model, AttentionSpec)
    rotary = att.rotary_fraction if att is not None else 0.25
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(model.rope_theta),
                             "partial_rotary_factor": rotary}
    if att is not None:
        kw.update(num_attention_heads=att.num_heads, num_key_value_heads=att.num_kv_heads, head_dim=att.head_dim)
    dn = first_of(model, DeltaNetSpec)
    if dn is not None:
        kw.update(linear_num_key_heads=dn.num_key_heads, linear_num_value_heads=dn.num_value_heads,
                  linear_key_head_dim=dn.key_head_dim, linear_value_head_dim=dn.value_head_dim,
                  linear_conv_kernel_dim=dn.conv_kernel)
    moe = model.moe
    if moe is not None:
        kw.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_ffn,
                  shared_expert_intermediate_size=moe.shared_expert_ffn, norm_topk_prob=moe.top_k > 1,
                  router_aux_loss_coef=moe.aux_loss_coef)
    else:
        kw.update(num_experts=0)
    return kw


def ignored(model: ModelSpec, name: str) -> bool:
    """The multi-token-prediction tensors (``mtp.*``), which Tessera does not build."""
    return name.startswith("mtp.")


FAMILY = Family(name="qwen3_next", label="Qwen3-Next", architecture="Qwen3NextForCausalLM",
                model_types=("qwen3_next",), preset="tiny-qwen3-next", names=NAMES, check=check_supported,
                fields=fields, config_class=Qwen3NextConfig,
                keys=(("hidden_act",), ("rms_norm_eps",), ("attention_bias",)), moe_keys=(("norm_topk_prob",),),
                rope=True, ignored=ignored)
