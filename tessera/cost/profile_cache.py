"""The profile cache: measured task and pair times on disk, keyed by what changes them.

One SQLite file (stdlib :mod:`sqlite3`) holds any number of profiles. A profile is identified by
a :class:`Fingerprint`, the SHA-256 of every field that changes timings: device name and count,
EP/TP sizes and GPUs per node (the topology), torch, DeepSpeed, transformers and NCCL versions,
compute dtype, the layer shapes (the model spec's layers), sequence length and micro-batch size.
Change any one and the profile is a different one; a run profiles only the items its profile
lacks (:meth:`ProfileCache.missing`).

Robustness:

* the file is checked on open (``PRAGMA integrity_check`` and the schema's format version); a
  corrupted, truncated or foreign file is moved aside to ``<name>.corrupt-<unix time>`` (nothing
  is deleted) and a new cache is started, with a :class:`ProfileCacheWarning` naming both files;
* several jobs may write the same cache: WAL journal, a busy timeout, and one transaction per
  :meth:`ProfileCache.put` (``INSERT OR REPLACE`` per item, so concurrent writers of the same item
  leave one consistent row).

A profile can be marked stale (:meth:`ProfileCache.mark_stale`, with the measured drift): its
items stay readable, and :meth:`ProfileCache.status` says so, so the planner can warn.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

__all__ = ["FINGERPRINT_FIELDS", "Fingerprint", "ProfileItem", "ProfileStatus", "ProfileCache",
           "ProfileCacheWarning", "make_fingerprint", "package_versions", "FORMAT_VERSION"]

FORMAT_VERSION = 1
"""Schema version stored in the file; another version is treated like a corrupted file."""

FINGERPRINT_FIELDS = ("device", "device_count", "ep", "tp", "gpus_per_node", "torch", "deepspeed", "transformers",
                      "nccl", "dtype", "layers", "seq_length", "micro_batch_size")
"""Every field a profile's fingerprint covers (module docstring)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles (
    fingerprint TEXT PRIMARY KEY, fields TEXT NOT NULL, created REAL NOT NULL,
    stale INTEGER NOT NULL DEFAULT 0, drift REAL);
CREATE TABLE IF NOT EXISTS items (
    fingerprint TEXT NOT NULL, item TEXT NOT NULL, median_ms REAL NOT NULL, p25_ms REAL NOT NULL,
    p75_ms REAL NOT NULL, reps INTEGER NOT NULL, warmup INTEGER NOT NULL, measured REAL NOT NULL,
    PRIMARY KEY (fingerprint, item));
"""


class ProfileCacheWarning(UserWarning):
    """A cache file was unusable and has been moved aside (the message names both paths)."""


@dataclass(frozen=True)
class Fingerprint:
    """The fields of a profile (``fields``: sorted ``(name, value)`` pairs, values as strings)."""

    fields: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        """SHA-256 hex digest of the canonical JSON of ``fields``."""
        return hashlib.sha256(json.dumps(self.fields, separators=(",", ":")).encode()).hexdigest()

    def as_dict(self) -> dict[str, str]:
        return dict(self.fields)


def package_versions() -> dict[str, str]:
    """Installed versions of torch, deepspeed and transformers (``"absent"`` when not installed),
    from package metadata (nothing is imported)."""
    out = {}
    for name in ("torch", "deepspeed", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def make_fingerprint(*, device: str, device_count: int, ep: int, tp: int, gpus_per_node: int, dtype: str,
                     layers: object, seq_length: int, micro_batch_size: int, nccl: str = "none",
                     versions: Mapping[str, str] | None = None) -> Fingerprint:
    """The fingerprint of a profile (:data:`FINGERPRINT_FIELDS`).

    Args:
        device: device name, e.g. ``"NVIDIA H200"`` or ``"cpu"``; device_count: devices profiled.
        ep, tp, gpus_per_node: the expert/tensor-parallel group sizes and the node size.
        dtype: compute dtype, e.g. ``"float32"``, ``"bfloat16"``.
        layers: the model's layer shapes, any JSON-serialisable value (e.g.
            ``ModelSpec.to_dict()["layers"]``).
        seq_length, micro_batch_size: the microbatch shape, tokens and sequences.
        nccl: NCCL version (``"none"`` for gloo).
        versions: torch/deepspeed/transformers versions (default :func:`package_versions`).
    """
    v = dict(package_versions() if versions is None else versions)
    fields = {"device": device, "device_count": device_count, "ep": ep, "tp": tp, "gpus_per_node": gpus_per_node,
              "torch": v.get("torch", "absent"), "deepspeed": v.get("deepspeed", "absent"),
              "transformers": v.get("transformers", "absent"), "nccl": nccl, "dtype": dtype,
              "layers": json.dumps(layers, sort_keys=True, separators=(",", ":")), "seq_length": seq_length,
              "micro_batch_size": micro_batch_size}
    return Fingerprint(tuple(sorted((k, str(val)) for k, val in fields.items())))


@dataclass(frozen=True)
class ProfileItem:
    """One timed item: ``name`` (a task, e.g. ``"F.L3.expert"``, or a pair), the ``median_ms`` and
    the spread ``p25_ms``/``p75_ms`` over ``reps`` timed repetitions after ``warmup`` untimed ones
    (ms), and when it was ``measured`` (unix time)."""

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    reps: int
    warmup: int
    measured: float = 0.0


@dataclass(frozen=True)
class ProfileStatus:
    """A profile's state: ``items`` stored, ``stale`` and the ``drift`` that made it so (relative,
    e.g. 0.14), ``created`` (unix time); ``exists`` false when the cache has no such profile."""

    exists: bool
    items: int = 0
    stale: bool = False
    drift: float | None = None
    created: float = 0.0


class ProfileCache:
    """A profile cache file (module docstring). Open with ``ProfileCache(path)``; every method
    opens its own short connection, so an instance can be shared by threads and pickled.

    Reading never creates anything: an absent file reads as an empty cache (no profile), and
    the file (and its directory) is made by the first write (:meth:`put`). An existing file is
    checked when opened."""

    def __init__(self, path: str | Path, timeout_s: float = 30.0):
        self.path = Path(path)
        self.timeout_s = float(timeout_s)
        if self.path.exists():
            self._ensure()

    def _absent(self) -> bool:
        return not self.path.exists()

    def _create(self) -> None:
        """Make the file (and its directory) for a write when it does not exist yet."""
        if self._absent():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._ensure()

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        con.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")
        return con

    def _ensure(self) -> None:
        problem = self._check()
        if problem is not None:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            self.path.replace(aside)
            for suffix in ("-wal", "-shm"):
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    side.replace(aside.with_name(aside.name + suffix))
            warnings.warn(f"profile cache {self.path} is unusable ({problem}); moved it to {aside} and "
                          "started a new cache", ProfileCacheWarning, stacklevel=3)
        con = self._connect()
        try:
            con.execute("PRAGMA journal_mode = WAL")
            con.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    con.execute(statement)
            con.execute("INSERT OR IGNORE INTO meta VALUES ('format_version', ?)", (str(FORMAT_VERSION),))
            con.execute("COMMIT")
        finally:
            con.close()

    def _check(self) -> str | None:
        """None if the file is absent or a usable cache, else what is wrong with it."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        try:
            con = self._connect()
            try:
                ok = con.execute("PRAGMA integrity_check").fetchone()[0]
                if ok != "ok":
                    return f"integrity check: {ok}"
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if not tables:  # a file another process has just made and is filling in (or an empty database)
                    return None
                if not {"meta", "profiles", "items"} <= tables:
                    return "not a profile cache (tables missing)"
                row = con.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
                if row is None or row[0] != str(FORMAT_VERSION):
                    return f"format version {row[0] if row else None}, expected {FORMAT_VERSION}"
            finally:
                con.close()
        except sqlite3.DatabaseError as e:
            return f"{type(e).__name__}: {e}"
        return None

    def put(self, fp: Fingerprint, items: Iterable[ProfileItem]) -> int:
        """Store ``items`` under ``fp`` (replacing items of the same name) in one transaction;
        creates the profile if new and clears its stale mark. Returns the number stored."""
        rows = [(fp.digest, i.name, float(i.median_ms), float(i.p25_ms), float(i.p75_ms), int(i.reps), int(i.warmup),
                 float(i.measured or time.time())) for i in items]
        self._create()
        con = self._connect()
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("INSERT OR IGNORE INTO profiles (fingerprint, fields, created) VALUES (?, ?, ?)",
                        (fp.digest, json.dumps(fp.fields), time.time()))
            con.execute("UPDATE profiles SET stale = 0, drift = NULL WHERE fingerprint = ?", (fp.digest,))
            con.executemany("INSERT OR REPLACE INTO items VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
            con.execute("COMMIT")
        finally:
            con.close()
        return len(rows)

    def get(self, fp: Fingerprint) -> dict[str, ProfileItem]:
        """Every item stored under ``fp`` by name (empty if none)."""
        if self._absent():
            return {}
        con = self._connect()
        try:
            rows = con.execute("SELECT item, median_ms, p25_ms, p75_ms, reps, warmup, measured FROM items "
                               "WHERE fingerprint = ? ORDER BY item", (fp.digest,)).fetchall()
        finally:
            con.close()
        return {r[0]: ProfileItem(*r) for r in rows}

    def missing(self, fp: Fingerprint, names: Iterable[str]) -> list[str]:
        """The names (in the given order, without repeats) that ``fp`` has no item for."""
        have = set(self.get(fp))
        out: list[str] = []
        for n in names:
            if n not in have and n not in out:
                out.append(n)
        return out

    def mark_stale(self, fp: Fingerprint, drift: float) -> None:
        """Mark the profile stale with the relative ``drift`` that was measured (no-op without
        the file: there is no profile to mark)."""
        if self._absent():
            return
        con = self._connect()
        try:
            con.execute("UPDATE profiles SET stale = 1, drift = ? WHERE fingerprint = ?", (float(drift), fp.digest))
        finally:
            con.close()

    def status(self, fp: Fingerprint) -> ProfileStatus:
        """The profile's :class:`ProfileStatus`."""
        if self._absent():
            return ProfileStatus(False)
        con = self._connect()
        try:
            row = con.execute("SELECT stale, drift, created FROM profiles WHERE fingerprint = ?", (fp.digest,)).fetchone()
            n = con.execute("SELECT COUNT(*) FROM items WHERE fingerprint = ?", (fp.digest,)).fetchone()[0]
        finally:
            con.close()
        if row is None:
            return ProfileStatus(False)
        return ProfileStatus(True, int(n), bool(row[0]), row[1], float(row[2]))
