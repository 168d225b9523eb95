"""Executable heterogeneous MoE layers split into tasks (mixer, router, dispatch, expert, shared,
combine, mlp, embed, head), with deferrable weight gradients (W) and expert-parallel all-to-all.

Modules: :mod:`~tessera.model.wgrad` (SplitLinear, DeferredWGrad, run_w),
:mod:`~tessera.model.moe` (MoEBlock, RouteInfo, MoEOptions), :mod:`~tessera.model.layers`
(DecoderLayer), :mod:`~tessera.model.recompute` and :mod:`~tessera.model.regions` (activation
recompute: Recompute, checkpointed and output-discarding regions), :mod:`~tessera.model.saved`
(SavedTensorMeter: bytes held by autograd's saved tensors), :mod:`~tessera.model.precision`
(compute dtype and autocast), :mod:`~tessera.model.ep` (EP exchange: shared plan, synchronous and asynchronous
fronts), :mod:`~tessera.model.hostsync` (HostSyncs: counting host synchronisations),
:mod:`~tessera.model.determinism` (deterministic kernels, receive buffers without their fill),
:mod:`~tessera.model.stage`
(StageModule), :mod:`~tessera.model.tasks` (the per-layer task split the engine runs). Importing this package imports torch, transformers and DeepSpeed (CPU accelerator
when no CUDA device is present).
"""

from tessera.model.layers import DecoderLayer
from tessera.model.moe import Dispatched, MoEBlock, MoEOptions, RouteInfo
from tessera.model.recompute import LayerRecompute, Recompute
from tessera.model.stage import Embedding, Head, StageModule
from tessera.model.wgrad import DeferredWGrad, SplitLinear, run_w, split_linears

__all__ = [
    "DecoderLayer", "DeferredWGrad", "Dispatched", "Embedding", "Head", "MoEBlock", "MoEOptions", "RouteInfo",
    "LayerRecompute", "Recompute", "SplitLinear", "StageModule", "run_w", "split_linears",
]
