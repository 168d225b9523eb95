"""PNG timeline: readable at pp=16 (bars, not hairlines), labelled sub-rows, one distinct colour per
(task kind, phase) in plot and legend, instruction labels that fit and never overlap."""

from __future__ import annotations

import colorsys
import struct
from pathlib import Path

import pytest
from matplotlib.colors import to_hex, to_rgb

from tessera.config.load import load_recipe
from tessera.flow import simulate_recipe
from tessera.sim.result import InstrSpan, RankMetrics, SimResult, TaskEvent
from tessera.sim.timeline import (BAND_IN, INSTR_TINT, LABEL_GID, PALETTE, labels, timeline_figure,
                                  write_timeline_png)

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
    """The task-bar collections (filled with a palette colour): hex -> collection list."""
    palette = set(PALETTE.values())
    out: dict[str, list] = {}
    for c in ax.collections:
        fc = c.get_facecolor()
        if len(fc) and to_hex(fc[0]) in palette:
            out.setdefault(to_hex(fc[0]), []).append(c)
    return out


def _height_px(collection, ax) -> float:
    return collection.get_paths()[0].get_extents(ax.transData).height


def test_labels_of_instruction_texts():
    assert labels("F(mb3.c0)") == ("F3", "3")
    assert labels("B(mb12.c1)") == ("B12", "12")
    assert labels("B+W(mb2.c0)") == ("BW2", "2")
    assert labels("W(mb0.c1)") == ("W0", "0")
    assert labels("FB(F mb4.c0 | B mb1.c1)") == ("F4|B1", "4|1")


def test_palette_distinct_and_phases_separable():
    colours = list(PALETTE.values())
    assert len(set(colours)) == len(colours) == 25  # 7 compute kinds x F/B/W + 2 A2A kinds x F/B
    assert not set(colours) & set(INSTR_TINT.values())
    hue = {p: [colorsys.rgb_to_hsv(*to_rgb(c))[0] * 360 for (k, q), c in PALETTE.items() if q == p] for p in "FBW"}
    assert all(200 <= h <= 260 for h in hue["F"]), hue["F"]  # blues / indigo / purple
    assert all(h <= 50 or h >= 340 for h in hue["B"]), hue["B"]  # reds / oranges / yellow-brown
    assert all(70 <= h <= 150 for h in hue["W"]), hue["W"]  # greens / olive
    for p in "FBW":  # head is a saturated colour of its phase, not a grey
        assert colorsys.rgb_to_hsv(*to_rgb(PALETTE[("head", p)]))[1] > 0.3


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


def test_legend_has_one_distinct_colour_per_kind_and_phase_present(figures, results):
    for k, fig in figures.items():
        r = results[k]
        present = {(e.kind, e.phase) for e in r.events if e.resource in ("compute", "ep_comm")}
        (legend,) = fig.legends
        entries = {t.get_text(): to_hex(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles)
                   if t.get_text()}
        tasks = {lab: c for lab, c in entries.items() if not lab.endswith("instruction, idle")}
        assert set(tasks) == {f"{p} {kind}" for kind, p in present}
        assert len(set(tasks.values())) == len(tasks) == len(present)
        assert {entries[f"{p} instruction, idle"] for p in "FBW"} == set(INSTR_TINT.values())
        # the plot uses exactly the legend's colours for its task bars
        assert set(_task_bars(fig.axes[0])) == set(tasks.values())
        # compact: the legend sits below the axes, is at most 3 rows high and within the figure
        renderer = fig.canvas.get_renderer()
        lb, axb = legend.get_window_extent(renderer), fig.axes[0].get_window_extent(renderer)
        assert lb.y1 < axb.y0 and lb.y0 >= 0 and lb.height < 0.12 * fig.bbox.height + 80
        assert lb.x0 >= 0 and lb.x1 <= fig.bbox.width


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
