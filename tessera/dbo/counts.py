"""Token-count sources: how many tokens each expert receives, per microbatch and MoE layer.

A :class:`TokenCounts` is the routing outcome the dynamic bubble optimizer predicts from (the
per-expert counts the EP group knows after routing and before dispatch) and the simulator runs
with. Three sources make one:

* :func:`uniform_counts`: every expert gets the same share (no routing skew);
* :func:`skewed_counts`: a skew model, Zipf or Dirichlet expert popularity with a temperature,
  drawn afresh for every (microbatch, layer) from a seed (deterministic);
  :func:`counts_for_skew` searches the temperature that gives a requested
  :func:`skew_max_over_mean`;
* :func:`recorded_counts`: a table recorded from a real router, read from JSON
  (:meth:`TokenCounts.to_json` writes the same format).

Experts are spread over the EP group in contiguous blocks (``num_experts / ep`` each, expert
``x`` on EP rank ``x // (num_experts / ep)``), as :mod:`tessera.model.ep` places them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tessera.cost.routing import relative_loads

DISTRIBUTIONS = ("zipf", "dirichlet")


@dataclass(frozen=True)
class TokenCounts:
    """Routed token counts of one iteration.

    Attributes:
        layers: the MoE layers' indices (decoder layer index, ascending).
        num_experts: routed experts per MoE layer.
        counts: ``counts[mb][i][x]``: tokens (token-expert assignments, top-k counted k times)
            routed to expert ``x`` of MoE layer ``layers[i]`` in microbatch ``mb``, summed over
            the EP group's ranks (each rank routes its own tokens of the microbatch).
        source: where the counts come from (``"uniform"``, ``"zipf T=..."``, a file name).

    Raises:
        ValueError: ragged or negative counts, a layer listed twice.
    """

    layers: tuple[int, ...]
    num_experts: int
    counts: tuple[tuple[tuple[int, ...], ...], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(set(self.layers)) != len(self.layers) or list(self.layers) != sorted(self.layers):
            raise ValueError(f"TokenCounts.layers {self.layers} must be ascending and distinct")
        for mb, per_layer in enumerate(self.counts):
            if len(per_layer) != len(self.layers):
                raise ValueError(f"TokenCounts.counts[{mb}] has {len(per_layer)} layers, expected "
                                 f"{len(self.layers)} (one per entry of layers)")
            for i, row in enumerate(per_layer):
                if len(row) != self.num_experts or any(c < 0 for c in row):
                    raise ValueError(f"TokenCounts.counts[{mb}][{i}] must hold {self.num_experts} counts >= 0, "
                                     f"got {row}")

    @property
    def num_microbatches(self) -> int:
        return len(self.counts)

    def expert_counts(self, mb: int, layer: int) -> tuple[int, ...]:
        """Per-expert counts of ``layer`` (decoder index) in microbatch ``mb``.

        Raises:
            KeyError: ``layer`` is not a MoE layer of the table, or ``mb`` out of range."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not a MoE layer of these counts (layers {self.layers})")
        if not 0 <= mb < len(self.counts):
            raise KeyError(f"microbatch {mb} out of range (counts hold {len(self.counts)})")
        return self.counts[mb][self.layers.index(layer)]

    def rank_loads(self, mb: int, layer: int, ep: int) -> tuple[int, ...]:
        """Tokens each of the ``ep`` EP ranks' experts receive (contiguous expert blocks).

        Raises:
            ValueError: ``num_experts`` is not a multiple of ``ep``."""
        if ep < 1 or self.num_experts % ep:
            raise ValueError(f"ep={ep} must divide num_experts={self.num_experts} (experts per EP rank)")
        per = self.num_experts // ep
        row = self.expert_counts(mb, layer)
        return tuple(sum(row[e * per:(e + 1) * per]) for e in range(ep))

    def to_json(self) -> str:
        return json.dumps({"layers": list(self.layers), "num_experts": self.num_experts,
                           "counts": [[list(r) for r in per] for per in self.counts], "source": self.source})


def skew_ratio(loads: Sequence[int]) -> float:
    """Busiest EP rank's tokens over the mean rank's (1.0: balanced or no tokens): the load factor
    of :func:`tessera.cost.routing.relative_loads`, which the cost model's ``dropless`` routing
    takes (``model.moe_max_over_mean``)."""
    return relative_loads(loads)[1]


def skew_max_over_mean(counts: TokenCounts, ep: int) -> float:
    """Mean over microbatches and MoE layers of :func:`skew_ratio` of the EP ranks' loads.

    Real routers give 1.1-1.5 (the range the DBO benchmark targets); 1.0 is perfectly balanced.
    Raises ValueError as :meth:`TokenCounts.rank_loads`."""
    ratios = [skew_ratio(counts.rank_loads(mb, l, ep)) for mb in range(counts.num_microbatches) for l in counts.layers]
    return sum(ratios) / len(ratios) if ratios else 1.0


def _check(num_microbatches: int, layers: Sequence[int], num_experts: int, tokens: int) -> None:
    for name, v in (("num_microbatches", num_microbatches), ("num_experts", num_experts), ("tokens", tokens)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


def uniform_counts(num_microbatches: int, layers: Sequence[int], num_experts: int, tokens: int) -> TokenCounts:
    """Every expert gets ``tokens // num_experts``; the remainder goes one each to the first
    experts (so the counts sum to ``tokens`` per microbatch and layer).

    ``tokens``: token-expert assignments per microbatch and layer over the EP group
    (``ep * micro_batch_size * seq_length * top_k``)."""
    _check(num_microbatches, layers, num_experts, tokens)
    q, r = divmod(tokens, num_experts)
    row = tuple(q + (1 if x < r else 0) for x in range(num_experts))
    return TokenCounts(tuple(layers), num_experts, tuple(tuple(row for _ in layers) for _ in range(num_microbatches)),
                       "uniform")


def _popularity(rng: np.random.Generator, dist: str, num_experts: int, temperature: float) -> np.ndarray:
    if dist == "zipf":  # p_x ~ rank^(-T) over a random ranking of the experts: T=0 uniform, larger: more skew
        w = np.arange(1, num_experts + 1, dtype=np.float64) ** (-temperature)
        return rng.permutation(w / w.sum())
    # Dirichlet with concentration 1/T per expert: T -> 0 uniform, larger T more skew
    return rng.dirichlet(np.full(num_experts, 1.0 / max(temperature, 1e-9)))


def skewed_counts(num_microbatches: int, layers: Sequence[int], num_experts: int, tokens: int, *,
                  dist: str = "zipf", temperature: float = 1.0, seed: int = 0) -> TokenCounts:
    """Counts drawn from a skew model: for every (microbatch, layer) an expert popularity ``p``
    (``dist="zipf"``: ``p_x`` proportional to ``rank_x ** -temperature`` over a fresh random
    ranking of the experts; ``"dirichlet"``: ``p ~ Dirichlet(1/temperature, ...)``), then the
    ``tokens`` assignments multinomially over ``p``. ``temperature=0`` is uniform in
    expectation; deterministic for a given ``seed`` (numpy PCG64).

    Raises:
        ValueError: unknown ``dist``, negative ``temperature``, sizes < 1."""
    _check(num_microbatches, layers, num_experts, tokens)
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist={dist!r} is not a skew model; use one of {DISTRIBUTIONS}")
    if not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0")
    rng = np.random.default_rng(seed)
    table = []
    for _ in range(num_microbatches):
        per = []
        for _ in layers:
            p = _popularity(rng, dist, num_experts, temperature)
            per.append(tuple(int(c) for c in rng.multinomial(tokens, p)))
        table.append(tuple(per))
    return TokenCounts(tuple(layers), num_experts, tuple(table), f"{dist} T={temperature:g} seed={seed}")


def counts_for_skew(target: float, ep: int, num_microbatches: int, layers: Sequence[int], num_experts: int,
                    tokens: int, *, dist: str = "zipf", seed: int = 0, tol: float = 0.01) -> TokenCounts:
    """:func:`skewed_counts` with the temperature (bisection over [0, 8], 40 steps at most) whose
    :func:`skew_max_over_mean` at ``ep`` is within ``tol`` of ``target`` (or the closest found).

    Raises:
        ValueError: ``target`` < 1, ``ep`` < 2 (one rank has no skew), or as :func:`skewed_counts`."""
    if not target >= 1.0:
        raise ValueError(f"skew target {target} must be >= 1.0 (busiest EP rank over the mean rank)")
    if ep < 2:
        raise ValueError(f"ep={ep}: a skew target needs an EP group of at least 2 ranks")
    lo, hi = 0.0, 8.0
    best = None
    for _ in range(40):
        mid = (lo + hi) / 2
        c = skewed_counts(num_microbatches, layers, num_experts, tokens, dist=dist, temperature=mid, seed=seed)
        s = skew_max_over_mean(c, ep)
        if best is None or abs(s - target) < abs(best[0] - target):
            best = (s, c)
        if abs(s - target) <= tol:
            break
        lo, hi = (mid, hi) if s < target else (lo, mid)
    return best[1]


def recorded_counts(path: str | Path) -> TokenCounts:
    """A table recorded from a real router: JSON ``{"layers": [...], "num_experts": E,
    "counts": [[[...E counts] per layer] per microbatch], "source": "..."}``.

    Raises:
        ValueError: the file is not such a table (names the file and the missing or bad field)."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
        return TokenCounts(tuple(int(x) for x in d["layers"]), int(d["num_experts"]),
                           tuple(tuple(tuple(int(c) for c in row) for row in per) for per in d["counts"]),
                           d.get("source", p.name))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"token counts file {p}: {type(e).__name__} {e}; expected JSON with layers, num_experts "
                         f"and counts[mb][layer][expert]") from None
