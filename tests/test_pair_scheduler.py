"""Pair scheduler (backbone-first + gap-fit) against hand-solved cases and the exact SCIP ILP."""

from __future__ import annotations

import random

import pytest

from tessera.cost.types import LayerCost, LayerMemory, ModelCosts, Phase, Resource, TaskCost, TaskKind
from tessera.cost.uniform import uniform_costs
from tessera.plan.pair_ilp import PairILPResult, solve_pair_ilp
from tessera.plan.pair_scheduler import VARIANTS, check_schedule, schedule_pair
from tessera.sched.chunkdag import fixed_order, pair_dag
from tessera.sched.dag import Task, TaskDAG, TaskSchedule, run_in_order

C, E = Resource.COMPUTE, Resource.EP_COMM


def _dag(*specs: tuple) -> TaskDAG:
    """Tasks from (name, resource, ms, deps, movable[, deadline]) tuples; ids in order."""
    tasks = []
    for i, (name, res, ms, deps, movable, *dl) in enumerate(specs):
        phase = Phase.W if movable else (Phase.F if name.startswith("F") else Phase.B)
        tasks.append(Task(i, name, TaskKind.MIXER if res == C else TaskKind.DISPATCH, phase, res, float(ms),
                          tuple(deps), side="F" if name.startswith("F") else "B", movable=movable,
                          deadline_ms=dl[0] if dl else None))
    return TaskDAG(tuple(tasks))


def _assert_valid(dag: TaskDAG, s: TaskSchedule) -> None:
    check_schedule(dag, s)
    replay = run_in_order(dag, s.order_dict())
    assert replay.makespan <= s.makespan + 1e-9


def _ilp(dag: TaskDAG) -> PairILPResult:
    r = solve_pair_ilp(dag, time_limit_s=20.0)
    assert r.optimal and r.gap == pytest.approx(0.0, abs=1e-9)
    check_schedule(dag, r.schedule)
    return r


# ---- hand-solved cases ------------------------------------------------------------------------

def test_two_alternating_chains_interleave_perfectly():
    # F: C2 -> E2 -> C2 ; B: E2 -> C2 -> E2. Interleaved, both resources are always busy: 6 ms
    # (each resource carries 6 ms); running one chain after the other takes 12 ms.
    dag = _dag(("F.c1", C, 2, (), False), ("F.e1", E, 2, (0,), False), ("F.c2", C, 2, (1,), False),
               ("B.e1", E, 2, (), False), ("B.c1", C, 2, (3,), False), ("B.e2", E, 2, (4,), False))
    s = schedule_pair(dag)
    _assert_valid(dag, s)
    assert s.makespan == pytest.approx(6.0)
    assert s.start == pytest.approx((0.0, 2.0, 4.0, 0.0, 2.0, 4.0))
    assert _ilp(dag).schedule.makespan == pytest.approx(6.0)


def test_w_is_delayed_rather_than_lengthen_the_makespan():
    # F: c1(1) -> e(3) -> c3(1) -> e(3): critical path 8. W (3 ms, after B.c 1 ms) does not fit
    # the 2 ms compute gap under the first A2A; running it there pushes F.c3 and makes 9 ms.
    # Delayed behind F.c3, it overlaps the last A2A: 8 ms.
    dag = _dag(("F.c1", C, 1, (), False), ("F.e2", E, 3, (0,), False), ("F.c3", C, 1, (1,), False),
               ("F.e4", E, 3, (2,), False), ("B.c", C, 1, (), False), ("W.c", C, 3, (4,), True))
    s = schedule_pair(dag)
    _assert_valid(dag, s)
    assert s.makespan == pytest.approx(8.0)
    assert s.start[5] >= s.end[2] - 1e-9  # W after F.c3
    assert _ilp(dag).schedule.makespan == pytest.approx(8.0)
    # the greedy alternative really is worse: W right after B.c
    greedy = run_in_order(dag, {C: (0, 4, 5, 2), E: (1, 3)})
    assert greedy.makespan == pytest.approx(9.0)


def test_gap_fit_puts_w_into_the_gap_of_a_comm_wait():
    # F: c1(1) -> e(3) -> c3(3); B.c(1) -> W(2). Compute waits 2 ms for the A2A: W fills exactly
    # that gap, makespan 7 (= critical path = compute load); W at the end would give 9.
    dag = _dag(("F.c1", C, 1, (), False), ("F.e2", E, 3, (0,), False), ("F.c3", C, 3, (1,), False),
               ("B.c", C, 1, (), False), ("W.c", C, 2, (3,), True))
    s = schedule_pair(dag)
    _assert_valid(dag, s)
    assert s.makespan == pytest.approx(7.0)
    assert (s.start[4], s.end[4]) == pytest.approx((2.0, 4.0))
    assert _ilp(dag).schedule.makespan == pytest.approx(7.0)
    assert run_in_order(dag, {C: (0, 3, 2, 4), E: (1,)}).makespan == pytest.approx(9.0)


def test_deadline_pulls_w_into_the_main_stream():
    # The delay case with a W deadline of 5 ms: W can no longer wait behind F.c3 (it would end at
    # 8); it must run in the gap and push the chain: 9 ms, the optimum under the deadline.
    dag = _dag(("F.c1", C, 1, (), False), ("F.e2", E, 3, (0,), False), ("F.c3", C, 1, (1,), False),
               ("F.e4", E, 3, (2,), False), ("B.c", C, 1, (), False), ("W.c", C, 3, (4,), True, 5.0))
    s = schedule_pair(dag)
    _assert_valid(dag, s)
    assert s.end[5] <= 5.0 + 1e-9
    assert s.makespan == pytest.approx(9.0)
    assert _ilp(dag).schedule.makespan == pytest.approx(9.0)


def test_unmeetable_deadline_raises():
    # W cannot end before 1 + 3 = 4 ms.
    dag = _dag(("B.c", C, 1, (), False), ("W.c", C, 3, (0,), True, 3.0), ("F.c", C, 1, (), False))
    with pytest.raises(ValueError, match="deadline"):
        schedule_pair(dag)


def test_empty_dag():
    s = schedule_pair(TaskDAG(()))
    assert s.makespan == 0.0 and s.order == ()


# ---- checker ------------------------------------------------------------------------------------

def _small_pair() -> TaskDAG:
    return pair_dag(uniform_costs(4, 2.0, 4.0, 2.0, a2a_ms=1.0), (0, 2), (2, 4), True)


def test_check_schedule_accepts_replays_and_rejects_bad_schedules():
    dag = _small_pair()
    good = schedule_pair(dag)
    check_schedule(dag, good)
    check_schedule(dag, run_in_order(dag, fixed_order(dag)))
    first_c = good.order_dict()[C][0]
    second_c = good.order_dict()[C][1]
    dep_task = next(t for t in dag.tasks if t.deps)

    def shifted(i: int, to: float) -> TaskSchedule:
        st, en = list(good.start), list(good.end)
        st[i], en[i] = to, to + dag.tasks[i].ms
        return TaskSchedule(tuple(st), tuple(en), max(en), good.order)

    bad = {
        "overlap": shifted(second_c, good.start[first_c]),
        "dependency": shifted(dep_task.id, good.end[dep_task.deps[0]] - 0.5),
        "duration": TaskSchedule(good.start, tuple(e + (0.5 if i == 0 else 0.0) for i, e in enumerate(good.end)),
                                 good.makespan + 0.5, good.order),
        "missing": TaskSchedule(good.start, good.end, good.makespan,
                                tuple((r, seq[:-1] if r == C else seq) for r, seq in good.order)),
        "makespan": TaskSchedule(good.start, good.end, good.makespan - 1.0, good.order),
        "length": TaskSchedule(good.start[:-1], good.end[:-1], good.makespan, good.order),
    }
    for label, s in bad.items():
        with pytest.raises(ValueError):
            check_schedule(dag, s)
            pytest.fail(f"check_schedule accepted a schedule with a bad {label}")
    late = _dag(("B.c", C, 1, (), False), ("W.c", C, 1, (0,), True, 1.5))
    with pytest.raises(ValueError, match="deadline"):
        check_schedule(late, TaskSchedule((1.0, 2.0), (2.0, 3.0), 3.0, ((C, (0, 1)),)))


# ---- scheduler vs exact ILP on random uniform pairs ----------------------------------------------

def test_random_uniform_pairs_within_five_percent_of_ilp():
    rng = random.Random(7)
    worst = 0.0
    for _ in range(8):
        nf, nb = rng.randint(1, 3), rng.randint(1, 3)
        costs = uniform_costs(8, rng.uniform(1.0, 4.0), rng.uniform(2.0, 8.0), rng.uniform(0.5, 4.0),
                              a2a_ms=rng.uniform(0.3, 3.0), overlap_slowdown=rng.uniform(1.0, 1.2))
        dag = pair_dag(costs, (0, nf), (4, 4 + nb), True)
        s = schedule_pair(dag)
        _assert_valid(dag, s)
        r = _ilp(dag)
        assert s.makespan >= r.schedule.makespan - 1e-6  # nothing beats the optimum
        assert s.makespan <= 1.05 * r.schedule.makespan
        assert r.schedule.makespan >= max(dag.critical_path_ms(), dag.resource_load_ms(C)) - 1e-6
        worst = max(worst, s.makespan / r.schedule.makespan - 1.0)
    assert worst < 0.05


def _hetero_costs(seed: int) -> ModelCosts:
    """Alternating DeltaNet-like (short mixer) and attention-like (long mixer) MoE layers with the
    full task graph (router, shared expert beside the dispatch, W per kind); times in ms."""
    rng = random.Random(seed)
    F, B, W = Phase.F, Phase.B, Phase.W
    K = TaskKind
    layers = []
    for i in range(6):
        mix = (2.4 if i % 2 else 0.9) * rng.uniform(0.8, 1.2)
        a2a, exp, sh = rng.uniform(0.6, 1.6), rng.uniform(0.8, 1.6), rng.uniform(0.2, 0.4)
        tasks = (TaskCost(K.MIXER, F, C, mix), TaskCost(K.ROUTER, F, C, 0.05, deps=(0,)),
                 TaskCost(K.DISPATCH, F, E, a2a, deps=(1,)), TaskCost(K.SHARED, F, C, sh, deps=(1,)),
                 TaskCost(K.EXPERT, F, C, exp, deps=(2,)), TaskCost(K.COMBINE, F, E, a2a, deps=(4,)),
                 TaskCost(K.COMBINE, B, E, a2a), TaskCost(K.SHARED, B, C, sh),
                 TaskCost(K.EXPERT, B, C, exp, deps=(6,)), TaskCost(K.DISPATCH, B, E, a2a, deps=(8,)),
                 TaskCost(K.ROUTER, B, C, 0.05, deps=(9, 7)), TaskCost(K.MIXER, B, C, 1.2 * mix, deps=(10,)),
                 TaskCost(K.MIXER, W, C, 0.8 * mix, deps=(11,)), TaskCost(K.EXPERT, W, C, exp, deps=(8,)),
                 TaskCost(K.SHARED, W, C, sh, deps=(7,)))
        layers.append(LayerCost(i, "DE" if i % 2 == 0 else "AE", tasks, LayerMemory(0, 0, 0, 0)))
    empty = LayerMemory(0, 0, 0, 0)
    return ModelCosts("synthetic", tuple(layers), LayerCost(-1, "emb", (), empty), LayerCost(6, "head", (), empty),
                      0.0, 0.0, 1.1, 1e15, 80e9, 4096)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heterogeneous_pairs_match_ilp_and_beat_fixed_order(seed):
    dag = pair_dag(_hetero_costs(seed), (0, 2), (3, 5), True)
    s = schedule_pair(dag)
    _assert_valid(dag, s)
    r = _ilp(dag)
    assert r.schedule.makespan - 1e-6 <= s.makespan <= 1.02 * r.schedule.makespan
    assert s.makespan <= run_in_order(dag, fixed_order(dag)).makespan + 1e-9


def test_deterministic_and_sorted():
    dag = pair_dag(_hetero_costs(3), (1, 3), (3, 6), True)
    a, b = schedule_pair(dag), schedule_pair(dag)
    assert a == b
    for _, seq in a.order:
        assert all(a.start[x] <= a.start[y] for x, y in zip(seq, seq[1:]))
    assert len(VARIANTS) >= 3


def test_ilp_keeps_the_warm_start_on_timeout_and_reports_it():
    dag = pair_dag(_hetero_costs(4), (0, 3), (3, 6), True)
    warm = schedule_pair(dag)
    r = solve_pair_ilp(dag, time_limit_s=0.01, warm_start=warm)
    check_schedule(dag, r.schedule)
    assert r.schedule.makespan <= warm.makespan + 1e-9
    assert r.solve_s > 0.0 and r.num_binaries > 0
    assert r.optimal or r.gap > 0.0
    assert r.lower_bound_ms <= r.schedule.makespan + 1e-6


def test_ilp_rejects_an_invalid_warm_start():
    dag = _small_pair()
    good = schedule_pair(dag)
    bad = TaskSchedule(tuple(0.0 for _ in good.start), tuple(t.ms for t in dag.tasks), good.makespan, good.order)
    with pytest.raises(ValueError):
        solve_pair_ilp(dag, warm_start=bad)


def test_analytic_qwen3_next_pairs_near_ilp():
    """Pairs of the analytic Qwen3-Next-80B-A3B costs on H800 (DeltaNet and attention layers)."""
    analytic = pytest.importorskip("tessera.cost.analytic")
    from tessera.config.schema import ParallelConfig
    from tessera.spec.hardware_presets import get_hardware
    from tessera.spec.presets import get_model

    costs = analytic.analytic_costs(get_model("qwen3-next-80b-a3b"), get_hardware("h800"),
                                    ParallelConfig(pp=8, vpp=2, ep=8, dp=8, num_microbatches=16,
                                                   micro_batch_size=1, seq_length=4096))
    for f, b in (((0, 2), (2, 4)), ((2, 5), (13, 16))):
        dag = pair_dag(costs, f, b, True)
        s = schedule_pair(dag)
        _assert_valid(dag, s)
        r = _ilp(dag)
        assert r.schedule.makespan - 1e-6 <= s.makespan <= 1.05 * r.schedule.makespan
        assert s.makespan < run_in_order(dag, fixed_order(dag)).makespan
