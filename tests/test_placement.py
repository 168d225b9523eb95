"""One rank placement for the plan, the simulator and the runtime (tessera.spec.placement): the
engine's groups and the cost model's NVLink / network split come from the same rank formula, the
GPU default keeps EP groups inside a node, and the node check maps or refuses Ray's ranks."""

from __future__ import annotations

import pytest

from tessera.config.load import load_recipe
from tessera.cost.analytic import analytic_costs
from tessera.cost.comm import a2a_bytes, a2a_split, split_ms
from tessera.cost.dp import dp_link_gbs
from tessera.cost.types import ParallelShape
from tessera.engine.groups import Layout, _all_group_ranks
from tessera.errors import TesseraConfigError
from tessera.flow import resolve, simulate_recipe
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.model import MoESpec
from tessera.spec.placement import (GROUP_KINDS, RANK_ORDERS, check_nodes, group_ranks, map_ranks, place,
                                    position, resolve_order, world_rank)
from tessera.spec.tasks import TaskKind

H100 = get_hardware("h100-sxm")


def _nodes(groups, gpn):
    return [sorted({r // gpn for r in g}) for g in groups]


@pytest.mark.parametrize("order", RANK_ORDERS)
@pytest.mark.parametrize("pp,dp,ep", [(8, 8, 8), (2, 4, 2), (4, 2, 2), (3, 4, 4)])
def test_engine_groups_are_the_placements_groups(order, pp, dp, ep):
    layout = Layout(pp, dp, ep, order=order)
    engine: dict[str, list] = {}
    for name, ranks in _all_group_ranks(layout):
        engine.setdefault(name, []).append(tuple(ranks))
    for kind in ("pipeline", "ep", "dense_dp", "expert_dp"):
        assert sorted(engine[kind]) == sorted(group_ranks(kind, order, pp, dp, ep)), kind
    assert engine["ep_counts"] == engine["ep"]  # the counts communicator: the same ranks, same order
    for r in range(pp * dp):  # the rank formula and its inverse
        p, d = layout.pipeline_rank(r), layout.replica(r)
        assert layout.global_rank(p, d) == r == world_rank(order, pp, dp, 1, p, d)
        assert position(order, pp, dp, 1, r) == (p, d) and layout.position(r) == d * pp + p
    # what the cost model reads of the same groups, on nodes of 4
    pl = place(pp, dp, ep, 4, order)
    for kind in ("pipeline", "ep", "dense_dp", "expert_dp"):
        g = pl.group(kind)
        spans = _nodes(engine[kind], 4)
        assert g.nodes == max(len(s) for s in spans) and g.count == len(engine[kind])
        assert g.local == min(sum(1 for r in grp if r // 4 == n) for grp in engine[kind] for n in {r // 4 for r in grp})


def test_the_gpu_default_keeps_each_ep_group_inside_a_node_and_the_old_order_does_not():
    auto = place(8, 8, 8, 8)  # pp=8, ep=8 on 8-GPU nodes
    assert auto.order == "ep-dp-pp" == resolve_order("auto", 8)
    assert (auto.group("ep").nodes, auto.group("ep").local) == (1, 8)
    assert auto.crossing() == ("pipeline",) and auto.num_nodes == 8
    layout = Layout(8, 8, 8, order=auto.order)  # the engine: every EP group on one node
    assert all(len({r // 8 for r in layout.ep_ranks(p, 0)}) == 1 for p in range(8))
    old = place(8, 8, 8, 8, "pp-ep-dp")
    assert (old.group("ep").nodes, old.group("ep").local) == (8, 1)
    assert old.crossing() == ("ep", "dense_dp") and not old.group("pipeline").crosses_nodes
    assert resolve_order("auto", 1) == "pp-ep-dp"  # the cpu preset: today's order
    d = auto.to_dict()
    assert d["crossing"] == ["pipeline"] and d["groups"]["ep"] == {"size": 8, "count": 8, "nodes": 1, "local": 8,
                                                                  "crosses_nodes": False}
    assert auto.describe().startswith("ep-dp-pp, 8 nodes x 8 GPUs; across nodes: pipeline (8 nodes)")


def test_the_cost_models_split_is_the_placements():
    """Qwen3-Next-80B pp8 ep8 dp8 on H100 nodes: the dispatch time under each order is the A2A
    whose NVLink share is the EP group's members on a node; the DP rings and the pipeline p2p
    follow the same placement."""
    recipe = load_recipe("recipes/qwen3-next-80b.yaml", ["hardware.preset=h100-sxm"])
    model = resolve(recipe).model
    moe = next(l.mlp for l in model.layers if isinstance(l.mlp, MoESpec))
    tokens = recipe.parallel.micro_batch_size * recipe.parallel.seq_length
    times = {}
    for order in RANK_ORDERS:
        shape = ParallelShape.of(recipe.parallel)
        shape = ParallelShape(**{**shape.__dict__, "rank_order": order})
        costs = analytic_costs(model, H100, shape)
        pl = place(8, 8, 8, 8, order)
        dispatch = next(t for lc in costs.layers for t in lc.tasks if t.kind == TaskKind.DISPATCH)
        split = a2a_split(a2a_bytes(tokens, moe.top_k, model.hidden), 8, pl.group("ep").local)
        assert dispatch.ms == pytest.approx(split_ms(split, H100), rel=1e-12)
        times[order] = (dispatch.ms, costs.p2p_ms, dp_link_gbs(shape, H100))
    (a2a_in, p2p_in, (dense_in, _)), (a2a_out, p2p_out, (dense_out, _)) = times["ep-dp-pp"], times["pp-ep-dp"]
    assert split_ms(a2a_split(1.0, 8, 8), H100) < split_ms(a2a_split(1.0, 8, 1), H100)
    assert a2a_out / a2a_in == pytest.approx((7 / 8 / H100.inter_node_gbs) / (7 / 8 / H100.intra_node_gbs), rel=0.05)
    assert dense_in == H100.intra_node_gbs and dense_out == H100.inter_node_gbs  # one member per node: one NIC
    assert p2p_out < p2p_in  # a pipeline inside a node sends over NVLink


def test_simulate_reports_the_placement_and_the_old_order_is_slower():
    runs = {o: simulate_recipe(load_recipe("recipes/qwen3-next-80b.yaml", [f"parallel.rank_order={o}"]))
            for o in RANK_ORDERS}
    fast, slow = runs["ep-dp-pp"].summary(), runs["pp-ep-dp"].summary()
    assert fast["iteration_ms"] == pytest.approx(1838.9925, abs=1e-3)  # the default: README's number
    assert fast["placement"]["crossing"] == ["pipeline"] and slow["placement"]["crossing"] == ["ep", "dense_dp"]
    assert slow["iteration_ms"] > 1.5 * fast["iteration_ms"]  # measured 3062.0 ms: EP all-to-alls on the network
    assert slow["exposed_a2a_ratio"] > fast["exposed_a2a_ratio"]


def test_node_check_maps_interleaved_ranks_and_refuses_a_node_of_another_size():
    planned = place(2, 2, 2, 2)  # tiny recipe on 2-GPU nodes: ep-dp-pp
    assert map_ranks(planned, ["a", "a", "b", "b"]) == ()  # Ray's node-grouped ranks: as planned
    assert map_ranks(planned, ["b", "b", "a", "a"]) == ()  # node labels do not matter
    got = check_nodes(planned, ["n1", "n2", "n1", "n2"])  # a launcher that deals ranks round-robin
    assert got["remapped"] and got["ranks"] == [0, 2, 1, 3] and got["nodes"] == [0, 1, 0, 1]
    assert got["placement"]["groups"]["ep"]["nodes"] == 1
    layout = Layout(2, 2, 2, order=planned.order, ranks=tuple(got["ranks"]))
    assert [got["nodes"][r] for r in layout.ep_ranks(0, 0)] == [0, 0]  # EP group of stage 0 on node 0
    assert [got["nodes"][r] for r in layout.ep_ranks(1, 0)] == [1, 1]
    assert sorted(layout.position(r) for r in range(4)) == [0, 1, 2, 3]
    with pytest.raises(TesseraConfigError) as e:
        map_ranks(planned, ["a", "a", "a", "b"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("parallel.rank_order='ep-dp-pp'")
    assert "ep groups across 2 nodes" in msg and "3, 1 workers on 2 nodes" in msg and "give every node 2 workers" in msg


def test_layout_refuses_a_rank_map_that_breaks_group_order():
    with pytest.raises(TesseraConfigError, match="out of ascending rank order"):
        Layout(2, 2, 2, order="ep-dp-pp", ranks=(1, 0, 2, 3))
    with pytest.raises(TesseraConfigError, match="4 distinct ranks"):
        Layout(2, 2, 2, order="ep-dp-pp", ranks=(0, 0, 2, 3))
    with pytest.raises(TesseraConfigError, match="parallel.rank_order"):
        Layout(2, 2, 2, order="auto")


def test_a_bad_rank_order_is_one_line():
    with pytest.raises(TesseraConfigError) as e:
        resolve(load_recipe("recipes/tiny-qwen3-next.yaml", ["parallel.rank_order=ep-pp-dp"]))
    assert "\n" not in str(e.value) and "parallel.rank_order" in str(e.value) and "ep-dp-pp" in str(e.value)


def test_production_sizes_place_every_rank():
    pl = place(16, 768, 64, 8, "auto")  # 12,288 GPUs: pp16, EP64 over 8 nodes
    assert pl.world == 12288 and pl.num_nodes == 1536
    assert (pl.group("ep").nodes, pl.group("ep").local) == (8, 8)
    assert all(pl.group(k).count * pl.group(k).size == 12288 for k in GROUP_KINDS)


def test_status_row_says_where_the_workers_ran():
    from tessera.cli.status import summary_rows

    placed = check_nodes(place(2, 2, 2, 2), ["n1", "n2", "n1", "n2"])
    row = dict(summary_rows({"placement": placed}))["placement"]
    assert row == "ep-dp-pp: 2 nodes (2, 2 workers); across nodes: pipeline; ranks re-mapped"
    assert dict(summary_rows({}))["placement"] == "-"
