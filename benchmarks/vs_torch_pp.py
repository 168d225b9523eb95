"""Tessera's engine against torch.distributed.pipelining on the same model, weights and data.

Usage::

    python benchmarks/vs_torch_pp.py [--json FILE] [--rounds 10] [--seq 64] [--mbs 2]

Model: preset ``tiny-qwen3-next`` (8 layers, 1.06M parameters), identical weights on both sides
(``StageModule(..., seed=1)`` of the same layer ranges), AdamW, micro-batch ``--mbs``, sequence
``--seq``, one thread per rank, gloo. The torch side's linears are plain ``nn.Linear``
(``split_w=False``: what a torch.distributed.pipelining user runs); Tessera's are
``SplitLinear`` only where its Program defers W (``tessera.train.worker.step.program_splits_w``, as in
training). Both compute the same values (a fused SplitLinear equals ``nn.Linear`` bitwise). Every configuration runs Tessera and torch alternately in
one launch (one warm-up iteration each, then ``--rounds`` rounds of one Tessera and one torch
iteration, Tessera first in even rounds and torch first in odd ones, ranks synchronised by a
barrier around each), and a round's ratio is
``torch_ms / tessera_ms`` (tokens/s of Tessera over torch: > 1 means Tessera is faster);
reported as the median with its 25th and 75th percentiles (``*_p25``, ``*_p75``).

Fields (``_m4`` / ``_m8``: 4 or 8 microbatches):

* ``ratio_i1f1b_default_m*``: 2 ranks, pp=2, ep=1, interleaved-1f1b vpp=2 with what the recipe
  default decides (``planner.overlap`` / ``planner.split_w: auto`` on the analytic ``cpu`` costs,
  ``auto_choice``) vs ``ScheduleInterleaved1F1B``; ``ratio_i1f1b_plain_m*``: overlap and split W
  off; ``ratio_i1f1b_on_m8``: both forced on.
* ``ratio_1f1b_default_m*`` / ``ratio_1f1b_plain_m*`` / ``ratio_1f1b_on_m8``: 1f1b (vpp=1) vs
  ``Schedule1F1B``.
* ``ratio_ep2_default``: 4 ranks, pp=2 dp=2 ep=2, interleaved-1f1b vpp=2 as ``auto`` decides, M=8, vs
  ``ScheduleInterleaved1F1B`` on the same stages (its MoE all-to-alls inside the stage, the same
  data-parallel gradient reduction).
* ``task_overhead_us``: one process, pp=1 1f1b without overlap or split W (``nn.Linear``), M=4; per task step,
  the paired median of (engine iteration - plain autograd of the same StageModule over the same
  microbatches) / task steps (process CPU time, one thread), over ``max(3 * rounds, 16)`` pairs (a small difference of two
  large times: it needs more pairs than the ratios). The engine runs each lone F and B
  instruction there as one step (:mod:`tessera.engine.fused`); ``task_path_overhead_us`` is the
  same figure with every task run as its own step (``TorchChunk.run``: the path of ``FB`` pairs
  and of chunks with all-to-alls).
* ``deferred_w_us`` (and ``cpu_time_scale``, ``deferred_w_us_cpu``), ``pair_task_us`` (and
  ``pair_cpu_time_scale``, ``pair_task_us_cpu``): the host costs of a deferred W and of an
  overlapped pair, measured (:func:`deferred_w_us`, :func:`pair_task_us`); ``*_preset``: the
  ``cpu`` preset's values.
* ``auto_choice``: per layout, the ``(overlap, split_w)`` that ``planner.overlap`` /
  ``planner.split_w: auto`` choose (simulated on the analytic ``cpu`` costs; no run).
* ``preempted_<configuration>``: rank 0's involuntary context switches of its main thread per
  iteration (median; Linux ``/proc/thread-self/status``), Tessera's and torch's: time the
  thread was runnable but descheduled (by the gloo transport threads or the other ranks on a
  small machine) is in the wall time but in neither side's compute.
* ``--only KEYS``: just those configurations (e.g. ``--seq 256 --only 1f1b_plain_m8`` for a
  larger problem), without the single-process fields; ``only`` lists them.
* ``engine_us_per_step``: the engine with no-op tasks (:class:`~tessera.engine.NoopChunk`), pp=1
  1f1b, M=64: median time of one ``advance()`` call.

All numbers come from a small shared CPU machine: compare them with each other; the JSON records
``uptime`` before and after the run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # benchmarks/ holds scripts, not modules

# torch and tessera are imported inside the functions that use them: ``--help`` answers without them
if TYPE_CHECKING:
    from tessera.engine import Batch

PRESET = "tiny-qwen3-next"
KINDS = {"i1f1b": ("interleaved-1f1b", 2, "interleaved-1f1b"), "1f1b": ("1f1b", 1, "1f1b")}


_MODULES = ("torch", "torch.distributed", "tessera.config.schema", "tessera.cost.analytic", "tessera.engine",
            "tessera.engine.lazy", "tessera.model", "tessera.plan.baseline", "tessera.program.compiler",
            "tessera.spec.hardware_presets", "tessera.spec.presets", "tessera.testing", "tessera.testing.torch_pp",
            "tessera.train.worker.step")
"""What this script imported at its top before ``--help`` stopped loading it (:func:`_import_modules`)."""


def _import_modules() -> None:
    """Import what the measurement uses before the run's ``wall_s`` clock starts (these were
    module-level imports: ``--help`` no longer pays for them, the timed run still excludes them)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(name)


def _costs(pp: int, vpp: int, dp: int, ep: int, m: int, mbs: int, seq: int):
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    return analytic_costs(get_model(PRESET), get_hardware("cpu"), ParallelConfig(
        pp=pp, vpp=vpp, ep=ep, dp=dp, num_microbatches=m, micro_batch_size=mbs, seq_length=seq))


def programs(template: str, pp: int, vpp: int, dp: int, ep: int, m: int, mbs: int, seq: int, overlap: bool,
             split_w: bool):
    from tessera.plan.baseline import baseline_plan
    from tessera.program.compiler import compile_plan

    costs = _costs(pp, vpp, dp, ep, m, mbs, seq)
    return compile_plan(baseline_plan(costs, template, pp, vpp, m, overlap=overlap, split_w=split_w))


def auto_choice(template: str, vpp: int, dp: int, ep: int, m: int, mbs: int, seq: int) -> dict:
    """What ``planner.overlap: auto`` / ``planner.split_w: auto`` pick for this layout (the shipped
    tiny recipe with these fields, ``tessera.flow.build_baseline``: the fastest simulated iteration
    on the analytic ``cpu`` costs)."""
    from tessera import flow
    from tessera.config.load import load_recipe

    recipe = load_recipe(None, [f"planner.template={template}", f"parallel.vpp={vpp}", "parallel.pp=2",
                                f"parallel.dp={dp}", f"parallel.ep={ep}", f"parallel.num_microbatches={m}",
                                f"parallel.micro_batch_size={mbs}", f"parallel.seq_length={seq}",
                                "planner.overlap=auto", "planner.split_w=auto", "hardware.preset=cpu"])
    res = flow.resolve(recipe)
    plan = flow.build_baseline(res, flow.build_costs(res))
    return {"overlap": plan.overlap, "split_w": plan.split_w}


def data(m: int, mbs: int, seq: int, step: int, replica: int) -> Batch:
    import torch

    from tessera.engine import Batch

    g = torch.Generator().manual_seed(1000 * step + replica)
    return Batch.from_tokens(torch.randint(0, 256, (m, mbs, seq + 1), generator=g))


def _preemptions() -> int | None:
    """Involuntary context switches of the calling thread so far (Linux
    ``/proc/thread-self/status``, ``nonvoluntary_ctxt_switches``); None where that is unreadable."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _timed(fn) -> tuple[float, int | None]:
    """(wall ms between two barriers around ``fn``, involuntary context switches of this thread
    while ``fn`` ran, None where unknown)."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), _preemptions()
    fn()
    c1 = _preemptions()
    dist.barrier()
    return (time.perf_counter() - t0) * 1e3, None if c0 is None or c1 is None else c1 - c0


def _spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2]}


def compare(groups, prog, torch_kind: str, m: int, mbs: int, seq: int, rounds: int, dp: int) -> dict:
    """Alternating rounds of Tessera and torch on one layout; per-round times (ms) of both."""
    import torch

    from tessera.engine import Engine, reduce_gradients
    from tessera.model import StageModule
    from tessera.spec.presets import get_model
    from tessera.testing.torch_pp import torch_schedule, torch_step
    from tessera.train.worker.step import program_splits_w

    model = get_model(PRESET)

    def build(split_w: bool):
        mods = [StageModule(model, (s.start, s.stop), ep_group=groups.ep, seed=1, split_w=split_w)
                for s in prog.stages]
        return mods, torch.optim.AdamW([p for x in mods for p in x.parameters()], lr=1e-3, foreach=False)

    t_mods, t_opt = build(program_splits_w(prog))
    engine = Engine(prog, t_mods, groups, t_opt)
    p_mods, p_opt = build(False)
    schedule = torch_schedule(prog, p_mods, groups.pipeline, mbs, seq, torch_kind)
    dense = [p for x in p_mods for n, p in x.named_parameters() if ".moe.experts." not in n]
    experts = [p for x in p_mods for n, p in x.named_parameters() if ".moe.experts." in n]
    step = [0, 0]

    def tessera_iter():
        engine.run_iteration(data(m, mbs, seq, step[0], groups.replica))
        step[0] += 1

    def torch_iter():
        torch_step(schedule, data(m, mbs, seq, step[1], groups.replica), groups.pipeline_rank, prog.pp)
        step[1] += 1
        reduce_gradients(dense, groups.dense_dp, 1.0 / dp)  # the schedule already divided by M
        reduce_gradients(experts, groups.expert_dp, 1.0 / dp)
        p_opt.step()
        p_opt.zero_grad(set_to_none=True)

    tessera_iter()
    torch_iter()
    out = {"tessera_ms": [], "torch_ms": [], "tessera_preempted": [], "torch_preempted": []}
    for r in range(rounds):  # A B, B A, ...: neither side always runs first after the other
        first, second = (("tessera", tessera_iter), ("torch", torch_iter))[::1 if r % 2 == 0 else -1]
        for name, fn in (first, second):
            ms, switches = _timed(fn)
            out[f"{name}_ms"].append(ms)
            out[f"{name}_preempted"].append(switches)
    return out


def variants(choice: dict, m: int, name: str) -> tuple[tuple[str, bool, bool], ...]:
    """``(variant, overlap, split_w)`` run for one layout: ``default`` as ``auto`` chose,
    ``plain`` both off, and at M=8 ``on`` both forced on (what ``auto`` avoids)."""
    c = choice[f"{name}_m{m}"]
    out = (("default", c["overlap"], c["split_w"]), ("plain", False, False))
    return out + ((("on", True, True),) if m == 8 else ())


def pp2_configs(choice: dict):
    """The pp=2 configurations in run order: ``(key, m, kind, overlap, split_w)``, ``key`` as in
    ``ratio_<key>`` (e.g. ``1f1b_plain_m8``), ``kind`` a :data:`KINDS` entry."""
    for m in (4, 8):
        for name, kind in KINDS.items():
            for variant, overlap, split_w in variants(choice, m, name):
                yield f"{name}_{variant}_m{m}", m, kind, overlap, split_w


def world_pp2(rank: int, world_size: int, rounds: int, mbs: int, seq: int, choice: dict,
              only: frozenset[str] | None = None) -> dict:
    """The pp=2 configurations (``only``: just these keys, e.g. ``1f1b_plain_m8``), rank's rounds."""
    from tessera.engine import Layout, make_groups

    groups = make_groups(Layout(2, 1, 1))
    res = {}
    for key, m, (template, vpp, torch_kind), overlap, split_w in pp2_configs(choice):
        if only is None or key in only:
            prog = programs(template, 2, vpp, 1, 1, m, mbs, seq, overlap, split_w)[groups.pipeline_rank]
            res[key] = compare(groups, prog, torch_kind, m, mbs, seq, rounds, 1)
    return res


def config_keys(choice: dict) -> list[str]:
    """Every configuration's key (``ratio_<key>``) in run order."""
    return [key for key, *_ in pp2_configs(choice)] + ["ep2_default"]


def world_ep2(rank: int, world_size: int, rounds: int, mbs: int, seq: int, choice: dict) -> dict:
    from tessera.engine import Layout, make_groups

    groups = make_groups(Layout(2, 2, 2))
    c = choice["ep2"]
    prog = programs("interleaved-1f1b", 2, 2, 2, 2, 8, mbs, seq, c["overlap"], c["split_w"])[groups.pipeline_rank]
    return {"ep2_default": compare(groups, prog, "interleaved-1f1b", 8, mbs, seq, rounds, 2)}


def task_overhead_us(mbs: int, seq: int, rounds: int) -> tuple[float, float, int]:
    """(paired median of engine - plain autograd per task step in us, the same for every task run
    as its own step, task steps per iteration).

    The engine runs each lone F and B instruction of this Program as one step
    (:mod:`tessera.engine.fused`); the second figure drives the same chunk's tasks one by one
    (``TorchChunk.run``, the path of ``FB`` pairs and of chunks with all-to-alls)."""
    from tessera.engine import Engine, TorchChunk
    from tessera.engine.lazy import Lazy
    from tessera.model import StageModule
    from tessera.spec.presets import get_model

    m = 4
    prog = programs("1f1b", 1, 1, 1, 1, m, mbs, seq, False, False)[0]
    model = get_model(PRESET)
    mod = StageModule(model, (-1, model.num_layers + 1), seed=1, split_w=False)
    engine = Engine(prog, [mod], None, None)
    batch = data(m, mbs, seq, 0, 0)
    chunk = TorchChunk(mod)
    tasks = m * (len(chunk.task_keys("F")) + len(chunk.task_keys("B")))

    def plain():
        for mb in range(m):
            mod(batch.input_ids[mb], batch.labels[mb]).backward()

    def by_task():
        for mb in range(m):
            chunk.begin_forward(mb, Lazy.of(batch.input_ids[mb]), batch.labels[mb])
            for key in chunk.task_keys("F"):
                chunk.run(key, mb)
            chunk.begin_backward(mb, None, False)
            for key in chunk.task_keys("B"):
                chunk.run(key, mb)
        chunk.end_iteration()

    def run(fn) -> float:  # CPU time of this process: one thread, so other jobs' load stays out of it
        mod.zero_grad(set_to_none=True)
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    fns = {"fused": lambda: engine.run_iteration(batch), "split": by_task, "plain": plain}
    for fn in fns.values():  # warm-up
        run(fn)
    fused, split = [], []
    names = list(fns)
    for r in range(rounds):  # each of the three goes first in turn
        t = {name: run(fns[name]) for name in names[r % 3:] + names[:r % 3]}
        fused.append((t["fused"] - t["plain"]) / tasks * 1e6)
        split.append((t["split"] - t["plain"]) / tasks * 1e6)
    return statistics.median(fused), statistics.median(split), tasks


def _paired_cpu_ms(engines, batch: Batch, rounds: int) -> list[tuple[float, float]]:
    """``rounds`` pairs of (first, second) engine iteration times, ms of process CPU time, after
    one warm-up iteration each; ``engines``: two ``(Engine, module)``."""
    def run(engine, mod) -> float:
        mod.zero_grad(set_to_none=True)
        t0 = time.process_time()
        engine.run_iteration(batch)
        return (time.process_time() - t0) * 1e3

    for e in engines:
        run(*e)
    return [(run(*engines[0]), run(*engines[1])) for _ in range(rounds)]


def deferred_w_us(mbs: int, seq: int, rounds: int) -> dict:
    """The host cost of deferring W, measured: one process, pp=1 1f1b, M=4, no overlap, process CPU
    time, paired rounds of the engine with split W and the same engine with W fused.

    Returns ``deferred_w_us`` (median of (split - fused) per weight-gradient GEMM the cost model
    counts, us), ``deferred_w_gemms_per_iteration``, ``fused_iteration_ms`` (median, measured),
    ``fused_iteration_sim_ms`` (the same Program simulated on the ``cpu`` preset),
    ``cpu_time_scale`` (measured / simulated: how much slower this host runs the tiny model than
    the nominal ``cpu`` preset says) and ``deferred_w_us_cpu`` = ``deferred_w_us / cpu_time_scale``,
    the cost in the preset's own time scale (its ``HardwareSpec.deferred_w_us``)."""
    from dataclasses import replace

    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.engine import Engine
    from tessera.model import StageModule
    from tessera.sim.simulator import simulated_iteration_ms
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    m = 4
    model = get_model(PRESET)
    per_gemm = replace(get_hardware("cpu"), deferred_w_us=1e3)  # deferred_ms then counts the GEMMs
    costs = analytic_costs(model, per_gemm, ParallelConfig(pp=1, vpp=1, ep=1, dp=1, num_microbatches=m,
                                                           micro_batch_size=mbs, seq_length=seq))
    gemms = m * sum(t.deferred_ms for lc in (costs.embed, *costs.layers, costs.head) for t in lc.tasks)
    engines = []
    for split in (True, False):
        mod = StageModule(model, (-1, model.num_layers + 1), seed=1, split_w=split)
        prog = programs("1f1b", 1, 1, 1, 1, m, mbs, seq, False, split)[0]
        engines.append((Engine(prog, [mod], None, None), mod))
    fused_sim = simulated_iteration_ms(programs("1f1b", 1, 1, 1, 1, m, mbs, seq, False, False),
                                       _costs(1, 1, 1, 1, m, mbs, seq))
    batch = data(m, mbs, seq, 0, 0)

    pairs = _paired_cpu_ms(engines, batch, rounds)
    us = statistics.median([(a - b) / gemms * 1e3 for a, b in pairs])
    fused = statistics.median([b for _, b in pairs])
    scale = fused / fused_sim
    return {"deferred_w_us": us, "deferred_w_gemms_per_iteration": gemms, "fused_iteration_ms": fused,
            "fused_iteration_sim_ms": fused_sim, "cpu_time_scale": scale, "deferred_w_us_cpu": us / scale}


def pair_task_us(mbs: int, seq: int, rounds: int) -> dict:
    """The host cost of an overlapped F&B pair, measured: one process, pp=1 1f1b, M=8, split W
    off, process CPU time, paired rounds of the engine with overlap (7 ``FB`` pairs, run task by
    task) and without (each chunk one autograd segment per side).

    Returns ``pair_task_us`` (median of (overlap - plain) per compute task of the overlapped
    pairs, us), ``pair_compute_tasks_per_iteration``, ``pair_cpu_time_scale`` (the plain run,
    measured / simulated on the ``cpu`` preset) and ``pair_task_us_cpu`` = ``pair_task_us /
    pair_cpu_time_scale`` (the preset's ``HardwareSpec.pair_task_us``)."""
    from tessera.engine import Engine
    from tessera.model import StageModule
    from tessera.program.instructions import Op
    from tessera.sched.chunkdag import pair_dag
    from tessera.sim.simulator import simulated_iteration_ms
    from tessera.spec.presets import get_model
    from tessera.spec.tasks import Resource

    m = 8
    model = get_model(PRESET)
    costs = _costs(1, 1, 1, 1, m, mbs, seq)
    on = programs("1f1b", 1, 1, 1, 1, m, mbs, seq, True, False)
    st = {x.chunk: (x.start, x.stop) for x in on[0].stages}
    tasks = sum(sum(t.resource == Resource.COMPUTE for t in pair_dag(costs, st[i.chunk], st[i.chunk2], i.with_w).tasks)
                for i in on[0].instructions if i.op == Op.FB)
    off = programs("1f1b", 1, 1, 1, 1, m, mbs, seq, False, False)
    engines = []
    for prog in (on[0], off[0]):
        mod = StageModule(model, (-1, model.num_layers + 1), seed=1, split_w=False)
        engines.append((Engine(prog, [mod], None, None), mod))
    batch = data(m, mbs, seq, 0, 0)

    pairs = _paired_cpu_ms(engines, batch, rounds)
    us = statistics.median([(a - b) / tasks * 1e3 for a, b in pairs])
    scale = statistics.median([b for _, b in pairs]) / simulated_iteration_ms(off, costs)
    return {"pair_task_us": us, "pair_compute_tasks_per_iteration": tasks, "pair_cpu_time_scale": scale,
            "pair_task_us_cpu": us / scale}


def engine_us_per_step(seq: int, iters: int = 5) -> float:
    import torch

    from tessera.engine import Batch, Engine, NoopChunk, TorchChunk
    from tessera.model import StageModule
    from tessera.spec.presets import get_model

    m = 64
    prog = programs("1f1b", 1, 1, 1, 1, m, 1, seq, True, True)[0]
    model = get_model(PRESET)
    chunk = NoopChunk.like(TorchChunk(StageModule(model, (-1, model.num_layers + 1))))
    engine = Engine(prog, [chunk], None, None)
    ids = torch.zeros(m, 1, seq, dtype=torch.int64)
    per_step = []
    for _ in range(iters):
        engine.begin(Batch(ids, ids))
        while True:
            t0 = time.perf_counter()
            if engine.advance() is None:
                break
            per_step.append(time.perf_counter() - t0)
    return statistics.median(per_step) * 1e6


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summarise(runs: dict) -> dict:
    out = {}
    for key, r in runs.items():
        ratios = [p / t for t, p in zip(r["tessera_ms"], r["torch_ms"])]
        s = _spread(ratios)
        field = "ratio_" + key
        out[field], out[field + "_p25"], out[field + "_p75"] = s["median"], s["p25"], s["p75"]
        out[field + "_ms"] = {"tessera": r["tessera_ms"], "torch": r["torch_ms"]}
        switches = {side: [x for x in r[f"{side}_preempted"] if x is not None] for side in ("tessera", "torch")}
        if all(switches.values()):
            out["preempted_" + key] = {side: statistics.median(xs) for side, xs in switches.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the result object to this file")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per configuration (default 10)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length in tokens (default 64)")
    ap.add_argument("--mbs", type=int, default=2, help="micro-batch size (default 2)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for each gloo launch (default 1800)")
    ap.add_argument("--skip-ep2", action="store_true", help="leave out the 4-rank layout")
    ap.add_argument("--only", help="comma-separated configurations to run (their ratio_* fields): "
                                   "{i1f1b,1f1b}_{default,plain}_m{4,8}, {i1f1b,1f1b}_on_m8, ep2_default; "
                                   "leaves out the single-process measurements")
    args = ap.parse_args(argv)
    import torch

    from tessera.spec.hardware_presets import get_hardware
    from tessera.testing import run_local

    torch.set_num_threads(1)
    _import_modules()
    t0 = time.perf_counter()
    result: dict = {"preset": PRESET, "seq_length": args.seq, "micro_batch_size": args.mbs, "rounds": args.rounds,
                    "torch_version": torch.__version__, "uptime_before": _uptime()}
    result["auto_choice"] = {f"{name}_m{m}": auto_choice(template, vpp, 1, 1, m, args.mbs, args.seq)
                             for m in (4, 8) for name, (template, vpp, _) in KINDS.items()}
    result["auto_choice"]["ep2"] = auto_choice("interleaved-1f1b", 2, 2, 2, 8, args.mbs, args.seq)
    only = None
    if args.only is not None:
        only = frozenset(x.strip() for x in args.only.split(",") if x.strip())
        keys = config_keys(result["auto_choice"])
        unknown = sorted(only - set(keys))
        if unknown or not only:
            ap.error(f"--only {','.join(unknown) or repr(args.only)}: not a configuration; "
                     f"use one or more of {','.join(keys)}")
        result["only"] = sorted(only)
    else:
        overhead, per_task_overhead, tasks = task_overhead_us(args.mbs, args.seq, max(3 * args.rounds, 16))
        result.update(deferred_w_us(args.mbs, args.seq, max(2 * args.rounds, 12)))
        result.update(pair_task_us(args.mbs, args.seq, max(args.rounds, 8)))
        result.update(task_overhead_us=overhead, task_path_overhead_us=per_task_overhead, task_steps_per_iteration=tasks,
                      deferred_w_us_preset=get_hardware("cpu").deferred_w_us,
                      pair_task_us_preset=get_hardware("cpu").pair_task_us,
                      engine_us_per_step=engine_us_per_step(args.seq))
    choice = result["auto_choice"]
    runs = {}
    if only is None or only - {"ep2_default"}:
        runs = run_local(functools.partial(world_pp2, rounds=args.rounds, mbs=args.mbs, seq=args.seq, choice=choice,
                                           only=only), 2, args.timeout)[0]
    if not args.skip_ep2 and (only is None or "ep2_default" in only):
        runs.update(run_local(functools.partial(world_ep2, rounds=args.rounds, mbs=args.mbs, seq=args.seq,
                                                choice=choice), 4, args.timeout)[0])
    result.update(summarise(runs))
    result["uptime_after"] = _uptime()
    result["wall_s"] = time.perf_counter() - t0
    for k, v in result.items():
        if isinstance(v, float) and not k.endswith(("_p25", "_p75")):
            spread = f" [{result[k + '_p25']:.2f}-{result[k + '_p75']:.2f}]" if k + "_p25" in result else ""
            print(f"{k:32s} {v:.3g}{spread}")
    for k, v in result.items():
        if k.startswith("preempted_"):
            print(f"{k:32s} tessera {v['tessera']:g} torch {v['torch']:g}")
    print(f"{'uptime':32s} {result['uptime_before']} / {result['uptime_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
