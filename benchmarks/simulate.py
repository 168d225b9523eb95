"""Benchmark ``tessera simulate`` (baseline plan) over the real-model recipes.

Usage::

    python benchmarks/simulate.py [--json FILE] [--recipes DIR] [KEY=VALUE ...]

For every recipe in ``DIR`` (default ``recipes/``) whose model preset is a real model (not a
``tiny-*`` preset) it runs the flow recipe -> costs -> baseline plan -> Programs -> validate ->
simulate in-process and records one JSON object with the fields ``recipe, preset, pp, vpp, ep,
iteration_ms, bubble_ratio, exposed_a2a_ratio, peak_mem_gb_max, mfu, tokens_per_s_per_gpu,
tflops_per_gpu, wall_s`` (see :meth:`tessera.flow.SimulationRun.summary`; ``wall_s``: the
whole flow's wall time, without writing the trace or PNG). The overrides apply to every recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# rich and tessera are imported inside the functions that use them: ``--help`` answers without them

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("recipe", "preset", "pp", "vpp", "ep", "iteration_ms", "bubble_ratio", "exposed_a2a_ratio",
          "peak_mem_gb_max", "mfu", "tokens_per_s_per_gpu", "tflops_per_gpu", "wall_s")


def real_recipes(folder: Path) -> list[Path]:
    """Recipe files in ``folder`` whose model is a real preset (not ``tiny-*``), sorted by name."""
    from tessera.config.load import load_recipe

    out = []
    for path in sorted(folder.glob("*.yaml")):
        preset = load_recipe(str(path)).model.preset or ""
        if preset and not preset.startswith("tiny-"):
            out.append(path)
    return out


def bench_one(path: Path, overrides: list[str]) -> dict:
    """One benchmark record for the recipe at ``path``."""
    from tessera.config.load import load_recipe
    from tessera.flow import simulate_recipe

    t0 = time.perf_counter()
    recipe = load_recipe(str(path), overrides)
    run = simulate_recipe(recipe)
    wall = time.perf_counter() - t0
    p, d = recipe.parallel, run.summary()  # the figures of ``tessera simulate --json``
    return {"recipe": recipe.name, "preset": recipe.model.preset, "pp": p.pp, "vpp": p.vpp, "ep": p.ep,
            "iteration_ms": round(d["iteration_ms"], 3), "bubble_ratio": round(d["bubble_ratio"], 4),
            "exposed_a2a_ratio": round(d["exposed_a2a_ratio"], 4), "peak_mem_gb_max": round(d["peak_mem_gb_max"], 3),
            "mfu": round(d["mfu"], 4), "tokens_per_s_per_gpu": round(d["tokens_per_s_per_gpu"], 1),
            "tflops_per_gpu": round(d["tflops_per_gpu"], 2), "wall_s": round(wall, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the records as a JSON list to FILE")
    ap.add_argument("--recipes", metavar="DIR", default=str(ROOT / "recipes"), help="recipe folder")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides applied to every recipe")
    args = ap.parse_args(argv)
    from rich.table import Table

    from tessera.cli.console import print_tables
    from tessera.errors import ProgramError, TesseraConfigError

    records = []
    try:
        for path in real_recipes(Path(args.recipes)):
            records.append(bench_one(path, args.overrides))
    except (TesseraConfigError, ProgramError) as e:
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 2
    table = Table(title="tessera simulate, baseline plan")
    for f in FIELDS:
        table.add_column(f, justify="left" if f in ("recipe", "preset") else "right")
    for rec in records:
        table.add_row(*(f"{rec[f]:.1%}" if f in ("bubble_ratio", "exposed_a2a_ratio", "mfu") else str(rec[f])
                        for f in FIELDS))
    print_tables(table)  # full rows when redirected, never an elided number
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
