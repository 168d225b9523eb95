"""Where a recipe's profile lives and what identifies it (:mod:`tessera.cost.profile_cache`).

:func:`profile_fingerprint` fills every field of :data:`tessera.cost.profile_cache.FINGERPRINT_FIELDS`
from the recipe, so the machine that plans and the workers that profile compute the same key:
the device is the recipe's hardware (its preset or inline name; the workers' own device name is
stored with the items and checked when profiling), the device count is ``pp * dp``, the topology
``ep``, ``tp`` and the hardware's GPUs per node, the dtype ``float32`` on the ``cpu`` preset
(the engine computes in fp32 there) and ``train.precision`` otherwise, the NCCL version that of the
installed ``nvidia-nccl-cu*`` package (``"none"`` on CPU), the layer shapes the resolved model's
layers, and the microbatch shape.
"""

from __future__ import annotations

import importlib.metadata
import os

from tessera.cost.profile_cache import Fingerprint, make_fingerprint

__all__ = ["profile_fingerprint", "profile_cache_path", "nccl_version"]


def nccl_version() -> str:
    """Version of the installed NCCL wheel (``nvidia-nccl-cu12`` / ``-cu13``), or ``"none"``."""
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def profile_fingerprint(recipe, model, hardware) -> Fingerprint:
    """The profile key of ``recipe`` with its resolved ``model`` (ModelSpec) and ``hardware``
    (HardwareSpec) (module docstring)."""
    p = recipe.parallel
    cpu = hardware.name == "cpu"
    return make_fingerprint(device=hardware.name, device_count=p.pp * p.dp, ep=p.ep, tp=p.tp,
                            gpus_per_node=hardware.gpus_per_node, dtype="float32" if cpu else recipe.train.precision,
                            layers=model.to_dict()["layers"], seq_length=p.seq_length,
                            micro_batch_size=p.micro_batch_size, nccl="none" if cpu else nccl_version())


def profile_cache_path(recipe) -> str:
    """``profile.cache`` as an absolute path: as given when absolute, else under ``logging.out_dir``
    (``~`` expanded)."""
    path = os.path.expanduser(recipe.profile.cache)
    if os.path.isabs(path):
        return path
    return os.path.abspath(os.path.join(os.path.expanduser(recipe.logging.out_dir), path))
