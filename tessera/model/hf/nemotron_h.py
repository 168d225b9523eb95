"""Nemotron-H in transformers' ``NemotronHForCausalLM`` format (transformers 5.x
``models/nemotron_h``: ``NemotronHConfig``, ``modeling_nemotron_h.py``).

A Nemotron-H layer is one block, ``norm`` then ``mixer``: Mamba-2 (``M``, HF block type
``linear_attention``), attention without RoPE (``*``, ``full_attention``), MoE (``E``, ``moe``) or
a dense squared-ReLU MLP (``-``, ``mlp``). Tessera builds it as a mixer-only or an MLP-only
layer, whose one norm is the block's. Names (Tessera global name -> HF, as ``save_pretrained``
writes them; an import also reads transformers' in-memory ``model.`` for ``backbone.``)::

    embed.weight                                  backbone.embeddings.weight
    layers.<i>.input_layernorm.weight  (M, *)     backbone.layers.<i>.norm.weight
    layers.<i>.attn.<p>                (M, *)     backbone.layers.<i>.mixer.<p>
    layers.<i>.post_attention_layernorm.weight    backbone.layers.<i>.norm.weight      (E, -)
    layers.<i>.mlp_module.<p>          (-)        backbone.layers.<i>.mixer.<p>        (up_proj, down_proj)
    layers.<i>.moe.gate.wg.weight  [E, H]         backbone.layers.<i>.mixer.gate.weight
    layers.<i>.moe.gate.e_score_correction_bias   backbone.layers.<i>.mixer.gate.e_score_correction_bias  [E] FP32
    layers.<i>.moe.experts.<l>.<p> (EP-local l)   backbone.layers.<i>.mixer.experts.<offset + l>.<p>  (up/down_proj)
    layers.<i>.moe.shared_expert.<p>              backbone.layers.<i>.mixer.shared_experts.<p>
    layers.<i>.moe.latent_down.weight  [L, H]     backbone.layers.<i>.mixer.fc1_latent_proj.weight  (latent experts)
    layers.<i>.moe.latent_up.weight    [H, L]     backbone.layers.<i>.mixer.fc2_latent_proj.weight
    head.norm.weight                              backbone.norm_f.weight
    head.output.weight                            lm_head.weight

Mamba-2 and attention parameters keep ``NemotronHMamba2Mixer`` / ``NemotronHAttention``'s names:
Tessera builds those modules (:mod:`tessera.model.mixers`).

Numerics: ``NemotronHRMSNorm`` (``w * x`` in FP32) with ``layer_norm_epsilon`` 1e-5 (also the
Mamba gated norm's), Mamba-2 with SiLU, conv bias, no projection bias, ``time_step_limit
(0, inf)`` and the spec's ``chunk_size``; squared-ReLU (``relu2``) MLPs and experts without bias;
routing (:class:`~tessera.model.gating.SigmoidRouter`, as ``NemotronHTopkRouter``): sigmoid
affinities, correction bias, ``n_group`` / ``topk_group``, gates normalised
(``norm_topk_prob=True``) times ``routed_scaling_factor``, dropless; the shared expert added
ungated; untied head.

Supported: single-block layers of those four kinds; MoE with full-width or latent-space experts
(``moe_latent_size``: Nemotron 3 Super) and a shared expert; one shape per kind. Exported with
``num_nextn_predict_layers=0``. Skipped on import: ``mtp.*`` (multi-token prediction;
``NemotronHForCausalLM._keys_to_ignore_on_load_unexpected``).
"""

from __future__ import annotations

from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

from tessera.model.hf.common import Family, Names, check_alike, first_of
from tessera.model.mixers import NORM_EPS
from tessera.spec.model import AttentionSpec, DenseMLPSpec, Mamba2Spec, ModelSpec, MoESpec

NAMES = Names(root="backbone", embed="embeddings", final_norm="norm_f", input_norm="norm", post_norm="norm",
              mixers=(("mamba2", "mixer"), ("attention", "mixer")), mlp="mixer", shared="shared_experts",
              alias="model")


def _block_type(layer) -> str:
    return {Mamba2Spec: "linear_attention", AttentionSpec: "full_attention", MoESpec: "moe",
            DenseMLPSpec: "mlp"}[type(layer.mixer if layer.mixer is not None else layer.mlp)]


def check_supported(model: ModelSpec) -> None:
    """Raise unless every layer of ``model`` is a Nemotron-H block (module docstring, Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    for layer in model.layers:
        m, mlp = layer.mixer, layer.mlp
        if m is not None and mlp is not None:
            raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "a Nemotron-H layer is one block: a mixer (Mamba-2, "
                                "attention) or an MLP (MoE, dense), not both")
        if m is not None and not isinstance(m, Mamba2Spec) and not (
                isinstance(m, AttentionSpec) and not m.gated and m.rotary_fraction == 0.0):
            raise FAMILY.refuse(layer.index, "mixer", m.kind, "Nemotron-H mixers are Mamba-2 or attention without "
                                "RoPE (gated=False, rotary_fraction=0.0)")
        if mlp is not None and mlp.gated:
            raise FAMILY.refuse(layer.index, "mlp", f"{mlp.kind} (gated=True)", "Nemotron-H MLPs and experts are "
                                "squared-ReLU up/down projections (gated=False)")
        if isinstance(mlp, MoESpec) and (mlp.router != "sigmoid" or mlp.shared_expert_gate
                                         or mlp.shared_expert_ffn <= 0):
            raise FAMILY.refuse(layer.index, "mlp", mlp.kind, "Nemotron-H MoE blocks route by sigmoid affinities "
                                "and add a shared expert ungated (router='sigmoid', shared_expert_gate=False, "
                                "shared_expert_ffn > 0)")
    check_alike(FAMILY, model)


def fields(model: ModelSpec) -> dict:
    """The ``NemotronHConfig`` fields of a checked ``model``, for ``FAMILY.config`` (module
    docstring; ``layers_block_type`` one entry per layer, the class defaults for the kinds the model
    lacks)."""
    kw: dict = dict(vocab_size=model.vocab, hidden_size=model.hidden,
                    layers_block_type=[_block_type(l) for l in model.layers], tie_word_embeddings=False,
                    layer_norm_epsilon=NORM_EPS["nemotron_h"], max_position_embeddings=model.max_positions,
                    attention_bias=False, mlp_hidden_act="relu2", mlp_bias=False, mamba_hidden_act="silu",
                    use_conv_bias=True, use_bias=False, time_step_limit=(0.0, float("inf")),
                    residual_in_fp32=False, num_nextn_predict_layers=0)
    att = first_of(model, AttentionSpec)
    if att is not None:
        kw.update(num_attention_heads=att.num_heads, num_key_value_heads=att.num_kv_heads, head_dim=att.head_dim)
    mamba = first_of(model, Mamba2Spec)
    if mamba is not None:
        kw.update(mamba_num_heads=mamba.num_heads, mamba_head_dim=mamba.head_dim, ssm_state_size=mamba.state_size,
                  n_groups=mamba.n_groups, conv_kernel=mamba.conv_kernel, chunk_size=mamba.chunk_size)
    moe = model.moe
    if moe is not None:
        kw.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                  moe_intermediate_size=moe.expert_ffn, moe_shared_expert_intermediate_size=moe.shared_expert_ffn,
                  moe_latent_size=moe.latent_dim or None, n_group=moe.num_groups, topk_group=moe.topk_groups,
                  routed_scaling_factor=moe.routed_scaling, norm_topk_prob=True)
    return kw


def ignored(model: ModelSpec, name: str) -> bool:
    """The multi-token-prediction tensors (``mtp.*``), which Tessera does not build."""
    return name.startswith("mtp.")


FAMILY = Family(name="nemotron_h", label="Nemotron-H", architecture="NemotronHForCausalLM",
                model_types=("nemotron_h",), preset="tiny-nemotron-h", names=NAMES, check=check_supported,
                fields=fields, config_class=NemotronHConfig,
                keys=(("layer_norm_epsilon",), ("attention_bias",), ("mlp_hidden_act",), ("mlp_bias",),
                      ("mamba_hidden_act",), ("use_conv_bias", "mamba_conv_bias"), ("use_bias",),
                      ("time_step_limit", "mamba_dt_limit")),
                moe_keys=(("norm_topk_prob",), ("routed_scaling_factor",), ("n_group",), ("topk_group",)),
                rope=False, ignored=ignored)
