"""Typed recipe schema (omegaconf structured configs).

A recipe YAML has the sections below; ``tessera.config.load.load_recipe`` merges the YAML and
``key=value`` overrides onto these dataclasses, validates, and returns a frozen :class:`Recipe`.
The dataclasses are frozen, so ``OmegaConf.structured`` makes read-only configs of them and
``OmegaConf.to_object`` gives instances of these very classes: a Recipe's sections are these
types (there is no second, hand-kept copy of the schema).
Every field is documented in ``docs/recipes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass(frozen=True)
class ModelConfig:
    """Which model: exactly one *source*, ``preset``, ``hf_config`` or ``inline``. The recipe file
    and the override list are two layers: each may set at most one source, and a source set by an
    override replaces the recipe's (``tessera.config.load``; ``docs/recipes.md``).

    preset: a name from ``tessera.spec.presets.MODEL_PRESETS`` (e.g. ``qwen3-next-80b-a3b``).
    hf_config: path to a HuggingFace ``config.json`` on disk.
    inline: a ModelSpec dict (``ModelSpec.to_dict`` format) or a pattern dict (see docs).
    num_layers: if > 0, keep only the first ``num_layers`` layers (for quick experiments).
    mtp_layers: if set, the number of multi-token-prediction modules after the last layer,
        replacing the source's (e.g. 0 for DeepSeek-V3 trained without MTP).
    moe_routing: how the MoE layers' tokens spread over the EP ranks, for the cost model
        (:mod:`tessera.cost.routing`): ``balanced`` (every EP rank the mean load), ``dropless``
        (no capacity: the busiest EP rank gates every MoE layer's expert compute, dispatch and
        combine and holds the largest receive buffers) or ``forced`` (tokens dropped above a
        capacity and padded up to it).
    moe_max_over_mean: the busiest EP rank's tokens over the mean rank's: with ``dropless`` the
        measured imbalance (default 1.30, cited in :data:`tessera.cost.routing.DROPLESS_MAX_OVER_MEAN`),
        with ``forced`` the capacity factor (default 1.0); null: the default; finite, >= 1.
    """

    preset: Optional[str] = None
    hf_config: Optional[str] = None
    inline: Optional[dict] = None
    num_layers: int = 0
    mtp_layers: Optional[int] = None
    moe_routing: str = "balanced"
    moe_max_over_mean: Optional[float] = None


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout and batch shape.

    pp: pipeline ranks; vpp: virtual stages (model chunks) per pipeline rank, or ``auto`` (the
    planner tries the values that fit: :mod:`tessera.config.auto`); ep: expert-parallel
    group size; tp: tensor-parallel size; dp: data-parallel replicas (EP is carved from dp*tp as in
    Megatron-Core); num_microbatches: microbatches per iteration per pipeline;
    micro_batch_size: sequences per microbatch; seq_length: tokens per sequence.
    moe_dispatcher: ``alltoall`` (a flat all-to-all: every top-k copy crosses its link) or
        ``deepep`` (DeepEP's hierarchical dispatch/combine: one copy per destination node over the
        network, NVLink fan-out inside the node); what the cost model assumes.
    dp_shard: ``zero1`` (distributed optimizer: optimizer state sharded over the data-parallel
        group) or ``fsdp`` (parameters, gradients and optimizer state sharded, per-layer
        all-gathers and reduce-scatters); what the cost and memory models assume.
    rank_order: which ranks share a node (:mod:`tessera.spec.placement`), for the cost model and
        the running job alike: ``ep-dp-pp`` (the data-parallel ranks of one pipeline stage
        consecutive: EP groups inside a node, pipeline stages across nodes; Megatron-Core's MoE
        order), ``pp-ep-dp`` (one replica's pipeline consecutive: a node holds whole pipelines, EP
        groups span nodes), or ``auto``: ``ep-dp-pp`` on nodes of several GPUs, ``pp-ep-dp`` on
        the ``cpu`` preset's single-device nodes.
    """

    pp: int = 1
    vpp: Any = 1
    ep: int = 1
    tp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    micro_batch_size: int = 1
    seq_length: int = 4096
    moe_dispatcher: str = "alltoall"
    dp_shard: str = "zero1"
    rank_order: str = "auto"


@dataclass(frozen=True)
class HardwareConfig:
    """Which device. ``preset`` names one of ``tessera.spec.hardware_presets.HARDWARE_PRESETS``;
    ``inline`` gives HardwareSpec fields that override the preset's."""

    preset: str = "h800"
    inline: Optional[dict] = None


@dataclass(frozen=True)
class PlannerConfig:
    """Pipeline template and planner knobs.

    template: ``1f1b`` | ``interleaved-1f1b`` | ``dualpipe-v`` | ``zb-h1`` | ``zb-v``
        (``zb-*``: the zero-bubble schedules of Qi et al. 2024; they need ``split_w``), or
        ``auto``: the planner plans every template that fits and keeps the fastest
        (:mod:`tessera.config.auto`).
    overlap: co-execute the forward chunk of one microbatch with the backward chunk of another in
        the steady state (templates that support it); ``auto``: the planner plans both and keeps
        the faster simulated iteration (:mod:`tessera.config.auto`).
    split_w: run weight gradients (W) as separate, deferrable tasks; ``auto`` as for ``overlap``.
    cost_source: ``analytic`` (default); ``profile``: task times measured on the job's workers
        (``tessera profile``, the ``profile`` section's cache; tasks never timed stay analytic);
        or ``trace``: MoE-layer task times from a PyTorch-profiler (Kineto) trace of an
        overlapped F&B pair (``planner.trace``; :mod:`tessera.cost.trace_costs`).
    trace: path of that trace (JSON), read when ``cost_source`` is ``trace``.
    candidate_radius: layers by which candidate stage boundaries may move from the serial-balanced
        partition.
    prune: drop pairs costlier than the baseline bottleneck before the MILP.
    time_limit_s: the MILP solver's wall-clock safety cap, seconds (its deterministic limit is a
        node count; a plan the cap stopped is marked, ``docs/planner.md``).
    solver: how the partition MILP is solved: ``scip`` (PySCIPOpt, the default), ``cvxpy-scip``
        or ``cvxpy-highs`` (the same model through cvxpy, solved by SCIP or HiGHS; see
        ``docs/planner.md``, "Solvers").
    memory_margin: fraction of device memory kept free (fragmentation, workspace).
    activation_recompute: ``none`` | ``selective`` | ``full`` (``false`` / ``true``, the older
        spelling, mean ``none`` / ``full``): full keeps only each layer's input and re-runs its
        forward in the backward; selective re-runs only ``recompute_modules``.
    recompute_modules: what selective recompute re-runs (Megatron-Core ``--recompute-modules``
        names: ``core_attn``, ``moe_act``, ``layernorm``, ``mla_up_proj``, ``mlp``, ``moe``,
        ``shared_experts``; default ``[core_attn]``, Megatron-Core's default).
    objective: ``iteration`` (default: the MILP optimum and the baseline re-ranked by the
        simulated iteration and refined by a boundary search with the simulator in the loop; a
        plan never slower than the baseline) or ``bottleneck`` (the paper's objective: the
        costliest overlapped pair, as the MILP solves it).
    search_evals: the ``iteration`` search's budget, simulated plans (starts included; under
        ``auto`` over all layouts): the plan depends on it, not on the machine's speed or load;
        null (the default): 5M task-microbatches over the model's tasks times
        ``num_microbatches``, 10..400 (:func:`tessera.plan.planner.search_budget`; 400 on
        Qwen3-Next-80B at 16 microbatches).
    search_time_s: the ``iteration`` search's wall-clock safety cap, seconds (a search it stops
        is marked in ``tessera plan``'s table and ``plan.json``).
    synthesis: after the ``iteration`` search, the planner writes each rank's instruction order
        itself (warm-up depth, which forward pairs with which backward, where each W runs),
        jointly with the stage boundaries, and keeps it where it beats the template's order
        (:func:`tessera.plan.planner.synthesize_jointly`, ``docs/planner.md``); ``false``: the
        template's order.
    synthesis_evals: the synthesis' budget, simulated plans; null (the default): the
        ``iteration`` search's (``search_evals``).
    rank_slowdown: per pipeline rank (``parallel.pp`` factors, or empty: every rank 1.0), how
        much slower that rank's compute runs than the cost model says (a slow GPU or node makes
        its rank the straggler): every compute task of the instructions the rank runs, and its
        optimizer step, take that many times longer (``ModelCosts.rank_scale``); finite, > 0.
        The planner then moves work off a slow rank. Measured by the running job
        (``tessera plan --slowdown-from RUN_DIR/slowdown.json``, :mod:`tessera.cost.slowdown`).
    ep_slowdown: per expert-parallel rank (``parallel.ep`` factors, or empty: 1.0), how much
        longer its routed-expert compute takes (uneven routing or a slow member). Every MoE
        layer's combine all-to-all waits for the slowest member of the EP group, so the whole
        group's expert compute lasts the slowest member's: the expert tasks (F, B and W) of
        every layer are scaled by the *largest* factor, folded into the task times when the
        costs are built (:func:`tessera.flow.build_costs`); finite, > 0.
    """

    template: str = "interleaved-1f1b"
    overlap: Any = True
    split_w: Any = True
    cost_source: str = "analytic"
    trace: str = ""
    candidate_radius: int = 1
    prune: bool = True
    time_limit_s: float = 60.0
    solver: str = "scip"
    memory_margin: float = 0.05
    activation_recompute: Any = False
    recompute_modules: list = field(default_factory=lambda: ["core_attn"])
    objective: str = "iteration"
    search_evals: Optional[int] = None
    search_time_s: float = 300.0
    synthesis: bool = True
    synthesis_evals: Optional[int] = None
    rank_slowdown: List[float] = field(default_factory=list)
    ep_slowdown: List[float] = field(default_factory=list)


@dataclass(frozen=True)
class DBOConfig:
    """Dynamic bubble optimizer (docs/dbo.md): fills routing-induced idle slots with deferred W.

    enabled: annotate the compiled Programs with slots (and give W slack,
        :func:`tessera.program.slots.annotate_slots`) and run the optimizer where it exists: the
        engine API (:class:`tessera.engine.dbo.DBOPolicy`) and the simulator
        (:func:`tessera.sim.dbo.simulate_dbo`) and the training job (:mod:`tessera.train.dbo.table`);
        with ``planner.split_w: auto`` it keeps W split off (the optimizer moves deferred W).
    pool_mem_gb: cap on the memory the pending W hold, GB (a W that would exceed it runs at once).
    margin: safety margin of the slot prediction (a task fits if it takes at most
        ``idle / (1 + margin)``).
    routing: token-count source the prediction and the simulator use (:mod:`tessera.dbo.counts`):
        ``uniform``, ``zipf``, ``dirichlet`` (skew models) or ``recorded`` (``counts_path``);
        ``router``: the training job predicts from the live counts of its own router, shared
        over ``transport`` each iteration (:mod:`tessera.train.dbo.live`; before they arrive the
        driver's prediction assumes uniform routing; the simulator has no router to read).
    temperature: skew of ``zipf`` / ``dirichlet`` (0: balanced in expectation).
    skew_target: if > 0, search the temperature whose ``skew_max_over_mean`` is this (1.1-1.5 is
        what real routers show); overrides ``temperature``.
    seed: seed of the skew model. counts_path: the recorded table (JSON), for ``recorded``.
    log: keep the choice per slot.
    transport: how ``routing: router`` counts reach the EP peers
        (:func:`tessera.train.dbo.transport.make_transport`): ``auto`` (the all-gather, measured
        faster at ep=2), ``allgather`` (``torch.distributed`` on the EP group) or
        ``compiled_graph`` (a Ray compiled graph; falls back to the all-gather with one warning).
    count_timeout_s: how long one compiled-graph exchange waits for a silent peer before it goes
        over the all-gather, seconds.
    """

    enabled: bool = False
    pool_mem_gb: float = 4.0
    margin: float = 0.1
    routing: str = "uniform"
    temperature: float = 1.0
    skew_target: float = 0.0
    seed: int = 0
    counts_path: str = ""
    log: bool = False
    transport: str = "auto"
    count_timeout_s: float = 5.0


@dataclass(frozen=True)
class ProfileConfig:
    """Measured costs (``tessera profile``, ``planner.cost_source: profile``; docs/profiling.md).

    cache: the profile cache file (SQLite; :mod:`tessera.cost.profile_cache`); a relative path
        is under ``logging.out_dir``.
    warmup: untimed iterations before timing; reps: timed iterations (each task and pair is
        timed once per iteration and microbatch; the median and the 25th/75th percentiles are kept).
    budget_s: wall-time budget of the timed iterations, seconds (0: none); when it runs out the
        profile keeps what was timed and items never timed fall back to the analytic model.
    drift_threshold: relative drift of a re-timed sample (``tessera profile --check``) or of the
        training run's own task times above which the profile is marked stale.
    check_every: compare the training run's task times with the profile every this many steps
        (0: never).
    """

    cache: str = "profiles.sqlite"
    warmup: int = 1
    reps: int = 3
    budget_s: float = 300.0
    drift_threshold: float = 0.10
    check_every: int = 10


@dataclass(frozen=True)
class TrainConfig:
    """Training loop: steps, learning rate, seed, data source, checkpointing; ``precision``
    (``auto`` | ``bf16`` | ``fp8`` | ``fp32``) is the dtype the model's compute runs in, for the
    cost model and the engine alike (``auto``: ``fp32`` on the ``cpu`` hardware preset, ``bf16``
    on GPU presets, :func:`tessera.config.auto.resolve_precision`). The engine runs the forward
    under ``torch.autocast`` in BF16 for ``bf16``; ``fp8`` is the cost model's only (FP8 GEMM peak
    and bytes), the engine computes BF16 under it (``docs/engine.md``, Precision);
    ``master_weights`` (default true: BF16 params with FP32 main grads, master copy and Adam
    state, 18 B per parameter as Megatron-LM, and the engine keeps FP32 parameters, gradients,
    AdamW state, pipeline messages and loss; false: pure BF16 params, grads and Adam state, 8 B, as
    FSDP2 on a BF16 model, and the engine's parameters, gradients, AdamW state and pipeline
    messages are BF16, :func:`tessera.model.precision.param_dtype`; refused with ``fp32``) is what
    the memory model, the optimizer step and the engine do. ``fp8_recipe`` (``tensorwise`` |
    ``delayed`` | ``mxfp8`` | ``blockwise``, Megatron-Core's ``--fp8-recipe`` names) is how the
    cost model's FP8 linears quantize their inputs under ``precision=fp8``
    (:func:`tessera.cost.fp8.fp8_quant`; ``mxfp8`` needs a device with ``hardware.mxfp8``; another
    value than ``tensorwise`` without ``precision=fp8`` is refused).
    ``cuda_graphs``: ``none`` (the default: eager, as the engine runs) or a list of the scopes run
    inside captured CUDA graphs (:data:`tessera.cost.types.CUDA_GRAPH_SCOPES`, Megatron-Core
    ``--cuda-graph-modules`` names and ``full_iteration``), whose kernels cost the cost model no
    host time (``docs/cost-model.md``, "Host time and CUDA graphs"); the cost model's only. A scope
    named twice or one the model has no layer part for is refused
    (:func:`tessera.config.cost_rules.check_cuda_graph_layers`).
    ``init_from``: a Hugging Face directory of the model's family (config.json + *.safetensors:
    Qwen3-Next, Qwen3-MoE, DeepSeek-V3, Nemotron-H; :mod:`tessera.model.hf`) the weights
    of a fresh run start from (each rank reads its own tensors; a Tessera checkpoint to resume
    from takes precedence; :mod:`tessera.train.worker.hf_io`, ``docs/running.md``); null: seeded init.
    ``data``: ``pydoc`` (embedded) or ``.txt`` / ``.jsonl`` / ``.parquet`` files, one path, a glob
    or a list (:mod:`tessera.train.worker.corpus`); ``data_field``: the JSONL field / Parquet
    column holding the text; ``tokenizer``: ``bytes`` (null: the same) or a local
    ``tokenizer.json`` file or Hugging Face tokenizer directory
    (:mod:`tessera.train.worker.tokenizer`); ``data_cache``: the token cache directory
    (relative: under ``logging.out_dir``), where a tokenizer's encoded corpus is kept."""

    steps: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    data: Any = "pydoc"
    data_field: str = "text"
    tokenizer: Optional[str] = "bytes"
    data_cache: str = "data-cache"
    checkpoint_every: int = 0
    resume: bool = False
    deterministic: bool = True
    precision: str = "auto"
    master_weights: bool = True
    init_from: Optional[str] = None
    fp8_recipe: str = "tensorwise"
    cuda_graphs: Any = "none"


@dataclass(frozen=True)
class LoggingConfig:
    """Where results go: output directory, W&B project/mode, trace and PNG outputs.

    out_dir: the directory of the training job's run directories (``<out_dir>/<run name>/``:
        checkpoints, ``plan_history.json``, ``metrics.jsonl``, ...; Ray Train's ``storage_path``)
        and of ``tessera plan`` / ``simulate`` outputs: a local path (relative: to the working
        directory; a shared mount on a cluster), or an object-store prefix ``s3://BUCKET/PATH``
        or ``gs://BUCKET/PATH``, read and written through ``pyarrow.fs`` with credentials and
        endpoint from the standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``,
        ``GOOGLE_APPLICATION_CREDENTIALS``, ...; :mod:`tessera.train.storage`). With an object
        store, what must be on a local disk (the token and profile caches, ``tessera plan`` /
        ``simulate`` files) goes to ``~/.cache/tessera/<scheme>/<bucket>/<path>``
        (:func:`tessera.config.storage_rules.local_dir`). Another ``scheme://`` is refused.
    """

    out_dir: str = "out"
    wandb_project: str = "tessera"
    wandb_mode: str = "offline"
    trace: bool = True
    png: bool = True


@dataclass(frozen=True)
class JobConfig:
    """The Ray Train job of ``tessera train`` (``docs/running.md``); ``tessera simulate`` and
    ``tessera plan`` check but do not use it. The ``tessera train`` flags ``--run-name``,
    ``--namespace``, ``--max-failures``, ``--cpus-per-worker``, ``--detached-driver``,
    ``--keep-driver`` and ``--oversubscribe`` are spellings of these fields.

    run_name: the run directory's name under ``logging.out_dir`` (null: ``<name>-<yyyymmdd-hhmmss>``,
        or with ``train.resume`` the newest run of the recipe that has a complete checkpoint).
    namespace: Ray namespace of the driver actor.
    max_failures: worker-group restarts before the job fails (-1: no limit; Ray Train's meaning).
    cpus_per_worker: Ray CPUs per worker (null: on CPU recipes the cluster's CPUs shared evenly,
        at most 1; on GPU recipes 1).
    threads: torch and OpenMP threads per worker (null: the worker's whole CPUs, at least 1).
    detached_driver: the driver actor outlives the launcher (else the job owns it).
    keep_driver: the launcher does not kill the driver actor at the end.
    pg_timeout_s: torch process-group timeout, seconds (a hung collective fails after it).
    num_to_keep: checkpoints Ray Train keeps (null: all).
    reshard_method: how a plan upgrade that moves layers moves parameters and optimizer state
        between pipeline ranks: ``p2p`` (point-to-point sends of the moved layers) or ``dcp``
        (``torch.distributed.checkpoint`` save and resharded load); ``docs/operations.md`` has both
        measured.
    upgrade_lead_steps: how many iterations after the one running when it arrives an accepted
        plan upgrade is announced to take effect (>= 1; from 2 on the announced step is the
        switch step; ``docs/operations.md``).
    socket_ifname: the network interface(s) gloo and NCCL use between workers, comma-separated
        names (set as ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` on every worker; null:
        not set, the launcher's own values of those variables pass on; ``docs/running.md``,
        multi-node).
    oversubscribe: on CPU recipes, run more than
        :data:`tessera.train.job.preflight.MAX_THREADS_PER_CPU` busy threads (workers x
        ``job.threads``) per CPU of the cluster, which pre-flight otherwise refuses.
    resources_per_worker: extra Ray resources every worker asks for besides its CPU share and
        GPU (name -> amount, Ray Train's ``ScalingConfig(resources_per_worker=...)``; null: none),
        so the workers run only on nodes that offer them: a custom resource started with
        ``ray start --resources '{"trainer": 8}'`` (one unit per worker slot of a node), an
        accelerator type (``accelerator_type:H100``), a node (``node:10.0.0.5``). ``CPU`` and
        ``GPU`` are ``job.cpus_per_worker`` and ``hardware.preset``'s.
    """

    run_name: Optional[str] = None
    namespace: str = "tessera"
    max_failures: int = 3
    cpus_per_worker: Optional[float] = None
    threads: Optional[int] = None
    detached_driver: bool = False
    keep_driver: bool = False
    pg_timeout_s: float = 300.0
    num_to_keep: Optional[int] = 3
    upgrade_lead_steps: int = 2
    reshard_method: str = "p2p"
    socket_ifname: Optional[str] = None
    oversubscribe: bool = False
    resources_per_worker: Optional[dict] = None


@dataclass(frozen=True)
class AutopilotConfig:
    """The autopilot of a running job (``docs/operations.md``, "Autopilot"): the job measures each
    pipeline rank's slowdown and the routing skew, re-plans when they move, switches live where
    the simulator predicts a gain and rolls back a switch that made the job slower.

    enabled: run it (the workers time their tasks every ``profile.check_every`` steps, the
        driver decides; ``tessera upgrade --autopilot on|off`` pauses and resumes the decisions).
    slowdown_threshold: a pipeline rank's slowdown over the one the running plan was made for
        (or under its inverse) that makes the autopilot re-plan; > 1 (1.15: 15 % slower).
    skew_threshold: the same for the routing skew (the busiest EP rank's tokens over the mean
        rank's); > 1.
    margin: the predicted gain (fraction of the running plan's simulated iteration time) a new
        plan must beat to be switched to; in [0, 1).
    holdoff_steps: steps after a decision or a switch before the next decision; >= 0.
    checks: estimates are medians over this many checks (and none is acted on before that
        many); >= 1.
    verify_steps: iterations after a switch whose median time is compared with the median
        before it (a switch slower beyond noise is rolled back); >= 1.
    max_switches_per_hour: at most this many switches in any hour (rollbacks not counted); >= 0
        (0: decide and record, never switch).
    replan_time_s: wall-clock cap of one re-plan on the driver, seconds (the planner's
        ``search_time_s`` and ``time_limit_s`` capped to it); > 0.
    """

    enabled: bool = False
    slowdown_threshold: float = 1.15
    skew_threshold: float = 1.3
    margin: float = 0.05
    holdoff_steps: int = 20
    checks: int = 3
    verify_steps: int = 10
    max_switches_per_hour: int = 4
    replan_time_s: float = 60.0


@dataclass(frozen=True)
class RecipeConfig:
    """The whole recipe (its sections in order; :class:`tessera.config.load.Recipe` adds the methods)."""

    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    dbo: DBOConfig = field(default_factory=DBOConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    job: JobConfig = field(default_factory=JobConfig)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
