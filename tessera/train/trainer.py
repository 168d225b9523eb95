"""The Ray Train ``TorchTrainer`` of a Tessera job.

* ``ScalingConfig``: ``pp * dp`` workers (tp = 1); on CPU recipes (``hardware.preset: cpu``)
  each worker asks for a fraction of a CPU (``cpus_per_worker``, default: the cluster's CPUs
  shared evenly, at most 1), on GPU recipes one GPU each;
* ``TorchConfig``: gloo on CPU, NCCL on GPUs, with a process-group timeout;
* ``RunConfig``: ``storage_path`` and ``name`` (the run directory holds the checkpoints),
  ``FailureConfig(max_failures)`` (a failed worker restarts the whole group from the newest
  checkpoint), ``CheckpointConfig(num_to_keep)``, quiet worker logs.

:func:`tessera.train.preflight.check_cluster` fails fast, before this is built, when the cluster
cannot hold the workers (Ray Train would otherwise wait for them forever).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerOptions:
    """Knobs of the Ray Train job that are not part of the recipe.

    Attributes:
        storage_path: absolute directory holding the run directories.
        max_failures: worker-group restarts before the job fails.
        cpus_per_worker: CPUs per worker on CPU recipes (None: shared evenly, at most 1).
        num_to_keep: checkpoints Ray keeps.
        pg_timeout_s: timeout of the torch process groups.
    """

    storage_path: str
    max_failures: int = 3
    cpus_per_worker: float | None = None
    num_to_keep: int = 3
    pg_timeout_s: float = 300.0


def uses_gpu(recipe) -> bool:
    """GPU workers unless the recipe's hardware is the ``cpu`` preset."""
    return recipe.hardware.preset != "cpu"


def worker_resources(recipe, cluster: dict, cpus_per_worker: float | None = None) -> dict:
    """``resources_per_worker`` of the job on a cluster with ``cluster`` resources."""
    world = recipe.parallel.pp * recipe.parallel.dp
    if uses_gpu(recipe):
        return {"GPU": 1.0, "CPU": cpus_per_worker if cpus_per_worker is not None else 1.0}
    if cpus_per_worker is None:
        cpus_per_worker = min(1.0, math.floor(100 * float(cluster.get("CPU", 1.0)) / world) / 100)
    return {"CPU": max(0.01, cpus_per_worker)}


def build_trainer(recipe, worker_config, options: TrainerOptions, resources: dict):
    """The ``TorchTrainer`` running :func:`tessera.train.worker.train_loop` with ``worker_config``
    (a :class:`~tessera.train.worker.WorkerConfig`)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tessera.train.ray_setup import WORKER_ENV
    from tessera.train.worker import train_loop

    world = recipe.parallel.pp * recipe.parallel.dp
    gpu = uses_gpu(recipe)
    scaling = ScalingConfig(num_workers=world, use_gpu=gpu, resources_per_worker=dict(resources))
    threads = max(1, int(resources.get("CPU", 1.0)))
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", **WORKER_ENV}
    if gpu and recipe.train.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS (train.deterministic)
    run = RunConfig(
        name=worker_config.run_name, storage_path=options.storage_path,
        failure_config=FailureConfig(max_failures=options.max_failures, controller_failure_limit=3),
        checkpoint_config=CheckpointConfig(num_to_keep=options.num_to_keep),
        worker_runtime_env={"env_vars": env}, logging_config=LoggingConfig(log_level="WARNING"),
    )
    return TorchTrainer(train_loop, train_loop_config=worker_config.to_dict(),
                        torch_config=TorchConfig(backend="nccl" if gpu else "gloo", timeout_s=int(options.pg_timeout_s)),
                        scaling_config=scaling, run_config=run)
