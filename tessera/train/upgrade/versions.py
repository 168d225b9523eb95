"""Plan versions of a running job: what the driver accepted, when each took effect, and the history
that checkpoints and a restarted driver carry on.

A :class:`PlanVersion` is one accepted plan (its ``Plan.to_dict`` form, whether the bubble
optimizer runs with it, the SHA-256 of both as canonical JSON, where it came from, and the step it
takes effect at). A :class:`History` is the ordered, immutable list of them; version numbers are
consecutive from 0 (the plan the job started with). The driver appends to it
(:meth:`History.accept`), confirms the step a version really took effect at
(:meth:`History.applied`) and writes it to ``<run dir>/plan_history.json`` after every change
(:func:`save_history`, an atomic replace on a local disk, one upload on an object store), so a
driver that Ray restarts comes back on the plan
the workers run; each checkpoint's ``plan.json`` also holds the history it was written under.

The *current* version is the newest accepted one (running or pending). Each version but 0
replaced the version current when it was accepted, its :meth:`History.predecessor`; a rollback
re-applies an earlier version's plan as a new version (``rollback_of``) and stands for that
version, so rollbacks in a row follow :meth:`History.lineage` back towards version 0, one version
each, and an upgrade after them replaces the version they led to. The path is derived from the
versions alone (nothing more is stored).

Everything is plain JSON: plans cross the wire as JSON text (:func:`plan_from_json`) and never as
pickled objects.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace

from tessera.train import storage

HISTORY_FILE = "plan_history.json"
FORMAT = 1  # the history file's format version


def plan_sha256(plan: dict, dbo: bool) -> str:
    """SHA-256 (hex) of ``plan`` (``Plan.to_dict`` form) and the DBO switch as canonical JSON
    (sorted keys, no spaces), so equal plans hash equal wherever they were made."""
    doc = json.dumps({"plan": plan, "dbo": bool(dbo)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


@dataclass(frozen=True)
class PlanVersion:
    """One accepted plan.

    Attributes:
        version: 0 for the job's first plan, then +1 per accepted request.
        plan: the Plan (``Plan.to_dict`` form).
        dbo: whether the bubble optimizer runs under this version.
        sha256: :func:`plan_sha256` of (plan, dbo).
        source: ``"initial"``, ``"plan"`` (a plan file), ``"recipe"`` (re-planned on the driver),
            ``"dbo"`` (the optimizer switched), ``"rollback"`` (an earlier version re-applied;
            ``rollback_of`` names it: ``tessera rollback`` or ``--to``), ``"restart"`` (a resumed job given a new plan)
            or ``"autopilot"`` (the job's autopilot switched, :mod:`tessera.train.job.autopilot`).
        effective_step: the first iteration run under it: announced when accepted, confirmed by
            the workers' reports (``applied``).
        applied: True once a worker report showed it running.
        requested_at: Unix time of the request, s.
        rollback_of: for a rollback, the version whose plan it re-applies.
    """

    version: int
    plan: dict
    dbo: bool
    sha256: str
    source: str
    effective_step: int
    applied: bool = False
    requested_at: float = 0.0
    rollback_of: int | None = None

    def summary(self) -> dict:
        """The fields ``tessera status`` shows (no plan body)."""
        from tessera.program.plan import Partition

        return {"version": self.version, "sha256": self.sha256, "source": self.source,
                "effective_step": self.effective_step, "applied": self.applied, "dbo": self.dbo,
                "template": self.plan["template"], "vpp": self.plan["vpp"],
                "partition": Partition(tuple(self.plan["partition"]["bounds"])).describe(),
                "rollback_of": self.rollback_of}

    def to_dict(self) -> dict:
        return {"version": self.version, "plan": self.plan, "dbo": self.dbo, "sha256": self.sha256,
                "source": self.source, "effective_step": self.effective_step, "applied": self.applied,
                "requested_at": self.requested_at, "rollback_of": self.rollback_of}

    @staticmethod
    def from_dict(d: dict) -> "PlanVersion":
        return PlanVersion(int(d["version"]), d["plan"], bool(d["dbo"]), d["sha256"], d["source"],
                           int(d["effective_step"]), bool(d.get("applied", False)), float(d.get("requested_at", 0.0)),
                           d.get("rollback_of"))


@dataclass(frozen=True)
class History:
    """The job's accepted plans, oldest first (``versions[i].version == i``)."""

    versions: tuple[PlanVersion, ...]

    @staticmethod
    def start(plan: dict, dbo: bool, source: str = "initial", step: int = 1) -> "History":
        """The history of a job that starts (at iteration ``step``) on ``plan``."""
        return History((PlanVersion(0, plan, dbo, plan_sha256(plan, dbo), source, step, True, time.time()),))

    @property
    def latest(self) -> PlanVersion:
        """The newest accepted version (pending or running)."""
        return self.versions[-1]

    def running(self) -> PlanVersion:
        """The newest version the workers have confirmed running."""
        return next(v for v in reversed(self.versions) if v.applied)

    def pending(self) -> tuple[PlanVersion, ...]:
        """Accepted versions not yet confirmed, oldest first."""
        return tuple(v for v in self.versions if not v.applied and v.version > self.running().version)

    def accept(self, plan: dict, dbo: bool, source: str, effective_step: int,
               rollback_of: int | None = None) -> "History":
        """This history with (plan, dbo) appended as the next version, taking effect at
        ``effective_step`` (at least one step after the newest version's own step: versions
        take effect in order, one per iteration boundary at most)."""
        last = self.latest
        step = max(int(effective_step), last.effective_step + 1)
        v = PlanVersion(last.version + 1, plan, dbo, plan_sha256(plan, dbo), source, step, False, time.time(),
                        rollback_of)
        return History(self.versions + (v,))

    def applied(self, version: int, step: int) -> "History":
        """This history with ``version`` confirmed at ``step`` (and every older unconfirmed version
        too: a worker runs a version only after the ones before it). Unknown or already confirmed:
        unchanged."""
        if not 0 <= version < len(self.versions) or self.versions[version].applied:
            return self
        out = list(self.versions)
        for i in range(version + 1):
            if not out[i].applied:
                out[i] = replace(out[i], applied=True, effective_step=step if i == version else out[i].effective_step)
        return History(tuple(out))

    def origin(self, version: int) -> int:
        """The version whose plan ``version`` runs: ``version`` itself, or for a rollback the
        version it re-applies (through rollbacks of rollbacks).

        Raises:
            KeyError: no such version."""
        v = self.at(version)
        while v.source == "rollback" and v.rollback_of is not None and v.rollback_of < v.version:
            v = self.at(v.rollback_of)
        return v.version

    def predecessor(self, version: int) -> int | None:
        """The version that ``version``'s plan replaced: the current version (the newest
        accepted one, as its :meth:`origin`) when that plan was first accepted; None for
        version 0. A rollback of version N has N's predecessor.

        Raises:
            KeyError: no such version."""
        first = self.origin(version)
        return None if first == 0 else self.origin(first - 1)

    def lineage(self, version: int | None = None) -> tuple[int, ...]:
        """The path back from ``version`` (None: the newest) to version 0 along
        :meth:`predecessor`, newest first, each entry an :meth:`origin`: the versions a run of
        rollbacks walks through (``tessera rollback``, docs/operations.md)."""
        path = [self.origin(self.latest.version if version is None else version)]
        while (p := self.predecessor(path[-1])) is not None:
            path.append(p)
        return tuple(path)

    def at(self, version: int) -> PlanVersion:
        """Version ``version``.

        Raises:
            KeyError: no such version (naming the versions there are)."""
        if not 0 <= version < len(self.versions):
            raise KeyError(f"plan version {version} does not exist (versions 0-{len(self.versions) - 1})")
        return self.versions[version]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "versions": [v.to_dict() for v in self.versions]}

    @staticmethod
    def from_dict(d: dict) -> "History":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: another format, no versions, or versions not numbered 0, 1, ...
        """
        if d.get("format") != FORMAT:
            raise ValueError(f"plan history format {d.get('format')!r}; this Tessera reads format {FORMAT}")
        versions = tuple(PlanVersion.from_dict(v) for v in d.get("versions", ()))
        if not versions or [v.version for v in versions] != list(range(len(versions))):
            raise ValueError("plan history must list versions 0, 1, ... in order")
        return History(versions)


def save_history(run_dir: str, history: History) -> str:
    """Write ``history`` to ``<run_dir>/plan_history.json`` and return that location; ``run_dir``
    is a local directory (created; a temporary file renamed into place) or an object-store
    prefix (one upload of the whole object), :func:`tessera.train.storage.write_text`."""
    path = storage.join(run_dir, HISTORY_FILE)
    storage.write_text(path, json.dumps(history.to_dict(), sort_keys=True))
    return path


def load_history(run_dir: str) -> History | None:
    """The history saved in ``run_dir`` (a local directory or an object-store prefix; None when
    there is none or it cannot be read)."""
    try:
        return History.from_dict(json.loads(storage.read_text(storage.join(run_dir, HISTORY_FILE))))
    except (OSError, ValueError, KeyError):
        return None


def plan_from_json(text: str) -> dict:
    """The Plan dict in ``text``: a ``Plan.to_dict`` object, or a ``tessera plan`` output file
    (``plan.json``: its ``"tessera"`` entry's ``"plan"``, or a top-level ``"plan"``).

    Raises:
        UpgradeRefused: not JSON, or no plan in it.
    """
    from tessera.errors import UpgradeRefused

    try:
        doc = json.loads(text)
    except (TypeError, ValueError) as e:
        raise UpgradeRefused("plan", "(not JSON)", f"cannot be parsed: {e}",
                             "pass a plan.json written by `tessera plan`") from None
    for path in (("plan",), ("tessera", "plan"), ()):
        got = doc
        for key in path:
            got = got.get(key) if isinstance(got, dict) else None
        if isinstance(got, dict) and {"template", "pp", "vpp", "num_microbatches", "partition"} <= set(got):
            return got
    raise UpgradeRefused("plan", "(no plan)", "holds no plan (needs template, pp, vpp, num_microbatches, partition)",
                         "pass a plan.json written by `tessera plan`")
