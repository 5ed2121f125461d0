#!/usr/bin/env python
"""Core benchmark: the cost of checkpointing {model, optim, step} at EVERY training step, four ways, in one run.

A thin wrapper: the benchmark lives in the package (``lazyckpt bench``, src/lazyckpt/cli/bench.py) so that
users can run it on their own machine. Same options as before, plus --plot FILE.png and --no-progress.

Usage:  python benchmarks/bench_core.py --size 100m [--steps 8] [--rounds 3] [--out-dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from lazyckpt.cli import bench
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lazyckpt.cli import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
