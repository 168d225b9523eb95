"""Analytic roofline cost source: ModelSpec + HardwareSpec + ParallelShape -> ModelCosts.

Per task (one microbatch, one GPU): compute time is the sum over its operators
(:mod:`tessera.cost.flops`) of ``max(flops / (peak * mfu_efficiency), bytes / mem_bw)`` (roofline:
GEMMs are compute-bound, norms/router softmax/conv/scans memory-bound-ish); A2A and P2P times come
from :mod:`tessera.cost.comm`; memory from :mod:`tessera.cost.memory`. Formulas and their sources
are listed in ``docs/cost-model.md``.

Tasks per layer: exactly the task split of the layer spec, :func:`tessera.spec.tasks.layer_shapes`
(kinds, phases, resources, deps; embedding and head: :func:`tessera.spec.tasks.block_shapes`);
this module only attaches durations, FLOPs, bytes and memory to them. The embedding's F is the
gather, B the gradient hand-off, W the scatter-add into the embedding grad; the head's F/B/W are
those of final norm + output GEMM + cross-entropy (+ MTP modules, whose A2As, if any, are added to
the head's F and B compute time: approximate).

With ``activation_recompute`` each B task also re-runs its F counterpart (compute and A2A time;
FLOPs stay model FLOPs, as MFU excludes recomputation) and only layer inputs are stored.
"""

from __future__ import annotations

import math

from tessera.cost.comm import a2a_bytes, a2a_ms, p2p_ms, tp_collective_ms
from tessera.cost.flops import BF16, OpCost, embed_ops, head_ops, layer_ops
from tessera.cost.memory import (ParamSplit, head_activation, head_params, layer_activation, layer_params,
                                 static_bytes)
from tessera.cost.types import CostOptions, LayerCost, LayerMemory, ModelCosts, ParallelShape, TaskCost
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import LayerSpec, ModelSpec, MoESpec
from tessera.spec.tasks import Phase, Resource, TaskKind, TaskShape, block_shapes, layer_shapes

_F, _B, _W = 0, 1, 2
_PHASE = {Phase.F: _F, Phase.B: _B, Phase.W: _W}  # the index of a phase in OpCost.flops / .bytes


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
    a2a = 0.0
    a2a_b = 0.0
    if isinstance(layer.mlp, MoESpec):
        moe = layer.mlp
        width = moe.latent_dim if moe.latent_dim > 0 else model.hidden
        a2a_b = a2a_bytes(tokens / p.tp, moe.top_k, width)
        a2a = a2a_ms(a2a_b, p.ep, hw)

    def cost(s: TaskShape) -> TaskCost:
        if s.resource == Resource.EP_COMM:  # dispatch / combine: one A2A (B re-runs F's under recompute)
            ms = a2a * (2 if recompute and s.phase == Phase.B else 1)
            return TaskCost(s.kind, s.phase, s.resource, ms, 0.0, a2a_b if p.ep > 1 else 0.0, s.deps)
        ph = _PHASE[s.phase]
        kind_ops = ops[s.kind]
        extra = coll if s.kind in (TaskKind.MIXER, TaskKind.MLP, TaskKind.SHARED) and ph != _W else 0.0
        ms = ops_ms(kind_ops, ph, hw) + extra
        if recompute and ph == _B:
            ms += ops_ms(kind_ops, _F, hw) + extra
        return TaskCost(s.kind, s.phase, s.resource, ms, _flops(kind_ops, ph), 0.0, s.deps)

    tasks = tuple(cost(s) for s in layer_shapes(layer))
    act = layer_activation(layer, model.hidden, tokens, tp=p.tp, recompute=recompute)
    mem = _memory(layer_params(layer, model.hidden), act.stored, act.gemm_inputs, p)
    return LayerCost(layer.index, layer.code, tasks, mem)


def _block(kind: TaskKind, ops: tuple[OpCost, ...], hw: HardwareSpec, extra_fb: float = 0.0,
           recompute: bool = False) -> tuple[TaskCost, ...]:
    """The tasks of one single-kind block (embedding or head, :func:`tessera.spec.tasks.block_shapes`)
    with their durations and FLOPs."""
    f = ops_ms(ops, _F, hw) + extra_fb
    b = ops_ms(ops, _B, hw) + extra_fb + (f if recompute else 0.0)
    ms = {Phase.F: f, Phase.B: b, Phase.W: ops_ms(ops, _W, hw)}
    return tuple(TaskCost(s.kind, s.phase, s.resource, ms[s.phase], _flops(ops, _PHASE[s.phase]), deps=s.deps)
                 for s in block_shapes(kind))


def analytic_costs(model: ModelSpec, hw: HardwareSpec, parallel: ParallelShape, *,
                   activation_recompute: bool = False, options: CostOptions | None = None) -> ModelCosts:
    """Analytic (roofline) costs of ``model`` on ``hw`` under ``parallel``, one microbatch of
    ``micro_batch_size * seq_length`` tokens per GPU.

    ``options`` (:class:`~tessera.cost.types.CostOptions`): recompute mode and modules, MoE
    dispatcher, data-parallel sharding, precision; ``None``: the defaults with
    ``recompute="full"`` when ``activation_recompute`` (the older spelling) is true.

    Returns ModelCosts with ms durations, FLOPs, A2A bytes, per-layer memory in bytes,
    ``p2p_ms`` (BF16 activation ``tokens*hidden*2/tp`` bytes over the inter-node link + latency),
    ``overlap_slowdown = hw.overlap_slowdown``, ``peak_flops = peak_tflops*1e12`` FLOP/s and
    ``device_mem_bytes = mem_gb*1e9``. Raises TesseraConfigError on an impossible layout."""
    p = parallel
    if options is None:
        options = CostOptions(recompute="full" if activation_recompute else "none")
    elif activation_recompute and options.recompute != "full":
        raise ValueError(f"analytic_costs: activation_recompute=True contradicts options.recompute="
                         f"{options.recompute!r}; give the mode in options only")
    activation_recompute = options.recompute == "full"
    _check(model, hw, p)
    tokens = p.micro_batch_size * p.seq_length
    layers = tuple(layer_cost(l, model, hw, p, activation_recompute) for l in model.layers)

    emb_ops = embed_ops(model, tokens, p.tp)
    emb_tasks = _block(TaskKind.EMBED, emb_ops, hw, recompute=False)
    ids = 8.0 * tokens  # int64 token ids kept for the scatter-add
    emb_mem = _memory(ParamSplit(float(model.vocab * model.hidden)), ids, ids, p)
    embed = LayerCost(-1, "emb", emb_tasks, emb_mem)

    mtp_a2a = 0.0
    last = model.layers[-1] if model.layers else None
    if model.mtp_layers and last is not None and isinstance(last.mlp, MoESpec):
        width = last.mlp.latent_dim if last.mlp.latent_dim > 0 else model.hidden
        mtp_a2a = 2 * model.mtp_layers * a2a_ms(a2a_bytes(tokens / p.tp, last.mlp.top_k, width), p.ep, hw)
    h_ops = head_ops(model, tokens, p.seq_length, p.tp, p.ep)
    head_tasks = _block(TaskKind.HEAD, h_ops, hw, extra_fb=mtp_a2a, recompute=activation_recompute)
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
