"""verify_checkpoint(): is this distributed checkpoint folder intact? Never unpickles anything.

The manifest lazyckpt writes beside ``.metadata`` names every data file with its size and the CRC32
of its bytes, the size and CRC32 of ``.metadata`` itself, and every item's (file, offset, length):
so every file the metadata names is checked, and the metadata is the one the manifest describes.
A checkpoint at a URL (``s3://bucket/run/step-100``) is checked the same way, its objects read by
streaming (never to disk); there ``.metadata`` is what makes the prefix a checkpoint (it is
uploaded last), so its absence is the first problem named.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

from lazyckpt.formats.crc import crc32
from lazyckpt.formats.dcp import MANIFEST, METADATA
from lazyckpt.recovery.verify import VerifyReport
from lazyckpt.storage import remote as _remote

_BLOCK = 64 << 20
_URL_BLOCK = 8 << 20  # one ranged read per block


class _LocalFolder:
    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, name: str) -> bytes:
        with open(os.path.join(self.root, name), "rb") as fh:
            return fh.read()

    def size(self, name: str) -> int | None:
        try:
            return os.path.getsize(os.path.join(self.root, name))
        except OSError:
            return None

    def crc(self, name: str, size: int) -> int:
        if size == 0:
            return 0
        crc = 0
        with open(os.path.join(self.root, name), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for start in range(0, size, _BLOCK):
                crc = crc32(mm[start : start + _BLOCK], crc)
        return crc


class _RemoteFolder:
    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.fs, rpath = _remote.filesystem(url, storage_options)
        self.rpath = rpath.rstrip("/")
        self.fs.invalidate_cache(self.rpath)  # listings cached by this process may be stale

    def read(self, name: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(f"{self.rpath}/{name}"))
        except FileNotFoundError:
            raise
        except OSError as exc:  # s3fs: a missing key can surface as another OSError
            if not self.fs.exists(f"{self.rpath}/{name}"):
                raise FileNotFoundError(name) from exc
            raise

    def size(self, name: str) -> int | None:
        try:
            return int(self.fs.info(f"{self.rpath}/{name}")["size"])
        except FileNotFoundError:
            return None

    def crc(self, name: str, size: int) -> int:
        crc = 0
        with self.fs.open(f"{self.rpath}/{name}", "rb", block_size=_URL_BLOCK, cache_type="none") as fh:
            while data := fh.read(_URL_BLOCK):
                crc = crc32(data, crc)
        return crc


def verify_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Check a checkpoint folder written by ``DistributedCheckpointer``; ``report.ok`` tells.

    ``path`` may be a URL (``storage_options`` go to fsspec). ``report.format`` is ``"dcp"``;
    ``report.records`` counts the items checked; ``report.size`` is the folder's data bytes.
    """
    root = os.fspath(path)
    report = VerifyReport(root, "dcp", 0)
    folder: _LocalFolder | _RemoteFolder
    metadata_missing = False
    if _remote.is_url(root):
        folder = _RemoteFolder(root, storage_options)
        metadata_missing = folder.size(METADATA) is None
        if metadata_missing:
            report.problems.append(
                f"no {METADATA}: not a committed checkpoint (a save in progress, or one that failed)"
            )
    else:
        folder = _LocalFolder(root)
    try:
        manifest = json.loads(folder.read(MANIFEST))
    except FileNotFoundError:
        report.problems.append(f"no {MANIFEST}: not written by lazyckpt (or not committed)")
        return report
    except (OSError, ValueError) as exc:
        report.problems.append(f"{MANIFEST} unreadable: {exc}")
        return report
    expected = dict(manifest.get("files", {}))
    expected[METADATA] = manifest.get(METADATA, {})
    for name, want in sorted(expected.items()):
        if name == METADATA and metadata_missing:
            continue  # already said
        _check_file(folder, name, want, report)
    sizes = {name: want.get("size", 0) for name, want in expected.items()}
    for rel, offset, length in manifest.get("items", []):
        report.records += 1
        if rel not in sizes:
            report.problems.append(f"item in {rel} at {offset}: file not in the manifest")
        elif offset + length > sizes[rel]:
            report.problems.append(f"item in {rel} at {offset}+{length} runs past the file's {sizes[rel]} bytes")
    return report


def _check_file(folder: _LocalFolder | _RemoteFolder, name: str, want: dict, report: VerifyReport) -> None:
    size = folder.size(name)
    if size is None:
        report.problems.append(f"{name}: missing")
        return
    report.size += size
    if size != want.get("size"):
        report.problems.append(f"{name}: {size} bytes, expected {want.get('size')}")
        return
    if want.get("crc32") is None:
        return  # saved with crc=False
    if folder.crc(name, size) != want["crc32"]:
        report.problems.append(f"{name}: CRC32 mismatch (corrupted)")
