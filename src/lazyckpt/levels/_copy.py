"""Feeding a slower level from a faster level's committed file, and the memory statement.

``copy_file`` is the local promotion: the committed source file is read through one open
descriptor (retention cannot take it away meanwhile: it is pinned, and an unlinked inode stays
readable anyway) into a temporary name in the destination folder, fsynced, renamed over the
final name, and the folder fsynced: the single-level save's commit protocol, through ``lazyckpt.storage.fs``
so fault injection reaches it. A failure unlinks the temporary file; the final name never holds
a partial file.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from lazyckpt.storage import fs as _fs

from ._level import Level, MemoryLevelWarning

COPY_CHUNK = 16 << 20
MEMORY_FRACTION = 0.5  # a memory level may hold up to this fraction of MemTotal before a warning


def copy_file(src: str, dst: str, fsync: bool) -> None:
    """Copy the committed file ``src`` to ``dst`` atomically (see the module docstring)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = _fs.temporary_path(dst)
    fd_in = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd_in).st_size
        fd = _fs.open_temporary(tmp, size)  # reserves the space: a full disk fails here
        try:
            _copy_data(fd_in, fd, size)
            if fsync:
                _fs.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _fs.close(fd)
        _fs.commit(tmp, dst, fsync)
    except BaseException:
        _fs.discard(tmp)
        raise
    finally:
        os.close(fd_in)


def _copy_data(fd_in: int, fd_out: int, size: int) -> None:
    buf = bytearray(min(COPY_CHUNK, max(size, 1)))
    view = memoryview(buf)
    offset = 0
    while offset < size:
        got = os.preadv(fd_in, [view[: min(len(buf), size - offset)]], offset)
        if got <= 0:
            raise OSError(5, f"source ended at byte {offset} of {size} while copying it")
        _fs.pwrite_all(fd_out, view[:got], offset)
        offset += got


def memory_total() -> int:
    """MemTotal in bytes (physical pages when /proc/meminfo is not there)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in ``obj`` (dicts, lists, tuples, objects' __dict__):
    the checkpoint's size to within its pickle and headers."""
    seen: set[tuple[str, int]] = set()
    total = 0
    stack, visited = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and id(item) not in visited and not isinstance(item, type):
            visited.add(id(item))
            stack.extend(vars(item).values())
    return total


def check_memory(levels: tuple[Level, ...], size: int) -> None:
    """First save: the memory levels (tmpfs) hold ``keep`` checkpoints plus the files pinned by
    slower levels' backlogs; warn with the numbers when that exceeds MEMORY_FRACTION of RAM."""
    total = memory_total()
    held, unbounded = 0, []
    for i, level in enumerate(levels):
        if level.is_url or not _fs.is_memory_filesystem(level.path):
            continue
        if level.keep is None:
            unbounded.append(level.path)
            continue
        held += (level.keep + sum(lv.backlog for lv in levels[i + 1 :])) * size
    limit = MEMORY_FRACTION * total
    if unbounded:
        warnings.warn(
            f"lazyckpt: memory level(s) {', '.join(unbounded)} keep every checkpoint (keep=None), "
            f"{size / 1e9:.2f} GB each, in RAM ({total / 1e9:.1f} GB); give them a keep",
            MemoryLevelWarning,
            stacklevel=5,
        )
    if held > limit:
        warnings.warn(
            f"lazyckpt: the memory levels may hold {held / 1e9:.2f} GB ({size / 1e9:.2f} GB per checkpoint x "
            f"keep plus the slower levels' backlogs), more than {MEMORY_FRACTION:.0%} of RAM "
            f"({total / 1e9:.1f} GB). Lower keep or backlog.",
            MemoryLevelWarning,
            stacklevel=5,
        )
