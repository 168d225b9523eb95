"""The train loop of one Ray Train worker: :class:`WorkerLoop`, run on every rank by
``train_loop(config)``, Ray Train's per-worker function.

1. :meth:`WorkerLoop.setup`: rank, world size and the default gloo/NCCL group come from Ray
   Train; the layout's process groups are made on top (:func:`tessera.engine.groups.make_groups`,
   each with the job's timeout ``job.pg_timeout_s``, as the default group has; a wait that outlives
   it ends the engine's iteration in one line, :class:`tessera.engine.groups.CommTimeout`, a
   failure Ray Train restarts from the newest checkpoint), after a check that the node has the
   interfaces ``job.socket_ifname`` names (:func:`check_interfaces`).
   The rank's Program comes from the driver actor (``get_program(rank)``, with ``dbo.enabled``
   also the rank's DBO table, :mod:`tessera.train.dbo.table`); only its stages are built
   (:func:`tessera.train.worker.step.make_step_runner`). With ``dbo.routing: router`` (the
   recipe's, or the running version's when the optimizer was switched on live) every rank of an
   EP group builds the count transport right after its Program
   (:func:`tessera.train.dbo.live.make_live`; closed when the loop ends, also on failure, and
   rebuilt at a plan change). Bad input found while building (a
   ``TesseraConfigError`` or ``ProgramError``) is recorded with the driver before it is raised;
   a restarted worker group then fails at once with it instead of building again.
2. :meth:`~WorkerLoop.restore`: the newest complete checkpoint (Ray's ``get_checkpoint()`` or the
   run directory; rank 0 decides and deletes partial ones) gives modules, optimizer, data
   position and step; rank 0 tells the driver the group started and every rank gets the attempt.
3. Each iteration: :meth:`~WorkerLoop.maybe_upgrade` (a plan version agreed for this boundary:
   the rank's new Program, and where the partition changed, its stages rebuilt with parameters
   and optimizer state moved by global names; no driver call otherwise), :meth:`~WorkerLoop.step`
   (the replica's batch, one engine iteration, metrics gathered over all ranks, with
   ``dbo.enabled`` also the ``dbo_*`` fields; the same all-gather carries rank 0's announcement
   of the next version, which rank 0 learns from a driver call it never waits for:
   :mod:`tessera.train.upgrade.schedule`; at check steps, every ``profile.check_every`` with the
   profile drift check or ``autopilot.enabled``, the iteration runs on the profiling engine, and
   with ``autopilot.enabled`` :meth:`~WorkerLoop.straggler_check` adds the autopilot's per-rank
   slowdown and routing skew),
   :meth:`~WorkerLoop.report` (rank 0 to the driver), the hooks' ``after_step``
   (:mod:`tessera.train.worker.hooks`), :meth:`~WorkerLoop.checkpoint` every ``train.checkpoint_every``
   steps and at the last step (none when it is 0), then whether the launcher asked the job to
   stop (:class:`StopPoll`: every rank ends after the same step, then :meth:`~WorkerLoop.finish`).

Ray Train and ``torch.distributed`` are reached through a :class:`RaySession` and the driver
through a :class:`DriverLink`, so the loop's methods also run in one process without Ray (tests).
``config`` is :meth:`WorkerConfig.to_dict` (plain values: Ray pickles it to every worker).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch

from tessera.train.worker.hooks import HookSpec
from tessera.train.worker.links import DriverLink, RaySession


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs besides the Recipe, all derived when the job starts (the job's
    options are the recipe's ``job`` section).

    Attributes:
        recipe: ``Recipe.to_dict()``.
        run_name, run_dir: the run chosen for this job and its directory (checkpoints).
        driver: the driver actor's name (in namespace ``job.namespace``).
        threads: ``torch.set_num_threads`` on CPU workers (``job.threads``, or the worker's CPUs).
        hooks: worker hooks to build on every rank (:class:`~tessera.train.worker.hooks.HookSpec`).
        profile_reference: with ``planner.cost_source=profile``, the profile the plan used (item
            -> median ms), for the drift check (:mod:`tessera.train.worker.drift`); empty: no check.
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


def _dbo_table(got: dict, program):
    """The :class:`~tessera.dbo.predict.RankTable` the driver sent with ``program``
    (``get_program``'s ``dbo`` entry, present with ``dbo.enabled``), else None."""
    if got.get("dbo") is None:
        return None
    from tessera.train.dbo.table import table_from_dict

    return table_from_dict(got["dbo"], program)


def version_recipe(recipe, got: dict):
    """``recipe`` with ``dbo.enabled`` and ``dbo.routing`` as the plan version in ``got`` (a
    ``get_program`` answer) has them (the bubble optimizer can be switched while the job runs;
    switched on live it reads the router's live counts, :attr:`tessera.train.job.driver.Driver.dbo_recipe`)."""
    on = bool(got.get("dbo_enabled", recipe.dbo.enabled))
    routing = got.get("dbo_routing", recipe.dbo.routing) if on else recipe.dbo.routing
    changes = ([f"dbo.enabled={str(on).lower()}"] if on != recipe.dbo.enabled else []) + \
        ([f"dbo.routing={routing}"] if routing != recipe.dbo.routing else [])
    return recipe.with_overrides(changes) if changes else recipe


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
        runner: the rank's :class:`~tessera.train.worker.step.StepRunner`; data: the replica's
            :class:`~tessera.train.worker.data.DataShard` (``position``, ``next_batch()``, state).
        model: the resolved ModelSpec; version: the plan version of ``runner``'s Program.
        hooks: resolved worker hooks (:class:`tessera.train.worker.hooks.WorkerHooks`).
        session: a :class:`RaySession` (anything with its methods).
        live: the rank's :class:`~tessera.train.dbo.live.LiveCounts` (``dbo.routing: router``),
            closed when the loop ends and rebuilt at a plan change; groups: the rank's
            :class:`~tessera.engine.groups.RankGroups` (to rebuild it).
        position: ``replica * pp + pipeline rank`` (:meth:`tessera.engine.groups.Layout.position`;
            None: ``rank``): the number of the rank's checkpoint part and of its Program.
    """

    def __init__(self, cfg: WorkerConfig, recipe, *, rank: int, world: int, device: str, driver, runner, data,
                 model, version: int, hooks=(), session=None, live=None, groups=None, plan_shape=None,
                 position: int | None = None) -> None:
        from tessera.train.upgrade.schedule import PendingPoll, UpgradeSchedule

        self.cfg, self.recipe, self.run_name = cfg, recipe, cfg.run_name
        self.rank, self.world, self.device = rank, world, device
        self.position = rank if position is None else position  # checkpoint part and Program number (Layout.position)
        self.driver, self.runner, self.data, self.model = driver, runner, data, model
        self.version, self.hooks = version, tuple(hooks)
        self.live, self.groups = live, groups
        self.plan_shape = plan_shape  # the driver's plan_shape of `version`: a change rebuilds the stages
        self.schedule = UpgradeSchedule(version)  # agreed plan switches (tessera.train.upgrade.schedule)
        self.poll = PendingPoll(driver) if rank == 0 else None
        self.stop_poll = StopPoll(driver, rank)  # the launcher's stop request (SIGTERM), agreed at a boundary
        self.stopping = False  # every rank: the launcher asked to stop (agreed in step's all-gather)
        self.switch: dict | None = None  # what the switch before this iteration cost (its metrics)
        self.session = session if session is not None else RaySession(self.host_group)
        self.attempt = 0
        self.flops = self.peak = 0.0
        p = recipe.parallel
        self.layout = (p.pp, p.dp, p.ep)
        self.drift = self._drift_check(cfg, recipe, model)
        self.check_every = recipe.profile.check_every if self.drift is not None or recipe.autopilot.enabled else 0
        self._signature: dict | None = None  # task -> item, for the autopilot's checks (built at the first)
        self.tokens = p.dp * p.num_microbatches * p.micro_batch_size * p.seq_length

    @staticmethod
    def _drift_check(cfg: WorkerConfig, recipe, model):
        """The :class:`~tessera.train.worker.drift.DriftCheck` of a run planned on a profile, else None."""
        if not cfg.profile_reference or recipe.profile.check_every <= 0:
            return None
        from tessera.config.resolve import resolve_hardware
        from tessera.cost.analytic import analytic_costs
        from tessera.cost.profile_costs import task_signatures
        from tessera.cost.types import ParallelShape
        from tessera.train.worker.drift import DriftCheck

        costs = analytic_costs(model, resolve_hardware(recipe), ParallelShape.of(recipe.parallel))
        return DriftCheck(dict(cfg.profile_reference), task_signatures(costs), recipe.profile.check_every)

    @classmethod
    def setup(cls, cfg: WorkerConfig, session=None) -> "WorkerLoop":
        """Build the loop on a Ray Train worker (module docstring, item 1): rank, world size and
        device from Ray Train, the node's interfaces checked, the driver actor reached, then
        :meth:`build`.

        Raises:
            RuntimeError: Ray Train started another number of workers than the layout needs.
            TesseraConfigError / ProgramError: bad input, found now or by a worker of an earlier
                start (recorded with the driver).
        """
        import ray
        import ray.train

        from tessera.config.load import recipe_from_dict

        recipe = recipe_from_dict(cfg.recipe)
        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        check_interfaces(recipe, rank, cfg)  # job.socket_ifname names interfaces of this node
        driver = DriverLink(ray.get_actor(cfg.driver, namespace=recipe.job.namespace))
        return cls.build(cfg, recipe, rank=rank, world=world, device=_device(recipe), driver=driver, session=session,
                         node_id=ray.get_runtime_context().get_node_id())

    @classmethod
    def build(cls, cfg: WorkerConfig, recipe, *, rank: int, world: int, device: str, driver,
              session=None, node_id: str | None = None) -> "WorkerLoop":
        """Build the loop once rank, world size, device and the driver are known (no Ray needed:
        :meth:`setup` on a Ray Train worker, the tests' ``tests/local_job.py`` in local
        processes): threads, seed and deterministic mode, the layout's process groups over the
        default group, the live counts, the rank's Program from ``driver`` (anything with
        :class:`DriverLink`'s methods) and its stages.

        Raises:
            RuntimeError: the world has another number of ranks than the layout needs.
            TesseraConfigError / ProgramError: bad input, found now or by a rank of an earlier
                start (recorded with the driver).
        """
        from tessera.config.resolve import resolve_model
        from tessera.engine.groups import make_groups
        from tessera.errors import ProgramError, TesseraConfigError
        from tessera.model.determinism import use_deterministic
        from tessera.program.instructions import Program
        from tessera.train.dbo.live import make_live
        from tessera.train.worker.data import shard_for
        from tessera.train.worker.hooks import resolve_hooks
        from tessera.train.worker.placement import placed_layout
        from tessera.train.worker.step import RankInfo, make_step_runner

        if device == "cpu":
            torch.set_num_threads(max(1, cfg.threads))
        torch.manual_seed(recipe.train.seed)
        if recipe.train.deterministic:  # CUDA: CUBLAS_WORKSPACE_CONFIG before any CUDA work; warn_only by model below
            use_deterministic(device)
        p = recipe.parallel
        if p.pp * p.dp != world:
            raise RuntimeError(f"the recipe's layout needs {p.pp * p.dp} workers (pp*dp), the world has {world}")
        layout = placed_layout(recipe, rank, world, device, driver, node_id)  # the driver's check of the nodes
        groups = make_groups(layout, timeout=recipe.job.pg_timeout_s)  # every group: the job's timeout
        live = None
        try:
            fatal = driver.call("fatal_error")
            if fatal is not None:  # a worker of an earlier start found bad input: restarting cannot help
                raise fatal[1]
            try:
                hooks = resolve_hooks(cfg.hooks)
                model = resolve_model(recipe)
                if recipe.train.deterministic and device != "cpu":  # warn_only=False unless an op has no such kernel
                    use_deterministic(device, model)
                got = driver.call("get_program", layout.position(rank))
                version, program = got["plan_version"], Program.from_dict(got["program"])
                info = RankInfo(rank, world, groups.pipeline_rank, groups.replica, groups.ep_rank, version, device)
                table = _dbo_table(got, program)
                running = version_recipe(recipe, got)  # the version's dbo.enabled / dbo.routing
                live = make_live(running, groups, device)  # dbo.routing=router: every EP rank builds the transport
                runner = make_step_runner(running, program, info, groups, model=model, dbo_table=table, live=live)
                data = shard_for(recipe, groups.replica)
            except (TesseraConfigError, ProgramError) as e:
                driver.call("record_fatal", rank, e)
                raise
        except BaseException:
            if live is not None:
                live.close()
            raise
        return cls(cfg, recipe, rank=rank, world=world, device=device, driver=driver, runner=runner, data=data,
                   model=model, version=version, hooks=hooks, session=session, live=live, groups=groups,
                   plan_shape=got.get("plan_shape"), position=layout.position(rank))

    # --- start ------------------------------------------------------------------------------------
    def restore_point(self):
        """Rank 0 picks the newest complete checkpoint (and deletes partial ones); every rank
        gets ``(CheckpointInfo or None, names of the deleted partial checkpoints)``."""
        from tessera.train.worker.checkpoint import cleanup_partial, latest_complete

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
        after (0: from the start). Without a checkpoint, ``train.init_from`` (a Hugging Face
        directory) gives the stages' weights (:func:`tessera.train.worker.hf_io.load_into_stages`: each
        rank reads its own tensors); a checkpoint takes precedence over it.

        Raises:
            RuntimeError: the checkpoint's layout differs from the recipe's.
            TesseraConfigError: ``train.init_from`` does not hold the recipe's model.
        """
        from tessera.train.worker.checkpoint import load_part

        start = 0
        point, removed = self.restore_point()
        if point is not None:
            if point.layout != self.layout:
                raise RuntimeError(f"checkpoint {point.path} has layout (pp, dp, ep) = {point.layout}, the recipe "
                                   f"{self.layout}")
            part = load_part(point.path, self.position)
            if self.runner.holds_stages_of(part["state"]):
                self.runner.load_state_dict(part["state"])
            else:  # saved under another partition: take this rank's parameters by name from its pipeline group's parts
                self.runner.load_parts([load_part(point.path, r)["state"] for r in self.pipeline_peers()])
            self.data.load_state_dict({"position": part["data_position"]})
            start = part["step"]
        elif self.recipe.train.init_from:  # a fresh run: weights from a Hugging Face directory
            from tessera.train.worker.hf_io import load_into_stages

            load_into_stages(self.recipe.train.init_from, self.runner.modules, self.model)
        started = self.driver.call("worker_group_started", start, removed) if self.rank == 0 else None
        self.attempt = self.session.broadcast(started, self.rank)
        return start

    def pipeline_peers(self) -> list[int]:
        """Positions (checkpoint part numbers, ``replica * pp + pipeline rank``) of this rank's
        pipeline group, in pipeline order."""
        pp = self.layout[0]
        return [self.position - self.position % pp + p for p in range(pp)]

    def prepare_metrics(self) -> None:
        """The iteration's model FLOPs and the job's peak FLOP/s (on CPU a matmul benchmark on
        every rank at once: a collective)."""
        from tessera.config.auto import resolve_precision
        from tessera.config.resolve import resolve_hardware
        from tessera.train.worker.metrics import iteration_flops, job_peak_flops

        self.flops = iteration_flops(self.model, self.recipe.parallel)
        self.peak = job_peak_flops(resolve_hardware(self.recipe), self.device, self.host_group,
                                   resolve_precision(self.recipe))

    # --- one iteration ---------------------------------------------------------------------------
    def maybe_upgrade(self, step: int) -> bool:
        """Before iteration ``step``: switch every rank to the version agreed for this boundary
        (:meth:`step` agrees on it, :mod:`tessera.train.upgrade.schedule`); returns True when it
        switched. The rank fetches its new Program (the only driver call, and only now); a
        changed partition, vpp or split W rebuilds the stages and moves parameters and optimizer
        state by global names over the pipeline group; with the bubble optimizer on, the count
        transport is torn down and built anew. :attr:`switch` holds what it cost (collective)."""
        from tessera.program.instructions import Program
        from tessera.train.worker.step import build_modules

        version = self.schedule.due(step)
        if version is None or version == self.version:
            return False
        t0 = time.perf_counter()
        got = self.driver.call("get_program", self.position, version)
        program = Program.from_dict(got["program"])
        table = _dbo_table(got, program)
        recipe = version_recipe(self.recipe, got)
        if self.live is not None:  # the transport is torn down before the plan change
            self.live.close()
            self.live = None
        if table is not None:
            from tessera.train.dbo.live import make_live
            from tessera.train.dbo.table import make_policy

            self.live = make_live(recipe, self.groups, self.device)  # collective over the EP group
            policy = make_policy(recipe, table, self.runner_ep_rank(), self.live)
        else:
            policy = None
        shape = got.get("plan_shape")
        def fresh_stages(p):
            return build_modules(recipe, self.model, p, self.groups, self.device)

        rebuild = fresh_stages if shape is not None and shape != self.plan_shape else None
        method = self.recipe.job.reshard_method
        from tessera.config.storage_rules import local_dir  # dcp writes files: an object-store run's local stand-in

        scratch = os.path.join(local_dir(self.cfg.run_dir), "reshard", f"v{version}-replica{self.groups.replica}") \
            if method == "dcp" and self.groups is not None else None
        report = self.runner.set_program(program, policy, self.live if policy is not None else None, rebuild,
                                         method, scratch)
        moved = report.moved_bytes if report is not None else 0
        total, slowest = self.session.reduce_switch(moved, time.perf_counter() - t0)
        self.switch = {"from": self.version, "moved_bytes": int(total), "switch_s": slowest}
        self.version, self.plan_shape = got["plan_version"], shape
        return True

    @property
    def host_group(self):
        """The group of host-side collectives (:attr:`tessera.engine.groups.RankGroups.host`;
        None: the default group, as on gloo)."""
        return getattr(self.groups, "host", None)

    def runner_ep_rank(self) -> int:
        """This rank's EP rank (for a new bubble-optimizer policy)."""
        return self.groups.ep_rank if self.groups is not None else 0

    def step(self, step: int):
        """Iteration ``step`` on the replica's next batch; returns the job's
        :class:`~tessera.train.worker.metrics.IterationMetrics` (gathered over every rank; the same
        all-gather carries rank 0's announcement of the next plan version, agreed into
        :attr:`schedule`, and whether the launcher asked the job to stop, agreed into
        :attr:`stopping`)."""
        from tessera.train.worker.metrics import gather_step

        position = self.data.position
        if self.poll is not None:
            self.poll.ask()  # answered while the iteration runs; read at its end
        timed = self.check_due(step)  # per-task times only where compared
        batch = self.data.next_batch()
        local = self.runner.run(batch, timed=True) if timed else self.runner.run(batch)
        if timed and self.drift is not None:
            local = replace(local, profile_drift=self.drift.drift(getattr(self.runner, "last_timings", ())))
        announce = self.schedule.announcement(self.poll.latest()) if self.poll is not None else None
        it, announced, self.stopping = gather_step(local, step=step, flops=self.flops, peak_flops=self.peak,
                                                   tokens=self.tokens, plan_version=self.version,
                                                   data_position=position, attempt=self.attempt,
                                                   group=self.host_group, announce=announce,
                                                   stop=self.stop_poll.answered())
        self.schedule = self.schedule.agree(step, announced)
        if self.switch is not None:
            it = replace(it, plan_switch_from=self.switch["from"], plan_switch_moved_bytes=self.switch["moved_bytes"],
                         plan_switch_s=self.switch["switch_s"])
        if timed and self.recipe.autopilot.enabled:  # the autopilot's check: every rank's task times and routing
            check = self.straggler_check(step)
            if check is not None:
                it = replace(it, **check.metrics())
        optimizer = getattr(self.runner, "optimizer", None)  # the learning rate of this step's update
        it = replace(it, lr=float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None,
                     device=self.device.partition(":")[0])
        if local.dbo is not None:  # dbo.enabled: every rank has a summary (a collective)
            from tessera.train.dbo.table import gather_summaries
            from tessera.train.worker.metrics import with_dbo

            it = with_dbo(it, gather_summaries(local.dbo, self.host_group))
        return it

    def check_due(self, step: int) -> bool:
        """Whether iteration ``step`` is a check step: every ``profile.check_every`` steps when
        the profile drift check or the autopilot (``autopilot.enabled``) runs; the iteration
        then runs on the profiling engine (per-task times, the routers' counts)."""
        return self.check_every > 0 and step % self.check_every == 0

    def straggler_check(self, step: int):
        """The autopilot's check of iteration ``step`` (just run on the profiling engine;
        :mod:`tessera.train.worker.straggler`): this rank's :class:`~tessera.train.worker.straggler.RankSample`
        (its task times per item; with EP its EP group's tokens per EP rank of every (microbatch,
        MoE layer) it ran, summed over the EP group by an all-reduce), gathered over every rank;
        rank 0 returns the :class:`~tessera.train.worker.straggler.CheckEstimate`, the other
        ranks None. Collective (every rank calls it at the same steps)."""
        import torch.distributed as dist

        from tessera.train.worker.straggler import RankSample, check_estimate, ep_block_counts, rank_sample

        pp, _, ep = self.layout
        if self._signature is None:
            self._signature = self._task_signatures()
        loads = []
        routes = list(getattr(self.runner, "last_routes", ()))
        if ep > 1 and routes:
            mine = torch.tensor([ep_block_counts(r.tolist() if hasattr(r, "tolist") else r, ep) for _, _, r in routes],
                                dtype=torch.int64, device=self.device)
            group = getattr(self.groups, "ep", None)
            if group is not None and dist.is_initialized():
                dist.all_reduce(mine, group=group)  # the EP group's tokens per EP rank, row by row
            loads = mine.cpu().tolist()
        pipeline_rank = self.groups.pipeline_rank if self.groups is not None else self.position % pp
        sample = rank_sample(self.rank, pipeline_rank, getattr(self.runner, "last_timings", ()), self._signature, ep,
                             loads)
        if dist.is_initialized() and dist.get_world_size(self.host_group) > 1:
            every = [None] * dist.get_world_size(self.host_group)
            dist.all_gather_object(every, sample.to_dict(), group=self.host_group)
        else:
            every = [sample.to_dict()]
        if self.rank != 0:
            return None
        return check_estimate(step, [RankSample.from_dict(d) for d in every], pp)

    def _task_signatures(self) -> dict:
        """Every task's item (:func:`tessera.cost.profile_costs.task_signatures` of the model's
        analytic costs: only the names matter)."""
        from tessera.config.resolve import resolve_hardware
        from tessera.cost.analytic import analytic_costs
        from tessera.cost.profile_costs import task_signatures
        from tessera.cost.types import ParallelShape

        costs = analytic_costs(self.model, resolve_hardware(self.recipe), ParallelShape.of(self.recipe.parallel))
        return task_signatures(costs)

    def report(self, step: int, it) -> None:
        """Rank 0 sends iteration ``step``'s metrics ``it`` to the driver (not waited for)."""
        if self.rank == 0:
            if self.switch is not None:  # the driver confirms the version and records the switch
                self.driver.send("confirm_version", self.version, step, self.switch)
            self.driver.send("report", self.rank, step, it.to_dict())
        self.switch = None

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
        doc = self.driver.call("plan_dict", self.version) if self.rank == 0 else None
        die = False
        for hook in self.hooks:
            die = bool(hook.die_before_marker(self, step)) or die
        self.session.save(step, {"step": step, "loss": it.loss}, rank=self.position, world_size=self.world,
                          layout=self.layout, plan_version=self.version, data_position=self.data.position,
                          state=self.runner.state_dict(), plan=doc["plan"] if doc else None,
                          history=doc.get("history") if doc else None, die_before_marker=die)
        return True

    # --- the whole loop --------------------------------------------------------------------------
    def finish(self) -> None:
        """Rank 0 waits until the driver has every report (calls from one caller run in order),
        then every rank meets at a barrier."""
        if self.rank == 0:
            self.driver.call("ready")
        self.session.barrier()

    def stop_due(self, step: int) -> bool:
        """After iteration ``step`` (and its checkpoint, when one was due): whether the launcher
        asked the job to stop (:class:`StopPoll`; the same answer on every rank, agreed in
        :meth:`step`'s all-gather)."""
        return self.stopping

    def run(self) -> None:
        """Restore, then every remaining iteration (module docstring) until the last step or a
        stop request (:meth:`stop_due`), then :meth:`finish`; the count transport
        (``dbo.routing: router``) is closed at the end, also on failure."""
        try:
            start = self.restore()
            self.prepare_metrics()
            for step in range(start + 1, self.recipe.train.steps + 1):
                self.stop_poll.ask()  # answered while the iteration runs; read at its end (step's all-gather)
                self.maybe_upgrade(step)
                it = self.step(step)
                self.report(step, it)
                for hook in self.hooks:
                    hook.after_step(self, step)
                self.checkpoint(step, it)
                if self.stop_due(step):
                    break
            self.finish()
        finally:
            if self.live is not None:
                self.live.close()


class StopPoll:
    """Whether the launcher asked the job to stop (the driver's ``stop_requested``: SIGTERM to
    the launcher, e.g. ``ray job stop``). Rank 0 asks at the start of an iteration (:meth:`ask`,
    never waiting) and :meth:`answered` reads the answer at its end; the iteration's metrics
    all-gather carries it to every rank (as the plan announcement of
    :class:`tessera.train.upgrade.schedule.PendingPoll`), so every rank
    ends after the same step (a request that comes during an iteration ends the job after the
    next one at the latest). A driver without ``submit`` (one process without Ray, tests) is
    never asked."""

    def __init__(self, driver, rank: int) -> None:
        self.driver, self.rank = driver, rank
        self.enabled = getattr(driver, "submit", None) is not None
        self.reason: str | None = None
        self._ref = None

    def ask(self) -> None:
        if self.enabled and self.rank == 0 and self._ref is None and self.reason is None:
            self._ref = self.driver.submit("stop_requested")

    def answered(self) -> bool:
        """Rank 0: whether the stop request has come (its reason, e.g. ``"SIGTERM"``, kept in
        :attr:`reason`); other ranks: False (they learn rank 0's answer from the all-gather)."""
        if self.enabled and self.rank == 0 and self._ref is not None:
            done, value = self.driver.poll(self._ref)
            if done:
                self._ref, self.reason = None, self.reason or value
        return self.reason is not None


def check_interfaces(recipe, rank: int, cfg: WorkerConfig) -> None:
    """Check on this worker's node that the interfaces ``job.socket_ifname`` names exist (gloo and
    NCCL get them as ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``), before any group uses them;
    a missing one is bad input, recorded with the driver (a restart cannot help). On CPU jobs Ray
    Train's gloo default group is made first, so there gloo's own error comes before this check.

    Raises:
        TesseraConfigError: an interface is missing here (node and rank named).
    """
    import socket

    from tessera.config.job_rules import check_socket_ifname_here
    from tessera.errors import TesseraConfigError

    try:
        check_socket_ifname_here(recipe.job, f"node {socket.gethostname()} (worker rank {rank})")
    except TesseraConfigError as e:
        import ray

        DriverLink(ray.get_actor(cfg.driver, namespace=recipe.job.namespace)).call("record_fatal", rank, e)
        raise


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: :class:`WorkerLoop` built from ``config``
    (:meth:`WorkerConfig.to_dict`) and run."""
    WorkerLoop.setup(WorkerConfig.from_dict(config)).run()
