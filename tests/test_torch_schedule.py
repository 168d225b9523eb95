"""Programs exported as torch.distributed.pipelining schedule CSVs (tessera.program.torch_schedule):
read back by torch's own loader (``_PipelineScheduleRuntime._load_csv``, which validates the
order and, for ``compute_only``, lowers it with its own sends and receives), written byte for
byte as torch's ``_dump_csv`` writes them, and run through torch's dry-run simulator of a
pipeline order (``_simulate_comms_compute``: a deadlock raises); and ``tessera plan
--export-schedule FILE`` in this process."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed.pipelining.schedules import (
    OVERLAP_F_B, REDUCE_GRAD, RESHARD, UNSHARD, _Action, _PipelineScheduleRuntime, _simulate_comms_compute)

from tessera.cli.main import build_parser, main, parse_args
from tessera.cli.plan import export_schedule
from tessera.config.load import load_recipe
from tessera.errors import ProgramError, TesseraConfigError
from tessera.flow import build_baseline, build_costs, compile_programs, resolve
from tessera.program.instructions import COMM_OPS, Op, Program
from tessera.program.torch_schedule import (
    BASE_ACTION_TYPES, schedule_export, torch_action_types, torch_actions, write_csv)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
ON = ["planner.overlap=true", "planner.split_w=true"]
CASES = {  # tiny recipe (8 layers) overrides: every template, with and without overlap / split W
    "interleaved-1f1b": [],
    "interleaved-1f1b-overlap-split": ON,
    "interleaved-1f1b-pp4": ["parallel.pp=4", "parallel.num_microbatches=8", *ON],
    "1f1b": ["parallel.vpp=1", "planner.template=1f1b", "planner.overlap=true", "planner.split_w=false"],
    "dualpipe-v": ["planner.template=dualpipe-v", "parallel.num_microbatches=8", *ON],
    "dualpipe-v-pp4": ["planner.template=dualpipe-v", "parallel.pp=4", "parallel.num_microbatches=8", *ON],
    "zb-h1": ["planner.template=zb-h1", "parallel.vpp=1", "planner.overlap=false", "planner.split_w=true"],
    "zb-v": ["planner.template=zb-v", "parallel.num_microbatches=8", *ON],
}


def _programs(over: list[str], dbo: bool = False) -> tuple[Program, ...]:
    """The baseline plan of the tiny recipe with ``over``, compiled and validated (with the DBO's
    slot annotations and W slack when ``dbo``)."""
    res = resolve(load_recipe(TINY, over))
    costs = build_costs(res)
    return compile_programs(build_baseline(res, costs), costs if dbo else None)


def _torch_load(path: Path, p0: Program, fmt: str) -> _PipelineScheduleRuntime:
    """torch's runtime schedule after ``_load_csv(path, format=fmt)``: the instance holds what the
    loader reads (pp, stages, microbatches) and no stage modules, which would need a process group
    of pp ranks; reading, validating (``_validate_schedule``) and lowering (``compute_only``:
    ``_add_send_recv``, which raises on an order it cannot run) are torch's own code."""
    s = object.__new__(_PipelineScheduleRuntime)
    s.pipeline_order, s._stages, s._defer_pp_recv = {}, [], False
    s.pp_group_size, s._num_stages, s._n_microbatches = p0.pp, p0.num_stages, p0.num_microbatches
    s._load_csv(str(path), format=fmt)
    return s


def _leaves(actions) -> list[_Action]:
    """The actions with every OVERLAP_F_B replaced by its sub-actions (as torch's runtime runs it)."""
    return [x for a in actions for x in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]


def _simulate(order: dict[int, list[_Action]], num_stages: int):
    """torch's dry run of a pipeline order with communication (``_simulate_comms_compute``; it
    models F/I/B/W and SEND/RECV, so OVERLAP_F_B runs as its sub-actions and UNSHARD, RESHARD and
    REDUCE_GRAD, no-ops between ranks, are left out); raises ``ValueError`` on a deadlock."""
    flat = {r: [a for a in _leaves(acts) if a.computation_type not in (UNSHARD, RESHARD, REDUCE_GRAD)]
            for r, acts in order.items()}
    owner = {a.stage_index: r for r, acts in flat.items() for a in acts}
    return _simulate_comms_compute(flat, lambda s: owner[s], num_stages)


def _compute_actions(p: Program) -> list[str]:
    """The mapping table of the module docstring, restated: the torch compute actions of ``p``'s
    compute instructions, in order (an FB as its two sub-actions)."""
    st = {s.chunk: s.stage for s in p.stages}
    out = []
    for i in p.instructions:
        bwd = "B" if i.with_w else "I"
        out += {Op.F: [f"{st.get(i.chunk)}F{i.mb}"], Op.B: [f"{st.get(i.chunk)}{bwd}{i.mb}"],
                Op.W: [f"{st.get(i.chunk)}W{i.mb}"],
                Op.FB: [f"{st.get(i.chunk)}F{i.mb}", f"{st.get(i.chunk2)}{bwd}{i.mb2}"]}.get(i.op, [])
    return out


def test_rows_of_a_two_rank_1f1b_by_hand():
    """1f1b, pp=2, M=2, overlap and split W (rank 1 is docs/programs.md's example): each
    instruction as its torch action on the global stage; the sends and receives in the order the
    engine posts them (rank 0 posts both gradient receives once its activations are out; rank 1
    both activation receives at once), REDUCE_GRAD per stage; register_w and optimizer_step
    are no actions."""
    p = _programs(["parallel.vpp=1", "planner.template=1f1b", "parallel.num_microbatches=2", *ON])
    comms = schedule_export(p, "compute_comms")
    assert comms.rows == (
        ("0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0I0", "0W0", "0I1", "0W1", "0REDUCE_GRAD"),
        ("1RECV_F0", "1RECV_F1", "1F0", "(1F1;1I0)OVERLAP_F_B", "1SEND_B0", "1W0", "1I1", "1SEND_B1", "1W1",
         "1REDUCE_GRAD"))
    assert comms.counts == (("F", 3), ("I", 3), ("W", 4), ("OVERLAP_F_B", 1), ("SEND_F", 2), ("RECV_F", 2),
                            ("SEND_B", 2), ("RECV_B", 2), ("REDUCE_GRAD", 2))
    assert comms.dropped == (("optimizer_step", 2), ("register_w", 4)) and comms.unsupported == ()
    assert comms.actions == 21
    only = schedule_export(p, "compute_only")
    assert only.rows == (("0F0", "0F1", "0I0", "0W0", "0I1", "0W1"),
                         ("1F0", "(1F1;1I0)OVERLAP_F_B", "1W0", "1I1", "1W1"))
    assert dict(only.dropped) == {"optimizer_step": 2, "register_w": 4, "send_act": 2, "recv_act": 2, "send_grad": 2,
                                  "recv_grad": 2, "reduce_grads": 2}
    assert torch_actions(p, "compute_only") == (only.rows, ())
    assert "1 overlapped F&B pair written as OVERLAP_F_B" in only.line()


@pytest.mark.parametrize("fmt", ["compute_comms", "compute_only"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_reads_validates_and_runs_the_export(case, fmt, tmp_path):
    """Per template and form: torch's loader reads the file back as the rows (and torch's writer
    writes the same bytes), every stage has each microbatch's F and backward once in the
    Program's compute order, and torch's simulator runs the order with its sends and receives
    (ours for compute_comms, torch's own lowering for compute_only) to the end."""
    programs = _programs(CASES[case])
    p0 = programs[0]
    path = tmp_path / "schedule.csv"
    e = write_csv(str(path), programs, fmt)
    assert e.path == str(path) and e.format == fmt and len(e.rows) == p0.pp

    s = _torch_load(path, p0, fmt)
    read = s.pipeline_order if fmt == "compute_only" else s.pipeline_order_with_comms
    assert [[str(a) for a in read[r]] for r in range(p0.pp)] == [list(row) for row in e.rows]
    s._dump_csv(str(tmp_path / "torch.csv"), format=fmt)  # torch's writer over what it read
    assert (tmp_path / "torch.csv").read_bytes() == path.read_bytes()

    for r, p in enumerate(programs):
        compute = [a for a in _leaves(read[r]) if a.computation_type.value in ("F", "I", "B", "W")]
        assert [str(a) for a in compute] == _compute_actions(p)
        kinds = Counter((a.stage_index, a.microbatch_index, "F" if a.computation_type.value == "F" else
                         "W" if a.computation_type.value == "W" else "dgrad") for a in compute)
        full = {(a.stage_index, a.microbatch_index) for a in compute if a.computation_type.value == "B"}
        for st in p.stages:
            for mb in range(p0.num_microbatches):
                assert kinds[st.stage, mb, "F"] == kinds[st.stage, mb, "dgrad"] == 1, (case, st.stage, mb)
                assert kinds[st.stage, mb, "W"] == (0 if (st.stage, mb) in full else 1)
        n = Counter(i.op for i in p.instructions)
        if fmt == "compute_comms":
            comm = Counter(a.computation_type.value for a in read[r] if "SEND" in a.computation_type.value
                           or "RECV" in a.computation_type.value)
            assert comm == Counter({"SEND_F": n[Op.SEND_ACT], "RECV_F": n[Op.RECV_ACT], "SEND_B": n[Op.SEND_GRAD],
                                    "RECV_B": n[Op.RECV_GRAD]}) - Counter()
            assert [str(a) for a in read[r] if a.computation_type == REDUCE_GRAD] == \
                [f"{st.stage}REDUCE_GRAD" for st in p.stages]
    fb = sum(i.op == Op.FB for p in programs for i in p.instructions)
    assert dict(e.counts).get("OVERLAP_F_B", 0) == fb and e.unsupported == ()
    assert sum(n for _, n in e.counts) == e.actions == sum(len(read[r]) for r in range(p0.pp))
    assert dict(e.dropped).get("register_w", 0) == sum(i.op == Op.REGISTER_W for p in programs for i in p.instructions)
    steps = _simulate(s.pipeline_order_with_comms, p0.num_stages)
    assert sum(a is not None for acts in steps.values() for a in acts) > 0


def test_without_overlap_f_b_an_fb_is_its_forward_then_its_backward(tmp_path):
    """A torch without OVERLAP_F_B (or REDUCE_GRAD): every FB becomes its F then its B, each one
    reported with what was written and why; torch still reads and runs the rows."""
    programs = _programs(CASES["dualpipe-v"])
    e = write_csv(str(tmp_path / "s.csv"), programs, "compute_comms", BASE_ACTION_TYPES)
    fbs = [(p.rank, k, i) for p in programs for k, i in enumerate(p.instructions) if i.op == Op.FB]
    fb_rows = [u for u in e.unsupported if u.instruction.startswith("FB")]
    assert [(u.rank, u.index) for u in fb_rows] == [(r, k) for r, k, _ in fbs] and fbs
    st = {p.rank: {s.chunk: s.stage for s in p.stages} for p in programs}
    assert [u.written for u in fb_rows] == [(f"{st[r][i.chunk]}F{i.mb}", f"{st[r][i.chunk2]}B{i.mb2}")
                                            for r, _, i in fbs]
    assert all("OVERLAP" not in a and "REDUCE_GRAD" not in a for row in e.rows for a in row)
    assert sum(u.instruction == "reduce_grads" for u in e.unsupported) == len(programs)
    assert f"{len(fbs)} overlapped F&B pairs written as F then I/B" in e.line()
    s = _torch_load(tmp_path / "s.csv", programs[0], "compute_comms")
    _simulate(s.pipeline_order_with_comms, programs[0].num_stages)
    assert "OVERLAP_F_B" in torch_action_types() and "REDUCE_GRAD" in torch_action_types()  # this torch has both


def test_without_a_posting_order_sends_and_receives_keep_instruction_order():
    """Programs without ``p2p_batches`` (built by hand): the sends and receives stay where the
    instructions have them; torch runs that too."""
    programs = tuple(replace(p, p2p_batches=()) for p in _programs(CASES["interleaved-1f1b-overlap-split"]))
    rows, _ = torch_actions(programs)
    for p, row in zip(programs, rows):
        st = {s.chunk: s.stage for s in p.stages}
        names = {Op.SEND_ACT: "SEND_F", Op.RECV_ACT: "RECV_F", Op.SEND_GRAD: "SEND_B", Op.RECV_GRAD: "RECV_B"}
        assert [a for a in row if "SEND" in a or "RECV" in a] == \
            [f"{st[i.chunk]}{names[i.op]}{i.mb}" for i in p.instructions if i.op in COMM_OPS]
    _simulate({r: [_Action.from_str(a) for a in row] for r, row in enumerate(rows)}, programs[0].num_stages)


def test_torch_checks_refuse_a_broken_order(tmp_path):
    """The checks above can fail: a receive moved behind the forward that needs it deadlocks
    torch's simulator, a backward before its forward fails torch's loader."""
    p = _programs(["parallel.vpp=1", "planner.template=1f1b", "parallel.num_microbatches=2", *ON])
    rows = [list(r) for r in torch_actions(p)[0]]
    rows[1][0], rows[1][2] = rows[1][2], rows[1][0]  # 1F0 before 1RECV_F0
    with pytest.raises(ValueError, match="not progressing"):
        _simulate({r: [_Action.from_str(a) for a in row] for r, row in enumerate(rows)}, 2)
    only = [list(r) for r in torch_actions(p, "compute_only")[0]]
    assert only[0] == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]
    only[0] = ["0F0", "0I1", "0F1", "0I0", "0W0", "0W1"]  # the backward of mb1 before its forward
    (tmp_path / "bad.csv").write_text("\n".join(",".join(r) for r in only) + "\n")
    with pytest.raises(AssertionError, match="without first running Forward"):
        _torch_load(tmp_path / "bad.csv", p[0], "compute_only")


def test_slot_annotations_and_the_w_pool_are_no_actions():
    """The DBO's Programs (slot annotations, W deferred to later deadlines): the slots are no
    actions (counted as dropped), the W actions sit at the deferred W instructions, every other
    compute action stays in place."""
    case = CASES["interleaved-1f1b-overlap-split"]
    plain, dbo = _programs(case), _programs(case, dbo=True)
    slots = sum(i.op == Op.SLOT for p in dbo for i in p.instructions)
    assert slots > 0
    a, b = schedule_export(plain), schedule_export(dbo)
    def of(row, kinds):
        return [x for x in row if _Action.from_str(x).computation_type.value in kinds]

    for p, ra, rb in zip(dbo, a.rows, b.rows):
        assert Counter(ra) == Counter(rb)
        others = ("F", "I", "B", "OVERLAP_F_B", "REDUCE_GRAD")
        assert of(ra, others) == of(rb, others)
        assert of(rb, ("W",)) == [x for x in _compute_actions(p) if x.split("W")[0].isdigit()]
    assert dict(b.dropped)["slot"] == slots and "slot" not in dict(a.dropped)


def test_bad_input_is_refused():
    programs = _programs(CASES["1f1b"])
    with pytest.raises(ProgramError, match="in rank order"):
        torch_actions(programs[::-1])
    with pytest.raises(ValueError, match="compute_comms, compute_only"):
        torch_actions(programs, "csv")
    k, ins = next((k, i) for k, i in enumerate(programs[0].instructions) if i.op == Op.SEND_ACT)
    bad = replace(programs[0], instructions=programs[0].instructions[:k] + (replace(ins, peer=0),)
                  + programs[0].instructions[k + 1:])
    with pytest.raises(ProgramError, match="stage 1 is on rank 1"):
        torch_actions((bad, programs[1]))


def test_plan_export_schedule(tmp_path, capsys):
    """``tessera plan TINY --export-schedule F``: F holds the Tessera plan's Programs (those of
    plan.json) as torch reads them, and the command says so in one line; a path in a missing
    directory is refused in one line before planning (exit 2, nothing written)."""
    quiet = ["logging.trace=false", "logging.png=false", "--no-progress", "--bound-time", "0"]
    csv_path, out = tmp_path / "schedule.csv", tmp_path / "out"
    capsys.readouterr()
    assert main(["plan", TINY, *quiet, "--out", str(out), "--export-schedule", str(csv_path)]) == 0
    text = capsys.readouterr().out
    programs = tuple(Program.from_dict(d) for d in json.loads((out / "plan.json").read_text())["programs"])
    e = schedule_export(programs)
    s = _torch_load(csv_path, programs[0], "compute_comms")
    assert [[str(a) for a in s.pipeline_order_with_comms[r]] for r in range(len(programs))] == [list(r) for r in e.rows]
    (line,) = [ln for ln in text.splitlines() if ln.startswith("torch schedule ")]
    assert line == replace(e, path=str(csv_path)).line()
    assert f"{csv_path} (compute_comms): {len(programs)} rows, {e.actions} actions" in line

    args = parse_args(build_parser(only="plan"), ["plan", TINY, "--export-schedule", "f.csv", "--export-format",
                                                  "compute_only"])
    assert export_schedule(str(csv_path), programs, args.export_format).startswith(
        f"torch schedule {csv_path} (compute_only): ")  # what `run` does with the flags, without planning again
    assert csv_path.read_text().splitlines() == [",".join(r) for r in schedule_export(programs, "compute_only").rows]
    with pytest.raises(TesseraConfigError, match="--export-schedule=.*cannot be written"):
        export_schedule(str(tmp_path / "gone" / "s.csv"), programs, "compute_comms")

    missing = tmp_path / "missing" / "s.csv"
    assert main(["plan", TINY, *quiet, "--out", str(tmp_path / "o2"), "--export-schedule", str(missing)]) == 2
    got = capsys.readouterr()
    (err,) = got.err.strip().splitlines()
    assert got.out == "" and err.startswith("tessera plan: error: --export-schedule=") and "does not exist" in err
    assert not (tmp_path / "o2").exists() and not missing.parent.exists()
