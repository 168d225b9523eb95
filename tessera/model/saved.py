"""Bytes held by autograd's saved tensors (what activation recompute shrinks), measured with
``torch.autograd.graph.saved_tensors_hooks``.

:class:`SavedTensorMeter` is a context manager: every tensor a forward saves for its backward
while the meter is active is counted, by storage (a storage saved several times, or through
several views, counts once, at its full ``nbytes``), from the moment it is saved until autograd
releases it (after the node's backward, or when the graph is freed). Storages of ``exclude``
(the parameters) are not counted. ``live`` is the current total, ``peak`` the maximum, bytes.

What it does not see: tensors kept alive outside autograd's saved tensors (a deferred W thunk's
input, a Python reference such as the engine's task state), and what a
``torch.utils.checkpoint`` region saves inside (those are dropped: the region's inputs, which it
saves itself, are counted) or rebuilds transiently in the backward.
"""

from __future__ import annotations

from typing import Iterable

import torch


class _Held:
    __slots__ = ("meter", "key", "tensor", "__weakref__")

    def __init__(self, meter: "SavedTensorMeter", key, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Counts saved-tensor bytes while active (module docstring).

    Args:
        exclude: tensors whose storages are not counted (e.g. ``model.parameters()``).

    Attributes:
        live: bytes of the storages saved and not yet released.
        peak: the largest ``live`` seen, bytes.
        saves: number of tensors packed.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {self._key(t) for t in exclude}
        self._refs: dict = {}
        self.live = self.peak = self.saves = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @staticmethod
    def _key(t: torch.Tensor):
        s = t.untyped_storage()
        return (t.device, s.data_ptr(), s.nbytes())

    def _pack(self, t: torch.Tensor):
        self.saves += 1
        key = self._key(t)
        if key in self._exclude or key[1] == 0:
            return t
        n = self._refs.get(key, 0)
        if n == 0:
            self.live += key[2]
            self.peak = max(self.peak, self.live)
        self._refs[key] = n + 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(p):
        return p.tensor if type(p) is _Held else p

    def _release(self, key) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.live -= key[2]
        else:
            self._refs[key] = n

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
