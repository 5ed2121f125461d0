"""Reading a file once, in parallel, computing the CRC32 of byte ranges as the bytes go by
(``read_with_crcs``; pieces read by a thread pool, joined with ``crc32_combine`` in file order).

``FileIdentity`` ties a verification to the file it read: ``lazyckpt.load()`` skips a second CRC
pass only when the file it opened has the identity ``lazyckpt.latest()`` verified.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lazyckpt.core.plan import usable_cpus
from lazyckpt.formats.crc import crc32, crc32_combine
from lazyckpt.storage import fs as _fs

READ_THREADS = 8  # more readers than cores: a disk serves several requests at once
PIECE_BYTES = 32 << 20
CHUNK_BYTES = 4 << 20

ReadInto = Callable[[memoryview, int], None]  # fill the whole view with the bytes at that offset


@dataclass(frozen=True)
class FileIdentity:
    """Device, inode, size, mtime and ctime of a file; equal identities mean the same, unchanged file."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileIdentity:
        return cls._of(os.fstat(fd))

    @classmethod
    def at(cls, path: str) -> FileIdentity:
        """The identity of the file at ``path`` now (``OSError`` when there is none)."""
        return cls._of(os.stat(path))

    @classmethod
    def _of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fd_path(fd: int, path: str) -> str:
    """A name that opens the very file behind ``fd`` (``/proc/self/fd/<fd>``), else ``path``."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


def readers(path: str, threads: int) -> int:
    """How many threads read ``path``: ``threads``, capped at the usable CPUs on a memory
    filesystem (where a read is a CPU-bound copy)."""
    threads = max(1, threads)
    if _fs.is_memory_filesystem(os.path.dirname(os.path.abspath(path))):
        return min(threads, usable_cpus())
    return threads


def read_with_crcs(
    read_into: ReadInto,
    size: int,
    ranges: Sequence[tuple[int, int]],
    *,
    threads: int = READ_THREADS,
    piece: int = PIECE_BYTES,
    chunk: int = CHUNK_BYTES,
    into: memoryview | None = None,
) -> list[int]:
    """Read bytes ``[0, size)`` (into ``into`` when given, else per-thread scratch buffers) and
    return the CRC32 of each ``(start, stop)`` range. The first read error is raised."""
    piece = max(1, piece)
    chunk = max(1, min(chunk, piece))
    starts = list(range(0, size, piece))
    scratch = threading.local()

    def task(start: int) -> list[tuple[int, int, int]]:
        stop = min(size, start + piece)
        mine = [i for i, (a, b) in enumerate(ranges) if a < stop and b > start and b > a]
        crcs = dict.fromkeys(mine, 0)
        for at in range(start, stop, chunk):
            end = min(stop, at + chunk)
            if into is not None:
                view = into[at:end]
            else:
                if getattr(scratch, "buf", None) is None:
                    scratch.buf = memoryview(bytearray(min(chunk, size)))
                view = scratch.buf[: end - at]
            read_into(view, at)
            for i in mine:
                a, b = ranges[i]
                if a < end and b > at:
                    crcs[i] = crc32(view[max(a, at) - at : min(b, end) - at], crcs[i])
        # (range index, bytes of the range in this piece, their CRC), for crc32_combine
        return [(i, min(stop, ranges[i][1]) - max(start, ranges[i][0]), crcs[i]) for i in mine]

    workers = min(max(1, threads), max(1, len(starts)))
    if workers == 1:
        parts = [task(s) for s in starts]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazyckpt-read") as ex:
            parts = list(ex.map(task, starts))  # in file order
    out = [0] * len(ranges)
    for piece_parts in parts:
        for i, nbytes, value in piece_parts:
            out[i] = crc32_combine(out[i], value, nbytes)
    return out
