"""Program format 2: pair orders name their tasks; the task structure comes from the layer specs
alone (tessera.spec.tasks, tessera.sched.structure) and agrees with every cost-carrying DAG of
the analytic model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from tessera.cost.analytic import analytic_costs
from tessera.cost.types import ParallelShape
from tessera.engine import Engine, EngineError, NoopChunk, TorchChunk
from tessera.errors import ProgramError
from tessera.model import StageModule
from tessera.plan.pair_cost import best_pair
from tessera.plan.pair_scheduler import schedule_pair
from tessera.program.instructions import FORMAT_VERSION, Instr, Op, PairOrder, Program, StageRef
from tessera.program.plan import Plan
from tessera.sched.chunkdag import chunk_dag, fixed_order, pair_dag, replay_pair
from tessera.sched.structure import ModelStructure, chunk_structure, named_order, order_ids, pair_structure
from tessera.sim.simulator import simulate
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import MODEL_PRESETS, get_model
from tessera.spec.tasks import Resource, layer_shapes


def _strip(dag):
    return tuple(dataclasses.replace(t, ms=0.0, flops=0.0, mem_bytes=0.0) for t in dag.tasks)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_structure_from_specs_equals_analytic_dags(name):
    m = get_model(name)
    L = m.num_layers
    costs = analytic_costs(m, get_hardware("h800"), ParallelShape(ep=8, dp=8, seq_length=4096))
    st = ModelStructure.of_specs(m.layers)
    assert st == ModelStructure.of_costs(costs)
    assert st.tasks(-1) == st.embed and st.tasks(L) == st.head and st.tasks(0) == layer_shapes(m.layers[0])
    for f, b in (((-1, 2), (L - 2, L + 1)), ((1, 3), (0, 2)), ((0, 1), (0, 1))):
        for with_w in (True, False):
            dag = pair_structure(m.layers, f, b, with_w)
            assert _strip(pair_dag(costs, f, b, with_w)) == dag.tasks
            assert all(t.ms == 0.0 for t in dag.tasks)
            assert len({t.name for t in dag.tasks}) == len(dag.tasks)  # names are unique
    for phases in ("F", "B", "W", "BW"):
        assert _strip(chunk_dag(costs, -1, L + 1, phases)) == chunk_structure(st, -1, L + 1, phases).tasks


def test_qwen3_next_moe_layer_structure():
    layer = get_model("qwen3-next-80b-a3b").layers[0]  # Gated DeltaNet + MoE with a shared expert
    got = [(s.phase.value, s.kind.value, s.resource.value, s.deps) for s in layer_shapes(layer)]
    assert got == [("F", "mixer", "compute", ()), ("F", "router", "compute", (0,)), ("F", "dispatch", "ep_comm", (1,)),
                   ("F", "expert", "compute", (2,)), ("F", "combine", "ep_comm", (3,)), ("F", "shared", "compute", (1,)),
                   ("B", "combine", "ep_comm", ()), ("B", "expert", "compute", (6,)), ("B", "dispatch", "ep_comm", (7,)),
                   ("B", "shared", "compute", ()), ("B", "router", "compute", (8, 9)), ("B", "mixer", "compute", (10,)),
                   ("W", "mixer", "compute", (11,)), ("W", "router", "compute", (10,)), ("W", "expert", "compute", (7,)),
                   ("W", "shared", "compute", (9,))]
    dag = pair_structure(get_model("qwen3-next-80b-a3b").layers, (3, 4), (7, 8), True)
    assert [t.name for t in dag.tasks][:3] == ["F.L3.mixer", "F.L3.router", "F.L3.dispatch"]
    assert [t.name for t in dag.tasks][-4:] == ["W.L7.mixer", "W.L7.router", "W.L7.expert", "W.L7.shared"]
    with pytest.raises(ValueError, match=r"^layer 49 is outside the model's extended layers -1..48$"):
        ModelStructure.of_specs(get_model("qwen3-next-80b-a3b").layers).tasks(49)


def test_named_orders_round_trip_and_replay_the_same_schedule():
    m = get_model("qwen3-next-80b-a3b")
    costs = analytic_costs(m, get_hardware("h800"), ParallelShape(ep=8, dp=8, seq_length=4096))
    ch = best_pair(costs, (3, 6), (30, 33), False, schedule_pair)
    po = ch.pair_order(1, 10, False)
    assert all(isinstance(n, str) for _, names in po.order for n in names)
    assert {r for r, _ in po.order} == {"compute", "ep_comm"}
    dag = pair_structure(m.layers, (3, 6), (30, 33), False)
    assert order_ids(dag, po.order) == ch.schedule.order_dict()
    _, replay = replay_pair(costs, (3, 6), (30, 33), False, po.order, po.overlapped)
    assert replay.makespan == ch.makespan_ms
    fixed = pair_dag(costs, (3, 6), (30, 33), False)
    assert order_ids(fixed, named_order(fixed, fixed_order(fixed))) == fixed_order(fixed)


def test_order_ids_errors_are_one_line():
    dag = pair_structure(get_model("tiny-qwen3-next").layers, (0, 1), (1, 2), True)
    with pytest.raises(ValueError, match=r"^pair order names task 'F.L5.mixer', which the pair DAG does not have "
                                         r"\(it has 16 tasks\): the order is for another model or partition$"):
        order_ids(dag, (("compute", ("F.L5.mixer",)),))
    with pytest.raises(ValueError, match=r"^pair order names resource 'gpu'; known: \['compute', 'ep_comm', 'pp_comm'\]$"):
        order_ids(dag, (("gpu", ()),))
    with pytest.raises(ValueError, match=r"task id 3, not a task name \(Program format 1\); re-run `tessera plan`"):
        order_ids(dag, (("compute", (3,)),))
    assert order_ids(dag, (("compute", ("F.L0.mixer",)),)) == {Resource.COMPUTE: (0,)}


def test_format_1_files_are_refused_with_the_fix():
    assert FORMAT_VERSION == 2
    prog = Program(0, 1, 1, 1, 1, (StageRef(0, 0, -1, 2),), (Instr(Op.F, 0, 0),),
                   (PairOrder(0, 0, True, (("compute", ("F.L0.mixer", "B.L0.mixer")),)),))
    d = json.loads(prog.to_json())
    assert d["version"] == 2 and d["pair_orders"][0]["order"] == [["compute", ["F.L0.mixer", "B.L0.mixer"]]]
    assert Program.from_dict(d) == prog
    with pytest.raises(ValueError, match=r"^Program format version 1 is not supported \(this Tessera reads version 2\); "
                                         r"re-run `tessera plan` to write the plan again$"):
        Program.from_dict({**d, "version": 1})
    with pytest.raises(ValueError, match=r"^pair order \(F S0, B S1\) lists task ids, not task names \(Program format "
                                         r"1\); re-run `tessera plan` to write the plan again$"):
        PairOrder(0, 1, True, (("compute", (0, 1)),))
    old_plan = {"name": "tessera", "template": "1f1b", "pp": 1, "vpp": 1, "num_microbatches": 1,
                "partition": {"bounds": [-1, 2]}, "pair_orders": [{"f_stage": 0, "b_stage": 0, "with_w": True,
                                                                    "order": [["compute", [0, 1]]]}]}
    with pytest.raises(ValueError, match="lists task ids, not task names"):
        Plan.from_dict(old_plan)


def test_simulator_refuses_an_order_for_another_model():
    m = get_model("tiny-qwen3-next")
    costs = analytic_costs(m, get_hardware("cpu"), ParallelShape(seq_length=64))
    stages = (StageRef(0, 0, -1, 2), StageRef(1, 1, 2, 9))
    bad = PairOrder(0, 1, True, (("compute", ("F.L0.mlp",)),))
    instrs = (Instr(Op.F, 0, 1), Instr(Op.FB, 1, 0, 0, 1, with_w=True, order=0))
    with pytest.raises(ProgramError, match="pair order names task 'F.L0.mlp', which the pair DAG does not have"):
        simulate([Program(0, 1, 2, 2, 2, stages, instrs, (bad,))], costs)


def test_engine_builds_pairs_from_the_spec_and_refuses_foreign_names():
    m = dataclasses.replace(get_model("tiny-qwen3-next"), layers=get_model("tiny-qwen3-next").layers[:1])
    chunk = NoopChunk.like(TorchChunk(StageModule(m, (-1, 2), seed=0)))
    dag = pair_structure(m.layers, (-1, 2), (-1, 2), False)
    good = PairOrder(0, 0, False, named_order(dag, dag.default_order()))
    instrs = (Instr(Op.F, 0, 0), Instr(Op.FB, 1, 0, 0, 0, order=0))
    Engine(Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, 2),), instrs, (good,)), [chunk])
    bad = dataclasses.replace(good, order=(("compute", ("F.L7.mixer",)),))
    with pytest.raises(EngineError, match=r"^rank 0: pair order #0: pair order names task 'F.L7.mixer', which the "
                                          r"pair DAG does not have"):
        Engine(Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, 2),), instrs, (bad,)), [chunk])
    bare = NoopChunk({p: chunk.task_keys(p) for p in "FBW"}, -1, 2)  # no model_spec, no task_costs
    with pytest.raises(EngineError, match="FB instructions need the model's task structure"):
        Engine(Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, 2),), instrs, (good,)), [bare])
    Engine(Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, 2),), instrs, (good,)), [bare],
           task_costs=ModelStructure.of_specs(m.layers))


def test_engine_imports_no_cost_model_and_no_config():
    code = ("import sys, tessera.engine.engine, tessera.engine.hooks; "
            "print(sorted(n for n in sys.modules if n.startswith(('tessera.cost', 'tessera.config', "
            "'tessera.spec.hardware', 'tessera.plan'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['tessera.cost', 'tessera.cost.types']"  # the pure value module (enums, TaskKey) only
    src = open(sys.modules[Engine.__module__].__file__).read()
    assert "tessera.cost" not in src and "tessera.config" not in src
