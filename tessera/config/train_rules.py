"""Value rules of ``train.init_from`` (a Hugging Face checkpoint directory the weights start from)
and of the data fields (``train.data``, ``train.data_field``, ``train.tokenizer``,
``train.data_cache``).

:func:`check_init_from` and :func:`check_train_data` are called by
:func:`tessera.config.validate.validate_recipe`, so a bad path is one
:class:`~tessera.errors.TesseraConfigError` line (field, value, rule, fix; exit code 2) from every
command, before Ray starts; the job start (:mod:`tessera.train.worker.hf_io`) checks ``init_from``
again where the workers read it. Whether the directory holds the recipe's model (config.json, tensor
names and shapes) is checked when the weights are read; whether the data files exist and parse,
and whether the tokenizer's ids fit ``model.vocab``, by the training pre-flight
(:mod:`tessera.train.job.preflight`).
"""

from __future__ import annotations

import glob
import os

from tessera.errors import TesseraConfigError

FIX = ("point it at a Hugging Face model directory (save_pretrained output: config.json + model*.safetensors), "
       "or null for seeded weights")


def check_hf_dir(path: str | None, field: str = "train.init_from") -> None:
    """Null, or a directory holding ``config.json`` and at least one ``*.safetensors`` file.

    Raises:
        TesseraConfigError: one line naming ``field``, the path, the rule and a fix.
    """
    if path is None:
        return
    if not isinstance(path, str) or not os.path.isdir(path):
        raise TesseraConfigError(field, path, "must be a directory", FIX)
    missing = [what for what, ok in (("config.json", os.path.isfile(os.path.join(path, "config.json"))),
                                     ("*.safetensors", bool(glob.glob(os.path.join(path, "*.safetensors")))))
               if not ok]
    if missing:
        raise TesseraConfigError(field, path, f"must hold config.json and *.safetensors files (missing: "
                                 f"{', '.join(missing)})", FIX)


def check_init_from(train) -> None:
    """The ``train.init_from`` rule (:func:`check_hf_dir`) of a :class:`~tessera.config.schema.TrainConfig`."""
    check_hf_dir(getattr(train, "init_from", None))


TOKENIZER_FIX = ("use train.tokenizer=bytes, or the path of a local tokenizer.json file or of a directory a Hugging Face "
                 "tokenizer was saved in (download it once, e.g. huggingface-cli download NAME --local-dir DIR)")


def check_train_data(train) -> None:
    """``train.data`` a non-empty string or list of non-empty strings; ``train.data_field`` and
    ``train.data_cache`` non-empty strings; ``train.tokenizer`` ``bytes`` / null or an existing
    file or directory (never a Hub name: nothing is downloaded).

    Raises:
        TesseraConfigError: one line naming the field, the value, the rule and a fix.
    """
    data = getattr(train, "data", "pydoc")
    items = [data] if isinstance(data, str) else data
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(d, str) and d for d in items):
        raise TesseraConfigError("train.data", data, "must be a path, a glob or a non-empty list of them",
                                 "use train.data=pydoc, train.data=corpus.jsonl, train.data='shards/*.parquet' "
                                 "or train.data=[a.txt,b.jsonl]")
    for name in ("data_field", "data_cache"):
        value = getattr(train, name, "x")
        if not isinstance(value, str) or not value:
            raise TesseraConfigError(f"train.{name}", value, "must be a non-empty string",
                                     "use train.data_field=text" if name == "data_field" else
                                     "use train.data_cache=data-cache (under logging.out_dir) or an absolute path")
    tok = getattr(train, "tokenizer", None)
    if tok is None or tok == "bytes":
        return
    path = os.path.expanduser(tok)
    if not os.path.exists(path):
        raise TesseraConfigError("train.tokenizer", tok, "is neither 'bytes' nor an existing tokenizer file or "
                                 "directory (tokenizers are read from disk, never from the Hugging Face Hub)",
                                 TOKENIZER_FIX)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, n)) for n in
                                       ("tokenizer.json", "tokenizer_config.json")):
        raise TesseraConfigError("train.tokenizer", tok, "is a directory without tokenizer.json or "
                                 "tokenizer_config.json", TOKENIZER_FIX)
