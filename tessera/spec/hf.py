"""Read a Hugging Face ``config.json`` into a :class:`~tessera.spec.model.ModelSpec`.

Supported ``model_type`` values and the transformers 5.x config classes whose field names are
read (``transformers/models/<type>/configuration_<type>.py``):

- ``qwen3_next`` (``Qwen3NextConfig``): ``layer_types`` (else ``full_attention_interval``),
  ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
  ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``num_experts``,
  ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ...
- ``qwen3_moe`` (``Qwen3MoeConfig``; ``num_experts`` is saved as ``num_local_experts``).
- ``deepseek_v3`` (``DeepseekV3Config``; also Kimi K2, whose config.json may say ``kimi_k2``):
  ``first_k_dense_replace``, ``n_routed_experts``, ``n_shared_experts``, ``q_lora_rank``,
  ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
  ``num_nextn_predict_layers``; ``moe_layer_freq`` from DeepSeek's own config.json.
- ``nemotron_h`` (``NemotronHConfig``): ``layers_block_type`` or the released configs'
  ``hybrid_override_pattern``, ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
  ``n_groups``, ``n_routed_experts``, ``moe_intermediate_size``,
  ``moe_shared_expert_intermediate_size``, ``moe_latent_size``, ...

All four: ``rope_theta`` (transformers 5 ``rope_parameters["rope_theta"]``, else the released
configs' top-level ``rope_theta``; class default 10000.0) and ``max_position_embeddings`` (class
default: 32768 for ``Qwen3NextConfig`` / ``Qwen3MoeConfig``, 4096 for ``DeepseekV3Config`` /
``NemotronHConfig``) become ``ModelSpec.rope_theta`` / ``ModelSpec.max_positions``.

A field that sets a dimension must be present; a missing one, or an unsupported
``model_type``, raises :class:`TesseraConfigError` naming the field. Optional switches take the
transformers class default (named at each use). Values that config.json does not carry come from
the family's public source (see :mod:`tessera.spec.presets`): MoE aux-loss coefficient 1e-4 for
DeepSeek-V3 and Nemotron-H, no rotary embedding in Nemotron-H attention, squared-ReLU (non-gated)
Nemotron-H MLPs and experts.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from tessera.errors import TesseraConfigError
from tessera.spec.model import (
    AttentionSpec,
    DeltaNetSpec,
    DenseMLPSpec,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    MoESpec,
)
from tessera.spec.presets import build_model

_MISSING = object()


class _Config:
    """A config dict with field access that raises :class:`TesseraConfigError` naming the field."""

    def __init__(self, d: dict[str, Any], model_type: str):
        self.d, self.model_type = d, model_type

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """First present key of ``keys`` (aliases); ``default`` when none is, else an error."""
        for k in keys:
            if k in self.d:
                return self.d[k]
        if default is _MISSING:
            raise TesseraConfigError(
                f"hf_config.{keys[0]}", None, f"missing from the {self.model_type} config",
                f"add {keys[0]!r} to config.json (transformers {self.model_type} config field)",
            )
        return default

    def num(self, *keys: str, default: Any = _MISSING) -> int:
        """Like :meth:`get`, and the value must be an integer."""
        v = self.get(*keys, default=default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TesseraConfigError(f"hf_config.{keys[0]}", v, "must be an integer", "fix config.json")
        return v


def _load(path_or_dict: str | os.PathLike | dict) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TesseraConfigError("model.hf_config", path, f"cannot read a JSON config ({e})",
                                 "pass a config.json path, its folder, or a dict") from None


def _moe_layer_set(c: _Config, n: int) -> list[bool]:
    """Qwen3 rule (``Qwen3MoeDecoderLayer``): MoE unless in ``mlp_only_layers`` (default []),
    when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0`` (default 1)."""
    only = set(c.get("mlp_only_layers", default=None) or [])
    step = c.num("decoder_sparse_step", default=1)
    experts = c.num("num_experts", "num_local_experts")
    return [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(n)]


def _qwen_mlps(c: _Config, n: int, hidden: int, shared: int):
    is_moe = _moe_layer_set(c, n)
    moe = dense = None
    if any(is_moe):
        moe = MoESpec(
            num_experts=c.num("num_experts", "num_local_experts"), top_k=c.num("num_experts_per_tok"),
            expert_ffn=c.num("moe_intermediate_size"), shared_expert_ffn=shared,
            aux_loss_coef=float(c.get("router_aux_loss_coef", default=0.001)),
        )
    if not all(is_moe):
        dense = DenseMLPSpec(c.num("intermediate_size"))
    return [moe if m else dense for m in is_moe]


def _qwen3_next(c: _Config) -> tuple[int, int, list, dict]:
    hidden, n = c.num("hidden_size"), c.num("num_hidden_layers")
    types = c.get("layer_types", default=None)
    if types is None:  # transformers default: full attention every ``full_attention_interval`` (4)
        k = c.num("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"full_attention", "linear_attention"}:
        raise TesseraConfigError("hf_config.layer_types", types,
                                 f"must list {n} of 'full_attention'/'linear_attention'", "fix config.json")
    rope = c.get("rope_parameters", "rope_scaling", default=None) or {}
    rotary = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", default=0.25))
    attention = AttentionSpec(
        num_heads=c.num("num_attention_heads"), num_kv_heads=c.num("num_key_value_heads"),
        head_dim=c.num("head_dim"), gated=True, rotary_fraction=float(rotary),
    )
    deltanet = DeltaNetSpec(
        num_key_heads=c.num("linear_num_key_heads"), num_value_heads=c.num("linear_num_value_heads"),
        key_head_dim=c.num("linear_key_head_dim"), value_head_dim=c.num("linear_value_head_dim"),
        conv_kernel=c.num("linear_conv_kernel_dim"),
    )
    mlps = _qwen_mlps(c, n, hidden, c.num("shared_expert_intermediate_size"))
    mixers = [attention if t == "full_attention" else deltanet for t in types]
    return hidden, c.num("vocab_size"), list(zip(mixers, mlps)), {}


def _qwen3_moe(c: _Config) -> tuple[int, int, list, dict]:
    hidden, n = c.num("hidden_size"), c.num("num_hidden_layers")
    heads = c.num("num_attention_heads")
    attention = AttentionSpec(
        num_heads=heads, num_kv_heads=c.num("num_key_value_heads"),
        head_dim=c.num("head_dim", default=hidden // heads),  # transformers: getattr(..., hidden // heads)
    )
    mlps = _qwen_mlps(c, n, hidden, 0)
    return hidden, c.num("vocab_size"), [(attention, m) for m in mlps], {}


def _deepseek_v3(c: _Config) -> tuple[int, int, list, dict]:
    hidden, n = c.num("hidden_size"), c.num("num_hidden_layers")
    q_lora = c.get("q_lora_rank")
    mla = MLASpec(
        num_heads=c.num("num_attention_heads"), q_lora_rank=c.num("q_lora_rank") if q_lora is not None else 0,
        kv_lora_rank=c.num("kv_lora_rank"), qk_nope_head_dim=c.num("qk_nope_head_dim"),
        qk_rope_head_dim=c.num("qk_rope_head_dim"), v_head_dim=c.num("v_head_dim"),
    )
    experts = c.get("n_routed_experts", "num_local_experts")
    first_dense = c.num("first_k_dense_replace") if experts else n
    freq = c.num("moe_layer_freq", default=1)  # DeepSeek modeling: i >= first_k and i % freq == 0
    is_moe = [bool(experts) and i >= first_dense and i % freq == 0 for i in range(n)]
    moe = dense = None
    if any(is_moe):
        ffn = c.num("moe_intermediate_size")
        moe = MoESpec(
            num_experts=c.num("n_routed_experts", "num_local_experts"), top_k=c.num("num_experts_per_tok"),
            expert_ffn=ffn, shared_expert_ffn=ffn * c.num("n_shared_experts"),
            aux_loss_coef=0.0001,  # DeepSeek-V3 report: sequence-wise balance loss alpha
            num_groups=c.num("n_group", default=1), topk_groups=c.num("topk_group", default=1),
            router="sigmoid", shared_expert_gate=False,  # DeepseekV3TopkRouter; ungated shared experts
            routed_scaling=float(c.get("routed_scaling_factor", default=2.5)),  # DeepseekV3Config default
            bias_update_rate=0.001,  # not in config.json: the DeepSeek-V3 report's gamma (sec. 4.2)
        )
    if not all(is_moe):
        dense = DenseMLPSpec(c.num("intermediate_size"))
    # transformers DeepseekV3Config default num_mtp_layers (saved as num_nextn_predict_layers): 1
    mtp = c.num("num_nextn_predict_layers", "num_mtp_layers", default=1)
    blocks = [(mla, moe if m else dense) for m in is_moe]
    return hidden, c.num("vocab_size"), blocks, {"mtp_layers": mtp}


_NEMOTRON_TYPES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_NEMOTRON_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _nemotron_h(c: _Config) -> tuple[int, int, list, dict]:
    hidden = c.num("hidden_size")
    types = c.get("layers_block_type", "layer_types", default=None)
    if types is None:
        pattern = c.get("hybrid_override_pattern")
        bad = sorted(set(pattern) - set(_NEMOTRON_TYPES))
        if bad:
            raise TesseraConfigError("hf_config.hybrid_override_pattern", pattern,
                                     f"unknown layer characters {bad}", "use only M, E, *, -")
        types = [_NEMOTRON_TYPES[ch] for ch in pattern]
    types = [_NEMOTRON_LEGACY.get(t, t) for t in types]
    bad = sorted(set(types) - set(_NEMOTRON_TYPES.values()))
    if bad or not types:
        raise TesseraConfigError("hf_config.layers_block_type", types, f"unknown or no block types {bad}",
                                 "use linear_attention (Mamba-2), moe, full_attention, mlp")
    specs: dict[str, Callable[[], Any]] = {
        "full_attention": lambda: AttentionSpec(
            num_heads=c.num("num_attention_heads"), num_kv_heads=c.num("num_key_value_heads"),
            head_dim=c.num("head_dim", "attention_head_dim"), rotary_fraction=0.0,
        ),
        "linear_attention": lambda: Mamba2Spec(
            num_heads=c.num("mamba_num_heads"), head_dim=c.num("mamba_head_dim"),
            state_size=c.num("ssm_state_size"), n_groups=c.num("n_groups", "mamba_n_groups"),
            conv_kernel=c.num("conv_kernel", "mamba_d_conv"), chunk_size=c.num("chunk_size", "mamba_chunk_size"),
        ),
        "moe": lambda: MoESpec(
            num_experts=c.num("n_routed_experts", "num_local_experts"), top_k=c.num("num_experts_per_tok"),
            expert_ffn=c.num("moe_intermediate_size"),
            shared_expert_ffn=c.num("moe_shared_expert_intermediate_size"),
            latent_dim=int(c.get("moe_latent_size", default=None) or 0),
            aux_loss_coef=0.0001, gated=False,  # Megatron-Bridge moe_aux_loss_coeff; relu2 up/down experts
            num_groups=c.num("n_group", default=1), topk_groups=c.num("topk_group", default=1),
            router="sigmoid", shared_expert_gate=False,  # NemotronHTopkRouter; ungated shared expert
            routed_scaling=float(c.get("routed_scaling_factor", default=1.0)),  # NemotronHConfig default
        ),
        "mlp": lambda: DenseMLPSpec(c.num("intermediate_size"), gated=False),
    }
    built = {t: specs[t]() for t in dict.fromkeys(types)}  # each needed spec once, in layer order
    blocks = [(built[t], None) if t in ("full_attention", "linear_attention") else (None, built[t]) for t in types]
    return hidden, c.num("vocab_size"), blocks, {"mtp_layers": c.num("num_nextn_predict_layers", default=0)}


# transformers 5.x class defaults of max_position_embeddings (configuration_<type>.py)
_MAX_POSITIONS_DEFAULT = {"qwen3_next": 32768, "qwen3_moe": 32768, "deepseek_v3": 4096, "kimi_k2": 4096,
                          "nemotron_h": 4096}


def _positions(c: _Config) -> dict:
    """``rope_theta`` and ``max_positions`` of the config (see the module docstring)."""
    rope = c.get("rope_parameters", default=None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if theta is None:
        theta = c.get("rope_theta", default=10000.0)  # transformers default for all four families
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise TesseraConfigError("hf_config.rope_theta", theta, "must be a positive number", "fix config.json")
    n = c.num("max_position_embeddings", default=_MAX_POSITIONS_DEFAULT[c.model_type])
    if n <= 0:
        raise TesseraConfigError("hf_config.max_position_embeddings", n, "must be > 0", "fix config.json")
    return {"rope_theta": float(theta), "max_positions": n}


_READERS: dict[str, Callable[[_Config], tuple[int, int, list, dict]]] = {
    "qwen3_next": _qwen3_next,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2": _deepseek_v3,
    "nemotron_h": _nemotron_h,
}


def model_from_hf_config(path_or_dict: str | os.PathLike | dict, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` described by a Hugging Face config (a config.json path, its folder,
    or the loaded dict). ``name`` defaults to the config's ``_name_or_path`` or ``model_type``."""
    d = _load(path_or_dict)
    model_type = d.get("model_type")
    if model_type not in _READERS:
        raise TesseraConfigError("hf_config.model_type", model_type, "unsupported model type",
                                 "use one of: " + ", ".join(_READERS))
    c = _Config(d, model_type)
    hidden, vocab, blocks, extra = _READERS[model_type](c)
    tie = bool(c.get("tie_word_embeddings", default=False))  # transformers default for all four: False
    return build_model(name or d.get("_name_or_path") or model_type, hidden, vocab, blocks,
                       tie_embeddings=tie, **extra, **_positions(c))
