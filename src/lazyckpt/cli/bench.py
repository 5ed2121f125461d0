"""``lazyckpt bench ARGS``: run the repository's core benchmark (``python -m benchmarks.bench_core ARGS``).

The benchmark is not in the installed package: it runs from the checkout lazyckpt is installed from
(``pip install -e .``) or the current directory, with every argument passed through
(``lazyckpt bench --help`` shows its options).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MODULE = "benchmarks.bench_core"
HOW_TO_GET_IT = (
    "the benchmark is not part of the installed package; it lives in the repository's benchmarks/ folder.\n"
    "  git clone <the lazyckpt repository> && cd lazyckpt && pip install -e .\n"
    "  python -m benchmarks.bench_core --size 100m      # or `lazyckpt bench --size 100m` from that folder"
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure the training stall per checkpoint (runs the repository's benchmarks/bench_core.py)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help goes to the benchmark itself
    )
    p.set_defaults(run=run, passthrough=True)  # main() hands every further argument to the benchmark


def repository_root() -> Path | None:
    """The checkout whose ``benchmarks/bench_core.py`` to run: the one lazyckpt is installed from, or the cwd."""
    import lazyckpt

    here = Path(lazyckpt.__file__).resolve().parents[2]  # <root>/src/lazyckpt/__init__.py in a checkout
    for root in (here, Path.cwd()):
        if (root / "benchmarks" / "bench_core.py").is_file():
            return root
    return None


def run(args: argparse.Namespace) -> int:
    root = repository_root()
    if root is None:
        print(f"lazyckpt bench: {HOW_TO_GET_IT}", file=sys.stderr)
        return 1
    # the checkout goes on the child's path; the cwd stays, so relative output paths keep their meaning
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", MODULE, *args.extra], env=env)
