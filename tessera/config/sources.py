"""Where a recipe's model comes from: the ``model`` fields that name a source, and which are set.

Read by loading (:mod:`tessera.config.load`: one source per recipe layer, an override's source
replaces the recipe's), resolving (:mod:`tessera.config.resolve`) and validation
(:mod:`tessera.config.validate`).
"""

from __future__ import annotations

from typing import Any, Mapping

MODEL_SOURCES = ("preset", "hf_config", "inline")
"""The fields of ``model`` that name where the model comes from (one per recipe)."""


def is_set(value: Any) -> bool:
    """Whether a model-source field counts as set (not ``null``, ``""`` or ``{}``)."""
    return value is not None and value != "" and not (isinstance(value, Mapping) and not value)


def sources_set(model_section: Any) -> list[str]:
    """The model-source fields set in a ``model`` section (a mapping or a ``ModelConfig``)."""
    get = model_section.get if isinstance(model_section, Mapping) else lambda k: getattr(model_section, k, None)
    return [s for s in MODEL_SOURCES if is_set(get(s))]
