"""Deferrable weight gradients: split a Linear's backward into B (input grad) and W (weight grad).

Zero-bubble style schedules run the backward of a microbatch in two parts: B, the input gradient
that the previous stage waits for, and W, the weight gradient that nothing waits for and that can
run later (a *movable* task). :class:`SplitLinear` is an ``nn.Linear`` whose autograd backward
computes only the input gradient while a :class:`DeferredWGrad` store is attached to it, and
records a thunk that computes the weight (and bias) gradient later; :func:`run_w` runs the thunks
of one key and accumulates them into ``.grad``. Without an attached store the backward computes
both at once ("fused"), with the same formulas.

Which parameters are deferred: only the weights and biases of :class:`SplitLinear` modules
(attention/DeltaNet projections, router, experts, shared expert, output head after
:func:`split_linears`). Every other parameter (the DeltaNet depthwise ``conv1d`` weight, RMSNorm
weights, ``A_log``, ``dt_bias``, embeddings) gets its gradient from ordinary autograd during B.

Bitwise contract (checked by ``tests/test_model.py`` with ``torch.equal``): for each parameter,
``run_w`` reproduces what autograd's accumulation would have produced in the fused backward. Within
one backward call (one autograd graph task) autograd first sums all contributions to a leaf (a
weight used twice, ``x @ w @ w``) in arrival order and then adds the sum to ``.grad``; the store
records the graph-task id of each contribution and sums the same way. Keys must be run in the order
their backward calls ran (microbatch order) for the ``.grad`` sums to match bitwise. A parameter
that is used both by a SplitLinear and by another op (e.g. tied embeddings) gets the other op's
contribution during B and is only allclose, not bitwise, to the fused result.

Forms: ``F.linear(x, w, b)`` forward; B: ``gx = gy2 @ w``; W: ``gw = gy2^T @ x2``,
``gb = gy2.sum(0)`` with ``x2 = x.reshape(-1, in)``, ``gy2 = gy.reshape(-1, out)``: the same
products, in the same operand order, that autograd's ``mm`` backward forms for ``F.linear``
(including its column-major branches), so a fused SplitLinear matches ``nn.Linear`` bitwise.
Mixed precision (a forward under ``torch.autocast`` without its cast cache,
:mod:`tessera.model.precision`): the products run in the dtype of ``gy`` (the output's, the
compute dtype) on ``x`` and ``w`` cast to it (``.to``, the cast autocast made), and each
contribution is cast to the parameter's dtype (FP32) before the sums, as each use's own cast node
does before ``AccumulateGrad``; so fused and deferred W stay bitwise equal under BF16 too.
The store keeps ``x`` and ``gy`` alive until W runs (its memory effect, ``w_activation``); a W
thunk raises if either was modified in place in between (e.g. a reused input buffer, or a leaf
whose ``.grad`` took over ``gy``'s storage and was accumulated into). Double backward
(``create_graph=True``) is not supported.

Fast paths (:func:`forward_mode`): a caller that knows at forward time what the backward will do
(the engine does, from its Program) runs the forward as the C++ ``F.linear`` (``FUSED``) or as
``F.linear`` on detached weights plus a hook on the output's autograd node that records the same
W thunk (``DEFERRED``), skipping the Python ``autograd.Function``; the results are bitwise the
same (``tests/test_engine_segments.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _Pending:
    key: Hashable
    tag: str | None
    group: int  # autograd graph-task id of the backward call that recorded it
    param: nn.Parameter
    thunk: Callable[[], torch.Tensor]


class DeferredWGrad:
    """An explicit store of deferred weight-gradient thunks (no global state: pass it around).

    Usage::

        store = DeferredWGrad()
        with store.capture(key=("mb", 0), module=stage):   # B only: SplitLinear weights deferred
            loss.backward()
        ...
        run_w(store, ("mb", 0))                            # W: accumulate into .grad

    Entries are keyed by ``(key, tag)``; ``tag`` is the ``SplitLinear.tag`` of the recording
    module (``"mixer"``, ``"router"``, ``"expert"``, ``"shared"``, ``"mlp"``, ``"head"``), so W can
    also run one task kind at a time (``run_w(store, key, tag="expert")``).
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, list[_Pending]] = {}  # by key, each in recorded order
        self._key: Hashable | None = None
        self._capturing = False

    @contextlib.contextmanager
    def capture(self, key: Hashable, module: nn.Module) -> Iterator["DeferredWGrad"]:
        """Attach this store to every SplitLinear in ``module`` for the duration of the block.

        Backward calls inside the block compute input gradients only and record W thunks under
        ``key``. Previous attachments are restored on exit. Not re-entrant on the same store.
        """
        linears = [m for m in module.modules() if isinstance(m, SplitLinear)]
        with self.capture_many(((key, linears),)):
            yield self

    @contextlib.contextmanager
    def capture_many(self, groups) -> Iterator["DeferredWGrad"]:
        """Attach this store to several sets of SplitLinears at once, each under its own key:
        ``groups`` is a sequence of ``(key, linears)`` (one backward call over several tasks
        records each task's thunks under its key). Previous attachments are restored on exit.

        Raises:
            RuntimeError: a capture of this store is already active.
        """
        if self._capturing:
            raise RuntimeError(f"DeferredWGrad.capture is already active for key {self._key!r}")
        previous = [(m, m.wgrad_store, m.wgrad_key) for _, linears in groups for m in linears]
        self._key, self._capturing = (groups[0][0] if len(groups) == 1 else None), True
        for key, linears in groups:
            for m in linears:
                _set(m, "wgrad_store", self)
                _set(m, "wgrad_key", key)
        try:
            yield self
        finally:
            for m, store, key in previous:
                _set(m, "wgrad_store", store)
                _set(m, "wgrad_key", key)
            self._key, self._capturing = None, False

    def record(self, param: nn.Parameter, thunk: Callable[[], torch.Tensor], tag: str | None,
               key: Hashable | None = None) -> None:
        """Record one deferred gradient contribution for ``param`` (called from backward) under
        ``key`` (default: the key of the active :meth:`capture`)."""
        if not self._capturing:
            raise RuntimeError("DeferredWGrad.record called outside capture()")
        key = self._key if key is None else key
        group = torch._C._current_graph_task_id()
        entries = self._entries.get(key)
        if entries is None:
            entries = self._entries[key] = []
        entries.append(_Pending(key, tag, group, param, thunk))

    def keys(self) -> tuple[Hashable, ...]:
        """Keys with pending entries, in first-recorded order."""
        return tuple(k for k, v in self._entries.items() if v)

    def num_pending(self, key: Hashable | None = None, tag: str | None = None) -> int:
        """Number of pending thunks (all, or of ``key`` / ``tag``)."""
        lists = self._entries.values() if key is None else (self._entries.get(key, ()),)
        return sum(1 for entries in lists for e in entries if tag is None or e.tag == tag)

    def run(self, key: Hashable, tag: str | None = None) -> int:
        """Run the thunks of ``key`` (optionally only ``tag``) in recorded order; returns how many.

        Contributions to one parameter recorded by the same backward call are summed first
        (autograd's input buffer), then added to ``.grad`` (autograd's AccumulateGrad).
        """
        entries = self._entries.get(key)
        if not entries:
            return 0
        if tag is None:
            todo, left = entries, []
        else:
            todo = [e for e in entries if e.tag == tag]
            left = [e for e in entries if e.tag != tag] if len(todo) < len(entries) else []
        if not todo:
            return 0
        if left:
            self._entries[key] = left
        else:
            del self._entries[key]
        buffers: dict[int, tuple[int, nn.Parameter, torch.Tensor]] = {}
        with torch.no_grad():
            for e in todo:
                g = e.thunk().to(e.param.dtype)  # a BF16 product lands on the FP32 parameter
                cur = buffers.get(id(e.param))
                if cur is not None and cur[0] == e.group:
                    buffers[id(e.param)] = (e.group, e.param, cur[2] + g)
                else:
                    if cur is not None:
                        _accumulate(cur[1], cur[2])
                    buffers[id(e.param)] = (e.group, e.param, g)
            for _, p, g in buffers.values():
                _accumulate(p, g)
        return len(todo)

    def clear(self) -> None:
        """Drop all pending thunks (and the activations they hold)."""
        self._entries.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())


def run_w(store: DeferredWGrad, key: Hashable, tag: str | None = None) -> int:
    """Run the deferred weight gradients of ``key`` (see :meth:`DeferredWGrad.run`)."""
    return store.run(key, tag)


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.contiguous()
    else:
        p.grad.add_(g)


def _column_major(m: torch.Tensor) -> bool:
    return m.dim() == 2 and m.stride(0) == 1 and m.stride(1) == m.shape[0]


class _SplitLinearFn(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight gradient when the module has a store."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):  # noqa: D401 - autograd signature
        ctx.save_for_backward(x, weight)
        ctx.module = module
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        x, weight = x.to(gy.dtype), weight.to(gy.dtype)  # the compute dtype (autocast's casts)
        module = ctx.module
        out_f, in_f = weight.shape
        gy2 = gy.reshape(-1, out_f)
        x2 = x.reshape(-1, in_f)
        gx = None
        if ctx.needs_input_grad[0]:
            if _column_major(x2):  # the branches of autograd's mm backward (mm_mat1_backward)
                gx = weight.t().mm(gy2.t()).t()
            else:
                gx = gy2.mm(weight)
            gx = gx.reshape(*gy.shape[:-1], in_f)
        need_w, need_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        wt_column_major = _column_major(weight.t())  # true for a contiguous weight

        store: DeferredWGrad | None = module.wgrad_store
        versions = (x2._version, gy2._version) if store is not None else None

        def check() -> None:  # views share the version counter of their base
            if versions is not None and (x2._version, gy2._version) != versions:
                raise RuntimeError(f"SplitLinear(tag={module.tag!r}): its input or output gradient was modified "
                                   "in place after B; the deferred weight gradient would be wrong")

        def wgrad() -> torch.Tensor:  # mm_mat2_backward for mat2 = weight.t(), then transposed
            check()
            return gy2.t().mm(x2) if wt_column_major else x2.t().mm(gy2).t()

        def bgrad() -> torch.Tensor:
            check()
            return gy2.sum(0)

        if store is None:
            return gx, (wgrad() if need_w else None), (bgrad() if need_b else None), None
        if need_w:
            store.record(module.weight, wgrad, module.tag, module.wgrad_key)
        if need_b:
            store.record(module.bias, bgrad, module.tag, module.wgrad_key)
        return gx, None, None, None


FUSED, DEFERRED = "fused", "deferred"
"""Forward modes of :func:`forward_mode` (what the backward of that forward will do)."""


@contextlib.contextmanager
def forward_mode(linears, mode: str) -> Iterator[None]:
    """Run forwards of ``linears`` (SplitLinears) knowing what their backward will do, on the
    C++ ``F.linear`` instead of the Python ``autograd.Function`` (the engine's hot path):

    * ``FUSED``: the backward computes weight gradients in place (plain ``F.linear``; bitwise
      the fused SplitLinear, see the module docstring);
    * ``DEFERRED``: the backward runs inside a :meth:`DeferredWGrad.capture` of these modules;
      ``F.linear`` on detached weights computes only the input gradient, and a hook on the
      output's autograd node records the same W thunk as :class:`_SplitLinearFn` (same
      operands, same products). Inputs that do not require grad keep the Function path.

    A forward under ``DEFERRED`` whose backward finds no store attached raises (it cannot
    compute W later). Use ``.backward()`` / ``torch.autograd.backward`` with these forwards (not
    ``torch.autograd.grad``). Previous modes are restored on exit.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in (FUSED, DEFERRED):
        raise ValueError(f"forward_mode: mode={mode!r}; use {FUSED!r} or {DEFERRED!r}")
    with _modes(linears, mode):
        yield


@contextlib.contextmanager
def function_path(linears) -> Iterator[None]:
    """Run forwards of ``linears`` (SplitLinears) on the ``autograd.Function`` path whatever
    :func:`forward_mode` set (restored on exit): its input is saved through autograd's saved
    tensors (so saved-tensor hooks and ``torch.utils.checkpoint`` can drop and rebuild it) and its
    backward records W from the saved input, where the ``DEFERRED`` fast path would keep the input
    alive in a hook from F to W. Bitwise the same results (module docstring). Modules of
    ``linears`` that are not SplitLinears (a model built without ``split_w``) are skipped."""
    with _modes([m for m in linears if isinstance(m, SplitLinear)], None):
        yield


@contextlib.contextmanager
def _modes(linears, mode) -> Iterator[None]:
    """``forward_mode`` of every module of ``linears`` set to ``mode``, each restored on exit."""
    previous = [(m, m.forward_mode) for m in linears]
    for m, _ in previous:
        _set(m, "forward_mode", mode)
    try:
        yield
    finally:
        for m, old in previous:
            _set(m, "forward_mode", old)


def _set(module: nn.Module, name: str, value) -> None:
    """Set a plain (non-parameter, non-module) attribute without ``nn.Module.__setattr__``'s
    registration checks (the hot path sets these per task)."""
    object.__setattr__(module, name, value)


def _deferring_linear(module: "SplitLinear", x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with detached weights (autograd forms the input gradient only) and a node
    pre-hook that records the weight (and bias) gradient thunk of ``gy`` (:func:`forward_mode`)."""
    weight, bias = module.weight, module.bias
    y = F.linear(x, weight.detach(), None if bias is None else bias.detach())
    version, shape = x._version, y.shape

    def hook(grad_outputs):
        if x._version != version:
            raise RuntimeError(f"SplitLinear(tag={module.tag!r}): its input was modified in place before the "
                               "backward; the deferred weight gradient would be wrong")
        store = module.wgrad_store
        if store is None:
            raise RuntimeError(f"SplitLinear(tag={module.tag!r}): forward ran under forward_mode(DEFERRED) but the "
                               "backward has no DeferredWGrad attached; run it inside store.capture(...) or use "
                               "forward_mode(FUSED)")
        gy = grad_outputs[0]
        if gy is None:
            gy = torch.zeros(shape, dtype=y_dtype, device=y_device)
        _record_w(store, module, x, gy, weight, bias is not None)

    y_dtype, y_device = y.dtype, y.device
    y.grad_fn.register_prehook(hook)
    return y


def _record_w(store: "DeferredWGrad", module: "SplitLinear", x: torch.Tensor, gy: torch.Tensor,
              weight: torch.Tensor, has_bias: bool) -> None:
    """Record the W thunks of one use of ``module`` (as :class:`_SplitLinearFn`'s backward does)."""
    out_f, in_f = weight.shape
    x = x.to(gy.dtype)  # the compute dtype: autocast's cast of the input (a no-op without autocast)
    gy2 = gy if gy.dim() == 2 else gy.reshape(-1, out_f)  # a 2-d operand is its own reshape (same strides)
    x2 = x if x.dim() == 2 else x.reshape(-1, in_f)
    versions = (x2._version, gy2._version)
    wt_column_major = weight.stride(1) == 1 and weight.stride(0) == in_f  # _column_major(weight.t()), no view

    def check() -> None:
        if (x2._version, gy2._version) != versions:
            raise RuntimeError(f"SplitLinear(tag={module.tag!r}): its input or output gradient was modified "
                               "in place after B; the deferred weight gradient would be wrong")

    def wgrad() -> torch.Tensor:
        check()
        return gy2.t().mm(x2) if wt_column_major else x2.t().mm(gy2).t()

    store.record(module.weight, wgrad, module.tag, module.wgrad_key)
    if has_bias:
        def bgrad() -> torch.Tensor:
            check()
            return gy2.sum(0)

        store.record(module.bias, bgrad, module.tag, module.wgrad_key)


class SplitLinear(nn.Linear):
    """``nn.Linear`` with a backward split into B (input grad) and deferrable W (weight grad).

    Shapes: input ``[..., in_features]`` -> output ``[..., out_features]`` (as ``nn.Linear``).

    Attributes:
        tag: task kind recorded with deferred entries (``"mixer"``, ``"expert"``, ...).
        wgrad_store: the attached :class:`DeferredWGrad` while inside ``store.capture``; else None
            (fused backward).
        wgrad_key: the key its thunks are recorded under (set by ``store.capture_many``; None:
            the capture's key).
    """

    tag: str | None
    wgrad_store: DeferredWGrad | None
    wgrad_key = None
    forward_mode: str | None = None  # set by forward_mode(); None: the autograd.Function path

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tag: str | None = None, **kw) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.tag, self.wgrad_store, self.wgrad_key = tag, None, None

    @classmethod
    def from_linear(cls, linear: nn.Linear, tag: str | None = None) -> "SplitLinear":
        """A SplitLinear sharing ``linear``'s Parameter objects (no new allocation, no RNG use)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.tag, new.wgrad_store, new.wgrad_key = tag, None, None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.forward_mode
        if mode is not None and torch.is_grad_enabled():
            if mode == FUSED:
                return F.linear(x, self.weight, self.bias)
            if x.requires_grad and self.weight.requires_grad and (self.bias is None or self.bias.requires_grad):
                return _deferring_linear(self, x)
        return _SplitLinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tag={self.tag!r}"


def split_linears(module: nn.Module, tag: str | None = None) -> nn.Module:
    """Replace every plain ``nn.Linear`` under ``module`` by a :class:`SplitLinear` (in place).

    The new modules share the old Parameter objects, so optimizers and references stay valid.
    Existing SplitLinears get ``tag`` if they have none. Works on third-party submodules
    (transformers' attention / DeltaNet / MLP, DeepSpeed's ``TopKGate.wg``). Returns ``module``.
    """
    if type(module) is nn.Linear:
        raise TypeError("split_linears(module): pass the parent of a bare nn.Linear, or use SplitLinear.from_linear")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SplitLinear.from_linear(child, tag))
            elif isinstance(child, SplitLinear) and child.tag is None:
                child.tag = tag
    return module
