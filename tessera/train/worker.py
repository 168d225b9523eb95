"""The train loop of one Ray Train worker (``train_loop(config)``, run on every rank).

1. Rank, world size and the default gloo/NCCL group come from Ray Train; the layout's process
   groups are made on top (:func:`tessera.engine.groups.make_groups`).
2. The rank's Program comes from the driver actor (``get_program(rank)``); only its stages are
   built (:func:`tessera.train.step.make_step_runner`). Bad input found while building (a
   ``TesseraConfigError`` or ``ProgramError``) is recorded with the driver before it is raised;
   a restarted worker group then fails at once with it instead of building again.
3. Restore: the newest complete checkpoint (Ray's ``get_checkpoint()`` or the run directory; rank
   0 decides and deletes partial ones) gives modules, optimizer, data position and step.
4. Each iteration: rank 0 asks the driver for the plan version (an upgrade lands at this
   boundary on every rank), the replica's batch, one engine iteration, metrics gathered over all
   ranks and reported to the driver by rank 0, a checkpoint every ``train.checkpoint_every``
   steps and at the last step (none when it is 0).

``config`` is :meth:`WorkerConfig.to_dict` (plain values: Ray pickles it to every worker).
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs besides the Recipe.

    Attributes:
        recipe: ``Recipe.to_dict()``.
        run_name, run_dir: the run and its directory (checkpoints).
        driver: the driver actor's name; namespace: its namespace.
        threads: ``torch.set_num_threads`` on CPU workers.
        fault_rank, fault_step: test-only fault injection: world rank ``fault_rank`` kills its own
            process after reporting step ``fault_step`` (once per run; -1: never).
        ckpt_fault_rank, ckpt_fault_step: test-only fault injection: world rank ``ckpt_fault_rank``
            kills its own process while writing the checkpoint of step ``ckpt_fault_step``, after
            its part's other files and before its marker (once per run; -1: never).
    """

    recipe: dict
    run_name: str
    run_dir: str
    driver: str
    namespace: str
    threads: int = 1
    fault_rank: int = -1
    fault_step: int = -1
    ckpt_fault_rank: int = -1
    ckpt_fault_step: int = -1

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "WorkerConfig":
        return WorkerConfig(**d)


def _broadcast_object(obj, rank: int):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _restore_point(run_dir: str, rank: int):
    """Rank 0 picks the newest complete checkpoint (and deletes partial ones); all ranks get
    ``(checkpoint or None, names of the deleted partial checkpoints)``."""
    from tessera.train.checkpoint import cleanup_partial, latest_complete

    info, removed = None, []
    if rank == 0:
        import ray.train

        ray_ckpt = ray.train.get_checkpoint()
        info = latest_complete(run_dir, extra=ray_ckpt.path if ray_ckpt is not None else None)
        removed = cleanup_partial(run_dir)
        if removed:
            print(f"tessera: removed {len(removed)} partial checkpoint(s): {', '.join(map(os.path.basename, removed))}")
    return _broadcast_object((info, [os.path.basename(r) for r in removed]), rank)


def _device(recipe) -> str:
    if recipe.hardware.preset != "cpu" and torch.cuda.is_available():
        import ray.train.torch

        return str(ray.train.torch.get_device())
    return "cpu"


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function (see the module docstring)."""
    import ray
    import ray.train
    import torch.distributed as dist

    from tessera.config.load import recipe_from_dict
    from tessera.config.resolve import resolve_model
    from tessera.errors import ProgramError, TesseraConfigError
    from tessera.engine.groups import Layout, make_groups
    from tessera.program.instructions import Program
    from tessera.train import checkpoint as ckpt
    from tessera.train.data import shard_for
    from tessera.train.metrics import aggregate, iteration_flops, job_peak_flops
    from tessera.train.step import RankInfo, make_step_runner

    cfg = WorkerConfig.from_dict(config)
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
        raise RuntimeError(f"the recipe's layout needs {layout.world_size} workers (pp*dp), Ray Train started {world}")
    groups = make_groups(layout)
    driver = ray.get_actor(cfg.driver, namespace=cfg.namespace)
    fatal = ray.get(driver.fatal_error.remote())
    if fatal is not None:  # a worker of an earlier start found bad input: restarting cannot help
        raise fatal[1]
    try:
        model = resolve_model(recipe)
        got = ray.get(driver.get_program.remote(rank))
        version, program = got["plan_version"], Program.from_dict(got["program"])
        info = RankInfo(rank, world, groups.pipeline_rank, groups.replica, groups.ep_rank, version, device)
        runner = make_step_runner(recipe, program, info, groups, model=model)
        data = shard_for(recipe, groups.replica)
    except (TesseraConfigError, ProgramError) as e:
        ray.get(driver.record_fatal.remote(rank, e))
        raise

    start = 0
    point, removed = _restore_point(cfg.run_dir, rank)
    if point is not None:
        if point.layout != (p.pp, p.dp, p.ep):
            raise RuntimeError(f"checkpoint {point.path} has layout (pp, dp, ep) = {point.layout}, the recipe "
                               f"{(p.pp, p.dp, p.ep)}")
        part = ckpt.load_part(point.path, rank)
        runner.load_state_dict(part["state"])
        data.load_state_dict({"position": part["data_position"]})
        start = part["step"]
    attempt = _broadcast_object(ray.get(driver.worker_group_started.remote(start, removed)) if rank == 0 else None,
                                rank)

    flops = iteration_flops(model, p)
    peak = job_peak_flops(recipe_hardware(recipe), device)
    tokens = p.dp * p.num_microbatches * p.micro_batch_size * p.seq_length
    every = recipe.train.checkpoint_every
    for step in range(start + 1, recipe.train.steps + 1):
        new_version = _broadcast_object(ray.get(driver.poll_plan.remote(step)) if rank == 0 else None, rank)
        if new_version != version:
            got = ray.get(driver.get_program.remote(rank))
            runner.set_program(Program.from_dict(got["program"]))
            version = got["plan_version"]
        position = data.position
        local = runner.run(data.next_batch())
        it = aggregate(local, step=step, flops=flops, peak_flops=peak, tokens=tokens, plan_version=version,
                       data_position=position, attempt=attempt)
        if rank == 0:
            driver.report.remote(rank, step, it.to_dict())
        if rank == cfg.fault_rank and step == cfg.fault_step and ray.get(
                driver.claim_fault.remote(f"{cfg.run_name}:{rank}:{step}")):
            print(f"tessera: fault injection: rank {rank} kills itself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if every > 0 and (step % every == 0 or step == recipe.train.steps):
            plan = ray.get(driver.plan_dict.remote())["plan"] if rank == 0 else None
            die = rank == cfg.ckpt_fault_rank and step == cfg.ckpt_fault_step and ray.get(
                driver.claim_fault.remote(f"{cfg.run_name}:ckpt:{rank}:{step}"))
            ckpt.save_through_ray(step, {"step": step, "loss": it.loss}, rank=rank, world_size=world,
                                  layout=(p.pp, p.dp, p.ep), plan_version=version, data_position=data.position,
                                  state=runner.state_dict(), plan=plan, die_before_marker=die)
    if rank == 0:  # calls from one caller run in order: the last report has landed when this returns
        ray.get(driver.ready.remote())
    dist.barrier()


def recipe_hardware(recipe):
    """The recipe's HardwareSpec (peak FLOP/s on GPUs)."""
    from tessera.config.resolve import resolve_hardware

    return resolve_hardware(recipe)
