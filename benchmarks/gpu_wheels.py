"""The pure-Python wheels the GPU machine needs and its image lacks, unpacked for ``gpu_check.py``.

Usage (here, where the package index is reachable; the GPU machine has no network)::

    python benchmarks/gpu_wheels.py            # -> .gpu_wheels/site (gitignored), sizes printed
    python benchmarks/gpu_wheels.py --with-fla-models

It runs ``pip download --no-deps --only-binary=:all: --python-version 3.12`` for :data:`WHEELS`
into ``.gpu_wheels/wheels`` and unpacks each wheel into ``.gpu_wheels/site`` (a wheel is a zip of
its installed files). ``benchmarks/gpu_check.py`` puts ``.gpu_wheels/site`` at the end of
``sys.path`` when the directory exists (part 0 reports it and its size). Carry only
``.gpu_wheels/site`` to the machine (the ``run`` tool's ``carry``; 64 MiB per run in all).

What is carried and why (requirements read from each wheel's METADATA, Python 3.12):

* ``fla-core`` 0.6.0: the ``fla`` package with FLA's Triton kernels; transformers' Qwen3-Next
  resolves ``chunk_gated_delta_rule`` from ``fla.ops.gated_delta_rule`` when ``fla`` imports,
  and ``gpu_check.py`` part 7 times it. Requires ``einops`` (and torch, triton: on the image;
  ``packaging``, which some of its modules import, comes with transformers).
* ``einops``: fla-core's one requirement the image does not list.
* ``omegaconf`` (the version installed here): the recipe loader (:mod:`tessera.config.load`)
  needs it. ``gpu_check.py`` does not import it (its test blocks it); it is carried so that the
  project's recipe code also imports there. omegaconf 2.4 requires only PyYAML (on the image):
  it no longer needs the ANTLR parser runtime that 2.1-2.3 required.
* Not carried by default: ``flash-linear-attention`` 0.6.0 (``--with-fla-models``) adds only
  ``fla.layers`` and ``fla.models`` (FLA's model zoo), which nothing here uses; once present,
  ``import fla`` imports them, and they require transformers >= 5.6.2.

Raises SystemExit with pip's message when a download fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu_wheels"
PYTHON_VERSION = "3.12"  # the GPU image's Python


def _installed(name: str, default: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return default


WHEELS = (
    ("fla-core", "0.6.0"),
    ("einops", _installed("einops", "0.8.2")),
    ("omegaconf", _installed("omegaconf", "2.4.0")),
)
"""(distribution, version) carried by default (module docstring)."""
FLA_MODELS = ("flash-linear-attention", "0.6.0")


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-fla-models", action="store_true", help="also carry flash-linear-attention (FLA's models)")
    ap.add_argument("--out", type=Path, default=OUT, help="default: .gpu_wheels in the repository")
    ap.add_argument("--json", type=Path, help="also write what was carried (wheels, MiB) here")
    args = ap.parse_args(argv)
    wheels = [*WHEELS, *([FLA_MODELS] if args.with_fla_models else [])]
    wdir, site = args.out / "wheels", args.out / "site"
    shutil.rmtree(wdir, ignore_errors=True)
    shutil.rmtree(site, ignore_errors=True)
    wdir.mkdir(parents=True)
    site.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON_VERSION, "-d", str(wdir), *(f"{n}=={v}" for n, v in wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"gpu_wheels: pip download failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    got = {}
    for w in sorted(wdir.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
        got[w.name] = w.stat().st_size / 2 ** 20
        print(f"gpu_wheels: {w.name}: {got[w.name]:.2f} MiB wheel")
    print(f"gpu_wheels: {site.relative_to(ROOT) if site.is_relative_to(ROOT) else site}: {size_mib(site):.1f} MiB "
          f"unpacked (carry this directory), wheels {size_mib(wdir):.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"wheels_mib": got, "site": str(site), "site_mib": size_mib(site),
                                         "python_version": PYTHON_VERSION}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
