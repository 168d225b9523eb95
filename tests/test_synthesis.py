"""Schedule synthesis (tessera.plan.synthesis): the list scheduler's rules over every template,
the search's never-slower rule, ``Plan.schedule`` as a format, and synthesized orders in the
engine, bitwise equal to the single-process reference.

Unit level (in-process): a grid of shapes (1f1b, interleaved-1f1b vpp 2/3, dualpipe-v, zb-h1,
zb-v; pp 2-4; overlap and split W on and off) under a sample of :func:`policy_grid` and per-rank
variants, on a heterogeneous cost model (``tests/plan_helpers.py``). Engine level: the ``syn_*``
scenarios of the one 4-rank launch of ``tests/test_engine.py`` (this module builds their
Programs, :func:`synthesized_programs`, and checks their results; the launch is shared through
``test_engine.launch``, so these tests run in its xdist group).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections import defaultdict

import pytest
import torch

import test_engine as eng
from plan_helpers import hetero_costs
from tessera.dbo.predict import moe_layers
from tessera.errors import TesseraConfigError
from tessera.flow import iteration_evaluator
from tessera.model import StageModule
from tessera.plan.baseline import baseline_plan
from tessera.plan.pair_scheduler import schedule_pair
from tessera.plan.list_scheduler import Policy, list_schedule, rank_changes, template_inflight
from tessera.plan.synthesis import apply_policy, policy_grid, synthesize
from tessera.program.compiler import compile_plan
from tessera.program.instructions import COMPUTE_OPS, Instr, Op
from tessera.program.memory import rank_memory_bytes, rank_static_bytes
from tessera.program.plan import Plan, with_split_w
from tessera.program.slots import annotate_slots
from tessera.program.templates import compute_schedule, get_template, stage_of
from tessera.program.validate import validate_programs
from tessera.sim.simulator import simulate
from tessera.testing import global_state_dict

SHAPES = (  # (template, pp, vpp, microbatches): every template, M < pp, M not a multiple of pp
    ("1f1b", 2, 1, 4), ("1f1b", 3, 1, 5), ("1f1b", 4, 1, 2),
    ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 3, 3, 5), ("interleaved-1f1b", 4, 2, 4),
    ("dualpipe-v", 2, 2, 4), ("dualpipe-v", 3, 2, 6),
    ("zb-h1", 3, 1, 4), ("zb-h1", 4, 1, 6),
    ("zb-v", 2, 2, 3), ("zb-v", 3, 2, 6),
)
PATTERN = "AMMAAMMAAMMAAMMAAMMA"  # compute-heavy and communication-heavy layers in turn


def costs_of(pp: int, vpp: int):
    """Heterogeneous costs with two decoder layers per stage and a p2p time."""
    return hetero_costs(PATTERN[:2 * pp * vpp], p2p_ms=0.2)


def flags(template: str):
    """(overlap, split W) pairs the template accepts."""
    return [(o, s) for o in (True, False) for s in (True, False) if s or not get_template(template).requires_split_w]


def sample_policies(pp: int, split: bool, overlap: bool, seed: str) -> list[Policy]:
    """Six policies of :func:`policy_grid` and two with per-rank warm-up allowances and pair waits."""
    grid = policy_grid(pp, split, overlap)
    out = random.Random(seed).sample(grid, min(6, len(grid)))
    wait = (lambda r: 0.5 * (r % 3)) if overlap else (lambda r: 0.0)
    out.append(Policy("depth", "mb", split, tuple(r % 3 for r in range(pp)), tuple(wait(r) for r in range(pp))))
    out.append(Policy("mb", "depth", False, tuple((pp - r) % 2 for r in range(pp)), tuple(wait(r + 1) for r in range(pp))))
    return out


def compute_order(program) -> list[Instr]:
    """A Program's compute instructions and ``register_w``, pair-order index dropped."""
    return [dataclasses.replace(i, order=-1) for i in program.instructions if i.op in COMPUTE_OPS | {Op.REGISTER_W}]


def check_order(plan: Plan, programs, where: str = "") -> None:
    """The synthesizer's contract on compiled ``programs`` of ``plan``: the Programs run
    ``plan.schedule``; every (microbatch, stage) forward and backward once and every W once, per
    chunk in microbatch order; with split W a W only as ``register_w`` + ``W`` after its
    backward (inside an ``FB`` only where the template keeps it there), without, inside B/FB.
    ``where`` prefixes the failure message."""
    m, fb_w = plan.num_microbatches, get_template(plan.template).pair_with_w(plan.split_w)
    seen = {k: defaultdict(list) for k in "FBW"}  # kind -> stage -> microbatches in execution order
    for r, prog in enumerate(programs):
        order = compute_order(prog)
        assert order == list(plan.schedule[r]), f"rank {r} runs another order than plan.schedule"
        stage = [stage_of(plan.template, r, c, plan.pp, plan.vpp) for c in range(plan.vpp)]
        registered = set()
        for ins in order:
            if ins.op in (Op.F, Op.FB):
                seen["F"][stage[ins.chunk]].append(ins.mb)
            if ins.op in (Op.B, Op.FB):
                mb, c = (ins.mb, ins.chunk) if ins.op == Op.B else (ins.mb2, ins.chunk2)
                assert mb in seen["F"][stage[c]], f"rank {r}: {ins} before its forward"
                seen["B"][stage[c]].append(mb)
                want_w = fb_w if ins.op == Op.FB else not plan.split_w
                assert ins.with_w == want_w, f"rank {r}: {ins} (split W {plan.split_w})"
                if ins.with_w:
                    seen["W"][stage[c]].append(mb)
            if ins.op == Op.REGISTER_W:
                assert plan.split_w and ins.mb in seen["B"][stage[ins.chunk]], f"rank {r}: {ins} before its B"
                registered.add((ins.mb, ins.chunk))
            if ins.op == Op.W:
                assert (ins.mb, ins.chunk) in registered, f"rank {r}: {ins} before its register_w"
                seen["W"][stage[ins.chunk]].append(ins.mb)
    for kind, by_stage in seen.items():
        assert sorted(by_stage) == list(range(plan.pp * plan.vpp)), kind
        for s, mbs in by_stage.items():
            assert mbs == list(range(m)), f"{where}{kind} of stage {s} in microbatch order {mbs}"


def live_bytes(programs, costs) -> list[float]:
    """Per rank, the peak of live activations: the memory rule's peak less static and transient."""
    return [peak - sum(rank_static_bytes(p, costs)) for peak, p in zip(rank_memory_bytes(programs, costs), programs)]


@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
def test_list_schedule_keeps_the_rules_on_every_template(shape):
    template, pp, vpp, m = shape
    costs = costs_of(pp, vpp)
    changed = written = 0
    for overlap, split in flags(template):
        plan = baseline_plan(costs, template, pp, vpp, m, overlap=overlap, split_w=split)
        base = compute_schedule(template, pp, vpp, m, overlap, split)
        cache: dict = {}
        for pol in sample_policies(pp, split, overlap, f"{shape}{overlap}{split}"):
            sched, new, predicted = list_schedule(costs, plan, pol, scheduler=schedule_pair, cache=cache)
            q = apply_policy(costs, plan, pol, scheduler=schedule_pair, cache=cache)
            if not sched:  # stuck (a cap too tight to let a rank progress): nothing to run
                assert q is None and new == () and predicted == math.inf
                continue
            assert q.schedule == sched and q.synthesized and q.pair_orders == plan.pair_orders + new
            progs = compile_plan(q)
            validate_programs(progs)
            check_order(q, progs, f"{pol}, overlap {overlap}, split W {split}: ")
            sim = simulate(progs, costs)
            assert 0 < sim.iteration_ms < math.inf and 0 < predicted < math.inf
            if overlap:  # every FB pair the order uses has a pair order, none runs the fixed order
                assert all(i.order >= 0 for p in progs for i in p.instructions if i.op == Op.FB)
            written += 1
            changed += sched != base
    assert written and changed, (written, changed)


def test_template_order_measures_as_itself():
    """``rank_changes`` of a template's own order against itself: nothing moved, the same
    warm-up, in-flight peak and ``FB`` count; ``template_inflight`` counts 1f1b's warm-up."""
    for template, pp, vpp, m in SHAPES:
        plan = baseline_plan(costs_of(pp, vpp), template, pp, vpp, m)
        base = compute_schedule(template, pp, vpp, m, True, True)
        for ch in rank_changes(plan, base):
            assert ch.moved_pairs == 0 and (ch.warmup, ch.inflight, ch.fb) == (ch.warmup_template, ch.inflight_template,
                                                                               ch.fb_template)
    plain, paired = (compute_schedule("1f1b", 4, 1, 8, overlap, False) for overlap in (False, True))
    assert [template_inflight(r) for r in plain] == [(4, 4), (3, 3), (2, 2), (1, 1)]
    # with FB: 2*(pp-rank-1)+1 forwards before the first pair, whose forward starts before its B frees
    assert [template_inflight(r) for r in paired] == [(7, 8), (5, 6), (3, 4), (1, 2)]


@pytest.mark.parametrize("shape", [("1f1b", 4, 1, 8, True), ("zb-h1", 3, 1, 6, True), ("1f1b", 3, 1, 6, False),
                                   ("interleaved-1f1b", 2, 2, 8, True)], ids=lambda s: "-".join(map(str, s)))
def test_memory_budget_bounds_live_activations(shape):
    """Under ``avail_bytes`` every order the list scheduler writes keeps each rank's live
    activations (the memory rule, as the simulator counts them) within the budget, and a budget
    below the unlimited order's peak really lowers it; a budget below one chunk's activations
    gets it stuck (``None``)."""
    template, pp, vpp, m, split = shape
    costs = costs_of(pp, vpp)
    plan = baseline_plan(costs, template, pp, vpp, m, split_w=split)
    bound = 0
    for pol in (Policy("breadth", "mb", split, (m * vpp,) * pp, (0.5,) * pp), Policy("depth", "depth", False, (2,) * pp)):
        free = live_bytes(compile_plan(apply_policy(costs, plan, pol, scheduler=schedule_pair)), costs)
        for frac in (0.3, 0.5, 0.7, 0.9):
            avail = [frac * x for x in free]
            q = apply_policy(costs, plan, pol, scheduler=schedule_pair, avail_bytes=avail)
            if q is None:
                continue
            progs = compile_plan(q)
            validate_programs(progs)
            got = live_bytes(progs, costs)
            assert all(g <= a for g, a in zip(got, avail)), (pol.label(), frac, got, avail)
            sim = simulate(progs, costs)
            assert all(abs((r.peak_mem_gb - r.static_mem_gb) * 1e9 - g) < 1e3 for r, g in zip(sim.ranks, got))
            bound += any(g < f for g, f in zip(got, free))
        assert apply_policy(costs, plan, pol, scheduler=schedule_pair, avail_bytes=[1e7] * pp) is None
    assert bound >= 2


def test_synthesize_is_never_slower_than_its_start():
    """With the planner's evaluator (compile, validate, simulate): the result is no slower than
    the template's order, its iteration is its plan's evaluated iteration, the budget holds; where
    a synthesized order wins (on these heterogeneous layers it does at least once) it is the
    one its policy writes and keeps the order's rules."""
    improved = 0
    for template, pp, vpp, m, split in (("1f1b", 4, 1, 8, True), ("zb-v", 3, 2, 6, True), ("zb-h1", 3, 1, 6, True),
                                        ("dualpipe-v", 2, 2, 6, False)):
        costs = costs_of(pp, vpp)
        plan = baseline_plan(costs, template, pp, vpp, m, split_w=split)
        res = synthesize(costs, plan, iteration_evaluator(costs), scheduler=schedule_pair, max_evals=30)
        fresh = iteration_evaluator(costs)
        assert res.start == plan and res.start_ms == fresh(plan), template
        assert res.iteration_ms == fresh(res.plan) <= res.start_ms, template
        assert 0 < res.evaluations <= 30 and not res.cap_hit, template
        if res.policy is None:
            assert res.plan == plan and res.changes == () and res.iteration_ms == res.start_ms, template
            continue
        improved += 1
        assert res.improved and res.iteration_ms < res.start_ms and res.plan.synthesized, template
        assert res.plan.schedule == apply_policy(costs, plan, res.policy, scheduler=schedule_pair).schedule, template
        assert res.changes == rank_changes(plan, res.plan.schedule) and len(res.changes) == pp, template
        check_order(res.plan, compile_plan(res.plan), f"{template}: ")
    assert improved >= 2


def test_synthesize_keeps_the_template_order_when_nothing_beats_it():
    costs = costs_of(2, 2)
    plan = baseline_plan(costs, "interleaved-1f1b", 2, 2, 8)
    real = iteration_evaluator(costs)

    def rejects_synthesized(p: Plan) -> float:  # e.g. every synthesized order over memory
        return math.inf if p.synthesized else real(p)

    for evaluate, tried in ((rejects_synthesized, range(1, 11)), (lambda p: 1e6, (10,))):  # a tie is no win
        res = synthesize(costs, plan, evaluate, scheduler=schedule_pair, max_evals=10)
        assert res.policy is None and not res.improved and res.changes == ()
        assert res.plan == plan and res.plan.schedule == () and res.iteration_ms == res.start_ms == evaluate(plan)
        assert res.evaluations in tried
    # the screen ranks the candidates, the evaluator confirms the winner: it rejects all of them
    res = synthesize(costs, plan, rejects_synthesized, scheduler=schedule_pair, max_evals=10, screen=lambda p: 1.0)
    assert res.policy is None and res.plan == plan and res.iteration_ms == real(plan) and res.evaluations >= 2
    res = synthesize(costs, plan, real, scheduler=schedule_pair, max_evals=5, start_ms=1.0)  # a start none beats
    assert res.policy is None and res.plan == plan and res.iteration_ms == 1.0


def test_plan_schedule_round_trips_and_template_plans_read_as_before():
    costs = costs_of(2, 2)
    plan = baseline_plan(costs, "zb-v", 2, 2, 4)
    syn = apply_policy(costs, plan, Policy("depth", "mb", True, (1, 2), (0.5, 0.0)), scheduler=schedule_pair)
    assert syn.synthesized and syn.pair_orders
    text = json.dumps(syn.to_dict())
    back = Plan.from_dict(json.loads(text))
    assert back == syn and json.dumps(back.to_dict()) == text
    assert compile_plan(back) == compile_plan(syn)
    d = plan.to_dict()
    assert "schedule" not in d and not plan.synthesized
    assert set(d) == {"name", "template", "pp", "vpp", "num_microbatches", "partition", "overlap", "split_w",
                      "pair_orders"}
    assert Plan.from_dict(json.loads(json.dumps(d))) == plan


def test_check_schedule_errors_are_one_line_naming_plan_schedule():
    costs = costs_of(2, 1)
    plan = apply_policy(costs, baseline_plan(costs, "1f1b", 2, 1, 4), Policy(), scheduler=schedule_pair)
    bad = (plan.schedule[:1],  # one rank's list for pp=2
           (plan.schedule[0] + (Instr(Op.SEND_ACT, mb=0, chunk=0, peer=1),), plan.schedule[1]),  # not compute
           (plan.schedule[0], plan.schedule[1] + (Instr(Op.F, mb=4, chunk=1),)))  # chunk 1 with vpp=1
    for sched, needle in zip(bad, ("1 ranks", "send_act", "chunks 0..0")):
        with pytest.raises(TesseraConfigError) as e:
            compile_plan(dataclasses.replace(plan, schedule=sched))
        msg = str(e.value)
        assert msg.startswith("plan.schedule=") and "\n" not in msg and needle in msg and "fix:" in msg, msg


@pytest.mark.parametrize("template,vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("dualpipe-v", 2)])
def test_with_split_w_splits_a_synthesized_w_in_b_order(template, vpp):
    """A synthesized W-in-B order, W split off: each backward that carried W (and each ``FB``'s
    unless the template keeps W in its pairs) now without it, followed by ``register_w`` and
    ``W``; everything else as it was; the Programs validate and keep the order's rules."""
    costs = costs_of(2, vpp)
    plan = baseline_plan(costs, template, 2, vpp, 4, split_w=False)
    syn = apply_policy(costs, plan, Policy("depth", "depth", False, (2, 1), (1.0, 0.5)), scheduler=schedule_pair)
    keeps = get_template(template).fb_keeps_w
    split = with_split_w(syn, keeps)
    assert split.split_w and split.partition == syn.partition and split.pair_orders == syn.pair_orders
    for before, after in zip(syn.schedule, split.schedule):
        out = list(after)
        for ins in before:
            head = out.pop(0)
            if ins.with_w and (ins.op == Op.B or not keeps):
                mb, c = (ins.mb, ins.chunk) if ins.op == Op.B else (ins.mb2, ins.chunk2)
                assert head == dataclasses.replace(ins, with_w=False)
                assert out[:2] == [Instr(Op.REGISTER_W, mb=mb, chunk=c), Instr(Op.W, mb=mb, chunk=c)]
                del out[:2]
            else:
                assert head == ins
        assert not out
    progs = compile_plan(split)
    validate_programs(progs)
    check_order(split, progs)
    assert with_split_w(plan) == dataclasses.replace(plan, split_w=True)  # a template plan: the flag only


# --------------------------------------------------------------------------------------------
# the engine: synthesized orders in the one 4-rank launch of tests/test_engine.py

SYN = tuple(sc for sc in eng.SCENARIOS if sc.policy is not None)


def template_plan(sc, costs) -> Plan:
    """The plan whose order a ``syn_*`` scenario re-synthesises (the baseline's partition)."""
    return baseline_plan(costs, sc.template, sc.pp, sc.vpp, sc.microbatches, overlap=True, split_w=sc.split_w)


def synthesized_plan(sc, costs) -> Plan:
    """The scenario's order: the list scheduler under ``sc.policy`` (the scheduler's pair orders)."""
    return apply_policy(costs, template_plan(sc, costs), sc.policy, scheduler=schedule_pair)


def synthesized_programs(sc, costs):
    """The validated Programs of a ``syn_*`` scenario. With ``slots`` the bubble optimizer is on:
    W split off the (W-in-B) order as the driver's switch does, slot annotations with W deferred
    (as :func:`tessera.flow.compile_programs` under ``dbo.enabled``), so the slot policy moves W."""
    plan = synthesized_plan(sc, costs)
    if sc.slots:
        plan = with_split_w(plan, get_template(plan.template).fb_keeps_w)
        progs = annotate_slots(compile_plan(plan), moe_layers(costs), defer_w=True)
    else:
        progs = compile_plan(plan)
    validate_programs(progs)
    return progs


def test_engine_scenarios_run_really_synthesized_orders():
    """Each ``syn_*`` scenario's order differs from its template's, and all together they move
    pairs, defer W, deepen the warm-up, on pp 2 (vpp 1, 2, 3), 3 and 4, with W split and in B."""
    kinds = set()
    for sc in SYN:
        costs = eng.costs_for(sc)
        plan = synthesized_plan(sc, costs)
        base = template_plan(sc, costs)
        assert plan.schedule != compute_schedule(sc.template, sc.pp, sc.vpp, sc.microbatches, True, sc.split_w), sc.name
        changes = rank_changes(base, plan.schedule)
        template_w = rank_changes(base, compute_schedule(sc.template, sc.pp, sc.vpp, sc.microbatches, True, sc.split_w))
        mine = {"moved pairs" for c in changes if c.moved_pairs} | {"deeper warm-up" for c in changes
                                                                   if c.warmup > c.warmup_template}
        mine |= {"deferred W" for c, t in zip(changes, template_w) if c.deferred_w > t.deferred_w}
        assert mine, sc.name
        kinds |= mine
        progs = synthesized_programs(sc, costs)
        if sc.slots:
            assert any(i.op == Op.SLOT for p in progs for i in p.instructions)
    assert kinds == {"moved pairs", "deeper warm-up", "deferred W"}
    assert {(sc.pp, sc.vpp) for sc in SYN} >= {(2, 1), (2, 2), (2, 3), (3, 1), (4, 1)}
    assert {sc.split_w for sc in SYN} == {True, False} and any(sc.slots for sc in SYN)


@pytest.mark.parametrize("name", [sc.name for sc in SYN])
def test_engine_scenario_orders_keep_the_rules(name):
    """The order each ``syn_*`` scenario runs keeps the synthesizer's rules (:func:`check_order`),
    the reason its result can be bitwise the reference's."""
    sc = next(s for s in SYN if s.name == name)
    plan = synthesized_plan(sc, eng.costs_for(sc))
    check_order(plan, compile_plan(plan), f"{name}: ")


_deterministic = eng._deterministic  # references as tests/test_engine.py computes them (1 thread, deterministic)


@pytest.fixture
def dist_results():
    return eng.launch()  # the launch of tests/test_engine.py (built once per process)


@pytest.mark.xdist_group("engine")
@pytest.mark.parametrize("name", [sc.name for sc in SYN])
def test_synthesized_order_trains_bitwise_like_the_reference(dist_results, name):
    """Per chunk the synthesized order keeps forwards, backwards and W in microbatch order, so
    every weight gradient sums its microbatches as the reference does: torch.equal after 2-3
    Adam steps. The ranks ran the synthesized Programs (their ``FB`` pair orders)."""
    sc = next(s for s in SYN if s.name == name)
    got = eng.merged_state(dist_results, name)
    eng.assert_state_equal(got, eng.reference(name).state)
    initial = global_state_dict(StageModule(eng.model_spec(sc.layers), (-1, sc.layers + 1), seed=eng.SEED))
    assert any(not torch.equal(got[k], initial[k]) for k in initial)
    progs = synthesized_programs(sc, eng.costs_for(sc))
    ran = [(rank, res[name]) for rank, res in enumerate(dist_results) if res[name] is not None]
    assert len(ran) == sc.pp * sc.dp
    for rank, res in ran:
        assert res["fb_orders"] == [i.order for i in progs[rank % sc.pp].instructions if i.op == Op.FB], (name, rank)
        assert res["pool_after"] == [0] * len(sc.seqs)


@pytest.mark.xdist_group("engine")
def test_slot_policy_moves_the_w_of_a_synthesized_order(dist_results):
    """The bubble optimizer's case: W split off a synthesized W-in-B order and deferred past the
    next compute instruction (:func:`annotate_slots`); the slot policy ran W early in slots
    (``slot_runs``), the pool was empty after every step, and the result is the reference's."""
    dbo = [sc for sc in SYN if sc.slots]
    assert dbo
    for sc in dbo:
        progs = synthesized_programs(sc, eng.costs_for(sc))
        assert any(i.op == Op.W and prev.op != Op.REGISTER_W for p in progs
                   for prev, i in zip(p.instructions, p.instructions[1:])), sc.name  # W deferred
        assert sum(res[sc.name]["slot_runs"] for res in dist_results) >= 1, sc.name
        assert all(res[sc.name]["max_pool"] >= 1 for res in dist_results), sc.name
        eng.assert_state_equal(eng.merged_state(dist_results, sc.name), eng.reference(sc.name).state)
