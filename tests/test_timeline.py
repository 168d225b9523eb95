"""PNG timeline: readable at pp=16 (bars, not hairlines), labelled sub-rows, colour = task kind (nine
distinct qualitative colours) and pattern = phase in plot and legend, instruction labels that fit,
never overlap and are explained by a caption, and the critical path (tessera.sim.critical): its
exact chain on a hand-built 2-rank iteration, a contiguous chain from 0 to the iteration's end on
real recipes, its line and outlines on the figure, and ``tessera simulate --json`` carrying it."""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from itertools import combinations
from pathlib import Path

import matplotlib
import pytest
from matplotlib.colors import to_hex, to_rgb
from matplotlib.path import Path as MplPath

from tessera.cli.main import main
from tessera.config.load import load_recipe
from tessera.flow import simulate_recipe
from tessera.sim.critical import PathStep, critical_ms_by_rank, critical_path
from tessera.sim.result import InstrSpan, RankMetrics, SimResult, TaskEvent, Transfer
from tessera.sim.timeline import (BAND_IN, CRITICAL_COLOUR, CRITICAL_GID, INSTR_TINT, KIND_COLOUR, LABEL_CAPTION,
                                  LABEL_GID, PHASE_HATCH, labels, timeline_figure, write_timeline_png)
from tessera.spec.tasks import TaskKind

pytestmark = pytest.mark.xdist_group("timeline")  # module fixtures built once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # name -> (recipe, overrides): pp=2, pp=8 vpp=2, pp=16 dualpipe-v
    "tiny": ("tiny-qwen3-next.yaml", []),
    "qwen": ("qwen3-next-80b.yaml", ["parallel.pp=8", "parallel.vpp=2"]),
    "deepseek": ("deepseek-v3.yaml", []),
}


@pytest.fixture(scope="module")
def results() -> dict[str, SimResult]:
    return {k: simulate_recipe(load_recipe(str(ROOT / "recipes" / f), ov)).result for k, (f, ov) in RECIPES.items()}


@pytest.fixture(scope="module")
def figures(results):
    out = {}
    for k, r in results.items():
        fig = timeline_figure(r, k)
        fig.canvas.draw()
        out[k] = fig
    return out


def _task_bars(ax):
    """The task-bar collections (filled with a kind's colour): hex -> collection list."""
    kinds = set(KIND_COLOUR.values())
    out: dict[str, list] = {}
    for c in ax.collections:
        fc = c.get_facecolor()
        if len(fc) and to_hex(fc[0]) in kinds:
            out.setdefault(to_hex(fc[0]), []).append(c)
    return out


def _patterns(ax) -> dict[str, int]:
    """The phase patterns drawn over the bars: hatch -> number of bars it covers."""
    return {p.get_hatch(): sum(1 for _ in p.get_path().iter_segments() if _[1] == MplPath.CLOSEPOLY)
            for p in ax.patches if p.get_hatch()}


def _height_px(collection, ax) -> float:
    return collection.get_paths()[0].get_extents(ax.transData).height


def test_labels_of_instruction_texts():
    assert labels("F(mb3.c0)") == ("F3", "3")
    assert labels("B(mb12.c1)") == ("B12", "12")
    assert labels("B+W(mb2.c0)") == ("BW2", "2")
    assert labels("W(mb0.c1)") == ("W0", "0")
    assert labels("FB(F mb4.c0 | B mb1.c1)") == ("F4|B1", "4|1")


def test_kind_colours_are_distinct_qualitative_and_leave_red_to_the_critical_path():
    assert set(KIND_COLOUR) == {k.value for k in TaskKind}
    tab10 = {to_hex(c) for c in matplotlib.colormaps["tab10"].colors}
    colours = list(KIND_COLOUR.values())
    assert len(set(colours)) == len(colours) == 9 and set(colours) <= tab10
    assert CRITICAL_COLOUR == to_hex(matplotlib.colormaps["tab10"].colors[3]) and CRITICAL_COLOUR not in colours
    # far apart: no two kinds closer than 0.25 in RGB (25 shades of three hues, one per kind and phase, came to 0.12)
    gap = min(sum((x - y) ** 2 for x, y in zip(to_rgb(a), to_rgb(b))) ** 0.5 for a, b in combinations(colours, 2))
    assert gap > 0.25
    assert PHASE_HATCH["F"] == "" and len({PHASE_HATCH[p] for p in "FBW"}) == 3  # F solid, B and W patterned


def test_height_grows_with_pp_and_bars_are_not_hairlines(figures):
    h = {k: f.get_figheight() for k, f in figures.items()}
    assert h["deepseek"] - h["qwen"] == pytest.approx(8 * BAND_IN)  # pp 16 vs 8, same legend
    assert h["qwen"] - h["tiny"] == pytest.approx(6 * BAND_IN)
    for k in ("qwen", "deepseek"):
        ax = figures[k].axes[0]
        heights = sorted({round(_height_px(c, ax), 1) for cs in _task_bars(ax).values() for c in cs})
        assert len(heights) == 2, heights  # EP comm row and compute row
        comm, compute = heights
        assert comm >= 24 and compute >= 40, (k, heights)  # pixels at 120 dpi


def test_png_size_follows_the_figure(results, figures, tmp_path):
    p = write_timeline_png(results["deepseek"], tmp_path / "a" / "t.png", "ds", width_in=12.0, dpi=100)
    raw = p.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", raw[16:24])
    assert w == 1200 and h == round(100 * figures["deepseek"].get_figheight())  # height: pp and legend only
    assert h >= 1500  # 16 ranks


def test_sub_rows_are_labelled(figures, results):
    for k, fig in figures.items():
        ax, pp = fig.axes[0], results[k].pp
        names = [t.get_text() for t in ax.get_yticklabels()]
        assert names == [f"r{r} {row}" for r in range(pp) for row in ("compute", "EP comm")]
        # each tick sits inside its sub-row's bars: compute above EP comm within the rank's band
        ticks = list(ax.get_yticks())
        for r in range(pp):
            compute, comm = ticks[2 * r], ticks[2 * r + 1]
            assert pp - 1 - r < comm < compute < pp - r


def test_legend_has_the_kinds_by_colour_and_the_phases_by_pattern(figures, results):
    for k, fig in figures.items():
        r = results[k]
        present = {(e.kind, e.phase) for e in r.events
                   if e.resource in ("compute", "ep_comm") and e.end_ms > e.start_ms}
        kinds_legend, marks_legend = fig.legends
        assert kinds_legend.get_title().get_text() == "colour = task kind"
        kinds = {t.get_text(): to_hex(h.get_facecolor()) for t, h in zip(kinds_legend.get_texts(),
                                                                         kinds_legend.legend_handles)}
        assert kinds == {kind: KIND_COLOUR[kind] for kind, _ in present}
        marks = {t.get_text(): h for t, h in zip(marks_legend.get_texts(), marks_legend.legend_handles)}
        phases = {lab[0]: h.get_hatch() or "" for lab, h in marks.items() if re.fullmatch(r"[FBW]: .+", lab)}
        assert phases == {p: PHASE_HATCH[p] for _, p in present}
        assert to_hex(marks["instruction, compute idle"].get_facecolor()) == INSTR_TINT
        (critical,) = [h for lab, h in marks.items() if lab.startswith("critical path")]
        assert to_hex(critical.get_color()) == CRITICAL_COLOUR
        # the plot fills every kind's bars with its colour and covers every B and W bar with its phase's
        # pattern (in white), nothing else
        ax = fig.axes[0]
        assert set(_task_bars(ax)) == {KIND_COLOUR[kind] for kind, _ in present}
        drawn = Counter(e.phase for e in r.events if e.resource in ("compute", "ep_comm") and e.end_ms > e.start_ms)
        assert _patterns(ax) == {PHASE_HATCH[p]: n for p, n in drawn.items() if PHASE_HATCH[p]}
        assert all(to_hex(p.get_hatchcolor()) == "#ffffff" for p in ax.patches if p.get_hatch())
        # compact: both legends and the caption sit below the axes and within the figure
        renderer = fig.canvas.get_renderer()
        axb = fig.axes[0].get_window_extent(renderer)
        (caption,) = [t for t in fig.texts if t.get_text() == LABEL_CAPTION]
        boxes = [lg.get_window_extent(renderer) for lg in fig.legends] + [caption.get_window_extent(renderer)]
        for upper, lower in zip(boxes, boxes[1:]):
            assert lower.y1 <= upper.y0 + 1  # kinds above phases above the caption, not overlapping
        for bb in boxes:
            assert bb.y1 < axb.y0 and bb.y0 >= 0 and bb.x0 >= 0 and bb.x1 <= fig.bbox.width


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_label_drawn_has_a_form_the_caption_explains(figures, name):
    forms = {r"(F|B|BW|W)\d+": ("F3 forward", "B3 input-gradient", "BW3 backward", "W3 weight"),
             r"F\d+\|B\d+": ("F9|B4 one FB instruction",), r"\d+(\|\d+)?": ("3, 9|4",)}
    for form, phrases in forms.items():
        assert all(p in LABEL_CAPTION for p in phrases), (form, phrases)
    drawn = {t.get_text() for t in figures[name].axes[0].texts if t.get_gid() == LABEL_GID}
    assert drawn and all(any(re.fullmatch(f, t) for f in forms) for t in drawn), drawn


def _label_boxes(fig):
    renderer = fig.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer)) for t in fig.axes[0].texts if t.get_gid() == LABEL_GID]


@pytest.mark.parametrize("name", list(RECIPES))
def test_instruction_labels_never_overlap(figures, name):
    boxes = _label_boxes(figures[name])
    assert len(boxes) >= 20, len(boxes)  # the tiny recipe: 24 (auto keeps W inside B on CPU)
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            disjoint = a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0
            assert disjoint, (ta, tb, a, b)


def _synthetic(widths_ms: list[float]) -> SimResult:
    """One rank running F(mb i) instructions of the given widths back to back, one mixer task each."""
    spans, events, t = [], [], 0.0
    for i, w in enumerate(widths_ms):
        spans.append(InstrSpan(0, i, "F", f"F(mb{10 + i}.c0)", t, t + w))
        events.append(TaskEvent(0, "compute", "F.L0.mixer", "mixer", "F", 10 + i, 0, t, t + w, instr=i))
        t += w
    ranks = (RankMetrics(0, t, t, 0.0, 0.0, 0.0, 0.0, 0.0),)
    return SimResult(1, t, ranks, 0.0, 0.0, 0.0, tuple(events), tuple(spans))


def test_labels_shorten_then_vanish_as_instructions_narrow():
    widths = [30.0 * 0.7 ** i for i in range(20)]  # 30 ms down to 0.03 ms of a ~180 ms axis
    fig = timeline_figure(_synthetic(widths))
    fig.canvas.draw()
    ax = fig.axes[0]
    got = {}
    for text, box in _label_boxes(fig):
        x_ms = ax.transData.inverted().transform(((box.x0 + box.x1) / 2, box.y0))[0]
        i = next(j for j in range(len(widths)) if sum(widths[:j]) <= x_ms < sum(widths[:j + 1]))
        left, right = (ax.transData.transform((v, 0))[0] for v in (sum(widths[:i]), sum(widths[:i + 1])))
        assert left <= box.x0 and box.x1 <= right, (text, i)  # inside its own instruction
        got[i] = text
    kinds = [("full" if got[i] == f"F{10 + i}" else "short") if i in got else "none" for i in range(len(widths))]
    assert kinds[0] == "full" and kinds[-1] == "none" and "short" in kinds
    assert kinds == sorted(kinds, key=["full", "short", "none"].index)  # full, then short, then none
    for i, k in enumerate(kinds):
        if k == "short":
            assert got[i] == str(10 + i)


# --------------------------------------------------------------------------- the critical path


def _two_ranks() -> SimResult:
    """Rank 0 runs F(mb0) (mixer, router, then its dispatch) and a short F(mb1) and sends both
    activations to rank 1 over one link; mb1's transfer waits on the link behind mb0's. Rank 1
    runs F(mb0) as soon as mb0 arrives, then blocks on mb1, then F(mb1) (a mixer and, tied at its
    end, a shorter dispatch; then the expert), then its optimizer step: the iteration's end."""
    def ev(rank, resource, name, kind, mb, start, end, instr):
        return TaskEvent(rank, resource, name, kind, "F", mb, 0, start, end, instr)

    events = (ev(0, "compute", "F.L0.mixer", "mixer", 0, 0.0, 1.0, 0),
              ev(0, "compute", "F.L0.router", "router", 0, 1.0, 2.0, 0),
              ev(0, "ep_comm", "F.L0.dispatch", "dispatch", 0, 2.0, 3.0, 0),
              ev(0, "compute", "F.L0.mixer", "mixer", 1, 3.0, 3.5, 2),
              ev(1, "compute", "F.L0.mixer", "mixer", 0, 4.0, 4.5, 1),
              ev(1, "compute", "F.L0.mixer", "mixer", 1, 5.0, 6.0, 3),
              ev(1, "ep_comm", "F.L0.dispatch", "dispatch", 1, 5.5, 6.0, 3),
              ev(1, "compute", "F.L0.expert", "expert", 1, 6.0, 7.0, 3))
    spans = (InstrSpan(0, 0, "F", "F(mb0.c0)", 0.0, 3.0),
             InstrSpan(0, 1, "send_act", "send_act(mb0.c0 -> r1)", 3.0, 3.0),
             InstrSpan(0, 2, "F", "F(mb1.c0)", 3.0, 3.5),
             InstrSpan(0, 3, "send_act", "send_act(mb1.c0 -> r1)", 3.5, 3.5),
             InstrSpan(0, 4, "optimizer_step", "optimizer_step", 3.5, 4.0),
             InstrSpan(1, 0, "recv_act", "recv_act(mb0.c0 <- r0)", 0.0, 4.0),
             InstrSpan(1, 1, "F", "F(mb0.c0)", 4.0, 4.5),
             InstrSpan(1, 2, "recv_act", "recv_act(mb1.c0 <- r0)", 4.5, 5.0),
             InstrSpan(1, 3, "F", "F(mb1.c0)", 5.0, 7.0),
             InstrSpan(1, 4, "optimizer_step", "optimizer_step", 7.0, 7.5))
    transfers = (Transfer("act", 0, 0, 0, 1, 3.0, 3.0, 4.0), Transfer("act", 1, 0, 0, 1, 3.5, 4.0, 5.0))
    ranks = (RankMetrics(0, 4.0, 3.5, 3.5, 0.0, 0.0, 0.0, 0.0), RankMetrics(1, 7.5, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0))
    return SimResult(2, 7.5, ranks, 0.5, 0.0, 0.0, events, spans, transfers)


def test_critical_path_of_a_hand_built_two_rank_iteration():
    """Backwards from rank 1's optimizer step: F(mb1)'s expert, then its mixer (the tie at 6.0 goes
    to the longer task), then not rank 1's own F(mb0) (which ended earlier) but the blocked receive:
    mb1's transfer, which waited on the link for mb0's, which was posted when rank 0's dispatch ended."""
    path = critical_path(_two_ranks())
    assert path == (
        PathStep("task", 0, 0.0, 1.0, "F.L0.mixer", 0, "compute", "F", 0),
        PathStep("task", 0, 1.0, 2.0, "F.L0.router", 0, "compute", "F", 0),
        PathStep("task", 0, 2.0, 3.0, "F.L0.dispatch", 0, "ep_comm", "F", 0),
        PathStep("transfer", 0, 3.0, 4.0, "act mb0", -1, "pp_comm", "", 0, 1),
        PathStep("transfer", 0, 4.0, 5.0, "act mb1", -1, "pp_comm", "", 1, 1),
        PathStep("task", 1, 5.0, 6.0, "F.L0.mixer", 3, "compute", "F", 1),
        PathStep("task", 1, 6.0, 7.0, "F.L0.expert", 3, "compute", "F", 1),
        PathStep("instruction", 1, 7.0, 7.5, "optimizer_step", 4),
    )
    assert critical_ms_by_rank(path) == {0: 3.0, 1: 2.5}


@pytest.mark.parametrize("name", list(RECIPES))
def test_critical_path_is_a_contiguous_chain_over_the_whole_iteration(results, name):
    r = results[name]
    path = critical_path(r)
    assert path[0].start_ms == 0.0 and path[-1].end_ms == r.iteration_ms
    assert all(a.end_ms == pytest.approx(b.start_ms, abs=1e-9 * r.iteration_ms) for a, b in zip(path, path[1:]))
    tasks = {(e.rank, e.instr, e.name, e.mb, e.start_ms, e.end_ms) for e in r.events}
    assert all((s.rank, s.instr, s.name, s.mb, s.start_ms, s.end_ms) in tasks for s in path if s.kind == "task")
    transfers = {(t.src, t.dst, t.mb, t.start_ms, t.end_ms) for t in r.transfers}
    hops = [s for s in path if s.kind == "transfer"]
    assert hops and all((s.rank, s.peer, s.mb, s.start_ms, s.end_ms) in transfers for s in hops)
    assert sum(critical_ms_by_rank(path).values()) + sum(s.end_ms - s.start_ms for s in hops) == \
        pytest.approx(r.iteration_ms, rel=1e-9)


def test_figure_marks_the_critical_path(figures, results):
    fig, r = figures["qwen"], results["qwen"]
    ax, path = fig.axes[0], critical_path(r)
    (line,) = [c for c in ax.collections if c.get_gid() == CRITICAL_GID]
    assert to_hex(line.get_color()[0]) == CRITICAL_COLOUR
    xs = [x for x, _ in line.get_segments()[0]]
    assert xs[0] == 0.0 and xs[-1] == r.iteration_ms and xs == sorted(xs)  # left to right through the iteration
    ys = {round(y % 1, 6) for _, y in line.get_segments()[0]}
    assert len(ys) == 1  # every point in a rank's lane (between its EP comm and compute rows)
    lanes = {r_ for s in path for r_ in (s.rank, s.peer) if r_ >= 0}
    assert {round(r.pp - 1 - y // 1) for _, y in line.get_segments()[0]} == lanes
    outlined = [c for c in ax.collections if len(c.get_edgecolor()) and to_hex(c.get_edgecolor()[0]) == CRITICAL_COLOUR
                and c.get_gid() != CRITICAL_GID]
    assert len(outlined) == 1 and 0 < len(outlined[0].get_paths()) <= sum(s.kind == "task" for s in path)
    # rank 5 holds the baseline's four-layer stage S5 (7 layers, the busiest rank), rank 7 the head
    assert "critical path: r5 68%, r7 17% of the iteration" in ax.get_title()


def test_tessera_simulate_writes_the_timeline_and_the_critical_path(tmp_path, capsys):
    tiny = str(ROOT / "recipes" / "tiny-qwen3-next.yaml")
    out, js = tmp_path / "sim", tmp_path / "sim.json"
    assert main(["simulate", tiny, "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    d = json.loads(js.read_text())
    path = critical_path(simulate_recipe(load_recipe(tiny)).result)
    assert d["critical_path"] == [s.to_dict() for s in path]
    assert d["critical_path"][-1]["end_ms"] == d["iteration_ms"]
    shares = sorted(critical_ms_by_rank(path).items(), key=lambda kv: -kv[1])
    row = ", ".join(f"r{k} {v / d['iteration_ms']:.0%}" for k, v in shares)
    assert "critical path" in printed and f"{row} of the iteration" in printed
