"""Cost values: what every cost source (analytic, profile, trace) produces.

A cost source turns (ModelSpec, HardwareSpec, :class:`ParallelShape`) into one frozen :class:`ModelCosts`.
Everything downstream (overlap graph, pair scheduler, MILP, simulator) reads only ModelCosts.

The tasks of one layer (``LayerCost.tasks``: kinds, phases, resources, ``deps`` as indices into
``LayerCost.tasks``) are the task split of its spec, :func:`tessera.spec.tasks.layer_shapes`
(embedding and head: :func:`tessera.spec.tasks.block_shapes`); a cost source attaches durations,
FLOPs, bytes and memory to them. Across layers the convention is fixed: every *entry* task (no
deps inside its layer-phase) of layer ``l+1`` in F depends on every *exit* task (no successor
inside its layer-phase) of layer ``l`` in F; in B the direction is reversed (layer ``l`` entries
depend on layer ``l+1`` exits).

:class:`Phase`, :class:`Resource` and :class:`TaskKind` are defined in :mod:`tessera.spec.tasks`
and re-exported here, beside the ``TaskCost`` that carries them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tessera.spec.tasks import Phase, Resource, TaskKind

__all__ = ["Phase", "Resource", "TaskKind", "TaskCost", "LayerMemory", "LayerDP", "LayerCost", "ModelCosts",
           "TaskKey", "ParallelShape"]


@dataclass(frozen=True)
class TaskCost:
    """One task of one layer in one phase.

    Attributes:
        kind, phase, resource: what it is and where it runs.
        ms: duration in milliseconds when it runs alone.
        flops: model FLOPs it performs (0 for communication).
        bytes: bytes it moves (communication tasks), else 0.
        deps: indices into the owning ``LayerCost.tasks`` that must finish first.
        deferred_ms: W tasks only: extra ms when this W runs as its own instruction after B (split
            W) rather than inside B; the host cost of deferring its weight-gradient GEMMs
            (:attr:`tessera.spec.hardware.HardwareSpec.deferred_w_us` times their count). Not part
            of ``ms``: a fused backward (``B`` with ``with_w``, or ``FB`` with ``with_w``) runs
            the same W without it.
    """

    kind: TaskKind
    phase: Phase
    resource: Resource
    ms: float
    flops: float = 0.0
    bytes: float = 0.0
    deps: tuple[int, ...] = ()
    deferred_ms: float = 0.0


@dataclass(frozen=True)
class LayerMemory:
    """Memory of one layer on its rank, bytes.

    params/grads/optimizer: static (weights of the local expert shard under EP, BF16 params,
    FP32 grads and Adam state as in Megatron mixed precision: 2 + 4 + 12 bytes per parameter, or
    as the cost source states; sharded over the data-parallel group under FSDP). activation: bytes
    stored per in-flight microbatch between F and B. w_activation: bytes of stored GEMM inputs the
    deferred W tasks still read after B (more than ``activation`` when recompute dropped tensors
    that B rebuilds for W). transient: bytes live only while this layer computes (FSDP's
    all-gathered parameters and unsharded gradient, :func:`tessera.cost.memory.fsdp_transient_bytes`);
    a rank adds the largest ``transient`` of its layers to its peak.
    """

    params: float
    grads: float
    optimizer: float
    activation: float
    w_activation: float = 0.0
    transient: float = 0.0

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class LayerDP:
    """Data-parallel costs of one layer (or embedding / head) on its rank, ms
    (:mod:`tessera.cost.dp`): ``gather_ms`` one all-gather of its local BF16 parameters over
    their data-parallel groups, ``reduce_ms`` one reduce-scatter of its FP32 gradients,
    ``optimizer_ms`` the Adam step over its local optimizer shard. All 0: not modelled (the
    simulator then charges nothing for ``reduce_grads`` / ``optimizer_step``)."""

    gather_ms: float = 0.0
    reduce_ms: float = 0.0
    optimizer_ms: float = 0.0


@dataclass(frozen=True)
class LayerCost:
    """All tasks (F, B and W), the memory and the data-parallel costs of one layer (or of the
    embedding / head)."""

    index: int  # layer index; -1 for the embedding, num_layers for the head
    code: str  # kind code, e.g. "DE" (see ModelSpec)
    tasks: tuple[TaskCost, ...]
    memory: LayerMemory
    dp: LayerDP = LayerDP()

    def phase_tasks(self, phase: Phase) -> tuple[int, ...]:
        """Indices of this layer's tasks in ``phase``."""
        return tuple(i for i, t in enumerate(self.tasks) if t.phase == phase)

    def phase_ms(self, phase: Phase, resource: Resource | None = None) -> float:
        """Serial time of this layer's ``phase`` tasks (optionally of one resource), ms."""
        return sum(t.ms for t in self.tasks if t.phase == phase and (resource is None or t.resource == resource))

    def flops(self, phase: Phase | None = None) -> float:
        return sum(t.flops for t in self.tasks if phase is None or t.phase == phase)


@dataclass(frozen=True)
class ModelCosts:
    """Costs of a whole model for one microbatch on one rank of each stage.

    Attributes:
        source: ``"analytic"``, ``"profile"``, ``"trace"``.
        layers: one LayerCost per decoder layer, in order.
        embed: the embedding (on the first stage).
        head: final norm + output head + loss (+ MTP) (on the last stage).
        p2p_ms: time to send one microbatch's activation (or its gradient) to the next stage, ms.
        p2p_bytes: bytes of that activation.
        overlap_slowdown: factor >= 1 applied to compute tasks that co-execute with communication
            of an overlapped F&B pair (communication kernels hold some SMs).
        peak_flops: peak FLOP/s of one device (for MFU).
        device_mem_bytes: device memory capacity, bytes.
        tokens_per_microbatch: micro_batch_size * seq_length.
        dp_shard: when the simulator runs the layers' :class:`LayerDP` collectives
            (``CostOptions.dp_shard``): ``"zero1"`` once per iteration (gather before a chunk's
            first forward, reduce-scatter after its last backward), ``"fsdp"`` around every
            forward and backward (docs/cost-model.md, "Data parallelism").
        measured_pairs: measured wall times of whole overlapped F&B pairs (``planner.cost_source:
            profile``), ``(item, with_w, ms)`` sorted by item, the item named by the two chunks'
            layer kind codes (:func:`tessera.cost.profile_costs.pair_item`); the planner prices a
            candidate pair with it instead of composing it from task times
            (:func:`tessera.plan.pair_cost.best_pair`). Empty for the other cost sources.
        pair_task_ms: host cost each compute task of an overlapped F&B pair pays, ms: the engine
            runs an interleaved pair task by task (one backward call per B task) where a chunk
            run alone, or a back-to-back pair, is one autograd segment per side
            (:attr:`tessera.spec.hardware.HardwareSpec.pair_task_us`; 0: not modelled).
        rank_scale: per pipeline rank (index = rank), the factor by which that rank's compute
            runs slower than the costs above (``planner.rank_slowdown``: a slow GPU or node makes
            its rank the straggler); empty: every rank 1.0. What a rank runs is
            :meth:`on_rank`: every ``Resource.COMPUTE`` task's time (``ms`` and the host costs
            ``deferred_ms`` and ``pair_task_ms`` it pays), each layer's ``LayerDP.optimizer_ms``
            and the measured pair times times its factor; communication (EP all-to-all, p2p,
            data-parallel collectives) and memory are not scaled (docs/cost-model.md, "Per-rank
            slowdown"). Finite and > 0 (``ValueError``).
    """

    source: str
    layers: tuple[LayerCost, ...]
    embed: LayerCost
    head: LayerCost
    p2p_ms: float
    p2p_bytes: float
    overlap_slowdown: float
    peak_flops: float
    device_mem_bytes: float
    tokens_per_microbatch: int
    dp_shard: str = "zero1"
    measured_pairs: tuple[tuple[str, bool, float], ...] = ()
    pair_task_ms: float = 0.0
    rank_scale: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        bad = [f for f in self.rank_scale if not 0 < f < math.inf]
        if bad:
            raise ValueError(f"ModelCosts.rank_scale={self.rank_scale!r}: every factor must be finite and > 0")

    def scale_of(self, rank: int) -> float:
        """The compute-time factor of pipeline rank ``rank`` (:attr:`rank_scale`; 1.0 when it is
        empty).

        Raises:
            ValueError: ``rank_scale`` is set and has no factor for ``rank``."""
        if not self.rank_scale:
            return 1.0
        if not 0 <= rank < len(self.rank_scale):
            raise ValueError(f"ModelCosts.rank_scale has {len(self.rank_scale)} factors (one per pipeline rank); "
                             f"rank {rank} has none")
        return self.rank_scale[rank]

    def scaled(self, factor: float, kinds: tuple[TaskKind, ...] | None = None) -> "ModelCosts":
        """These costs with every ``Resource.COMPUTE`` task's ``ms`` (only those of ``kinds``, if
        given) times ``factor``. Without ``kinds`` (a whole device slower) also the host costs
        compute tasks pay (``TaskCost.deferred_ms``, :attr:`pair_task_ms`), so that every
        compute task's simulated time is ``factor`` times longer, each layer's
        ``LayerDP.optimizer_ms`` (the Adam step runs on the same device) and every measured
        pair time (a measured pair is scaled whole: its overlapped communication with it, an
        upper estimate). FLOPs, bytes, memory and communication are unchanged; ``rank_scale``
        is kept. ``self`` when ``factor`` is 1."""
        if factor == 1.0:
            return self

        def task(t: TaskCost) -> TaskCost:
            if t.resource != Resource.COMPUTE or (kinds is not None and t.kind not in kinds):
                return t
            return replace(t, ms=t.ms * factor, deferred_ms=t.deferred_ms * (factor if kinds is None else 1.0))

        def layer(lc: LayerCost) -> LayerCost:
            dp = lc.dp if kinds is not None else replace(lc.dp, optimizer_ms=lc.dp.optimizer_ms * factor)
            return replace(lc, tasks=tuple(task(t) for t in lc.tasks), dp=dp)

        pairs = self.measured_pairs if kinds is not None else tuple((k, w, ms * factor)
                                                                     for k, w, ms in self.measured_pairs)
        return replace(self, layers=tuple(layer(lc) for lc in self.layers), embed=layer(self.embed),
                       head=layer(self.head), measured_pairs=pairs,
                       pair_task_ms=self.pair_task_ms * (factor if kinds is None else 1.0))

    def on_rank(self, rank: int) -> "ModelCosts":
        """The costs pipeline rank ``rank`` runs: :meth:`scaled` by :meth:`scale_of` ``(rank)``,
        with ``rank_scale`` empty (so nothing downstream scales twice); ``self`` when no rank is
        scaled."""
        if not self.rank_scale:
            return self
        return replace(self, rank_scale=()).scaled(self.scale_of(rank))

    def layer(self, index: int) -> LayerCost:
        """LayerCost for ``index``; -1 is the embedding and ``len(layers)`` the head."""
        if index == -1:
            return self.embed
        if index == len(self.layers):
            return self.head
        return self.layers[index]

    def serial_ms(self, index: int) -> float:
        """Serial F+B+W time of layer ``index`` (one microbatch), ms."""
        return sum(t.ms for t in self.layer(index).tasks)

    def model_flops_per_microbatch(self) -> float:
        """Model FLOPs (F+B+W) of one microbatch through the whole model (for MFU)."""
        return sum(l.flops() for l in self.layers) + self.embed.flops() + self.head.flops()


@dataclass(frozen=True, order=True)
class TaskKey:
    """One task of a chunk: ``phase`` ``"F"``/``"B"``/``"W"``, extended ``layer`` (-1 embedding,
    L head), ``kind`` (a :class:`tessera.spec.tasks.TaskKind` value). ``str()`` is the name
    :func:`tessera.sched.chunkdag.pair_dag` gives the task, e.g. ``"F.L3.dispatch"``."""

    phase: str
    layer: int
    kind: str

    def __str__(self) -> str:
        return f"{self.phase}.L{self.layer}.{self.kind}"


@dataclass(frozen=True)
class ParallelShape:
    """The parallel layout and batch shape a cost source needs (the recipe's ``parallel``
    section, without the recipe): pipeline ranks ``pp``, virtual stages per rank ``vpp``,
    expert-, tensor- and data-parallel sizes ``ep``/``tp``/``dp``, ``num_microbatches`` per
    iteration, ``micro_batch_size`` sequences of ``seq_length`` tokens; ``rank_order``: which
    ranks share a node (:mod:`tessera.spec.placement`; ``auto``: EP inside a node on multi-GPU
    nodes)."""

    pp: int = 1
    vpp: int = 1
    ep: int = 1
    tp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    micro_batch_size: int = 1
    seq_length: int = 4096
    rank_order: str = "auto"

    @staticmethod
    def of(parallel) -> "ParallelShape":
        """The shape of anything with these attributes (a recipe's ``parallel`` section, the
        schema dataclass, or a ParallelShape itself; a missing ``rank_order`` is ``auto``)."""
        if isinstance(parallel, ParallelShape):
            return parallel
        return ParallelShape(**{f: getattr(parallel, f) for f in ParallelShape.__dataclass_fields__
                                if f != "rank_order"}, rank_order=getattr(parallel, "rank_order", "auto"))


RECOMPUTE_MODES = ("none", "selective", "full")
"""``planner.activation_recompute``: nothing, the listed modules (``recompute_modules``), or every
layer but its input (Korthikanti et al. 2022 sec. 5; Megatron-Core ``--recompute-granularity``)."""
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""Modules selective recompute may name: Megatron-Core ``--recompute-modules`` (its default is
``core_attn``)."""
DISPATCHERS = ("alltoall", "deepep")
"""``parallel.moe_dispatcher``: a flat all-to-all (every top-k copy crosses its link) or DeepEP's
hierarchical dispatch/combine (one copy per destination node, NVLink fan-out inside the node)."""
DP_SHARDS = ("zero1", "fsdp")
"""``parallel.dp_shard``: distributed optimizer (optimizer state sharded over dp; gradient
reduce-scatter and parameter all-gather once per iteration) or FSDP (parameters, gradients and
optimizer state sharded; per-layer all-gathers in F and B, reduce-scatters in B)."""
PRECISIONS = ("bf16", "fp8", "fp32")
"""``train.precision`` once resolved (``auto`` is the recipe's: :func:`tessera.config.auto.resolve_precision`):
what the GEMMs run in (peak FLOP/s; FP8 also bytes moved). ``fp32`` runs every compute op at
:meth:`~tessera.spec.hardware.HardwareSpec.peak_for` ``("fp32")`` (TF32 on GPUs; the one native
peak on ``cpu``) and counts bytes and memory as ``bf16`` does."""
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
"""``train.fp8_recipe`` (Megatron-Core ``--fp8-recipe`` names): how the FP8 linear layers are
quantized under ``precision="fp8"`` (:class:`tessera.cost.fp8.FP8Run`, :func:`tessera.cost.fp8.fp8_quant`):
per-tensor current scaling, per-tensor delayed scaling, MXFP8 1x32 blocks (Blackwell), or
DeepSeek-V3's 1x128 / 128x128 blocks."""

CUDA_GRAPH_SCOPES = ("attn", "mamba", "mlp", "moe_router", "moe_preprocess", "moe", "full_iteration")
"""``train.cuda_graphs``: what of each layer runs inside a captured CUDA graph, so costs no host
time (Megatron-Core ``--cuda-graph-modules`` names, ``full_iteration`` for ``--cuda-graph-impl
full_iteration``; :func:`tessera.cost.efficiency.captured`): the token mixer (``attn``, also Gated
DeltaNet and MLA; ``mamba``), the dense MLP (``mlp``), the MoE router and shared expert
(``moe_router``), the token permutation before dispatch (``moe_preprocess``), the whole MoE layer
(``moe``: drop-and-pad routing only) or every layer, the embedding and the head
(``full_iteration``). Empty: eager, every kernel issued by the host."""


@dataclass(frozen=True)
class CostOptions:
    """What a cost source assumes beyond the layout (:class:`ParallelShape`): the recipe's
    ``planner.activation_recompute`` / ``recompute_modules``, ``parallel.moe_dispatcher`` /
    ``dp_shard``, ``train.precision`` and ``train.master_weights`` (FP32 master weights and Adam
state, or pure BF16: :mod:`tessera.cost.memory`), without the recipe. Values are checked against the
    tuples above by the recipe rules; a cost source raises ``ValueError`` on an unknown one.
    ``moe_load``: the busiest EP rank's tokens over the mean rank's in every MoE layer
    (``model.moe_routing`` / ``moe_max_over_mean``, :func:`tessera.cost.routing.load_factor`;
    1.0: balanced), a finite number >= 1. ``fp8_recipe``: ``train.fp8_recipe``
    (:data:`FP8_RECIPES`), read only under ``precision="fp8"``. ``cuda_graphs``: the scopes of
    :data:`CUDA_GRAPH_SCOPES` captured in CUDA graphs (``train.cuda_graphs``; empty: eager)."""

    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    moe_dispatcher: str = "alltoall"
    dp_shard: str = "zero1"
    precision: str = "bf16"
    master_weights: bool = True
    moe_load: float = 1.0
    fp8_recipe: str = "tensorwise"
    cuda_graphs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1.0 <= self.moe_load < math.inf:
            raise ValueError(f"CostOptions.moe_load={self.moe_load!r}: must be a finite number >= 1")
        for name, allowed in (("recompute", RECOMPUTE_MODES), ("moe_dispatcher", DISPATCHERS),
                              ("dp_shard", DP_SHARDS), ("precision", PRECISIONS), ("fp8_recipe", FP8_RECIPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"CostOptions.{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad:
            raise ValueError(f"CostOptions.recompute_modules: unknown {bad}; use some of {', '.join(RECOMPUTE_MODULES)}")
        bad = [m for m in self.cuda_graphs if m not in CUDA_GRAPH_SCOPES]
        if bad:
            raise ValueError(f"CostOptions.cuda_graphs: unknown {bad}; use some of {', '.join(CUDA_GRAPH_SCOPES)}")

    @staticmethod
    def recompute_mode(value) -> str:
        """``planner.activation_recompute`` as a mode: booleans (the older spelling) map to
        ``full`` / ``none``; a mode name is returned as is."""
        if isinstance(value, bool):
            return "full" if value else "none"
        return str(value)
