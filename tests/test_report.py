"""``tessera report``'s input errors, the MFU title of a CPU run, and the W&B workspace object of
``tessera.train.report.dashboards`` (built offline, nothing sent). The rendering of real runs' records
is in tests/test_report_dbo.py (the bubble optimizer's panels) and tests/test_train_ray.py (loss,
learning rate and the nominal CPU MFU of a ``tessera train`` job)."""

from __future__ import annotations

import json

import pytest

from tessera.cli.main import main
from tessera.train.report import dashboards
from tessera.train.report.panels import AUTOPILOT_PANELS, CPU_MFU_TITLE, DBO_PANELS, PANELS, panel_title


def test_missing_metrics_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tessera train" in err
    assert f"metrics.jsonl='{tmp_path}/metrics.jsonl': no such file" in err


@pytest.mark.parametrize("bad, why", [('{"step": 2, "loss"', "not a JSON line"),
                                      ("[1, 2]", "a list, not a JSON object"), ('{"loss": 1.0}', "step=None")],
                         ids=["partial-line", "not-an-object", "no-step"])
def test_malformed_line_names_file_line_and_fix(tmp_path, capsys, bad, why):
    good = json.dumps({"step": 1, "mfu": 0.1})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start"}) + "\n" + good + "\n" + bad + "\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{tmp_path}/metrics.jsonl:3=" in err and why in err and "repair that line" in err
    assert not (tmp_path / "report").exists()


def test_run_without_iterations_is_an_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "no iteration records" in capsys.readouterr().err


def test_workspace_has_the_report_panels_with_their_metric_keys():
    pytest.importorskip("wandb_workspaces")
    w = dashboards.build_workspace("some-entity", "tessera")
    assert (w.entity, w.project) == ("some-entity", "tessera")
    assert [s.name for s in w.sections] == ["training", "dynamic bubble optimizer", "autopilot"]
    for section, panels in zip(w.sections, (PANELS, DBO_PANELS, AUTOPILOT_PANELS)):
        assert [(p.title, p.x, list(p.y)) for p in section.panels] == [(q.title, "Step", [q.key]) for q in panels]
    keys = [p.key for p in PANELS]
    assert keys == ["loss", "lr", "mfu", "iteration_ms", "bubble_ratio", "bubble_fill_rate", "exposed_a2a_ms",
                    "plan_version", "profile_drift"]


def test_offline_points_to_tessera_report(monkeypatch, capsys):
    pytest.importorskip("wandb_workspaces")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert dashboards.main(["--entity", "some-entity"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == dashboards.OFFLINE and "tessera report RUN_DIR" in err


def test_mfu_of_a_cpu_run_is_titled_nominal_with_its_measured_peak():
    mfu, loss = (next(p for p in PANELS if p.key == k) for k in ("mfu", "loss"))
    cpu = [{"step": 1, "mfu": 0.1, "device": "cpu", "peak_tflops": 0.0523},
           {"step": 2, "mfu": 0.1, "device": "cpu", "peak_tflops": 0.0611}]  # a restart measured again
    assert panel_title(mfu, cpu) == CPU_MFU_TITLE + "\n(52.3-61.1 GFLOP/s; compare steps, not runs)"
    assert panel_title(mfu, cpu[:1]) == CPU_MFU_TITLE + "\n(52.3 GFLOP/s; compare steps, not runs)"
    assert panel_title(mfu, [{"step": 1, "mfu": 0.4, "device": "cuda", "peak_tflops": 7912.0}]) == "MFU"
    assert panel_title(mfu, [{"step": 1, "mfu": 0.1}]) == "MFU"  # records that do not say where they ran
    assert panel_title(loss, cpu) == "loss"
