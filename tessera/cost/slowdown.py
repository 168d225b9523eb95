"""Per-rank slowdown: measured factors by which ranks run slower than the cost model, as a file.

A cluster is not always uniform: one slow GPU or node makes its pipeline rank the straggler, and
uneven routing (or a slow member) makes one expert-parallel rank's expert work the longest. The
recipe says so with ``planner.rank_slowdown`` (one factor per pipeline rank) and
``planner.ep_slowdown`` (one per EP rank); the running job measures them and writes them into
its run directory as :data:`SLOWDOWN_FILE`, which ``tessera plan RECIPE --slowdown-from FILE``
reads back (:func:`read_slowdown`, :meth:`Slowdown.as_overrides`).

The file (UTF-8 JSON, one object; both keys optional, a missing one is "every rank 1.0")::

    {"rank_slowdown": [1.0, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0],
     "ep_slowdown": [1.0, 1.1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}

``rank_slowdown[r]``: pipeline rank ``r``'s compute time over the modelled one (``parallel.pp``
factors); ``ep_slowdown[e]``: EP rank ``e``'s routed-expert compute time over the modelled one
(``parallel.ep`` factors, the same for every pipeline rank's EP group). Factors are finite and
> 0 (1.0: as modelled); their counts are checked against the recipe's layout when the overrides
are applied (:func:`tessera.config.validate.check_slowdown`). Any other key is an error.

What the factors scale (:meth:`Slowdown.apply`, docs/cost-model.md, "Per-rank slowdown"): a
rank's compute tasks and optimizer step (``ModelCosts.rank_scale``, applied per rank by the
simulator, the bounds and the planner), and every MoE layer's expert tasks by the *largest* EP
factor (folded into the task times: the combine all-to-all of every MoE layer waits for the
slowest member of the EP group, so the group's expert compute lasts as long as the slowest
member's).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from tessera.cost.routing import expert_gate
from tessera.cost.types import ModelCosts, TaskKind
from tessera.errors import TesseraConfigError

SLOWDOWN_FILE = "slowdown.json"
"""The file name the running job writes its measured factors to, in its run directory."""

KEYS = ("rank_slowdown", "ep_slowdown")
"""The keys of the file (module docstring), also the ``planner`` recipe fields they set."""


@dataclass(frozen=True)
class Slowdown:
    """Measured slowdown factors (module docstring).

    Attributes:
        rank_slowdown: per pipeline rank, its compute time over the modelled one (empty: all 1.0).
        ep_slowdown: per EP rank, its routed-expert compute time over the modelled one (empty:
            all 1.0).

    Raises:
        ValueError: a factor that is not a finite number > 0.
    """

    rank_slowdown: tuple[float, ...] = ()
    ep_slowdown: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for key in KEYS:
            bad = [f for f in getattr(self, key) if not 0 < f < math.inf]
            if bad:
                raise ValueError(f"Slowdown.{key}={getattr(self, key)!r}: every factor must be finite and > 0")

    @property
    def ep_factor(self) -> float:
        """The factor every MoE layer's expert tasks take: the largest EP factor (1.0 if none)."""
        return max(self.ep_slowdown, default=1.0)

    def to_dict(self) -> dict:
        """The file's JSON object (module docstring)."""
        return {k: list(getattr(self, k)) for k in KEYS}

    def as_overrides(self) -> list[str]:
        """The recipe overrides that set these factors, e.g.
        ``["planner.rank_slowdown=[1.0,1.3]", "planner.ep_slowdown=[]"]`` (both fields, an empty
        one meaning every rank 1.0: the file is the whole measured state)."""
        return [f"planner.{k}=[{','.join(repr(float(f)) for f in getattr(self, k))}]" for k in KEYS]

    def apply(self, costs: ModelCosts, routed: float = 1.0) -> ModelCosts:
        """``costs`` with these factors: ``rank_scale`` set to ``rank_slowdown`` and every
        routed-expert compute task (F, B and W) times :attr:`ep_factor` (module docstring), or,
        where ``costs`` already carry a routing imbalance ``routed`` > 1 (``CostOptions.moe_load``,
        :mod:`tessera.cost.routing`), times :func:`tessera.cost.routing.expert_gate`: the slowest
        EP member gates the layer once, ``max(ep_factor, routed)`` in all.
        The one place the recipe's factors enter the costs (:func:`tessera.flow.build_costs`);
        ``costs`` itself when there is nothing to apply."""
        ep = expert_gate(routed, self.ep_factor)
        if not self.rank_slowdown and ep == 1.0 and not costs.rank_scale:
            return costs
        out = costs.scaled(ep, kinds=(TaskKind.EXPERT,))
        return replace(out, rank_scale=tuple(float(f) for f in self.rank_slowdown))

    @staticmethod
    def of(planner) -> "Slowdown":
        """The factors of a recipe's ``planner`` section (``rank_slowdown``, ``ep_slowdown``)."""
        return Slowdown(tuple(float(f) for f in planner.rank_slowdown), tuple(float(f) for f in planner.ep_slowdown))


def _bad(path: str, rule: str, fix: str = "write {\"rank_slowdown\": [1.0, 1.3, ...], \"ep_slowdown\": [...]} "
                                          "(tessera.cost.slowdown)") -> TesseraConfigError:
    return TesseraConfigError("--slowdown-from", path, rule, fix)


def read_slowdown(path: str) -> Slowdown:
    """The factors in the slowdown file ``path`` (module docstring).

    Raises:
        TesseraConfigError: the file is missing or unreadable, not JSON, not an object, has an
            unknown key, or a value that is not a list of finite numbers > 0 (one line naming
            the file, the rule and the fix).
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise _bad(path, "file does not exist", f"give the {SLOWDOWN_FILE} of a run directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(path, f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())})",
                   "make it a readable UTF-8 file") from None
    except json.JSONDecodeError as e:
        raise _bad(path, f"is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise _bad(path, f"must hold one JSON object, not {type(doc).__name__}")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise _bad(path, f"has unknown key {unknown[0]!r}", f"use only {' and '.join(KEYS)}")
    got = {}
    for key in KEYS:
        value = doc.get(key, [])
        if not isinstance(value, list) or any(isinstance(f, bool) or not isinstance(f, (int, float)) for f in value):
            raise _bad(path, f"{key} must be a list of numbers, not {json.dumps(value)[:60]}")
        bad = [i for i, f in enumerate(value) if not 0 < f < math.inf]
        if bad:
            raise _bad(path, f"{key}[{bad[0]}]={value[bad[0]]!r}: every factor must be a finite number > 0",
                       "use e.g. 1.3 for a rank 30% slower than modelled, 1.0 for one as modelled")
        got[key] = tuple(float(f) for f in value)
    return Slowdown(**got)


def write_slowdown(path: str, slowdown: Slowdown) -> None:
    """Write ``slowdown`` to ``path`` in the file's format (module docstring), replacing the file
    in one step (written beside it, then renamed), so a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(slowdown.to_dict(), f)
        f.write("\n")
    os.replace(tmp, path)
