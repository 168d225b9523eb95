"""Where a recipe's profile lives and what identifies it (:mod:`tessera.cost.profile_cache`).

:func:`profile_fingerprint` fills every field of :data:`tessera.cost.profile_cache.FINGERPRINT_FIELDS`
from the recipe, so the machine that plans and the workers that profile compute the same key:
the device is the recipe's hardware (its preset or inline name; the workers' own device name is
stored with the items and checked when profiling), the device count is ``pp * dp``, the topology
``ep``, ``tp`` and the hardware's GPUs per node, the dtype the resolved ``train.precision``
(:func:`tessera.config.auto.resolve_precision`; ``fp32`` written ``float32``, the ``cpu``
preset's default; ``-pure`` appended under ``train.master_weights=false``, whose BF16 parameters
the profiled stages hold), the NCCL version that of the
installed ``nvidia-nccl-cu*`` package (``"none"`` on CPU), the layer shapes the resolved model's
layers, and the microbatch shape.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

from tessera.cost.profile_cache import Fingerprint, make_fingerprint

__all__ = ["profile_fingerprint", "profile_cache_path", "nccl_version", "LoadedProfile", "load_profile_costs"]


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
    from tessera.config.auto import resolve_precision

    cpu = hardware.name == "cpu"
    dtype = resolve_precision(recipe) + ("" if recipe.train.master_weights else "-pure")
    return make_fingerprint(device=hardware.name, device_count=p.pp * p.dp, ep=p.ep, tp=p.tp,
                            gpus_per_node=hardware.gpus_per_node, dtype="float32" if dtype == "fp32" else dtype,
                            layers=model.to_dict()["layers"], seq_length=p.seq_length,
                            micro_batch_size=p.micro_batch_size, nccl="none" if cpu else nccl_version())


def profile_cache_path(recipe) -> str:
    """``profile.cache`` as an absolute path: as given when absolute, else under ``logging.out_dir``
    (``~`` expanded; an object-store ``logging.out_dir`` stands for a local directory of this node,
    :func:`tessera.config.storage_rules.local_dir`: the cache is an SQLite file)."""
    from tessera.config.storage_rules import local_dir

    path = os.path.expanduser(recipe.profile.cache)
    if os.path.isabs(path):
        return path
    return os.path.abspath(os.path.join(local_dir(recipe.logging.out_dir), path))


@dataclass(frozen=True)
class LoadedProfile:
    """A recipe's profile applied to its analytic costs (:func:`load_profile_costs`).

    Attributes:
        costs: the profiled :class:`~tessera.cost.types.ModelCosts`.
        report: :class:`~tessera.cost.profile_costs.ProfileCostReport` (measured, fallback and
            scaled tasks; measured pairs).
        path, digest: the cache file and the profile's fingerprint digest.
        stale, drift: the profile's stale mark and the drift that set it (None when fresh).
    """

    costs: object
    report: object
    path: str
    digest: str
    stale: bool
    drift: float | None

    def fallback_note(self) -> str:
        """e.g. ``"profile 1a2b3c4d5e6f (134 tasks measured, 0 fell back to the analytic model;
        40 pairs measured)"``."""
        r = self.report
        scaled = f", {len(r.scaled)} of them scaled by the calibration" if r.scaled else ""
        return (f"profile {self.digest[:12]} ({len(r.measured)} tasks measured, {len(r.fallback)} fell back to the "
                f"analytic model{scaled}; {r.pairs_measured} pairs measured)" + (" STALE" if self.stale else ""))


def load_profile_costs(recipe, model, hardware, analytic) -> LoadedProfile:
    """The recipe's profile (its cache and fingerprint: module docstring) applied to ``analytic``
    (:func:`tessera.cost.profile_costs.profiled_costs`); reading creates no file.

    Raises:
        TesseraConfigError: the cache has no profile of this model, layout and software
            (``planner.cost_source``; fix: ``tessera profile`` first).
    """
    from tessera.cost.profile_cache import ProfileCache
    from tessera.cost.profile_costs import profiled_costs
    from tessera.errors import TesseraConfigError

    path = profile_cache_path(recipe)
    fp = profile_fingerprint(recipe, model, hardware)
    cache = ProfileCache(path)
    items = cache.get(fp)
    if not items:
        raise TesseraConfigError("planner.cost_source", "profile",
                                 f"the profile cache {path} has no profile of this model, layout and software "
                                 f"(fingerprint {fp.digest[:12]})",
                                 "run `tessera profile RECIPE` with this recipe file and the same overrides "
                                 f"(logging.out_dir and profile.cache name {path}) first, or use "
                                 "planner.cost_source=analytic")
    costs, report = profiled_costs(analytic, {k: v.median_ms for k, v in items.items()})
    status = cache.status(fp)
    return LoadedProfile(costs, report, path, fp.digest, status.stale, status.drift)
