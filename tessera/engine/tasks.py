"""Running F, B and W of one chunk (a :class:`~tessera.model.StageModule`) as tasks.

:class:`TorchChunk` keeps the state of every microbatch of its chunk between tasks and runs one
:class:`~tessera.model.tasks.TaskKey` at a time, so the engine can interleave the tasks of two
microbatches (``FB``) in any order that respects the data flow. Communication tasks (``dispatch``,
``combine``) *issue* asynchronous all-to-alls (:mod:`tessera.model.ep.asynchronous`); the first
task that needs their rows waits (a lazy value), so compute issued in between overlaps the
transfer. ``eager_comm=True`` waits inside the communication task instead (profiling).
The route counts of a MoE layer are exchanged in its router task, on the counts group (a
communicator of their own, so they never queue behind a row all-to-all), and read on the host
once in its dispatch task (:func:`~tessera.model.ep.exchange_route_counts`,
:func:`~tessera.model.ep.read_route`): one host synchronisation per MoE layer and microbatch,
counted on :attr:`TorchChunk.host_syncs`.

Autograd segments (:mod:`tessera.engine.segments`): the B tasks of a microbatch form runs; the
forward keeps the tensors of tasks in one run connected and puts a detached leaf on every edge
between runs (recording the edge as a root of the producer's run), and the first B task of a run
makes one ``torch.autograd.backward`` call for the whole run, with the W thunks of every task in
it recorded under their own ``(mb, layer)`` keys. The identity nodes of :mod:`tessera.model.tasks`
(``enter``, ``exit_router``, ``tap_shared``) keep every gradient sum of the detached task form,
so the arithmetic, and the result bitwise, does not depend on the runs.
Forward tasks run under the chunk module's autocast (:mod:`tessera.model.precision`), their SplitLinears
under :func:`~tessera.model.wgrad.forward_mode` when :meth:`TorchChunk.begin_forward` knows ``defer_w``.

Inputs come from a :class:`Lazy` the engine supplies (token ids, a received buffer, or another
local chunk's output), evaluated by the first task that needs them: a receive is waited where
the data is used. Gradients are not scaled here (seed 1 for each microbatch's loss).
:class:`NoopChunk`: same interface and task lists, no work (engine overhead).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable

import torch

from tessera.model import tasks as lt
from tessera.cost.types import TaskKey
from tessera.model.ep import (ep_size, exchange_route_counts, expert_major, read_route, start_combine,
                              start_combine_grad, start_dispatch)
from tessera.model.hostsync import HostSyncs
from tessera.model.precision import module_autocast
from tessera.model.stage import StageModule
from tessera.model.streams import NO_STREAM, CommStream
from tessera.model.wgrad import DEFERRED, FUSED, DeferredWGrad, SplitLinear, forward_mode
from tessera.engine import fused
from tessera.engine.lazy import Lazy, get as _get
from tessera.engine.segments import GIVEN as _GIVEN, LAZY as _LAZY, LEAF as _LEAF, LEAF_OPT as _LEAF_OPT
from tessera.engine.segments import BackwardRuns, backward_runs
from tessera.engine.timing import SpanLog, SpanTotal, Timer, first_device, make_timer


_INPUT = -1  # "run" of the chunk input: a leaf in every run


class _Micro:
    """State of one microbatch of a chunk from its first F task to its last B task.

    ``outs[L]``: layer ``L``'s output (a tensor, or a :class:`Lazy` while a combine all-to-all is
    in flight) and ``out_run[L]`` the run owning it (-1 for the embedding's output on no chunk:
    see ``_INPUT``); ``roots[r]``: the ``(tensor, gradient source, mode)`` roots of run ``r``."""

    __slots__ = ("source", "labels", "bsource", "defer", "runs", "roots", "done", "states", "experts", "routes",
                 "exchanged", "outs", "out_run", "h_run", "pending", "in_leaf", "loss", "mode")

    def __init__(self, source: Lazy, labels, runs: BackwardRuns, mode: str | None = None) -> None:
        self.source, self.labels, self.bsource, self.defer, self.runs = source, labels, None, False, runs
        self.mode = mode  # forward_mode of its SplitLinears (None: unknown, the Function path)
        self.roots: list[list] = [[] for _ in range(runs.count)]
        self.done = -1  # last run whose backward ran
        self.states: dict[int, lt.LayerState] = {}
        self.experts: dict[int, lt.ExpertState] = {}
        self.routes: dict = {}
        self.exchanged: dict = {}  # layer -> RouteCounts, from its router task until its dispatch task
        self.outs: dict[int, object] = {}
        self.out_run: dict[int, int] = {}
        self.h_run: dict[int, int] = {}
        self.pending: dict[tuple[str, int], Lazy] = {}
        self.in_leaf = None
        self.loss = None


def _capture_module(layer, kind: str) -> torch.nn.Module:
    """The smallest module holding the SplitLinears of ``layer``'s ``kind``."""
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
        profile: ``(TaskKey, ms)`` of every task (W per kind) in :attr:`timings` (a SpanLog; every B its own segment).
        timer, stream: task timer (None: ``make_timer`` of its device), all-to-alls' CommStream.
        counts_group: the group the route counts travel on: the EP group's ranks on a
            communicator of their own (:class:`~tessera.engine.groups.RankGroups` ``ep_counts``);
            None: ``ep_group``.
        host_syncs: the counter of host synchronisations (:class:`~tessera.model.hostsync.HostSyncs`;
            None: a new one), :attr:`host_syncs`; the engine passes one to all its chunks.

    Raises:
        ValueError: ``counts_group`` has another size than ``ep_group``.

    Protocol used by the engine: :meth:`begin_forward` (with the microbatch's
    :class:`~tessera.engine.segments.BackwardRuns`, default :meth:`lone_runs`),
    :meth:`begin_backward`, :meth:`run` for every key of :meth:`task_keys` (in an order
    respecting the data flow), :meth:`output` / :meth:`pop_input_grad` at the chunk boundaries,
    :meth:`run_w` for deferred W.
    """

    def __init__(self, module: StageModule, ep_group=None, eager_comm: bool = False, profile: bool = False,
                 timer: Timer | None = None, stream: CommStream = NO_STREAM, counts_group=None,
                 host_syncs: HostSyncs | None = None) -> None:
        self.module, self.ep_group, self.eager_comm, self.profile = module, ep_group, eager_comm, profile
        if counts_group is not None and ep_size(counts_group) != ep_size(ep_group):
            raise ValueError(f"the counts group has {ep_size(counts_group)} ranks, the EP group {ep_size(ep_group)}")
        self.counts_group = ep_group if counts_group is None else counts_group
        self.host_syncs = HostSyncs() if host_syncs is None else host_syncs  # one read per MoE layer and microbatch
        self.timer, self.stream = make_timer(first_device([module])) if timer is None else timer, stream
        self.timings = SpanLog(self.timer)  # (task, ms) of every task run, when profiling
        self.a2a_wait = SpanTotal(self.timer)  # time blocked on this chunk's all-to-alls (exposed all-to-all)
        self.start, self.stop = module.start, module.stop
        self.model_spec = module.model_spec  # the task structure of FB pairs comes from it
        self.store = DeferredWGrad()
        self._amp = module_autocast(module)  # the context of every forward task (compute dtype)
        self._keys = _chunk_keys(module)
        self._layers = {layer.index: layer for layer in module.layers}
        # the index whose output leaves the chunk: its last decoder layer, or the embedding alone (-1)
        self._last = module.layers[-1].index if len(module.layers) else (-1 if module.has_embed else None)
        self._head = module.model_spec.num_layers
        self.comm = any(layer.moe is not None and layer.moe.ep_group is not None for layer in module.layers)
        self._linears = {(layer.index, kind): [m for m in _capture_module(layer, kind).modules()
                                               if isinstance(m, SplitLinear)]
                         for layer in module.layers for kind in lt.weight_kinds(layer)}
        if module.has_head:
            self._linears[(self._head, "head")] = [m for m in module.head.modules() if isinstance(m, SplitLinear)]
        self.all_linears = tuple(m for lins in self._linears.values() for m in lins)  # the fused forward's
        self._bkey = {(k.layer, k.kind): k for k in self._keys["B"]}
        self._last_b = self._keys["B"][-1] if self._keys["B"] else None
        self._lone = self.runs_for(self._keys["B"], [False] * len(self._keys["B"]))
        self._micro: dict[int, _Micro] = {}
        self._w_left: dict[int, set[TaskKey]] = {}
        self._g_in: dict[int, torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._run = {("F", k): getattr(self, f"_f_{k}") for k in
                     ("embed", "mixer", "router", "dispatch", "shared", "expert", "combine", "mlp", "head")}
        self._post = {"combine": self._b_combine, "dispatch": self._b_dispatch} if self.comm else {}
        self.on_route: Callable = lambda mb, layer, requested: None  # after each router task (DBO's live counts)

    # --- protocol ------------------------------------------------------------------------------
    def task_keys(self, phase: str) -> tuple[TaskKey, ...]:
        """Tasks of ``phase`` (``"F"``, ``"B"``, ``"W"``) in the order of a lone instruction."""
        return self._keys[phase]

    def runs_for(self, order, breaks_before) -> BackwardRuns:
        """The autograd segments of a backward that runs this chunk's B tasks in ``order`` with
        ``breaks_before[i]`` where the Program interleaves other work (see
        :func:`~tessera.engine.segments.backward_runs`)."""
        return backward_runs(tuple(order), tuple(breaks_before), self.comm, split_all=self.profile)

    def lone_runs(self) -> BackwardRuns:
        """The segments of a lone ``B`` instruction."""
        return self._lone

    def fuses(self, mb: int) -> bool:
        """Whether ``mb``'s lone ``F`` and ``B`` instructions run as one step each
        (:meth:`run_forward`, :meth:`run_backward`; :mod:`tessera.engine.fused`): its backward is
        one segment, the chunk exchanges no all-to-all and does not profile per task."""
        micro = self._micro.get(mb)
        return micro is not None and micro.runs.count == 1 and not self.comm and not self.profile

    def run_forward(self, mb: int) -> None:
        """Every F task of ``mb`` as one step (only where :meth:`fuses`)."""
        fused.forward(self, self._require(mb), mb)

    def run_backward(self, mb: int) -> None:
        """Every B task of ``mb`` as one step (only where :meth:`fuses`)."""
        fused.backward(self, self._require(mb), mb)

    def begin_forward(self, mb: int, source: Lazy, labels: torch.Tensor | None,
                      runs: BackwardRuns | None = None, defer_w: bool | None = None) -> None:
        """Start the forward of ``mb``: ``source`` yields token ids ``[B, S]`` (embedding chunk) or
        the input activation ``[B, S, H]``; ``labels [B, S]`` for the head chunk; ``runs``: the
        segments its backward will run in (default :meth:`lone_runs`); ``defer_w``: what its
        backward will do (True: defer W, False: compute W in B), so the forward tasks run their
        SplitLinears on the matching fast path (:func:`tessera.model.wgrad.forward_mode`);
        :meth:`begin_backward` must then pass the same; None: decided at the backward."""
        if mb in self._micro:
            raise RuntimeError(f"chunk [{self.start},{self.stop}): forward of mb {mb} started twice")
        mode = None if defer_w is None else DEFERRED if defer_w else FUSED
        self._micro[mb] = _Micro(source, labels, self._lone if runs is None else runs, mode)

    def begin_backward(self, mb: int, source: Lazy | None, defer_w: bool) -> None:
        """Start the backward of ``mb``; ``source`` yields the output gradient (None for the head
        chunk); ``defer_w``: record weight gradients for :meth:`run_w` instead of computing them."""
        micro = self._require(mb)
        if micro.mode is not None and (micro.mode == DEFERRED) != defer_w:
            raise RuntimeError(f"chunk [{self.start},{self.stop}): the forward of mb {mb} was run for "
                               f"defer_w={micro.mode == DEFERRED}, its backward asks defer_w={defer_w}")
        micro.bsource, micro.defer = source, defer_w
        if defer_w:
            self._w_left[mb] = set(self._keys["W"])
        if source is not None and self._last is not None:
            micro.roots[micro.out_run[self._last]].append((micro.outs[self._last], source, _LAZY))

    def run(self, key: TaskKey, mb: int) -> None:
        """Run one F or B task of ``mb`` (a B task that starts a segment runs the segment's
        backward)."""
        t0 = self.timer.mark() if self.profile else None
        micro = self._require(mb)
        if key.phase == "F":
            lins = self._linears.get((key.layer, key.kind)) if micro.mode is not None else None
            with self._amp(), (forward_mode(lins, micro.mode) if lins else contextlib.nullcontext()):
                self._run[(key.phase, key.kind)](micro, key.layer, mb)
        else:
            r = micro.runs.run_of[key]
            if r > micro.done:
                micro.done = r
                self._backward_run(micro, mb, r)
            post = self._post.get(key.kind)
            if post is not None:
                post(micro, key.layer)
            if key == self._last_b:
                self._finish_backward(mb)
        if self.profile:
            self.timings.add(key, t0, self.timer.mark())

    def output(self, mb: int) -> torch.Tensor:
        """The chunk's output activation ``[B, S, H]`` for ``mb`` (with its graph)."""
        micro = self._require(mb)
        out = micro.outs[self._last]
        if type(out) is Lazy:
            out = micro.outs[self._last] = out.get()
        return out

    def output_ready(self, mb: int) -> bool:
        """Whether :meth:`output` would return without waiting for an all-to-all."""
        micro = self._micro.get(mb)
        if micro is None or self._last not in micro.outs:
            return False
        out = micro.outs[self._last]
        return type(out) is not Lazy or out.ready()

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
            t0 = self.timer.mark() if self.profile else None
            n += self.store.run((mb, k.layer), k.kind)
            if self.profile:
                self.timings.add(k, t0, self.timer.mark())
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

    def _input(self, micro: _Micro, layer: int) -> tuple[torch.Tensor, int]:
        """Layer ``layer``'s input and the run owning it (``_INPUT``: the chunk input leaf)."""
        prev = micro.outs.get(layer - 1)
        if prev is not None:
            return _get(prev), micro.out_run[layer - 1]
        if micro.in_leaf is None:
            micro.in_leaf = lt.leaf(micro.source.get())
        return micro.in_leaf, _INPUT

    def _edge(self, micro: _Micro, t: torch.Tensor, producer: int, consumer: int, mode: int = _LEAF,
              enter: bool = False) -> torch.Tensor:
        """``t`` as the input of a task of run ``consumer``: connected within a run (through an
        identity node with ``enter``), else a detached leaf whose gradient becomes a root of the
        producer's run."""
        if producer == consumer or producer == _INPUT:
            return lt.enter(t) if enter else t
        x = lt.leaf(t)
        micro.roots[producer].append((t, x, mode))
        return x

    def _r(self, micro: _Micro, layer: int, kind: str) -> int:
        return micro.runs.run_of[self._bkey[(layer, kind)]]

    def _backward_run(self, micro: _Micro, mb: int, r: int) -> None:
        tensors, grads = [], []
        for t, src, mode in micro.roots[r]:
            if mode == _LEAF:
                g = src.grad
                if g is None:
                    g = torch.zeros_like(src)
            elif mode == _LEAF_OPT:
                g = src.grad
                if g is None:
                    continue
            elif mode == _LAZY:
                g = src.get()
            else:
                g = src
            tensors.append(_get(t))
            grads.append(g)
        micro.roots[r] = []
        if not tensors:
            return
        if not micro.defer:
            torch.autograd.backward(tensors, grads)
            return
        groups = micro.runs.linears.get((id(self), r))
        if groups is None:
            groups = micro.runs.linears[(id(self), r)] = [
                (k.layer, self._linears[(k.layer, k.kind)]) for k in micro.runs.members[r]
                if (k.layer, k.kind) in self._linears]
        with self.store.capture_many([((mb, layer), lins) for layer, lins in groups]):
            torch.autograd.backward(tensors, grads)

    def _finish_backward(self, mb: int) -> None:
        micro = self._micro.pop(mb)
        if not self.module.has_embed and micro.in_leaf is not None:
            g = micro.in_leaf.grad
            self._g_in[mb] = torch.zeros_like(micro.in_leaf) if g is None else g

    def _set_out(self, micro: _Micro, layer: int, out, run: int) -> None:
        micro.outs[layer], micro.out_run[layer] = out, run

    # --- forward tasks -------------------------------------------------------------------------
    def _f_embed(self, micro: _Micro, layer: int, mb: int) -> None:
        self._set_out(micro, -1, self.module.embed(micro.source.get()), self._r(micro, -1, "embed"))

    def _f_mixer(self, micro: _Micro, layer: int, mb: int) -> None:
        x, owner = self._input(micro, layer)
        r = self._r(micro, layer, "mixer")
        st = micro.states[layer] = lt.LayerState()
        st.h = self._layers[layer].mixer(self._edge(micro, x, owner, r))
        micro.h_run[layer] = r
        self._set_out(micro, layer, st.h, r)

    def _state(self, micro: _Micro, layer: int) -> lt.LayerState:
        st = micro.states.get(layer)
        if st is None:  # layer without a mixer task: h = x
            st = micro.states[layer] = lt.LayerState()
            st.h, micro.h_run[layer] = self._input(micro, layer)
        return st

    def _f_router(self, micro: _Micro, layer: int, mb: int) -> None:
        st, module = self._state(micro, layer), self._layers[layer]
        r = self._r(micro, layer, "router")
        st.route = module.router(self._edge(micro, st.h, micro.h_run[layer], r, enter=True))
        st.tok_d, st.tok_s, st.gates, st.aux = lt.exit_router(st.route, module.moe.shared_expert is not None)
        micro.exchanged[layer] = exchange_route_counts(st.route.counts, st.route.capacity, self.ep_group,
                                                       self.counts_group)
        self.on_route(mb, layer, st.route.requested)

    def _f_dispatch(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states[layer]
        route = micro.routes[layer] = read_route(micro.exchanged.pop(layer), self.host_syncs)
        st.rows = self._layers[layer].moe.gather_rows(replace(st.route, tokens=st.tok_d), route.num_send)
        if not self.comm:
            return
        flight = start_dispatch(st.rows.detach(), route, self.ep_group, self.stream, self.a2a_wait)
        if self.eager_comm:
            flight.result()
        micro.pending[("F", layer)] = Lazy(lambda: expert_major(flight.result(), route.plan))

    def _f_shared(self, micro: _Micro, layer: int, mb: int) -> None:
        st = micro.states[layer]
        tok_s = self._edge(micro, st.tok_s, self._r(micro, layer, "router"), self._r(micro, layer, "shared"))
        st.shared = self._layers[layer].shared(replace(st.route, tokens=tok_s))

    def _f_expert(self, micro: _Micro, layer: int, mb: int) -> None:
        st, r = micro.states[layer], self._r(micro, layer, "expert")
        if self.comm:
            x = lt.leaf(micro.pending.pop(("F", layer)).get())
        else:
            x = self._edge(micro, st.rows, self._r(micro, layer, "router"), r)
        est = micro.experts[layer] = lt.ExpertState()
        est.x = x
        est.y = lt.expert_rows(self._layers[layer].moe.experts, x, micro.routes[layer].counts)

    def _f_combine(self, micro: _Micro, layer: int, mb: int) -> None:
        """Issues the combine (under EP); the layer output is formed by its first user, so a
        shared expert that a pair order runs after combine is still in it."""
        st, module, est = micro.states[layer], self._layers[layer], micro.experts[layer]
        r, r_router = self._r(micro, layer, "combine"), self._r(micro, layer, "router")
        has_shared = module.moe.shared_expert is not None
        top = r if not has_shared else min(r, self._r(micro, layer, "shared"))
        if self.comm:
            flight = start_combine(est.y.detach(), micro.routes[layer], self.ep_group, self.stream, self.a2a_wait)
            if self.eager_comm:
                flight.result()
        else:
            flight = None

        def land() -> torch.Tensor:
            if flight is None:
                y_back = self._edge(micro, est.y, self._r(micro, layer, "expert"), r)
            else:
                y_back = st.y_back = lt.leaf(flight.result())
            gates = self._edge(micro, st.gates, r_router, r)
            aux = self._edge(micro, st.aux, r_router, r, _LEAF_OPT)
            residual = self._edge(micro, st.h, micro.h_run[layer], r)
            route = replace(st.route, tokens=st.route.tokens.detach(), residual=residual, gates=gates,
                            aux_loss=aux)
            shared = st.shared
            out = module.moe.combine_rows(y_back, route, None if shared is None else shared.detach())
            if shared is None:
                return out
            return lt.tap_shared(self._edge(micro, out, r, top),
                                 self._edge(micro, shared, self._r(micro, layer, "shared"), top))

        self._set_out(micro, layer, Lazy(land, flight), top)

    def _f_mlp(self, micro: _Micro, layer: int, mb: int) -> None:
        st = self._state(micro, layer)
        r = self._r(micro, layer, "mlp")
        st.out = self._layers[layer].mlp(self._edge(micro, st.h, micro.h_run[layer], r))
        self._set_out(micro, layer, st.out, r)

    def _f_head(self, micro: _Micro, layer: int, mb: int) -> None:
        if micro.labels is None:
            raise RuntimeError("the head chunk needs labels")
        r = self._r(micro, layer, "head")
        x, owner = self._input(micro, layer) if self._last is None else (
            _get(micro.outs[self._last]), micro.out_run[self._last])
        micro.loss = self.module.head(self._edge(micro, x, owner, r), micro.labels)
        micro.roots[r].append((micro.loss, None, _GIVEN))
        self._losses[mb] = micro.loss.detach()

    # --- backward post-actions under EP (after the task's segment ran) ---------------------------
    def _b_combine(self, micro: _Micro, layer: int) -> None:
        """Issue the combine gradient's all-to-all; the expert segment waits for it."""
        route, st = micro.routes[layer], micro.states[layer]
        g = st.y_back.grad
        flight = start_combine_grad(torch.zeros_like(st.y_back) if g is None else g, route, self.ep_group, self.stream,
                                    self.a2a_wait)
        if self.eager_comm:
            flight.result()
        micro.roots[self._r(micro, layer, "expert")].append(
            (micro.experts[layer].y, Lazy(lambda: expert_major(flight.result(), route.plan)), _LAZY))
        st.y_back = None

    def _b_dispatch(self, micro: _Micro, layer: int) -> None:
        """Issue the expert-input gradient's all-to-all back to the rows' sources; the router
        segment waits for it."""
        est, st = micro.experts.pop(layer), micro.states[layer]
        g = est.x.grad if est.x.grad is not None else torch.zeros_like(est.x)
        flight = start_combine(g, micro.routes.pop(layer), self.ep_group, self.stream, self.a2a_wait)
        if self.eager_comm:
            flight.result()
        micro.roots[self._r(micro, layer, "router")].append((st.rows, Lazy(flight.result), _LAZY))
