"""Hugging Face checkpoints of every model family Tessera builds: the name and shape map between
Tessera's stage modules and transformers' ``<Arch>ForCausalLM``, and the ModelSpec -> config
conversion, per family (:attr:`ModelSpec.family <tessera.spec.model.ModelSpec.family>`):

=================  ==========================  ==============================================
family             transformers class          module (names, config, what is refused)
=================  ==========================  ==============================================
``qwen3_next``     ``Qwen3NextForCausalLM``    :mod:`tessera.model.hf.qwen3_next`
``qwen3_moe``      ``Qwen3MoeForCausalLM``     :mod:`tessera.model.hf.qwen3_moe`
``deepseek_v3``    ``DeepseekV3ForCausalLM``   :mod:`tessera.model.hf.deepseek_v3`
``nemotron_h``     ``NemotronHForCausalLM``    :mod:`tessera.model.hf.nemotron_h`
=================  ==========================  ==============================================

Tessera's layers are built from each family's own transformers modules
(:mod:`tessera.model.mixers`, :mod:`tessera.model.moe`), so every tensor keeps its shape; only
the module paths differ. Tessera global names (:mod:`tessera.train.upgrade.reshard`) map to HF
``state_dict`` names by :func:`hf_name`; the tensors of a stage are its parameters and persistent
buffers (the sigmoid router's ``e_score_correction_bias``, exported and imported as FP32).
Routed experts are written per expert (``<mlp>.experts.<e>.<proj>.weight``, what
``save_pretrained`` writes); an import also reads transformers 5's stacked in-memory layout
(:data:`~tessera.model.hf.common.STACKED`, :mod:`tessera.train.worker.hf_io`).

What has no HF equivalent in the model's family (a layer kind of another family, latent experts outside Nemotron-H,
two shapes of one kind, a softmax router in a DeepSeek-V3 model, ...) raises
:class:`~tessera.errors.TesseraConfigError` naming the layer and its kind. The byte-level
tokenizer written next to an export: :mod:`tessera.model.hf.tokenizer`.
"""

from __future__ import annotations

from typing import Iterator

import torch

from tessera.model.hf import common
from tessera.model.hf.common import STACKED, Family, plain, same, without_training_fields
from tessera.model.hf.deepseek_v3 import FAMILY as DEEPSEEK_V3
from tessera.model.hf.nemotron_h import FAMILY as NEMOTRON_H
from tessera.model.hf.qwen3_moe import FAMILY as QWEN3_MOE
from tessera.model.hf.qwen3_next import FAMILY as QWEN3_NEXT
from tessera.model.hf.tokenizer import BYTE_VOCAB, TOKENIZER_FILES, byte_tokenizer, save_byte_tokenizer
from tessera.model.layers import DecoderLayer
from tessera.spec.model import ModelSpec

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN3_NEXT, QWEN3_MOE, DEEPSEEK_V3, NEMOTRON_H)}
"""``ModelSpec.family`` -> its :class:`~tessera.model.hf.common.Family`."""

__all__ = ["BYTE_VOCAB", "FAMILIES", "STACKED", "TOKENIZER_FILES", "byte_tokenizer", "canonical", "check_supported",
           "config_mismatch", "family_of", "hf_config", "hf_name", "hf_shapes", "ignored", "layer_params",
           "qwen3_next_config", "save_byte_tokenizer", "stage_params"]


def family_of(model: ModelSpec) -> Family:
    """The :class:`~tessera.model.hf.common.Family` of ``model`` (``model.family``)."""
    return FAMILIES[model.family]


def check_supported(model: ModelSpec) -> None:
    """Raise unless ``model`` has an HF equivalent in its family (the family module's Supported).

    Raises:
        TesseraConfigError: naming the first layer whose kind or dims have none.
    """
    family_of(model).check(model)


def hf_config(model: ModelSpec):
    """The transformers config of ``model`` in its family (``Qwen3NextConfig``,
    ``Qwen3MoeConfig``, ``DeepseekV3Config`` or ``NemotronHConfig``; ``architectures`` set).

    Raises:
        TesseraConfigError: as :func:`check_supported`.
    """
    return family_of(model).config(model)


def qwen3_next_config(model: ModelSpec):
    """The ``Qwen3NextConfig`` of a Qwen3-Next model (:mod:`tessera.model.hf.qwen3_next`).

    Raises:
        TesseraConfigError: a layer has no Qwen3-Next equivalent.
    """
    return QWEN3_NEXT.config(model)


def config_mismatch(model: ModelSpec, hf: dict) -> str | None:
    """The first difference between an HF ``config.json`` dict and ``model`` that changes the
    weights' shapes or the logits (``"<field>=<theirs> where the model has <ours>"``), or None.

    Compared: ``model_type``; the family's numeric switches (``Family.keys``, and
    ``Family.moe_keys`` when the model has MoE layers: e.g. ``rms_norm_eps`` /
    ``layer_norm_epsilon``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``,
    ``topk_group``, ``rope_interleave``), a field absent from config.json taking the transformers
    class default as transformers does; the RoPE type (``default`` only) where the family has
    RoPE; then the layer pattern and dims through :func:`tessera.spec.hf.model_from_hf_config`
    (``hidden``, ``vocab``, ``num_layers``, ``rope_theta``, each layer's mixer and MLP).
    Not compared: ``max_position_embeddings``, ``router_aux_loss_coef``, MTP layers and other
    fields with no effect on the weights or the logits.

    Raises:
        TesseraConfigError: ``model`` has no HF equivalent (:func:`check_supported`).
    """
    from tessera.spec.hf import model_from_hf_config

    family = family_of(model)
    if hf.get("model_type") not in family.model_types:
        return f"model_type={hf.get('model_type')!r} where the model needs {family.model_types[0]!r}"
    want = family.config(model)
    defaults = family.config_class()
    for keys in family.keys + (family.moe_keys if model.moe is not None else ()):
        theirs = next((hf[k] for k in keys if k in hf), getattr(defaults, keys[0]))
        ours = getattr(want, keys[0])
        if not same(theirs, ours):
            return f"{keys[0]}={plain(theirs)!r} where the model has {plain(ours)!r}"
    if family.rope:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            return f"rope_parameters.rope_type={kind!r} where the model has 'default'"
    theirs = model_from_hf_config(hf)
    for key in ("hidden", "vocab", "num_layers") + (("rope_theta",) if family.rope else ()):
        if getattr(theirs, key) != getattr(model, key):
            return f"{key}={getattr(theirs, key)!r} where the model has {getattr(model, key)!r}"
    for a, b in zip(theirs.layers, model.layers):
        for part in ("mixer", "mlp"):
            x, y = without_training_fields(getattr(a, part)), without_training_fields(getattr(b, part))
            if x != y:
                return f"layers[{a.index}].{part}={x} where the model has {y}"
    return None


def hf_name(name: str, mixer_kind: str | None, expert_offset: int = 0, family: str = "qwen3_next") -> str:
    """The HF ``state_dict`` name of the Tessera global name ``name`` in ``family``'s format
    (the family module's name table); ``mixer_kind``: the layer's mixer kind (``"deltanet"``,
    ``"attention"``, ``"mla"``, ``"mamba2"``; None outside layers and for MLP-only layers);
    ``expert_offset``: the EP rank's first global expert.

    Raises:
        KeyError: ``name`` is not a tensor of a stage of that family.
    """
    return common.hf_name(FAMILIES[family], name, mixer_kind, expert_offset)


def layer_params(layer: DecoderLayer, family: str = "qwen3_next",
                 expert_offset: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of one decoder layer's parameters and persistent buffers in
    ``family``'s format (``expert_offset``: default the layer's own ``MoEBlock.expert_offset``)."""
    return common.layer_tensors(FAMILIES[family], layer, expert_offset)


def stage_params(module) -> dict[str, torch.Tensor]:
    """HF name -> live tensor of every parameter and persistent buffer (the sigmoid router's
    ``e_score_correction_bias``) a :class:`~tessera.model.stage.StageModule` holds, in its
    model's family format (its routed experts under their global ids)."""
    return common.stage_tensors(family_of(module.model_spec), module)


def hf_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of ``model``'s checkpoint in its family's format
    (per-expert layout; :func:`tessera.model.hf.common.hf_shapes`).

    Raises:
        TesseraConfigError: as :func:`check_supported`.
    """
    family = family_of(model)
    family.check(model)
    return common.hf_shapes(family, model)


def ignored(model: ModelSpec, name: str) -> bool:
    """Whether an import skips the HF tensor ``name`` (multi-token prediction; the family module)."""
    return family_of(model).ignored(model, name)


def canonical(model: ModelSpec, name: str) -> str:
    """``name`` in the spelling :func:`hf_name` gives (another spelling of the root a family's
    checkpoints may use: Nemotron-H's in-memory ``model.`` for ``backbone.``), else ``name``."""
    n = family_of(model).names
    if n.alias is not None and name.startswith(n.alias + "."):
        return n.root + name[len(n.alias):]
    return name

