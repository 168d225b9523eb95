"""Candidates, overlap graph and the partition MILP (SCIP) against brute-force enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from plan_helpers import chains, random_layout, hetero_costs
from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.types import LayerMemory, ModelCosts
from tessera.cost.uniform import uniform_costs
from tessera.errors import TesseraConfigError
from tessera.plan.baseline import serial_balanced_partition
from tessera.plan.candidates import (Candidate, CandidateMemory, candidate_memory, candidates_of, inflight_microbatches,
                                     partition_of, stage_candidates, stage_ranks)
from tessera.plan.milp import solve_partition
from tessera.plan.overlap_graph import (OverlapEdge, bottleneck_ms, overlap_edges, pair_costs,
                                        partition_bottleneck_ms)
from tessera.plan.pair_scheduler import schedule_pair
from tessera.program.plan import Partition
from tessera.sched.chunkdag import fixed_order, pair_dag
from tessera.sched.dag import run_in_order
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

def fixed_scheduler(dag):
    """The template's fixed overlap order (deterministic stand-in for the pair scheduler)."""
    return run_in_order(dag, fixed_order(dag))


# ---------------------------------------------------------------------------------------------
# candidates


def test_candidates_small_exact():
    base = Partition((-1, 4, 9))  # 8 layers, 2 stages
    cands = stage_candidates(base, 1, 8)
    assert cands == ((Candidate(0, -1, 3), Candidate(0, -1, 4), Candidate(0, -1, 5)),
                     (Candidate(1, 3, 9), Candidate(1, 4, 9), Candidate(1, 5, 9)))
    kept = stage_candidates(base, 1, 8, forbidden_cuts=(4,))
    assert [c.range for c in kept[0]] == [(-1, 3), (-1, 5)]
    assert [c.range for c in kept[1]] == [(3, 9), (5, 9)]


def test_candidates_tile_exactly_once():
    costs = uniform_costs(12, 1.0, 2.0, 1.0)
    base = serial_balanced_partition(costs, 4)
    assert base.bounds == (-1, 3, 6, 9, 13)
    cands = stage_candidates(base, 2, 12)
    assert [len(c) for c in cands] == [5, 22, 22, 5]  # 25 minus starts >= stops: (4,4), (5,4), (5,5)
    all_chains = chains(cands)
    increasing = [t for t in itertools.product(range(1, 6), range(4, 9), range(7, 12)) if t[0] < t[1] < t[2]]
    assert len(all_chains) == len(increasing) == 95
    for ch in all_chains:
        covered = [i for c in ch for i in range(c.start, c.stop)]
        assert covered == list(range(-1, 13))
        assert all(c.num_decoder_layers(12) >= 1 for c in ch)
        assert partition_of(ch).bounds[0] == -1 and partition_of(ch).bounds[-1] == 13
    # every candidate is on some chain
    used = {c for ch in all_chains for c in ch}
    assert used == {c for s in cands for c in s}


def test_candidates_drop_dead_ends_and_keep_one_layer():
    base = Partition((-1, 1, 2, 3, 5))  # 4 layers, 4 stages of one layer
    cands = stage_candidates(base, 1, 4)
    for ch in chains(cands):
        assert [c.num_decoder_layers(4) for c in ch] == [1, 1, 1, 1]
    assert len(chains(cands)) == 1 and all(len(s) == 1 for s in cands)


def test_candidates_without_choice_raise():
    with pytest.raises(TesseraConfigError, match="stage 0 has no candidate|no candidate range"):
        stage_candidates(Partition((-1, 2, 5)), 0, 4, forbidden_cuts=(2,))
    with pytest.raises(TesseraConfigError, match="candidate_radius"):
        stage_candidates(Partition((-1, 2, 5)), -1, 4)


# ---------------------------------------------------------------------------------------------
# overlap graph and memory tables


def test_overlap_edges_and_inflight():
    edges = overlap_edges("1f1b", 4, 1, 8)
    assert edges == tuple(OverlapEdge(r, r, r) for r in range(4))
    inter = overlap_edges("interleaved-1f1b", 2, 2, 8)
    assert {(e.f_stage, e.b_stage) for e in inter if e.rank == 0} <= {(0, 0), (0, 2), (2, 0), (2, 2)}
    assert all(stage_ranks("interleaved-1f1b", 2, 2)[e.f_stage] == e.rank for e in inter)
    assert stage_ranks("dualpipe-v", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    act, w = inflight_microbatches("1f1b", 4, 1, 8)
    assert act == (8, 6, 4, 2)  # 2*(pp-rank-1)+1 warmup forwards with the FB pairing, plus the one in the FB
    assert w == (1, 1, 1, 1)


def test_pair_costs_deduplicate_identical_content():
    pattern = "MA" * 6
    costs = hetero_costs(pattern)
    cands = stage_candidates(Partition((-1, 4, 8, 13)), 1, 12)
    edges = (OverlapEdge(0, 0, 2), OverlapEdge(0, 2, 0), OverlapEdge(1, 1, 1))
    pc = pair_costs(costs, cands, edges, scheduler=fixed_scheduler)
    assert pc.pairs_total == 3 * 3 + 3 * 3 + 9 == len(pc.pair_ms)  # (1, 1): one range per stage

    def content(c):
        return tuple({-1: "emb", 12: "head"}.get(i, pattern[i] if 0 <= i < 12 else "") for i in range(c.start, c.stop))

    assert pc.pairs_distinct == len({(content(f), content(b)) for f, b in pc.pair_ms}) == 26
    for (cf, cb), ms in pc.pair_ms.items():  # the cache returns what direct scheduling gives
        assert ms == pytest.approx(fixed_scheduler(pair_dag(costs, cf.range, cb.range, True)).makespan)
    same_a, same_b = Candidate(1, 3, 7), Candidate(1, 5, 9)  # both "AMAM"
    assert pc.pair_ms[(same_a, same_a)] == pc.pair_ms[(same_b, same_b)]
    f = pc.f_ms[Candidate(1, 4, 8)]
    assert f == pytest.approx(2 * (0.3 + 0.8 + 4.0) + 2 * (2.0 + 0.5 + 0.4))  # F of "MAMA" alone: one chain
    assert pc.b_ms[Candidate(1, 4, 8)] > 0 and pc.unpaired_stage_ms() == {}


# ---------------------------------------------------------------------------------------------
# MILP vs brute force


def random_instance(seed: int, with_memory: bool):
    rng = random.Random(seed)
    base, cands, n_layers, ranks = random_layout(rng)
    n_stages = len(cands)
    edges = set()
    for s in range(n_stages):
        for t in range(n_stages):
            if ranks[s] == ranks[t] and rng.random() < 0.6:
                edges.add((s, t))
    ec = {}
    for f, b in edges:
        for cf in cands[f]:
            for cb in (cands[b] if f != b else (cf,)):
                ec[(cf, cb)] = float(rng.randint(10, 60))  # integers: ties happen
    paired = {s for e in edges for s in e}
    stage_ms = {c: float(rng.randint(10, 60)) for s in range(n_stages) if s not in paired for c in cands[s]}
    memory = cap = None
    if with_memory:
        layer_gb = [rng.uniform(1, 4) for _ in range(n_layers + 2)]
        memory = CandidateMemory(ranks, {c: 1e9 * sum(layer_gb[i + 1] for i in range(c.start, c.stop))
                                         for s in cands for c in s})
        peaks = sorted(max(sum(memory.bytes[c] for c in ch if ranks[c.stage] == r) for r in set(ranks))
                       for ch in chains(cands))
        cap = peaks[len(peaks) // 3]  # a third of the choices fit
    return base, cands, ec, stage_ms, memory, cap


def brute(cands, ec, stage_ms, memory, cap):
    edges = {(cf.stage, cb.stage) for cf, cb in ec}
    best = None
    for ch in chains(cands):
        if memory is not None:
            ranks = set(memory.stage_rank)
            if any(sum(memory.bytes[c] for c in ch if memory.stage_rank[c.stage] == r) > cap * (1 + 1e-9)
                   for r in ranks):
                continue
        vals = [ec[(ch[f], ch[b])] for f, b in edges] + [stage_ms[c] for c in ch if c in stage_ms]
        v = max(vals)
        best = v if best is None else min(best, v)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_milp_equals_brute_force(seed):
    base, cands, ec, stage_ms, memory, cap = random_instance(seed, with_memory=seed % 2 == 1)
    res = solve_partition(cands, ec, memory, cap, prune=False, stage_ms=stage_ms, time_limit_s=30)
    assert res.status == "optimal"
    assert res.bottleneck_ms == pytest.approx(brute(cands, ec, stage_ms, memory, cap), abs=1e-9)
    assert res.partition.bounds[0] == -1 and res.partition.bounds[-1] == base.bounds[-1]
    assert res.choice in set(chains(cands))
    if memory is not None:
        for r in set(memory.stage_rank):
            assert sum(memory.bytes[c] for c in res.choice if memory.stage_rank[c.stage] == r) <= cap * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(30, 60))
def test_pruning_never_removes_the_optimum(seed):
    base, cands, ec, stage_ms, memory, cap = random_instance(seed, with_memory=seed % 3 == 0)
    base_choice = candidates_of(base)
    edges = {(cf.stage, cb.stage) for cf, cb in ec}
    tau = max([ec[(base_choice[f], base_choice[b])] for f, b in edges]
              + [stage_ms[c] for c in base_choice if c in stage_ms])
    full = solve_partition(cands, ec, memory, cap, prune=False, stage_ms=stage_ms)
    pruned = solve_partition(cands, ec, memory, cap, baseline_bottleneck_ms=tau, prune=True, stage_ms=stage_ms)
    assert pruned.bottleneck_ms == pytest.approx(full.bottleneck_ms, abs=1e-9)
    assert pruned.bottleneck_ms <= tau + 1e-9 or pruned.status.endswith("+unpruned")
    assert pruned.n_vars_after <= pruned.n_vars_before == full.n_vars_after
    assert pruned.pairs_after_pruning <= pruned.pairs_before_pruning == len(ec)
    if memory is None:  # without memory the baseline is feasible, so pruning keeps its pairs
        assert pruned.status == "optimal" and pruned.bottleneck_ms <= tau


def test_pruning_falls_back_when_the_baseline_does_not_fit():
    cands = stage_candidates(Partition((-1, 3, 7)), 1, 6)
    base_pair = (Candidate(0, -1, 3), Candidate(1, 3, 7))
    ec = {(f, b): (10.0 if (f, b) == base_pair else 20.0 + f.stop + b.start) for f in cands[0] for b in cands[1]}
    memory = CandidateMemory((0, 1), {c: (10e9 * (c.stop + 1) if c.stage == 0 else 0.0) for s in cands for c in s})
    res = solve_partition(cands, ec, memory, 35e9, baseline_bottleneck_ms=10.0)
    assert res.status == "optimal+unpruned"
    assert res.partition.bounds == (-1, 2, 7) and res.bottleneck_ms == 24.0  # only [-1, 2) fits in 35 GB
    assert res.n_vars_after == res.n_vars_before


def test_tie_break_minimises_the_sum_at_the_optimal_bottleneck():
    base, cands, ec, stage_ms, _, _ = random_instance(3, with_memory=False)
    res = solve_partition(cands, ec, None, None, stage_ms=stage_ms)
    edges = {(cf.stage, cb.stage) for cf, cb in ec}
    best_sum = min(sum(ec[(ch[f], ch[b])] for f, b in edges) + sum(stage_ms.get(c, 0.0) for c in ch)
                   for ch in chains(cands)
                   if max([ec[(ch[f], ch[b])] for f, b in edges] + [stage_ms[c] for c in ch if c in stage_ms])
                   <= res.bottleneck_ms + 1e-9)
    assert res.sum_ms == pytest.approx(best_sum)


# ---------------------------------------------------------------------------------------------
# memory


def _memory_costs(heavy: tuple[int, ...], heavy_gb: float, light_gb: float, n: int = 8) -> ModelCosts:
    costs = uniform_costs(n, 1.0, 2.0, 1.0, a2a_ms=0.5)
    layers = tuple(dataclasses.replace(l, memory=LayerMemory((heavy_gb if l.index in heavy else light_gb) * 1e9,
                                                              0.0, 0.0, 0.0)) for l in costs.layers)
    return dataclasses.replace(costs, layers=layers)


def test_memory_infeasible_names_rank_and_gb():
    costs = _memory_costs(heavy=(6, 7), heavy_gb=46.2, light_gb=10.0)
    base = Partition((-1, 2, 4, 6, 9))  # 1f1b pp=4: stage s on rank s; rank 3 holds layers 6, 7 + head
    cands = stage_candidates(base, 0, 8)
    edges = overlap_edges("1f1b", 4, 1, 8)
    pc = pair_costs(costs, cands, edges, scheduler=fixed_scheduler)
    mem = candidate_memory(costs, cands, stage_ranks("1f1b", 4, 1), *inflight_microbatches("1f1b", 4, 1, 8))
    with pytest.raises(TesseraConfigError) as err:
        solve_partition(cands, pc.pair_ms, mem, 80e9)
    assert "rank 3 needs 92.4 GB, capacity 80.0 GB" in str(err.value)
    assert "\n" not in str(err.value)
    # with radius 1 rank 3 can drop layer 6 to rank 2 (30.0 + 46.2 GB): it fits, rank 2 too
    cands = stage_candidates(base, 1, 8)
    pc = pair_costs(costs, cands, edges, scheduler=fixed_scheduler)
    mem = candidate_memory(costs, cands, stage_ranks("1f1b", 4, 1), *inflight_microbatches("1f1b", 4, 1, 8))
    res = solve_partition(cands, pc.pair_ms, mem, 80e9, partition_bottleneck_ms(costs, base, edges, fixed_scheduler))
    assert res.partition.bounds[-2] == 7  # layer 6 moved off rank 3
    assert sum(mem.bytes[c] for c in res.choice if c.stage == 3) == pytest.approx(46.2e9)


def test_memory_jointly_infeasible_names_the_least_fullest_rank():
    # 4 layers of 30 GB, 2 stages on 2 ranks, capacity 50 GB: each rank alone could hold one
    # layer, but the two stages must hold all four: the fullest rank needs 60 GB at best.
    costs = _memory_costs(heavy=(0, 1, 2, 3), heavy_gb=30.0, light_gb=30.0, n=4)
    cands = stage_candidates(Partition((-1, 2, 5)), 1, 4)
    edges = overlap_edges("1f1b", 2, 1, 4)
    pc = pair_costs(costs, cands, edges, scheduler=fixed_scheduler)
    mem = candidate_memory(costs, cands, (0, 1), (0, 0))
    with pytest.raises(TesseraConfigError, match=r"rank \d needs 60.0 GB, capacity 50.0 GB"):
        solve_partition(cands, pc.pair_ms, mem, 50e9)


# ---------------------------------------------------------------------------------------------
# overlap-aware beats serial-balanced


def test_overlap_aware_partition_beats_serial_balanced():
    """Compute-heavy "A" layers hide little when a chunk of them overlaps with itself (1F1B pairs
    F and B of the same stage), comm-heavy "M" layers hide their A2A behind the other
    microbatch's compute. The serial-balanced cut gives stage 2 five A layers (the straggler pair);
    the MILP moves boundaries so that no pair costs more than 32 ms."""
    costs = hetero_costs("MMMMMMAAAAAAMMMM")
    base = serial_balanced_partition(costs, 4)
    assert base.bounds == (-1, 3, 7, 12, 17)
    edges = overlap_edges("1f1b", 4, 1, 8)
    cands = stage_candidates(base, 2, 16)
    expected = {fixed_scheduler: (37.5, 32.0), schedule_pair: None}
    for sched, values in expected.items():
        pc = pair_costs(costs, cands, edges, scheduler=sched)
        assert pc.pairs_total == 59 and pc.pairs_distinct == 49  # "MMMM" ranges repeat
        tau = bottleneck_ms(pc, candidates_of(base))
        assert tau == pytest.approx(partition_bottleneck_ms(costs, base, edges, sched))
        res = solve_partition(cands, pc.pair_ms, None, None, tau, stage_ms=pc.unpaired_stage_ms())
        best = min(bottleneck_ms(pc, ch) for ch in chains(cands))
        assert res.bottleneck_ms == pytest.approx(best)
        assert res.bottleneck_ms == pytest.approx(bottleneck_ms(pc, res.choice))
        assert res.bottleneck_ms < 0.9 * tau  # > 10 % better bottleneck
        assert res.n_vars_after < res.n_vars_before and res.pairs_after_pruning < res.pairs_before_pruning
        if values is not None:
            assert (tau, res.bottleneck_ms) == pytest.approx(values)


def test_pair_costs_in_worker_processes_match():
    costs = hetero_costs("MAMMAM")
    cands = stage_candidates(Partition((-1, 3, 7)), 1, 6)
    edges = (OverlapEdge(0, 0, 1), OverlapEdge(0, 1, 0))
    one = pair_costs(costs, cands, edges, scheduler=schedule_pair)
    two = pair_costs(costs, cands, edges, scheduler=schedule_pair, workers=2)
    assert one.pair_ms == two.pair_ms and one.f_ms == two.f_ms and one.b_ms == two.b_ms
    assert one.pairs_distinct == two.pairs_distinct == 18


def test_end_to_end_tiny_qwen3_next_analytic():
    model = get_model("tiny-qwen3-next")
    par = ParallelConfig(pp=2, vpp=2, ep=2, tp=1, dp=2, num_microbatches=4, micro_batch_size=2, seq_length=64)
    costs = analytic_costs(model, get_hardware("cpu"), par)
    base = serial_balanced_partition(costs, 4)
    edges = overlap_edges("interleaved-1f1b", 2, 2, 4)
    cands = stage_candidates(base, 1, model.num_layers)
    pc = pair_costs(costs, cands, edges)
    assert pc.pairs_distinct <= pc.pairs_total
    tau = bottleneck_ms(pc, candidates_of(base))
    mem = candidate_memory(costs, cands, stage_ranks("interleaved-1f1b", 2, 2),
                           *inflight_microbatches("interleaved-1f1b", 2, 2, 4))
    res = solve_partition(cands, pc.pair_ms, mem, costs.device_mem_bytes, tau, stage_ms=pc.unpaired_stage_ms(),
                          warm_start=candidates_of(base))
    assert res.status == "optimal"
    assert res.bottleneck_ms <= tau + 1e-9
    assert res.bottleneck_ms == pytest.approx(min(bottleneck_ms(pc, ch) for ch in chains(cands)))
    assert sum(res.partition.sizes()) == model.num_layers
