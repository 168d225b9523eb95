"""First-in-first-out point-to-point order: the validator's per-link check, the compiler's send
order and p2p batches (one posting order per rank that both ends of every link share and that
cannot hang on NCCL), and the engine posting exactly that order, every batch a
``batch_isend_irecv`` on the pipeline group (gloo, pp=2), bitwise equal to the reference."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from tessera.engine import Batch, Engine, Layout, make_groups
from tessera.engine.p2p import program_links, program_order
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


def test_compiled_programs_carry_one_p2p_order_both_ends_share():
    """Every template's Programs carry p2p batches: each rank's every send and receive once; on
    every link both ends list the same messages in the same order (NCCL pairs them)."""
    for (template, pp, vpp, m), (overlap, split_w) in itertools.product(_shapes(), ((False, False), (True, True))):
        split_w = split_w or TEMPLATES[template].requires_split_w
        progs = compile_plan(_plan(template, pp, vpp, m, overlap, split_w))
        for p in progs:
            ops = program_order(p)
            assert sorted(k for b in ops for _, _, k in b) == sorted((o.kind, o.mb, o.sender_stage)
                                                                    for seq in link_ops(p).values() for o in seq)
            for peer in link_ops(p):
                mine = [k for b in ops for q, _, k in b if q == peer]
                theirs = [k for b in program_order(progs[peer]) for q, _, k in b if q == p.rank]
                assert mine == theirs, (template, pp, vpp, m, p.rank, peer)


def test_each_rank_posting_its_own_instruction_order_is_rejected():
    """1f1b pp=4: each rank posting its operations in its own instruction order pairs the
    crossing messages of a link differently on its two ends (a hang or a swapped buffer on NCCL)."""
    progs = compile_plan(_plan("1f1b", 4, 1, 8, overlap=False, split_w=False))
    own = tuple(dataclasses.replace(p, p2p_batches=tuple(((o.kind, o.mb, o.sender_stage),) for o in sorted(
        (o for seq in link_ops(p).values() for o in seq), key=lambda o: o.index))) for p in progs)
    with pytest.raises(ProgramError, match=r"link r0<->r1: batch \d+ holds .* on rank 0 but .* on rank 1; both ends "
                                           r"must group an exchange the same way"):
        validate_programs(own)


def test_an_order_that_would_hang_on_one_communicator_is_rejected():
    """1f1b pp=3: rank 1 posting its send to rank 2 of mb0 before the receive from rank 0 that
    send's data needs pairs up on both links, but on one communicator (one batch after another)
    the send waits for data the receive behind it brings: the validator names the stuck ranks."""
    progs = compile_plan(_plan("1f1b", 3, 1, 3, overlap=False, split_w=False))
    order = list(progs[1].p2p_batches)
    recv0, send0 = order.index((("act", 0, 0),)), order.index((("act", 0, 1),))
    assert recv0 < send0
    order.insert(recv0, order.pop(send0))  # each link's own order unchanged
    bad = (progs[0], dataclasses.replace(progs[1], p2p_batches=tuple(order)), progs[2])
    with pytest.raises(ProgramError, match=r"p2p batches would hang under NCCL .*rank 1 at instruction"):
        validate_programs(bad)


def test_a_batch_that_receives_before_its_send_is_rejected():
    """A batch is one group call: it cannot hold a receive the rank needs before its send's data
    exists (the batch could never be posted)."""
    progs = compile_plan(_plan("1f1b", 2, 1, 4, overlap=False, split_w=False))
    ops = [o for seq in link_ops(progs[0]).values() for o in seq]
    recv = next(o for o in ops if not o.send)
    later_send = next(o for o in ops if o.send and o.index > recv.index)
    keys = [b for b in progs[0].p2p_batches if b[0] not in {(recv.kind, recv.mb, recv.sender_stage),
                                                           (later_send.kind, later_send.mb, later_send.sender_stage)}]
    merged = ((recv.kind, recv.mb, recv.sender_stage), (later_send.kind, later_send.mb, later_send.sender_stage))
    bad = (dataclasses.replace(progs[0], p2p_batches=(merged, *keys)), progs[1])
    with pytest.raises(ProgramError, match=r"receives at instruction \d+ before its send at instruction \d+"):
        validate_programs(bad)


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
def test_engine_posts_the_programs_p2p_order_and_matches_reference(results, name):
    progs = _programs(name)
    crossing = 0
    for rank, res in enumerate(results):
        order, links = program_order(progs[rank]), program_links(progs[rank])
        for log, batches, sends in res[name]["logs"]:
            assert [ops for _, ops in log] == list(order), (name, rank)  # exactly the Program's batches, in order
            assert sends == sum(1 for _, ops in log for _, s, _ in ops if s) and batches == len(log)
            posted = [op for _, ops in log for op in ops]
            for peer, link in links.items():  # each direction keeps its first-in-first-out order
                for send in (True, False):
                    assert [k for p, s, k in posted if p == peer and s == send] == [k for s2, k in link if s2 == send]
                # where the link crosses (both ends send first), the shared order is not this end's own
                crossing += [(s, k) for p, s, k in posted if p == peer] != list(link)
    assert crossing >= 1

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
