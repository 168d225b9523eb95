"""Rules of the pair DAG and the template's fixed overlap order (issue 9, item A).

A layer may hold several tasks of one kind (an expert W split in two, e.g. over two GEMM
streams). The fixed order must place each of them, once, in its kind's slot: keyed by
(side, layer, kind) the second task overwrote the first, which then went to the end of its
resource, so the makespan depended on the order the costs listed the two tasks in.
"""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.types import ModelCosts, Phase, Resource, TaskKind
from tessera.sched.chunkdag import fixed_order, pair_dag
from tessera.sched.dag import Task, TaskDAG, run_in_order
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

pytestmark = pytest.mark.xdist_group("rules_sched")  # module fixtures built once (tests/conftest.py)


@pytest.fixture(scope="module")
def deepseek_costs() -> ModelCosts:
    """DeepSeek-V3 analytic costs on H800 (the deepseek-v3 recipe's layout)."""
    return analytic_costs(get_model("deepseek-v3"), get_hardware("h800"),
                          ParallelConfig(pp=16, vpp=2, ep=64, dp=64, num_microbatches=32, seq_length=4096))


def _split_expert_w(costs: ModelCosts, share: float, reverse: bool) -> ModelCosts:
    """Each MoE layer's expert W as two tasks (``share`` and ``1 - share`` of its time), listed
    in that order or, with ``reverse``, the other way round."""
    layers = []
    for lc in costs.layers:
        tasks = list(lc.tasks)
        j = next((i for i, t in enumerate(tasks) if t.phase == Phase.W and t.kind == TaskKind.EXPERT), None)
        if j is not None:
            w = tasks[j]
            halves = [dataclasses.replace(w, ms=w.ms * share, flops=w.flops * share),
                      dataclasses.replace(w, ms=w.ms * (1 - share), flops=w.flops * (1 - share))]
            tasks[j:j + 1] = halves[::-1] if reverse else halves
        layers.append(dataclasses.replace(lc, tasks=tuple(tasks)))
    return dataclasses.replace(costs, layers=tuple(layers))


def _check_permutation(dag: TaskDAG, order: dict) -> None:
    ids = [i for seq in order.values() for i in seq]
    assert sorted(ids) == list(range(len(dag.tasks)))  # every task exactly once
    for r, seq in order.items():
        assert all(dag.tasks[i].resource == r for i in seq)


@pytest.mark.parametrize("f_range,b_range", [((5, 8), (20, 23)), ((10, 12), (10, 12)), ((58, 62), (0, 3))])
def test_fixed_order_places_split_tasks_and_ignores_listing_order(deepseek_costs, f_range, b_range):
    whole = pair_dag(deepseek_costs, f_range, b_range, True)
    whole_ms = run_in_order(whole, fixed_order(whole)).makespan
    spans = []
    for reverse in (False, True):
        dag = pair_dag(_split_expert_w(deepseek_costs, 0.8, reverse), f_range, b_range, True)
        names = [t.name for t in dag.tasks]
        assert len(set(names)) == len(names)
        moe_b = [l for l in range(*b_range) if 0 <= l < 61 and deepseek_costs.layers[l].code == "LE"]
        for l in moe_b:
            assert names.count(f"W.L{l}.expert") == 1 and names.count(f"W.L{l}.expert#1") == 1
        order = fixed_order(dag)
        _check_permutation(dag, order)
        comp = list(order[Resource.COMPUTE])
        for l in moe_b:  # both halves right after their B.expert (fused backward)
            b = next(t.id for t in dag.tasks if t.name == f"B.L{l}.expert")
            halves = [t.id for t in dag.tasks if t.phase == Phase.W and t.layer == l and t.kind == TaskKind.EXPERT]
            assert comp[comp.index(b) + 1: comp.index(b) + 3] == halves
        spans.append(run_in_order(dag, order).makespan)
    assert spans[0] == pytest.approx(spans[1], rel=1e-12)
    # the two halves run back to back where the whole W ran: the schedule is the unsplit one
    assert spans[0] == pytest.approx(whole_ms, rel=1e-12)


def test_fixed_order_rejects_duplicate_names():
    C = Resource.COMPUTE
    tasks = (Task(0, "F.L0.mixer", TaskKind.MIXER, Phase.F, C, 1.0, (), 0, "F"),
             Task(1, "F.L0.mixer", TaskKind.MIXER, Phase.F, C, 1.0, (0,), 0, "F"))
    with pytest.raises(ValueError, match="task name 'F.L0.mixer' is used by tasks 0 and 1"):
        fixed_order(TaskDAG(tasks))


def test_engine_refuses_a_pair_dag_with_split_tasks(deepseek_costs):
    """The engine runs one task per (phase, layer, kind); a DAG with a split kind must not be
    replayed by running that task twice."""
    from tessera.cost.types import TaskKey
    from tessera.engine.pairs import pair_steps
    from tessera.engine.values import EngineError

    def keys(dag, phase):
        return tuple(dict.fromkeys(TaskKey(t.phase.value, t.layer, t.kind.value) for t in dag.tasks
                                   if t.phase == phase))

    whole = pair_dag(deepseek_costs, (5, 8), (20, 23), True)
    f, b, w = keys(whole, Phase.F), keys(whole, Phase.B), keys(whole, Phase.W)
    assert len(pair_steps(whole, fixed_order(whole), f, b, w, True)) == len(whole.tasks)
    split = pair_dag(_split_expert_w(deepseek_costs, 0.8, False), (5, 8), (20, 23), True)
    with pytest.raises(EngineError, match=r"several tasks of one kind in one layer \(e.g. W.L22.expert#1\)"):
        pair_steps(split, fixed_order(split), f, b, w, True)
