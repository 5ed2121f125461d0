"""``lazyckpt bench ARGS``: run the repository's core benchmark (``python -m benchmarks.bench_core ARGS``).

The benchmark harness and its GPT model are not part of the installed package: they live in the
``benchmarks/`` folder of a clone of the repository. This command finds that folder (the checkout
lazyckpt is installed from with ``pip install -e .``, or the current directory) and runs the
benchmark there with this Python, passing every argument through (``lazyckpt bench --help`` shows
its options). Without a checkout it says how to get one.
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
    # The checkout's root goes on the child's path (it is not a package of this installation); the
    # working directory stays, so relative --out-dir/--json/--plot paths mean what the user meant.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", MODULE, *args.extra], env=env)
