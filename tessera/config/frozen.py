"""Frozen containers of a :class:`~tessera.config.load.Recipe`: dicts become :class:`FrozenDict`,
lists become tuples, so that a recipe is hashable; :func:`thaw` gives plain dicts and lists back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Sequence


class FrozenDict(Mapping):
    """A read-only, hashable mapping (the frozen form of a recipe's dict-valued fields)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | Sequence[tuple[str, Any]] = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        object.__setattr__(self, "_items", tuple(sorted((str(k), freeze(v)) for k, v in pairs)))

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


def freeze(v: Any) -> Any:
    """dict -> FrozenDict, list/tuple -> tuple, recursively; scalars unchanged."""
    if isinstance(v, Mapping) and not isinstance(v, FrozenDict):
        return FrozenDict(v)
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def thaw(v: Any) -> Any:
    """Inverse of :func:`freeze`: FrozenDict (any mapping) -> dict, tuple -> list."""
    if isinstance(v, Mapping):
        return {k: thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [thaw(x) for x in v]
    return v
