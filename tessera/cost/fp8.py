"""FP8 as Transformer Engine runs it: what quantizing a GEMM's BF16 activation input costs under
each ``train.fp8_recipe`` (:class:`FP8Run`, :func:`fp8_quant`), beside the FP8 GEMM itself
(:func:`tessera.cost.flops.gemm_bytes`, :mod:`tessera.cost.efficiency`).

Read in TransformerEngine ``release_v2.16`` (c9877beb) and Megatron-Core ``TEGroupedMLP``
(44151194); the per-recipe table is in docs/cost-model.md ("FP8"). Pure functions of frozen
values.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost.flops import BF16, FP8, FP32, GemmShape


@dataclass(frozen=True)
class FP8Run:
    """How a run quantizes its FP8 linear layers (``train.fp8_recipe``; :func:`fp8_quant`).

    Attributes:
        recipe: Megatron-Core ``--fp8-recipe`` name (:data:`tessera.cost.types.FP8_RECIPES`):
            ``tensorwise`` (Transformer Engine ``Float8CurrentScaling``, one scale per tensor from
            its current amax), ``delayed`` (``DelayedScaling``, the scale from an amax history),
            ``mxfp8`` (``MXFP8BlockScaling``, one E8M0 scale per 32 elements, Blackwell) or
            ``blockwise`` (``Float8BlockScaling``, DeepSeek-V3's 1x128 activation and 128x128
            weight blocks with FP32 scales).
        pad_experts: the grouped expert GEMMs pad each expert's rows themselves (Megatron-Core's
            ``alltoall`` dispatcher; DeepEP and HybridEP pad while permuting).
    """

    recipe: str = "tensorwise"
    pad_experts: bool = False


@dataclass(frozen=True)
class QuantCost:
    """The FP8 quantization work of one GEMM in one phase: HBM ``bytes``, ``kernels`` launched and
    ``allreduces`` (one-float amax all-reduces over the tensor-parallel group)."""

    bytes: float = 0.0
    kernels: float = 0.0
    allreduces: int = 0


def fp8_quant(g: GemmShape, phase: int, run: FP8Run = FP8Run()) -> QuantCost:
    """What Transformer Engine runs to quantize a GEMM's BF16 activation input in phase 0/1/2
    (F/B/W), beside the GEMM (Transformer Engine 2.16 ``module/linear.py``,
    ``layernorm_linear.py``, ``grouped_linear.py``, ``csrc/quantizer.cpp``,
    ``csrc/extensions/cast.cpp``; Megatron-Core ``TEGroupedMLP``). F quantizes X (``m x k``), B
    quantizes dY (``m x n``), W reuses both (the wgrad reads the column-wise copies made in F and
    B). Per quantized tensor of ``e`` elements (per local expert of a grouped GEMM, whose
    ``split_quantize`` launches one quantizer per expert except under ``delayed``, which has a
    fused multi-tensor cast-transpose):

    * ``tensorwise`` (current scaling): an amax reduction kernel reads the tensor (2 B/elem;
      skipped for ``fp8_in="norm"``, where TE's RMSNorm kernel computes the amax of its output),
      a kernel turns the amax into the scale, and the cast-transpose reads it again (2 B) and
      writes the row-wise FP8 copy and the transposed one the Hopper TN-only wgrad/dgrad GEMMs
      need (2 x 1 B): 6 B/elem, 3 kernels.
    * ``delayed``: the cast-transpose alone (4 B/elem), the amax a side output; one kernel.
    * ``mxfp8`` / ``blockwise``: one kernel writes both copies and their block scales
      (E8M0 per 32 elements: 2/32 B/elem; FP32 per 128: 8/128 B/elem); no amax pass.

    Under sequence parallelism (``tp > 1``) a column-parallel GEMM's X (F) and a row-parallel
    one's dY (B) are quantized on the local ``m/tp`` rows and all-gathered in FP8; per-tensor
    recipes gather the row-wise copy only (``supports_only_rowwise_all_gather``): the cast writes
    1 B/elem, ``tensorwise`` all-reduces the amax over the group (a one-float NCCL all-reduce the
    compute stream waits for), and B transposes the gathered X and dY (read and write 1 B/elem of
    the full ``m`` rows, one kernel each). ``fp8_in="shared"``: the other GEMM of the module did
    F's cast; its dY bytes are counted, its kernels are the other's.

    Expert padding (``run.pad_experts`` and ``g.fp8_pad``, grouped GEMMs): ``fp8_pad="in"`` copies
    the input rows into the padded buffer in F and back in B (4 B/elem of ``m x k``, 2 kernels:
    hidden states and probabilities), ``"out"`` unpads the output in F and pads dY in B (``m x n``,
    1 kernel). The padded rows themselves (fewer than 16 per expert, 32 under MXFP8: Transformer
    Engine ``get_align_size_for_quantization``) are not added.

    Weight casts are not charged: Megatron-Core passes ``is_first_microbatch`` so Transformer
    Engine caches the FP8 weights for the iteration, and Megatron-Bridge's FP8 recipes keep FP8
    parameters (``fp8_param_gather``), cast once per step by the optimizer."""
    if not g.fp8 or phase == 2:
        return QuantCost()
    recipe = run.recipe
    per_tensor = recipe in ("tensorwise", "delayed")
    cols = g.k if phase == 0 else g.n
    sp = g.tp > 1 and g.split == ("n" if phase == 0 else "k")  # the quantized tensor is all-gathered
    e = g.m * cols / (g.tp if sp else 1.0)
    groups = g.groups
    nbytes, kernels, allreduces = 0.0, 0.0, 0
    if not (phase == 0 and g.fp8_in == "shared"):
        write = FP8 * (1 if sp and per_tensor else 2)
        scales = {"mxfp8": 2.0 / 32, "blockwise": 2.0 * FP32 / 128}.get(recipe, 0.0)
        nbytes += e * (BF16 + write + scales)
        kernels += 1 if recipe == "delayed" else groups
        if recipe == "tensorwise":
            if not (phase == 0 and g.fp8_in == "norm"):
                nbytes += BF16 * e
                kernels += groups
            kernels += groups
            allreduces += int(sp)
        if g.fp8_in == "shared":  # B: quantized with the other GEMM's dY, in its kernels
            kernels, allreduces = 0.0, 0
    if phase == 1 and per_tensor and g.tp > 1:  # transposes of the gathered row-wise FP8 copies
        if g.split == "n" and g.fp8_in != "shared":
            nbytes += 2 * FP8 * g.m * g.k
            kernels += 1
        if g.split == "k":
            nbytes += 2 * FP8 * g.m * g.n
            kernels += 1
    if run.pad_experts and g.fp8_pad:
        nbytes += 2 * BF16 * g.m * (g.k if g.fp8_pad == "in" else g.n)
        kernels += 2 if g.fp8_pad == "in" else 1
    return QuantCost(nbytes, kernels, allreduces)


def fp8_cast_bytes(g: GemmShape, phase: int, run: FP8Run = FP8Run()) -> float:
    """HBM bytes of :func:`fp8_quant` (the quantization of a GEMM's activation input)."""
    return fp8_quant(g, phase, run).bytes


