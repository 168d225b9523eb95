"""Per-layer memory: parameters, gradients, optimizer state and activations (bytes), and what
activation recompute re-runs.

**Static memory** per parameter (Megatron-LM mixed precision with the distributed optimizer,
Megatron-LM ``docs/source/api-guide/dist_optimizer.md``): 2 B BF16 param + 4 B FP32 main grad +
12 B FP32 master/m/v. Dense (non-expert) parameters are split over ``tp``, routed experts over
``ep`` (``num_experts/ep`` experts per GPU); a parameter's data-parallel group is ``dp`` for dense
parameters and the expert-data-parallel group ``max(1, dp*tp // ep)`` for experts
(Megatron-Core carves EP from dp*tp). ``parallel.dp_shard`` (:func:`static_bytes`):

* ``zero1`` (``--use-distributed-optimizer``): the 12 B of optimizer state are sharded over the
  group; BF16 params and the FP32 grad buffer are whole (the grads are reduce-scattered into the
  full-size buffer, each rank updating its shard).
* ``fsdp`` (PyTorch FSDP2 ``fully_shard``; Megatron-FSDP ``optim_grads_params``): params, grads
  and optimizer state, all 18 B, sharded over the group. Before each layer's forward and backward
  its parameters are all-gathered and freed after it (FSDP2 docs: "pre-forward/backward hooks
  all-gather the parameters ... post-forward/backward hooks free the unsharded parameters"), and
  the backward reduce-scatters the layer's unsharded gradient. The transient bytes
  (:func:`fsdp_transient_bytes`, ``LayerMemory.transient``) are ``2*2 + 4 = 8`` B per local
  parameter of a layer: its BF16 parameters and those of the layer being prefetched (bounded by
  the largest layer on the rank: the rank adds the largest ``transient`` of its layers) plus its
  unsharded FP32 gradient before the reduce-scatter. FSDP2 proper keeps FP32 sharded params as
  the master copy (16 B/dp, no separate BF16 shard); the 18 B of Megatron-FSDP are used
  (conservative by 2 B/dp).

``train.master_weights`` (:class:`~tessera.cost.types.CostOptions`): ``true`` (default) is the
mixed precision above; ``false`` is pure BF16 training, a BF16 model under FSDP2 with
``torch.optim.Adam`` as NeMo AutoModel's benchmark recipes run it (the model is built in its
config's BF16 ``torch_dtype``; ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
reduces in FP32 and stores the sharded gradient in the parameter dtype; Adam's m and v take the
parameter dtype): 2 B params + 2 B grads + 4 B Adam state = 8 B per parameter, sharded as above.

**Activations** (bytes per in-flight microbatch on one GPU) are the tensors backward kernels read
(:class:`SavedTensor`), after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4, in BF16 (2 B/elem, FP32 where the kernel keeps FP32). Differences
from their ``sbh(34 + 5as/h)``: FlashAttention-2 stores Q, K, V, O and an FP32 log-sum-exp
instead of the s x s softmax (no ``5as^2b`` term), no dropout masks (these models train with
dropout 0), SwiGLU and gates add their inputs. The router probabilities are applied inside the
expert activation (``act(fc1_out) * prob``, the fc2 input; Megatron-Core ``TEGroupedMLP`` with
``weighted_bias_swiglu_impl``, NeMo AutoModel ``GroupedExpertsDeepEP.expert_activation``), so the
combine is a plain sum that saves nothing: ``d(prob)`` comes from ``fc1_out``, which the
activation backward keeps anyway; the expert outputs are not stored. With sequence parallelism everything is divided by
``tp`` (Korthikanti et al. sec. 4.2.2). A GPT-3 layer (GELU 4h MLP, QK-norm inputs counted) comes
to 36*sbh plus a FP32 LSE, against Korthikanti's 34*sbh + 5*a*s^2*b (docs/cost-model.md).

Every saved tensor lists its readers (:class:`Reader`): a backward kernel, an FP8-capable linear
layer (``gemm``: a TransformerEngine linear, whose weight gradient W reads its input), or a GEMM
that stays BF16 (``gemm16``: the router and the output head). A tensor is stored while one of its
readers still holds it; what the cost options change:

* **recompute** (``planner.activation_recompute``, :class:`~tessera.cost.types.CostOptions`):
  ``full`` keeps only each layer's input ``2*s*b*h/tp`` (Korthikanti "full recomputation");
  ``selective`` drops every reader that a named Megatron-Core ``--recompute-modules`` module
  recomputes (Megatron-Core ``TransformerConfig.recompute_modules``): ``core_attn`` the attention
  core's own stores (with FlashAttention only the FP32 LSE and its reference to O: Q, K, V are the
  checkpoint's inputs and O feeds the gate / o_proj), ``mla_up_proj`` the MLA up-projection and
  RoPE outputs (the Q, K, V of the core, rebuilt from the normed latents), ``layernorm`` the
  outputs of the input and pre-MLP norms (the first GEMM inputs), ``moe_act`` the routed experts'
  activation outputs (fc2 inputs, rebuilt from fc1's outputs), ``mlp`` the dense MLP's internals
  (TransformerEngine's fused LayerNormMLP: everything but the block input), ``moe`` the MoE
  layer's internals (router probabilities, dispatched tokens, expert tensors, shared expert,
  latent projections; the normed input stays, it is the checkpoint's input), ``shared_experts``
  the shared expert's internals. Tensors that W reads stay in ``w_activation`` (B rebuilds them).
* **precision** ``fp8`` (TransformerEngine ``te.Linear``: the input is quantized once and the
  columnwise FP8 copy, 1 B/elem, is what the backward keeps for the weight gradient; TE docs,
  "Linear Module: End-to-End Walkthrough", "Save for Backward"): a tensor read by FP8 linear
  layers is stored as 1 B/elem; if a kernel or a BF16 GEMM also reads it, its BF16 copy stays
  beside the FP8 one. Scale factors (one per tensor or per 32 elements) are left out. Every
  ``train.fp8_recipe`` saves so (Transformer Engine 2.16 ``module/linear.py``: the row-wise copy
  is dropped, the column-wise one kept; under sequence parallelism a per-tensor recipe keeps the
  local row-wise shard instead, 1 B/elem of the local rows either way).

:func:`recompute_ops` says which forward operators each B task re-runs (its time goes into the B
task's duration, :func:`tessera.cost.analytic.layer_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tessera.cost.flops import BF16, FP8, FP32
from tessera.cost.types import CostOptions
from tessera.spec.model import (AttentionSpec, DeltaNetSpec, DenseMLPSpec, LayerSpec, Mamba2Spec, MLASpec,
                                ModelSpec, MoESpec)
from tessera.spec.tasks import TaskKind

PARAM_BYTES = BF16  # BF16 weights
GRAD_BYTES = FP32  # FP32 main grads (Megatron-LM accumulates into FP32 buffers)
OPTIM_BYTES = 3 * FP32  # FP32 master copy + Adam m + v
BF16_GRAD_BYTES = BF16  # pure BF16 (train.master_weights=false): gradients in the parameter dtype
BF16_OPTIM_BYTES = 2 * BF16  # pure BF16: Adam m + v in the parameter dtype, no master copy
FSDP_TRANSIENT_BYTES = 2 * PARAM_BYTES + GRAD_BYTES
"""Transient FSDP bytes per local parameter of a layer: its all-gathered BF16 parameters, the
prefetched next layer's (bounded by the same size) and its unsharded FP32 gradient."""

KERNEL, GEMM, GEMM16 = "kernel", "gemm", "gemm16"
"""Reader kinds (:class:`Reader`): a backward kernel; an FP8-capable linear layer; a BF16 GEMM."""
ALL_OPS = frozenset({"*"})
"""In :func:`recompute_ops`: every operator of the task re-runs (with its TP collectives)."""


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


@dataclass(frozen=True)
class Reader:
    """One backward reader of a saved tensor: ``kind`` (:data:`KERNEL`, :data:`GEMM`,
    :data:`GEMM16`) and the selective-recompute ``modules`` that drop its copy (the reader's
    forward re-runs in the backward, or the tensor is an output they discard and rebuild)."""

    kind: str
    modules: frozenset[str] = frozenset()


@dataclass(frozen=True)
class SavedTensor:
    """One tensor the backward reads: ``elems`` elements on one GPU (after the TP split),
    ``width`` bytes per element when not FP8 (2: BF16, 4: FP32), its ``readers``."""

    name: str
    elems: float
    width: int
    readers: tuple[Reader, ...]

    def stored_bytes(self, dropped: frozenset[str], fp8: bool) -> float:
        """Bytes held between F and B when the modules ``dropped`` are recomputed, ``fp8``: FP8
        linear layers keep a 1 B copy (module docstring)."""
        live = [r for r in self.readers if not (r.modules & dropped)]
        wide = any(r.kind != GEMM or not fp8 for r in live)
        narrow = fp8 and any(r.kind == GEMM for r in live)
        return self.elems * (self.width * wide + FP8 * narrow)

    def w_bytes(self, fp8: bool) -> float:
        """Bytes the W tasks read after B (0 if no GEMM reads the tensor); recomputed tensors
        count too: B rebuilds them and W reads them."""
        wide = any(r.kind == GEMM16 or (r.kind == GEMM and not fp8) for r in self.readers)
        narrow = fp8 and any(r.kind == GEMM for r in self.readers)
        return self.elems * (self.width * wide + FP8 * narrow)


def _t(name: str, elems: float, *readers: tuple[str, tuple[str, ...]], width: int = BF16) -> SavedTensor:
    return SavedTensor(name, elems, width, tuple(Reader(k, frozenset(m)) for k, m in readers))


_K = (KERNEL, ())  # a backward kernel no module drops
_G = (GEMM, ())  # an FP8-capable linear layer no module drops


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


def static_bytes(params: ParamSplit, *, tp: int, ep: int, dp: int,
                 dp_shard: str = "zero1", master_weights: bool = True) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one GPU for ``params`` (module docstring): ``zero1``
    shards the 12 B of optimizer state over the data-parallel group, ``fsdp`` all 18 B;
    ``master_weights=False`` (pure BF16) has 2 B grads and 4 B of Adam state, 8 B in all."""
    dense, expert = params.dense / tp, params.expert / ep
    edp = max(1, (dp * tp) // ep)
    shard = dense / dp + expert / edp
    grad_b, optim_b = (GRAD_BYTES, OPTIM_BYTES) if master_weights else (BF16_GRAD_BYTES, BF16_OPTIM_BYTES)
    if dp_shard == "fsdp":
        return PARAM_BYTES * shard, grad_b * shard, optim_b * shard
    if dp_shard != "zero1":
        raise ValueError(f"static_bytes: dp_shard={dp_shard!r}: use zero1 or fsdp")
    local = dense + expert
    return PARAM_BYTES * local, grad_b * local, optim_b * shard


def fsdp_transient_bytes(params: ParamSplit, *, tp: int, ep: int, dp_shard: str = "zero1") -> float:
    """Bytes live only while a layer computes, on one GPU: under ``fsdp``
    :data:`FSDP_TRANSIENT_BYTES` per local parameter (``dense/tp + expert/ep``; module
    docstring); 0 under ``zero1`` (parameters stay resident)."""
    if dp_shard != "fsdp":
        return 0.0
    return FSDP_TRANSIENT_BYTES * (params.dense / tp + params.expert / ep)


def _mixer_tensors(mixer, h: int, t: float) -> list[SavedTensor]:
    """Saved tensors of a token mixer with its input norm, ``t`` tokens, no TP split."""
    ln = (GEMM, ("layernorm",))  # the normed input: the first GEMM's input
    out = [_t("input", t * h, _K), _t("normed", t * h, ln)]
    if isinstance(mixer, AttentionSpec):
        q, kv = mixer.num_heads * mixer.head_dim, mixer.num_kv_heads * mixer.head_dim
        fa = (KERNEL, ("core_attn",))  # flash-attn backward's own references
        out += [_t("qk_prenorm", t * (q + kv), _K),  # q/k before the per-head QK RMSNorm
                _t("qkv", t * (q + 2 * kv), _K),  # after qk-norm/rope: the core's (checkpoint) inputs
                _t("lse", t * mixer.num_heads, fa, width=FP32)]
        if mixer.gated:  # O read by flash-attn and the gate; gate logits; gated output = o_proj input
            out += [_t("attn_out", t * q, fa, _K), _t("gate", t * q, _K), _t("gated_out", t * q, _G)]
        else:
            out.append(_t("attn_out", t * q, fa, _G))
        return out
    if isinstance(mixer, MLASpec):
        nh, dqk = mixer.num_heads, mixer.qk_nope_head_dim + mixer.qk_rope_head_dim
        ql, kvl, rope = mixer.q_lora_rank, mixer.kv_lora_rank, mixer.qk_rope_head_dim
        fa = (KERNEL, ("core_attn",))
        return out + [_t("latents", t * (ql + kvl + rope), _K),  # down outputs (latent norm inputs)
                      _t("latents_normed", t * (ql + kvl), _G),  # up-projection inputs
                      _t("qkv", t * nh * (2 * dqk + mixer.v_head_dim), (KERNEL, ("mla_up_proj",))),
                      _t("lse", t * nh, fa, width=FP32),
                      _t("attn_out", t * nh * mixer.v_head_dim, fa, _G)]
    if isinstance(mixer, DeltaNetSpec):
        qk, nv = mixer.num_key_heads * mixer.key_head_dim, mixer.num_value_heads
        v = nv * mixer.value_head_dim
        return out + [_t("proj", t * (2 * qk + 2 * v + 2 * nv), _K),  # q, k, v (conv inputs), z, beta, g
                      _t("conv_out", t * (2 * qk + v), _K),  # conv/SiLU outputs (l2norm, delta-rule inputs)
                      _t("chunk_inverse", t * nv * mixer.chunk_size, _K),  # (I + A)^-1 per chunk
                      _t("core_out", t * v, _K),  # delta-rule output (gated-norm input)
                      _t("normed_out", t * v, _G)]  # out_proj input
    if isinstance(mixer, Mamba2Spec):
        d_in, gn = mixer.num_heads * mixer.head_dim, mixer.n_groups * mixer.state_size
        # the fused path (mamba_ssm MambaSplitConv1dScanCombinedFn, Megatron-Core MambaMixer's
        # use_mem_eff_path) saves the in_proj output and the scan output; it recomputes the
        # conv1d output (SSD x, B, C) in the backward, so that is not stored
        return out + [_t("proj", t * (2 * d_in + 2 * gn + mixer.num_heads), _K),  # z, xBC (conv input), dt
                      _t("ssd_out", t * d_in, _K),  # gated-norm input
                      _t("normed_out", t * d_in, _G)]  # out_proj input
    raise TypeError(f"unknown mixer spec {type(mixer).__name__}")


def _mlp_tensors(mlp, h: int, tokens: float, tp: int, load: float = 1.0) -> list[SavedTensor]:
    """Saved tensors of a channel mixer with its pre-MLP norm on one GPU (after the TP split);
    ``load``: the busiest EP rank's received token-expert assignments over the mean's
    (``CostOptions.moe_load``), which sizes the routed experts' tensors."""
    if isinstance(mlp, DenseMLPSpec):
        t = tokens / tp
        up = 2 * mlp.ffn if mlp.gated else mlp.ffn
        m = ("mlp",)
        return [_t("mlp_input", t * h, _K), _t("mlp_normed", t * h, (GEMM, ("layernorm",) + m)),
                _t("fc1_out", t * up, (KERNEL, m)), _t("act_out", t * mlp.ffn, (GEMM, m))]
    t = tokens / tp
    a = t * mlp.top_k * load  # token-expert assignments this GPU receives (load 1: balanced routing)
    width = mlp.latent_dim if mlp.latent_dim > 0 else h
    up = 2 * mlp.expert_ffn if mlp.gated else mlp.expert_ffn
    moe = ("moe",)
    # the normed input: router GEMM (BF16), and the FP8 linears that read it too (shared expert
    # fc1, latent down-projection); "moe" keeps it (the MoE checkpoint's input)
    normed = [(GEMM16, ("layernorm",))]
    if mlp.shared_expert_ffn:
        normed.append((GEMM, ("layernorm", "shared_experts", "moe")))
    if mlp.latent_dim:
        normed.append((GEMM, ("layernorm", "moe")))
    out = [_t("mlp_input", t * h, _K), _t("router_input", t * h, *normed),
           _t("router_probs", t * mlp.num_experts, (KERNEL, moe), width=FP32),
           _t("expert_in", a * width, (GEMM, moe)),  # dispatched tokens: fc1 input
           _t("expert_fc1_out", a * up, (KERNEL, moe)),
           _t("expert_act_out", a * mlp.expert_ffn, (GEMM, ("moe_act", "moe")))]  # fc2 input (weighted)
    if mlp.latent_dim:
        out += [_t("latent_combined", t * mlp.latent_dim, (GEMM, moe)),  # latent up-projection input
                _t("latent_down_out", t * mlp.latent_dim, (KERNEL, moe))]
    if mlp.shared_expert_ffn:
        sh = ("shared_experts", "moe")
        s_up = 2 * mlp.shared_expert_ffn if mlp.gated else mlp.shared_expert_ffn
        out += [_t("shared_fc1_out", t * s_up, (KERNEL, sh)),
                _t("shared_act_out", t * mlp.shared_expert_ffn, (GEMM, sh))]
    return out


def layer_tensors(layer: LayerSpec, hidden: int, tokens: float, *, tp: int = 1,
                  load: float = 1.0) -> tuple[SavedTensor, ...]:
    """The saved tensors of one decoder layer for one microbatch (``tokens`` = micro_batch_size
    * seq_length) on one GPU (everything split over ``tp``: sequence parallelism). ``load``
    (``CostOptions.moe_load``, :mod:`tessera.cost.routing`): the routed experts' tensors
    (``expert_in``, ``expert_fc1_out``, ``expert_act_out``: the receive buffer and what is
    computed from it) are those of the busiest EP rank, ``load`` times the balanced size."""
    out: list[SavedTensor] = []
    if layer.mixer is not None:
        out += [SavedTensor(s.name, s.elems / tp, s.width, s.readers) for s in _mixer_tensors(layer.mixer, hidden, tokens)]
    if layer.mlp is not None:
        out += _mlp_tensors(layer.mlp, hidden, tokens, tp, load)
    return tuple(out)


def _options(recompute, options: CostOptions | None) -> CostOptions:
    """``options``, or the older boolean ``recompute`` (True: full) as options."""
    if options is not None:
        return options
    return CostOptions(recompute=CostOptions.recompute_mode(recompute) if isinstance(recompute, bool) else recompute)


def _dropped(options: CostOptions) -> frozenset[str]:
    return frozenset(options.recompute_modules) if options.recompute == "selective" else frozenset()


def activation_of(tensors: tuple[SavedTensor, ...], layer_input: float, options: CostOptions) -> ActivationBytes:
    """Stored and W-read bytes of ``tensors`` under ``options``; ``full`` recompute stores only
    ``layer_input`` bytes (module docstring)."""
    fp8 = options.precision == "fp8"
    w = sum(s.w_bytes(fp8) for s in tensors)
    if options.recompute == "full":
        return ActivationBytes(layer_input, w)
    dropped = _dropped(options)
    return ActivationBytes(sum(s.stored_bytes(dropped, fp8) for s in tensors), w)


def layer_activation(layer: LayerSpec, hidden: int, tokens: float, *, tp: int = 1, recompute: bool | str = False,
                     options: CostOptions | None = None) -> ActivationBytes:
    """Activations of one decoder layer for one microbatch (``tokens`` = micro_batch_size *
    seq_length) on one GPU, bytes, under ``options`` (default: ``recompute``, a boolean or a
    mode, with the other defaults). Full recompute stores only the layer input 2*s*b*h/tp
    (Korthikanti et al. "full recomputation"); ``gemm_inputs`` are what W reads after B (B
    rebuilds what recompute dropped)."""
    opts = _options(recompute, options)
    return activation_of(layer_tensors(layer, hidden, tokens, tp=tp, load=opts.moe_load), BF16 * tokens * hidden / tp,
                         opts)


def head_tensors(model: ModelSpec, tokens: float, *, tp: int = 1) -> tuple[SavedTensor, ...]:
    """Final norm input, output-GEMM input (a BF16 GEMM: Megatron's output layer is not a
    TransformerEngine linear) and the FP32 softmax of the vocab-parallel cross-entropy
    (4*tokens*vocab/tp, Megatron-LM keeps it for the backward); once per MTP module too, with its
    eh norm inputs and eh-proj input (2h wide each)."""
    h, v, t = model.hidden, model.vocab, tokens / tp
    one = [_t("final_norm_in", t * h, _K), _t("logits_in", t * h, (GEMM16, ())),
           _t("softmax", t * v, _K, width=FP32)]
    out = list(one)
    for _ in range(model.mtp_layers if model.layers else 0):
        out += [_t("mtp_eh_norm_in", 2 * t * h, _K), _t("mtp_eh_proj_in", 2 * t * h, _G)] + one
    return tuple(out)


def head_activation(model: ModelSpec, tokens: float, *, tp: int = 1, recompute: bool | str = False,
                    options: CostOptions | None = None) -> ActivationBytes:
    """Activations of the head (:func:`head_tensors`) plus, per MTP module, one layer of the last
    layer's kind (:func:`layer_activation`, the same options). Recompute never drops the head's
    own tensors (Megatron-Core recomputes transformer layers, not the output layer)."""
    opts = _options(recompute, options)
    keep = CostOptions(precision=opts.precision, recompute="none")
    own = activation_of(head_tensors(model, tokens, tp=tp), 0.0, keep)
    stored, gin = own.stored, own.gemm_inputs
    if model.mtp_layers and model.layers:
        lay = layer_activation(model.layers[-1], model.hidden, tokens, tp=tp, options=opts)
        stored += model.mtp_layers * lay.stored
        gin += model.mtp_layers * lay.gemm_inputs
    return ActivationBytes(stored, gin)


def recompute_ops(layer: LayerSpec, options: CostOptions) -> Mapping[TaskKind, frozenset[str]]:
    """Which forward operators (names of :mod:`tessera.cost.flops`) each B task of ``layer``
    re-runs before its own backward, per task kind; :data:`ALL_OPS`: the whole forward of the
    task (with its TP collectives; for dispatch/combine, the A2A). Kinds that re-run nothing are
    absent. ``full``: every task; ``selective``: per Megatron-Core ``--recompute-modules``
    (module docstring): ``core_attn`` -> mixer ``attn``; ``mla_up_proj`` -> mixer ``q_up``,
    ``kv_up``, ``rope``; ``layernorm`` -> mixer ``input_norm`` and router/mlp ``mlp_norm``;
    ``moe_act`` -> expert ``expert_act``; ``mlp`` -> the dense MLP; ``moe`` -> router (but its
    norm), dispatch, expert, combine, shared; ``shared_experts`` -> shared."""
    if options.recompute == "none":
        return {}
    is_moe, mixer = isinstance(layer.mlp, MoESpec), layer.mixer
    kinds: set[TaskKind] = set()
    if mixer is not None:
        kinds.add(TaskKind.MIXER)
    if is_moe:
        kinds |= {TaskKind.ROUTER, TaskKind.DISPATCH, TaskKind.EXPERT, TaskKind.COMBINE}
        if layer.mlp.shared_expert_ffn:
            kinds.add(TaskKind.SHARED)
    elif layer.mlp is not None:
        kinds.add(TaskKind.MLP)
    if options.recompute == "full":
        return {k: ALL_OPS for k in kinds}
    out: dict[TaskKind, set[str]] = {}

    def add(kind: TaskKind, names) -> None:
        if kind in kinds:
            out.setdefault(kind, set()).update(names)

    mods = set(options.recompute_modules)
    attn_core = isinstance(mixer, (AttentionSpec, MLASpec))
    if "core_attn" in mods and attn_core:
        add(TaskKind.MIXER, {"attn"})
    if "mla_up_proj" in mods and isinstance(mixer, MLASpec):
        add(TaskKind.MIXER, {"q_up", "kv_up", "rope"})
    if "layernorm" in mods:
        add(TaskKind.MIXER, {"input_norm"})
        add(TaskKind.ROUTER if is_moe else TaskKind.MLP, {"mlp_norm"})
    if "moe_act" in mods:
        add(TaskKind.EXPERT, {"expert_act"})
    if "mlp" in mods and not is_moe:
        add(TaskKind.MLP, ALL_OPS)
    if "moe" in mods and is_moe:
        add(TaskKind.ROUTER, {"router", "softmax_topk", "latent_down"})
        for k in (TaskKind.DISPATCH, TaskKind.EXPERT, TaskKind.COMBINE, TaskKind.SHARED):
            add(k, ALL_OPS)
    if "shared_experts" in mods:
        add(TaskKind.SHARED, ALL_OPS)
    return {k: (ALL_OPS if "*" in v else frozenset(v)) for k, v in out.items()}
