"""Checkpoints through Ray Train, complete only when every rank's part is.

Layout of one checkpoint (a directory ``step_<8 digits>`` in the run directory
``<storage_path>/<run name>``, written by ``ray.train.report(checkpoint=...)``, which merges the
ranks' directories into one):

* ``rank_<r>.pt``: rank ``r``'s part (``torch.save``): its stages' modules and optimizer
  (:meth:`StepRunner.state_dict`), the data position, the step and the plan version;
* ``plan.json`` (rank 0 only): the Plan the job runs, its version and the plan history;
* ``rank_<r>.done``: the marker, written last (also when the part is copied into the run's
  storage): step, plan version, layout, data position, and the size and SHA-256 of every file of
  the rank's part.

A checkpoint *counts* only when it has one marker per rank of its layout and every file a marker
names exists with that size and hash (so an interrupted upload, whatever order its files arrived
in, never counts). :func:`latest_complete` finds the newest checkpoint that counts;
:func:`cleanup_partial` deletes the others that do not (and raises :class:`CheckpointCleanupError`
when one cannot be deleted).

The run directory is a local or shared directory, or an object-store prefix (``s3://``,
``gs://``): every read, listing and deletion here goes through :mod:`tessera.train.storage`
(``pyarrow.fs``), and a checkpoint path is a location of that module (a URI on object storage).
A part is always written into a local directory first (``torch.save`` needs a file):
:func:`save_through_ray` hands it to Ray Train, which uploads it into the run's storage, marker
last; :func:`write_part` given a URI writes into a local temporary directory and uploads the
files the same way (:func:`upload_part`). :func:`load_part` reads a part from object storage into
memory before ``torch.load``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass

import torch

from tessera.train import storage

PREFIX = "step_"
PLAN_FILE = "plan.json"


def dir_name(step: int) -> str:
    """Checkpoint directory name of ``step`` (sorts by step)."""
    return f"{PREFIX}{step:08d}"


def part_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def marker_name(rank: int) -> str:
    return f"rank_{rank:05d}.done"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: where it is and what it holds (from its markers)."""

    path: str
    step: int
    plan_version: int
    world_size: int
    layout: tuple[int, int, int]  # (pp, dp, ep)
    data_position: int


def _digest(path: str) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex)`` of the file at the location ``path``."""
    h = hashlib.sha256()
    size = 0
    with storage.open_input(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _atomic_write(path: str, write) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def write_part(directory: str, *, rank: int, world_size: int, layout: tuple[int, int, int], step: int,
               plan_version: int, data_position: int, state: dict, plan: dict | None = None,
               history: dict | None = None) -> str:
    """Write rank ``rank``'s part of the checkpoint of ``step`` into ``directory``; marker last.

    Args:
        state: the rank's state (modules, optimizer, ...), ``torch.save``-able.
        plan: the job's Plan dict (rank 0 writes it as ``plan.json``).
        history: the job's plan history (:meth:`tessera.train.upgrade.versions.History.to_dict`), kept
            in ``plan.json`` with the plan.

    ``directory`` may be an object-store URI: the part is written into a local temporary
    directory and uploaded, marker last (:func:`upload_part`).

    Returns:
        The marker's path (location).
    """
    if storage.is_remote(directory):
        with tempfile.TemporaryDirectory(prefix="tessera-ckpt-") as tmp:
            write_part(tmp, rank=rank, world_size=world_size, layout=layout, step=step, plan_version=plan_version,
                       data_position=data_position, state=state, plan=plan, history=history)
            upload_part(tmp, directory)
        return storage.join(directory, marker_name(rank))
    os.makedirs(directory, exist_ok=True)
    files = [part_name(rank)]
    payload = {"state": state, "step": step, "plan_version": plan_version, "data_position": data_position}
    _atomic_write(os.path.join(directory, files[0]), lambda p: torch.save(payload, p))
    if plan is not None:
        files.append(PLAN_FILE)
        doc = json.dumps({"plan": plan, "plan_version": plan_version, "step": step, "history": history},
                         sort_keys=True)
        _atomic_write(os.path.join(directory, PLAN_FILE), lambda p: _write_text(p, doc))
    listed = {}
    for name in files:
        size, sha = _digest(os.path.join(directory, name))
        listed[name] = {"size": size, "sha256": sha}
    marker = {"rank": rank, "world_size": world_size, "layout": list(layout), "step": step,
              "plan_version": plan_version, "data_position": data_position, "files": listed}
    path = os.path.join(directory, marker_name(rank))
    _atomic_write(path, lambda p: _write_text(p, json.dumps(marker, sort_keys=True)))
    return path


def upload_part(local_dir: str, directory: str, die_before_marker: bool = False) -> None:
    """Copy a part written by :func:`write_part` into ``local_dir`` to the checkpoint location
    ``directory``, the marker (``*.done``) last, so a part whose upload was cut off never has a
    marker. ``die_before_marker`` (a worker hook asked for it: test-only fault injection,
    :mod:`tessera.train.worker.hooks`) kills this process after the other files, before the
    marker."""
    storage.makedirs(directory)
    for file in sorted(os.listdir(local_dir), key=lambda n: (n.endswith(".done"), n)):
        if die_before_marker and file.endswith(".done"):
            import signal

            print(f"tessera: fault injection: killed while writing checkpoint {storage.basename(directory)}, "
                  f"before {file}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        storage.upload(os.path.join(local_dir, file), storage.join(directory, file))


def _markers(path: str, names) -> list[dict]:
    out = []
    for name in names:
        if name.startswith("rank_") and name.endswith(".done"):
            try:
                out.append(json.loads(storage.read_text(storage.join(path, name))))
            except (OSError, ValueError):
                return []  # a torn marker: the checkpoint does not count
    return out


def check_complete(path: str, verify_hash: bool = True) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if it counts (see the module docstring), else None; one deleted
    while it is read (Ray Train keeps only the newest ``job.num_to_keep``) does not count."""
    try:
        return _check_complete(path, verify_hash)
    except FileNotFoundError:
        return None


def _check_complete(path: str, verify_hash: bool) -> CheckpointInfo | None:
    listing = storage.entries(path)  # one listing: names and sizes
    if not listing:  # missing, no directory, or empty
        return None
    sizes = {e.name: e.size for e in listing if not e.is_dir}
    markers = _markers(path, sorted(sizes))
    if not markers:
        return None
    first = markers[0]
    world = int(first["world_size"])
    keys = {(m["world_size"], tuple(m["layout"]), m["step"], m["plan_version"], m["data_position"]) for m in markers}
    if len(keys) != 1 or sorted(m["rank"] for m in markers) != list(range(world)):
        return None
    for m in markers:
        for name, want in m["files"].items():
            if sizes.get(name) != want["size"]:  # missing (or a directory) or another size
                return None
            if verify_hash and _digest(storage.join(path, name))[1] != want["sha256"]:
                return None
    return CheckpointInfo(path, int(first["step"]), int(first["plan_version"]), world, tuple(first["layout"]),
                          int(first["data_position"]))


def _candidates(run_dir: str) -> list[str]:
    names = sorted((e.name for e in storage.entries(run_dir) if e.is_dir and e.name.startswith(PREFIX)),
                   reverse=True)
    return [storage.join(run_dir, n) for n in names]


def latest_complete(run_dir: str, extra: str | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``run_dir`` (and ``extra``, e.g. the location of
    ``ray.train.get_checkpoint()``), by step; None if there is none. Both are locations of
    :mod:`tessera.train.storage` (a local path or an object-store URI)."""
    found = [c for c in (check_complete(p) for p in _candidates(run_dir)) if c is not None]
    if extra and storage.is_dir(extra):
        c = check_complete(extra)
        if c is not None:
            found.append(c)
    return max(found, key=lambda c: c.step, default=None)


class CheckpointCleanupError(OSError):
    """A partial checkpoint could not be deleted (:func:`cleanup_partial`).

    Attributes:
        path: the first directory that is still there; reason: why (the OS error).
        removed: the directories that were deleted before the error was raised.
    """

    def __init__(self, path: str, reason: str, removed: list[str], failed: int):
        self.path, self.reason, self.removed = path, reason, removed
        more = f" (and {failed - 1} more)" if failed > 1 else ""
        super().__init__(f"cannot delete partial checkpoint {path}{more}: {reason}; {len(removed)} other(s) deleted; "
                         "fix: remove it by hand or fix its permissions, then restart")

    def __reduce__(self):  # picklable across Ray processes
        return (type(self), (self.path, self.reason, self.removed, 1))


def cleanup_partial(run_dir: str) -> list[str]:
    """Delete the checkpoint directories of ``run_dir`` that do not count; returns the paths that
    were deleted (each checked to be gone).

    It fails loudly: every partial checkpoint is tried, and if any is still there afterwards
    (:func:`tessera.train.storage.remove_tree` failed: on a local disk e.g. a permission error, or
    the checkpoint path is a symbolic link to a directory, which ``shutil.rmtree`` refuses; on an
    object store a refused deletion) it raises :class:`CheckpointCleanupError` naming
    the first such path and the reason. A directory that vanished meanwhile is neither an error
    nor reported. Call only when no rank is writing (e.g. at start-up, before the first save)."""
    removed: list[str] = []
    failed: list[tuple[str, str]] = []
    for p in _candidates(run_dir):
        if check_complete(p, verify_hash=False) is not None:
            continue
        err: OSError | None = None
        try:
            storage.remove_tree(p)
        except OSError as e:
            err = e
        if not (storage.exists(p) if storage.is_remote(p) else os.path.lexists(p)):
            if err is None:
                removed.append(p)
            continue
        failed.append((p, f"{type(err).__name__}: {err}" if err is not None else "still present after rmtree"))
    if failed:
        raise CheckpointCleanupError(failed[0][0], failed[0][1], removed, len(failed))
    return removed


def load_part(path: str, rank: int) -> dict:
    """Rank ``rank``'s part of the checkpoint at ``path``: ``{"state", "step", "plan_version",
    "data_position"}`` (from an object store: read into memory, then loaded)."""
    f = storage.join(path, part_name(rank))
    source = io.BytesIO(storage.read_bytes(f)) if storage.is_remote(f) else f
    return torch.load(source, map_location="cpu", weights_only=False)


def load_plan(path: str) -> tuple[dict, int, int]:
    """``(plan dict, plan version, step)`` stored in the checkpoint at ``path``."""
    doc = json.loads(storage.read_text(storage.join(path, PLAN_FILE)))
    return doc["plan"], int(doc["plan_version"]), int(doc["step"])


def load_history(path: str):
    """The plan history (:class:`tessera.train.upgrade.versions.History`) kept in the checkpoint at
    ``path``, or None (a checkpoint written without one, or an unreadable one)."""
    from tessera.train.upgrade.versions import History

    try:
        doc = json.loads(storage.read_text(storage.join(path, PLAN_FILE)))
        return History.from_dict(doc["history"]) if doc.get("history") else None
    except (OSError, ValueError, KeyError):
        return None


def _upload_marker_last(local_dir: str, name: str, die_before_marker: bool = False):
    """``checkpoint_upload_fn`` of :func:`save_through_ray`: copy the part's files from
    ``local_dir`` into the checkpoint ``name`` of the run's storage, the marker (``*.done``) last,
    so a part whose upload was cut off never has a marker. ``die_before_marker`` (a worker hook
    asked for it: test-only fault injection, :mod:`tessera.train.worker.hooks`) kills this process after
    the other files, before the marker (:func:`upload_part`)."""
    import ray.train

    ctx = ray.train.get_context().get_storage()
    fs, dest = ctx.storage_filesystem, ctx.build_checkpoint_path_from_name(name)
    upload_part(local_dir, storage.location_of(fs, dest), die_before_marker)
    return ray.train.Checkpoint(path=dest, filesystem=fs)


def save_through_ray(step: int, metrics: dict, *, die_before_marker: bool = False, **part) -> None:
    """Write this rank's part into a temporary directory and hand it to ``ray.train.report``
    as the checkpoint ``step_<step>`` (a barrier across ranks; the upload copies the marker last;
    Ray registers the checkpoint once every rank has uploaded). ``part``: the keyword arguments
    of :func:`write_part` other than ``directory`` and ``step``; ``die_before_marker``: a worker
    hook's request (see :func:`_upload_marker_last`)."""
    import ray.train

    with tempfile.TemporaryDirectory(prefix="tessera-ckpt-") as tmp:
        write_part(tmp, step=step, **part)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=dir_name(step),
                         checkpoint_upload_fn=lambda c, name: _upload_marker_last(c.path, name, die_before_marker))
