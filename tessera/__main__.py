"""``python -m tessera``: the same command line as the ``tessera`` console script."""

import sys

from tessera.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
