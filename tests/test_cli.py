"""``tessera simulate`` end to end through a subprocess: table, trace, PNG, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli.main import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "recipes" / "qwen3-next-80b.yaml")
TINY = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
NO_FILES = ["logging.png=false", "logging.trace=false"]


def _run(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m tessera ARGS`` (same entry point as the console script); never waits forever."""
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT, env=env)


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-500:])
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tessera simulate: error: ")
    return lines[0]


def test_subcommand_table_and_parser():
    assert "simulate" in SUBCOMMANDS
    args = build_parser().parse_args(["simulate", QWEN, "parallel.pp=8", "parallel.vpp=2", "--out", "x"])
    assert (args.recipe, args.overrides, args.out) == (QWEN, ["parallel.pp=8", "parallel.vpp=2"], "x")


def test_simulate_qwen3_next_pp8_vpp2(tmp_path):
    out = tmp_path / "sim"
    p = _run("simulate", QWEN, "parallel.pp=8", "parallel.vpp=2", "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    text = p.stdout
    for needle in ("tessera simulate: qwen3-next-80b (baseline plan)", "interleaved-1f1b", "pp=8 vpp=2 ep=8",
                   "iteration", "bubble ratio", "exposed A2A share", "peak memory (max)",
                   "peak memory per rank", "MFU", "simulation wall time", "S0[emb,0-2]", "per rank"):
        assert needle in text, needle
    # the serial-balanced partition of the cost model: one four-layer stage (S5), the head's S15 of two
    assert "layers per stage 3 3 3 3 3 4 3 3 3 3 3 3 3 3 3 2" in text
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert len(events) > 1000
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_default_out_dir_is_logging_out_dir_and_name(tmp_path):
    p = _run("simulate", TINY, "logging.png=false", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "tiny-qwen3-next" / "trace.json").read_text())
    assert not (tmp_path / "out" / "tiny-qwen3-next" / "timeline.png").exists()


@pytest.mark.parametrize("args,needles", [
    ((QWEN, "parallel.ep=3", "parallel.dp=3"), ("parallel.ep=3", "512 experts of qwen3-next-80b-a3b", "parallel.ep=2 with parallel.dp=4")),
    ((QWEN, "parallel.pipe=4"), ("parallel.pipe=4", "unknown key", "known keys")),
    ((QWEN, "parallel.pp=0"), ("parallel.pp=0", "must be >= 1")),
    ((QWEN, "parallel.pp=6", "parallel.num_microbatches=3"), ("parallel.num_microbatches=3", "3 < 6")),
    ((QWEN, "model.preset=gpt5"), ("model.preset='gpt5'", "qwen3-next-80b-a3b")),
    ((QWEN, "planner.template=gpipe"), ("planner.template='gpipe'", "1f1b")),
    ((QWEN, "hardware.inline.mem_gb=20"), ("needs", "capacity 19.0 GB (h800", "raise parallel.pp")),
    (("recipes/does-not-exist.yaml",), ("does-not-exist.yaml", "file does not exist")),
])
def test_bad_recipes_exit_2_with_one_line(args, needles):
    line = _one_line_error(_run("simulate", *args, *NO_FILES))
    for n in needles:
        assert n in line, (n, line)


def test_memory_error_names_worst_rank():
    line = _one_line_error(_run("simulate", QWEN, "planner.activation_recompute=false", "parallel.seq_length=8192",
                                *NO_FILES))
    # rank 0 holds S0 and the four-layer S8 (7 layers) and the most microbatches in flight
    assert "rank 0 needs 127.9 GB, capacity 81.2 GB (h800: 85.52 GB less planner.memory_margin=0.05)" in line
    assert "fix: set planner.activation_recompute=selective with planner.recompute_modules=[moe_act,layernorm] or =full (cheaper in time first)" in line


@pytest.mark.parametrize("m", range(1, 8))
def test_1f1b_with_fewer_microbatches_than_ranks_runs_or_exits_2(m, tmp_path):
    p = _run("simulate", QWEN, "planner.template=1f1b", "parallel.pp=8", "parallel.vpp=1",
             f"parallel.num_microbatches={m}", *NO_FILES, "--out", str(tmp_path / "o"), timeout=60)
    assert not (tmp_path / "o").exists()  # nothing to write, no folder made
    if p.returncode == 0:
        assert "iteration" in p.stdout and "bubble ratio" in p.stdout
    else:
        line = _one_line_error(p)
        assert f"{m}" in line and "8" in line and "num_microbatches" in line, line


def test_program_error_exits_2_with_one_line(monkeypatch, capsys):
    import tessera.flow
    from tessera.cli.main import main
    from tessera.errors import ProgramError

    def broken(recipe):
        raise ProgramError(3, 7, "deadlock:\n rank 3 waits for the act of mb 1")

    monkeypatch.setattr(tessera.flow, "simulate_recipe", broken)
    assert main(["simulate", TINY]) == 2
    err = capsys.readouterr().err
    assert err == "tessera simulate: error: rank 3, instruction 7: deadlock: rank 3 waits for the act of mb 1\n"


DEEPSEEK = str(ROOT / "recipes" / "deepseek-v3.yaml")


def _run_80_columns(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m tessera ARGS`` with stdout a pipe (not a TTY) and ``COLUMNS=80``, as in a log."""
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _row(text: str, label: str) -> str:
    """The one table line whose first cell is ``label``."""
    lines = [ln for ln in text.splitlines() if ln.startswith(f"│ {label} ")]
    assert len(lines) == 1, (label, lines)
    return lines[0]


def test_redirected_output_keeps_full_rows_numbers_and_paths(tmp_path):
    from tessera.config.load import load_recipe
    from tessera.flow import simulate_recipe

    out = tmp_path / "a-long-output-folder-name-so-that-the-paths-alone-exceed-eighty-columns" / "deepseek-v3"
    p = _run_80_columns("simulate", DEEPSEEK, "logging.png=false", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    text = p.stdout
    assert "…" not in text and "..." not in text
    run = simulate_recipe(load_recipe(DEEPSEEK))  # the same deterministic numbers, in-process
    r = run.result
    assert _row(text, "iteration").split("│")[2].strip() == f"{r.iteration_ms:.2f} ms"
    assert _row(text, "peak memory per rank").split("│")[2].strip() == \
        " ".join(f"{m.peak_mem_gb:.1f}" for m in r.ranks) + " GB"
    (stages,) = [ln for ln in text.splitlines() if "S0[emb," in ln]
    assert run.plan.partition.describe() in stages  # the 32 stages on one line
    assert _row(text, "output").split("│")[2].strip() == str(out / "trace.json")
    assert max(len(ln) for ln in text.splitlines()) > 300  # rows wider than COLUMNS, not wrapped
    assert "costs are nominal" not in text and "(nominal" not in text  # h800: a real preset


def test_cpu_preset_says_costs_are_nominal():
    from tessera.config.load import load_recipe
    from tessera.flow import simulate_recipe

    p = _run_80_columns("simulate", TINY, *NO_FILES)
    assert p.returncode == 0, p.stderr[-2000:]
    text = p.stdout
    r = simulate_recipe(load_recipe(TINY)).result
    assert _row(text, "iteration").split("│")[2].strip() == f"{r.iteration_ms:.2f} ms (nominal, see note)"
    assert _row(text, "MFU").split("│")[2].strip() == f"{100 * r.mfu:.1f}% (nominal, see note)"
    note = text[text.index("│ note "):text.index("│ layout ")]
    for needle in ("cpu costs are nominal", "analytic roofline", "1 TFLOP/s peak", "0.1 TB/s memory",
                   "not measured, no datasheet", "not a prediction of this machine's",
                   "then plan with planner.cost_source=profile"):
        assert needle in note, needle
    q = _run_80_columns("simulate", QWEN, *NO_FILES)
    assert q.returncode == 0, q.stderr[-2000:]
    assert "│ note " not in q.stdout and "nominal" not in q.stdout  # h800


@pytest.mark.parametrize("argv, recipe, overrides", [
    (["plan", "r.yaml", "--compare", "planner.cost_source=profile", "parallel.pp=2"], "r.yaml",
     ["planner.cost_source=profile", "parallel.pp=2"]),
    (["simulate", "r.yaml", "a=1", "--out", "d", "b=2"], "r.yaml", ["a=1", "b=2"]),
    (["profile", "r.yaml", "--check", "profile.reps=2"], "r.yaml", ["profile.reps=2"]),
    (["train", "r.yaml", "--no-progress", "train.steps=2"], "r.yaml", ["train.steps=2"]),
])
def test_overrides_are_accepted_after_flags(argv, recipe, overrides):
    from tessera.cli.main import parse_args

    args = parse_args(build_parser(only=argv[0]), argv)
    assert (args.recipe, args.overrides) == (recipe, overrides)


def test_an_unknown_flag_is_still_a_usage_error(capsys):
    from tessera.cli.main import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(only="plan"), ["plan", "r.yaml", "a=1", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
