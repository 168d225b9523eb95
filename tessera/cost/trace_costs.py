"""Per-task costs from a Kineto trace (``planner.cost_source: trace``).

A trace of one overlapped F&B pair (:mod:`tessera.cost.trace`) times four kinds of work per MoE
layer and phase: ``attn`` (the mixer with its norm and the router), ``mlp`` (routed and shared
experts), ``dispatch`` and ``combine``. :func:`trace_costs` keeps the task structure, FLOPs,
bytes and memory of a template :class:`ModelCosts` of the same model (the analytic one) and, for
every MoE layer, rescales the tasks each trace group stands for so that the group's time equals
the trace's mean per-layer time::

    factor[group] = mean over traced instances of the group's GPU span
                    / mean over the model's MoE layers of the template's group time
    ms(task)      = template ms(task) * factor[group of task]

so per-layer differences of the template (a longer sequence, a different mixer) are kept and the
level is the measured one. Layers without an MoE (dense layers), the embedding and the head keep
the template's costs and are listed as such in :class:`TraceCostReport` (nothing is dropped
silently). The factors are also the calibration of the template against the measurement
(``TraceCostReport.factors``: > 1 means the template is optimistic).

The overlap slowdown becomes the one the trace shows: communication kernels hold
``KinetoTrace.comm_blocks()`` SMs (DeepEP runs one block per SM) of the device's ``num_sms``,
``slowdown = num_sms / (num_sms - comm_blocks)`` (:attr:`tessera.spec.hardware.HardwareSpec.overlap_slowdown`).
The traced compute times already run beside communication, so the trace-derived compute task
times are divided by that slowdown to give the times alone, and the pair DAG multiplies it back.

:func:`check_trace_matches` refuses a trace of another device group or model width (its
``traceName`` encodes ``ep``, ``tp``, ``hidden`` and ``seqlen`` for DeepSeek's profiles).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tessera.cost.trace import KinetoTrace
from tessera.cost.types import LayerCost, ModelCosts, ParallelShape, TaskKind
from tessera.errors import TesseraConfigError
from tessera.spec.hardware import HardwareSpec

__all__ = ["TraceCostReport", "trace_costs", "trace_layout", "check_trace_matches", "GROUPS"]

GROUPS = {TaskKind.MIXER: "attn", TaskKind.ROUTER: "attn", TaskKind.EXPERT: "mlp", TaskKind.SHARED: "mlp",
          TaskKind.DISPATCH: "dispatch", TaskKind.COMBINE: "combine"}
"""Task kind -> the trace op whose time it shares."""


@dataclass(frozen=True)
class TraceCostReport:
    """What :func:`trace_costs` did.

    Attributes:
        trace_ms: ``"<op>(<phase>)"`` -> mean traced GPU span per layer, ms.
        template_ms: the same groups' mean time in the template over the MoE layers, ms.
        factors: ``trace_ms / template_ms`` per group (the template's calibration).
        traced_layers: decoder layers whose costs come from the trace.
        template_layers: decoder layers (and ``"embed"``, ``"head"``) left at the template's costs.
        comm_blocks: SMs held by communication kernels in the trace; overlap_slowdown: the result.
    """

    trace_ms: dict[str, float]
    template_ms: dict[str, float]
    factors: dict[str, float]
    traced_layers: tuple[int, ...]
    template_layers: tuple[int | str, ...]
    comm_blocks: int
    overlap_slowdown: float


def trace_layout(trace: KinetoTrace) -> dict[str, int]:
    """Layout fields encoded in the trace name (``ep``, ``tp``, ``hidden``, ``seqlen``), e.g.
    ``prof_ep64_tp1_varsm_hidden7168_seqlen4096`` -> ``{"ep": 64, "tp": 1, "hidden": 7168,
    "seqlen": 4096}``; fields absent from the name are absent from the dict."""
    name = trace.trace_name.rsplit("/", 1)[-1]
    return {k: int(v) for k, v in re.findall(r"(ep|tp|hidden|seqlen)(\d+)", name)}


def check_trace_matches(trace: KinetoTrace, model, hw: HardwareSpec, shape: ParallelShape) -> None:
    """Raise :class:`TesseraConfigError` (field ``planner.trace``) if the trace was taken on
    another GPU, EP/TP group, model width or sequence length than the recipe's (only the fields
    the trace states are compared), naming each mismatch."""
    lay = trace_layout(trace)
    wanted = {"ep": shape.ep, "tp": shape.tp, "hidden": model.hidden, "seqlen": shape.seq_length}
    bad = [f"{k} {lay[k]} (recipe {v})" for k, v in wanted.items() if k in lay and lay[k] != v]
    gpu = hw.name.replace("-sxm", "").replace("-", " ").lower()
    if trace.device and gpu not in trace.device.lower():
        bad.append(f"device {trace.device!r} (recipe hardware {hw.name!r})")
    if bad:
        raise TesseraConfigError("planner.trace", trace.path, "the trace was taken under another layout: " +
                                 ", ".join(bad), "use a trace of this model and device group, or "
                                 "planner.cost_source=analytic")


def trace_costs(template: ModelCosts, trace: KinetoTrace, hw: HardwareSpec) -> tuple[ModelCosts, TraceCostReport]:
    """``template`` with MoE-layer task times from ``trace`` (module docstring).

    Raises:
        TesseraConfigError: the model has no MoE layer, or the trace lacks a group the model's
            MoE layers need (e.g. no ``combine(B)``).
    """
    moe = [lc for lc in template.layers if any(t.kind == TaskKind.DISPATCH for t in lc.tasks)]
    if not moe:
        raise TesseraConfigError("planner.trace", trace.path, "the model has no MoE layer for the trace to time",
                                 "use planner.cost_source=analytic")
    comm_blocks = trace.comm_blocks()
    slowdown = (hw.num_sms / (hw.num_sms - comm_blocks)) if 0 < comm_blocks < hw.num_sms else template.overlap_slowdown
    spans: dict[str, list[float]] = {}
    for inst in trace.instances:
        alone = inst.span_ms() / (slowdown if trace.role_of(inst) == "compute" else 1.0)
        spans.setdefault(inst.name, []).append(alone)
    trace_ms = {g: sum(v) / len(v) for g, v in spans.items()}
    tmpl: dict[str, float] = {}
    for lc in moe:
        for t in lc.tasks:
            if t.kind in GROUPS:
                g = f"{GROUPS[t.kind]}({t.phase.value})"
                tmpl[g] = tmpl.get(g, 0.0) + t.ms / len(moe)
    missing = sorted(g for g, v in tmpl.items() if v > 0 and g not in trace_ms)
    if missing:
        raise TesseraConfigError("planner.trace", trace.path, f"the trace has no {', '.join(missing)} annotations "
                                 "the model's MoE layers need", "trace a full overlapped F&B pair (F, B and W of "
                                 "attn, mlp, dispatch and combine)")
    factors = {g: trace_ms[g] / v for g, v in tmpl.items() if v > 0}

    def scaled(lc: LayerCost) -> LayerCost:
        tasks = tuple(replace(t, ms=t.ms * factors.get(f"{GROUPS[t.kind]}({t.phase.value})", 1.0))
                      if t.kind in GROUPS else t for t in lc.tasks)
        return replace(lc, tasks=tasks)

    traced = {lc.index for lc in moe}
    layers = tuple(scaled(lc) if lc.index in traced else lc for lc in template.layers)
    costs = replace(template, source="trace", layers=layers, overlap_slowdown=slowdown)
    report = TraceCostReport(trace_ms={g: trace_ms[g] for g in sorted(tmpl) if g in trace_ms},
                             template_ms=dict(sorted(tmpl.items())), factors=dict(sorted(factors.items())),
                             traced_layers=tuple(sorted(traced)),
                             template_layers=tuple(lc.index for lc in template.layers if lc.index not in traced)
                             + ("embed", "head"), comm_blocks=comm_blocks, overlap_slowdown=slowdown)
    return costs, report
