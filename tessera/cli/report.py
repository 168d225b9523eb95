"""``tessera report RUN_DIR [--out DIR]``: the run's standard panels (loss, learning rate, MFU,
iteration time, bubble ratio, bubble fill rate, exposed all-to-all, plan version, profile drift,
the bubble optimizer's) as PNG files from its ``metrics.jsonl`` (:mod:`tessera.train.report.panels`;
MFU of a CPU run is titled nominal: its peak is a start-up benchmark), the offline form of the W&B
workspace. Prints the files written; a missing or malformed ``metrics.jsonl`` is one line on
stderr and exit code 2."""

from __future__ import annotations

import argparse

from tessera.cli.common import EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `tessera train` (holds metrics.jsonl; "
                                                      "local, or s3:// / gs:// on object storage)")
    p.add_argument("--out", default=None, help="where the PNG files go (default: RUN_DIR/report; for a run on object "
                                               "storage, report/ in its local stand-in under ~/.cache/tessera)")


def run(args: argparse.Namespace) -> int:
    from tessera.train.report.panels import render

    for path in render(args.run_dir, args.out):
        print(path)
    return EXIT_OK
