"""Benchmark ``tessera simulate`` (baseline plan) over the real-model recipes, under both rank
orders, and ``tessera simulate`` / ``tessera plan`` at production GPU counts.

Usage::

    python benchmarks/simulate.py [--json FILE] [--recipes DIR] [--scale] [KEY=VALUE ...]

For every recipe in ``DIR`` (default ``recipes/``) whose model preset is a real model (not a
``tiny-*`` preset) it runs the flow recipe -> costs -> baseline plan -> Programs -> validate ->
simulate in-process once per rank order of :data:`tessera.spec.placement.RANK_ORDERS`
(``parallel.rank_order``: ``ep-dp-pp``, EP inside a node, the GPU presets' default; ``pp-ep-dp``,
a node holding whole pipelines) and records one JSON object per recipe and order with the fields
``recipe, preset, rank_order, gpus, pp, vpp, ep, crossing, iteration_ms, bubble_ratio,
exposed_a2a_ratio, peak_mem_gb_max, mfu, tokens_per_s_per_gpu, tflops_per_gpu, wall_s`` (see
:meth:`tessera.flow.SimulationRun.summary`; ``crossing``: the group kinds that span nodes;
``wall_s``: the whole flow's wall time, without writing the trace or PNG), plus
``slowdown_vs_default`` (iteration over the default order's). The overrides apply to every recipe.

``--scale``: ``qwen3-next-80b`` at :data:`SCALE_GPUS` GPUs (``parallel.dp = gpus / pp``, the
paper's production sizes), ``tessera simulate`` and ``tessera plan`` (iteration search included)
each timed in-process: rows ``{"scale": true, "command", "gpus", "dp", "iteration_ms", "wall_s"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# rich and tessera are imported inside the functions that use them: ``--help`` answers without them

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("recipe", "preset", "rank_order", "gpus", "pp", "vpp", "ep", "crossing", "iteration_ms",
          "slowdown_vs_default", "bubble_ratio", "exposed_a2a_ratio", "peak_mem_gb_max", "mfu",
          "tokens_per_s_per_gpu", "tflops_per_gpu", "wall_s")
SCALE_RECIPE = "qwen3-next-80b"
SCALE_GPUS = (4096, 8192, 12288)


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
    return {"recipe": recipe.name, "preset": recipe.model.preset, "rank_order": d["rank_order"], "gpus": d["gpus"],
            "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "crossing": ",".join(d["placement"]["crossing"]) or "none",
            "iteration_ms": round(d["iteration_ms"], 3), "bubble_ratio": round(d["bubble_ratio"], 4),
            "exposed_a2a_ratio": round(d["exposed_a2a_ratio"], 4), "peak_mem_gb_max": round(d["peak_mem_gb_max"], 3),
            "mfu": round(d["mfu"], 4), "tokens_per_s_per_gpu": round(d["tokens_per_s_per_gpu"], 1),
            "tflops_per_gpu": round(d["tflops_per_gpu"], 2), "wall_s": round(wall, 3)}


def bench_scale(folder: Path, gpus: int, overrides: list[str]) -> list[dict]:
    """``tessera simulate`` and ``tessera plan`` (the commands, in-process, outputs to a temporary
    directory) of :data:`SCALE_RECIPE` at ``gpus`` GPUs, each timed."""
    import contextlib
    import io
    import tempfile

    from tessera.cli.main import main as tessera
    from tessera.config.load import load_recipe

    path = str(folder / f"{SCALE_RECIPE}.yaml")
    base = load_recipe(path)
    dp = gpus // (base.parallel.pp * base.parallel.tp)
    rows = []
    for command in ("simulate", "plan"):
        with tempfile.TemporaryDirectory() as out:
            extra = ["--json", f"{out}/s.json"] if command == "simulate" else ["--no-progress"]
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                rc = tessera([command, path, "--out", out, *extra, f"parallel.dp={dp}", *overrides])
            wall = time.perf_counter() - t0
            doc = json.loads(Path(out, "s.json" if command == "simulate" else "plan.json").read_text())
        if rc != 0:
            raise RuntimeError(f"tessera {command} at {gpus} GPUs exited {rc}")
        it = doc["iteration_ms"] if command == "simulate" else doc["tessera"]["iteration_ms"]
        rows.append({"scale": True, "command": command, "recipe": base.name, "gpus": gpus, "dp": dp,
                     "rank_order": doc["placement"]["order"] if command == "plan" else doc["rank_order"],
                     "iteration_ms": round(it, 3), "wall_s": round(wall, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--json", metavar="FILE", help="write the records as a JSON list to FILE")
    ap.add_argument("--recipes", metavar="DIR", default=str(ROOT / "recipes"), help="recipe folder")
    ap.add_argument("--scale", action="store_true", help=f"also time simulate and plan of {SCALE_RECIPE} at "
                    f"{', '.join(map(str, SCALE_GPUS))} GPUs")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides applied to every recipe")
    args = ap.parse_args(argv)
    from rich.table import Table

    from tessera.cli.console import print_tables
    from tessera.errors import ProgramError, TesseraConfigError
    from tessera.spec.placement import RANK_ORDERS

    records, scale = [], []
    try:
        for path in real_recipes(Path(args.recipes)):
            rows = [bench_one(path, [*args.overrides, f"parallel.rank_order={o}"]) for o in RANK_ORDERS]
            for r in rows:
                r["slowdown_vs_default"] = round(r["iteration_ms"] / rows[0]["iteration_ms"], 4)
            records += rows
        if args.scale:
            for g in SCALE_GPUS:
                scale += bench_scale(Path(args.recipes), g, args.overrides)
    except (TesseraConfigError, ProgramError) as e:
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 2
    table = Table(title="tessera simulate, baseline plan, per rank order")
    for f in FIELDS:
        table.add_column(f, justify="left" if f in ("recipe", "preset", "rank_order", "crossing") else "right")
    for rec in records:
        table.add_row(*(f"{rec[f]:.1%}" if f in ("bubble_ratio", "exposed_a2a_ratio", "mfu") else str(rec[f])
                        for f in FIELDS))
    tables = [table]
    if scale:
        st = Table(title=f"{SCALE_RECIPE} at production GPU counts")
        for f in ("command", "gpus", "dp", "iteration_ms", "wall_s"):
            st.add_column(f, justify="right")
        for rec in scale:
            st.add_row(*(str(rec[f]) for f in ("command", "gpus", "dp", "iteration_ms", "wall_s")))
        tables.append(st)
    print_tables(*tables)  # full rows when redirected, never an elided number
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records + scale, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
