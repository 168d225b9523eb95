"""The training corpus (``train.data``): its files, their documents, and the token cache.

Sources (``train.data``): ``pydoc`` (embedded: the help texts of ``pydoc_data.topics.topics``,
one document per topic in sorted-key order), or one path, a glob (``*``, ``?``, ``[``; ``**``
recursive; matched files in sorted order) or a list of these; paths are absolute or relative to
the working directory. Files by suffix (:func:`iter_documents`):

* ``.txt``: the whole file is one document (UTF-8);
* ``.jsonl``: one JSON object per line, its ``train.data_field`` (default ``text``) a string;
  blank lines are skipped; rows are the file's line numbers (from 1);
* ``.parquet``: the string column ``train.data_field`` (read with pyarrow, batch by batch); rows
  count from 1.

Empty documents are skipped. Every bad input is one :class:`~tessera.errors.TesseraConfigError`
line naming the file (field ``train.data``), the line or row, what is wrong and the fix.

Token cache (:func:`open_token_file`, for a ``train.tokenizer`` other than ``bytes``): the
documents are encoded once (:class:`tessera.train.worker.tokenizer.TextTokenizer`: each document
on its own, joined with the tokenizer's separator) into a flat token file, the idea of
Megatron-LM's indexed dataset (``.bin`` tokens + ``.idx`` index):

* ``<cache>/<key>/tokens.bin``: the token ids, native byte order, ``uint16`` when the
  tokenizer's ids fit (vocabulary <= 65536), else ``uint32``; read as a ``numpy.memmap``;
* ``<cache>/<key>/index.json``: what it was built from (``inputs``: every source's absolute path,
  size and mtime, the tokenizer's path and SHA-256, the field) and what it holds (``num_tokens``,
  ``dtype``, ``vocab_size``, ``separator``, per source ``documents`` and ``tokens``).

``<cache>`` is ``train.data_cache`` (relative: under ``logging.out_dir``); ``<key>`` hashes the
source paths, the tokenizer path and the field, so each corpus and tokenizer has its own entry.
The entry is built under a file lock (``filelock``, ``<key>/build.lock``) by the first process
that needs it (the ``tessera train`` pre-flight, before Ray starts); any other process (the
workers, a restarted job, a second run on the same corpus) takes the lock, finds ``inputs``
equal to what it would build from, and maps the file. A changed source (size or mtime), another
tokenizer content or field rebuilds it (tokens first, the index last, each written to a temporary
name and renamed into place, so a reader never sees half a file).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from tessera.errors import TesseraConfigError

EMBEDDED = "pydoc"
"""``train.data`` value of the embedded corpus."""
SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File types ``train.data`` reads."""
INDEX_VERSION = 1
"""Format of ``index.json`` (another version rebuilds the entry)."""
BATCH_DOCUMENTS = 512
"""Documents encoded per tokenizer call while a cache entry is built."""

FIX_SOURCE = ("use train.data=pydoc, or a .txt, .jsonl or .parquet file, a glob of them (quoted: 'data/*.jsonl') "
              "or a list [a.jsonl,b.parquet]")


def _err(path: str, rule: str, fix: str) -> TesseraConfigError:
    return TesseraConfigError("train.data", path, rule, fix)


def _fix_field(field: str) -> str:
    return (f"give every row a string \"{field}\" (empty rows are skipped), or name the field that holds the text "
            f"with train.data_field=NAME")


def data_sources(data) -> tuple[str, ...]:
    """The sources of ``train.data`` (a string or a list of strings): ``pydoc`` and every file,
    globs expanded (sorted), in the order given.

    Raises:
        TesseraConfigError: an empty value, a glob matching no file, a path that is not an
            existing file (a directory too), an unsupported suffix.
    """
    items = [data] if isinstance(data, str) else list(data or ())
    if not items:
        raise _err(data, "names no source", FIX_SOURCE)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise _err(item, "is not a path", FIX_SOURCE)
        if item == EMBEDDED:
            out.append(item)
            continue
        path = os.path.expanduser(item)
        if glob.has_magic(path):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise _err(item, "matches no file", "check the pattern (relative patterns start at the working "
                                                     f"directory {os.getcwd()})")
            bad = [p for p in found if not p.endswith(SUFFIXES)]
            if bad:
                raise _err(bad[0], f"(matched by {item!r}) has an unsupported suffix",
                           f"narrow the glob to {', '.join(SUFFIXES)} files, e.g. {item.rstrip('*')}*.jsonl")
            out.extend(found)
            continue
        if not os.path.isfile(path):
            what = " (a directory)" if os.path.isdir(path) else ""
            raise _err(item, f"is neither 'pydoc' nor an existing file{what}",
                       FIX_SOURCE + ("; for a directory's files give a glob, e.g. DIR/*.jsonl" if what else ""))
        if not path.endswith(SUFFIXES):
            raise _err(item, "has an unsupported suffix", "give a .txt file (raw text), a .jsonl file (one "
                                                          "{\"text\": ...} per line) or a .parquet file (a text column)")
        out.append(path)
    return tuple(out)


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@contextmanager
def _reading(path: str):
    """Turn an ``OSError`` while ``path`` is opened or read into its one line."""
    try:
        yield
    except OSError as e:
        raise _err(path, f"cannot be read ({type(e).__name__}: {e.strerror or e})",
                   "fix the file's permissions or the path") from None


def _read_bytes(path: str) -> bytes:
    with _reading(path), open(path, "rb") as f:
        return f.read()


def _txt(path: str) -> Iterator[tuple[int, str]]:
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise _err(path, f"line {line} is not UTF-8 text (byte {e.start}: {e.reason})",
                   "convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None
    yield 1, text


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with _reading(path), open(path, "rb") as f:
        yield from enumerate(f, 1)


def _jsonl(path: str, field: str) -> Iterator[tuple[int, str]]:
    for n, raw in _lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _err(path, f"line {n} is not UTF-8 text (column {e.start + 1}: {e.reason})",
                       "convert the file to UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _err(path, f"line {n} is not JSON ({e.msg}, column {e.colno})",
                       f"write one JSON object per line with a \"{field}\" field") from None
        if not isinstance(obj, dict):
            raise _err(path, f"line {n} is a JSON {type(obj).__name__}, not an object",
                       f"write one JSON object per line with a \"{field}\" field")
        if field not in obj:
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            raise _err(path, f"line {n} has no \"{field}\" field (its keys: {keys})", _fix_field(field))
        text = obj[field]
        if not isinstance(text, str):
            raise _err(path, f"line {n}: \"{field}\" is a {type(text).__name__}, not a string", _fix_field(field))
        yield n, text


def _parquet(path: str, field: str) -> Iterator[tuple[int, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def broken(e: Exception) -> TesseraConfigError:
        return _err(path, f"cannot be read as Parquet ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                    "give a valid .parquet file")

    with _reading(path):
        try:
            pf = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise broken(e) from None
    schema = pf.schema_arrow
    if field not in schema.names:
        cols = ", ".join(schema.names[:8]) or "none"
        raise _err(path, f"has no column \"{field}\" (its columns: {cols})",
                   "name the text column with train.data_field=NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise _err(path, f"column \"{field}\" holds {kind}, not strings",
                   "give a string column of text (train.data_field=NAME)")
    row = 0
    with _reading(path):
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[field]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text is None:
                        raise _err(path, f"row {row}: \"{field}\" is null, not a string", _fix_field(field))
                    yield row, text
        except pa.ArrowException as e:
            raise broken(e) from None


def iter_documents(source: str, field: str = "text") -> Iterator[tuple[int, str]]:
    """``(row, text)`` of every document of one source (module docstring; ``pydoc``: the topics,
    rows from 1), empty ones included.

    Raises:
        TesseraConfigError: the file cannot be read, a line is not UTF-8 / not JSON / not an
            object / lacks the field / has a non-string one, a Parquet file lacks the column or
            holds another type or a null.
    """
    if source == EMBEDDED:
        yield from enumerate(_pydoc_topics(), 1)
    elif source.endswith(".jsonl"):
        yield from _jsonl(source, field)
    elif source.endswith(".parquet"):
        yield from _parquet(source, field)
    else:
        yield from _txt(source)


def _empty(sources: Sequence[str], documents: int) -> TesseraConfigError:
    shown = ", ".join(sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
    return _err(sources[0] if len(sources) == 1 else shown,
                f"holds no text ({documents} document(s) in {len(sources)} source(s), all empty)",
                "give a corpus with text in it")


def corpus_bytes(sources: Sequence[str], field: str = "text") -> bytes:
    """The byte-level corpus: the UTF-8 bytes of every non-empty document joined with
    ``b"\\n\\n"`` (a ``.txt`` file's bytes as they are, UTF-8 or not).

    Raises:
        TesseraConfigError: as :func:`iter_documents`; no text at all.
    """
    parts: list[bytes] = []
    documents = 0
    for source in sources:
        if source.endswith(".txt"):
            docs: Iterator[bytes] = iter([_read_bytes(source)])
        else:
            docs = (text.encode("utf-8") for _, text in iter_documents(source, field))
        for doc in docs:
            documents += 1
            if doc:
                parts.append(doc)
    if not parts:
        raise _empty(sources, documents)
    return b"\n\n".join(parts)


# --------------------------------------------------------------------------- the token cache


@dataclass(frozen=True)
class TokenFile:
    """A built cache entry (module docstring): ``bin_path`` holds ``num_tokens`` ids of ``dtype``;
    ``built``: this call encoded the corpus (False: it was already there)."""

    bin_path: str
    index_path: str
    num_tokens: int
    dtype: str
    vocab_size: int
    built: bool

    def array(self) -> np.ndarray:
        """The token ids, ``numpy.memmap`` (read-only) of shape ``[num_tokens]``."""
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


def cache_root(recipe) -> str:
    """The absolute cache directory: ``train.data_cache``, relative to ``logging.out_dir`` (to its
    local stand-in on this node when it is an object store: the cache is a memory-mapped file
    under a file lock, :func:`tessera.config.storage_rules.local_dir`)."""
    from tessera.config.storage_rules import local_dir

    root = os.path.expanduser(recipe.train.data_cache)
    if not os.path.isabs(root):
        root = os.path.join(local_dir(recipe.logging.out_dir), root)
    return os.path.abspath(root)


def absolute_data_paths(recipe, out_root: str):
    """``recipe`` with its data paths absolute, as the launcher hands it to the workers (whose
    working directory is Ray's, not the launcher's): every ``train.data`` path and glob and
    ``train.tokenizer`` from the working directory, a relative ``train.data_cache`` under
    ``out_root`` (the job's run root, :func:`tessera.train.job.outputs.out_root`; for an
    object-store root, under its local stand-in on the launcher's node,
    :func:`tessera.config.storage_rules.local_dir`, which every worker builds on its own node); so too
    ``train.init_from`` and the driver's inputs (:func:`absolute_plan_inputs`). ``pydoc``,
    ``bytes``, unset (null / empty) and absolute paths stay as they are; the result is ``recipe``
    itself when nothing changes."""
    from tessera.config.load import recipe_from_dict
    from tessera.config.storage_rules import local_dir

    recipe = absolute_plan_inputs(recipe)
    tr = recipe.train

    def absolute(path: str) -> str:
        return path if path == EMBEDDED else os.path.abspath(os.path.expanduser(path))

    data = absolute(tr.data) if isinstance(tr.data, str) else [absolute(d) for d in tr.data]
    tok = tr.tokenizer if tr.tokenizer in (None, "bytes") else absolute(tr.tokenizer)
    cache = os.path.expanduser(tr.data_cache)
    cache = cache if os.path.isabs(cache) else os.path.join(local_dir(out_root), cache)
    init = absolute(tr.init_from) if tr.init_from else tr.init_from
    if (data, tok, cache, init) == (tr.data if isinstance(tr.data, str) else list(tr.data), tr.tokenizer,
                                    tr.data_cache, tr.init_from):
        return recipe
    d = recipe.to_dict()
    d["train"].update(data=data, tokenizer=tok, data_cache=cache, init_from=init)
    return recipe_from_dict(d)


def absolute_plan_inputs(recipe):
    """``recipe`` with the files its planning reads absolute from the working directory:
    ``planner.trace`` and ``dbo.counts_path``, which the driver actor reads in Ray's working
    directory (the launcher's recipe and ``tessera upgrade --recipe``'s); empty paths stay empty;
    the result is ``recipe`` itself when nothing changes."""
    from tessera.config.load import recipe_from_dict

    trace, counts = recipe.planner.trace, recipe.dbo.counts_path
    new = [os.path.abspath(os.path.expanduser(p)) if p else p for p in (trace, counts)]
    if new == [trace, counts]:
        return recipe
    d = recipe.to_dict()
    d["planner"]["trace"], d["dbo"]["counts_path"] = new
    return recipe_from_dict(d)


def _stat(source: str) -> dict:
    if source == EMBEDDED:
        return {"path": source, "python": sys.version.split()[0]}
    st = os.stat(source)
    return {"path": os.path.abspath(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_index(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _batches(documents: Iterator[tuple[int, str]], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for _, text in documents:
        batch.append(text)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _build(sources: Sequence[str], field: str, tok, dtype: str, bin_path: str) -> tuple[int, list[dict]]:
    """Encode ``sources`` with ``tok`` into ``bin_path`` (the packing rule of
    :mod:`tessera.train.worker.tokenizer`); returns the token count and, per source, its
    documents and tokens."""
    sep = list(tok.separator)
    per: list[dict] = []
    last: list[int] | None = None  # the previous non-empty document's ids
    tmp = bin_path + ".tmp"
    try:
        with open(tmp, "wb") as out:
            for source in sources:
                docs = tokens = 0
                for batch in _batches(iter_documents(source, field), BATCH_DOCUMENTS):
                    docs += len(batch)
                    pieces: list[list[int]] = []
                    for ids in tok.encode_batch([t for t in batch if t]):
                        if not ids:
                            continue
                        if last is not None and sep and last[-len(sep):] != sep:
                            pieces.append(sep)
                        pieces.append(ids)
                        last = ids
                    if pieces:
                        flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]).astype(dtype)
                        flat.tofile(out)
                        tokens += int(flat.size)
                per.append({"documents": docs, "tokens": tokens})
        total = sum(p["tokens"] for p in per)
        if total == 0:
            raise _empty(sources, sum(p["documents"] for p in per))
        os.replace(tmp, bin_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return total, per


def open_token_file(recipe) -> TokenFile:
    """The token cache entry of ``recipe`` (``train.data``, ``train.data_field``,
    ``train.tokenizer``, ``train.data_cache``), built under its lock if missing or stale (module
    docstring).

    Raises:
        TesseraConfigError: a bad source (:func:`data_sources`, :func:`iter_documents`), no text,
            an unloadable tokenizer, or a cache directory that cannot be written
            (``train.data_cache``).
    """
    from filelock import FileLock

    from tessera.train.worker.tokenizer import load_tokenizer, tokenizer_sha256

    tr = recipe.train
    sources = data_sources(tr.data)
    tok_path = os.path.abspath(os.path.expanduser(tr.tokenizer))
    if not os.path.exists(tok_path):
        load_tokenizer(tr.tokenizer)  # its one-line error
    key = hashlib.sha256(json.dumps({"version": INDEX_VERSION, "sources": [_stat(s)["path"] for s in sources],
                                     "tokenizer": tok_path, "field": tr.data_field}).encode()).hexdigest()[:16]
    entry = os.path.join(cache_root(recipe), key)
    bin_path, index_path = os.path.join(entry, "tokens.bin"), os.path.join(entry, "index.json")
    try:
        os.makedirs(entry, exist_ok=True)
        lock = FileLock(os.path.join(entry, "build.lock"))
        lock.acquire()
    except OSError as e:
        raise TesseraConfigError("train.data_cache", tr.data_cache, f"cannot be written at {entry} "
                                 f"({type(e).__name__}: {e.strerror or e})",
                                 "set train.data_cache to a writable directory") from None
    try:
        inputs = {"version": INDEX_VERSION, "sources": [_stat(s) for s in sources],
                  "tokenizer": {"path": tok_path, "sha256": tokenizer_sha256(tok_path)}, "field": tr.data_field}
        index = _read_index(index_path)
        if index is not None and index.get("inputs") == inputs and os.path.isfile(bin_path):
            return TokenFile(bin_path, index_path, index["num_tokens"], index["dtype"], index["vocab_size"], False)
        if os.path.exists(index_path):
            os.remove(index_path)  # stale: no reader may pair it with the new tokens
        tok = load_tokenizer(tr.tokenizer)
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        total, per = _build(sources, tr.data_field, tok, dtype, bin_path)
        index = {"inputs": inputs, "num_tokens": total, "dtype": dtype, "vocab_size": tok.vocab_size,
                 "separator": list(tok.separator),
                 "sources": [dict(path=s["path"], **p) for s, p in zip(inputs["sources"], per)]}
        tmp = index_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(index, f, indent=1)
        os.replace(tmp, index_path)
        return TokenFile(bin_path, index_path, total, dtype, tok.vocab_size, True)
    finally:
        lock.release()
