"""What a worker's loop asks of the outside: the driver actor (:class:`DriverLink`) and Ray
Train / ``torch.distributed`` (:class:`RaySession`). :class:`tessera.train.worker.loop.WorkerLoop`
takes anything with their methods, so the loop also runs in one process without Ray (tests)."""

from __future__ import annotations

import torch


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

    def submit(self, method: str, *args):
        """Start a call and return its reference at once (read it with :meth:`poll`)."""
        return getattr(self.handle, method).remote(*args)

    def poll(self, ref) -> tuple[bool, object]:
        """``(True, answer)`` if the call ``ref`` has finished (``(True, None)`` if it failed,
        e.g. the driver restarted), else ``(False, None)``; never waits."""
        import ray

        done, _ = ray.wait([ref], timeout=0)
        if not done:
            return False, None
        try:
            return True, ray.get(ref)
        except Exception:  # noqa: BLE001 - a failed poll is retried at the next step; nothing is lost
            return True, None


class RaySession:
    """What the loop asks of Ray Train and ``torch.distributed`` on a worker."""

    def __init__(self, group=None) -> None:
        self.group = group  # the host group (RankGroups.host; None: the default group)

    def broadcast(self, obj, rank: int):
        """Rank 0's ``obj`` on every rank (``broadcast_object_list``; other ranks pass None)."""
        import torch.distributed as dist

        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def checkpoint_path(self) -> str | None:
        """The location of Ray Train's ``get_checkpoint()`` (the newest it registered: a local
        path, or an ``s3://`` / ``gs://`` URI, :func:`tessera.train.storage.location_of`), or None."""
        import ray.train

        from tessera.train.storage import location_of

        got = ray.train.get_checkpoint()
        return location_of(got.filesystem, got.path) if got is not None else None

    def save(self, step: int, metrics: dict, **part) -> None:
        """:func:`tessera.train.worker.checkpoint.save_through_ray` (a barrier across ranks)."""
        from tessera.train.worker.checkpoint import save_through_ray

        save_through_ray(step, metrics, **part)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def reduce_switch(self, moved_bytes: int, seconds: float) -> tuple[int, float]:
        """``(sum of moved_bytes, max of seconds)`` over every rank (a plan switch's cost)."""
        import torch.distributed as dist

        both = torch.tensor([float(moved_bytes), float(seconds)], dtype=torch.float64)
        parts = [torch.empty_like(both) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, both, group=self.group)
        rows = torch.stack(parts)
        return int(rows[:, 0].sum().item()), float(rows[:, 1].max().item())
