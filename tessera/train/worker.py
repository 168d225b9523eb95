"""The train loop of one Ray Train worker: :class:`WorkerLoop`, run on every rank by
``train_loop(config)``, Ray Train's per-worker function.

1. :meth:`WorkerLoop.setup`: rank, world size and the default gloo/NCCL group come from Ray
   Train; the layout's process groups are made on top (:func:`tessera.engine.groups.make_groups`).
   The rank's Program comes from the driver actor (``get_program(rank)``, with ``dbo.enabled``
   also the rank's DBO table, :mod:`tessera.train.dbo_run`); only its stages are built
   (:func:`tessera.train.step.make_step_runner`). With ``dbo.routing: router`` every rank of an
   EP group builds the count transport right after the groups
   (:func:`tessera.train.dbo_live.make_live`; closed when the loop ends, also on failure, and
   rebuilt at a plan change). Bad input found while building (a
   ``TesseraConfigError`` or ``ProgramError``) is recorded with the driver before it is raised;
   a restarted worker group then fails at once with it instead of building again.
2. :meth:`~WorkerLoop.restore`: the newest complete checkpoint (Ray's ``get_checkpoint()`` or the
   run directory; rank 0 decides and deletes partial ones) gives modules, optimizer, data
   position and step; rank 0 tells the driver the group started and every rank gets the attempt.
3. Each iteration: :meth:`~WorkerLoop.maybe_upgrade` (rank 0 asks the driver for the plan
   version, broadcast: an upgrade lands at this boundary on every rank), :meth:`~WorkerLoop.step`
   (the replica's batch, one engine iteration, metrics gathered over all ranks, with
   ``dbo.enabled`` also the ``dbo_*`` fields),
   :meth:`~WorkerLoop.report` (rank 0 to the driver), the hooks' ``after_step``
   (:mod:`tessera.train.hooks`), :meth:`~WorkerLoop.checkpoint` every ``train.checkpoint_every``
   steps and at the last step (none when it is 0).

Ray Train and ``torch.distributed`` are reached through a :class:`RaySession` and the driver
through a :class:`DriverLink`, so the loop's methods also run in one process without Ray (tests).
``config`` is :meth:`WorkerConfig.to_dict` (plain values: Ray pickles it to every worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from tessera.train.hooks import HookSpec


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs besides the Recipe, all derived when the job starts (the job's
    options are the recipe's ``job`` section).

    Attributes:
        recipe: ``Recipe.to_dict()``.
        run_name, run_dir: the run chosen for this job and its directory (checkpoints).
        driver: the driver actor's name (in namespace ``job.namespace``).
        threads: ``torch.set_num_threads`` on CPU workers (``job.threads``, or the worker's CPUs).
        hooks: worker hooks to build on every rank (:class:`~tessera.train.hooks.HookSpec`).
        profile_reference: with ``planner.cost_source=profile``, the profile the plan used (item
            -> median ms), for the drift check (:mod:`tessera.train.drift`); empty: no check.
    """

    recipe: dict
    run_name: str
    run_dir: str
    driver: str
    threads: int = 1
    hooks: tuple[HookSpec, ...] = ()
    profile_reference: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "run_name": self.run_name, "run_dir": self.run_dir, "driver": self.driver,
                "threads": self.threads, "hooks": [h.to_dict() for h in self.hooks],
                "profile_reference": dict(self.profile_reference)}

    @staticmethod
    def from_dict(d: dict) -> "WorkerConfig":
        return WorkerConfig(d["recipe"], d["run_name"], d["run_dir"], d["driver"], int(d.get("threads", 1)),
                            tuple(HookSpec.from_dict(h) for h in d.get("hooks", ())),
                            dict(d.get("profile_reference") or {}))


class DriverLink:
    """The worker's calls to the driver actor ``handle``: :meth:`call` waits for the answer
    (``ray.get``), :meth:`send` does not (calls from one caller still run in order)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))

    def send(self, method: str, *args) -> None:
        getattr(self.handle, method).remote(*args)


class RaySession:
    """What the loop asks of Ray Train and ``torch.distributed`` on a worker."""

    def broadcast(self, obj, rank: int):
        """Rank 0's ``obj`` on every rank (``broadcast_object_list``; other ranks pass None)."""
        import torch.distributed as dist

        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def checkpoint_path(self) -> str | None:
        """The path of Ray Train's ``get_checkpoint()`` (the newest it registered), or None."""
        import ray.train

        got = ray.train.get_checkpoint()
        return got.path if got is not None else None

    def save(self, step: int, metrics: dict, **part) -> None:
        """:func:`tessera.train.checkpoint.save_through_ray` (a barrier across ranks)."""
        from tessera.train.checkpoint import save_through_ray

        save_through_ray(step, metrics, **part)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def _dbo_table(got: dict, program):
    """The :class:`~tessera.dbo.predict.RankTable` the driver sent with ``program``
    (``get_program``'s ``dbo`` entry, present with ``dbo.enabled``), else None."""
    if got.get("dbo") is None:
        return None
    from tessera.train.dbo_run import table_from_dict

    return table_from_dict(got["dbo"], program)


def _device(recipe) -> str:
    if recipe.hardware.preset != "cpu" and torch.cuda.is_available():
        import ray.train.torch

        return str(ray.train.torch.get_device())
    return "cpu"


class WorkerLoop:
    """One rank's training loop (module docstring); :meth:`setup` builds it on a Ray Train worker.

    Args:
        cfg: the :class:`WorkerConfig`; recipe: its Recipe.
        rank, world: world rank and size; device: ``"cpu"`` or ``"cuda:<i>"``.
        driver: a :class:`DriverLink` (anything with its ``call``/``send``).
        runner: the rank's :class:`~tessera.train.step.StepRunner`; data: the replica's
            :class:`~tessera.train.data.DataShard` (``position``, ``next_batch()``, state).
        model: the resolved ModelSpec; version: the plan version of ``runner``'s Program.
        hooks: resolved worker hooks (:class:`tessera.train.hooks.WorkerHooks`).
        session: a :class:`RaySession` (anything with its methods).
        live: the rank's :class:`~tessera.train.dbo_live.LiveCounts` (``dbo.routing: router``),
            closed when the loop ends and rebuilt at a plan change; groups: the rank's
            :class:`~tessera.engine.groups.RankGroups` (to rebuild it).
    """

    def __init__(self, cfg: WorkerConfig, recipe, *, rank: int, world: int, device: str, driver, runner, data,
                 model, version: int, hooks=(), session=None, live=None, groups=None) -> None:
        self.cfg, self.recipe, self.run_name = cfg, recipe, cfg.run_name
        self.rank, self.world, self.device = rank, world, device
        self.driver, self.runner, self.data, self.model = driver, runner, data, model
        self.version, self.hooks = version, tuple(hooks)
        self.live, self.groups = live, groups
        self.session = session if session is not None else RaySession()
        self.attempt = 0
        self.flops = self.peak = 0.0
        p = recipe.parallel
        self.layout = (p.pp, p.dp, p.ep)
        self.drift = self._drift_check(cfg, recipe, model)
        self.tokens = p.dp * p.num_microbatches * p.micro_batch_size * p.seq_length

    @staticmethod
    def _drift_check(cfg: WorkerConfig, recipe, model):
        """The :class:`~tessera.train.drift.DriftCheck` of a run planned on a profile, else None."""
        if not cfg.profile_reference or recipe.profile.check_every <= 0:
            return None
        from tessera.config.resolve import resolve_hardware
        from tessera.cost.analytic import analytic_costs
        from tessera.cost.profile_costs import task_signatures
        from tessera.cost.types import ParallelShape
        from tessera.train.drift import DriftCheck

        costs = analytic_costs(model, resolve_hardware(recipe), ParallelShape.of(recipe.parallel))
        return DriftCheck(dict(cfg.profile_reference), task_signatures(costs), recipe.profile.check_every)

    @classmethod
    def setup(cls, cfg: WorkerConfig, session=None) -> "WorkerLoop":
        """Build the loop on a Ray Train worker (module docstring, item 1).

        Raises:
            RuntimeError: Ray Train started another number of workers than the layout needs.
            TesseraConfigError / ProgramError: bad input, found now or by a worker of an earlier
                start (recorded with the driver).
        """
        import ray
        import ray.train

        from tessera.config.load import recipe_from_dict
        from tessera.config.resolve import resolve_model
        from tessera.engine.groups import Layout, make_groups
        from tessera.errors import ProgramError, TesseraConfigError
        from tessera.program.instructions import Program
        from tessera.train.data import shard_for
        from tessera.train.dbo_live import make_live
        from tessera.train.hooks import resolve_hooks
        from tessera.train.step import RankInfo, make_step_runner

        recipe = recipe_from_dict(cfg.recipe)
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        device = _device(recipe)
        if device == "cpu":
            torch.set_num_threads(max(1, cfg.threads))
        torch.manual_seed(recipe.train.seed)
        if recipe.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        p = recipe.parallel
        layout = Layout(p.pp, p.dp, p.ep)
        if layout.world_size != world:
            raise RuntimeError(f"the recipe's layout needs {layout.world_size} workers (pp*dp), Ray Train started "
                               f"{world}")
        groups = make_groups(layout)
        live = make_live(recipe, groups, device)  # dbo.routing=router: every EP rank builds the transport
        try:
            driver = DriverLink(ray.get_actor(cfg.driver, namespace=recipe.job.namespace))
            fatal = driver.call("fatal_error")
            if fatal is not None:  # a worker of an earlier start found bad input: restarting cannot help
                raise fatal[1]
            try:
                hooks = resolve_hooks(cfg.hooks)
                model = resolve_model(recipe)
                got = driver.call("get_program", rank)
                version, program = got["plan_version"], Program.from_dict(got["program"])
                info = RankInfo(rank, world, groups.pipeline_rank, groups.replica, groups.ep_rank, version, device)
                table = _dbo_table(got, program)
                runner = make_step_runner(recipe, program, info, groups, model=model, dbo_table=table, live=live)
                data = shard_for(recipe, groups.replica)
            except (TesseraConfigError, ProgramError) as e:
                driver.call("record_fatal", rank, e)
                raise
        except BaseException:
            if live is not None:
                live.close()
            raise
        return cls(cfg, recipe, rank=rank, world=world, device=device, driver=driver, runner=runner, data=data,
                   model=model, version=version, hooks=hooks, session=session, live=live, groups=groups)

    # --- start ------------------------------------------------------------------------------------
    def restore_point(self):
        """Rank 0 picks the newest complete checkpoint (and deletes partial ones); every rank
        gets ``(CheckpointInfo or None, names of the deleted partial checkpoints)``."""
        from tessera.train.checkpoint import cleanup_partial, latest_complete

        info, removed = None, []
        if self.rank == 0:
            info = latest_complete(self.cfg.run_dir, extra=self.session.checkpoint_path())
            removed = cleanup_partial(self.cfg.run_dir)
            if removed:
                print(f"tessera: removed {len(removed)} partial checkpoint(s): "
                      f"{', '.join(map(os.path.basename, removed))}")
        return self.session.broadcast((info, [os.path.basename(r) for r in removed]), self.rank)

    def restore(self) -> int:
        """Load the newest complete checkpoint (if any) into the runner and the data, tell the
        driver the group started (rank 0) and set :attr:`attempt`; returns the step to resume
        after (0: from the start).

        Raises:
            RuntimeError: the checkpoint's layout differs from the recipe's.
        """
        from tessera.train.checkpoint import load_part

        start = 0
        point, removed = self.restore_point()
        if point is not None:
            if point.layout != self.layout:
                raise RuntimeError(f"checkpoint {point.path} has layout (pp, dp, ep) = {point.layout}, the recipe "
                                   f"{self.layout}")
            part = load_part(point.path, self.rank)
            self.runner.load_state_dict(part["state"])
            self.data.load_state_dict({"position": part["data_position"]})
            start = part["step"]
        started = self.driver.call("worker_group_started", start, removed) if self.rank == 0 else None
        self.attempt = self.session.broadcast(started, self.rank)
        return start

    def prepare_metrics(self) -> None:
        """The iteration's model FLOPs and the job's peak FLOP/s (on CPU a matmul benchmark on
        every rank at once: a collective)."""
        from tessera.config.resolve import resolve_hardware
        from tessera.train.metrics import iteration_flops, job_peak_flops

        self.flops = iteration_flops(self.model, self.recipe.parallel)
        self.peak = job_peak_flops(resolve_hardware(self.recipe), self.device)

    # --- one iteration ---------------------------------------------------------------------------
    def maybe_upgrade(self, step: int) -> bool:
        """Before iteration ``step``: rank 0 polls the driver, the version is broadcast, and on a
        new version every rank switches to its new Program; returns True when it switched."""
        from tessera.program.instructions import Program

        new_version = self.session.broadcast(self.driver.call("poll_plan", step) if self.rank == 0 else None,
                                             self.rank)
        if new_version == self.version:
            return False
        got = self.driver.call("get_program", self.rank)
        program = Program.from_dict(got["program"])
        table = _dbo_table(got, program)
        if table is None:
            self.runner.set_program(program)
        else:  # the new Program's slots: a policy on its own table, same EP rank
            from tessera.train.dbo_run import make_policy

            if self.live is not None:  # the transport is torn down before the plan change and built anew
                from tessera.train.dbo_live import make_live

                self.live.close()
                self.live = make_live(self.recipe, self.groups, self.device)
            self.runner.set_program(program, make_policy(self.recipe, table, self.runner.slot_policy.ep_rank,
                                                         self.live), self.live)
        self.version = got["plan_version"]
        return True

    def step(self, step: int):
        """Iteration ``step`` on the replica's next batch; returns the job's
        :class:`~tessera.train.metrics.IterationMetrics` (gathered over every rank)."""
        from tessera.train.metrics import aggregate

        position = self.data.position
        timed = self.drift is not None and self.drift.due(step)  # per-task times only where compared
        batch = self.data.next_batch()
        local = self.runner.run(batch, timed=True) if timed else self.runner.run(batch)
        if timed:
            local = replace(local, profile_drift=self.drift.drift(getattr(self.runner, "last_timings", ())))
        it = aggregate(local, step=step, flops=self.flops, peak_flops=self.peak, tokens=self.tokens,
                       plan_version=self.version, data_position=position, attempt=self.attempt)
        if local.dbo is not None:  # dbo.enabled: every rank has a summary (a collective)
            from tessera.train.dbo_run import gather_summaries
            from tessera.train.metrics import with_dbo

            it = with_dbo(it, gather_summaries(local.dbo))
        return it

    def report(self, step: int, it) -> None:
        """Rank 0 sends iteration ``step``'s metrics ``it`` to the driver (not waited for)."""
        if self.rank == 0:
            self.driver.send("report", self.rank, step, it.to_dict())

    def claim_once(self, key: str) -> bool:
        """True exactly once per ``key`` in the run (the driver keeps the keys; for hooks)."""
        return bool(self.driver.call("claim_fault", key))

    def checkpoint_due(self, step: int) -> bool:
        """Whether iteration ``step`` writes a checkpoint (every ``train.checkpoint_every`` steps
        and at the last step; never when it is 0)."""
        every, steps = self.recipe.train.checkpoint_every, self.recipe.train.steps
        return every > 0 and (step % every == 0 or step == steps)

    def checkpoint(self, step: int, it) -> bool:
        """Write this rank's part of the checkpoint of ``step`` when due (rank 0 adds the plan;
        a hook may ask to die before the marker); returns whether one was written."""
        if not self.checkpoint_due(step):
            return False
        plan = self.driver.call("plan_dict")["plan"] if self.rank == 0 else None
        die = False
        for hook in self.hooks:
            die = bool(hook.die_before_marker(self, step)) or die
        self.session.save(step, {"step": step, "loss": it.loss}, rank=self.rank, world_size=self.world,
                          layout=self.layout, plan_version=self.version, data_position=self.data.position,
                          state=self.runner.state_dict(), plan=plan, die_before_marker=die)
        return True

    # --- the whole loop --------------------------------------------------------------------------
    def finish(self) -> None:
        """Rank 0 waits until the driver has every report (calls from one caller run in order),
        then every rank meets at a barrier."""
        if self.rank == 0:
            self.driver.call("ready")
        self.session.barrier()

    def run(self) -> None:
        """Restore, then every remaining iteration (module docstring), then :meth:`finish`; the
        count transport (``dbo.routing: router``) is closed at the end, also on failure."""
        try:
            start = self.restore()
            self.prepare_metrics()
            for step in range(start + 1, self.recipe.train.steps + 1):
                self.maybe_upgrade(step)
                it = self.step(step)
                self.report(step, it)
                for hook in self.hooks:
                    hook.after_step(self, step)
                self.checkpoint(step, it)
            self.finish()
        finally:
            if self.live is not None:
                self.live.close()


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: :class:`WorkerLoop` built from ``config``
    (:meth:`WorkerConfig.to_dict`) and run."""
    WorkerLoop.setup(WorkerConfig.from_dict(config)).run()
