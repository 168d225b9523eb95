"""The standard W&B workspace of a project: the panels of :data:`tessera.train.report.panels.PANELS` (loss,
learning rate, MFU, iteration time, bubble ratio, bubble fill rate, exposed all-to-all, plan
version, profile drift), plus the dynamic bubble optimizer's (``DBO_PANELS``) and the autopilot's
(``AUTOPILOT_PANELS``), as line plots
against the step: the panels ``tessera report`` draws (the workspace is made before any run, so
its MFU panel is titled plainly; a CPU run's MFU is nominal, :mod:`tessera.train.report.panels`).

Needs the optional extra ``dashboards`` (``pip install 'tessera[dashboards]'``: the
``wandb-workspaces`` library) and W&B credentials (``wandb login``)::

    python -m tessera.train.report.dashboards --entity ENTITY [--project tessera] [--name tessera]

Offline (no credentials, or ``WANDB_MODE=offline``/``disabled``) it prints one line pointing to
``tessera report RUN_DIR``, which renders the same panels as PNG files, and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tessera.train.report.panels import AUTOPILOT_PANELS, DBO_PANELS, PANELS

OFFLINE = ("tessera dashboards: W&B is offline (no credentials from `wandb login`, or WANDB_MODE=offline); "
           "render the same panels as PNG files with `tessera report RUN_DIR`")


def build_workspace(entity: str, project: str, name: str = "tessera"):
    """The workspace object (nothing is sent): section ``training`` with one line plot per
    :data:`~tessera.train.report.panels.PANELS` entry (``y`` = its metric key, ``x`` = ``Step``) and
    section ``dynamic bubble optimizer`` with one per :data:`~tessera.train.report.panels.DBO_PANELS`
    and section ``autopilot`` with one per :data:`~tessera.train.report.panels.AUTOPILOT_PANELS`.

    Raises:
        ImportError: ``wandb-workspaces`` is not installed (install the ``dashboards`` extra).
    """
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def plots(panels):  # W&B plots the logged value: ratios stay ratios (the PNGs show %)
        return [wr.LinePlot(title=p.title, x="Step", y=[p.key], title_x="step",
                            title_y="ratio" if p.scale == 100.0 else p.unit) for p in panels]

    return ws.Workspace(name=name, entity=entity, project=project, sections=[
        ws.Section(name="training", is_open=True, panels=plots(PANELS)),
        ws.Section(name="dynamic bubble optimizer", is_open=True, panels=plots(DBO_PANELS)),
        ws.Section(name="autopilot", is_open=True, panels=plots(AUTOPILOT_PANELS)),
    ])


def online() -> bool:
    """Whether W&B can be used: credentials configured (no prompt, no network check) and
    ``WANDB_MODE`` not ``offline``/``disabled``."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return False
    import wandb

    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # noqa: BLE001 - any credential problem means offline
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Create the workspace and print its URL (0); offline, print :data:`OFFLINE` (2)."""
    p = argparse.ArgumentParser(prog="python -m tessera.train.report.dashboards", description=__doc__.split("\n\n")[0])
    p.add_argument("--entity", required=True, help="W&B entity (user or team) that owns the project")
    p.add_argument("--project", default="tessera", help="W&B project (logging.wandb_project; default tessera)")
    p.add_argument("--name", default="tessera", help="workspace (view) name")
    args = p.parse_args(argv)
    try:
        workspace = build_workspace(args.entity, args.project, args.name)
    except ImportError:
        print("tessera dashboards: wandb-workspaces is not installed; pip install 'tessera[dashboards]'",
              file=sys.stderr)
        return 2
    if not online():
        print(OFFLINE, file=sys.stderr)
        return 2
    print(workspace.save().url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
