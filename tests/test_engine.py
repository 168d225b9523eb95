"""The execution engine against the single-process reference, bitwise (torch.equal).

One 4-rank gloo launch (pp=2 x dp=2, ep=2; deterministic algorithms) runs every multi-process
scenario in turn (see SCENARIOS); the parent computes the matching references in-process and
compares the final parameters of every rank under global names. Model: tiny-qwen3-next cut to
4 layers (DeltaNet x3 + gated attention, all MoE with a shared expert; 6 where a scenario needs
more stages), hidden 64, seq 16, mbs 1.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.engine import (Batch, Engine, EngineError, Layout, MovablePool, MovableTask, NoopChunk, OldestFirst,
                            TorchChunk, make_groups, reduce_gradients)
from tessera.testing import WorkerError, global_state_dict, reference_train, run_local
from tessera.errors import TesseraConfigError
from tessera.model import MoEOptions, StageModule
from tessera.plan.baseline import baseline_plan
from tessera.plan.planner import make_plan
from tessera.plan.list_scheduler import Policy
from tessera.program.plan import Plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Instr, Op, PairOrder
from tessera.program.templates import co_executed_pairs
from tessera.sched.chunkdag import pair_dag
from tessera.sched.structure import named_order
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

pytestmark = pytest.mark.xdist_group("engine")  # module fixtures built once (tests/conftest.py)

SEED, LR, WORLD, TIMEOUT_S = 7, 3e-3, 4, 200


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One multi-process run: a Program family, a layout and the data shape."""

    name: str
    template: str = "1f1b"
    pp: int = 2
    vpp: int = 1
    dp: int = 2
    ep: int = 2
    microbatches: int = 4
    split_w: bool = True
    pair_orders: bool = False
    planner: bool = False  # the Tessera plan of make_plan (its partition and pair orders)
    slots: bool = False
    seqs: tuple[int, ...] = (16, 16, 16)
    force_route: bool = False
    policy: Policy | None = None  # the rank orders synthesized under it (tests/test_synthesis.py)
    layers: int = 4  # decoder layers of the model (model_spec)


SCENARIOS = (
    Scenario("1f1b"),
    Scenario("interleaved", template="interleaved-1f1b", vpp=2),
    Scenario("zb_h1", template="zb-h1"),
    Scenario("zb_v", template="zb-v", vpp=2),
    Scenario("tessera", pair_orders=True),
    Scenario("tessera_plan", template="interleaved-1f1b", vpp=2, planner=True),
    Scenario("slots", slots=True),
    Scenario("no_split", split_w=False),
    Scenario("m8", microbatches=8, seqs=(16, 16)),
    Scenario("pp1_m8", pp=1, microbatches=8, seqs=(16, 16)),
    Scenario("varlen", seqs=(16, 24, 12)),
    Scenario("one_rank", force_route=True, seqs=(16,)),
    # synthesized rank orders, checked in tests/test_synthesis.py
    Scenario("syn_1f1b", seqs=(16, 16), policy=Policy("breadth", "depth", True, (0, 0), (0.5, 0.5))),
    Scenario("syn_interleaved", template="interleaved-1f1b", vpp=2, seqs=(16, 16),
             policy=Policy("depth", "depth", True, (0, 1), (1.0, 0.5))),
    Scenario("syn_vpp3", template="interleaved-1f1b", vpp=3, layers=6, seqs=(16, 16),
             policy=Policy("depth", "mb", True, (2, 2), (1.0, 1.0))),
    Scenario("syn_zb_v", template="zb-v", vpp=2, seqs=(16, 16), policy=Policy("breadth", "depth", True, (2, 1),
                                                                               (1.0, 0.5))),
    Scenario("syn_dualpipe", template="dualpipe-v", vpp=2, microbatches=8, seqs=(16, 16),
             policy=Policy("breadth", "depth", True, (2, 2), (0.0, 0.0))),
    Scenario("syn_dualpipe_w_in_b", template="dualpipe-v", vpp=2, split_w=False, seqs=(16, 16),
             policy=Policy("depth", "depth", False, (2, 2), (1.0, 1.0))),
    Scenario("syn_dbo", template="interleaved-1f1b", vpp=2, split_w=False, slots=True, seqs=(16, 16),
             policy=Policy("depth", "depth", False, (0, 0), (1.0, 1.0))),
    Scenario("syn_pp4", pp=4, dp=1, ep=1, microbatches=6, seqs=(16, 16),
             policy=Policy("breadth", "depth", True, (0, 0, 1, 0), (1.0, 1.0, 0.5, 1.0))),
    Scenario("syn_pp3", template="zb-h1", pp=3, dp=1, ep=1, microbatches=6, seqs=(16, 16),
             policy=Policy("breadth", "depth", True, (0, 0, 0), (0.5, 0.5, 0.5))),
)


def model_spec(layers: int = 4):
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:layers])


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


def batches(sc: Scenario) -> list[list[Batch]]:
    """``[step][replica]`` next-token batches of random bytes."""
    g = torch.Generator().manual_seed(SEED)  # same data for scenarios of the same shape
    return [[Batch.from_tokens(torch.randint(0, 256, (sc.microbatches, 1, s + 1), generator=g)) for _ in range(sc.dp)]
            for s in sc.seqs]


def force_first_owner(module: StageModule) -> None:
    """Router weights with which every token picks two of experts 0-3 (EP rank 0's): rows 0/1
    and 2/3 are +-u and +-v (one of each pair has a positive logit), experts 4-7 get logit 0."""
    with torch.no_grad():
        for layer in module.layers:
            w = layer.moe.gate.wg.weight
            u, v = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(layer.index))
            w.zero_()
            w[0], w[1], w[2], w[3] = 50 * u, -50 * u, 50 * v, -50 * v


def costs_for(sc: Scenario):
    return analytic_costs(model_spec(sc.layers), get_hardware("cpu"), ParallelConfig(
        pp=sc.pp, vpp=sc.vpp, ep=sc.ep, dp=sc.dp, num_microbatches=sc.microbatches, micro_batch_size=1, seq_length=16))


def programs(sc: Scenario):
    costs = costs_for(sc)
    if sc.policy is not None:
        from test_synthesis import synthesized_programs

        return synthesized_programs(sc, costs)
    if sc.planner:
        return compile_plan(tessera_plan(sc, costs))
    plan = baseline_plan(costs, sc.template, sc.pp, sc.vpp, sc.microbatches, overlap=True, split_w=sc.split_w)
    if sc.pair_orders:
        plan = dataclasses.replace(plan, name="tessera", pair_orders=tessera_orders(plan, costs))
    progs = compile_plan(plan)
    if sc.slots:
        progs = tuple(with_slots(p) for p in progs)
    return progs


def tessera_plan(sc: Scenario, costs) -> Plan:
    """The plan ``make_plan`` picks (MILP partition + the pair scheduler's order per pair). Here its
    partition equals the baseline's: 4 decoder layers over pp*vpp = 4 stages leave one layer per
    stage, so no candidate moves a layer; the scenario still exercises the planner's pair orders
    (the reference is partition-independent, so a moved layer would need no change)."""
    return make_plan(costs, template=sc.template, pp=sc.pp, vpp=sc.vpp, num_microbatches=sc.microbatches,
                     overlap=True, split_w=sc.split_w, radius=1).tessera


def with_slots(prog):
    """Every W deadline moved to just before reduce_grads and an idle-slot annotation before
    every compute instruction: the slot policy, not the template, decides when most W run."""
    body = [i for i in prog.instructions if i.op not in (Op.W, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP)]
    body = [x for ins in body for x in (((Instr(Op.SLOT, ins.mb, ins.chunk), ins)) if ins.op in (Op.F, Op.B, Op.FB)
                                        else (ins,))]
    tail = [i for i in prog.instructions if i.op in (Op.W, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP)]
    return dataclasses.replace(prog, instructions=tuple(body + tail))


def tessera_orders(plan: Plan, costs) -> tuple[PairOrder, ...]:
    """Pair orders from the pair scheduler (else the DAG's topological order: valid, not fixed)."""
    try:
        from tessera.plan.pair_scheduler import schedule_pair
    except ImportError:
        schedule_pair = None
    out = []
    for _, fs, bs in co_executed_pairs(plan.template, plan.pp, plan.vpp, plan.num_microbatches):
        dag = pair_dag(costs, plan.partition.stage_range(fs), plan.partition.stage_range(bs), not plan.split_w)
        order = schedule_pair(dag).order_dict() if schedule_pair else dag.default_order()
        out.append(PairOrder(fs, bs, not plan.split_w, named_order(dag, order)))
    return tuple(out)


def run_scenario(sc: Scenario, rank: int, groups_cache: dict) -> dict | None:
    layout = Layout(sc.pp, sc.dp, sc.ep)
    if layout not in groups_cache:
        groups_cache[layout] = make_groups(layout)
    groups = groups_cache[layout]
    if groups is None:
        return None
    prog = programs(sc)[groups.pipeline_rank]
    model = model_spec(sc.layers)
    mods = [StageModule(model, (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    if sc.force_route:
        for m in mods:
            force_first_owner(m)
    engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]),
                    slot_policy=OldestFirst(2) if sc.slots else None)
    out = {"max_pool": 0, "pool_after": [], "slot_runs": 0, "idle_ms": [], "slot_ms": [], "slot_steps_ms": [],
           "first_f_ms": [], "fb_orders": [i.order for i in prog.instructions if i.op == Op.FB]}
    first_f = next(i for i, ins in enumerate(prog.instructions) if ins.op in (Op.F, Op.FB))
    for step in batches(sc):
        engine.begin(step[groups.replica])
        slot_steps = first_f_ms = 0.0
        while True:
            before = len(engine.pool)
            if (rec := engine.advance()) is None:
                break
            slot_steps += rec.ms if rec.op == "slot" else 0.0
            first_f_ms += rec.ms if rec.index == first_f else 0.0
            out["max_pool"] = max(out["max_pool"], len(engine.pool))
            out["slot_runs"] += before - len(engine.pool) if rec.op == "slot" else 0
            if sc.force_route and rec.op == "reduce_grads":
                out["grads"] = {n: p.grad.clone() for m in mods for n, p in _global_params(m).items()}
        out["pool_after"].append(len(engine.pool) + sum(len(c.store) for c in engine.chunks))
        out["idle_ms"].append(engine.idle_ms)
        out["slot_ms"].append(engine.slot_ms)
        out["slot_steps_ms"].append(slot_steps)
        out["first_f_ms"].append(first_f_ms)
    out["state"] = {k: v for m in mods for k, v in global_state_dict(m).items()}
    return out


def _global_params(module: StageModule) -> dict:
    names = list(global_state_dict(module))
    return dict(zip(names, [p for _, p in _ordered_params(module)]))


def _ordered_params(module: StageModule):
    for layer in module.layers:
        yield from layer.named_parameters()
    for sub in (module.embed, module.head):
        if sub is not None:
            yield from sub.named_parameters()


def error_checks(rank: int, groups_cache: dict) -> dict:
    """Bad batches raise clear errors on every rank (no hang); the engine works afterwards."""
    sc = Scenario("errors")
    groups = groups_cache.setdefault(Layout(2, 2, 2), make_groups(Layout(2, 2, 2)))
    prog = programs(sc)[groups.pipeline_rank]
    mods = [StageModule(model_spec(), (s.start, s.stop), ep_group=groups.ep, seed=SEED) for s in prog.stages]
    engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]))
    ids = torch.randint(0, 256, (4, 1, 16))
    out = {}
    try:
        Batch(ids, ids[..., :-1])
    except ValueError as e:
        out["labels"] = str(e)
    seq = 16 if groups.pipeline_rank == 0 else 20  # the two stages disagree on seq_length
    try:
        engine.run_iteration(Batch(ids.new_zeros(4, 1, seq), ids.new_zeros(4, 1, seq)))
    except EngineError as e:
        out["shape"] = str(e)
    out["loss_after"] = engine.run_iteration(Batch(ids, ids)).loss
    return out


def ordered_reduce_check(rank: int) -> dict:
    """``reduce_gradients(ordered=True)`` over 4 ranks equals ((g0 + g1) + g2) + g3, then scaled."""
    p = torch.nn.Parameter(torch.zeros(1000))
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(WORLD)]
    p.grad = grads[rank].clone()
    reduce_gradients([p], torch.distributed.group.WORLD, 0.25, ordered=True)
    want = grads[0].clone()
    for g in grads[1:]:
        want = want + g
    return {"equal": torch.equal(p.grad, want.mul_(0.25))}


def world(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    torch.use_deterministic_algorithms(True)
    cache: dict = {}
    res = {sc.name: run_scenario(sc, rank, cache) for sc in SCENARIOS if sc.name in names}
    res["errors"] = error_checks(rank, cache)
    res["ordered_reduce"] = ordered_reduce_check(rank)
    return res


@functools.lru_cache(maxsize=None)
def launch() -> list:
    """The one launch of every scenario, per rank its results (shared with tests/test_synthesis.py)."""
    return run_local(functools.partial(world, names=tuple(sc.name for sc in SCENARIOS)), WORLD, TIMEOUT_S)


@pytest.fixture(scope="module")
def dist_results():
    return launch()


@pytest.fixture(autouse=True)
def _deterministic():
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.set_num_threads(old_threads)
    torch.use_deterministic_algorithms(old_det)


def reference(name: str):
    """The reference of a scenario; it depends only on the data, EP shape and model, not on the pipeline
    (template, pp, vpp, partition, pair orders, split W), so scenarios of the same shape share it."""
    sc = next(s for s in SCENARIOS if s.name == name)
    return _reference(sc.microbatches, sc.dp, sc.seqs, sc.ep, sc.force_route, sc.layers)


@functools.lru_cache(maxsize=None)
def _reference(microbatches: int, dp: int, seqs: tuple[int, ...], ep: int, force_route: bool, layers: int = 4):
    sc = Scenario("reference", microbatches=microbatches, dp=dp, seqs=seqs, ep=ep, force_route=force_route)
    return reference_train(model_spec(layers), batches(sc), ep=ep, seed=SEED, make_optimizer=make_optimizer,
                           prepare=force_first_owner if force_route else None)


def merged_state(results: list, name: str) -> dict:
    """Union of the ranks' parameters; replicas must agree exactly."""
    out: dict = {}
    for res in results:
        if res[name] is None:
            continue
        for k, v in res[name]["state"].items():
            if k in out:
                assert torch.equal(out[k], v), f"replicas disagree on {k}"
            out[k] = v
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} of {len(want)} parameters differ, e.g. {bad[:4]}"


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb_h1", "zb_v", "tessera", "tessera_plan", "slots", "no_split",
                                  "m8", "pp1_m8", "varlen"])
def test_bitwise_equal_to_reference(dist_results, name):
    got = merged_state(dist_results, name)
    assert_state_equal(got, reference(name).state)
    initial = global_state_dict(StageModule(model_spec(), (-1, 5), seed=SEED))
    assert any(not torch.equal(got[k], initial[k]) for k in initial)  # it trained


def test_zero_bubble_templates_equal_1f1b(dist_results):
    """zb-h1 (W deferred by the rank) and zb-v (V placement, W deferred in the cooldown) train
    bitwise like 1f1b: the same data and EP shape, a different pipeline."""
    want = merged_state(dist_results, "1f1b")
    for name in ("zb_h1", "zb_v"):
        assert_state_equal(merged_state(dist_results, name), want)


def test_gradient_scaled_once_whatever_pp(dist_results):
    assert_state_equal(merged_state(dist_results, "m8"), merged_state(dist_results, "pp1_m8"))


def test_split_w_off_equals_split_w_on(dist_results):
    assert_state_equal(merged_state(dist_results, "no_split"), merged_state(dist_results, "1f1b"))


def test_pool_used_and_empty_after_every_step(dist_results):
    for res in dist_results:
        for name in ("1f1b", "interleaved", "tessera", "tessera_plan", "slots", "varlen"):
            assert res[name]["max_pool"] >= 1 and res[name]["pool_after"] == [0] * len(res[name]["pool_after"])
        assert res["no_split"]["max_pool"] == 0
        assert res["slots"]["slot_runs"] >= 1 and res["1f1b"]["slot_runs"] == 0  # W run early by the policy


def test_idle_and_slot_time_measured_on_the_fast_path(dist_results):
    """The bubble metric's inputs without profiling: the last stage's first receive is waited
    inside its first forward task, so its idle time covers most of the first stage's forward of
    mb 0 (both start together after begin's shape all_reduce); ``slot_ms`` is the time of the W
    the slot policy ran in slot steps: within the slot steps' times, and positive where it ran W."""
    for replica in range(2):
        first, last = dist_results[2 * replica], dist_results[2 * replica + 1]
        for idle, f_ms in zip(last["1f1b"]["idle_ms"], first["1f1b"]["first_f_ms"]):
            assert idle >= 0.5 * f_ms > 0, (idle, f_ms)
    for res in dist_results:
        assert all(0.0 <= a <= b for a, b in zip(res["slots"]["slot_ms"], res["slots"]["slot_steps_ms"]))
        assert res["1f1b"]["slot_ms"] == [0.0, 0.0, 0.0]
    assert sum(sum(res["slots"]["slot_ms"]) for res in dist_results) > 0


def test_all_tokens_on_one_ep_rank(dist_results):
    for rank, res in enumerate(dist_results):
        grads = {k: g for k, g in res["one_rank"]["grads"].items() if ".moe.experts." in k}
        assert grads
        for k, g in grads.items():
            expert = int(k.split(".moe.experts.")[1].split(".")[0])
            if expert >= 4:  # EP rank 1's experts: no token reached them
                assert torch.equal(g, torch.zeros_like(g)), k
            else:
                assert g.abs().sum() > 0, k
    assert_state_equal(merged_state(dist_results, "one_rank"), reference("one_rank").state)


def test_bad_batches_raise_clear_errors(dist_results):
    for res in dist_results:
        err = res["errors"]
        assert "labels have shape (4, 1, 15) but input_ids have (4, 1, 16)" in err["labels"]
        assert "differs across the pipeline" in err["shape"] and "seq_length 16..20" in err["shape"]
    assert all(res["errors"]["loss_after"] is not None for res in dist_results[1::2])  # head ranks


def test_single_process_engine_matches_reference_and_plain_autograd():
    """pp=1 in-process, interleaved (two local chunks, local hand-over); the reference is also
    allclose to plain autograd of the whole model (the task split changes only summation order)."""
    sc = Scenario("local", template="interleaved-1f1b", pp=1, vpp=2, dp=1, ep=1, seqs=(16, 16))
    prog = programs(sc)[0]
    mods = [StageModule(model_spec(), (s.start, s.stop), seed=SEED) for s in prog.stages]
    engine = Engine(prog, mods, None, make_optimizer([p for m in mods for p in m.parameters()]))
    data = batches(sc)
    losses = [engine.run_iteration(step[0]).loss for step in data]
    ref = reference_train(model_spec(), data, seed=SEED, make_optimizer=make_optimizer)
    assert_state_equal({k: v for m in mods for k, v in global_state_dict(m).items()}, ref.state)
    assert losses == pytest.approx(ref.losses, rel=1e-6)  # float32 mean vs Python float mean
    # plain autograd of the whole model, one SGD step (Adam would amplify rounding of ~0 grads).
    # The aux-loss gradient enters at coef * aux_loss_scale whatever the loss is divided by, so
    # the plain run divides it by M explicitly (the engine scales every gradient once, at reduce).
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    ref1 = reference_train(model_spec(), data[:1], seed=SEED, make_optimizer=sgd)
    plain = StageModule(model_spec(), (-1, 5), seed=SEED, moe=MoEOptions(aux_loss_scale=1 / sc.microbatches))
    start = global_state_dict(plain)
    for mb in range(sc.microbatches):
        (plain(data[0][0].input_ids[mb], data[0][0].labels[mb]) / sc.microbatches).backward()
    sgd(plain.parameters()).step()
    for k, v in global_state_dict(plain).items():  # the SGD updates agree to ~1e-5 relative
        torch.testing.assert_close(v - start[k], ref1.state[k] - start[k], rtol=1e-3, atol=1e-6, msg=k)


def test_fsm_steps_and_noop_engine():
    """advance() walks task boundaries; the no-op executor runs the same Program without work."""
    sc = Scenario("fsm", pp=1, dp=1, ep=1, seqs=(16,))
    prog = programs(sc)[0]
    chunk = TorchChunk(StageModule(model_spec(), (prog.stages[0].start, prog.stages[0].stop), seed=SEED))
    engine = Engine(prog, [NoopChunk.like(chunk)], None, None, task_costs=costs_for(sc))
    engine.begin(batches(sc)[0][0])
    records = []
    while (rec := engine.advance()) is not None:
        records.append(rec)
    assert records[0].task == "F.L-1.embed" and records[-1].op == "optimizer_step"
    fb = [r.task for r in records if r.op == "FB"]
    assert fb and {t.split(".")[0] for t in fb} == {"F", "B"}
    assert {r.index for r in records} == set(range(len(prog.instructions)))
    with pytest.raises(EngineError, match="before begin"):
        engine.advance()


def test_tessera_plan_runs_scheduler_pair_orders(dist_results):
    """The Programs run in "tessera_plan" are make_plan's: FB instructions point at the scheduler's
    pair orders (order >= 0), not the template's fixed order (-1), on every rank."""
    sc = next(s for s in SCENARIOS if s.name == "tessera_plan")
    plan = tessera_plan(sc, costs_for(sc))
    assert plan.name == "tessera" and plan.pair_orders
    progs = compile_plan(plan)
    for rank, res in enumerate(dist_results):
        run = res["tessera_plan"]["fb_orders"]
        assert run == [i.order for i in progs[rank % sc.pp].instructions if i.op == Op.FB]
        assert run and any(o >= 0 for o in run), (rank, run)


def test_ordered_reduce_over_four_ranks(dist_results):
    assert all(res["ordered_reduce"]["equal"] for res in dist_results)


def test_pool_order_and_layout_checks():
    pool = MovablePool(max_pending=3)
    for mb in (1, 0, 2):
        pool.register(MovableTask(0, mb))
    with pytest.raises(ValueError, match="registered twice"):
        pool.register(MovableTask(0, 1))
    assert pool.due(MovableTask(0, 1)) == (MovableTask(0, 0), MovableTask(0, 1))  # microbatch order
    pool.mark_done(MovableTask(0, 0))
    assert pool.eligible(MovableTask(0, 1)) and not pool.eligible(MovableTask(1, 1))
    assert OldestFirst(1).select(None, pool) == (MovableTask(0, 1),)
    with pytest.raises(TesseraConfigError, match="must divide dp"):
        Layout(pp=2, dp=3, ep=2)
    lay = Layout(pp=2, dp=4, ep=2, base=1)
    assert lay.ep_ranks(1, 3) == (6, 8) and lay.expert_dp_ranks(0, 1) == (3, 7) and lay.pipeline_ranks(2) == (5, 6)


def _fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    torch.distributed.barrier()  # rank 0 would wait forever; the launcher must not


def test_launcher_reports_worker_failure():
    with pytest.raises(WorkerError, match="(?s)rank 1 failed.*boom on rank 1"):
        run_local(_fails, 2, timeout_s=60)


def test_engine_rejects_mismatched_chunks():
    sc = Scenario("fit", pp=1, dp=1, ep=1, seqs=(16,))
    prog = programs(sc)[0]
    wrong = StageModule(model_spec(), (-1, 3), seed=SEED)
    with pytest.raises(EngineError, match="holds layers"):
        Engine(prog, [wrong], None, None)
