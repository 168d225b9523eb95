"""Value rule of ``train.init_from`` (a Hugging Face checkpoint directory the weights start from).

:func:`check_init_from` is called by :func:`tessera.config.validate.validate_recipe`, so a bad path
is one :class:`~tessera.errors.TesseraConfigError` line (field, value, rule, fix; exit code 2)
from every command, before Ray starts; the job start (:mod:`tessera.train.worker.hf_io`) checks it again
where the workers read it. Whether the directory holds the recipe's model (config.json, tensor
names and shapes) is checked when the weights are read.
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
