"""The tokenizer of the training data (``train.tokenizer``), and the copy a run keeps for export.

``train.tokenizer`` is one of:

* ``bytes`` (the default; null means the same): token id = byte value of the UTF-8 text,
  vocabulary 256, no special tokens (:data:`tessera.train.worker.data.VOCAB`);
* the path of a ``tokenizer.json`` file (the Hugging Face ``tokenizers`` format), read as
  ``transformers.PreTrainedTokenizerFast(tokenizer_file=PATH)``;
* the path of a directory a Hugging Face tokenizer was saved in (``save_pretrained``: e.g.
  ``tokenizer.json`` + ``tokenizer_config.json``), read with
  ``transformers.AutoTokenizer.from_pretrained(PATH, local_files_only=True)``.

Nothing is ever fetched from the Hugging Face Hub: a path that does not exist is refused
(:func:`tessera.config.train_rules.check_train_data`) before anything runs.

Encoding rule (:meth:`TextTokenizer.encode_batch`): each document is encoded on its own as
``tokenizer(text)["input_ids"]`` (the tokenizer's own special tokens included, e.g. a BOS its
post-processor adds: exactly the ids ``AutoTokenizer.from_pretrained(exported)(text)`` gives).
Documents are joined with the **separator** (:attr:`TextTokenizer.separator`): the tokenizer's
EOS token (``eos_token``; for a bare ``tokenizer.json``, the first of :data:`EOS_NAMES` among its
special tokens); without one, the ids of a blank line (``"\\n\\n"`` encoded alone, no special
tokens; possibly none), as the byte-level path joins documents with ``b"\\n\\n"``. No separator
is added after a document whose ids already end with it, nor after the last document.

The vocabulary a model must hold (:attr:`TextTokenizer.vocab_size`) is the largest token id + 1,
added tokens included; :func:`check_vocab` compares it with ``model.vocab`` in the training
pre-flight. :func:`tokenizer_sha256` fingerprints the tokenizer's files (the token cache,
:mod:`tessera.train.worker.corpus`, is rebuilt when it changes).

A run keeps the tokenizer it trained with in its run directory (:func:`save_run_tokenizer`,
``<run_dir>/tokenizer/``, written by the launcher before the workers start), so that
``tessera export`` writes it next to the weights (:func:`export_tokenizer`) whatever becomes of
the original files; a byte-level run keeps none and exports the byte-level tokenizer
(:func:`tessera.model.hf.save_byte_tokenizer`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from tessera.config.train_rules import TOKENIZER_FIX as FIX_PATH
from tessera.errors import TesseraConfigError

BYTES = "bytes"
"""``train.tokenizer`` value of the byte-level tokenizer (the default)."""
BYTE_VOCAB = 256
"""Token ids of the byte-level tokenizer (one per byte value)."""
BLANK_LINE = "\n\n"
"""What documents are joined with when the tokenizer has no EOS token (its ids)."""
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
"""EOS spellings looked for among the special tokens of a bare ``tokenizer.json`` (which names
no EOS itself): GPT-2/Qwen, Llama/T5/Mistral, Llama 3, Gemma and chat-style conventions."""
RUN_TOKENIZER = "tokenizer"
"""The run directory's sub-directory holding the run's tokenizer (:func:`save_run_tokenizer`)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
"""Files of a tokenizer directory :func:`tokenizer_sha256` does not read (model weights that may
share the directory)."""



def is_bytes(spec: str | None) -> bool:
    """Whether ``train.tokenizer`` value ``spec`` names the byte-level tokenizer (``bytes`` or null)."""
    return spec is None or spec == BYTES


def tokenizer_sha256(path: str) -> str:
    """SHA-256 (hex) of the tokenizer at ``path``: of the file, or of every file directly in the
    directory except model weights (:data:`WEIGHT_SUFFIXES`), with their names, in name order.

    Raises:
        OSError: a file cannot be read.
    """
    h = hashlib.sha256()
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path)
                       if os.path.isfile(os.path.join(path, n)) and not n.endswith(WEIGHT_SUFFIXES))
        files = [(n, os.path.join(path, n)) for n in names]
    else:
        files = [("", path)]
    for name, p in files:
        h.update(name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class TextTokenizer:
    """A loaded tokenizer (module docstring): ``hf`` is the transformers tokenizer,
    ``vocab_size`` the largest id + 1, ``separator`` the ids put between documents,
    ``sha256`` the :func:`tokenizer_sha256` of ``path``."""

    path: str
    hf: object
    vocab_size: int
    separator: tuple[int, ...]
    sha256: str

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``tokenizer(text)["input_ids"]`` of each text (the tokenizer's special tokens included)."""
        if not texts:
            return []
        return [list(ids) for ids in self.hf(list(texts))["input_ids"]]


def _load_hf(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=path, clean_up_tokenization_spaces=False)
    specials = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    eos = next((n for n in EOS_NAMES if n in specials), None)
    if eos is not None:
        tok.eos_token = eos
    return tok


@lru_cache(maxsize=4)
def _load(path: str, sha256: str) -> TextTokenizer:
    try:
        hf = _load_hf(path)
    except Exception as e:  # any reader's error (JSON, sentencepiece, missing file in the directory): one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TesseraConfigError("train.tokenizer", path, f"cannot be loaded as a tokenizer ({type(e).__name__}: "
                                 f"{msg[:200]})", FIX_PATH) from None
    vocab = hf.get_vocab()
    size = max(max(vocab.values(), default=-1) + 1, len(hf))
    eos = getattr(hf, "eos_token_id", None)
    if eos is not None:
        separator: tuple[int, ...] = (int(eos),)
    else:
        separator = tuple(int(i) for i in hf(BLANK_LINE, add_special_tokens=False)["input_ids"])
    return TextTokenizer(path, hf, size, separator, sha256)


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer of ``train.tokenizer`` value ``spec`` (a file or a directory, not ``bytes``),
    loaded once per content (cached by path and :func:`tokenizer_sha256`).

    Raises:
        TesseraConfigError: the path does not exist, cannot be read, or holds no tokenizer
            transformers can read offline (field ``train.tokenizer``).
    """
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):
        raise TesseraConfigError("train.tokenizer", spec, "does not exist", FIX_PATH)
    try:
        sha = tokenizer_sha256(path)
    except OSError as e:
        raise TesseraConfigError("train.tokenizer", spec, f"cannot be read ({type(e).__name__}: {e})",
                                 "fix the file's permissions") from None
    return _load(path, sha)


def vocab_size(spec: str | None) -> int:
    """Token ids of ``train.tokenizer`` value ``spec``: :data:`BYTE_VOCAB` for ``bytes``, else the
    loaded tokenizer's largest id + 1."""
    return BYTE_VOCAB if is_bytes(spec) else load_tokenizer(spec).vocab_size


def check_vocab(recipe, model) -> None:
    """The model's embedding holds every id of the recipe's tokenizer: ``model.vocab >=``
    :func:`vocab_size` of ``train.tokenizer``.

    Raises:
        TesseraConfigError: a smaller ``model.vocab`` (names both numbers and both fields), or a
            tokenizer that cannot be loaded.
    """
    spec = recipe.train.tokenizer
    need = vocab_size(spec)
    if model.vocab >= need:
        return
    what = ("the byte-level tokenizer (train.tokenizer=bytes: token ids 0..255)" if is_bytes(spec)
            else f"train.tokenizer={spec!r} (token ids 0..{need - 1})")
    raise TesseraConfigError("model.vocab", model.vocab, f"is smaller than the {need} token ids of {what}: every id "
                             f"needs an embedding row of {model.name}",
                             f"train a model with a vocabulary of at least {need} (model.hf_config with vocab_size >= "
                             f"{need}, or model.inline with vocab >= {need}), or a tokenizer of at most "
                             f"{model.vocab} ids")


def save_run_tokenizer(recipe, run_dir: str) -> str | None:
    """Keep the recipe's tokenizer in ``run_dir/tokenizer/`` (``save_pretrained`` of the loaded
    tokenizer: a directory ``AutoTokenizer`` reads offline) and return that path; for ``bytes``
    remove an earlier copy (a resumed run that now trains on bytes) and return None. A
    ``run_dir`` on object storage gets the directory saved locally and uploaded
    (:mod:`tessera.train.storage`).

    Raises:
        TesseraConfigError: the tokenizer cannot be loaded.
    """
    from tessera.train import storage

    dest = storage.join(run_dir, RUN_TOKENIZER)
    if storage.is_remote(run_dir):
        if storage.is_dir(dest):
            storage.remove_tree(dest)
        if is_bytes(recipe.train.tokenizer):
            return None
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tessera-tokenizer-") as tmp:
            load_tokenizer(recipe.train.tokenizer).hf.save_pretrained(tmp)
            storage.upload(tmp, dest)
        return dest
    if is_bytes(recipe.train.tokenizer):
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        return None
    tok = load_tokenizer(recipe.train.tokenizer)
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.hf.save_pretrained(tmp)
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def run_tokenizer(run_dir: str) -> str | None:
    """The tokenizer directory ``run_dir`` keeps (:func:`save_run_tokenizer`; a location of
    :mod:`tessera.train.storage`: on object storage a URI, to download before reading), or None:
    the run trained on bytes."""
    from tessera.train import storage

    path = storage.join(run_dir, RUN_TOKENIZER)
    return path if storage.is_dir(path) else None


def export_tokenizer(src: str, to: str, model) -> list[str]:
    """Write the tokenizer saved in ``src`` (a run's :func:`run_tokenizer`) into the Hugging Face
    directory ``to`` with ``model_max_length = model.max_positions``; returns the names of the
    files it wrote.

    Raises:
        TesseraConfigError: it cannot be loaded (field ``RUN_DIR``), or has more ids than
            ``model.vocab``.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as e:
        raise TesseraConfigError("RUN_DIR", os.path.dirname(src), f"keeps a tokenizer in {src} that cannot be loaded "
                                 f"({type(e).__name__})", "export a run directory whose tokenizer/ is intact") from None
    size = max(max(tok.get_vocab().values(), default=-1) + 1, len(tok))
    if size > model.vocab:
        raise TesseraConfigError("model.vocab", model.vocab, f"is smaller than the {size} token ids of the run's "
                                 f"tokenizer ({src})", "export with the run's own model (drop --recipe)")
    tok.model_max_length = model.max_positions
    before = set(os.listdir(to)) if os.path.isdir(to) else set()
    written = tok.save_pretrained(to)
    names = {os.path.basename(str(p)) for p in written if os.path.exists(str(p))}
    return sorted(names | (set(os.listdir(to)) - before))
