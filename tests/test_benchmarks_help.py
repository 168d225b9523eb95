"""Every benchmark script starts from the repository root as the README runs it
(``python benchmarks/NAME.py ...``): ``--help`` exits 0 and names its ``--json`` output, and no
script is named like a module of the standard library (Python puts the script's folder first on
``sys.path``, so ``benchmarks/profile.py`` once shadowed the ``profile`` module that cProfile,
torch and transformers import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))


def test_no_benchmark_script_shadows_a_standard_library_module():
    assert SCRIPTS, "no benchmark scripts found"
    clash = sorted(p.name for p in SCRIPTS if p.stem in sys.stdlib_module_names)
    assert clash == [], f"rename {clash}: each shadows the standard library module of its name"


def test_every_benchmark_script_answers_help_from_the_repository_root():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    procs = {p.name: subprocess.Popen([sys.executable, str(p.relative_to(ROOT)), "--help"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in SCRIPTS}  # all at once: each spends its seconds importing torch
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out or "--json" not in out:
            failed[name] = (proc.returncode, out[-500:], err[-1500:])
    assert failed == {}, failed
