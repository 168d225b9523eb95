"""The Ray Train ``TorchTrainer`` of a Tessera job, configured from the recipe's ``job`` section.

* ``ScalingConfig``: ``pp * dp`` workers (tp = 1); on CPU recipes (``hardware.preset: cpu``)
  each worker asks for a fraction of a CPU (``job.cpus_per_worker``, default: the cluster's CPUs
  shared evenly, at most 1), on GPU recipes one GPU each; plus the extra resources of
  ``job.resources_per_worker`` (so the workers run only on nodes that offer them);
* ``TorchConfig``: gloo on CPU, NCCL on GPUs, with a process-group timeout (``job.pg_timeout_s``;
  the workers give the same timeout to every group they make, :func:`tessera.engine.groups.make_groups`);
* the workers' environment (:func:`worker_env`, Ray Train's ``worker_runtime_env``): OpenMP threads,
  quiet libraries, and the socket interface of gloo and NCCL (``job.socket_ifname`` as
  ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``; null: the launcher's own values of those
  variables, where set), and with ``logging.out_dir`` on object storage the launcher's storage
  variables (credentials, region, endpoint: :func:`tessera.train.storage.storage_env`);
* ``RunConfig``: ``storage_path`` and ``name`` (the run directory holds the checkpoints; on object
  storage with a ``storage_filesystem`` built on the launcher, :func:`tessera.train.storage.ray_storage`),
  ``FailureConfig(job.max_failures)`` (a failed worker restarts the whole group from the newest
  checkpoint), ``CheckpointConfig(job.num_to_keep)``, quiet worker logs.

:func:`tessera.train.job.preflight.check_cluster` fails fast, before this is built, when the cluster
cannot hold the workers (Ray Train would otherwise wait for them forever).
"""

from __future__ import annotations

import math
import os
from typing import Mapping


def uses_gpu(recipe) -> bool:
    """GPU workers unless the recipe's hardware is the ``cpu`` preset."""
    return recipe.hardware.preset != "cpu"


def worker_resources(recipe, cluster: dict) -> dict:
    """``resources_per_worker`` of the job on a cluster with ``cluster`` resources (``{"CPU": n,
    ...}``): ``job.cpus_per_worker`` CPUs, or on CPU recipes the cluster's CPUs shared evenly (at
    most 1, at least 0.01), on GPU recipes 1 CPU; plus one GPU on GPU recipes; plus
    ``job.resources_per_worker`` (extra Ray resources, e.g. a custom resource of the nodes the
    workers must run on)."""
    world = recipe.parallel.pp * recipe.parallel.dp
    cpus_per_worker = recipe.job.cpus_per_worker
    extra = {str(k): float(v) for k, v in (recipe.job.resources_per_worker or {}).items()}
    if uses_gpu(recipe):
        return {"GPU": 1.0, "CPU": cpus_per_worker if cpus_per_worker is not None else 1.0, **extra}
    if cpus_per_worker is None:
        cpus_per_worker = min(1.0, math.floor(100 * float(cluster.get("CPU", 1.0)) / world) / 100)
    return {"CPU": max(0.01, cpus_per_worker), **extra}


def worker_threads(recipe, resources: dict) -> int:
    """torch and OpenMP threads per worker: ``job.threads``, else the worker's whole CPUs (at
    least 1)."""
    if recipe.job.threads is not None:
        return int(recipe.job.threads)
    return max(1, int(resources.get("CPU", 1.0)))


def worker_env(recipe, threads: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables every worker process gets (Ray Train's ``worker_runtime_env``):
    ``threads`` OpenMP threads, quiet libraries (:data:`tessera.train.job.ray_setup.WORKER_ENV`),
    on deterministic GPU recipes cuBLAS's workspace setting, and the socket interface(s):
    ``job.socket_ifname`` as both ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, or when it is
    null each of those variables that the launcher's environment ``environ`` (default
    ``os.environ``) sets, as it is; with ``logging.out_dir`` on object storage the storage
    variables ``environ`` sets (:func:`tessera.train.storage.storage_env`: ``AWS_*``, ...), which
    the workers need to read and write the run directory."""
    from tessera.config.job_rules import SOCKET_IFNAME_ENV
    from tessera.train.job.ray_setup import WORKER_ENV
    from tessera.train.storage import storage_env

    environ = os.environ if environ is None else environ
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", **WORKER_ENV}
    if uses_gpu(recipe) and recipe.train.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS (train.deterministic)
    ifname = recipe.job.socket_ifname
    for name in SOCKET_IFNAME_ENV:
        value = ifname if ifname is not None else environ.get(name)
        if value:
            env[name] = value
    env.update(storage_env(recipe.logging.out_dir, environ))
    return env


def build_trainer(recipe, worker_config, storage_path: str, resources: dict, loop=None):
    """The ``TorchTrainer`` running ``loop`` (default :func:`tessera.train.worker.loop.train_loop`;
    :func:`tessera.train.job.profile.profile_loop` for a profile run) with ``worker_config``
    (a :class:`~tessera.train.worker.loop.WorkerConfig`, whose ``threads`` it also gives OpenMP), its
    run directories under ``storage_path`` (absolute, or an ``s3://`` / ``gs://`` URI:
    :func:`tessera.train.storage.ray_storage`), ``resources`` per worker
    (:func:`worker_resources`) and the workers' environment :func:`worker_env`."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tessera.train.storage import ray_storage
    from tessera.train.worker.loop import train_loop

    world = recipe.parallel.pp * recipe.parallel.dp
    gpu = uses_gpu(recipe)
    scaling = ScalingConfig(num_workers=world, use_gpu=gpu, resources_per_worker=dict(resources))
    job = recipe.job
    env = worker_env(recipe, worker_config.threads)
    path, filesystem = ray_storage(storage_path)
    run = RunConfig(
        name=worker_config.run_name, storage_path=path, storage_filesystem=filesystem,
        failure_config=FailureConfig(max_failures=job.max_failures, controller_failure_limit=3),
        checkpoint_config=CheckpointConfig(num_to_keep=job.num_to_keep),
        worker_runtime_env={"env_vars": env}, logging_config=LoggingConfig(log_level="WARNING"),
    )
    return TorchTrainer(loop or train_loop, train_loop_config=worker_config.to_dict(),
                        torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=int(job.pg_timeout_s)),
                        scaling_config=scaling, run_config=run)
