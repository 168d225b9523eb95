"""Run directories on local disk or on object storage (``s3://``, ``gs://``), through ``pyarrow.fs``.

A *location* is a string: a local path (``~`` expanded, relative to the working directory) or an
object-store URI (``s3://BUCKET/KEY``, ``gs://BUCKET/KEY``; :mod:`tessera.config.storage_rules`).
:func:`resolve` turns it into ``(pyarrow.fs.FileSystem, path)``: ``LocalFileSystem`` and the
absolute path for a local path, so local runs take the same code; ``FileSystem.from_uri`` for a
URI, the way Ray Train resolves its ``storage_path``. Credentials, region and endpoint come from
the standard environment, as pyarrow's ``S3FileSystem`` / ``GcsFileSystem`` read it:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` (an S3-compatible server such as MinIO),
``~/.aws/credentials``, an instance role; ``GOOGLE_APPLICATION_CREDENTIALS`` or the machine's
account for GCS. :func:`storage_env` names the variables the launcher hands to the job's other
processes; :func:`ray_storage` is Ray Train's ``storage_path`` / ``storage_filesystem`` pair.

The operations the training runtime needs, the same on both: :func:`exists`, :func:`is_dir`,
:func:`is_file`, :func:`entries` / :func:`list_dir` (a directory's children), :func:`mtime`,
:func:`read_bytes` / :func:`read_text` / :func:`open_input`, :func:`write_bytes` /
:func:`write_text`, :func:`append_text`, :func:`makedirs`, :func:`remove_tree`, :func:`upload` /
:func:`download` (a file or a directory tree between this machine's disk and a location).

What object stores lack, and what takes its place:

* **Directories.** A directory exists while an object has its prefix (or pyarrow's empty marker
  object ``KEY/``, written by :func:`makedirs`); its :func:`mtime` is its newest object's.
* **Rename.** A write is one upload of the whole object, which readers see whole or not at all,
  so :func:`write_bytes` writes the final key (on a local disk: a temporary file renamed into
  place, as before).
* **Append.** :func:`append_text` reads the object and writes it back with the text at its end
  (one reader-writer per file: the driver's records); a file appended to often is kept on local
  disk and uploaded now and then instead (``metrics.jsonl``,
  :class:`tessera.train.worker.metrics.MetricsSink`).
* **Local files.** What needs a local path (``torch.save``, a tokenizer's ``save_pretrained``, W&B)
  is written into a local directory and uploaded (:func:`upload`), or downloaded first
  (:func:`download`); :func:`tessera.config.storage_rules.local_dir` is the local directory that
  stands for a location.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from dataclasses import dataclass
from typing import Mapping

from tessera.config.storage_rules import OBJECT_SCHEMES, is_object_uri, normalize_uri, object_store_env


def is_remote(location: str) -> bool:
    """True when ``location`` is an object-store URI (``s3://``, ``gs://``)."""
    return is_object_uri(location)


def resolve(location: str):
    """``(pyarrow.fs.FileSystem, path)`` of ``location``: ``LocalFileSystem`` and the absolute
    path (``~`` expanded) for a local path; ``FileSystem.from_uri`` for an object-store URI
    (``S3FileSystem`` / ``GcsFileSystem``, configured from the environment: module docstring)."""
    import pyarrow.fs

    if is_object_uri(location):
        return pyarrow.fs.FileSystem.from_uri(normalize_uri(location))
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))


def location_of(fs, path: str) -> str:
    """The location of ``path`` on the pyarrow file system ``fs`` (the inverse of
    :func:`resolve`): the path itself on a local file system, ``s3://path`` / ``gs://path`` on
    an object store (e.g. what ``ray.train.Checkpoint`` holds: its ``filesystem`` and ``path``).

    Raises:
        ValueError: a file system of another kind."""
    kind = fs.type_name
    if kind == "local":
        return path
    scheme = "gs" if kind == "gcs" else kind
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(f"file system {kind!r} is neither local disk nor an object store ({OBJECT_SCHEMES})")
    return normalize_uri(f"{scheme}://{path}")


def join(location: str, *names: str) -> str:
    """``location`` with ``names`` appended (``/``-separated for a URI, ``os.path.join`` for a path)."""
    if is_object_uri(location):
        return normalize_uri(posixpath.join(normalize_uri(location), *names))
    return os.path.join(location, *names)


def basename(location: str) -> str:
    """The last component of ``location`` (``s3://b/runs/r1`` -> ``r1``)."""
    if is_object_uri(location):
        return posixpath.basename(normalize_uri(location))
    return os.path.basename(os.path.normpath(location))


def _info(location: str):
    fs, path = resolve(location)
    return fs.get_file_info(path)


def exists(location: str) -> bool:
    """True when a file or directory is at ``location``."""
    import pyarrow.fs

    return _info(location).type != pyarrow.fs.FileType.NotFound


def is_dir(location: str) -> bool:
    """True when ``location`` is a directory (on an object store: a prefix that holds objects, or
    a directory marker)."""
    import pyarrow.fs

    return _info(location).type == pyarrow.fs.FileType.Directory


def is_file(location: str) -> bool:
    """True when ``location`` is a file (an object)."""
    import pyarrow.fs

    return _info(location).type == pyarrow.fs.FileType.File


def _seconds(info) -> float | None:
    return info.mtime_ns / 1e9 if info.mtime_ns is not None else None


@dataclass(frozen=True)
class Entry:
    """One child of a directory: its name, whether it is a directory, its size in bytes (files)
    and its modification time (Unix seconds; None where the store keeps none, e.g. an
    object-store directory)."""

    name: str
    is_dir: bool
    size: int | None
    mtime: float | None


def entries(location: str) -> tuple[Entry, ...]:
    """The children of the directory ``location``, sorted by name (one listing: sizes and times
    come with it); () when it does not exist or is no directory."""
    import pyarrow.fs

    fs, path = resolve(location)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True, recursive=False))
    except (NotADirectoryError, FileNotFoundError):
        return ()
    except OSError:
        if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
            return ()
        raise
    out = [Entry(info.base_name, info.type == pyarrow.fs.FileType.Directory,
                 info.size if info.type == pyarrow.fs.FileType.File else None, _seconds(info)) for info in infos]
    return tuple(sorted(out, key=lambda e: e.name))


def list_dir(location: str) -> list[str]:
    """The names in the directory ``location``, sorted; [] when it does not exist."""
    return [e.name for e in entries(location)]


def mtime(location: str) -> float | None:
    """When ``location`` was last modified (Unix seconds): the file's or local directory's own
    time; for an object-store directory, which keeps none, the newest object under it; None when
    nothing is there."""
    import pyarrow.fs

    fs, path = resolve(location)
    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.NotFound:
        return None
    if info.mtime_ns is not None or info.type != pyarrow.fs.FileType.Directory:
        return _seconds(info)
    inside = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True, recursive=True))
    times = [t for t in (_seconds(i) for i in inside) if t is not None]
    return max(times, default=None)


def open_input(location: str):
    """A binary input stream of the file ``location`` (a context manager; ``read(n)``).

    Raises:
        FileNotFoundError: nothing is there."""
    fs, path = resolve(location)
    return fs.open_input_stream(path)


def read_bytes(location: str) -> bytes:
    """The content of the file ``location``.

    Raises:
        FileNotFoundError: nothing is there."""
    with open_input(location) as f:
        return f.read()


def read_text(location: str) -> str:
    """The content of the file ``location`` as UTF-8 text.

    Raises:
        FileNotFoundError: nothing is there; UnicodeDecodeError: not UTF-8."""
    return read_bytes(location).decode("utf-8")


def makedirs(location: str) -> None:
    """Create the directory ``location`` and its parents (no error when it exists)."""
    fs, path = resolve(location)
    fs.create_dir(path, recursive=True)


def write_bytes(location: str, data: bytes) -> None:
    """Write ``data`` to the file ``location`` so that a reader sees the old or the new content,
    never a part: on a local disk into ``<location>.tmp``, then renamed into place (parents
    created); on an object store as one upload of the object."""
    fs, path = resolve(location)
    if is_object_uri(location):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    fs.create_dir(os.path.dirname(path), recursive=True)
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_text(location: str, text: str) -> None:
    """:func:`write_bytes` of ``text`` as UTF-8."""
    write_bytes(location, text.encode("utf-8"))


def append_text(location: str, text: str) -> None:
    """Append ``text`` (UTF-8) to the file ``location``, creating it when missing: on a local
    disk an append; on an object store, which cannot append, the object is read and written back
    with ``text`` at its end (one writer per file)."""
    if not is_object_uri(location):
        path = os.path.abspath(os.path.expanduser(location))
        with open(path, "a") as f:
            f.write(text)
        return
    try:
        old = read_bytes(location)
    except FileNotFoundError:
        old = b""
    write_bytes(location, old + text.encode("utf-8"))


def remove_tree(location: str) -> None:
    """Delete the directory ``location`` and everything in it (a local one with
    ``shutil.rmtree``, which refuses a symbolic link; on an object store every object under the
    prefix). No error when nothing is there.

    Raises:
        OSError: it cannot be deleted."""
    if not is_object_uri(location):
        shutil.rmtree(os.path.abspath(os.path.expanduser(location)))
        return
    fs, path = resolve(location)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass


def upload(local_path: str, location: str) -> None:
    """Copy the local file or directory tree ``local_path`` to ``location`` (files there with the
    same names are replaced; a directory's files in sorted order)."""
    import pyarrow.fs

    fs, path = resolve(location)
    if os.path.isdir(local_path):
        fs.create_dir(path, recursive=True)
        for name in sorted(os.listdir(local_path)):
            upload(os.path.join(local_path, name), join(location, name))
        return
    if not is_object_uri(location):
        fs.create_dir(os.path.dirname(path), recursive=True)
    pyarrow.fs.copy_files(local_path, path, destination_filesystem=fs)


def download(location: str, local_path: str) -> None:
    """Copy the file or directory tree at ``location`` to the local ``local_path`` (parents
    created).

    Raises:
        FileNotFoundError: nothing is at ``location``."""
    import pyarrow.fs

    fs, path = resolve(location)
    kind = fs.get_file_info(path).type
    if kind == pyarrow.fs.FileType.NotFound:
        raise FileNotFoundError(f"{location} does not exist")
    if kind == pyarrow.fs.FileType.Directory:
        os.makedirs(local_path, exist_ok=True)
        for e in entries(location):
            download(join(location, e.name), os.path.join(local_path, e.name))
        return
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    pyarrow.fs.copy_files(path, os.path.abspath(local_path), source_filesystem=fs,
                          destination_filesystem=pyarrow.fs.LocalFileSystem())


def storage_env(location: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that configure access to ``location``, as ``environ`` (default
    ``os.environ``) sets them: for an object-store URI
    :func:`tessera.config.storage_rules.object_store_env` (every ``AWS_*`` variable,
    ``GOOGLE_APPLICATION_CREDENTIALS``, ...); {} for a local path. The launcher hands them to the
    workers and the driver actor (Ray runtime environments), which resolve the location in
    processes of their own."""
    if not is_object_uri(location):
        return {}
    return object_store_env(environ)


def ray_storage(root: str, environ: Mapping[str, str] | None = None):
    """Ray Train's ``(storage_path, storage_filesystem)`` for the run root ``root``: a local
    path as it is, with None (Ray resolves it, as before); for an object-store URI, the path
    on the store and a file system built here (Ray Train's controller runs in a process of its
    own, which may lack this environment). For S3 the file system carries the endpoint, region
    and, when ``environ`` (default ``os.environ``) holds them, the access keys explicitly
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``,
    ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` [+ ``AWS_SESSION_TOKEN``]); without keys
    each process finds its own credentials (a profile, an instance role)."""
    if not is_object_uri(root):
        return root, None
    fs, path = resolve(root)
    environ = os.environ if environ is None else environ
    if fs.type_name == "s3":
        import pyarrow.fs

        opts: dict = {}
        endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_override"] = endpoint
        region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
        if region:
            opts["region"] = region
        if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
            opts.update(access_key=environ["AWS_ACCESS_KEY_ID"], secret_key=environ["AWS_SECRET_ACCESS_KEY"],
                        session_token=environ.get("AWS_SESSION_TOKEN"))
        fs = pyarrow.fs.S3FileSystem(**opts)
    return path, fs
