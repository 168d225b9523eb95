"""One training iteration on one rank: the seam between the Ray Train loop and the engine.

:func:`make_step_runner` builds this rank's stages (only the chunks its Program lists), their
optimizer and a :class:`tessera.engine.engine.Engine`, and returns a :class:`StepRunner`:

* ``run(tokens) -> StepMetrics``: one iteration of the rank's Program on the replica's batch
  (``tokens`` int64 ``[num_microbatches, micro_batch_size, seq_length + 1]``);
* ``state_dict() / load_state_dict()``: module and optimizer state for checkpoints;
* ``set_program(program)``: switch to another Program with the same stages (a plan upgrade
  applied at an iteration boundary).

Ordinary iterations run the engine's fast path (``Engine(profile=False)``: consecutive tasks of
a chunk as one autograd segment, no per-step records); the bubble metric comes from what the
engine measures anyway: ``IterationResult.idle_ms``, the time blocked waiting for pipeline
receives (timed around each wait, wherever it happens), and ``IterationResult.slot_ms``, the time
in ``slot`` steps (idle time filled with movable W tasks). ``run(tokens, timed=True)`` runs the
iteration on a second engine over the same modules with ``profile=True`` (one task per segment,
receives waited at their instruction, per-task times in :attr:`EngineStepRunner.last_timings`):
the iterations the drift check compares (:mod:`tessera.train.drift`, every
``profile.check_every`` steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.program.instructions import Program


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job.

    Attributes:
        world_rank, world_size: Ray Train / torch.distributed rank and size (``pp * dp``).
        pipeline_rank, replica, ep_rank: position in the layout (:mod:`tessera.engine.groups`).
        plan_version: version of the plan the Program came from (0 = the driver's first plan).
        device: ``"cpu"`` or ``"cuda:<i>"``.
    """

    world_rank: int
    world_size: int
    pipeline_rank: int
    replica: int
    ep_rank: int
    plan_version: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class StepMetrics:
    """What one iteration on one rank measured.

    Attributes:
        loss: mean microbatch loss (the rank holding the head), else None.
        wall_ms: iteration wall time on this rank.
        idle_ms: time blocked waiting for pipeline receives (bubble).
        slot_fill_ms: time running movable tasks inside ``slot`` annotations (filled idle time).
        exposed_a2a_ms: all-to-all time not hidden by compute, None while the engine does not
            measure it.
        tasks: task boundaries the engine crossed.
        profile_drift: this rank's drift from the profile (:mod:`tessera.train.drift`), None when
            not checked this step.
        dbo: with ``dbo.enabled``, the rank's :func:`tessera.engine.dbo.iteration_summary` of
            this iteration (keys ``dbo_*``), else None.
    """

    loss: float | None
    wall_ms: float
    idle_ms: float = 0.0
    slot_fill_ms: float = 0.0
    exposed_a2a_ms: float | None = None
    tasks: int = 0
    profile_drift: float | None = None
    dbo: dict | None = None


class StepRunner(Protocol):
    """The per-rank iteration interface the train loop uses (see the module docstring)."""

    program: Program

    def run(self, tokens: torch.Tensor, timed: bool = False) -> StepMetrics: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def set_program(self, program: Program) -> None: ...


class EngineStepRunner:
    """:class:`StepRunner` on :class:`tessera.engine.engine.Engine` (pipelined, EP, DP).

    Args:
        program: this rank's Program.
        modules: one :class:`~tessera.model.stage.StageModule` per local chunk.
        groups: the rank's :class:`~tessera.engine.groups.RankGroups`.
        optimizer: optimizer over the modules' parameters.
        device: torch device of the modules.
        slot_policy: fills ``slot`` annotations (None: W runs at its deadline); a
            :class:`~tessera.engine.dbo.DBOPolicy` is reset before every iteration and its
            counters reported in :attr:`StepMetrics.dbo`.
        live: the rank's :class:`~tessera.train.dbo_live.LiveCounts` (``dbo.routing: router``):
            every engine's chunks report their router counts to it (``on_route``), it is reset
            before every iteration and its counters join :attr:`StepMetrics.dbo`; its exchanges
            (run inside slot steps) are taken out of :attr:`StepMetrics.slot_fill_ms`.
    """

    def __init__(self, program: Program, modules, groups, optimizer, device: str = "cpu", slot_policy=None,
                 live=None) -> None:
        self.modules, self.groups, self.optimizer = tuple(modules), groups, optimizer
        self.device, self.slot_policy, self.live = torch.device(device), slot_policy, live
        self.program = program
        self._engine = self._make_engine(program)
        self._timed = None  # the profile=True engine of `program`, built on the first timed run
        self.last_timings: list = []  # (TaskKey, ms) of the last timed iteration's tasks (else empty)

    def _make_engine(self, program: Program, profile: bool = False):
        from tessera.engine import Engine

        engine = Engine(program, self.modules, self.groups, self.optimizer, profile=profile,
                        slot_policy=self.slot_policy)
        if self.live is not None:
            for chunk in engine.chunks:
                if hasattr(chunk, "on_route"):
                    chunk.on_route = self.live.routed
        return engine

    def run(self, tokens: torch.Tensor, timed: bool = False) -> StepMetrics:
        """One iteration; ``timed``: on the profiling engine, with per-task times in
        :attr:`last_timings` (module docstring). Both paths compute the same arithmetic (the
        engine's results do not depend on its segments) and report the same metrics."""
        from tessera.engine import Batch
        from tessera.engine.dbo import DBOPolicy, iteration_summary

        engine = self._engine
        dbo = isinstance(self.slot_policy, DBOPolicy)
        if dbo:
            self.slot_policy.reset()
        if self.live is not None:
            self.live.reset()
        if timed:
            if self._timed is None:
                self._timed = self._make_engine(self.program, profile=True)
            engine = self._timed
        result = engine.run_iteration(Batch.from_tokens(tokens.to(self.device)))
        self.last_timings = []
        for chunk in engine.chunks:  # per-task times of this iteration: kept until the next one
            timings = getattr(chunk, "timings", None)
            if timings is not None:
                self.last_timings.extend(timings)
                timings.clear()
        summary, slot_ms = None, result.slot_ms
        if self.live is not None:  # the count exchanges run inside slot steps: not filled time
            slot_ms = max(0.0, slot_ms - self.live.summary()["dbo_count_exchange_ms"])
        if dbo:
            stats = self.slot_policy.stats()
            # nor the policy's own decisions (all of them: a lower bound on the filled time)
            slot_ms = max(0.0, slot_ms - stats.overhead_ms)
            summary = iteration_summary(stats, slot_ms=slot_ms, idle_ms=result.idle_ms)
            if self.live is not None:
                summary.update(self.live.summary(), dbo_live=1)
        return StepMetrics(loss=result.loss, wall_ms=result.wall_ms, idle_ms=result.idle_ms,
                           slot_fill_ms=slot_ms, exposed_a2a_ms=None, tasks=result.steps, dbo=summary)

    def state_dict(self) -> dict:
        return {"modules": [m.state_dict() for m in self.modules], "optimizer": self.optimizer.state_dict(),
                "stages": [(s.stage, s.start, s.stop) for s in self.program.stages]}

    def load_state_dict(self, state: dict) -> None:
        """Restore modules and optimizer.

        Raises:
            ValueError: the state was saved for other stages (another partition).
        """
        mine = [(s.stage, s.start, s.stop) for s in self.program.stages]
        saved = [tuple(x) for x in state["stages"]]
        if saved != mine:
            raise ValueError(f"checkpoint holds stages {saved}, this rank runs {mine} (the partition changed)")
        for m, sd in zip(self.modules, state["modules"]):
            m.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])

    def set_program(self, program: Program, slot_policy=None, live=None) -> None:
        """Run ``program`` from the next iteration on (``slot_policy``: the policy for its slots,
        e.g. a :class:`~tessera.engine.dbo.DBOPolicy` on the new Program's table; ``live``: the
        live counts for it; None keeps the current one).

        Raises:
            ValueError: ``program`` has other stages (moving layers between ranks is not supported).
        """
        old = [(s.chunk, s.start, s.stop) for s in self.program.stages]
        new = [(s.chunk, s.start, s.stop) for s in program.stages]
        if old != new:
            raise ValueError(f"the new Program has stages {new}, this rank holds {old}; changing the partition "
                             "of a running job is not supported")
        if slot_policy is not None:
            self.slot_policy = slot_policy
        if live is not None:
            self.live = live
        self._engine = self._make_engine(program)
        self._timed = None
        self.program = program


def build_stages(recipe, model, program: Program, groups, device: str = "cpu"):
    """This rank's :class:`~tessera.model.stage.StageModule` per local chunk (chunk order), on
    ``device``; weights depend only on (``train.seed``, layer index)."""
    stages = sorted(program.stages, key=lambda s: s.chunk)
    split_w = program_splits_w(program)  # one answer per Program, not per stage
    return [build_stage(recipe, model, (s.start, s.stop), groups, device, split_w) for s in stages]


def build_stage(recipe, model, layer_range: tuple[int, int], groups, device: str = "cpu", split_w: bool = True):
    """One :class:`~tessera.model.stage.StageModule` of extended layers ``layer_range`` with the
    rank's EP group, on ``device`` (:func:`build_stages`; the profiler's candidate chunks)."""
    from tessera.model.stage import StageModule

    ep = groups.ep if groups is not None else None
    return StageModule(model, layer_range, ep_group=ep, seed=recipe.train.seed, split_w=split_w).to(device)


def program_splits_w(program: Program) -> bool:
    """Whether ``program`` runs weight gradients as separate W tasks (``register_w`` / ``W``
    instructions), so its layers need deferrable (split) linears: the plan's choice, which under
    ``planner.split_w: auto`` the recipe does not state."""
    from tessera.program.instructions import Op

    return any(ins.op in (Op.W, Op.REGISTER_W) for ins in program.instructions)


def make_step_runner(recipe, program: Program, rank_info: RankInfo, groups, *, model=None,
                     dbo_table=None, live=None) -> StepRunner:
    """The :class:`StepRunner` of this rank: stages, AdamW (``train.lr``, ``train.weight_decay``)
    and the engine; with ``dbo.enabled`` the engine fills slots with
    :class:`~tessera.engine.dbo.DBOPolicy` on ``dbo_table`` (:mod:`tessera.train.dbo_run`).

    Args:
        recipe: the job's Recipe.
        program: this rank's Program (slot-annotated with ``dbo.enabled``).
        rank_info: where the rank sits.
        groups: :func:`tessera.engine.groups.make_groups` result for the recipe's layout.
        model: the resolved ModelSpec (default: resolved from the recipe).
        dbo_table: the rank's :class:`~tessera.dbo.predict.RankTable` (required with
            ``dbo.enabled``; the driver's :func:`tessera.train.dbo_run.dbo_tables`).
        live: the rank's :class:`~tessera.train.dbo_live.LiveCounts` with ``dbo.routing:
            router`` (:func:`tessera.train.dbo_live.make_live`), else None.

    Raises:
        ValueError: ``dbo.enabled`` without ``dbo_table``.
    """
    if model is None:
        from tessera.config.resolve import resolve_model

        model = resolve_model(recipe)
    modules = build_stages(recipe, model, program, groups, rank_info.device)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)
    policy = None
    if recipe.dbo.enabled:
        from tessera.train.dbo_run import make_policy

        if dbo_table is None:
            raise ValueError("dbo.enabled: the step runner needs the rank's DBO table (the driver's "
                             "tessera.train.dbo_run.dbo_tables); got none")
        policy = make_policy(recipe, dbo_table, rank_info.ep_rank, live)
    return EngineStepRunner(program, modules, groups, optimizer, rank_info.device, policy, live if policy else None)
