"""Typed recipe schema (omegaconf structured configs).

A recipe YAML has the sections below; ``tessera.config.load.load_recipe`` merges the YAML and
``key=value`` overrides onto these dataclasses, validates, and returns a frozen :class:`Recipe`.
Every field is documented in ``docs/recipes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    """Which model: exactly one *source*, ``preset``, ``hf_config`` or ``inline``. The recipe file
    and the override list are two layers: each may set at most one source, and a source set by an
    override replaces the recipe's (``tessera.config.load``; ``docs/recipes.md``).

    preset: a name from ``tessera.spec.presets.MODEL_PRESETS`` (e.g. ``qwen3-next-80b-a3b``).
    hf_config: path to a HuggingFace ``config.json`` on disk.
    inline: a ModelSpec dict (``ModelSpec.to_dict`` format) or a pattern dict (see docs).
    num_layers: if > 0, keep only the first ``num_layers`` layers (for quick experiments).
    """

    preset: Optional[str] = None
    hf_config: Optional[str] = None
    inline: Optional[dict] = None
    num_layers: int = 0


@dataclass
class ParallelConfig:
    """Parallel layout and batch shape.

    pp: pipeline ranks; vpp: virtual stages (model chunks) per pipeline rank; ep: expert-parallel
    group size; tp: tensor-parallel size; dp: data-parallel replicas (EP is carved from dp*tp as in
    Megatron-Core); num_microbatches: microbatches per iteration per pipeline;
    micro_batch_size: sequences per microbatch; seq_length: tokens per sequence.
    """

    pp: int = 1
    vpp: int = 1
    ep: int = 1
    tp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    micro_batch_size: int = 1
    seq_length: int = 4096


@dataclass
class HardwareConfig:
    """Which device. ``preset`` names one of ``tessera.spec.hardware_presets.HARDWARE_PRESETS``;
    ``inline`` gives HardwareSpec fields that override the preset's."""

    preset: str = "h800"
    inline: Optional[dict] = None


@dataclass
class PlannerConfig:
    """Pipeline template and planner knobs.

    template: ``1f1b`` | ``interleaved-1f1b`` | ``dualpipe-v``.
    overlap: co-execute the forward chunk of one microbatch with the backward chunk of another in
        the steady state (templates that support it).
    split_w: run weight gradients (W) as separate, deferrable tasks.
    cost_source: ``analytic`` (default), later ``profile`` or ``trace``.
    candidate_radius: layers by which candidate stage boundaries may move from the serial-balanced
        partition.
    prune: drop pairs costlier than the baseline bottleneck before the MILP.
    time_limit_s: MILP solver time limit, seconds.
    memory_margin: fraction of device memory kept free (fragmentation, workspace).
    activation_recompute: recompute activations in backward (stores only layer inputs).
    """

    template: str = "interleaved-1f1b"
    overlap: bool = True
    split_w: bool = True
    cost_source: str = "analytic"
    candidate_radius: int = 1
    prune: bool = True
    time_limit_s: float = 60.0
    memory_margin: float = 0.05
    activation_recompute: bool = False


@dataclass
class DBOConfig:
    """Dynamic bubble optimizer: enabled, pool memory cap (GB), slot prediction margin.

    The optimizer is not available yet: ``enabled`` must be false (validated); ``pool_mem_gb`` and
    ``margin`` are range-checked but not read by anything yet."""

    enabled: bool = False
    pool_mem_gb: float = 4.0
    margin: float = 0.1


@dataclass
class TrainConfig:
    """Training loop: steps, learning rate, seed, data source, checkpointing."""

    steps: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    data: str = "pydoc"
    checkpoint_every: int = 0
    resume: bool = False
    deterministic: bool = True


@dataclass
class LoggingConfig:
    """Where results go: output directory, W&B project/mode, trace and PNG outputs."""

    out_dir: str = "out"
    wandb_project: str = "tessera"
    wandb_mode: str = "offline"
    trace: bool = True
    png: bool = True


@dataclass
class RecipeConfig:
    """The whole recipe (mutable omegaconf schema; see :class:`tessera.config.load.Recipe`)."""

    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    dbo: DBOConfig = field(default_factory=DBOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
