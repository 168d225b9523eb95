"""The autopilot against a straggler: emulated Qwen3-Next-80B devices, and the real tiny job.

Usage::

    python benchmarks/autopilot.py --json FILE [--scale 0.1] [--slowdown 1.3] [--slow-rank 3]
                                   [--slow-step 61] [--steps 140] [--noise-steps 220]
                                   [--bad-steps 170] [--noise 0.05] [--jitter 0.02]
                                   [--tiny-slowdown 1.5] [--tiny-slow-step 21] [--tiny-steps 60]
                                   [--tiny-noise-steps 60] [--no-emulated] [--no-tiny]

**Emulated** (``emulated``): ``recipes/qwen3-next-80b.yaml`` (``qwen3-next-80b-a3b``, ``h800``
analytic costs) with F&B overlap off (``planner.overlap=false``: the emulation does not model
the overlap slowdown), ``autopilot.enabled=true``, ``profile.check_every=5`` and the other
``autopilot`` fields at their defaults: interleaved-1f1b, pp 8 x vpp 2 (16 stages of 3 layers),
16 microbatches of 1 x 4096 tokens, ep 8 / dp 8 in the costs. It runs as 8 local gloo processes
(:func:`tessera.testing.run_local`), one per pipeline rank, each standing for its whole EP group
(balanced routing: every member runs the same clock, so an all-to-all completes at its issue time
plus its duration); data-parallel collectives are not emulated. Every rank runs the real
:class:`~tessera.engine.Engine` on :mod:`tessera.engine.emulate` chunks (cost-model durations,
``--scale`` wall ms per cost-model ms, real sends). The emulated device of this script
(:class:`StragglerDevice`) multiplies each compute task's duration by the rank's slowdown factor
(``--slowdown`` on pipeline rank ``--slow-rank`` from iteration ``--slow-step`` on, else 1), by a
per-(rank, iteration) factor ``exp(N(0, --jitter))`` and by a per-task factor
``exp(N(0, --noise))``, and keeps each task's time (W tasks one at a time).

Rank 0 holds the job's real :class:`~tessera.train.job.driver.Driver` (in-process, on a plan made
once by the planner for nominal conditions) and plays the worker loop's part: every iteration it
reports the iteration time (the largest rank's emulated clock from one common start instant,
cost-model ms: :attr:`~tessera.engine.emulate.EmulatedDevice.iteration_ms`), and at check steps
the check of :mod:`tessera.train.worker.straggler` on every rank's task times
(:func:`~tessera.train.worker.straggler.rank_sample`, :func:`~tessera.train.worker.straggler.check_estimate`).
The driver's autopilot does the rest as in a job: window medians, re-plan in its background
thread with the measured factors as ``planner.rank_slowdown`` (the real planner under
``autopilot.replan_time_s``), simulate, switch (a new version), verify on the reported iteration
times, roll back. The ranks switch Programs (:meth:`Driver.get_program`) at the announced step.
While the driver re-plans, rank 0 reports each iteration no earlier than it would end at the cost
model's speed (wall time from the re-plan's start >= the emulated iterations since), so the
re-plan spans as many iterations as it would in such a job (at ``--scale`` alone the emulated
iterations would outrun the planner tenfold).

Runs: ``straggler`` (``--steps``), ``noise`` (no straggler, ``--noise-steps``) and ``bad_plan``
(``--bad-steps``: the straggler again, with the driver's first re-plan replaced by a deliberately
bad plan: the planner's plan for the slow rank running *faster* than the others, claimed to be
``2 * autopilot.margin`` faster than the running plan, so the autopilot switches to it and must
roll it back; its later re-plans are its own). Fields (times in cost-model ms; ``wall_*``: wall
ms / scale, host overhead included, also the driver's re-plan, which shares rank 0's process):

* ``slowdown``, ``slow_rank``, ``slow_step``;
* ``iteration_ms_before`` (median of the ordinary iterations 6 .. slow_step - 1),
  ``iteration_ms_straggler`` (slow_step .. the switch - 1), ``iteration_ms_after_switch`` (the
  switch + 1 .. the end); ``recovered_share`` = (straggler - after) / (straggler - before);
* ``steps_to_switch``: from ``slow_step`` to the step the new plan ran first; ``detect_step``
  (the check whose window median moved), ``decision_step``, ``replan_s`` (the driver's re-plan,
  wall s), ``replan_steps`` (iterations from the detection to the decision) beside
  ``replan_steps_at_iteration_ms`` (``replan_s`` over the straggler's iteration time: what a job
  at the cost model's speed would run meanwhile), ``effective_step``;
* ``switch_pause_s``: the slowest rank's Program switch (fetch the Program from the driver, build
  the engine; wall s; nothing moves in the emulation: the tiny job's ``switch_pause_s`` is a real one);
* ``false_switches``: switches in the ``noise`` run, with ``noise_decisions`` (every decision
  that run recorded) and ``noise_rank_slowdown_max`` (the largest window median it saw);
* ``rollbacks``: rollbacks in the ``bad_plan`` run, with ``bad_plan`` (its versions, decisions
  and verifications, the bad plan's measured and simulated iteration);
* ``predictions``: the decision's options (``running`` and ``replan``, simulated by the driver
  under the measured conditions with data-parallel costs), and ``sim_emulated`` (the simulator on
  the emulation's own costs, data-parallel costs zeroed: v0 nominal, v0 and the switched plan with
  the true slowdown) beside the measured clocks;
* ``host_lag_ms``: how far a rank's host fell behind its clock at worst (wall times only);
* ``targets``: recovered_share >= 0.5, false_switches == 0, steps_to_switch <= 20.

**Tiny** (``tiny``): ``tessera train recipes/tiny-qwen3-next.yaml`` (8 layers, 4 gloo workers
pp 2 x dp 2, ep 2, vpp 2; a local Ray) with ``autopilot.enabled=true``,
``profile.check_every=5``, W&B off, ``TESSERA_SLOW_RANK=2:SLOW_STEP:--tiny-slowdown`` (world
rank 2 is pipeline rank 0 of replica 1) for ``--tiny-steps`` steps, and once without a straggler
for ``--tiny-noise-steps`` (``false_switches``; 0: not run). The same fields from
``metrics.jsonl`` (``iteration_ms``: rank 0's wall time; check steps, which run on the profiling
engine, and the switch's own iteration left out), ``switch_pause_s`` = ``plan_switch_s``,
``rank_slowdown_measured`` (the window medians the decision acted on), the decision and the
verification as recorded; ``runs``: each command's ``wall_s`` and 1-minute load average before
and after. CPU wall times on a shared 2-core machine: read them with the load.

``command``, ``wall_s``, ``uptime_before`` / ``uptime_after``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # benchmarks/ holds scripts, not modules
# torch, Ray and tessera are imported inside the functions that use them: ``--help`` answers without them

ROOT = Path(__file__).resolve().parents[1]
BIG = str(ROOT / "recipes" / "qwen3-next-80b.yaml")
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
EMULATED = ("planner.overlap=false", "autopilot.enabled=true", "profile.check_every=5", "logging.wandb_mode=disabled")
TINY_OVERRIDES = ("autopilot.enabled=true", "profile.check_every=5", "logging.wandb_mode=disabled")
TINY_SLOW_RANK = 2  # world rank 2: pipeline rank 0 of replica 1 (the tiny recipe's pp-ep-dp order on cpu)
WARMUP = 5  # iterations left out of every median
TARGETS = {"recovered_share": (">=", 0.5), "false_switches": ("==", 0), "steps_to_switch": ("<=", 20)}


# --------------------------------------------------------------------------- the emulated device


def _device_classes():
    """(:class:`StragglerDevice`, :class:`TimedChunk`), defined once torch and tessera are imported."""
    from tessera.engine.emulate import EmulatedChunk, EmulatedDevice

    class StragglerDevice(EmulatedDevice):
        """An :class:`EmulatedDevice` whose compute lasts ``factor`` x a per-iteration jitter x a
        per-task noise times the cost model's; the first compute of the task named in
        :attr:`task` is kept in :attr:`timings` as ``(task, ms)`` (cost-model ms)."""

        def __init__(self, scale: float, noise: float, jitter: float, seed: int) -> None:
            super().__init__(scale)
            self.noise, self.jitter, self.rng = noise, jitter, random.Random(seed)
            self.factor = self.step_factor = 1.0
            self.task: str | None = None
            self.timings: list[tuple[str, float]] = []

        def new_iteration(self, factor: float) -> None:
            self.factor = factor
            self.step_factor = math.exp(self.rng.gauss(0.0, self.jitter)) if self.jitter > 0 else 1.0
            self.timings = []

        def compute(self, ms: float) -> None:
            ms = ms * self.factor * self.step_factor * (math.exp(self.rng.gauss(0.0, self.noise)) if self.noise > 0
                                                        else 1.0)
            if self.task is not None:
                self.timings.append((self.task, ms))
                self.task = None
            super().compute(ms)

    class TimedChunk(EmulatedChunk):
        """An :class:`EmulatedChunk` that names each task to its device, and runs a chunk's
        deferred W one task at a time (the same total) so each W task is timed."""

        def run(self, key, mb) -> None:
            self.device.task = str(key)
            try:
                super().run(key, mb)
            finally:
                self.device.task = None

        def run_w(self, mb, key=None) -> int:
            done = 0
            for k in (self.task_keys("W") if key is None else (key,)):
                self.device.task = str(k)
                try:
                    done += super().run_w(mb, k)
                finally:
                    self.device.task = None
            return done

    return StragglerDevice, TimedChunk


def emulation_costs(recipe, slowdown: tuple[float, ...] = ()):
    """The emulation's costs: the recipe's, data-parallel costs zeroed (not emulated), and
    ``slowdown`` as ``rank_scale`` (for the simulator; the emulation scales its own tasks)."""
    from tessera.cost.types import LayerDP
    from tessera.flow import build_costs, resolve

    c = build_costs(resolve(recipe))
    z = LayerDP()
    return dataclasses.replace(c, layers=tuple(dataclasses.replace(x, dp=z) for x in c.layers),
                               embed=dataclasses.replace(c.embed, dp=z), head=dataclasses.replace(c.head, dp=z),
                               rank_scale=tuple(slowdown))


# --------------------------------------------------------------------------- rank 0: the driver


def _inject_bad_replan(claimed_gain: float) -> None:
    """Replace the driver's first re-plan (in this process) by a deliberately bad one: the
    planner's plan for the measured slow ranks running as much *faster* (inverse factors),
    presented as ``claimed_gain`` faster than the running plan (module docstring, ``bad_plan``);
    later re-plans are the driver's own."""
    import tessera.train.job.autopilot as ap
    from tessera.flow import build_costs, compile_programs, resolve
    from tessera.program.plan import Plan
    from tessera.sim.simulator import simulated_iteration_ms
    from tessera.train.upgrade.autopilot import Conditions, Option
    from tessera.train.upgrade.versions import plan_sha256

    real = ap.evaluate_options

    def bad_replan(recipe, plan, dbo, conditions):
        ap.evaluate_options = real  # once
        inverse = Conditions(tuple(1.0 / f for f in conditions.rank_slowdown), conditions.ep_slowdown,
                             conditions.routing_skew)
        bad = real(recipe, plan, dbo, inverse)
        costs = build_costs(resolve(ap.scaled_recipe(recipe, conditions, dbo)))  # the measured conditions
        cur = Option("running", plan_sha256(plan, dbo),
                     simulated_iteration_ms(compile_programs(Plan.from_dict(plan)), costs), dbo, plan)
        b = next(o for o in bad.options if o.name == "replan")
        lie = Option("replan", b.sha256, cur.predicted_ms * (1 - claimed_gain), b.dbo, b.plan)
        return ap.Evaluation(cur, (lie,), conditions, bad.replan_s,
                             (f"injected: the plan for rank_slowdown {[round(f, 3) for f in inverse.rank_slowdown]} "
                              f"claimed {claimed_gain:.0%} faster than the running plan",))

    ap.evaluate_options = bad_replan


class Leader:
    """Rank 0's side: the job's driver in this process, fed as the worker loop feeds it."""

    def __init__(self, recipe, plan: dict, run_dir: str, name: str, bad: bool) -> None:
        from tessera.train.job.driver import Driver

        if bad:
            _inject_bad_replan(2 * recipe.autopilot.margin)
        # the driver's re-plan thread shares this process: a short GIL switch interval keeps this
        # rank's iterations near their emulated length while it runs (the pacing in report())
        sys.setswitchinterval(1e-4)
        self.driver = Driver(recipe.to_dict(), run_dir, name, plan_dict=plan)
        if self.driver.error is not None:
            raise self.driver.error
        self.pp = recipe.parallel.pp
        self.pace: tuple[float, float] | None = None  # (wall start, emulated seconds since) while re-planning
        self.rows: list[dict] = []

    def programs(self, version: int | None = None) -> dict:
        """``{"version", "programs"}``: every pipeline rank's Program (dict) of ``version``."""
        got = [self.driver.get_program(r, version) for r in range(self.pp)]
        return {"version": got[0]["plan_version"], "programs": [g["program"] for g in got]}

    def report(self, step: int, clock_ms: float, wall_ms: float, check, switch_from) -> None:
        m = {"iteration_ms": clock_ms, "wall_iteration_ms": wall_ms, "plan_version": self.driver.plan_version,
             "plan_switch_from": switch_from}
        if check is not None:
            m.update(check.metrics())
        self.rows.append(dict(m, step=step))
        if self.pace is not None:  # a re-plan in flight: this iteration's report comes when it would at model speed
            self.pace = (self.pace[0], self.pace[1] + clock_ms / 1e3)
            time.sleep(max(0.0, self.pace[0] + self.pace[1] - time.monotonic()))
        self.driver.report(0, step, m)
        replanning = self.driver.autopilot_status()["replanning"]
        self.pace = (self.pace or (time.monotonic(), 0.0)) if replanning else None

    def switch_due(self, step: int) -> dict | None:
        """The version announced for iteration ``step + 1`` (its Programs), or None."""
        due = [v for v, at in self.driver.pending_versions() if at <= step + 1]
        return dict(self.programs(max(due)), step=step + 1) if due else None


# --------------------------------------------------------------------------- every rank


def _iteration(engine, dev, batch) -> tuple[float, float]:
    """(wall ms, emulated clock ms) of one iteration from a start instant common to all ranks
    (:func:`tessera.engine.emulate.timed_iteration`, 0.005 s ahead)."""
    from tessera.engine.emulate import timed_iteration

    return timed_iteration(engine, dev, batch, 0.005)


def world(rank: int, world_size: int, cfg: dict) -> dict:
    """One emulated pipeline rank of run ``cfg`` (module docstring); rank 0 returns the run."""
    import torch
    import torch.distributed as dist

    from tessera.config.load import recipe_from_dict
    from tessera.cost.profile_costs import task_signatures
    from tessera.engine import Batch, Engine, Layout, make_groups
    from tessera.program.instructions import Program
    from tessera.train.worker.straggler import RankSample, check_estimate, rank_sample

    device_cls, chunk_cls = _device_classes()
    recipe = recipe_from_dict(cfg["recipe"])
    pp, ep, m = recipe.parallel.pp, recipe.parallel.ep, recipe.parallel.num_microbatches
    costs = emulation_costs(recipe)
    signature = task_signatures(costs)
    every = recipe.profile.check_every
    groups = make_groups(Layout(pp, 1, 1))
    dev = device_cls(cfg["scale"], cfg["noise"], cfg["jitter"], cfg["seed"] * 1000 + rank)
    leader = Leader(recipe, cfg["plan"], cfg["run_dir"], cfg["name"], cfg["bad"]) if rank == 0 else None

    def engine_of(msg: dict):
        prog = Program.from_dict(msg["programs"][groups.pipeline_rank])
        chunks = [chunk_cls(costs, s.start, s.stop, dev) for s in sorted(prog.stages, key=lambda s: s.chunk)]
        return Engine(prog, chunks, groups, hooks=[dev])

    box = [leader.programs() if leader else None]
    dist.broadcast_object_list(box, src=0)
    engine, version = engine_of(box[0]), box[0]["version"]
    ids = torch.zeros((m, 1, 1), dtype=torch.int64)
    batch = Batch(ids, ids)
    switch_s: dict[int, float] = {}
    lag, switch_from = 0.0, None
    for step in range(1, cfg["steps"] + 1):
        slow = cfg["slow"] is not None and rank == cfg["slow"][0] and step >= cfg["slow"][1]
        dev.new_iteration(cfg["slow"][2] if slow else 1.0)
        wall, clock = _iteration(engine, dev, batch)
        lag = max(lag, dev.lag_ms) if step > WARMUP else lag
        sample = rank_sample(rank, groups.pipeline_rank, dev.timings, signature, ep).to_dict() \
            if every > 0 and step % every == 0 else None
        got = [None] * world_size
        dist.all_gather_object(got, (clock, sample), group=None)
        box = [None]
        if leader is not None:
            check = None if sample is None else check_estimate(step, [RankSample.from_dict(s) for _, s in got], pp)
            leader.report(step, max(c for c, _ in got), wall / cfg["scale"], check, switch_from)
            box = [leader.switch_due(step)]
        dist.broadcast_object_list(box, src=0)
        switch_from = None
        if box[0] is not None:  # the announced version runs from the next iteration on
            t0 = time.perf_counter()
            engine = engine_of(box[0])
            took = [None] * world_size
            dist.all_gather_object(took, time.perf_counter() - t0)
            switch_s[box[0]["step"]] = max(took)
            if leader is not None:
                leader.driver.confirm_version(box[0]["version"], box[0]["step"],
                                              {"from": version, "moved_bytes": 0, "switch_s": max(took)})
            switch_from, version = version, box[0]["version"]
    lags = [None] * world_size
    dist.all_gather_object(lags, lag)
    if leader is None:
        return {}
    d = leader.driver
    return {"rows": leader.rows, "records": [r for r in d.records if "event" in r], "switch_s": switch_s,
            "status": d.autopilot_status(), "versions": [v.summary() for v in d.history.versions],
            "plans": {v.version: v.plan for v in d.history.versions}, "host_lag_ms": max(lags)}


def run_emulated(recipe, plan: dict, name: str, steps: int, slow, scale: float, noise: float, jitter: float,
                 seed: int, bad: bool = False) -> dict:
    """One emulated run on 8 local processes (module docstring); rank 0's result, ``wall_s`` added."""
    from tessera.testing import run_local

    with tempfile.TemporaryDirectory(prefix=f"tsr-autopilot-{name}-") as run_dir:
        cfg = {"recipe": recipe.to_dict(), "plan": plan, "run_dir": run_dir, "name": name, "steps": steps,
               "slow": slow, "scale": scale, "noise": noise, "jitter": jitter, "seed": seed, "bad": bad}
        t0 = time.time()
        out = run_local(functools.partial(world, cfg=cfg), recipe.parallel.pp, 3600.0)[0]
    out["wall_s"] = time.time() - t0
    return out


# --------------------------------------------------------------------------- summaries


def _median(rows, lo: int, hi: int, every: int, key: str = "iteration_ms") -> float | None:
    """Median ``key`` of the ordinary iterations ``lo .. hi`` (no check step, no switch)."""
    got = [r[key] for r in rows if lo <= r["step"] <= hi and not (every > 0 and r["step"] % every == 0)
           and r.get("plan_switch_from") is None and r.get(key) is not None]
    return statistics.median(got) if got else None


def _events(records, name: str) -> list[dict]:
    return [r for r in records if r.get("event") == name]


def _slim(event: dict | None) -> dict | None:
    """A decision or verification event without its name and wall-clock time."""
    if event is None:
        return None
    return {k: v for k, v in event.items() if k not in ("time", "event")}


def straggler_fields(rows, records, slow_step: int, every: int) -> dict:
    """The fields of a straggler run from its iteration rows and driver records (module
    docstring): before / straggler / after medians, the share recovered, the switch's steps."""
    decisions = [e for e in _events(records, "autopilot_decision") if e["action"] != "skip"]
    switch = next((e for e in decisions if e["action"] == "switch"), None)
    last = rows[-1]["step"]
    at = next((r["step"] for r in rows if r.get("plan_switch_from") is not None), None)
    before = _median(rows, WARMUP + 1, slow_step - 1, every)
    straggler = _median(rows, slow_step, (at or last + 1) - 1, every)
    after = _median(rows, at + 1, last, every) if at else None
    out = {"iteration_ms_before": before, "iteration_ms_straggler": straggler, "iteration_ms_after_switch": after,
           "recovered_share": (straggler - after) / (straggler - before)
           if None not in (before, straggler, after) and straggler != before else None,
           "steps_to_switch": at - slow_step if at else None, "switch_step": at,
           "detect_step": switch["started_step"] if switch else None, "decision_step": switch["step"] if switch else None,
           "effective_step": switch["effective_step"] if switch else None,
           "replan_s": switch["replan_s"] if switch else None,
           "replan_steps": switch["step"] - switch["started_step"] if switch else None,
           "replan_steps_at_iteration_ms": 1e3 * switch["replan_s"] / straggler if switch and straggler else None,
           "decision": _slim(switch),
           "decisions": [_slim(e) for e in decisions], "verify": [_slim(e) for e in _events(records, "autopilot_verify")]}
    if switch:
        opts = {o["name"]: o["predicted_ms"] for o in switch["options"]}
        out["predictions"] = {"conditions": switch["conditions"], "running_ms": opts.get("running"),
                              "replan_ms": opts.get("replan"), "predicted_gain": switch["predicted_gain"]}
    return out


def emulated(args) -> dict:
    """The emulated part (module docstring)."""
    from tessera.config.load import load_recipe
    from tessera.flow import compile_programs, plan_programs
    from tessera.program.plan import Plan
    from tessera.sim.simulator import simulated_iteration_ms

    recipe = load_recipe(BIG, list(EMULATED))
    pp, every = recipe.parallel.pp, recipe.profile.check_every
    t0 = time.time()
    plan = plan_programs(recipe)[0].to_dict()
    plan_s = time.time() - t0
    slow = (args.slow_rank, args.slow_step, args.slowdown)
    kw = {"scale": args.scale, "noise": args.noise, "jitter": args.jitter}
    runs = {"straggler": run_emulated(recipe, plan, "straggler", args.steps, slow, seed=1, **kw)}
    runs["noise"] = run_emulated(recipe, plan, "noise", args.noise_steps, None, seed=2, **kw)
    runs["bad_plan"] = run_emulated(recipe, plan, "bad_plan", args.bad_steps, slow, seed=3, bad=True, **kw)

    s = runs["straggler"]
    out = {"slowdown": args.slowdown, "slow_rank": args.slow_rank, "slow_step": args.slow_step,
           **straggler_fields(s["rows"], s["records"], args.slow_step, every)}
    out["switch_pause_s"] = max(s["switch_s"].values()) if s["switch_s"] else None
    at = out["switch_step"]  # the same medians in wall time (host overhead included)
    out["wall_iteration_ms_before"] = _median(s["rows"], WARMUP + 1, args.slow_step - 1, every, "wall_iteration_ms")
    out["wall_iteration_ms_straggler"] = _median(s["rows"], args.slow_step, (at or args.steps + 1) - 1, every,
                                                 "wall_iteration_ms")
    out["wall_iteration_ms_after_switch"] = _median(s["rows"], at + 1, args.steps, every, "wall_iteration_ms") \
        if at else None
    true = tuple(args.slowdown if r == args.slow_rank else 1.0 for r in range(pp))
    sim = {"v0_nominal_ms": simulated_iteration_ms(compile_programs(Plan.from_dict(plan)), emulation_costs(recipe)),
           "v0_straggler_ms": simulated_iteration_ms(compile_programs(Plan.from_dict(plan)),
                                                     emulation_costs(recipe, true))}
    new = s["plans"].get(1)
    if new is not None:
        sim["switched_straggler_ms"] = simulated_iteration_ms(compile_programs(Plan.from_dict(new)),
                                                              emulation_costs(recipe, true))
        out["partition_before"] = plan["partition"]["bounds"]
        out["partition_after"] = new["partition"]["bounds"]
    out.setdefault("predictions", {})["sim_emulated"] = sim

    n = runs["noise"]
    noise_decisions = _events(n["records"], "autopilot_decision")
    out["false_switches"] = sum(1 for e in noise_decisions if e["action"] == "switch")
    out["noise_steps"] = args.noise_steps
    out["noise_decisions"] = [_slim(e) for e in noise_decisions]
    out["noise_rank_slowdown_max"] = max((e["rank_slowdown_max"] for e in _events(n["records"], "autopilot_estimate")
                                          if e["full"]), default=None)
    out["noise_iteration_ms_median"] = _median(n["rows"], WARMUP + 1, args.noise_steps, every)
    ms = [r["iteration_ms"] for r in n["rows"] if r["step"] > WARMUP and r["step"] % every]
    out["noise_iteration_ms_cv"] = statistics.pstdev(ms) / statistics.mean(ms) if len(ms) > 1 else None

    b = runs["bad_plan"]
    verdicts = _events(b["records"], "autopilot_verify")
    out["rollbacks"] = b["status"]["rollbacks"]
    bad = {"switches": b["status"]["switches"], "verify": [_slim(v) for v in verdicts],
           "decisions": [_slim(e) for e in _events(b["records"], "autopilot_decision") if e["action"] != "skip"],
           "versions": [{k: v[k] for k in ("version", "source", "effective_step") if k in v} for v in b["versions"]]}
    if 1 in b["plans"]:
        bad["partition"] = b["plans"][1]["partition"]["bounds"]
        bad["sim_emulated_straggler_ms"] = simulated_iteration_ms(compile_programs(Plan.from_dict(b["plans"][1])),
                                                                  emulation_costs(recipe, true))
        on = [r for r in b["rows"] if r["plan_version"] == 1 and r.get("plan_switch_from") is None
              and r["step"] % every]
        bad["iteration_ms_bad_plan"] = statistics.median(r["iteration_ms"] for r in on) if on else None
    out["bad_plan"] = bad

    out["host_lag_ms"] = max(r["host_lag_ms"] for r in runs.values())
    out["runs_wall_s"] = {k: r["wall_s"] for k, r in runs.items()}
    out["initial_plan_s"] = plan_s
    out["case"] = {"recipe": os.path.relpath(BIG, ROOT), "overrides": list(EMULATED), "pp": pp,
                   "vpp": recipe.parallel.vpp, "ep_in_costs": recipe.parallel.ep, "dp_in_costs": recipe.parallel.dp,
                   "num_microbatches": recipe.parallel.num_microbatches, "processes": pp,
                   "scale_wall_ms_per_model_ms": args.scale, "noise_sigma": args.noise, "jitter_sigma": args.jitter,
                   "steps": args.steps, "autopilot": dataclasses.asdict(recipe.autopilot),
                   "check_every": every, "upgrade_lead_steps": recipe.job.upgrade_lead_steps}
    return out


# --------------------------------------------------------------------------- the real tiny job


def tiny_job(out_dir: str, name: str, steps: int, slow: str | None) -> tuple[list[dict], list[dict], dict]:
    """``tessera train`` of the tiny recipe with the autopilot on (module docstring); returns its
    metrics.jsonl (iteration rows, events) and ``{"wall_s", "load_1min_before", "load_1min_after"}``
    (the command's wall time, ``os.getloadavg`` around it).

    Raises:
        RuntimeError: the command failed (its last output lines in the message).
    """
    cmd = [sys.executable, "-m", "tessera", "train", TINY, f"train.steps={steps}", f"logging.out_dir={out_dir}",
           *TINY_OVERRIDES, "--run-name", name, "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TESSERA_SLOW_RANK")}
    if slow:
        env["TESSERA_SLOW_RANK"] = slow
    t0, load0 = time.time(), os.getloadavg()[0]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"tessera train exited {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    run = {"wall_s": time.time() - t0, "load_1min_before": load0, "load_1min_after": os.getloadavg()[0]}
    return [r for r in records if "event" not in r], [r for r in records if "event" in r], run


def tiny(args) -> dict:
    """The real tiny job's part (module docstring)."""
    from tessera.config.load import load_recipe

    every = load_recipe(TINY, list(TINY_OVERRIDES)).profile.check_every
    with tempfile.TemporaryDirectory(prefix="tsr-autopilot-tiny-") as out_dir:
        slow = f"{TINY_SLOW_RANK}:{args.tiny_slow_step}:{args.tiny_slowdown}"
        rows, events, wall = tiny_job(out_dir, "straggler", args.tiny_steps, slow)
        out = {"slowdown": args.tiny_slowdown, "slow_world_rank": TINY_SLOW_RANK, "slow_step": args.tiny_slow_step,
               "steps": args.tiny_steps, **straggler_fields(rows, events, args.tiny_slow_step, every)}
        sw = next((r for r in rows if r.get("plan_switch_from") is not None), None)
        out["switch_pause_s"] = sw["plan_switch_s"] if sw else None
        out["switch_moved_bytes"] = sw["plan_switch_moved_bytes"] if sw else None
        out["rollbacks"] = sum(1 for v in _events(events, "autopilot_verify") if v["action"] == "rollback")
        out["rank_slowdown_measured"] = out["decision"]["conditions"]["rank_slowdown"] if out["decision"] else None
        out["losses_finite"] = all(math.isfinite(r["loss"]) for r in rows)
        out["steps_run"] = [r["step"] for r in rows] == list(range(1, args.tiny_steps + 1))
        out["runs"] = {"straggler": wall}
        if args.tiny_noise_steps > 0:
            rows_n, events_n, wall_n = tiny_job(out_dir, "noise", args.tiny_noise_steps, None)
            decisions = _events(events_n, "autopilot_decision")
            out["false_switches"] = sum(1 for e in decisions if e["action"] == "switch")
            out["noise_steps"] = args.tiny_noise_steps
            out["noise_decisions"] = [_slim(e) for e in decisions]
            out["noise_rank_slowdown_max"] = max((e["rank_slowdown_max"] for e in _events(events_n, "autopilot_estimate")
                                                  if e["full"]), default=None)
            out["noise_iteration_ms_median"] = _median(rows_n, WARMUP + 1, args.tiny_noise_steps, every)
            out["runs"]["noise"] = wall_n
    out["case"] = {"recipe": os.path.relpath(TINY, ROOT), "overrides": list(TINY_OVERRIDES),
                   "env": f"TESSERA_SLOW_RANK={slow}"}
    return out


# --------------------------------------------------------------------------- main


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def targets(part: dict) -> dict:
    """Each target of :data:`TARGETS`: ``{"value", "rule", "met"}`` (met None when not measured)."""
    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b}
    out = {}
    for key, (op, bound) in TARGETS.items():
        v = part.get(key)
        out[key] = {"value": v, "rule": f"{op} {bound}", "met": None if v is None else bool(ops[op](v, bound))}
    return out


ROWS = ("slowdown", "iteration_ms_before", "iteration_ms_straggler", "iteration_ms_after_switch", "recovered_share",
        "steps_to_switch", "detect_step", "effective_step", "replan_s", "switch_pause_s", "false_switches",
        "rollbacks")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--json", required=True, metavar="FILE", help="where to write the results")
    ap.add_argument("--scale", type=float, default=0.1, help="emulation: wall ms per cost-model ms")
    ap.add_argument("--slowdown", type=float, default=1.3, help="emulation: the straggler's compute factor")
    ap.add_argument("--slow-rank", type=int, default=3, help="emulation: the slow pipeline rank")
    ap.add_argument("--slow-step", type=int, default=61, help="emulation: the first slow iteration")
    ap.add_argument("--steps", type=int, default=140, help="emulation: iterations of the straggler runs")
    ap.add_argument("--noise-steps", type=int, default=220, help="emulation: iterations of the run without straggler")
    ap.add_argument("--bad-steps", type=int, default=170, help="emulation: iterations of the run with a bad re-plan")
    ap.add_argument("--noise", type=float, default=0.05, help="emulation: sigma of each task's log-normal noise")
    ap.add_argument("--jitter", type=float, default=0.02, help="emulation: sigma of each rank's per-iteration factor")
    ap.add_argument("--tiny-slowdown", type=float, default=1.5, help="tiny job: TESSERA_SLOW_RANK's factor")
    ap.add_argument("--tiny-slow-step", type=int, default=21, help="tiny job: the first slow iteration")
    ap.add_argument("--tiny-steps", type=int, default=60, help="tiny job: steps of the straggler run")
    ap.add_argument("--tiny-noise-steps", type=int, default=60, help="tiny job: steps of the run without straggler "
                    "(0: not run)")
    ap.add_argument("--no-emulated", action="store_true", help="skip the emulated part")
    ap.add_argument("--no-tiny", action="store_true", help="skip the real tiny job")
    args = ap.parse_args(argv)
    from rich.table import Table

    from tessera.cli.console import print_tables

    t0, up0 = time.time(), _uptime()
    out: dict = {}
    if not args.no_tiny:  # first: its CPU wall times suffer most from what else runs
        out["tiny"] = tiny(args)
        out["tiny"]["targets"] = targets(out["tiny"])
    if not args.no_emulated:
        out["emulated"] = emulated(args)
        out["emulated"]["targets"] = targets(out["emulated"])
    out.update({"uptime_before": up0, "uptime_after": _uptime(), "command": " ".join([sys.executable] + sys.argv),
                "wall_s": time.time() - t0})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    parts = [p for p in ("emulated", "tiny") if p in out]
    table = Table(title="autopilot against a straggler (emulated: cost-model ms; tiny: CPU wall ms)")
    table.add_column("field")
    for p in parts:
        table.add_column(p, justify="right")
    for key in ROWS:
        table.add_row(key, *(_fmt(out[p].get(key)) for p in parts))
    for key in TARGETS:
        table.add_row(f"target {key} {TARGETS[key][0]} {TARGETS[key][1]}",
                      *(_fmt(out[p]["targets"][key]["met"]) for p in parts))
    print_tables(table)
    print(f"{up0}\n{out['uptime_after']}\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
