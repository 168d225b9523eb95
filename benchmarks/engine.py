"""Benchmark the execution engine on CPU.

Usage::

    python benchmarks/engine.py [--json FILE] [--seq 64] [--mbs 1] [--microbatches 8] [--iters 5]
                                [--rounds 3] [--no-torch]

Four measurements, one run:

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
3. **A synthesized order, simulated and measured**: on those measured costs the schedule
   synthesizer (:func:`tessera.plan.synthesis.synthesize`, the policy grid and the per-rank local
   search, ``planner.synthesis``'s search) writes the rank orders of the same plan (partition,
   template, overlap, split W) that simulate fastest; where none beats the template's own order
   the fastest synthesized one is kept anyway (``synthesized_beats_template_sim`` says which).
   Another launch on the same 4 ranks builds the stages once, runs a warm-up iteration of each
   plan and a ping-pong, then ``--iters`` times a profiling iteration of the template's Program
   (as above) and one timed iteration of each plan, so the task times are sampled across the
   timed iterations' window, under the same machine load; per launch (``rounds``, ``--rounds`` launches) the best of each
   plan's iterations (``*_measured_ms``), the simulator's iteration on that launch's measured
   costs (the same costs for both plans, ``*_sim_ms``) and ``*_sim_error = simulated / measured
   - 1``. The top-level ``template_measured_ms`` / ``synthesized_measured_ms`` and
   ``template_sim_ms`` / ``synthesized_sim_ms`` are the medians over the rounds, and
   ``template_sim_error`` / ``synthesized_sim_error`` their ``simulated / measured - 1``;
   ``synthesized_policy`` names the order, ``synthesized_changes`` what it changed per rank.
4. **torch.distributed.pipelining**: the same stages (same layer ranges, weights, EP group, data,
   AdamW and gradient reduction; plain autograd per stage, the model's synchronous all-to-alls)
   under ``ScheduleInterleaved1F1B`` (:mod:`tessera.testing.torch_pp`, shared with
   ``benchmarks/vs_torch_pp.py``), in a launch of its own on the same 4 ranks; tokens/s of both
   and ``tokens_per_s_ratio = tessera / torch``. If it fails, ``torch_pipelining_error`` says
   why and the other numbers are kept; ``--no-torch`` skips it.

All numbers are from a small shared CPU machine (4 processes on 2 cores): compare them with each
other, not with GPU runs. Ratios use the best-of-N times. The machine's load (``os.getloadavg``)
is kept: ``load_1min_before`` / ``_after``, and per round of part 3 ``load_1min``.
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
          "template_measured_ms", "template_sim_ms", "template_sim_error", "synthesized_measured_ms",
          "synthesized_sim_ms", "synthesized_sim_error", "synthesized_beats_template_sim",
          "tessera_tokens_per_s", "torch_pipelining_tokens_per_s", "tokens_per_s_ratio")


_MODULES = ("torch", "torch.distributed", "tessera.config.schema", "tessera.cost.analytic", "tessera.engine",
            "tessera.engine.p2p", "tessera.testing", "tessera.testing.torch_pp", "tessera.cost.measured",
            "tessera.model", "tessera.plan.baseline", "tessera.program.compiler", "tessera.sim.simulator",
            "tessera.spec.hardware_presets", "tessera.spec.presets", "tessera.flow", "tessera.plan.synthesis",
            "tessera.plan.pair_scheduler")
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


def costs_and_plan(cfg: Config, pp: int, vpp: int, template: str):
    """(model, analytic ``cpu`` costs, the baseline plan: serial-balanced partition, overlap, split W)."""
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.plan.baseline import baseline_plan
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    model = get_model(PRESET)
    costs = analytic_costs(model, get_hardware("cpu"), ParallelConfig(
        pp=pp, vpp=vpp, ep=EP if pp > 1 else 1, dp=DP if pp > 1 else 1, num_microbatches=cfg.microbatches,
        micro_batch_size=cfg.mbs, seq_length=cfg.seq))
    return model, costs, baseline_plan(costs, template, pp, vpp, cfg.microbatches)


def costs_and_programs(cfg: Config, pp: int, vpp: int, template: str):
    from tessera.program.compiler import compile_plan

    model, costs, plan = costs_and_plan(cfg, pp, vpp, template)
    return model, costs, compile_plan(plan)


def synthesized(costs, plan):
    """The rank orders the schedule synthesizer writes for ``plan``'s partition under ``costs``
    (the measured ones): the fastest simulated synthesized order, also where the template's own
    order simulates faster. Returns ``(SynthesisResult, template's simulated ms)``."""
    import math

    from tessera.flow import iteration_evaluator
    from tessera.plan.pair_scheduler import schedule_pair
    from tessera.plan.synthesis import synthesize

    evaluate = iteration_evaluator(costs)
    template_ms = evaluate(plan)
    # start_ms=inf: the template's order does not compete, so the result is a synthesized order
    return synthesize(costs, plan, evaluate, scheduler=schedule_pair, start_ms=math.inf), template_ms


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


def world_orders(rank: int, world_size: int, cfg: Config, programs: dict) -> dict:
    """Part 3's launch: every plan of ``programs`` (name -> Programs, one stage layout, the
    template's first) on the same stages and optimizer: a warm-up iteration of each and a
    ping-pong, then ``cfg.iters`` times a profiling iteration of the first (as :func:`world`)
    and one iteration of each. Returns ``{"times": {name: [ms, ...]}, "timings", "p2p_ms"}``."""
    import torch

    from tessera.engine import Engine, Layout, make_groups
    from tessera.engine.p2p import ping_pong_ms

    groups = make_groups(Layout(PP, DP, EP))
    model, _, _ = costs_and_programs(cfg, PP, VPP, TEMPLATE)
    mine = {name: progs[groups.pipeline_rank] for name, progs in programs.items()}
    mods, opt = build(model, next(iter(mine.values())), groups)  # the plans share the stages
    engines = {name: Engine(prog, mods, groups, opt) for name, prog in mine.items()}
    step = [0]

    def iteration(engine):
        engine.run_iteration(data(cfg, step[0], groups.replica))
        step[0] += 1

    profiler = Engine(next(iter(mine.values())), mods, groups, opt, profile=True, eager_comm=True)
    for engine in (*engines.values(), profiler):  # warm-up
        iteration(engine)
    for ch in profiler.chunks:
        ch.timings.clear()
    p2p = ping_pong_ms(groups, torch.zeros(cfg.mbs, cfg.seq, model.hidden), reps=20)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(cfg.iters):  # task times sampled across the timed iterations' window
        iteration(profiler)
        for name, engine in engines.items():
            times[name] += timed(lambda: iteration(engine), 1)
    return {"times": times, "timings": [(str(k), ms) for ch in profiler.chunks for k, ms in ch.timings],
            "p2p_ms": p2p}


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
    ap.add_argument("--rounds", type=int, default=3, help="launches of part 3 (template vs synthesized order)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.distributed.pipelining comparison")
    args = ap.parse_args(argv)
    import os
    from dataclasses import asdict

    import torch

    from tessera.cost.measured import measured_costs, median_times
    from tessera.program.compiler import compile_plan
    from tessera.sim.simulator import simulate
    from tessera.testing import WorkerError, run_local

    torch.set_num_threads(1)
    cfg = Config(args.seq, args.mbs, args.microbatches, args.iters)
    _import_modules()
    t0 = time.perf_counter()
    result: dict = {"preset": PRESET, "pp": PP, "dp": DP, "ep": EP, "vpp": VPP, "template": TEMPLATE,
                    "seq_length": cfg.seq, "micro_batch_size": cfg.mbs, "num_microbatches": cfg.microbatches,
                    "iters": cfg.iters, "cpus": os.cpu_count(), "load_1min_before": os.getloadavg()[0],
                    "overhead_us_per_instr": overhead_us(cfg)}
    ranks = run_local(functools.partial(world, cfg=cfg), PP * DP, args.timeout)
    model, costs, plan = costs_and_plan(cfg, PP, VPP, TEMPLATE)
    progs = compile_plan(plan)
    measured, measured_median = min(ranks[0]["tessera_ms"]), statistics.median(ranks[0]["tessera_ms"])
    times = median_times(t for r in ranks for t in r["timings"])
    p2p = statistics.median(r["p2p_ms"] for r in ranks if r["p2p_ms"] is not None)
    mcosts = measured_costs(costs, times, p2p_ms=p2p)
    simulated = simulate(progs, mcosts).iteration_ms
    tokens = DP * cfg.microbatches * cfg.mbs * cfg.seq
    result.update(iteration_ms_measured=measured, iteration_ms_measured_median=measured_median,
                  iteration_ms_simulated=simulated, sim_ratio=measured / simulated, p2p_ms=p2p,
                  tessera_tokens_per_s=tokens / (measured / 1e3), tessera_ms_all=ranks[0]["tessera_ms"])
    # part 3: the order synthesized on these measured costs, then both plans profiled (the
    # template's Programs), simulated and timed in one launch, under one machine load
    syn, template_ms = synthesized(mcosts, plan)
    syn_progs = compile_plan(syn.plan)
    rounds = []
    for _ in range(args.rounds):
        ranks3 = run_local(functools.partial(world_orders, cfg=cfg,
                                             programs={"template": progs, "synthesized": syn_progs}),
                           PP * DP, args.timeout)
        costs3 = measured_costs(costs, median_times(t for r in ranks3 for t in r["timings"]),
                                p2p_ms=statistics.median(r["p2p_ms"] for r in ranks3 if r["p2p_ms"] is not None))
        one = {"load_1min": os.getloadavg()[0]}
        for name, progs_ in (("template", progs), ("synthesized", syn_progs)):
            times_ = ranks3[0]["times"][name]
            sim_ms = simulate(progs_, costs3).iteration_ms
            one.update({f"{name}_measured_ms": min(times_), f"{name}_ms_all": times_, f"{name}_sim_ms": sim_ms,
                        f"{name}_sim_error": sim_ms / min(times_) - 1})
        rounds.append(one)
        print(f"round {len(rounds)}: template {one['template_sim_ms']:.1f} sim / {one['template_measured_ms']:.1f} "
              f"measured ms, synthesized {one['synthesized_sim_ms']:.1f} / {one['synthesized_measured_ms']:.1f}, "
              f"load {one['load_1min']:.2f}", flush=True)
    for name in ("template", "synthesized"):
        meas = statistics.median(r[f"{name}_measured_ms"] for r in rounds)
        sim_ms = statistics.median(r[f"{name}_sim_ms"] for r in rounds)
        result.update({f"{name}_measured_ms": meas, f"{name}_sim_ms": sim_ms, f"{name}_sim_error": sim_ms / meas - 1})
    result.update(rounds=rounds, synthesized_beats_template_sim=syn.iteration_ms < template_ms - 1e-9,
                  synthesized_policy=syn.policy.label() if syn.policy is not None else None,
                  synthesized_evaluations=syn.evaluations, synthesized_changes=[asdict(c) for c in syn.changes],
                  synthesized_plan=syn.plan.to_dict())
    try:  # a separate launch: a failure there keeps the numbers above
        if not args.no_torch:
            torch_all = run_local(functools.partial(world_torch, cfg=cfg), PP * DP, args.timeout)[0]
            torch_ms = min(torch_all)
            result.update(torch_pipelining_ms=torch_ms, torch_pipelining_ms_median=statistics.median(torch_all),
                          torch_ms_all=torch_all, torch_pipelining_tokens_per_s=tokens / (torch_ms / 1e3),
                          tokens_per_s_ratio=torch_ms / measured)
    except WorkerError as e:
        result["torch_pipelining_error"] = str(e)[-2000:]
    result["wall_s"] = time.perf_counter() - t0
    result["load_1min_after"] = os.getloadavg()[0]
    for k in FIELDS:
        v = result.get(k)
        print(f"{k:32s} {v:.4g}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
