"""First-in-first-out point-to-point order: the validator's per-link check, the compiler's send
order, and the engine posting each peer's messages in Program order (gloo, pp=2), batched where a
send and a receive with the same peer become due together, bitwise equal to the reference."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.engine.p2p import program_links
from tessera.errors import ProgramError, TesseraConfigError
from tessera.model import StageModule
from tessera.program.compiler import compile_plan
from tessera.program.instructions import Instr, Op
from tessera.program.link_order import link_ops
from tessera.program.plan import Partition, Plan
from tessera.program.templates import TEMPLATES, check_shape
from tessera.program.validate import validate_programs
from tessera.spec.presets import get_model
from tessera.testing import global_state_dict, reference_train, run_local

pytestmark = pytest.mark.xdist_group("p2p_order")  # module fixtures built once (tests/conftest.py)

SEED, LR, SEQ = 11, 3e-3, 8


def _plan(template, pp, vpp, m, overlap, split_w, layers=None):
    n = layers or pp * vpp
    bounds = (-1, *[round(n * s / (pp * vpp)) for s in range(1, pp * vpp)], n + 1)
    return Plan("fifo", template, pp, vpp, m, Partition(bounds), overlap, split_w)


def _assert_fifo(progs) -> int:
    """Every directed link's sends (sender's order) equal its receives (receiver's order),
    checked from the instruction lists alone; returns the number of links with a message."""
    links = 0
    for p in progs:
        for peer, ops in link_ops(p).items():
            sent = [(o.kind, o.mb, o.sender_stage) for o in ops if o.send]
            got = [(o.kind, o.mb, o.sender_stage) for o in link_ops(progs[peer])[p.rank] if not o.send]
            assert sent == got, (p.template, p.rank, peer)
            links += bool(sent)
    return links


# --- validator ------------------------------------------------------------------------------

def _swapped_pair():
    """1f1b pp=2 M=2, rank 0 sending mb1's activation before mb0's; rank 1 receives mb0 first."""
    good = compile_plan(_plan("1f1b", 2, 1, 2, overlap=False, split_w=False))
    r0 = (Instr(Op.F, 0, 0), Instr(Op.F, 1, 0), Instr(Op.SEND_ACT, 1, 0, peer=1), Instr(Op.SEND_ACT, 0, 0, peer=1),
          Instr(Op.RECV_GRAD, 0, 0, peer=1), Instr(Op.B, 0, 0, with_w=True), Instr(Op.RECV_GRAD, 1, 0, peer=1),
          Instr(Op.B, 1, 0, with_w=True), Instr(Op.REDUCE_GRADS), Instr(Op.OPTIMIZER_STEP))
    return (dataclasses.replace(good[0], instructions=r0), good[1])


def test_swapped_sends_on_one_link_are_rejected_naming_both_ranks_and_messages():
    progs = _swapped_pair()
    recvs = [str(i) for i in progs[1].instructions if i.op == Op.RECV_ACT]
    assert recvs == ["recv_act(mb0.c0 <- r0)", "recv_act(mb1.c0 <- r0)"]
    with pytest.raises(ProgramError) as e:
        validate_programs(progs)
    assert (e.value.rank, e.value.index) == (0, 2)
    msg = str(e.value)
    assert msg.startswith("rank 0, instruction 2: link r0->r1 is not first-in-first-out: message #0 rank 0 sends is "
                          "the activation of mb1 S0->S1 (instruction 2 send_act(mb1.c0 -> r1)) but message #0 rank 1 "
                          "receives is the activation of mb0 S0->S1 (instruction 0 recv_act(mb0.c0 <- r0))")
    assert "order the receives on rank 1 as rank 0 sends" in msg
    # the same Programs with tag matching alone would pass: only the FIFO rule rejects them
    fixed = list(progs[0].instructions)
    fixed[2], fixed[3] = fixed[3], fixed[2]
    validate_programs((dataclasses.replace(progs[0], instructions=tuple(fixed)), progs[1]))


def test_activations_and_gradients_share_the_link():
    """interleaved pp=2 vpp=2: rank 0 sends activations (S0->S1) and gradients (S2->S1) to rank 1
    on one link; swapping an activation with a gradient there is a FIFO error, not a match error."""
    progs = compile_plan(_plan("interleaved-1f1b", 2, 2, 4, overlap=True, split_w=True, layers=8))
    ins = list(progs[0].instructions)
    k = next(j for j, i in enumerate(ins) if i.op == Op.FB)
    assert [i.op for i in ins[k + 1:k + 3]] == [Op.SEND_ACT, Op.SEND_GRAD] and ins[k + 1].peer == ins[k + 2].peer == 1
    ins[k + 1], ins[k + 2] = ins[k + 2], ins[k + 1]
    with pytest.raises(ProgramError, match=rf"rank 0, instruction {k + 1}: link r0->r1 is not first-in-first-out: "
                                           r"message #\d+ rank 0 sends is the gradient of mb0 S2->S1 .* rank 1 receives "
                                           r"is the activation of mb3 S0->S1"):
        validate_programs((dataclasses.replace(progs[0], instructions=tuple(ins)), progs[1]))


# --- compiler: every template x shapes --------------------------------------------------------

def _shapes():
    for template, pp, vpp, m in itertools.product(sorted(TEMPLATES), (2, 3, 4), (1, 2, 3), (4, 6, 9)):
        try:
            check_shape(template, pp, vpp, m, pp * vpp)
        except TesseraConfigError:
            continue
        yield template, pp, vpp, m


def test_every_template_is_fifo_on_every_link():
    seen, links = set(), 0
    for (template, pp, vpp, m), (overlap, split_w) in itertools.product(_shapes(), ((False, False), (True, True))):
        if TEMPLATES[template].requires_split_w:
            split_w = True
        progs = compile_plan(_plan(template, pp, vpp, m, overlap, split_w))
        validate_programs(progs)
        links += _assert_fifo(progs)
        seen.add(template)
    assert seen == set(TEMPLATES) and links > 100


def test_compiler_moves_a_send_behind_the_message_its_receiver_takes_first():
    """dualpipe-v pp=3 M=6: rank 1 takes mb0's gradient of S5->S4 before mb4's activation of
    S0->S1 from rank 0, so rank 0 sends mb4's activation after that gradient, not right after F."""
    p0 = compile_plan(_plan("dualpipe-v", 3, 2, 6, overlap=False, split_w=False))[0]
    text = [str(i) for i in p0.instructions]
    f4, act4, grad0 = text.index("F(mb4.c0)"), text.index("send_act(mb4.c0 -> r1)"), text.index("send_grad(mb0.c1 -> r1)")
    assert f4 < grad0 < act4 and text[grad0 + 1] == "send_act(mb4.c0 -> r1)"
    assert text[f4 + 1] == "recv_act(mb0.c1 <- r1)"


# --- engine (gloo, pp=2) ----------------------------------------------------------------------

CASES = {"1f1b": ("1f1b", 1, 4), "interleaved": ("interleaved-1f1b", 2, 4)}


def model_spec():
    m = get_model("tiny-qwen3-next")
    return dataclasses.replace(m, layers=m.layers[:4])


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)


def _programs(name):
    template, vpp, m = CASES[name]
    return compile_plan(_plan(template, 2, vpp, m, overlap=True, split_w=True, layers=4))


def _batches(m):
    g = torch.Generator().manual_seed(SEED)
    return [[Batch.from_tokens(torch.randint(0, 256, (m, 1, SEQ + 1), generator=g))] for _ in range(2)]


def world(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    groups = make_groups(Layout(2, 1, 1))
    out = {}
    for name in CASES:
        prog = _programs(name)[groups.pipeline_rank]
        mods = [StageModule(model_spec(), (s.start, s.stop), seed=SEED) for s in prog.stages]
        engine = Engine(prog, mods, groups, make_optimizer([p for m in mods for p in m.parameters()]))
        logs = []
        for step in _batches(prog.num_microbatches):
            engine.run_iteration(step[0])
            comm = engine._comm
            logs.append((list(comm.post_log), comm.batches_posted, comm.sends_posted))
        out[name] = {"logs": logs, "state": {k: v for m in mods for k, v in global_state_dict(m).items()}}
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(world, 2, timeout_s=200)


@functools.lru_cache(maxsize=None)
def _reference(m):
    return reference_train(model_spec(), _batches(m), seed=SEED, make_optimizer=make_optimizer).state


@pytest.mark.parametrize("name", list(CASES))
def test_engine_posts_each_peer_in_program_order_and_matches_reference(results, name):
    progs = _programs(name)
    together = 0
    for rank, res in enumerate(results):
        links = program_links(progs[rank])
        for log, batches, sends in res[name]["logs"]:
            posted = [op for _, ops in log for op in ops]
            for peer, order in links.items():  # per peer: exactly the Program's order
                assert [(s, k) for p, s, k in posted if p == peer] == list(order), (name, rank, peer)
            assert sends == sum(1 for _, s, _ in posted if s)
            assert batches == sum(1 for _, ops in log if len(ops) > 1)
            # a send and a receive with the same peer became due at one point: one batch
            together += sum(1 for _, ops in log if len({s for p, s, _ in ops}) == 2)
    assert together >= 2 * len(results)  # on both ranks, in both iterations

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # as the workers
    torch.use_deterministic_algorithms(True)
    try:
        want = _reference(CASES[name][2])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    got = {}
    for res in results:
        got.update(res[name]["state"])
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} of {len(want)} parameters differ, e.g. {bad[:4]}"
