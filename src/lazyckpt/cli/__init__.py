"""The ``lazyckpt`` command line: ``verify``, ``inspect``, ``doctor``, ``bench``.

Each subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``. Exit codes: 0 ok,
1 a check failed or bad input, 2 bad usage, 130 interrupted. Output on stdout (``--json``: one JSON
document); diagnostics on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import bench, doctor, inspect, verify

__all__ = ["main"]

logger = logging.getLogger(__name__)

_COMMANDS = (verify, inspect, doctor, bench)


def build_parser() -> argparse.ArgumentParser:
    from lazyckpt import __version__

    parser = argparse.ArgumentParser(
        prog="lazyckpt",
        description="Check, inspect and benchmark checkpoints; diagnose the checkpointing environment.",
    )
    parser.add_argument("--version", action="version", version=f"lazyckpt {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _configure_logging(args.verbose)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("lazyckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lazyckpt inspect big.pt | head`
        sys.stderr.close()
        return 0


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The CLI's stderr handler (added once)."""


def _configure_logging(verbosity: int) -> None:
    """Log lazyckpt's records to stderr; the root logger is left alone."""
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    root = logging.getLogger("lazyckpt")
    if not any(isinstance(h, _CliHandler) for h in root.handlers):
        handler = _CliHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("lazyckpt: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level)
