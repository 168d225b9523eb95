"""Autograd segments (runs of B tasks as one backward call), keyed W capture, and early sends
in the simulator (one process, no communication)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.cost.types import TaskKey
from tessera.engine import Engine, TorchChunk
from tessera.engine.segments import backward_runs
from tessera.model import StageModule
from tessera.model.wgrad import DeferredWGrad, SplitLinear
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.sim.simulator import simulate
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:2])


def keys(*names: str) -> tuple[TaskKey, ...]:
    return tuple(TaskKey("B", int(n.split(".")[0]), n.split(".")[1]) for n in names)


def test_runs_break_where_the_program_interleaves_and_at_all_to_alls():
    order = keys("1.combine", "1.shared", "1.expert", "1.dispatch", "1.router", "1.mixer", "0.combine")
    plain = backward_runs(order, [False] * 7, comm=False)
    assert plain.count == 1 and set(plain.run_of.values()) == {0}
    gaps = backward_runs(order, [False, True, False, False, True, False, False], comm=False)
    assert gaps.members == (order[:1], order[1:4], order[4:])
    ep = backward_runs(order, [False] * 7, comm=True)  # combine issues; expert and router wait
    assert ep.members == (order[:1], order[1:2], order[2:4], order[4:])
    assert backward_runs(order, [False] * 7, comm=False, split_all=True).count == 7
    with pytest.raises(ValueError, match="break flags"):
        backward_runs(order, [False], comm=False)


def test_lone_backward_is_one_segment_and_pairs_few():
    """Without EP a lone B of a chunk is one backward call; an FB pair's B side a few (the fixed
    order interleaves the other microbatch's forward), never one per task."""
    spec = model_spec()
    chunk = TorchChunk(StageModule(spec, (-1, 3), seed=1))
    assert chunk.lone_runs().count == 1 and len(chunk.task_keys("B")) == 14
    costs = analytic_costs(spec, get_hardware("cpu"), ParallelConfig(pp=1, vpp=1, ep=1, dp=1, num_microbatches=4,
                                                                     micro_batch_size=1, seq_length=16))
    prog = compile_plan(baseline_plan(costs, "1f1b", 1, 1, 4, overlap=True, split_w=True))[0]
    engine = Engine(prog, [chunk], None, None)
    fb = next(i for i in prog.instructions if i.op == Op.FB)
    runs = engine._b_runs[(fb.chunk2, fb.mb2)]
    assert 1 < runs.count < len(chunk.task_keys("B"))
    assert engine._b_runs[(0, 3)].count == 1  # the last microbatch's lone B


def test_capture_many_records_each_linear_under_its_key():
    a, b = SplitLinear(3, 2, tag="mixer"), SplitLinear(2, 1, tag="expert")
    x = torch.randn(4, 3, requires_grad=True)
    store = DeferredWGrad()
    with store.capture_many([(("mb0", 0), [a]), (("mb0", 1), [b])]):
        b(a(x)).sum().backward()
    assert a.weight.grad is None and b.weight.grad is None
    assert store.keys() == (("mb0", 1), ("mb0", 0)) and store.num_pending(("mb0", 0)) == 2
    assert a.wgrad_store is None and a.wgrad_key is None  # restored
    assert store.run(("mb0", 0), "mixer") == 2 and a.weight.grad is not None and b.weight.grad is None
    with store.capture_many([(("k",), [a])]), pytest.raises(RuntimeError, match="already active"):
        with store.capture_many([(("k",), [b])]):
            pass


def test_simulator_sends_fb_data_when_its_side_is_done():
    """An FB pair's activation (or gradient) leaves when the pair's F (or B) side ends, as the
    engine posts it, not at the end of the pair."""
    spec = get_model("tiny-qwen3-next")
    costs = analytic_costs(spec, get_hardware("cpu"), ParallelConfig(pp=2, vpp=1, ep=1, dp=1, num_microbatches=4,
                                                                     micro_batch_size=2, seq_length=64))
    progs = compile_plan(baseline_plan(costs, "1f1b", 2, 1, 4, overlap=True, split_w=True))
    res = simulate(progs, costs)
    early = 0
    for r, prog in enumerate(progs):
        spans = {s.index: s for s in res.rank_spans(r)}
        for i, ins in enumerate(prog.instructions):
            if ins.op != Op.FB:
                continue
            nxt = prog.instructions[i + 1]
            if nxt.op in (Op.SEND_ACT, Op.SEND_GRAD):
                tr = next(t for t in res.transfers if t.src == r and t.mb == nxt.mb and
                          t.kind == ("act" if nxt.op == Op.SEND_ACT else "grad"))
                assert spans[i].start_ms <= tr.issue_ms <= spans[i].end_ms
                early += tr.issue_ms < spans[i].end_ms - 1e-9
    assert early >= 1


@pytest.mark.parametrize("index", [0, 3])  # DeltaNet + MoE, gated attention + MoE
def test_forward_modes_equal_the_function_path_bitwise(index):
    """The engine's fast forwards (tessera.model.wgrad.forward_mode): DEFERRED (detached-weight
    F.linear + a node hook recording W) and FUSED (plain F.linear) give the same input and weight
    gradients, bitwise, as the autograd.Function path, over two microbatches in order."""
    from tessera.model import DecoderLayer
    from tessera.model.wgrad import DEFERRED, FUSED, forward_mode

    torch.manual_seed(5)
    model = get_model("tiny-qwen3-next")
    layer = DecoderLayer(model, model.layers[index], seed=3)
    lins = [m for m in layer.modules() if isinstance(m, SplitLinear)]
    inputs, target = [torch.randn(2, 16, 64) for _ in range(2)], torch.randn(2, 16, 64)

    def run(mode: str | None, defer: bool):
        layer.zero_grad(set_to_none=True)
        store, dx, after_b = DeferredWGrad(), [], None
        for mb, x0 in enumerate(inputs):
            x = x0.clone().requires_grad_(True)
            if mode is None:
                out = layer(x)
            else:
                with forward_mode(lins, mode):
                    out = layer(x)
            loss = (out * target).sum()
            if defer:
                with store.capture(mb, layer):
                    loss.backward()
            else:
                loss.backward()
            dx.append(x.grad)
        if defer:
            after_b = {n: p.grad for n, p in layer.named_parameters()}
            for mb in range(len(inputs)):
                assert store.run(mb) > 0
        return dx, {n: p.grad.clone() for n, p in layer.named_parameters()}, after_b

    want_dx, want = run(None, True)[:2]
    for mode, defer in ((DEFERRED, True), (FUSED, False), (None, False)):
        dx, got, after_b = run(mode, defer)
        assert all(torch.equal(a, b) for a, b in zip(dx, want_dx)), mode
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), mode
        if defer:  # every SplitLinear weight waited for W
            split = {id(p) for m in lins for p in m.parameters()}
            assert all((g is None) == (id(p) in split) for (n, g), p in zip(after_b.items(), layer.parameters()))


def test_deferred_forward_needs_its_store_and_an_unchanged_input():
    from tessera.model.wgrad import DEFERRED, forward_mode

    lin = SplitLinear(4, 3, bias=True, tag="mixer")
    with forward_mode([lin], DEFERRED):
        y = lin(torch.randn(5, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="no DeferredWGrad attached"):
        y.sum().backward()
    x = torch.randn(5, 4, requires_grad=True)
    with forward_mode([lin], DEFERRED):
        y = lin(x * 1.0)
    with torch.no_grad():
        x.add_(1.0)  # the leaf itself may change; its product x * 1.0 did not
    store = DeferredWGrad()
    with store.capture(0, lin):
        y.sum().backward()
    assert store.num_pending(0) == 2 and lin.weight.grad is None
    with forward_mode([lin], DEFERRED):
        h = x * 1.0
        y = lin(h)
    h.mul_(2.0)  # the saved input changed before B: the deferred W would be wrong
    with pytest.raises(RuntimeError, match="modified in place"):
        with store.capture(1, lin):
            y.sum().backward()
    with pytest.raises(ValueError, match="mode="):
        with forward_mode([lin], "later"):
            pass
    assert lin.forward_mode is None
