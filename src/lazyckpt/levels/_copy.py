"""Feeding a slower level from a faster level's committed file, and the memory statement.

``copy_file`` is the local promotion: the committed source file is read through one open
descriptor (retention cannot take it away meanwhile: it is pinned, and an unlinked inode stays
readable anyway) into a temporary name in the destination folder, fsynced, renamed over the
final name, and the folder fsynced: the single-level save's commit protocol, through ``lazyckpt.storage.fs``
so fault injection reaches it. A failure unlinks the temporary file; the final name never holds
a partial file. ``copy_tree`` does the same for a folder checkpoint: every file into a hidden
temporary folder beside the destination, each fsynced, then one rename of the folder.
``upload_folder`` feeds a URL level from a folder: every file, then the manifest last
(``commit/remote_folder.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import tempfile
import traceback
import warnings
from collections.abc import Generator
from typing import Any

import torch

from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.commit.folder import MARKER_PREFIX
from lazyckpt.core.warn import user_stacklevel
from lazyckpt.storage import fs as _fs
from lazyckpt.storage.remote import RemoteTier

from ._level import Level, MemoryLevelWarning
from ._wire import replace_folder

logger = logging.getLogger(__name__)

COPY_CHUNK = 16 << 20
DIRECT_MIN = 16 << 20  # smaller files are copied buffered (as the engine's use_direct_io rule)
MEMORY_FRACTION = 0.5  # a memory level may hold up to this fraction of MemTotal before a warning


def copy_file(src: str, dst: str, fsync: bool) -> None:
    """Copy the committed file ``src`` to ``dst`` atomically (see the module docstring)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = _fs.temporary_path(dst)
    try:
        _write_copy(src, tmp, fsync)
        _fs.commit(tmp, dst, fsync)
    except BaseException:
        _fs.discard(tmp)
        raise


def _write_copy(src: str, new: str, fsync: bool) -> None:
    """Create ``new`` (it must not exist) with the bytes of ``src``, fsynced (``fsync``)."""
    fd_in = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd_in).st_size
        fd = _fs.open_temporary(new, size)  # reserves the space: a full disk fails here
        try:
            _copy_data(fd_in, fd, size, new)
            if fsync:
                _fs.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _fs.close(fd)
    finally:
        os.close(fd_in)


def copy_tree(src: str, dst: str, fsync: bool) -> None:
    """Copy the complete folder ``src`` to ``dst`` atomically: its files and subfolders (pending
    markers and lazyckpt temporaries left out) into a hidden temporary folder beside ``dst``, every
    file and folder fsynced, then renamed to ``dst`` and the parent fsynced. A ``dst`` already
    there (the same step saved again) is renamed away first and deleted after. On failure the
    temporary folder is removed (a killed process's is removed by ``cleanup_temporaries``, as the
    levels do when they open) and ``dst`` is what it was."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = _fs.temporary_path(dst)
    os.mkdir(tmp)
    try:
        for root, dirs, names in os.walk(src):
            out = os.path.normpath(os.path.join(tmp, os.path.relpath(root, src)))
            dirs[:] = sorted(d for d in dirs if not _is_protocol_file(d))
            for d in dirs:
                os.mkdir(os.path.join(out, d))
            for name in sorted(n for n in names if not _is_protocol_file(n)):
                _write_copy(os.path.join(root, name), os.path.join(out, name), fsync)
            if fsync and out != os.path.normpath(tmp):
                _fs.fsync_dir(out)
        replace_folder(tmp, dst, fsync)  # tmp fsynced there
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_protocol_file(name: str) -> bool:
    """A pending marker, a lazyckpt temporary, or a distributed save's staging folder: never copied."""
    return name.startswith(MARKER_PREFIX) or (name.startswith(".") and name.endswith(".tmp") and ".lazyckpt-" in name)


def upload_folder(tier: RemoteTier, src: str, url: str) -> None:
    """Upload the complete folder ``src`` to the prefix ``url``: every file, the manifest last (its
    local copy in a scratch folder: ``src`` is a level's checkpoint and stays untouched).
    ``UploadError`` on failure, with nothing left that reads as a checkpoint at ``url``."""
    with tempfile.TemporaryDirectory(prefix="lazyckpt-manifest-") as scratch:
        _remote_folder.upload_folder(tier, src, url, scratch=scratch)


def _copy_data(fd_in: int, fd_out: int, size: int, new: str) -> None:
    """The bytes of ``fd_in`` into ``fd_out`` (the file ``new``), written straight from a read-only
    mapping of the source, ``COPY_CHUNK`` at a time (``_source_chunks``): no bounce buffer, so the
    source's bytes cross the memory bus once (the kernel or the device reads them for the write),
    not three times (read, written into a buffer, read again). A 1.17 GB tmpfs file to ext4 with
    O_DIRECT: 0.07 CPU s and 0.61-0.71 s, against 0.25-0.32 CPU s and 0.73-1.08 s through a bounce
    buffer (4 rounds); MAP_POPULATE measured no better (0.08 CPU s). Whole pages go
    through a second, O_DIRECT descriptor where the destination takes one (not tmpfs) and the copy
    is big: a buffered copy of the same file cost the copying process 1.5-3.1 CPU s here (the page
    cache's copy and its writeback); the CPU is what a copy in the background takes from the
    training. The last partial page is written buffered (the file's fsync covers both)."""
    dfd = _fs.open_direct(new) if size >= DIRECT_MIN else -1
    try:
        with contextlib.closing(_source_chunks(fd_in, size)) as chunks:
            try:
                for offset, view in chunks:
                    n = len(view)
                    whole = n - n % mmap.PAGESIZE if dfd >= 0 else 0
                    if whole:
                        try:
                            _fs.pwrite_all(dfd, view[:whole], offset)
                        except OSError as exc:
                            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem refuses O_DIRECT here
                                raise
                            os.close(dfd)
                            dfd, whole = -1, 0
                    if whole < n:
                        _fs.pwrite_all(fd_out, view[whole:n], offset + whole)
            except BaseException as exc:
                # the failed write's frames (kept by the traceback) hold views of the chunk: cleared,
                # so that the chunk's mapping can close and this error is the one that propagates
                traceback.clear_frames(exc.__traceback__)
                raise
    finally:
        if dfd >= 0:
            os.close(dfd)


def _source_chunks(fd_in: int, size: int) -> Generator[tuple[int, memoryview], None, None]:
    """``(offset, view)`` for each ``COPY_CHUNK`` of the source ``fd_in``: a view of a read-only
    mapping of that chunk or, where the source cannot be mapped (ENODEV: some FUSE and network
    filesystems), of a page-aligned buffer it was read into. A view is released, and its mapping
    closed, when the next one is asked for or the generator is closed. Only the kernel reads a
    mapping (inside the consumer's ``pwrite``): a source cut short under the copy fails that write
    (EFAULT), never the process (SIGBUS)."""
    buf: mmap.mmap | None = None
    mapped, offset = True, 0
    try:
        while offset < size:
            n = min(COPY_CHUNK, size - offset)
            chunk: mmap.mmap | None = None
            if mapped:
                try:
                    chunk = mmap.mmap(fd_in, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
                except OSError as exc:
                    logger.debug("lazyckpt: the copy's source cannot be mapped (%s): read through a buffer", exc)
                    mapped = False
            if chunk is not None:
                view = memoryview(chunk)
            else:
                if buf is None:
                    buf = mmap.mmap(-1, min(COPY_CHUNK, size))  # page-aligned, as O_DIRECT needs
                view = memoryview(buf)[:n]
                got = os.preadv(fd_in, [view], offset)
                if got != n:
                    view.release()
                    raise OSError(errno.EIO, f"source ended at byte {offset + max(got, 0)} of {size} while copying it")
            try:
                yield offset, view
            finally:
                view.release()
                if chunk is not None:
                    chunk.close()
            offset += n
    finally:
        if buf is not None:
            buf.close()


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
    slower levels' backlogs (a level with ``replicas=k``: also ``k x keep`` of its peers' and up to
    its ``backlog`` of its own still open for sending); warn with the numbers when that exceeds
    MEMORY_FRACTION of RAM."""
    total = memory_total()
    held, unbounded, parts = 0, [], []
    for i, level in enumerate(levels):
        if level.is_url or not _fs.is_memory_filesystem(level.path):
            continue
        if level.keep is None:
            unbounded.append(f"level {i} ({level.path})")
            continue
        backlogs = sum(lv.backlog for lv in levels[i + 1 :])
        k = int(getattr(level, "replicas", 0))  # peers' steps held here: k x keep, + their files in flight
        held += (level.keep * (1 + k) + backlogs + (level.backlog if k else 0)) * size
        parts.append(f"level {i} ({level.path}): keep={level.keep}" + (f" x (1 + {k} replicas)" if k else "")
                     + f" + {backlogs + (level.backlog if k else 0)} backlog")  # fmt: skip
    limit = MEMORY_FRACTION * total
    if unbounded:
        warnings.warn(
            f"lazyckpt: memory {', '.join(unbounded)} keep every checkpoint (keep=None), "
            f"{_size(size)} each, in RAM ({_size(total)}); give them a keep",
            MemoryLevelWarning,
            stacklevel=user_stacklevel(),
        )
    if held > limit:
        warnings.warn(
            f"lazyckpt: the memory levels may hold {_size(held)} ({'; '.join(parts)} checkpoints of "
            f"{_size(size)}), more than {MEMORY_FRACTION:.0%} of RAM ({_size(total)}). Lower keep or backlog.",
            MemoryLevelWarning,
            stacklevel=user_stacklevel(),
        )


def _size(n: float) -> str:
    """``1.17 GB``, ``20.5 MB``, ``4.1 kB``: enough digits to be read at any size."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
