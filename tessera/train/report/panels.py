"""``tessera report RUN_DIR``: the standard panels of a run as PNG files, from its ``metrics.jsonl``.

:data:`PANELS` is the one list of the standard panels (the W&B workspace of
:mod:`tessera.train.report.dashboards` has the same ones, with the same metric keys): loss,
learning rate, MFU, iteration time, bubble ratio, bubble fill rate, exposed all-to-all, plan
version, profile drift, then the dynamic bubble optimizer's :data:`DBO_PANELS` and the
autopilot's :data:`AUTOPILOT_PANELS`, each against the step. :func:`read_metrics` reads the per-iteration records (``{"event": ...}`` lines are skipped; a
step replayed after a restart keeps its last record); :func:`render` draws one PNG per panel and an
overview of all of them with matplotlib's Agg backend (no display needed), each panel's title also
in its PNG's ``Title`` text chunk. A metric the run never logged (absent or always null) gets a
panel saying "not logged in this run".

MFU of a run on CPU (records with ``device: "cpu"``) is drawn, titled nominal
(:func:`panel_title`): its peak is not a datasheet figure but a matmul benchmark the workers ran
at start-up on the cores they were given (:func:`tessera.train.worker.metrics.job_peak_flops`), so
its level moves with ``--num-cpus`` and with whatever else ran then, while its course over the
steps of one run still follows throughput (a plan upgrade shows). It is kept, not left out, for
that course; the title says not to compare its level across runs or with GPU MFU.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from tessera.errors import TesseraConfigError


@dataclass(frozen=True)
class Panel:
    """One standard panel: ``key`` in ``metrics.jsonl`` / W&B, ``title``, y-axis ``unit``, and
    ``scale`` applied before plotting (100 turns a ratio into %); ``name``: the PNG's stem."""

    key: str
    title: str
    unit: str
    scale: float = 1.0
    steps: bool = False  # drawn as a step function (a count that changes at iteration boundaries)
    from_zero: bool = True  # the y axis starts at 0 (counts, times, ratios); False: fitted to the values

    @property
    def name(self) -> str:
        return self.key.replace("_", "-")


PANELS: tuple[Panel, ...] = (
    Panel("loss", "loss", "nats / token", from_zero=False),
    Panel("lr", "learning rate", "lr"),
    Panel("mfu", "MFU", "%", 100.0),
    Panel("iteration_ms", "iteration time", "ms"),
    Panel("bubble_ratio", "bubble ratio", "%", 100.0),
    Panel("bubble_fill_rate", "bubble fill rate", "%", 100.0),
    Panel("exposed_a2a_ms", "exposed all-to-all", "ms"),
    Panel("plan_version", "plan version", "version", steps=True),
    Panel("profile_drift", "profile drift", "%", 100.0),
)
"""The standard panels, in workspace order."""

DBO_PANELS: tuple[Panel, ...] = (
    Panel("dbo_slots", "DBO slots seen", "slots"),
    Panel("dbo_tasks_moved", "DBO W moved into slots", "tasks"),
    Panel("dbo_forced_deadline_runs", "DBO forced deadline runs", "tasks"),
    Panel("dbo_pool_mem_peak_gb", "DBO pool memory peak", "GB"),
    Panel("dbo_pred_fill_rate", "DBO predicted fill rate", "%", 100.0),
    Panel("dbo_slot_pred_err", "DBO slot prediction error", "%", 100.0),
    Panel("dbo_overhead_ms", "DBO own time", "ms"),
)
"""The dynamic bubble optimizer's per-step metrics (:mod:`tessera.train.worker.metrics`), in workspace order."""

AUTOPILOT_PANELS: tuple[Panel, ...] = (
    Panel("rank_slowdown_max", "slowest rank's slowdown", "x", from_zero=False),
    Panel("routing_skew", "routing skew", "busiest / mean EP rank", from_zero=False),
)
"""The autopilot's check-step estimates (:mod:`tessera.train.worker.straggler`; logged at check
steps only, so drawn as points every ``profile.check_every`` steps)."""

ALL_PANELS: tuple[Panel, ...] = PANELS + DBO_PANELS + AUTOPILOT_PANELS

OVERVIEW = "overview.png"


def _short(line: str, n: int = 60) -> str:
    line = line.strip()
    return line if len(line) <= n else line[:n] + "..."


def read_metrics(path: str) -> list[dict]:
    """The per-iteration records of ``metrics.jsonl`` at ``path`` (a local path or an ``s3://`` /
    ``gs://`` URI, :mod:`tessera.train.storage`), by step (a replayed step keeps its last record).

    Raises:
        TesseraConfigError: the file is missing or empty of iterations, or a line is not a JSON
            object (names the file, line and fix).
    """
    from tessera.train import storage

    if not storage.is_file(path):
        raise TesseraConfigError("metrics.jsonl", path, "no such file",
                                 "give the run directory that `tessera train` printed (it holds metrics.jsonl)")
    by_step: dict[int, dict] = {}
    for lineno, line in enumerate(storage.read_text(path).splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TesseraConfigError(f"{path}:{lineno}", _short(line), f"not a JSON line ({e.msg})",
                                     "delete or repair that line (a run killed mid-write can leave a partial "
                                     "last line)") from None
        if not isinstance(rec, dict):
            raise TesseraConfigError(f"{path}:{lineno}", _short(line), f"a {type(rec).__name__}, not a JSON "
                                     "object", "delete or repair that line")
        if "event" in rec:
            continue
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise TesseraConfigError(f"{path}:{lineno}", _short(line), f"step={step!r}: an iteration record "
                                     "needs an integer 'step'", "delete or repair that line")
        by_step[step] = rec
    if not by_step:
        raise TesseraConfigError("metrics.jsonl", path, "no iteration records",
                                 "wait for the run's first step (a run logs one record per step)")
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], panel: Panel) -> tuple[list[int], list[float]]:
    """The (steps, values) of ``panel`` in ``records``, scaled; steps where it is null, missing or
    NaN are left out (an empty pair: not logged in this run)."""
    xs, ys = [], []
    for rec in records:
        v = rec.get(panel.key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
            xs.append(rec["step"])
            ys.append(v * panel.scale)
    return xs, ys


CPU_MFU_TITLE = "MFU, nominal: CPU peak measured at start-up"
"""First line of the MFU panel's title for a run on CPU (module docstring)."""


def panel_title(panel: Panel, records: list[dict]) -> str:
    """The title ``panel`` is drawn with: ``panel.title``, except MFU of a run whose records say
    ``device: "cpu"``: :data:`CPU_MFU_TITLE` and a second line with the measured peak
    (``peak_tflops``, GFLOP/s; a range when restarts measured it again)."""
    if panel.key != "mfu" or not any(r.get("device") == "cpu" for r in records):
        return panel.title
    peaks = sorted({round(r["peak_tflops"] * 1e3, 1) for r in records
                    if isinstance(r.get("peak_tflops"), (int, float)) and r.get("device") == "cpu"})
    if not peaks:
        return CPU_MFU_TITLE
    peak = f"{peaks[0]:g}" if len(peaks) == 1 else f"{peaks[0]:g}-{peaks[-1]:g}"
    return f"{CPU_MFU_TITLE}\n({peak} GFLOP/s; compare steps, not runs)"


def _draw(ax, records: list[dict], panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    xs, ys = series(records, panel)
    title = panel_title(panel, records)
    ax.set_title(title, fontsize=10 if "\n" not in title else 8)
    if not xs:
        ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes,
                color="0.4", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if panel.steps:
        ax.step(xs, ys, where="post", color="C0")
    else:
        ax.plot(xs, ys, marker="o", markersize=3, color="C0")
    if panel.from_zero and min(ys) >= 0:  # counts, times, ratios start at 0 (a constant 0 not around -0.04..0.04)
        top = 1.1 * max(ys) if max(ys) > 0 else 1.0
        ax.set_ylim(-0.03 * top, top)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.steps:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(panel.unit, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def render(run_dir: str, out_dir: str | None = None, panels: tuple[Panel, ...] = ALL_PANELS) -> list[str]:
    """Draw every panel of ``run_dir/metrics.jsonl`` as ``out_dir/<panel name>.png`` (default
    ``out_dir``: ``run_dir/report``; for a run directory on object storage, ``report/`` in its
    local stand-in, :func:`tessera.config.storage_rules.local_dir`) and all of them in
    ``overview.png``; returns the paths written (in ``panels`` order, the overview last).

    Raises:
        TesseraConfigError: see :func:`read_metrics`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tessera.config.storage_rules import local_dir
    from tessera.train import storage

    records = read_metrics(storage.join(run_dir, "metrics.jsonl"))
    out_dir = out_dir or os.path.join(local_dir(run_dir), "report")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(4.8, 3.0), dpi=100)
        _draw(ax, records, panel)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel.name}.png")
        fig.savefig(path, metadata={"Title": panel_title(panel, records)})
        plt.close(fig)
        written.append(path)
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), dpi=100, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, records, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{storage.basename(run_dir)}: steps {records[0]['step']}-{records[-1]['step']}",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, OVERVIEW)
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written
