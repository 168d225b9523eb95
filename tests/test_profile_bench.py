"""benchmarks/profile.py shares its name with the standard library's ``profile`` module; run as a
script it must not shadow it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_script_does_not_shadow_the_stdlib_profile_module():
    code = ("import runpy, sys\n"
            "sys.path.insert(0, 'benchmarks')  # what `python benchmarks/profile.py` puts first\n"
            "sys.argv = ['benchmarks/profile.py', '--help']\n"
            "try:\n"
            "    runpy.run_path('benchmarks/profile.py', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "import profile, cProfile\n"
            "print(profile.__file__)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--json FILE" in p.stdout
    path = Path(p.stdout.strip().splitlines()[-1])
    assert path.name == "profile.py" and path.parent != ROOT / "benchmarks"  # the standard library's
