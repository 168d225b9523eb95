"""Frozen values the engine takes and returns: :class:`Batch`, :class:`StepRecord`,
:class:`IterationResult`; and :class:`EngineError`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class EngineError(RuntimeError):
    """The engine cannot run a Program as given (the message names the rank and instruction)."""


@dataclass(frozen=True, eq=False)
class Batch:
    """One replica's data for one iteration: ``input_ids`` and ``labels``, int64
    ``[num_microbatches, micro_batch_size, seq_length]`` (every rank of the pipeline gets the same
    batch; only the first / last stage read it).

    Raises:
        ValueError: not 3-d, or labels and input_ids differ in shape.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 3:
            raise ValueError(f"input_ids must be [num_microbatches, micro_batch_size, seq_length], got shape "
                             f"{tuple(self.input_ids.shape)}")
        if self.labels.shape != self.input_ids.shape:
            raise ValueError(f"labels have shape {tuple(self.labels.shape)} but input_ids have "
                             f"{tuple(self.input_ids.shape)}; both must be [num_microbatches, micro_batch_size, "
                             "seq_length]")

    @staticmethod
    def from_tokens(tokens: torch.Tensor) -> "Batch":
        """Next-token batch from ``tokens [M, mbs, S + 1]``."""
        return Batch(tokens[..., :-1], tokens[..., 1:])


@dataclass(frozen=True)
class StepRecord:
    """What one :meth:`Engine.advance` ran: instruction ``index`` and ``op``, ``task`` name
    (e.g. ``"F.L3.dispatch"``, ``"W(mb0.c1)"`` or the instruction text), its ``mb`` and
    ``chunk`` (-1 if none) and wall time ``ms``."""

    index: int
    op: str
    task: str
    mb: int = -1
    chunk: int = -1
    ms: float = 0.0


@dataclass(frozen=True)
class IterationResult:
    """``loss``: mean microbatch loss (ranks with the head; else None); ``steps`` run;
    ``wall_ms``; ``profile``: every step (empty unless the engine profiles); ``idle_ms``: time
    blocked waiting for pipeline receives (the rank's bubble, measured around each wait with or
    without ``profile``); ``slot_ms``: time running the movable work a slot policy chose at ``slot`` steps (the W moved
    there; not the policy's own decisions nor the count exchanges it asks for), ms;
    ``a2a_wait_ms``: time blocked waiting for the rank's expert-parallel all-to-alls (dispatch,
    combine and their gradients: the all-to-all time compute did not hide), ms, or None when no
    chunk of the rank exchanges rows (no EP); ``host_syncs``: host synchronisations the rank's
    torch chunks made in the iteration (reads of device values on the host: one per MoE layer
    and microbatch, the route plan, :mod:`tessera.model.ep.plan`; a recomputed router reads
    nothing), counted the same on CPU, where they cost nothing."""

    loss: float | None
    steps: int
    wall_ms: float
    profile: tuple[StepRecord, ...] = ()
    idle_ms: float = 0.0
    slot_ms: float = 0.0
    a2a_wait_ms: float | None = None
    host_syncs: int = 0
