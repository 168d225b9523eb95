"""Stragglers and routing skew, estimated from the job's own check steps (the autopilot's eyes,
``docs/operations.md``, "Autopilot").

At every check step (``profile.check_every``, with ``autopilot.enabled`` or the profile drift
check) each rank runs its iteration on the profiling engine, which times every task
(:mod:`tessera.train.worker.drift`), and records its routers' per-expert counts.

**Slowdown per pipeline rank.** Each rank reduces its task times to one median per *item* (the
task's signature, :func:`tessera.cost.profile_costs.task_signature`: phase, layer kind and task
kind, so ``W.L3.expert`` and ``W.L7.expert`` of two layers of one kind are one item): the same
computation on the same shapes, wherever the partition puts it. A check compares, item by item,
each rank's median with the same item on the other ranks (:func:`check_estimate`): the
reference of an item is the lower median over the ranks that ran it (robust to fewer than half
of them being slow; with two ranks, the faster one), a rank's ratio is the median over its items
of its time over the reference, and a pipeline rank's slowdown is the largest ratio of its
data-parallel replicas (one slow replica holds back the whole stage at every gradient
reduction). Comparing the same items across ranks needs no cost model: an error of the cost
model (different for each layer kind) or a partition change does not look like a straggler, and
the window of checks stays valid across a plan switch. Only tasks that wait on nothing are
compared (:func:`comparable`): with expert parallelism the all-to-alls are asynchronous and a
peer's late dispatch lands inside whichever task reads its result (an expert, the next mixer),
so there only weight-gradient (W) tasks, shared experts, the embedding and the head count; without
it every compute task does (pipeline receives are waited at their own instruction on the
profiling engine). A rank that shares no item with another rank has no estimate (None).

**Routing skew.** For every (microbatch, MoE layer) a rank ran, the EP group's tokens per EP
rank (each rank's per-expert counts summed over the group, experts in contiguous blocks of
``E / ep``: :mod:`tessera.model.ep`); ``routing_skew`` is the mean over those rows of the busiest
EP rank's tokens over the mean rank's (the factor by which a layer's expert phase outlasts
balanced routing, :func:`tessera.dbo.counts.skew_ratio`); ``ep_load[e]`` is EP rank ``e``'s
tokens over all rows over the mean rank's (the systematic part: an EP rank that is always the
busiest; what ``planner.ep_slowdown`` takes).

**Robust over time.** :class:`StragglerWindow` keeps the last ``autopilot.checks`` checks and
gives their per-rank medians (:class:`Estimate`); the autopilot acts on nothing before the
window is full, one odd check cannot move a median of three, and the decision side adds a
threshold and a hold-off (:mod:`tessera.train.upgrade.autopilot`).

Every value here is frozen and JSON-ready (``to_dict``/``from_dict``); nothing here communicates.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["RankSample", "CheckEstimate", "Estimate", "StragglerWindow", "comparable", "rank_sample",
           "route_stats", "check_estimate", "ep_block_counts"]

QUIET_KINDS = ("shared", "embed", "head")
"""Task kinds that wait on no all-to-all in any phase (with W, every kind of W)."""

COMM_KINDS = ("dispatch", "combine")
"""Task kinds that are communication: never compared."""

MIN_FACTOR = 0.01
"""The smallest EP factor an :class:`Estimate` gives (an EP rank that received no tokens)."""


def comparable(name: str, ep: int) -> bool:
    """Whether task ``name`` (``"F.L3.expert"``: phase, layer, kind) is compared across ranks
    (module docstring): never dispatch or combine; with ``ep > 1`` only W tasks and
    :data:`QUIET_KINDS`."""
    phase, _, rest = name.partition(".")
    kind = rest.rpartition(".")[2]
    if kind in COMM_KINDS:
        return False
    return ep <= 1 or phase == "W" or kind in QUIET_KINDS


@dataclass(frozen=True)
class RankSample:
    """One rank's share of a check.

    Attributes:
        world_rank, pipeline_rank: where the rank sits.
        items: ``(item, median ms)`` of its compared tasks, sorted by item.
        route_rows: (microbatch, MoE layer) rows its routers ran (0 without EP data).
        skew_sum: sum over those rows of the busiest EP rank's tokens over the mean rank's.
        ep_tokens: tokens per EP rank summed over those rows (the EP group's), ``ep`` values.
    """

    world_rank: int
    pipeline_rank: int
    items: tuple[tuple[str, float], ...] = ()
    route_rows: int = 0
    skew_sum: float = 0.0
    ep_tokens: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return {"world_rank": self.world_rank, "pipeline_rank": self.pipeline_rank,
                "items": [list(i) for i in self.items], "route_rows": self.route_rows, "skew_sum": self.skew_sum,
                "ep_tokens": list(self.ep_tokens)}

    @staticmethod
    def from_dict(d: Mapping) -> "RankSample":
        return RankSample(int(d["world_rank"]), int(d["pipeline_rank"]),
                          tuple((str(k), float(v)) for k, v in d.get("items", ())), int(d.get("route_rows", 0)),
                          float(d.get("skew_sum", 0.0)), tuple(float(x) for x in d.get("ep_tokens", ())))


def ep_block_counts(requested: Sequence[int], ep: int) -> tuple[int, ...]:
    """Per-expert counts ``requested`` (``[E]``) summed into the ``ep`` contiguous blocks of
    ``E / ep`` experts each EP rank holds.

    Raises:
        ValueError: ``E`` not divisible by ``ep``."""
    counts = [int(c) for c in requested]
    if ep < 1 or len(counts) % ep:
        raise ValueError(f"{len(counts)} experts cannot be split over ep={ep} ranks")
    per = len(counts) // ep
    return tuple(sum(counts[e * per:(e + 1) * per]) for e in range(ep))


def route_stats(loads: Iterable[Sequence[float]]) -> tuple[int, float, tuple[float, ...]]:
    """``(rows, skew_sum, ep_tokens)`` of the EP group's tokens per EP rank, one row per
    (microbatch, MoE layer) (rows without tokens are skipped): see :class:`RankSample`."""
    rows, skew, total = 0, 0.0, None
    for row in loads:
        row = [float(x) for x in row]
        mean = sum(row) / len(row) if row else 0.0
        if mean <= 0:
            continue
        rows += 1
        skew += max(row) / mean
        total = row if total is None else [a + b for a, b in zip(total, row)]
    return rows, skew, tuple(total or ())


def rank_sample(world_rank: int, pipeline_rank: int, timings: Iterable[tuple[object, float]],
                signature: Mapping[str, str], ep: int, loads: Iterable[Sequence[float]] = ()) -> RankSample:
    """This rank's :class:`RankSample` from one timed iteration's ``(task, ms)`` (the profiling
    engine's, :attr:`tessera.train.worker.step.EngineStepRunner.last_timings`), the item of
    every task (``signature``: :func:`tessera.cost.profile_costs.task_signatures`), the EP size
    and the EP group's tokens per EP rank of every (microbatch, MoE layer) the rank ran
    (``loads``; empty without EP)."""
    samples: dict[str, list[float]] = {}
    for key, ms in timings:
        name = str(key)
        item = signature.get(name)
        if item is not None and comparable(name, ep) and ms > 0:
            samples.setdefault(item, []).append(float(ms))
    items = tuple(sorted((item, statistics.median(v)) for item, v in samples.items()))
    rows, skew, tokens = route_stats(loads)
    return RankSample(world_rank, pipeline_rank, items, rows, skew, tokens)


@dataclass(frozen=True)
class CheckEstimate:
    """What one check saw (module docstring).

    Attributes:
        step: the check's iteration.
        rank_slowdown: per pipeline rank, its time over the reference on the items it shares with
            other ranks (1.0: as fast as the typical rank); None where it shares none.
        routing_skew: mean over (microbatch, MoE layer) of the busiest EP rank's tokens over the
            mean rank's (>= 1); None without EP data.
        ep_load: per EP rank, its tokens over the mean EP rank's; empty without EP data.
    """

    step: int
    rank_slowdown: tuple[float | None, ...]
    routing_skew: float | None = None
    ep_load: tuple[float, ...] = ()

    @property
    def slowest(self) -> float | None:
        """The largest rank slowdown (None when no rank has one)."""
        got = [s for s in self.rank_slowdown if s is not None]
        return max(got) if got else None

    def metrics(self) -> dict:
        """The iteration record's fields (``metrics.jsonl``: ``rank_slowdown`` (list, null where
        none), ``rank_slowdown_max``, ``routing_skew``, ``ep_load`` (list; null without EP data))."""
        return {"rank_slowdown": list(self.rank_slowdown), "rank_slowdown_max": self.slowest,
                "routing_skew": self.routing_skew, "ep_load": list(self.ep_load) if self.ep_load else None}

    @staticmethod
    def from_metrics(record: Mapping) -> "CheckEstimate | None":
        """The check in an iteration record (None when the iteration was no check)."""
        ranks = record.get("rank_slowdown")
        if ranks is None:
            return None
        return CheckEstimate(int(record["step"]), tuple(None if s is None else float(s) for s in ranks),
                             None if record.get("routing_skew") is None else float(record["routing_skew"]),
                             tuple(float(x) for x in record.get("ep_load") or ()))


def check_estimate(step: int, samples: Sequence[RankSample], pp: int) -> CheckEstimate:
    """One check from every rank's :class:`RankSample` (module docstring): per item the lower
    median over the ranks that ran it is the reference (items on one rank only are skipped); a
    rank's ratio is the median over its items of its time over the reference; a pipeline rank's
    slowdown the largest ratio of its replicas. Routing: the rows summed over every rank (each EP
    group's members report the same rows, so sums and means are unchanged by counting them
    ``ep`` times)."""
    by_item: dict[str, list[float]] = {}
    for s in samples:
        for item, ms in s.items:
            by_item.setdefault(item, []).append(ms)
    ref = {item: statistics.median_low(v) for item, v in by_item.items() if len(v) >= 2}
    per_rank: list[float | None] = [None] * pp
    for s in samples:
        ratios = [ms / ref[item] for item, ms in s.items if item in ref and ref[item] > 0]
        if ratios and 0 <= s.pipeline_rank < pp:
            r = statistics.median(ratios)
            cur = per_rank[s.pipeline_rank]
            per_rank[s.pipeline_rank] = r if cur is None else max(cur, r)
    rows = sum(s.route_rows for s in samples)
    skew = sum(s.skew_sum for s in samples) / rows if rows else None
    tokens = [s.ep_tokens for s in samples if s.route_rows and s.ep_tokens]
    load: tuple[float, ...] = ()
    if tokens:
        total = [sum(col) for col in zip(*tokens)]
        mean = sum(total) / len(total)
        load = tuple(t / mean for t in total) if mean > 0 else ()
    return CheckEstimate(int(step), tuple(per_rank), skew, load)


@dataclass(frozen=True)
class Estimate:
    """The medians of a window of checks (:class:`StragglerWindow`).

    Attributes:
        step: the newest check's iteration; checks: how many checks the medians are over.
        rank_slowdown: per pipeline rank, the median of its slowdowns (1.0 where no check had one).
        routing_skew: median routing skew (1.0 without EP data).
        ep_slowdown: per EP rank, the median of its load over the mean rank's (``ep_load``):
            what ``planner.ep_slowdown`` takes (empty without EP data).
    """

    step: int
    checks: int
    rank_slowdown: tuple[float, ...]
    routing_skew: float = 1.0
    ep_slowdown: tuple[float, ...] = ()

    @property
    def slowest(self) -> float:
        return max(self.rank_slowdown, default=1.0)

    def slowdown(self):
        """These factors as a :class:`tessera.cost.slowdown.Slowdown` (what the re-plan and the
        run directory's ``slowdown.json`` take)."""
        from tessera.cost.slowdown import Slowdown

        return Slowdown(tuple(self.rank_slowdown), tuple(self.ep_slowdown))

    def to_dict(self) -> dict:
        return {"step": self.step, "checks": self.checks, "rank_slowdown": list(self.rank_slowdown),
                "rank_slowdown_max": self.slowest, "routing_skew": self.routing_skew,
                "ep_slowdown": list(self.ep_slowdown)}


def _median(values: Sequence[float], default: float) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else default


@dataclass(frozen=True)
class StragglerWindow:
    """The last ``size`` checks (``autopilot.checks``), oldest first."""

    size: int
    entries: tuple[CheckEstimate, ...] = ()

    def add(self, check: CheckEstimate) -> "StragglerWindow":
        """This window with ``check`` appended (the oldest dropped past ``size``); a check whose
        rank count differs from the window's starts the window afresh."""
        kept = self.entries if not self.entries or len(self.entries[-1].rank_slowdown) == len(check.rank_slowdown) \
            else ()
        return StragglerWindow(self.size, (kept + (check,))[-max(1, self.size):])

    @property
    def full(self) -> bool:
        """Whether it holds ``size`` checks (nothing is acted on before)."""
        return len(self.entries) >= self.size

    def estimate(self) -> Estimate | None:
        """The per-rank medians over the window (None while it is empty)."""
        if not self.entries:
            return None
        pp = len(self.entries[-1].rank_slowdown)
        ranks = tuple(_median([c.rank_slowdown[r] for c in self.entries], 1.0) for r in range(pp))
        skew = _median([c.routing_skew for c in self.entries], 1.0)
        loads = [c.ep_load for c in self.entries if c.ep_load]
        ep = len(loads[-1]) if loads else 0
        # an EP rank that got no tokens has load 0: kept > 0 (a factor), the cost model reads the largest
        ep_slowdown = tuple(max(MIN_FACTOR, _median([lo[e] for lo in loads if len(lo) == ep], 1.0)) for e in range(ep))
        return Estimate(self.entries[-1].step, len(self.entries), ranks, skew, ep_slowdown)
