"""Resolve a :class:`~tessera.config.load.Recipe`'s model and hardware into a
:class:`~tessera.spec.model.ModelSpec` and a :class:`~tessera.spec.hardware.HardwareSpec`.

The model comes from exactly one source, ``model.preset``, ``model.hf_config`` or
``model.inline`` (:func:`tessera.config.load.load_recipe` enforces one per recipe layer and lets an
override's source replace the recipe's; see ``docs/recipes.md``). :func:`model_source` names it.
Sizes that would make building the model slow (layer counts) are checked here, before building;
every other model rule is :func:`tessera.config.model_checks.check_model`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import TYPE_CHECKING, Mapping

from tessera.config.frozen import thaw
from tessera.config.limits import MODEL_LAYERS
from tessera.config.sources import sources_set
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import ModelSpec

if TYPE_CHECKING:
    from tessera.config.load import Recipe

def model_source(recipe: "Recipe") -> str:
    """Where the recipe's model comes from, for display: ``"preset qwen3-next-80b-a3b"``,
    ``"hf_config /abs/path/config.json"`` (absolute path) or ``"inline"``.

    Raises:
        TesseraConfigError: no model source is set.
    """
    m = recipe.model
    src = sources_set(m)
    if not src:
        raise _no_source()
    if src[0] == "preset":
        return f"preset {m.preset}"
    if src[0] == "hf_config":
        return f"hf_config {os.path.abspath(m.hf_config)}"
    return "inline"


def _no_source() -> TesseraConfigError:
    return TesseraConfigError("model", None, "needs one of preset, hf_config or inline",
                              "set e.g. model.preset=qwen3-next-80b-a3b")


def _layer_count(field: str, n: int) -> None:
    if n > MODEL_LAYERS.value:
        raise TesseraConfigError(field, n, f"more than {MODEL_LAYERS.value} layers ({MODEL_LAYERS.reason})",
                                 f"use a model with at most {MODEL_LAYERS.value} layers")


def _truncate(model: ModelSpec, n: int) -> ModelSpec:
    if n <= 0 or n == model.num_layers:
        return model
    if n > model.num_layers:
        raise TesseraConfigError("model.num_layers", n, f"exceeds the {model.num_layers} layers of {model.name}",
                                 f"use 0 (all layers) or a value in 1..{model.num_layers}")
    return dataclasses.replace(model, name=f"{model.name}[:{n}]", layers=model.layers[:n])


def _inline_model(inline: Mapping) -> ModelSpec:
    d = thaw(inline)
    if "pattern" in d:
        from tessera.spec.model import AttentionSpec, DenseMLPSpec, Mamba2Spec, MoESpec
        from tessera.spec.presets import from_pattern

        if isinstance(d["pattern"], str):
            _layer_count("model.inline.pattern", len(d["pattern"]))
        specs = {"attention": AttentionSpec, "mamba": Mamba2Spec, "moe": MoESpec, "dense": DenseMLPSpec}
        try:
            args = {k: (specs[k](**v) if k in specs and isinstance(v, dict) else v) for k, v in d.items()}
            args.setdefault("name", "inline")
            for k in ("attention", "mamba", "moe"):
                args.setdefault(k, None)
            return from_pattern(**args)
        except (TypeError, ValueError, AttributeError) as e:
            raise TesseraConfigError("model.inline", json.dumps(d, default=str)[:80],
                                     f"is not a valid pattern model ({e})",
                                     "give name, pattern, hidden, vocab and the mixer/moe dims (docs/recipes.md)") from None
    if isinstance(d.get("layers"), list):
        _layer_count("model.inline.layers", len(d["layers"]))
    try:
        return ModelSpec.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TesseraConfigError("model.inline", json.dumps(d, default=str)[:80],
                                 f"is not a ModelSpec dict ({type(e).__name__}: {e})",
                                 "give ModelSpec.to_dict() output or a pattern dict (docs/recipes.md)") from None


# config.json keys whose length is the layer count (transformers config classes)
_HF_LAYER_LISTS = ("layer_types", "hybrid_override_pattern", "layers_block_type")


def _hf_model(path: str) -> ModelSpec:
    """Read ``path`` (a config.json or its folder), bound its layer count, build the ModelSpec."""
    from tessera.spec.hf import model_from_hf_config

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        what = "folder has no config.json" if os.path.isdir(path) else "file does not exist"
        raise TesseraConfigError("model.hf_config", path, what,
                                 "give the path of a Hugging Face config.json or its folder")
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TesseraConfigError("model.hf_config", path, f"cannot be read as JSON ({type(e).__name__}: {e})",
                                 "give a readable UTF-8 config.json of a Hugging Face model") from None
    if not isinstance(d, dict):
        raise TesseraConfigError("model.hf_config", path, f"holds a JSON {type(d).__name__}, not an object",
                                 "give the config.json of a Hugging Face model (a JSON object)")
    n = d.get("num_hidden_layers")
    if isinstance(n, int) and not isinstance(n, bool):
        _layer_count("hf_config.num_hidden_layers", n)
    for key in _HF_LAYER_LISTS:
        if isinstance(d.get(key), (list, str)):
            _layer_count(f"hf_config.{key}", len(d[key]))
    try:
        return model_from_hf_config(d)
    except TesseraConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TesseraConfigError("model.hf_config", path, f"is not a config this reader understands "
                                 f"({type(e).__name__}: {e})", "fix config.json (see docs/recipes.md)") from None


def resolve_model(recipe: "Recipe") -> ModelSpec:
    """The recipe's ModelSpec from its one source (``preset``, ``hf_config`` or ``inline``),
    truncated to ``model.num_layers`` layers if that is > 0.

    Raises:
        TesseraConfigError: no source or more than one, unknown preset (with a did-you-mean),
            missing/unreadable/invalid config, more than 1024 layers, bad ``num_layers``.
    """
    m = recipe.model
    if m.num_layers < 0:
        raise TesseraConfigError("model.num_layers", m.num_layers, "must be >= 0",
                                 "use 0 for all layers or a positive count")
    src = sources_set(m)
    if len(src) > 1:
        raise TesseraConfigError(f"model.{src[1]}", getattr(m, src[1]), f"model.{src[0]} is set too; a recipe "
                                 "uses one model source (preset, hf_config or inline)",
                                 f"set only one of model.{src[0]} and model.{src[1]}")
    if not src:
        raise _no_source()
    if src[0] == "preset":
        from tessera.spec.presets import get_model
        model = get_model(m.preset)
    elif src[0] == "hf_config":
        model = _hf_model(m.hf_config)
    else:
        model = _inline_model(m.inline)
    model = _truncate(model, m.num_layers)
    if m.mtp_layers is not None:
        if m.mtp_layers < 0 or m.mtp_layers > 8:
            raise TesseraConfigError("model.mtp_layers", m.mtp_layers, "must be 0..8 (multi-token-prediction modules)",
                                     "use 0 for none, or leave it unset to keep the model's own count")
        model = dataclasses.replace(model, mtp_layers=m.mtp_layers)
    return model


def resolve_hardware(recipe: "Recipe") -> HardwareSpec:
    """The recipe's HardwareSpec: the preset with ``hardware.inline`` fields overriding it.

    Raises:
        TesseraConfigError: unknown preset, unknown inline field, a value of the wrong type, or out
            of range (:func:`check_hardware`).
    """
    from tessera.spec.hardware_presets import get_hardware

    hw = get_hardware(recipe.hardware.preset)
    inline = thaw(recipe.hardware.inline) if recipe.hardware.inline else {}
    if not inline:
        return hw
    fields = {f.name: f.type for f in dataclasses.fields(HardwareSpec)}
    for k, v in inline.items():
        if k not in fields:
            close = difflib.get_close_matches(k, list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TesseraConfigError(f"hardware.inline.{k}", v, "is not a HardwareSpec field",
                                     f"{hint}known fields: {', '.join(fields)}")
        want = type(getattr(hw, k))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            inline[k] = float(v)
        elif not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise TesseraConfigError(f"hardware.inline.{k}", v, f"must be of type {want.__name__}",
                                     f"give a {want.__name__} like the preset's {getattr(hw, k)!r}")
    out = dataclasses.replace(hw, **inline)
    check_hardware(out, set(inline))
    return out


# HardwareSpec fields that must be > 0, and those that must be >= 0
_POSITIVE = ("peak_tflops", "mem_gb", "mem_bw_tbs", "intra_node_gbs", "inter_node_gbs", "gpus_per_node")
_NON_NEGATIVE = ("num_sms", "comm_sms", "link_latency_us", "peak_tflops_fp8", "peak_tflops_fp32", "gemm_mn_half",
                 "gemm_k_half", "kernel_launch_us", "deferred_w_us", "pair_task_us", "host_kernel_us",
                 "host_gemm_us")
# HardwareSpec fractions that must lie in (0, 1]
_FRACTIONS = ("mfu_efficiency", "fp8_efficiency_ratio", "mem_bw_efficiency")
# measured kernel-class fractions: in [0, 1], 0 = not measured (HardwareSpec.kernel_efficiency)
_KERNEL_FRACTIONS = ("attention_fwd_efficiency", "attention_bwd_efficiency", "attention_fwd_efficiency_hd256",
                     "attention_bwd_efficiency_hd256", "delta_rule_fwd_efficiency", "delta_rule_bwd_efficiency")


def check_hardware(hw: HardwareSpec, given: set[str]) -> None:
    """Range rules of a HardwareSpec built from ``hardware.inline`` (``given``: the fields the
    recipe set; a rule broken by a preset's own value names the first given field it involves).

    Raises:
        TesseraConfigError: a value that is not finite, a non-positive capacity/bandwidth/peak, a negative count or latency,
            an efficiency fraction (``mfu_efficiency``, ``fp8_efficiency_ratio``,
            ``mem_bw_efficiency``) outside (0, 1], a measured kernel fraction (``attention_*`` /
            ``delta_rule_*_efficiency``) outside [0, 1], or ``comm_sms >= num_sms`` on a device with SMs.
    """
    def err(field: str, rule: str, fix: str) -> TesseraConfigError:
        return TesseraConfigError(f"hardware.inline.{field}", getattr(hw, field), rule, fix)

    for f in _POSITIVE + _NON_NEGATIVE + _FRACTIONS + _KERNEL_FRACTIONS:
        if not math.isfinite(getattr(hw, f)):
            raise err(f, "must be a finite number", f"give the device's {f.replace('_', ' ')} (preset {hw.name!r})")
    for f in _POSITIVE:
        if getattr(hw, f) <= 0:
            raise err(f, "must be > 0", f"give the device's {f.replace('_', ' ')} (preset {hw.name!r})")
    for f in _NON_NEGATIVE:
        if getattr(hw, f) < 0:
            raise err(f, "must be >= 0", "use 0 or a positive value")
    if not 0.0 < hw.mfu_efficiency <= 1.0:
        raise err("mfu_efficiency", "must be in (0, 1] (fraction of peak that large GEMMs reach)",
                  "use e.g. 0.6")
    for f, what, e in (("fp8_efficiency_ratio", "FP8 over BF16 achieved fraction of peak", 0.91),
                       ("mem_bw_efficiency", "fraction of memory bandwidth memory-bound kernels reach", 0.8)):
        if not 0.0 < getattr(hw, f) <= 1.0:
            raise err(f, f"must be in (0, 1] ({what})", f"use e.g. {e} (Hopper presets)")
    for f in _KERNEL_FRACTIONS:
        if not 0.0 <= getattr(hw, f) <= 1.0:
            raise err(f, "must be in [0, 1] (measured fraction of peak; 0: not measured, mfu_efficiency)",
                      "use e.g. the Hopper preset's value or 0")
    if hw.num_sms > 0 and hw.comm_sms >= hw.num_sms:
        field = "comm_sms" if "comm_sms" in given or "num_sms" not in given else "num_sms"
        raise err(field, f"comm_sms={hw.comm_sms} must be below num_sms={hw.num_sms} (compute needs SMs left)",
                  f"use comm_sms < {hw.num_sms}, e.g. 20 of 132 as DeepSeek-V3 reports")
