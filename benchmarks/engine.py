"""Benchmark the execution engine on CPU.

Usage::

    python benchmarks/engine.py [--json FILE] [--seq 64] [--mbs 1] [--microbatches 8] [--iters 5]

Three measurements, one run:

1. **Overhead**: the engine with no-op tasks (:class:`~tessera.engine.NoopChunk`) runs a pp=1
   1f1b Program of tiny-qwen3-next in one process; ``overhead_us_per_instr`` is the median over
   every instruction of several iterations of the wall time of its :meth:`Engine.advance` calls.
2. **Measured vs simulated**: tiny-qwen3-next on 4 gloo ranks (pp=2 x dp=2, ep=2), the baseline
   interleaved-1f1b Program (vpp=2, overlap, split W). ``iteration_ms_measured``: the best of
   ``--iters`` iterations (ranks synchronised by a barrier before and after; the best one is the
   least disturbed by other processes on a shared machine; ``*_median`` and ``*_all`` are kept
   too). Task times come from a
   profiling run of the same Program (``profile=True, eager_comm=True``: every all-to-all waited
   inside its task), pooled over ranks (median per task), and the p2p time from a ping-pong of
   one activation; :func:`tessera.cost.measured.measured_costs` turns them into ModelCosts and
   :func:`tessera.sim.simulator.simulate` predicts ``iteration_ms_simulated``;
   ``sim_ratio = measured / simulated``.
3. **torch.distributed.pipelining**: the same stages (same layer ranges, weights, EP group, data,
   AdamW and gradient reduction; plain autograd per stage, the model's synchronous all-to-alls)
   under ``ScheduleInterleaved1F1B`` (:mod:`tessera.testing.torch_pp`, shared with
   ``benchmarks/vs_torch_pp.py``), in a second launch on the same 4 ranks; tokens/s of both
   and ``tokens_per_s_ratio = tessera / torch``. If it fails, ``torch_pipelining_error`` says
   why and the other numbers are kept.

All numbers are from a small shared CPU machine (4 processes on 2 cores): compare them with each
other, not with GPU runs. Ratios use the best-of-N times.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch and tessera are imported inside the functions that use them: ``--help`` answers without them
if TYPE_CHECKING:
    from tessera.engine import Batch

PRESET, PP, DP, EP, VPP, TEMPLATE = "tiny-qwen3-next", 2, 2, 2, 2, "interleaved-1f1b"
FIELDS = ("overhead_us_per_instr", "iteration_ms_measured", "iteration_ms_simulated", "sim_ratio",
          "tessera_tokens_per_s", "torch_pipelining_tokens_per_s", "tokens_per_s_ratio")


_MODULES = ("torch", "torch.distributed", "tessera.config.schema", "tessera.cost.analytic", "tessera.engine",
            "tessera.engine.p2p", "tessera.testing", "tessera.testing.torch_pp", "tessera.cost.measured",
            "tessera.model", "tessera.plan.baseline", "tessera.program.compiler", "tessera.sim.simulator",
            "tessera.spec.hardware_presets", "tessera.spec.presets")
"""What this script imported at its top before ``--help`` stopped loading it (:func:`_import_modules`)."""


def _import_modules() -> None:
    """Import what the measurement uses before the run's ``wall_s`` clock starts (these were
    module-level imports: ``--help`` no longer pays for them, the timed run still excludes them)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(name)


@dataclass(frozen=True)
class Config:
    seq: int
    mbs: int
    microbatches: int
    iters: int


def costs_and_programs(cfg: Config, pp: int, vpp: int, template: str):
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.plan.baseline import baseline_plan
    from tessera.program.compiler import compile_plan
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    model = get_model(PRESET)
    costs = analytic_costs(model, get_hardware("cpu"), ParallelConfig(
        pp=pp, vpp=vpp, ep=EP if pp > 1 else 1, dp=DP if pp > 1 else 1, num_microbatches=cfg.microbatches,
        micro_batch_size=cfg.mbs, seq_length=cfg.seq))
    return model, costs, compile_plan(baseline_plan(costs, template, pp, vpp, cfg.microbatches))


def overhead_us(cfg: Config, iters: int = 5) -> float:
    """Median engine time per instruction with no-op tasks (pp=1 1f1b, 64 microbatches)."""
    import torch

    from tessera.engine import Batch, Engine, NoopChunk, TorchChunk
    from tessera.model import StageModule

    big = Config(cfg.seq, cfg.mbs, 64, cfg.iters)
    model, costs, progs = costs_and_programs(big, 1, 1, "1f1b")
    st = progs[0].stages[0]
    chunk = NoopChunk.like(TorchChunk(StageModule(model, (st.start, st.stop))))
    engine = Engine(progs[0], [chunk], None, None, task_costs=costs)
    ids = torch.zeros(big.microbatches, cfg.mbs, cfg.seq, dtype=torch.int64)
    per_instr: list[float] = []
    for _ in range(iters):
        engine.begin(Batch(ids, ids))
        acc: dict[int, float] = {}
        while True:
            t0 = time.perf_counter()
            rec = engine.advance()
            dt = time.perf_counter() - t0
            if rec is None:
                break
            acc[rec.index] = acc.get(rec.index, 0.0) + dt
        per_instr += list(acc.values())
    return statistics.median(per_instr) * 1e6


def data(cfg: Config, step: int, replica: int) -> Batch:
    import torch

    from tessera.engine import Batch

    g = torch.Generator().manual_seed(1000 * step + replica)
    return Batch.from_tokens(torch.randint(0, 256, (cfg.microbatches, cfg.mbs, cfg.seq + 1), generator=g))


def timed(fn, iters: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def build(model, prog, groups):
    import torch

    from tessera.model import StageModule

    mods = [StageModule(model, (s.start, s.stop), ep_group=groups.ep, seed=1) for s in prog.stages]
    return mods, torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-3, foreach=False)


def torch_pipelining_ms(cfg: Config, model, prog, groups) -> list[float]:
    from tessera.engine import reduce_gradients
    from tessera.testing.torch_pp import torch_schedule, torch_step

    mods, opt = build(model, prog, groups)
    schedule = torch_schedule(prog, mods, groups.pipeline, cfg.mbs, cfg.seq, "interleaved-1f1b")
    dense = [p for m in mods for n, p in m.named_parameters() if ".moe.experts." not in n]
    experts = [p for m in mods for n, p in m.named_parameters() if ".moe.experts." in n]
    step = [0]

    def iteration():
        torch_step(schedule, data(cfg, step[0], groups.replica), groups.pipeline_rank, prog.pp)
        step[0] += 1
        reduce_gradients(dense, groups.dense_dp, 1.0 / DP)  # the schedule already divides by M
        reduce_gradients(experts, groups.expert_dp, 1.0 / DP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    iteration()
    return timed(iteration, cfg.iters)


def world(rank: int, world_size: int, cfg: Config) -> dict:
    import torch
    import torch.distributed as dist

    from tessera.engine import Engine, Layout, make_groups
    from tessera.engine.p2p import ping_pong_ms

    groups = make_groups(Layout(PP, DP, EP))
    model, costs, progs = costs_and_programs(cfg, PP, VPP, TEMPLATE)
    prog = progs[groups.pipeline_rank]
    mods, opt = build(model, prog, groups)
    step = [0]

    def iteration(engine):
        engine.run_iteration(data(cfg, step[0], groups.replica))
        step[0] += 1

    engine = Engine(prog, mods, groups, opt)
    iteration(engine)
    out = {"tessera_ms": timed(lambda: iteration(engine), cfg.iters)}
    profiler = Engine(prog, mods, groups, opt, profile=True, eager_comm=True)
    for _ in range(2):
        iteration(profiler)
    out["timings"] = [(str(k), ms) for ch in profiler.chunks for k, ms in ch.timings]
    out["p2p_ms"] = ping_pong_ms(groups, torch.zeros(cfg.mbs, cfg.seq, model.hidden), reps=20)
    dist.barrier()
    return out


def world_torch(rank: int, world_size: int, cfg: Config) -> list[float]:
    from tessera.engine import Layout, make_groups

    groups = make_groups(Layout(PP, DP, EP))
    model, _, progs = costs_and_programs(cfg, PP, VPP, TEMPLATE)
    return torch_pipelining_ms(cfg, model, progs[groups.pipeline_rank], groups)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the result object to this file")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    import torch

    from tessera.cost.measured import measured_costs, median_times
    from tessera.sim.simulator import simulate
    from tessera.testing import WorkerError, run_local

    torch.set_num_threads(1)
    cfg = Config(args.seq, args.mbs, args.microbatches, args.iters)
    _import_modules()
    t0 = time.perf_counter()
    result: dict = {"preset": PRESET, "pp": PP, "dp": DP, "ep": EP, "vpp": VPP, "template": TEMPLATE,
                    "seq_length": cfg.seq, "micro_batch_size": cfg.mbs, "num_microbatches": cfg.microbatches,
                    "overhead_us_per_instr": overhead_us(cfg)}
    ranks = run_local(functools.partial(world, cfg=cfg), PP * DP, args.timeout)
    model, costs, progs = costs_and_programs(cfg, PP, VPP, TEMPLATE)
    measured, measured_median = min(ranks[0]["tessera_ms"]), statistics.median(ranks[0]["tessera_ms"])
    times = median_times(t for r in ranks for t in r["timings"])
    p2p = statistics.median(r["p2p_ms"] for r in ranks if r["p2p_ms"] is not None)
    simulated = simulate(progs, measured_costs(costs, times, p2p_ms=p2p)).iteration_ms
    tokens = DP * cfg.microbatches * cfg.mbs * cfg.seq
    result.update(iteration_ms_measured=measured, iteration_ms_measured_median=measured_median,
                  iteration_ms_simulated=simulated, sim_ratio=measured / simulated, p2p_ms=p2p,
                  tessera_tokens_per_s=tokens / (measured / 1e3), tessera_ms_all=ranks[0]["tessera_ms"])
    try:  # a separate launch: a failure there keeps the numbers above
        torch_all = run_local(functools.partial(world_torch, cfg=cfg), PP * DP, args.timeout)[0]
        torch_ms = min(torch_all)
        result.update(torch_pipelining_ms=torch_ms, torch_pipelining_ms_median=statistics.median(torch_all),
                      torch_ms_all=torch_all, torch_pipelining_tokens_per_s=tokens / (torch_ms / 1e3),
                      tokens_per_s_ratio=torch_ms / measured)
    except WorkerError as e:
        result["torch_pipelining_error"] = str(e)[-2000:]
    result["wall_s"] = time.perf_counter() - t0
    for k in FIELDS:
        v = result.get(k)
        print(f"{k:32s} {v:.4g}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
