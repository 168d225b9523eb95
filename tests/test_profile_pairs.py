"""Candidate F&B pairs in a profile: which pairs are timed, timing them with the engine's pair
code, the planner pricing candidate pairs with their measured times, and the calibration scales
that tune the analytic model for items the profile lacks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.config.load import load_recipe
from tessera.cost.profile_costs import (CALIB_PREFIX, PAIR_WITH_W_ITEM, item_kind, pair_item, profiled_costs,
                                        task_signatures)
from tessera.flow import build_costs, compile_programs, plan_recipe, resolve
from tessera.plan.pair_cost import best_pair
from tessera.plan.pair_scheduler import schedule_pair
from tessera.train.profile.fit import analytic_medians, calibration, calibration_scales
from tessera.train.profile.pairs import PairSpec, candidate_pair_specs, candidate_pairs

pytestmark = pytest.mark.xdist_group("profile_pairs")  # module fixtures built once (tests/conftest.py)

TINY = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-qwen3-next.yaml")
FAST = ["planner.search_time_s=1", "planner.objective=bottleneck", "planner.candidate_radius=1",
        "planner.overlap=true", "planner.split_w=true"]  # fixed: the pairs are what these tests price


@pytest.fixture(scope="module")
def tiny():
    """The tiny recipe planned on the analytic costs (bottleneck objective: no simulated search)."""
    recipe = load_recipe(TINY, FAST)
    res = resolve(recipe)
    costs = build_costs(res)
    return recipe, res, costs, plan_recipe(res, costs)


def test_every_candidate_pair_has_one_spec_per_signature(tiny):
    """The specs cover the pair item of every candidate pair the planner costed, once each, in the
    order the planner stores (the pair scheduler's, or back to back)."""
    from tessera.plan.overlap_graph import distinct_pairs, overlap_edges
    from tessera.plan.planner import candidate_ranges

    recipe, res, costs, report = tiny
    specs = candidate_pair_specs(costs, report)
    t = report.tessera
    cands = candidate_ranges(report.baseline.partition, report.radius, len(costs.layers), report.alone)
    edges = overlap_edges(t.template, t.pp, t.vpp, t.num_microbatches)
    assert len(distinct_pairs(costs, cands, edges)) == report.pairs_distinct  # the planner's own candidates
    every = {pair_item(costs, cf.range, cb.range) for e in edges
             for cf in cands[e.f_stage] for cb in cands[e.b_stage] if e.f_stage != e.b_stage or cf == cb}
    assert {s.item for s in specs} == every and len(specs) == len(every)
    assert len(specs) <= report.pairs_distinct <= report.pairs_total
    s = specs[0]
    ch = best_pair(costs, s.f_range, s.b_range, report.with_w, schedule_pair)
    assert (s.order, s.overlapped) == (ch.pair_order(0, 0, report.with_w).order, ch.overlapped)
    assert PairSpec.from_dict(s.to_dict()) == s


def test_a_measured_pair_prices_the_pair(tiny):
    """best_pair costs a pair at its measured time when the costs have one for its with_w."""
    recipe, res, costs, report = tiny
    item, (f, b) = next(iter(candidate_pairs(costs, report).items()))
    w = report.with_w
    composed = best_pair(costs, f, b, w, schedule_pair)
    got = best_pair(replace(costs, measured_pairs=((item, w, 123.0),)), f, b, w, schedule_pair)
    assert got.measured and got.makespan_ms == 123.0 and not composed.measured
    other = best_pair(replace(costs, measured_pairs=((item, not w, 123.0),)), f, b, w, schedule_pair)
    assert other.makespan_ms == composed.makespan_ms  # timed with another with_w: not used


def _write_profile(recipe, res, costs, pair_ms: dict[str, float], with_w: bool) -> None:
    """A profile of the recipe: every task at its analytic median and the given pair times."""
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache, ProfileItem

    vals = {**analytic_medians(costs), **pair_ms, "p2p": costs.p2p_ms, PAIR_WITH_W_ITEM: 1.0 if with_w else 0.0}
    ProfileCache(profile_cache_path(recipe)).put(profile_fingerprint(recipe, res.model, res.hardware),
                                                 [ProfileItem(k, v, v, v, 1, 0) for k, v in vals.items()])


def test_an_inflated_pair_item_moves_the_plan(tiny, tmp_path):
    """Planning on a profile (planner.cost_source=profile) uses the measured candidate pair times:
    with every pair at its composed time the plan is the analytic one; with the pair item of the
    plan's bottleneck edge made 50x larger the planner reports that cost or avoids the pair."""
    from tessera.cli.plan import cost_source_line

    recipe, res, costs, report = tiny
    pairs = candidate_pairs(costs, report)
    composed = {k: best_pair(costs, f, b, report.with_w, schedule_pair).makespan_ms for k, (f, b) in pairs.items()}
    prof = recipe.with_overrides([f"logging.out_dir={tmp_path}", "planner.cost_source=profile"])
    _write_profile(prof, res, costs, composed, report.with_w)
    pres = resolve(prof)
    pcosts = build_costs(pres)
    assert len(pcosts.measured_pairs) == len(pairs)
    same = plan_recipe(pres, pcosts)
    assert same.tessera.partition == report.tessera.partition
    line = cost_source_line(pres, pcosts, same)
    assert line.startswith("profile: ") and "0 fell back" in line and f"{len(pairs)} of {len(pairs)} measured" in line

    worst = max(same.tessera_edges, key=lambda e: e.ms)
    part = same.tessera.partition
    item = pair_item(costs, part.stage_range(worst.f_stage), part.stage_range(worst.b_stage))
    big = 50 * composed[item]
    _write_profile(prof, res, costs, {**composed, item: big}, report.with_w)
    moved = plan_recipe(pres, build_costs(pres))
    formed = {pair_item(costs, moved.tessera.partition.stage_range(e.f_stage),
                        moved.tessera.partition.stage_range(e.b_stage)) for e in moved.tessera_edges}
    if moved.tessera.partition == part:
        assert moved.tessera_bottleneck_ms == pytest.approx(big)  # the reported pair cost is the measured one
    else:
        assert item not in formed and moved.tessera_bottleneck_ms < big
    assert moved.tessera.partition != part  # the tiny model has partitions without that pair


def test_candidate_pairs_run_on_the_engines_pair_code(tiny):
    """time_candidate_pairs builds the chunks, runs F of one microbatch and B of another in the
    spec's order (one process, experts local) and stops when the budget says so."""
    from tessera.config.resolve import resolve_model
    from tessera.train.profile.pairs import time_candidate_pairs

    recipe, res, costs, report = tiny
    specs = candidate_pair_specs(costs, report)[:3]
    one = recipe.with_overrides(["parallel.pp=1"])  # this process plays pipeline rank 0 of pp=1
    program = compile_programs(report.tessera)[0]
    loop = SimpleNamespace(recipe=one, model=resolve_model(recipe),
                           runner=SimpleNamespace(groups=None, device="cpu", program=program))
    calls, rounds = [], []
    got = time_candidate_pairs(loop, specs, warmup=1, reps=2, budget_left=lambda: calls.append(1) or len(calls) <= 2,
                               on_round=lambda d, n: rounds.append((d, n)))
    assert list(got) == [s.item for s in specs[:2]] and rounds == [(1, 3), (2, 3)]
    assert all(len(v) == 2 and min(v) > 0 for v in got.values())


def test_calibration_scale_tunes_items_the_profile_lacks(tiny):
    """Per-kind scale = median measured / analytic; the report's error drops to 0 after it for a
    kind off by a constant factor; a task whose item is missing gets analytic x its kind's scale
    and is listed as scaled."""
    recipe, res, costs, report = tiny
    an = analytic_medians(costs)
    medians = {k: v * (2.0 if item_kind(k) == "expert" else 1.0) for k, v in an.items()}
    scales = calibration_scales(costs, medians)
    assert scales["F.expert"] == pytest.approx(2.0) and scales["B.mixer"] == pytest.approx(1.0)
    cal = calibration(costs, medians)
    assert cal["expert"]["mean_err"] == pytest.approx(0.5) and cal["expert"]["mean_err_fit"] == pytest.approx(0.0)
    assert cal["mixer"]["max_err"] == pytest.approx(0.0)
    # each phase gets its own scale: forward 3x off, backward 1.5x off, both fitted exactly
    skew = {k: v * (3.0 if k.startswith("F.") else 1.5) if item_kind(k) == "mixer" else v for k, v in an.items()}
    per_phase = calibration_scales(costs, skew)
    assert per_phase["F.mixer"] == pytest.approx(3.0) and per_phase["B.mixer"] == pytest.approx(1.5)
    assert calibration(costs, skew)["mixer"]["mean_err_fit"] == pytest.approx(0.0, abs=1e-12)
    sig = task_signatures(costs)
    lost = sig["F.L0.expert"]
    prof = {k: v for k, v in medians.items() if k != lost}
    prof[f"{CALIB_PREFIX}F.expert"] = scales["F.expert"]
    got, rep = profiled_costs(costs, prof)
    i = next(j for j, t in enumerate(costs.layers[0].tasks) if t.kind.value == "expert" and t.phase.value == "F")
    assert got.layers[0].tasks[i].ms == pytest.approx(2.0 * costs.layers[0].tasks[i].ms)
    assert "F.L0.expert" in rep.fallback and "F.L0.expert" in rep.scaled
    del prof[f"{CALIB_PREFIX}F.expert"]
    got, rep = profiled_costs(costs, prof)
    assert got.layers[0].tasks[i].ms == costs.layers[0].tasks[i].ms and rep.scaled == ()


def test_a_complete_fresh_profile_needs_no_analytic_plan(tiny, tmp_path):
    """profile_complete (what a planner.cost_source=profile job asks before planning on the
    analytic costs to list what to profile): true only for a fresh profile with every task item,
    p2p and timed pairs."""
    from tessera.config.profile_rules import profile_cache_path, profile_fingerprint
    from tessera.cost.profile_cache import ProfileCache
    from tessera.train.profile.setup import profile_complete

    recipe, res, costs, report = tiny
    prof = recipe.with_overrides([f"logging.out_dir={tmp_path}", "planner.cost_source=profile"])
    assert not profile_complete(prof) and not Path(profile_cache_path(prof)).exists()  # reading made no file
    item, (f, b) = next(iter(candidate_pairs(costs, report).items()))
    _write_profile(prof, res, costs, {item: 1.0}, report.with_w)
    assert profile_complete(prof)
    cache, fp = ProfileCache(profile_cache_path(prof)), profile_fingerprint(prof, res.model, res.hardware)
    cache.mark_stale(fp, 0.5)
    assert not profile_complete(prof)
    other = prof.with_overrides([f"logging.out_dir={tmp_path / 'b'}"])
    _write_profile(other, res, costs, {}, report.with_w)  # tasks and p2p, no pair timed
    assert not profile_complete(other)
