"""The dynamic bubble optimizer (DBO) on emulated devices, against the simulator.

Usage::

    python benchmarks/dbo.py --json FILE [--rounds 5] [--skew 1.45] [--counts COUNTS.json]
                             [--scale 1.0] [--pp 4] [--ep 2] [--vpp 4] [--m 8] [--unit split] [--independent]
                             [--recorded ROUTER_COUNTS.json] [--recorded-scale 50] [--no-transports]

Case: ``qwen3-next-80b-a3b`` analytic costs on ``h800`` (``micro_batch_size=1``,
``seq_length=4096``, activation recompute off), ``interleaved-1f1b`` at ``pp x vpp`` (48 layers
in ``pp * vpp`` chunks), ``ep`` EP ranks (``dp = ep`` replicas: ``pp * ep`` local gloo
processes, :func:`tessera.testing.run_local`), ``--m`` microbatches, F&B overlap off (no ``FB``
pairs: the emulation does not model the overlap slowdown), split W, slot-annotated Programs
with W slack (:func:`tessera.program.slots.annotate_slots` ``defer_w=True``). The layers'
data-parallel costs are zeroed in the costs both sides use (the emulation runs a real one-float
gradient all-reduce, not the modelled one). Routing: ``counts_for_skew(--skew, ep, ...)`` (Zipf,
seed 1; ``ep * seq * top_k`` assignments per microbatch and layer) or ``--counts`` (a
:class:`~tessera.dbo.counts.TokenCounts` JSON, e.g. recorded from a real router).

The optimizer is :class:`~tessera.engine.dbo_joint.JointDBOPolicy` (layer-level W units,
``--unit``: ``layer``, ``split`` or ``task``, :mod:`tessera.dbo.units`; the EP group's joint
choice, ``--independent``: each EP rank alone); the simulator runs the same rule.
Every rank runs :class:`~tessera.engine.Engine` on :class:`~tessera.engine.emulate.EmulatedChunk`
(compute: cost-model ms times ``--scale`` of sleep; communication: real gloo sends and EP
all-to-alls, see :mod:`tessera.engine.emulate`). One warm-up iteration each, then ``--rounds``
paired rounds of one iteration with the optimizer off and one on (order alternating), all ranks
synchronised by a barrier around each iteration.

Fields (times in cost-model ms: wall ms / scale):

* ``clock_iteration_ms_off`` / ``_on``, ``clock_reduction``: the same on the ranks' emulated
  clocks (:attr:`EmulatedDevice.iteration_ms`, largest rank; all ranks start at one instant),
  free of host overhead; ``host_lag_ms``: how far the host fell behind a clock at worst (> 0:
  the wall times include Python and scheduling overhead of the loaded 2-core host);
  ``sim_vs_clock_off`` / ``_on``: sim / clock - 1.
* ``skew_max_over_mean``: of the counts at ``ep`` (:func:`tessera.dbo.counts.skew_max_over_mean`).
* ``iteration_ms_off`` / ``iteration_ms_on``: median over rounds of the iteration (wall time
  from the common start to the closing barrier) with the optimizer off / on; ``reduction``: median over rounds of ``1 - on / off``.
* ``bubble_fill_rate``: filled / annotated predicted slot time, over all ranks, last on-iteration
  (:class:`~tessera.engine.dbo.DBOStats`); ``moved``: W units run in slots; ``at_once``,
  ``forced``: chunk W run at registration / with units left at their deadline.
* ``monitor_overhead_ms``: the policy's own decision time in the last on-iteration
  (``DBOStats.overhead_ms`` of :class:`~tessera.engine.dbo_joint.JointDBOPolicy`: CPU time of
  the rank's thread, ms, largest rank; not scaled: it is real CPU work; CPU time, not wall
  time, since the 8 emulated ranks share 2 cores and wall time would count waiting for one);
  ``monitor_overhead_ratio``: that over ``iteration_ms_on`` (the iteration at the cost model's
  real speed, which the decisions would share on a device).
* ``peak_mem_increase_points``: largest rank's peak memory
  (:func:`tessera.program.memory.rank_memory_bytes`) of the W-slack Programs minus that of the
  template's, in percentage points of device memory (the DBO moves W only earlier than their
  deadline, so the slack is what costs memory).
* ``slot_prediction_mean_err``: over EP slots with measured or predicted idle (optimizer off,
  last iteration, every rank), ``sum |predicted - measured| / sum measured``; measured: the
  emulated waits for later-issuing peers plus the transfers' extra length
  (:attr:`EmulatedDevice.slot_idle_ms`). Receive slots are not measured.
* ``sim_iteration_ms_off`` / ``sim_iteration_ms_on``: :func:`tessera.sim.dbo.simulate_dbo` on
  the same Programs, costs and counts; ``sim_plain_iteration_ms``: :func:`tessera.sim.simulator.simulate`
  (balanced routing); ``sim_vs_emulated_off`` / ``_on``: sim / emulated - 1.
* ``count_latency_us_allgather`` / ``count_latency_us_compiled_graph``: median time of one
  exchange (:func:`tessera.train.dbo.transport.measure_latency`, one microbatch's counts of
  every MoE layer, µs) over each transport, both measured in one Ray Train job of ``ep`` gloo
  workers on a local Ray of its own (:func:`transport_latencies`; all-gather first, with no graph
  open; median over ranks; null with ``--no-transports`` or without Ray, or when the graph fell
  back); ``count_transport_faster`` names the faster; ``count_latency_us_allgather_in_emulation``:
  the all-gather over each EP group of the emulated ranks, while the other groups exchange too.
* ``recorded`` (``--recorded FILE``): the same measurement on counts recorded from the real
  router of tiny-qwen3-next on real text (``python -m tessera.train.profile.routes
  recipes/tiny-qwen3-next.yaml --steps 2 --out FILE``), on that model's own case
  (:func:`recorded_case`: ``cpu`` preset costs, pp=2 vpp=2 ep=2, ``--recorded-scale``): the
  fields of :data:`RECORDED_KEYS` and its ``case``.
* ``uptime_before`` / ``uptime_after``, ``command``, ``wall_s``, ``case`` (the parameters).

``benchmarks/results/dbo-cpu.json`` (``--rounds 3 --scale 8 --recorded
benchmarks/results/route-counts-tiny.json``, 8 ranks on 2 shared cores, load average 15-18 from
other jobs, the default ``--unit split``, joint rule): reduction 0.0468 in wall time, 0.0465 on
the emulated clocks (1516.7 -> 1443.9 ms), the clocks equal to the simulator off and on
(1514.15 / 1443.67 ms, the wall times within 0.17 % of it), 599 W units moved (sim: 599),
bubble fill rate 0.398, ``monitor_overhead_ratio`` 0.0064 (9.3 ms; 0.014 and 0.0093 at load 4
before the joint pool's bookkeeping got cheaper, docs/dbo.md), peak memory +0.99 points; count
exchange (24576 counts, ep=2) all-gather 28161 us, compiled graph 17841 us at that load (3060 /
2912 us at load 4). ``recorded`` (tiny router, skew 1.061): 17 units moved, fill rate 0.039,
no gain on the clocks and in the simulator (7.4175 ms off and on; wall reduction -0.11 at that
load, the host behind the clocks). Before layer-level W the same case
gained nothing (2 of 256 chunk W moved): a chunk's W was longer than a slot on the busiest EP
rank, whose only idle is the transfers' extra length, so W moved on the less loaded rank only,
and the next compute instruction, which starts when the last EP rank reaches it, waited for
the busy rank's W at its deadline as before. Simulated on the same case: ``--unit layer``
0.026, ``split`` 0.047, ``task`` 0.049; the joint rule equals each EP rank filling alone here
(with one compute instruction of W slack each slot has one chunk's W to choose from), and gains
where a slot holds W of several deadlines (W two compute instructions late: 0.062 vs 0.061).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # benchmarks/ holds scripts, not modules
# torch, Ray and tessera are imported inside the functions that use them: ``--help`` answers without them


_MODULES = ("torch", "torch.distributed", "tessera.config.schema", "tessera.cost.analytic", "tessera.cost.types",
            "tessera.dbo", "tessera.dbo.counts", "tessera.engine", "tessera.dbo.units", "tessera.engine.dbo_joint",
            "tessera.engine.emulate", "tessera.plan.baseline", "tessera.program.compiler",
            "tessera.program.memory", "tessera.program.slots", "tessera.sim.dbo", "tessera.sim.simulator",
            "tessera.spec.hardware_presets", "tessera.spec.presets", "tessera.testing")
"""What this script imported at its top before ``--help`` stopped loading it (:func:`_import_modules`)."""


def _import_modules() -> None:
    """Import what the measurement uses before the run's ``wall_s`` clock starts (these were
    module-level imports: ``--help`` no longer pays for them, the timed run still excludes them)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(name)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "qwen3-next-80b-a3b"
    hardware: str = "h800"
    template: str = "interleaved-1f1b"
    pp: int = 4
    vpp: int = 4
    ep: int = 2
    m: int = 8
    seq: int = 4096
    scale: float = 1.0
    margin: float = 0.1
    pool_mem_gb: float = math.inf
    unit: str = "split"
    joint: bool = True


def build(case: Case):
    """(costs with DP zeroed, template Programs, W-slack Programs)."""
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.cost.types import LayerDP
    from tessera.dbo import moe_layers
    from tessera.plan.baseline import baseline_plan
    from tessera.program.compiler import compile_plan
    from tessera.program.slots import annotate_slots
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    c = analytic_costs(get_model(case.model), get_hardware(case.hardware), ParallelConfig(
        pp=case.pp, vpp=case.vpp, ep=case.ep, dp=case.ep, num_microbatches=case.m, micro_batch_size=1,
        seq_length=case.seq))
    z = LayerDP()
    c = dataclasses.replace(c, layers=tuple(dataclasses.replace(x, dp=z) for x in c.layers),
                            embed=dataclasses.replace(c.embed, dp=z), head=dataclasses.replace(c.head, dp=z))
    plain = compile_plan(baseline_plan(c, case.template, case.pp, case.vpp, case.m, overlap=False, split_w=True))
    return c, plain, annotate_slots(plain, moe_layers(c), defer_w=True)


def _iteration(engine, dev, batch) -> tuple[float, float]:
    """(wall ms, emulated clock ms) of one iteration from a start instant common to all ranks
    (:func:`tessera.engine.emulate.timed_iteration`, 0.02 s ahead)."""
    from tessera.engine.emulate import timed_iteration

    return timed_iteration(engine, dev, batch, 0.02)


def world(rank: int, world_size: int, case: Case, counts, rounds: int) -> dict:
    import torch

    from tessera.dbo import rank_tables
    from tessera.dbo.units import unit_table
    from tessera.engine import Batch, Engine, Layout, make_groups
    from tessera.engine.dbo_joint import JointDBOPolicy
    from tessera.engine.emulate import EmulatedDevice, emulated_chunks

    costs, _, progs = build(case)
    groups = make_groups(Layout(case.pp, case.ep, case.ep))
    prog = progs[groups.pipeline_rank]
    table = rank_tables(progs, costs, counts, case.ep, case.margin)[groups.pipeline_rank]
    dev = {k: EmulatedDevice(case.scale, groups.ep, groups.ep_rank, case.ep, counts) for k in ("off", "on")}
    policy = JointDBOPolicy(table, unit_table(table, prog, costs, case.unit), groups.ep_rank,
                            pool_mem_gb=case.pool_mem_gb, joint=case.joint)
    eng = {"off": Engine(prog, emulated_chunks(prog, costs, dev["off"]), groups, hooks=[dev["off"]]),
           "on": Engine(prog, emulated_chunks(prog, costs, dev["on"]), groups, slot_policy=policy,
                        hooks=[dev["on"]])}
    ids = torch.zeros((case.m, 1, 1), dtype=torch.int64)
    batch = Batch(ids, ids)
    times = {"off": [], "on": []}
    clock = {"off": [], "on": []}
    lag = {"off": 0.0, "on": 0.0}
    for k in ("off", "on"):  # warm-up
        _iteration(eng[k], dev[k], batch)
    for r in range(rounds):
        for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if k == "on":
                policy.reset()
            dev[k].slot_idle_ms.clear()
            wall, virt = _iteration(eng[k], dev[k], batch)
            times[k].append(wall)
            clock[k].append(virt)
            lag[k] = max(lag[k], dev[k].lag_ms)
    pred = {s.index: s.idle_ms[groups.ep_rank] for s in table.slots if s.instr.resource == "ep_comm"}
    return {"allgather_us": _allgather_us(groups, counts), "times": times, "clock": clock, "lag": lag, "stats": policy.stats(), "pred": pred, "measured": dict(dev["off"].slot_idle_ms),
            "hidden_ms": dev["on"].bg_hidden_ms}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _allgather_us(groups, counts) -> float | None:
    """The all-gather count transport's latency on the EP group, µs (None without it)."""
    try:
        from tessera.train.dbo.factory import make_transport
        from tessera.train.dbo.transport import measure_latency
    except ImportError:
        return None
    t = make_transport("allgather", groups.ep)
    try:
        return measure_latency(t, n=counts.num_experts * len(counts.layers), reps=100)
    finally:
        t.close()


def _transport_loop(config: dict) -> None:
    """Ray Train's per-worker function of :func:`transport_latencies`: the all-gather first (no
    graph open: an idle graph's channel reads busy-wait), then the compiled graph, each
    :func:`~tessera.train.dbo.transport.measure_latency` over the job's one EP group."""
    import ray.train
    import torch.distributed as dist

    from tessera.train.dbo.factory import make_transport
    from tessera.train.dbo.transport import measure_latency

    rank = ray.train.get_context().get_world_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    out = {}
    for kind in ("allgather", "compiled_graph"):
        t = make_transport(kind, group, timeout_s=10.0)
        try:
            out[kind] = {"us": measure_latency(t, n=config["n"], reps=config["reps"]), "kind": t.kind,
                         "fallen_back": bool(getattr(t, "fallen_back", False))}
        finally:
            t.close()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def transport_latencies(ep: int, n: int, reps: int = 100) -> dict:
    """Both count transports measured in one Ray Train job of ``ep`` gloo workers (a local Ray
    of its own: ``ep`` CPUs, its own temp dir, stopped afterwards), as
    ``tests/test_count_transport.py`` runs them: ``{kind: median over ranks of the median
    exchange time of n int64 counts, µs}``, ``{}`` without Ray. A graph that could not be used
    (the transport fell back to the all-gather) gives None."""
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        return {}
    import shutil
    import tempfile

    temp = tempfile.mkdtemp(prefix="tsr-dbo-ct-", dir="/tmp")
    out = os.path.join(temp, "out")
    os.makedirs(out)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    try:
        ray.init(address="local", num_cpus=ep, _temp_dir=temp, logging_level="ERROR", include_dashboard=False)
        TorchTrainer(_transport_loop, train_loop_config={"out": out, "n": n, "reps": reps},
                     torch_config=TorchConfig(backend="gloo", timeout_s=120),
                     scaling_config=ScalingConfig(num_workers=ep, resources_per_worker={"CPU": 0.5}),
                     run_config=RunConfig(name="counts", storage_path=os.path.join(temp, "runs"),
                                          failure_config=FailureConfig(max_failures=0),
                                          worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                                                                           "OMP_NUM_THREADS": "1"}})).fit()
        rows = []
        for r in range(ep):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    res = {}
    for kind in ("allgather", "compiled_graph"):
        ok = [x[kind]["us"] for x in rows if x[kind]["kind"] == kind and not x[kind]["fallen_back"]]
        res[kind] = statistics.median(ok) if len(ok) == ep else None
    return res


def count_latencies(res: list, ray_us: dict, n: int) -> dict:
    """The count-transport fields (module doc): both transports from :func:`transport_latencies`,
    the faster one, and the all-gather as measured inside the emulation's gloo processes."""
    us = [r["allgather_us"] for r in res if r.get("allgather_us") is not None]
    ag, cg = ray_us.get("allgather"), ray_us.get("compiled_graph")
    faster = None if ag is None or cg is None else ("allgather" if ag <= cg else "compiled_graph")
    return {"count_latency_us_allgather": ag, "count_latency_us_compiled_graph": cg, "count_transport_faster": faster,
            "count_latency_us_allgather_in_emulation": statistics.median(us) if us else None,
            "count_latency_note": f"median exchange of {n} int64 counts (every MoE layer's counts of a microbatch): "
                                  "both transports in one Ray Train job of ep gloo workers (all-gather first, then "
                                  "the compiled graph; median over ranks); _in_emulation: the all-gather over each "
                                  "EP group of the emulated ranks, alongside the other groups"}


def run(case: Case, counts, rounds: int, timeout_s: float = 1800, ray_us: dict | None = None) -> dict:
    from tessera.dbo.counts import skew_max_over_mean
    from tessera.program.memory import rank_memory_bytes
    from tessera.sim.dbo import simulate_dbo
    from tessera.sim.simulator import simulate
    from tessera.testing import run_local

    costs, plain, progs = build(case)
    res = run_local(functools.partial(world, case=case, counts=counts, rounds=rounds), case.pp * case.ep, timeout_s)
    s = case.scale
    off = [t / s for t in res[0]["times"]["off"]]
    on = [t / s for t in res[0]["times"]["on"]]
    c_off = [max(r["clock"]["off"][i] for r in res) for i in range(rounds)]
    c_on = [max(r["clock"]["on"][i] for r in res) for i in range(rounds)]
    stats = [r["stats"] for r in res]
    ann, fill = sum(x.annotated_ms for x in stats), sum(x.filled_ms for x in stats)
    err_num = err_den = 0.0
    for r in res:
        for i, p in r["pred"].items():
            m = r["measured"].get(i, 0.0)
            if p > 0 or m > 0:
                err_num += abs(p - m)
                err_den += m
    sim = {e: simulate_dbo(progs, costs, counts, case.ep, enabled=e, margin=case.margin, pool_mem_gb=case.pool_mem_gb,
                           joint=case.joint, unit=case.unit) for e in (False, True)}
    mem = costs.device_mem_bytes
    out = {
        "skew_max_over_mean": skew_max_over_mean(counts, case.ep),
        "iteration_ms_off": statistics.median(off), "iteration_ms_on": statistics.median(on),
        "reduction": statistics.median(1 - b / a for a, b in zip(off, on)),
        "iteration_ms_off_rounds": off, "iteration_ms_on_rounds": on,
        "clock_iteration_ms_off": statistics.median(c_off), "clock_iteration_ms_on": statistics.median(c_on),
        "clock_reduction": statistics.median(1 - b / a for a, b in zip(c_off, c_on)),
        "host_lag_ms": max(max(r["lag"].values()) for r in res),
        "bubble_fill_rate": fill / ann if ann > 0 else 0.0,
        "moved": sum(x.moved for x in stats), "at_once": sum(x.at_once for x in stats),
        "forced": sum(x.forced for x in stats),
        "background_w_hidden_ms": sum(r["hidden_ms"] for r in res) / max(1, rounds + 1),
        "monitor_overhead_ms": max(x.overhead_ms for x in stats),
        "monitor_overhead_ratio": max(x.overhead_ms for x in stats) / statistics.median(on),
        "peak_mem_increase_points": 100 * (max(rank_memory_bytes(progs, costs)) - max(rank_memory_bytes(plain, costs)))
        / mem,
        "slot_prediction_mean_err": err_num / err_den if err_den > 0 else None,
        "sim_iteration_ms_off": sim[False].iteration_ms, "sim_iteration_ms_on": sim[True].iteration_ms,
        "sim_plain_iteration_ms": simulate(plain, costs).iteration_ms,
        "sim_moved": sim[True].moved, "sim_bubble_fill_rate": sim[True].bubble_fill_rate,
    }
    out["sim_vs_emulated_off"] = out["sim_iteration_ms_off"] / out["iteration_ms_off"] - 1
    out["sim_vs_emulated_on"] = out["sim_iteration_ms_on"] / out["iteration_ms_on"] - 1
    out["sim_vs_clock_off"] = out["sim_iteration_ms_off"] / out["clock_iteration_ms_off"] - 1
    out["sim_vs_clock_on"] = out["sim_iteration_ms_on"] / out["clock_iteration_ms_on"] - 1
    out.update(count_latencies(res, ray_us or {}, counts.num_experts * len(counts.layers)))
    out["case"] = dataclasses.asdict(case) | {"counts_source": counts.source, "rounds": rounds}
    return out


RECORDED_KEYS = ("skew_max_over_mean", "reduction", "clock_reduction", "bubble_fill_rate", "iteration_ms_off",
                 "iteration_ms_on", "clock_iteration_ms_off", "clock_iteration_ms_on", "sim_iteration_ms_off",
                 "sim_iteration_ms_on", "sim_vs_clock_off", "sim_vs_clock_on", "moved", "sim_moved", "at_once",
                 "forced", "host_lag_ms", "monitor_overhead_ratio", "slot_prediction_mean_err")
"""The fields of the ``recorded`` row (module doc)."""


def recorded_case(counts, scale: float) -> Case:
    """The case of the ``recorded`` row: tiny-qwen3-next on the ``cpu`` preset as
    ``recipes/tiny-qwen3-next.yaml`` plans it (interleaved-1f1b, pp=2 vpp=2, ep=2; 128 tokens
    per microbatch: the recipe's 2 x 64 as one sequence), ``counts``' first (at most 8)
    microbatches, ``scale``."""
    return Case(model="tiny-qwen3-next", hardware="cpu", pp=2, vpp=2, ep=2, m=min(8, counts.num_microbatches),
                seq=128, scale=scale)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skew", type=float, default=1.45)
    ap.add_argument("--counts", default=None, help="a TokenCounts JSON (recorded routing)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--vpp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--unit", default="split", help="movable W unit: layer, split (expert W apart) or task")
    ap.add_argument("--independent", action="store_true", help="each EP rank fills alone (no joint rule)")
    ap.add_argument("--recorded", default=None, help="router counts of tiny-qwen3-next (python -m "
                    "tessera.train.profile.routes recipes/tiny-qwen3-next.yaml --steps 2 --out FILE): adds the "
                    "'recorded' row")
    ap.add_argument("--recorded-scale", type=float, default=50.0, help="--scale of the recorded row")
    ap.add_argument("--no-transports", action="store_true", help="skip the Ray job that times both count transports")
    a = ap.parse_args(argv)
    from tessera.dbo import counts_for_skew, moe_layers
    from tessera.dbo.counts import recorded_counts
    from tessera.spec.presets import get_model

    _import_modules()
    t0 = time.time()
    up0 = _uptime()
    case = Case(model=a.model, hardware=a.hardware, pp=a.pp, vpp=a.vpp, ep=a.ep, m=a.m, seq=a.seq, scale=a.scale,
                unit=a.unit, joint=not a.independent)
    costs, _, _ = build(case)
    if a.counts:
        counts = recorded_counts(a.counts)
    else:
        moe = next(x.mlp for x in get_model(case.model).layers if getattr(x.mlp, "kind", None) == "moe")
        counts = counts_for_skew(a.skew, case.ep, case.m, moe_layers(costs), moe.num_experts,
                                 case.ep * case.seq * moe.top_k, seed=1)
    n = counts.num_experts * len(counts.layers)
    ray_us = {} if a.no_transports else transport_latencies(case.ep, n)
    out = run(case, counts, a.rounds, ray_us=ray_us)
    if a.no_transports:
        out["count_latency_note"] += " (both null: --no-transports)"
    if a.recorded:
        rec = recorded_counts(a.recorded)
        rcase = recorded_case(rec, a.recorded_scale)
        row = run(rcase, rec, a.rounds)
        out["recorded"] = {k: row[k] for k in RECORDED_KEYS} | {"case": row["case"], "counts_path": a.recorded}
    out.update({"uptime_before": up0, "uptime_after": _uptime(), "command": " ".join([sys.executable] + sys.argv),
                "wall_s": time.time() - t0})
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_rounds")}, indent=1, default=str))


if __name__ == "__main__":
    main()
