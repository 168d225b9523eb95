"""A separate process talking to a running job's driver actor (``tessera status | upgrade |
rollback``): connect to the cluster, find the driver, call its RPCs.

* :func:`connect`: ``ray.init`` for a client (``--address``, else ``RAY_ADDRESS``, else
  ``auto``; the address check of :func:`tessera.train.job.ray_setup.check_address` first, so a
  missing token or an unreachable head is one line). Token authentication works as for
  ``ray job submit``: with ``auto`` Ray reads ``~/.ray/auth_token`` itself, an explicit address
  needs ``RAY_AUTH_MODE=token``.
* :func:`find_driver`: ``--job`` is a run name (the actor :func:`~tessera.train.job.driver.driver_name`
  of it in the namespace), or a Ray job submission id (``raysubmit_...``) or Ray job id
  (``03000000``): the job, from the State API's job list, gives its Ray job id, and the job's
  live actor of class ``Driver`` named ``tessera-driver-...`` is its driver, in whatever namespace
  the job put it. The State API needs the cluster's dashboard (``ray start --head`` has one);
  when it does not answer, the driver whose status reports that submission id (the launcher
  passes it to the driver) is used. Nothing found: one line naming the drivers that do exist
  (any namespace).
* :class:`DriverClient`: the RPCs. Plans and recipes go as JSON strings (``json.dumps`` of
  ``Plan.to_dict()`` / ``Recipe.to_dict()``), never pickled objects. A refusal raised in the
  actor (:class:`~tessera.errors.UpgradeRefused`, any :class:`~tessera.errors.TesseraConfigError`
  or :class:`~tessera.errors.ProgramError`) comes back as that exception itself, without Ray's
  wrapper, so the CLI prints its one line.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from tessera.errors import ProgramError, TesseraConfigError
from tessera.train.job.driver import NAMESPACE, driver_name

DRIVER_PREFIX = driver_name("")
"""Actor-name prefix of every driver (``tessera-driver-``)."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds to wait for one driver RPC (``upgrade --recipe`` plans on the driver: seconds to minutes)."""


@dataclass(frozen=True)
class DriverRef:
    """Where a run's driver actor lives.

    Attributes:
        run: the run name (the actor name without :data:`DRIVER_PREFIX`).
        actor_name: the actor's name.
        namespace: its Ray namespace.
        job_id: the Ray job id (hex) that created it when found through a job, else None.
        found_by: ``"run name"``, ``"submission id"`` or ``"job id"``.
    """

    run: str
    actor_name: str
    namespace: str
    job_id: str | None
    found_by: str


def resolve_address(address: str | None) -> str:
    """``address``, else ``RAY_ADDRESS``, else ``"auto"``."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def connect(address: str | None, namespace: str = NAMESPACE) -> bool:
    """Join the cluster as a client; True when this call connected (the caller then calls
    ``ray.shutdown``), False when this process was connected already (that connection is used).

    Raises:
        TesseraConfigError: the address is unreachable, needs ``RAY_AUTH_MODE=token``, or Ray
            cannot connect (no cluster found for ``auto``, several found, ...).
    """
    import ray

    from tessera.train.job.ray_setup import TOKEN_FIX, check_address

    if ray.is_initialized():
        return False
    address = resolve_address(address)
    check_address(address)
    try:
        ray.init(address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as e:
        raise TesseraConfigError("--address", address, f"Ray cannot connect ({' '.join(str(e).split())})",
                                 "give the cluster's address (--address HOST:PORT or RAY_ADDRESS, as printed by "
                                 f"ray start); if the cluster uses token authentication, {TOKEN_FIX}") from None
    return True


@contextlib.contextmanager
def connected(address: str | None, namespace: str = NAMESPACE) -> Iterator[None]:
    """:func:`connect` for a block; disconnects at the end if it connected."""
    import ray

    owns = connect(address, namespace)
    try:
        yield
    finally:
        if owns:
            ray.shutdown()


def existing_drivers() -> list[tuple[str, str]]:
    """``(run name, namespace)`` of every named driver actor on the cluster, sorted."""
    import ray

    return sorted((a["name"][len(DRIVER_PREFIX):], a["namespace"])
                  for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(DRIVER_PREFIX))


def _not_found(job: str, namespace: str, why: str) -> TesseraConfigError:
    import ray

    runs = ", ".join(f"{run} (namespace {ns})" for run, ns in existing_drivers()) or "none"
    try:
        where = f" (on the Ray cluster at {ray.get_runtime_context().gcs_address})"
    except Exception:  # noqa: BLE001 - only for the message
        where = ""
    return TesseraConfigError("--job", job, f"{why}; running drivers: {runs}{where}",
                              "give one of those run names, or the submission id of a running `ray job submit` "
                              "job (and --namespace if its driver is not in namespace tessera); with several Ray "
                              "clusters on the machine give --address (the job prints its own at start, and keeps "
                              "it in <run dir>/ray_address) with RAY_AUTH_MODE=token")


def _first_sentence(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text.split(". ")[0][:limit]


def _state_api_error(job: str, e: Exception) -> TesseraConfigError:
    return TesseraConfigError("--job", job, "is no run name with a driver here, no driver reports it as its submission "
                              "id, and the cluster's job list cannot be read to look it up as a job "
                              f"({type(e).__name__}: {_first_sentence(e)})",
                              "give the run name instead (its driver actor is tessera-driver-<run name>), or start "
                              "the head with its dashboard (the State API needs it)")


def _job_driver(job: str, gcs_address: str) -> DriverRef | None:
    """The driver of the Ray job whose submission id or job id is ``job``, through the State API
    (None: no such job).

    Raises:
        TesseraConfigError: the job exists but has no live driver actor.
        Exception: whatever the State API raises when it cannot answer (no dashboard, ...).
    """
    from ray.util.state import list_actors, list_jobs

    found_by = "submission id"
    jobs = list_jobs(address=gcs_address, filters=[("submission_id", "=", job)], raise_on_missing_output=False)
    if not jobs:
        found_by = "job id"
        jobs = list_jobs(address=gcs_address, filters=[("job_id", "=", job)], raise_on_missing_output=False)
    if not jobs:
        return None
    info = jobs[0]
    actors = []  # a job without a job id: its entrypoint has not joined the cluster yet
    if info.job_id is not None:
        actors = list_actors(address=gcs_address, raise_on_missing_output=False,
                             filters=[("job_id", "=", info.job_id), ("class_name", "=", "Driver"), ("state", "=", "ALIVE")])
    drivers = [a for a in actors if (a.name or "").startswith(DRIVER_PREFIX)]
    if not drivers:
        status = str(getattr(info.status, "value", info.status))
        raise TesseraConfigError("--job", job, f"is Ray job {info.job_id or '(not started)'} ({status}), which has no live tessera driver "
                                 f"actor{' yet' if status in ('PENDING', 'RUNNING') else ''}",
                                 "wait until its driver has planned (a RUNNING job), or give a running job; running "
                                 f"drivers: {', '.join(r for r, _ in existing_drivers()) or 'none'}")
    a = drivers[0]
    return DriverRef(a.name[len(DRIVER_PREFIX):], a.name, a.ray_namespace, info.job_id, found_by)


def _driver_with_submission_id(job: str, timeout_s: float = 10.0) -> DriverRef | None:
    """The driver whose status names ``job`` as its submission id (asks every driver; one that
    does not answer within ``timeout_s`` is skipped); None when none does."""
    import ray

    for run, ns in existing_drivers():
        try:
            status = ray.get(ray.get_actor(driver_name(run), namespace=ns).status.remote(history=0), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead, busy or foreign actor: not this job's driver
            continue
        if isinstance(status, dict) and status.get("submission_id") == job:
            return DriverRef(run, driver_name(run), ns, None, "submission id")
    return None


def find_driver(job: str, namespace: str = NAMESPACE) -> DriverRef:
    """The driver of ``job`` on a connected Ray: the run named ``job`` in ``namespace``, else the
    Ray job with that submission id or job id (State API), else (the State API does not answer)
    the driver that reports ``job`` as its submission id.

    Raises:
        TesseraConfigError: no driver for ``job`` (the message lists the drivers that exist).
    """
    import ray

    if not job:
        raise _not_found(job, namespace, "is empty")
    try:
        ray.get_actor(driver_name(job), namespace=namespace)
        return DriverRef(job, driver_name(job), namespace, None, "run name")
    except ValueError:  # no such named actor
        pass
    try:
        ref = _job_driver(job, ray.get_runtime_context().gcs_address)
    except TesseraConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the State API's errors (no dashboard, timeouts) vary by Ray version
        ref = _driver_with_submission_id(job)
        if ref is None:
            raise _state_api_error(job, e) from None
    if ref is None:
        raise _not_found(job, namespace, f"is neither a run with a driver in namespace {namespace} nor a Ray job "
                                         "submission id or job id on this cluster")
    return ref


def _unwrap(e: BaseException) -> BaseException | None:
    """The tessera error inside Ray's wrapper of an actor exception (``RayTaskError.cause``: the
    exception the actor raised, unpickled); None when it is another kind."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, (TesseraConfigError, ProgramError)) else None


@dataclass(frozen=True)
class DriverClient:
    """The RPCs of one run's driver (``handle``: its actor handle). Every method waits at most
    ``timeout_s`` seconds.

    Raises (every method):
        UpgradeRefused / TesseraConfigError / ProgramError: the driver refused (its own exception).
        TesseraConfigError: the driver died or did not answer within ``timeout_s`` (``--job``).
    """

    ref: DriverRef
    handle: Any
    timeout_s: float = DEFAULT_TIMEOUT_S

    @staticmethod
    def open(job: str, namespace: str = NAMESPACE, timeout_s: float = DEFAULT_TIMEOUT_S) -> "DriverClient":
        """Find ``job``'s driver (:func:`find_driver`) on the connected Ray."""
        import ray

        ref = find_driver(job, namespace)
        return DriverClient(ref, ray.get_actor(ref.actor_name, namespace=ref.namespace), timeout_s)

    def _call(self, method: str, *args, **kwargs):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(getattr(self.handle, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except RayTaskError as e:
            inner = _unwrap(e)
            if inner is None:
                raise
            raise inner from None
        except RayActorError as e:
            raise TesseraConfigError("--job", self.ref.run, f"its driver actor {self.ref.actor_name} died "
                                     f"({_first_sentence(e)})",
                                     "check the job (ray job status / logs); a restarted driver answers again "
                                     "once it has recovered") from None
        except GetTimeoutError:
            raise TesseraConfigError("--job", self.ref.run, f"its driver did not answer {method} within "
                                     f"{self.timeout_s:g} s (a request may still be accepted later)",
                                     "check tessera status before retrying, or raise --timeout") from None

    def status(self, history: int = 50) -> dict:
        """The driver's status dict (``Driver.status``): run, step, total_steps, plan_version,
        plan, partition, pending_upgrade, versions, last, metrics (the last ``history`` records), ..."""
        return self._call("status", history=history)

    def upgrade_plan(self, plan: dict) -> dict:
        """Queue ``plan`` (``Plan.to_dict`` form); ``{"version", "effective_step"}``, or with
        ``"no_change": True`` (and ``"running"``) the current version when ``plan`` runs what it
        runs (nothing queued)."""
        return self._call("upgrade_plan", json.dumps(plan))

    def upgrade_recipe(self, recipe_dict: dict) -> dict:
        """Re-plan on the driver for ``recipe_dict`` (``Recipe.to_dict`` form) and queue it;
        as :meth:`upgrade_plan`, with ``"ignored"``: the fields that cannot change a plan and
        differ from the running job's, ``["field: running=X new=Y", ...]``."""
        return self._call("upgrade_recipe", json.dumps(recipe_dict))

    def upgrade_dbo(self, on: bool) -> dict:
        """Switch the bubble optimizer on or off; ``{"version", "effective_step"}``."""
        return self._call("upgrade_dbo", bool(on))

    def set_autopilot(self, on: bool) -> dict:
        """Resume (``on``) or pause the autopilot's decisions; ``{"enabled", "step"}``."""
        return self._call("set_autopilot", bool(on))

    def rollback(self, to: int | None = None) -> dict:
        """Back one version along the job's versions (the one the current version replaced), or
        to version ``to``; as :meth:`upgrade_plan`."""
        return self._call("rollback", None if to is None else int(to))


def read_plan_file(path: str) -> dict:
    """The plan in ``path`` (``Plan.to_dict`` form): the ``plan`` of a ``plan.json`` written by
    ``tessera plan`` (or its ``tessera.plan``), or a bare ``Plan.to_dict()``; checked here so a
    broken file fails before the cluster is asked.

    Raises:
        TesseraConfigError: unreadable, not JSON, or no plan in it (``--plan``).
    """
    fix = "give the plan.json that tessera plan wrote (or a JSON file holding one Plan.to_dict())"
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise TesseraConfigError("--plan", path, f"cannot be read ({e.strerror or e})", fix) from None
    except ValueError as e:
        raise TesseraConfigError("--plan", path, f"is not JSON ({e})", fix) from None
    keys = ("template", "pp", "vpp", "num_microbatches", "partition")
    for where in (("plan",), ("tessera", "plan"), ()):  # as tessera.train.upgrade.versions.plan_from_json reads it
        plan = doc
        for key in where:
            plan = plan.get(key) if isinstance(plan, dict) else None
        if isinstance(plan, dict) and set(keys) <= set(plan):
            return plan
    plan = doc.get("plan") if isinstance(doc, dict) and isinstance(doc.get("plan"), dict) else doc
    missing = [k for k in keys if not isinstance(plan, dict) or k not in plan]
    raise TesseraConfigError("--plan", path, f"holds no plan (missing {', '.join(missing)})", fix)
