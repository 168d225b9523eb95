"""Rich consoles and tables for tessera's command-line output: numbers and paths are never elided.

Rich sizes its output to the terminal; when stdout is not a terminal (a log file, ``ray job logs``,
CI, a pipe) it falls back to ``COLUMNS`` or 80 columns and wraps or elides (``…``) whatever does
not fit. :func:`console` gives a console that, off a terminal, is so wide that every table is as
wide as its content (one full row per line, nothing wrapped or elided); on a terminal it is rich's
usual console. :func:`fold` makes a table's columns fold overlong cells onto the next line instead
of eliding them, which matters on a narrow terminal. :func:`print_tables` does both::

    from tessera.cli.console import print_tables
    print_tables(table)               # stdout; print_tables(table, stderr=True) for stderr

:func:`nominal_cost_note` is the caveat the ``simulate`` and ``plan`` tables show for the nominal
``cpu`` hardware preset.
"""

from __future__ import annotations

import sys

from rich.console import Console, RenderableType
from rich.table import Table

from tessera.spec.hardware import HardwareSpec

OFF_TERMINAL_WIDTH = 100_000
"""Console width, in columns, when the stream is not a terminal: wider than any row tessera prints.
Tables are only as wide as their content, so this only removes the 80-column limit."""

NOMINAL_PRESETS = ("cpu",)
"""Hardware presets whose numbers are placeholders (see :mod:`tessera.spec.hardware_presets`)."""


def _isatty(stderr: bool) -> bool:
    stream = sys.stderr if stderr else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def console(stderr: bool = False) -> Console:
    """A rich Console for stdout (or stderr) that never elides: off a terminal it is
    :data:`OFF_TERMINAL_WIDTH` columns wide with soft wrapping (plain full rows, whatever
    ``COLUMNS`` says); on a terminal, rich's usual console (terminal width).

    Whether the stream is a terminal is decided by its ``isatty()``, not by ``FORCE_COLOR`` (CI
    logs that force colour still get full rows). Colours follow rich's own rules.
    """
    if _isatty(stderr):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=OFF_TERMINAL_WIDTH, soft_wrap=True)


def fold(table: Table) -> Table:
    """Set ``overflow="fold"`` on every column of ``table`` (an overlong number or path continues
    on the next line instead of being cut to ``…``); returns the same table."""
    for column in table.columns:
        column.overflow = "fold"
    return table


def print_tables(*renderables: RenderableType, stderr: bool = False) -> None:
    """Print ``renderables`` on :func:`console` (stdout, or stderr), folding the columns of every
    :class:`~rich.table.Table` among them (:func:`fold`)."""
    out = console(stderr)
    for r in renderables:
        out.print(fold(r) if isinstance(r, Table) else r)


def nominal_cost_note(hw: HardwareSpec, cost_source: str = "analytic") -> tuple[str, ...]:
    """The caveat, as a few short lines, for a hardware preset with placeholder numbers (``cpu``)
    under the analytic cost source; ``()`` for any other preset, or when the costs are measured
    (``cost_source`` ``profile`` or ``trace``).

    The text names the preset's peak (TFLOP/s), memory bandwidth (TB/s) and host link (GB/s), so it
    stays true when ``hardware.inline`` overrides them.
    """
    if hw.name not in NOMINAL_PRESETS or cost_source != "analytic":
        return ()
    return (f"{hw.name} costs are nominal: the analytic roofline on the preset's placeholder numbers",
            f"({hw.peak_tflops:g} TFLOP/s peak, {hw.mem_bw_tbs:g} TB/s memory, {hw.intra_node_gbs:g} GB/s between "
            f"processes; not measured, no datasheet),",
            "so the iteration time and MFU are not a prediction of this machine's;",
            "for measured costs run `tessera profile RECIPE`,", "then plan with planner.cost_source=profile")
