"""PNG timeline of a simulated iteration (matplotlib, Agg canvas, no display needed).

One band per rank (rank 0 on top) with two labelled sub-rows: ``rN compute`` (tall) and
``rN EP comm`` (the dispatch/combine all-to-alls, shorter). Two channels, each readable alone:

* **colour = task kind** (:data:`KIND_COLOUR`: one of matplotlib's qualitative ``tab10`` colours
  per kind, nine distinct hues: mixer, router, expert, shared expert, dense MLP, embedding, head,
  dispatch, combine); red is kept for the critical path;
* **pattern = phase** (:data:`PHASE_HATCH`): F (forward) solid, B (input-gradient backward) with
  white diagonal stripes, W (weight gradient) with white crosses.

Each compute instruction is filled with a pale grey (:data:`INSTR_TINT`), visible where compute is
idle inside it, and outlined in dark grey when it is at least a few pixels wide. The **critical
path** (:func:`tessera.sim.critical.critical_path`: the chain of tasks, pipeline transfers and
waits that sets the iteration time) is a red line in a lane between each rank's two rows while
the path is on that rank, crossing to another rank's lane along each pipeline transfer that
carried it, and its tasks are outlined in red: follow it to see which task made a rank late.

Instructions wide enough carry a short label above the bar, and a caption under the legend
(:data:`LABEL_CAPTION`) explains them: ``F3`` forward of microbatch 3, ``B3`` input-gradient
backward, ``BW3`` backward with its weight gradients, ``W3`` weight gradient, ``F9|B4`` one FB
instruction overlapping the forward of microbatch 9 with the backward of microbatch 4; only the
numbers, ``3`` or ``9|4``, when the letters do not fit; nothing when neither fits, so labels never
overlap. The legend sits below the plot in two rows: the kinds (colour), then the phases
(pattern), the idle tint and the critical path. The title adds the path's share of the iteration
on each rank it runs through. The figure grows with the number of ranks so bars keep a readable
height. The x axis (top and bottom) is in ms.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path as MplPath

from tessera.sim.critical import PathStep, critical_path
from tessera.sim.result import InstrSpan, SimResult
from tessera.spec.tasks import Resource, TaskKind

PHASES = ("F", "B", "W")
KIND_ORDER = tuple(k.value for k in TaskKind)

KIND_COLOUR: dict[str, str] = {
    TaskKind.MIXER.value: "#1f77b4",  # tab:blue
    TaskKind.ROUTER.value: "#17becf",  # tab:cyan
    TaskKind.EXPERT.value: "#ff7f0e",  # tab:orange
    TaskKind.SHARED.value: "#bcbd22",  # tab:olive
    TaskKind.MLP.value: "#9467bd",  # tab:purple
    TaskKind.EMBED.value: "#7f7f7f",  # tab:gray
    TaskKind.HEAD.value: "#e377c2",  # tab:pink
    TaskKind.DISPATCH.value: "#2ca02c",  # tab:green
    TaskKind.COMBINE.value: "#8c564b",  # tab:brown
}
"""Fill colour of every task kind: matplotlib's ``tab10`` without its red; all distinct."""
FALLBACK_COLOUR = "#404040"
"""Fill of a kind missing from :data:`KIND_COLOUR`."""
PHASE_HATCH: dict[str, str] = {"F": "", "B": "////", "W": "xxx"}
"""Pattern of a task's phase, drawn in white over its kind's colour: F solid, B stripes, W crosses."""
PHASE_NAME: dict[str, str] = {"F": "forward", "B": "input-gradient backward", "W": "weight gradient"}
INSTR_TINT = "#e9e9e9"
"""Pale background of a compute instruction: where it shows, the instruction is waiting (e.g. on
its all-to-all) and the compute stream is idle."""
CRITICAL_COLOUR = "#d62728"
"""The critical path's colour (tab:red, used by no task kind)."""
CRITICAL_GID = "critical-path"
"""``gid`` of the critical path's line (tests and tools can find it on the figure)."""
LABEL_CAPTION = ("labels: F3 forward of microbatch 3 · B3 input-gradient backward · BW3 backward with its weight "
                 "gradients · W3 weight gradient · F9|B4 one FB instruction: the forward of microbatch 9 overlapped "
                 "with the backward of microbatch 4 · 3, 9|4: the same where only the numbers fit")
"""The caption under the legend that explains the instruction labels."""

ROW_LABEL = {Resource.COMPUTE.value: "compute", Resource.EP_COMM.value: "EP comm"}
_ROW = {Resource.COMPUTE.value: (0.36, 0.40), Resource.EP_COMM.value: (0.06, 0.24)}  # (y offset, height) in a band
_LABEL_Y = 0.78  # bottom of the instruction labels, in a band (above the compute row)
BAND_IN = 0.85
"""Height of one rank's band, inches."""
_TOP_IN, _BOTTOM_IN, _LEGEND_ROW_IN = 0.9, 0.5, 0.38  # title (2 lines) + top axis; bottom axis; one legend
_CAPTION_IN = 0.3  # the label caption under the legend
_OUTLINE_MIN_PX = 6.0  # narrower instructions get no outline (it would hide them); their tint still shows
_CRITICAL_MIN_PX = 3.0  # narrower critical tasks get no red outline (the path's lane still marks their time)
LABEL_FONTSIZE = 6.5
_LABEL_PAD_PX = 2.0  # free pixels a label keeps on each side inside its instruction
LABEL_GID = "instr-label"
"""``gid`` of the instruction-label texts (tests and tools can find them on the figure)."""


def colour(kind: str) -> str:
    """Fill colour (hex) of a task of ``kind`` (any phase: the phase is its pattern)."""
    return KIND_COLOUR.get(kind, FALLBACK_COLOUR)


def labels(text: str) -> tuple[str, ...]:
    """Candidate labels of an instruction text, longest first, e.g. ``"F(mb3.c0)"`` ->
    ``("F3", "3")`` and ``"FB(F mb4.c0 | B mb1.c1)"`` -> ``("F4|B1", "4|1")``."""
    nums = re.findall(r"mb(\d+)", text)
    if text.startswith("FB") and len(nums) >= 2:
        return f"F{nums[0]}|B{nums[1]}", f"{nums[0]}|{nums[1]}"
    head = "BW" if text.startswith("B+W") else text[:1]
    return (f"{head}{nums[0]}", nums[0]) if nums else (text[:2],)


def _present(result: SimResult) -> tuple[list[str], list[str]]:
    """(kinds, phases) drawn, in :data:`KIND_ORDER` / :data:`PHASES` order (unknown ones after)."""
    drawn = [e for e in result.events if e.resource in _ROW and e.end_ms > e.start_ms]
    rank = {k: i for i, k in enumerate(KIND_ORDER)}
    phase = {p: i for i, p in enumerate(PHASES)}
    kinds = sorted({e.kind for e in drawn}, key=lambda k: (rank.get(k, len(rank)), k))
    phases = sorted({e.phase for e in drawn}, key=lambda p: (phase.get(p, len(phase)), p))
    return kinds, phases


def _legend(fig: Figure, kinds: list[str], phases: list[str], critical: bool, top_in: float) -> None:
    """Below the plot, its top ``top_in`` inches above the figure's bottom edge: a row of the task
    kinds drawn (colour), under it a row of the phases drawn (pattern), the idle tint and the
    critical path, and under both the label caption (:data:`LABEL_CAPTION`)."""
    height = fig.get_figheight()
    kind_handles = [Patch(facecolor=colour(k), edgecolor="none", label=k) for k in kinds]
    marks = [Patch(facecolor="#9a9a9a", edgecolor="white", linewidth=0, hatch=PHASE_HATCH.get(p, ""),
                   label=f"{p}: {PHASE_NAME.get(p, p)}") for p in phases]
    marks.append(Patch(facecolor=INSTR_TINT, edgecolor="#222222", linewidth=0.45, label="instruction, compute idle"))
    if critical:
        marks.append(Line2D([], [], color=CRITICAL_COLOUR, linewidth=1.8, label="critical path: the chain of tasks "
                            "and transfers that sets the iteration time"))
    style = dict(loc="upper center", fontsize=7, frameon=False, handlelength=2.0, handleheight=1.1,
                 columnspacing=1.4, title_fontsize=7)
    if kind_handles:
        fig.legend(handles=kind_handles, bbox_to_anchor=(0.5, top_in / height), ncol=len(kind_handles),
                   title="colour = task kind", **style)
    fig.legend(handles=marks, bbox_to_anchor=(0.5, (top_in - _LEGEND_ROW_IN) / height), ncol=len(marks),
               title="pattern = phase; marks", **style)
    fig.text(0.5, 0.08 / height, LABEL_CAPTION, ha="center", va="bottom", fontsize=7, color="#333333")


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


def _draw_bars(ax, result: SimResult, pp: int, px_per_ms: float, path: tuple[PathStep, ...]) -> None:
    """Task bars (one collection per kind and phase), instruction tints below them, instruction
    outlines above, then the critical path's task outlines and line on top."""
    groups: dict[tuple[str, str], list] = {}
    for e in result.events:
        if e.resource in _ROW and e.end_ms > e.start_ms:
            y0, h = _ROW[e.resource]
            groups.setdefault((colour(e.kind), PHASE_HATCH.get(e.phase, "")), []).append(
                _rect(e.start_ms, e.end_ms - e.start_ms, pp - 1 - e.rank + y0, h))
    tints, outlines = [], []
    y0, h = _ROW[Resource.COMPUTE.value]
    for spans in _compute_spans(result).values():
        for s in spans:
            x, w, y = s.start_ms, s.end_ms - s.start_ms, pp - 1 - s.rank + y0
            tints.append(_rect(x, w, y, h))
            if w * px_per_ms >= _OUTLINE_MIN_PX:
                outlines.append(_rect(x, w, y, h))

    def add(verts: list, zorder: float, **style):
        if verts:  # an (N, 4, 2) array: PolyCollection's fast path
            c = PolyCollection(np.asarray(verts), zorder=zorder, **style)
            ax.add_collection(c, autolim=False)
            return c
        return None

    add(tints, 0.5, facecolors=INSTR_TINT, linewidths=0)
    patterned: dict[str, list] = {}
    for (c, hatch), verts in groups.items():
        add(verts, 1.0, facecolors=c, edgecolors="none", linewidths=0)
        if hatch:
            patterned.setdefault(hatch, []).extend(verts)
    for hatch, verts in patterned.items():  # one compound path per pattern: Agg hatches it once, not per bar
        ax.add_artist(PathPatch(MplPath.make_compound_path_from_polys(np.asarray(verts)), facecolor="none",
                                edgecolor="white", linewidth=0, hatch=hatch, zorder=1.5))  # no autolim: fixed axes
    add(outlines, 2.5, facecolors="none", edgecolors="#222222", linewidths=0.45)
    _draw_critical(ax, path, pp, px_per_ms)


def _row_y(rank: int, resource: str, pp: int) -> float:
    """Centre of a rank's sub-row, data units."""
    y0, h = _ROW.get(resource, _ROW[Resource.COMPUTE.value])
    return pp - 1 - rank + y0 + h / 2


def _lane_y(rank: int, pp: int) -> float:
    """The critical path's lane of a rank: between its EP comm row and its compute row."""
    comm, compute = _ROW[Resource.EP_COMM.value], _ROW[Resource.COMPUTE.value]
    return pp - 1 - rank + (comm[0] + comm[1] + compute[0]) / 2


def _draw_critical(ax, path: tuple[PathStep, ...], pp: int, px_per_ms: float) -> None:
    """The critical path: one red line in each rank's lane (:func:`_lane_y`) while the path is on
    that rank, crossing to the receiver's lane along each transfer (from its start to its end; a
    transfer that another on the path waited for on the same link stays in the sender's lane),
    and a red outline on each of its tasks at least :data:`_CRITICAL_MIN_PX` wide."""
    boxes = [_rect(s.start_ms, s.end_ms - s.start_ms, pp - 1 - s.rank + _ROW[s.resource][0], _ROW[s.resource][1])
             for s in path if s.kind == "task" and s.resource in _ROW
             and (s.end_ms - s.start_ms) * px_per_ms >= _CRITICAL_MIN_PX]
    if boxes:
        ax.add_collection(PolyCollection(np.asarray(boxes), facecolors="none", edgecolors=CRITICAL_COLOUR,
                                         linewidths=0.7, zorder=2.8), autolim=False)
    points: list[tuple[float, float]] = []
    for i, s in enumerate(path):  # contiguous links: each starts where the one before it ended
        end_rank = s.peer if s.kind == "transfer" else s.rank
        nxt = path[i + 1] if i + 1 < len(path) else None
        if nxt is not None and s.kind == nxt.kind == "transfer" and (s.rank, s.peer) == (nxt.rank, nxt.peer):
            end_rank = s.rank  # the next transfer waited for the link behind this one: at the sender
        points += [(s.start_ms, _lane_y(s.rank, pp)), (s.end_ms, _lane_y(end_rank, pp))]
    if len(points) > 1:
        line = LineCollection([np.asarray(points)], colors=CRITICAL_COLOUR, linewidths=1.8, zorder=3.0,
                              capstyle="butt", joinstyle="miter")
        line.set_gid(CRITICAL_GID)
        ax.add_collection(line, autolim=False)


def timeline_figure(result: SimResult, title: str = "", *, width_in: float = 16.0, dpi: int = 120,
                    critical: tuple[PathStep, ...] | None = None) -> Figure:
    """The timeline of ``result`` as a matplotlib Figure on an Agg canvas (see the module doc).

    Args:
        result: a simulated iteration.
        title: figure title; the summary line of ``result`` and the critical path's share per
            rank are appended.
        width_in: figure width, inches; the height is ``BAND_IN`` inches per rank plus margins,
            the legend and the caption.
        dpi: resolution, dots per inch.
        critical: the critical path to mark (default: :func:`~tessera.sim.critical.critical_path`
            of ``result``).
    """
    pp = max(result.pp, 1)
    kinds, phases = _present(result)
    path = critical_path(result) if critical is None else critical
    legend_in = 2 * _LEGEND_ROW_IN + _CAPTION_IN
    bottom_in = _BOTTOM_IN + legend_in
    height_in = _TOP_IN + BAND_IN * pp + bottom_in
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    canvas = FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.075, right=0.99, bottom=bottom_in / height_in, top=1 - _TOP_IN / height_in)
    ax = fig.add_subplot(1, 1, 1)
    span_ms = max(result.iteration_ms, 1e-9)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_ylim(0, pp)

    _draw_bars(ax, result, pp, ax.get_window_extent(canvas.get_renderer()).width / (span_ms * 1.01), path)

    ticks, names = [], []
    for r in range(result.pp):
        for res in (Resource.COMPUTE.value, Resource.EP_COMM.value):
            ticks.append(_row_y(r, res, pp))
            names.append(f"r{r} {ROW_LABEL[res]}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(names, fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", top=True, labeltop=True, labelsize=8)
    ax.set_xlabel("time (ms)")
    for r in range(1, pp):
        ax.axhline(r, color="#bbbbbb", linewidth=0.6)
    head = f"{title} — " if title else ""
    ax.set_title(head + result.summary() + _critical_summary(path, span_ms), fontsize=9, pad=18)
    _add_labels(ax, result, pp, canvas.get_renderer())
    _legend(fig, kinds, phases, bool(path), legend_in)
    return fig


def _critical_summary(path: tuple[PathStep, ...], span_ms: float) -> str:
    """``"; critical path: r7 58%, r1 26%, ..."``: the share of the iteration the path spends on
    each rank's tasks and instructions, largest first (ranks under 5% left out)."""
    from tessera.sim.critical import critical_ms_by_rank

    by_rank = sorted(critical_ms_by_rank(path).items(), key=lambda kv: (-kv[1], kv[0]))
    shown = [f"r{r} {ms / span_ms:.0%}" for r, ms in by_rank if ms / span_ms >= 0.05]
    return f"\ncritical path: {', '.join(shown)} of the iteration" if shown else ""


def write_timeline_png(result: SimResult, path: str | Path, title: str = "", *, width_in: float = 16.0,
                       dpi: int = 120, critical: tuple[PathStep, ...] | None = None) -> Path:
    """Draw the timeline of ``result`` (:func:`timeline_figure`) to a PNG at ``path`` (parent
    folders created).

    Args:
        result: a simulated iteration.
        path: output file.
        title: figure title; the summary line of ``result`` and the critical path's shares are appended.
        width_in, dpi: figure width in inches and resolution in dots per inch.
        critical: the critical path to mark (default: computed from ``result``).

    Returns:
        The path written.
    """
    fig = timeline_figure(result, title, width_in=width_in, dpi=dpi, critical=critical)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    return p
