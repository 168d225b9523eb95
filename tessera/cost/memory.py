"""Per-layer memory: parameters, gradients, optimizer state and activations (bytes).

Static memory (Megatron-LM mixed precision with the distributed optimizer, Megatron-LM
``docs/source/api-guide/dist_optimizer.md``: 2 B BF16 param + 4 B FP32 grad + 12 B FP32
master/m/v per parameter, the 12 B sharded over the parameter's data-parallel group):

* dense (non-expert) parameters are split over ``tp``; their optimizer state over ``dp``;
* routed experts are split over ``ep`` (``num_experts/ep`` experts per GPU); their optimizer state
  over the expert-data-parallel group ``max(1, dp*tp // ep)`` (Megatron-Core carves EP from dp*tp).

Activations (bytes per in-flight microbatch, on one GPU) follow the tensor-by-tensor accounting
of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
sec. 4: every tensor a backward kernel reads is stored in BF16 (2 B/elem). Differences from their
``sbh(34 + 5as/h)``: FlashAttention-2 stores Q, K, V, O and an FP32 log-sum-exp instead of the
s x s softmax (no ``5as^2b`` term), no dropout masks (these models train with dropout 0), SwiGLU
and gates add their inputs. With sequence parallelism everything is divided by ``tp``
(Korthikanti et al. sec. 4.2.2). With full recomputation only the layer input (2*s*b*h) stays.
A GPT-3 layer (GELU 4h MLP, QK-norm inputs counted) comes to 36*sbh plus a FP32 LSE, against
Korthikanti's 34*sbh + 5*a*s^2*b (see docs/cost-model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost.flops import BF16, FP32
from tessera.spec.model import (AttentionSpec, DeltaNetSpec, DenseMLPSpec, LayerSpec, Mamba2Spec, MLASpec,
                                ModelSpec, MoESpec)

PARAM_BYTES = BF16  # BF16 weights
GRAD_BYTES = FP32  # FP32 main grads (Megatron-LM accumulates into FP32 buffers)
OPTIM_BYTES = 3 * FP32  # FP32 master copy + Adam m + v


@dataclass(frozen=True)
class ParamSplit:
    """Parameter count of one layer (or embedding/head): ``dense`` (TP-sharded, replicated over
    EP) and ``expert`` (all routed experts of the layer, EP-sharded)."""

    dense: float
    expert: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass(frozen=True)
class ActivationBytes:
    """Activations of one layer for one microbatch on one GPU, bytes: ``stored`` (held between F
    and B) and ``gemm_inputs`` (the stored GEMM inputs the W tasks read after B)."""

    stored: float
    gemm_inputs: float


def mixer_params(mixer, hidden: int) -> float:
    """Parameters of one token mixer with its input RMSNorm (transformers module layouts)."""
    h = hidden
    if mixer is None:
        return 0.0
    if isinstance(mixer, AttentionSpec):
        q, kv = mixer.num_heads * mixer.head_dim, mixer.num_kv_heads * mixer.head_dim
        return h * q * (2 if mixer.gated else 1) + 2 * h * kv + q * h + 2 * mixer.head_dim + h
    if isinstance(mixer, MLASpec):
        nh, ql, kvl, rope = mixer.num_heads, mixer.q_lora_rank, mixer.kv_lora_rank, mixer.qk_rope_head_dim
        return (h * ql + ql + ql * nh * (mixer.qk_nope_head_dim + rope) + h * (kvl + rope) + kvl
                + kvl * nh * (mixer.qk_nope_head_dim + mixer.v_head_dim) + nh * mixer.v_head_dim * h + h)
    if isinstance(mixer, DeltaNetSpec):
        qk, nv = mixer.num_key_heads * mixer.key_head_dim, mixer.num_value_heads
        v = nv * mixer.value_head_dim
        return (h * (2 * qk + 2 * v + 2 * nv) + mixer.conv_kernel * (2 * qk + v) + 2 * nv
                + mixer.value_head_dim + v * h + h)
    if isinstance(mixer, Mamba2Spec):
        d_in, gn = mixer.num_heads * mixer.head_dim, mixer.n_groups * mixer.state_size
        return (h * (2 * d_in + 2 * gn + mixer.num_heads) + (mixer.conv_kernel + 1) * (d_in + 2 * gn)
                + 3 * mixer.num_heads + d_in + d_in * h + h)
    raise TypeError(f"unknown mixer spec {type(mixer).__name__}")


def mlp_params(mlp, hidden: int) -> ParamSplit:
    """Parameters of one channel mixer with its pre-MLP RMSNorm: router (+ expert bias), latent
    projections and shared expert are dense; routed experts (SwiGLU: 3 matrices, ``gated=False``:
    2) are ``expert``."""
    h = hidden
    if mlp is None:
        return ParamSplit(0.0)
    if isinstance(mlp, DenseMLPSpec):
        return ParamSplit((3 if mlp.gated else 2) * h * mlp.ffn + h)
    if isinstance(mlp, MoESpec):
        width = mlp.latent_dim if mlp.latent_dim > 0 else h
        mats = 3 if mlp.gated else 2
        dense = h + h * mlp.num_experts + mlp.num_experts + mats * h * mlp.shared_expert_ffn + 2 * h * mlp.latent_dim
        return ParamSplit(dense, mlp.num_experts * mats * width * mlp.expert_ffn)
    raise TypeError(f"unknown mlp spec {type(mlp).__name__}")


def layer_params(layer: LayerSpec, hidden: int) -> ParamSplit:
    """Parameters of one decoder layer split into dense and routed-expert parts."""
    m = mlp_params(layer.mlp, hidden)
    return ParamSplit(mixer_params(layer.mixer, hidden) + m.dense, m.expert)


def head_params(model: ModelSpec, pp: int = 1) -> ParamSplit:
    """Final norm + output head (+ MTP modules: eh norms, eh-proj 2h*h, one layer of the last
    layer's kind, final norm; DeepSeek-V3 shares embedding and head with MTP). With tied
    embeddings the head owns a copy only when it is on another stage (pp > 1, Megatron-LM)."""
    h = model.hidden
    out = 0.0 if (model.tie_embeddings and pp == 1) else model.vocab * h
    dense, expert = out + h, 0.0
    if model.mtp_layers and model.layers:
        lp = layer_params(model.layers[-1], h)
        dense += model.mtp_layers * (3 * h + 2 * h * h + lp.dense)
        expert += model.mtp_layers * lp.expert
    return ParamSplit(dense, expert)


def static_bytes(params: ParamSplit, *, tp: int, ep: int, dp: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one GPU for ``params`` (see module docstring)."""
    dense, expert = params.dense / tp, params.expert / ep
    local = dense + expert
    edp = max(1, (dp * tp) // ep)
    return PARAM_BYTES * local, GRAD_BYTES * local, OPTIM_BYTES * (dense / dp + expert / edp)


def _mixer_act(mixer, h: int, t: float) -> ActivationBytes:
    """Stored activations of a mixer (input norm included), ``t`` tokens, no TP split."""
    norm_in, gemm_in = BF16 * t * h, BF16 * t * h  # norm input; normed x = first GEMM input
    if isinstance(mixer, AttentionSpec):
        q, kv = mixer.num_heads * mixer.head_dim, mixer.num_kv_heads * mixer.head_dim
        qkv = BF16 * t * (q + 2 * kv)  # after qk-norm/rope, read by flash-attn backward
        o = BF16 * t * q + FP32 * t * mixer.num_heads  # attention output + LSE
        gate = 2 * BF16 * t * q if mixer.gated else 0.0  # gate logits + gated output (o_proj input)
        pre = BF16 * t * (q + kv)  # q/k before the per-head QK RMSNorm (Qwen3 family)
        o_in = BF16 * t * q
        return ActivationBytes(norm_in + gemm_in + pre + qkv + o + gate, gemm_in + o_in)
    if isinstance(mixer, MLASpec):
        nh, dqk = mixer.num_heads, mixer.qk_nope_head_dim + mixer.qk_rope_head_dim
        ql, kvl, rope = mixer.q_lora_rank, mixer.kv_lora_rank, mixer.qk_rope_head_dim
        lat = BF16 * t * (2 * ql + kvl + rope + kvl)  # down outputs + normed (up GEMM inputs)
        qkv = BF16 * t * nh * (2 * dqk + mixer.v_head_dim)
        o = BF16 * t * nh * mixer.v_head_dim + FP32 * t * nh
        up_in = BF16 * t * (ql + kvl)
        return ActivationBytes(norm_in + gemm_in + lat + qkv + o, gemm_in + up_in + BF16 * t * nh * mixer.v_head_dim)
    if isinstance(mixer, DeltaNetSpec):
        qk, nv = mixer.num_key_heads * mixer.key_head_dim, mixer.num_value_heads
        v = nv * mixer.value_head_dim
        proj = BF16 * t * (2 * qk + 2 * v + 2 * nv)  # q, k, v (conv inputs), z, beta, g
        conv = BF16 * t * (2 * qk + v)  # conv/SiLU outputs (l2norm, delta-rule inputs)
        tri = BF16 * t * nv * mixer.chunk_size  # (I + A)^-1 per chunk, kept by the chunk kernel
        o = 2 * BF16 * t * v  # delta-rule output (gated-norm input) and out_proj input
        return ActivationBytes(norm_in + gemm_in + proj + conv + tri + o, gemm_in + BF16 * t * v)
    if isinstance(mixer, Mamba2Spec):
        d_in, gn = mixer.num_heads * mixer.head_dim, mixer.n_groups * mixer.state_size
        proj = BF16 * t * (2 * d_in + 2 * gn + mixer.num_heads)  # z, xBC (conv input), dt
        conv = BF16 * t * (d_in + 2 * gn)  # conv outputs: SSD x, B, C
        y = 2 * BF16 * t * d_in  # SSD output (gated-norm input) and out_proj input
        return ActivationBytes(norm_in + gemm_in + proj + conv + y, gemm_in + BF16 * t * d_in)
    raise TypeError(f"unknown mixer spec {type(mixer).__name__}")


def _swiglu_act(t: float, width: int, ffn: int, gated: bool = True) -> ActivationBytes:
    """fc1 input, fc1 output(s), activation output (fc2 input)."""
    up = 2 * ffn if gated else ffn
    return ActivationBytes(BF16 * t * (width + up + ffn), BF16 * t * (width + ffn))


def _mlp_act(mlp, h: int, tokens: float, tp: int) -> ActivationBytes:
    """Stored activations of a channel mixer on one GPU (pre-MLP norm included)."""
    if isinstance(mlp, DenseMLPSpec):
        a = _swiglu_act(tokens, h, mlp.ffn, mlp.gated)
        return ActivationBytes((BF16 * tokens * h + a.stored) / tp, a.gemm_inputs / tp)
    t = tokens / tp
    width = mlp.latent_dim if mlp.latent_dim > 0 else h
    a = t * mlp.top_k  # token-expert assignments on this GPU under balanced routing
    norm_router = 2 * BF16 * t * h + FP32 * t * mlp.num_experts  # norm in, router in, FP32 probs
    ex = _swiglu_act(a, width, mlp.expert_ffn, mlp.gated)
    expert_out = BF16 * a * width  # expert outputs: combine backward needs them for d(prob)
    latent = 2 * BF16 * t * mlp.latent_dim  # latent up-proj input (combined tokens), down-proj out
    stored = norm_router + ex.stored + expert_out + latent
    gemm_in = BF16 * t * h + ex.gemm_inputs + (BF16 * t * mlp.latent_dim if mlp.latent_dim else 0.0)
    if mlp.shared_expert_ffn:
        s = _swiglu_act(tokens, h, mlp.shared_expert_ffn, mlp.gated)
        stored += (s.stored - BF16 * tokens * h) / tp  # fc1 input shared with the router input
        gemm_in += (s.gemm_inputs - BF16 * tokens * h) / tp
    return ActivationBytes(stored, gemm_in)


def layer_activation(layer: LayerSpec, hidden: int, tokens: float, *, tp: int = 1,
                     recompute: bool = False) -> ActivationBytes:
    """Activations of one decoder layer for one microbatch (``tokens`` = micro_batch_size *
    seq_length) on one GPU, bytes. ``recompute``: only the layer input 2*s*b*h/tp is stored
    (Korthikanti et al. "full recomputation"); ``gemm_inputs`` are what B recomputed and W reads."""
    h = hidden
    stored, gin = 0.0, 0.0
    if layer.mixer is not None:
        m = _mixer_act(layer.mixer, h, tokens)
        stored, gin = stored + m.stored / tp, gin + m.gemm_inputs / tp
    if layer.mlp is not None:
        m = _mlp_act(layer.mlp, h, tokens, tp)
        stored, gin = stored + m.stored, gin + m.gemm_inputs
    if recompute:
        stored = BF16 * tokens * h / tp
    return ActivationBytes(stored, gin)


def head_activation(model: ModelSpec, tokens: float, *, tp: int = 1, recompute: bool = False) -> ActivationBytes:
    """Final norm input, output-GEMM input and the FP32 softmax of the vocab-parallel
    cross-entropy (4*tokens*vocab/tp, Megatron-LM keeps it for the backward), plus MTP modules."""
    h, v = model.hidden, model.vocab
    one = ActivationBytes((2 * BF16 * tokens * h + FP32 * tokens * v) / tp, BF16 * tokens * h / tp)
    stored, gin = one.stored, one.gemm_inputs
    if model.mtp_layers and model.layers:
        lay = layer_activation(model.layers[-1], h, tokens, tp=tp, recompute=recompute)
        eh = 2 * 2 * BF16 * tokens * h / tp  # eh norm inputs and eh-proj input (2h wide)
        stored += model.mtp_layers * (lay.stored + eh + one.stored)
        gin += model.mtp_layers * (lay.gemm_inputs + BF16 * 2 * tokens * h / tp + one.gemm_inputs)
    return ActivationBytes(stored, gin)
