"""Reports of a run: the standard panels drawn from its ``metrics.jsonl``, and the same panels as a
W&B workspace.

:mod:`~tessera.train.report.panels` is ``tessera report RUN_DIR`` (PNG files with matplotlib);
:mod:`~tessera.train.report.dashboards` creates the W&B workspace (``python -m
tessera.train.report.dashboards``, extra ``dashboards``). It reads files only and imports nothing
else of :mod:`tessera.train`.
"""
