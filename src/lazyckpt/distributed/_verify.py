"""verify_checkpoint(): is this distributed checkpoint folder intact? Never unpickles anything.

The manifest lazyckpt writes beside ``.metadata`` names every data file with its size and the CRC32
of its bytes, the size and CRC32 of ``.metadata`` itself, and every item's (file, offset, length):
so every file the metadata names is checked, and the metadata is the one the manifest describes.
"""

from __future__ import annotations

import json
import mmap
import os

from .._crc import crc32
from .._verify import VerifyReport
from ._commit import MANIFEST, METADATA

_BLOCK = 64 << 20


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Check a checkpoint folder written by ``DistributedCheckpointer``; ``report.ok`` tells.

    ``report.format`` is ``"dcp"``; ``report.records`` counts the items checked; ``report.size``
    is the folder's data bytes.
    """
    root = os.fspath(path)
    report = VerifyReport(root, "dcp", 0)
    try:
        with open(os.path.join(root, MANIFEST), "rb") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        report.problems.append(f"no {MANIFEST}: not written by lazyckpt (or not committed)")
        return report
    except (OSError, ValueError) as exc:
        report.problems.append(f"{MANIFEST} unreadable: {exc}")
        return report
    expected = dict(manifest.get("files", {}))
    expected[METADATA] = manifest.get(METADATA, {})
    for name, want in sorted(expected.items()):
        _check_file(os.path.join(root, name), name, want, report)
    sizes = {name: want.get("size", 0) for name, want in expected.items()}
    for rel, offset, length in manifest.get("items", []):
        report.records += 1
        if rel not in sizes:
            report.problems.append(f"item in {rel} at {offset}: file not in the manifest")
        elif offset + length > sizes[rel]:
            report.problems.append(f"item in {rel} at {offset}+{length} runs past the file's {sizes[rel]} bytes")
    return report


def _check_file(full: str, name: str, want: dict, report: VerifyReport) -> None:
    try:
        size = os.path.getsize(full)
    except OSError:
        report.problems.append(f"{name}: missing")
        return
    report.size += size
    if size != want.get("size"):
        report.problems.append(f"{name}: {size} bytes, expected {want.get('size')}")
        return
    if want.get("crc32") is None:
        return  # saved with crc=False
    if _file_crc(full, size) != want["crc32"]:
        report.problems.append(f"{name}: CRC32 mismatch (corrupted)")


def _file_crc(full: str, size: int) -> int:
    if size == 0:
        return 0
    crc = 0
    with open(full, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for start in range(0, size, _BLOCK):
            crc = crc32(mm[start : start + _BLOCK], crc)
    return crc
