"""Parameter counts of a :class:`~tessera.spec.model.ModelSpec`: total and active per token.

The layouts follow the transformers implementations (``modeling_qwen3_next.py``,
``modeling_qwen3_moe.py``, ``modeling_deepseek_v3.py``, ``modeling_nemotron_h.py``); every
weight matrix and RMSNorm weight is counted. Left out (each below 1e-5 of any real preset):
Qwen3 per-head q/k norms, the Qwen3-Next shared-expert gate (hidden x 1), router bias buffers.

Active parameters are those one token uses: everything except the routed experts, of which
``top_k`` count, plus the shared expert and the router. Embedding and output head count in both
(DeepSeek-V3's "37B activated" and Qwen3-235B-A22B's "22B" include them); ``embedding`` reports
them separately for "non-embedding" comparisons.

MTP layers (``ModelSpec.mtp_layers``, DeepSeek-V3 report section 2.2) each count one extra
layer of the last layer's kind plus its ``2*hidden x hidden`` projection and two RMSNorms; they
share the embedding and head with the main model. DeepSeek-V3's public "671B" excludes the MTP
module (Hugging Face card: 671B main + 14B MTP incl. a copy of embedding and head); pass
``include_mtp=False`` to compare with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.spec.model import (
    AttentionSpec,
    DeltaNetSpec,
    DenseMLPSpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    MoESpec,
)


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts (number of scalars, not bytes).

    Attributes:
        total: all parameters.
        active: parameters one token uses (``top_k`` routed experts, shared expert, router, the
            rest of every layer, embedding and head).
        embedding: input embedding plus output head (head omitted when tied); included in both
            ``total`` and ``active``.
    """

    total: int
    active: int
    embedding: int = 0


def _attention(h: int, a: AttentionSpec) -> int:
    q_out = a.num_heads * a.head_dim * (2 if a.gated else 1)  # gated: q_proj also yields the gate
    kv_out = 2 * a.num_kv_heads * a.head_dim
    return h * q_out + h * kv_out + a.num_heads * a.head_dim * h


def _mla(h: int, a: MLASpec) -> int:
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    if a.q_lora_rank:
        q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_heads * qk  # q_a, q_a_norm, q_b
    else:
        q = h * a.num_heads * qk
    kv_a = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # kv_a_proj_with_mqa + norm
    kv_b = a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv_a + kv_b + a.num_heads * a.v_head_dim * h


def _deltanet(h: int, d: DeltaNetSpec) -> int:
    key_dim = d.num_key_heads * d.key_head_dim
    value_dim = d.num_value_heads * d.value_head_dim
    in_proj = h * (2 * key_dim + 2 * value_dim) + h * 2 * d.num_value_heads  # in_proj_qkvz, in_proj_ba
    conv = (2 * key_dim + value_dim) * d.conv_kernel  # depthwise, no bias
    per_head = 2 * d.num_value_heads  # dt_bias, A_log
    return in_proj + conv + per_head + d.value_head_dim + value_dim * h  # + gated norm, out_proj


def _mamba2(h: int, m: Mamba2Spec) -> int:
    inner = m.num_heads * m.head_dim
    conv_dim = inner + 2 * m.n_groups * m.state_size
    in_proj = h * (inner + conv_dim + m.num_heads)  # z, xBC, dt
    conv = conv_dim * m.conv_kernel + conv_dim  # depthwise with bias
    return in_proj + conv + 3 * m.num_heads + inner + inner * h  # dt_bias, A_log, D; norm; out_proj


def _mixer(h: int, m) -> int:
    if m is None:
        return 0
    if isinstance(m, AttentionSpec):
        return _attention(h, m)
    if isinstance(m, MLASpec):
        return _mla(h, m)
    if isinstance(m, DeltaNetSpec):
        return _deltanet(h, m)
    if isinstance(m, Mamba2Spec):
        return _mamba2(h, m)
    raise TypeError(f"unknown mixer spec {type(m).__name__}")


def _mlp(h: int, m) -> tuple[int, int]:
    """(total, active) of one channel mixer."""
    if m is None:
        return 0, 0
    if isinstance(m, DenseMLPSpec):
        n = (3 if m.gated else 2) * h * m.ffn
        return n, n
    if isinstance(m, MoESpec):
        mats = 3 if m.gated else 2
        width = m.latent_dim or h
        expert = mats * width * m.expert_ffn
        always = h * m.num_experts  # router
        always += 2 * h * m.latent_dim  # latent down/up projections (0 when no latent space)
        always += mats * h * m.shared_expert_ffn
        return always + m.num_experts * expert, always + m.top_k * expert
    raise TypeError(f"unknown mlp spec {type(m).__name__}")


def layer_params(hidden: int, layer: LayerSpec) -> ParamCount:
    """Parameters of one decoder layer: mixer, mlp and one RMSNorm (``hidden``) per present half."""
    mix = _mixer(hidden, layer.mixer)
    mlp_total, mlp_active = _mlp(hidden, layer.mlp)
    norms = hidden * ((layer.mixer is not None) + (layer.mlp is not None))
    return ParamCount(mix + mlp_total + norms, mix + mlp_active + norms)


def count_params(model: ModelSpec, *, include_mtp: bool = True) -> ParamCount:
    """Total and active parameters of ``model`` (embedding, layers, final norm, head, MTP layers)."""
    h = model.hidden
    embedding = model.vocab * h * (1 if model.tie_embeddings else 2)
    total = active = embedding + h  # + final norm
    for layer in model.layers:
        c = layer_params(h, layer)
        total += c.total
        active += c.active
    if include_mtp and model.mtp_layers and model.layers:
        last = layer_params(h, model.layers[-1])
        extra = 2 * h * h + 2 * h  # eh_proj and the norms of its two inputs
        total += model.mtp_layers * (last.total + extra)
        active += model.mtp_layers * (last.active + extra)
    return ParamCount(total, active, embedding)
