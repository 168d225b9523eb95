"""GPU check: the engine's CUDA path on one GPU, measured against the analytic cost model.

Usage::

    python benchmarks/gpu_check.py [--json FILE] [--seq 2048] [--mbs 1] [--microbatches 4] [--iters 3]
    python benchmarks/gpu_check.py --smoke-cpu [--json FILE]   # the same code on CPU, tiny model

Without CUDA (and without ``--smoke-cpu``) it prints one line saying there is no GPU, writes
``{"skipped": "..."}`` to ``--json`` if given, and exits 0: nothing is measured.

On a GPU (one device, ``cuda:0``; planned to finish in under 8 minutes on an H200, ``--budget-s``
stops adding iterations early) it runs:

1. **The engine's CUDA path at pp=1**: ``qwen3-next-1b-check`` (:func:`check_model`: the
   Qwen3-Next layer pattern ``DDDA DDDA`` from :mod:`tessera.spec.presets` with gated attention,
   Gated DeltaNet and a 64-expert top-4 MoE with a shared expert on every layer, hidden 1024,
   vocab 32768; about 1.0e9 parameters, random weights, nothing downloaded) as one
   ``StageModule`` with ``compute_dtype=torch.bfloat16`` (the engine's bf16 autocast,
   :mod:`tessera.model.precision`; FP32 master weights, AdamW), the 1f1b Program of ``--microbatches``
   microbatches with split W; the engine times with CUDA events (:mod:`tessera.engine.timing`)
   and has its side streams (:mod:`tessera.model.streams`). One warm-up iteration, then
   ``--iters`` timed ones (``wall_ms``: event time of each iteration), then one profiled
   iteration (``profile=True``: one autograd segment per task, per-task event times).
2. **Per-task times vs the analytic model** (:func:`tessera.cost.analytic.analytic_costs` on the
   hardware preset matching the device name, ``h200`` when none matches): per (kind, phase), the
   measured ms per microbatch summed over layers, the analytic ms, and their ratio: the measured
   calibration row (``calibration_row``) for that GPU.
3. **Throughput**: ``tokens_per_s`` = tokens of an iteration / median iteration time, and
   ``mfu`` = model FLOPs of an iteration (the analytic model's task FLOPs: model FLOPs, no
   recompute) / (median iteration time * the preset's BF16 peak, the dtype the GEMMs run in).
4. **The communication stream around a real NCCL collective**: a one-rank NCCL group, an
   ``all_to_all_single`` of one microbatch's expert rows issued on a :class:`CommStream` while a
   GEMM runs on the compute stream; its result must equal the input. At pp=1 and ep=1 the engine
   itself issues no communication, and pipeline p2p needs two GPUs: neither is measured here.

Self-checks (``checks`` in the JSON, exit status 1 if one fails, the JSON is still written): CUDA
events and side streams in use, bf16 autocast in effect, every loss finite and the last below the
first, every task of the profiled iteration timed (finite, >= 0) and their sum within the
iteration's time, 0 < MFU < 1, the whole run within ``--budget-s``.

``--smoke-cpu`` runs every step on CPU with tiny-qwen3-next (host timer, no streams, no NCCL): a
dry run of this script's code, not a GPU result (``"smoke": true``). There the two checks a CPU
cannot evaluate, ``cuda_events`` and ``side_streams``, are not in ``checks`` but in
``checks_skipped`` with the reason; MFU is taken against a peak measured on the CPU at run time
(:func:`tessera.train.worker.metrics.measure_matmul_flops` in bf16, the dtype the engine's GEMMs
run in, as the training job measures its CPU peak; the larger of a measurement just before the
timed iterations and one just after them, so a passing load does not lower the peak) instead of
the ``cpu`` preset's placeholder, so ``mfu_in_range`` is checked there too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent  # benchmarks/ holds scripts, not modules: not on sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads (transformers' optional hub kernels included)

# torch and tessera are imported inside the functions that use them: ``--help`` answers without them
if TYPE_CHECKING:
    import torch

    from tessera.engine import Batch
    from tessera.model import StageModule
    from tessera.spec.model import ModelSpec

NO_GPU = "no GPU: torch.cuda.is_available() is False, nothing measured (benchmarks/gpu_check.py needs CUDA)"
PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("H800", "h800"), ("B200", "b200"))
# The self-checks a CPU smoke run cannot evaluate, and why (``checks_skipped`` in its JSON).
SMOKE_SKIPPED = {
    "cuda_events": "CPU smoke run: no CUDA events, the engine times with the host clock (timer HostTimer)",
    "side_streams": "CPU smoke run: no CUDA side streams and no NCCL (comm_stream skipped)",
}


def check_model() -> ModelSpec:
    """``qwen3-next-1b-check``: Qwen3-Next's structure (:func:`qwen3_next_80b_a3b`'s head
    shapes and layer pattern) at hidden 1024 and 8 layers, 64 experts top-4 (about 1.0e9
    parameters: each layer's experts 64 * 3 * 1024 * 512 = 100.7e6, embedding and head 2 * 33.6e6)."""
    from tessera.spec.model import AttentionSpec, DeltaNetSpec, MoESpec
    from tessera.spec.presets import build_model, qwen3_next_layers

    attention = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=256, gated=True, rotary_fraction=0.25)
    deltanet = DeltaNetSpec(num_key_heads=8, num_value_heads=16, key_head_dim=128, value_head_dim=128, conv_kernel=4)
    moe = MoESpec(num_experts=64, top_k=4, expert_ffn=512, shared_expert_ffn=512, aux_loss_coef=0.001)
    return build_model("qwen3-next-1b-check", 1024, 32768, qwen3_next_layers(8, attention, deltanet, moe),
                       rope_theta=1e7, max_positions=65536)


def hardware_for(device_name: str) -> str:
    """The hardware preset of a CUDA device name (``h200`` when none matches: noted in the JSON)."""
    return next((preset for key, preset in PRESETS if key in device_name.upper()), "h200")


def build(spec: ModelSpec, device: torch.device, bf16: bool) -> tuple[StageModule, str]:
    """The whole model as one stage on ``device``; the bf16 route taken (the engine's
    ``compute_dtype``, or ``none`` for FP32)."""
    import torch

    from tessera.model import StageModule

    kw = {"compute_dtype": torch.bfloat16} if bf16 else {}
    mod = StageModule(spec, (-1, spec.num_layers + 1), seed=0, **kw)  # seeded on the CPU RNG: weights by seed
    return mod.to(device), "engine compute_dtype=bfloat16 (tessera.model.precision)" if bf16 else "none (fp32)"


def program(spec: ModelSpec, m: int):
    from tessera.program.compiler import compile_plan
    from tessera.program.plan import Partition, Plan

    plan = Plan("gpu-check", "1f1b", 1, 1, m, Partition((-1, spec.num_layers + 1)), overlap=False, split_w=True)
    return compile_plan(plan)[0]


def batch(spec: ModelSpec, m: int, mbs: int, seq: int, device) -> Batch:
    import torch

    from tessera.engine import Batch

    g = torch.Generator().manual_seed(0)
    return Batch.from_tokens(torch.randint(0, spec.vocab, (m, mbs, seq + 1), generator=g).to(device))


def task_table(costs, timings, m: int) -> list[dict]:
    """Per (kind, phase): measured ms per microbatch summed over layers, analytic ms, ratio."""
    analytic = {(lc.index, t.phase.value, t.kind.value): t.ms for lc in (costs.embed, *costs.layers, costs.head)
                for t in lc.tasks}
    measured: dict[tuple[str, str], float] = defaultdict(float)
    model: dict[tuple[str, str], float] = defaultdict(float)
    seen = set()
    for key, ms in timings:
        measured[(key.kind, key.phase)] += ms / m
        if (key.layer, key.phase, key.kind) not in seen:
            seen.add((key.layer, key.phase, key.kind))
            model[(key.kind, key.phase)] += analytic.get((key.layer, key.phase, key.kind), math.nan)
    return [{"kind": k, "phase": p, "measured_ms": measured[(k, p)], "analytic_ms": model[(k, p)],
             "ratio": measured[(k, p)] / model[(k, p)] if model[(k, p)] > 0 else None}
            for k, p in sorted(measured)]


def model_flops(costs) -> float:
    """Model FLOPs of one microbatch (every task of embedding, layers and head)."""
    return sum(t.flops for lc in (costs.embed, *costs.layers, costs.head) for t in lc.tasks)


def comm_stream_check(hidden: int, rows: int) -> dict:
    """A one-rank NCCL ``all_to_all_single`` of ``[rows, hidden]`` bf16 on a side stream while a
    GEMM runs on the compute stream (module docstring, item 4)."""
    import torch
    import torch.distributed as dist

    from tessera.model.ep.plan import issue_all_to_all
    from tessera.model.streams import CommStream

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        stream = CommStream(torch.device("cuda", 0))
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with stream.issue(x):
            out, work = issue_all_to_all(x, [rows], [rows], dist.group.WORLD, async_op=True)
        y = w
        for _ in range(8):
            y = y @ w / 64
        stream.land(work, out)
        equal = bool(torch.equal(out, x))
        torch.cuda.synchronize()
        return {"ok": equal and stream.active, "equal": equal, "side_stream": stream.active,
                "rows": rows, "hidden": hidden, "wall_ms": (time.perf_counter() - t0) * 1e3,
                "nccl_version": ".".join(map(str, v)) if isinstance(v := torch.cuda.nccl.version(), tuple) else str(v)}
    finally:
        dist.destroy_process_group()


def run(args) -> dict:
    import torch

    from tessera.cost.analytic import analytic_costs
    from tessera.cost.types import ParallelShape
    from tessera.engine import Engine
    from tessera.model.precision import module_autocast
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model
    from tessera.train.worker.metrics import measure_matmul_flops

    t_start = time.monotonic()
    smoke = args.smoke_cpu
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    spec = get_model("tiny-qwen3-next") if smoke else check_model()
    seq, mbs, m = (32, 1, 2) if smoke else (args.seq, args.mbs, args.microbatches)
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(device)
    preset = hardware_for(name) if not smoke else "cpu"
    hw = get_hardware(preset)
    mod, precision = build(spec, device, bf16=True)
    params = sum(p.numel() for p in mod.parameters())
    build_s = time.monotonic() - t_start
    prog = program(spec, m)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4, weight_decay=0.0)
    engine = Engine(prog, [mod], None, opt)
    b = batch(spec, m, mbs, seq, device)
    losses, walls = [], []
    warm = engine.run_iteration(b)  # kernels, allocator, autotuning
    losses.append(warm.loss)
    # CPU: the peak MFU is taken against, measured (bf16 GEMMs, as the engine runs them) on each side of the timed loop
    cpu_peaks = [measure_matmul_flops(dtype=torch.bfloat16)] if smoke else []
    for _ in range(args.iters):
        res = engine.run_iteration(b)
        losses.append(res.loss)
        walls.append(res.wall_ms)
        if time.monotonic() - t_start > 0.6 * args.budget_s:  # leave time for the profiled iteration
            break
    if smoke:
        cpu_peaks.append(measure_matmul_flops(dtype=torch.bfloat16))
    timed = Engine(prog, [mod], None, opt, profile=True)
    prof = timed.run_iteration(b)
    losses.append(prof.loss)
    timings = list(timed.chunks[0].timings)
    costs = analytic_costs(spec, hw, ParallelShape(pp=1, num_microbatches=m, micro_batch_size=mbs, seq_length=seq))
    flops = model_flops(costs) * m
    wall_s = statistics.median(walls) / 1e3
    peak_flops = max(cpu_peaks) if smoke else hw.peak_tflops * 1e12
    mfu = flops / (wall_s * peak_flops)
    table = task_table(costs, timings, m)
    comm = {"skipped": "smoke run on CPU: no NCCL"} if smoke else comm_stream_check(spec.hidden, mbs * seq * 4)
    amp = module_autocast(mod)
    with amp():
        probe = torch.nn.functional.linear(torch.ones(2, 4, device=device), torch.ones(3, 4, device=device))
    n_keys = sum(len(timed.chunks[0].task_keys(p)) for p in "FBW")
    elapsed = time.monotonic() - t_start
    skipped = SMOKE_SKIPPED if smoke else {}
    checks = {
        "cuda_events": type(engine.timer).__name__ == "CudaEventTimer",
        "side_streams": engine.chunks[0].stream.active and bool(comm.get("ok")),
        "bf16_autocast": probe.dtype == torch.bfloat16,
        "losses_finite_and_falling": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0],
        "every_task_timed": len(timings) == n_keys * m and all(math.isfinite(ms) and ms >= 0 for _, ms in timings),
        "tasks_within_iteration": sum(ms for _, ms in timings) <= prof.wall_ms * 1.01 + 0.1,
        "mfu_in_range": 0.0 < mfu < 1.0,
        "within_budget": elapsed <= args.budget_s,
    }
    checks = {k: v for k, v in checks.items() if k not in skipped}
    return {
        "smoke": smoke, "device": name, "hardware_preset": preset,
        "preset_matches_device": smoke or any(k in name.upper() for k, _ in PRESETS),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "model": spec.name, "params": params, "mixers": [type(layer.mixer).__name__ for layer in spec.layers],
        "seq_length": seq, "micro_batch_size": mbs, "num_microbatches": m, "template": "1f1b pp=1, split W",
        "precision": precision, "timer": type(engine.timer).__name__, "build_s": build_s,
        "iteration_ms": walls, "iteration_ms_median": wall_s * 1e3, "profiled_iteration_ms": prof.wall_ms,
        "idle_ms": prof.idle_ms, "tokens_per_s": m * mbs * seq / wall_s, "model_flops_per_iteration": flops,
        "peak_tflops_bf16": peak_flops / 1e12,
        "peak_source": (f"measured on this CPU: bf16 matmul, max of {[round(f / 1e9, 3) for f in cpu_peaks]} GFLOP/s"
                        if smoke else f"hardware preset {preset}"),
        "mfu": mfu, "losses": losses, "tasks": table,
        "calibration_row": {"source": "gpu_check", "device": name, "preset": preset, "precision": "bf16",
                            "ratio_by_task": {f"{r['phase']}.{r['kind']}": r["ratio"] for r in table}},
        "comm_stream": comm, "elapsed_s": elapsed, "checks": checks, "checks_skipped": dict(skipped),
        "ok": all(checks.values()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding iterations past 60%% of this")
    ap.add_argument("--smoke-cpu", action="store_true", help="run the same code on CPU with a tiny model")
    args = ap.parse_args(argv)
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"gpu_check: {NO_GPU}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": NO_GPU}) + "\n")
        return 0
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text if not args.json else f"gpu_check: {out['device']}: {out['tokens_per_s']:.0f} tokens/s, "
          f"MFU {out['mfu']:.1%}, checks {'ok' if out['ok'] else 'FAILED ' + str(out['checks'])}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
