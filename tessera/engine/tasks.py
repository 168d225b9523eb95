"""Running F, B and W of one chunk (a :class:`~tessera.model.StageModule`) as tasks.

:class:`TorchChunk` keeps the state of every microbatch of its chunk between tasks and runs one
:class:`~tessera.model.tasks.TaskKey` at a time, so the engine can interleave the tasks of
two microbatches (``FB``) in any order that respects the data flow. Communication tasks
(``dispatch``, ``combine``) *issue* asynchronous all-to-alls (:mod:`tessera.model.ep.asynchronous`);
the first task that needs their rows waits (a lazy value), so compute issued in between overlaps
the transfer. ``eager_comm=True`` waits inside the communication task instead (profiling: task
times without overlap).

Inputs come from a :class:`Lazy` the engine supplies (token ids, a received buffer, or another
local chunk's output), evaluated by the first task that needs them: a receive is waited where
the data is used. Gradients are not scaled here (seed 1 for each microbatch's loss).

:class:`NoopChunk` has the same interface and task lists but does no work (engine overhead).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tessera.model import tasks as lt
from tessera.cost.types import TaskKey
from tessera.model.ep import expert_major, plan_route, start_combine, start_combine_grad, start_dispatch
from tessera.model.stage import StageModule
from tessera.model.wgrad import DeferredWGrad


class Lazy:
    """A value computed on first :meth:`get` (then cached)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn, self._value = fn, None

    @staticmethod
    def of(value) -> "Lazy":
        lazy = Lazy(None)
        lazy._value = value
        return lazy

    def get(self):
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value


class _Micro:
    """State of one microbatch of a chunk from its first F task to its last B task."""

    __slots__ = ("source", "labels", "bsource", "defer", "states", "experts", "routes", "outs", "pending", "grads",
                 "embed_out", "head")

    def __init__(self, source: Lazy, labels) -> None:
        self.source, self.labels, self.bsource, self.defer = source, labels, None, False
        self.states: dict[int, lt.LayerState] = {}
        self.experts: dict[int, lt.ExpertState] = {}
        self.routes: dict = {}
        self.outs: dict[int, Lazy] = {}
        self.pending: dict[tuple[str, int], Lazy] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.embed_out = None
        self.head = lt.HeadState()


def _capture_module(layer, kind: str) -> torch.nn.Module:
    """The smallest module holding the SplitLinears of ``layer``'s ``kind`` (the W-deferral
    capture walks it on every backward task)."""
    if kind == "mixer":
        return layer.attn
    if kind == "mlp":
        return layer.mlp_module
    if kind == "router":
        return layer.moe.gate
    if kind == "expert":
        return layer.moe.experts
    return torch.nn.ModuleList([m for m in (layer.moe.shared_expert, layer.moe.shared_expert_gate) if m is not None])


def _chunk_keys(module: StageModule) -> dict[str, tuple[TaskKey, ...]]:
    n = module.model_spec.num_layers
    f, b, w = [], [], []
    if module.has_embed:
        f.append(TaskKey("F", -1, "embed"))
    for layer in module.layers:
        f += [TaskKey("F", layer.index, k) for k in lt.forward_kinds(layer)]
    if module.has_head:
        f.append(TaskKey("F", n, "head"))
        b.append(TaskKey("B", n, "head"))
        w.append(TaskKey("W", n, "head"))
    for layer in reversed(module.layers):
        b += [TaskKey("B", layer.index, k) for k in lt.backward_kinds(layer)]
        w += [TaskKey("W", layer.index, k) for k in lt.weight_kinds(layer)]
    if module.has_embed:
        b.append(TaskKey("B", -1, "embed"))
        w.append(TaskKey("W", -1, "embed"))
    return {"F": tuple(f), "B": tuple(b), "W": tuple(w)}


class TorchChunk:
    """Executes the tasks of one chunk for many microbatches.

    Args:
        module: the chunk's layers (its MoE layers built with the EP group ``ep_group``).
        ep_group: EP process group (None: all experts local).
        eager_comm: wait for each all-to-all inside its own task (profiling).
        profile: append ``(TaskKey, ms)`` of every task (W per kind) to :attr:`timings`.

    Protocol used by the engine: :meth:`begin_forward`, :meth:`begin_backward`, :meth:`run` for
    every key of :meth:`task_keys` (in an order respecting the data flow), :meth:`output` /
    :meth:`pop_input_grad` at the chunk boundaries, :meth:`run_w` for deferred W.
    """

    def __init__(self, module: StageModule, ep_group=None, eager_comm: bool = False, profile: bool = False) -> None:
        self.module, self.ep_group, self.eager_comm, self.profile = module, ep_group, eager_comm, profile
        self.timings: list[tuple[TaskKey, float]] = []  # (task, ms) of every task run, when profiling
        self.start, self.stop = module.start, module.stop
        self.model_spec = module.model_spec  # the task structure of FB pairs comes from it
        self.store = DeferredWGrad()
        self._keys = _chunk_keys(module)
        self._layers = {layer.index: layer for layer in module.layers}
        self._first = module.layers[0].index if len(module.layers) else None
        self._last = module.layers[-1].index if len(module.layers) else None
        self._capture = {(layer.index, kind): _capture_module(layer, kind)
                         for layer in module.layers for kind in lt.weight_kinds(layer)}
        if module.has_head:
            self._capture[(module.model_spec.num_layers, "head")] = module.head
        self._micro: dict[int, _Micro] = {}
        self._w_left: dict[int, set[TaskKey]] = {}
        self._g_in: dict[int, torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._run = {("F", "embed"): self._f_embed, ("F", "mixer"): self._f_mixer, ("F", "router"): self._f_router,
                     ("F", "dispatch"): self._f_dispatch, ("F", "shared"): self._f_shared,
                     ("F", "expert"): self._f_expert, ("F", "combine"): self._f_combine, ("F", "mlp"): self._f_mlp,
                     ("F", "head"): self._f_head, ("B", "head"): self._b_head, ("B", "combine"): self._b_combine,
                     ("B", "shared"): self._b_shared, ("B", "expert"): self._b_expert,
                     ("B", "dispatch"): self._b_dispatch, ("B", "router"): self._b_router, ("B", "mlp"): self._b_mlp,
                     ("B", "mixer"): self._b_mixer, ("B", "embed"): self._b_embed}

    # --- protocol ------------------------------------------------------------------------------
    def task_keys(self, phase: str) -> tuple[TaskKey, ...]:
        """Tasks of ``phase`` (``"F"``, ``"B"``, ``"W"``) in the order of a lone instruction."""
        return self._keys[phase]

    def begin_forward(self, mb: int, source: Lazy, labels: torch.Tensor | None) -> None:
        """Start the forward of ``mb``: ``source`` yields token ids ``[B, S]`` (embedding chunk) or
        the input activation ``[B, S, H]``; ``labels [B, S]`` for the head chunk."""
        if mb in self._micro:
            raise RuntimeError(f"chunk [{self.start},{self.stop}): forward of mb {mb} started twice")
        self._micro[mb] = _Micro(source, labels)

    def begin_backward(self, mb: int, source: Lazy | None, defer_w: bool) -> None:
        """Start the backward of ``mb``; ``source`` yields the output gradient (None for the head
        chunk); ``defer_w``: record weight gradients for :meth:`run_w` instead of computing them."""
        micro = self._require(mb)
        micro.bsource, micro.defer = source, defer_w
        if defer_w:
            self._w_left[mb] = set(self._keys["W"])

    def run(self, key: TaskKey, mb: int) -> None:
        """Run one F or B task of ``mb``."""
        t0 = time.perf_counter()
        self._run[(key.phase, key.kind)](self._require(mb), key.layer, mb)
        if self.profile:
            self.timings.append((key, (time.perf_counter() - t0) * 1e3))
        if key.phase == "B" and key == self._keys["B"][-1]:
            self._finish_backward(mb)

    def output(self, mb: int) -> torch.Tensor:
        """The chunk's output activation ``[B, S, H]`` for ``mb`` (with its graph)."""
        return self._require(mb).outs[self._last].get()

    def loss(self, mb: int) -> torch.Tensor | None:
        return self._losses.get(mb)

    def pop_input_grad(self, mb: int) -> torch.Tensor:
        """Gradient of the chunk's input activation (after its last B task)."""
        try:
            return self._g_in.pop(mb)
        except KeyError:
            raise RuntimeError(f"chunk [{self.start},{self.stop}): no input gradient of mb {mb}") from None

    def w_pending(self, mb: int) -> bool:
        """Whether ``mb``'s backward deferred W tasks that have not all run."""
        return mb in self._w_left

    def run_w(self, mb: int, key: TaskKey | None = None) -> int:
        """Run the deferred weight gradients of ``mb`` (one W task, or all that are left);
        returns how many thunks ran."""
        left = self._w_left.get(mb)
        if left is None:
            return 0
        keys = [k for k in self._keys["W"] if k in left] if key is None else [key]
        left.difference_update(keys)
        if not left:
            del self._w_left[mb]
        n = 0
        for k in keys:
            t0 = time.perf_counter()
            n += self.store.run((mb, k.layer), k.kind)
            if self.profile:
                self.timings.append((k, (time.perf_counter() - t0) * 1e3))
        return n

    def end_iteration(self) -> dict[int, torch.Tensor]:
        """Drop per-iteration state; returns the losses by microbatch (head chunk)."""
        losses, self._losses = self._losses, {}
        self._micro.clear()
        self._g_in.clear()
        self._w_left.clear()
        self.store.clear()
        return losses

    def parameters(self):
        return self.module.parameters()

    # --- helpers -------------------------------------------------------------------------------
    def _require(self, mb: int) -> _Micro:
        try:
            return self._micro[mb]
        except KeyError:
            raise RuntimeError(f"chunk [{self.start},{self.stop}): mb {mb} has no forward state") from None

    def _input(self, micro: _Micro, layer: int) -> torch.Tensor:
        prev = micro.outs.get(layer - 1)
        return micro.source.get() if prev is None else prev.get()

    def _g_out(self, micro: _Micro, layer: int) -> torch.Tensor:
        g = micro.grads.get(layer)
        if g is None:
            if micro.bsource is None or layer != self._last:
                raise RuntimeError(f"chunk [{self.start},{self.stop}): no output gradient for layer {layer}")
            g = micro.grads[layer] = micro.bsource.get()
        return g

    def _backward(self, micro: _Micro, mb: int, layer: int, kind: str, fn, *args):
        if not micro.defer:
            return fn(*args)
        with self.store.capture((mb, layer), self._capture[(layer, kind)]):
            return fn(*args)

    def _finish_backward(self, mb: int) -> None:
        micro = self._micro.pop(mb)
        if self._first is not None and not self.module.has_embed:
            self._g_in[mb] = micro.grads[self._first - 1]

    def _set_input_grad(self, micro: _Micro, layer: int, g: torch.Tensor) -> None:
        micro.grads[layer - 1] = g

    # --- forward tasks -------------------------------------------------------------------------
    def _f_embed(self, micro: _Micro, layer: int, mb: int) -> None:
        micro.embed_out = self.module.embed(micro.source.get())
        micro.outs[-1] = Lazy.of(micro.embed_out)

    def _f_mixer(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states.setdefault(layer, lt.LayerState())
        lt.f_mixer(self._layers[layer], st, self._input(micro, layer))
        micro.outs[layer] = Lazy.of(st.h)

    def _state(self, micro: _Micro, layer: int) -> lt.LayerState:
        st = micro.states.get(layer)
        if st is None:  # layer without a mixer task
            st = micro.states[layer] = lt.LayerState()
            lt.f_mixer(self._layers[layer], st, self._input(micro, layer))
        return st

    def _f_router(self, micro: _Micro, layer: int, mb: int) -> None:
        lt.f_router(self._layers[layer], self._state(micro, layer))

    def _f_dispatch(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states[layer]
        rows = lt.f_gather(self._layers[layer], st)
        route = micro.routes[layer] = plan_route(st.route.counts, st.route.capacity, self.ep_group)
        flight = start_dispatch(rows, route, self.ep_group)
        if self.eager_comm:
            flight.result()
        micro.pending[("F", layer)] = Lazy(lambda: expert_major(flight.result(), route.plan))

    def _f_shared(self, micro: _Micro, layer: int, mb: int) -> None:
        lt.f_shared(self._layers[layer], micro.states[layer])

    def _f_expert(self, micro: _Micro, layer: int, mb: int) -> None:
        route = micro.routes[layer]
        est = micro.experts[layer] = lt.ExpertState()
        lt.f_expert(self._layers[layer].moe.experts, est, micro.pending.pop(("F", layer)).get(), route.counts)

    def _f_combine(self, micro: _Micro, layer: int, mb: int) -> None:
        st, module = micro.states[layer], self._layers[layer]
        flight = start_combine(micro.experts[layer].y.detach(), micro.routes[layer], self.ep_group)
        if self.eager_comm:
            flight.result()
        micro.outs[layer] = Lazy(lambda: lt.f_combine(module, st, flight.result()))

    def _f_mlp(self, micro: _Micro, layer: int, mb: int) -> None:
        st = self._state(micro, layer)
        lt.f_mlp(self._layers[layer], st)
        micro.outs[layer] = Lazy.of(st.out)

    def _f_head(self, micro: _Micro, layer: int, mb: int) -> None:
        if micro.labels is None:
            raise RuntimeError("the head chunk needs labels")
        x = micro.outs[self._last].get() if self._last is not None else micro.source.get()
        self._losses[mb] = lt.f_head(self.module.head, micro.head, x, micro.labels).detach()

    # --- backward tasks ------------------------------------------------------------------------
    def _b_head(self, micro: _Micro, layer: int, mb: int) -> None:
        micro.grads[self._last] = self._backward(micro, mb, layer, "head", lt.b_head, micro.head)

    def _b_combine(self, micro: _Micro, layer: int, mb: int) -> None:
        route = micro.routes[layer]
        g = lt.b_combine(micro.states[layer], self._g_out(micro, layer))
        flight = start_combine_grad(g, route, self.ep_group)
        if self.eager_comm:
            flight.result()
        micro.pending[("B", layer)] = Lazy(lambda: expert_major(flight.result(), route.plan))

    def _b_shared(self, micro: _Micro, layer: int, mb: int) -> None:
        module = self._layers[layer]
        self._backward(micro, mb, layer, "shared", lt.b_shared, module, micro.states[layer], self._g_out(micro, layer))

    def _b_expert(self, micro: _Micro, layer: int, mb: int) -> None:
        est = micro.experts[layer]
        self._backward(micro, mb, layer, "expert", lt.b_expert, est, micro.pending.pop(("B", layer)).get())

    def _b_dispatch(self, micro: _Micro, layer: int, mb: int) -> None:
        st, est = micro.states[layer], micro.experts.pop(layer)
        flight = start_combine(est.g_x, micro.routes.pop(layer), self.ep_group)
        if self.eager_comm:
            flight.result()
        micro.pending[("B", layer)] = Lazy(lambda: lt.b_gather(st, flight.result()))

    def _b_router(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states[layer]
        micro.pending.pop(("B", layer)).get()
        self._backward(micro, mb, layer, "router", lt.b_router, st, self._g_out(micro, layer))
        self._after_layer_backward(micro, layer)

    def _b_mlp(self, micro: _Micro, layer: int, mb: int) -> None:
        self._backward(micro, mb, layer, "mlp", lt.b_mlp, micro.states[layer], self._g_out(micro, layer))
        self._after_layer_backward(micro, layer)

    def _after_layer_backward(self, micro: _Micro, layer: int) -> None:
        if self._layers[layer].attn is None:  # no mixer task: g_h is the input gradient
            self._set_input_grad(micro, layer, micro.states.pop(layer).g_h)

    def _b_mixer(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states.pop(layer)
        g_h = st.g_h if st.g_h is not None else self._g_out(micro, layer)
        self._set_input_grad(micro, layer, self._backward(micro, mb, layer, "mixer", lt.b_mixer, st, g_h))
        micro.grads.pop(layer, None)

    def _b_embed(self, micro: _Micro, layer: int, mb: int) -> None:
        torch.autograd.backward(micro.embed_out, micro.grads.pop(-1))
        micro.embed_out = None


class NoopChunk:
    """Same task lists and protocol as :class:`TorchChunk`, no work (engine-overhead runs).
    ``model_spec`` (optional) gives the engine the task structure of ``FB`` pairs."""

    def __init__(self, keys: dict[str, tuple[TaskKey, ...]], start: int, stop: int, model_spec=None) -> None:
        self._keys, self.start, self.stop, self.model_spec = keys, start, stop, model_spec
        self._dummy = torch.zeros(())

    @staticmethod
    def like(chunk: TorchChunk) -> "NoopChunk":
        return NoopChunk({p: chunk.task_keys(p) for p in "FBW"}, chunk.start, chunk.stop, chunk.model_spec)

    def task_keys(self, phase: str) -> tuple[TaskKey, ...]:
        return self._keys[phase]

    def begin_forward(self, mb, source, labels) -> None:
        pass

    def begin_backward(self, mb, source, defer_w) -> None:
        pass

    def run(self, key, mb) -> None:
        pass

    def output(self, mb):
        return self._dummy

    def loss(self, mb):
        return None

    def pop_input_grad(self, mb):
        return self._dummy

    def w_pending(self, mb) -> bool:
        return False

    def run_w(self, mb, key=None) -> int:
        return 0

    def end_iteration(self) -> dict:
        return {}

    def parameters(self):
        return iter(())
