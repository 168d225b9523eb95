"""Execution engine: the runtime only. Runs a rank's Program on torch with pipeline (p2p) and
expert-parallel (all-to-all) communication, plan-agnostic.

Modules: :mod:`~tessera.engine.engine` (:class:`Engine`, :class:`Batch`),
:mod:`~tessera.engine.tasks` (chunk executors over the layer task split of
:mod:`tessera.model.tasks`; their EP all-to-alls are the asynchronous front of
:mod:`tessera.model.ep`), :mod:`~tessera.engine.pairs` (FB task sequences),
:mod:`~tessera.engine.pool` (movable W pool), :mod:`~tessera.engine.p2p`,
:mod:`~tessera.engine.groups` (process groups, gradient reduction), :mod:`~tessera.engine.hooks` (the hooks ``Engine.advance()`` calls). Run-time features (bubble optimizer, profiler, plan upgrade) plug into the
engine's hooks and slot policy. The local multi-process launcher and the single-process bitwise
reference are test tools in :mod:`tessera.testing`; measured task costs are a cost source in
:mod:`tessera.cost.measured`. See ``docs/engine.md``.
"""

from tessera.engine.engine import Engine
from tessera.engine.hooks import HookList, Hooks
from tessera.engine.groups import Layout, RankGroups, make_groups, reduce_gradients
from tessera.engine.pool import MovablePool, MovableTask, MovableUnit, OldestFirst, SlotPolicy
from tessera.engine.noop import NoopChunk
from tessera.engine.tasks import TorchChunk
from tessera.engine.values import Batch, EngineError, IterationResult, StepRecord

__all__ = [
    "Batch", "Engine", "EngineError", "HookList", "Hooks", "IterationResult", "Layout", "MovablePool", "MovableTask",
    "MovableUnit", "NoopChunk",
    "OldestFirst", "RankGroups", "SlotPolicy", "StepRecord", "TorchChunk", "make_groups", "reduce_gradients",
]
