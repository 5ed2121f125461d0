"""``lazyckpt verify PATH...``: are these checkpoints intact? Exit 0 when all are, 1 otherwise.

Files: every CRC32, the zip or safetensors layout, the pickle walked without running it. Directories
are searched recursively; folders are checked for unfinished lazyckpt saves, Accelerate folders for
every expected file, distributed checkpoint folders against their manifest (a ``*.distcp`` file
stands for its folder). URLs (any fsspec URL or prefix) are checked by ranged reads, never
downloaded; credentials come from the environment (``AWS_*``) or ``--storage-options JSON``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lazyckpt.recovery.check import Result, check

from ._format import dump_json, human_bytes


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check that checkpoint files / folders are intact (exit 0 ok, 1 damaged)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint file, Accelerate folder, or directory")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the failures and the summary")
    p.add_argument(
        "--storage-options", type=json.loads, default=None, metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'',
    )  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = getattr(args, "storage_options", None)
    results = [r for path in args.paths for r in check(path, options)]
    checked = [r for r in results if r.kind != "temporary"]
    failed = [r for r in checked if not r.ok]
    if args.json:
        doc = {"ok": not failed, "checked": len(checked), "failed": len(failed)}
        dump_json({**doc, "results": [r.to_json() for r in results]})
    else:
        for r in results:
            if not (args.quiet and r.ok):
                print(_line(r))
        summary = f"{len(checked) - len(failed)} of {len(checked)} OK" + (f", {len(failed)} FAILED" if failed else "")
        print(summary)
    return 1 if failed else 0


def _line(r: Result) -> str:
    status = "OK  " if r.ok else "FAIL"
    if r.kind == "temporary":
        status = "NOTE"
    details = [d for d in (r.format, human_bytes(r.size) if r.size is not None else "") if d]
    if r.records is not None:
        unit = {"accelerate-folder": "files", "folder": "files", "dcp-folder": "items"}.get(r.kind, "records")
        details.append(f"{r.records} {unit}")
    text = f"{status}  {r.path}" + (f"  ({', '.join(details)})" if details else "")
    messages = r.problems or r.notes
    return text + (": " + "; ".join(messages) if messages else "")
