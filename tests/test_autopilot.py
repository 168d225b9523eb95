"""The autopilot: the straggler and routing-skew estimator on synthetic timings (noise is not a
straggler, a 1.3x rank is found within the window), the pure decision and verification rules,
the recipe section's one-line errors, the test-only straggler hook's parsing, and the driver's
wiring in-process (no Ray, as tests/test_upgrade.py drives a Driver): reported checks with a
slowed rank re-plan, switch, record every decision, verify and keep a switch that paid, roll back
one that made the job slower and never try it again; noise switches nothing. And one real Ray
Train job (the tiny recipe, 4 gloo workers, one slowed by ``TESSERA_SLOW_RANK``): the autopilot
finds the slow pipeline rank, re-plans and switches on its own, no step is lost or repeated, and
the losses and final parameters are bitwise those of the same switch made by hand at the same step
(the job's worker loop on local gloo ranks, tests/local_job.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tessera.config.load import load_recipe
from tessera.errors import TesseraConfigError, UpgradeRefused
from tessera.train.upgrade.autopilot import (AutopilotState, Conditions, Option, Pending, choose, gate, moved,
                                             tolerance, verify)
from tessera.train.worker.straggler import (CheckEstimate, RankSample, StragglerWindow, check_estimate, comparable,
                                            ep_block_counts, rank_sample, route_stats)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
PP2 = ["parallel.dp=1", "parallel.ep=1", "planner.overlap=false", "planner.split_w=false",
       "logging.wandb_mode=disabled"]
AUTO = ["autopilot.enabled=true", "profile.check_every=5", "autopilot.verify_steps=4", "autopilot.holdoff_steps=5"]

# --------------------------------------------------------------------------- the estimator

LAYERS = 16
KIND_MS = {"mixer": 2.0, "router": 0.3, "expert": 3.0, "shared": 1.0, "dispatch": 0.5}


def _tasks(pipeline_rank: int, pp: int):
    """(task name, item, base ms) of the layers pipeline rank ``pipeline_rank`` holds (contiguous
    quarters of 16 layers of kinds DDDA...)."""
    per = LAYERS // pp
    out = []
    for layer in range(pipeline_rank * per, (pipeline_rank + 1) * per):
        code = "A" if layer % 4 == 3 else "D"
        for phase in ("F", "B", "W"):
            for kind, ms in KIND_MS.items():
                if phase == "W" and kind in ("router", "dispatch"):
                    continue
                base = ms * (1.5 if code == "A" and kind == "mixer" else 1.0) * (2.0 if phase == "B" else 1.0)
                out.append((f"{phase}.L{layer}.{kind}", f"{phase}.{code}E.{kind}", base))
    return out


def _check(step, rng, pp=4, dp=2, ep=1, slow=None, noise=0.05, late=None):
    """One check of synthetic ranks: two microbatches per task, log-normal noise; ``slow``:
    ``(pipeline rank, replica, factor)``; ``late``: ``(pipeline rank, factor)`` inflates every F
    and B task there but the shared expert's (what all-to-all waits inside tasks look like)."""
    samples = []
    for r in range(pp):
        for d in range(dp):
            tasks = _tasks(r, pp)
            signature = {name: item for name, item, _ in tasks}
            factor = slow[2] if slow and slow[:2] == (r, d) else 1.0
            timings = []
            for name, _, base in tasks:
                wait = late[1] if late and late[0] == r and name[0] in "FB" and not name.endswith("shared") else 1.0
                timings += [(name, base * factor * wait * math.exp(rng.gauss(0, noise))) for _ in range(2)]
            samples.append(rank_sample(r * dp + d, r, timings, signature, ep))
    return check_estimate(step, samples, pp)


def test_noise_is_no_straggler_and_a_slow_rank_is_found_within_the_window():
    rng = random.Random(0)
    threshold, checks = 1.15, 3
    window = StragglerWindow(checks)
    for i in range(20):  # noise only: every estimate stays well below the threshold
        c = _check(i, rng)
        assert all(0.85 < s < 1.1 for s in c.rank_slowdown), c
        window = window.add(c)
        assert window.estimate().slowest < threshold
    assert window.full and len(window.entries) == checks
    # replica 1 of pipeline rank 2 computes 1.3x slower from now on: the stage's slowdown is its slowest replica's
    found = None
    for i in range(20, 30):
        window = window.add(_check(i, rng, slow=(2, 1, 1.3)))
        est = window.estimate()
        assert max(s for r, s in enumerate(est.rank_slowdown) if r != 2) < threshold  # no other rank is blamed
        if found is None and est.rank_slowdown[2] >= threshold:
            found = i - 20 + 1  # checks since the onset
    assert found == 2  # the median of three flips with the second slow check: within `checks`
    assert est.rank_slowdown[2] == pytest.approx(1.3, abs=0.05) and est.checks == checks
    assert est.slowdown().rank_slowdown == est.rank_slowdown  # what the re-plan and slowdown.json take


def test_only_tasks_that_wait_on_nothing_are_compared_with_expert_parallelism():
    rng = random.Random(1)
    # all-to-all waits land inside rank 0's F and B tasks: a straggler at ep=1 (every task
    # compared), nothing at ep=2 (only W, shared, embedding and head compared)
    at_ep1 = _check(1, rng, late=(0, 3.0))
    at_ep2 = _check(1, rng, ep=2, late=(0, 3.0))
    assert at_ep1.rank_slowdown[0] > 1.15 and at_ep2.rank_slowdown[0] < 1.1
    assert comparable("W.L3.expert", 2) and comparable("F.L3.shared", 2) and not comparable("F.L3.expert", 2)
    assert comparable("F.L3.expert", 1) and not comparable("F.L3.dispatch", 1) and not comparable("B.L3.combine", 1)
    # a rank that shares no item with another rank has no estimate
    lone = check_estimate(3, [RankSample(0, 0, (("F.DE.mixer", 2.0),)), RankSample(1, 1, (("F.AE.mixer", 3.0),))], 2)
    assert lone.rank_slowdown == (None, None) and lone.slowest is None


def test_routing_skew_is_the_busiest_ep_rank_over_the_mean_per_row():
    assert ep_block_counts([1, 2, 3, 4], 2) == (3, 7) and ep_block_counts([5, 5], 1) == (10,)
    with pytest.raises(ValueError, match="3 experts cannot be split over ep=2"):
        ep_block_counts([1, 2, 3], 2)
    rows = [[30, 10], [20, 20], [0, 0]]  # the empty row is skipped
    assert route_stats(rows) == (2, pytest.approx(1.5 + 1.0), (50.0, 30.0))
    rows_b = [[15, 15]]  # another pipeline rank's EP group
    # both members of each EP group report the same rows: counted twice, nothing changes
    samples = [rank_sample(w, w // 2, (), {}, 2, rows if w < 2 else rows_b) for w in range(4)]
    c = check_estimate(7, samples, 2)
    assert c.routing_skew == pytest.approx((2.5 * 2 + 1.0 * 2) / 6)
    assert c.ep_load == pytest.approx((130 / 110, 90 / 110))  # every row twice: (50+15, 30+15) over their mean
    rec = c.metrics()
    assert rec == {"rank_slowdown": [None, None], "rank_slowdown_max": None, "routing_skew": c.routing_skew,
                   "ep_load": list(c.ep_load)}
    assert CheckEstimate.from_metrics(dict(rec, step=7)) == c and CheckEstimate.from_metrics({"step": 8}) is None
    assert RankSample.from_dict(json.loads(json.dumps(samples[0].to_dict()))) == samples[0]
    est = StragglerWindow(3).add(c).estimate()
    assert est.rank_slowdown == (1.0, 1.0) and est.ep_slowdown == pytest.approx(c.ep_load)


# --------------------------------------------------------------------------- decisions


def test_conditions_move_past_a_threshold_either_way():
    planned = Conditions((1.0, 1.3), (), 1.0)
    assert moved(Conditions((1.05, 1.25), (), 1.1), planned, 1.15, 1.3) == ()
    assert moved(Conditions((1.2, 1.3), (), 1.0), planned, 1.15, 1.3) == ("rank 0 slowdown 1.20 (plan made for 1.00)",)
    # the slow rank recovered: its plan no longer fits either
    assert moved(Conditions((1.0, 1.0), (), 1.4), planned, 1.15, 1.3) == (
        "rank 1 slowdown 1.00 (plan made for 1.30)", "routing skew 1.40 (plan made for 1.00)")
    assert Conditions((1.02, 1.49)).key() == Conditions((0.98, 1.51)).key() == ((1.0, 1.5), (), 1.0)
    assert Conditions.from_dict(planned.to_dict()) == planned
    recipe = load_recipe(TINY, PP2 + ["planner.rank_slowdown=[1.0,1.3]", "dbo.skew_target=1.2"])
    assert Conditions.of_recipe(recipe) == Conditions((1.0, 1.3), (), 1.2)
    assert Conditions.of_recipe(load_recipe(TINY, PP2)) == Conditions.nominal(2)


def test_a_switch_needs_a_gain_above_the_margin_and_no_rollback_before():
    cur = Option("running", "a", 100.0, False)
    fast, slow = Option("replan", "b", 90.0, False), Option("dbo_on", "c", 97.0, True)
    d = choose(cur, [fast, slow], 0.05)
    assert (d.action, d.option, d.gain) == ("switch", fast, pytest.approx(0.1))
    assert d.to_dict()["options"][0] == {"name": "running", "sha256": "a", "predicted_ms": 100.0, "dbo": False}
    keep = choose(cur, [slow], 0.05)
    assert keep.action == "keep" and keep.option == slow and "+3.0%" in keep.reason
    cond = Conditions((1.5, 1.0))
    again = choose(cur, [fast], 0.05, frozenset({("b", cond.key())}), cond)
    assert again.action == "keep" and again.reason == "rolled back before under these conditions"
    other = choose(cur, [fast], 0.05, frozenset({("b", Conditions((1.0, 1.5)).key())}), cond)
    assert other.action == "switch"  # rolled back under other conditions only
    same = choose(cur, [Option("replan", "a", 80.0, False)], 0.05)
    assert same.action == "keep" and same.reason == "no other plan"
    assert choose(cur, [Option("replan", "b", math.inf, False)], 0.0).action == "keep"


def test_the_gate_holds_back_during_verification_hold_off_and_past_the_hourly_cap():
    s = AutopilotState(True, Conditions.nominal(2))
    assert gate(s, 10, 1000.0, 20, 4) is None
    assert gate(AutopilotState(False, s.planned), 10, 1000.0, 20, 4) == "autopilot off"
    held = AutopilotState(True, s.planned, last_decision_step=10)
    assert gate(held, 29, 1000.0, 20, 4).startswith("hold-off until step 30") and gate(held, 30, 1000.0, 20, 4) is None
    busy = AutopilotState(True, s.planned, switch_times=(0.0, 500.0, 900.0, 950.0))
    assert "4 switches in the last hour" in gate(busy, 100, 1000.0, 0, 4)
    assert gate(busy, 100, 3700.0, 0, 4) is None  # the first two are more than an hour old
    p = Pending(3, 2, 5, 8, 0.9, (1.0,), ("x", ()), s.planned, s.planned)
    assert gate(AutopilotState(True, s.planned, pending=p), 100, 1000.0, 0, 4) == "verifying version 3"


def test_verification_rolls_back_only_what_is_slower_beyond_noise():
    rng = random.Random(2)
    before = [100 * math.exp(rng.gauss(0, 0.02)) for _ in range(10)]
    same = [100 * math.exp(rng.gauss(0, 0.02)) for _ in range(10)]
    assert verify(1, before, same, 0.9).action == "keep"  # noise
    v = verify(1, before, [x * 1.1 for x in same], 0.9)
    assert v.action == "rollback" and v.measured_ratio > 1 + v.tolerance and v.predicted_ratio == 0.9
    faster = verify(1, before, [x * 0.85 for x in same], 0.9)
    assert faster.action == "keep" and faster.to_dict()["measured_gain"] == pytest.approx(1 - faster.measured_ratio)
    # the tolerance: three standard errors of the difference of two medians, at least 1 %
    assert tolerance([100.0] * 5, 5) == 0.01 and tolerance([100.0], 5) == 0.01
    spread = [90.0, 95.0, 100.0, 105.0, 110.0]
    assert tolerance(spread, 5) == pytest.approx(3 * 1.2533 * 1.4826 * 0.05 * math.sqrt(2 / 5))
    with pytest.raises(ValueError):
        verify(1, [], [1.0], 1.0)


def test_wandb_gets_per_rank_numbers_and_the_autopilot_events():
    from tessera.train.worker.metrics import IterationMetrics, wandb_fields

    it = IterationMetrics(step=10, loss=2.0, tokens=8, tokens_per_s=1.0, iteration_ms=5.0, mfu=0.1, bubble_ratio=0.2,
                          bubble_fill_rate=0.0, exposed_a2a_ms=None, plan_version=0, data_position=0, time=7.0,
                          **CheckEstimate(10, (1.0, 1.31), 1.2, (1.1, 0.9)).metrics()).to_dict()
    got = wandb_fields(it)
    assert got["rank_slowdown/1"] == 1.31 and got["rank_slowdown_max"] == 1.31 and got["ep_load/0"] == 1.1
    assert got["routing_skew"] == 1.2 and "rank_slowdown" not in got and "step" not in got and got["time"] == 7.0
    event = {"event": "autopilot_decision", "action": "switch", "switch": True, "predicted_gain": 0.12, "step": 10,
             "options": [{"name": "replan"}], "time": 7.0, "conditions": {"rank_slowdown": [1.5]}}
    assert wandb_fields(event) == {"autopilot_decision/switch": True, "autopilot_decision/predicted_gain": 0.12}


# --------------------------------------------------------------------------- controls


@pytest.mark.parametrize("override, start", [
    ("autopilot.slowdown_threshold=1.0", "autopilot.slowdown_threshold=1.0: must be a finite number > 1"),
    ("autopilot.skew_threshold=0.5", "autopilot.skew_threshold=0.5: must be a finite number > 1"),
    ("autopilot.margin=1.0", "autopilot.margin=1.0: must be in [0, 1)"),
    ("autopilot.holdoff_steps=-1", "autopilot.holdoff_steps=-1: must be >= 0"),
    ("autopilot.checks=0", "autopilot.checks=0: must be >= 1"),
    ("autopilot.verify_steps=0", "autopilot.verify_steps=0: must be >= 1"),
    ("autopilot.max_switches_per_hour=-2", "autopilot.max_switches_per_hour=-2: must be >= 0"),
    ("autopilot.replan_time_s=0", "autopilot.replan_time_s=0.0: must be a finite number > 0 seconds"),
    ("profile.check_every=0", "profile.check_every=0: must be > 0 with autopilot.enabled=true"),
])
def test_bad_autopilot_values_are_one_line_errors(override, start):
    from tessera.flow import resolve

    with pytest.raises(TesseraConfigError) as e:
        resolve(load_recipe(TINY, PP2 + ["autopilot.enabled=true", override]))
    msg = str(e.value)
    assert msg.startswith(start) and "; fix: " in msg and "\n" not in msg


def test_every_autopilot_field_has_a_recipes_md_row_and_the_slow_hook_parses():
    import dataclasses

    from tessera.config.schema import AutopilotConfig
    from tessera.testing.slow import SlowRank, slow_rank
    from tessera.train.worker.hooks import HookSpec, hooks_from_env, resolve_hooks

    doc = (ROOT / "docs" / "recipes.md").read_text()
    section = doc.split("## `autopilot`", 1)[1].split("\n## ", 1)[0]
    for f in dataclasses.fields(AutopilotConfig):
        assert f"| `{f.name}` | `{str(f.default).lower() if isinstance(f.default, bool) else f.default}` |" in section
    specs = hooks_from_env({"TESSERA_SLOW_RANK": "1:20:1.3"})
    assert specs == (HookSpec("tessera.testing.slow:slow_rank", {"text": "1:20:1.3"}, "TESSERA_SLOW_RANK"),)
    assert resolve_hooks(specs) == (SlowRank(1, 20, 1.3),)
    for bad in ("1:20", "a:b:c", "1:0:1.3", "1:5:0.5"):
        with pytest.raises(TesseraConfigError, match=r"^TESSERA_SLOW_RANK=.*; fix: e\.g\. TESSERA_SLOW_RANK=1:20:1\.3"):
            slow_rank(bad)


# --------------------------------------------------------------------------- the driver


def _driver(run_dir, extra=()):
    from tessera.train.job.driver import Driver

    d = Driver(load_recipe(TINY, PP2 + AUTO + list(extra)).to_dict(), str(run_dir), "r")
    assert d.error is None, d.error
    return d


def _report(d, step: int, ms: float, slow=(1.0, 1.0)) -> None:
    """Rank 0's report of ``step``; every 5th step is a check (on the profiling engine: 3x slower,
    which verification must leave out)."""
    m = {"iteration_ms": ms, "loss": 2.0, "plan_switch_from": None}
    if step % 5 == 0:
        m.update(iteration_ms=3 * ms, rank_slowdown=list(slow), rank_slowdown_max=max(slow), routing_skew=None,
                 ep_load=None)
    d.report(0, step, m)


def _events(d, name):
    return [r for r in d.records if r.get("event") == name]


def _stages_on(plan: dict, rank: int) -> int:
    """Decoder layers pipeline rank ``rank`` holds (stage s runs on rank s % pp)."""
    b = plan["partition"]["bounds"]
    return sum(max(0, min(b[s + 1], LAYERS) - max(b[s], 0)) for s in range(len(b) - 1) if s % plan["pp"] == rank)


def test_a_slow_rank_is_replanned_switched_verified_and_noise_switches_nothing(tmp_path):
    from tessera.cli.status import summary_rows
    from tessera.cost.slowdown import read_slowdown

    d = _driver(tmp_path / "run")
    rng = random.Random(3)
    for step in range(1, 21):  # noise: estimates, no decision
        _report(d, step, 100 * math.exp(rng.gauss(0, 0.02)), (1.0 + rng.uniform(0, 0.04), 1.0 + rng.uniform(0, 0.04)))
    est = _events(d, "autopilot_estimate")
    assert [e["step"] for e in est] == [5, 10, 15, 20] and [e["full"] for e in est] == [False, False, True, True]
    assert _events(d, "autopilot_decision") == [] and len(d.history.versions) == 1
    written = read_slowdown(str(tmp_path / "run" / "slowdown.json"))
    assert written.rank_slowdown == tuple(est[-1]["rank_slowdown"]) and written.ep_slowdown == ()
    # pipeline rank 0 turns 1.5x slow: its checks say so, its iterations take longer
    for step in range(21, 31):
        _report(d, step, 130.0, (1.5, 1.0))
    assert d.autopilot_status()["replanning"]  # the second slow check: the median moved, off the report path
    decision = d.autopilot_join(120)
    assert decision == _events(d, "autopilot_decision")[-1] and decision["action"] == "switch"
    assert decision["trigger"] == ["rank 0 slowdown 1.50 (plan made for 1.00)"] and decision["step"] == 30
    assert decision["conditions"]["rank_slowdown"] == [1.5, 1.0] and decision["option"] == "replan"
    opts = {o["name"]: o for o in decision["options"]}
    assert decision["predicted_gain"] == pytest.approx(1 - opts["replan"]["predicted_ms"] / opts["running"]["predicted_ms"])
    assert decision["predicted_gain"] > 0.05  # above autopilot.margin
    v1 = d.history.at(1)
    assert v1.source == "autopilot" and v1.sha256 == decision["sha256"] and decision["plan_version"] == 1
    assert _stages_on(v1.plan, 0) < _stages_on(d.history.at(0).plan, 0)  # work moved off the slow rank
    pending = d.autopilot.pending
    assert pending.before_ms == (130.0,) * 4  # ordinary iterations only (no check step, no noise phase)
    assert pending.predicted_ratio == pytest.approx(1 - decision["predicted_gain"])
    # the workers switch at the announced step; the new plan runs faster: kept
    eff = decision["effective_step"]
    for step in range(31, eff):
        _report(d, step, 130.0, (1.5, 1.0))
    d.confirm_version(1, eff, {"from": 0, "moved_bytes": 10, "switch_s": 0.1})
    _report(d, eff, 500.0)  # the switch's own iteration is left out
    step = eff
    while not _events(d, "autopilot_verify"):
        step += 1
        _report(d, step, 115.0, (1.5, 1.0))
    (v,) = _events(d, "autopilot_verify")
    assert v["action"] == "keep" and v["plan_version"] == 1 and v["measured_ratio"] == pytest.approx(115 / 130)
    assert v["after_ms"] == 115.0 and d.autopilot.pending is None and len(d.history.versions) == 2
    st = d.status()["autopilot"]
    assert (st["enabled"], st["switches"], st["rollbacks"], st["last_verdict"]["action"]) == (True, 1, 0, "keep")
    rows = dict(summary_rows(d.status()))
    assert rows["autopilot"] == "on: 1 switch, 0 rollbacks"
    assert rows["autopilot saw"].startswith(f"step {st['estimate']['step']}: rank slowdown 1.50 1.00")
    assert rows["autopilot did"].startswith("step 30: switch to v1 (replan, predicted -")
    # tessera upgrade --autopilot off|on: recorded; the same twice is refused in one line
    assert d.set_autopilot(False) == {"enabled": False, "step": step}
    with pytest.raises(UpgradeRefused, match=r"^autopilot='off': is already off; fix: nothing to do$"):
        d.set_autopilot(False)
    assert d.set_autopilot(True)["enabled"]
    assert [e["enabled"] for e in _events(d, "autopilot_toggled")] == [False, True]
    assert _events(d, "plan_refused")[-1]["request"] == "set_autopilot"


def test_a_switch_that_made_the_job_slower_is_rolled_back_and_not_tried_again(tmp_path, monkeypatch):
    import tessera.train.job.driver as driver_mod

    d = _driver(tmp_path / "run")
    with pytest.raises(UpgradeRefused, match="is already on"):
        d.set_autopilot(True)
    for step in range(1, 16):
        _report(d, step, 130.0, (1.5, 1.0))
    first = d.autopilot_join(120)
    assert first["action"] == "switch" and first["step"] == 15
    eff = first["effective_step"]
    for step in range(16, eff):
        _report(d, step, 130.0, (1.5, 1.0))
    d.confirm_version(1, eff, {"from": 0, "moved_bytes": 10, "switch_s": 0.1})
    step = eff
    while not _events(d, "autopilot_verify"):  # slower than before, beyond the (zero) noise
        step += 1
        _report(d, step, 140.0, (1.5, 1.0))
    (v,) = _events(d, "autopilot_verify")
    assert v["action"] == "rollback" and v["measured_ratio"] == pytest.approx(140 / 130) and v["rollback"]
    back = d.history.at(v["rollback_version"])
    assert back.source == "rollback" and back.rollback_of == 0 and back.plan == d.history.at(0).plan
    assert d.autopilot.rejected == {(first["sha256"], Conditions((1.5, 1.0)).key())}
    # the same conditions: held back first (a skip, recorded), then re-planned to the same plan,
    # which is not tried again
    def decided():
        return [e for e in _events(d, "autopilot_decision") if e["action"] != "skip"]

    while len(decided()) == 1:
        step += 1
        _report(d, step, 130.0, (1.5, 1.0))
        d.autopilot_join(120)
    skips = [e for e in _events(d, "autopilot_decision") if e["action"] == "skip"]
    assert skips and all(e["reason"].startswith("hold-off until step ") for e in skips)
    again = decided()[-1]
    assert again["action"] == "keep" and again["reason"] == "rolled back before under these conditions"
    assert len(d.history.versions) == 3 and d.status()["autopilot"]["rollbacks"] == 1
    # a restarted driver remembers what was rolled back (from its records)
    monkeypatch.setattr(driver_mod, "_actor_restarted", lambda: True)
    restarted = _driver(tmp_path / "run")
    assert restarted.autopilot.rejected == d.autopilot.rejected
    assert (restarted.autopilot.switches, restarted.autopilot.rollbacks) == (1, 1)


def test_with_expert_parallelism_and_skew_the_bubble_optimizer_is_an_option():
    """Under a measured routing skew (ep=2) every option is simulated with the bubble optimizer's
    simulator on counts of that skew: the running plan, the re-plan and the running plan with the
    optimizer on (W split off B, as ``upgrade_dbo`` does); without skew only the re-plan, which
    under nominal conditions is the running plan itself."""
    from tessera.flow import build_costs, compile_programs, plan_programs, resolve
    from tessera.program.plan import Plan
    from tessera.sim.simulator import simulated_iteration_ms
    from tessera.train.job.autopilot import evaluate_options, scaled_recipe

    recipe = load_recipe(TINY, ["parallel.pp=2", "parallel.vpp=1", "parallel.dp=2", "parallel.ep=2",
                                "planner.template=1f1b", "parallel.num_microbatches=2", "parallel.seq_length=16",
                                "logging.wandb_mode=disabled"])
    plan = plan_programs(recipe)[0].to_dict()
    assert not plan["split_w"]  # the planner keeps W inside B here (cpu preset)
    skewed = evaluate_options(recipe, plan, False, Conditions((1.0, 1.0), (1.2, 0.8), 1.6))
    assert [o.name for o in skewed.options] == ["replan", "dbo_on"] and skewed.notes == ()
    on = skewed.options[1]
    assert on.dbo and on.plan["split_w"] and on.plan["partition"] == plan["partition"]
    nominal = evaluate_options(recipe, plan, False, Conditions((1.0, 1.0)))
    (replan,) = nominal.options
    assert replan.sha256 == nominal.current.sha256  # the planner reproduces the running plan
    costs = build_costs(resolve(scaled_recipe(recipe, Conditions((1.0, 1.0)), False)))
    assert nominal.current.predicted_ms == simulated_iteration_ms(compile_programs(Plan.from_dict(plan)), costs)
    # the skew (and the busiest EP rank's factor) cost time; every option is runnable
    assert skewed.current.predicted_ms > nominal.current.predicted_ms
    assert all(0 < o.predicted_ms < math.inf for o in (skewed.current, *skewed.options))


# --------------------------------------------------------------------------- a real Ray Train job

JOB_STEPS = 12
SLOW = "2:3:2.0"  # world rank 2 (pipeline rank 0 of replica 1) computes twice as long from step 3 on
JOIN = [[s, "autopilot_join", 120] for s in range(2, JOB_STEPS)]  # a re-plan is decided at the step it started
LIVE = ("parallel.seq_length=32", "job.cpus_per_worker=0.25", "job.max_failures=0", "job.pg_timeout_s=120",
        "logging.wandb_mode=disabled", f"train.steps={JOB_STEPS}", f"train.checkpoint_every={JOB_STEPS}")
AUTO_JOB = ("autopilot.enabled=true", "profile.check_every=2", "autopilot.checks=3", "autopilot.holdoff_steps=0",
            "autopilot.verify_steps=100")  # no verdict within the job: the switch stays


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _units_on(plan: dict, rank: int) -> int:
    """Extended layers (decoder layers, the embedding, the head) pipeline rank ``rank`` holds."""
    b = plan["partition"]["bounds"]
    return sum(b[s + 1] - b[s] for s in range(len(b) - 1) if s % plan["pp"] == rank)


@pytest.fixture(scope="module")
def autopilot_job(ray_cluster, tmp_path_factory):
    """The tiny recipe (4 gloo workers, pp=2 x dp=2, ep=2; 32-token sequences) as a Ray Train job
    with the autopilot on and world rank 2 slowed by the test hook (``TESSERA_SLOW_RANK``), then
    the same recipe without the autopilot on the job's worker loop on local gloo ranks
    (tests/local_job.py), its driver given the autopilot's plan by hand (``upgrade_plan``) for
    the step the autopilot's switch took effect."""
    from local_job import run_local_job
    from tessera.train.job.driver import Driver
    from tessera.train.job.run import run_job
    from tessera.train.upgrade.versions import load_history
    from tessera.train.worker.hooks import HookSpec

    out = tmp_path_factory.mktemp("autopilot")
    base = load_recipe(TINY, [*LIVE, f"logging.out_dir={out}"])
    live = run_job(base.with_overrides([*AUTO_JOB, "job.run_name=auto"]), progress=False,
                   hooks=(HookSpec("tessera.testing.slow:slow_rank", {"text": SLOW}),
                          HookSpec("tessera.testing.upgrades:requests_at", {"actions": JOIN})))
    records = _jsonl(live.metrics_path)
    history = load_history(live.run_dir)
    switches = [r for r in records if r.get("event") == "plan_switch"]
    at = switches[0]["step"] if switches else JOB_STEPS
    hand_dir = str(out / "hand")
    hand = base.with_overrides(["job.run_name=hand", f"job.upgrade_lead_steps={max(1, at - 1)}"])
    driver = Driver(hand.to_dict(), hand_dir, "hand", plan_dict=history.at(0).plan)
    answer = driver.upgrade_plan(json.dumps(history.versions[-1].plan))
    ranks: list[dict] = []
    rows = run_local_job(hand, hand_dir, driver, out=ranks)
    return {"live": live, "records": records, "history": history, "switches": switches,
            "hand": {"rows": rows, "run_dir": hand_dir, "answer": answer, "ranks": ranks}}


@pytest.mark.xdist_group("ray-autopilot")  # on the run's shared Ray head (tests/conftest.py)
def test_in_a_ray_job_the_autopilot_moves_layers_off_the_slow_rank(autopilot_job):
    records, history = autopilot_job["records"], autopilot_job["history"]
    rows = [r for r in records if "event" not in r]
    checks = [r for r in rows if r.get("rank_slowdown") is not None]
    assert [r["step"] for r in checks] == list(range(2, JOB_STEPS + 1, 2))  # every profile.check_every steps
    decisions = [r for r in records if r.get("event") == "autopilot_decision" and r["action"] != "skip"]
    (switch,) = decisions  # one decision: the switch (no verdict within the job: verify_steps=100)
    assert switch["action"] == "switch" and switch["option"] == "replan" and switch["predicted_gain"] > 0.05
    assert switch["trigger"] and all(t.startswith("rank 0 slowdown") for t in switch["trigger"])
    slow = switch["conditions"]["rank_slowdown"]
    assert slow[0] >= 1.15 > slow[1]  # pipeline rank 0 (world ranks 0 and 2) is the straggler, rank 1 is not
    started = switch["started_step"]
    assert started >= 4 and started % 2 == 0 and switch["step"] == started  # decided at the check it started at
    assert switch["effective_step"] == started + 3  # announced job.upgrade_lead_steps (2) after the running one
    assert [v.source for v in history.versions] == ["initial", "autopilot"] and all(v.applied for v in history.versions)
    v0, v1 = history.at(0).plan, history.at(1).plan
    assert history.at(1).sha256 == switch["sha256"] and history.at(1).effective_step == switch["effective_step"]
    assert _units_on(v1, 0) < _units_on(v0, 0)  # layers (or the embedding) moved off the slow pipeline rank
    (sw,) = autopilot_job["switches"]
    assert (sw["step"], sw["from_version"], sw["plan_version"]) == (switch["effective_step"], 0, 1)
    assert sw["moved_bytes"] > 0
    assert [r["plan_version"] for r in rows] == [0] * (sw["step"] - 1) + [1] * (JOB_STEPS - sw["step"] + 1)
    estimates = [r for r in records if r.get("event") == "autopilot_estimate"]
    assert [e["step"] for e in estimates] == [r["step"] for r in checks]
    assert Path(autopilot_job["live"].run_dir, "slowdown.json").exists()


@pytest.mark.xdist_group("ray-autopilot")
def test_the_autopilot_switch_loses_no_step_and_trains_as_the_same_switch_by_hand(autopilot_job):
    """Every step once, in order, data positions continuing, and the losses and the final
    parameters and optimizer state bitwise those of the run switched by hand at the same step
    (check steps run on the profiling engine, the slowed rank sleeps: neither changes a value)."""
    from local_job import assert_parts_equal

    from tessera.train.worker import checkpoint as ckpt

    live = [r for r in autopilot_job["records"] if "event" not in r]
    hand = autopilot_job["hand"]
    at = autopilot_job["switches"][0]["step"]
    assert hand["answer"] == {"version": 1, "effective_step": at}
    assert [r["confirmed"] for r in hand["ranks"]][0] == [[1, at]]
    global_batch = 2 * 4 * 2  # dp * num_microbatches * micro_batch_size
    for rows in (live, hand["rows"]):
        assert [r["step"] for r in rows] == list(range(1, JOB_STEPS + 1))
        assert [r["data_position"] for r in rows] == [global_batch * k for k in range(JOB_STEPS)]
        assert [r["plan_version"] for r in rows] == [0] * (at - 1) + [1] * (JOB_STEPS - at + 1)
    assert all(math.isfinite(r["loss"]) for r in live)
    assert [r["loss"] for r in live] == [r["loss"] for r in hand["rows"]]
    a, b = ckpt.latest_complete(autopilot_job["live"].run_dir), ckpt.latest_complete(hand["run_dir"])
    assert a.step == b.step == JOB_STEPS
    assert_parts_equal(a.path, b.path, 4)
