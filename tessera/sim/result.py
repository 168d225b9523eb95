"""What the simulator returns: per-task intervals, per-instruction spans and iteration metrics.

All times are milliseconds from the start of the iteration; memory is in GB (1e9 bytes).
Every value is a frozen dataclass and :meth:`SimResult.to_dict` gives a JSON-serialisable dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TaskEvent:
    """One executed task.

    Attributes:
        rank: pipeline rank that ran it.
        resource: ``"compute"``, ``"ep_comm"`` or ``"pp_comm"`` (:class:`tessera.spec.tasks.Resource` value).
        name: task name from the DAG, e.g. ``"F.L3.dispatch"``.
        kind: :class:`tessera.spec.tasks.TaskKind` value, e.g. ``"expert"``.
        phase: ``"F"``, ``"B"`` or ``"W"``.
        mb, chunk: microbatch and local chunk the task belongs to.
        start_ms, end_ms: absolute interval, ms.
        instr: index of the instruction that ran it on ``rank``.
        flops: model FLOPs of the task.
    """

    rank: int
    resource: str
    name: str
    kind: str
    phase: str
    mb: int
    chunk: int
    start_ms: float
    end_ms: float
    instr: int = -1
    flops: float = 0.0


@dataclass(frozen=True)
class InstrSpan:
    """One executed instruction: ``start_ms`` is when the previous instruction of the rank ended,
    ``end_ms`` when this one ended (for receives: when the data had arrived; for ``reduce_grads``:
    when the rank's gradient reduce-scatters had finished; ``optimizer_step`` lasts the
    optimizer's time; sends and annotations take zero time)."""

    rank: int
    index: int
    op: str
    text: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer on the directed link ``(src, dst)``.

    Attributes:
        kind: ``"act"`` or ``"grad"``.
        mb: microbatch.
        src_stage: virtual stage of the sender (the match key together with kind and mb).
        issue_ms: when the sender issued it; start_ms/end_ms: when it occupied the link (end = arrival).
    """

    kind: str
    mb: int
    src_stage: int
    src: int
    dst: int
    issue_ms: float
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Collective:
    """One data-parallel collective on ``rank``'s data-parallel link (:mod:`tessera.sim.dpsync`):
    ``kind`` ``"all_gather"`` (parameters) or ``"reduce_scatter"`` (gradients) of local ``chunk``,
    charged to instruction ``instr``; ``start_ms``/``end_ms`` its interval."""

    rank: int
    kind: str
    chunk: int
    instr: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class SlotMark:
    """A ``slot`` or ``register_w`` annotation reached at ``time_ms``."""

    rank: int
    index: int
    op: str
    mb: int
    chunk: int
    time_ms: float


@dataclass(frozen=True)
class RankMetrics:
    """Per-rank metrics.

    Attributes:
        rank: pipeline rank.
        end_ms: end of the rank's last instruction, ms.
        busy_ms: compute time of compute instructions (F, B, W, FB: their task DAGs' makespans), ms.
        idle_ms: ``iteration_ms - busy_ms - dp_exposed_ms - optimizer_ms``: the pipeline bubble
            (waiting for receives, and after the rank's end), ms.
        exposed_a2a_ms: time during which the rank's EP_COMM resource is busy and its COMPUTE
            resource idle, ms.
        peak_mem_gb: static memory of the rank's layers plus the peak of live activations, GB.
        static_mem_gb: the static part alone, GB.
        flops: model FLOPs of all tasks the rank executed.
        dp_exposed_ms: data-parallel collective time not hidden by compute: compute instructions
            lasting past their makespan for a parameter all-gather, and ``reduce_grads`` waiting
            for gradient reduce-scatters, ms. Neither busy nor idle.
        optimizer_ms: the ``optimizer_step``, ms. Neither busy nor idle.
    """

    rank: int
    end_ms: float
    busy_ms: float
    idle_ms: float
    exposed_a2a_ms: float
    peak_mem_gb: float
    static_mem_gb: float
    flops: float
    dp_exposed_ms: float = 0.0
    optimizer_ms: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """Outcome of simulating one iteration of a set of Programs.

    Attributes:
        pp: number of ranks.
        iteration_ms: the largest ``end_ms`` over ranks, ms.
        ranks: per-rank metrics, indexed by rank.
        bubble_ratio: ``sum(idle_ms) / (pp * iteration_ms)`` (pipeline idle only: exposed
            data-parallel and optimizer time are not bubble).
        exposed_a2a_ratio: ``sum(exposed_a2a_ms) / (pp * iteration_ms)``.
        mfu: ``sum(flops) / (pp * iteration_s * peak_flops)``.
        events: every executed task.
        spans: every executed instruction.
        transfers: every point-to-point transfer.
        marks: slot / register_w annotations.
        template, plan_name: provenance copied from the Programs.
        collectives: every data-parallel collective.
    """

    pp: int
    iteration_ms: float
    ranks: tuple[RankMetrics, ...]
    bubble_ratio: float
    exposed_a2a_ratio: float
    mfu: float
    events: tuple[TaskEvent, ...]
    spans: tuple[InstrSpan, ...]
    transfers: tuple[Transfer, ...] = ()
    marks: tuple[SlotMark, ...] = ()
    template: str = ""
    plan_name: str = ""
    collectives: tuple[Collective, ...] = ()

    @property
    def peak_mem_gb(self) -> float:
        """Largest per-rank peak memory, GB."""
        return max((r.peak_mem_gb for r in self.ranks), default=0.0)

    def rank_spans(self, rank: int) -> tuple[InstrSpan, ...]:
        """Instruction spans of ``rank`` in program order."""
        return tuple(s for s in self.spans if s.rank == rank)

    def rank_events(self, rank: int) -> tuple[TaskEvent, ...]:
        """Task events of ``rank`` in execution order."""
        return tuple(e for e in self.events if e.rank == rank)

    def summary(self) -> str:
        """One line: iteration, bubble, exposed A2A, MFU, peak memory."""
        return (f"iteration {self.iteration_ms:.3f} ms, bubble {self.bubble_ratio:.1%}, "
                f"exposed A2A {self.exposed_a2a_ratio:.1%}, MFU {self.mfu:.1%}, peak mem {self.peak_mem_gb:.2f} GB")

    def to_dict(self) -> dict:
        """JSON-serialisable dict of every field."""
        return {
            "pp": self.pp, "iteration_ms": self.iteration_ms, "bubble_ratio": self.bubble_ratio,
            "exposed_a2a_ratio": self.exposed_a2a_ratio, "mfu": self.mfu,
            "template": self.template, "plan_name": self.plan_name,
            "ranks": [asdict(r) for r in self.ranks],
            "events": [asdict(e) for e in self.events],
            "spans": [asdict(s) for s in self.spans],
            "transfers": [asdict(t) for t in self.transfers],
            "marks": [asdict(m) for m in self.marks],
            "collectives": [asdict(c) for c in self.collectives],
        }
