"""GPU check: what one GPU can prove about the engine, in parts, each with a pass/fail and numbers.

Usage::

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py --json benchmarks/results/gpu-h200.json --budget-s 420
    python benchmarks/gpu_check.py --smoke-cpu [--json FILE]      # the same functions on CPU, tiny shapes
    python benchmarks/gpu_check.py --write-programs benchmarks/results/gpu-check-programs.json

Without CUDA (and without ``--smoke-cpu``) it prints one line saying there is no GPU, writes
``{"skipped": "..."}`` to ``--json`` if given, and exits 0: nothing is measured.

What it needs on the GPU machine: Python, torch, transformers and numpy (the image's packages);
the project is put on ``sys.path`` from this file's location (it need not be installed), and
``.gpu_wheels/site`` too when it exists (``benchmarks/gpu_wheels.py``: ``fla-core`` for the
Gated DeltaNet kernels, ``einops``, ``omegaconf``). Nothing here imports Ray, DeepSpeed, PySCIPOpt,
cvxpy, W&B or omegaconf (``tests/test_gpu_check.py`` runs the CPU dry run with their imports
blocked); the Programs come from a committed file (:data:`PROGRAMS_FILE`, written by
``--write-programs``), so no planner runs there. DeepSpeed's gating is used when it imports, else
:mod:`tessera.model.gating` (``GATING_SOURCE`` in part 0).

Parts (cheapest and most diagnostic first). Each is a function returning a dict with ``ok``
(True / False; None when skipped), its numbers, and ``skipped`` (why) where this device cannot
evaluate it or the budget ran out. One progress line per part on stdout; the JSON is rewritten
after every part, so a killed run keeps what finished; the exit status is 1 when a part failed.
A part that raises is a failed part (``error``: the exception's one line), never a lost run.

0. ``env``: versions (Python, torch, CUDA, cuDNN, NCCL, transformers, triton, numpy, fla),
   which optional packages exist, whether the project's modules import (all that this script
   uses), who routes (``tessera.model.moe.GATING_SOURCE``), which Gated DeltaNet kernel
   transformers picked, the device (name, capability, memory). Fails when a project module does
   not import or Ray / PySCIPOpt / cvxpy / W&B got imported.
1. ``nccl_eager``: a one-rank NCCL world created eagerly (``init_process_group(device_id=cuda:0)``)
   and a one-rank ``new_group(device_id=...)``; an ``all_reduce`` of 2**20 FP32 on each must
   return its input; the group's ``bound_device_id`` must be ``cuda:0``. CPU: the same calls on
   gloo without ``device_id`` (``skipped`` says the eager NCCL init was not exercised).
2. ``programs``: pp=1 Programs from the committed file on one small model
   (:func:`check_spec`: tiny-qwen3-next's Gated DeltaNet and gated-attention layers, 8 experts
   top-2 with a shared expert; 2 microbatches of 1 x 32 tokens): ``1f1b`` (W inside
   B), ``1f1b`` with split W, ``1f1b`` with F&B pairs (``FB``), ``zb-h1``, ``interleaved-1f1b``
   vpp=2 (two chunks on the rank: the activation and its gradient handed over locally),
   ``dualpipe-v`` (with F&B pairs) and ``zb-v`` (the V's turn on the rank, also local), split W
   with full and with selective recompute, and the bubble optimizer on (the split-W Program
   slot-annotated with W deferred, :class:`tessera.engine.dbo.DBOPolicy`; at pp=1 and ep=1 no slot
   has a predicted idle time, so it moves nothing: its counters are reported). FP32 with
   deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts, TF32 off):
   the loss and every gradient bitwise equal across the Programs and to the single-process
   reference (:func:`tessera.testing.reference.reference_train`, the same task functions), and
   within :data:`FP32_PLAIN_TOL` of plain autograd of the whole model (one ``backward`` per
   microbatch: another summation order, so not bitwise). Where CUDA runs ops without a
   deterministic kernel (:func:`tessera.model.determinism.cuda_nondeterministic`: the DeltaNet's
   ``cumsum``), FP32 bitwise is reported, not required. BF16 (the engine's ``compute_dtype``,
   autocast, FP32 master weights): every Program within :data:`BF16_TOL` of plain autograd in
   BF16; whether the BF16 Programs are bitwise equal to each other, and how far BF16 is from the
   FP32 reference, are reported.
3. ``memory``: one real-size layer of each kind (:func:`timing_spec`) in BF16, one profiled
   iteration: per task (F, B, W of mixer, router, dispatch, expert, shared, combine, embed, head)
   the bytes its forward saves for the backward (:class:`tessera.model.saved.SavedTensorMeter`),
   and on CUDA ``torch.cuda.memory_allocated`` after minus before and
   ``torch.cuda.max_memory_allocated`` (reset before the task) minus before; the forward's
   numbers against the memory model's saved tensors of that task kind
   (:func:`tessera.cost.memory.layer_tensors`, :func:`~tessera.cost.memory.head_tensors`,
   assigned to kinds by :data:`MODEL_TENSOR_KIND`). Pass: every task measured, finite; the
   ratios are reported, not judged (the memory model assumes FlashAttention and fused kernels,
   the engine runs transformers' eager attention and keeps autocast's BF16 weight copies).
4. ``task_timings``: the same layers, per task F, B and W with the engine's timer (CUDA events;
   CPU: host clock), median over microbatches and profiled iterations, against
   :func:`tessera.cost.analytic.analytic_costs` for the ``h200`` preset (``cpu`` on the dry run)
   at the same shape with ``ep=8`` (its MoE tasks are an ep=8 rank's): ratio per (layer kind,
   task kind, phase) and per (task kind, phase) summed over the layers. Dispatch and combine are
   all-to-alls in the model and local gathers here: their ratios are listed, marked
   ``comparable: false``. The Gated DeltaNet runs transformers' torch path here; part 7 times the
   FLA kernels. Pass: every task timed, finite and >= 0, every comparable analytic time > 0.
5. ``overlap``: a GEMM chain on the compute stream while a pinned host-to-device copy, or a
   one-rank NCCL ``all_to_all_single``, runs on a :class:`tessera.model.streams.CommStream`:
   GEMM alone, transfer alone, both serial on one stream, both overlapped (CUDA events, median of
   3). Pass: the results equal the serial ones bitwise and overlapped <= 1.05 x serial. CPU: the
   same code with no side stream and gloo (results checked; the timing ``skipped``).
6. ``throughput``: tokens/s and MFU of part 4's unprofiled iterations (model FLOPs: the
   analytic model's task FLOPs, no recompute; peak: the preset's dense BF16, on the dry run a
   BF16 matmul measured on this CPU). Pass: 0 < MFU < 1.
7. ``deltanet_fla``: the Gated DeltaNet layer's F/B/W with FLA's ``chunk_gated_delta_rule``
   (``fla-core``) instead of transformers' torch path, and the mixer's output of both on one
   input (pass: relative L2 difference <= :data:`FLA_TOL`). Last, because Triton compiles and
   autotunes FLA's kernels on first use. Skipped when ``fla.ops.gated_delta_rule`` does not import
   or there is no CUDA.

Shapes (part 3, 4, 7; :func:`timing_spec`): Qwen3-Next-80B-A3B's numbers from the public
Hugging Face config ``Qwen/Qwen3-Next-80B-A3B-Instruct`` (config.json; :mod:`tessera.spec.presets`):
hidden 2048, vocab 151936; gated attention 16 query / 2 KV heads of 256, RoPE on 25 %; Gated
DeltaNet 16 key / 32 value heads of 128, conv kernel 4; MoE 512 experts, top-10, expert FFN 512,
shared expert FFN 512. One microbatch is 1 x 4096 tokens, 2 microbatches (Program
``timing/1f1b``, split W). The MoE layer is built with the 64 experts an ep=8 rank holds and routes
the rank's 4096 tokens top-10 over them (the layer built with ``num_experts=64``, no EP group):
under balanced routing an ep=8 rank's experts see 8 * 4096 * 10 / 8 = 40960 rows, the same as
here; the router GEMM is 2048 x 64 here, 2048 x 512 in the model (reported, not corrected).
Dry run: tiny-qwen3-next's layer kinds (hidden 64, 8 experts top-2) at ep=2 (4 local experts),
1 x 64 tokens. Hardware numbers: :func:`tessera.spec.hardware_presets.h200` (NVIDIA H200 datasheet:
989 TFLOP/s dense BF16, 141 GB HBM3e, 4.8 TB/s).

Budget: ``--budget-s`` (default 420 s, planned to finish under 8 minutes on an H200). Before a
part starts, the seconds left must cover its estimate (:data:`PARTS`), otherwise it is skipped
with the reason; parts 4 and 7 also stop adding iterations when the budget runs out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import inspect
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

HERE = Path(__file__).resolve().parent  # benchmarks/ holds scripts, not modules: not on sys.path
ROOT = HERE.parent
PROGRAMS_FILE = HERE / "results" / "gpu-check-programs.json"
WHEELS_SITE = ROOT / ".gpu_wheels" / "site"

if TYPE_CHECKING:
    import torch

    from tessera.program.instructions import Program
    from tessera.spec.model import ModelSpec

NO_GPU = "no GPU: torch.cuda.is_available() is False, nothing measured (benchmarks/gpu_check.py needs CUDA)"
NO_SWITCH = ("the Gated DeltaNet kernel switch did not take effect: this transformers calls its chunked gated delta "
             "rule another way (gpu_check.deltanet_kernel)")
PROGRAMS_FORMAT = "tessera-gpu-check-programs/1"
SEED = 0
CHECK_M, CHECK_MBS, CHECK_SEQ = 2, 1, 32  # part 2: microbatches x (micro batch size x sequence)
TIMING_M, TIMING_MBS = 2, 1  # parts 3, 4, 7
TIMING_SEQ = {"cuda": 4096, "cpu": 64}
TIMING_EP = {"cuda": 8, "cpu": 2}  # the EP size whose rank's experts the MoE layer holds
HEAVY = ("ray", "pyscipopt", "cvxpy", "wandb")
"""Packages the device image lacks that nothing on this script's path may import."""
OPTIONAL = ("deepspeed", "omegaconf", "fla", "einops", "triton", "matplotlib", "rich", "yaml", *HEAVY)

FP32_PLAIN_TOL = {"loss_rel": 1e-5, "grad_max_rel": 1e-4, "grad_rel_l2": 1e-5}
"""FP32, each Program vs plain autograd: the mean loss within ``loss_rel`` relative; per gradient
tensor ``max|a - b| <= grad_max_rel * max|b|``; over all gradients ``||a - b|| / ||b|| <=
grad_rel_l2``. The same arithmetic in another summation order (dry run: 1e-6 to 3e-6 per tensor,
depending on the CPU threads, 3e-7 in L2, equal losses)."""
BF16_TOL = {"loss_rel": 1e-2, "grad_max_rel": 5e-2, "grad_rel_l2": 1e-2}
"""BF16 (autocast), each Program vs plain autograd in BF16, the same three measures. One BF16
rounding is up to 2**-8 = 3.9e-3 relative; the dry run differs by 1.7e-7 per tensor and 9e-9 in
L2 (CPU BF16 GEMMs accumulate in FP32 as cuBLAS does). Against the FP32 reference BF16 differs by
far more, as plain autograd in BF16 does (dry run: 0.22 per tensor, 4e-2 in L2; 1.2 in L2 on a
4-layer version of the model, where routes flip): reported, not judged."""
FLA_TOL = 5e-2
"""Part 7: relative L2 difference of the DeltaNet mixer's BF16 output, FLA vs torch path."""

MODEL_TENSOR_KIND = {
    # mixer (attention / DeltaNet) with its input norm
    "input": "mixer", "normed": "mixer", "qk_prenorm": "mixer", "qkv": "mixer", "lse": "mixer",
    "attn_out": "mixer", "gate": "mixer", "gated_out": "mixer", "proj": "mixer", "conv_out": "mixer",
    "chunk_inverse": "mixer", "core_out": "mixer", "normed_out": "mixer",
    # MoE: the router task holds the pre-MLP norm's input and output and the router probabilities,
    # the dispatch task the gathered rows (the experts' input), the expert task its fc1 / act outputs
    "mlp_input": "router", "router_input": "router", "router_probs": "router",
    "expert_in": "dispatch", "expert_fc1_out": "expert", "expert_act_out": "expert",
    "shared_fc1_out": "shared", "shared_act_out": "shared",
    # head
    "final_norm_in": "head", "logits_in": "head", "softmax": "head",
}
"""Which task's forward creates each saved tensor of :mod:`tessera.cost.memory` (its names)."""


# --- the device --------------------------------------------------------------------------------------------------
class Device:
    """Where the parts run and the few calls that differ: ``cuda:0`` (events, the caching allocator's
    counters, NCCL) or, for ``--smoke-cpu``, the CPU (host clock, no memory counters, gloo, one
    intra-op thread). Every part calls only these, so the dry run executes the same functions."""

    def __init__(self, smoke: bool) -> None:
        import torch

        self.smoke, self.cuda = smoke, not smoke
        self.kind = "cpu" if smoke else "cuda"
        self.torch = torch.device("cpu") if smoke else torch.device("cuda", 0)
        self.backend = "gloo" if smoke else "nccl"
        self.clock = "host perf_counter" if smoke else "CUDA events"
        if self.cuda:
            torch.cuda.set_device(self.torch)
        else:  # tiny GEMMs: one thread is 5x faster than two spinning on a shared 2-core machine
            torch.set_num_threads(1)
        self.name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(self.torch)
        self.preset = "cpu" if smoke else "h200"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.torch)

    def mark(self):
        """A time mark: a recorded CUDA event on the current stream, or the host clock (s)."""
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        """Milliseconds between two marks (CUDA: synchronizes first)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def time_ms(self, fn: Callable[[], object], reps: int = 3) -> float:
        """Median ms of ``reps`` runs of ``fn`` (each synchronized before it starts)."""
        out = []
        for _ in range(reps):
            self.sync()
            a = self.mark()
            fn()
            out.append(self.ms(a, self.mark()))
        return statistics.median(out)

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.torch)

    def allocated(self) -> int | None:
        """Bytes the caching allocator has handed out (None on CPU: no counter)."""
        if self.cuda:
            import torch

            return torch.cuda.memory_allocated(self.torch)
        return None

    def peak(self) -> int | None:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.torch)
        return None


@dataclasses.dataclass
class Ctx:
    """What the parts share: the arguments, the device, the clock, the built models."""

    args: argparse.Namespace
    dev: Device
    t0: float
    cache: dict = dataclasses.field(default_factory=dict)

    def left(self) -> float:
        """Seconds of ``--budget-s`` left."""
        return self.args.budget_s - (time.monotonic() - self.t0)


# --- specs and Programs ------------------------------------------------------------------------------------------
def check_spec() -> ModelSpec:
    """Part 2's model: tiny-qwen3-next's two layer kinds, a Gated DeltaNet layer and a gated
    attention layer, each with the MoE (hidden 64, vocab 256, 8 experts top-2, expert and shared
    FFN 64): :func:`timing_spec` ``("cpu", local=False)``."""
    return dataclasses.replace(timing_spec("cpu", local=False), name="tiny-qwen3-next-2layer-check")


def timing_spec(kind: str, local: bool = True) -> ModelSpec:
    """Parts 3, 4, 7: one Gated DeltaNet layer (index 0) and one gated-attention layer (index 1),
    each with the MoE, plus embedding and head: Qwen3-Next-80B-A3B's sizes on ``cuda``,
    tiny-qwen3-next's on ``cpu`` (module docstring, "Shapes").

    ``local``: the MoE holds the experts of one rank of :data:`TIMING_EP` (``num_experts / ep``,
    top-k unchanged; what the engine builds); False: all experts (what the cost model is given,
    with ``ep`` in its :class:`~tessera.cost.types.ParallelShape`)."""
    from tessera.spec.model import AttentionSpec, DeltaNetSpec, MoESpec
    from tessera.spec.presets import build_model, get_model

    base = get_model("qwen3-next-80b-a3b" if kind == "cuda" else "tiny-qwen3-next")
    delta = next(l for l in base.layers if isinstance(l.mixer, DeltaNetSpec))
    attn = next(l for l in base.layers if isinstance(l.mixer, AttentionSpec))
    moe = delta.mlp
    assert isinstance(moe, MoESpec)
    if local:
        moe = dataclasses.replace(moe, num_experts=moe.num_experts // TIMING_EP[kind])
    name = f"{base.name}-2layer" + (f"-ep{TIMING_EP[kind]}-rank" if local else "")
    return build_model(name, base.hidden, base.vocab, [(delta.mixer, moe), (attn.mixer, moe)],
                       rope_theta=base.rope_theta, max_positions=base.max_positions)


def moe_layer_indices(spec: ModelSpec) -> tuple[int, ...]:
    """Indices of ``spec``'s layers with a routed MoE."""
    from tessera.spec.model import MoESpec

    return tuple(l.index for l in spec.layers if isinstance(l.mlp, MoESpec))


def program_plans() -> dict:
    """The Plans behind :data:`PROGRAMS_FILE`: name -> (Plan, slot annotation or None)."""
    from tessera.program.plan import Partition, Plan

    n = check_spec().num_layers
    whole = Partition((-1, n + 1))

    def check(template, vpp=1, overlap=False, split_w=True, bounds=whole):
        return Plan("gpu-check", template, 1, vpp, CHECK_M, bounds, overlap=overlap, split_w=split_w)

    slots = {"moe_layers": list(moe_layer_indices(check_spec())), "defer_w": True}
    two = timing_spec("cpu").num_layers
    assert two == timing_spec("cuda").num_layers  # one Program for the dry run and the GPU
    return {
        "check/1f1b": (check("1f1b", split_w=False), None),
        "check/1f1b-split-w": (check("1f1b"), None),
        "check/1f1b-fb": (check("1f1b", overlap=True), None),
        "check/zb-h1": (check("zb-h1"), None),
        "check/interleaved-vpp2": (check("interleaved-1f1b", vpp=2, bounds=Partition((-1, n // 2, n + 1))), None),
        "check/dualpipe-v": (check("dualpipe-v", vpp=2, overlap=True, bounds=Partition((-1, n // 2, n + 1))), None),
        "check/zb-v": (check("zb-v", vpp=2, bounds=Partition((-1, n // 2, n + 1))), None),
        "check/dbo": (check("1f1b"), slots),
        "timing/1f1b": (Plan("gpu-check-timing", "1f1b", 1, 1, TIMING_M, Partition((-1, two + 1)), overlap=False,
                             split_w=True), None),
    }


def build_programs() -> dict:
    """The JSON content of :data:`PROGRAMS_FILE`, compiled now (imports the compiler; the GPU run
    only reads the file). Each entry: its Plan, the slot annotation applied (or None) and the
    rank-0 Program."""
    from tessera.program.compiler import compile_plan
    from tessera.program.slots import annotate_slots

    out = {}
    for name, (plan, slots) in program_plans().items():
        progs = compile_plan(plan)
        if slots is not None:
            progs = annotate_slots(progs, slots["moe_layers"], defer_w=slots["defer_w"])
        out[name] = {"plan": plan.to_dict(), "slots": slots, "program": progs[0].to_dict()}
    return {"format": PROGRAMS_FORMAT,
            "written_by": "python benchmarks/gpu_check.py --write-programs benchmarks/results/gpu-check-programs.json",
            "programs": out}


def load_programs(path: Path = PROGRAMS_FILE) -> dict[str, Program]:
    """name -> Program from ``path`` (no compiler, no planner).

    Raises:
        ValueError: the file's format is not :data:`PROGRAMS_FORMAT` (write it again)."""
    from tessera.program.instructions import Program

    d = json.loads(Path(path).read_text())
    if d.get("format") != PROGRAMS_FORMAT:
        raise ValueError(f"{path}: format {d.get('format')!r}, expected {PROGRAMS_FORMAT!r}; write it again with "
                         "--write-programs")
    return {name: Program.from_dict(e["program"]) for name, e in d["programs"].items()}


# --- comparisons -------------------------------------------------------------------------------------------------
def compare(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict:
    """Tensors by name against ``want``: ``bitwise`` (same names, every ``torch.equal``),
    ``tensors_differ`` (how many are not bitwise equal), ``max_abs`` (largest ``|a - b|``),
    ``max_rel`` (largest over tensors of ``max|a - b| / max|b|``; inf for a difference where
    ``b`` is all zeros), ``rel_l2`` (``||a - b|| / ||b||`` over all tensors together) and
    ``worst`` (the tensor with the largest ``max_rel``). Statistics in float64."""
    import torch

    if got.keys() != want.keys():
        return {"bitwise": False, "names_differ": sorted(set(got) ^ set(want))[:5], "tensors_differ": None,
                "max_abs": math.inf, "max_rel": math.inf, "rel_l2": math.inf, "worst": None}
    differ, max_abs, max_rel, worst, num, den = 0, 0.0, 0.0, None, 0.0, 0.0
    for k in sorted(want):
        a, b = got[k], want[k]
        if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
            den += float(b.double().square().sum())
            continue
        differ += 1
        if a.shape != b.shape:
            return {"bitwise": False, "shape_differs": k, "tensors_differ": differ, "max_abs": math.inf,
                    "max_rel": math.inf, "rel_l2": math.inf, "worst": k}
        a64, b64 = a.detach().double(), b.detach().double()
        d = (a64 - b64).abs()
        m, scale = float(d.max()) if d.numel() else 0.0, float(b64.abs().max()) if b64.numel() else 0.0
        rel = m / scale if scale > 0 else (0.0 if m == 0 else math.inf)
        max_abs = max(max_abs, m)
        if rel >= max_rel:
            max_rel, worst = rel, k
        num += float(d.square().sum())
        den += float(b64.square().sum())
    rel_l2 = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return {"bitwise": differ == 0, "tensors_differ": differ, "max_abs": max_abs, "max_rel": max_rel,
            "rel_l2": rel_l2, "worst": worst}


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / |b|`` (0 when equal, inf when ``b`` is 0 and ``a`` is not)."""
    return 0.0 if a == b else (abs(a - b) / abs(b) if b != 0 else math.inf)


def named_grads(mods) -> dict[str, torch.Tensor]:
    """Gradients of stage modules under global names (``layers.<layer index>.…``, ``embed.…``,
    ``head.…``); a parameter without a gradient counts as zeros. Detached clones."""
    import torch

    def g(p):
        return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()

    out = {}
    for m in mods:
        for layer in m.layers:
            out.update({f"layers.{layer.index}.{n}": g(p) for n, p in layer.named_parameters()})
        for prefix, sub in (("embed", m.embed), ("head", m.head)):
            if sub is not None:
                out.update({f"{prefix}.{n}": g(p) for n, p in sub.named_parameters()})
    return out


# --- the Gated DeltaNet kernel switch ----------------------------------------------------------------------------
def fla_status() -> tuple[bool, str]:
    """Whether FLA's ``chunk_gated_delta_rule`` imports (fla-core, triton), and its version or why not."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
        return True, str(getattr(importlib.import_module("fla"), "__version__", "?"))
    except Exception as e:  # a missing package, or triton failing to load
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def transformers_deltanet_kernel() -> str:
    """Which chunked gated delta rule transformers' Qwen3-Next resolved at import time: ``fla``
    when the function it calls wraps FLA's, ``torch`` otherwise (its own pure-torch path; on a
    CPU input it takes that path anyway)."""
    import transformers.models.qwen3_next.modeling_qwen3_next as q

    fn = getattr(q, "torch_chunk_gated_delta_rule", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if callable(v) and str(getattr(v, "__module__", "")).startswith("fla"):
            return "fla"
    return "torch"


@contextlib.contextmanager
def deltanet_kernel(module, impl: str, calls: Counter):
    """Route every Gated DeltaNet mixer of ``module`` through ``impl`` (``torch``: transformers'
    pure-torch ``torch_chunk_gated_delta_rule``; ``fla``: ``fla.ops.gated_delta_rule.
    chunk_gated_delta_rule`` with the keyword arguments it takes) and count the calls in ``calls``.

    Transformers 5 looks the function up as a module global at each call; older versions kept
    it on the module (``chunk_gated_delta_rule``): both are switched and restored after.

    Raises:
        ImportError: ``impl="fla"`` and FLA does not import.
    """
    import transformers.models.qwen3_next.modeling_qwen3_next as q

    current = getattr(q, "torch_chunk_gated_delta_rule")
    torch_fn = inspect.unwrap(current)
    if impl == "torch":
        fn = torch_fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

        takes = set(inspect.signature(fla_fn).parameters)

        def fn(query, key, value, g, beta, **kw):
            return fla_fn(query, key, value, g=g, beta=beta, **{k: v for k, v in kw.items() if k in takes})

    def counted(*a, **kw):
        calls[impl] += 1
        return fn(*a, **kw)

    q.torch_chunk_gated_delta_rule = counted
    held = [(m, m.chunk_gated_delta_rule) for m in module.modules()
            if isinstance(m, q.Qwen3NextGatedDeltaNet) and hasattr(m, "chunk_gated_delta_rule")]
    for m, _ in held:
        m.chunk_gated_delta_rule = counted
    try:
        yield
    finally:
        q.torch_chunk_gated_delta_rule = current
        for m, old in held:
            m.chunk_gated_delta_rule = old


# --- part 0: env -------------------------------------------------------------------------------------------------
PROJECT_MODULES = (
    "tessera.model", "tessera.model.moe", "tessera.model.saved", "tessera.model.streams", "tessera.model.ep.plan",
    "tessera.model.determinism", "tessera.engine", "tessera.engine.dbo", "tessera.program.instructions",
    "tessera.program.plan", "tessera.cost.analytic", "tessera.cost.memory", "tessera.spec.presets",
    "tessera.spec.hardware_presets", "tessera.dbo", "tessera.testing.reference", "tessera.train.worker.metrics",
)
"""Every project module this script imports on the GPU path (part 0 imports them all first)."""


def _version(name: str) -> str | None:
    """The installed distribution's version (None when not installed)."""
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def part_env(ctx: Ctx) -> dict:
    """Part 0 (module docstring): versions, packages, the project's imports, the device."""
    import importlib.util

    import torch

    dev = ctx.dev
    failed = {}
    for m in PROJECT_MODULES:
        try:
            importlib.import_module(m)
        except Exception as e:
            failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    moe = sys.modules.get("tessera.model.moe")
    present = {}
    for name in OPTIONAL:
        try:
            present[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            present[name] = False
    fla_ok, fla_info = fla_status()
    heavy = sorted(m for m in HEAVY if sys.modules.get(m) is not None)
    out = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if dev.cuda else None,
        "nccl": (".".join(map(str, v)) if isinstance(v := torch.cuda.nccl.version(), tuple) else str(v))
        if dev.cuda else None,
        "transformers": _version("transformers"), "triton": _version("triton"), "numpy": _version("numpy"),
        "fla_core": _version("fla-core"), "fla_kernels_import": fla_ok, "fla": fla_info,
        "deltanet_kernel_transformers_picked": transformers_deltanet_kernel() if "tessera.model" not in failed
        else None,
        "gating_source": getattr(moe, "GATING_SOURCE", "deepspeed") if moe is not None else None,
        "wheels_site": str(WHEELS_SITE) if str(WHEELS_SITE) in sys.path else None,
        "wheels_site_mib": sum(f.stat().st_size for f in WHEELS_SITE.rglob("*") if f.is_file()) / 2 ** 20
        if str(WHEELS_SITE) in sys.path else 0.0,
        "packages_present": present, "project_modules": len(PROJECT_MODULES), "project_import_errors": failed,
        "heavy_imported": heavy, "device": dev.name, "clock": dev.clock,
        "deterministic_env": {"CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
    }
    if dev.cuda:
        p = torch.cuda.get_device_properties(dev.torch)
        out.update(capability=f"{p.major}.{p.minor}", memory_gb=p.total_memory / 1e9, sms=p.multi_processor_count)
    out["ok"] = not failed and not heavy
    return out


# --- part 1: eager NCCL ------------------------------------------------------------------------------------------
def _free_port() -> int:
    """A free TCP port on 127.0.0.1 for the one-rank rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(dev: Device) -> dict:
    """A one-rank default group on ``dev``'s backend (NCCL: eager, ``device_id``); returns timings."""
    import torch.distributed as dist

    if dist.is_initialized():
        return {"reused": True}
    if dev.cuda:  # one rank: NCCL's bootstrap needs no network, loopback is enough (the machine has none)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    kw = {"device_id": dev.torch} if dev.cuda else {}
    t = time.perf_counter()
    dist.init_process_group(dev.backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), **kw)
    return {"reused": False, "init_ms": (time.perf_counter() - t) * 1e3}


def part_nccl(ctx: Ctx) -> dict:
    """Part 1 (module docstring): eager one-rank NCCL (gloo on the dry run) and an ``all_reduce``.
    The default group stays up for part 5; :func:`run` destroys it at the end."""
    import torch
    import torch.distributed as dist

    dev = ctx.dev
    out = {"backend": dev.backend, **init_world(dev)}
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    x = torch.arange(1 << 20, dtype=torch.float32, device=dev.torch)
    y = x.clone()
    a = time.perf_counter()
    dist.all_reduce(y)
    dev.sync()
    out["first_all_reduce_ms"] = (time.perf_counter() - a) * 1e3
    a = time.perf_counter()
    sub = dist.new_group([0], group_desc="gpu_check", **({"device_id": dev.torch} if dev.cuda else {}))
    out["new_group_ms"] = (time.perf_counter() - a) * 1e3
    z = x.clone()
    dist.all_reduce(z, group=sub)
    dev.sync()
    out.update(bound_device_id=str(bound), nccl_socket_ifname=os.environ.get("NCCL_SOCKET_IFNAME"),
               all_reduce_equal=bool(torch.equal(y, x)),
               new_group_all_reduce_equal=bool(torch.equal(z, x)))
    out["ok"] = out["all_reduce_equal"] and out["new_group_all_reduce_equal"] and (
        not dev.cuda or bound == dev.torch)
    if dev.cuda:
        out["nccl_version"] = ".".join(map(str, v)) if isinstance(v := torch.cuda.nccl.version(), tuple) else str(v)
    else:
        out["skipped"] = ("eager NCCL init (device_id) needs CUDA: the same calls ran on gloo without device_id, "
                          "results checked")
    return out


# --- part 2: Programs --------------------------------------------------------------------------------------------
VARIANTS = (
    # name, Program (PROGRAMS_FILE), recompute (mode, modules), bubble optimizer
    ("1f1b", "check/1f1b", ("none", ()), False),
    ("1f1b-split-w", "check/1f1b-split-w", ("none", ()), False),
    ("1f1b-fb-pairs", "check/1f1b-fb", ("none", ()), False),
    ("zb-h1", "check/zb-h1", ("none", ()), False),
    ("interleaved-vpp2", "check/interleaved-vpp2", ("none", ()), False),
    ("dualpipe-v", "check/dualpipe-v", ("none", ()), False),
    ("zb-v", "check/zb-v", ("none", ()), False),
    ("recompute-full", "check/1f1b-split-w", ("full", ()), False),
    ("recompute-selective", "check/1f1b-split-w", ("selective", ("core_attn", "layernorm", "moe_act")), False),
    ("dbo", "check/dbo", ("none", ()), True),
)
"""Part 2's runs: each a Program of :data:`PROGRAMS_FILE` on :func:`check_spec`."""


def check_batch(spec: ModelSpec, dev: Device):
    """Part 2's batch: ``[CHECK_M, CHECK_MBS, CHECK_SEQ]`` token ids (and labels) drawn by seed."""
    import torch

    from tessera.engine import Batch

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, spec.vocab, (CHECK_M, CHECK_MBS, CHECK_SEQ + 1), generator=g)
    return Batch.from_tokens(ids.to(dev.torch))


def run_variant(ctx: Ctx, spec: ModelSpec, prog: Program, batch, dtype, recompute, dbo: bool) -> dict:
    """One iteration of ``prog`` (no optimizer: the gradients stay, scaled by 1/M): loss, grads."""
    from tessera.engine import Engine
    from tessera.model import Recompute, StageModule

    rc = Recompute(*recompute)
    mods = [StageModule(spec, (s.start, s.stop), seed=SEED, recompute=rc, compute_dtype=dtype).to(ctx.dev.torch)
            for s in prog.stages]
    policy = dbo_policy(spec, prog, ctx.dev) if dbo else None
    res = Engine(prog, mods, None, None, slot_policy=policy).run_iteration(batch)
    out = {"loss": res.loss, "grads": named_grads(mods), "steps": res.steps}
    if policy is not None:
        st = policy.stats()
        out["dbo"] = {"slots": st.slots, "moved": st.moved, "forced_at_deadline": st.forced, "at_once": st.at_once,
                      "annotated_ms": st.annotated_ms, "note": "pp=1, ep=1: no slot has a predicted idle time"}
    return out


def dbo_policy(spec: ModelSpec, prog: Program, dev: Device):
    """The bubble optimizer for ``prog`` (uniform routing; analytic costs of ``dev``'s preset)."""
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.types import ParallelShape
    from tessera.dbo import moe_layers, rank_tables, uniform_counts
    from tessera.engine.dbo import DBOPolicy
    from tessera.spec.hardware_presets import get_hardware

    costs = analytic_costs(spec, get_hardware(dev.preset), ParallelShape(
        pp=1, num_microbatches=CHECK_M, micro_batch_size=CHECK_MBS, seq_length=CHECK_SEQ))
    moe = next(l.mlp for l in spec.layers if l.index in moe_layers(costs))
    counts = uniform_counts(CHECK_M, moe_layers(costs), moe.num_experts, CHECK_MBS * CHECK_SEQ * moe.top_k)
    return DBOPolicy(rank_tables([prog], costs, counts, 1, 0.1)[0], 0, log=True)


def reference_run(spec: ModelSpec, batch, dev: Device) -> dict:
    """The single-process reference (:func:`tessera.testing.reference.reference_train`, one step,
    no optimizer update): its loss as the engine forms it and its gradients."""
    import torch

    from tessera.testing.reference import reference_train

    held = []

    class Keep:  # an optimizer that keeps the reduced gradients in place
        def __init__(self, params) -> None:
            pass

        def step(self) -> None:
            pass

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    ref = reference_train(spec, [[batch]], seed=SEED, make_optimizer=Keep, prepare=held.append, device=dev.torch)
    per_mb = torch.tensor(ref.microbatch_losses[0], dtype=torch.float32, device=dev.torch)
    return {"loss": float(torch.stack(list(per_mb.unbind())).mean()), "grads": named_grads(held[:1])}


def plain_run(spec: ModelSpec, batch, dev: Device, dtype) -> dict:
    """Plain autograd of the whole model in ``dtype`` (the engine's ``compute_dtype``): per
    microbatch ``(loss / M).backward()``, the aux-loss gradient scaled by 1/M as the engine's one
    scaling does."""
    import torch

    from tessera.model import MoEOptions, StageModule

    mod = StageModule(spec, (-1, spec.num_layers + 1), seed=SEED, moe=MoEOptions(aux_loss_scale=1 / CHECK_M),
                      compute_dtype=dtype).to(dev.torch)
    losses = []
    for mb in range(CHECK_M):
        loss = mod(batch.input_ids[mb], batch.labels[mb])
        (loss / CHECK_M).backward()
        losses.append(loss.detach())
    return {"loss": float(torch.stack(losses).mean()), "grads": named_grads([mod])}


@contextlib.contextmanager
def deterministic(dev: Device, spec: ModelSpec):
    """FP32 deterministic mode for part 2 (:func:`tessera.model.determinism.use_deterministic`,
    TF32 off), restored after; yields the ops that keep a CUDA run from being bitwise."""
    import torch

    from tessera.model.determinism import use_deterministic

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    left = use_deterministic(dev.torch, spec)
    try:
        yield left
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was[2], was[3]


def within(c: dict, loss_rel: float, tol: Mapping[str, float]) -> bool:
    """Whether a :func:`compare` result and a loss difference are inside ``tol``."""
    return loss_rel <= tol["loss_rel"] and c["max_rel"] <= tol["grad_max_rel"] and c["rel_l2"] <= tol["grad_rel_l2"]


def part_programs(ctx: Ctx) -> dict:
    """Part 2 (module docstring): every :data:`VARIANTS` Program in FP32 (deterministic) and BF16
    against each other, the reference and plain autograd."""
    import torch

    dev = ctx.dev
    spec = check_spec()
    progs = load_programs(ctx.args.programs)
    batch = check_batch(spec, dev)
    calls: Counter = Counter()
    out: dict = {"model": spec.name, "shape": {"microbatches": CHECK_M, "micro_batch_size": CHECK_MBS,
                                               "seq_length": CHECK_SEQ},
                 "programs": {name: {"program": key, "recompute": list(rc), "dbo": dbo,
                                     "hash": progs[key].content_hash} for name, key, rc, dbo in VARIANTS},
                 "deltanet_kernel": "torch (transformers' torch_chunk_gated_delta_rule; FLA is part 7)",
                 "tolerance": {"fp32_vs_plain": FP32_PLAIN_TOL, "bf16_vs_bf16_plain": BF16_TOL}}
    first = VARIANTS[0][0]

    def against(runs: dict, want: dict, tol=None) -> dict:
        res = {}
        for name, r in runs.items():
            c = dict(compare(r["grads"], want["grads"]), loss_equal=r["loss"] == want["loss"],
                     loss_rel=rel_diff(r["loss"], want["loss"]))
            if tol is not None:
                c["within"] = within(c, c["loss_rel"], tol)
            res[name] = c
        return res

    probe = torch.nn.Module()  # the switch is transformers' module global: every mixer built inside uses it
    with deltanet_kernel(probe, "torch", calls):
        with deterministic(dev, spec) as nondet:
            runs = {name: run_variant(ctx, spec, progs[key], batch, torch.float32, rc, dbo)
                    for name, key, rc, dbo in VARIANTS}
            ref = reference_run(spec, batch, dev)
            plain = plain_run(spec, batch, dev, torch.float32)
        fp32 = {"nondeterministic_ops": list(nondet), "loss": runs[first]["loss"], "reference_loss": ref["loss"],
                "plain_loss": plain["loss"], "across_programs": against(runs, runs[first]),
                "vs_reference": against(runs, ref), "vs_plain": against(runs, plain, FP32_PLAIN_TOL)}
        fp32["bitwise"] = all(v["bitwise"] and v["loss_equal"] for d in ("across_programs", "vs_reference")
                              for v in fp32[d].values())
        fp32["within_plain_tolerance"] = all(v["within"] for v in fp32["vs_plain"].values())
        dbo = runs["dbo"].get("dbo")
        runs = None  # free the FP32 gradients before the BF16 runs
        bf = {name: run_variant(ctx, spec, progs[key], batch, torch.bfloat16, rc, d)
              for name, key, rc, d in VARIANTS}
        plain16 = plain_run(spec, batch, dev, torch.bfloat16)
    bf16 = {"loss": bf[first]["loss"], "plain_loss": plain16["loss"], "across_programs": against(bf, bf[first]),
            "vs_plain": against(bf, plain16, BF16_TOL), "vs_fp32_reference": against(bf, ref)}
    bf16["bitwise_across_programs"] = all(v["bitwise"] and v["loss_equal"] for v in bf16["across_programs"].values())
    bf16["within_tolerance"] = all(v["within"] for v in bf16["vs_plain"].values())
    bf16["vs_fp32_note"] = ("not judged: BF16 against FP32 measures this random-initialised model's sensitivity to "
                            "rounding (MoE routes flip), not the engine; plain autograd shows the same difference")
    # FP32: bitwise is the claim; where CUDA has ops without a deterministic kernel, the stated
    # plain-autograd tolerance is what can still be asked (both are reported)
    fp32_ok = fp32["bitwise"] or bool(fp32["nondeterministic_ops"])
    out.update(fp32=fp32, bf16=bf16, dbo=dbo, deltanet_calls=dict(calls))
    if not calls["torch"]:
        out["error"] = NO_SWITCH
    out["ok"] = bool(fp32_ok and fp32["within_plain_tolerance"] and bf16["within_tolerance"] and calls["torch"] > 0)
    return out


# --- the real-size model of parts 3, 4, 7 ------------------------------------------------------------------------
def timing_model(ctx: Ctx):
    """(spec, StageModule in BF16 on the device, batch), built once (weights by seed on the CPU,
    then moved; about 1.1e9 parameters at the real size)."""
    if "timing" not in ctx.cache:
        import torch

        from tessera.engine import Batch
        from tessera.model import StageModule

        spec = timing_spec(ctx.dev.kind)
        t = time.perf_counter()
        mod = StageModule(spec, (-1, spec.num_layers + 1), seed=SEED, compute_dtype=torch.bfloat16).to(ctx.dev.torch)
        seq = TIMING_SEQ[ctx.dev.kind]
        g = torch.Generator().manual_seed(SEED)
        batch = Batch.from_tokens(torch.randint(0, spec.vocab, (TIMING_M, TIMING_MBS, seq + 1), generator=g)
                                  .to(ctx.dev.torch))
        ctx.cache["timing"] = (spec, mod, batch)
        ctx.cache["timing_build_s"] = time.perf_counter() - t
    return ctx.cache["timing"]


def layer_name(spec: ModelSpec, index: int) -> str:
    """``embed``, ``head`` or ``<mixer kind>+moe`` for an extended layer index."""
    n = spec.num_layers
    if index == -1:
        return "embed"
    if index == n:
        return "head"
    return f"{spec.layers[index].mixer.kind}+moe"


def analytic_for(ctx: Ctx):
    """Analytic costs of the timing layers with all experts at ``ep`` (an ep rank's share), on
    ``dev``'s preset (``h200``; ``cpu`` on the dry run)."""
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.types import ParallelShape
    from tessera.spec.hardware_presets import get_hardware

    kind = ctx.dev.kind
    ep = TIMING_EP[kind]
    shape = ParallelShape(pp=1, ep=ep, dp=ep, num_microbatches=TIMING_M, micro_batch_size=TIMING_MBS,
                          seq_length=TIMING_SEQ[kind])
    hw = get_hardware(ctx.dev.preset)
    return analytic_costs(timing_spec(kind, local=False), hw, shape), hw, shape


# --- part 3: memory ----------------------------------------------------------------------------------------------
def model_bytes_by_kind(ctx: Ctx) -> dict[tuple[int, str], float]:
    """(layer index, task kind) -> bytes the memory model says that task's forward saves for one
    microbatch (:data:`MODEL_TENSOR_KIND`; BF16 unless the model says FP32, no recompute)."""
    from tessera.cost.memory import head_tensors, layer_tensors

    spec = timing_spec(ctx.dev.kind, local=False)
    tokens = TIMING_MBS * TIMING_SEQ[ctx.dev.kind]
    out: dict[tuple[int, str], float] = defaultdict(float)
    for layer in spec.layers:
        for s in layer_tensors(layer, spec.hidden, tokens):
            out[(layer.index, MODEL_TENSOR_KIND[s.name])] += s.stored_bytes(frozenset(), False)
    for s in head_tensors(spec, tokens):
        out[(spec.num_layers, MODEL_TENSOR_KIND[s.name])] += s.stored_bytes(frozenset(), False)
    out[(-1, "embed")] += 8.0 * tokens  # int64 ids (as analytic_costs' embedding memory)
    return dict(out)


class TaskMemory:
    """Wraps a :class:`~tessera.engine.tasks.TorchChunk`'s ``run`` (F and B tasks) and its
    deferred-W store's ``run`` (W per kind): per task the saved-tensor bytes added
    (``meter.live`` after minus before), and where the device counts them the allocated bytes
    added and the peak above the start (device synchronized around each task). Install it before
    the engine's first iteration (the engine binds ``chunk.run`` into its cached steps); it
    measures while :attr:`meter` is set (a :class:`~tessera.model.saved.SavedTensorMeter`)."""

    def __init__(self, chunk, dev: Device) -> None:
        self.rows: list[dict] = []
        self.dev, self.meter = dev, None
        run, store_run = chunk.run, chunk.store.run

        def run_task(key, mb):
            return self._measure(key, lambda: run(key, mb))

        def run_w(key, tag=None):
            from tessera.cost.types import TaskKey

            return self._measure(TaskKey("W", key[1], tag or "all"), lambda: store_run(key, tag))

        chunk.run, chunk.store.run = run_task, run_w

    def _measure(self, key, fn):
        if self.meter is None:
            return fn()
        dev = self.dev
        dev.sync()
        before, saved = dev.allocated(), self.meter.live
        dev.reset_peak()
        r = fn()
        dev.sync()
        after, peak = dev.allocated(), dev.peak()
        self.rows.append({"phase": key.phase, "layer": key.layer, "kind": key.kind,
                          "saved_bytes": self.meter.live - saved,
                          "allocated_bytes": None if before is None else after - before,
                          "peak_bytes": None if before is None else peak - before})
        return r


def part_memory(ctx: Ctx) -> dict:
    """Part 3 (module docstring): bytes per task of one profiled iteration of :func:`timing_model`
    against :func:`model_bytes_by_kind`."""
    from tessera.engine import Engine
    from tessera.model.saved import SavedTensorMeter

    dev = ctx.dev
    spec, mod, batch = timing_model(ctx)
    prog = load_programs(ctx.args.programs)["timing/1f1b"]
    calls: Counter = Counter()
    with deltanet_kernel(mod, "torch", calls):
        engine = Engine(prog, [mod], None, None, profile=True)
        mem = TaskMemory(engine.chunks[0], dev)
        engine.run_iteration(batch)  # warm-up: gradient buffers exist, so the measured iteration holds activations
        with SavedTensorMeter(mod.parameters()) as meter:
            mem.meter = meter
            dev.sync()
            start = dev.allocated()
            dev.reset_peak()
            res = engine.run_iteration(batch)
            dev.sync()
            iteration_peak = None if start is None else dev.peak() - start
            mem.meter = None
    model = model_bytes_by_kind(ctx)
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in mem.rows:
        by[(r["layer"], r["kind"], r["phase"])].append(r)
    rows = []
    for (layer, kind, phase), rs in sorted(by.items()):
        row = {"layer": layer_name(spec, layer), "index": layer, "kind": kind, "phase": phase, "samples": len(rs)}
        for f in ("saved_bytes", "allocated_bytes", "peak_bytes"):
            vals = [r[f] for r in rs if r[f] is not None]
            row[f] = statistics.median(vals) if vals else None
        if phase == "F":
            m = model.get((layer, kind), 0.0)
            row["model_bytes"] = m
            row["ratio_saved"] = row["saved_bytes"] / m if m > 0 else None
            row["ratio_allocated"] = row["allocated_bytes"] / m if m > 0 and row["allocated_bytes"] is not None \
                else None
        rows.append(row)
    finite = all(math.isfinite(r[f]) for r in rows for f in ("saved_bytes", "allocated_bytes", "peak_bytes")
                 if r[f] is not None)
    expected = {(k.layer, k.kind, k.phase) for p in "FB" for k in engine.chunks[0].task_keys(p)}
    missing = sorted(str(k) for k in expected - set(by))
    out = {"model": spec.name, "tokens_per_microbatch": TIMING_MBS * TIMING_SEQ[dev.kind], "dtype": "bf16 autocast",
           "build_s": ctx.cache.get("timing_build_s"), "loss": res.loss, "rows": rows, "missing_tasks": missing,
           "iteration_peak_bytes": iteration_peak, "saved_peak_bytes": meter.peak,
           "model_bytes_by_task": {f"{layer_name(spec, l)}.{k}": v for (l, k), v in sorted(model.items())},
           "deltanet_calls": dict(calls)}
    if not dev.cuda:
        out["skipped"] = ("CPU: no allocator counters (torch.cuda.memory_allocated / max_memory_allocated); "
                          "allocated_bytes and peak_bytes are null, saved-tensor bytes measured")
    if not calls["torch"]:
        out["error"] = NO_SWITCH
    out["ok"] = bool(finite and not missing and calls["torch"] > 0)
    return out


# --- part 4: task timings ----------------------------------------------------------------------------------------
def timing_rows(spec: ModelSpec, timings, costs) -> tuple[list[dict], list[dict]]:
    """Per (layer, kind, phase): the median measured ms over its samples, the analytic ms and
    their ratio; and per (kind, phase) the sums over the layers (comparable tasks only in the
    ratio of that sum). Dispatch and combine run on ``ep_comm`` in the model: ``comparable`` False."""
    analytic, resource = {}, {}
    for lc in (costs.embed, *costs.layers, costs.head):
        for t in lc.tasks:
            analytic[(lc.index, t.kind.value, t.phase.value)] = analytic.get((lc.index, t.kind.value, t.phase.value),
                                                                              0.0) + t.ms
            resource[(lc.index, t.kind.value, t.phase.value)] = t.resource.value
    samples: dict[tuple, list[float]] = defaultdict(list)
    for key, ms in timings:
        samples[(key.layer, key.kind, key.phase)].append(ms)
    rows = []
    for (layer, kind, phase), ms in sorted(samples.items()):
        a = analytic.get((layer, kind, phase))
        comparable = resource.get((layer, kind, phase), "compute") == "compute"
        rows.append({"layer": layer_name(spec, layer), "index": layer, "kind": kind, "phase": phase,
                     "samples": len(ms), "measured_ms": statistics.median(ms), "analytic_ms": a,
                     "ratio": statistics.median(ms) / a if a else None, "comparable": comparable})
    sums: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0, True])
    for r in rows:
        s = sums[(r["kind"], r["phase"])]
        s[0] += r["measured_ms"]
        s[1] += r["analytic_ms"] or 0.0
        s[2] = s[2] and r["comparable"]
    by_kind = [{"kind": k, "phase": p, "measured_ms": m, "analytic_ms": a, "ratio": m / a if a > 0 else None,
                "comparable": c} for (k, p), (m, a, c) in sorted(sums.items())]
    return rows, by_kind


def profile_tasks(ctx: Ctx, mod, prog, batch, iters: int) -> tuple[list, int]:
    """Per-task (TaskKey, ms) of ``iters`` profiled iterations after one warm-up (fewer when the
    budget runs out; at least one)."""
    from tessera.engine import Engine

    engine = Engine(prog, [mod], None, None, profile=True)
    engine.run_iteration(batch)  # warm-up: kernels, allocator, autotuning
    engine.chunks[0].timings.clear()
    done = 0
    for _ in range(iters):
        engine.run_iteration(batch)
        done += 1
        if ctx.left() < 30:
            break
    return list(engine.chunks[0].timings), done


def part_timings(ctx: Ctx) -> dict:
    """Part 4 (module docstring): per-task times of :func:`timing_model` (torch DeltaNet path)
    against :func:`analytic_for`; keeps the unprofiled iteration times for part 6."""
    from tessera.engine import Engine

    dev = ctx.dev
    spec, mod, batch = timing_model(ctx)
    prog = load_programs(ctx.args.programs)["timing/1f1b"]
    costs, hw, shape = analytic_for(ctx)
    calls: Counter = Counter()
    with deltanet_kernel(mod, "torch", calls):
        plain = Engine(prog, [mod], None, None)
        plain.run_iteration(batch)  # warm-up
        walls = [plain.run_iteration(batch).wall_ms for _ in range(3)]
        timings, iters = profile_tasks(ctx, mod, prog, batch, 2)
    rows, by_kind = timing_rows(spec, timings, costs)
    expected = {(k.layer, k.kind, k.phase) for p in "FBW" for k in plain.chunks[0].task_keys(p)}
    seen = {(r["index"], r["kind"], r["phase"]) for r in rows}
    ok = (not expected - seen and all(math.isfinite(ms) and ms >= 0 for _, ms in timings)
          and all(r["analytic_ms"] and r["analytic_ms"] > 0 for r in rows if r["comparable"] and r["kind"] != "embed")
          and calls["torch"] > 0)
    ctx.cache["throughput"] = {"walls_ms": walls, "tokens": TIMING_M * TIMING_MBS * TIMING_SEQ[dev.kind],
                               "flops": TIMING_M * sum(t.flops for lc in (costs.embed, *costs.layers, costs.head)
                                                       for t in lc.tasks), "hw": hw}
    ctx.cache["timing_rows"] = rows
    return {"model": spec.name, "analytic_model": timing_spec(dev.kind, local=False).name,
            "hardware_preset": hw.name, "analytic_shape": dataclasses.asdict(shape), "clock": dev.clock,
            "deltanet_kernel": "torch", "profiled_iterations": iters, "microbatches": TIMING_M,
            "missing_tasks": sorted(str(k) for k in expected - seen), "rows": rows, "by_kind_phase": by_kind,
            "deltanet_calls": dict(calls), "ok": bool(ok), **({} if calls["torch"] else {"error": NO_SWITCH})}


# --- part 5: overlap ---------------------------------------------------------------------------------------------
class _Done:
    """A finished ``Work`` for :meth:`CommStream.land` around a copy (nothing to wait for)."""

    def wait(self) -> bool:
        return True


def part_overlap(ctx: Ctx) -> dict:
    """Part 5 (module docstring): GEMM chain vs a pinned host-to-device copy and a one-rank
    all-to-all on a :class:`~tessera.model.streams.CommStream`, serial and overlapped."""
    import torch
    import torch.distributed as dist

    from tessera.model.ep.plan import issue_all_to_all
    from tessera.model.streams import CommStream

    dev = ctx.dev
    init_world(dev)
    n, reps, mib = (8192, 6, 512) if dev.cuda else (256, 2, 4)
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(SEED)
    a = (torch.randn(n, n, generator=g) / math.sqrt(n)).to(dev.torch, dt)
    rows = mib * 2 ** 20 // (2 * 4096)
    src_host = torch.randn(rows, 4096, generator=g).to(dt)
    if dev.cuda:
        src_host = src_host.pin_memory()
    src_dev = src_host.to(dev.torch)
    stream = CommStream(dev.torch)

    def gemm():
        y = a
        for _ in range(reps):
            y = y @ a
        return y

    def h2d(on_side: bool):
        dst = torch.empty_like(src_dev)
        if on_side:
            with stream.issue():
                dst.copy_(src_host, non_blocking=True)
            return dst, _Done()
        dst.copy_(src_host, non_blocking=True)
        return dst, None

    def a2a(on_side: bool):
        if on_side:
            with stream.issue(src_dev):
                return issue_all_to_all(src_dev, [rows], [rows], dist.group.WORLD, async_op=True)
        out, work = issue_all_to_all(src_dev, [rows], [rows], dist.group.WORLD, async_op=True)
        work.wait()
        return out, None

    want_gemm = gemm()
    dev.sync()
    out: dict = {"gemm": f"{reps + 1} x [{n}, {n}] @ [{n}, {n}] bf16", "transfer_mib": mib,
                 "side_stream": stream.active, "kinds": {}}
    for name, issue, want in (("h2d_copy", h2d, src_host.to(dev.torch)), ("nccl_all_to_all", a2a, src_dev)):
        res: dict = {}

        def alone():
            t, work = issue(True)
            stream.land(work or _Done(), t)
            return t

        def serial():
            y = gemm()
            t, _ = issue(False)
            return y, t

        def overlapped():
            t, work = issue(True)
            y = gemm()
            stream.land(work or _Done(), t)
            return y, t

        alone()  # warm-up
        serial()
        overlapped()
        res["gemm_ms"] = dev.time_ms(gemm)
        res["transfer_ms"] = dev.time_ms(alone)
        res["serial_ms"] = dev.time_ms(serial)
        res["overlapped_ms"] = dev.time_ms(overlapped)
        y1, t1 = serial()
        y2, t2 = overlapped()
        dev.sync()
        res["results_equal"] = bool(torch.equal(y1, want_gemm) and torch.equal(y2, want_gemm)
                                    and torch.equal(t1, want) and torch.equal(t2, want))
        hide = min(res["gemm_ms"], res["transfer_ms"])
        res["hidden_fraction"] = (res["serial_ms"] - res["overlapped_ms"]) / hide if hide > 0 else None
        res["overlap_not_slower"] = res["overlapped_ms"] <= 1.05 * res["serial_ms"]
        out["kinds"][name] = res
    ok_results = all(r["results_equal"] for r in out["kinds"].values())
    if dev.cuda:
        out["ok"] = ok_results and all(r["overlap_not_slower"] for r in out["kinds"].values())
    else:
        out["ok"] = ok_results
        out["skipped"] = ("CPU: no CUDA side stream, nothing can overlap: the same code ran with gloo and the "
                          "results were checked; the times are not an overlap measurement")
    return out


# --- part 6: throughput ------------------------------------------------------------------------------------------
def part_throughput(ctx: Ctx) -> dict:
    """Part 6 (module docstring): tokens/s and MFU of part 4's unprofiled iterations."""
    import torch

    from tessera.train.worker.metrics import measure_matmul_flops

    tp = ctx.cache.get("throughput")
    if tp is None:
        return {"ok": None, "skipped": "part 4 (task_timings) did not run: no unprofiled iterations to use"}
    wall_s = statistics.median(tp["walls_ms"]) / 1e3
    if ctx.dev.cuda:
        peak, source = tp["hw"].peak_tflops * 1e12, f"hardware preset {tp['hw'].name} (dense BF16)"
    else:
        peak = measure_matmul_flops(dtype=torch.bfloat16)
        source = f"measured on this CPU: bf16 matmul, {peak / 1e9:.3f} GFLOP/s"
    mfu = tp["flops"] / (wall_s * peak)
    return {"iteration_ms": tp["walls_ms"], "iteration_ms_median": wall_s * 1e3, "tokens_per_iteration": tp["tokens"],
            "tokens_per_s": tp["tokens"] / wall_s, "model_flops_per_iteration": tp["flops"],
            "peak_tflops_bf16": peak / 1e12, "peak_source": source, "mfu": mfu, "ok": 0.0 < mfu < 1.0}


# --- part 7: FLA ---------------------------------------------------------------------------------------------------
def part_fla(ctx: Ctx) -> dict:
    """Part 7 (module docstring): the DeltaNet layer with FLA's kernels: output against the torch
    path, F/B/W times beside part 4's."""
    import torch

    dev = ctx.dev
    fla_ok, info = fla_status()
    if not dev.cuda:
        return {"ok": None, "fla": info, "skipped": "CPU: FLA's kernels are Triton kernels for CUDA"}
    if not fla_ok:
        return {"ok": None, "fla": info, "skipped": f"fla.ops.gated_delta_rule does not import ({info}): carry "
                                                      "fla-core (benchmarks/gpu_wheels.py)"}
    spec, mod, batch = timing_model(ctx)
    prog = load_programs(ctx.args.programs)["timing/1f1b"]
    costs, _, _ = analytic_for(ctx)
    layer = next(l for l in mod.layers if l.mixer_kind == "deltanet")
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(TIMING_MBS, TIMING_SEQ[dev.kind], spec.hidden, generator=g).to(dev.torch)
    calls: Counter = Counter()
    outs = {}
    with torch.no_grad():
        hn = layer.input_layernorm(x)
        for impl in ("torch", "fla"):  # the mixer's own output (no residual), BF16 autocast as in the engine
            with deltanet_kernel(mod, impl, calls), torch.autocast("cuda", dtype=torch.bfloat16):
                outs[impl] = layer.attn(hn).float()
    diff = compare({"out": outs["fla"]}, {"out": outs["torch"]})
    t = time.perf_counter()
    with deltanet_kernel(mod, "fla", calls):
        timings, iters = profile_tasks(ctx, mod, prog, batch, 2)
    rows, _ = timing_rows(spec, timings, costs)
    rows = [r for r in rows if r["index"] == layer.index and r["kind"] == "mixer"]
    torch_rows = {(r["phase"]): r for r in ctx.cache.get("timing_rows", ()) if r["index"] == layer.index
                  and r["kind"] == "mixer"}
    for r in rows:
        tr = torch_rows.get(r["phase"])
        r["torch_path_ms"] = tr["measured_ms"] if tr else None
    return {"fla": info, "first_use_and_profile_s": time.perf_counter() - t, "profiled_iterations": iters,
            "mixer_rows": rows, "output_vs_torch": diff, "tolerance_rel_l2": FLA_TOL, "deltanet_calls": dict(calls),
            "ok": bool(diff["rel_l2"] <= FLA_TOL and calls["fla"] > 0 and rows),
            **({} if calls["fla"] else {"error": NO_SWITCH})}


# --- the run -----------------------------------------------------------------------------------------------------
PARTS = (
    # name, function, seconds it needs on an H200 (estimate), on the CPU dry run
    ("env", part_env, 0, 0),
    ("nccl_eager", part_nccl, 30, 5),
    ("programs", part_programs, 60, 20),
    ("memory", part_memory, 90, 5),
    ("task_timings", part_timings, 90, 5),
    ("overlap", part_overlap, 20, 2),
    ("throughput", part_throughput, 0, 1),
    ("deltanet_fla", part_fla, 60, 0),
)
"""The parts in order; a part starts only when the budget left covers its estimate."""


def calibration_row(parts: dict, device: str) -> dict | None:
    """measured / analytic per ``phase.kind`` (summed over the layers; comparable tasks only),
    the row a measured calibration of the cost model starts from."""
    t = parts.get("task_timings", {})
    if not t.get("by_kind_phase"):
        return None
    return {"source": "gpu_check", "device": device, "preset": t.get("hardware_preset"), "precision": "bf16",
            "deltanet_kernel": "torch",
            "ratio_by_task": {f"{r['phase']}.{r['kind']}": r["ratio"] for r in t["by_kind_phase"] if r["comparable"]}}


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


def write(path: Path | None, out: dict) -> None:
    """Write ``out`` as JSON to ``path`` atomically (a temporary file renamed); nothing for None."""
    if path is not None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str) + "\n")
        tmp.replace(path)


def run(args) -> dict:
    """Every part of :data:`PARTS` in order (module docstring): the result dict, also written to
    ``args.json`` after each part.

    Raises:
        SystemExit: ``--parts`` names an unknown part."""
    dev = Device(args.smoke_cpu)
    ctx = Ctx(args, dev, time.monotonic())
    wanted = set(args.parts.split(",")) if args.parts else None
    if wanted is not None and wanted - {p[0] for p in PARTS}:
        raise SystemExit(f"gpu_check: --parts {args.parts}: unknown {sorted(wanted - {p[0] for p in PARTS})}; "
                         f"parts: {', '.join(p[0] for p in PARTS)}")
    out: dict = {"tool": "benchmarks/gpu_check.py", "smoke": dev.smoke, "device": dev.name,
                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "budget_s": args.budget_s, "argv": sys.argv[1:], "parts": {}}
    n = len(PARTS) - 1
    for i, (name, fn, need_gpu, need_cpu) in enumerate(PARTS):
        need = need_cpu if dev.smoke else need_gpu
        left = ctx.left()
        t = time.monotonic()
        if wanted is not None and name not in wanted:
            res = {"ok": None, "skipped": f"not selected (--parts {args.parts})"}
        elif left < need:
            res = {"ok": None, "skipped": f"budget: {left:.0f} s of --budget-s {args.budget_s:g} left, the part needs "
                                          f"about {need} s"}
        else:
            try:
                res = fn(ctx)
            except Exception as e:
                res = {"ok": False, "error": one_line(e), "traceback": traceback.format_exc().splitlines()[-12:]}
        res["seconds"] = time.monotonic() - t
        out["parts"][name] = res
        out["elapsed_s"] = time.monotonic() - ctx.t0
        write(args.json, out)
        status = {True: "ok", False: "FAILED", None: "skipped"}[res["ok"]]
        if res["ok"] is True and res.get("skipped"):
            status = "ok, partly skipped"
        why = f": {res.get('error') or res.get('skipped')}" if res.get("error") or res.get("skipped") else ""
        print(f"[gpu_check] part {i}/{n} {name}: {status}{why} ({res['seconds']:.1f} s, budget left "
              f"{max(ctx.left(), 0):.0f} s)", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    parts = out["parts"]
    out["failed"] = [k for k, v in parts.items() if v["ok"] is False]
    out["skipped"] = {k: v["skipped"] for k, v in parts.items() if v["ok"] is None}
    out["heavy_imported"] = sorted(m for m in HEAVY if sys.modules.get(m) is not None)
    out["calibration_row"] = calibration_row(parts, dev.name)
    out["elapsed_s"] = time.monotonic() - ctx.t0
    out["ok"] = not out["failed"] and not out["heavy_imported"]
    write(args.json, out)
    return out


def setup_paths() -> None:
    """This file's directory off ``sys.path``; the project root first on it (the project need not
    be installed) and ``.gpu_wheels/site`` last when it exists (it adds packages, never shadows
    the image's), before anything imports transformers (which looks for FLA at import)."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if WHEELS_SITE.is_dir() and str(WHEELS_SITE) not in sys.path:
        sys.path.append(str(WHEELS_SITE))


def main(argv=None) -> int:
    """The command line (module docstring); returns the exit status: 0, or 1 when a part failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here (rewritten after every part)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds for the whole run: a part starts only if its estimate fits (default 420)")
    ap.add_argument("--smoke-cpu", action="store_true", help="run the same parts on CPU with tiny shapes")
    ap.add_argument("--parts", help=f"comma-separated subset of: {', '.join(p[0] for p in PARTS)}")
    ap.add_argument("--programs", type=Path, default=PROGRAMS_FILE, help="the Programs file (default: committed)")
    ap.add_argument("--write-programs", type=Path, metavar="FILE",
                    help="compile the Programs the check runs, write them to FILE and exit")
    args = ap.parse_args(argv)
    setup_paths()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads (transformers' optional hub kernels included)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts (part 2's deterministic mode)
    if args.write_programs:
        args.write_programs.write_text(json.dumps(build_programs(), indent=1, sort_keys=True) + "\n")
        print(f"gpu_check: wrote {len(program_plans())} Programs to {args.write_programs}")
        return 0
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"gpu_check: {NO_GPU}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": NO_GPU}) + "\n")
        return 0
    out = run(args)
    print(f"gpu_check: {out['device']}: {'ok' if out['ok'] else 'FAILED ' + str(out['failed'])}"
          f"{' (heavy modules imported: ' + str(out['heavy_imported']) + ')' if out['heavy_imported'] else ''}, "
          f"skipped {sorted(out['skipped'])}, {out['elapsed_s']:.0f} s" + (f", JSON {args.json}" if args.json else ""))
    if not args.json:
        print(json.dumps(out, indent=1, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
