"""Recompute regions: the mechanisms behind :mod:`tessera.model.recompute`.

* :func:`checkpointed`: ``fn(*tensors)`` as a non-reentrant ``torch.utils.checkpoint``: the
  tensors ``fn`` saves for backward are dropped after the forward and rebuilt by re-running
  ``fn`` when the backward first needs one (inside the B task's ``torch.autograd.backward``);
  the inputs stay (saved by the checkpoint itself). The SplitLinears ``fn`` runs take the
  ``autograd.Function`` path in the forward and in the re-run
  (:func:`tessera.model.wgrad.function_path`), so their inputs are dropped too and a deferred W
  reads the rebuilt input (held from B to W: the cost model's ``w_activation``).
* :func:`drop_output`: an output-discarding region (Megatron-Core's ``CheckpointWithoutOutput``
  idea): ``out = fn(*inputs)`` (a tensor or a tuple of tensors) is checkpointed, and
  ``consumer(out)`` runs under saved-tensor hooks that store, in place of an output or any view
  of one, a token that rebuilds ``out`` from ``inputs`` (once per region, under ``no_grad`` and
  the forward's autocast state) when a backward unpacks it. Other tensors go to the hooks active
  outside (if any), so measuring hooks keep seeing them.
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
    """The outputs of one :func:`drop_output` region, rebuilt on first use (under the forward's
    autocast state, as ``torch.utils.checkpoint`` re-runs) and then shared."""

    __slots__ = ("fn", "inputs", "layout", "autocast", "value")

    def __init__(self, fn, inputs, outs: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.inputs = fn, tuple(inputs)
        self.layout = tuple((o.size(), o.stride(), o.storage_offset(), o.dtype) for o in outs)
        device = outs[0].device.type
        self.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                             dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        self.value = None

    def view(self, index: int, size, stride, offset) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad(), torch.autocast(**self.autocast):
                value = self.fn(*(t.detach() for t in self.inputs))
            value = value if isinstance(value, tuple) else (value,)
            for v, (size0, stride0, _, dtype0) in zip(value, self.layout, strict=True):
                if v.size() != size0 or v.stride() != stride0 or v.dtype != dtype0:
                    raise RuntimeError(f"recompute: a rebuilt region output has shape {tuple(v.shape)}, strides "
                                       f"{v.stride()}, dtype {v.dtype}; the forward had {tuple(size0)}, {stride0}, "
                                       f"{dtype0}")
            self.value = value
        base = self.value[index]
        return base.as_strided(size, stride, base.storage_offset() + offset - self.layout[index][2])


class _Dropped:
    __slots__ = ("rebuild", "index", "size", "stride", "offset")

    def __init__(self, rebuild: _Rebuild, index: int, t: torch.Tensor) -> None:
        self.rebuild, self.index = rebuild, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _Outer:
    __slots__ = ("packed",)

    def __init__(self, packed) -> None:
        self.packed = packed


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse)
        return None


def drop_output(fn: Callable, inputs: Sequence[torch.Tensor], consumer: Callable, *, linears: Sequence = (),
                fn_linears: Sequence = ()):
    """``consumer(fn(*inputs))`` with ``fn``'s output (a tensor, or a tuple of tensors) not kept
    for the backward (module docstring). ``fn`` must be free of side effects (it runs up to three
    times: forward, rebuild, and its own checkpoint re-run); ``fn_linears``: the SplitLinears
    ``fn`` runs (on the Function path there, so their W is recorded once, by the forward's graph,
    from the re-run's saved inputs); ``linears``: the SplitLinears ``consumer`` runs (forced onto
    the Function path, whose saved inputs the hooks see). Without grad mode, or when no output
    has storage, plainly ``consumer(fn(*inputs))``. Returns what ``consumer`` returns."""
    if not torch.is_grad_enabled():
        return consumer(fn(*inputs))
    out = checkpointed(fn, *inputs, linears=fn_linears)
    outs = out if isinstance(out, tuple) else (out,)
    index: dict[int, int] = {}  # storage pointer -> output
    for i, o in enumerate(outs):
        ptr = _storage_ptr(o)
        if o.numel() and ptr:
            index.setdefault(ptr, i)
    if not index:
        return consumer(out)
    rebuild = _Rebuild(fn, inputs, outs)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    kinds = tuple((o.dtype, o.device) for o in outs)

    def pack(t: torch.Tensor):
        i = index.get(_storage_ptr(t))
        if i is not None and (t.dtype, t.device) == kinds[i]:
            return _Dropped(rebuild, i, t)
        return t if outer_pack is None else _Outer(outer_pack(t))

    def unpack(p):
        if type(p) is _Dropped:
            return p.rebuild.view(p.index, p.size, p.stride, p.offset)
        if type(p) is _Outer:
            return outer_unpack(p.packed)
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), function_path(linears):
        result = consumer(out)
    del out, outs  # alive until here: no new tensor can take their storage while the hooks match on it
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
