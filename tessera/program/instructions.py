"""Programs: what one pipeline rank executes in one iteration.

A :class:`Program` is a frozen, JSON-serialisable, versioned list of :class:`Instr`. The same
Program feeds the simulator and the engine; neither needs to know which plan produced it.

Instruction set (``Op``):

====================  =====================================================================
``recv_act``          wait for the activation of (mb, chunk) from ``peer`` (blocking)
``send_act``          send the output activation of (mb, chunk) to ``peer`` (asynchronous)
``recv_grad``         wait for the output gradient of (mb, chunk) from ``peer`` (blocking)
``send_grad``         send the input gradient of (mb, chunk) to ``peer`` (asynchronous)
``F``                 forward of (mb, chunk)
``B``                 input-gradient backward of (mb, chunk); ``with_w``: W runs inside too
``W``                 weight-gradient backward of (mb, chunk)
``FB``                forward of (mb, chunk) overlapped with backward of (mb2, chunk2) using
                      task order ``pair_orders[order]`` (-1: the template's fixed order)
``register_w``        hand the W of (mb, chunk) to the movable pool; it must run before the
                      matching ``W`` instruction (its deadline), where it runs if still pending
``slot``              annotation: routing skew may leave an idle slot here (filled by the DBO);
                      ``resource`` and ``cause`` say which wait (:mod:`tessera.program.slots`)
``reduce_grads``      data-parallel / expert-parallel gradient reduction
``optimizer_step``    optimizer step (ends the iteration)
====================  =====================================================================

Send and receive pair up by (kind, mb, virtual stage): the sender of ``send_act`` for stage s
matches the ``recv_act`` of stage s+1 on ``peer``. Sends never block; receives do.

Format version 2 (:data:`FORMAT_VERSION`): a :class:`PairOrder` names its tasks (``"F.L3.dispatch"``,
names of :func:`tessera.sched.structure.pair_structure`), so a Program is read without a cost
model. Version 1 listed task ids; reading it raises ``ValueError`` saying to plan again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

FORMAT_VERSION = 2
REPLAN = "re-run `tessera plan` to write the plan again"


class Op(str, Enum):
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"
    F = "F"
    B = "B"
    W = "W"
    FB = "FB"
    REGISTER_W = "register_w"
    SLOT = "slot"
    REDUCE_GRADS = "reduce_grads"
    OPTIMIZER_STEP = "optimizer_step"


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.W, Op.FB})
COMM_OPS = frozenset({Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD})


@dataclass(frozen=True)
class Instr:
    """One instruction. Unused fields stay at -1 / False.

    mb, chunk: microbatch and local chunk (0..vpp-1) it acts on (for ``FB``: the forward side).
    mb2, chunk2: for ``FB``, the backward side.
    peer: for send/recv, the other rank.
    with_w: for ``B``/``FB``, W tasks of the backward run inside this instruction.
    order: for ``FB``, index into ``Program.pair_orders``; -1 = the fixed template order.
    resource, cause: for ``slot``, the resource whose wait may leave the compute stream idle
        (``"ep_comm"``, ``"pp_comm"``) and why (:data:`tessera.program.slots.CAUSES`); ``""``
        on other instructions and on slots written before these fields existed (omitted from
        JSON when empty, so older Programs read and hash as before).
    """

    op: Op
    mb: int = -1
    chunk: int = -1
    mb2: int = -1
    chunk2: int = -1
    peer: int = -1
    with_w: bool = False
    order: int = -1
    resource: str = ""
    cause: str = ""

    def __str__(self) -> str:
        o = self.op
        if o in COMM_OPS:
            arrow = "->" if o in (Op.SEND_ACT, Op.SEND_GRAD) else "<-"
            return f"{o.value}(mb{self.mb}.c{self.chunk} {arrow} r{self.peer})"
        if o == Op.FB:
            w = "+W" if self.with_w else ""
            return f"FB(F mb{self.mb}.c{self.chunk} | B{w} mb{self.mb2}.c{self.chunk2}" + (
                f" order#{self.order})" if self.order >= 0 else ")")
        if o == Op.SLOT and self.cause:
            side = f" | mb{self.mb2}.c{self.chunk2}" if self.mb2 >= 0 else ""
            peer = f" <- r{self.peer}" if self.peer >= 0 else ""
            return f"slot(mb{self.mb}.c{self.chunk}{side}{peer} {self.resource}:{self.cause})"
        if o in (Op.F, Op.B, Op.W, Op.REGISTER_W, Op.SLOT):
            w = "+W" if (o == Op.B and self.with_w) else ""
            return f"{o.value}{w}(mb{self.mb}.c{self.chunk})"
        return o.value

    def to_dict(self) -> dict:
        d = {"op": self.op.value}
        for k, v in asdict(self).items():
            if k != "op" and v != Instr.__dataclass_fields__[k].default:
                d[k] = v
        return d

    @staticmethod
    def from_dict(d: dict) -> "Instr":
        d = dict(d)
        return Instr(op=Op(d.pop("op")), **d)


@dataclass(frozen=True)
class StageRef:
    """A local chunk of a rank: its global virtual stage and extended layer range [start, stop)
    (-1 = embedding, num_layers = head)."""

    chunk: int
    stage: int
    start: int
    stop: int


@dataclass(frozen=True)
class PairOrder:
    """Per-resource task order of one overlapped pair: ``order`` is ``((resource value, (task
    name, ...)), ...)``, e.g. ``(("compute", ("F.L3.mixer", "B.L7.expert", ...)), ("ep_comm",
    (...)))``, names as in :func:`tessera.sched.structure.pair_structure` (unique within a pair);
    ``f_stage``/``b_stage`` say which pair it is for.

    ``overlapped=False`` runs the pair without reserving SMs for communication (compute at full
    speed, ``pair_dag(..., slowdown=1.0)``): the planner chooses it where overlapping costs more
    than it hides (e.g. a head stage with no all-to-all to hide).

    Raises:
        ValueError: ``order`` lists task ids instead of names (a format-1 plan or Program).
    """

    f_stage: int
    b_stage: int
    with_w: bool
    order: tuple[tuple[str, tuple[str, ...]], ...]
    overlapped: bool = True

    def __post_init__(self) -> None:
        for r, names in self.order:
            if not isinstance(r, str) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"pair order (F S{self.f_stage}, B S{self.b_stage}) lists task ids, not task names "
                                 f"(Program format 1); {REPLAN}")


@dataclass(frozen=True)
class Program:
    """What ``rank`` runs in one iteration.

    Attributes:
        rank: pipeline rank (0..pp-1).
        pp, vpp, num_microbatches: the shape it was compiled for.
        num_stages: total virtual stages (pp * vpp).
        stages: local chunks, indexed by chunk.
        instructions: the instruction list.
        pair_orders: task orders referenced by ``FB`` instructions.
        template, plan_name: provenance (informational only; the engine ignores them).
        version: Program format version.
        p2p_batches: the point-to-point messages grouped as both ends of each link post them, in
            this rank's posting order; each batch is the ``(kind, mb, sender stage)`` keys of one
            link's messages (:mod:`tessera.program.exchanges`; the compiler sets it, the
            validator checks it). Empty: not grouped (every operation posted alone: gloo only).
    """

    rank: int
    pp: int
    vpp: int
    num_microbatches: int
    num_stages: int
    stages: tuple[StageRef, ...]
    instructions: tuple[Instr, ...]
    pair_orders: tuple[PairOrder, ...] = ()
    template: str = ""
    plan_name: str = ""
    version: int = FORMAT_VERSION
    p2p_batches: tuple[tuple[tuple[str, int, int], ...], ...] = ()

    def to_dict(self) -> dict:
        return {
            "version": self.version, "rank": self.rank, "pp": self.pp, "vpp": self.vpp,
            "num_microbatches": self.num_microbatches, "num_stages": self.num_stages,
            "template": self.template, "plan_name": self.plan_name,
            "stages": [asdict(s) for s in self.stages],
            "pair_orders": [{"f_stage": p.f_stage, "b_stage": p.b_stage, "with_w": p.with_w,
                             "overlapped": p.overlapped,
                             "order": [[r, list(ids)] for r, ids in p.order]} for p in self.pair_orders],
            "instructions": [i.to_dict() for i in self.instructions],
            "p2p_batches": [[list(k) for k in b] for b in self.p2p_batches],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict) -> "Program":
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"Program format version {d.get('version')!r} is not supported (this Tessera reads "
                             f"version {FORMAT_VERSION}); {REPLAN}")
        return Program(
            rank=d["rank"], pp=d["pp"], vpp=d["vpp"], num_microbatches=d["num_microbatches"],
            num_stages=d["num_stages"], stages=tuple(StageRef(**s) for s in d["stages"]),
            instructions=tuple(Instr.from_dict(i) for i in d["instructions"]),
            pair_orders=tuple(PairOrder(p["f_stage"], p["b_stage"], p["with_w"],
                                        tuple((r, tuple(ids)) for r, ids in p["order"]),
                                        p.get("overlapped", True)) for p in d["pair_orders"]),
            template=d.get("template", ""), plan_name=d.get("plan_name", ""), version=d["version"],
            p2p_batches=tuple(tuple((str(k[0]), int(k[1]), int(k[2])) for k in b) for b in d.get("p2p_batches", ())),
        )

    @staticmethod
    def from_json(s: str) -> "Program":
        return Program.from_dict(json.loads(s))

    @property
    def content_hash(self) -> str:
        """SHA-256 (first 16 hex digits) of the canonical JSON form."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def __str__(self) -> str:
        head = (f"Program v{self.version} rank {self.rank}/{self.pp} vpp={self.vpp} M={self.num_microbatches} "
                f"[{self.template} {self.plan_name}] #{self.content_hash}")
        st = "  stages: " + ", ".join(f"c{s.chunk}=S{s.stage}[{s.start},{s.stop})" for s in self.stages)
        body = [f"  {k:4d}  {ins}" for k, ins in enumerate(self.instructions)]
        return "\n".join([head, st, *body])
