"""Per-rank cost scales (``planner.rank_slowdown`` / ``ep_slowdown``, ``ModelCosts.rank_scale``):
what the simulator, the lower bounds, the planner and the list scheduler make of a slowed rank,
the recipe rules, and the ``slowdown.json`` file ``tessera plan --slowdown-from`` reads."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from plan_helpers import hetero_costs
from tessera.config.load import load_recipe
from tessera.cost.slowdown import SLOWDOWN_FILE, Slowdown, read_slowdown, write_slowdown
from tessera.cost.types import Resource, TaskKind
from tessera.errors import TesseraConfigError
from tessera.flow import build_baseline, build_costs, compile_programs, iteration_evaluator, plan_recipe, resolve
from tessera.program.memory import rank_memory_bytes
from tessera.sim.bound import iteration_lower_bound
from tessera.sim.simulator import _compute_dag, simulate, simulated_iteration_ms

pytestmark = pytest.mark.xdist_group("rank_slowdown")  # the module fixture built once (tests/conftest.py)

TINY = ["planner.template=interleaved-1f1b", "parallel.vpp=2", "planner.overlap=true", "planner.split_w=true"]


def _compute_ms(result, rank: int) -> float:
    return sum(e.end_ms - e.start_ms for e in result.events if e.rank == rank and e.resource == "compute")


def _comm_ms(result, rank: int) -> float:
    return sum(e.end_ms - e.start_ms for e in result.events if e.rank == rank and e.resource != "compute")


@pytest.fixture(scope="module")
def tiny():
    """The tiny recipe (pp 2, vpp 2, ep 2, dp 2, overlapped interleaved 1F1B): its costs and the
    baseline's Programs."""
    res = resolve(load_recipe(None, TINY))
    costs = build_costs(res)
    return costs, compile_programs(build_baseline(res, costs))


def test_every_rank_doubled_doubles_compute_exactly(tiny):
    costs, progs = tiny
    base = simulate(progs, costs)
    slow = simulate(progs, replace(costs, rank_scale=(2.0, 2.0)))
    for r in range(2):
        assert _compute_ms(slow, r) == pytest.approx(2 * _compute_ms(base, r), rel=1e-12)
        assert _comm_ms(slow, r) == pytest.approx(_comm_ms(base, r), rel=1e-12)  # the links are not slower
        assert slow.ranks[r].optimizer_ms == pytest.approx(2 * base.ranks[r].optimizer_ms, rel=1e-12)
    # compute-bound on the cpu preset: the iteration grows by most of the compute added
    assert base.iteration_ms * 1.5 < slow.iteration_ms <= 2 * base.iteration_ms + 1e-9
    assert simulated_iteration_ms(progs, replace(costs, rank_scale=(2.0, 2.0))) == slow.iteration_ms


def test_one_rank_slowed_costs_what_its_compute_adds(tiny):
    costs, progs = tiny
    base = simulate(progs, costs)
    scaled = replace(costs, rank_scale=(1.0, 1.3))
    slow = simulate(progs, scaled)
    assert _compute_ms(slow, 0) == pytest.approx(_compute_ms(base, 0), rel=1e-12)
    assert _compute_ms(slow, 1) == pytest.approx(1.3 * _compute_ms(base, 1), rel=1e-12)
    # the simulator runs every rank in a fixed order (max-plus): lengthening rank 1's compute by
    # 0.3 of it delays the iteration by at least nothing and at most all of it
    added = 0.3 * (_compute_ms(base, 1) + base.ranks[1].optimizer_ms)
    assert base.iteration_ms < slow.iteration_ms <= base.iteration_ms + added + 1e-9
    assert slow.iteration_ms >= slow.ranks[1].busy_ms  # the slowed rank's own work fits in it
    # the memory rule replays each FB on its rank's costs, as the simulator does
    need = rank_memory_bytes(progs, scaled)
    assert [m.peak_mem_gb for m in slow.ranks] == pytest.approx([b / 1e9 for b in need], rel=1e-12)
    print(f"\ntiny pp 2: iteration {base.iteration_ms:.4f} ms -> {slow.iteration_ms:.4f} ms with rank 1 at 1.3 "
          f"(rank 1 compute {_compute_ms(base, 1):.4f} ms, at most +{added:.4f} ms)")


@pytest.mark.parametrize("scale", [(1.0, 1.3), (1.3, 1.0), (0.7, 1.0), (2.0, 2.0)])
def test_lower_bound_stays_below_the_simulated_iteration(tiny, scale):
    costs, progs = tiny
    scaled = replace(costs, rank_scale=scale)
    lb = iteration_lower_bound(progs, scaled)
    sim = simulate(progs, scaled)
    assert 0 < lb.ms <= sim.iteration_ms * (1 + 1e-9)
    # the bound's jobs are the simulator's, on each rank's own costs
    base = iteration_lower_bound(progs, costs)
    for r, f in enumerate(scale):
        assert lb.work_ms[r] == pytest.approx(sim.ranks[r].busy_ms, rel=1e-12)
        assert (lb.work_ms[r] > base.work_ms[r], lb.work_ms[r] < base.work_ms[r]) == (f > 1, f < 1)


def test_partition_bound_with_a_faster_rank_stays_a_bound(tiny):
    from tessera.plan.partition_bound import partition_lower_bound

    costs, progs = tiny
    scaled = replace(costs, rank_scale=(0.5, 1.0))
    pb = partition_lower_bound(scaled, template="interleaved-1f1b", pp=2, vpp=2, num_microbatches=4,
                               time_limit_s=20)
    assert pb.ms <= simulate(progs, scaled).iteration_ms * (1 + 1e-9)


def test_cache_is_keyed_by_the_rank_factor(tiny):
    costs, progs = tiny
    scaled = replace(costs, rank_scale=(1.0, 1.5))
    prog = progs[0]
    i, ins = next((i, x) for i, x in enumerate(prog.instructions) if x.op.value == "FB")
    cache: dict = {}
    fast = _compute_dag(prog, ins, scaled, i, cache)[1].makespan
    slow = _compute_dag(replace(prog, rank=1), ins, scaled, i, cache)[1].makespan  # same content, rank 1
    assert fast == _compute_dag(prog, ins, costs, i, {})[1].makespan
    assert fast < slow < 1.5 * fast + 1e-9  # compute 1.5x, the pair's exposed A2A not


def test_pp1_slowed_rank_is_a_uniformly_slower_model():
    """pp 1: the one rank slowed by 1.3 is the model with every compute task (and the optimizer
    step) 1.3 times longer, built here by hand; with no communication (ep 1, dp 1) the iteration
    is exactly 1.3 times as long."""
    res = resolve(load_recipe(None, ["parallel.pp=1", "parallel.vpp=1", "parallel.ep=2", "parallel.dp=2",
                                     "planner.template=1f1b", "planner.overlap=false", "planner.split_w=true"]))
    costs = build_costs(res)
    progs = compile_programs(build_baseline(res, costs))

    def slower(lc):
        return replace(lc, tasks=tuple(replace(t, ms=t.ms * 1.3, deferred_ms=t.deferred_ms * 1.3)
                                       if t.resource == Resource.COMPUTE else t for t in lc.tasks),
                       dp=replace(lc.dp, optimizer_ms=lc.dp.optimizer_ms * 1.3))

    by_hand = replace(costs, layers=tuple(slower(lc) for lc in costs.layers), embed=slower(costs.embed),
                      head=slower(costs.head), pair_task_ms=costs.pair_task_ms * 1.3)
    assert simulate(progs, replace(costs, rank_scale=(1.3,))).iteration_ms == pytest.approx(
        simulate(progs, by_hand).iteration_ms, rel=1e-12)

    res = resolve(load_recipe(None, ["parallel.pp=1", "parallel.vpp=1", "parallel.ep=1", "parallel.dp=1",
                                     "planner.template=1f1b", "planner.overlap=false", "planner.split_w=true"]))
    costs = build_costs(res)
    progs = compile_programs(build_baseline(res, costs))
    assert simulate(progs, replace(costs, rank_scale=(1.3,))).iteration_ms == pytest.approx(
        1.3 * simulate(progs, costs).iteration_ms, rel=1e-12)


def test_ep_slowdown_scales_expert_tasks_by_the_slowest_member():
    r = load_recipe(None, TINY)
    plain = build_costs(resolve(r))
    costs = build_costs(resolve(r.with_overrides(["planner.ep_slowdown=[1.1,1.4]"])))
    assert costs.rank_scale == ()
    n = 0
    for a, b in zip(plain.layers, costs.layers):
        for ta, tb in zip(a.tasks, b.tasks):
            expert = ta.kind == TaskKind.EXPERT and ta.resource == Resource.COMPUTE
            assert tb.ms == pytest.approx(ta.ms * (1.4 if expert else 1.0), rel=1e-12)
            n += expert
    assert n > 0
    assert build_costs(resolve(r.with_overrides(["planner.rank_slowdown=[1,1.3]"]))).rank_scale == (1.0, 1.3)


def test_list_scheduler_times_scale_with_the_rank():
    """With no p2p time every decision of the list scheduler is scale-free: all ranks at 2.0 give
    the same orders and exactly twice the predicted iteration."""
    from tessera.plan.baseline import baseline_plan
    from tessera.plan.pair_scheduler import schedule_pair
    from tessera.plan.list_scheduler import list_schedule
    from tessera.plan.synthesis import policy_grid

    costs = hetero_costs("AMAMMAAMAMMA")
    plan = baseline_plan(costs, "interleaved-1f1b", 2, 2, 4, overlap=True, split_w=True)
    for pol in policy_grid(2, True, True)[:3]:
        sched, _, ms = list_schedule(costs, plan, pol, scheduler=schedule_pair)
        sched2, _, ms2 = list_schedule(replace(costs, rank_scale=(2.0, 2.0)), plan, pol, scheduler=schedule_pair)
        assert sched2 == sched and ms2 == pytest.approx(2 * ms, rel=1e-12)
        _, _, ms3 = list_schedule(replace(costs, rank_scale=(1.0, 1.5)), plan, pol, scheduler=schedule_pair)
        assert ms < ms3 <= 1.5 * ms + 1e-9


def test_milp_moves_layers_off_a_slowed_rank():
    """The bottleneck objective (the MILP alone): each edge's pair costs times its rank's factor,
    so the slowed rank gets less work; the reported edge costs carry the factor."""
    from tessera.plan.planner import _stage_ranks, make_plan

    costs = hetero_costs("AMAMMAAMAMMA")
    kw = dict(template="interleaved-1f1b", pp=2, vpp=2, num_microbatches=4, objective="bottleneck")
    plain = make_plan(costs, **kw)
    slow = make_plan(replace(costs, rank_scale=(1.0, 1.5)), **kw)
    ranks = _stage_ranks(plain.tessera)

    def work(plan, r):
        return sum(costs.serial_ms(i) for s, rk in enumerate(ranks) if rk == r
                   for i in range(*plan.partition.stage_range(s)))

    assert work(slow.tessera, 1) < work(plain.tessera, 1)
    for e in slow.baseline_edges:  # the baseline partition's pairs, as in the unscaled plan, times the factor
        same = next(x for x in plain.baseline_edges if (x.f_stage, x.b_stage) == (e.f_stage, e.b_stage))
        assert e.ms == pytest.approx(same.ms * (1.5 if e.rank == 1 else 1.0), rel=1e-12)


def test_replanning_for_a_slowed_rank_moves_work_off_it_and_is_faster():
    """Qwen3-Next-80B, pp 8 vpp 2 ep 8 dp 8, analytic costs, 8 microbatches and 150 evaluations
    (about 4 s of CPU per plan; the recipe's 16 microbatches and full budget take four times as
    long: docs/planner.md, "Slowed ranks" for their numbers): rank 3 at 1.3. The plan made for
    these costs holds less work on rank 3 than the plan made for uniform ranks, and simulated on
    the slowed costs it is faster (measured 989.9 -> 938.1 ms; rank 3 serial 83.7 -> 55.8 ms)."""
    from tessera.config.validate import capacity_gb
    from tessera.plan.planner import _stage_ranks

    r0 = load_recipe("qwen3-next-80b", ["parallel.num_microbatches=8", "planner.search_evals=150"])
    assert (r0.parallel.pp, r0.parallel.vpp, r0.parallel.ep, r0.parallel.dp) == (8, 2, 8, 8)
    r1 = r0.with_overrides(["planner.rank_slowdown=[1,1,1,1.3,1,1,1,1]"])
    res0, res1 = resolve(r0), resolve(r1)
    c0, c1 = build_costs(res0), build_costs(res1)
    uniform, replanned = plan_recipe(res0, c0), plan_recipe(res1, c1)
    on_slowed = iteration_evaluator(c1, capacity_gb(r1, res1.hardware) * 1e9)
    old_ms, new_ms = on_slowed(uniform.tessera), replanned.tessera_iteration_ms
    assert new_ms == on_slowed(replanned.tessera)
    ranks = _stage_ranks(uniform.tessera)

    def rank3_ms(plan) -> float:
        return sum(c0.serial_ms(i) for s, rk in enumerate(ranks) if rk == 3
                   for i in range(*plan.partition.stage_range(s)))

    print(f"\nqwen3-next-80b M=8, rank 3 at 1.3: uniform plan {old_ms:.1f} ms, re-planned {new_ms:.1f} ms; "
          f"rank 3 serial {rank3_ms(uniform.tessera):.1f} -> {rank3_ms(replanned.tessera):.1f} ms; partitions "
          f"{uniform.tessera.partition.sizes()} -> {replanned.tessera.partition.sizes()}")
    assert rank3_ms(replanned.tessera) < rank3_ms(uniform.tessera)
    assert new_ms < old_ms
    assert new_ms < replanned.baseline_iteration_ms  # never slower than the baseline, on the slowed costs


@pytest.mark.parametrize("override, needles", [
    ("planner.rank_slowdown=[1,1.3,1]", ["planner.rank_slowdown=[1.0, 1.3, 1.0]", "parallel.pp=2", "has 3",
                                         "fix: give 2 factors"]),
    ("planner.rank_slowdown=[1,0]", ["planner.rank_slowdown=[1.0, 0.0]", "finite number > 0", "rank 1"]),
    ("planner.ep_slowdown=[1,nan]", ["planner.ep_slowdown=[1.0, nan]", "finite number > 0"]),
    ("planner.ep_slowdown=[1]", ["planner.ep_slowdown=[1.0]", "parallel.ep=2", "has 1"]),
])
def test_bad_factors_are_one_line_errors(override, needles):
    with pytest.raises(TesseraConfigError) as e:
        resolve(load_recipe(None, TINY + [override]))
    msg = str(e.value)
    assert "\n" not in msg and "; fix: " in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_slowdown_file_round_trip(tmp_path):
    sd = Slowdown((1.0, 1.3), (1.0, 1.25))
    path = tmp_path / SLOWDOWN_FILE
    write_slowdown(str(path), sd)
    assert json.loads(path.read_text()) == {"rank_slowdown": [1.0, 1.3], "ep_slowdown": [1.0, 1.25]}
    back = read_slowdown(str(path))
    assert back == sd and back.ep_factor == 1.25
    r = load_recipe(None, TINY).with_overrides(back.as_overrides())
    assert (r.planner.rank_slowdown, r.planner.ep_slowdown) == ((1.0, 1.3), (1.0, 1.25))
    assert Slowdown.of(r.planner) == sd
    path.write_text('{"rank_slowdown": [1, 1.5]}')  # a missing key: every rank 1.0
    assert read_slowdown(str(path)) == Slowdown((1.0, 1.5), ())


@pytest.mark.parametrize("text, needle", [
    (None, "file does not exist"),
    ("{", "is not valid JSON"),
    ("[1.0]", "must hold one JSON object"),
    ('{"rank_slowdowns": [1.0]}', "unknown key 'rank_slowdowns'"),
    ('{"rank_slowdown": "1.3"}', "must be a list of numbers"),
    ('{"ep_slowdown": [1.0, -1]}', "ep_slowdown[1]=-1"),
    ('{"rank_slowdown": [NaN]}', "finite number > 0"),
])
def test_bad_slowdown_file_is_one_line_error(tmp_path, text, needle):
    path = tmp_path / SLOWDOWN_FILE
    if text is not None:
        path.write_text(text)
    with pytest.raises(TesseraConfigError) as e:
        read_slowdown(str(path))
    msg = str(e.value)
    assert msg.startswith(f"--slowdown-from={str(path)!r}: ") and "\n" not in msg and "; fix: " in msg
    assert needle in msg


def test_plan_slowdown_from_round_trip(tmp_path, capsys):
    """``tessera plan RECIPE --slowdown-from FILE``: the file's factors are the plan's recipe
    overrides (plan.json), the table says so, and its simulated iteration is the slowed one; a
    bad file is exit code 2 with one line."""
    from tessera.cli.main import main

    path = tmp_path / SLOWDOWN_FILE
    write_slowdown(str(path), Slowdown((1.0, 1.5), ()))
    args = ["plan", "--slowdown-from", str(path), "--no-progress", "--bound-time", "0", "--out", str(tmp_path / "o"),
            *TINY, "planner.search_evals=10", "planner.synthesis=false", "logging.png=false", "logging.trace=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "slowdown: rank 1 x1.5" in " ".join(out.split())
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert doc["recipe"]["planner"]["rank_slowdown"] == [1.0, 1.5]
    # the plan's simulated iteration is the slowed costs' (the recipe built from plan.json agrees)
    from tessera.config.load import recipe_from_dict
    from tessera.program.plan import Plan

    res = resolve(recipe_from_dict(doc["recipe"]))
    costs = build_costs(res)
    assert costs.rank_scale == (1.0, 1.5)
    plan = Plan.from_dict(doc["plan"])
    slowed = iteration_evaluator(costs)(plan)
    assert slowed == pytest.approx(doc["tessera"]["iteration_ms"], rel=1e-9)
    assert iteration_evaluator(replace(costs, rank_scale=()))(plan) < slowed
    assert main(["plan", "--slowdown-from", str(tmp_path / "missing.json"), "--no-progress", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--slowdown-from=" in err and "file does not exist" in err


def test_factors_must_be_positive_on_the_value_too():
    costs = hetero_costs("AM")
    with pytest.raises(ValueError, match="rank_scale"):
        replace(costs, rank_scale=(1.0, math.inf))
    with pytest.raises(ValueError, match="rank 2 has none"):
        replace(costs, rank_scale=(1.0, 1.2)).scale_of(2)
    with pytest.raises(ValueError, match="finite and > 0"):
        Slowdown((0.0,))
