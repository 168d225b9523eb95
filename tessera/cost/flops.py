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
(:func:`gemm_bytes`; FP8 inputs under ``train.precision=fp8``, with the quantization work of
``train.fp8_recipe`` beside them, :func:`tessera.cost.fp8.fp8_quant`) and which the size-dependent
efficiency curve of :mod:`tessera.cost.efficiency` reads. Every operator also carries a rough
count of the kernels it launches per phase (``OpCost.kernels``; counts in docs/cost-model.md),
which the analytic model charges ``kernel_launch_us`` each on the device and ``host_kernel_us`` (a
GEMM call: ``host_gemm_us``) on the host (:mod:`tessera.cost.efficiency`).

Memory-bound MoE data movement (Megatron-Core ``MoEAlltoAllTokenDispatcher``): the token
permutation by expert before dispatch (router task), the local sort of received chunks by expert
after dispatch and before combine (expert task, ``ep > 1`` with several local experts) and the
unpermutation with the routing-probability weighting after combine (expert task, accounted before
combine as the latent up-projection is); residual adds (mixer, router / dense MLP task).
"""

from __future__ import annotations

import math
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
        fp8_in: where its FP8 input comes from (:func:`tessera.cost.fp8.fp8_quant`): ``"cast"`` it quantizes a
            BF16 input itself (``te.Linear``, ``te.GroupedLinear``); ``"norm"`` the input is the
            RMSNorm output of the same ``te.LayerNormLinear`` module, whose norm kernel also
            computes the amax; ``"shared"`` another GEMM of the same Transformer Engine module
            quantized the same input (Megatron-Core's one ``linear_qkv`` is ``q_proj`` and
            ``kv_proj`` here): no cast of its own in F, its dY is quantized with the other's in B.
        fp8_pad: the FP8 padding of a grouped expert GEMM's rows to a multiple of 16 (32 for
            MXFP8) per expert, where the dispatcher does not pad (Megatron-Core ``TEGroupedMLP``
            ``Fp8Padding`` / ``Fp8Unpadding``): ``"in"`` pads the input (fc1), ``"out"`` unpads the
            output (fc2), ``""`` none.
        tp: the tensor-parallel group the GEMM is split over (:meth:`scaled` sets it); with
            ``tp > 1`` it runs under sequence parallelism (a column-parallel GEMM all-gathers its
            input, a row-parallel one reduce-scatters its output).
    """

    m: float
    k: float
    n: float
    groups: float = 1.0
    split: str = "n"
    fp8: bool = True
    fp8_in: str = "cast"
    fp8_pad: str = ""
    tp: float = 1.0

    def phase_mnk(self, phase: int) -> tuple[float, float, float]:
        """(M, N, K) of one group's GEMM in phase 0/1/2 (F/B/W), output rows x output columns x
        reduction: F ``X W`` is (m/g, n, k); B (dgrad) ``dY W^T`` is (m/g, k, n); W (wgrad)
        ``X^T dY`` is (k, n, m/g): the weight gradient reduces over the group's tokens."""
        mg = self.m / self.groups
        return ((mg, self.n, self.k), (mg, self.k, self.n), (self.k, self.n, mg))[phase]

    def scaled(self, s: float) -> "GemmShape":
        """The shape with its ``split`` dim multiplied by ``s`` (``s = 1/tp``) and ``tp`` divided by it."""
        if self.split == "k":
            return replace(self, k=self.k * s, tp=self.tp / s)
        return replace(self, n=self.n * s, tp=self.tp / s)


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


FP8 = 1  # bytes per element of an FP8 tensor (E4M3 / E5M2)


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
        rate_class: for an operator without a GEMM shape, the kernel class whose achieved rate
            computes it (:meth:`tessera.spec.hardware.HardwareSpec.kernel_efficiency`):
            ``"attention"`` (fused attention), ``"delta_rule"`` (chunked gated delta rule),
            ``"ssd"`` (Mamba-2 chunked scan), ``"conv"`` (causal convolution); ``""`` (default),
            and every class on a device without a measured rate for it, runs its model FLOPs at
            ``peak_tflops * mfu_efficiency``.
        kernel_flops: FLOPs its kernels execute in phases (F, B, W) where they differ from the
            model FLOPs (a backward that recomputes forward products, full tiles of causal
            blocks); the time at a measured rate is computed from them. None: ``flops``.
        head_dim: the head dim its achieved rate depends on (attention: mean of the q/k and v
            head dims); 0 otherwise.
    """

    name: str
    flops: tuple[float, float, float]
    bytes: tuple[float, float, float]
    gemm: Optional[GemmShape] = None
    kernels: tuple[int, int, int] = (0, 0, 0)
    rate_class: str = ""
    kernel_flops: Optional[tuple[float, float, float]] = None
    head_dim: float = 0.0

    def scaled(self, s: float) -> "OpCost":
        """The same operator on ``s`` of the work (e.g. 1/tp): FLOPs and bytes multiplied by ``s``;
        a GEMM's ``split`` dim is multiplied by ``s`` and its bytes follow from the new shape (the
        unsplit activation of a column-parallel GEMM is read whole). Kernel counts, ``rate_class``
        and ``head_dim`` stay; ``kernel_flops`` scale with the FLOPs."""
        if self.gemm is not None:
            g = self.gemm.scaled(s)
            return replace(self, flops=tuple(x * s for x in self.flops),
                           bytes=tuple(gemm_bytes(g, ph) for ph in range(3)), gemm=g)
        work = None if self.kernel_flops is None else tuple(x * s for x in self.kernel_flops)
        return replace(self, flops=tuple(x * s for x in self.flops), bytes=tuple(x * s for x in self.bytes),
                       kernel_flops=work)

    @property
    def total_flops(self) -> float:
        return sum(self.flops)

    def work(self, phase: int) -> float:
        """FLOPs the kernels execute in phase 0/1/2 (``kernel_flops``, else ``flops``)."""
        return (self.flops if self.kernel_flops is None else self.kernel_flops)[phase]


def gemm(name: str, m: float, k: float, n: float, copies: float = 1.0, split: str = "n",
         fp8: bool = True, fp8_in: str = "cast", fp8_pad: str = "") -> OpCost:
    """``m`` tokens through a k x n weight: 2mkn FLOPs per phase (Megatron-LM 3x convention).

    ``copies``: distinct weight matrices touched (grouped expert GEMM: local experts; the ``m``
    tokens are split among them). Bytes (:func:`gemm_bytes`, BF16): F and B read the two
    activations and the BF16 weights; W reads X and dY and read-modify-writes the FP32 main grad
    (8 B/param). ``split``/``fp8``/``fp8_in``/``fp8_pad``: see :class:`GemmShape`. Kernels per phase: one per weight
    matrix, ``copies`` for a grouped expert GEMM: on Hopper both Transformer Engine's
    ``GroupedLinear`` (``nvte_multi_tensor_gemm``: one cuBLAS GEMM per expert, round-robin on 4
    compute streams, unless ``NVTE_USE_CUTLASS_GROUPED_GEMM`` is set) and the ``grouped_gemm``
    package NeMo AutoModel calls (``CublasGroupedGemm``: one ``cublasGemmEx`` per expert on 4
    streams on SM90) launch a GEMM per local expert (docs/cost-model.md, "Host time and CUDA
    graphs"); :func:`tessera.cost.efficiency.device_launches` counts the streams.
    """
    f = 2.0 * m * k * n
    g = GemmShape(float(m), float(k), float(n), float(copies), split, fp8, fp8_in, fp8_pad)
    c = max(1, math.ceil(copies))
    return OpCost(name, (f, f, f), tuple(gemm_bytes(g, ph) for ph in range(3)), g, (c, c, c))


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
    B = W = F (it has weights; Megatron-LM's GDN term counts kernel*(2qk+v) MACs). Rate class
    ``conv`` (memory-bound: 2*kernel FLOPs per 4 B read and written)."""
    f = 2.0 * tokens * channels * kernel
    b = BF16 * tokens * channels * 2
    return OpCost(name, (f, f, f), (b, 1.5 * b, b), kernels=(1, 1, 1), rate_class="conv")


def attention_core(name: str, tokens: float, seq: float, nh: int, nkv: int, dqk: int, dv: int) -> OpCost:
    """Causal fused attention (FlashAttention / cuDNN): QK^T and AV over half the s x s matrix
    (Megatron-LM x0.5).

    Model FLOPs: F = 2 * tokens * nh * seq * (dqk + dv) / 2; B = 2F (Megatron-LM); W = 0. The
    backward kernel executes 2.5F (``kernel_flops``): it recomputes QK^T and computes dV, dP, dQ
    and dK, five products of the forward's two (Dao 2023, FlashAttention-2, sec. 3.1.2; the
    convention of the FlashAttention and cuDNN benchmarks). Rate class ``attention`` at head dim
    ``(dqk + dv) / 2``. Bytes: Q, K, V, O and the FP32 log-sum-exp (no s x s matrix); B reads
    those and dO, writes dQ/dK/dV.
    """
    f = tokens * nh * seq * (dqk + dv)
    qkvo = BF16 * tokens * (nh * dqk + nkv * (dqk + dv) + nh * dv) + FP32 * tokens * nh
    # kernels: forward; backward preprocess (rowsum dO*O), main, dQ conversion
    return OpCost(name, (f, 2 * f, 0.0), (qkvo, 2 * qkvo, 0.0), kernels=(1, 3, 0), rate_class="attention",
                  kernel_flops=(f, 2.5 * f, 0.0), head_dim=(dqk + dv) / 2.0)


def delta_rule_macs(dk: float, dv: float, c: float) -> tuple[float, float]:
    """MACs per token and value head that flash-linear-attention's ``chunk_gated_delta_rule``
    kernels execute (F, B), key dim ``dk``, value dim ``dv``, chunk ``c`` (fla-org/
    flash-linear-attention at 6eefe8ed, 2025-11-03: ``ops/gated_delta_rule/chunk.py``,
    ``wy_fast.py``, ``ops/common/chunk_scaled_dot_kkt.py``, ``chunk_delta_h.py``,
    ``chunk_o.py``, ``ops/utils/solve_tril.py``; full c x c tiles, causal masks applied after the
    products). Per chunk, F: KK^T ``c^2 dk``, (I+A)^-1 ``c^3/3`` (16x16 blocks merged),
    W = A(beta g K) ``c^2 dk``, U = A(beta V) ``c^2 dv``, the state pass V_new = U - W S and
    S += K^T V_new ``2 c dk dv``, the output Q S ``c dk dv``, QK^T ``c^2 dk``, (QK^T) V_new
    ``c^2 dv``: per token ``3 dk dv + c (3 dk + 2 dv) + c^2/3``. B recomputes W, U and the states
    (``c^2 (dk + dv) + 2 c dk dv``), then dV local ``c^2 (dk + dv)``, the reverse state pass
    dV += K dS, dS += Q^T dO - W^T dV ``3 c dk dv``, dQ/dK/dW ``3 c dk dv + c^2 (3 dk + dv)``
    and the WY backward ``c^2 (5 dk + 2 dv) + 2 c^3``: per token
    ``8 dk dv + c (10 dk + 5 dv) + 2 c^2`` (2.87x F at dk = dv = 128, c = 64)."""
    return (3 * dk * dv + c * (3 * dk + 2 * dv) + c * c / 3.0,
            8 * dk * dv + c * (10 * dk + 5 * dv) + 2 * c * c)


def delta_rule_bytes(dk: float, dv: float, c: float) -> tuple[float, float]:
    """HBM bytes per token and value head of the same kernels (F, B): BF16 q/k/v/w/u/v_new/o and
    their gradients, FP32 gates, the FP32 KK^T (``4c``) that the solve reads and turns into the
    BF16 (I+A)^-1 (``2c``, into a zeroed buffer), and the per-chunk states h ``[chunks, heads, dk,
    dv]`` in BF16 (``2 dk dv / c`` per token): F writes them in the state pass and reads them for
    the output; B recomputes and rewrites them, writes the state gradients dh the same size and
    reads both for dQ/dK/dW. F: cumsum, KK^T, solve, W/U, states, output
    ``14 dk + 12 dv + 14 c + 4 dk dv / c + 28``; B: W/U and states again, dV local, reverse state
    pass, dQ/dK/dW (+ the sum of its per-block dg), WY backward, dk and dg accumulation, reverse
    cumsum ``46 dk + 30 dv + 4 c + 8 dk dv / c + 76``. Re-reads that stay in L2 are not counted."""
    s = dk * dv / c
    return 14 * dk + 12 * dv + 14 * c + 4 * s + 28, 46 * dk + 30 * dv + 4 * c + 8 * s + 76


def delta_rule(name: str, tokens: float, spec: DeltaNetSpec) -> OpCost:
    """Chunked gated delta rule (Yang et al. 2024, "Gated Delta Networks", arXiv 2412.06464) as
    flash-linear-attention's ``chunk_gated_delta_rule`` runs it, per value head (q and k
    repeated to the value heads beforehand, as Megatron-Core does), chunk C, key dim dk, value
    dim dv.

    Model FLOPs: F = 2 * tokens * nv * (3 dk dv + C (3 dk + 2 dv) + C^2/3) (the kernels' forward,
    :func:`delta_rule_macs`), B = 2F (MFU convention), W = 0. The backward kernels execute
    ``8 dk dv + C (10 dk + 5 dv) + 2 C^2`` MACs per token-head (``kernel_flops``); rate class
    ``delta_rule``. Bytes: :func:`delta_rule_bytes`, the per-chunk states included. Kernels:
    F cumsum, KK^T, zero-fill and solve_tril, W/U, states, output (7); B W/U, states, dV local,
    reverse state pass, dQ/dK/dW, its dg sum, WY backward, two accumulations, reverse cumsum (10)."""
    c, dk, dv, nv = spec.chunk_size, spec.key_head_dim, spec.value_head_dim, spec.num_value_heads
    fm, bm = delta_rule_macs(dk, dv, c)
    fb, bb = delta_rule_bytes(dk, dv, c)
    th = tokens * nv
    f = 2.0 * th * fm
    return OpCost(name, (f, 2 * f, 0.0), (th * fb, th * bb, 0.0), kernels=(7, 10, 0), rate_class="delta_rule",
                  kernel_flops=(f, 2.0 * th * bm, 0.0))


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
    return OpCost(name, (f, 2 * f, 0.0), (io, 2 * io, 0.0), kernels=(5, 10, 0), rate_class="ssd")


def layout_copy(name: str, elems: float, kernels: tuple[int, int, int] = (1, 1, 0)) -> OpCost:
    """A BF16 copy into another memory layout (``.contiguous()`` of a transposed or sliced view):
    F reads and writes ``elems``; B copies the gradient back the same way. 0 FLOPs."""
    b = 2 * BF16 * elems
    return OpCost(name, (0.0, 0.0, 0.0), (b, b, 0.0), kernels=kernels)


def deltanet_glue_ops(spec: DeltaNetSpec, tokens: float, seq: float, where: str) -> tuple[OpCost, ...]:
    """The memory-bound work around the Gated DeltaNet convolution and delta rule, as
    Megatron-Core's ``GatedDeltaNet.forward`` runs it (NVIDIA/Megatron-LM
    ``megatron/core/ssm/gated_delta_net.py`` at bbc762d5, the code of the published Qwen3-Next
    runs), for ``tokens`` tokens (``qk = nk*dk``, ``v = nv*dv``):

    * ``"pre"``: q/k/v sliced from the in_proj output and transposed channels-first for
      ``causal_conv1d_fn`` (a copy of ``2qk + v`` channels; B copies the gradient back);
    * ``"mid"``: after the conv, q, k and v made contiguous (three copies; B one copy of the
      gradient into the conv's layout), the q/k L2 norms (FLA ``l2norm``: F reads and writes,
      B reads x and dy and writes dx), q and k repeated to the ``nv`` value heads when
      ``nv > nk`` (``repeat_interleave``; B sums the repeats), the output gate, beta and alpha
      made contiguous and the decay ``g = -exp(A_log) * softplus(alpha + dt_bias)`` in FP32 and
      ``beta = sigmoid(beta)``, each its own PyTorch kernel (F 10: three copies, cast, add,
      softplus, exp, negate, multiply, sigmoid; B 10 with the A_log and dt_bias reductions);
    * ``"post"``: the gated RMSNorm (Transformer Engine RMSNorm over ``dv`` per head, then
      ``y * silu(gate)``, a compiled kernel), and with more than one sequence per microbatch the
      copy back to sequence-first (a view when ``tokens == seq``)."""
    t = tokens
    nk, nv = spec.num_key_heads, spec.num_value_heads
    qk, v = nk * spec.key_head_dim, nv * spec.value_head_dim
    if where == "pre":
        return (layout_copy("conv_in_layout", t * (2 * qk + v)),)
    if where == "mid":
        ops = [layout_copy("qkv_layout", t * (2 * qk + v), (3, 1, 0)),
               elementwise("qk_l2norm", 2 * t * qk, 2 * t * qk, (2, 2, 0))]
        rep = nv // nk if nk else 1
        if rep > 1:
            b = BF16 * 2 * t * qk * (1 + rep)
            ops.append(OpCost("qk_repeat", (0.0, 0.0, 0.0), (b, b, 0.0), kernels=(2, 2, 0)))
        tn = t * nv
        # gate copy 4 B/elem; beta, alpha copies 8 B; decay in FP32: cast 6, add 8, softplus 8, multiply 8;
        # sigmoid 4. B: the same copies, the gradients through them and the A_log / dt_bias reductions.
        ops.append(OpCost("gate_decay", (0.0, 0.0, 0.0), (2 * BF16 * t * v + 42 * tn, 2 * BF16 * t * v + 56 * tn, 0.0),
                          kernels=(10, 10, 0)))
        return tuple(ops)
    ops = [norm("out_norm", t * v), elementwise("out_gate", 2 * t * v, t * v)]
    if tokens > seq:
        ops.append(layout_copy("out_layout", t * v))
    return tuple(ops)


# ---------------------------------------------------------------------------------------------
# Per-kind operator lists (tokens = tokens of one microbatch, before TP division)


def mixer_ops(mixer, hidden: int, tokens: float, seq: float) -> tuple[OpCost, ...]:
    """Operators of one token mixer including its input RMSNorm, whole layer (no TP split)."""
    h, t = hidden, tokens
    ops = [norm("input_norm", t * h)]
    if isinstance(mixer, AttentionSpec):
        q = mixer.num_heads * mixer.head_dim
        kv = mixer.num_kv_heads * mixer.head_dim
        ops += [gemm("q_proj", t, h, q * (2 if mixer.gated else 1), fp8_in="norm"),  # one linear_qkv
                gemm("kv_proj", t, h, 2 * kv, fp8_in="shared"),
                elementwise("qk_norm_rope", t * (q + kv), t * (q + kv), (4, 6, 0)),  # q, k norms + rope
                attention_core("attn", t, seq, mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.head_dim)]
        if mixer.gated:
            ops.append(elementwise("out_gate", 2 * t * q, t * q))
        ops.append(gemm("o_proj", t, q, h, split="k"))
    elif isinstance(mixer, MLASpec):
        nh, dqk = mixer.num_heads, mixer.qk_nope_head_dim + mixer.qk_rope_head_dim
        ql, kvl, rope = mixer.q_lora_rank, mixer.kv_lora_rank, mixer.qk_rope_head_dim
        ops += [gemm("q_down", t, h, ql), norm("q_norm", t * ql), gemm("q_up", t, ql, nh * dqk, fp8_in="norm"),
                gemm("kv_down", t, h, kvl + rope), norm("kv_norm", t * kvl),
                gemm("kv_up", t, kvl, nh * (mixer.qk_nope_head_dim + mixer.v_head_dim), fp8_in="norm"),
                elementwise("rope", t * nh * dqk, t * nh * dqk),
                attention_core("attn", t, seq, nh, nh, dqk, mixer.v_head_dim),
                gemm("o_proj", t, nh * mixer.v_head_dim, h, split="k")]
    elif isinstance(mixer, DeltaNetSpec):
        qk = mixer.num_key_heads * mixer.key_head_dim
        v = mixer.num_value_heads * mixer.value_head_dim
        ops += [gemm("in_proj", t, h, 2 * qk + 2 * v + 2 * mixer.num_value_heads, fp8_in="norm"),
                *deltanet_glue_ops(mixer, t, seq, "pre"),
                conv1d("conv", t, 2 * qk + v, mixer.conv_kernel),
                *deltanet_glue_ops(mixer, t, seq, "mid"),
                delta_rule("delta_rule", t, mixer),
                *deltanet_glue_ops(mixer, t, seq, "post"),
                gemm("out_proj", t, v, h, split="k")]
    elif isinstance(mixer, Mamba2Spec):
        d_in = mixer.num_heads * mixer.head_dim
        gn = mixer.n_groups * mixer.state_size
        ops += [gemm("in_proj", t, h, 2 * d_in + 2 * gn + mixer.num_heads, fp8_in="norm"),
                conv1d("conv", t, d_in + 2 * gn, mixer.conv_kernel),
                ssd_scan("ssd", t, mixer),
                elementwise("gated_norm", 2 * t * d_in, t * d_in, (1, 2, 0)),
                gemm("out_proj", t, d_in, h, split="k")]
    else:
        raise TypeError(f"unknown mixer spec {type(mixer).__name__}")
    ops.append(residual_add("mixer_residual", t * h))
    return tuple(ops)


def swiglu_ops(prefix: str, tokens: float, width: int, ffn: int, gated: bool = True,
               copies: float = 1.0, fc1_in: str = "cast", routed: bool = False) -> tuple[OpCost, ...]:
    """SwiGLU (gated) or plain 2-matrix MLP: fc1 width -> (2x)ffn, activation, fc2 ffn -> width.
    ``fc1_in``: fc1's FP8 input (``"norm"``: Transformer Engine's LayerNormLinear, the dense MLP);
    ``routed``: the routed experts' grouped GEMMs (FP8 row padding, :class:`GemmShape`)."""
    up = 2 * ffn if gated else ffn
    return (gemm(f"{prefix}fc1", tokens, width, up, copies, fp8_in=fc1_in, fp8_pad="in" if routed else ""),
            elementwise(f"{prefix}act", tokens * up, tokens * ffn),
            gemm(f"{prefix}fc2", tokens, ffn, width, copies, split="k", fp8_pad="out" if routed else ""))


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
    expert += list(swiglu_ops("expert_", a, width, moe.expert_ffn, moe.gated, local, routed=True))
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
            "", tokens, hidden, layer.mlp.ffn, layer.mlp.gated, fc1_in="norm") + (
            residual_add("mlp_residual", tokens * hidden),)
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
