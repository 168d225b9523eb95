"""The same stages under ``torch.distributed.pipelining``: an independent pipeline to compare with.

:func:`torch_schedule` wraps this rank's :class:`~tessera.model.StageModule` s (the Program's
chunks, same layer ranges and weights) as ``PipelineStage`` s of one of torch's schedules
(``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``), with plain
autograd per stage and the MoE layers' synchronous all-to-alls; :func:`torch_step` runs one
iteration on a :class:`~tessera.engine.Batch` (gradients summed over microbatches and divided by
``M`` by the schedule, as Tessera's reduction does before its data-parallel sum). Used by
``benchmarks/vs_torch_pp.py``, ``benchmarks/engine.py`` and the independent-reference test.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from tessera.engine import Batch
from tessera.model import StageModule
from tessera.program.instructions import Program

SCHEDULES = ("1f1b", "interleaved-1f1b", "interleaved-zb")


class PipeChunk(torch.nn.Module):
    """A StageModule as a torch.distributed.pipelining stage: ``[B, S]`` ids or ``[B, S, H]`` ->
    ``[B, S, H]``, the head stage returns logits ``[B, S, V]`` (the loss is the schedule's)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        if s.embed is not None:
            x = s.embed(x)
        for layer in s.layers:
            x = layer(x)
        return s.head.logits(x) if s.head is not None else x


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def torch_schedule(program: Program, modules: Sequence[StageModule], group, micro_batch_size: int, seq: int,
                   kind: str = "interleaved-1f1b"):
    """torch's ``kind`` schedule over this rank's ``modules`` (one per ``program.stages`` entry,
    in chunk order) on the pipeline process group ``group``.

    Raises:
        ValueError: unknown ``kind``, or ``1f1b`` with more than one stage per rank.
    """
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    if kind not in SCHEDULES:
        raise ValueError(f"unknown torch schedule {kind!r}; use one of {SCHEDULES}")
    model = modules[0].model_spec
    device = next(modules[0].parameters()).device
    stages = []
    for st, m in zip(program.stages, modules):
        first, last = st.start == -1, st.stop == model.num_layers + 1
        x = (torch.zeros(micro_batch_size, seq, dtype=torch.int64, device=device) if first
             else torch.zeros(micro_batch_size, seq, model.hidden, requires_grad=True, device=device))
        y = torch.zeros(micro_batch_size, seq, model.vocab if last else model.hidden, requires_grad=True,
                        device=device)
        stages.append(PipelineStage(PipeChunk(m), st.stage, program.num_stages, device, input_args=x,
                                    output_args=y, group=group))
    m = program.num_microbatches
    if kind == "1f1b":
        if len(stages) != 1:
            raise ValueError(f"Schedule1F1B runs one stage per rank; this rank has {len(stages)}")
        return Schedule1F1B(stages[0], n_microbatches=m, loss_fn=_loss)
    cls = ScheduleInterleaved1F1B if kind == "interleaved-1f1b" else ScheduleInterleavedZeroBubble
    return cls(stages, n_microbatches=m, loss_fn=_loss)


def torch_step(schedule, batch: Batch, pipeline_rank: int, pp: int) -> None:
    """One iteration of ``schedule`` on ``batch`` (``input_ids``, ``labels``: ``[M, mbs, S]``):
    rank 0 feeds the ids, the last rank the labels (torch splits ``[M * mbs, S]`` into ``M``)."""
    seq = batch.input_ids.shape[-1]
    ids, labels = batch.input_ids.reshape(-1, seq), batch.labels.reshape(-1, seq)
    kw = {"target": labels} if pipeline_rank == pp - 1 else {}
    if pipeline_rank == 0:
        schedule.step(ids, **kw)
    else:
        schedule.step(**kw)
