"""Load a recipe: YAML file + ``key=value`` overrides -> frozen :class:`Recipe`; resolve its model
and hardware into :class:`~tessera.spec.model.ModelSpec` and :class:`~tessera.spec.hardware.HardwareSpec`.

Parsing and type checking are omegaconf's: the YAML and the dotlist overrides are merged onto
``OmegaConf.structured(RecipeConfig)``, so unknown keys and wrong types are rejected there. Each
omegaconf error is rephrased as one :class:`~tessera.errors.TesseraConfigError` line naming the
field, the value, the rule and a fix.

The returned :class:`Recipe` is a frozen dataclass whose sections mirror
:mod:`tessera.config.schema` field for field (same names, same defaults), with dicts turned into
:class:`FrozenDict` and lists into tuples, so that a Recipe is hashable and ``to_dict()`` gives a
plain JSON/YAML-ready dict back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from tessera.config import schema
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import ModelSpec

DEFAULT_RECIPE_YAML = """\
# Embedded default recipe: a tiny Qwen3-Next on CPU workers (pp=2, ep=2), for training runs.
name: tiny-qwen3-next
model:
  preset: tiny-qwen3-next
parallel:
  pp: 2
  vpp: 2
  ep: 2
  dp: 2
  num_microbatches: 4
  micro_batch_size: 2
  seq_length: 64
hardware:
  preset: cpu
planner:
  template: interleaved-1f1b
train:
  steps: 50
  lr: 0.003
  data: pydoc
logging:
  wandb_mode: offline
"""
"""The recipe used when no path is given (``recipes/tiny-qwen3-next.yaml`` holds the same values)."""


class FrozenDict(Mapping):
    """A read-only, hashable mapping (the frozen form of a recipe's dict-valued fields)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | Sequence[tuple[str, Any]] = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        object.__setattr__(self, "_items", tuple(sorted((str(k), _freeze(v)) for k, v in pairs)))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __reduce__(self):
        return (FrozenDict, (self._items,))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is read-only")

    def __repr__(self) -> str:
        return f"FrozenDict({dict(self._items)!r})"


def _freeze(v: Any) -> Any:
    """dict -> FrozenDict, list/tuple -> tuple, recursively; scalars unchanged."""
    if isinstance(v, Mapping) and not isinstance(v, FrozenDict):
        return FrozenDict(v)
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    """Inverse of :func:`_freeze`: FrozenDict -> dict, tuple -> list."""
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def _frozen_section(cls: type, name: str) -> type:
    """A frozen dataclass with the fields, types and defaults of the schema dataclass ``cls``."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    out = dataclasses.make_dataclass(name, fields, frozen=True)
    out.__module__ = __name__
    out.__doc__ = f"Frozen form of :class:`tessera.config.schema.{cls.__name__}`.\n\n{cls.__doc__}"
    return out


ModelSection = _frozen_section(schema.ModelConfig, "ModelSection")
ParallelSection = _frozen_section(schema.ParallelConfig, "ParallelSection")
HardwareSection = _frozen_section(schema.HardwareConfig, "HardwareSection")
PlannerSection = _frozen_section(schema.PlannerConfig, "PlannerSection")
DBOSection = _frozen_section(schema.DBOConfig, "DBOSection")
TrainSection = _frozen_section(schema.TrainConfig, "TrainSection")
LoggingSection = _frozen_section(schema.LoggingConfig, "LoggingSection")

_SECTIONS: dict[str, type] = {
    "model": ModelSection, "parallel": ParallelSection, "hardware": HardwareSection,
    "planner": PlannerSection, "dbo": DBOSection, "train": TrainSection, "logging": LoggingSection,
}


@dataclass(frozen=True)
class Recipe:
    """A validated-by-type, immutable recipe (see ``docs/recipes.md`` for every field).

    Sections have the same fields as the :mod:`tessera.config.schema` dataclasses; dict values
    are :class:`FrozenDict`. Equal recipes hash equally; :meth:`to_dict` round-trips through
    :func:`recipe_from_dict`.
    """

    name: str
    model: ModelSection
    parallel: ParallelSection
    hardware: HardwareSection
    planner: PlannerSection
    dbo: DBOSection
    train: TrainSection
    logging: LoggingSection

    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-ready)."""
        out: dict[str, Any] = {"name": self.name}
        for sec in _SECTIONS:
            out[sec] = {f.name: _thaw(getattr(getattr(self, sec), f.name))
                        for f in dataclasses.fields(getattr(self, sec))}
        return out

    def to_yaml(self) -> str:
        """The recipe as YAML (loadable by :func:`load_recipe`)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: Sequence[str]) -> "Recipe":
        """A new Recipe with ``key=value`` overrides applied (same rules as :func:`load_recipe`)."""
        return _build(OmegaConf.create(self.to_dict()), overrides, base_dir=None)


# --------------------------------------------------------------------------- omegaconf -> Recipe


def _known_keys(object_type: Any) -> list[str]:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    return []


def _nested_key(object_type: Any, key: str) -> str | None:
    """``"inline.mem_gb"`` when ``key`` is a field of what a nested field of ``object_type`` holds
    (``hardware.inline``: :class:`HardwareSpec` fields, as in ``hardware.inline.mem_gb``), else
    None."""
    if object_type is schema.HardwareConfig and key in {f.name for f in dataclasses.fields(HardwareSpec)}:
        return f"inline.{key}"
    return None


def _rephrase(e: OmegaConfBaseException, origin: str, given: Mapping[str, Any]) -> TesseraConfigError:
    """One-line TesseraConfigError from an omegaconf error (keeps field, value, rule, fix).

    ``given`` maps dotted keys to the values the user wrote (used when omegaconf omits the value).
    """
    full_key = getattr(e, "full_key", None) or "recipe"
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0].strip()
    if isinstance(e, ConfigKeyError):
        known = _known_keys(getattr(e, "object_type", None))
        key = str(getattr(e, "key", full_key))
        close = difflib.get_close_matches(key, known, n=1)
        section = full_key.rpartition(".")[0] or "the recipe top level"
        nested = _nested_key(getattr(e, "object_type", None), key)
        hint = (f"did you mean {close[0]!r}? " if close else
                f"did you mean {'.'.join(filter(None, (full_key.rpartition('.')[0], nested)))!r}? " if nested else "")
        return TesseraConfigError(full_key, given.get(full_key, key),
                                  f"unknown key in {section} ({origin})",
                                  f"{hint}known keys: {', '.join(known)}")
    value = getattr(e, "value", None)
    value = given.get(full_key, value) if value is None else value
    ftype = ""
    parent = getattr(e, "object_type", None)
    if isinstance(parent, type) and dataclasses.is_dataclass(parent):
        types = {f.name: f.type for f in dataclasses.fields(parent)}
        ftype = str(types.get(str(getattr(e, "key", "")), ""))
    rule = f"{msg} ({origin})"
    fix = f"give {full_key} a value of type {ftype}" if ftype else "see docs/recipes.md for the field's type"
    return TesseraConfigError(full_key, value, rule, fix)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf of a nested dict."""
    if not isinstance(d, Mapping):
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, Mapping) and v else {key: v})
    return out


def _check_shape(user: Mapping, origin: str) -> None:
    """Every section present in ``user`` must be a mapping (omegaconf's message lacks the key)."""
    for sec in _SECTIONS:
        if sec in user and user[sec] is not None and not isinstance(user[sec], Mapping):
            raise TesseraConfigError(sec, user[sec], f"is a section and needs a mapping of fields ({origin})",
                                     f"set its fields instead, e.g. {sec}.<field>=value "
                                     f"(fields: {', '.join(_known_keys(_SECTIONS[sec]))})")


def _check_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Syntax-check the dotlist; return it as a nested dict parsed by omegaconf."""
    for o in overrides:
        key, eq, _ = o.partition("=")
        if not eq or not key.strip():
            raise TesseraConfigError("override", o, "must have the form section.field=value",
                                     "write e.g. parallel.pp=8")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise TesseraConfigError("override", list(overrides), f"cannot be parsed ({str(e).splitlines()[0]})",
                                 "write each as section.field=value, quoting strings with spaces") from None


def _build(base: Any, overrides: Sequence[str], base_dir: str | None) -> Recipe:
    """Merge ``base`` (an omegaconf node of user values) and the overrides onto the schema."""
    over = _check_overrides(overrides)
    user = OmegaConf.to_container(base) if OmegaConf.is_config(base) else dict(base)
    _check_shape(user, "recipe")
    _check_shape(over, "override")
    origin, given = "recipe", _flatten(user)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema.RecipeConfig), base)
        origin, given = "override", _flatten(over)
        cfg = OmegaConf.merge(cfg, over)
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _rephrase(e, origin, given) from None
    except (TypeError, yaml.YAMLError) as e:
        raise TesseraConfigError(origin, list(overrides) if origin == "override" else "<file>",
                                 f"cannot be merged onto the recipe schema ({str(e).splitlines()[0]})",
                                 "give each section as a mapping of field: value (see docs/recipes.md)") from None
    mc = obj.model
    if mc.hf_config and base_dir and not os.path.isabs(mc.hf_config):
        cand = os.path.join(base_dir, mc.hf_config)
        if os.path.exists(cand) and not os.path.exists(mc.hf_config):
            mc.hf_config = os.path.normpath(cand)
    sections = {sec: cls(**{f.name: _freeze(getattr(getattr(obj, sec), f.name)) for f in dataclasses.fields(cls)})
                for sec, cls in _SECTIONS.items()}
    return Recipe(name=obj.name, **sections)


def load_recipe(path: str | None, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML (``None``: the embedded :data:`DEFAULT_RECIPE_YAML`) plus overrides.

    Args:
        path: recipe file, or ``None`` for the default recipe.
        overrides: omegaconf dotlist items such as ``"parallel.pp=8"``.

    Returns:
        The frozen :class:`Recipe` (types checked; value rules are checked by
        :func:`tessera.config.validate.validate_recipe`).

    Raises:
        TesseraConfigError: missing file, invalid YAML, unknown key, wrong type, bad override.
    """
    if path is None:
        return _build(OmegaConf.create(DEFAULT_RECIPE_YAML), overrides, base_dir=None)
    if not os.path.isfile(path):
        raise TesseraConfigError("recipe", path, "file does not exist",
                                 "give the path of a recipe YAML, e.g. recipes/qwen3-next-80b.yaml")
    try:
        base = OmegaConf.load(path)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise TesseraConfigError("recipe", path, f"is not valid YAML{line} ({getattr(e, 'problem', e)})",
                                 "fix the YAML syntax") from None
    if not isinstance(base, Mapping) and not OmegaConf.is_dict(base):
        raise TesseraConfigError("recipe", path, "top level must be a mapping of sections",
                                 "start the file with e.g. 'name: ...' and 'model:'")
    return _build(base, overrides, base_dir=os.path.dirname(os.path.abspath(path)))


def recipe_from_dict(d: Mapping) -> Recipe:
    """Recipe from a (partial) nested dict, e.g. the output of :meth:`Recipe.to_dict`."""
    return _build(OmegaConf.create(_thaw(d)), (), base_dir=None)


# --------------------------------------------------------------------------- model & hardware


def _truncate(model: ModelSpec, n: int) -> ModelSpec:
    if n <= 0 or n == model.num_layers:
        return model
    if n > model.num_layers:
        raise TesseraConfigError("model.num_layers", n, f"exceeds the {model.num_layers} layers of {model.name}",
                                 f"use 0 (all layers) or a value in 1..{model.num_layers}")
    return dataclasses.replace(model, name=f"{model.name}[:{n}]", layers=model.layers[:n])


def _inline_model(inline: Mapping) -> ModelSpec:
    d = _thaw(inline)
    if "pattern" in d:
        from tessera.spec.model import AttentionSpec, DenseMLPSpec, Mamba2Spec, MoESpec
        from tessera.spec.presets import from_pattern
        specs = {"attention": AttentionSpec, "mamba": Mamba2Spec, "moe": MoESpec, "dense": DenseMLPSpec}
        try:
            args = {k: (specs[k](**v) if k in specs and isinstance(v, dict) else v) for k, v in d.items()}
            args.setdefault("name", "inline")
            for k in ("attention", "mamba", "moe"):
                args.setdefault(k, None)
            return from_pattern(**args)
        except TypeError as e:
            raise TesseraConfigError("model.inline", json.dumps(d)[:80], f"is not a valid pattern model ({e})",
                                     "give name, pattern, hidden, vocab and the mixer/moe dims (docs/recipes.md)") from None
    try:
        return ModelSpec.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise TesseraConfigError("model.inline", json.dumps(d)[:80],
                                 f"is not a ModelSpec dict ({type(e).__name__}: {e})",
                                 "give ModelSpec.to_dict() output or a pattern dict (docs/recipes.md)") from None


def resolve_model(recipe: Recipe) -> ModelSpec:
    """The recipe's ModelSpec: ``preset``, else ``hf_config``, else ``inline``; then truncated to
    ``model.num_layers`` layers if that is > 0.

    Raises:
        TesseraConfigError: no source given, unknown preset, unreadable config, bad num_layers.
    """
    m = recipe.model
    if m.num_layers < 0:
        raise TesseraConfigError("model.num_layers", m.num_layers, "must be >= 0",
                                 "use 0 for all layers or a positive count")
    if m.preset:
        from tessera.spec.presets import get_model
        model = get_model(m.preset)
    elif m.hf_config:
        from tessera.spec.hf import model_from_hf_config
        if not os.path.exists(m.hf_config):
            raise TesseraConfigError("model.hf_config", m.hf_config, "file does not exist",
                                     "give the path of a HuggingFace config.json (absolute, or relative to the recipe)")
        model = model_from_hf_config(m.hf_config)
    elif m.inline:
        model = _inline_model(m.inline)
    else:
        raise TesseraConfigError("model", None, "needs one of preset, hf_config or inline",
                                 "set e.g. model.preset=qwen3-next-80b-a3b")
    return _truncate(model, m.num_layers)


def resolve_hardware(recipe: Recipe) -> HardwareSpec:
    """The recipe's HardwareSpec: the preset with ``hardware.inline`` fields overriding it.

    Raises:
        TesseraConfigError: unknown preset, unknown inline field, a value of the wrong type, or out
            of range (:func:`_check_hardware`).
    """
    from tessera.spec.hardware_presets import get_hardware

    hw = get_hardware(recipe.hardware.preset)
    inline = _thaw(recipe.hardware.inline) if recipe.hardware.inline else {}
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
    _check_hardware(out, set(inline))
    return out


# HardwareSpec fields that must be > 0, and those that must be >= 0
_POSITIVE = ("peak_tflops", "mem_gb", "mem_bw_tbs", "intra_node_gbs", "inter_node_gbs", "gpus_per_node")
_NON_NEGATIVE = ("num_sms", "comm_sms", "link_latency_us")


def _check_hardware(hw: HardwareSpec, given: set[str]) -> None:
    """Range rules of a HardwareSpec built from ``hardware.inline`` (``given``: the fields the
    recipe set; a rule broken by a preset's own value names the first given field it involves).

    Raises:
        TesseraConfigError: a non-positive capacity/bandwidth/peak, a negative count or latency,
            ``mfu_efficiency`` outside (0, 1], or ``comm_sms >= num_sms`` on a device with SMs.
    """
    def err(field: str, rule: str, fix: str) -> TesseraConfigError:
        return TesseraConfigError(f"hardware.inline.{field}", getattr(hw, field), rule, fix)

    for f in _POSITIVE:
        if getattr(hw, f) <= 0:
            raise err(f, "must be > 0", f"give the device's {f.replace('_', ' ')} (preset {hw.name!r})")
    for f in _NON_NEGATIVE:
        if getattr(hw, f) < 0:
            raise err(f, "must be >= 0", "use 0 or a positive value")
    if not 0.0 < hw.mfu_efficiency <= 1.0:
        raise err("mfu_efficiency", "must be in (0, 1] (fraction of peak that large GEMMs reach)",
                  "use e.g. 0.6")
    if hw.num_sms > 0 and hw.comm_sms >= hw.num_sms:
        field = "comm_sms" if "comm_sms" in given or "num_sms" not in given else "num_sms"
        raise err(field, f"comm_sms={hw.comm_sms} must be below num_sms={hw.num_sms} (compute needs SMs left)",
                  f"use comm_sms < {hw.num_sms}, e.g. 20 of 132 as DeepSeek-V3 reports")
