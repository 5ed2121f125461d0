"""Feeding a slower level from a faster level's committed checkpoint (on the level threads), and
the memory check. Copies commit as single-level saves do, through ``lazyckpt.storage.fs`` (so fault
injection reaches them): a final name never holds a partial copy.
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
from lazyckpt.core.remote import RemoteTier
from lazyckpt.core.warn import user_stacklevel
from lazyckpt.formats.crc import crc32
from lazyckpt.levels import Level, MemoryLevelWarning
from lazyckpt.storage import fs as _fs

logger = logging.getLogger(__name__)

COPY_CHUNK = 16 << 20
DIRECT_MIN = 16 << 20  # smaller files are copied buffered (as the engine's use_direct_io rule)
MEMORY_FRACTION = 0.5  # a memory level may hold up to this fraction of MemTotal before a warning


def copy_file(src: str, dst: str, fsync: bool) -> None:
    """Copy the committed file ``src`` to ``dst`` atomically; a failure leaves no temporary file."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = _fs.temporary_path(dst)
    try:
        _write_copy(src, tmp, fsync)
        _fs.commit(tmp, dst, fsync)
    except BaseException:
        _fs.discard(tmp)
        raise


def copy_checked(src: str, staging: str, name: str, expected_crc: int | None, fsync: bool) -> None:
    """``src`` to the new file ``<staging>/<name>`` (``staging`` made if missing), fsynced with ``fsync``; with
    ``expected_crc``, the bytes read must have that CRC32 (``OSError`` EIO otherwise). A failure leaves no file."""
    os.makedirs(staging, exist_ok=True)
    dst = os.path.join(staging, name)
    try:
        _write_copy(src, dst, fsync, expected_crc)
    except BaseException:
        _fs.discard(dst)
        raise


def check_file(src: str, expected_crc: int | None) -> None:
    """Read ``src`` once and compare its CRC32 with ``expected_crc`` (``OSError`` EIO), e.g. before an upload."""
    if expected_crc is None:
        return
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        crc = 0
        with contextlib.closing(_source_chunks(fd, os.fstat(fd).st_size, mapped=False)) as chunks:
            for _, view in chunks:
                crc = crc32(view, crc)
    finally:
        os.close(fd)
    _check(src, crc, expected_crc)


def _check(src: str, crc: int, expected: int) -> None:
    if crc != expected:
        raise OSError(
            errno.EIO,
            f"{src} changed since it was written (CRC32 {crc:#010x}, written as {expected:#010x}): "
            "the faster level's copy is corrupt, so it is not copied on",
        )


def _write_copy(src: str, new: str, fsync: bool, expected_crc: int | None = None) -> None:
    """Create ``new`` (it must not exist) with the bytes of ``src``, CRC-checked against ``expected_crc``
    (unless None), fsynced with ``fsync``."""
    fd_in = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd_in).st_size
        fd = _fs.open_temporary(new, size)  # reserves the space: a full disk fails here
        try:
            if expected_crc is None:
                _copy_data(fd_in, fd, size, new)
            else:
                _check(src, _copy_data(fd_in, fd, size, new, True), expected_crc)
            if fsync:
                _fs.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _fs.close(fd)
    finally:
        os.close(fd_in)


def copy_tree(src: str, dst: str, fsync: bool) -> None:
    """Copy the complete folder ``src`` to ``dst`` atomically (pending markers and temporaries left
    out); on failure ``dst`` is unchanged and no temporary is left."""
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
        _fs.publish_folder(tmp, dst, fsync)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_protocol_file(name: str) -> bool:
    """A pending marker, a lazyckpt temporary, or a distributed save's staging folder: never copied."""
    return name.startswith(MARKER_PREFIX) or (name.startswith(".") and name.endswith(".tmp") and ".lazyckpt-" in name)


def upload_folder(tier: RemoteTier, src: str, url: str) -> None:
    """Upload the complete folder ``src`` to the prefix ``url``, the manifest last; ``src`` is not
    changed. ``UploadError`` on failure, with nothing at ``url`` that reads as a checkpoint."""
    with tempfile.TemporaryDirectory(prefix="lazyckpt-manifest-") as scratch:
        _remote_folder.upload_folder(tier, src, url, scratch=scratch)


def _copy_data(fd_in: int, fd_out: int, size: int, new: str, crc: bool = False) -> int:
    """The bytes of ``fd_in`` into ``fd_out`` (the file ``new``), written straight from a read-only
    mapping of the source (no bounce buffer); with ``crc``, read into a buffer instead and their CRC32
    returned (0 otherwise). For a big file, whole pages go through an O_DIRECT descriptor where the
    filesystem accepts one (to spare the training's CPU); the tail is buffered."""
    dfd = _fs.open_direct(new) if size >= DIRECT_MIN else -1
    value = 0
    try:
        with contextlib.closing(_source_chunks(fd_in, size, mapped=not crc)) as chunks:
            try:
                for offset, view in chunks:
                    n = len(view)
                    if crc:  # a buffer of ours: a source truncated meanwhile cannot fault this read
                        value = crc32(view, value)
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
                # the traceback's frames hold views of the chunk: cleared so its mapping can close
                traceback.clear_frames(exc.__traceback__)
                raise
    finally:
        if dfd >= 0:
            os.close(dfd)
    return value


def _source_chunks(fd_in: int, size: int, mapped: bool = True) -> Generator[tuple[int, memoryview], None, None]:
    """``(offset, view)`` for each ``COPY_CHUNK`` of ``fd_in``: a read-only mapping of the chunk (with
    ``mapped``), or a page-aligned buffer read into (without, or where the source cannot be mapped). Each
    view is released when the next is asked for or the generator closes. The consumer must hand a mapped
    view only to the kernel (``pwrite``): a source truncated meanwhile then fails the write (EFAULT), never
    SIGBUS."""
    buf: mmap.mmap | None = None
    offset = 0
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
    """Bytes of the distinct tensor storages reachable in ``obj`` (containers, objects' __dict__)."""
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
    """At the first save: ``MemoryLevelWarning`` when the memory levels' worst-case holding (``keep``
    plus slower levels' backlogs, plus replicas) of ``size``-byte checkpoints exceeds
    ``MEMORY_FRACTION`` of RAM, or a memory level has ``keep=None``."""
    total = memory_total()
    held, unbounded, parts = 0, [], []
    for i, level in enumerate(levels):
        if level.is_url or not _fs.is_memory_filesystem(level.path):
            continue
        if level.keep is None:
            unbounded.append(f"level {i} ({level.path})")
            continue
        backlogs = sum(lv.backlog for lv in levels[i + 1 :])
        k = int(getattr(level, "replicas", 0))  # peers' steps held here, and own steps in flight
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
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
