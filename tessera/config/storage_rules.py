"""Where ``logging.out_dir`` may point: a local directory, or an object store (``s3://``, ``gs://``).

A recipe's ``logging.out_dir`` is a path on the file system of the node that runs the job (a
shared mount on a cluster), or the URI of an object-store prefix, ``s3://BUCKET[/KEY]`` (Amazon
S3 and S3-compatible stores) or ``gs://BUCKET[/KEY]`` (Google Cloud Storage). The training job
reads and writes its run directories there through ``pyarrow.fs`` (:mod:`tessera.train.storage`),
as Ray Train's ``storage_path`` does.

:func:`check_out_dir` is the value rule (called by :func:`tessera.config.validate.validate_recipe`).
What must live on a local disk (a file lock, a ``numpy.memmap``, an SQLite file, a PNG a person
opens, a ``torch.distributed.checkpoint`` scratch directory) lives under :func:`local_dir` of
the location: the location itself when it is local, a cache directory of this node for an
object-store URI. Nothing here imports pyarrow or touches the network.
"""

from __future__ import annotations

import os
import re

from tessera.errors import TesseraConfigError

OBJECT_SCHEMES = ("s3", "gs")
"""URI schemes of the object stores ``logging.out_dir`` may name (pyarrow's ``S3FileSystem`` and
``GcsFileSystem``; pyarrow also spells Google Cloud Storage ``gcs://``, read as ``gs://``)."""

STORAGE_ENV_PREFIXES = ("AWS_",)
"""Environment variables (by prefix) that configure S3 access, as pyarrow's ``S3FileSystem`` (the
AWS SDK) reads them: credentials, profile, region, endpoint (``AWS_ENDPOINT_URL``), certificates."""
STORAGE_ENV_NAMES = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")
"""Further environment variables of object-store access (Google Cloud Storage)."""

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.S)
OUT_DIR_FIX = ("use a local directory (e.g. out, /shared/runs) or an object-store prefix s3://BUCKET/PATH or "
               "gs://BUCKET/PATH")


def scheme_of(location: str) -> str | None:
    """The URI scheme of ``location`` in lower case (``"gcs"`` read as ``"gs"``), or None for a
    plain path."""
    m = _SCHEME.fullmatch(location) if isinstance(location, str) else None
    if m is None:
        return None
    scheme = m.group(1).lower()
    return "gs" if scheme == "gcs" else scheme


def is_object_uri(location: str) -> bool:
    """True when ``location`` is an object-store URI (a scheme of :data:`OBJECT_SCHEMES`)."""
    return scheme_of(location) in OBJECT_SCHEMES


def normalize_uri(location: str) -> str:
    """An object-store URI in its one spelling: lower-case scheme (``gcs`` as ``gs``), no empty or
    ``.`` segments, no trailing ``/`` (``S3://b//runs/`` -> ``s3://b/runs``); a plain path is
    returned as it is."""
    scheme = scheme_of(location)
    if scheme is None:
        return location
    rest = _SCHEME.fullmatch(location).group(2)
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    return f"{scheme}://" + "/".join(parts)


def check_out_dir(out_dir) -> None:
    """The rule of ``logging.out_dir``: a non-empty path that is not an existing file, or an
    object-store URI ``s3://BUCKET[/PATH]`` / ``gs://BUCKET[/PATH]`` with a bucket name and no
    ``..`` segment.

    Raises:
        TesseraConfigError: one line naming ``logging.out_dir``, the value, the broken rule and a fix.
    """
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise TesseraConfigError("logging.out_dir", out_dir, "must be a non-empty path or URI", OUT_DIR_FIX)
    scheme = scheme_of(out_dir)
    if scheme is None:
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise TesseraConfigError("logging.out_dir", out_dir, "is an existing file, not a directory",
                                     "give a directory path (it is created if missing), e.g. out")
        return
    if scheme not in OBJECT_SCHEMES:
        raise TesseraConfigError("logging.out_dir", out_dir,
                                 f"has the URI scheme {scheme}://, which is no object store the job writes to "
                                 f"(one of {', '.join(s + '://' for s in OBJECT_SCHEMES)})", OUT_DIR_FIX)
    parts = _SCHEME.fullmatch(out_dir).group(2).split("/")
    if not parts[0]:
        raise TesseraConfigError("logging.out_dir", out_dir, f"names no bucket ({scheme}://BUCKET/PATH)",
                                 f"use e.g. {scheme}://my-bucket/runs")
    if ".." in parts:
        raise TesseraConfigError("logging.out_dir", out_dir, "has a '..' segment (object stores have no parent "
                                 "directories)", f"spell the prefix out, e.g. {scheme}://{parts[0]}/runs")


def object_store_env(environ=None) -> dict[str, str]:
    """The object-store variables ``environ`` (default ``os.environ``) sets: every
    :data:`STORAGE_ENV_PREFIXES` variable and :data:`STORAGE_ENV_NAMES`; what another process
    (a Ray worker, a local rank) needs to reach the same store."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(STORAGE_ENV_PREFIXES) or k in STORAGE_ENV_NAMES}


def cache_home(env=None) -> str:
    """This node's cache directory of Tessera: ``$XDG_CACHE_HOME/tessera``, else
    ``~/.cache/tessera`` (absolute)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "tessera"))


def local_dir(location: str, env=None) -> str:
    """The local directory that stands for ``location`` where a file must be on a local disk: a
    plain path as it is (``~`` expanded; relative stays relative); for an object-store URI
    ``<cache_home>/<scheme>/<bucket>/<path>`` on this node (e.g. ``s3://b/runs`` ->
    ``~/.cache/tessera/s3/b/runs``)."""
    if not is_object_uri(location):
        return os.path.expanduser(location)
    uri = normalize_uri(location)
    scheme, rest = uri.split("://", 1)
    return os.path.join(cache_home(env), scheme, *rest.split("/"))
