"""``tessera rollback --job JOB [--to VERSION]``: switch a running job back to an earlier plan
version (:mod:`tessera.train.job.client`).

Versions form a history, numbered from 0 (the plan the job started with); each accepted upgrade
*replaced* the version that was current then (the newest accepted one, running or pending).
``tessera rollback`` re-applies the version the current one replaced (the nearest one back
whose plan or bubble optimizer differs), as a new version of source ``rollback``, through the
same checks as an upgrade. Rollbacks in a row walk back one version each (v3 -> v2 -> v1 -> v0),
never back and forth; ``--to VERSION`` switches to that version (any version the job has had);
an upgrade after rollbacks continues from where they led, and a later rollback returns there.

Prints one line, ``tessera rollback: RUN: plan version V takes effect at step S (rollback to
vN)`` (or ``no change: plan equals running version N`` for a ``--to`` the current version already
runs); a refusal (nothing to go back to, no such version, ...) is one line on stderr and exit
code 2."""

from __future__ import annotations

import argparse

from tessera.cli.common import EXIT_OK
from tessera.cli.status import add_job_arguments, driver_client
from tessera.cli.upgrade import done_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``tessera rollback``."""
    add_job_arguments(p)
    p.epilog = ("Versions form a history (0: the job's first plan); each upgrade replaced the version current then "
                "(the newest accepted). A rollback re-applies the version the current one replaced, as a new version, "
                "so rollbacks in a row walk back one version each (v2 -> v1 -> v0), never back and forth; --to "
                "VERSION goes to any version; an upgrade after rollbacks continues from where they led. tessera "
                "status --json lists the path back (lineage).")
    p.add_argument("--to", type=int, metavar="VERSION",
                   help="switch to this plan version (tessera status lists them); default: the version the current "
                        "one replaced, so that rollbacks in a row walk back one version each")


def run(args: argparse.Namespace) -> int:
    with driver_client(args) as client:
        answer = client.rollback(args.to)
    what = f"rollback to v{answer['rollback_of']}" if "rollback_of" in answer else "rollback"
    print(done_line("rollback", client.ref.run, answer, what))
    return EXIT_OK
