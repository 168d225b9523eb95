"""Local multi-process launcher: ``world_size`` processes on this host with gloo (or NCCL).

:func:`run_local` starts one process per rank (``torch.multiprocessing``, from a fork server by default), starts a
process group (``backend``: gloo by default; ``"nccl"``: each rank on CUDA device
``rank % device_count`` first, one GPU per rank, see :func:`nccl_unavailable`) whose rendezvous is
a ``torch.distributed.TCPStore`` the parent opens on port 0 (the OS picks the port as it binds
it: no free-port guess that another process could take first), calls ``world_fn(rank,
world_size)`` in each, and returns the ranks' results in rank order. Results travel as ``torch.save`` bytes (tensors are
fine; no shared-memory handles outlive the workers). It fails fast: when a worker raises, its
traceback (and those of ranks failing within the next two seconds, typically as a consequence)
is raised in the parent; when a worker dies without reporting, or the timeout passes, the
remaining workers are terminated and an error names the ranks.

``world_fn`` must be picklable (a module-level function or a ``functools.partial`` of one).
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tessera.config.job_rules import SOCKET_IFNAME_ENV
from tessera.config.storage_rules import object_store_env


class WorkerError(RuntimeError):
    """A worker raised, died, or did not finish in time (message: rank and traceback / exit code)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago: every socket stays
    bound until all are chosen (one at a time, the OS may hand the same port out twice, and Ray
    refuses two components on one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


BACKENDS = ("gloo", "nccl")
START_METHODS = ("spawn", "fork", "forkserver")
HOST = "127.0.0.1"
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "tessera.engine", "tessera.model.stage", "tessera.flow", "tessera.testing.reference"]
"""What a ``forkserver`` imports once, before it forks the ranks of every later launch."""


def nccl_unavailable(world_size: int) -> str | None:
    """Why ``world_size`` local NCCL ranks cannot run here (None: they can): NCCL needs one CUDA
    device per rank (two ranks on one GPU are refused by NCCL)."""
    if not torch.cuda.is_available():
        return "NCCL needs CUDA: torch.cuda.is_available() is False on this machine"
    if torch.cuda.device_count() < world_size:
        return f"NCCL needs {world_size} CUDA devices (one per rank), this machine has {torch.cuda.device_count()}"
    return None


def _worker(rank: int, world_size: int, port: int, world_fn: Callable[[int, int], Any], results, threads: int,
            pg_timeout_s: float, backend: str = "gloo", env: dict[str, str] | None = None) -> None:
    try:
        import torch.distributed as dist

        os.environ.update(env or {})  # a fork server's ranks have the server's environment, not the caller's
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore(HOST, port, None, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            value = world_fn(rank, world_size)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, buf.getvalue(), None))
    except BaseException:  # report everything; never leave the parent waiting
        results.put((rank, None, traceback.format_exc()))


def _collect_errors(results, errors: dict[int, str], waiting: int, grace_s: float = 2.0) -> str:
    """The first failure often makes other ranks fail too (closed connections): gather what
    arrives within ``grace_s`` so the root cause is in the message, in order of arrival."""
    deadline = time.monotonic() + grace_s
    while len(errors) < waiting and time.monotonic() < deadline:
        try:
            rank, _, err = results.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        if err is not None:
            errors[rank] = err
    return "\n".join(f"rank {r} failed:\n{e}" for r, e in errors.items())


def run_local(world_fn: Callable[[int, int], Any], world_size: int, timeout_s: float, *, threads: int = 1,
              backend: str = "gloo", start_method: str = "forkserver") -> list:
    """Run ``world_fn(rank, world_size)`` on ``world_size`` local ranks.

    Args:
        world_fn: picklable; its return value must be ``torch.save``-able.
        world_size: number of processes.
        timeout_s: wall-clock limit for the whole run, seconds (also the default group's timeout,
            which :func:`tessera.engine.groups.make_groups` gives its groups unless told another).
        threads: ``torch.set_num_threads`` in each worker.
        backend: ``"gloo"`` (default) or ``"nccl"`` (rank ``r`` on ``cuda:r % device_count``;
            ``world_fn`` puts its tensors there, e.g. ``torch.cuda.current_device()``).
        start_method: how the rank processes start (:data:`START_METHODS`): ``"forkserver"``
            (default: the first launch starts a clean server process that imports
            :data:`FORKSERVER_PRELOAD` once, every rank of this and later launches is forked from
            it, so no rank pays for those imports and nothing of the parent, threads or a Ray
            connection, leaks in), ``"spawn"`` (a fresh interpreter per rank) or ``"fork"`` (the
            parent itself; never with CUDA initialised in it).

    The ranks get the caller's ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` where set
    (:data:`tessera.config.job_rules.SOCKET_IFNAME_ENV`: the interface gloo and NCCL use, as
    ``job.socket_ifname`` sets them on a job's workers), and its object-store variables
    (:func:`tessera.config.storage_rules.object_store_env`: ``AWS_*``, ...), also when they come
    from a fork server started before the variables were set.

    Returns:
        The workers' return values, indexed by rank.

    Raises:
        ValueError: ``backend`` is not gloo / nccl, ``start_method`` not one of
            :data:`START_METHODS`, or NCCL cannot run ``world_size`` ranks here
            (:func:`nccl_unavailable` says why).
        WorkerError: a worker raised (its traceback is in the message), exited without a result,
            or the run exceeded ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"run_local backend={backend!r}: must be one of {BACKENDS}; use gloo on CPU")
    why = nccl_unavailable(world_size) if backend == "nccl" else None
    if why is not None:
        raise ValueError(f"run_local backend='nccl' world_size={world_size}: {why}; use backend='gloo'")
    if start_method not in START_METHODS:
        raise ValueError(f"run_local start_method={start_method!r}: must be one of {START_METHODS}; use forkserver")
    if start_method == "fork" and backend == "nccl":
        raise ValueError("run_local start_method='fork' backend='nccl': CUDA cannot be used in a forked child; "
                         "use start_method='spawn'")
    import torch.distributed as dist

    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    results = ctx.Queue()
    # the rendezvous: the parent holds the store's listening socket, bound to a port the OS chose
    store = dist.TCPStore(HOST, 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    env = {name: os.environ[name] for name in SOCKET_IFNAME_ENV if os.environ.get(name)}
    env.update(object_store_env())  # AWS_* and kin: ranks reading or writing a run directory on object storage
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, world_fn, results, threads, timeout_s,
                                               backend, env), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, payload, err = results.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(f"rank(s) {dead} died without a result (exit codes "
                                      f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise WorkerError(f"rank(s) {missing} did not finish within {timeout_s:.0f} s") from None
                continue
            if err is not None:
                raise WorkerError(_collect_errors(results, {rank: err}, world_size - len(out)))
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
        del store
    return [out[r] for r in range(world_size)]
