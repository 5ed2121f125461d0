"""verify_checkpoint(): is this distributed checkpoint folder (or URL prefix) intact? Never unpickles.

Checks every file against lazyckpt's manifest (sizes, CRC32s, item bounds; see ``formats/dcp.py``).
At a URL, a missing ``.metadata`` (uploaded last) means the checkpoint was never committed.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

from lazyckpt.core import remote as _remote
from lazyckpt.formats.crc import crc32
from lazyckpt.formats.dcp import MANIFEST, METADATA
from lazyckpt.recovery.verify import VerifyReport

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

    ``path`` may be a URL (``storage_options`` go to fsspec). Returns a ``VerifyReport`` whose
    ``format`` is ``"dcp"``, ``records`` the items checked and ``size`` the folder's data bytes.
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


def _folder(root: str, storage_options: dict[str, Any] | None) -> _LocalFolder | _RemoteFolder:
    return _RemoteFolder(root, storage_options) if _remote.is_url(root) else _LocalFolder(root)


def read_manifest(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of the DCP folder at ``path``; ``FileNotFoundError`` without one."""
    manifest = json.loads(_folder(os.fspath(path), storage_options).read(MANIFEST))
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} is not a JSON object")
    return manifest


def is_dcp_folder(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is a folder (or URL prefix) holding a ``lazyckpt.distributed`` manifest."""
    folder = _folder(os.fspath(path), storage_options)
    try:
        return folder.size(MANIFEST) is not None
    except OSError:  # not a folder, unreadable: not one
        return False


def partial_problem(manifest: dict[str, Any]) -> str | None:
    """Why a folder is no whole checkpoint by itself (a node-local copy of some ranks), or None."""
    if manifest.get("complete", True):
        return None
    ranks = sorted(int(r) for r in manifest.get("ranks", {}))
    return (
        f"holds the files of rank(s) {ranks} of {manifest.get('world_size')} only (a node-local copy): "
        "it serves those ranks when a job of the same layout calls lazyckpt.latest() on every rank"
    )


def rank_problems(
    path: str | os.PathLike[str],
    rank: int,
    world_size: int,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> list[str] | None:
    """Whether ``rank`` of a ``world_size`` job can load its own items from the DCP folder at
    ``path``: ``.metadata``, its files and the shared files present with their sizes (``verify``:
    and CRCs). ``[]`` when it can, the problems when not, None when the manifest has no per-rank
    list for this layout (use ``verify_checkpoint``)."""
    root = os.fspath(path)
    try:
        manifest = read_manifest(root, storage_options)
    except FileNotFoundError:
        return [f"no {MANIFEST}: not written by lazyckpt (or not committed)"]
    except (OSError, ValueError) as exc:
        return [f"{MANIFEST} unreadable: {exc}"]
    files = manifest.get("ranks", {}).get(str(rank))
    if manifest.get("world_size") != world_size or files is None:
        return None
    folder = _folder(root, storage_options)
    report = VerifyReport(root, "dcp", 0)
    if isinstance(folder, _RemoteFolder) and folder.size(METADATA) is None:
        return [f"no {METADATA}: not a committed checkpoint (a save in progress, or one that failed)"]
    expected = manifest.get("files", {})
    shared = sorted(name for name, want in expected.items() if want.get("rank") is None)  # extra files (meta.pt)
    for name in [METADATA, *files, *shared]:
        want = manifest.get(METADATA, {}) if name == METADATA else expected.get(name)
        if want is None:
            report.problems.append(f"{name}: not in the manifest's files")
        elif verify:
            _check_file(folder, name, want, report)
        elif (size := folder.size(name)) != want.get("size"):
            report.problems.append(f"{name}: missing" if size is None else f"{name}: {size} bytes")
    return report.problems


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
