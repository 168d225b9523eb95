"""Execution engine: runs a rank's Program on torch with pipeline (p2p) and expert-parallel
(all-to-all) communication, plan-agnostic.

Modules: :mod:`~tessera.engine.engine` (:class:`Engine`, :class:`Batch`),
:mod:`~tessera.engine.tasks` (chunk executors), :mod:`~tessera.engine.layer_tasks` (per-layer
task functions), :mod:`~tessera.engine.pairs` (FB task sequences), :mod:`~tessera.engine.pool`
(movable W pool), :mod:`~tessera.engine.p2p`, :mod:`~tessera.engine.exchange` (EP all-to-all),
:mod:`~tessera.engine.groups` (process groups, gradient reduction),
:mod:`~tessera.engine.launch_local` (local launcher), :mod:`~tessera.engine.reference`
(single-process reference), :mod:`~tessera.engine.measured` (measured task costs).
See ``docs/engine.md``.
"""

from tessera.engine.engine import Engine
from tessera.engine.groups import Layout, RankGroups, make_groups, reduce_gradients
from tessera.engine.layer_tasks import TaskKey
from tessera.engine.launch_local import WorkerError, run_local
from tessera.engine.pool import MovablePool, MovableTask, OldestFirst, SlotPolicy
from tessera.engine.reference import ReferenceResult, global_state_dict, reference_train
from tessera.engine.tasks import NoopChunk, TorchChunk
from tessera.engine.values import Batch, EngineError, IterationResult, StepRecord

__all__ = [
    "Batch", "Engine", "EngineError", "IterationResult", "Layout", "MovablePool", "MovableTask", "NoopChunk",
    "OldestFirst", "RankGroups", "ReferenceResult", "SlotPolicy", "StepRecord", "TaskKey", "TorchChunk",
    "WorkerError", "global_state_dict", "make_groups", "reduce_gradients", "reference_train", "run_local",
]
