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
* ``job.num_to_keep``: null or >= 1 (Ray Train's ``CheckpointConfig``);
* ``job.socket_ifname``: null or interface names separated by commas, each 1-15 letters, digits,
  ``.``, ``_``, ``-`` or ``:`` (Linux names are at most 15 characters), without NCCL's ``^`` and
  ``=`` prefixes (gloo takes the names as they are: one value must suit both). Whether the
  interfaces exist is a property of the nodes, not of the recipe: :func:`check_socket_ifname_here`
  checks it on a machine that runs workers (the launcher's own, when it starts the local cluster;
  every worker's node before it makes its groups).
* ``job.resources_per_worker``: null or a mapping of Ray resource names to amounts, each name a
  non-empty string other than :data:`RESERVED_RESOURCES` (set by ``job.cpus_per_worker`` and
  ``hardware.preset``), each amount a finite number > 0 (not a bool). Whether the cluster offers
  them is pre-flight's check (:func:`tessera.train.job.preflight.check_cluster`).
"""

from __future__ import annotations

import math
import re

from tessera.errors import TesseraConfigError

SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The environment variables that name the socket interface(s) of gloo and of NCCL: what
``job.socket_ifname`` sets on every worker (``tessera.train.job.trainer``), and what
``tessera.testing.launch_local.run_local`` hands its ranks when they are set."""

RESERVED_RESOURCES = ("CPU", "GPU")
"""Ray resources a worker's share of which other fields set (``job.cpus_per_worker``, one GPU per
worker unless ``hardware.preset=cpu``): not allowed in ``job.resources_per_worker``."""
RESOURCES_FIX = ("give extra Ray resources as name: amount, e.g. job.resources_per_worker={trainer: 1} for nodes "
                 "started with ray start --resources '{\"trainer\": 8}', or null")

_IFNAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
SOCKET_IFNAME_FIX = ("use e.g. job.socket_ifname=eth0 (`ip -o link` lists a node's interfaces), or null to let gloo "
                     "and NCCL choose")


def _ifnames_ok(value) -> bool:
    return value is None or (isinstance(value, str) and all(_IFNAME.fullmatch(n) for n in value.split(",")))


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
        ("job.socket_ifname", job.socket_ifname, _ifnames_ok(job.socket_ifname),
         "must be null or interface names separated by commas (each 1-15 letters, digits, '.', '_', '-' or ':'; "
         "NCCL's '^' and '=' prefixes are not gloo's)", SOCKET_IFNAME_FIX),
    )
    for field, value, ok, rule, fix in checks:
        if not ok:
            raise TesseraConfigError(field, value, rule, fix)
    check_resources_per_worker(job.resources_per_worker)


def check_resources_per_worker(resources) -> None:
    """The rule of ``job.resources_per_worker`` (module docstring).

    Raises:
        TesseraConfigError: not a mapping (field ``job.resources_per_worker``), a name that is
            empty, not a string or reserved, or an amount that is no finite number > 0 (field
            ``job.resources_per_worker.<name>``).
    """
    if resources is None:
        return
    field = "job.resources_per_worker"
    if not hasattr(resources, "items"):
        raise TesseraConfigError(field, resources, "must be null or a mapping of Ray resource names to amounts",
                                 RESOURCES_FIX)
    for name, amount in resources.items():
        if not isinstance(name, str) or not name.strip():
            raise TesseraConfigError(field, name, "names a resource with an empty or non-string name", RESOURCES_FIX)
        if name in RESERVED_RESOURCES:
            raise TesseraConfigError(f"{field}.{name}", amount, f"{name} is not an extra resource: workers get their "
                                     "CPUs from job.cpus_per_worker and one GPU each unless hardware.preset=cpu",
                                     f"remove {name} from job.resources_per_worker and set job.cpus_per_worker "
                                     "or hardware.preset")
        ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and 0 < amount < math.inf
        if not ok:
            raise TesseraConfigError(f"{field}.{name}", amount, "must be a finite number > 0 (Ray resource units "
                                     "per worker)", f"use e.g. job.resources_per_worker.{name}=1, or remove it")


def check_socket_ifname_here(job, where: str = "this machine", have: list[str] | None = None) -> None:
    """Check that every interface ``job.socket_ifname`` names exists on this machine (nothing
    when it is null). Call it only where workers run: the launcher when it starts the local
    cluster (its workers run here), a worker before it makes its process groups.

    Args:
        job: a :class:`tessera.config.schema.JobConfig`.
        where: this machine as the message names it (e.g. ``"node n1 (worker rank 3)"``).
        have: the machine's interface names (default: ``socket.if_nameindex()``).

    Raises:
        TesseraConfigError: an interface is missing (field ``job.socket_ifname``; the rule lists
            the interfaces there are).
    """
    if job.socket_ifname is None:
        return
    if have is None:
        import socket

        have = [name for _, name in socket.if_nameindex()]
    missing = [n for n in job.socket_ifname.split(",") if n not in have]
    if missing:
        raise TesseraConfigError("job.socket_ifname", job.socket_ifname,
                                 f"names interface(s) {', '.join(missing)} that {where} does not have "
                                 f"(it has {', '.join(sorted(have)) or 'none'})", SOCKET_IFNAME_FIX)
