"""Analytic roofline cost source: ModelSpec + HardwareSpec + ParallelShape -> ModelCosts.

Per task (one microbatch, one GPU): compute time is the sum over its operators
(:mod:`tessera.cost.flops`) of ``max(flops / (peak * mfu_efficiency), bytes / mem_bw)`` (roofline:
GEMMs are compute-bound, norms/router softmax/conv/scans memory-bound-ish); A2A and P2P times come
from :mod:`tessera.cost.comm`; memory from :mod:`tessera.cost.memory`. Formulas and their sources
are listed in ``docs/cost-model.md``.

Task DAG per layer (indices into ``LayerCost.tasks``; the convention of :mod:`tessera.cost.types`):

* F: ``mixer -> router -> dispatch -> expert -> combine``, ``shared`` after ``router``;
  dense: ``mixer -> mlp``; single-block layers keep only their half.
* B: ``combine -> expert -> dispatch -> router -> mixer``; ``shared`` depends on nothing inside
  the layer (it starts from the layer's output gradient, like ``combine``) and ``router`` waits for
  both ``dispatch`` and ``shared`` (the exact mirror of F, where ``shared`` follows ``router``: the
  pre-MLP norm backward in ``router`` sums both gradient paths). Dense: ``mlp -> mixer``.
* W: one task per kind with weights (mixer, router, expert, shared, mlp), each depending on the
  B task of the same kind.
* Embedding (index -1): F gather, B gradient hand-off, W scatter-add into the embedding grad.
  Head (index L): F/B/W of final norm + output GEMM + cross-entropy (+ MTP modules, whose A2As,
  if any, are added to the head's F and B compute time: approximate).

With ``activation_recompute`` each B task also re-runs its F counterpart (compute and A2A time;
FLOPs stay model FLOPs, as MFU excludes recomputation) and only layer inputs are stored.
"""

from __future__ import annotations

import math

from tessera.cost.comm import a2a_bytes, a2a_ms, p2p_ms, tp_collective_ms
from tessera.cost.flops import BF16, OpCost, embed_ops, head_ops, layer_ops
from tessera.cost.memory import (ParamSplit, head_activation, head_params, layer_activation, layer_params,
                                 static_bytes)
from tessera.cost.types import LayerCost, LayerMemory, ModelCosts, ParallelShape, Phase, Resource, TaskCost, TaskKind
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import LayerSpec, ModelSpec, MoESpec

_F, _B, _W = 0, 1, 2
_WEIGHTED = (TaskKind.MIXER, TaskKind.ROUTER, TaskKind.EXPERT, TaskKind.SHARED, TaskKind.MLP)


def ops_ms(ops: tuple[OpCost, ...], phase: int, hw: HardwareSpec) -> float:
    """Roofline time of ``ops`` in phase 0/1/2 (F/B/W), ms: per operator
    ``max(flops / (peak_tflops*1e12*mfu_efficiency), bytes / (mem_bw_tbs*1e12))``, summed."""
    rate = hw.peak_tflops * 1e12 * hw.mfu_efficiency
    bw = hw.mem_bw_tbs * 1e12
    return sum(max(o.flops[phase] / rate, o.bytes[phase] / bw) for o in ops) * 1e3


def _flops(ops: tuple[OpCost, ...], phase: int) -> float:
    return sum(o.flops[phase] for o in ops)


def _check(model: ModelSpec, hw: HardwareSpec, p: ParallelShape) -> None:
    for name in ("pp", "vpp", "ep", "tp", "dp", "micro_batch_size", "seq_length"):
        if getattr(p, name) < 1:
            raise TesseraConfigError(f"parallel.{name}", getattr(p, name), "must be >= 1", "use a positive integer")
    moe = model.moe
    if moe is not None and moe.num_experts % p.ep:
        raise TesseraConfigError("parallel.ep", p.ep, f"must divide num_experts={moe.num_experts}",
                                 "use a divisor of the expert count")
    if p.ep > 1 and p.ep > p.dp * p.tp:
        raise TesseraConfigError("parallel.ep", p.ep, f"must be <= dp*tp={p.dp * p.tp} (EP is carved from dp*tp)",
                                 "raise dp or lower ep")
    if hw.peak_tflops <= 0 or hw.mem_bw_tbs <= 0 or hw.inter_node_gbs <= 0 or hw.intra_node_gbs <= 0:
        raise TesseraConfigError("hardware", hw.name, "peak_tflops, mem_bw_tbs and link bandwidths must be > 0",
                                 "fix the hardware preset or inline fields")


def _memory(params: ParamSplit, act_stored: float, act_w: float, p: ParallelShape) -> LayerMemory:
    prm, grd, opt = static_bytes(params, tp=p.tp, ep=p.ep, dp=p.dp)
    return LayerMemory(prm, grd, opt, act_stored, act_w)


def layer_cost(layer: LayerSpec, model: ModelSpec, hw: HardwareSpec, p: ParallelShape,
               recompute: bool = False) -> LayerCost:
    """Tasks (F, B, W) and memory of one decoder layer on its rank (see module docstring)."""
    tokens = p.micro_batch_size * p.seq_length
    ops = layer_ops(layer, model.hidden, tokens, p.seq_length, p.tp, p.ep)
    coll = 2 * tp_collective_ms(BF16 * tokens * model.hidden, p.tp, hw)  # SP all-gather + reduce-scatter
    C, E = Resource.COMPUTE, Resource.EP_COMM
    a2a = 0.0
    a2a_b = 0.0
    if isinstance(layer.mlp, MoESpec):
        moe = layer.mlp
        width = moe.latent_dim if moe.latent_dim > 0 else model.hidden
        a2a_b = a2a_bytes(tokens / p.tp, moe.top_k, width)
        a2a = a2a_ms(a2a_b, p.ep, hw)

    def comp(kind: TaskKind, phase: Phase, ph: int, deps: tuple[int, ...]) -> TaskCost:
        extra = coll if kind in (TaskKind.MIXER, TaskKind.MLP, TaskKind.SHARED) and ph != _W else 0.0
        ms = ops_ms(ops[kind], ph, hw) + extra
        if recompute and ph == _B:
            ms += ops_ms(ops[kind], _F, hw) + extra
        return TaskCost(kind, phase, C, ms, _flops(ops[kind], ph), 0.0, deps)

    def comm(kind: TaskKind, phase: Phase, deps: tuple[int, ...]) -> TaskCost:
        ms = a2a * (2 if recompute and phase == Phase.B else 1)
        return TaskCost(kind, phase, E, ms, 0.0, a2a_b if p.ep > 1 else 0.0, deps)

    tasks: list[TaskCost] = []
    idx: dict[tuple[Phase, TaskKind], int] = {}

    def add(t: TaskCost) -> int:
        idx[(t.phase, t.kind)] = len(tasks)
        tasks.append(t)
        return len(tasks) - 1

    # F
    prev: tuple[int, ...] = ()
    if TaskKind.MIXER in ops:
        prev = (add(comp(TaskKind.MIXER, Phase.F, _F, ())),)
    if isinstance(layer.mlp, MoESpec):
        r = add(comp(TaskKind.ROUTER, Phase.F, _F, prev))
        d = add(comm(TaskKind.DISPATCH, Phase.F, (r,)))
        e = add(comp(TaskKind.EXPERT, Phase.F, _F, (d,)))
        add(comm(TaskKind.COMBINE, Phase.F, (e,)))
        if TaskKind.SHARED in ops:
            add(comp(TaskKind.SHARED, Phase.F, _F, (r,)))
    elif TaskKind.MLP in ops:
        add(comp(TaskKind.MLP, Phase.F, _F, prev))
    # B
    prev = ()
    if isinstance(layer.mlp, MoESpec):
        c = add(comm(TaskKind.COMBINE, Phase.B, ()))
        e = add(comp(TaskKind.EXPERT, Phase.B, _B, (c,)))
        d = add(comm(TaskKind.DISPATCH, Phase.B, (e,)))
        rdeps = (d,)
        if TaskKind.SHARED in ops:
            rdeps = (d, add(comp(TaskKind.SHARED, Phase.B, _B, ())))
        prev = (add(comp(TaskKind.ROUTER, Phase.B, _B, rdeps)),)
    elif TaskKind.MLP in ops:
        prev = (add(comp(TaskKind.MLP, Phase.B, _B, ())),)
    if TaskKind.MIXER in ops:
        add(comp(TaskKind.MIXER, Phase.B, _B, prev))
    # W
    for kind in _WEIGHTED:
        if kind in ops:
            add(comp(kind, Phase.W, _W, (idx[(Phase.B, kind)],)))

    act = layer_activation(layer, model.hidden, tokens, tp=p.tp, recompute=recompute)
    mem = _memory(layer_params(layer, model.hidden), act.stored, act.gemm_inputs, p)
    return LayerCost(layer.index, layer.code, tuple(tasks), mem)


def _three(kind: TaskKind, ops: tuple[OpCost, ...], hw: HardwareSpec, extra_fb: float = 0.0,
           recompute: bool = False) -> tuple[TaskCost, ...]:
    """F, B and W tasks of one single-kind block (embedding or head); W depends on B (index 1)."""
    C = Resource.COMPUTE
    f = ops_ms(ops, _F, hw) + extra_fb
    b = ops_ms(ops, _B, hw) + extra_fb + (f if recompute else 0.0)
    return (TaskCost(kind, Phase.F, C, f, _flops(ops, _F)),
            TaskCost(kind, Phase.B, C, b, _flops(ops, _B)),
            TaskCost(kind, Phase.W, C, ops_ms(ops, _W, hw), _flops(ops, _W), deps=(1,)))


def analytic_costs(model: ModelSpec, hw: HardwareSpec, parallel: ParallelShape, *,
                   activation_recompute: bool = False) -> ModelCosts:
    """Analytic (roofline) costs of ``model`` on ``hw`` under ``parallel``, one microbatch of
    ``micro_batch_size * seq_length`` tokens per GPU.

    Returns ModelCosts with ms durations, FLOPs, A2A bytes, per-layer memory in bytes,
    ``p2p_ms`` (BF16 activation ``tokens*hidden*2/tp`` bytes over the inter-node link + latency),
    ``overlap_slowdown = hw.overlap_slowdown``, ``peak_flops = peak_tflops*1e12`` FLOP/s and
    ``device_mem_bytes = mem_gb*1e9``. Raises TesseraConfigError on an impossible layout."""
    p = parallel
    _check(model, hw, p)
    tokens = p.micro_batch_size * p.seq_length
    layers = tuple(layer_cost(l, model, hw, p, activation_recompute) for l in model.layers)

    emb_ops = embed_ops(model, tokens, p.tp)
    emb_tasks = _three(TaskKind.EMBED, emb_ops, hw, recompute=False)
    ids = 8.0 * tokens  # int64 token ids kept for the scatter-add
    emb_mem = _memory(ParamSplit(float(model.vocab * model.hidden)), ids, ids, p)
    embed = LayerCost(-1, "emb", emb_tasks, emb_mem)

    mtp_a2a = 0.0
    last = model.layers[-1] if model.layers else None
    if model.mtp_layers and last is not None and isinstance(last.mlp, MoESpec):
        width = last.mlp.latent_dim if last.mlp.latent_dim > 0 else model.hidden
        mtp_a2a = 2 * model.mtp_layers * a2a_ms(a2a_bytes(tokens / p.tp, last.mlp.top_k, width), p.ep, hw)
    h_ops = head_ops(model, tokens, p.seq_length, p.tp, p.ep)
    head_tasks = _three(TaskKind.HEAD, h_ops, hw, extra_fb=mtp_a2a, recompute=activation_recompute)
    h_act = head_activation(model, tokens, tp=p.tp, recompute=activation_recompute)
    head_mem = _memory(head_params(model, p.pp), h_act.stored, h_act.gemm_inputs, p)
    head = LayerCost(model.num_layers, "head", head_tasks, head_mem)

    act_bytes = BF16 * tokens * model.hidden / p.tp
    costs = ModelCosts("analytic", layers, embed, head, p2p_ms(act_bytes, hw), act_bytes, hw.overlap_slowdown,
                       hw.peak_tflops * 1e12, hw.mem_gb * 1e9, tokens)
    for lc in (embed, head) + layers:
        for t in lc.tasks:
            if not math.isfinite(t.ms) or t.ms < 0:
                raise ValueError(f"layer {lc.index} task {t.kind.value}/{t.phase.value}: bad duration {t.ms}")
    return costs
