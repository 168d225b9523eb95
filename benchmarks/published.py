"""The cost model against published, measured MoE training runs (calibration and validation).

Usage::

    python benchmarks/published.py --json FILE [--runs benchmarks/published_runs.yaml] [--only ID,...]

Each record of ``benchmarks/published_runs.yaml`` (every number quoted from its source, named in
the record) becomes a recipe: the model preset (``model.mtp_layers`` when the run's MTP count
differs from the preset's, ``model.num_layers`` for a run of its first layers), the hardware
preset of its GPU, ``train.precision`` and ``fp8_recipe``, the layout (tp, pp, vpp, ep, dp), micro batch and
sequence length, ``planner.activation_recompute`` / ``recompute_modules``,
``parallel.moe_dispatcher``, ``parallel.dp_shard``, ``train.master_weights``, ``train.cuda_graphs``
(the record's ``cuda_graphs`` scopes; none where it states none) and ``model.moe_routing``
(the record's ``routing``: forced balance or unstated -> balanced, dropless -> dropless) as the run used them,
and the template its schedule is (interleaved 1F1B when vpp > 1, DualPipe-V for DualPipe, else
1F1B), with W inside each backward (``planner.split_w=false``: none of these schedules defers
it) and F&B overlap only where the run enabled Megatron's EP all-to-all overlap. The recipe runs the same flow as ``tessera simulate`` (baseline plan, Programs, memory
rule, simulator).

A step of the published run is ``passes`` pipeline iterations: NeMo AutoModel (``am-*`` rows,
torch.distributed.pipelining) runs ``grad_accum`` separate pipeline passes of
``local_batch / micro_batch`` microbatches; Megatron runs one pass of
``global_batch / (dp * micro_batch)`` microbatches. Predicted step time
``= passes * iteration_ms - (passes - 1) * optimizer_ms`` (the optimizer steps once per step),
``predicted_tokens_per_s_per_gpu = global_batch * seq_length / (step_s * gpus)``.

Writes ``{"records": [...], "summary": {...}}``. A record: ``id, model, gpus, hardware,
precision, layout, published_tokens_per_s_per_gpu, predicted_tokens_per_s_per_gpu, ratio``
(predicted / published), ``published_tflops_per_gpu, predicted_tflops_per_gpu, memory_accepted,
peak_mem_gb, derived`` (the published tokens/s is derived from a step time, not stated),
``source, set`` (``calibration`` or ``validation``), or ``skipped`` with the reason for a run the
cost model cannot describe. Summary: ``mape_calibration, mape_validation`` (mean of
``|predicted - published| / published``), ``spearman_tflops`` (rank correlation of published and
predicted TFLOP/s/GPU over every simulated run that publishes one), ``memory_refused`` (runs whose
own layout the memory rule refuses), ``dsv3_dp_pair`` (the 1,024- over the 256-GPU DeepSeek-V3
tokens/s, published and predicted: the measured direction is < 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import yaml

# numpy, rich and tessera are imported inside the functions that use them: ``--help`` answers without them

ROOT = Path(__file__).resolve().parent
RUNS = ROOT / "published_runs.yaml"

HARDWARE = {"H100": "h100-sxm", "H800": "h800", "H200": "h200", "B200": "b200"}
"""GPU names of the records -> hardware presets (H100 = DGX/HGX H100 SXM)."""
PRESET_BY_MODEL = {"Qwen3-30B-A3B": "qwen3-30b-a3b"}
"""Records without a ``preset`` whose model the presets hold under another spelling."""


class Skip(Exception):
    """A run the cost model cannot describe (the message says why)."""


def _precision(r: dict) -> str:
    text = str(r.get("precision") or "").lower()
    if "fp8" in text:
        return "fp8"
    if r.get("precision") is None:  # mb-2509 DeepSeek-V3: the footnote shows an FP8 recipe
        return "fp8"
    return "bf16"


def _fp8_recipe(r: dict) -> str:
    """``train.fp8_recipe`` of a record's ``precision`` text (Megatron-Core ``--fp8-recipe`` names):
    ``mxfp8``; ``blockwise`` for DeepSeek's fine-grained 1x128 / 128x128 scaling; ``delayed``;
    otherwise ``tensorwise`` (per-tensor current scaling, Megatron-Bridge's H100 FP8 recipe,
    also for the DeepSeek-V3 H100 row whose table gives no recipe)."""
    text = str(r.get("precision") or "").lower()
    if "mxfp8" in text:
        return "mxfp8"
    if "blockwise" in text or "fine-grained" in text or "1x128" in text:
        return "blockwise"
    if "delayed" in text:
        return "delayed"
    return "tensorwise"


def _recompute(r: dict) -> tuple[str, list[str]]:
    """(mode, modules) from the record's ``recompute`` text."""
    text = r.get("recompute")
    if text is None or str(text).strip().lower() in ("none", "no", "false"):
        return "none", []
    t = str(text).lower()
    if t.startswith("full"):
        return "full", []
    if "rmsnorm and mla up-projections" in t:  # DeepSeek-V3 report sec. 3.2.3
        return "selective", ["layernorm", "mla_up_proj"]
    if t.startswith("selective"):
        inside = t[t.index("[") + 1:t.index("]")]
        return "selective", [m.strip() for m in inside.split(",") if m.strip()]
    raise Skip(f"recompute {text!r} not understood")


def _dispatcher(r: dict) -> str:
    t = str(r.get("dispatcher") or "").lower()
    if "deepep" in t or "hybridep" in t or "custom" in t:  # hierarchical IB + NVLink dispatch
        return "deepep"
    return "alltoall"


def _dp_shard(r: dict) -> str:
    return "fsdp" if "fsdp" in str(r.get("dp_shard") or "").lower() else "zero1"


def _master_weights(r: dict) -> bool:
    """FP32 master weights and Adam state (Megatron-LM / Megatron-Bridge), or pure BF16: NeMo
    AutoModel's benchmark recipes build the model in its config's BF16 dtype, shard it with FSDP2
    (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) and step ``torch.optim.Adam``
    on the BF16 parameters (AM ``components/moe/parallelizer.py`` and the models' ``torch_dtype``
    at the calibration commit). A record's own ``master_weights`` wins."""
    if r.get("master_weights") is not None:
        return bool(r["master_weights"])
    return not r["id"].startswith("am-")


def _cuda_graphs(r: dict):
    """``train.cuda_graphs`` of a record's ``cuda_graphs`` (the scopes its recipe captured, as
    Megatron-Core ``--cuda-graph-modules`` names): a list of scopes, or ``none`` where the record
    says none or states nothing (the frameworks' default: Megatron-Core ``cuda_graph_impl="none"``;
    NeMo AutoModel has no CUDA graph option at the rows' commits)."""
    v = r.get("cuda_graphs")
    if v is None or v == "none" or v is False:
        return "none"
    return [str(x) for x in (v if isinstance(v, list) else [v])]


def _routing(r: dict) -> str:
    """``model.moe_routing`` of a record's ``routing`` text (docs/cost-model.md, "Routing
    imbalance"): ``dropless`` where the run routed with its own router and dropped no token;
    ``forced`` for a capacity factor (tokens dropped and padded); ``balanced`` for a forced
    balance (Megatron ``--moe-router-force-load-balancing``, AutoModel's fake balanced gate) and
    where the record states none."""
    t = str(r.get("routing") or "").lower()
    if "dropless" in t:
        return "dropless"
    if "capacity" in t:
        return "forced"
    return "balanced"


def _template(r: dict) -> str:
    if "report" in r["id"]:  # DeepSeek-V3 report: DualPipe
        return "dualpipe-v"
    vpp = r.get("vpp") or 1
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def layout_bounds(layout: str, num_layers: int, stages: int) -> tuple[int, ...]:
    """Partition bounds (:class:`tessera.program.plan.Partition`) of a Megatron-Core
    ``--pipeline-model-parallel-layout`` string (``E`` embedding, ``t`` a decoder layer, ``m`` an
    MTP layer, ``L`` the loss, ``|`` between virtual stages in stage order, ``(...)*n`` a repeat):
    stage ``s`` holds its ``t`` count of layers; the embedding opens stage 0, and the MTP layers
    and the loss are Tessera's head (extended index ``num_layers``), which must close the last stage.

    Raises:
        Skip: the string does not describe ``stages`` stages of ``num_layers`` layers so.
    """
    import re

    text = layout.replace(" ", "")
    while "(" in text:
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        if new == text:
            raise Skip(f"pipeline_layout {layout!r}: unbalanced '(...)*n'")
        text = new
    parts = text.split("|")
    counts = [part.count("t") for part in parts]
    ok = (len(parts) == stages and sum(counts) == num_layers and parts[0].startswith("E")
          and parts[-1].endswith("L") and "E" not in "".join(parts[1:]) and "L" not in "".join(parts[:-1])
          and "m" not in "".join(parts[:-1]))
    if not ok:
        raise Skip(f"pipeline_layout {layout!r}: not {stages} stages of {num_layers} layers with E first and mL last")
    return (-1, *itertools.accumulate(counts[:-1]), num_layers + 1)


def passes_and_microbatches(r: dict) -> tuple[int, int]:
    """(pipeline passes per step, microbatches per pass) of a record (module docstring)."""
    per_replica = r["global_batch"] // (r["dp"] * r["micro_batch"])
    if r["id"].startswith("am-") and r["pp"] > 1:
        passes = int(r.get("grad_accum") or 1)
        return passes, per_replica // passes
    return 1, per_replica


def recipe_of(r: dict):
    """The recipe a published run corresponds to (raises :class:`Skip`)."""
    from tessera.config.load import recipe_from_dict

    preset = r.get("preset") or PRESET_BY_MODEL.get(str(r.get("model")).split(" ")[0])
    if not preset:
        raise Skip(f"no model preset for {r.get('model')!r} (attention sinks / sliding windows not modelled)")
    hw = HARDWARE.get(r["hardware"])
    if hw is None:
        raise Skip(f"no hardware preset for {r['hardware']}")
    if (r.get("cp") or 1) > 1:
        raise Skip("context parallelism is not modelled")
    if r.get("micro_batch") is None or r.get("global_batch") is None:
        raise Skip("the source gives no micro batch")
    passes, m = passes_and_microbatches(r)
    mode, modules = _recompute(r)
    # the published schedules keep W inside the backward; F&B overlap only where the run enabled it
    planner = {"template": _template(r), "activation_recompute": mode, "split_w": False,
               "overlap": bool(r.get("ep_a2a_overlap")) or _template(r) == "dualpipe-v"}
    if modules:
        planner["recompute_modules"] = modules
    model = {"preset": preset}
    if r.get("mtp_layers") is not None:
        model["mtp_layers"] = int(r["mtp_layers"])
    if r.get("num_layers"):  # a run of the preset's first layers only (a proxy of the model)
        model["num_layers"] = int(r["num_layers"])
    if _routing(r) != "balanced":  # the cited default max/mean (tessera.cost.routing); none is fitted here
        model["moe_routing"] = _routing(r)
    recipe = recipe_from_dict({
        "name": r["id"], "model": model, "hardware": {"preset": hw},
        "parallel": {"pp": r["pp"], "vpp": r.get("vpp") or 1, "ep": r["ep"], "tp": r["tp"], "dp": r["dp"],
                     "num_microbatches": m, "micro_batch_size": r["micro_batch"], "seq_length": r["seq_length"],
                     "moe_dispatcher": _dispatcher(r), "dp_shard": _dp_shard(r)},
        "planner": planner, "train": {"precision": _precision(r), "master_weights": _master_weights(r),
                                           "fp8_recipe": _fp8_recipe(r), "cuda_graphs": _cuda_graphs(r)},
        "logging": {"trace": False, "png": False},
    })
    return recipe, passes


def _optimizer_ms(result) -> float:
    """The optimizer step's ms on the slowest rank (``RankMetrics.optimizer_ms``)."""
    return max(m.optimizer_ms for m in result.ranks)


def bench_one(r: dict) -> dict:
    """One record: the run simulated under its own settings (module docstring)."""
    from tessera.config.validate import validate_memory
    from tessera.errors import ProgramError, TesseraConfigError
    from tessera.flow import build_baseline, build_costs, compile_programs, resolve
    from tessera.sim.simulator import simulate

    published = r.get("tokens_per_s_per_gpu") or r.get("derived_tokens_per_s_per_gpu")
    out = {"id": r["id"], "set": r["set"], "model": r["model"], "gpus": r["gpus"], "hardware": r["hardware"],
           "precision": str(r.get("precision")), "source": r["source"],
           "layout": f"tp{r['tp']} pp{r['pp']} vpp{r.get('vpp') or 1} ep{r['ep']} dp{r['dp']} "
                     f"mbs{r.get('micro_batch')} seq{r['seq_length']} gbs{r['global_batch']}",
           "published_tokens_per_s_per_gpu": published, "derived": r.get("tokens_per_s_per_gpu") is None,
           "published_tflops_per_gpu": r.get("tflops_per_gpu")}
    try:
        recipe, passes = recipe_of(r)
        t0 = time.perf_counter()
        res = resolve(recipe)
        costs = build_costs(res)
        plan = build_baseline(res, costs)
        if r.get("pipeline_layout"):  # the run's own partition, not the baseline's balanced one
            from tessera.program.plan import Partition
            plan = dataclasses.replace(plan, partition=Partition(layout_bounds(
                r["pipeline_layout"], len(costs.layers), plan.pp * plan.vpp)))
        programs = compile_programs(plan)
    except Skip as e:
        return {**out, "skipped": str(e)}
    except (TesseraConfigError, ProgramError) as e:
        return {**out, "skipped": f"recipe refused: {e}"}
    try:
        validate_memory(recipe, res.hardware, programs, costs)
        accepted = True
    except TesseraConfigError:
        accepted = False
    result = simulate(programs, costs)
    p = recipe.parallel
    step_ms = passes * result.iteration_ms - (passes - 1) * _optimizer_ms(result)
    tokens = r["global_batch"] * r["seq_length"]
    predicted = tokens / (step_ms / 1e3) / r["gpus"]
    # model FLOPs per GPU per second: the simulated tasks' FLOPs over the step, as in tessera simulate
    flops = passes * result.mfu * result.iteration_ms * costs.peak_flops / 1e3
    return {**out, "predicted_tokens_per_s_per_gpu": predicted,
            "ratio": predicted / published if published else None,
            "predicted_tflops_per_gpu": flops / (step_ms / 1e3) / 1e12,
            "memory_accepted": accepted, "peak_mem_gb": result.peak_mem_gb, "passes": passes,
            "num_microbatches": p.num_microbatches, "template": recipe.planner.template,
            "recompute": recipe.planner.activation_recompute, "dispatcher": p.moe_dispatcher, "dp_shard": p.dp_shard,
            "step_ms": step_ms, "bubble_ratio": result.bubble_ratio, "exposed_a2a_ratio": result.exposed_a2a_ratio,
            "wall_s": time.perf_counter() - t0}


def _spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman rank correlation (Pearson correlation of the ranks; ties get their mean rank)."""
    import numpy as np

    if len(a) < 3:
        return None

    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        rk = np.empty(len(x))
        rk[order] = np.arange(1, len(x) + 1)
        for v in np.unique(x):
            rk[x == v] = rk[x == v].mean()
        return rk

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def summarise(records: list[dict]) -> dict:
    """The summary fields of the module docstring."""
    import numpy as np

    done = [r for r in records if "skipped" not in r]

    def mape(which: str) -> float | None:
        errs = [abs(r["ratio"] - 1.0) for r in done if r["set"] == which and r["ratio"] is not None]
        return float(np.mean(errs)) if errs else None

    tf = [r for r in done if r.get("published_tflops_per_gpu")]
    by_id = {r["id"]: r for r in done}
    pair = None
    if "am-dsv3-h100-1024-bf16" in by_id and "am-dsv3-h100-256-bf16" in by_id:
        big, small = by_id["am-dsv3-h100-1024-bf16"], by_id["am-dsv3-h100-256-bf16"]
        pair = {"published": big["published_tokens_per_s_per_gpu"] / small["published_tokens_per_s_per_gpu"],
                "predicted": big["predicted_tokens_per_s_per_gpu"] / small["predicted_tokens_per_s_per_gpu"]}
    return {"mape_calibration": mape("calibration"), "mape_validation": mape("validation"),
            "spearman_tflops": _spearman([r["published_tflops_per_gpu"] for r in tf],
                                         [r["predicted_tflops_per_gpu"] for r in tf]),
            "memory_refused": sum(1 for r in done if not r["memory_accepted"]),
            "simulated": len(done), "skipped": len(records) - len(done), "dsv3_dp_pair": pair}


def write_results(table, records: list[dict], summary: dict, path: str | None) -> None:
    """Print ``table`` (a rich Table) and ``summary`` (JSON); with ``path``, write
    ``{"records": records, "summary": summary}`` there as JSON (folders created)."""
    from tessera.cli.console import print_tables

    print_tables(table)
    print(json.dumps(summary, indent=1))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"records": records, "summary": summary}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write records and summary to FILE")
    ap.add_argument("--runs", default=str(RUNS), help="the published runs (YAML list)")
    ap.add_argument("--only", default="", help="comma-separated record ids")
    args = ap.parse_args(argv)
    from rich.table import Table

    runs = yaml.safe_load(Path(args.runs).read_text())
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r["id"] in keep]
    records = [bench_one(r) for r in runs]
    summary = summarise(records)
    table = Table(title="cost model vs published runs (tokens/s/GPU)")
    for col in ("id", "set", "layout", "published", "predicted", "ratio", "TFLOPS pub/pred", "mem"):
        table.add_column(col, justify="left" if col in ("id", "set", "layout") else "right")
    for r in records:
        if "skipped" in r:
            table.add_row(r["id"], r["set"], r["layout"], str(r["published_tokens_per_s_per_gpu"]), "-",
                          "-", "-", r["skipped"][:60])
            continue
        tf = f"{r['published_tflops_per_gpu'] or '-'} / {r['predicted_tflops_per_gpu']:.0f}"
        table.add_row(r["id"], r["set"], r["layout"], f"{r['published_tokens_per_s_per_gpu']:.0f}",
                      f"{r['predicted_tokens_per_s_per_gpu']:.0f}", f"{r['ratio']:.2f}", tf,
                      f"{r['peak_mem_gb']:.1f}" + ("" if r["memory_accepted"] else " over capacity"))
    write_results(table, records, summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
