"""Operator-level FLOPs and HBM bytes of every layer kind, and model FLOPs for MFU.

Every operator is an :class:`OpCost`: FLOPs and HBM bytes of one microbatch on one GPU, for each
phase (F = forward, B = input gradient "dgrad", W = weight gradient "wgrad").

Conventions (sources):

* GEMM ``Y[m,n] = X[m,k] W[k,n]``: 2*m*n*k FLOPs forward; B (dgrad) and W (wgrad) each repeat
  the forward FLOPs. This is the "3x" of Megatron-LM ``num_floating_point_operations``
  (megatron/training/training.py; Narayanan et al. 2021, appendix "Floating-point operations").
* Causal attention scores/context (QK^T, AV): half of the s x s matrix is computed (x0.5, as in
  Megatron-LM's "causal mask" factor); B = 2x forward (dQ, dK from the scores, dV and dP from the
  context), no W. Total 3x forward, as in Megatron-LM.
* Sequence-mixing scans without weights (chunked gated delta rule, Mamba-2 SSD): B = 2x F, no W.
  Depthwise short convolutions have weights: B = W = F.
* Norms, activations, gates, softmax and cross-entropy are counted as bytes only (0 model FLOPs;
  Megatron-LM counts none of them). They matter through the roofline (memory-bound time).
* Layer dims follow Megatron-LM's hybrid terms: gated attention doubles q_proj; GQA; MLA
  (q/kv LoRA ranks, rope dims); Gated DeltaNet in_proj h*(2*qk + 2*v + 2*nv), conv, out_proj;
  Mamba-2 in_proj h*(2*d_in + 2*ng*N + nh), out_proj; MoE top_k routed SwiGLU experts
  (3 matrices; ``gated=False``: 2, squared-ReLU), latent MoE (experts in ``latent_dim`` with
  down/up projections h<->latent), shared expert; dense SwiGLU; MTP (eh-proj 2h->h + a layer
  of the last layer's kind + logits).
* Deviations from Megatron-LM (documented in docs/cost-model.md): the router GEMM (h x E) is
  counted; the delta rule uses the chunked-form count below instead of 4*dv^2 MACs per head;
  Mamba-2 uses the SSD chunked count instead of 7*d_in*N.

Bytes are BF16 (2 B) activations and weights; W writes FP32 main grads (read+write, 8 B/param).
GEMM operators carry their shape (:class:`GemmShape`), from which their bytes follow
(:func:`gemm_bytes`; FP8 inputs under ``train.precision=fp8``) and which the size-dependent
efficiency curve of :mod:`tessera.cost.efficiency` reads. Every operator also carries a rough
count of the kernels it launches per phase (``OpCost.kernels``; counts in docs/cost-model.md),
which the analytic model charges ``kernel_launch_us`` each.

Memory-bound MoE data movement (Megatron-Core ``MoEAlltoAllTokenDispatcher``): the token
permutation by expert before dispatch (router task), the local sort of received chunks by expert
after dispatch and before combine (expert task, ``ep > 1`` with several local experts) and the
unpermutation with the routing-probability weighting after combine (expert task, accounted before
combine as the latent up-projection is); residual adds (mixer, router / dense MLP task).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from tessera.spec.model import (AttentionSpec, DeltaNetSpec, DenseMLPSpec, LayerSpec, Mamba2Spec, MLASpec,
                                ModelSpec, MoESpec)
from tessera.spec.tasks import TaskKind

BF16 = 2  # bytes per element of activations, weights and A2A payloads
FP32 = 4


@dataclass(frozen=True)
class GemmShape:
    """The shape of one GEMM operator ``Y[m, n] = X[m, k] W[k, n]`` on one GPU, in elements.

    Attributes:
        m: rows of X (tokens; for a grouped expert GEMM all token-expert assignments together).
        k: input features (the forward reduction dim).
        n: output features.
        groups: distinct weight matrices (grouped expert GEMM: the local experts); the ``m`` rows
            are split evenly among them (balanced routing).
        split: the dim tensor parallelism divides (:meth:`scaled`): ``"n"`` column-parallel
            (q/kv/in projections, fc1, the vocab-parallel output), ``"k"`` row-parallel
            (o/out projections, fc2).
        fp8: whether the GEMM runs in FP8 under ``train.precision=fp8`` (Megatron-Core / Transformer
            Engine FP8 recipes keep the router and the output layer in BF16).
    """

    m: float
    k: float
    n: float
    groups: float = 1.0
    split: str = "n"
    fp8: bool = True

    def phase_mnk(self, phase: int) -> tuple[float, float, float]:
        """(M, N, K) of one group's GEMM in phase 0/1/2 (F/B/W), output rows x output columns x
        reduction: F ``X W`` is (m/g, n, k); B (dgrad) ``dY W^T`` is (m/g, k, n); W (wgrad)
        ``X^T dY`` is (k, n, m/g): the weight gradient reduces over the group's tokens."""
        mg = self.m / self.groups
        return ((mg, self.n, self.k), (mg, self.k, self.n), (self.k, self.n, mg))[phase]

    def scaled(self, s: float) -> "GemmShape":
        """The shape with its ``split`` dim multiplied by ``s`` (``s = 1/tp``)."""
        if self.split == "k":
            return replace(self, k=self.k * s)
        return replace(self, n=self.n * s)


def gemm_bytes(g: GemmShape, phase: int, fp8: bool = False) -> float:
    """HBM bytes of one GEMM operator in phase 0/1/2 (F/B/W).

    BF16: F and B read both activations (X and Y, or dY and dX) and the BF16 weights; W reads X and
    dY and read-modify-writes the FP32 main grad (8 B/param). FP8 (``fp8`` and ``g.fp8``): the GEMM
    inputs are FP8 (1 B: X and W in F, dY and W in B, X^T and dY^T in W), outputs stay BF16, the
    main grad FP32; FP8 weight copies are cast once per iteration and cached across microbatches
    (Transformer Engine ``is_first_microbatch``), so they are not charged here."""
    m, k, n, w = g.m, g.k, g.n, g.k * g.n * g.groups
    if fp8 and g.fp8:
        return (m * k + w + BF16 * m * n, m * n + w + BF16 * m * k, m * (k + n) + 2 * FP32 * w)[phase]
    act = BF16 * m * (k + n)
    return (act + BF16 * w, act + BF16 * w, act + 2 * FP32 * w)[phase]


def fp8_cast_bytes(g: GemmShape, phase: int) -> float:
    """HBM bytes of the FP8 quantization of a GEMM's activation input (memory-bound, BF16 in):
    F casts X (read 2 B, write FP8 X and X^T for the wgrad: 2 x 1 B, Transformer Engine's
    cast-transpose), B casts dY likewise, W reuses both: ``4*m*k``, ``4*m*n``, 0. Charged as a
    separate kernel (not fused into the preceding norm or activation: an upper bound)."""
    if not g.fp8:
        return 0.0
    return (4.0 * g.m * g.k, 4.0 * g.m * g.n, 0.0)[phase]


@dataclass(frozen=True)
class OpCost:
    """One operator for one microbatch on one GPU.

    Attributes:
        name: readable name, e.g. ``"q_proj"``.
        flops: model FLOPs in phases (F, B, W).
        bytes: HBM bytes touched in phases (F, B, W) (BF16; for GEMMs ``gemm_bytes`` of ``gemm``).
        gemm: the GEMM's shape, or None for other operators (attention core, scans, convolutions,
            memory-bound kernels).
        kernels: kernels launched in phases (F, B, W), roughly (docs/cost-model.md).
    """

    name: str
    flops: tuple[float, float, float]
    bytes: tuple[float, float, float]
    gemm: Optional[GemmShape] = None
    kernels: tuple[int, int, int] = (0, 0, 0)

    def scaled(self, s: float) -> "OpCost":
        """The same operator on ``s`` of the work (e.g. 1/tp): FLOPs and bytes multiplied by ``s``;
        a GEMM's ``split`` dim is multiplied by ``s`` and its bytes follow from the new shape (the
        unsplit activation of a column-parallel GEMM is read whole). Kernel counts stay."""
        if self.gemm is not None:
            g = self.gemm.scaled(s)
            return replace(self, flops=tuple(x * s for x in self.flops),
                           bytes=tuple(gemm_bytes(g, ph) for ph in range(3)), gemm=g)
        return replace(self, flops=tuple(x * s for x in self.flops), bytes=tuple(x * s for x in self.bytes))

    @property
    def total_flops(self) -> float:
        return sum(self.flops)


def gemm(name: str, m: float, k: float, n: float, copies: float = 1.0, split: str = "n",
         fp8: bool = True) -> OpCost:
    """``m`` tokens through a k x n weight: 2mkn FLOPs per phase (Megatron-LM 3x convention).

    ``copies``: distinct weight matrices touched (grouped expert GEMM: local experts; the ``m``
    tokens are split among them). Bytes (:func:`gemm_bytes`, BF16): F and B read the two
    activations and the BF16 weights; W reads X and dY and read-modify-writes the FP32 main grad
    (8 B/param). ``split``/``fp8``: see :class:`GemmShape`. One kernel per phase (a grouped GEMM is
    one grouped kernel: CUTLASS / DeepGEMM / Transformer Engine grouped GEMM).
    """
    f = 2.0 * m * k * n
    g = GemmShape(float(m), float(k), float(n), float(copies), split, fp8)
    return OpCost(name, (f, f, f), tuple(gemm_bytes(g, ph) for ph in range(3)), g, (1, 1, 1))


def elementwise(name: str, elems_in: float, elems_out: float, kernels: tuple[int, int, int] = (1, 1, 0)) -> OpCost:
    """Memory-bound op (norm, activation, gate, softmax): 0 model FLOPs.

    F reads the input and writes the output; B reads the saved input and dY and writes dX.
    ``kernels``: per phase; one each by default (norms: :func:`norm`)."""
    return OpCost(name, (0.0, 0.0, 0.0), (BF16 * (elems_in + elems_out), BF16 * (2 * elems_in + elems_out), 0.0),
                  kernels=kernels)


def norm(name: str, elems: float, kernels: tuple[int, int, int] = (1, 2, 0)) -> OpCost:
    """RMSNorm (or L2 norm) over ``elems`` elements: memory-bound; backward is a dX kernel and a
    reduction of the weight-gradient partials (Apex / Transformer Engine RMSNorm), 2 kernels."""
    return elementwise(name, elems, elems, kernels)


def residual_add(name: str, elems: float) -> OpCost:
    """Residual add ``x + f(x)``: F reads two BF16 tensors and writes one; B sums the two gradient
    paths of the residual stream (read two, write one). 0 FLOPs, one kernel each."""
    b = BF16 * 3 * elems
    return OpCost(name, (0.0, 0.0, 0.0), (b, b, 0.0), kernels=(1, 1, 0))


def permute(name: str, rows: float, width: float, kernels: tuple[int, int, int] = (2, 2, 0)) -> OpCost:
    """Token gather into expert order (Megatron-Core ``permute``; also the local sort of received
    chunks, ``sort_chunks_by_idxs``): ``rows`` = tokens*top_k rows of ``width`` BF16 read and
    written in F; B moves the gradient back the same way. Memory-bound, 0 FLOPs; the unfused path
    is an index computation plus the gather (2 kernels)."""
    b = 2 * BF16 * rows * width
    return OpCost(name, (0.0, 0.0, 0.0), (b, b, 0.0), kernels=kernels)


def unpermute(name: str, tokens: float, rows: float, width: float) -> OpCost:
    """Scatter of the ``rows`` = tokens*top_k expert outputs back to ``tokens`` tokens, weighted by
    the routing probabilities (Megatron-Core ``unpermute``): F reads the rows and writes the
    tokens, B reads the token gradients and writes the row gradients (BF16). 2 kernels each."""
    b = BF16 * (rows + tokens) * width
    return OpCost(name, (0.0, 0.0, 0.0), (b, b, 0.0), kernels=(2, 2, 0))


def conv1d(name: str, tokens: float, channels: float, kernel: int) -> OpCost:
    """Depthwise causal conv (Gated DeltaNet, Mamba-2): 2*kernel FLOPs per channel-token;
    B = W = F (it has weights; Megatron-LM's GDN term counts kernel*(2qk+v) MACs)."""
    f = 2.0 * tokens * channels * kernel
    b = BF16 * tokens * channels * 2
    return OpCost(name, (f, f, f), (b, 1.5 * b, b), kernels=(1, 1, 1))


def attention_core(name: str, tokens: float, seq: float, nh: int, nkv: int, dqk: int, dv: int) -> OpCost:
    """Causal flash attention: QK^T and AV over half the s x s matrix (Megatron-LM x0.5).

    F = 2 * tokens * nh * seq * (dqk + dv) / 2 FLOPs; B = 2F; W = 0. Bytes: Q, K, V, O and the
    FP32 log-sum-exp (FlashAttention-2 keeps no s x s matrix); B reads those and dO, writes dQ/dK/dV.
    """
    f = tokens * nh * seq * (dqk + dv)
    qkvo = BF16 * tokens * (nh * dqk + nkv * (dqk + dv) + nh * dv) + FP32 * tokens * nh
    # kernels: FlashAttention forward; backward preprocess (rowsum dO*O), main, dQ conversion
    return OpCost(name, (f, 2 * f, 0.0), (qkvo, 2 * qkvo, 0.0), kernels=(1, 3, 0))


def delta_rule(name: str, tokens: float, spec: DeltaNetSpec) -> OpCost:
    """Chunked gated delta rule (Yang et al. 2024, "Gated Delta Networks"; the chunk form of
    flash-linear-attention / transformers ``torch_chunk_gated_delta_rule``), per value head,
    chunk C, key dim dk, value dim dv. MACs per chunk: KK^T C^2 dk, (I+A)^-1 C^3/3,
    W = T(beta K) C^2 dk, U = T(beta V) C^2 dv, QK^T C^2 dk, U - WS C dk dv, QS C dk dv,
    (QK^T)(U-WS) C^2 dv, state update K^T(U-WS) C dk dv. Per token:
    ``3 dk dv + C (3 dk + 2 dv) + C^2/3`` MACs (x2 FLOPs). B = 2F, W = 0.
    Bytes: q, k, v, g, beta in, o out, chunk states (BF16) written and read once."""
    c, dk, dv, nv = spec.chunk_size, spec.key_head_dim, spec.value_head_dim, spec.num_value_heads
    macs = 3 * dk * dv + c * (3 * dk + 2 * dv) + c * c / 3.0
    f = 2.0 * tokens * nv * macs
    qk = spec.num_key_heads * dk
    io = BF16 * tokens * (2 * qk + 2 * nv * dv + 2 * nv)
    states = 2 * BF16 * (tokens / c) * nv * dk * dv
    # kernels (flash-linear-attention chunk_gated_delta_rule): F cumsum, KK^T, solve_tril, W/U,
    # chunk states, output (6); B recomputes the four of them and runs seven backward kernels
    return OpCost(name, (f, 2 * f, 0.0), (io + states, 2 * (io + states), 0.0), kernels=(6, 11, 0))


def ssd_scan(name: str, tokens: float, spec: Mamba2Spec) -> OpCost:
    """Mamba-2 SSD chunked scan (Dao & Gu 2024, "Transformers are SSMs", sec. 6), chunk Q,
    head dim P, state N, groups G, heads H. MACs per token: CB^T G*Q*N, diagonal blocks
    H*Q*P, chunk states H*N*P, state-to-output H*N*P, inter-chunk pass H*N*P/Q (x2 FLOPs).
    Megatron-LM uses 7*d_in*N FLOPs instead (7-10% more for Nemotron 3 dims). B = 2F, W = 0."""
    q, p, n, g, h = spec.chunk_size, spec.head_dim, spec.state_size, spec.n_groups, spec.num_heads
    macs = g * q * n + h * (q * p + 2 * n * p + n * p / q)
    f = 2.0 * tokens * macs
    io = BF16 * tokens * (2 * h * p + 2 * g * n + h)
    # kernels (mamba_ssm mamba_chunk_scan_combined): F chunk cumsum, chunk state, state passing,
    # CB^T, chunk scan (5); B about twice as many
    return OpCost(name, (f, 2 * f, 0.0), (io, 2 * io, 0.0), kernels=(5, 10, 0))


# ---------------------------------------------------------------------------------------------
# Per-kind operator lists (tokens = tokens of one microbatch, before TP division)


def mixer_ops(mixer, hidden: int, tokens: float, seq: float) -> tuple[OpCost, ...]:
    """Operators of one token mixer including its input RMSNorm, whole layer (no TP split)."""
    h, t = hidden, tokens
    ops = [norm("input_norm", t * h)]
    if isinstance(mixer, AttentionSpec):
        q = mixer.num_heads * mixer.head_dim
        kv = mixer.num_kv_heads * mixer.head_dim
        ops += [gemm("q_proj", t, h, q * (2 if mixer.gated else 1)), gemm("kv_proj", t, h, 2 * kv),
                elementwise("qk_norm_rope", t * (q + kv), t * (q + kv), (4, 6, 0)),  # q, k norms + rope
                attention_core("attn", t, seq, mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.head_dim)]
        if mixer.gated:
            ops.append(elementwise("out_gate", 2 * t * q, t * q))
        ops.append(gemm("o_proj", t, q, h, split="k"))
    elif isinstance(mixer, MLASpec):
        nh, dqk = mixer.num_heads, mixer.qk_nope_head_dim + mixer.qk_rope_head_dim
        ql, kvl, rope = mixer.q_lora_rank, mixer.kv_lora_rank, mixer.qk_rope_head_dim
        ops += [gemm("q_down", t, h, ql), norm("q_norm", t * ql), gemm("q_up", t, ql, nh * dqk),
                gemm("kv_down", t, h, kvl + rope), norm("kv_norm", t * kvl),
                gemm("kv_up", t, kvl, nh * (mixer.qk_nope_head_dim + mixer.v_head_dim)),
                elementwise("rope", t * nh * dqk, t * nh * dqk),
                attention_core("attn", t, seq, nh, nh, dqk, mixer.v_head_dim),
                gemm("o_proj", t, nh * mixer.v_head_dim, h, split="k")]
    elif isinstance(mixer, DeltaNetSpec):
        qk = mixer.num_key_heads * mixer.key_head_dim
        v = mixer.num_value_heads * mixer.value_head_dim
        ops += [gemm("in_proj", t, h, 2 * qk + 2 * v + 2 * mixer.num_value_heads),
                conv1d("conv", t, 2 * qk + v, mixer.conv_kernel),
                elementwise("qk_l2norm", 2 * t * qk, 2 * t * qk, (2, 2, 0)),
                delta_rule("delta_rule", t, mixer),
                elementwise("gated_norm", 2 * t * v, t * v, (1, 2, 0)),
                gemm("out_proj", t, v, h, split="k")]
    elif isinstance(mixer, Mamba2Spec):
        d_in = mixer.num_heads * mixer.head_dim
        gn = mixer.n_groups * mixer.state_size
        ops += [gemm("in_proj", t, h, 2 * d_in + 2 * gn + mixer.num_heads),
                conv1d("conv", t, d_in + 2 * gn, mixer.conv_kernel),
                ssd_scan("ssd", t, mixer),
                elementwise("gated_norm", 2 * t * d_in, t * d_in, (1, 2, 0)),
                gemm("out_proj", t, d_in, h, split="k")]
    else:
        raise TypeError(f"unknown mixer spec {type(mixer).__name__}")
    ops.append(residual_add("mixer_residual", t * h))
    return tuple(ops)


def swiglu_ops(prefix: str, tokens: float, width: int, ffn: int, gated: bool = True,
               copies: float = 1.0) -> tuple[OpCost, ...]:
    """SwiGLU (gated) or plain 2-matrix MLP: fc1 width -> (2x)ffn, activation, fc2 ffn -> width."""
    up = 2 * ffn if gated else ffn
    return (gemm(f"{prefix}fc1", tokens, width, up, copies),
            elementwise(f"{prefix}act", tokens * up, tokens * ffn),
            gemm(f"{prefix}fc2", tokens, ffn, width, copies, split="k"))


def moe_ops(moe: MoESpec, hidden: int, tokens: float, tp: int = 1, ep: int = 1) -> dict[TaskKind, tuple[OpCost, ...]]:
    """Router, routed-expert and shared-expert operators of one MoE block on one GPU.

    ``tokens``: tokens of one microbatch before TP division. Under sequence parallelism each TP
    rank routes tokens/tp tokens; under balanced routing each GPU's ``num_experts/ep`` local experts
    receive (tokens/tp)*top_k token-expert assignments (as many as the GPU sends).
    Router: pre-MLP RMSNorm, GEMM h x E (BF16 also under FP8), the FP32 score/top-k/aux-loss
    kernels, the token permutation by expert (``tokens*top_k`` rows) and the layer's second
    residual add; latent MoE adds the down projection h -> latent here (the permutation then moves
    latent rows) and the up projection latent -> h in the expert task. Expert: with ``ep > 1`` and
    several local experts the received chunks are sorted by expert and sorted back before
    combine; the grouped SwiGLU GEMMs; the unpermutation. The up projection, the unpermutation and
    the residual add really run after combine; their time is accounted before it (see
    docs/cost-model.md)."""
    t = tokens / tp
    a = t * moe.top_k
    width = moe.latent_dim if moe.latent_dim > 0 else hidden
    local = moe.num_experts / ep
    e = moe.num_experts
    # FP32 router tail (Megatron-Core TopKRouter, unfused): F reads the logits, writes the scores,
    # top-k reads them, writes the probability and routing maps (FP32 + bool), the aux loss reads
    # the scores: about 21 B per token-expert; B about four FP32 passes. 6 kernels each.
    router = [norm("mlp_norm", t * hidden), gemm("router", t, hidden, e, fp8=False),
              OpCost("softmax_topk", (0.0, 0.0, 0.0), ((5 * FP32 + 1) * t * e, 4 * FP32 * t * e, 0.0),
                     kernels=(6, 6, 0))]
    expert: list[OpCost] = []
    if moe.latent_dim > 0:
        router.append(gemm("latent_down", t, hidden, moe.latent_dim))
    router += [permute("permute", a, width), residual_add("mlp_residual", t * hidden)]
    if ep > 1 and local > 1:
        expert.append(permute("sort_chunks", a, width, (1, 1, 0)))
    expert += list(swiglu_ops("expert_", a, width, moe.expert_ffn, moe.gated, local))
    if ep > 1 and local > 1:
        expert.append(permute("unsort_chunks", a, width, (1, 1, 0)))
    expert.append(unpermute("unpermute", t, a, width))
    if moe.latent_dim > 0:
        expert.append(gemm("latent_up", t, moe.latent_dim, hidden))
    out = {TaskKind.ROUTER: tuple(router), TaskKind.EXPERT: tuple(expert)}
    if moe.shared_expert_ffn > 0:
        shared = swiglu_ops("shared_", tokens, hidden, moe.shared_expert_ffn, moe.gated)
        out[TaskKind.SHARED] = tuple(o.scaled(1.0 / tp) for o in shared)
    return out


def layer_ops(layer: LayerSpec, hidden: int, tokens: float, seq: float, tp: int = 1,
              ep: int = 1) -> dict[TaskKind, tuple[OpCost, ...]]:
    """Compute operators of one decoder layer on one GPU, grouped by task kind.

    Dense (TP-sharded) parts are divided by ``tp`` (FLOPs, weight and activation bytes: sequence
    parallelism); experts are computed per GPU as in :func:`moe_ops`."""
    out: dict[TaskKind, tuple[OpCost, ...]] = {}
    if layer.mixer is not None:
        out[TaskKind.MIXER] = tuple(o.scaled(1.0 / tp) for o in mixer_ops(layer.mixer, hidden, tokens, seq))
    if isinstance(layer.mlp, MoESpec):
        out.update(moe_ops(layer.mlp, hidden, tokens, tp, ep))
    elif isinstance(layer.mlp, DenseMLPSpec):
        ops = (norm("mlp_norm", tokens * hidden),) + swiglu_ops(
            "", tokens, hidden, layer.mlp.ffn, layer.mlp.gated) + (residual_add("mlp_residual", tokens * hidden),)
        out[TaskKind.MLP] = tuple(o.scaled(1.0 / tp) for o in ops)
    return out


def embed_ops(model: ModelSpec, tokens: float, tp: int = 1) -> tuple[OpCost, ...]:
    """Embedding lookup: F gathers rows (read + write tokens*h BF16); B passes the gradient on
    (read tokens*h); W scatter-adds it into the FP32 main grad (read dY, read+write FP32 rows).
    0 model FLOPs (Megatron-LM counts none)."""
    th = tokens * model.hidden / tp
    return (OpCost("embedding", (0.0, 0.0, 0.0), (2 * BF16 * th, BF16 * th, (BF16 + 2 * FP32) * th),
                   kernels=(1, 1, 1)),)


def head_ops(model: ModelSpec, tokens: float, seq: float, tp: int = 1, ep: int = 1) -> tuple[OpCost, ...]:
    """Final RMSNorm, output GEMM h x vocab, vocab-parallel cross-entropy (FP32 softmax over the
    logits: F reads BF16 logits and writes FP32 softmax, B reads it and writes BF16 dlogits), and
    ``model.mtp_layers`` MTP modules (DeepSeek-V3 report sec. 2.2; Megatron-LM MTP term: eh norms,
    eh-proj 2h -> h, one layer of the last layer's kind, shared output head + loss). The output
    GEMM stays BF16 under FP8 (Megatron-Core's output layer is not a Transformer Engine module);
    the cross-entropy is 3 kernels in F (max, sum-exp, loss) and 2 in B."""
    h, v = model.hidden, model.vocab
    t = tokens / tp

    def logits() -> list[OpCost]:
        return [norm("final_norm", t * h), gemm("output", tokens, h, v, fp8=False).scaled(1.0 / tp),
                OpCost("cross_entropy", (0.0, 0.0, 0.0), ((BF16 + FP32) * t * v, (FP32 + BF16) * t * v, 0.0),
                       kernels=(3, 2, 0))]

    ops = logits()
    last = model.layers[-1] if model.layers else None
    for _ in range(model.mtp_layers):
        ops += [norm("mtp_eh_norm", 2 * t * h),
                gemm("mtp_eh_proj", tokens, 2 * h, h).scaled(1.0 / tp)]
        if last is not None:
            for kind_ops in layer_ops(last, h, tokens, seq, tp, ep).values():
                ops += list(kind_ops)
        ops += logits()
    return tuple(ops)


def model_flops(model: ModelSpec, tokens: float, *, seq_length: float | None = None) -> float:
    """Model FLOPs (F + B + W) of ``tokens`` tokens through the whole model (for MFU).

    Equals the sum of :func:`tessera.cost.analytic.analytic_costs` task FLOPs times ``tp`` for
    one microbatch (balanced routing); for GEMM-only models it is the Megatron-LM
    ``num_floating_point_operations`` value: 3x the forward GEMM FLOPs, with causal attention.
    ``seq_length`` (default: ``tokens``, one sequence) sets the attention/scan span."""
    seq = tokens if seq_length is None else seq_length
    total = sum(o.total_flops for o in embed_ops(model, tokens) + head_ops(model, tokens, seq))
    for layer in model.layers:
        total += sum(o.total_flops for ops in layer_ops(layer, model.hidden, tokens, seq).values() for o in ops)
    return total
