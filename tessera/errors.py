"""One error type for bad input, printed as one line by the CLI (exit code 2)."""

from __future__ import annotations


class TesseraConfigError(ValueError):
    """Bad user input: a recipe field, an override or a plan that cannot work.

    The message always names the field, the offending value, the rule it breaks and a fix,
    so that ``str(err)`` is a complete one-line diagnosis.

    Args:
        field: dotted recipe path, e.g. ``"parallel.pp"``.
        value: the offending value (rendered with ``repr``).
        rule: the rule that is broken, e.g. ``"must divide model.num_layers=48"``.
        fix: what the user can do, e.g. ``"use pp=4, 6, 8, 12, ..."``.
    """

    def __init__(self, field: str, value: object, rule: str, fix: str):
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        super().__init__(f"{field}={value!r}: {rule}; fix: {fix}")

    def __reduce__(self):  # picklable, so Ray can carry it across processes
        return (type(self), (self.field, self.value, self.rule, self.fix))


class ProgramError(ValueError):
    """A Program failed validation; the message names the rank and instruction index."""

    def __init__(self, rank: int, index: int | None, message: str):
        self.rank, self.index = rank, index
        self.message = message
        where = f"rank {rank}" + (f", instruction {index}" if index is not None else "")
        super().__init__(f"{where}: {message}")

    def __reduce__(self):
        return (type(self), (self.rank, self.index, self.message))


class UpgradeRefused(TesseraConfigError):
    """The driver refused a plan upgrade (``tessera upgrade`` / ``tessera rollback``): the running
    job is untouched. Same fields and one-line message as :class:`TesseraConfigError`; ``field``
    names the part of the request at fault (e.g. ``"plan.partition"``, ``"plan.pp"``, ``"rollback"``)."""
