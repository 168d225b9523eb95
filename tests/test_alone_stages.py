"""Stages without a decoder layer: the embedding alone on stage 0, the head alone on the last stage.

The compiler, the validator, the simulator and the engine run them (issue #12 part 4); the
engine trains them bitwise like the single-process reference (torch.equal), on the tiny preset
cut to 4 layers, pp 2, interleaved 1F1B with vpp 2 (4 virtual stages), dp 1, ep 1, gloo.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.model import StageModule
from tessera.program.compiler import compile_plan
from tessera.program.plan import Partition, Plan
from tessera.program.validate import validate_programs
from tessera.sim.simulator import simulate
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.testing import global_state_dict, reference_train, run_local

pytestmark = pytest.mark.xdist_group("alone_stages")  # module fixtures built once (tests/conftest.py)

SEED, LR, M, STEPS = 11, 3e-3, 4, 2
# 4 decoder layers over 4 virtual stages: S3 the head alone; S0 the embedding alone
HEAD_ALONE = (-1, 1, 2, 4, 5)
EMB_ALONE = (-1, 0, 2, 3, 5)
BOTH_ALONE = (-1, 0, 2, 4, 5)


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def plan_of(bounds, template="interleaved-1f1b", vpp=2) -> Plan:
    return Plan("test", template, 2, vpp, M, Partition(bounds), overlap=True, split_w=True)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


def batches() -> list[list[Batch]]:
    g = torch.Generator().manual_seed(SEED)
    return [[Batch.from_tokens(torch.randint(0, 256, (M, 1, 17), generator=g))] for _ in range(STEPS)]


@pytest.mark.parametrize("template,bounds", [("interleaved-1f1b", HEAD_ALONE), ("interleaved-1f1b", EMB_ALONE),
                                             ("interleaved-1f1b", BOTH_ALONE), ("dualpipe-v", BOTH_ALONE),
                                             ("zb-v", HEAD_ALONE)])
def test_alone_stages_compile_validate_and_simulate(template, bounds):
    plan = plan_of(bounds, template)
    progs = compile_plan(plan)
    validate_programs(progs)
    assert plan.partition.sizes()[0] == (0 if bounds[1] == 0 else bounds[1])
    costs = analytic_costs(model_spec(), get_hardware("cpu"), ParallelConfig(
        pp=2, vpp=2, ep=1, dp=1, num_microbatches=M, micro_batch_size=1, seq_length=16))
    res = simulate(progs, costs)
    # the head-alone stage runs the head's tasks and nothing else
    last = plan.partition.num_stages - 1
    if bounds[-2] == 4:
        rank, chunk = next((p.rank, s.chunk) for p in progs for s in p.stages if s.stage == last)
        names = {e.name.split(".")[1] for e in res.events if e.rank == rank and e.chunk == chunk
                 and e.resource == "compute"}
        assert names == {"L4"}, names
    assert res.iteration_ms > 0


def _train(bounds) -> dict:
    groups = make_groups(Layout(2, 1, 1))
    prog = compile_plan(plan_of(bounds))[groups.pipeline_rank]
    mods = [StageModule(model_spec(), (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]))
    for step in batches():
        engine.run_iteration(step[0])
    return {k: v for m in mods for k, v in global_state_dict(m).items()}


def _world(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    return {b: _train(b) for b in (HEAD_ALONE, BOTH_ALONE)}


@pytest.fixture(scope="module")
def trained():
    """One 2-rank gloo launch training both partitions, and the single-process reference."""
    old = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        results = run_local(_world, 2, 200)
        want = reference_train(model_spec(), batches(), ep=1, seed=SEED, make_optimizer=make_optimizer).state
    finally:
        torch.set_num_threads(old[0])
        torch.use_deterministic_algorithms(old[1])
    return results, want


@pytest.mark.parametrize("bounds", [HEAD_ALONE, BOTH_ALONE])
def test_engine_runs_alone_stages_bitwise_like_the_reference(trained, bounds):
    results, want = trained
    got = {k: v for res in results for k, v in res[bounds].items()}
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} of {len(want)} parameters differ, e.g. {bad[:4]}"
    initial = global_state_dict(StageModule(model_spec(), (-1, 5), seed=SEED))
    assert any(not torch.equal(got[k], initial[k]) for k in initial)  # it trained


def test_alone_partition_balances_the_layers_over_the_other_stages():
    from tessera.cost.uniform import uniform_costs
    from tessera.errors import TesseraConfigError
    from tessera.plan.baseline import alone_partition, serial_balanced_partition

    costs = uniform_costs(8, 1.0, 2.0, 1.0)
    assert alone_partition(costs, 4, head=True).bounds == (-1, 3, 6, 8, 9)
    assert alone_partition(costs, 4, embedding=True, head=False).bounds == (-1, 0, 3, 6, 9)
    assert alone_partition(costs, 4, embedding=True, head=True).bounds == (-1, 0, 4, 8, 9)
    assert alone_partition(costs, 4, embedding=False, head=False) == serial_balanced_partition(costs, 4)
    with pytest.raises(TesseraConfigError, match="2 stages remain for 1 decoder layers"):
        alone_partition(uniform_costs(1, 1.0, 1.0, 1.0), 4, embedding=True, head=True)


def test_candidates_offer_the_head_and_the_embedding_alone_beyond_the_radius():
    from tessera.plan.candidates import Candidate, stage_candidates

    base = Partition((-1, 3, 6, 9, 13))  # 12 layers on 4 stages
    plain = stage_candidates(base, 1, 12)
    wide = stage_candidates(base, 1, 12, alone=True)
    assert Candidate(3, 12, 13) in wide[3] and Candidate(0, -1, 0) in wide[0]
    assert Candidate(3, 12, 13) not in plain[3] and Candidate(0, -1, 0) not in plain[0]
    # the neighbours close the chain: stage 2 may end at 12 (taking the last stage's layers), stage 1 start at 0
    assert Candidate(2, 6, 12) in wide[2] and Candidate(1, 0, 6) in wide[1]
    assert set(plain[1]) <= set(wide[1]) and set(plain[2]) <= set(wide[2])
    assert stage_candidates(base, 0, 12, alone=True) == stage_candidates(base, 0, 12)  # radius 0: baseline only


def test_planner_with_alone_candidates_is_never_worse_and_compiles():
    """The alone candidates are a superset: the MILP's bottleneck can only drop; the plan chosen
    among them compiles and validates, and its memory is checked like any other's."""
    from tessera.plan.planner import make_plan

    costs = analytic_costs(model_spec(), get_hardware("h800"), ParallelConfig(
        pp=2, vpp=2, ep=1, dp=1, num_microbatches=M, micro_batch_size=1, seq_length=16))
    shape = dict(template="interleaved-1f1b", pp=2, vpp=2, num_microbatches=M, radius=1, objective="bottleneck")
    off = make_plan(costs, **shape, alone=False)
    on = make_plan(costs, **shape, alone=True, capacity_bytes=1e12)
    assert not off.alone and on.alone
    assert on.candidates > off.candidates and on.pairs_total > off.pairs_total
    assert on.milp.bottleneck_ms <= off.milp.bottleneck_ms + 1e-9
    validate_programs(compile_plan(on.tessera))
