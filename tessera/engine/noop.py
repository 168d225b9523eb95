"""A chunk executor with the task lists and protocol of :class:`~tessera.engine.tasks.TorchChunk`
and no work: the engine's own overhead (``benchmarks/engine.py``, ``benchmarks/vs_torch_pp.py``)."""

from __future__ import annotations

import torch

from tessera.cost.types import TaskKey
from tessera.engine.segments import BackwardRuns, backward_runs
from tessera.engine.tasks import TorchChunk


class NoopChunk:
    """Same task lists and protocol as :class:`TorchChunk`, no work (engine-overhead runs).
    ``model_spec`` (optional) gives the engine the task structure of ``FB`` pairs."""

    def __init__(self, keys: dict[str, tuple[TaskKey, ...]], start: int, stop: int, model_spec=None) -> None:
        self._keys, self.start, self.stop, self.model_spec = keys, start, stop, model_spec
        self._dummy = torch.zeros(())

    @staticmethod
    def like(chunk: TorchChunk) -> "NoopChunk":
        return NoopChunk({p: chunk.task_keys(p) for p in "FBW"}, chunk.start, chunk.stop, chunk.model_spec)

    def task_keys(self, phase: str) -> tuple[TaskKey, ...]:
        return self._keys[phase]

    comm = False

    def runs_for(self, order, breaks_before) -> BackwardRuns:
        return backward_runs(tuple(order), tuple(breaks_before), False)

    def lone_runs(self) -> BackwardRuns:
        return self.runs_for(self._keys["B"], [False] * len(self._keys["B"]))

    def fuses(self, mb) -> bool:  # every task is its own step (TorchChunk.fuses)
        return False

    def begin_forward(self, mb, source, labels, runs=None, defer_w=None) -> None:
        pass

    def output_ready(self, mb) -> bool:
        return True

    def begin_backward(self, mb, source, defer_w) -> None:
        pass

    def run(self, key, mb) -> None:
        pass

    def output(self, mb):
        return self._dummy

    def loss(self, mb):
        return None

    def pop_input_grad(self, mb):
        return self._dummy

    def w_pending(self, mb) -> bool:
        return False

    def run_w(self, mb, key=None) -> int:
        return 0

    def end_iteration(self) -> dict:
        return {}

    def parameters(self):
        return iter(())
