"""The iteration-aware objective and the never-slower rule (tessera.plan.refine, make_plan with
``evaluate``), on the real pair scheduler and simulator."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tessera.config.load import load_recipe
from tessera.flow import build_costs, compile_programs, iteration_evaluator, plan_recipe, resolve
from tessera.plan.overlap_graph import overlap_edges
from tessera.plan.pair_scheduler import schedule_pair
from tessera.plan.planner import make_plan
from tessera.plan.refine import boundary_moves, refine, stage_serial_ms
from tessera.program.plan import Partition
from tessera.sim.simulator import simulate

from plan_helpers import hetero_costs

TINY = "recipes/tiny-qwen3-next.yaml"


def _tiny(*overrides):
    res = resolve(load_recipe(TINY, list(overrides)))
    return res, build_costs(res)


def test_boundary_moves_keep_every_stage_and_shrink_the_heavier_first():
    part = Partition((-1, 2, 4, 9))  # stages: [emb,0,1] [2,3] [4..7,head]
    moves = boundary_moves(part, 1)
    assert len(moves) == 4 and all(len(m.bounds) == 4 for m in moves)
    # no stage is left with only the embedding or the head
    assert boundary_moves(Partition((-1, 0, 4, 9)), 1) == [Partition((-1, 1, 4, 9)), Partition((-1, 0, 3, 9)),
                                                          Partition((-1, 0, 5, 9))]
    assert all(m.bounds[i] < m.bounds[i + 1] for m in moves for i in range(3))
    # the last stage is far heavier: the move that shrinks it (boundary 2 to the right) comes first
    ordered = boundary_moves(part, 1, [3.0, 2.0, 9.0])
    assert ordered[0].bounds == (-1, 2, 5, 9) and sorted(map(str, ordered)) == sorted(map(str, moves))
    # a step that would empty a stage is not offered
    assert all(m.bounds != (-1, 4, 4, 9) for m in boundary_moves(part, 2))
    # stage serial times add up to the model's
    costs = hetero_costs("AMAMAMAM")
    p8 = Partition((-1, 4, 9))
    assert sum(stage_serial_ms(costs, p8)) == pytest.approx(sum(costs.serial_ms(i) for i in range(-1, 9)))


def test_refine_never_returns_worse_than_its_best_start_and_reports_real_times():
    res, costs = _tiny()
    report = plan_recipe(res, costs)
    s = report.search
    assert report.objective == "iteration" and s is not None
    assert s.iteration_ms <= min(s.start_ms) + 1e-9
    assert s.evaluations >= len(s.start_ms)
    # the figure reported is the simulator's for the plan returned
    assert simulate(compile_programs(report.tessera), costs).iteration_ms == pytest.approx(report.tessera_iteration_ms)
    assert simulate(compile_programs(report.baseline), costs).iteration_ms == pytest.approx(report.baseline_iteration_ms)
    assert report.tessera_iteration_ms <= report.baseline_iteration_ms


def test_refine_moves_a_boundary_when_that_pays():
    # a deliberately bad start: the first stage holds almost everything
    res, costs = _tiny()
    p = res.recipe.parallel
    report = plan_recipe(res, costs)
    n = len(costs.layers)
    bad = replace(report.baseline, partition=Partition((-1, n - 3, n - 2, n - 1, n + 1)), pair_orders=())
    evaluate = iteration_evaluator(costs)
    edges = overlap_edges(bad.template, p.pp, p.vpp, p.num_microbatches)
    out = refine(costs, (bad,), evaluate, edges, True, schedule_pair, max_evals=400, time_budget_s=60)
    assert out.moves > 0 and out.iteration_ms < 0.8 * evaluate(bad)
    assert out.iteration_ms == pytest.approx(evaluate(out.plan))


def test_never_slower_falls_back_to_the_baseline_with_its_own_orders():
    res, costs = _tiny()
    p, pl = res.recipe.parallel, res.recipe.planner
    real = iteration_evaluator(costs)
    base_bounds = plan_recipe(res, costs).baseline.partition.bounds

    def baseline_wins(plan):  # every other partition is reported slower than the baseline
        ms = real(plan)
        return ms if plan.partition.bounds == base_bounds and not plan.pair_orders else ms + 1e3

    for objective in ("iteration", "bottleneck"):
        r = make_plan(costs, template=pl.template, pp=p.pp, vpp=p.vpp, num_microbatches=p.num_microbatches,
                      objective=objective, evaluate=baseline_wins, search_time_s=5)
        assert r.fallback and "baseline" in r.fallback
        assert r.tessera.partition == r.baseline.partition and r.tessera.pair_orders == r.baseline.pair_orders
        assert r.tessera_iteration_ms == r.baseline_iteration_ms == pytest.approx(real(r.baseline))


def test_bottleneck_objective_without_evaluate_is_the_papers_plan():
    res, costs = _tiny()
    p, pl = res.recipe.parallel, res.recipe.planner
    r = make_plan(costs, template=pl.template, pp=p.pp, vpp=p.vpp, num_microbatches=p.num_microbatches,
                  objective="bottleneck")
    assert r.search is None and r.baseline_iteration_ms is None and not r.fallback
    assert r.tessera_bottleneck_ms <= r.baseline_bottleneck_ms + 1e-9
    with pytest.raises(ValueError, match="objective"):
        make_plan(costs, template=pl.template, pp=p.pp, vpp=p.vpp, num_microbatches=p.num_microbatches,
                  objective="fastest")


def test_evaluator_rejects_plans_over_memory():
    res, costs = _tiny()
    plan = plan_recipe(res, costs).baseline
    assert iteration_evaluator(costs, capacity_bytes=1.0)(plan) == math.inf
    assert iteration_evaluator(costs)(plan) < math.inf


def test_auto_template_and_vpp_plan_every_layout_and_keep_the_fastest():
    from tessera.config.validate import layout_options
    from tessera.flow import simulate_recipe

    res, costs = _tiny("planner.template=auto", "parallel.vpp=auto")
    opts = layout_options(res.recipe, res.model)
    layouts = {(o.planner.template, o.parallel.vpp) for o in opts}
    # tiny preset: 8 layers over pp=2; interleaved 2..4, the fixed-vpp templates at their own vpp
    assert layouts == {("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                       ("interleaved-1f1b", 4), ("dualpipe-v", 2), ("zb-v", 2)}
    report = plan_recipe(res, costs)
    alts = report.alternatives
    assert {(a[0], a[1]) for a in alts} == layouts
    assert report.tessera_iteration_ms == pytest.approx(min(a[3] for a in alts))
    assert report.baseline_iteration_ms == pytest.approx(min(a[2] for a in alts))
    assert report.tessera_iteration_ms <= report.baseline_iteration_ms
    # the chosen plan is what the simulator says
    assert simulate(compile_programs(report.tessera), costs).iteration_ms == pytest.approx(report.tessera_iteration_ms)
    # tessera simulate with auto runs the fastest baseline
    run = simulate_recipe(res.recipe)
    assert run.result.iteration_ms == pytest.approx(report.baseline_iteration_ms)
    # without split W the zero-bubble templates are not offered
    res2, _ = _tiny("planner.template=auto", "parallel.vpp=auto", "planner.split_w=false")
    assert {o.planner.template for o in layout_options(res2.recipe, res2.model)} == {"1f1b", "interleaved-1f1b",
                                                                                   "dualpipe-v"}


def test_auto_with_no_valid_layout_is_one_error_naming_the_rule():
    from tessera.errors import TesseraConfigError

    with pytest.raises(TesseraConfigError) as e:
        _tiny("planner.template=auto", "parallel.vpp=5")
    assert "no layout of the auto template/vpp passes" in str(e.value) and "parallel.vpp" in str(e.value)
