"""PNG timeline of a simulated iteration (matplotlib, Agg canvas, no display needed).

One band per rank (rank 0 on top) with two labelled sub-rows: ``rN compute`` (tall) and
``rN EP comm`` (the dispatch/combine all-to-alls, shorter). Every (task kind, phase) pair has its
own colour: the hue family gives the phase (F forward: blues/purples, B dgrad: oranges/reds,
W wgrad: greens) and the shade within the family the task kind (:data:`PALETTE`). Each compute
instruction is filled with a pale tint of its phase (an FB: F tint on top, B below), visible where
compute is idle inside it, and outlined in black when it is at least a few pixels wide.
Instructions wide enough carry a short label above the bar (``F3``, ``BW2``, ``F4|B1``, or only
the microbatch numbers ``3``, ``4|1`` when the full label does not fit; nothing when neither fits,
so labels never overlap). The legend sits below the plot: one column per task kind, one row per
phase. The figure grows with the number of ranks so bars keep a readable height. The x axis (top
and bottom) is in ms.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch

from tessera.sim.result import InstrSpan, SimResult
from tessera.spec.tasks import Resource, TaskKind

PHASES = ("F", "B", "W")
KIND_ORDER = tuple(k.value for k in TaskKind)

# (kind, phase) -> colour: matplotlib's tab20c / tab20b shades. F: blue and purple groups,
# B: orange, red and yellow-brown groups, W: green and olive groups; the same kind takes the
# analogous shade in every phase (expert darkest, mixer mid, shared light, ...).
_SHADES: dict[str, dict[str, str]] = {
    TaskKind.EXPERT.value: {"F": "#393b79", "B": "#843c39", "W": "#637939"},
    TaskKind.MIXER.value: {"F": "#3182bd", "B": "#e6550d", "W": "#31a354"},
    TaskKind.ROUTER.value: {"F": "#6baed6", "B": "#fd8d3c", "W": "#74c476"},
    TaskKind.SHARED.value: {"F": "#9ecae1", "B": "#fdae6b", "W": "#a1d99b"},
    TaskKind.MLP.value: {"F": "#756bb1", "B": "#d6616b", "W": "#8ca252"},
    TaskKind.EMBED.value: {"F": "#bcbddc", "B": "#e7cb94", "W": "#c7e9c0"},
    TaskKind.HEAD.value: {"F": "#5254a3", "B": "#ad494a", "W": "#b5cf6b"},
    TaskKind.DISPATCH.value: {"F": "#6b6ecf", "B": "#bd9e39"},
    TaskKind.COMBINE.value: {"F": "#9c9ede", "B": "#e7ba52"},
}
PALETTE: dict[tuple[str, str], str] = {(k, p): c for k, by_phase in _SHADES.items() for p, c in by_phase.items()}
"""Fill colour of every known (task kind, phase) pair; all distinct."""
FALLBACK_COLOUR = "#404040"
"""Fill of a (kind, phase) pair missing from :data:`PALETTE`."""
INSTR_TINT: dict[str, str] = {"F": "#eaf2fb", "B": "#fdeee2", "W": "#eaf6e7"}
"""Pale background of a compute instruction by phase (an FB: F tint on top, B below): where it
shows, the instruction is waiting (e.g. on its all-to-all) and the compute stream is idle."""

ROW_LABEL = {Resource.COMPUTE.value: "compute", Resource.EP_COMM.value: "EP comm"}
_ROW = {Resource.COMPUTE.value: (0.36, 0.40), Resource.EP_COMM.value: (0.06, 0.24)}  # (y offset, height) in a band
_LABEL_Y = 0.78  # bottom of the instruction labels, in a band (above the compute row)
BAND_IN = 0.85
"""Height of one rank's band, inches."""
_TOP_IN, _BOTTOM_IN, _LEGEND_ROW_IN = 0.75, 0.5, 0.17  # title + top axis; bottom axis; one legend row
_OUTLINE_MIN_PX = 6.0  # narrower instructions get no outline (it would hide them); their tint still shows
LABEL_FONTSIZE = 6.5
_LABEL_PAD_PX = 2.0  # free pixels a label keeps on each side inside its instruction
LABEL_GID = "instr-label"
"""``gid`` of the instruction-label texts (tests and tools can find them on the figure)."""


def colour(kind: str, phase: str) -> str:
    """Fill colour (hex) of a task of ``kind`` in ``phase``."""
    return PALETTE.get((kind, phase), FALLBACK_COLOUR)


def labels(text: str) -> tuple[str, ...]:
    """Candidate labels of an instruction text, longest first, e.g. ``"F(mb3.c0)"`` ->
    ``("F3", "3")`` and ``"FB(F mb4.c0 | B mb1.c1)"`` -> ``("F4|B1", "4|1")``."""
    nums = re.findall(r"mb(\d+)", text)
    if text.startswith("FB") and len(nums) >= 2:
        return f"F{nums[0]}|B{nums[1]}", f"{nums[0]}|{nums[1]}"
    head = "BW" if text.startswith("B+W") else text[:1]
    return (f"{head}{nums[0]}", nums[0]) if nums else (text[:2],)


def _present_pairs(result: SimResult) -> list[tuple[str, str]]:
    """(kind, phase) pairs drawn, in kind order then phase order."""
    pairs = {(e.kind, e.phase) for e in result.events if e.resource in _ROW and e.end_ms > e.start_ms}
    rank = {k: i for i, k in enumerate(KIND_ORDER)}
    phase = {p: i for i, p in enumerate(PHASES)}
    return sorted(pairs, key=lambda kp: (rank.get(kp[0], len(rank)), kp[0], phase.get(kp[1], len(phase)), kp[1]))


def _legend(fig: Figure, pairs: list[tuple[str, str]], top_in: float) -> None:
    """Below the plot, its top ``top_in`` inches above the figure's bottom edge: one column per
    kind, one row per phase (blank cells where a kind has no such phase)."""
    phases = [p for p in PHASES if any(ph == p for _, ph in pairs)] + sorted({ph for _, ph in pairs} - set(PHASES))
    kinds = list(dict.fromkeys(k for k, _ in pairs))
    present = set(pairs)
    handles = []
    for k in kinds:  # legend fills column by column: kind-major order puts each kind in one column
        for p in phases:
            if (k, p) in present:
                handles.append(Patch(facecolor=colour(k, p), edgecolor="none", label=f"{p} {k}"))
            else:
                handles.append(Patch(visible=False, label=""))
    for p in phases:  # last column: the pale instruction backgrounds
        if p in INSTR_TINT:
            handles.append(Patch(facecolor=INSTR_TINT[p], edgecolor="#222222", linewidth=0.45,
                                 label=f"{p} instruction, idle"))
    if not handles:  # nothing drawn
        return
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, top_in / fig.get_figheight()),
               ncol=len(kinds) + 1, fontsize=7, frameon=False, handlelength=1.4, columnspacing=1.2,
               title="colour: hue = phase (F forward blue, B dgrad orange/red, W wgrad green), shade = task kind; "
                     "outline = one instruction (an FB: F tint on top, B below), pale fill = compute idle inside it",
               title_fontsize=7)


def _add_labels(ax, result: SimResult, pp: int, renderer) -> None:
    """Instruction labels above the compute row, only where one fits inside its instruction."""
    x0, x1 = ax.get_xlim()
    px_per_ms = ax.get_window_extent(renderer).width / (x1 - x0)
    prop = FontProperties(size=LABEL_FONTSIZE)
    width_px: dict[str, float] = {}  # label -> width in pixels (the Agg renderer measures at the figure's dpi)

    def text_px(s: str) -> float:
        if s not in width_px:
            w, _, _ = renderer.get_text_width_height_descent(s, prop, ismath=False)
            width_px[s] = w
        return width_px[s]

    for s in (s for spans in _compute_spans(result).values() for s in spans):
        room = (s.end_ms - s.start_ms) * px_per_ms - 2 * _LABEL_PAD_PX
        text = next((c for c in labels(s.text) if text_px(c) <= room), None)
        if text is not None:
            ax.text((s.start_ms + s.end_ms) / 2, pp - 1 - s.rank + _LABEL_Y, text, ha="center", va="bottom",
                    fontsize=LABEL_FONTSIZE, gid=LABEL_GID, clip_on=True)


def _compute_spans(result: SimResult) -> dict[int, list[InstrSpan]]:
    """Rank -> its compute instructions (F, B, W, FB) of positive length, in program order."""
    out: dict[int, list[InstrSpan]] = {}
    for s in result.spans:
        if s.op in ("F", "B", "W", "FB") and s.end_ms > s.start_ms:
            out.setdefault(s.rank, []).append(s)
    return out


def _rect(x: float, w: float, y: float, h: float) -> list[tuple[float, float]]:
    return [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]


def _draw_bars(ax, result: SimResult, pp: int, px_per_ms: float) -> None:
    """Task bars (one collection per colour), instruction tints below them and outlines above."""
    by_colour: dict[str, list] = {}
    for e in result.events:
        if e.resource in _ROW and e.end_ms > e.start_ms:
            y0, h = _ROW[e.resource]
            by_colour.setdefault(colour(e.kind, e.phase), []).append(
                _rect(e.start_ms, e.end_ms - e.start_ms, pp - 1 - e.rank + y0, h))
    tints: dict[str, list] = {}
    outlines = []
    y0, h = _ROW[Resource.COMPUTE.value]
    for spans in _compute_spans(result).values():
        for s in spans:
            x, w, y = s.start_ms, s.end_ms - s.start_ms, pp - 1 - s.rank + y0
            if s.op == "FB":  # F tint on top, B below
                tints.setdefault(INSTR_TINT["F"], []).append(_rect(x, w, y + h / 2, h / 2))
                tints.setdefault(INSTR_TINT["B"], []).append(_rect(x, w, y, h / 2))
            else:
                tints.setdefault(INSTR_TINT.get(s.op, INSTR_TINT["F"]), []).append(_rect(x, w, y, h))
            if w * px_per_ms >= _OUTLINE_MIN_PX:
                outlines.append(_rect(x, w, y, h))
    def add(verts: list, zorder: float, **style) -> None:
        if verts:  # an (N, 4, 2) array: PolyCollection's fast path
            ax.add_collection(PolyCollection(np.asarray(verts), zorder=zorder, **style), autolim=False)

    for c, verts in tints.items():
        add(verts, 0.5, facecolors=c, linewidths=0)
    for c, verts in by_colour.items():
        add(verts, 1.0, facecolors=c, linewidths=0)
    add(outlines, 2.5, facecolors="none", edgecolors="#222222", linewidths=0.45)


def timeline_figure(result: SimResult, title: str = "", *, width_in: float = 16.0, dpi: int = 120) -> Figure:
    """The timeline of ``result`` as a matplotlib Figure on an Agg canvas (see the module doc).

    Args:
        result: a simulated iteration.
        title: figure title; the summary line of ``result`` is appended.
        width_in: figure width, inches; the height is ``BAND_IN`` inches per rank plus margins
            and the legend.
        dpi: resolution, dots per inch.
    """
    pp = max(result.pp, 1)
    pairs = _present_pairs(result)
    n_phases = len({p for _, p in pairs}) or 1
    legend_in = 0.4 + _LEGEND_ROW_IN * n_phases
    bottom_in = _BOTTOM_IN + legend_in
    height_in = _TOP_IN + BAND_IN * pp + bottom_in
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    canvas = FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.075, right=0.99, bottom=bottom_in / height_in, top=1 - _TOP_IN / height_in)
    ax = fig.add_subplot(1, 1, 1)
    span_ms = max(result.iteration_ms, 1e-9)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_ylim(0, pp)

    _draw_bars(ax, result, pp, ax.get_window_extent(canvas.get_renderer()).width / (span_ms * 1.01))

    ticks, names = [], []
    for r in range(result.pp):
        for res in (Resource.COMPUTE.value, Resource.EP_COMM.value):
            ry, rh = _ROW[res]
            ticks.append(pp - 1 - r + ry + rh / 2)
            names.append(f"r{r} {ROW_LABEL[res]}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(names, fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", top=True, labeltop=True, labelsize=8)
    ax.set_xlabel("time (ms)")
    for r in range(1, pp):
        ax.axhline(r, color="#bbbbbb", linewidth=0.6)
    head = f"{title} — " if title else ""
    ax.set_title(head + result.summary(), fontsize=9, pad=18)
    _add_labels(ax, result, pp, canvas.get_renderer())
    _legend(fig, pairs, legend_in)
    return fig


def write_timeline_png(result: SimResult, path: str | Path, title: str = "", *, width_in: float = 16.0,
                       dpi: int = 120) -> Path:
    """Draw the timeline of ``result`` (:func:`timeline_figure`) to a PNG at ``path`` (parent
    folders created).

    Args:
        result: a simulated iteration.
        path: output file.
        title: figure title; the summary line of ``result`` is appended.
        width_in, dpi: figure width in inches and resolution in dots per inch.

    Returns:
        The path written.
    """
    fig = timeline_figure(result, title, width_in=width_in, dpi=dpi)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    return p
