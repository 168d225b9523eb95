"""Re-partitioning parameters and AdamW state by global names (tessera.train.upgrade.reshard).

Real gloo ranks (``run_local``: torch.multiprocessing spawn, tcp on a free localhost port) on the
tiny preset cut to its first 4 decoder layers for time (3 Gated DeltaNet, 1 gated attention: both
mixers). Each rank builds its stages of partition A, takes 2 AdamW steps, and moves to
partition B with ``move_state`` (p2p, then dcp); the parent builds B's stages,
loads them from the union of A's named states, and compares bitwise (torch.equal) with what
the ranks hold after each move. Layers, the embedding and the head move in both directions.

The sigmoid router's correction bias (a persistent buffer) moves with the parameters: one
in-process test on tiny-deepseek-v3.

One spawn of 3 ranks: the whole world (split_w=False, 3-way), then a 2-rank subgroup (group
ranks != global ranks; split_w=True, 2 chunks per rank under A; only one rank trained, so half
the names carry no optimizer state).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tessera.model.stage import StageModule
from tessera.spec.presets import get_model
from tessera.testing import run_local
from tessera.train.upgrade.reshard import (MoveReport, global_param_names, load_named, move_state, named_state,
                                   state_from_parts)

TIMEOUT_S = 180
# per rank: the (start, stop) chunks it holds (extended indices: -1 embedding, 4 head)
A2 = [[(-1, 1), (2, 3)], [(1, 2), (3, 5)]]  # the subgroup of global ranks 1 and 2
B2 = [[(2, 5)], [(-1, 2)]]
A3 = [[(-1, 1)], [(1, 3)], [(3, 5)]]
B3 = [[(-1, 1), (4, 5)], [(1, 2), (3, 4)], [(2, 3)]]


def tiny_model():
    """The tiny preset's first 4 decoder layers (layer 3 is its first gated attention)."""
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def build(chunks, split_w):
    model = tiny_model()
    modules = [StageModule(model, c, seed=5, split_w=split_w) for c in chunks]
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2, weight_decay=0.01)
    return modules, opt


def train(modules, opt, seed, steps=2):
    """``steps`` AdamW steps; loss: the head's loss plus the mean square of other stages' outputs."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for m in modules:
            x = torch.randint(0, 256, (1, 8), generator=g) if m.has_embed else torch.randn(1, 8, 64, generator=g)
            labels = torch.randint(0, 256, (1, 8), generator=g) if m.has_head else None
            out = m(x, labels)
            loss = loss + (out if m.has_head else out.pow(2).mean())
        loss.backward()
        opt.step()


def snapshot(modules, opt):
    return {n: {k: t.clone() for k, t in e.items()} for n, e in named_state(modules, opt).items()}


def part_of(modules, opt, chunks):
    return {"modules": [m.state_dict() for m in modules], "optimizer": opt.state_dict(),
            "stages": [(i, s, e) for i, (s, e) in enumerate(chunks)],
            "param_names": [n for m in modules for n in global_param_names(m)]}


def moves(old, old_opt, new_chunks, split_w, group, scratch):
    """Move to ``new_chunks`` with each method; per method: (report, snapshot after the move)."""
    import torch.distributed as dist

    out = {}
    for method in ("p2p", "dcp"):
        new, new_opt = build(new_chunks, split_w)
        dist.barrier(group)  # the reported seconds: the move, not the other ranks' builds
        rep = move_state(old, old_opt, new, new_opt, group, method=method, scratch_dir=scratch / method)
        out[method] = (rep, snapshot(new, new_opt))
        if method == "p2p" and any(new_opt.state.values()):  # the loaded state trains on
            train(new, new_opt, seed=99, steps=1)
    return out


def world(rank, size, *, scratch):
    """3 ranks: the whole world moves A3 -> B3 (split_w=False, all ranks trained); then the
    subgroup of global ranks 1, 2 (group ranks 0, 1) moves A2 -> B2 (split_w=True, only group
    rank 1 trained: group rank 0's names have no optimizer state)."""
    import torch.distributed as dist

    old, opt = build(A3[rank], False)
    train(old, opt, seed=rank)
    res = {"before": snapshot(old, opt), "part": part_of(old, opt, A3[rank])}
    res["moves"] = moves(old, opt, B3[rank], False, None, scratch / "world")
    try:  # rank 0 claims to hold nothing: its names are held by no member
        new, new_opt = build(B3[rank], False)
        move_state([] if rank == 0 else old, opt, new, new_opt, None)
    except ValueError as e:
        res["missing"] = str(e)
    same, same_opt = build(A3[rank], False)  # nothing moves: every rank saves and loads no DCP keys
    res["same"] = (move_state(old, opt, same, same_opt, None, method="dcp", scratch_dir=scratch / "same"),
                   snapshot(same, same_opt))
    sub = dist.new_group([1, 2])
    if rank > 0:
        old, opt = build(A2[rank - 1], True)
        if rank == 2:
            train(old, opt, seed=rank)
        res["sub_before"] = snapshot(old, opt)
        res["sub_moves"] = moves(old, opt, B2[rank - 1], True, sub, scratch / "sub")
    dist.barrier()
    return res


def union(states):
    out = {}
    for s in states:
        assert not set(s) & set(out)
        out.update(s)
    return out


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert sorted(got[name]) == sorted(want[name]), name
        for key, t in want[name].items():
            assert got[name][key].dtype == t.dtype and torch.equal(got[name][key], t), (name, key)


def check_moves(results_moves, before, new_chunks, split_w):
    """Every rank's state after each move equals B built here and loaded from the union of A;
    moved bytes/tensors are those of the names that changed rank."""
    full, counts = union(before), []
    for r, chunks in enumerate(new_chunks):
        ref, ref_opt = build(chunks, split_w)
        load_named(ref, ref_opt, full)
        want = snapshot(ref, ref_opt)
        moved = [n for n in want if n not in before[r]]
        counts.append((len(moved), len(want)))
        for method, (rep, got) in results_moves[r].items():
            assert isinstance(rep, MoveReport) and rep.method == method
            assert_same(got, want)
            assert rep.moved_bytes == sum(t.numel() * t.element_size() for n in moved for t in full[n].values())
            assert rep.moved_tensors == sum(len(full[n]) for n in moved)
            print(f"{len(new_chunks)} ranks rank {r} {method}: {rep.moved_bytes} B in {rep.moved_tensors} "
                  f"tensors, {rep.seconds * 1e3:.1f} ms")
    assert 0 < sum(m for m, _ in counts) < sum(n for _, n in counts)  # some names move, some stay


def test_move_state_matches_reference(tmp_path):
    res = run_local(functools.partial(world, scratch=tmp_path), 3, TIMEOUT_S)
    before = [r["before"] for r in res]
    full = union(before)
    assert all(set(e) == {"param", "step", "exp_avg", "exp_avg_sq"} for e in full.values())
    check_moves([r["moves"] for r in res], before, B3, False)
    assert_same(state_from_parts([r["part"] for r in res]), full)
    # every rank raises the same error, naming a parameter only rank 0 held
    assert len({r["missing"] for r in res}) == 1 and "no member holds it" in res[0]["missing"]
    assert res[0]["missing"].split("'")[1] in res[0]["before"]
    for r in res:
        assert r["same"][0].moved_bytes == 0 and r["same"][0].moved_tensors == 0
        assert_same(r["same"][1], r["before"])
    sub_before = [res[1]["sub_before"], res[2]["sub_before"]]
    assert all(set(e) == {"param"} for e in sub_before[0].values())
    assert all(len(e) == 4 for e in sub_before[1].values())
    check_moves([res[1]["sub_moves"], res[2]["sub_moves"]], sub_before, B2, True)


def test_global_names_do_not_depend_on_split_w():
    model = tiny_model()
    names = {w: global_param_names(StageModule(model, (1, 5), seed=5, split_w=w)) for w in (True, False)}
    assert names[True] == names[False]
    assert names[True][0].startswith("layers.1.") and names[True][-1] == "head.output.weight"
    assert {n.split(".")[1] for n in names[True] if n.startswith("layers.")} == {str(i) for i in range(1, 4)}


def test_load_named_errors_name_the_parameter():
    mods, opt = build([(-1, 1)], True)
    train(mods, opt, seed=0, steps=1)
    state = snapshot(mods, opt)
    target, target_opt = build([(-1, 1)], False)
    missing = dict(state)
    del missing["layers.0.attn.out_proj.weight"]
    with pytest.raises(KeyError, match="layers.0.attn.out_proj.weight"):
        load_named(target, target_opt, missing)
    bad = dict(state)
    bad["embed.weight"] = {"param": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="embed.weight"):
        load_named(target, target_opt, bad)
    load_named(target, target_opt, state)
    assert_same(snapshot(target, target_opt), state)
    part = part_of(mods, opt, [(-1, 1)])
    del part["param_names"]
    with pytest.raises(KeyError, match="param_names"):
        state_from_parts([part])


def test_correction_bias_moves_with_a_repartition():
    """The sigmoid router's correction bias (a persistent buffer, which training moves) is named
    state: another partition's stages get it from named_state (a hot upgrade; move_state sends
    the same names) and from checkpoint parts (state_from_parts: a restart under another
    partition), with no optimizer state. In process, on tiny-deepseek-v3 (MoE layers 1-3)."""
    model = get_model("tiny-deepseek-v3")
    old = [StageModule(model, c) for c in ((-1, 2), (2, 5))]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in old]
    want = {i: torch.arange(8.0) / 10 + i for i in (1, 2, 3)}
    with torch.no_grad():
        for m in old:
            for l in m.layers:
                if l.moe is not None:
                    l.moe.gate.e_score_correction_bias.copy_(want[l.index])
    named = union([named_state([m], o) for m, o in zip(old, opts)])
    assert {n: set(e) for n, e in named.items() if "moe.gate.e_score" in n} == {
        f"layers.{i}.moe.gate.e_score_correction_bias": {"param"} for i in want}
    parts = [part_of([m], o, [(m.start, m.stop)]) for m, o in zip(old, opts)]
    for source in (named, state_from_parts(parts)):
        new = [StageModule(model, c) for c in ((-1, 3), (3, 5))]
        load_named(new, torch.optim.AdamW([p for m in new for p in m.parameters()], lr=1e-2), source)
        got = {l.index: l.moe.gate.e_score_correction_bias for m in new for l in m.layers if l.moe is not None}
        assert got.keys() == want.keys() and all(torch.equal(got[i], want[i]) for i in want)
