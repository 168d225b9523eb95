"""The fused hot path (tessera.engine.fused): a lone F or B instruction of a one-segment
microbatch as one engine step, with the task path's gradients bitwise.

* on one chunk (embedding + layers, middle layers, layers + head; FP32 and BF16; W fused, W
  deferred, W unknown at the forward) the fused forward and backward give the same parameter and
  input gradients, the same loss and the same deferred W thunks as running every task;
* an engine on a 1f1b Program runs each lone F and B instruction as one step, and the same
  Program with per-task profiling (no fusing) gives bitwise the same gradients;
* a chunk whose microbatch's backward is several segments (an ``FB`` pair interleaves into it)
  or which profiles per task does not fuse.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.engine import Batch, Engine, TorchChunk
from tessera.engine.lazy import Lazy
from tessera.model import StageModule
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model

MODEL = get_model("tiny-qwen3-next")
L = MODEL.num_layers
B, S = 2, 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run_chunk(fuse: bool, layers: tuple[int, int], split_w: bool, defer: bool | None, dtype=torch.float32):
    """(parameter grads, input grad or None, loss or None) of one microbatch on a fresh chunk."""
    mod = StageModule(MODEL, layers, seed=1, split_w=split_w, compute_dtype=dtype)
    ch = TorchChunk(mod)
    src = torch.randint(0, 256, (B, S), generator=_gen(4)) if mod.has_embed else \
        torch.randn(B, S, MODEL.hidden, generator=_gen(5))
    labels = torch.randint(0, 256, (B, S), generator=_gen(6)) if mod.has_head else None
    ch.begin_forward(0, Lazy.of(src), labels, defer_w=defer)
    assert ch.fuses(0)
    if fuse:
        ch.run_forward(0)
    else:
        for key in ch.task_keys("F"):
            ch.run(key, 0)
    g_out = None if mod.has_head else Lazy.of(torch.randn(B, S, MODEL.hidden, generator=_gen(7)))
    ch.begin_backward(0, g_out, bool(defer))
    if fuse:
        ch.run_backward(0)
    else:
        for key in ch.task_keys("B"):
            ch.run(key, 0)
    if defer:
        assert ch.run_w(0) > 0
    grads = [None if p.grad is None else p.grad.clone() for p in mod.parameters()]
    g_in = None if mod.has_embed else ch.pop_input_grad(0)
    loss = ch.loss(0)
    ch.end_iteration()
    return grads, g_in, loss


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("layers", [(-1, 3), (2, 5), (5, L + 1), (-1, L + 1)])
@pytest.mark.parametrize("split_w,defer", [(False, None), (True, True), (True, False)])
def test_fused_chunk_equals_its_tasks_bitwise(one_thread, layers, split_w, defer):
    want = _run_chunk(False, layers, split_w, defer)
    got = _run_chunk(True, layers, split_w, defer)
    assert len(got[0]) == len(want[0]) and all(_equal(a, b) for a, b in zip(got[0], want[0]))
    assert _equal(got[1], want[1]) and _equal(got[2], want[2])
    assert any(g is not None and g.abs().sum() > 0 for g in got[0])  # gradients really flowed


def test_fused_chunk_equals_its_tasks_bitwise_in_bf16(one_thread):
    want = _run_chunk(False, (-1, L + 1), True, True, torch.bfloat16)
    got = _run_chunk(True, (-1, L + 1), True, True, torch.bfloat16)
    assert all(_equal(a, b) for a, b in zip(got[0], want[0])) and _equal(got[2], want[2])


def _program(m: int, overlap: bool):
    costs = analytic_costs(MODEL, get_hardware("cpu"), ParallelConfig(
        pp=1, vpp=1, ep=1, dp=1, num_microbatches=m, micro_batch_size=B, seq_length=S))
    return compile_plan(baseline_plan(costs, "1f1b", 1, 1, m, overlap=overlap, split_w=overlap))[0]


def _engine_grads(prog, profile: bool):
    mod = StageModule(MODEL, (-1, L + 1), seed=1, split_w=False)
    engine = Engine(prog, [mod], None, None, profile=profile)
    engine.begin(Batch.from_tokens(torch.randint(0, 256, (prog.num_microbatches, B, S + 1), generator=_gen(8))))
    records = []
    while (rec := engine.advance()) is not None:
        records.append(rec)
    return [p.grad.clone() for p in mod.parameters()], records


def test_engine_runs_lone_instructions_as_one_step_with_the_same_gradients(one_thread):
    prog = _program(3, overlap=False)
    fused_grads, fused_records = _engine_grads(prog, profile=False)
    task_grads, task_records = _engine_grads(prog, profile=True)  # profiling: one step per task
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, task_grads))
    chunk = TorchChunk(StageModule(MODEL, (-1, L + 1), seed=1, split_w=False))
    per_mb = len(chunk.task_keys("F")) + len(chunk.task_keys("B"))
    compute = [r for r in fused_records if r.op in ("F", "B")]
    assert len(compute) == 2 * 3  # one step per lone F and B instruction
    assert len([r for r in task_records if r.op in ("F", "B")]) == 3 * per_mb


def test_no_fusing_where_a_pair_interleaves_or_per_task_profiling(one_thread):
    mod = StageModule(MODEL, (-1, L + 1), seed=1, split_w=False)
    ch = TorchChunk(mod)
    keys = ch.task_keys("B")
    split = ch.runs_for(keys, [i == len(keys) // 2 for i in range(len(keys))])  # interleaved half-way
    ch.begin_forward(0, Lazy.of(torch.zeros(B, S, dtype=torch.int64)), torch.zeros(B, S, dtype=torch.int64), split)
    ch.begin_forward(1, Lazy.of(torch.zeros(B, S, dtype=torch.int64)), torch.zeros(B, S, dtype=torch.int64))
    assert split.count == 2 and not ch.fuses(0) and ch.fuses(1) and not ch.fuses(2)
    profiling = TorchChunk(mod, profile=True)
    profiling.begin_forward(0, Lazy.of(torch.zeros(B, S, dtype=torch.int64)), None)
    assert not profiling.fuses(0)
