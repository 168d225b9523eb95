"""Upper bounds of the recipe values that scale work or memory, each with its reason.

:func:`tessera.config.validate.validate_recipe` checks them in constant time, before any cost,
plan or Program is built, so that a typo such as ``parallel.num_microbatches=100000000`` is one
error line instead of minutes of simulation. Every limit is generous: well above the largest
public training setups, and low enough that ``tessera simulate`` at the limit still finishes
(measured numbers in ``docs/recipes.md``, section "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    """One upper bound: ``value`` and why (the reason is part of the error message)."""

    value: int
    reason: str


MAX_LAYERS = 1024
MAX_NUM_MICROBATCHES = 4096
MAX_LAYER_MICROBATCHES = 262_144  # 2**18
MAX_TOKENS_PER_MICROBATCH = 16_777_216  # 2**24
MAX_MODEL_DIM = 16_777_216  # 2**24
MAX_GPUS = 1_048_576  # 2**20

PARALLEL: dict[str, Limit] = {
    "pp": Limit(MAX_LAYERS, "pipeline ranks; pp*vpp <= layers bounds it further"),
    "vpp": Limit(64, "model chunks per rank; Megatron-LM runs 2-8, each one adds instructions on every rank"),
    "ep": Limit(4096, "expert-parallel ranks; ep also divides the routed experts (public models have <= 512)"),
    "tp": Limit(128, "tensor-parallel ranks share one NVLink domain (8 GPUs in an HGX node, 72 in an NVL72 rack)"),
    "dp": Limit(65536, "data-parallel replicas; the largest public clusters have about 100k GPUs in all"),
    "num_microbatches": Limit(MAX_NUM_MICROBATCHES, "every microbatch adds instructions on every rank; "
                              "the simulator's work grows about linearly with it"),
    "micro_batch_size": Limit(4096, "sequences per microbatch"),
    "seq_length": Limit(1_048_576, "tokens per sequence; the longest public context windows are 1M tokens"),
}
"""``parallel.<field>`` -> its upper bound."""

MODEL_LAYERS = Limit(MAX_LAYERS, "8x the deepest public decoder (Llama 3.1 405B: 126 layers); the cost model, "
                                 "simulator and planner work per layer")
MTP_LAYERS = Limit(16, "multi-token-prediction modules (DeepSeek-V3: 1, Nemotron 3 Super: 2), each costed as a layer")
MODEL_DIM = Limit(MAX_MODEL_DIM, "above every public model's widths, head counts, experts and vocabulary (~262k)")
LAYER_MICROBATCHES = Limit(MAX_LAYER_MICROBATCHES, "the simulator runs every task of every layer for every "
                                                   "microbatch (48 layers x 4096 microbatches fit)")
TOKENS_PER_MICROBATCH = Limit(MAX_TOKENS_PER_MICROBATCH, "activation memory and time per microbatch grow with it")
GPUS = Limit(MAX_GPUS, "GPUs of one job (pp*dp*tp); the largest public clusters have about 100k")
CANDIDATE_RADIUS = Limit(4, "the planner's candidate ranges and pair costs grow quadratically with it; "
                            "tessera plan on qwen3-next-80b takes ~5 s at radius 1, ~30 s at 3, ~4 min at 6")
TIME_LIMIT_S = Limit(86_400, "one day")
SEARCH_EVALS = Limit(1_000_000, "each evaluation compiles and simulates a plan (0.03-0.3 s on real models), "
                                 "so a million is days")
