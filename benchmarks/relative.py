"""One-setting pairs of published runs: the cost model's predicted throughput ratio beside the measured one.

Usage::

    python benchmarks/relative.py --json FILE [--pairs benchmarks/published_pairs.yaml]
                                  [--runs benchmarks/published_runs.yaml]

A pair (``pairs`` of ``benchmarks/published_pairs.yaml``) is two published runs of one source that
differ in one setting: ``a`` the reference, ``b`` the changed run, each a record of
``published_runs.yaml`` or of the pairs file's own ``runs`` (the same schema; every number quoted
from the source named in the record). Each run is simulated as ``benchmarks/published.py``
simulates a run (:func:`published.bench_one`: the record's recipe through the baseline plan, the
memory rule and the simulator), so the setting reaches the recipe as ``published.recipe_of`` maps
it: EP all-to-all overlap -> ``planner.overlap``, recompute -> ``planner.activation_recompute``,
GPU count -> ``parallel.dp``, CUDA graph scopes (``cuda_graphs``) -> ``train.cuda_graphs``. The pair's ``knob`` names the recipe fields that must differ between
its two recipes; a setting Tessera has no recipe field for (``knob: null``, reason in
``no_knob``) keeps its published ratio and gets no prediction (``skipped``).

Ratios are b / a. ``published_ratio`` is over the throughput both runs state, tokens/s/GPU where
the source gives it, else TFLOP/s/GPU (the Megatron-LM formula counts the model's FLOPs per token,
recompute not included, so within a pair of one model and sequence length it is tokens/s times a
constant); ``predicted_ratio`` is over the predicted tokens/s/GPU. ``direction_right``: both ratios
on the same side of 1; ``size_error_points = 100 * (predicted_ratio - published_ratio)``.

Writes ``{"records": [...], "summary": {...}}``. A record: ``id, setting, a_value, b_value`` (the
setting in each run's record), ``changed_settings`` (every setting field the two records differ
in), ``knob, recipe_changes`` (the recipe fields that differ, ``[a, b]`` each, ``passes`` included:
the pipeline passes per step), ``published_metric, published_ratio, predicted_ratio,
direction_right, size_error_points``, ``a`` and ``b`` (per run: ``id, layout, published`` (the
metric's value), ``published_tokens_per_s_per_gpu`` (stated or derived, as published.py),
``published_tflops_per_gpu, predicted_tokens_per_s_per_gpu, predicted_tflops_per_gpu, step_ms,
passes, memory_accepted, peak_mem_gb, published_peak_allocated_mb`` (the source's max allocated,
in its unit, where stated)),
``source, note``, or ``skipped`` with the reason. Summary: ``pairs, predicted, skipped,
direction_right`` (count), ``max_abs_size_error_points, mean_abs_size_error_points,
mean_size_error_points`` (over the predicted pairs).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import yaml

# numpy, rich and tessera are imported inside the functions that use them: ``--help`` answers without them

HERE = Path(__file__).resolve().parent
PAIRS = HERE / "published_pairs.yaml"
RUNS = HERE / "published_runs.yaml"

NOT_SETTINGS = frozenset({
    "id", "set", "model", "source", "source_note", "stated_throughput", "iterations", "dp_computed",
    "step_time_s", "tokens_per_s_per_gpu", "derived_tokens_per_s_per_gpu", "tflops_per_gpu",
    "peak_allocated_mb",
})
"""Record fields that are results, provenance or names, not settings of the run."""


def _published_module():
    """``benchmarks/published.py`` as a module (benchmarks/ holds scripts, not a package)."""
    mod = sys.modules.get("tessera_bench_published")
    if mod is None:
        spec = importlib.util.spec_from_file_location("tessera_bench_published", HERE / "published.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def load(pairs_path: Path = PAIRS, runs_path: Path = RUNS) -> tuple[list[dict], dict[str, dict]]:
    """(pairs, runs by id): the pairs file's ``pairs``, and the records of both files.

    Raises ValueError naming the pair when one names a run neither file holds."""
    doc = yaml.safe_load(Path(pairs_path).read_text())
    runs = {r["id"]: r for r in yaml.safe_load(Path(runs_path).read_text())}
    for r in doc.get("runs") or []:
        if r["id"] in runs:
            raise ValueError(f"run {r['id']!r} of {pairs_path} is also in {runs_path}: keep one record")
        runs[r["id"]] = r
    for p in doc["pairs"]:
        for side in ("a", "b"):
            if p[side] not in runs:
                raise ValueError(f"pair {p['id']!r}: {side}={p[side]!r} is in neither {pairs_path} nor "
                                 f"{runs_path}; fix: name a run id of one of them")
    return doc["pairs"], runs


def changed_settings(a: dict, b: dict) -> list[str]:
    """The setting fields (all record fields but :data:`NOT_SETTINGS`) whose values differ, sorted."""
    keys = (set(a) | set(b)) - NOT_SETTINGS
    return sorted(k for k in keys if a.get(k) != b.get(k))


def recipe_changes(ra, rb, passes_a: int, passes_b: int) -> dict[str, list]:
    """``{"section.field": [a, b]}`` for the recipe fields two recipes differ in (``name`` aside),
    plus ``passes`` (pipeline passes per step, not a recipe field) where they differ."""

    def flat(recipe) -> dict:
        out = {}
        for section, values in dataclasses.asdict(recipe).items():
            if isinstance(values, dict):
                out.update({f"{section}.{k}": v for k, v in values.items()})
            elif section != "name":
                out[section] = values
        return out

    fa, fb = flat(ra), flat(rb)
    diff = {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}
    if passes_a != passes_b:
        diff["passes"] = [passes_a, passes_b]
    return diff


def published_metric(a: dict, b: dict) -> str | None:
    """The throughput both records state: ``tokens_per_s_per_gpu``, else ``tflops_per_gpu``."""
    for metric in ("tokens_per_s_per_gpu", "tflops_per_gpu"):
        if a.get(metric) and b.get(metric):
            return metric
    return None


def _run_view(r: dict, sim: dict | None, metric: str | None) -> dict:
    out = {"id": r["id"], "published": r.get(metric) if metric else None,
           "published_tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu") or r.get("derived_tokens_per_s_per_gpu"),
           "published_tflops_per_gpu": r.get("tflops_per_gpu"),
           "published_peak_allocated_mb": r.get("peak_allocated_mb")}
    if sim is not None:
        out["layout"] = sim["layout"]
        if "skipped" in sim:
            out["skipped"] = sim["skipped"]
        else:
            out.update({k: sim[k] for k in ("predicted_tokens_per_s_per_gpu", "predicted_tflops_per_gpu", "step_ms",
                                            "passes", "memory_accepted", "peak_mem_gb")})
    return out


def bench_pair(p: dict, runs: dict[str, dict], simulated: dict[str, dict]) -> dict:
    """One pair's record (module docstring); ``simulated`` caches :func:`published.bench_one` by run id."""
    pub = _published_module()
    a, b = runs[p["a"]], runs[p["b"]]
    metric = published_metric(a, b)
    out = {"id": p["id"], "setting": p["setting"], "a_value": a.get(p["setting"]), "b_value": b.get(p["setting"]),
           "changed_settings": changed_settings(a, b), "knob": p.get("knob"), "published_metric": metric,
           "published_ratio": b[metric] / a[metric] if metric else None,
           "source": p["source"], "note": " ".join(str(p.get("note") or "").split())}
    if not p.get("knob"):
        return {**out, "a": _run_view(a, None, metric), "b": _run_view(b, None, metric),
                "skipped": "no Tessera knob: " + " ".join(str(p["no_knob"]).split())}
    for r in (a, b):
        if r["id"] not in simulated:
            simulated[r["id"]] = pub.bench_one(r)
    sa, sb = simulated[a["id"]], simulated[b["id"]]
    out.update(a=_run_view(a, sa, metric), b=_run_view(b, sb, metric))
    for sim in (sa, sb):
        if "skipped" in sim:
            return {**out, "skipped": f"run {sim['id']} not simulated: {sim['skipped']}"}
    (ra, passes_a), (rb, passes_b) = pub.recipe_of(a), pub.recipe_of(b)
    out["recipe_changes"] = recipe_changes(ra, rb, passes_a, passes_b)
    missing = [k for k in p["knob"] if k not in out["recipe_changes"]]
    if missing:
        return {**out, "skipped": f"the recipes do not differ in {missing}: the setting did not reach the recipe"}
    pred = sb["predicted_tokens_per_s_per_gpu"] / sa["predicted_tokens_per_s_per_gpu"]
    pub_ratio = out["published_ratio"]
    return {**out, "predicted_ratio": pred,
            "direction_right": (pred > 1) == (pub_ratio > 1) and (pred < 1) == (pub_ratio < 1),
            "size_error_points": 100.0 * (pred - pub_ratio)}


def summarise(records: list[dict]) -> dict:
    """The summary fields of the module docstring."""
    done = [r for r in records if "skipped" not in r]
    errs = [r["size_error_points"] for r in done]
    return {"pairs": len(records), "predicted": len(done), "skipped": len(records) - len(done),
            "direction_right": sum(bool(r["direction_right"]) for r in done),
            "max_abs_size_error_points": max((abs(e) for e in errs), default=None),
            "mean_abs_size_error_points": sum(abs(e) for e in errs) / len(errs) if errs else None,
            "mean_size_error_points": sum(errs) / len(errs) if errs else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write records and summary to FILE")
    ap.add_argument("--pairs", default=str(PAIRS), help="the pairs and their own runs (YAML)")
    ap.add_argument("--runs", default=str(RUNS), help="the published runs the pairs may name (YAML list)")
    args = ap.parse_args(argv)
    from rich.table import Table

    pairs, runs = load(Path(args.pairs), Path(args.runs))
    simulated: dict[str, dict] = {}
    records = [bench_pair(p, runs, simulated) for p in pairs]
    summary = summarise(records)
    table = Table(title="one-setting pairs: measured vs predicted ratio (b / a)")
    for col in ("pair", "setting a -> b", "published a / b", "predicted tok/s a / b", "published", "predicted",
                "points"):
        table.add_column(col, justify="left" if col in ("pair", "setting a -> b") else "right")
    for r in records:
        pa, pb = r["a"].get("published"), r["b"].get("published")
        row = [r["id"], f"{r['setting']}: {r['a_value']} -> {r['b_value']}", f"{pa} / {pb}",
               "-", f"{r['published_ratio']:.3f}" if r["published_ratio"] else "-"]
        if "skipped" in r:
            table.add_row(*row, "-", r["skipped"][:50])
            continue
        row[3] = f"{r['a']['predicted_tokens_per_s_per_gpu']:.0f} / {r['b']['predicted_tokens_per_s_per_gpu']:.0f}"
        table.add_row(*row, f"{r['predicted_ratio']:.3f}",
                      f"{r['size_error_points']:+.1f}" + ("" if r["direction_right"] else " wrong way"))
    _published_module().write_results(table, records, summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
