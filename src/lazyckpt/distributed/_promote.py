"""One rank's part of a slower level's copy of a step: its own file, read from the fastest level's
committed folder (never the training tensors, never on the training thread), CRC-checked against
the CRC recorded when it was written, then copied into the level's staging folder or uploaded.
Failures raise ``OSError`` / ``UploadError``; the caller reports them (``_levels.py``)."""

from __future__ import annotations

import errno
import os
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo

from lazyckpt.formats.crc import crc32
from lazyckpt.storage import fs as _fs

CHUNK = 16 << 20


def copy_checked(src: str, staging: str, name: str, expected_crc: int | None, fsync: bool) -> None:
    """``src`` to ``<staging>/<name>`` (a new file), CRC-checked, fsynced (``fsync``)."""
    os.makedirs(staging, exist_ok=True)
    dst = os.path.join(staging, name)
    fd_in = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd_in).st_size
        fd = _fs.open_temporary(dst, size)  # reserves the space: a full disk fails here
        try:
            crc = _copy(fd_in, fd, size)
            _check(src, crc, expected_crc)
            if fsync:
                _fs.fsync(fd)
        except BaseException:
            os.close(fd)
            _fs.discard(dst)
            raise
        _fs.close(fd)
    finally:
        os.close(fd_in)


def check_file(src: str, expected_crc: int | None) -> None:
    """Read ``src`` once and compare its CRC32 (before it is uploaded)."""
    if expected_crc is None:
        return
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        crc, offset, buf = 0, 0, bytearray(CHUNK)
        view = memoryview(buf)
        while got := os.preadv(fd, [view], offset):
            crc = crc32(view[:got], crc)
            offset += got
    finally:
        os.close(fd)
    _check(src, crc, expected_crc)


def renamed(storage: dict[Any, Any], name: str) -> dict[Any, Any]:
    """This rank's storage data with its file called ``name`` (same offsets: the same bytes)."""
    return {index: _StorageInfo(name, info.offset, info.length) for index, info in storage.items()}


def _copy(fd_in: int, fd_out: int, size: int) -> int:
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    offset, crc = 0, 0
    while offset < size:
        got = os.preadv(fd_in, [view[: min(len(buf), size - offset)]], offset)
        if got <= 0:
            raise OSError(errno.EIO, f"source ended at byte {offset} of {size} while copying it")
        crc = crc32(view[:got], crc)
        _fs.pwrite_all(fd_out, view[:got], offset)
        offset += got
    return crc


def _check(src: str, crc: int, expected: int | None) -> None:
    if expected is not None and crc != expected:
        raise OSError(
            errno.EIO,
            f"{src} changed since it was written (CRC32 {crc:#010x}, written as {expected:#010x}): "
            "the faster level's copy is corrupt, so it is not copied on",
        )
