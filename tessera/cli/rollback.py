"""``tessera rollback --job JOB``: back to the plan version before the running one
(:mod:`tessera.train.job.client`). Prints one line, ``tessera rollback: RUN: plan version V takes
effect at step S (rollback)``; a refusal (nothing to go back to, ...) is one line on stderr and
exit code 2."""

from __future__ import annotations

import argparse

from tessera.cli.common import EXIT_OK
from tessera.cli.status import add_job_arguments, driver_client
from tessera.cli.upgrade import done_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera rollback``."""
    add_job_arguments(p)


def run(args: argparse.Namespace) -> int:
    with driver_client(args) as client:
        answer = client.rollback()
    print(done_line("rollback", client.ref.run, answer, "rollback"))
    return EXIT_OK
