"""Analytic roofline cost source: ModelSpec + HardwareSpec + ParallelShape -> ModelCosts.

Per task (one microbatch, one GPU): compute time is the sum over its operators
(:mod:`tessera.cost.flops`) of ``max(flops / (peak * eff), bytes / (mem_bw * mem_bw_efficiency))``
plus ``kernels * kernel_launch_us`` (roofline, :mod:`tessera.cost.efficiency`: GEMMs at a
shape-dependent efficiency and, under ``CostOptions.precision="fp8"``, at the FP8 peak with FP8
inputs; norms/router softmax/permutes/conv/scans memory-bound-ish); A2A, P2P and DP times come
from :mod:`tessera.cost.comm` / :mod:`tessera.cost.dp` on the run's rank placement
(:func:`tessera.spec.placement.placement_of`: which groups' members share a node); memory from
:mod:`tessera.cost.memory`. Formulas and their sources are listed in ``docs/cost-model.md``.

Tasks per layer: exactly the task split of the layer spec, :func:`tessera.spec.tasks.layer_shapes`
(kinds, phases, resources, deps; embedding and head: :func:`tessera.spec.tasks.block_shapes`);
this module only attaches durations, FLOPs, bytes and memory to them. The embedding's F is the
gather, B the gradient hand-off, W the scatter-add into the embedding grad; the head's F/B/W are
those of final norm + output GEMM + cross-entropy (+ MTP modules, whose A2As, if any, are added to
the head's F and B compute time: approximate).

Recompute (``CostOptions.recompute``): each B task also re-runs the forward operators
:func:`tessera.cost.memory.recompute_ops` names (``full``: its whole F counterpart, compute and
A2A time; ``selective``: the recomputed modules' operators), and the memory model drops what they
rebuild; FLOPs stay model FLOPs (MFU excludes recomputation).

Split W: each W task carries ``deferred_ms`` (:func:`deferred_ms`), the host cost of running its
weight-gradient GEMMs deferred rather than inside B (``HardwareSpec.deferred_w_us`` per GEMM);
the simulator charges it only to W instructions (:func:`tessera.sched.chunkdag.chunk_dag` with
``phases="W"``).

Routing imbalance (``CostOptions.moe_load``, :mod:`tessera.cost.routing`): every MoE layer's
expert, dispatch and combine tasks last ``moe_load`` times their balanced time, and its
receive-sized saved tensors are ``moe_load`` times larger (:func:`tessera.cost.memory.layer_tensors`);
1.0 (balanced) leaves every number as it was. The MTP modules' MoE compute, folded into the head,
is not scaled.

Host time (``HardwareSpec.host_kernel_us`` / ``host_gemm_us``, ``CostOptions.cuda_graphs``): each
task also has the time the host takes to issue its kernels from PyTorch eager mode
(:func:`ops_host_ms`: operators outside the captured CUDA graphs, one launch per collective and
per graph replay, the recomputed forward's in B); per layer and phase the tasks last
``max(device, host)`` (:func:`host_bound`), the excess on the compute tasks. Folded into
``TaskCost.ms``, so every consumer of the costs sees it; 0 on the ``cpu`` preset.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tessera.cost.comm import moe_a2a, p2p_ms, tp_collective_ms
from tessera.cost.dp import layer_dp
from tessera.cost.efficiency import captured, op_host_seconds, op_seconds, precision_view
from tessera.cost.flops import BF16, OpCost, embed_ops, head_ops, layer_ops
from tessera.cost.fp8 import FP8Run
from tessera.cost.memory import (ALL_OPS, ParamSplit, fsdp_transient_bytes, head_activation, head_params,
                                 layer_activation, layer_params, recompute_ops, static_bytes)
from tessera.cost.routing import ROUTED_KINDS
from tessera.cost.types import CostOptions, LayerCost, LayerMemory, ModelCosts, ParallelShape, TaskCost
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec
from tessera.spec.model import LayerSpec, Mamba2Spec, ModelSpec, MoESpec
from tessera.spec.placement import placement_of
from tessera.spec.tasks import Phase, Resource, TaskKind, TaskShape, block_shapes, layer_shapes

_F, _B, _W = 0, 1, 2
_PHASE = {Phase.F: _F, Phase.B: _B, Phase.W: _W}  # the index of a phase in OpCost.flops / .bytes


def ops_ms(ops: tuple[OpCost, ...], phase: int, hw: HardwareSpec, precision: str = "bf16",
           run: FP8Run = FP8Run()) -> float:
    """Roofline time of ``ops`` in phase 0/1/2 (F/B/W), ms: per operator
    ``max(flops / (peak * eff), bytes / (mem_bw_tbs*1e12*mem_bw_efficiency)) + kernels*kernel_launch_us``,
    summed (:func:`tessera.cost.efficiency.op_seconds`: GEMMs at their shape-dependent efficiency,
    FP8 GEMMs under ``precision="fp8"``; other compute at ``peak_tflops*mfu_efficiency``; under
    ``precision="fp32"`` all of it at the FP32 peak, :func:`tessera.cost.efficiency.precision_view`);
    ``run``: how FP8 GEMMs quantize their inputs (:func:`fp8_run`)."""
    fp8 = precision == "fp8"
    hw = precision_view(hw, precision)
    return sum(op_seconds(o, phase, hw, fp8, run) for o in ops) * 1e3


def fp8_run(options: CostOptions) -> FP8Run:
    """The FP8 quantization of ``options``: ``fp8_recipe``, and expert padding in the grouped GEMMs
    under the ``alltoall`` dispatcher (Megatron-Core ``TEGroupedMLP``; DeepEP and HybridEP pad
    while permuting: :func:`tessera.cost.fp8.fp8_quant`)."""
    return FP8Run(options.fp8_recipe, pad_experts=options.moe_dispatcher == "alltoall")


def _flops(ops: tuple[OpCost, ...], phase: int) -> float:
    return sum(o.flops[phase] for o in ops)


def deferred_gemms(ops: tuple[OpCost, ...]) -> float:
    """Weight-gradient GEMM calls of ``ops`` in W: one per weight matrix (``GemmShape.groups``:
    a grouped expert GEMM is one call per local expert in the engine's W, which runs each
    expert's ``Linear`` on its own)."""
    return sum(o.gemm.groups for o in ops if o.gemm is not None and o.flops[_W] > 0)


def deferred_ms(ops: tuple[OpCost, ...], hw: HardwareSpec) -> float:
    """Extra ms of running the W of ``ops`` deferred (split W) rather than inside B:
    ``deferred_gemms(ops) * hw.deferred_w_us / 1000`` (:attr:`HardwareSpec.deferred_w_us`)."""
    return deferred_gemms(ops) * hw.deferred_w_us / 1e3


def ops_host_ms(ops: tuple[OpCost, ...], phase: int, hw: HardwareSpec, options: CostOptions, kind: TaskKind,
                mamba: bool = False) -> float:
    """Host time to issue ``ops`` of a ``kind`` task in phase 0/1/2 (F/B/W) from PyTorch eager
    mode, ms: :func:`tessera.cost.efficiency.op_host_seconds` of each operator outside the CUDA
    graphs of ``options.cuda_graphs`` (:func:`tessera.cost.efficiency.captured`; ``mamba``: the
    layer's mixer is Mamba-2), summed."""
    fp8 = options.precision == "fp8"
    run = fp8_run(options)
    return sum(op_host_seconds(o, phase, hw, fp8, run) for o in ops
               if not captured(options.cuda_graphs, kind, o.name, mamba)) * 1e3


def host_bound(tasks: tuple[TaskCost, ...], host: tuple[float, ...]) -> tuple[TaskCost, ...]:
    """``tasks`` (one layer, or the embedding or head) with the host's issue time set against
    the device's, per phase: the host issues a phase's kernels while the device runs them, so the
    phase lasts ``max(D, H)`` with ``D`` the sum of its tasks' ``ms`` (communication included) and
    ``H`` the sum of ``host`` (ms, one per task). The excess ``H - D`` is added to the phase's
    compute tasks in proportion to their host time (a host-bound task lasts as long as the host
    takes to issue it). Granularity: a layer's phase, because every MoE layer's forward
    synchronises the host with the device (the token dispatcher needs the per-expert counts on the
    host: docs/cost-model.md, "Host time and CUDA graphs"), so the host cannot run ahead across
    layers to hide one layer's excess behind another's slack."""
    out = list(tasks)
    for phase in Phase:
        idx = [i for i, t in enumerate(tasks) if t.phase == phase]
        d = sum(tasks[i].ms for i in idx)
        h = sum(host[i] for i in idx)
        hc = sum(host[i] for i in idx if tasks[i].resource == Resource.COMPUTE)
        if h <= d or hc <= 0:
            continue
        for i in idx:
            if tasks[i].resource == Resource.COMPUTE:
                out[i] = replace(tasks[i], ms=tasks[i].ms + (h - d) * host[i] / hc)
    return tuple(out)


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


def _memory(params: ParamSplit, act_stored: float, act_w: float, p: ParallelShape,
            options: CostOptions) -> LayerMemory:
    prm, grd, opt = static_bytes(params, tp=p.tp, ep=p.ep, dp=p.dp, dp_shard=options.dp_shard,
                                 master_weights=options.master_weights)
    return LayerMemory(prm, grd, opt, act_stored, act_w, fsdp_transient_bytes(params, tp=p.tp, ep=p.ep,
                                                                             dp_shard=options.dp_shard))


def _rerun_ms(kind_ops: tuple[OpCost, ...], names: frozenset[str], hw: HardwareSpec, coll: float,
              precision: str = "bf16", run: FP8Run = FP8Run()) -> float:
    """F time a B task re-runs under recompute, ms: the operators ``names``
    (:func:`tessera.cost.memory.recompute_ops`), or all of them with the task's TP collectives
    ``coll`` (:data:`~tessera.cost.memory.ALL_OPS`)."""
    if names == ALL_OPS:
        return ops_ms(kind_ops, _F, hw, precision, run) + coll
    return ops_ms(tuple(o for o in kind_ops if o.name in names), _F, hw, precision, run)


def _one_rank_balanced(options: CostOptions, p: ParallelShape) -> CostOptions:
    """``options`` with ``moe_load`` 1.0 when ``p.ep`` is 1: one EP rank holds every expert and
    receives every token, so it is the mean rank (no routing imbalance between ranks)."""
    return replace(options, moe_load=1.0) if p.ep == 1 and options.moe_load != 1.0 else options


def layer_cost(layer: LayerSpec, model: ModelSpec, hw: HardwareSpec, p: ParallelShape,
               recompute: bool = False, options: CostOptions | None = None) -> LayerCost:
    """Tasks (F, B, W) and memory of one decoder layer on its rank (see module docstring);
    ``options`` (default: ``recompute`` true means full recompute) as in :func:`analytic_costs`."""
    if options is None:
        options = CostOptions(recompute="full" if recompute else "none")
    options = _one_rank_balanced(options, p)
    rerun = recompute_ops(layer, options)
    tokens = p.micro_batch_size * p.seq_length
    ops = layer_ops(layer, model.hidden, tokens, p.seq_length, p.tp, p.ep)
    coll = 2 * tp_collective_ms(BF16 * tokens * model.hidden, p.tp, hw)  # SP all-gather + reduce-scatter
    a2a = 0.0
    a2a_b = 0.0
    if isinstance(layer.mlp, MoESpec):
        moe = layer.mlp
        width = moe.latent_dim if moe.latent_dim > 0 else model.hidden
        a2a, a2a_b = moe_a2a(tokens / p.tp, moe, width, p.ep, hw, options.moe_dispatcher,  # by dispatcher
                             placement_of(p, hw.gpus_per_node).group("ep").local)

    load = options.moe_load  # the busiest EP rank's tokens over the mean's (tessera.cost.routing)
    run = fp8_run(options)

    def cost(s: TaskShape) -> TaskCost:
        if s.resource == Resource.EP_COMM:  # dispatch / combine: one A2A (B re-runs F's under recompute)
            ms = a2a * (2 if s.kind in rerun and s.phase == Phase.B else 1) * load
            return TaskCost(s.kind, s.phase, s.resource, ms, 0.0, a2a_b if p.ep > 1 else 0.0, s.deps)
        ph = _PHASE[s.phase]
        kind_ops = ops[s.kind]
        extra = coll if s.kind in (TaskKind.MIXER, TaskKind.MLP, TaskKind.SHARED) and ph != _W else 0.0
        ms = ops_ms(kind_ops, ph, hw, options.precision, run) + extra
        if s.kind in rerun and ph == _B:
            ms += _rerun_ms(kind_ops, rerun[s.kind], hw, extra, options.precision, run)
        if s.kind in ROUTED_KINDS:
            ms *= load
        return TaskCost(s.kind, s.phase, s.resource, ms, _flops(kind_ops, ph), 0.0, s.deps,
                        deferred_ms(kind_ops, hw) if ph == _W else 0.0)

    tasks = tuple(cost(s) for s in layer_shapes(layer))
    mamba = isinstance(layer.mixer, Mamba2Spec)

    def host(s: TaskShape) -> float:  # ms the host takes to issue the task's kernels (eager)
        ph = _PHASE[s.phase]
        reruns = 2 if s.kind in rerun and s.phase == Phase.B else 1
        if s.resource == Resource.EP_COMM:  # one collective launch per A2A (none inside the moe graph)
            graphed = captured(options.cuda_graphs, s.kind, "", mamba)
            return reruns * hw.host_kernel_us / 1e3 if p.ep > 1 and not graphed else 0.0
        kind_ops = ops[s.kind]
        # a captured scope is one graph replay in F and in B (its backward graph holds the weight
        # gradients too); full_iteration replays once per iteration, left out
        replay = ph != _W and "full_iteration" not in options.cuda_graphs
        if captured(options.cuda_graphs, s.kind, "", mamba):  # the whole task in a graph
            return reruns * replay * hw.host_kernel_us / 1e3
        colls = 2 if p.tp > 1 and s.kind in (TaskKind.MIXER, TaskKind.MLP, TaskKind.SHARED) and ph != _W else 0
        graphs = replay and any(captured(options.cuda_graphs, s.kind, o.name, mamba) for o in kind_ops)
        ms = ops_host_ms(kind_ops, ph, hw, options, s.kind, mamba) + (colls + graphs) * hw.host_kernel_us / 1e3
        if s.kind in rerun and ph == _B:
            names = rerun[s.kind]
            again = kind_ops if names == ALL_OPS else tuple(o for o in kind_ops if o.name in names)
            ms += ops_host_ms(again, _F, hw, options, s.kind, mamba)
            ms += colls * hw.host_kernel_us / 1e3 if names == ALL_OPS else 0.0
        return ms

    tasks = host_bound(tasks, tuple(host(s) for s in layer_shapes(layer)))
    act = layer_activation(layer, model.hidden, tokens, tp=p.tp, options=options)
    params = layer_params(layer, model.hidden)
    mem = _memory(params, act.stored, act.gemm_inputs, p, options)
    return LayerCost(layer.index, layer.code, tasks, mem, layer_dp(params, p, hw, options.master_weights))


def _block(kind: TaskKind, ops: tuple[OpCost, ...], hw: HardwareSpec, extra_fb: float = 0.0,
           rerun_b: float = 0.0, precision: str = "bf16", run: FP8Run = FP8Run()) -> tuple[TaskCost, ...]:
    """The tasks of one single-kind block (embedding or head, :func:`tessera.spec.tasks.block_shapes`)
    with their durations and FLOPs; ``rerun_b``: forward time the B task re-runs (recompute), ms."""
    f = ops_ms(ops, _F, hw, precision, run) + extra_fb
    b = ops_ms(ops, _B, hw, precision, run) + extra_fb + rerun_b
    ms = {Phase.F: f, Phase.B: b, Phase.W: ops_ms(ops, _W, hw, precision, run)}
    return tuple(TaskCost(s.kind, s.phase, s.resource, ms[s.phase], _flops(ops, _PHASE[s.phase]), deps=s.deps,
                          deferred_ms=deferred_ms(ops, hw) if s.phase == Phase.W else 0.0)
                 for s in block_shapes(kind))


def _head_rerun_ms(model: ModelSpec, hw: HardwareSpec, p: ParallelShape, options: CostOptions,
                   mtp_a2a: float) -> float:
    """Forward time the head's B re-runs under recompute, ms: the recomputed operators of each
    MTP module's layer (:func:`tessera.cost.memory.recompute_ops` of the last layer's kind) and,
    where dispatch/combine re-run, the MTP A2As ``mtp_a2a``. The output layer and loss are never
    recomputed (Megatron-Core recomputes transformer layers only)."""
    if not model.mtp_layers or not model.layers:
        return 0.0
    last = model.layers[-1]
    rerun = recompute_ops(last, options)
    ops = layer_ops(last, model.hidden, p.micro_batch_size * p.seq_length, p.seq_length, p.tp, p.ep)
    ms = sum(_rerun_ms(ops[k], names, hw, 0.0, options.precision, fp8_run(options))
             for k, names in rerun.items() if k in ops)
    a2a = mtp_a2a if TaskKind.DISPATCH in rerun else 0.0
    return model.mtp_layers * ms + a2a


def analytic_costs(model: ModelSpec, hw: HardwareSpec, parallel: ParallelShape, *,
                   activation_recompute: bool = False, options: CostOptions | None = None) -> ModelCosts:
    """Analytic (roofline) costs of ``model`` on ``hw`` under ``parallel``, one microbatch of
    ``micro_batch_size * seq_length`` tokens per GPU.

    ``options`` (:class:`~tessera.cost.types.CostOptions`): recompute mode and modules, MoE
    dispatcher, data-parallel sharding, precision; ``None``: the defaults with
    ``recompute="full"`` when ``activation_recompute`` (the older spelling) is true.

    Returns ModelCosts with ms durations, FLOPs, A2A bytes, per-layer memory in bytes,
    ``p2p_ms`` (BF16 activation ``tokens*hidden*2/tp`` bytes over the inter-node link + latency;
    NVLink where the placement keeps every pipeline inside a node, :func:`~tessera.cost.comm.p2p_ms`),
    ``overlap_slowdown = hw.overlap_slowdown``, ``peak_flops = peak_tflops*1e12`` FLOP/s and
    ``device_mem_bytes = mem_gb*1e9``. Raises TesseraConfigError on an impossible layout."""
    p = parallel
    if options is None:
        options = CostOptions(recompute="full" if activation_recompute else "none")
    elif activation_recompute and options.recompute != "full":
        raise ValueError(f"analytic_costs: activation_recompute=True contradicts options.recompute="
                         f"{options.recompute!r}; give the mode in options only")
    _check(model, hw, p)
    options = _one_rank_balanced(options, p)
    if options.precision == "fp8" and hw.peak_tflops_fp8 <= 0:
        raise TesseraConfigError("train.precision", "fp8", f"hardware {hw.name!r} has no FP8 peak (peak_tflops_fp8=0)",
                                 "use train.precision=bf16, a preset with FP8 (h100-sxm, h800, h200, b200) or "
                                 "hardware.inline.peak_tflops_fp8")
    if options.precision == "fp8" and options.fp8_recipe == "mxfp8" and not hw.mxfp8:
        raise TesseraConfigError("train.fp8_recipe", "mxfp8", f"hardware {hw.name!r} has no MXFP8 tensor cores "
                                 "(Blackwell, compute capability 10.0)",
                                 "use train.fp8_recipe=tensorwise (or blockwise), a preset with MXFP8 (b200) or "
                                 "hardware.inline.mxfp8=true")
    tokens = p.micro_batch_size * p.seq_length
    placement = placement_of(p, hw.gpus_per_node)
    layers = tuple(layer_cost(l, model, hw, p, options=options) for l in model.layers)

    emb_ops = embed_ops(model, tokens, p.tp)
    emb_tasks = _block(TaskKind.EMBED, emb_ops, hw, precision=options.precision, run=fp8_run(options))
    emb_tasks = host_bound(emb_tasks, tuple(ops_host_ms(emb_ops, _PHASE[t.phase], hw, options, TaskKind.EMBED)
                                            for t in emb_tasks))
    ids = 8.0 * tokens  # int64 token ids kept for the scatter-add
    emb_params = ParamSplit(float(model.vocab * model.hidden))
    emb_mem = _memory(emb_params, ids, ids, p, options)
    embed = LayerCost(-1, "emb", emb_tasks, emb_mem, layer_dp(emb_params, p, hw, options.master_weights))

    mtp_a2a = 0.0
    last = model.layers[-1] if model.layers else None
    if model.mtp_layers and last is not None and isinstance(last.mlp, MoESpec):
        width = last.mlp.latent_dim if last.mlp.latent_dim > 0 else model.hidden
        mtp_a2a = 2 * model.mtp_layers * moe_a2a(tokens / p.tp, last.mlp, width, p.ep, hw, options.moe_dispatcher,
                                                 placement.group("ep").local)[0]
    h_ops = head_ops(model, tokens, p.seq_length, p.tp, p.ep)
    head_tasks = _block(TaskKind.HEAD, h_ops, hw, extra_fb=mtp_a2a,
                        rerun_b=_head_rerun_ms(model, hw, p, options, mtp_a2a), precision=options.precision,
                        run=fp8_run(options))
    head_tasks = host_bound(head_tasks, tuple(ops_host_ms(h_ops, _PHASE[t.phase], hw, options, TaskKind.HEAD)
                                              for t in head_tasks))
    h_act = head_activation(model, tokens, tp=p.tp, options=options)
    h_params = head_params(model, p.pp)
    head_mem = _memory(h_params, h_act.stored, h_act.gemm_inputs, p, options)
    head = LayerCost(model.num_layers, "head", head_tasks, head_mem, layer_dp(h_params, p, hw, options.master_weights))

    act_bytes = BF16 * tokens * model.hidden / p.tp
    same_node = not placement.group("pipeline").crosses_nodes
    costs = ModelCosts("analytic", layers, embed, head, p2p_ms(act_bytes, hw, same_node), act_bytes, hw.overlap_slowdown,
                       hw.peak_tflops * 1e12, hw.mem_gb * 1e9, tokens, dp_shard=options.dp_shard,
                       pair_task_ms=hw.pair_task_us / 1e3)
    for lc in (embed, head) + layers:
        for t in lc.tasks:
            if not math.isfinite(t.ms) or t.ms < 0:
                raise ValueError(f"layer {lc.index} task {t.kind.value}/{t.phase.value}: bad duration {t.ms}")
    return costs
