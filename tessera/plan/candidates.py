"""Candidate layer ranges per virtual stage, near the serial-balanced partition.

Tessera (OSDI 2026, §4, "overlap graph"): every virtual stage gets a set of
contiguous layer ranges whose boundaries lie within ``radius`` layers of the serial-balanced
partition's boundaries; the partition MILP (:mod:`tessera.plan.milp`) picks one per stage.

Ranges are over *extended* layer indices (see :class:`tessera.program.plan.Partition`): -1 is the
embedding, ``num_layers`` the head. Stage 0 always starts at -1 and the last stage always ends at
``num_layers + 1``; every candidate holds at least one decoder layer. A boundary value ``v`` (a
"cut") means the next stage starts at extended index ``v``.

Also here: the memory table of the candidates (:func:`candidate_memory`), built from the
template's in-flight microbatch counts (:func:`inflight_microbatches`) and stage placement
(:func:`stage_ranks`), which the MILP's per-rank memory constraints read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from tessera.cost.types import ModelCosts
from tessera.errors import TesseraConfigError
from tessera.program.plan import Partition
from tessera.program.instructions import Op
from tessera.program.templates import compute_schedule, rank_chunk_of, stage_of


@dataclass(frozen=True, order=True)
class Candidate:
    """One choice for virtual stage ``stage``: extended layers ``[start, stop)``."""

    stage: int
    start: int
    stop: int

    @property
    def range(self) -> tuple[int, int]:
        return self.start, self.stop

    def num_decoder_layers(self, num_layers: int) -> int:
        """Decoder layers in the range (embedding and head not counted)."""
        return decoder_layers(self.start, self.stop, num_layers)

    def __str__(self) -> str:
        return f"S{self.stage}[{self.start},{self.stop})"


def decoder_layers(start: int, stop: int, num_layers: int) -> int:
    """Number of decoder layers (indices ``0..num_layers-1``) in extended range ``[start, stop)``."""
    return max(0, min(stop, num_layers) - max(start, 0))


def _allowed_cuts(baseline: Partition, boundary: int, radius: int, num_layers: int,
                  forbidden: frozenset[int]) -> tuple[int, ...]:
    """Values boundary ``boundary`` (0..num_stages) may take."""
    if boundary == 0:
        return (-1,)
    if boundary == baseline.num_stages:
        return (num_layers + 1,)
    c = baseline.bounds[boundary]
    return tuple(v for v in range(c - radius, c + radius + 1) if 0 <= v <= num_layers and v not in forbidden)


def _propagate(per_stage: list[list[Candidate]]) -> list[list[Candidate]]:
    """Keep only candidates that lie on some contiguous chain from stage 0 to the last stage.

    A forward pass drops candidates whose start is no stop of the previous stage's survivors; a
    backward pass drops those whose stop is no start of the next stage's survivors. Two passes
    reach the fixpoint: a survivor of both has a predecessor that has a successor (itself).
    """
    out = [list(c) for c in per_stage]
    for s in range(1, len(out)):
        stops = {c.stop for c in out[s - 1]}
        out[s] = [c for c in out[s] if c.start in stops]
    for s in range(len(out) - 2, -1, -1):
        starts = {c.start for c in out[s + 1]}
        out[s] = [c for c in out[s] if c.stop in starts]
    return out


def restrict_to_chains(candidates: Sequence[Iterable[Candidate]]) -> tuple[tuple[Candidate, ...], ...]:
    """Public form of the contiguity filter: drop candidates on no stage-0-to-last chain."""
    return tuple(tuple(c) for c in _propagate([list(c) for c in candidates]))


def stage_candidates(baseline: Partition, radius: int, num_layers: int, *,
                     forbidden_cuts: Sequence[int] = ()) -> tuple[tuple[Candidate, ...], ...]:
    """Candidate ranges of every virtual stage.

    Args:
        baseline: the serial-balanced partition (extended indices, ``bounds[0] == -1``,
            ``bounds[-1] == num_layers + 1``).
        radius: how many layers a boundary may move from the baseline's (>= 0).
        num_layers: decoder layers of the model.
        forbidden_cuts: extended indices that may not start a stage, i.e. layers ``v-1`` and ``v``
            must stay together (e.g. ``(num_layers - 1,)`` keeps the last layer with the head,
            where an MTP block lives).

    Returns:
        For each stage ``s``, its candidates sorted by (start, stop): all ``[a, b)`` with
        ``|a - bounds[s]| <= radius`` and ``|b - bounds[s+1]| <= radius`` (stage 0 fixed at
        ``a = -1``, the last stage at ``b = num_layers + 1``), at least one decoder layer, no
        forbidden cut, and lying on at least one chain that tiles ``-1..num_layers``.

    Raises:
        TesseraConfigError: bad baseline or radius, or a stage is left with no candidate.
    """
    b = baseline.bounds
    if radius < 0:
        raise TesseraConfigError("planner.candidate_radius", radius, "must be >= 0", "use 0, 1, 2, ...")
    if b[0] != -1 or b[-1] != num_layers + 1 or any(x >= y for x, y in zip(b, b[1:])):
        raise TesseraConfigError("partition.bounds", b, f"must increase from -1 to num_layers+1={num_layers + 1}",
                                 "build the baseline with serial_balanced_partition")
    forbidden = frozenset(forbidden_cuts)
    n_stages = baseline.num_stages
    cuts = [_allowed_cuts(baseline, k, radius, num_layers, forbidden) for k in range(n_stages + 1)]
    per_stage = [[Candidate(s, a, z) for a in cuts[s] for z in cuts[s + 1] if decoder_layers(a, z, num_layers) >= 1]
                 for s in range(n_stages)]
    per_stage = _propagate(per_stage)
    for s, cands in enumerate(per_stage):
        if not cands:
            raise TesseraConfigError("planner.candidate_radius", radius,
                                     f"leaves stage {s} with no candidate range (forbidden cuts {sorted(forbidden)})",
                                     "widen the radius or use fewer stages")
    return tuple(tuple(sorted(c)) for c in per_stage)


def partition_of(choice: Sequence[Candidate]) -> Partition:
    """The Partition formed by one candidate per stage (must be contiguous, in stage order)."""
    for prev, nxt in zip(choice, choice[1:]):
        if prev.stop != nxt.start or nxt.stage != prev.stage + 1:
            raise ValueError(f"candidates {prev} and {nxt} are not contiguous")
    return Partition(tuple(c.start for c in choice) + (choice[-1].stop,))


def candidates_of(partition: Partition) -> tuple[Candidate, ...]:
    """The candidates a partition selects (one per stage)."""
    return tuple(Candidate(s, *partition.stage_range(s)) for s in range(partition.num_stages))


@dataclass(frozen=True)
class CandidateMemory:
    """Memory a candidate needs on its rank and which rank holds each stage.

    Attributes:
        stage_rank: rank of every virtual stage (``stage_rank[s]``).
        bytes: candidate -> bytes: static (params, grads, optimizer state of its layers) plus the
            activations the template keeps in flight for that stage at the stage's own peak
            (summed over a rank's stages: an upper bound of the rank's peak).
        rows: exact form, ``(rank, candidate -> bytes)`` per distinct instruction boundary of the
            rank's compute order (:func:`memory_profile`): the rank's memory there is the sum over
            its stages of the chosen candidates' bytes, and its peak the largest row. Empty:
            one row per rank from ``bytes``.
    """

    stage_rank: tuple[int, ...]
    bytes: dict[Candidate, float]
    rows: tuple[tuple[int, dict[Candidate, float]], ...] = ()

    def rank_rows(self) -> list[tuple[int, dict[Candidate, float]]]:
        """The memory rows, ``(rank, candidate -> bytes)``; see ``rows``."""
        if self.rows:
            return list(self.rows)
        return [(r, {c: b for c, b in self.bytes.items() if self.stage_rank[c.stage] == r})
                for r in sorted(set(self.stage_rank))]

    def peak(self, choice: Iterable[Candidate]) -> dict[int, float]:
        """Per rank, the peak memory of one candidate per stage, bytes."""
        chosen = list(choice)
        out: dict[int, float] = {}
        for r, row in self.rank_rows():
            out[r] = max(out.get(r, 0.0), sum(row[c] for c in chosen if c in row))
        return out


def candidate_memory(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], stage_rank: Sequence[int],
                     inflight: Sequence[int], inflight_w: Sequence[int] | None = None) -> CandidateMemory:
    """Per-candidate memory, bytes: ``sum_layers static + inflight[s] * activation
    + inflight_w[s] * w_activation``. Summing these over a rank's stages bounds the rank's peak
    from above (its stages need not peak at the same moment).

    Args:
        costs: per-layer :class:`tessera.cost.types.LayerMemory`.
        candidates: per stage, its candidates.
        stage_rank: rank of each stage.
        inflight: per stage, the most microbatches whose activations the template holds at once
            (F done, B not yet), e.g. ``pp - rank + 1`` for 1F1B with FB overlap
            (:func:`inflight_microbatches`).
        inflight_w: per stage, the most microbatches whose W is still pending after B (deferred
            W holds ``w_activation``); default none.
    """
    out: dict[Candidate, float] = {}
    for stage in candidates:
        for c in stage:
            nw = inflight_w[c.stage] if inflight_w is not None else 0
            mems = [costs.layer(i).memory for i in range(c.start, c.stop)]
            out[c] = sum(m.static + inflight[c.stage] * m.activation + nw * m.w_activation for m in mems)
    return CandidateMemory(tuple(stage_rank), out)


def memory_profile(template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = True,
                   split_w: bool = True) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """Per rank, the in-flight counts at every instruction boundary of its compute order, with the
    simulator's accounting (:func:`tessera.program.memory.rank_memory_bytes`): ``F``/``FB``
    allocate a microbatch's activation at their start, ``B`` frees it at its end but keeps the
    W activation when W is deferred (``with_w=False``), ``W`` frees that.

    Returns:
        ``profile[r]``: the distinct count vectors not dominated by another of rank ``r``, each
        a tuple over the rank's stages (ascending) of ``(activations held, deferred W held)``.
        A rank's memory at a boundary is ``sum_s static_s + a_s * activation_s + w_s *
        w_activation_s``, so its peak is the largest over these vectors (a dominated vector never
        is, as every coefficient is non-negative).
    """
    sched = compute_schedule(template, pp, vpp, num_microbatches, overlap, split_w)
    out = []
    for r, instrs in enumerate(sched):
        stages = sorted(stage_of(template, r, c, pp, vpp) for c in range(vpp))
        pos = {s: k for k, s in enumerate(stages)}
        a, w = [0] * len(stages), [0] * len(stages)
        points: set[tuple[tuple[int, int], ...]] = set()

        def mark() -> None:
            points.add(tuple(zip(a, w)))

        for i in instrs:
            if i.op in (Op.F, Op.FB):
                a[pos[stage_of(template, r, i.chunk, pp, vpp)]] += 1
                mark()
            if i.op in (Op.B, Op.FB):
                k = pos[stage_of(template, r, i.chunk2 if i.op == Op.FB else i.chunk, pp, vpp)]
                a[k] -= 1
                if not i.with_w:
                    w[k] += 1
                mark()
            elif i.op == Op.W:
                w[pos[stage_of(template, r, i.chunk, pp, vpp)]] -= 1
                mark()
        pts = sorted(points)
        keep = [p for p in pts if not any(q != p and all(x <= y for t, u in zip(p, q) for x, y in zip(t, u))
                                          for q in pts)]
        out.append(tuple(keep))
    return tuple(out)


def exact_candidate_memory(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], template: str, pp: int,
                           vpp: int, num_microbatches: int, overlap: bool = True,
                           split_w: bool = True) -> CandidateMemory:
    """:class:`CandidateMemory` with one row per rank and :func:`memory_profile` vector, so that
    a rank's peak under any choice equals the simulator's (and
    :func:`tessera.program.memory.rank_memory_bytes`'s) for the compiled Programs; ``bytes``
    holds each candidate's largest value over its rank's rows (its stage's own peak: summed over
    a rank's stages, an upper bound of the rank's peak)."""
    ranks = stage_ranks(template, pp, vpp)
    parts: dict[Candidate, tuple[float, float, float]] = {}  # static, activation, W activation (bytes)
    for stage in candidates:
        for c in stage:
            mems = [costs.layer(i).memory for i in range(c.start, c.stop)]
            parts[c] = (sum(m.static for m in mems), sum(m.activation for m in mems),
                        sum(m.w_activation for m in mems))
    rows = []
    peak: dict[Candidate, float] = {}
    for r, vectors in enumerate(memory_profile(template, pp, vpp, num_microbatches, overlap, split_w)):
        stages = sorted(s for s, rr in enumerate(ranks) if rr == r)
        for vec in vectors:
            row = {}
            for s, (na, nw) in zip(stages, vec):
                for c in candidates[s]:
                    st, act, wact = parts[c]
                    row[c] = st + na * act + nw * wact
                    peak[c] = max(peak.get(c, 0.0), row[c])
            rows.append((r, row))
    return CandidateMemory(ranks, peak, tuple(rows))


def inflight_microbatches(template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = True,
                          split_w: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per virtual stage, the most microbatches whose activations are held at once (F done, B
    not yet; an ``FB`` counts its F before its B) and the most whose deferred W is pending
    (B done with ``with_w=False``, W not yet), from the template's compute order
    (:func:`tessera.program.templates.compute_schedule`)."""
    sched = compute_schedule(template, pp, vpp, num_microbatches, overlap, split_w)
    n = pp * vpp
    act, w, peak_a, peak_w = [0] * n, [0] * n, [0] * n, [0] * n
    for r, instrs in enumerate(sched):
        for i in instrs:
            fwd = [i.chunk] if i.op in (Op.F, Op.FB) else []
            bwd = [(i.chunk2 if i.op == Op.FB else i.chunk)] if i.op in (Op.B, Op.FB) else []
            for c in fwd:
                s = stage_of(template, r, c, pp, vpp)
                act[s] += 1
                peak_a[s] = max(peak_a[s], act[s])
            for c in bwd:
                s = stage_of(template, r, c, pp, vpp)
                act[s] -= 1
                if not i.with_w:
                    w[s] += 1
                    peak_w[s] = max(peak_w[s], w[s])
            if i.op == Op.W:
                w[stage_of(template, r, i.chunk, pp, vpp)] -= 1
    return tuple(peak_a), tuple(peak_w)


def stage_ranks(template: str, pp: int, vpp: int) -> tuple[int, ...]:
    """Rank holding each virtual stage."""
    return tuple(rank_chunk_of(template, s, pp, vpp)[0] for s in range(pp * vpp))
