"""Engine hooks (tessera.engine.hooks) and the Op -> handler table: which events advance() emits,
in which order, for a tiny one-rank Program."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.cost.types import TaskKey
from tessera.engine import Batch, Engine, NoopChunk, TorchChunk
from tessera.engine.hooks import HookList, Hooks, as_hooks
from tessera.engine.pool import MovablePool, SlotPolicy
from tessera.model import StageModule
from tessera.program.instructions import Instr, Op, Program, StageRef
from tessera.spec.presets import get_model


class Recorder(Hooks):
    def __init__(self, tag: str = "") -> None:
        self.tag, self.events = tag, []

    def iteration_start(self, program: Program) -> None:
        self.events.append(("start", program.rank))

    def slot(self, index: int, ins: Instr) -> None:
        self.events.append(("slot", index, str(ins)))

    def step_done(self, record) -> None:
        self.events.append(("step", record.index, record.op, record.task, record.mb, record.chunk))

    def iteration_end(self, program: Program) -> None:
        self.events.append(("end", program.rank))


class SeesSlot(SlotPolicy):
    """A slot policy that records when it runs (to place the slot hook before it)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def select(self, ins: Instr, pool: MovablePool):
        self.log.append(("policy", str(ins)))
        return ()


KEYS = {"F": (TaskKey("F", -1, "embed"), TaskKey("F", 0, "mixer")),
        "B": (TaskKey("B", 0, "mixer"), TaskKey("B", -1, "embed")), "W": ()}
INSTRS = (Instr(Op.SLOT, 0, 0), Instr(Op.F, 0, 0), Instr(Op.B, 0, 0), Instr(Op.REGISTER_W, 0, 0), Instr(Op.W, 0, 0),
          Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
EXPECTED = [
    ("start", 0),
    ("slot", 0, "slot(mb0.c0)"),
    ("step", 0, "slot", "slot(mb0.c0)", 0, 0),
    ("step", 1, "F", "F.L-1.embed", 0, 0),
    ("step", 1, "F", "F.L0.mixer", 0, 0),
    ("step", 2, "B", "B.L0.mixer", 0, 0),
    ("step", 2, "B", "B.L-1.embed", 0, 0),
    ("step", 3, "register_w", "register_w(mb0.c0)", 0, 0),
    ("step", 4, "W", "W(mb0.c0)", 0, 0),
    ("step", 5, "reduce_grads", "reduce_grads", -1, -1),
    ("step", 6, "optimizer_step", "optimizer_step", -1, -1),
    ("end", 0),
]


def tiny_program() -> Program:
    return Program(0, 1, 1, 1, 1, (StageRef(0, 0, -1, 2),), INSTRS)


def batch() -> Batch:
    ids = torch.zeros(1, 1, 4, dtype=torch.int64)
    return Batch(ids, ids)


def run(engine: Engine) -> int:
    engine.begin(batch())
    steps = 0
    while engine.advance() is not None:
        steps += 1
    return steps


def test_recording_hook_sees_the_exact_event_sequence():
    rec = Recorder()
    engine = Engine(tiny_program(), [NoopChunk(KEYS, -1, 2)], hooks=rec)
    assert run(engine) == 9
    assert rec.events == EXPECTED
    with pytest.raises(Exception, match="before begin"):
        engine.advance()
    assert rec.events == EXPECTED  # nothing more after the end
    run(engine)  # a second iteration emits the same events again
    assert rec.events == EXPECTED * 2


def test_several_hooks_in_order_and_slot_hook_before_the_policy():
    log: list = []

    class Logs(Recorder):
        def slot(self, index, ins):
            log.append((self.tag, "slot", index))

    a, b = Logs("a"), Logs("b")
    engine = Engine(tiny_program(), [NoopChunk(KEYS, -1, 2)], hooks=[a, b], slot_policy=SeesSlot(log))
    run(engine)
    assert log == [("a", "slot", 0), ("b", "slot", 0), ("policy", "slot(mb0.c0)")]
    assert a.events == b.events == [e for e in EXPECTED if e[0] != "slot"]
    assert isinstance(engine.hooks, HookList) and engine.hooks.hooks == (a, b)


def test_as_hooks_defaults_and_errors():
    assert type(as_hooks(None)) is Hooks
    one = Recorder()
    assert as_hooks(one) is one and as_hooks([one]) is one
    with pytest.raises(TypeError, match="hooks must be a tessera.engine.hooks.Hooks or a list of them, got int"):
        as_hooks(3)


def test_handler_table_covers_every_op_with_a_method():
    assert set(Engine.HANDLERS) == set(Op)
    assert all(callable(getattr(Engine, name)) for name in Engine.HANDLERS.values())
    with pytest.raises(TypeError):
        Engine.HANDLERS[Op.F] = "_do_b"  # read-only mapping


def test_fb_hooks_on_a_real_chunk_structure():
    """An FB of a one-layer qwen3-next chunk: the structure comes from the model spec (no costs),
    and every task of both sides is one step_done, F side with mb1, B side with mb0."""
    m = get_model("tiny-qwen3-next")
    spec = dataclasses.replace(m, layers=m.layers[:1])
    chunk = NoopChunk.like(TorchChunk(StageModule(spec, (-1, 2), seed=0)))
    instrs = (Instr(Op.F, 0, 0), Instr(Op.FB, 1, 0, 0, 0, with_w=True), Instr(Op.B, 1, 0, with_w=True),
              Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
    prog = Program(0, 1, 1, 2, 1, (StageRef(0, 0, -1, 2),), instrs)
    rec = Recorder()
    engine = Engine(prog, [chunk], hooks=rec)
    engine.begin(Batch(torch.zeros(2, 1, 4, dtype=torch.int64), torch.zeros(2, 1, 4, dtype=torch.int64)))
    while engine.advance() is not None:
        pass
    fb = [e for e in rec.events if e[0] == "step" and e[1] == 1]
    n_f, n_b, n_w = (len(chunk.task_keys(p)) for p in "FBW")
    assert len(fb) == n_f + n_b + n_w + 1  # + the fused W of the B side (with_w)
    assert {e[4] for e in fb if e[3].startswith("F.")} == {1}
    assert {e[4] for e in fb if e[3][0] in "BW"} == {0}
    assert fb[0][3] == "F.L-1.embed" and fb[-1][3] == "W(mb0.c0)"
    assert rec.events[0] == ("start", 0) and rec.events[-1] == ("end", 0)


def test_slot_time_is_the_moved_work_alone_not_the_policys_decision():
    """``IterationResult.slot_ms`` (the bubble fill rate's numerator) counts only W a policy moved
    into a slot: a policy that spends 30 ms deciding and moves nothing fills nothing."""
    import time

    class SlowNothing(SlotPolicy):
        def select(self, ins: Instr, pool: MovablePool):
            time.sleep(0.03)
            return ()

    engine = Engine(tiny_program(), [NoopChunk(KEYS, -1, 2)], slot_policy=SlowNothing())
    engine.begin(batch())
    slot_step_ms = []
    while (rec := engine.advance()) is not None:
        if rec.op == "slot":
            slot_step_ms.append(rec.ms)
    assert len(slot_step_ms) == 1 and slot_step_ms[0] >= 25.0  # the step itself took the decision's time
    assert engine.slot_ms == 0.0
