"""Candidate layer ranges per virtual stage, near the serial-balanced partition.

Tessera (OSDI 2026, §4, "overlap graph"): every virtual stage gets a set of
contiguous layer ranges whose boundaries lie within ``radius`` layers of the serial-balanced
partition's boundaries; the partition MILP (:mod:`tessera.plan.milp`) picks one per stage.

Ranges are over *extended* layer indices (see :class:`tessera.program.plan.Partition`): -1 is the
embedding, ``num_layers`` the head. Stage 0 always starts at -1 and the last stage always ends at
``num_layers + 1``; every candidate holds at least one decoder layer, except, with ``alone``, the
embedding alone on stage 0 (``[-1, 0)``) and the head alone on the last stage (``[L, L+1)``). A boundary value ``v`` (a
"cut") means the next stage starts at extended index ``v``.

Also here: the memory table of the candidates (:func:`candidate_memory`), built from the
template's in-flight microbatch counts (:func:`inflight_microbatches`) and stage placement
(:func:`stage_ranks`), which the MILP's per-rank memory constraints read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tessera.cost.types import ModelCosts
from tessera.errors import TesseraConfigError
from tessera.program.instructions import Op
from tessera.program.memory import pair_peak_bytes
from tessera.program.plan import Partition
from tessera.program.templates import co_executed_pairs, compute_schedule, get_template, rank_chunk_of, stage_of
from tessera.sched.chunkdag import replay_pair


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
                  forbidden: frozenset[int], alone: bool = False) -> tuple[int, ...]:
    """Values boundary ``boundary`` (0..num_stages) may take (``alone``: also 0 for the first
    inner boundary and ``num_layers`` for the last, whatever the radius: the embedding or the
    head alone on its stage)."""
    if boundary == 0:
        return (-1,)
    if boundary == baseline.num_stages:
        return (num_layers + 1,)
    c = baseline.bounds[boundary]
    extra = ({0} if alone and boundary == 1 else set()) | \
        ({num_layers} if alone and boundary == baseline.num_stages - 1 else set())
    near = set(range(c - radius, c + radius + 1)) | extra
    return tuple(sorted(v for v in near if 0 <= v <= num_layers and v not in forbidden))


def stage_range_ok(start: int, stop: int, num_layers: int, alone: bool = True) -> bool:
    """Extended range ``[start, stop)`` may be a virtual stage: it holds a decoder layer, or (with
    ``alone``) it is the embedding alone ``[-1, 0)`` or the head alone ``[L, L+1)``, the two
    ranges without a decoder layer that the compiler and the engine run."""
    return decoder_layers(start, stop, num_layers) >= 1 or (
        alone and (start, stop) in ((-1, 0), (num_layers, num_layers + 1)))


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
                     forbidden_cuts: Sequence[int] = (), alone: bool = False) -> tuple[tuple[Candidate, ...], ...]:
    """Candidate ranges of every virtual stage.

    Args:
        baseline: the serial-balanced partition (extended indices, ``bounds[0] == -1``,
            ``bounds[-1] == num_layers + 1``).
        radius: how many layers a boundary may move from the baseline's (>= 0).
        num_layers: decoder layers of the model.
        forbidden_cuts: extended indices that may not start a stage, i.e. layers ``v-1`` and ``v``
            must stay together (e.g. ``(num_layers - 1,)`` keeps the last layer with the head,
            where an MTP block lives).
        alone: also offer the embedding alone on stage 0 (``[-1, 0)``) and the head alone on the
            last stage (``[L, L+1)``), with the cuts 0 and ``L`` allowed on the first and last
            inner boundaries beyond the radius (the neighbouring stage then takes the layers the
            baseline gave the embedding's or the head's stage, as far as the radius allows);
            ignored at radius 0 (the baseline's ranges only).

    Returns:
        For each stage ``s``, its candidates sorted by (start, stop): all ``[a, b)`` with
        ``|a - bounds[s]| <= radius`` and ``|b - bounds[s+1]| <= radius`` (stage 0 fixed at
        ``a = -1``, the last stage at ``b = num_layers + 1``), at least one decoder layer, no
        forbidden cut, and lying on at least one chain that tiles ``-1..num_layers``; with
        ``alone`` also the two ranges without a decoder layer above.

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
    alone = alone and radius > 0  # radius 0: the baseline's ranges only
    cuts = [_allowed_cuts(baseline, k, radius, num_layers, forbidden, alone) for k in range(n_stages + 1)]
    per_stage = [[Candidate(s, a, z) for a in cuts[s] for z in cuts[s + 1] if a < z
                  and stage_range_ok(a, z, num_layers, alone)] for s in range(n_stages)]
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


Pair = tuple[Candidate, Candidate]  # (F-side candidate, B-side candidate) of an overlap edge


@dataclass(frozen=True)
class CandidateMemory:
    """Memory a candidate needs on its rank and which rank holds each stage.

    Attributes:
        stage_rank: rank of every virtual stage (``stage_rank[s]``).
        bytes: candidate -> bytes: static (params, grads, optimizer state of its layers, its
            largest FSDP transient) plus the activations the template keeps in flight for that
            stage at the stage's own peak (summed over a rank's stages: an upper bound of the
            rank's peak).
        rows: exact form, ``(rank, candidate -> bytes)`` per distinct instruction boundary of the
            rank's compute order (:func:`memory_profile`): the rank's memory there is the sum over
            its stages of the chosen candidates' bytes (plus the row's pair term, ``pair_terms``),
            and its peak the largest row. Empty: one row per rank from ``bytes``.
        pair_terms: per row (same order as ``rows``; empty: none), ``(F candidate, B candidate)
            -> bytes`` added when both are chosen: inside an ``FB`` the pair's own peak depends on
            both chunks (:func:`tessera.program.memory.pair_peak_bytes`); the part that depends on
            the F candidate alone is in the row, these are the non-negative rest.
    """

    stage_rank: tuple[int, ...]
    bytes: dict[Candidate, float]
    rows: tuple[tuple[int, dict[Candidate, float]], ...] = ()
    pair_terms: tuple[dict[Pair, float], ...] = ()

    def rank_rows(self) -> list[tuple[int, dict[Candidate, float]]]:
        """The memory rows, ``(rank, candidate -> bytes)``, without their pair terms: a lower
        bound of each row (pair terms are >= 0), what pruning may use; see ``rows``."""
        if self.rows:
            return list(self.rows)
        return [(r, {c: b for c, b in self.bytes.items() if self.stage_rank[c.stage] == r})
                for r in sorted(set(self.stage_rank))]

    def exact_rows(self) -> list[tuple[int, dict[Candidate, float], dict[Pair, float]]]:
        """The memory rows with their pair terms, ``(rank, candidate -> bytes, pair -> bytes)``."""
        rows = self.rank_rows()
        terms = list(self.pair_terms) if self.pair_terms else [{} for _ in rows]
        return [(r, row, t) for (r, row), t in zip(rows, terms)]

    def peak(self, choice: Iterable[Candidate]) -> dict[int, float]:
        """Per rank, the peak memory of one candidate per stage, bytes."""
        chosen = list(choice)
        chosen_set = set(chosen)
        out: dict[int, float] = {}
        for r, row, terms in self.exact_rows():
            v = sum(row[c] for c in chosen if c in row)
            v += sum(b for (cf, cb), b in terms.items() if cf in chosen_set and cb in chosen_set)
            out[r] = max(out.get(r, 0.0), v)
        return out


def _transient(costs: ModelCosts, c: Candidate) -> float:
    """The largest ``LayerMemory.transient`` of a candidate's layers, bytes."""
    return max((costs.layer(i).memory.transient for i in range(c.start, c.stop)), default=0.0)


def candidate_memory(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], stage_rank: Sequence[int],
                     inflight: Sequence[int], inflight_w: Sequence[int] | None = None) -> CandidateMemory:
    """Per-candidate memory, bytes: ``sum_layers static + inflight[s] * activation
    + inflight_w[s] * w_activation``, plus the largest FSDP transient of its layers. Summing these
    over a rank's stages bounds the rank's peak from above (its stages need not peak at the same
    moment; an ``FB`` counts its forward's whole activation, never less than its own peak).

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
            out[c] += _transient(costs, c)
    return CandidateMemory(tuple(stage_rank), out)


Point = tuple[tuple[tuple[int, int], ...], tuple[int, int] | None]
"""One memory point of a rank: per stage (ascending) ``(activations held, deferred W held)``, and
``(f_stage, b_stage)`` when the point is inside an ``FB`` (the counts are those before it)."""


def memory_profile(template: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = True,
                   split_w: bool = True) -> tuple[tuple[Point, ...], ...]:
    """Per rank, its memory points: the in-flight counts at every instruction boundary of its
    compute order and inside every ``FB``, with the accounting of
    :func:`tessera.program.memory.rank_memory_bytes`: ``F`` allocates a microbatch's activation at
    its start, ``B`` frees it at its end but keeps the W activation when W is deferred
    (``with_w=False``), ``W`` frees that; an ``FB`` adds a point tagged with its pair, whose
    counts are those before it (its own peak is the pair's, added by
    :func:`exact_candidate_memory`), then its boundary after both sides.

    Returns:
        ``profile[r]``: the distinct points not dominated by another of rank ``r``. A rank's
        memory at an untagged point is ``sum_s static_s + a_s * activation_s + w_s *
        w_activation_s``; at a tagged one the pair's peak (>= 0) is added. A point is dominated
        by one with the same tag, or by a tagged one, whose counts are all at least its own
        (every coefficient is non-negative).
    """
    sched = compute_schedule(template, pp, vpp, num_microbatches, overlap, split_w)
    out = []
    for r, instrs in enumerate(sched):
        stages = sorted(stage_of(template, r, c, pp, vpp) for c in range(vpp))
        pos = {s: k for k, s in enumerate(stages)}
        a, w = [0] * len(stages), [0] * len(stages)
        points: set[Point] = set()

        def mark(tag: tuple[int, int] | None = None) -> None:
            points.add((tuple(zip(a, w)), tag))

        for i in instrs:
            if i.op == Op.FB:
                mark((stage_of(template, r, i.chunk, pp, vpp), stage_of(template, r, i.chunk2, pp, vpp)))
            if i.op in (Op.F, Op.FB):
                a[pos[stage_of(template, r, i.chunk, pp, vpp)]] += 1
                if i.op == Op.F:
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
        pts = sorted(points, key=lambda p: (p[0], p[1] or (-1, -1)))

        def covers(q: Point, p: Point) -> bool:  # q's value >= p's under every choice
            return (q[1] == p[1] or (p[1] is None and q[1] is not None)) and all(
                x <= y for t, u in zip(p[0], q[0]) for x, y in zip(t, u))

        keep = [p for p in pts if not any(q != p and covers(q, p) for q in pts)]
        out.append(tuple(keep))
    return tuple(out)


def exact_candidate_memory(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], template: str, pp: int,
                           vpp: int, num_microbatches: int, overlap: bool = True, split_w: bool = True,
                           pair_peak: Mapping[Pair, float] | None = None) -> CandidateMemory:
    """:class:`CandidateMemory` with one row per rank and :func:`memory_profile` point (times the
    rank's stages when a layer has an FSDP transient: one row per stage whose candidate's largest
    transient is added), so that a rank's peak under any choice equals the simulator's (and
    :func:`tessera.program.memory.rank_memory_bytes`'s) for the compiled Programs.

    ``pair_peak``: ``(F candidate, B candidate) -> bytes``, the pair's own peak
    (:func:`tessera.program.memory.pair_peak_bytes`) under the order the Programs will run it
    with (the planner's: :attr:`tessera.plan.overlap_graph.PairCosts.pair_peak`; the template's
    fixed order: :func:`fixed_order_pair_peaks`), for every candidate pair of every overlap
    edge; ``None``: the forward's whole activation (an upper bound under any order). ``bytes``
    holds each candidate's largest value over its rank's rows with its largest pair term (its
    stage's own peak: summed over a rank's stages, an upper bound of the rank's peak)."""
    ranks = stage_ranks(template, pp, vpp)
    parts: dict[Candidate, tuple[float, float, float, float]] = {}  # static, activation, W activation, transient
    for stage in candidates:
        for c in stage:
            mems = [costs.layer(i).memory for i in range(c.start, c.stop)]
            parts[c] = (sum(m.static for m in mems), sum(m.activation for m in mems),
                        sum(m.w_activation for m in mems), _transient(costs, c))
    rows: list[tuple[int, dict[Candidate, float]]] = []
    terms: list[dict[Pair, float]] = []
    peak: dict[Candidate, float] = {}
    for r, points in enumerate(memory_profile(template, pp, vpp, num_microbatches, overlap, split_w)):
        stages = sorted(s for s, rr in enumerate(ranks) if rr == r)
        with_transient = any(parts[c][3] > 0 for s in stages for c in candidates[s])
        for vec, tag in points:
            row: dict[Candidate, float] = {}
            for s, (na, nw) in zip(stages, vec):
                for c in candidates[s]:
                    st, act, wact, _ = parts[c]
                    row[c] = st + na * act + nw * wact
            extra: dict[Pair, float] = {}
            if tag is not None:
                f, b = tag
                for cf in candidates[f]:
                    if pair_peak is None:
                        row[cf] += parts[cf][1]
                        continue
                    partners = (cf,) if f == b else candidates[b]
                    vals = {cb: pair_peak[(cf, cb)] for cb in partners}
                    base = min(vals.values())
                    row[cf] += base
                    extra.update({(cf, cb): v - base for cb, v in vals.items() if v > base})
            for s_t in (stages if with_transient else (None,)):
                rr = dict(row)
                if s_t is not None:
                    for c in candidates[s_t]:
                        rr[c] += parts[c][3]
                rows.append((r, rr))
                terms.append(extra)
                for c, v in rr.items():
                    most = max((x for (cf, cb), x in extra.items() if c in (cf, cb)), default=0.0)
                    peak[c] = max(peak.get(c, 0.0), v + most)
    return CandidateMemory(ranks, peak, tuple(rows), tuple(terms))


def fixed_order_pair_peaks(costs: ModelCosts, candidates: Sequence[Sequence[Candidate]], template: str, pp: int,
                           vpp: int, num_microbatches: int, split_w: bool = True) -> dict[Pair, float]:
    """``(F candidate, B candidate) -> bytes``: the own peak of every candidate pair of every
    overlap edge of ``template`` run in the template's fixed order (the baseline's ``FB``
    instructions, :func:`tessera.sched.chunkdag.fixed_order`), for
    :func:`exact_candidate_memory`."""
    with_w = get_template(template).pair_with_w(split_w)
    out: dict[Pair, float] = {}
    for _, f, b in co_executed_pairs(template, pp, vpp, num_microbatches):
        for cf in candidates[f]:
            for cb in ((cf,) if f == b else candidates[b]):
                if (cf, cb) not in out:
                    dag, sched = replay_pair(costs, cf.range, cb.range, with_w)
                    out[(cf, cb)] = pair_peak_bytes(costs, dag, sched, cf.range, cb.range, with_w)
    return out


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
