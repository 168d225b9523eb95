"""Fixes for a broken layout rule that are themselves valid.

:func:`fix_for` proposes values for the blamed field (and, per rule, for a related field or a
pair such as ``ep`` with ``dp``) and keeps only those for which
:func:`tessera.config.layout_rules.first_broken` finds *no* broken rule, so a suggestion never
leads into another error of the same checks. Candidates are bounded (powers of two, divisors,
small multiples; at most a few hundred per field) and every check is constant time.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import replace
from typing import Iterable, Sequence

from tessera.config.layout_rules import Broken, Layout, ModelFacts, first_broken
from tessera.config.limits import PARALLEL
from tessera.errors import TesseraConfigError

# (rule kind, blamed field) -> other fields whose single changes are also offered
_SECONDARY: dict[tuple[str, str], tuple[str, ...]] = {
    ("stages", "pp"): ("vpp",),
    ("stages", "vpp"): ("pp",),
    ("tokens", "micro_batch_size"): ("seq_length",),
    ("ep_dp", "ep"): ("dp",),
    ("tp", "tp"): ("seq_length",),
    ("shape", "vpp"): ("template",),
    ("shape", "num_microbatches"): ("vpp", "template"),
}
_WITH_DP = ("ep", "tp")  # rule kinds that also offer (field, dp) pairs


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1`` in increasing order (O(sqrt n))."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _pow2(hi: int) -> set[int]:
    return {1 << k for k in range(max(hi, 1).bit_length()) if 1 << k <= hi}


def _dp_for(dp: int, tp: int, ep: int) -> int:
    """The smallest dp' >= dp with ``ep | dp'*tp``."""
    step = ep // math.gcd(ep, tp)
    return max(1, -(-max(dp, 1) // step)) * step


def candidates(name: str, lay: Layout, m: ModelFacts) -> list:
    """Values worth trying for ``name`` (a ``Layout`` field), within its limit."""
    from tessera.program.templates import TEMPLATES

    if name == "template":
        return list(TEMPLATES)
    hi = PARALLEL[name].value
    cur = max(getattr(lay, name), 1)
    if name == "pp":
        vals = _pow2(min(hi, m.num_layers)) | set(divisors(m.num_layers)) | {cur - 1, cur + 1}
    elif name == "vpp":
        vals = set(range(1, min(hi, m.num_layers // max(lay.pp, 1)) + 1))
    elif name == "ep":
        vals = set(divisors(m.num_experts)) if m.num_experts else {1}
    elif name == "tp":
        vals = set(divisors(math.gcd(m.tp_gcd, max(lay.seq_length, 1))))
    elif name == "num_microbatches":
        vals = _pow2(hi) | {k * max(lay.pp, 1) for k in range(1, 9)}
    elif name == "dp":
        vals = _pow2(hi) | {cur * k for k in range(1, 9)} | {_dp_for(cur, max(lay.tp, 1), max(lay.ep, 1))}
    else:  # micro_batch_size, seq_length
        vals = _pow2(hi) | {cur // 2, cur * 2}
    return sorted(v for v in vals if 1 <= v <= hi)


def _full(name: str) -> str:
    return "planner.template" if name == "template" else f"parallel.{name}"


def _nearest(values: list, cur, k: int) -> list:
    """The ``k`` values closest to ``cur`` (ints: shown ascending; names: first ``k``)."""
    if not values or not all(isinstance(v, int) for v in values) or not isinstance(cur, int):
        return values[:k]
    return sorted(sorted(values, key=lambda v: (abs(v - cur), v))[:k])


def _join(name: str, values: Iterable) -> str:
    vals = [str(v) for v in values]
    return f"{_full(name)}=" + (", ".join(vals[:-1]) + " or " + vals[-1] if len(vals) > 1 else vals[0])


def fix_for(b: Broken, lay: Layout, m: ModelFacts) -> str:
    """A fix for the broken rule ``b`` of ``lay``: changes that pass every layout rule, e.g.
    ``"use parallel.ep=1; or parallel.ep=2 with parallel.dp=4"``; if none is found among the
    candidates, a pointer to the rule's documentation."""
    name = "template" if b.field == "planner.template" else b.field.partition("parallel.")[2]
    if name != "template" and name not in PARALLEL:
        return f"see docs/recipes.md for the rules of {b.field}"

    def ok(**change) -> bool:
        return first_broken(replace(lay, **change), m) is None

    cur = getattr(lay, name)
    primary = [c for c in candidates(name, lay, m) if c != cur and ok(**{name: c})]
    parts = [_join(name, _nearest(primary, cur, 4))] if primary else []
    for g in _SECONDARY.get((b.kind, name), ()):
        vals = [c for c in candidates(g, lay, m) if c != getattr(lay, g) and ok(**{g: c})]
        if vals:
            parts.append(_join(g, _nearest(vals, getattr(lay, g), 2)))
    if b.kind in _WITH_DP and not any(c > 1 for c in primary):  # only 1 (or nothing) fits the current dp
        rest = [c for c in candidates(name, lay, m) if c not in primary and c != cur]
        pairs = 0
        for c in sorted(rest, key=lambda v: (abs(v - cur), v)):
            d = _dp_for(lay.dp, lay.tp, c) if name == "ep" else _dp_for(lay.dp, c, lay.ep)
            if d != lay.dp and d <= PARALLEL["dp"].value and ok(**{name: c, "dp": d}):
                parts.append(f"{_full(name)}={c} with parallel.dp={d}")
                pairs += 1
                if pairs == 2:
                    break
    if not parts:
        return f"see docs/recipes.md for the rules of {b.field}"
    fix = "use " + "; or ".join(parts)
    if b.kind == "template":
        close = difflib.get_close_matches(str(b.value), primary, n=1)
        fix = (f"did you mean {close[0]!r}? " if close else "") + fix
    if b.kind == "stages":
        fix = f"use pp*vpp <= {m.num_layers}, e.g. " + fix[len("use "):]
    return fix


def one_of(field: str, value, known: Sequence[str], rule: str) -> None:
    """Check that ``value`` is one of ``known``.

    Raises:
        TesseraConfigError: naming ``field``, ``value`` and ``rule``; the fix suggests the closest
            known name (difflib, ignoring case: ``MXFP8`` gets ``mxfp8``) and lists all of them.
    """
    if value not in known:
        lower = {str(k).lower(): k for k in known}
        close = difflib.get_close_matches(str(value).lower(), list(lower), n=1)
        hint = f"did you mean {lower[close[0]]!r}? " if close else ""
        raise TesseraConfigError(field, value, rule, f"{hint}use one of: {', '.join(known)}")
