"""Load a recipe: YAML file + ``key=value`` overrides -> frozen :class:`Recipe`.

Parsing and type checking are omegaconf's: the YAML and the dotlist overrides are merged onto
``OmegaConf.structured(RecipeConfig)``, so unknown keys and wrong types are rejected there. Each
omegaconf error is rephrased as one :class:`~tessera.errors.TesseraConfigError` line naming the
field, the value, the rule and a fix. File errors (missing, a directory, unreadable, invalid
YAML) name the path and suggest close names.

Model source: the recipe file and the override list are two *layers*. Within one layer at most
one of ``model.preset`` / ``model.hf_config`` / ``model.inline`` may be set; a source set by the
override layer replaces the recipe's (``model.hf_config=x.json`` on a preset recipe uses x.json).
A ``model.hf_config`` path must exist (checked here, at load).

The schema's dataclasses are frozen, so the merged config is read-only and ``OmegaConf.to_object``
returns the schema's own section types; the returned :class:`Recipe` (the schema's
``RecipeConfig`` plus methods) holds them with dicts turned into :class:`FrozenDict` and lists
into tuples, so that a Recipe is hashable and ``to_dict()`` gives a plain JSON/YAML-ready dict
back. Model and hardware resolution live in
:mod:`tessera.config.resolve`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from tessera.config import schema
from tessera.config.frozen import freeze as _freeze, thaw as _thaw
from tessera.config.sources import MODEL_SOURCES, sources_set
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec

SHIPPED_RECIPES = Path(__file__).resolve().parents[1] / "recipes"
"""The recipes shipped as package data (``tessera/recipes/``; ``recipes/`` in a checkout links to it)."""
DEFAULT_RECIPE = SHIPPED_RECIPES / "tiny-qwen3-next.yaml"
"""The recipe used when no path is given: the shipped ``tiny-qwen3-next.yaml`` itself."""


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(schema.RecipeConfig) if f.name != "name")
"""The recipe's sections in schema order (``model``, ``parallel``, ...)."""
_SECTION_TYPES: dict[str, type] = {sec: type(getattr(schema.RecipeConfig(), sec)) for sec in SECTIONS}


@dataclass(frozen=True)
class Recipe(schema.RecipeConfig):
    """A validated-by-type, immutable recipe (see ``docs/recipes.md`` for every field).

    The fields are :class:`tessera.config.schema.RecipeConfig`'s and each section is an instance
    of its frozen schema dataclass (``recipe.parallel`` is a ``ParallelConfig``), as
    ``OmegaConf.to_object`` returns it, with dict values as :class:`FrozenDict` and lists as
    tuples. Equal recipes hash equally; :meth:`to_dict` round-trips through :func:`recipe_from_dict`.
    """

    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-ready)."""
        out: dict[str, Any] = {"name": self.name}
        for sec in SECTIONS:
            out[sec] = {f.name: _thaw(getattr(getattr(self, sec), f.name))
                        for f in dataclasses.fields(getattr(self, sec))}
        return out

    def to_yaml(self) -> str:
        """The recipe as YAML (loadable by :func:`load_recipe`)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: Sequence[str]) -> "Recipe":
        """A new Recipe with ``key=value`` overrides applied (same rules as :func:`load_recipe`)."""
        return _build(OmegaConf.create(self.to_dict()), overrides, base_dir=None)


def _frozen(section: Any) -> Any:
    """``section`` with its dict and list values frozen (hashable)."""
    return dataclasses.replace(section, **{f.name: _freeze(getattr(section, f.name))
                                           for f in dataclasses.fields(section)})


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
    for sec in SECTIONS:
        if sec in user and user[sec] is not None and not isinstance(user[sec], Mapping):
            raise TesseraConfigError(sec, user[sec], f"is a section and needs a mapping of fields ({origin})",
                                     f"set its fields instead, e.g. {sec}.<field>=value "
                                     f"(fields: {', '.join(_known_keys(_SECTION_TYPES[sec]))})")


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


def _short(v: Any) -> Any:
    """A value for an error message: dicts as (truncated) JSON."""
    if isinstance(v, Mapping):
        return json.dumps(_thaw(v), default=str)[:60]
    return v


def _model_sources(user: Mapping, over: dict[str, Any]) -> None:
    """One model source per layer; an override's source replaces the recipe's (module docstring).

    Mutates ``over``: when it sets a source, the other sources are set to ``null`` in it.
    """
    for layer, origin in ((user, "recipe"), (over, "overrides")):
        m = layer.get("model")
        src = sources_set(m) if isinstance(m, Mapping) else []
        if len(src) > 1:
            a, b = src[0], src[1]
            fix = (f"keep one: delete model.{a} or model.{b} from the recipe (an override such as model.{b}=... "
                   f"replaces the recipe's source)" if origin == "recipe" else
                   f"give one: drop model.{a}=... or model.{b}=... (the one you give replaces the recipe's source)")
            raise TesseraConfigError(f"model.{b}", _short(m[b]), f"model.{a}={_short(m[a])!r} is set in the same "
                                     f"{origin}; one layer may set only one model source (preset, hf_config, inline)",
                                     fix)
    om = over.get("model")
    if isinstance(om, dict) and sources_set(om):
        for s in MODEL_SOURCES:
            om.setdefault(s, None)


def _close_files(path: str, suffixes: tuple[str, ...], extra_dirs: Sequence[Path] = ()) -> list[str]:
    """Names close to ``path``'s file name among the files with ``suffixes`` in its folder and in
    ``extra_dirs``, as paths the user can type (relative to the working directory when inside it)."""
    want = os.path.basename(os.path.normpath(path))
    found: dict[str, str] = {}
    for d in [Path(os.path.dirname(path) or ".")] + list(extra_dirs):
        if not d.is_dir():
            continue
        names = sorted(p.name for p in d.iterdir() if p.is_file() and p.name.endswith(suffixes))
        for n in difflib.get_close_matches(want, names, n=3, cutoff=0.6):
            full = d / n
            shown = os.path.join(os.path.dirname(path), n) if d == Path(os.path.dirname(path) or ".") else _display(full)
            found.setdefault(str(full.resolve()), shown)
    return list(found.values())[:3]


def _display(p: Path) -> str:
    """``p`` relative to the working directory when below it; a shipped recipe as ``recipes/<name>``
    when the working directory has the checkout's ``recipes/`` link to the shipped folder."""
    here = Path("recipes")
    if p.parent == SHIPPED_RECIPES and here.is_dir() and here.resolve() == SHIPPED_RECIPES:
        return str(here / p.name)
    rel = os.path.relpath(p)
    return str(p) if rel.startswith("..") else rel


def _hf_config_path(path: str, base_dir: str | None) -> str:
    """``model.hf_config`` as used: the path itself if it exists (absolute or relative to the working
    directory), else relative to the recipe's folder; a path found nowhere is an error."""
    if os.path.exists(path):
        return path
    if base_dir and not os.path.isabs(path):
        cand = os.path.join(base_dir, path)
        if os.path.exists(cand):
            return os.path.normpath(cand)
    where = "there" if os.path.isabs(path) else "in " + os.getcwd() + (f" and {base_dir}" if base_dir else "")
    close = _close_files(path, (".json",))
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise TesseraConfigError("model.hf_config", path, f"file does not exist (looked {where})",
                             f"{hint}give the path of a Hugging Face config.json or its folder (absolute, or "
                             f"relative to the working directory or the recipe file)")


def _build(base: Any, overrides: Sequence[str], base_dir: str | None) -> Recipe:
    """Merge ``base`` (an omegaconf node of user values) and the overrides onto the schema."""
    over = _check_overrides(overrides)
    user = OmegaConf.to_container(base) if OmegaConf.is_config(base) else dict(base)
    _check_shape(user, "recipe")
    _check_shape(over, "override")
    _model_sources(user, over)
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
    sections = {sec: _frozen(getattr(obj, sec)) for sec in SECTIONS}
    if obj.model.hf_config:
        sections["model"] = dataclasses.replace(sections["model"],
                                                hf_config=_hf_config_path(obj.model.hf_config, base_dir))
    return Recipe(name=obj.name, **sections)


def _recipe_path_error(path: str) -> TesseraConfigError:
    """'is a directory' (listing its YAML files), 'is not a regular file', or 'file does not exist'
    (with close names from the path's folder and the shipped ``recipes/``)."""
    if os.path.isdir(path):
        ymls = sorted(p for p in os.listdir(path) if p.endswith((".yaml", ".yml")))
        inside = ", ".join(os.path.join(path, y) for y in ymls[:6]) + (", ..." if len(ymls) > 6 else "")
        return TesseraConfigError("recipe", path, "is a directory, not a recipe file",
                                  f"give one of its YAML files: {inside}" if ymls else
                                  "it holds no .yaml files; give the path of a recipe YAML, e.g. "
                                  f"{_display(SHIPPED_RECIPES / 'qwen3-next-80b.yaml')}")
    if os.path.exists(path):
        return TesseraConfigError("recipe", path, "is not a regular file", "give the path of a recipe YAML file")
    close = _close_files(path, (".yaml", ".yml"), [SHIPPED_RECIPES])
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return TesseraConfigError("recipe", path, "file does not exist",
                              f"{hint}give the path of a recipe YAML, e.g. "
                              f"{_display(SHIPPED_RECIPES / 'qwen3-next-80b.yaml')}")


def shipped_recipe(path: str) -> str | None:
    """The shipped recipe ``path`` names when no such file exists here: a bare name
    (``qwen3-next-80b``), a file name (``qwen3-next-80b.yaml``) or ``recipes/<file name>`` (as the
    docs write it, so the examples work from an installed package too); else None."""
    folder, name = os.path.split(path)
    if folder not in ("", "recipes") or not name:
        return None
    if not name.endswith((".yaml", ".yml")):
        name += ".yaml"
    found = SHIPPED_RECIPES / name
    return str(found) if found.is_file() else None


def load_recipe(path: str | None, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML (``None``: the shipped :data:`DEFAULT_RECIPE`) plus overrides.

    Args:
        path: recipe file, or ``None`` for :data:`DEFAULT_RECIPE`.
        overrides: omegaconf dotlist items such as ``"parallel.pp=8"``.

    Returns:
        The frozen :class:`Recipe` (types checked; value rules are checked by
        :func:`tessera.config.validate.validate_recipe`).

    Raises:
        TesseraConfigError: missing file (that is not a shipped recipe's name:
            :func:`shipped_recipe`) or a directory (with did-you-mean names), unreadable
            file, invalid YAML, unknown key, wrong type, bad override, two model sources in one
            layer, missing ``model.hf_config``.
    """
    if path is None:
        path = str(DEFAULT_RECIPE)
    if not os.path.isfile(path):
        shipped = shipped_recipe(path)
        if shipped is None:
            raise _recipe_path_error(path)
        path = shipped
    try:
        base = OmegaConf.load(path)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        why = " ".join(str(getattr(e, "problem", None) or e).split())
        raise TesseraConfigError("recipe", path, f"is not valid YAML{line} ({why})", "fix the YAML syntax") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TesseraConfigError("recipe", path, f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())})",
                                 "make it a readable UTF-8 text file (check its permissions)") from None
    except OmegaConfBaseException as e:
        raise TesseraConfigError("recipe", path, f"is not a valid recipe ({' '.join(str(e).split())[:120]})",
                                 "write sections as mappings of string keys, e.g. 'parallel:' then '  pp: 8'") from None
    if not isinstance(base, Mapping) and not OmegaConf.is_dict(base):
        raise TesseraConfigError("recipe", path, "top level must be a mapping of sections",
                                 "start the file with e.g. 'name: ...' and 'model:'")
    return _build(base, overrides, base_dir=os.path.dirname(os.path.abspath(path)))


def recipe_from_dict(d: Mapping) -> Recipe:
    """Recipe from a (partial) nested dict, e.g. the output of :meth:`Recipe.to_dict`.

    Raises:
        TesseraConfigError: as :func:`load_recipe` for the dict's values.
    """
    return _build(OmegaConf.create(_thaw(d)), (), base_dir=None)
