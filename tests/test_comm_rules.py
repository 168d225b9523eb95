"""The communication rules NCCL imposes, checked on the real ``torch.distributed`` calls of gloo runs
(issue 31, :mod:`tessera.testing.recorder`).

* The recorder and the three checks on hand-made cases: in-process on constructed records, and in
  one 3-rank gloo launch that breaks each rule on purpose (a lone ``isend``, p2p on the default
  group, one exchange batched differently by its two ends, a group's collectives in two orders)
  next to a clean exchange: each check fails exactly where its rule is broken.
* The engine: three gloo launches (2, 3 and 4 ranks) record every rank's calls while they run,
  configuration after configuration (:data:`CONFIGS`): pp=2, 3 and 4 runs of every template, pp=2
  without split W, with activation recompute (full, and the MoE block with its all-to-alls),
  with the bubble optimizer (ep=2 x dp=2: the per-task and the joint layer-level policy), and a
  hot upgrade (step runner, two Program switches that reshard: a layer moved, then 1f1b to
  interleaved-1f1b). For each configuration, on the records of all its ranks: (a) no unbatched
  p2p and no p2p on the default group, (b) on each link batch k of one end matches batch k of
  the other, (c) per group, one sequence of collectives on every member; (c) also over each
  launch as a whole (groups created, every configuration in turn).

Model: tiny-qwen3-next cut to ``pp * vpp`` layers (one per stage), sequences of :data:`SEQ`
tokens, one sample per microbatch, :data:`STEPS` iterations per configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import pytest
import torch

from tessera.errors import TesseraConfigError
from tessera.program.templates import TEMPLATES, check_shape
from tessera.testing import run_local
from tessera.testing.recorder import (COLLECTIVE, P2P, P2P_BATCH, RECV, SEND, WORLD, CommRecord, CommRecorder,
                                      P2PRecord, RecorderError, check_all, check_collective_order, check_link_batches,
                                      check_p2p_batched, format_violations)

pytestmark = pytest.mark.xdist_group("comm_rules")  # module fixtures built once (tests/conftest.py)

SEED, SEQ, STEPS, TIMEOUT_S = 3, 8, 2, 300
ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")


# --------------------------------------------------------------------------- the checks on constructed records

def _batch(seq, rank, group, *ops, name="batch_isend_irecv", kind=P2P_BATCH):
    return CommRecord(seq, rank, kind, name, group, ops=tuple(ops))


def _send(peer, shape=(1, 8, 64), dtype="torch.float32"):
    return P2PRecord(SEND, peer, shape, dtype)


def _recv(peer, shape=(1, 8, 64), dtype="torch.float32"):
    return P2PRecord(RECV, peer, shape, dtype)


def _coll(seq, rank, group, name="all_reduce", shape=(4,), dtype="torch.int64", detail=(("op", "SUM"),), uneven=False):
    return CommRecord(seq, rank, COLLECTIVE, name, group, shape=shape, dtype=dtype, detail=detail, uneven=uneven)


G = (0, 1)


def test_clean_records_pass_every_check():
    r0 = [_batch(0, 0, G, _send(1)), _coll(1, 0, G), _batch(2, 0, G, _send(1), _recv(1))]
    r1 = [_batch(0, 1, G, _recv(0)), _coll(1, 1, G), _batch(2, 1, G, _recv(0), _send(0))]
    assert check_all([r0, r1]) == []
    assert check_all({0: r0, 1: r1}) == []


def test_unbatched_and_default_group_p2p_are_named():
    r0 = [_batch(0, 0, G, _send(1), kind=P2P, name="isend"), _batch(1, 0, WORLD, _send(1))]
    r1 = [_batch(0, 1, G, _recv(0)), _batch(1, 1, WORLD, _recv(0))]
    got = check_p2p_batched([r0, r1])
    assert [(v.rule, v.rank, v.group, v.position) for v in got] == [
        ("unbatched-p2p", 0, G, 0), ("p2p-on-default-group", 0, WORLD, 1), ("p2p-on-default-group", 1, WORLD, 1)]
    assert str(got[0]).startswith("rank 0: p2p call #0 is a lone isend(send to rank 1 [1, 8, 64] float32) on group "
                                  "(0, 1) (seq 0); every p2p operation must be posted by batch_isend_irecv")
    assert check_link_batches([r0, r1]) == []  # the same exchange, grouped alike on both ends


def test_link_batches_grouped_differently_shaped_differently_or_counted_differently():
    # rank 0 batches two sends, rank 1 receives them in two batches
    split = check_link_batches([[_batch(0, 0, G, _send(1), _send(1))], [_batch(0, 1, G, _recv(0)),
                                                                        _batch(1, 1, G, _recv(0))]])
    assert [(v.rule, v.rank, v.position) for v in split] == [("link-batches", 0, 0), ("link-batches", 0, 1)]
    assert str(split[0]) == ("link 0-1 on group (0, 1): batch #0 does not match (2 send(s) on one end against 1 "
                             "recv(s) on the other): rank 0 posts {send [1, 8, 64] float32, send [1, 8, 64] float32} "
                             "in batch_isend_irecv (seq 0, 2 op(s) in all), rank 1 posts {recv [1, 8, 64] float32} in "
                             "batch_isend_irecv (seq 0, 1 op(s) in all)")
    assert "rank 0 posts 1 batch(es) on the link, rank 1 2" in str(split[1])
    # same grouping, another dtype / shape
    dtype = check_link_batches([[_batch(0, 0, G, _send(1, dtype="torch.bfloat16"))], [_batch(0, 1, G, _recv(0))]])
    assert len(dtype) == 1 and "the sends and recvs differ in shape or dtype" in str(dtype[0])
    assert "{send [1, 8, 64] bfloat16}" in str(dtype[0])
    shape = check_link_batches([[_batch(0, 0, G, _recv(1, (2, 3)))], [_batch(0, 1, G, _send(0, (3, 2)))]])
    assert len(shape) == 1 and "recvs and sends differ" in str(shape[0])
    # projections: rank 1 batches with ranks 0 and 2 at once; each link sees only its own part
    three = [[_batch(0, 0, (0, 1, 2), _send(1))],
             [_batch(0, 1, (0, 1, 2), _recv(0), _send(2))],
             [_batch(0, 2, (0, 1, 2), _recv(1))]]
    assert check_link_batches(three) == []
    # the same link on two groups: each group's batches pair up on their own
    assert len(check_link_batches([[_batch(0, 0, G, _send(1))], [_batch(0, 1, (0, 1, 2), _recv(0))]])) == 2
    # a receive from any source
    anysrc = check_link_batches([[], [_batch(0, 1, G, P2PRecord(RECV, None, (2,), "torch.float32"), kind=P2P,
                                             name="irecv")]])
    assert len(anysrc) == 1 and "receives from any source" in str(anysrc[0])


def test_collectives_in_another_order_or_count_or_shape():
    a = _coll(0, 0, G)
    b = _coll(1, 0, G, detail=(("op", "MAX"),))
    swapped = check_collective_order([[a, b], [dataclasses.replace(b, rank=1, seq=0),
                                               dataclasses.replace(a, rank=1, seq=1)]])
    assert [(v.rule, v.rank, v.group, v.position) for v in swapped] == [("collective-order", 1, G, 0)]
    assert str(swapped[0]) == ("group (0, 1): collective #0 differs: rank 0 issues all_reduce [4] int64 op=SUM "
                               "on group (0, 1) (seq 0), rank 1 issues all_reduce [4] int64 op=MAX on group (0, 1) "
                               "(seq 0)")
    # two groups of the same ranks are two communicators: each has its own order
    g1, g2 = dataclasses.replace(a, group_name="1"), dataclasses.replace(b, group_name="2")
    assert check_collective_order([[g1, g2], [dataclasses.replace(g2, rank=1), dataclasses.replace(g1, rank=1)]]) == []
    assert len(check_link_batches([[_batch(0, 0, G, _send(1))],
                                   [dataclasses.replace(_batch(0, 1, G, _recv(0)), group_name="2")]])) == 2
    short = check_collective_order([[a, b], [dataclasses.replace(a, rank=1)]])
    assert len(short) == 1 and "rank 0 issues 2 collective(s), rank 1 1" in str(short[0])
    # a member that never issued the group's collective
    assert len(check_collective_order([[a], []])) == 1
    # the default group's members are the ranks given
    w = _coll(0, 0, WORLD, name="barrier", shape=None, dtype=None, detail=())
    assert len(check_collective_order([[w], [], [dataclasses.replace(w, rank=2)]])) == 1
    # an all-to-all with split sizes: the first dimension may differ, the rest may not
    rows = _coll(0, 0, G, "all_to_all_single", (5, 64), "torch.float32", (("split", True),), uneven=True)
    assert check_collective_order([[rows], [dataclasses.replace(rows, rank=1, shape=(9, 64))]]) == []
    assert len(check_collective_order([[rows], [dataclasses.replace(rows, rank=1, shape=(9, 32))]])) == 1
    even = dataclasses.replace(rows, detail=(("split", False),), uneven=False)
    assert len(check_collective_order([[even], [dataclasses.replace(even, rank=1, shape=(9, 64))]])) == 1


def test_install_wraps_and_uninstall_restores():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    before = {name: getattr(dist, name) for name in ("isend", "irecv", "batch_isend_irecv", "all_reduce", "new_group")}
    rec = CommRecorder()
    with rec:
        assert rec.installed
        for name, fn in before.items():
            assert getattr(dist, name) is not fn and getattr(dist, name).__tessera_recorded__ is fn
            assert getattr(c10d, name) is getattr(dist, name)  # P2POp's check and batch_isend_irecv see it
        with pytest.raises(RecorderError, match="already installed"):
            CommRecorder().install()
        c10d._check_op(dist.isend)  # P2POp accepts the wrapper (it checks against the module's isend)
    assert not rec.installed
    assert {name: getattr(dist, name) for name in before} == before
    assert all(getattr(c10d, name) is fn for name, fn in before.items())
    with pytest.raises(RecorderError, match="not installed"):
        rec.uninstall()


# --------------------------------------------------------------------------- the checks on a real gloo run

def handmade_world(rank: int, world_size: int) -> dict:
    """Each case on two of three ranks, the third idle; ``out[case]`` = this rank's records."""
    import torch.distributed as dist

    original_isend = dist.isend
    rec = CommRecorder().install()
    g01, g12, g01b = dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([0, 1])
    out = {"setup": rec.take()}
    x = torch.full((2, 3), float(rank))

    def done(works):
        for w in works:
            w.wait()

    # clean: ranks 1 and 2 exchange in one batch each on their group (group ranks != global ranks)
    if rank in (1, 2):
        peer, buf = 3 - rank, torch.empty(2, 3)
        done(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, group=g12),
                                     dist.P2POp(dist.isend, x, peer, group=g12)]))
        out["clean_value"] = buf
        t = torch.tensor([rank])
        dist.all_reduce(t, group=g12)
        out["clean_sum"] = int(t)
    out["clean"] = rec.take()
    # lone: rank 1 posts a plain isend (group rank 1 of g12 = global 2), rank 2 a batch of one
    if rank == 1:
        dist.isend(x, group=g12, group_dst=1).wait()
    elif rank == 2:
        buf = torch.empty(2, 3)
        done(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1, group=g12)]))
    out["lone"] = rec.take()
    # world: ranks 0 and 1 exchange on the default group
    if rank in (0, 1):
        done(dist.batch_isend_irecv([dist.P2POp(dist.isend if rank == 0 else dist.irecv,
                                                x if rank == 0 else torch.empty(2, 3), 1 - rank)]))
    out["world"] = rec.take()
    # split: rank 0 sends two messages in one batch, rank 1 receives them in two
    if rank == 0:
        done(dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1, group=g01),
                                     dist.P2POp(dist.isend, x + 1, 1, group=g01)]))
    elif rank == 1:
        a, b = torch.empty(2, 3), torch.empty(2, 3)
        done(dist.batch_isend_irecv([dist.P2POp(dist.irecv, a, 0, group=g01)]))
        done(dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0, group=g01)]))
        out["split_values"] = (a, b)
    out["split"] = rec.take()
    # order: ranks 0 and 1 issue a SUM and a MAX all-reduce in opposite orders (gloo completes it)
    if rank in (0, 1):
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
        for op in ops if rank == 0 else ops[::-1]:
            dist.all_reduce(torch.ones(4), op=op, group=g01)
    out["order"] = rec.take()
    # two communicators of ranks 0 and 1, used in opposite orders (asynchronous: gloo completes it)
    if rank in (0, 1):
        pair = [g01, g01b] if rank == 0 else [g01b, g01]
        works = [dist.all_reduce(torch.ones(2), group=g, async_op=True) for g in pair]
        done(works)
    out["two_groups"] = rec.take()
    # objects: one record per object collective (not their inner all_gather / broadcast)
    got = [None] * world_size
    dist.all_gather_object(got, {"rank": rank})
    box = [rank * 10]
    dist.broadcast_object_list(box, src=2)
    out["objects_values"] = (got, box)
    out["objects"] = rec.take()
    out["errors"] = rec.errors
    rec.uninstall()
    out["restored"] = dist.isend is original_isend
    return out


@pytest.fixture(scope="module")
def handmade():
    return run_local(handmade_world, 3, TIMEOUT_S)


def _case(results, case):
    return [r[case] for r in results]


def test_recorder_on_a_real_run_records_each_call_once_with_global_peers(handmade):
    for rank, r in enumerate(handmade):
        assert r["errors"] == [] and r["restored"]
        assert [(x.name, x.group, x.detail) for x in r["setup"]] == [
            ("new_group", WORLD, (("ranks", ranks), ("backend", None))) for ranks in ((0, 1), (1, 2), (0, 1))]
    # behaviour unchanged: the values arrived
    assert torch.equal(handmade[1]["clean_value"], torch.full((2, 3), 2.0))
    assert handmade[1]["clean_sum"] == handmade[2]["clean_sum"] == 3
    a, b = handmade[1]["split_values"]
    assert torch.equal(a, torch.zeros(2, 3)) and torch.equal(b, torch.ones(2, 3))
    assert handmade[0]["objects_values"] == ([{"rank": 0}, {"rank": 1}, {"rank": 2}], [20])
    # the batch once (not its inner isend / irecv), the peers as global ranks, the group's ranks
    c1 = handmade[1]["clean"]
    assert [(x.kind, x.name, x.group) for x in c1] == [(P2P_BATCH, "batch_isend_irecv", (1, 2)),
                                                        (COLLECTIVE, "all_reduce", (1, 2))]
    assert c1[0].group_name == c1[1].group_name == handmade[2]["clean"][0].group_name is not None
    assert c1[0].ops == (P2PRecord(RECV, 2, (2, 3), "torch.float32"), P2PRecord(SEND, 2, (2, 3), "torch.float32"))
    assert c1[0].stream is None and c1[1].detail == (("op", "SUM"),) and c1[1].shape == (1,)
    assert [x.seq for x in handmade[1]["setup"] + c1] == [0, 1, 2, 3, 4]
    lone = handmade[1]["lone"]
    assert [(x.kind, x.name, x.group, x.ops) for x in lone] == [
        (P2P, "isend", (1, 2), (P2PRecord(SEND, 2, (2, 3), "torch.float32"),))]
    assert handmade[0]["clean"] == [] and handmade[0]["lone"] == []
    two = [[(x.group, x.group_name) for x in r["two_groups"]] for r in handmade[:2]]
    assert two[0] == two[1][::-1] and two[0][0][0] == two[0][1][0] == (0, 1) and two[0][0][1] != two[0][1][1]
    objs = handmade[2]["objects"]
    assert [(x.name, x.group, x.shape, x.detail) for x in objs] == [
        ("all_gather_object", WORLD, (3,), ()), ("broadcast_object_list", WORLD, (1,), (("src", 2),))]


def test_each_check_fails_on_the_case_that_breaks_its_rule(handmade):
    def rules(case):
        return sorted({v.rule for v in check_all(_case(handmade, case))})

    assert rules("clean") == [] and rules("objects") == [] and rules("setup") == [] and rules("two_groups") == []
    assert rules("lone") == ["unbatched-p2p"]
    assert rules("world") == ["p2p-on-default-group"]
    assert rules("split") == ["link-batches"]
    assert rules("order") == ["collective-order"]
    lone = check_p2p_batched(_case(handmade, "lone"))
    assert [(v.rank, v.group, v.position) for v in lone] == [(1, (1, 2), 0)]
    assert "lone isend(send to rank 2 [2, 3] float32) on group (1, 2)" in str(lone[0])
    world = check_p2p_batched(_case(handmade, "world"))
    assert [(v.rank, v.group) for v in world] == [(0, WORLD), (1, WORLD)]
    split = check_link_batches(_case(handmade, "split"))
    assert [(v.rank, v.group, v.position) for v in split] == [(0, (0, 1), 0), (0, (0, 1), 1)]
    order = check_collective_order(_case(handmade, "order"))
    assert [(v.rank, v.group, v.position) for v in order] == [(1, (0, 1), 0)]
    assert "rank 0 issues all_reduce [4] float32 op=SUM" in str(order[0])
    assert "rank 1 issues all_reduce [4] float32 op=MAX" in str(order[0])


# --------------------------------------------------------------------------- the engine's runs


@dataclasses.dataclass(frozen=True)
class Config:
    """One engine run inside a launch: a template's Programs on a layout, with its features."""

    name: str
    template: str
    pp: int
    vpp: int
    m: int
    dp: int = 1
    ep: int = 1
    split_w: bool = True
    recompute: str | None = None  # "full" | "moe" (the MoE block with its all-to-alls)
    dbo: str | None = None  # "task" (DBOPolicy) | "joint" (JointDBOPolicy)

    @property
    def layers(self) -> int:
        return self.pp * self.vpp


def _vpp(template: str) -> int:
    return 1 if template in ("1f1b", "zb-h1") else 2


def _microbatches(template: str, pp: int) -> int:
    """The fewest microbatches (at least ``pp``) the template runs at this shape."""
    for m in itertools.count(pp):
        try:
            check_shape(template, pp, _vpp(template), m, pp * _vpp(template))
            return m
        except TesseraConfigError:
            if m > 4 * pp:
                raise


def _template_configs(pp: int) -> list[Config]:
    return [Config(f"pp{pp}-{t}", t, pp, _vpp(t), _microbatches(t, pp)) for t in sorted(TEMPLATES)]


EP = dict(pp=2, vpp=1, m=4, dp=2, ep=2)
CONFIGS: dict[int, list[Config]] = {
    2: _template_configs(2) + [
        Config("pp2-1f1b-fused-w", "1f1b", 2, 1, 2, split_w=False),
        Config("pp2-interleaved-fused-w", "interleaved-1f1b", 2, 2, 2, split_w=False),
        Config("pp2-dualpipe-v-fused-w", "dualpipe-v", 2, 2, 4, split_w=False),
        Config("pp2-interleaved-recompute-full", "interleaved-1f1b", 2, 2, 2, recompute="full"),
    ],
    3: _template_configs(3),
    4: _template_configs(4) + [
        Config("pp2xep2-1f1b", "1f1b", **EP),
        Config("pp2xep2-dbo", "1f1b", **EP, dbo="task"),
        Config("pp2xep2-dbo-joint", "1f1b", **EP, dbo="joint"),
        Config("pp2xep2-recompute-moe", "1f1b", **EP, recompute="moe"),
        Config("pp2xep2-recompute-full-fused-w", "1f1b", **EP, recompute="full", split_w=False),
    ],
}
UPGRADE = "pp2-hot-upgrade"  # in the 2-rank launch: 1f1b -> a layer moved -> interleaved-1f1b
NAMES = [c.name for cs in CONFIGS.values() for c in cs] + [UPGRADE]


def model_spec(layers: int):
    from tessera.spec.presets import get_model

    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:layers])


def _plan(template: str, pp: int, vpp: int, m: int, split_w: bool, layers: int, bounds=None):
    from tessera.program.plan import Partition, Plan

    n = pp * vpp
    bounds = bounds or (-1, *[round(layers * s / n) for s in range(1, n)], layers + 1)
    return Plan("comm-rules", template, pp, vpp, m, Partition(tuple(bounds)), True, split_w)


def _tokens(m: int, step: int, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 100 * step + replica)
    return torch.randint(0, 256, (m, 1, SEQ + 1), generator=g)


def _dbo_policy(cfg: Config, groups):
    """Slot-annotated Programs and this rank's policy (as tests/test_dbo_engine.py)."""
    from tessera.config.schema import ParallelConfig
    from tessera.cost.analytic import analytic_costs
    from tessera.dbo import counts_for_skew, moe_layers, rank_tables
    from tessera.dbo.units import unit_table
    from tessera.engine.dbo import DBOPolicy
    from tessera.engine.dbo_joint import JointDBOPolicy
    from tessera.plan.baseline import baseline_plan
    from tessera.program.compiler import compile_plan
    from tessera.program.slots import annotate_slots
    from tessera.spec.hardware_presets import get_hardware

    hw = dataclasses.replace(get_hardware("cpu"), deferred_w_us=0.0)  # W moves into slots
    costs = analytic_costs(model_spec(cfg.layers), hw, ParallelConfig(
        pp=cfg.pp, vpp=cfg.vpp, ep=cfg.ep, dp=cfg.dp, num_microbatches=cfg.m, micro_batch_size=1, seq_length=SEQ))
    progs = annotate_slots(compile_plan(baseline_plan(costs, cfg.template, cfg.pp, cfg.vpp, cfg.m, overlap=True,
                                                      split_w=True)), moe_layers(costs), defer_w=True)
    counts = counts_for_skew(1.3, cfg.ep, cfg.m, moe_layers(costs), 8, 2 * SEQ * 2, seed=1)
    table = rank_tables(progs, costs, counts, cfg.ep, 0.1)[groups.pipeline_rank]
    if cfg.dbo == "joint":
        units = unit_table(table, progs[groups.pipeline_rank], costs, "split")
        return progs, JointDBOPolicy(table, units, groups.ep_rank)
    return progs, DBOPolicy(table, groups.ep_rank)


def run_config(cfg: Config, groups) -> dict:
    """``STEPS`` iterations of ``cfg`` on this rank; its loss (the last stage) for a sanity check."""
    from tessera.engine import Batch, Engine
    from tessera.model import Recompute, StageModule
    from tessera.program.compiler import compile_plan

    policy = None
    if cfg.dbo:
        progs, policy = _dbo_policy(cfg, groups)
    else:
        progs = compile_plan(_plan(cfg.template, cfg.pp, cfg.vpp, cfg.m, cfg.split_w, cfg.layers))
    prog = progs[groups.pipeline_rank]
    recompute = {None: Recompute(), "full": Recompute("full"), "moe": Recompute("selective", ("moe",))}[cfg.recompute]
    mods = [StageModule(model_spec(cfg.layers), (s.start, s.stop), ep_group=groups.ep, seed=SEED,
                        split_w=cfg.split_w, recompute=recompute) for s in prog.stages]
    engine = Engine(prog, mods, groups, None, slot_policy=policy)
    losses = []
    for step in range(STEPS):
        if policy is not None and hasattr(policy, "reset"):
            policy.reset()
        res = engine.run_iteration(Batch.from_tokens(_tokens(cfg.m, step, groups.replica)))
        losses.append(getattr(res, "loss", None))
    moved = policy.stats().moved if policy is not None else None
    return {"losses": losses, "moved": moved}


def run_upgrade(groups, rank: int, world: int) -> dict:
    """A step runner (make_step_runner) on 1f1b, switched twice with resharding over the
    pipeline group (set_program with rebuild): the last layer of rank 0 moves to rank 1, then
    interleaved-1f1b vpp=2; one iteration on each Program."""
    from tessera.config.load import load_recipe
    from tessera.program.compiler import compile_plan
    from tessera.train.worker.step import RankInfo, build_modules, make_step_runner

    layers, m = 4, 2
    recipe = load_recipe(TINY, ["parallel.pp=2", "parallel.vpp=1", "parallel.dp=1", "parallel.ep=1",
                                "planner.template=1f1b", f"parallel.num_microbatches={m}",
                                "parallel.micro_batch_size=1", f"parallel.seq_length={SEQ}"])
    model = model_spec(layers)
    plans = [_plan("1f1b", 2, 1, m, True, layers, (-1, 2, 5)), _plan("1f1b", 2, 1, m, True, layers, (-1, 1, 5)),
             _plan("interleaved-1f1b", 2, 2, m, True, layers, (-1, 1, 2, 3, 5))]
    progs = [compile_plan(p)[groups.pipeline_rank] for p in plans]
    runner = make_step_runner(recipe, progs[0], RankInfo(rank, world, groups.pipeline_rank, groups.replica,
                                                         groups.ep_rank), groups, model=model)
    losses, moved = [runner.run(_tokens(m, 0, groups.replica)).loss], []
    for step, prog in enumerate(progs[1:], 1):
        report = runner.set_program(prog, rebuild=lambda p: build_modules(recipe, model, p, groups))
        moved.append(report.moved_bytes)
        losses.append(runner.run(_tokens(m, step, groups.replica)).loss)
    return {"losses": losses, "moved": moved}


def engine_world(rank: int, world_size: int) -> dict:
    """Every configuration of :data:`CONFIGS` ``[world_size]`` in turn, recorded; ``out["records"]
    [name]`` = this rank's records of that configuration (``"setup"``: the groups' creation)."""
    from tessera.engine import Layout, make_groups

    torch.use_deterministic_algorithms(True)
    rec = CommRecorder().install()
    try:
        layouts = {Layout(c.pp, c.dp, c.ep) for c in CONFIGS[world_size]} | ({Layout(2, 1, 1)} if world_size == 2
                                                                             else set())
        groups = {lay: make_groups(lay) for lay in sorted(layouts, key=lambda x: (x.pp, x.dp, x.ep))}
        out = {"records": {"setup": rec.take()}, "runs": {}}
        for cfg in CONFIGS[world_size]:
            g = groups[Layout(cfg.pp, cfg.dp, cfg.ep)]
            if g is None:
                continue
            out["runs"][cfg.name] = run_config(cfg, g)
            out["records"][cfg.name] = rec.take()
        if world_size == 2:
            out["runs"][UPGRADE] = run_upgrade(groups[Layout(2, 1, 1)], rank, world_size)
            out["records"][UPGRADE] = rec.take()
        out["errors"] = rec.errors
        return out
    finally:
        rec.uninstall()


@pytest.fixture(scope="module")
def launches() -> dict[int, list[dict]]:
    """World size -> every rank's :func:`engine_world` result."""
    return {ws: run_local(engine_world, ws, TIMEOUT_S) for ws in sorted(CONFIGS)}


@functools.lru_cache(maxsize=None)
def _config(name: str) -> tuple[int, Config | None]:
    for ws, cs in CONFIGS.items():
        for c in cs:
            if c.name == name:
                return ws, c
    return 2, None  # the upgrade


def _records(launches, name: str) -> dict[int, list[CommRecord]]:
    ws, _ = _config(name)
    return {rank: r["records"][name] for rank, r in enumerate(launches[ws]) if name in r["records"]}


def test_every_run_trained_and_was_recorded(launches):
    """The recorder saw the runs (a bypass would make every rule pass vacuously)."""
    for ws, results in launches.items():
        for rank, r in enumerate(results):
            assert r["errors"] == [], (ws, rank)
    for name in NAMES:
        ws, cfg = _config(name)
        recs = _records(launches, name)
        assert len(recs) == (cfg.pp * cfg.dp if cfg else 2), name
        for rank, rs in recs.items():
            assert sum(len(x.ops) for x in rs if x.kind in (P2P, P2P_BATCH)) > 0, (name, rank)
            assert any(x.kind == COLLECTIVE for x in rs), (name, rank)  # the shape agreement at least
        losses = [lo for rank in recs for lo in launches[ws][rank]["runs"][name]["losses"] if lo is not None]
        assert losses and all(torch.isfinite(torch.tensor(lo)) for lo in losses), name
    ep = _records(launches, "pp2xep2-1f1b")
    assert any(x.name == "all_to_all_single" for x in ep[0])  # the EP all-to-alls are recorded
    assert launches[4][0]["runs"]["pp2xep2-dbo"]["moved"] > 0  # the optimizer did move W into slots
    assert launches[4][0]["runs"]["pp2xep2-dbo-joint"]["moved"] > 0
    received = [sum(x) for x in zip(*(r["runs"][UPGRADE]["moved"] for r in launches[2]))]
    assert len(received) == 2 and min(received) > 0  # both switches moved state between the ranks
    up = _records(launches, UPGRADE)
    assert any(x.name == "all_gather_object" for x in up[0])  # the reshard's metadata exchange


@pytest.mark.parametrize("name", NAMES)
def test_p2p_is_batched_on_a_pipeline_group(launches, name):
    """(a) every p2p operation in a batch_isend_irecv, none on the default group."""
    violations = check_p2p_batched(_records(launches, name))
    assert not violations, format_violations(violations, title=name)


@pytest.mark.parametrize("name", NAMES)
def test_both_ends_of_each_link_batch_alike(launches, name):
    """(b) batch k of one end of a link matches batch k of the other."""
    violations = check_link_batches(_records(launches, name))
    assert not violations, format_violations(violations, title=name)


@pytest.mark.parametrize("name", NAMES)
def test_each_group_sees_one_order_of_collectives(launches, name):
    """(c) per group, the same collectives in the same order on every member."""
    violations = check_collective_order(_records(launches, name))
    assert not violations, format_violations(violations, title=name)


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_each_group_sees_one_order_over_a_whole_launch(launches, world_size):
    """(c) over a launch: the groups' creation and every configuration in turn."""
    results = launches[world_size]
    whole = {rank: [x for recs in r["records"].values() for x in recs] for rank, r in enumerate(results)}
    violations = check_collective_order(whole)
    assert not violations, format_violations(violations, title=f"world {world_size}")
