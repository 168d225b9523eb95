"""The named-state entry a parameter travels as when a plan upgrade moves it between ranks.

An entry is ``{key: tensor}``: the parameter under :data:`PARAM` and its optimizer state under
the optimizer's own keys (``exp_avg``, ``exp_avg_sq``, ``step``). Its :func:`signature` lists
``(key, dtype, shape)`` in the order tensors travel; both transports of
:func:`tessera.train.upgrade.reshard.move_state` (p2p there, ``torch.distributed.checkpoint`` in
:mod:`tessera.train.upgrade.dcp`) read it.
"""

from __future__ import annotations

import torch

PARAM = "param"
"""Key of the parameter itself in an entry."""


def signature(entry: dict[str, torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """``((key, dtype, shape), ...)`` of a named-state entry: ``"param"`` first, then the
    optimizer keys sorted; the order tensors travel in."""
    keys = [PARAM] + sorted(k for k in entry if k != PARAM)
    return tuple((k, str(entry[k].dtype), tuple(entry[k].shape)) for k in keys)


def dtype_of(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    return getattr(torch, name.removeprefix("torch."))


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` (as :func:`signature` writes it) and ``shape``."""
    n = dtype_of(dtype).itemsize
    for s in shape:
        n *= s
    return n
