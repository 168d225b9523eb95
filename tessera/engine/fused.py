"""A microbatch's whole forward, or whole backward, on one chunk as one engine step.

A lone ``F`` instruction runs its chunk's forward tasks back to back; when the microbatch's
backward is one autograd segment (:class:`~tessera.engine.segments.BackwardRuns` with one run:
no other microbatch's task interleaved into it, no all-to-all inside it, i.e. ``ep = 1`` or no
MoE exchange on the chunk) and the chunk is not profiling per task, no task boundary of that
forward cuts anything: every task feeds the next in one graph. :func:`forward` then runs the
layers directly, with the operations of :class:`~tessera.engine.tasks.TorchChunk`'s forward
tasks in their lone order (mixer, router and its identity nodes, dispatch's row gather and
route plan, shared expert, experts, combine; the head), so the autograd graph is the task
path's node for node, created in the same order, and the gradients are bitwise those of the
task path (``tests/test_engine_fused.py``). What it leaves out is the per-task bookkeeping: an
engine step, a dict entry per output, a context per task and a ``replace`` of the route per use
(``task_overhead_us(2, 64, 100)`` of ``benchmarks/vs_torch_pp.py``, 100 rounds on this host's CPU:
39 us per task step over plain autograd fused, 53 task by task). :func:`backward`
is the lone ``B`` instruction of such a microbatch: its one backward call and the input
gradient, without a step per B task.

Both take the chunk (a :class:`~tessera.engine.tasks.TorchChunk`) and its microbatch state; the
chunk decides when they apply (:meth:`~tessera.engine.tasks.TorchChunk.fuses`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from tessera.model import tasks as lt
from tessera.model.ep import plan_route
from tessera.model.wgrad import forward_mode
from tessera.engine.segments import GIVEN

RUN = 0  # the one run (autograd segment) of a fused microbatch


def forward(chunk, micro, mb: int) -> None:
    """Run every forward task of ``mb`` on ``chunk`` as one graph; leaves in ``micro`` what the
    backward and the chunk's outputs read: the output (``outs[last]``, run 0), the input leaf
    (no embedding), the loss root (head) and the detached loss in ``chunk``'s losses."""
    module = chunk.module
    lins = chunk.all_linears if micro.mode is not None else ()
    with chunk._amp(), (forward_mode(lins, micro.mode) if lins else contextlib.nullcontext()):
        if module.has_embed:
            x = module.embed(micro.source.get())
            micro.outs[-1], micro.out_run[-1] = x, RUN
        else:
            x = micro.in_leaf = lt.leaf(micro.source.get())
        for layer in module.layers:
            x = _layer(chunk, layer, x, mb)
            micro.outs[layer.index], micro.out_run[layer.index] = x, RUN
        if module.has_head:
            if micro.labels is None:
                raise RuntimeError("the head chunk needs labels")
            micro.loss = module.head(x, micro.labels)
            micro.roots[RUN].append((micro.loss, None, GIVEN))
            chunk._losses[mb] = micro.loss.detach()


def _layer(chunk, layer, x, mb: int):
    """One decoder layer as its tasks run in one segment (tessera.engine.tasks: ``_f_*``)."""
    h = layer.mixer(x) if layer.attn is not None else x
    moe = layer.moe
    if moe is None:
        return layer.mlp(h) if layer.mlp_module is not None else h
    shared = moe.shared_expert is not None
    route = layer.router(lt.enter(h))
    tok_d, tok_s, gates, aux = lt.exit_router(route, shared)
    chunk.on_route(mb, layer.index, route.requested)
    plan = plan_route(route.counts, route.capacity, chunk.ep_group, chunk.counts_group, chunk.host_syncs)
    rows = moe.gather_rows(replace(route, tokens=tok_d), plan.num_send)
    s = layer.shared(replace(route, tokens=tok_s)) if shared else None
    y = lt.expert_rows(moe.experts, rows, plan.counts)
    route = replace(route, tokens=route.tokens.detach(), residual=h, gates=gates, aux_loss=aux)
    out = moe.combine_rows(y, route, None if s is None else s.detach())
    return out if s is None else lt.tap_shared(out, s)


def backward(chunk, micro, mb: int) -> None:
    """Run ``mb``'s one-segment backward (every B task) and keep its input gradient."""
    micro.done = RUN
    chunk._backward_run(micro, mb, RUN)
    chunk._finish_backward(mb)
