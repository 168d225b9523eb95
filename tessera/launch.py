"""``python -m tessera.launch RECIPE [key=value ...]``: the entrypoint for ``ray job submit``, the
same code path as ``tessera train`` (:mod:`tessera.cli.train`; the job itself is
:mod:`tessera.train.job.run`)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tessera.launch``; bad input exits with code 2 and one line, a failed job with 1."""
    from tessera.cli.train import add_arguments, run

    parser = argparse.ArgumentParser(prog="python -m tessera.launch", description="Run a Tessera training job on Ray.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
