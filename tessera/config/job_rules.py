"""Value rules of the recipe's ``job`` section (the Ray Train job of ``tessera train``).

:func:`check_job` is called by :func:`tessera.config.validate.validate_recipe`, so a bad value is
one :class:`~tessera.errors.TesseraConfigError` line (field, value, rule, fix; exit code 2) from
every command, before Ray starts. The rules (also in ``docs/recipes.md``):

* ``job.run_name``: null or a plain directory name (not empty, no ``/``, not ``.`` or ``..``);
* ``job.namespace``: not empty;
* ``job.max_failures``: >= -1 (-1: no limit, as Ray Train's ``FailureConfig``);
* ``job.cpus_per_worker``: null or a finite number > 0;
* ``job.threads``: null or >= 1;
* ``job.pg_timeout_s``: a finite number >= 1 (seconds; Ray's ``TorchConfig`` takes whole seconds);
* ``job.num_to_keep``: null or >= 1 (Ray Train's ``CheckpointConfig``).
"""

from __future__ import annotations

import math

from tessera.errors import TesseraConfigError


def _name_ok(name: str | None) -> bool:
    return name is None or (name.strip() != "" and "/" not in name and "\0" not in name and name not in (".", ".."))


def check_job(job) -> None:
    """Check the ``job`` section's value rules (module docstring), in order.

    Args:
        job: a :class:`tessera.config.schema.JobConfig` (a recipe's ``job``).

    Raises:
        TesseraConfigError: the first broken rule, naming ``job.<field>``.
    """
    cpus, threads, keep = job.cpus_per_worker, job.threads, job.num_to_keep
    checks = (
        ("job.run_name", job.run_name, _name_ok(job.run_name),
         "must be null or a plain directory name (not empty, no '/', not '.' or '..')",
         "use e.g. job.run_name=my-run, or null to have one chosen"),
        ("job.namespace", job.namespace, job.namespace.strip() != "", "must not be empty",
         "use e.g. job.namespace=tessera (the default)"),
        ("job.max_failures", job.max_failures, job.max_failures >= -1,
         "must be >= -1 (worker-group restarts; -1: no limit)", "use 0 (fail at once), e.g. 3, or -1"),
        ("job.cpus_per_worker", cpus, cpus is None or 0 < cpus < math.inf, "must be null or a finite number > 0",
         "use e.g. job.cpus_per_worker=0.5, or null to share the cluster's CPUs evenly"),
        ("job.threads", threads, threads is None or threads >= 1, "must be null or >= 1",
         "use e.g. job.threads=1, or null for the worker's whole CPUs"),
        ("job.pg_timeout_s", job.pg_timeout_s, 1 <= job.pg_timeout_s < math.inf,
         "must be a finite number >= 1 (seconds; Ray's TorchConfig takes whole seconds)", "use e.g. 300"),
        ("job.num_to_keep", keep, keep is None or keep >= 1, "must be null or >= 1 (Ray Train's CheckpointConfig)",
         "use e.g. job.num_to_keep=3, or null to keep every checkpoint"),
        ("job.upgrade_lead_steps", job.upgrade_lead_steps, job.upgrade_lead_steps >= 1,
         "must be >= 1 (iterations between an accepted upgrade and its switch)", "use e.g. job.upgrade_lead_steps=2"),
        ("job.reshard_method", job.reshard_method, job.reshard_method in ("p2p", "dcp"),
         "must be p2p or dcp", "use job.reshard_method=p2p"),
    )
    for field, value, ok, rule, fix in checks:
        if not ok:
            raise TesseraConfigError(field, value, rule, fix)
