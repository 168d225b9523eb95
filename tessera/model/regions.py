"""Recompute regions: the mechanisms behind :mod:`tessera.model.recompute`.

* :func:`checkpointed`: ``fn(*tensors)`` as a non-reentrant ``torch.utils.checkpoint``: the
  tensors ``fn`` saves for backward are dropped after the forward and rebuilt by re-running
  ``fn`` when the backward first needs one (inside the B task's ``torch.autograd.backward``);
  the inputs stay (saved by the checkpoint itself). The SplitLinears ``fn`` runs take the
  ``autograd.Function`` path in the forward and in the re-run
  (:func:`tessera.model.wgrad.function_path`), so their inputs are dropped too and a deferred W
  reads the rebuilt input (held from B to W: the cost model's ``w_activation``).
* :func:`drop_output`: an output-discarding region (Megatron-Core's ``CheckpointWithoutOutput``
  idea): ``out = fn(*inputs)`` is checkpointed, and ``consumer(out)`` runs under saved-tensor
  hooks that store, in place of ``out`` or any view of it, a token that rebuilds ``out`` from
  ``inputs`` (once per region, under ``no_grad``) when a backward unpacks it. Other tensors go to
  the hooks active outside (if any), so measuring hooks keep seeing them.
* :data:`CORE_ATTN`: a transformers attention implementation (eager attention, checkpointed over
  Q, K, V) that a layer's attention selects through its own config's ``_attn_implementation``.

Nothing here issues a collective: regions wrap compute only (the engine runs the all-to-alls
outside the task functions), so a re-run never repeats a dispatch or combine. Re-runs are
bitwise the forward on CPU (same kernels, same operands), so gradients are bitwise those without
recompute (``tests/test_recompute.py``); on GPU this holds where the kernels are deterministic.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from tessera.model.wgrad import function_path


def checkpointed(fn: Callable, *tensors: torch.Tensor, linears: Sequence = ()):
    """``fn(*tensors)`` with its saved tensors recomputed in the backward (module docstring);
    ``linears``: the SplitLinears ``fn`` runs. Without grad mode, plainly ``fn(*tensors)``.
    Returns what ``fn`` returns (any structure)."""
    if not torch.is_grad_enabled():
        return fn(*tensors)

    def run(*args):
        with function_path(linears):
            return fn(*args)

    return checkpoint(run, *tensors, use_reentrant=False)


class _Rebuild:
    """The output of one :func:`drop_output` region, rebuilt on first use and then shared."""

    __slots__ = ("fn", "inputs", "size", "stride", "offset", "value")

    def __init__(self, fn, inputs, out: torch.Tensor) -> None:
        self.fn, self.inputs = fn, tuple(inputs)
        self.size, self.stride, self.offset = out.size(), out.stride(), out.storage_offset()
        self.value = None

    def view(self, size, stride, offset) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                value = self.fn(*(t.detach() for t in self.inputs))
            if value.size() != self.size or value.stride() != self.stride:
                raise RuntimeError(f"recompute: a rebuilt region output has shape {tuple(value.shape)}, strides "
                                   f"{value.stride()}; the forward had {tuple(self.size)}, {self.stride}")
            self.value = value
        base = self.value
        return base.as_strided(size, stride, base.storage_offset() + offset - self.offset)


class _Dropped:
    __slots__ = ("rebuild", "size", "stride", "offset")

    def __init__(self, rebuild: _Rebuild, t: torch.Tensor) -> None:
        self.rebuild, self.size, self.stride, self.offset = rebuild, t.size(), t.stride(), t.storage_offset()


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed) -> None:
        self.packed = packed


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse)
        return None


def drop_output(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], consumer: Callable, *,
                linears: Sequence = ()):
    """``consumer(fn(*inputs))`` with ``fn``'s output not kept for the backward (module
    docstring). ``fn`` must be free of SplitLinears and side effects (it runs up to three times:
    forward, rebuild, and its own checkpoint re-run); ``linears``: the SplitLinears ``consumer``
    runs (forced onto the Function path, whose saved inputs the hooks see). Without grad mode,
    or for an empty output, plainly ``consumer(fn(*inputs))``. Returns what ``consumer`` returns."""
    if not torch.is_grad_enabled():
        return consumer(fn(*inputs))
    out = checkpointed(fn, *inputs)
    ptr = _storage_ptr(out)
    if out.numel() == 0 or ptr is None or ptr == 0:
        return consumer(out)
    rebuild = _Rebuild(fn, inputs, out)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    dtype, device = out.dtype, out.device

    def pack(t: torch.Tensor):
        if t.dtype == dtype and t.device == device and _storage_ptr(t) == ptr:
            return _Dropped(rebuild, t)
        return t if outer_pack is None else _Outer(outer_pack(t))

    def unpack(p):
        if type(p) is _Dropped:
            return p.rebuild.view(p.size, p.stride, p.offset)
        if type(p) is _Outer:
            return outer_unpack(p.packed)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), function_path(linears):
        result = consumer(out)
    del out  # alive until here: no new tensor can take its storage while the hooks match on it
    return result


CORE_ATTN = "tessera_core_attn_recompute"
"""The attention implementation name of an attention core recomputed in the backward."""


def _core_attn(module, query, key, value, attention_mask, **kwargs):
    """The eager attention of ``module``'s own transformers model file, checkpointed over
    ``query``, ``key``, ``value`` ``[B, heads, S, head_dim]``: its ``S x S`` scores and softmax
    are rebuilt in the backward. Returns ``(attn_output [B, S, heads, head_dim], attn_weights)``."""
    eager = sys.modules[type(module).__module__].eager_attention_forward

    def core(q, k, v):
        return eager(module, q, k, v, attention_mask, **kwargs)

    return checkpointed(core, query, key, value)


AttentionInterface.register(CORE_ATTN, _core_attn)  # a fixed name -> function entry; registering again is a no-op
