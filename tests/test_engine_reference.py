"""An independent reference for the engine, and its early sends.

One 2-rank gloo launch (pp=2, interleaved-1f1b vpp=2 with F&B overlap and split W, the recipe
defaults: ``FB`` pairs, deferred W) on tiny-qwen3-next cut to 4 layers, seq 16, 4 microbatches:

* after one iteration Tessera's gradients equal, to float32 rounding, those of
  ``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B`` on the same stages and weights
  (plain autograd per stage, no Tessera task function) and those of plain single-process
  autograd of the whole model;
* a send is posted inside its ``FB`` pair, right after the side producing it, before the rest
  of the pair runs (the engine's hooks see the steps in the order they ran, and the isend count
  rises at the send's step).
"""

from __future__ import annotations

import dataclasses

import torch

from tessera.config.schema import ParallelConfig
from tessera.cost.analytic import analytic_costs
from tessera.engine import Batch, Engine, Hooks, Layout, make_groups
from tessera.model import MoEOptions, StageModule
from tessera.plan.baseline import baseline_plan
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Op
from tessera.spec.hardware_presets import get_hardware
from tessera.spec.presets import get_model
from tessera.testing import global_state_dict, run_local
from tessera.testing.torch_pp import torch_schedule, torch_step

SEED, M, SEQ = 3, 4, 16


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def program(rank: int):
    costs = analytic_costs(model_spec(), get_hardware("cpu"), ParallelConfig(
        pp=2, vpp=2, ep=1, dp=1, num_microbatches=M, micro_batch_size=1, seq_length=SEQ))
    return compile_plan(baseline_plan(costs, "interleaved-1f1b", 2, 2, M, overlap=True, split_w=True))[rank]


def batch() -> Batch:
    return Batch.from_tokens(torch.randint(0, 256, (M, 1, SEQ + 1), generator=torch.Generator().manual_seed(SEED)))


def grads_by_name(mods) -> dict[str, torch.Tensor]:
    out = {}
    for m in mods:
        names = list(global_state_dict(m))
        params = [p for layer in m.layers for _, p in layer.named_parameters()]
        params += [p for sub in (m.embed, m.head) if sub is not None for _, p in sub.named_parameters()]
        out.update({n: p.grad.clone() for n, p in zip(names, params)})
    return out


class StepLog(Hooks):
    """Every step as it ran: (instruction index, op, task, isends posted so far)."""

    def __init__(self) -> None:
        self.engine, self.events = None, []

    def step_done(self, record) -> None:
        self.events.append((record.index, record.op, record.task, self.engine.sends_posted))


def world(rank: int, world_size: int) -> dict:
    groups = make_groups(Layout(2, 1, 1))
    prog = program(groups.pipeline_rank)
    mods = [StageModule(model_spec(), (s.start, s.stop), seed=SEED) for s in prog.stages]
    log = StepLog()
    engine = Engine(prog, mods, groups, None, hooks=log)
    log.engine = engine
    engine.run_iteration(batch())
    out = {"tessera": grads_by_name(mods), "events": log.events}
    ref = [StageModule(model_spec(), (s.start, s.stop), seed=SEED) for s in prog.stages]
    torch_step(torch_schedule(prog, ref, groups.pipeline, 1, SEQ), batch(), groups.pipeline_rank, 2)
    out["torch"] = grads_by_name(ref)
    return out


def plain_grads() -> dict[str, torch.Tensor]:
    """Plain autograd of the whole model: mean loss over the microbatches (the aux loss scaled
    by 1/M the same way)."""
    model = StageModule(model_spec(), (-1, 5), seed=SEED, moe=MoEOptions(aux_loss_scale=1 / M))
    b = batch()
    for mb in range(M):
        (model(b.input_ids[mb], b.labels[mb]) / M).backward()
    return grads_by_name([model])


def test_gradients_match_torch_pipelining_and_plain_autograd():
    torch.set_num_threads(1)
    ranks = run_local(world, 2, timeout_s=120)
    tessera = {k: v for r in ranks for k, v in r["tessera"].items()}
    pipelining = {k: v for r in ranks for k, v in r["torch"].items()}
    plain = plain_grads()
    assert tessera.keys() == pipelining.keys() == plain.keys() and len(plain) > 100
    for name, want in plain.items():
        scale = want.abs().max().item()
        assert scale > 0, name
        for got in (tessera[name], pipelining[name]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1e-2), msg=name)

    # early sends: some FB pair's send runs inside the pair, between two of its tasks, and really
    # posts an isend there (the isend count rises at that step)
    inside = []
    for rank, res in enumerate(ranks):
        events, prog = res["events"], program(rank)
        for k in range(1, len(events) - 1):
            index, op, task, posted = events[k]
            if op in ("send_act", "send_grad") and events[k - 1][0] == events[k + 1][0] != index:
                fb = prog.instructions[events[k - 1][0]]
                # held (FIFO per link, docs/engine.md): the pair's other send to the same peer
                # comes first in the Program and its side has not ended yet
                prev = prog.instructions[index - 1]
                held = prev.op in (Op.SEND_ACT, Op.SEND_GRAD) and prev.peer == prog.instructions[index].peer and \
                    any(e[0] == index - 1 for e in events[k + 1:])
                assert fb.op == Op.FB and posted == events[k - 1][3] + (0 if held else 1), (rank, events[k - 1:k + 2])
                if held:
                    continue
                side_mb = fb.mb if op == "send_act" else fb.mb2
                assert prog.instructions[index].mb == side_mb
                inside.append((rank, task, events[k + 1][2]))
    assert any(t.startswith("send_grad") for _, t, _ in inside), inside
