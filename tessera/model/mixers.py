"""Token mixers and norms of each model family, built from transformers' own modules.

:attr:`ModelSpec.family <tessera.spec.model.ModelSpec.family>` picks the family; each mixer kind
is the family's module (pure-torch paths on CPU; where a fused kernel package is installed on a
GPU, transformers' kernel hub or ``mamba_ssm`` / ``causal_conv1d`` take over inside the module):

=============================  ==============================================================
mixer spec                     transformers module (one-layer config built by :func:`build_mixer`)
=============================  ==============================================================
``DeltaNetSpec``               ``Qwen3NextGatedDeltaNet`` (chunked gated delta rule, chunk 64)
``AttentionSpec(gated=True)``  ``Qwen3NextAttention`` (sigmoid output gate, partial RoPE)
``AttentionSpec`` (RoPE)       ``Qwen3MoeAttention`` (q/k RMSNorm, full RoPE)
``AttentionSpec`` (no RoPE)    ``NemotronHAttention`` (``rotary_fraction=0``: Nemotron-H)
``MLASpec``                    ``DeepseekV3Attention`` (multi-head latent attention; interleaved
                               RoPE on the ``qk_rope_head_dim`` part, ``rope_interleave=True``
                               as in ``DeepseekV3Config``)
``Mamba2Spec``                 ``NemotronHMamba2Mixer`` (SSD scan, chunked; gated RMSNorm)
=============================  ==============================================================

Norms (each family's RMSNorm class; epsilon from its config class default):
``Qwen3NextRMSNorm`` (``(1 + w) * x``, w zero-initialised, eps 1e-6), ``Qwen3MoeRMSNorm`` and
``DeepseekV3RMSNorm`` (``w * x``, eps 1e-6), ``NemotronHRMSNorm`` (``w * x`` in FP32, eps 1e-5,
``NemotronHConfig.layer_norm_epsilon``).

A mixer is called as ``Mixer.run(hn [B, S, H]) -> [B, S, H]`` with a causal mask and the RoPE
positions ``0..S-1`` where the module takes them. :meth:`Mixer.run_mla_up_proj` runs an MLA
mixer with its up-projections as a recompute region (``recompute_modules`` ``mla_up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _deepseek
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHAttention, NemotronHMamba2Mixer, NemotronHRMSNorm
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRMSNorm
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextGatedDeltaNet,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
)

from tessera.errors import TesseraConfigError
from tessera.model.regions import checkpointed, drop_output
from tessera.spec.model import AttentionSpec, DeltaNetSpec, LayerSpec, Mamba2Spec, MLASpec, ModelSpec

NORM_EPS = {"qwen3_next": 1e-6, "qwen3_moe": 1e-6, "deepseek_v3": 1e-6, "nemotron_h": 1e-5}
"""RMSNorm epsilon per family: the config classes' defaults (``rms_norm_eps`` of
``Qwen3NextConfig`` / ``Qwen3MoeConfig`` / ``DeepseekV3Config``, ``NemotronHConfig.layer_norm_epsilon``)."""

_NORMS = {"qwen3_next": Qwen3NextRMSNorm, "qwen3_moe": Qwen3MoeRMSNorm, "deepseek_v3": DeepseekV3RMSNorm,
          "nemotron_h": NemotronHRMSNorm}


def make_norm(model: ModelSpec, width: int | None = None) -> nn.Module:
    """The family's RMSNorm over ``width`` (default ``model.hidden``) features (module docstring)."""
    family = model.family
    return _NORMS[family](model.hidden if width is None else width, eps=NORM_EPS[family])


def causal_mask(seq: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive causal mask ``[1, 1, S, S]``: 0 on and below the diagonal, dtype-min above."""
    upper = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


def _rope(model: ModelSpec, fraction: float = 1.0) -> dict:
    return {"rope_type": "default", "rope_theta": float(model.rope_theta), "partial_rotary_factor": fraction}


def _qwen3_next_layer_config(model: ModelSpec, layer: LayerSpec) -> Qwen3NextConfig:
    """A one-layer ``Qwen3NextConfig`` with ``layer``'s mixer dims (eager attention),
    ``model.max_positions`` and, for attention, RoPE base ``model.rope_theta``."""
    kw: dict = dict(hidden_size=model.hidden, vocab_size=model.vocab, num_hidden_layers=1,
                    rms_norm_eps=NORM_EPS["qwen3_next"], hidden_act="silu",
                    max_position_embeddings=model.max_positions, attn_implementation="eager")
    m = layer.mixer
    if isinstance(m, AttentionSpec):
        kw.update(layer_types=["full_attention"], num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                  head_dim=m.head_dim, rope_parameters=_rope(model, m.rotary_fraction))
    elif isinstance(m, DeltaNetSpec):
        kw.update(layer_types=["linear_attention"], linear_num_key_heads=m.num_key_heads,
                  linear_num_value_heads=m.num_value_heads, linear_key_head_dim=m.key_head_dim,
                  linear_value_head_dim=m.value_head_dim, linear_conv_kernel_dim=m.conv_kernel)
    else:
        kw.update(layer_types=["linear_attention"])
    return Qwen3NextConfig(**kw)


def _deepseek_layer_config(model: ModelSpec, m: MLASpec) -> DeepseekV3Config:
    """A one-layer ``DeepseekV3Config`` with ``m``'s MLA dims (``q_lora_rank=0``: no query
    compression, HF ``q_lora_rank=None``), default RoPE of base ``model.rope_theta`` (interleaved),
    eager attention."""
    return DeepseekV3Config(hidden_size=model.hidden, vocab_size=model.vocab, num_hidden_layers=1,
                            num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
                            q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                            v_head_dim=m.v_head_dim, rms_norm_eps=NORM_EPS["deepseek_v3"], attention_bias=False,
                            max_position_embeddings=model.max_positions, rope_parameters=_rope(model),
                            rope_interleave=True, first_k_dense_replace=0, attn_implementation="eager")


def _nemotron_layer_config(model: ModelSpec, m: Mamba2Spec | AttentionSpec) -> NemotronHConfig:
    """A one-layer ``NemotronHConfig`` for a Mamba-2 (``linear_attention``) or attention
    (``full_attention``) block with ``m``'s dims; other fields the class defaults (SiLU Mamba
    activation, conv bias, no projection bias, ``time_step_limit (0, inf)``), eager attention."""
    kw: dict = dict(hidden_size=model.hidden, vocab_size=model.vocab, num_hidden_layers=1,
                    layer_norm_epsilon=NORM_EPS["nemotron_h"], max_position_embeddings=model.max_positions,
                    attn_implementation="eager")
    if isinstance(m, Mamba2Spec):
        kw.update(layers_block_type=["linear_attention"], mamba_num_heads=m.num_heads, mamba_head_dim=m.head_dim,
                  ssm_state_size=m.state_size, n_groups=m.n_groups, conv_kernel=m.conv_kernel,
                  chunk_size=m.chunk_size)
    else:
        kw.update(layers_block_type=["full_attention"], num_attention_heads=m.num_heads,
                  num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim)
    return NemotronHConfig(**kw)


@dataclass(eq=False)
class Mixer:
    """A built token mixer: ``module`` (its parameters are the layer's ``attn.*``), the rotary
    embedding ``rotary`` (None where the module takes no positions) and ``masked`` (the module
    takes a causal mask)."""

    module: nn.Module
    rotary: nn.Module | None = None
    masked: bool = False

    def run(self, hn: torch.Tensor) -> torch.Tensor:
        """The mixer on normed tokens ``hn [B, S, H]`` -> ``[B, S, H]``."""
        if not self.masked:
            return self.module(hn)
        seq = hn.shape[1]
        mask = causal_mask(seq, hn.dtype, hn.device)
        if self.rotary is None:
            out, _ = self.module(hn, attention_mask=mask)
            return out
        positions = torch.arange(seq, device=hn.device).unsqueeze(0)
        out, _ = self.module(hn, self.rotary(hn, positions), mask)
        return out

    def run_mla_up_proj(self, hn: torch.Tensor, core_attn: bool = False) -> torch.Tensor:
        """:meth:`run` of a ``DeepseekV3Attention`` (the same operations in the same order, so
        bitwise the same output and gradients) with its up-projections and RoPE as an
        output-discarding region (Megatron-Core MLA's ``recompute_up_proj``): the query (and key /
        value) up-projections ``q_b_proj`` (``q_proj`` without query compression) and
        ``kv_b_proj``, RoPE and the key concatenation run as one
        :func:`~tessera.model.regions.drop_output` over the normed latents, whose outputs Q, K,
        V ``[B, heads, S, d]`` the attention core reads; the backward rebuilds them from the
        latents. What stays: the down-projections' outputs, the normed latents (the region's
        inputs), the core's own saved tensors and its output (as
        :func:`tessera.cost.memory.recompute_ops` assumes for ``mla_up_proj``). With
        ``core_attn`` the region and the eager attention core are one checkpoint over the latents
        (the core's scores are rebuilt too, and nothing holds Q, K, V). ``hn [B, S, H]`` -> ``[B, S, H]``."""
        attn = self.module
        batch, seq = hn.shape[:-1]
        mask = causal_mask(seq, hn.dtype, hn.device)
        cos, sin = self.rotary(hn, torch.arange(seq, device=hn.device).unsqueeze(0))
        q_in = hn if attn.q_lora_rank is None else attn.q_a_layernorm(attn.q_a_proj(hn))
        latent = attn.kv_a_proj_with_mqa(hn)
        kv_nope, k_rot = torch.split(latent, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = attn.kv_a_layernorm(kv_nope).view(batch, 1, seq, attn.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, seq, attn.qk_rope_head_dim)
        q_up = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
        rope = (_deepseek.apply_rotary_pos_emb_interleave if attn.config.rope_interleave
                else _deepseek.apply_rotary_pos_emb)

        def up_proj(q_in, kv_nope, k_rot, cos, sin):
            q = q_up(q_in).view(batch, seq, -1, attn.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
            q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
            key, value = attn.expand_kv(kv_nope, k_rot)
            return torch.cat((q_pass, q_rot), dim=-1), key, value

        def core(qkv, interface):
            out, _ = interface(attn, *qkv, mask, dropout=attn.attention_dropout if attn.training else 0.0,
                               scaling=attn.scaling)
            return out

        latents, up_linears = (q_in, kv_nope, k_rot, cos, sin), (q_up, attn.kv_b_proj)
        if core_attn:
            out = checkpointed(lambda *a: core(up_proj(*a), _deepseek.eager_attention_forward), *latents,
                               linears=up_linears)
        else:
            interface = _deepseek.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                        _deepseek.eager_attention_forward)
            out = drop_output(up_proj, latents, lambda qkv: core(qkv, interface), fn_linears=up_linears)
        return attn.o_proj(out.reshape(batch, seq, -1).contiguous())


def build_mixer(model: ModelSpec, layer: LayerSpec) -> Mixer:
    """The transformers module of ``layer.mixer`` (module docstring), weights drawn from the
    current RNG state.

    Raises:
        TesseraConfigError: non-gated attention with ``0 < rotary_fraction < 1`` (no family has it).
    """
    m = layer.mixer
    if isinstance(m, DeltaNetSpec):
        return Mixer(Qwen3NextGatedDeltaNet(_qwen3_next_layer_config(model, layer), 0))
    if isinstance(m, AttentionSpec) and m.gated:
        config = _qwen3_next_layer_config(model, layer)
        return Mixer(Qwen3NextAttention(config, 0), Qwen3NextRotaryEmbedding(config), True)
    if isinstance(m, AttentionSpec) and m.rotary_fraction == 0.0:
        return Mixer(NemotronHAttention(_nemotron_layer_config(model, m), 0), None, True)
    if isinstance(m, AttentionSpec):
        if m.rotary_fraction != 1.0:
            raise TesseraConfigError(f"model.layers[{layer.index}].mixer.rotary_fraction", m.rotary_fraction,
                                     "non-gated attention is built with full RoPE (Qwen3-MoE) or none (Nemotron-H)",
                                     "use rotary_fraction=1.0, 0.0, or gated=True")
        attn = Qwen3MoeAttention(Qwen3MoeConfig(
            hidden_size=model.hidden, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim, rms_norm_eps=NORM_EPS["qwen3_moe"], max_position_embeddings=model.max_positions,
            attn_implementation="eager"), 0)
        return Mixer(attn, Qwen3NextRotaryEmbedding(_qwen3_next_layer_config(model, layer)), True)
    if isinstance(m, MLASpec):
        config = _deepseek_layer_config(model, m)
        return Mixer(DeepseekV3Attention(config, 0), DeepseekV3RotaryEmbedding(config), True)
    if isinstance(m, Mamba2Spec):
        return Mixer(NemotronHMamba2Mixer(_nemotron_layer_config(model, m), 0))
    raise TesseraConfigError(f"model.layers[{layer.index}].mixer", getattr(m, "kind", m), "this mixer kind is not built",
                             "use attention, mla, deltanet or mamba2 layers")
