"""The tasks of one layer with detached boundaries: forward pieces and their backward.

Every task's tensor inputs are detached leaves that require grad; its backward is
``torch.autograd.backward(outputs, grads)`` followed by reading the leaves' ``.grad``. So a task
runs its own small autograd graph and gradients cross task boundaries explicitly. Where a tensor
feeds two tasks, each gets its own leaf and the gradients are added in a fixed order:

* the normalised tokens feed dispatch and the shared expert: ``g_tokens = g_dispatch + g_shared``;
* the post-mixer residual ``h`` feeds the router and the output: ``g_h = g_router + g_out``
  (the gradient of the residual and of the shared-expert output is ``g_out`` itself, because
  ``out = residual + (moe + shared)``; the combine backward therefore only differentiates the
  expert rows, the gates and the aux loss).

MoE layer tasks (forward order of :func:`forward_kinds`): ``mixer`` (x -> h), ``router``
(h -> RouteInfo), ``dispatch`` (gather rows; the all-to-all is the caller's), ``shared``,
``expert`` (rows -> expert outputs, expert-major), ``combine`` (rows back -> layer output).
Dense layers: ``mixer``, ``mlp``. The embedding and head are tasks ``embed`` / ``head`` of the
extended layers ``-1`` / ``L``. The engine (:mod:`tessera.engine.tasks`) and the single-process
reference (:mod:`tessera.testing.reference`) both call these functions, so their arithmetic is
identical by construction; they differ only in orchestration and in how rows move.

Weight gradients: a caller that wants W deferred wraps a backward in
``DeferredWGrad.capture((mb, layer), module)``; W is then ``store.run((mb, layer), kind)``.
Tensor shapes: ``x``, ``h``, outputs ``[B, S, H]``; tokens ``[T = B*S, H]``; rows ``[N, H]``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from tessera.model.layers import DecoderLayer
from tessera.model.moe import expert_rows as moe_expert_rows


COMM_KINDS = frozenset({"dispatch", "combine"})


def forward_kinds(layer: DecoderLayer) -> tuple[str, ...]:
    """Forward tasks of ``layer`` in the engine's order for a lone forward."""
    mixer = ("mixer",) if layer.attn is not None else ()
    if layer.moe is not None:
        shared = ("shared",) if layer.moe.shared_expert is not None else ()
        return (*mixer, "router", "dispatch", *shared, "expert", "combine")
    return (*mixer, "mlp") if layer.mlp_module is not None else mixer


def backward_kinds(layer: DecoderLayer) -> tuple[str, ...]:
    """Backward (input-gradient) tasks of ``layer`` in the engine's order for a lone backward."""
    mixer = ("mixer",) if layer.attn is not None else ()
    if layer.moe is not None:
        shared = ("shared",) if layer.moe.shared_expert is not None else ()
        return ("combine", *shared, "expert", "dispatch", "router", *mixer)
    return ("mlp", *mixer) if layer.mlp_module is not None else mixer


def weight_kinds(layer: DecoderLayer) -> tuple[str, ...]:
    """Kinds of ``layer`` with weights (one W task each)."""
    return tuple(k for k in backward_kinds(layer) if k not in COMM_KINDS)[::-1]


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached leaf sharing ``t``'s storage that requires grad (a task boundary)."""
    return t.detach().requires_grad_(True)


class LayerState:
    """Scratch tensors of one layer for one microbatch (mutable; owned by one runner)."""

    __slots__ = ("x", "h", "h_in", "route", "tok_d", "rows", "tok_s", "shared", "y_back", "gates", "aux", "out",
                 "g_gates", "g_aux", "g_tok_d", "g_tok_s", "g_h")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, None)


class ExpertState:
    """Expert inputs ``x`` (leaf, expert-major) and outputs ``y`` of one layer and microbatch."""

    __slots__ = ("x", "y", "g_x")

    def __init__(self) -> None:
        self.x = self.y = self.g_x = None


# --- forward ---------------------------------------------------------------------------------
def f_mixer(layer: DecoderLayer, st: LayerState, x: torch.Tensor) -> None:
    """``h = x + mixer(norm(x))``; without a mixer ``h = x`` (no task)."""
    if layer.attn is None:
        st.h = x
        return
    st.x = leaf(x)
    st.h = layer.mixer(st.x)


def f_router(layer: DecoderLayer, st: LayerState) -> None:
    st.h_in = leaf(st.h)
    st.route = layer.router(st.h_in)


def f_gather(layer: DecoderLayer, st: LayerState) -> torch.Tensor:
    """Rows to dispatch ``[N_send, H]`` (send order); returns them detached for the exchange.
    Reads the kept routes' count ``N_send`` on the host (a synchronisation on a GPU: this is the
    single-process reference's path, not the engine's)."""
    st.tok_d = leaf(st.route.tokens)
    st.rows = layer.moe.gather_rows(replace(st.route, tokens=st.tok_d), int(st.route.counts.sum()))
    return st.rows.detach()


def f_shared(layer: DecoderLayer, st: LayerState) -> None:
    st.tok_s = leaf(st.route.tokens)
    st.shared = layer.shared(replace(st.route, tokens=st.tok_s))


def f_expert(experts: Sequence[torch.nn.Module], est: ExpertState, x: torch.Tensor,
             counts: Sequence[int]) -> torch.Tensor:
    """``experts`` (a rank's local experts, in order) on expert-major rows ``x [N, H]``
    (``counts[e]`` rows for expert ``e``); returns the outputs ``[N, H]`` detached.

    Same ops as :meth:`MoEBlock.run_experts` (split, each expert, cat; experts without rows run
    on ``[0, H]`` so their gradients are zeros); taking the experts as a sequence lets the
    single-process reference run the experts of each EP owner on that owner's own buffer, so
    every expert GEMM sees the same operands at the same offsets as under EP.
    """
    est.x = leaf(x)
    est.y = expert_rows(experts, est.x, counts)
    return est.y.detach()


def expert_rows(experts: Sequence[torch.nn.Module], x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The ops of :func:`f_expert` on ``x [N, H]`` as given (no boundary): split by ``counts``,
    each expert, cat; returns ``[N, H]`` with its graph (one recompute region when ``experts`` is
    an :class:`~tessera.model.moe.ExpertList` with ``recompute``)."""
    return moe_expert_rows(experts, x, counts)


def f_combine(layer: DecoderLayer, st: LayerState, y_back: torch.Tensor) -> torch.Tensor:
    """Layer output ``[B, S, H]`` from the expert outputs back in send order ``y_back``."""
    st.y_back, st.gates, st.aux = leaf(y_back), leaf(st.route.gates), leaf(st.route.aux_loss)
    route = replace(st.route, tokens=st.route.tokens.detach(), residual=st.h_in.detach(), gates=st.gates,
                    aux_loss=st.aux)
    st.out = layer.moe.combine_rows(st.y_back, route, None if st.shared is None else st.shared.detach())
    return st.out


def f_mlp(layer: DecoderLayer, st: LayerState) -> None:
    st.h_in = leaf(st.h)
    st.out = layer.mlp(st.h_in)


def layer_output(st: LayerState) -> torch.Tensor:
    """The layer's output tensor (with its task graph)."""
    return st.h if st.out is None else st.out


# --- backward --------------------------------------------------------------------------------
def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if t.grad is None else t.grad


def b_combine(st: LayerState, g_out: torch.Tensor) -> torch.Tensor:
    """Backward of combine: returns the gradient of the returned rows ``[N_send, H]``; keeps the
    gates' and aux loss's gradients for the router."""
    torch.autograd.backward(st.out, g_out)
    st.g_gates, st.g_aux = st.gates.grad, st.aux.grad
    g = _grad_or_zeros(st.y_back)
    st.out = st.y_back = None
    return g


def b_expert(est: ExpertState, g_y: torch.Tensor) -> torch.Tensor:
    """Backward of the experts: gradient of their (expert-major) input rows."""
    torch.autograd.backward(est.y, g_y)
    est.g_x = _grad_or_zeros(est.x)
    est.x = est.y = None
    return est.g_x


def b_gather(st: LayerState, g_rows: torch.Tensor) -> None:
    torch.autograd.backward(st.rows, g_rows)
    st.g_tok_d = _grad_or_zeros(st.tok_d)
    st.rows = st.tok_d = None


def b_shared(layer: DecoderLayer, st: LayerState, g_out: torch.Tensor) -> None:
    torch.autograd.backward(st.shared, g_out.reshape(-1, layer.hidden))
    st.g_tok_s = _grad_or_zeros(st.tok_s)
    st.shared = st.tok_s = None


def b_router(st: LayerState, g_out: torch.Tensor) -> torch.Tensor:
    """Backward of the router; returns ``g_h = g_router + g_out`` (also kept in ``st.g_h``)."""
    g_tok = st.g_tok_d if st.g_tok_s is None else st.g_tok_d + st.g_tok_s
    g_gates = torch.zeros_like(st.route.gates) if st.g_gates is None else st.g_gates
    outs, grads = [st.route.tokens, st.route.gates], [g_tok, g_gates]
    if st.g_aux is not None:
        outs.append(st.route.aux_loss)
        grads.append(st.g_aux)
    torch.autograd.backward(outs, grads)
    st.g_h = _grad_or_zeros(st.h_in) + g_out
    st.route = st.h_in = None
    return st.g_h


def b_mlp(st: LayerState, g_out: torch.Tensor) -> torch.Tensor:
    torch.autograd.backward(st.out, g_out)
    st.g_h = _grad_or_zeros(st.h_in)
    st.out = st.h_in = None
    return st.g_h


def b_mixer(st: LayerState, g_h: torch.Tensor) -> torch.Tensor:
    """Backward of the mixer; returns the gradient of the layer input."""
    torch.autograd.backward(st.h, g_h)
    g = _grad_or_zeros(st.x)
    st.h = st.x = None
    return g


# --- embedding and head ----------------------------------------------------------------------
class HeadState:
    """Head input leaf ``x [B, S, H]`` and the microbatch's scalar ``loss``."""

    __slots__ = ("x", "loss")

    def __init__(self) -> None:
        self.x = self.loss = None


def f_head(head, hs: HeadState, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Final norm, output projection and mean cross-entropy over ``labels [B, S]``."""
    hs.x = leaf(x)
    hs.loss = head(hs.x, labels)
    return hs.loss


def b_head(hs: HeadState) -> torch.Tensor:
    """Backward of the loss with seed 1 (scaling happens once, at gradient reduction)."""
    torch.autograd.backward(hs.loss)
    g = _grad_or_zeros(hs.x)
    hs.x = hs.loss = None
    return g


# --- connected boundaries (one autograd graph over several tasks) -----------------------------
# The engine runs consecutive tasks of one chunk as one autograd segment: the tasks' tensors stay
# connected and one backward call covers the segment. These three identity nodes keep every
# gradient sum of the detached form above, in the same order: a sum of two terms is exact in
# either order, and each node makes one task's gradients arrive together (as one backward call's
# roots would), so the nodes inside a task see the same arrival order as in the detached form.
class _Enter(torch.autograd.Function):
    """Identity; its backward first sums the task's uses of the input (a detached leaf's
    ``.grad``), so the producer then adds it to its other consumers' gradient as one term."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def enter(x: torch.Tensor) -> torch.Tensor:
    """``x`` through an identity node (the connected form of :func:`leaf` for an input with
    other consumers)."""
    return _Enter.apply(x)


class _RouterExit(torch.autograd.Function):
    """Router outputs ``(tokens, gates, aux)`` -> ``(tokens for dispatch, tokens for the shared
    expert or None, gates, aux)``; backward forms :func:`b_router`'s root gradients:
    ``g_tokens = g_dispatch + g_shared`` (zeros for a missing one), zeros for missing gate
    gradients, nothing for a missing aux gradient."""

    @staticmethod
    def forward(ctx, tokens, gates, aux, shared: bool):
        ctx.set_materialize_grads(False)
        ctx.shared = shared
        ctx.save_for_backward(tokens, gates)
        tok_s = tokens.view_as(tokens) if shared else None
        return tokens.view_as(tokens), tok_s, gates.view_as(gates), aux.view_as(aux)

    @staticmethod
    def backward(ctx, g_d, g_s, g_gates, g_aux):
        tokens, gates = ctx.saved_tensors
        g_d = torch.zeros_like(tokens) if g_d is None else g_d
        if ctx.shared:
            g_d = g_d + (torch.zeros_like(tokens) if g_s is None else g_s)
        return g_d, (torch.zeros_like(gates) if g_gates is None else g_gates), g_aux, None


def exit_router(route, shared: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(tok_d [T, H], tok_s [T, H] or None, gates [k, T], aux [])`` of a
    :class:`~tessera.model.moe.RouteInfo` through one node (``tok_s`` None unless ``shared``)."""
    return _RouterExit.apply(route.tokens, route.gates, route.aux_loss, shared)


class _Tap(torch.autograd.Function):
    """Layer output ``out`` (which already includes the detached shared-expert output) -> ``out``;
    backward sends ``g_out`` to ``out`` and ``g_out.reshape(shared.shape)`` to the shared expert,
    as :func:`b_shared` does (the shared backward never waits for combine's)."""

    @staticmethod
    def forward(ctx, out, shared):
        ctx.shape = shared.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g, g.reshape(ctx.shape)


def tap_shared(out: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The layer output with the shared expert's gradient path attached (see :class:`_Tap`)."""
    return _Tap.apply(out, shared)
