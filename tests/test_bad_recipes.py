"""Bad recipes and overrides never crash: every one is exit code 2 and one stderr line naming the field
and the rule or fix (issue 9).

:data:`BAD_CASES` is the table: ``Case(id, args, needles, train)``. ``args`` are the command-line
arguments after the subcommand, with ``{root}`` (the repository) and ``{tmp}`` (a folder holding the
files of :func:`write_fixtures`) to fill in with :func:`case_args`; ``needles`` must all appear in the
error line; ``train=False`` marks cases whose first error under ``tessera train`` may differ (tensor
parallelism, which training rejects first, and simulate/plan-only outputs). Each case runs in-process
through :func:`tessera.cli.main` for ``simulate`` and ``plan``; a few run through ``python -m tessera``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tessera.cli.main import main

pytestmark = pytest.mark.xdist_group("bad_recipes")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
QWEN = "{root}/recipes/qwen3-next-80b.yaml"
QWEN235 = "{root}/recipes/qwen3-235b.yaml"
DEEPSEEK = "{root}/recipes/deepseek-v3.yaml"


class Case(NamedTuple):
    """One bad input: ``args`` after the subcommand, ``needles`` that the error line contains."""

    id: str
    args: tuple[str, ...]
    needles: tuple[str, ...]
    train: bool = True


_HF_QWEN_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_ATT = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
_MOE = {"num_experts": 4, "top_k": 2, "expert_ffn": 32}

FIXTURES: dict[str, str | bytes] = {
    "invalid.yaml": "name: x\nparallel: [1, 2\n",
    "list.yaml": "- a\n- b\n",
    "notutf8.yaml": b"name: \xff\xfe x\n",
    "unknown_key.yaml": "name: x\nparalel:\n  pp: 2\n",
    "wrong_type.yaml": "name: x\nmodel:\n  preset: tiny-qwen3-next\nparallel:\n  pp: eight\n",
    "both_sources.yaml": "name: x\nmodel:\n  preset: tiny-qwen3-next\n  hf_config: hf/config.json\n",
    "somedir/a.yaml": "name: a\n",
    "somedir/b.yaml": "name: b\n",
    "emptydir/readme.txt": "no recipes here\n",
    "hf/config.json": json.dumps(_HF_QWEN_MOE),
    "hf_notjson.json": "{not json",
    "hf_list.json": "[1, 2]",
    "hf_huge.json": json.dumps({**_HF_QWEN_MOE, "num_hidden_layers": 100000}),
    "hf_llama.json": json.dumps({**_HF_QWEN_MOE, "model_type": "llama"}),
    "hf_heads_str.json": json.dumps({**_HF_QWEN_MOE, "num_attention_heads": "four"}),
    "inline_hidden0.yaml": json.dumps({"name": "i", "model": {"inline": {
        "name": "i", "pattern": "*E*E", "hidden": 0, "vocab": 256, "attention": _ATT, "moe": _MOE}},
        "hardware": {"preset": "cpu"}}),
    "inline_topk.yaml": json.dumps({"name": "i", "model": {"inline": {
        "name": "i", "pattern": "*E*E", "hidden": 64, "vocab": 256, "attention": _ATT,
        "moe": {**_MOE, "top_k": 9}}}, "hardware": {"preset": "cpu"}}),
    "inline_long.yaml": json.dumps({"name": "i", "model": {"inline": {
        "name": "i", "pattern": "*E" * 1000, "hidden": 64, "vocab": 256, "attention": _ATT, "moe": _MOE}}}),
    "inline_nolayers.yaml": json.dumps({"name": "i", "model": {"inline": {"name": "i", "hidden": 64, "vocab": 256,
                                                                         "layers": []}}}),
    "inline_dense.yaml": json.dumps({"name": "i", "model": {"inline": {
        "name": "i", "pattern": "*-*-", "hidden": 64, "vocab": 256, "attention": _ATT, "dense": {"ffn": 128}}},
        "hardware": {"preset": "cpu"}, "parallel": {"ep": 2, "dp": 2}}),
    "hw_nan.yaml": "name: x\nmodel:\n  preset: tiny-qwen3-next\nhardware:\n  preset: cpu\n  inline:\n    mem_gb: .nan\n",
}
"""Files (path under ``{tmp}`` -> content) that the file cases read."""

BAD_CASES: list[Case] = [
    # --- files
    Case("recipe-missing", ("{root}/recipes/qwen3-next-80.yaml",),
         ("recipe=", "file does not exist", "did you mean", "qwen3-next-80b.yaml")),
    Case("recipe-is-directory", ("{tmp}/somedir",), ("recipe=", "is a directory", "somedir/a.yaml", "somedir/b.yaml")),
    Case("recipe-directory-without-yaml", ("{tmp}/emptydir/",), ("recipe=", "is a directory", "holds no .yaml")),
    Case("recipe-invalid-yaml", ("{tmp}/invalid.yaml",), ("recipe=", "is not valid YAML at line", "fix the YAML")),
    Case("recipe-top-level-list", ("{tmp}/list.yaml",), ("recipe=", "top level must be a mapping")),
    Case("recipe-not-utf8", ("{tmp}/notutf8.yaml",), ("recipe=", "cannot be read", "UnicodeDecodeError", "UTF-8")),
    Case("recipe-unknown-key", ("{tmp}/unknown_key.yaml",), ("paralel", "unknown key", "did you mean 'parallel'")),
    Case("recipe-wrong-type", ("{tmp}/wrong_type.yaml",), ("parallel.pp='eight'", "of type int")),
    # --- syntax, keys and types (overrides)
    Case("override-no-equals", (QWEN, "parallel.pp"), ("override='parallel.pp'", "section.field=value")),
    Case("override-unknown-section", (QWEN, "paralel.pp=3"), ("paralel", "did you mean 'parallel'")),
    Case("override-unknown-top-level", (QWEN, "foo=1"), ("foo", "unknown key in the recipe top level")),
    Case("override-section-scalar", (QWEN, "parallel=8"), ("parallel=8", "is a section", "num_microbatches")),
    Case("override-wrong-type-int", (QWEN, "parallel.pp=eight"), ("parallel.pp='eight'", "of type int")),
    # --- model
    Case("model-preset-unknown", (QWEN, "model.preset=qwen3-next"),
         ("model.preset='qwen3-next'", "unknown preset", "did you mean 'qwen3-next-80b-a3b'")),
    Case("model-two-sources-in-recipe", ("{tmp}/both_sources.yaml",),
         ("model.hf_config", "model.preset='tiny-qwen3-next'", "same recipe", "one model source")),
    Case("model-two-sources-in-overrides", (QWEN, "model.preset=deepseek-v3", "model.hf_config=x.json"),
         ("model.hf_config='x.json'", "same overrides", "one model source")),
    Case("model-hf-config-missing", ("model.hf_config=no-such-config.json",),
         ("model.hf_config='no-such-config.json'", "file does not exist")),
    Case("model-hf-config-folder-without-config", (QWEN, "model.hf_config={tmp}/somedir"),
         ("model.hf_config=", "folder has no config.json")),
    Case("model-hf-config-not-json", (QWEN, "model.hf_config={tmp}/hf_notjson.json"),
         ("model.hf_config=", "cannot be read as JSON")),
    Case("model-hf-config-json-list", (QWEN, "model.hf_config={tmp}/hf_list.json"),
         ("model.hf_config=", "holds a JSON list")),
    Case("model-hf-config-too-many-layers", (QWEN, "model.hf_config={tmp}/hf_huge.json"),
         ("hf_config.num_hidden_layers=100000", "1024 layers")),
    Case("model-hf-config-unsupported-type", (QWEN, "model.hf_config={tmp}/hf_llama.json"),
         ("hf_config.model_type='llama'", "unsupported model type", "qwen3_moe")),
    Case("model-hf-config-wrong-type", (QWEN, "model.hf_config={tmp}/hf_heads_str.json"),
         ("hf_config.num_attention_heads='four'", "must be an integer")),
    Case("model-no-source-left", (QWEN, "model.preset=null"), ("model=None", "needs one of preset, hf_config or inline")),
    Case("model-num-layers-over-model", (QWEN, "model.num_layers=60"),
         ("model.num_layers=60", "48 layers of qwen3-next-80b-a3b", "1..48")),
    Case("model-num-layers-negative", (QWEN, "model.num_layers=-1"), ("model.num_layers=-1", "must be >= 0")),
    Case("model-inline-not-a-spec", (QWEN, "model.inline.x=1"), ("model.inline=", "is not a ModelSpec dict")),
    Case("model-inline-hidden-zero", ("{tmp}/inline_hidden0.yaml",), ("model.inline.hidden=0", "must be in 1..")),
    Case("model-inline-top-k", ("{tmp}/inline_topk.yaml",),
         ("model.inline.layers[1].mlp.top_k=9", "num_experts=4")),
    Case("model-inline-too-many-layers", ("{tmp}/inline_long.yaml",), ("model.inline.pattern=2000", "1024 layers")),
    Case("model-inline-no-layers", ("{tmp}/inline_nolayers.yaml",), ("model.inline.layers=0", "needs 1..1024 layers")),
    # --- parallel: sizes and bounds
    Case("pp-zero", (QWEN, "parallel.pp=0"), ("parallel.pp=0", "must be >= 1", "use parallel.pp=")),
    Case("pp-over-limit", (QWEN, "parallel.pp=5000"), ("parallel.pp=5000", "must be <= 1024")),
    Case("vpp-over-limit", (QWEN, "parallel.vpp=1000"), ("parallel.vpp=1000", "must be <= 64")),
    Case("dp-over-limit", (QWEN, "parallel.dp=1000000"), ("parallel.dp=1000000", "must be <= 65536")),
    Case("tp-over-limit", (QWEN, "parallel.tp=256"), ("parallel.tp=256", "must be <= 128")),
    Case("ep-over-limit", (QWEN, "parallel.ep=8192"), ("parallel.ep=8192", "must be <= 4096")),
    Case("microbatches-over-limit", (QWEN, "parallel.num_microbatches=100000000"),
         ("parallel.num_microbatches=100000000", "must be <= 4096", "parallel.num_microbatches=512, 1024, 2048 or 4096")),
    Case("seq-length-over-limit", (QWEN, "parallel.seq_length=100000000"), ("parallel.seq_length=", "<= 1048576")),
    Case("micro-batch-over-limit", (QWEN, "parallel.micro_batch_size=100000"),
         ("parallel.micro_batch_size=100000", "<= 4096")),
    Case("tokens-per-microbatch", (QWEN, "parallel.micro_batch_size=4096", "parallel.seq_length=8192"),
         ("parallel.micro_batch_size=4096", "tokens per microbatch exceed 16777216")),
    Case("layer-microbatches", (QWEN235, "parallel.num_microbatches=4096"),
         ("parallel.num_microbatches=4096", "94*4096", "262144")),
    Case("gpus-over-limit", (DEEPSEEK, "parallel.dp=65536", "parallel.tp=2"), ("parallel.dp=65536", "pp*dp*tp", "1048576")),
    # --- parallel: layout rules
    Case("pp-more-stages-than-layers", (QWEN, "parallel.pp=64"),
         ("parallel.pp=64", "exceed the 48 layers", "parallel.pp=6, 8, 12 or 16")),
    Case("vpp-more-stages-than-layers", ("parallel.pp=8", "parallel.vpp=2", "parallel.num_microbatches=8"),
         ("parallel.vpp=2", "use pp*vpp <= 8", "parallel.vpp=1")),
    Case("ep-not-dividing-experts", ("parallel.ep=3", "parallel.dp=3"),
         ("parallel.ep=3", "8 experts of tiny-qwen3-next", "parallel.ep=1", "parallel.ep=2 with parallel.dp=4")),
    Case("ep-not-dividing-dp-tp", (QWEN, "parallel.ep=16"), ("parallel.ep=16", "dp*tp = 8*1 = 8", "parallel.dp=16")),
    Case("ep-not-dividing-dp-tp-with-tp", ("parallel.ep=8", "parallel.dp=2", "parallel.tp=2"),
         ("parallel.ep=8", "dp*tp = 2*2 = 4"), train=False),
    Case("ep-without-moe", ("{tmp}/inline_dense.yaml",), ("parallel.ep=2", "no MoE layers", "parallel.ep=1")),
    Case("tp-three", (QWEN, "parallel.tp=3"),
         ("parallel.tp=3", "16 Gated DeltaNet key heads", "attention query heads", "parallel.tp=1 or 2"), train=False),
    Case("tp-kv-heads", (QWEN, "parallel.tp=4"), ("parallel.tp=4", "2 attention KV heads", "parallel.tp=1 or 2"),
         train=False),
    Case("tp-seq-length", ("parallel.tp=2", "parallel.seq_length=63"),
         ("parallel.tp=2", "parallel.seq_length=63", "sequence parallelism"), train=False),
    # --- planner and template shapes
    Case("template-unknown", (QWEN, "planner.template=interleaved"),
         ("planner.template='interleaved'", "unknown template", "did you mean 'interleaved-1f1b'")),
    Case("template-1f1b-with-vpp", (QWEN, "planner.template=1f1b"),
         ("parallel.vpp=2", "1f1b", "parallel.vpp=1", "planner.template=interleaved-1f1b")),
    Case("template-interleaved-too-few-microbatches", (QWEN, "parallel.pp=6", "parallel.num_microbatches=3"),
         ("parallel.num_microbatches=3", "3 < 6", "parallel.vpp=1")),
    Case("template-dualpipe-v-too-few-microbatches", (QWEN, "planner.template=dualpipe-v", "parallel.num_microbatches=8"),
         ("parallel.num_microbatches=8", "8 < 16", "parallel.num_microbatches=16")),
    Case("template-dualpipe-v-vpp", (QWEN, "planner.template=dualpipe-v", "parallel.vpp=3"),
         ("parallel.vpp=3", "dualpipe-v", "parallel.vpp=2")),
    Case("planner-radius-negative", (QWEN, "planner.candidate_radius=-1"), ("planner.candidate_radius=-1", ">= 0")),
    Case("planner-radius-over-limit", (QWEN, "planner.candidate_radius=50"), ("planner.candidate_radius=50", "<= 4")),
    Case("planner-time-limit-zero", (QWEN, "planner.time_limit_s=0"), ("planner.time_limit_s=0.0", "(0, 86400]")),
    Case("parallel-vpp-word", (QWEN, "parallel.vpp=two"), ("parallel.vpp='two'", "integer >= 1 or auto")),
    Case("planner-objective", (QWEN, "planner.objective=makespan"),
         ("planner.objective='makespan'", "not a planner objective", "iteration", "bottleneck")),
    Case("planner-search-time-negative", (QWEN, "planner.search_time_s=-1"),
         ("planner.search_time_s=-1", "[0, 86400]")),
    Case("train-master-weights-type", (QWEN, "train.master_weights=maybe"), ("train.master_weights='maybe'",)),
    Case("train-master-weights-fp32", (QWEN, "train.master_weights=false", "train.precision=fp32"),
         ("train.master_weights=False", "BF16 compute precision", "train.precision=bf16")),
    Case("planner-memory-margin", (QWEN, "planner.memory_margin=1.5"), ("planner.memory_margin=1.5", "[0, 1)")),
    Case("planner-cost-source", (QWEN, "planner.cost_source=profil"),
         ("planner.cost_source='profil'", "not yet implemented", "analytic")),
    Case("planner-overlap-type", (QWEN, "planner.overlap=maybe"), ("planner.overlap='maybe'", "bool")),
    # --- hardware
    Case("hardware-preset-unknown", (QWEN, "hardware.preset=h100"),
         ("hardware.preset='h100'", "unknown preset", "did you mean 'h100-sxm'")),
    Case("hardware-inline-unknown-field", (QWEN, "hardware.inline.mem_gbs=96"),
         ("hardware.inline.mem_gbs=96", "did you mean 'mem_gb'")),
    Case("hardware-inline-type", (QWEN, "hardware.inline.mem_gb=lots"), ("hardware.inline.mem_gb='lots'", "float")),
    Case("hardware-inline-range", (QWEN, "hardware.inline.comm_sms=132"),
         ("hardware.inline.comm_sms=132", "must be below num_sms=132")),
    Case("hardware-inline-nan", ("{tmp}/hw_nan.yaml",), ("hardware.inline.mem_gb=nan", "finite")),
    Case("hardware-memory", ("hardware.inline.mem_gb=0.001",), ("parallel.pp=2", "GB", "capacity")),
    # --- dbo
    Case("dbo-routing", (QWEN, "dbo.routing=sticky"), ("dbo.routing='sticky'", "must be one of", "use uniform")),
    Case("dbo-pool-negative", (QWEN, "dbo.pool_mem_gb=-1"), ("dbo.pool_mem_gb=-1.0", ">= 0")),
    Case("dbo-margin-type", (QWEN, "dbo.margin=lots"), ("dbo.margin='lots'", "float")),
    # --- train
    Case("train-steps-negative", (QWEN, "train.steps=-1"), ("train.steps=-1", ">= 0")),
    Case("train-steps-type", (QWEN, "train.steps=many"), ("train.steps='many'", "int")),
    Case("train-lr-zero", (QWEN, "train.lr=0"), ("train.lr=0.0", "> 0")),
    Case("train-weight-decay-negative", (QWEN, "train.weight_decay=-0.1"), ("train.weight_decay=-0.1", ">= 0")),
    Case("train-checkpoint-negative", (QWEN, "train.checkpoint_every=-5"), ("train.checkpoint_every=-5", ">= 0")),
    # --- logging
    Case("logging-png-type", (QWEN, "logging.png=maybe"), ("logging.png='maybe'", "bool"), train=False),
    Case("logging-unknown-key", (QWEN, "logging.pngs=false"), ("logging.pngs", "did you mean 'png'")),
    Case("logging-wandb-mode", (QWEN, "logging.wandb_mode=onlin"),
         ("logging.wandb_mode='onlin'", "unknown W&B mode", "did you mean 'online'")),
    Case("logging-out-dir-is-file", (QWEN, "logging.out_dir={tmp}/invalid.yaml"),
         ("logging.out_dir=", "is an existing file")),
    # --- job
    Case("recompute-mode", (QWEN, "planner.activation_recompute=partial"),
         ("planner.activation_recompute='partial'", "is not a recompute mode", "use one of: none, selective, full")),
    Case("recompute-module", (QWEN, "planner.activation_recompute=selective", "planner.recompute_modules=[attn]"),
         ("planner.recompute_modules='attn'", "unknown module", "core_attn")),
    Case("recompute-selective-empty", (QWEN, "planner.activation_recompute=selective", "planner.recompute_modules=[]"),
         ("planner.recompute_modules=[]", "needs at least one module")),
    Case("dispatcher", (QWEN, "parallel.moe_dispatcher=deep_ep"),
         ("parallel.moe_dispatcher='deep_ep'", "did you mean 'deepep'")),
    Case("dp-shard", (QWEN, "parallel.dp_shard=zero3"), ("parallel.dp_shard='zero3'", "use one of: zero1, fsdp")),
    Case("precision", (QWEN, "train.precision=fp4"), ("train.precision='fp4'", "use one of: auto, bf16, fp8, fp32")),
    Case("mtp-layers", (QWEN, "model.mtp_layers=-1"), ("model.mtp_layers=-1", "must be 0..8")),
    Case("job-unknown-key", (QWEN, "job.max_failure=1"), ("job.max_failure", "did you mean 'max_failures'")),
    Case("job-max-failures", (QWEN, "job.max_failures=-2"), ("job.max_failures=-2", "must be >= -1")),
    Case("job-max-failures-type", (QWEN, "job.max_failures=many"), ("job.max_failures='many'", "int")),
    Case("job-cpus-per-worker", (QWEN, "job.cpus_per_worker=0"), ("job.cpus_per_worker=0.0", "> 0")),
    Case("job-threads", (QWEN, "job.threads=0"), ("job.threads=0", "must be null or >= 1")),
    Case("job-pg-timeout", (QWEN, "job.pg_timeout_s=0"), ("job.pg_timeout_s=0.0", ">= 1")),
    Case("job-num-to-keep", (QWEN, "job.num_to_keep=0"), ("job.num_to_keep=0", "must be null or >= 1")),
    Case("job-run-name", (QWEN, "job.run_name=a/b"), ("job.run_name='a/b'", "plain directory name")),
    Case("job-socket-ifname", (QWEN, "job.socket_ifname=^docker"),
         ("job.socket_ifname='^docker'", "interface names separated by commas", "job.socket_ifname=eth0")),
]
"""Every bad input and what its one error line must contain."""


def write_fixtures(tmp: Path) -> Path:
    """Write :data:`FIXTURES` under ``tmp``; returns ``tmp``."""
    for rel, content in FIXTURES.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return tmp


def case_args(case: Case, tmp: Path) -> list[str]:
    """``case.args`` with ``{root}`` and ``{tmp}`` filled in (``tmp``: a :func:`write_fixtures` folder)."""
    return [a.format(root=ROOT, tmp=tmp) for a in case.args]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("bad_recipes"))


def _quiet(args: list[str]) -> list[str]:
    """``args`` with ``logging.png=false logging.trace=false`` as the first overrides (the case's own
    overrides come later and win)."""
    quiet = ["logging.png=false", "logging.trace=false"]
    return args[:1] + quiet + args[1:] if "=" not in args[0] else quiet + args


def _error_line(err: str, out: str, command: str) -> str:
    assert "Traceback" not in err and out == "", (out[-500:], err[-500:])
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tessera {command}: error: "), lines[0]
    assert "; fix: " in lines[0], lines[0]
    return lines[0]


def test_the_table_covers_every_section():
    assert len(BAD_CASES) >= 40 and len({c.id for c in BAD_CASES}) == len(BAD_CASES)
    fields = " ".join(n for c in BAD_CASES for n in c.needles)
    for section in ("recipe=", "model.", "parallel.", "hardware.", "planner.", "dbo.", "train.", "logging.", "job."):
        assert section in fields, section


@pytest.mark.parametrize("command", ["simulate", "plan"])
@pytest.mark.parametrize("case", BAD_CASES, ids=[c.id for c in BAD_CASES])
def test_bad_input_is_one_line_and_exit_2(case, command, fixtures, capsys, tmp_path):
    rc = main([command, *_quiet(case_args(case, fixtures)), "--out", str(tmp_path / "out")])
    cap = capsys.readouterr()
    assert rc == 2, (cap.out[-500:], cap.err[-500:])
    line = _error_line(cap.err, cap.out, command)
    for n in case.needles:
        assert n in line, (n, line)
    assert not (tmp_path / "out").exists()  # nothing written


# Run as root, drop the two capabilities that let root open any file (CAP_DAC_OVERRIDE = 1,
# CAP_DAC_READ_SEARCH = 2) from the bounding set (prctl PR_CAPBSET_DROP = 24), then exec the command:
# a uid-0 process gets the bounding set as its capabilities at exec, so it then reads a file by its
# mode bits like any user. Elsewhere it just execs the command.
_NO_DAC = ("import ctypes, os, sys\n"
           "if os.geteuid() == 0:\n"
           "    libc = ctypes.CDLL(None, use_errno=True)\n"
           "    for cap in (1, 2):\n"
           "        if libc.prctl(24, cap, 0, 0, 0) != 0:\n"
           "            raise OSError(ctypes.get_errno(), f'prctl(PR_CAPBSET_DROP, {cap}) failed')\n"
           "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


def test_unreadable_recipe(tmp_path):
    """A recipe file that exists but cannot be opened (mode 0): one line naming the PermissionError
    and the fix. CI runs as root, which reads files whatever their mode, so the command runs without
    root's file-access override (``_NO_DAC``): the same check for root and for any other user."""
    p = tmp_path / "secret.yaml"
    p.write_text("name: x\n")
    p.chmod(0)
    proc = subprocess.run([sys.executable, "-c", _NO_DAC, "-m", "tessera", "simulate", str(p)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, (proc.stdout[-500:], proc.stderr[-500:])
    line = _error_line(proc.stderr, proc.stdout, "simulate")
    assert line == (f"tessera simulate: error: recipe='{p}': cannot be read (PermissionError: [Errno 13] "
                    f"Permission denied: '{p}'); fix: make it a readable UTF-8 text file (check its permissions)")


# --------------------------------------------------------------------------- proposed fixes are valid

_ASSIGN = re.compile(r"(parallel\.\w+|planner\.template)=([\w.-]+(?:, [\w.-]+)*(?: or [\w.-]+)?)"
                     r"(?: with (parallel\.dp)=(\d+))?")


def _proposals(fix: str) -> list[list[str]]:
    """Each override set a fix proposes: ``parallel.ep=1, 2 or 4`` gives three, ``parallel.ep=2 with
    parallel.dp=4`` one with both."""
    out = []
    for m in _ASSIGN.finditer(fix):
        values = re.split(r", | or ", m.group(2))
        extra = [f"{m.group(3)}={m.group(4)}"] if m.group(3) else []
        out += [[f"{m.group(1)}={v}"] + extra for v in values]
    return out


_LAYOUT_IDS = {"pp-zero", "pp-over-limit", "vpp-over-limit", "dp-over-limit", "tp-over-limit", "ep-over-limit",
               "microbatches-over-limit", "seq-length-over-limit", "micro-batch-over-limit", "tokens-per-microbatch",
               "layer-microbatches", "gpus-over-limit", "pp-more-stages-than-layers", "vpp-more-stages-than-layers",
               "ep-not-dividing-experts", "ep-not-dividing-dp-tp", "ep-not-dividing-dp-tp-with-tp", "ep-without-moe",
               "tp-three", "tp-kv-heads", "tp-seq-length", "template-unknown", "template-1f1b-with-vpp",
               "template-interleaved-too-few-microbatches", "template-dualpipe-v-too-few-microbatches",
               "template-dualpipe-v-vpp"}
LAYOUT_CASES = [c for c in BAD_CASES if c.id in _LAYOUT_IDS]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c.id for c in LAYOUT_CASES])
def test_every_proposed_layout_value_passes_validation(case, fixtures):
    from tessera.config.load import load_recipe
    from tessera.config.resolve import resolve_model
    from tessera.config.validate import validate_recipe
    from tessera.errors import TesseraConfigError
    from tessera.flow import resolve

    args = case_args(case, fixtures)
    path, overrides = (None, args) if "=" in args[0] else (args[0], args[1:])
    with pytest.raises(TesseraConfigError) as ei:
        resolve(load_recipe(path, overrides))
    proposals = _proposals(ei.value.fix)
    assert proposals, ei.value.fix
    for extra in proposals:
        r = load_recipe(path, [*overrides, *extra])
        validate_recipe(r, resolve_model(r))  # raises if the proposal is invalid


def test_proposals_parser():
    assert _proposals("use parallel.ep=1; or parallel.ep=2 with parallel.dp=4") == [
        ["parallel.ep=1"], ["parallel.ep=2", "parallel.dp=4"]]
    assert _proposals("use pp*vpp <= 48, e.g. parallel.pp=6, 8 or 16; or planner.template=dualpipe-v") == [
        ["parallel.pp=6"], ["parallel.pp=8"], ["parallel.pp=16"], ["planner.template=dualpipe-v"]]


# --------------------------------------------------------------------------- the console entry point

SUBPROCESS_CASES = [
    ("simulate", ("model.hf_config=no-such-config.json",), ("model.hf_config='no-such-config.json'", "file does not exist")),
    ("plan", ("recipes/qwen3-next-80b.yaml", "parallel.pp=64"), ("parallel.pp=64", "parallel.pp=6, 8, 12 or 16")),
    ("simulate", ("recipes/qwen3-next-80b.yaml", "parallel.num_microbatches=100000000"), ("must be <= 4096",)),
    ("simulate", ("recipes/",), ("is a directory", "recipes/deepseek-v3.yaml")),
]


@pytest.mark.parametrize("command,args,needles", SUBPROCESS_CASES, ids=[f"{c}-{a[-1]}" for c, a, _ in SUBPROCESS_CASES])
def test_console_entry_point(command, args, needles, tmp_path):
    p = subprocess.run([sys.executable, "-m", "tessera", command, *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
    assert p.returncode == 2, (p.stdout[-500:], p.stderr[-500:])
    line = _error_line(p.stderr, p.stdout, command)
    for n in needles:
        assert n in line, (n, line)


@pytest.fixture(scope="module")
def closed_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens: a train case that got past the recipe checks
    would fail on the address, never start or join a Ray."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


TRAIN_CASES = [c for c in BAD_CASES if c.train]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.id for c in TRAIN_CASES])
def test_train_rejects_bad_input_before_ray(case, fixtures, capsys, tmp_path, closed_address):
    """The same table through ``tessera train`` (its pre-flight checks run before Ray starts)."""
    rc = main(["train", *case_args(case, fixtures), "--address", closed_address, "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 2, (cap.out[-500:], cap.err[-500:])
    line = _error_line(cap.err, cap.out, "train")
    assert "--address" not in line, line  # refused by the recipe checks, before the address
    for n in case.needles:
        assert n in line, (n, line)
