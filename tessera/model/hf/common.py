"""What every family's Hugging Face map shares: the :class:`Family` record, the name map driven by
:class:`Names`, the tensors of a stage, the shapes of a checkpoint and the checks common to all.

A family module (:mod:`~tessera.model.hf.qwen3_next`, :mod:`~tessera.model.hf.qwen3_moe`,
:mod:`~tessera.model.hf.deepseek_v3`, :mod:`~tessera.model.hf.nemotron_h`) gives one
:class:`Family`: how transformers' ``<Arch>ForCausalLM`` names its tensors (:class:`Names`), which
layers it has (``check``), its config (``config``), the config.json fields that change the logits
(``keys`` / ``moe_keys``) and the tensors an import skips (``ignored``: multi-token prediction).

Tensors of a stage: its parameters and its persistent buffers (the sigmoid router's
``e_score_correction_bias``, :class:`~tessera.model.gating.SigmoidRouter`; the rotary
``inv_freq`` and the router's load count are not persistent and not exported).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from tessera.errors import TesseraConfigError
from tessera.model.layers import DecoderLayer
from tessera.spec.model import DenseMLPSpec, LayerSpec, ModelSpec, MoESpec

STACKED = ("gate_up_proj", "up_proj", "down_proj")
"""Stacked expert tensors of transformers 5's in-memory experts (``<mlp>.experts.<t>``):
``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` for SwiGLU experts
(``Qwen3NextExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``), ``up_proj [E, I, H]`` and
``down_proj [E, H, I]`` for ``NemotronHExperts``. ``save_pretrained`` writes them per expert."""

TRAINING_ONLY = ("aux_loss_coef", "bias_update_rate")
"""MoESpec fields that a checkpoint does not carry and that do not change the logits (the balance
loss weight, the correction bias's update speed): left out where specs are compared."""

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"moe\.experts\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Names:
    """How a family's HF ``state_dict`` (what ``save_pretrained`` writes) names the tensors.

    Attributes:
        root: the base model's prefix (``"model"``; Nemotron-H: ``"backbone"``).
        embed, final_norm: the embedding and final-norm modules under ``root``.
        input_norm, post_norm: a layer's norm before the mixer / before the MLP (Nemotron-H: both
            ``"norm"``, one per single-block layer).
        mixers: mixer kind -> the layer's mixer module (``"self_attn"``, ``"linear_attn"``, ``"mixer"``).
        mlp: the layer's MLP / MoE module (``"mlp"``; Nemotron-H: ``"mixer"``).
        shared: the MoE's shared expert module (``"shared_expert"`` / ``"shared_experts"``).
        shared_gate: the MoE's shared-expert gate (Qwen3-Next ``"shared_expert_gate"``), or None.
        alias: another spelling of ``root`` an import also reads (transformers' in-memory
            ``model.`` of Nemotron-H), or None.
    """

    root: str = "model"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    mixers: tuple[tuple[str, str], ...] = ()
    mlp: str = "mlp"
    shared: str = "shared_expert"
    shared_gate: str | None = None
    alias: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family's Hugging Face format (module docstring).

    Attributes:
        name: ``ModelSpec.family`` (and the config's ``model_type``).
        label: its name in messages, e.g. ``"DeepSeek-V3"``.
        architecture: transformers' causal-LM class, e.g. ``"DeepseekV3ForCausalLM"``.
        model_types: config.json ``model_type`` values an import accepts.
        preset: a tiny preset of the family (named in fixes).
        names: :class:`Names`.
        check: ``ModelSpec -> None``, raises :class:`TesseraConfigError` for a layer without an
            HF equivalent.
        fields: ``ModelSpec -> dict``: the family's config fields of a checked model
            (:meth:`config` adds the dense width and builds the config).
        config_class: the transformers config class (its defaults stand for absent fields).
        keys: config.json fields (each with its aliases) that must equal ``config``'s.
        moe_keys: the same, compared only when the model has MoE layers.
        rope: the family's attention takes RoPE (``rope_parameters`` and ``rope_theta`` compared).
        ignored: ``(ModelSpec, HF name) -> bool``: tensors an import skips (multi-token prediction).
    """

    name: str
    label: str
    architecture: str
    model_types: tuple[str, ...]
    preset: str
    names: Names
    check: Callable[[ModelSpec], None]
    fields: Callable[[ModelSpec], dict]
    config_class: type
    keys: tuple[tuple[str, ...], ...]
    moe_keys: tuple[tuple[str, ...], ...]
    rope: bool
    ignored: Callable[[ModelSpec, str], bool]

    def config(self, model: ModelSpec):
        """The transformers config of ``model`` in this family: :attr:`check`, then
        :attr:`fields`, ``intermediate_size`` = the dense MLP width where the model has dense
        layers (else the class default), ``architectures = [architecture]``.

        Raises:
            TesseraConfigError: as :attr:`check`.
        """
        self.check(model)
        kw = self.fields(model)
        dense = first_of(model, DenseMLPSpec)
        if dense is not None:
            kw["intermediate_size"] = dense.ffn
        cfg = self.config_class(**kw)
        cfg.architectures = [self.architecture]
        return cfg

    def refuse(self, index: int, what: str, kind, rule: str) -> TesseraConfigError:
        """The one-line error for layer ``index``'s ``what`` (its ``kind``) breaking ``rule``."""
        return TesseraConfigError(f"model.layers[{index}].{what}", kind, rule,
                                  f"export/import Hugging Face checkpoints of models whose layers all have a "
                                  f"{self.label} equivalent (transformers {self.architecture}; e.g. the {self.preset} "
                                  "preset)")


def without_training_fields(spec):
    """``spec`` with :data:`TRAINING_ONLY` fields at 0 (MoESpec), else ``spec``."""
    if not isinstance(spec, MoESpec):
        return spec
    names = {f.name for f in dataclasses.fields(spec)}
    return dataclasses.replace(spec, **{k: 0.0 for k in TRAINING_ONLY if k in names})


def check_alike(family: Family, model: ModelSpec) -> None:
    """One shape per mixer kind and per MLP kind over all layers (an HF config has one of each).

    Raises:
        TesseraConfigError: naming the first layer that differs from the first of its kind.
    """
    first: dict[str, object] = {}
    for layer in model.layers:
        for part in ("mixer", "mlp"):
            spec = without_training_fields(getattr(layer, part))
            if spec is None:
                continue
            if first.setdefault(spec.kind, spec) != spec:
                raise family.refuse(layer.index, part, spec.kind,
                                    f"{family.label} has one {spec.kind} shape for all layers ({first[spec.kind]})")


def first_of(model: ModelSpec, cls):
    """The first layer's mixer or MLP spec of type ``cls``, or None."""
    return next((p for l in model.layers for p in (l.mixer, l.mlp) if isinstance(p, cls)), None)


_LATENT = {"latent_down": "fc1_latent_proj", "latent_up": "fc2_latent_proj"}
"""MoEBlock's latent projections -> transformers ``NemotronHMoE``'s names."""


def hf_name(family: Family, name: str, mixer_kind: str | None, expert_offset: int = 0) -> str:
    """The HF ``state_dict`` name of the Tessera global name ``name``
    (:mod:`tessera.train.upgrade.reshard`) in ``family``'s format; ``mixer_kind``: the layer's
    mixer kind (None outside layers and for MLP-only layers); ``expert_offset``: the EP rank's
    first global expert (``MoEBlock.expert_offset``; routed experts keep EP-local ids in Tessera).

    Raises:
        KeyError: ``name`` has no place in the family's checkpoint.
    """
    n = family.names
    fixed = {"embed.weight": f"{n.root}.{n.embed}.weight", "head.norm.weight": f"{n.root}.{n.final_norm}.weight",
             "head.output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"{name!r} is not a Tessera global parameter name (embed.*, layers.<i>.*, head.*)")
    i, rest = m.groups()
    layer = f"{n.root}.layers.{i}"
    head, _, tail = rest.partition(".")
    mixers = dict(n.mixers)
    if head == "input_layernorm":
        return f"{layer}.{n.input_norm}.{tail}"
    if head == "post_attention_layernorm":
        return f"{layer}.{n.post_norm}.{tail}"
    if head == "attn" and mixer_kind in mixers:
        return f"{layer}.{mixers[mixer_kind]}.{tail}"
    if head == "mlp_module":
        return f"{layer}.{n.mlp}.{tail}"
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        return f"{layer}.{n.mlp}.experts.{expert_offset + int(e.group(1))}.{e.group(2)}"
    if rest in ("moe.gate.wg.weight", "moe.gate.e_score_correction_bias"):
        return f"{layer}.{n.mlp}.gate.{'weight' if rest.endswith('.weight') else 'e_score_correction_bias'}"
    part, _, sub = tail.partition(".")
    if head == "moe" and part in _LATENT:  # latent-space experts (Nemotron 3 Super's MoE)
        return f"{layer}.{n.mlp}.{_LATENT[part]}.{sub}"
    if head == "moe" and part == "shared_expert":
        return f"{layer}.{n.mlp}.{n.shared}.{sub}"
    if head == "moe" and part == "shared_expert_gate" and n.shared_gate is not None:
        return f"{layer}.{n.mlp}.{n.shared_gate}.{sub}"
    raise KeyError(f"{name!r} has no Hugging Face {family.label} name (mixer kind {mixer_kind!r})")


def module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(local name, tensor)`` of ``module``'s parameters and persistent buffers, the
    ``state_dict`` entries, as the live tensors (``copy_`` into them sets the module)."""
    yield from module.state_dict(keep_vars=True).items()


def layer_tensors(family: Family, layer: DecoderLayer,
                  expert_offset: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of one decoder layer's parameters and persistent buffers
    (``expert_offset``: default the layer's own ``MoEBlock.expert_offset``)."""
    offset = expert_offset if expert_offset is not None else (layer.moe.expert_offset if layer.moe is not None else 0)
    for n, p in module_tensors(layer):
        yield hf_name(family, f"layers.{layer.index}.{n}", layer.mixer_kind, offset), p


def stage_tensors(family: Family, module) -> dict[str, torch.Tensor]:
    """HF name -> live tensor of every parameter and persistent buffer a
    :class:`~tessera.model.stage.StageModule` holds (its routed experts under their global ids)."""
    out: dict[str, torch.Tensor] = {}
    for part, prefix in ((module.embed, "embed"), (module.head, "head")):
        if part is not None:
            out.update((hf_name(family, f"{prefix}.{n}", None), p) for n, p in module_tensors(part))
    for layer in module.layers:
        out.update(layer_tensors(family, layer))
    return out


def hf_shapes(family: Family, model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of ``model``'s checkpoint in ``family``'s format
    (per-expert layout). One layer per distinct layer spec is built on the meta device (no
    memory, no init); the others are renamed from it."""
    n = family.names
    out: dict[str, tuple[int, ...]] = {f"{n.root}.{n.embed}.weight": (model.vocab, model.hidden),
                                       f"{n.root}.{n.final_norm}.weight": (model.hidden,),
                                       "lm_head.weight": (model.vocab, model.hidden)}
    built: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
    prefix = f"{n.root}.layers.0."
    for layer in model.layers:
        key = (layer.mixer, layer.mlp)
        if key not in built:
            with torch.device("meta"):
                proto = DecoderLayer(model, LayerSpec(0, layer.mixer, layer.mlp), split_w=False)
            built[key] = [(name.removeprefix(prefix), tuple(p.shape)) for name, p in layer_tensors(family, proto, 0)]
        out.update((f"{n.root}.layers.{layer.index}.{name}", s) for name, s in built[key])
    return out


def plain(value):
    """A config value as JSON holds it, comparable: transformers' ``{"__float__": "Infinity"}``
    as the float, tuples as lists."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def same(a, b) -> bool:
    """``plain(a) == plain(b)``, with floats equal to 1e-9 relative (JSON round trips)."""
    a, b = plain(a), plain(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
    return a == b
