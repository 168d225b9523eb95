"""The import contracts of ``pyproject.toml`` ([tool.importlinter]) hold: one-way layers from
``spec``/``errors`` up to the command line, an engine that never reads the recipe config, one
expert-parallel exchange whose two fronts share one planning module, the training runtime's rooms
read top-down (job above profiling above the worker above upgrades and the live bubble optimizer,
all above run-directory storage), and no import circle among the modules or sub-packages of any package.
A back-arrow anywhere in ``tessera/`` fails this test (see docs/CONTRACTS.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: install the test extras (pip install -e '.[test]')")
    p = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [c["type"] for c in contracts] == ["layers", "forbidden", "layers", "layers", "acyclic_siblings"], contracts
    assert next(c for c in contracts if c.get("containers") == ["tessera.train"])["layers"] == [
        "job | report", "profile", "worker", "upgrade | dbo", "storage"]
    assert f"{len(contracts)} kept, 0 broken" in p.stdout, p.stdout[-2000:]
