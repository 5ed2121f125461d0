"""``python -m lazyckpt``: the same command line as the ``lazyckpt`` console script."""

from __future__ import annotations

import sys

from lazyckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
