"""``python -m pdjax.router`` (``pdjax.router.cli.main``)."""

import sys

from pdjax.router.cli import main

if __name__ == "__main__":
    sys.exit(main())
