"""Model specification: the layer sequence of a (heterogeneous) MoE decoder, with kinds and dims.

A :class:`ModelSpec` is a frozen, JSON-serialisable value. Each :class:`LayerSpec` holds one
token mixer (softmax/gated attention, MLA, Gated DeltaNet, Mamba-2, or none) and one channel
mixer (MoE, dense MLP, or none). Hybrid models whose pattern has single-block layers
(Nemotron-H: ``M`` = Mamba-2 only, ``E`` = MoE only, ``*`` = attention only, ``-`` = dense MLP
only) use ``None`` for the missing half.

Dims follow the public configs (see ``tessera.spec.presets`` and ``shared/design/MODELS.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Union


@dataclass(frozen=True)
class AttentionSpec:
    """Softmax attention with grouped KV heads (GQA); ``gated`` adds a sigmoid output gate
    produced by ``q_proj`` (Qwen3-Next gated attention)."""

    kind: ClassVar[str] = "attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gated: bool = False
    rotary_fraction: float = 1.0


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    kind: ClassVar[str] = "mla"
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DeltaNetSpec:
    """Gated DeltaNet linear attention (Qwen3-Next ``linear_attention``)."""

    kind: ClassVar[str] = "deltanet"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba-2 SSD mixer (Nemotron-H ``M`` layers)."""

    kind: ClassVar[str] = "mamba2"
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    chunk_size: int = 128


@dataclass(frozen=True)
class MoESpec:
    """Sparse MoE: ``num_experts`` routed experts (SwiGLU, ``expert_ffn`` wide), ``top_k`` per
    token, plus an optional shared expert of width ``shared_expert_ffn`` (0 = none).
    ``latent_dim`` > 0 runs the routed experts in a smaller latent space (Nemotron 3 Super).
    ``gated=False``: experts (and the shared expert) are plain two-matrix MLPs (Nemotron-H
    squared-ReLU experts, transformers ``NemotronHExperts`` up_proj/down_proj).
    ``num_groups`` / ``topk_groups``: group-limited routing (HF ``n_group`` / ``topk_group``): the
    experts form ``num_groups`` equal groups and a token's top-k lie in at most ``topk_groups`` of
    them (DeepSeek-V3: 8 / 4, its report's node-limited routing, "each token is sent to at most
    M = 4 nodes", sec. 3.2). 1 / 1: no limit. The cost model reads them (A2A traffic of the
    ``deepep`` dispatcher) and the ``sigmoid`` router applies them.
    ``router``: ``"softmax"`` (top-k of the softmax probabilities, renormalised for k > 1:
    DeepSpeed's ``TopKGate``, Qwen3) or ``"sigmoid"`` (DeepSeek-V3 report sec. 2.1.2: sigmoid
    affinities, the expert chosen on affinity + a correction bias within the ``topk_groups`` best
    groups, gates = the chosen affinities normalised to sum 1, times ``routed_scaling``;
    transformers ``DeepseekV3TopkRouter`` / ``NemotronHTopkRouter``).
    ``routed_scaling``: factor on the routed experts' gates (HF ``routed_scaling_factor``;
    ``sigmoid`` router only). ``shared_expert_gate``: the shared expert's output is scaled by
    ``sigmoid(shared_expert_gate(x))`` (Qwen3-Next); DeepSeek-V3 and Nemotron-H add it ungated.
    ``bias_update_rate``: the ``sigmoid`` router's aux-loss-free balancing speed gamma (the
    correction bias moves by gamma per step against each expert's load; DeepSeek-V3 report
    sec. 4.2: 0.001); 0: the bias stays as loaded."""

    kind: ClassVar[str] = "moe"
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_expert_ffn: int = 0
    latent_dim: int = 0
    aux_loss_coef: float = 0.001
    gated: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    router: str = "softmax"
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True
    bias_update_rate: float = 0.0


@dataclass(frozen=True)
class DenseMLPSpec:
    """Dense SwiGLU MLP of width ``ffn`` (``gated=False``: plain two-matrix MLP, e.g. squared-ReLU)."""

    kind: ClassVar[str] = "dense"
    ffn: int
    gated: bool = True


MixerSpec = Union[AttentionSpec, MLASpec, DeltaNetSpec, Mamba2Spec]
MlpSpec = Union[MoESpec, DenseMLPSpec]

MIXER_TYPES: dict[str, type] = {c.kind: c for c in (AttentionSpec, MLASpec, DeltaNetSpec, Mamba2Spec)}
MLP_TYPES: dict[str, type] = {c.kind: c for c in (MoESpec, DenseMLPSpec)}

# One-letter codes used in layer-kind strings, tables and plots.
MIXER_CODE = {"attention": "A", "mla": "L", "deltanet": "D", "mamba2": "M", None: "-"}
MLP_CODE = {"moe": "E", "dense": "F", None: "-"}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: ``mixer`` then ``mlp``; either may be ``None`` (not both)."""

    index: int
    mixer: MixerSpec | None
    mlp: MlpSpec | None

    @property
    def code(self) -> str:
        """Two-letter kind code, e.g. ``"DE"`` (DeltaNet + MoE), ``"AE"``, ``"M-"``, ``"-E"``."""
        return MIXER_CODE[self.mixer.kind if self.mixer else None] + MLP_CODE[self.mlp.kind if self.mlp else None]

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoESpec)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model: embedding, ``layers``, final norm and output head.

    Attributes:
        name: preset or config name.
        hidden: model width (d_model).
        vocab: vocabulary size.
        layers: the decoder layers in order; ``layers[i].index == i``.
        tie_embeddings: input embedding shared with the output head.
        mtp_layers: multi-token-prediction layers after the head (DeepSeek-V3: 1); costed on the
            last stage like an extra layer of the last layer's kind.
        rope_theta: RoPE base of the attention layers (HF ``rope_theta``, or
            ``rope_parameters["rope_theta"]`` in transformers 5). Default 10000.0, the transformers
            ``Qwen3NextConfig`` / ``Qwen3MoeConfig`` default; each preset names its source.
        max_positions: longest sequence the positions cover, tokens (HF
            ``max_position_embeddings``). Default 32768, the transformers ``Qwen3NextConfig``
            default. An executable attention layer refuses longer microbatches.
    """

    name: str
    hidden: int
    vocab: int
    layers: tuple[LayerSpec, ...]
    tie_embeddings: bool = False
    mtp_layers: int = 0
    rope_theta: float = 10000.0
    max_positions: int = 32768

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe(self) -> MoESpec | None:
        """The MoE spec of the first MoE layer (all MoE layers share it in every preset)."""
        return next((l.mlp for l in self.layers if isinstance(l.mlp, MoESpec)), None)

    @property
    def family(self) -> str:
        """The transformers model family whose modules build this model and whose checkpoint
        format it exports: ``"deepseek_v3"`` (any MLA layer), ``"nemotron_h"`` (any Mamba-2
        layer, single-block layer, non-gated MLP or attention without RoPE), ``"qwen3_next"``
        (any Gated DeltaNet or gated attention layer), else ``"qwen3_moe"``."""
        mixers = [l.mixer for l in self.layers]
        if any(isinstance(m, MLASpec) for m in mixers):
            return "deepseek_v3"
        if any(isinstance(m, Mamba2Spec) or (isinstance(m, AttentionSpec) and m.rotary_fraction == 0.0)
               or l.mixer is None or l.mlp is None or not getattr(l.mlp, "gated", True) for m, l in zip(mixers, self.layers)):
            return "nemotron_h"
        if any(isinstance(m, DeltaNetSpec) or (isinstance(m, AttentionSpec) and m.gated) for m in mixers):
            return "qwen3_next"
        return "qwen3_moe"

    @property
    def kinds(self) -> str:
        """Layer-kind codes joined by spaces, e.g. ``"DE DE DE AE ..."``."""
        return " ".join(l.code for l in self.layers)

    def to_dict(self) -> dict:
        """JSON-ready dict; each mixer/mlp dict carries its ``kind``."""
        def part(p):
            return None if p is None else {"kind": p.kind, **dataclasses.asdict(p)}

        return {
            "name": self.name, "hidden": self.hidden, "vocab": self.vocab,
            "tie_embeddings": self.tie_embeddings, "mtp_layers": self.mtp_layers,
            "rope_theta": self.rope_theta, "max_positions": self.max_positions,
            "layers": [{"index": l.index, "mixer": part(l.mixer), "mlp": part(l.mlp)} for l in self.layers],
        }

    @staticmethod
    def from_dict(d: dict) -> "ModelSpec":
        """Inverse of :meth:`to_dict`; a dict without ``rope_theta`` / ``max_positions`` (written
        before they existed) gets the defaults."""
        def part(p, types):
            if p is None:
                return None
            p = dict(p)
            return types[p.pop("kind")](**p)

        layers = tuple(
            LayerSpec(l["index"], part(l["mixer"], MIXER_TYPES), part(l["mlp"], MLP_TYPES)) for l in d["layers"]
        )
        return ModelSpec(d["name"], d["hidden"], d["vocab"], layers, d.get("tie_embeddings", False), d.get("mtp_layers", 0),
                         float(d.get("rope_theta", 10000.0)), int(d.get("max_positions", 32768)))
