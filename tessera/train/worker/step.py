"""One training iteration on one rank: the seam between the Ray Train loop and the engine.

:func:`make_step_runner` builds this rank's stages (only the chunks its Program lists), their
optimizer and a :class:`tessera.engine.engine.Engine`, and returns a :class:`StepRunner`:

* ``run(tokens) -> StepMetrics``: one iteration of the rank's Program on the replica's batch
  (``tokens`` int64 ``[num_microbatches, micro_batch_size, seq_length + 1]``);
* ``state_dict() / load_state_dict()``: module and optimizer state for checkpoints (with every
  parameter's global name, so ``load_parts`` restores a checkpoint of another partition);
* ``set_program(program, ...)``: switch to another Program at an iteration boundary (a plan
  upgrade); with another partition the stages are rebuilt and parameters and optimizer state
  move by global names over the pipeline group (:mod:`tessera.train.upgrade.reshard`).

Ordinary iterations run the engine's fast path (``Engine(profile=False)``: consecutive tasks of
a chunk as one autograd segment, no per-step records); the bubble metric comes from what the
engine measures anyway: ``IterationResult.idle_ms``, the time blocked waiting for pipeline
receives (timed around each wait, wherever it happens), and ``IterationResult.slot_ms``, the time
in ``slot`` steps (idle time filled with movable W tasks). ``run(tokens, timed=True)`` runs the
iteration on a second engine over the same modules with ``profile=True`` (one task per segment,
receives waited at their instruction, per-task times in :attr:`EngineStepRunner.last_timings`,
the routers' counts in :attr:`EngineStepRunner.last_routes`): the iterations the drift check
compares (:mod:`tessera.train.worker.drift`) and the autopilot's checks
(:mod:`tessera.train.worker.straggler`), every ``profile.check_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.program.instructions import Program


KEEP = object()
"""``EngineStepRunner.set_program``'s default: keep the current slot policy / live counts."""


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
        slot_fill_ms: time running the W a slot policy moved into ``slot`` annotations (filled
            idle time; ``IterationResult.slot_ms``: 0 when nothing moved).
        exposed_a2a_ms: time blocked waiting for expert-parallel all-to-alls (the all-to-all time
            compute did not hide; ``IterationResult.a2a_wait_ms``), None without EP.
        tasks: task boundaries the engine crossed.
        profile_drift: this rank's drift from the profile (:mod:`tessera.train.worker.drift`), None when
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
        live: the rank's :class:`~tessera.train.dbo.live.LiveCounts` (``dbo.routing: router``):
            every engine's chunks report their router counts to it (``on_route``), it is reset
            before every iteration and its counters join :attr:`StepMetrics.dbo` (its exchanges,
            asked for at slot steps, are not filled time: the engine times the moved W alone).

    Attributes:
        last_timings: ``(TaskKey, ms)`` of the last timed iteration's tasks (else empty).
        last_routes: ``(mb, layer, requested)`` of every router task of the last timed iteration
            (``requested``: the rank's per-expert counts, int64 ``[E]``; else empty): the
            autopilot's routing skew (:mod:`tessera.train.worker.straggler`).
        engine_hooks, time_scale: test-only (:mod:`tessera.testing.slow`, :meth:`add_engine_hook`).
    """

    def __init__(self, program: Program, modules, groups, optimizer, device: str = "cpu", slot_policy=None,
                 live=None) -> None:
        self.modules, self.groups, self.optimizer = tuple(modules), groups, optimizer
        self.device, self.slot_policy, self.live = torch.device(device), slot_policy, live
        self.program = program
        self.engine_hooks: tuple = ()  # test-only (add_engine_hook)
        self.time_scale = 1.0  # test-only (add_engine_hook)
        self._engine = self._make_engine(program)
        self._timed = None  # the profile=True engine of `program`, built on the first timed run
        self.last_timings: list = []  # (TaskKey, ms) of the last timed iteration's tasks (else empty)
        self.last_routes: list = []  # (mb, layer, requested) of the last timed iteration's routers
        self._routes: list = []

    def _make_engine(self, program: Program, profile: bool = False):
        from tessera.engine import Engine

        engine = Engine(program, self.modules, self.groups, self.optimizer, profile=profile,
                        slot_policy=self.slot_policy, hooks=self.engine_hooks or None)
        route = self.live.routed if self.live is not None else None
        if profile:  # the timed engine also keeps the routers' counts (the autopilot's routing skew)
            def route(mb, layer, requested, live=route):
                self._routes.append((mb, layer, requested.detach() if hasattr(requested, "detach") else requested))
                if live is not None:
                    live(mb, layer, requested)
        if route is not None:
            for chunk in engine.chunks:
                if hasattr(chunk, "on_route"):
                    chunk.on_route = route
        return engine

    def add_engine_hook(self, hook, time_scale: float = 1.0) -> None:
        """Test-only: run ``hook`` (a :class:`tessera.engine.hooks.Hooks`) on this rank's engines
        from the next iteration on (kept through plan switches), and report the timed iteration's
        task times times ``time_scale`` (what a device that many times slower would time;
        :mod:`tessera.testing.slow` sleeps between tasks, outside their timed spans)."""
        self.engine_hooks = self.engine_hooks + (hook,)
        self.time_scale = float(time_scale)
        self._engine = self._make_engine(self.program)
        self._timed = None

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
        if timed:
            if self._timed is None:
                self._timed = self._make_engine(self.program, profile=True)
            engine = self._timed
        if self.live is not None:  # timed on the engine's clock: its slot times lose the exchanges below
            from tessera.engine.timing import SpanTotal

            self.live.use_clock(SpanTotal(engine.timer))
            self.live.reset()
        self._routes = []
        result = engine.run_iteration(Batch.from_tokens(tokens.to(self.device)))
        self.last_timings, self.last_routes, self._routes = [], self._routes, []
        for chunk in engine.chunks:  # per-task times of this iteration: kept until the next one
            timings = getattr(chunk, "timings", None)
            if timings is not None:
                scale = self.time_scale
                self.last_timings.extend(timings if scale == 1.0 else [(k, ms * scale) for k, ms in timings])
                timings.clear()
        summary, slot_ms = None, result.slot_ms  # the moved W's own run time (not decisions, not count exchanges)
        if dbo:
            summary = iteration_summary(self.slot_policy.stats(), slot_ms=slot_ms, idle_ms=result.idle_ms,
                                        a2a_wait_ms=result.a2a_wait_ms)
            if self.live is not None:
                summary.update(self.live.summary(), dbo_live=1)
        return StepMetrics(loss=result.loss, wall_ms=result.wall_ms, idle_ms=result.idle_ms,
                           slot_fill_ms=slot_ms, exposed_a2a_ms=result.a2a_wait_ms, tasks=result.steps, dbo=summary)

    def state_dict(self) -> dict:
        """Modules (one state dict per chunk), optimizer, the stages, and ``param_names``: every
        parameter's global name in the optimizer's order (:func:`tessera.train.upgrade.reshard.global_param_names`),
        so a checkpoint loads under another partition too (:meth:`load_parts`); ``model``: the
        ModelSpec dict the stages were built from (``tessera export`` reads it)."""
        from tessera.train.upgrade.reshard import global_param_names

        spec = getattr(self.modules[0], "model_spec", None) if self.modules else None
        return {"modules": [m.state_dict() for m in self.modules], "optimizer": self.optimizer.state_dict(),
                "stages": [(s.stage, s.start, s.stop) for s in self.program.stages],
                "param_names": [n for m in self.modules for n in global_param_names(m)],
                "model": spec.to_dict() if spec is not None else None}

    def holds_stages_of(self, state: dict) -> bool:
        """Whether ``state`` (a :meth:`state_dict`) was saved for this rank's stages."""
        return [tuple(x) for x in state["stages"]] == [(s.stage, s.start, s.stop) for s in self.program.stages]

    def load_state_dict(self, state: dict) -> None:
        """Restore modules and optimizer.

        Raises:
            ValueError: the state was saved for other stages (another partition; use :meth:`load_parts`).
        """
        if not self.holds_stages_of(state):
            mine = [(s.stage, s.start, s.stop) for s in self.program.stages]
            raise ValueError(f"checkpoint holds stages {[tuple(x) for x in state['stages']]}, this rank runs {mine} "
                             "(the partition changed)")
        for m, sd in zip(self.modules, state["modules"]):
            m.load_state_dict(sd)
        self.optimizer.load_state_dict(state["optimizer"])

    def load_parts(self, states: list[dict]) -> None:
        """Restore this rank's parameters and optimizer state by global names from the states of
        every rank of its pipeline group, saved under another partition
        (:func:`tessera.train.upgrade.reshard.state_from_parts`).

        Raises:
            KeyError / ValueError: a parameter of this rank is in none of them (named).
        """
        from tessera.train.upgrade.reshard import load_named, state_from_parts

        load_named(self.modules, self.optimizer, state_from_parts(states))

    def set_program(self, program: Program, slot_policy=KEEP, live=KEEP, rebuild=None, method: str = "p2p",
                    scratch_dir: str | None = None):
        """Run ``program`` from the next iteration on (a plan upgrade at an iteration boundary).

        Args:
            slot_policy: the policy for its slots (e.g. a :class:`~tessera.engine.dbo.DBOPolicy`
                on the new Program's table; None: W at its deadline); :data:`KEEP`: unchanged.
            live: the live counts for it (None: none); :data:`KEEP`: unchanged.
            rebuild: ``program -> (modules, optimizer)``, fresh stages for ``program``; given when
                the plan's partition, vpp or split W changed (then every rank of the pipeline group
                calls this at the same boundary: parameters and optimizer state move by global
                names over the pipeline group, :func:`tessera.train.upgrade.reshard.move_state` with ``method``
                ``p2p`` or ``dcp``); None: the same stages.
            scratch_dir: with ``dcp``, a directory the pipeline group shares (removed afterwards).

        Returns:
            The :class:`~tessera.train.upgrade.reshard.MoveReport` of a rebuild, else None.

        Raises:
            ValueError: ``program`` has other stages and no ``rebuild`` was given.
        """
        report = None
        if rebuild is not None:
            modules, optimizer = rebuild(program)
            report = self._move_to(modules, optimizer, method, scratch_dir)
            self.modules, self.optimizer = tuple(modules), optimizer
        else:
            old = [(s.chunk, s.start, s.stop) for s in self.program.stages]
            new = [(s.chunk, s.start, s.stop) for s in program.stages]
            if old != new:
                raise ValueError(f"the new Program has stages {new}, this rank holds {old}; a partition change "
                                 "needs rebuild (fresh stages for the new Program)")
        if slot_policy is not KEEP:
            self.slot_policy = slot_policy
        if live is not KEEP:
            self.live = live
        self._engine = self._make_engine(program)
        self._timed = None
        self.program = program
        return report


    def _move_to(self, modules, optimizer, method: str, scratch_dir: str | None):
        """Parameters and optimizer state of the current stages into ``modules``/``optimizer`` by
        global names: over the pipeline group (every member calls it), or locally when the
        pipeline has one rank."""
        import shutil
        import time

        from tessera.train.upgrade.reshard import MoveReport, load_named, move_state, named_state

        group = self.groups.pipeline if self.groups is not None else None
        if group is None:  # one pipeline rank: everything stays here
            t0 = time.perf_counter()
            load_named(modules, optimizer, named_state(self.modules, self.optimizer))
            return MoveReport("local", 0, 0, time.perf_counter() - t0)
        import torch.distributed as dist

        report = move_state(self.modules, self.optimizer, modules, optimizer, group, method=method,
                            scratch_dir=scratch_dir)
        if method == "dcp" and scratch_dir is not None:
            dist.barrier(group)  # every member has loaded before the files go
            if dist.get_rank(group) == 0:
                shutil.rmtree(scratch_dir, ignore_errors=True)
        return report


def build_modules(recipe, model, program: Program, groups, device: str = "cpu"):
    """``(stages, optimizer)`` of this rank under ``program``: :func:`build_stages` and AdamW
    over their parameters (``train.lr``, ``train.weight_decay``)."""
    modules = build_stages(recipe, model, program, groups, device)
    params = [p for m in modules for p in m.parameters()]
    return modules, torch.optim.AdamW(params, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)


def build_stages(recipe, model, program: Program, groups, device: str = "cpu"):
    """This rank's :class:`~tessera.model.stage.StageModule` per local chunk (chunk order), on
    ``device``; weights depend only on (``train.seed``, layer index)."""
    stages = sorted(program.stages, key=lambda s: s.chunk)
    split_w = program_splits_w(program)  # one answer per Program, not per stage
    return [build_stage(recipe, model, (s.start, s.stop), groups, device, split_w) for s in stages]


def build_stage(recipe, model, layer_range: tuple[int, int], groups, device: str = "cpu", split_w: bool = True):
    """One :class:`~tessera.model.stage.StageModule` of extended layers ``layer_range`` with the
    rank's EP group and EP counts group, the recipe's activation recompute
    (``planner.activation_recompute``, ``planner.recompute_modules``:
    :class:`tessera.model.recompute.Recompute`) and compute dtype
    (``train.precision`` resolved: :func:`tessera.model.precision.compute_dtype`) and parameter
    dtype (with ``train.master_weights``: :func:`tessera.model.precision.param_dtype`, BF16 for
    ``false``), on ``device`` (:func:`build_stages`; the profiler's candidate chunks)."""
    from tessera.config.auto import resolve_precision
    from tessera.model.precision import compute_dtype, param_dtype
    from tessera.model.recompute import Recompute
    from tessera.model.stage import StageModule

    ep = groups.ep if groups is not None else None
    counts = groups.ep_counts if groups is not None else None
    recompute = Recompute.of(recipe.planner.activation_recompute, recipe.planner.recompute_modules)
    precision = resolve_precision(recipe)
    return StageModule(model, layer_range, ep_group=ep, seed=recipe.train.seed, split_w=split_w,
                       recompute=recompute, compute_dtype=compute_dtype(precision), counts_group=counts,
                       param_dtype=param_dtype(precision, recipe.train.master_weights)).to(device)


def program_splits_w(program: Program) -> bool:
    """Whether ``program`` runs weight gradients as separate W tasks (``register_w`` / ``W``
    instructions), so its layers need deferrable (split) linears: the plan's choice, which under
    ``planner.split_w: auto`` the recipe does not state."""
    from tessera.program.instructions import Op

    return any(ins.op in (Op.W, Op.REGISTER_W) for ins in program.instructions)


def make_step_runner(recipe, program: Program, rank_info: RankInfo, groups, *, model=None,
                     dbo_table=None, live=None) -> StepRunner:
    """The :class:`StepRunner` of this rank: stages, AdamW (``train.lr``, ``train.weight_decay``)
    and the engine; with ``dbo.enabled`` the engine fills slots with the policy
    :func:`tessera.train.dbo.table.make_policy` builds on ``dbo_table`` (the joint, layer-level
    :class:`~tessera.engine.dbo_joint.JointDBOPolicy` when the table carries its W units).

    Args:
        recipe: the job's Recipe.
        program: this rank's Program (slot-annotated with ``dbo.enabled``).
        rank_info: where the rank sits.
        groups: :func:`tessera.engine.groups.make_groups` result for the recipe's layout.
        model: the resolved ModelSpec (default: resolved from the recipe).
        dbo_table: the rank's :class:`~tessera.dbo.predict.RankTable` (required with
            ``dbo.enabled``; the driver's :func:`tessera.train.dbo.table.dbo_tables`).
        live: the rank's :class:`~tessera.train.dbo.live.LiveCounts` with ``dbo.routing:
            router`` (:func:`tessera.train.dbo.live.make_live`), else None.

    Raises:
        ValueError: ``dbo.enabled`` without ``dbo_table``.
    """
    if model is None:
        from tessera.config.resolve import resolve_model

        model = resolve_model(recipe)
    modules, optimizer = build_modules(recipe, model, program, groups, rank_info.device)
    policy = None
    if recipe.dbo.enabled:
        from tessera.train.dbo.table import make_policy

        if dbo_table is None:
            raise ValueError("dbo.enabled: the step runner needs the rank's DBO table (the driver's "
                             "tessera.train.dbo.table.dbo_tables); got none")
        policy = make_policy(recipe, dbo_table, rank_info.ep_rank, live)
    return EngineStepRunner(program, modules, groups, optimizer, rank_info.device, policy, live if policy else None)
