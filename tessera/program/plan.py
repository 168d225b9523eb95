"""Plans: a partition of the layers into virtual stages, a template, and per-pair task orders."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tessera.program.instructions import Instr, Op, PairOrder


@dataclass(frozen=True)
class Partition:
    """Contiguous layer ranges of the virtual stages, over *extended* layer indices.

    ``bounds`` has ``num_stages + 1`` entries; stage ``s`` holds extended layers
    ``[bounds[s], bounds[s+1])``. Extended index -1 is the embedding and ``num_layers`` the head,
    so ``bounds[0] == -1`` and ``bounds[-1] == num_layers + 1``: every layer, the embedding and
    the head are placed exactly once.
    """

    bounds: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_range(self, s: int) -> tuple[int, int]:
        return self.bounds[s], self.bounds[s + 1]

    def num_decoder_layers(self, s: int) -> int:
        """Decoder layers in stage ``s`` (embedding and head not counted)."""
        a, b = self.stage_range(s)
        n_layers = self.bounds[-1] - 1
        return len([i for i in range(a, b) if 0 <= i < n_layers])

    def sizes(self) -> tuple[int, ...]:
        return tuple(self.num_decoder_layers(s) for s in range(self.num_stages))

    def describe(self) -> str:
        """e.g. ``"S0[emb,0-5] S1[6-11] ... S15[42-47,head]"``."""
        n = self.bounds[-1] - 1
        out = []
        for s in range(self.num_stages):
            a, b = self.stage_range(s)
            parts = []
            if a <= -1 < b:
                parts.append("emb")
            lo, hi = max(a, 0), min(b, n) - 1
            if lo <= hi:
                parts.append(f"{lo}-{hi}" if hi > lo else f"{lo}")
            if a <= n < b:
                parts.append("head")
            out.append(f"S{s}[{','.join(parts)}]")
        return " ".join(out)


@dataclass(frozen=True)
class Plan:
    """Everything the compiler needs to produce Programs.

    Attributes:
        name: ``"baseline"`` or ``"tessera"`` (provenance only).
        template: ``1f1b`` | ``interleaved-1f1b`` | ``dualpipe-v``.
        pp, vpp, num_microbatches: pipeline shape.
        partition: the stage layer ranges (``pp * vpp`` stages).
        overlap: co-execute F and B chunks in the steady state (FB instructions).
        split_w: W runs as separate, deferrable instructions.
        pair_orders: task orders for the overlapped pairs; pairs not listed use the fixed order.
        schedule: per rank, its compute instructions (``F``, ``B``, ``W``, ``FB``, ``register_w``)
            in execution order, as written by the schedule synthesizer
            (:mod:`tessera.plan.synthesis`); the compiler lowers them instead of the template's
            order. Empty (the default): the template's order
            (:func:`tessera.program.templates.compute_schedule`). The template still places the
            stages on ranks and names the order the synthesis started from.
    """

    name: str
    template: str
    pp: int
    vpp: int
    num_microbatches: int
    partition: Partition
    overlap: bool = True
    split_w: bool = True
    pair_orders: tuple[PairOrder, ...] = field(default=())
    schedule: tuple[tuple[Instr, ...], ...] = field(default=())

    @property
    def synthesized(self) -> bool:
        """The plan carries its own instruction order (:attr:`schedule`), not the template's."""
        return bool(self.schedule)

    def to_dict(self) -> dict:
        """JSON-ready dict (inverse: :meth:`from_dict`)."""
        d = asdict(self)
        d["partition"] = {"bounds": list(self.partition.bounds), "describe": self.partition.describe()}
        d["pair_orders"] = [{"f_stage": o.f_stage, "b_stage": o.b_stage, "with_w": o.with_w,
                             "overlapped": o.overlapped, "order": [[r, list(ids)] for r, ids in o.order]}
                            for o in self.pair_orders]
        if self.schedule:
            d["schedule"] = [[i.to_dict() for i in rank] for rank in self.schedule]
        else:  # a template plan reads and hashes as before the field existed
            d.pop("schedule")
        return d

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        orders = tuple(PairOrder(o["f_stage"], o["b_stage"], o["with_w"],
                                 tuple((r, tuple(ids)) for r, ids in o["order"]), o.get("overlapped", True))
                       for o in d.get("pair_orders", ()))
        schedule = tuple(tuple(Instr.from_dict(i) for i in rank) for rank in d.get("schedule", ()))
        return Plan(d["name"], d["template"], d["pp"], d["vpp"], d["num_microbatches"],
                    Partition(tuple(d["partition"]["bounds"])), d.get("overlap", True), d.get("split_w", True), orders,
                    schedule)


def with_split_w(plan: Plan, fb_keeps_w: bool = False) -> Plan:
    """``plan`` with W split off its backwards (``split_w=True``, the bubble optimizer's
    precondition). A template plan only changes the flag (the template splits W); in a
    synthesized :attr:`Plan.schedule` every ``B`` that carries W, and every ``FB`` unless
    ``fb_keeps_w`` (the template keeps W inside its pairs, e.g. DualPipeV), gets ``with_w=False``
    followed by ``register_w`` and its ``W`` right after: the order a template's steady state
    gives, whose W the optimizer may then move. Per chunk the W's keep their microbatch order."""
    if not plan.schedule or plan.split_w:
        return replace(plan, split_w=True)
    out = []
    for instrs in plan.schedule:
        rank: list[Instr] = []
        for ins in instrs:
            if ins.with_w and (ins.op == Op.B or (ins.op == Op.FB and not fb_keeps_w)):
                mb, c = (ins.mb, ins.chunk) if ins.op == Op.B else (ins.mb2, ins.chunk2)
                rank += [replace(ins, with_w=False), Instr(Op.REGISTER_W, mb=mb, chunk=c), Instr(Op.W, mb=mb, chunk=c)]
            else:
                rank.append(ins)
        out.append(tuple(rank))
    return replace(plan, split_w=True, schedule=tuple(out))
