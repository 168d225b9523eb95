"""A training job's worker loop on local gloo processes, without Ray (a reference for the Ray job tests).

:func:`run_local_job` runs :class:`tessera.train.worker.loop.WorkerLoop` (built by
:meth:`~tessera.train.worker.loop.WorkerLoop.build`, the second half of a Ray Train worker's
set-up) on ``pp * dp`` local ranks (:func:`tessera.testing.launch_local.run_local`): the same
process groups, Programs, stages, data shards, optimizer, metrics all-gather, checkpoints and
restore as a Ray job, with two stand-ins for what Ray provides:

* :class:`LocalDriver` answers the worker's driver calls from a real
  :class:`tessera.train.job.driver.Driver` built once in the calling process (its Programs, DBO
  tables and plan, for every rank, and those of the versions it has pending: plan upgrades
  accepted before the launch, which the ranks agree on and switch to at their steps as in a Ray
  job), and keeps rank 0's reports (a job's ``metrics.jsonl`` rows) and version confirmations;
* :class:`LocalSession` is the worker's :class:`~tessera.train.worker.links.RaySession` (its
  ``torch.distributed`` collectives) with checkpoints written as plain files into the run
  directory instead of through ``ray.train.report``.

A Ray job test compares a live job with such a run where the comparison is the point (the same
training bitwise, another plan or the optimizer off) and a second Ray job would only repeat
what the first proves about Ray.
"""

from __future__ import annotations

import functools
import os

from tessera.testing.launch_local import run_local
from tessera.train.worker.links import RaySession


class LocalDriver:
    """The driver calls a worker makes (``call`` / ``send``, as :class:`DriverLink`), answered
    from plain values: ``programs`` (world rank -> ``Driver.get_program(rank)``) and ``plan``
    (``Driver.plan_dict()``). Rank 0's ``report`` calls are kept in :attr:`reports`; the run
    starts as attempt 0. ``upgrades``: per pending version, ``{"programs": {rank: ...}, "plan":
    Driver.plan_dict(version)}``, and ``pending``: ``Driver.pending_versions()``; rank 0's
    ``confirm_version`` calls are kept in :attr:`confirmed` (``[version, step]``)."""

    def __init__(self, programs: dict, plan: dict, placement=None, upgrades: dict | None = None,
                 pending: list | None = None) -> None:
        self.programs, self.plan, self.placement = programs, plan, placement
        self.upgrades, self.pending = upgrades or {}, list(pending or [])
        self.reports: list[dict] = []
        self.confirmed: list[list[int]] = []
        self.placed: dict | None = None

    def call(self, method: str, *args):
        return getattr(self, f"_{method}")(*args)

    send = call

    def _fatal_error(self):
        return None

    def _place_ranks(self, node_ids: list, record: bool = True) -> dict:
        """:meth:`tessera.train.job.driver.Driver.place_ranks` on ``placement`` (the driver's
        planned :class:`~tessera.spec.placement.Placement`)."""
        from tessera.spec.placement import check_nodes

        self.placed = check_nodes(self.placement, node_ids)
        return self.placed

    def _record_fatal(self, rank: int, error: Exception) -> None:
        return None

    def _get_program(self, rank: int, version: int | None = None) -> dict:
        if version is not None and int(version) in self.upgrades:
            return self.upgrades[int(version)]["programs"][rank]
        got = self.programs[rank]
        if version is not None and int(version) != got["plan_version"]:
            raise KeyError(f"LocalDriver serves plan version {got['plan_version']}, not {version}")
        return got

    def _worker_group_started(self, step: int, removed=None) -> int:
        return 0

    def _pending_versions(self) -> list:
        return self.pending

    def _confirm_version(self, version: int, step: int, switch=None) -> None:
        self.confirmed.append([int(version), int(step)])

    def _report(self, rank: int, step: int, metrics: dict) -> None:
        if rank == 0:
            self.reports.append(dict(metrics, step=step))

    def _ready(self) -> None:
        return None

    def _plan_dict(self, version: int | None = None) -> dict:
        if version is not None and int(version) in self.upgrades:
            return self.upgrades[int(version)]["plan"]
        return self.plan

    def _claim_fault(self, key: str) -> bool:
        return True


class LocalSession(RaySession):
    """:class:`RaySession` without Ray Train: no Ray checkpoint to resume from, and a checkpoint
    part written straight into ``run_dir`` (then a barrier, as Ray Train's report is)."""

    def __init__(self, run_dir: str, group=None) -> None:
        super().__init__(group)
        self.run_dir = run_dir

    def checkpoint_path(self) -> None:
        return None

    def save(self, step: int, metrics: dict, *, die_before_marker: bool = False, **part) -> None:
        from tessera.train.worker.checkpoint import dir_name, write_part

        write_part(os.path.join(self.run_dir, dir_name(step)), step=step, **part)
        self.barrier()


def _rank(rank: int, world: int, *, recipe: dict, run_dir: str, programs: dict, plan: dict, placement,
          node_ids=None, upgrades=None, pending=None) -> dict:
    from tessera.config.load import recipe_from_dict
    from tessera.train.worker.loop import WorkerConfig, WorkerLoop

    cfg = WorkerConfig(recipe, "local", run_dir, "local", threads=1)
    driver = LocalDriver(programs, plan, placement, upgrades, pending)
    loop = WorkerLoop.build(cfg, recipe_from_dict(recipe), rank=rank, world=world, device="cpu", driver=driver,
                            session=LocalSession(run_dir), node_id=None if node_ids is None else node_ids[rank])
    loop.session.group = loop.host_group
    loop.run()
    return {"reports": driver.reports, "placed": driver.placed, "slot": loop.groups.layout.position(rank)
            if loop.groups is not None else None, "confirmed": driver.confirmed}


def run_local_job(recipe, run_dir: str, driver, timeout_s: float = 300.0, node_ids=None, out=None) -> list[dict]:
    """Run ``recipe``'s worker loop on ``pp * dp`` local gloo ranks on the plan ``driver`` runs
    (a :class:`tessera.train.job.driver.Driver` made in this process on ``run_dir``; with
    ``train.resume`` it has recovered from the run's newest checkpoint, which the ranks restore);
    checkpoints go to ``run_dir`` as ``train.checkpoint_every`` says; the versions ``driver`` has
    pending (upgrades accepted before this call) are switched to at their steps. Returns rank 0's reports:
    per step the job's metrics, as a Ray job's ``metrics.jsonl`` rows. ``node_ids``: the node each
    world rank reports (default: the host name, one node); ``out``: a list that gets every rank's
    result (``placed``: the driver's answer to its nodes, ``slot``: its position, ``confirmed``:
    rank 0's ``[version, step]`` switches).

    Raises:
        tessera.testing.launch_local.WorkerError: a rank failed (its traceback in the message).
    """
    p = recipe.parallel
    world = p.pp * p.dp
    programs = {r: driver.get_program(r) for r in range(world)}
    pending = driver.pending_versions()
    upgrades = {v: {"programs": {r: driver.get_program(r, v) for r in range(world)}, "plan": driver.plan_dict(v)}
                for v, _ in pending}
    from tessera.config.resolve import resolve_hardware
    from tessera.spec.placement import place

    planned = place(p.pp, p.dp, p.ep, resolve_hardware(recipe).gpus_per_node, p.rank_order)
    fn = functools.partial(_rank, recipe=recipe.to_dict(), run_dir=run_dir, programs=programs,
                           plan=driver.plan_dict(), placement=planned, node_ids=node_ids, upgrades=upgrades,
                           pending=pending)
    results = run_local(fn, world, timeout_s)
    if out is not None:
        out.extend(results)
    return results[0]["reports"]


def assert_parts_equal(a_path: str, b_path: str, parts: int) -> None:
    """Assert the first ``parts`` rank parts of two checkpoints (locations of
    :func:`tessera.train.worker.checkpoint.load_part`) hold the same stages and parameter names,
    and bitwise the same module tensors and optimizer state; a failure names the part."""
    import torch

    from tessera.train.worker import checkpoint as ckpt

    for part in range(parts):
        x, y = ckpt.load_part(a_path, part)["state"], ckpt.load_part(b_path, part)["state"]
        assert x["stages"] == y["stages"] and x["param_names"] == y["param_names"], part
        for mx, my in zip(x["modules"], y["modules"]):
            assert mx.keys() == my.keys() and all(torch.equal(mx[k], my[k]) for k in mx), part
        sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
        assert sx.keys() == sy.keys() and all(torch.equal(sx[i][k], sy[i][k]) for i in sx for k in sx[i]), part
