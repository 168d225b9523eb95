"""Hugging Face Qwen3-Next checkpoints: the name and shape map between Tessera's stage modules and
transformers' ``Qwen3NextForCausalLM``, and the ModelSpec -> ``Qwen3NextConfig`` conversion.

Tessera's layers are built from transformers' own Qwen3-Next modules (:mod:`tessera.model.layers`,
:mod:`tessera.model.moe`), so every tensor keeps its shape; only the module paths differ.
Tessera global names (:mod:`tessera.train.upgrade.reshard`) map to HF ``state_dict`` names as::

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

``<offset>`` is the EP rank's first global expert (``MoEBlock.expert_offset``). Each routed
expert is a ``Qwen3NextMLP`` (``gate_proj`` / ``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``):
the per-expert layout ``save_pretrained`` writes (transformers 5 converts it from and to its
stacked in-memory ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, gate
rows first; :data:`STACKED` names those, read by :mod:`tessera.train.worker.hf_io` too).

Numerics that must agree for the same logits (checked by :func:`config_mismatch`): RMSNorm
``eps`` 1e-6 (:data:`~tessera.model.layers.RMS_EPS`) with the ``(1 + weight)`` Qwen3-Next norm,
SiLU, default RoPE with the model's ``rope_theta`` and each attention layer's
``rotary_fraction`` as ``partial_rotary_factor``, untied head. Routing: DeepSpeed's
``topkgating`` / ``top2gating`` (Tessera) renormalise the top-k softmax probabilities, as HF's
``norm_topk_prob=True``; its ``top1gating`` does not, as ``norm_topk_prob=False``; so
``norm_topk_prob = top_k > 1``. Dropless routing only (``MoEOptions.drop_tokens=False``, the
default): HF has no capacity.

Tokenizer: Tessera trains on bytes (:mod:`tessera.train.worker.data`: token id = byte value of the
UTF-8 text, ids 0..255). :func:`byte_tokenizer` is that encoding as a transformers tokenizer (a
``tokenizers`` byte-level BPE with the 256 byte tokens and no merges, no special tokens), which
:func:`save_byte_tokenizer` writes next to an exported checkpoint (``tokenizer.json``,
``tokenizer_config.json``) so that ``AutoTokenizer.from_pretrained(PATH)`` encodes text as the
model was trained, offline.

Supported: Qwen3-Next layers (Gated DeltaNet or gated attention, then MoE with a gated shared
expert, or a dense SwiGLU MLP), all attention layers alike, all DeltaNet layers alike, all MoE
layers alike. Anything else (MLA, Mamba-2, non-gated attention, squared-ReLU MLPs, latent
experts, a layer without mixer or MLP) raises :class:`~tessera.errors.TesseraConfigError`
naming the layer and its kind.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterator

import torch
from torch import nn
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from tessera.errors import TesseraConfigError
from tessera.model.layers import RMS_EPS, DecoderLayer
from tessera.spec.model import AttentionSpec, DeltaNetSpec, DenseMLPSpec, LayerSpec, ModelSpec, MoESpec

STACKED = ("gate_up_proj", "down_proj")
"""Stacked expert tensors of transformers 5's in-memory ``Qwen3NextExperts`` (``mlp.experts.<t>``)."""

BYTE_VOCAB = 256
"""Token ids of Tessera's byte-level data (:data:`tessera.train.worker.data.VOCAB`): one per byte value."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What :func:`save_byte_tokenizer` writes."""

_FIXED = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
          "head.output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"moe\.experts\.(\d+)\.(.+)")


def _refuse(index: int, what: str, kind, rule: str) -> TesseraConfigError:
    return TesseraConfigError(f"model.layers[{index}].{what}", kind, rule,
                              "export/import Hugging Face checkpoints of Qwen3-Next models only (e.g. the "
                              "tiny-qwen3-next preset)")


def check_supported(model: ModelSpec) -> None:
    """Raise unless ``model`` has a Qwen3-Next HF equivalent (module docstring, Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    first: dict[str, object] = {}
    for layer in model.layers:
        m, mlp = layer.mixer, layer.mlp
        if m is None or not isinstance(m, (AttentionSpec, DeltaNetSpec)):
            raise _refuse(layer.index, "mixer", None if m is None else m.kind,
                          "Qwen3-Next layers have a Gated DeltaNet or gated-attention mixer")
        if isinstance(m, AttentionSpec) and not m.gated:
            raise _refuse(layer.index, "mixer.gated", False, "Qwen3-Next attention is gated")
        if mlp is None or not getattr(mlp, "gated", True):
            raise _refuse(layer.index, "mlp", None if mlp is None else f"{mlp.kind} (gated=False)",
                          "Qwen3-Next layers end in a SwiGLU MoE or dense MLP")
        if isinstance(mlp, MoESpec) and (mlp.latent_dim or not mlp.shared_expert_ffn):
            raise _refuse(layer.index, "mlp", mlp.kind, "Qwen3-Next MoE layers have full-width experts "
                          "(latent_dim=0) and a shared expert (shared_expert_ffn > 0)")
        for key, spec in ((m.kind, m), (mlp.kind, dataclasses.replace(mlp, aux_loss_coef=0.0)
                                        if isinstance(mlp, MoESpec) else mlp)):
            if first.setdefault(key, spec) != spec:
                raise _refuse(layer.index, "mixer" if key == m.kind else "mlp", key,
                              f"Qwen3-Next has one {key} shape for all layers ({first[key]})")


def qwen3_next_config(model: ModelSpec) -> Qwen3NextConfig:
    """The transformers ``Qwen3NextConfig`` of ``model`` (module docstring: eps, RoPE, routing
    normalisation; ``mlp_only_layers`` lists the dense layers; ``intermediate_size`` is the
    dense width, else the config class default).

    Raises:
        TesseraConfigError: as :func:`check_supported`.
    """
    check_supported(model)
    kw: dict = dict(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.num_layers,
                    rms_norm_eps=RMS_EPS, hidden_act="silu", max_position_embeddings=model.max_positions,
                    tie_word_embeddings=False, attention_bias=False, decoder_sparse_step=1,
                    layer_types=["full_attention" if isinstance(l.mixer, AttentionSpec) else "linear_attention"
                                 for l in model.layers],
                    mlp_only_layers=[l.index for l in model.layers if isinstance(l.mlp, DenseMLPSpec)])
    att = next((l.mixer for l in model.layers if isinstance(l.mixer, AttentionSpec)), None)
    rotary = att.rotary_fraction if att is not None else 0.25
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(model.rope_theta),
                             "partial_rotary_factor": rotary}
    if att is not None:
        kw.update(num_attention_heads=att.num_heads, num_key_value_heads=att.num_kv_heads, head_dim=att.head_dim)
    dn = next((l.mixer for l in model.layers if isinstance(l.mixer, DeltaNetSpec)), None)
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
    dense = next((l.mlp for l in model.layers if isinstance(l.mlp, DenseMLPSpec)), None)
    if dense is not None:
        kw["intermediate_size"] = dense.ffn
    cfg = Qwen3NextConfig(**kw)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return cfg


def config_mismatch(model: ModelSpec, hf: dict) -> str | None:
    """The first difference between an HF ``config.json`` dict and ``model`` that changes the
    weights' shapes or the logits (``"<field>=<theirs> where the model has <ours>"``), or None.
    The layer pattern and dims are compared through :func:`tessera.spec.hf.model_from_hf_config`;
    ``max_position_embeddings`` and ``router_aux_loss_coef`` (no effect on the weights or the
    logits) are not compared."""
    from tessera.spec.hf import model_from_hf_config

    if hf.get("model_type") != "qwen3_next":
        return f"model_type={hf.get('model_type')!r} where the model needs 'qwen3_next'"
    want = qwen3_next_config(model)
    for key in ("hidden_act", "rms_norm_eps", "attention_bias"):
        if key in hf and hf[key] != getattr(want, key):
            return f"{key}={hf[key]!r} where the model has {getattr(want, key)!r}"
    if model.moe is not None and bool(hf.get("norm_topk_prob", True)) != want.norm_topk_prob:
        return (f"norm_topk_prob={hf.get('norm_topk_prob', True)!r} where the model's top-{model.moe.top_k} routing "
                f"has {want.norm_topk_prob!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_parameters.rope_type={rope.get('rope_type', rope.get('type'))!r} where the model has 'default'"
    theirs = model_from_hf_config(hf)
    for key in ("hidden", "vocab", "num_layers", "rope_theta"):
        if getattr(theirs, key) != getattr(model, key):
            return f"{key}={getattr(theirs, key)!r} where the model has {getattr(model, key)!r}"
    for a, b in zip(theirs.layers, model.layers):
        for part in ("mixer", "mlp"):
            x, y = getattr(a, part), getattr(b, part)
            if isinstance(x, MoESpec) and isinstance(y, MoESpec):
                x, y = dataclasses.replace(x, aux_loss_coef=0.0), dataclasses.replace(y, aux_loss_coef=0.0)
            if x != y:
                return f"layers[{a.index}].{part}={x} where the model has {y}"
    return None


def hf_name(name: str, mixer_kind: str | None, expert_offset: int = 0) -> str:
    """The HF ``state_dict`` name of the Tessera global name ``name`` (module docstring);
    ``mixer_kind``: the layer's mixer kind (``"deltanet"`` / ``"attention"``; None outside
    layers); ``expert_offset``: the EP rank's first global expert.

    Raises:
        KeyError: ``name`` is not a parameter of a Qwen3-Next stage.
    """
    if name in _FIXED:
        return _FIXED[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"{name!r} is not a Tessera global parameter name (embed.*, layers.<i>.*, head.*)")
    i, rest = m.groups()
    head, _, tail = rest.partition(".")
    if head in ("input_layernorm", "post_attention_layernorm"):
        return f"model.layers.{i}.{rest}"
    if head == "attn" and mixer_kind in ("deltanet", "attention"):
        return f"model.layers.{i}.{'linear_attn' if mixer_kind == 'deltanet' else 'self_attn'}.{tail}"
    if head == "mlp_module":
        return f"model.layers.{i}.mlp.{tail}"
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        return f"model.layers.{i}.mlp.experts.{expert_offset + int(e.group(1))}.{e.group(2)}"
    if rest == "moe.gate.wg.weight":
        return f"model.layers.{i}.mlp.gate.weight"
    if head == "moe" and tail.partition(".")[0] in ("shared_expert", "shared_expert_gate"):
        return f"model.layers.{i}.mlp.{tail}"
    raise KeyError(f"{name!r} has no Hugging Face Qwen3-Next name (mixer kind {mixer_kind!r})")


def layer_params(layer: DecoderLayer, expert_offset: int | None = None) -> Iterator[tuple[str, nn.Parameter]]:
    """``(HF name, parameter)`` of one decoder layer (``expert_offset``: default the layer's own
    ``MoEBlock.expert_offset``)."""
    offset = expert_offset if expert_offset is not None else (layer.moe.expert_offset if layer.moe is not None else 0)
    for n, p in layer.named_parameters():
        yield hf_name(f"layers.{layer.index}.{n}", layer.mixer_kind, offset), p


def stage_params(module) -> dict[str, nn.Parameter]:
    """HF name -> parameter of every parameter a :class:`~tessera.model.stage.StageModule` holds
    (its routed experts under their global ids)."""
    out: dict[str, nn.Parameter] = {}
    for part, prefix in ((module.embed, "embed"), (module.head, "head")):
        if part is not None:
            out.update((hf_name(f"{prefix}.{n}", None), p) for n, p in part.named_parameters())
    for layer in module.layers:
        out.update(layer_params(layer))
    return out


def hf_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of ``model``'s ``Qwen3NextForCausalLM`` checkpoint
    (per-expert layout). One layer per distinct layer spec is built on the meta device (no
    memory, no init); the others are renamed from it.

    Raises:
        TesseraConfigError: as :func:`check_supported`.
    """
    check_supported(model)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab, model.hidden),
                                       "model.norm.weight": (model.hidden,),
                                       "lm_head.weight": (model.vocab, model.hidden)}
    built: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
    for layer in model.layers:
        key = (layer.mixer, layer.mlp)
        if key not in built:
            with torch.device("meta"):
                proto = DecoderLayer(model, LayerSpec(0, layer.mixer, layer.mlp), split_w=False)
            built[key] = [(n.removeprefix("model.layers.0."), tuple(p.shape)) for n, p in layer_params(proto, 0)]
        out.update((f"model.layers.{layer.index}.{n}", s) for n, s in built[key])
    return out


def byte_tokenizer(model_max_length: int):
    """The transformers tokenizer of Tessera's training data: ``text`` -> its UTF-8 bytes, each byte
    one token whose id is the byte value (``tokenizer(text)["input_ids"] == list(text.encode())``);
    ``decode`` joins the bytes back into text (invalid UTF-8 becomes U+FFFD). A ``tokenizers``
    byte-level BPE: the GPT-2 byte-to-character table as its 256-token vocabulary (token ``b``
    is the character standing for byte ``b``), no merges, no regex split, no prefix space, no
    special tokens. ``model_max_length``: tokens the model's positions cover (``max_positions``).

    Returns:
        a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()  # byte value -> the printable character ByteLevel maps it to
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def save_byte_tokenizer(to: str, model: ModelSpec) -> list[str]:
    """Write :func:`byte_tokenizer` (``model_max_length = model.max_positions``) into the HF
    directory ``to``; returns the file names (:data:`TOKENIZER_FILES`).

    Raises:
        TesseraConfigError: ``model.vocab`` is under :data:`BYTE_VOCAB` (byte ids would not fit).
    """
    if model.vocab < BYTE_VOCAB:
        raise TesseraConfigError("model.vocab", model.vocab, f"must be >= {BYTE_VOCAB} for the byte-level tokenizer "
                                 f"Tessera trains with (ids 0..{BYTE_VOCAB - 1})",
                                 "export a model with a vocabulary of at least 256")
    byte_tokenizer(model.max_positions).save_pretrained(to)
    return sorted(n for n in os.listdir(to) if n in TOKENIZER_FILES)
