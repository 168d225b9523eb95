"""PNG timeline of a simulated iteration (matplotlib, Agg canvas, no display needed).

One band per rank (rank 0 on top) with two sub-rows: compute (thick) and EP communication (thin).
Boxes are coloured by task kind; the phase is shown by shading of that colour: F as is, B darker,
W lighter (blended with black / white; the legend shows the three shades on a grey swatch).
Compute instructions wide enough get a short label (e.g. ``F3``, ``BW2``, ``F4|B1``). The x axis
is in ms.
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tessera.cost.types import Resource, TaskKind
from tessera.sim.result import SimResult

KIND_COLOURS: dict[str, str] = {
    TaskKind.EMBED.value: "#8c564b", TaskKind.MIXER.value: "#1f77b4", TaskKind.ROUTER.value: "#17becf",
    TaskKind.DISPATCH.value: "#d62728", TaskKind.EXPERT.value: "#2ca02c", TaskKind.SHARED.value: "#bcbd22",
    TaskKind.COMBINE.value: "#ff7f0e", TaskKind.MLP.value: "#9467bd", TaskKind.HEAD.value: "#7f7f7f",
}
PHASE_SHADE: dict[str, tuple[str, float]] = {"F": ("white", 0.0), "B": ("black", 0.35), "W": ("white", 0.55)}
PHASE_LABEL: dict[str, str] = {"F": "F (forward)", "B": "B (dgrad)", "W": "W (wgrad)"}
_ROW = {Resource.COMPUTE.value: (0.35, 0.5), Resource.EP_COMM.value: (0.05, 0.25)}  # (y offset, height)


def shade(colour: str, phase: str) -> tuple[float, float, float]:
    """``colour`` blended towards black or white by the phase's shade (F unchanged)."""
    target, t = PHASE_SHADE.get(phase, ("white", 0.0))
    c, m = to_rgb(colour), to_rgb(target)
    return tuple((1 - t) * a + t * b for a, b in zip(c, m))


def _label(text: str) -> str:
    """Short label of an instruction text, e.g. ``"F(mb3.c0)"`` -> ``"F3"``."""
    nums = re.findall(r"mb(\d+)", text)
    if text.startswith("FB") and len(nums) >= 2:
        return f"F{nums[0]}|B{nums[1]}"
    head = "BW" if text.startswith("B+W") else text[0]
    return f"{head}{nums[0]}" if nums else text[:2]


def write_timeline_png(result: SimResult, path: str | Path, title: str = "", *, width_in: float = 16.0,
                       dpi: int = 120) -> Path:
    """Draw the timeline of ``result`` to a PNG at ``path`` (parent folders created).

    Args:
        result: a simulated iteration.
        path: output file.
        title: figure title; the summary line of ``result`` is appended.
        width_in, dpi: figure width in inches and resolution.

    Returns:
        The path written.
    """
    pp = max(result.pp, 1)
    fig = Figure(figsize=(width_in, 1.0 + 0.7 * pp), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    groups: dict[tuple[int, str, str, str], list[tuple[float, float]]] = {}
    for e in result.events:
        if e.resource in _ROW and e.end_ms > e.start_ms:
            groups.setdefault((e.rank, e.resource, e.kind, e.phase), []).append((e.start_ms, e.end_ms - e.start_ms))
    edge = dict(edgecolor="black", linewidth=0.3) if len(result.events) <= 2000 else dict(linewidth=0)
    for (rank, res, kind, phase), bars in groups.items():
        y0, h = _ROW[res]
        ax.broken_barh(bars, (pp - 1 - rank + y0, h), facecolors=shade(KIND_COLOURS.get(kind, "#333333"), phase), **edge)
    span_ms = max(result.iteration_ms, 1e-9)
    for s in result.spans:
        if s.op in ("F", "B", "W", "FB") and (s.end_ms - s.start_ms) > 0.02 * span_ms:
            y0, h = _ROW[Resource.COMPUTE.value]
            ax.text((s.start_ms + s.end_ms) / 2, pp - 1 - s.rank + y0 + h + 0.06, _label(s.text),
                    ha="center", va="bottom", fontsize=6)
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(result.pp)])
    ax.set_yticklabels([f"rank {r}" for r in range(result.pp)])
    ax.set_ylim(0, pp)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    for r in range(1, pp):
        ax.axhline(r, color="#cccccc", linewidth=0.5)
    order = list(KIND_COLOURS)
    kinds = sorted({e.kind for e in result.events}, key=lambda k: (order.index(k) if k in order else len(order), k))
    handles = [Patch(facecolor=KIND_COLOURS.get(k, "#333333"), edgecolor="black", label=k) for k in kinds]
    handles += [Patch(facecolor=shade("#808080", p), edgecolor="black", label=PHASE_LABEL[p]) for p in PHASE_SHADE]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    head = f"{title} — " if title else ""
    ax.set_title(head + result.summary(), fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.9, bottom=0.8 / fig.get_figheight(), top=1 - 0.4 / fig.get_figheight())
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    return p
