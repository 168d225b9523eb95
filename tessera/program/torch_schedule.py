"""Programs as a torch.distributed.pipelining schedule: its CSV schedule format.

torch's pipeline runtime (``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``)
reads a schedule from a CSV file: row ``r`` holds pipeline rank ``r``'s actions in the order it
runs them, one per cell, each as ``_Action``'s string: ``{stage}{type}{microbatch}`` with
``stage`` the global virtual stage (``0F3``, ``5I1``, ``2W0``, ``3SEND_F2``, ``1REDUCE_GRAD``),
and an overlapped pair as ``({stage}F{mb};{stage}B{mb})OVERLAP_F_B``. Two forms
(:data:`FORMATS`):

``compute_comms``
    every action, sends and receives included, run as written:
    ``schedule._load_csv(path, format="compute_comms")``.
``compute_only``
    the compute actions only (F, I, B, W, OVERLAP_F_B): ``schedule._load_csv(path)``, what
    torchtitan's ``parallelism.pipeline_parallel_schedule_csv`` reads; torch's lowering then
    inserts its own sends and receives (``_add_send_recv``) and a ``REDUCE_GRAD`` after each
    stage's last backward (``_add_reduce_grad``).

Mapping of a :class:`~tessera.program.instructions.Program` (``s`` = ``Program.stages[chunk].stage``):

===================  ====================================================================
Tessera              torch action
===================  ====================================================================
``F``                ``{s}F{mb}``
``B`` with W         ``{s}B{mb}`` (full backward)
``B``                ``{s}I{mb}`` (backward of the input only; its ``W`` comes later)
``W``                ``{s}W{mb}``
``FB``               ``({s}F{mb};{s2}I{mb2})OVERLAP_F_B`` (``{s2}B{mb2}`` inside when its backward
                     carries W); a torch without ``OVERLAP_F_B``: the two actions in turn,
                     reported in ``unsupported``
``send_act``         ``{s}SEND_F{mb}``; ``recv_act``: ``{s}RECV_F{mb}``
``send_grad``        ``{s}SEND_B{mb}``; ``recv_grad``: ``{s}RECV_B{mb}``
``reduce_grads``     ``{s}REDUCE_GRAD`` for each of the rank's stages, in chunk order
``register_w``       no action: the W runs at its ``W`` action (the movable pool that may run
                     it earlier, in an idle slot, has none)
``slot``             no action (an annotation for the dynamic bubble optimizer)
``optimizer_step``   no action (the training loop steps the optimizer after ``schedule.step()``)
===================  ====================================================================

A send or receive names the stage of the rank that performs it (the sender's stage ``s``, the
receiver's ``s+1`` for an activation and ``s-1`` for a gradient), as torch's ``_add_send_recv``
names them; torch finds the peer from the stage -> rank map it infers from the rows. In
``compute_comms`` the sends and receives follow the order Tessera's engine posts them
(``Program.p2p_batches``, :mod:`tessera.program.exchanges`: a receive as soon as every earlier
operation of the rank is posted, a send at its instruction), so torch's runtime, which posts each
SEND/RECV action when it reaches it, posts them in the engine's order; a Program without batches
keeps its instruction order.

What the format cannot carry: the task order inside an overlapped pair (``pair_orders``; torch's
runtime runs ``OVERLAP_F_B``'s two sub-actions one after the other unless a function is
registered for it, ``register_custom_function(OVERLAP_F_B, fn)``), the movable W pool
(``register_w``: a W runs at its ``W`` action), the DBO's slots, the optimizer step (the
training loop's, after ``schedule.step()``), a point-to-point batch of more than one message
(torch posts each action alone) and the stages' layer ranges (torch's stages are built by the
caller). Torch is imported only by :func:`torch_action_types`.
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from tessera.errors import ProgramError
from tessera.program.instructions import COMM_OPS, Instr, Op, Program
from tessera.program.link_order import link_ops

COMPUTE_COMMS, COMPUTE_ONLY = "compute_comms", "compute_only"
FORMATS = (COMPUTE_COMMS, COMPUTE_ONLY)
"""The two CSV forms torch's ``_PipelineScheduleRuntime._load_csv`` reads (module docstring)."""

ACTION_TYPES = ("F", "I", "B", "W", "OVERLAP_F_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD")
"""The torch action types this export writes, in the order the summary counts them."""

BASE_ACTION_TYPES = frozenset({"F", "I", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"})
"""The action types every torch with ``_PipelineScheduleRuntime`` has; ``OVERLAP_F_B`` and
``REDUCE_GRAD`` came later (:func:`torch_action_types` says whether the installed one has them)."""

_ACTION = re.compile(r"\d+([A-Z_]*[A-Z])\d*")  # stage, type, microbatch of a single action
_COMM = {Op.SEND_ACT: "SEND_F", Op.RECV_ACT: "RECV_F", Op.SEND_GRAD: "SEND_B", Op.RECV_GRAD: "RECV_B"}


def torch_action_types() -> frozenset[str]:
    """The action types (``_ComputationType`` values) of the installed torch's pipeline schedules,
    e.g. ``{"F", "I", "B", "W", "OVERLAP_F_B", "REDUCE_GRAD", "SEND_F", ...}``;
    :data:`BASE_ACTION_TYPES` when ``torch.distributed.pipelining`` cannot be imported."""
    try:
        from torch.distributed.pipelining.schedules import _ComputationType
    except ImportError:
        return BASE_ACTION_TYPES
    return frozenset(t.value for t in _ComputationType)


@dataclass(frozen=True)
class Unexpressed:
    """One instruction the format cannot express as Tessera runs it.

    rank, index: the Program and the instruction's position in it; instruction: its string form
    (``FB(F mb3.c0 | B mb1.c0)``); written: the actions written for it (``("0F3", "0I1")``,
    ``()`` for none); reason: what is lost.
    """

    rank: int
    index: int
    instruction: str
    written: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ScheduleExport:
    """Programs as torch schedule rows, with what the format could not carry.

    Attributes:
        format: ``"compute_comms"`` or ``"compute_only"`` (:data:`FORMATS`).
        rows: per pipeline rank (index = rank), its actions as torch's strings, in order.
        counts: ``(action type, actions written)`` in :data:`ACTION_TYPES` order, types with
            none left out; an ``OVERLAP_F_B`` counts once (its two sub-actions are not counted).
        dropped: ``(Tessera op, instructions)`` written as no action (``register_w``, ``slot``,
            ``optimizer_step``; in ``compute_only`` also the sends, receives and ``reduce_grads``,
            which torch's lowering adds itself), sorted by op.
        unsupported: the instructions written otherwise than Tessera runs them (:class:`Unexpressed`).
        notes: one sentence per limit that applies (overlapped pairs, dropped instructions,
            point-to-point batches).
        path: the CSV file written (``""``: not written).
    """

    format: str
    rows: tuple[tuple[str, ...], ...]
    counts: tuple[tuple[str, int], ...]
    dropped: tuple[tuple[str, int], ...]
    unsupported: tuple[Unexpressed, ...]
    notes: tuple[str, ...]
    path: str = ""

    @property
    def actions(self) -> int:
        """Actions written, all ranks (an ``OVERLAP_F_B`` is one)."""
        return sum(len(r) for r in self.rows)

    def line(self) -> str:
        """One line: the file, its form, rows and actions, and what was not expressed, e.g.
        ``torch schedule out/s.csv (compute_comms): 2 rows, 58 actions (10 F, ...); 6 overlapped
        F&B pairs written as OVERLAP_F_B: ...``."""
        kinds = ", ".join(f"{n} {t}" for t, n in self.counts)
        head = f"torch schedule {self.path or '(not written)'} ({self.format}): {len(self.rows)} rows, " \
               f"{self.actions} actions ({kinds})"
        return "; ".join([head, *self.notes])


def _check(programs: Sequence[Program]) -> dict[int, int]:
    """Stage -> rank of ``programs``; raise ProgramError unless they are one pipeline in rank order."""
    if not programs:
        raise ProgramError(0, None, "no programs to export")
    owner: dict[int, int] = {}
    for i, p in enumerate(programs):
        if p.rank != i or p.pp != len(programs) or p.num_microbatches != programs[0].num_microbatches:
            raise ProgramError(p.rank, None, f"program at position {i} is rank {p.rank} of pp={p.pp} with "
                               f"{p.num_microbatches} microbatches; export one Program per rank, in rank order, "
                               "of one plan (tessera.flow.compile_programs)")
        for s in p.stages:
            owner[s.stage] = p.rank
    return owner


def _compute(ins: Instr, stage: dict[int, int], types: frozenset[str]) -> tuple[str, ...]:
    """The actions of a compute instruction (F, B, W, FB)."""
    if ins.op == Op.F:
        return (f"{stage[ins.chunk]}F{ins.mb}",)
    if ins.op == Op.B:
        return (f"{stage[ins.chunk]}{'B' if ins.with_w else 'I'}{ins.mb}",)
    if ins.op == Op.W:
        return (f"{stage[ins.chunk]}W{ins.mb}",)
    f, b = f"{stage[ins.chunk]}F{ins.mb}", f"{stage[ins.chunk2]}{'B' if ins.with_w else 'I'}{ins.mb2}"
    return (f"({f};{b})OVERLAP_F_B",) if "OVERLAP_F_B" in types else (f, b)


def _comm_rows(p: Program, owner: dict[int, int], stage: dict[int, int],
               actions: list[tuple[str, ...]]) -> list[str]:
    """Rank ``p``'s full row: ``actions[i]`` (the actions of instruction ``i``, ``()`` for sends
    and receives) merged with its sends and receives in posting order (module docstring)."""
    ops = {o.index: o for seq in link_ops(p).values() for o in seq}
    for i, o in ops.items():
        ins = p.instructions[i]
        neighbour = (o.sender_stage + (1 if o.kind == "act" else -1)) if o.send else o.sender_stage
        if owner.get(neighbour) != ins.peer:
            raise ProgramError(p.rank, i, f"{ins} names rank {ins.peer}, but stage {neighbour} is on rank "
                               f"{owner.get(neighbour)}: torch finds the peer from the stage; validate the Programs "
                               "(tessera.program.validate.validate_programs)")
    comm = {i: f"{stage[p.instructions[i].chunk]}{_COMM[p.instructions[i].op]}{p.instructions[i].mb}" for i in ops}
    if not p.p2p_batches:  # no posting order: instruction order
        return [a for i in range(len(p.instructions)) for a in ((comm[i],) if i in comm else actions[i])]
    by_key = {(o.kind, o.mb, o.sender_stage): o.index for o in ops.values()}
    batches: list[tuple[int, list[int]]] = []  # (post after instruction index, its instructions)
    for keys in p.p2p_batches:
        idx = [by_key.get(tuple(k)) for k in keys]
        if None in idx:
            raise ProgramError(p.rank, None, f"p2p batch {[list(k) for k in keys]} names a message the Program does "
                               "not send or receive; recompile the plan (tessera.program.exchanges.with_exchanges)")
        sends = [i for i in idx if ops[i].send]
        batches.append((max(sends) + 1 if sends else 0, idx))
    row: list[str] = []
    posted: set[int] = set()
    k = 0

    def post(pc: int) -> None:
        nonlocal k
        while k < len(batches) and batches[k][0] <= pc:
            row.extend(comm[i] for i in batches[k][1])
            posted.update(batches[k][1])
            k += 1

    post(0)
    for i, acts in enumerate(actions):
        if i in ops and not ops[i].send and i not in posted:
            raise ProgramError(p.rank, i, f"{p.instructions[i]} is not posted before it waits (p2p_batches out of "
                               "order); recompile the plan (tessera.program.exchanges.with_exchanges)")
        row.extend(acts)
        post(i + 1)
    return row


def schedule_export(programs: Sequence[Program], format: str = COMPUTE_COMMS,
                    action_types: frozenset[str] | None = None) -> ScheduleExport:
    """``programs`` (one per pipeline rank, in rank order) as torch schedule rows.

    Args:
        programs: the Programs of one plan (:func:`tessera.flow.compile_programs`).
        format: ``"compute_comms"`` or ``"compute_only"`` (:data:`FORMATS`).
        action_types: the torch action types to write with; None: the installed torch's
            (:func:`torch_action_types`). Without ``OVERLAP_F_B`` an ``FB`` is written as its F
            then its I/B; without ``REDUCE_GRAD``, ``reduce_grads`` as nothing; both are reported
            in ``unsupported``.

    Raises:
        ValueError: ``format`` not in :data:`FORMATS`.
        ProgramError: the Programs are not one pipeline in rank order, a send or receive names
            a peer that does not own the neighbouring stage, or ``p2p_batches`` do not fit the
            instructions (recompile the plan).
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: torch's schedule CSV is one of {', '.join(FORMATS)}")
    types = torch_action_types() if action_types is None else frozenset(action_types)
    owner = _check(programs)
    counts: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    unsupported: list[Unexpressed] = []
    fb = 0
    rows = []
    for p in programs:
        stage = {s.chunk: s.stage for s in p.stages}
        actions: list[tuple[str, ...]] = []
        for i, ins in enumerate(p.instructions):
            acts: tuple[str, ...] = ()
            if ins.op in (Op.F, Op.B, Op.W, Op.FB):
                acts = _compute(ins, stage, types)
                if ins.op == Op.FB:
                    fb += 1
                    if len(acts) == 2:
                        unsupported.append(Unexpressed(p.rank, i, str(ins), acts, "this torch has no OVERLAP_F_B "
                                                       "action: written as F then the backward, run back to back"))
            elif ins.op == Op.REDUCE_GRADS and format == COMPUTE_COMMS:
                if "REDUCE_GRAD" in types:
                    acts = tuple(f"{s.stage}REDUCE_GRAD" for s in p.stages)
                else:
                    unsupported.append(Unexpressed(p.rank, i, str(ins), (), "this torch has no REDUCE_GRAD action"))
            elif not (ins.op in COMM_OPS and format == COMPUTE_COMMS):
                dropped[ins.op.value] += 1
            actions.append(acts)
        row = _comm_rows(p, owner, stage, actions) if format == COMPUTE_COMMS else [a for x in actions for a in x]
        counts.update("OVERLAP_F_B" if a.startswith("(") else _ACTION.fullmatch(a).group(1) for a in row)
        rows.append(tuple(row))
    notes = []
    pairs = f"{fb} overlapped F&B pair{'' if fb == 1 else 's'}"
    if fb and "OVERLAP_F_B" in types:
        notes.append(f"{pairs} written as OVERLAP_F_B: torch's runtime runs the two sub-actions back to back unless a "
                     "function is registered for OVERLAP_F_B (their task order is not in the format)")
    elif fb:
        notes.append(f"{pairs} written as F then I/B: this torch has no OVERLAP_F_B, it runs them back to back")
    if any(u.instruction == "reduce_grads" for u in unsupported):
        notes.append("reduce_grads written as nothing: this torch has no REDUCE_GRAD action")
    if dropped:
        notes.append("not actions: " + ", ".join(f"{n} {op}" for op, n in sorted(dropped.items())))
    if format == COMPUTE_COMMS and any(len(b) > 1 for p in programs for b in p.p2p_batches):
        notes.append("p2p batches of several messages written as one SEND/RECV action each (torch posts each alone)")
    return ScheduleExport(format, tuple(rows), tuple((t, counts[t]) for t in ACTION_TYPES if counts[t]),
                          tuple(sorted(dropped.items())), tuple(unsupported), tuple(notes))


Rows = tuple[tuple[str, ...], ...]
"""Per pipeline rank (index = rank), its torch action strings in order."""


def torch_actions(programs: Sequence[Program], format: str = COMPUTE_COMMS,
                  action_types: frozenset[str] | None = None) -> tuple[Rows, tuple[Unexpressed, ...]]:
    """``(rows, unsupported)`` of :func:`schedule_export`: per rank its torch action strings, and
    the instructions not expressed as Tessera runs them. Raises as :func:`schedule_export`."""
    e = schedule_export(programs, format, action_types)
    return e.rows, e.unsupported


def write_csv(path: str, programs: Sequence[Program], format: str = COMPUTE_COMMS,
              action_types: frozenset[str] | None = None) -> ScheduleExport:
    """Write ``programs`` to ``path`` in torch's schedule CSV (module docstring), as torch's
    ``_dump_csv`` writes one: ``csv.writer`` rows, rank 0 first, one action string per cell.

    Returns the :class:`ScheduleExport` with ``path`` set (counts, what was not expressible).

    Raises:
        OSError: ``path`` cannot be written.
        ValueError, ProgramError: as :func:`schedule_export`.
    """
    e = schedule_export(programs, format, action_types)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for row in e.rows:
            w.writerow(row)
    return replace(e, path=str(path))
