"""Atomic commit: write under a temporary name in the target directory, fsync, rename, fsync dir.

A crash at any moment leaves the previous file (or nothing) at the final name, plus at most a
temporary file named ``.<name>.lazyckpt-<pid>-<n>.tmp`` (or a file or folder renamed there by
``LazyCheckpointer.remove`` and not yet deleted); such leftovers of dead processes are removed by
the next checkpointer that writes to that directory, or by ``cleanup_temporaries``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import logging
import os
import re
import shutil
from typing import Any

logger = logging.getLogger(__name__)

_TMP_RE = re.compile(r"^\..+\.lazyckpt-(\d+)-\d+\.tmp$")
_counter = itertools.count()


def _load_fallocate() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
    except Exception:  # pragma: no cover - non-glibc platforms
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


_fallocate = _load_fallocate()


def temporary_path(final: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.lazyckpt-{os.getpid()}-{next(_counter)}.tmp")


def is_temporary(name: str) -> bool:
    return _TMP_RE.match(os.path.basename(name)) is not None


def open_temporary(tmp: str, size: int) -> int:
    """Create ``tmp`` and reserve ``size`` bytes, so a full disk fails here rather than mid-write."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _reserve(fd, size)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    return fd


def open_direct(tmp: str) -> int:
    """A second, O_DIRECT descriptor for page-aligned bulk writes, or -1 where unsupported (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(tmp, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def _reserve(fd: int, size: int) -> None:
    if size <= 0:
        return
    # The raw syscall, not posix_fallocate: glibc's fallback writes zeros, which would double the I/O.
    if _fallocate is not None and _fallocate(fd, 0, 0, size) == 0:
        return
    err = ctypes.get_errno() if _fallocate is not None else errno.EOPNOTSUPP
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)  # filesystems without fallocate: a sparse file of the final size


def commit(tmp: str, final: str, fsync: bool) -> None:
    """Rename ``tmp`` over ``final`` atomically and make the rename durable."""
    os.replace(tmp, final)
    if fsync:
        fsync_dir(os.path.dirname(final) or ".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - logged, nothing else to do
        logger.warning("lazyckpt: could not remove temporary file %s: %s", path, exc)


def discard(tmp: str) -> None:
    _unlink_quietly(tmp)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (permission errors count as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists but is not ours
        return True
    return True


def cleanup_temporaries(directory: str | os.PathLike[str]) -> list[str]:
    """Remove lazyckpt temporary files left in ``directory`` by processes that no longer run.

    Returns the removed paths. Temporaries of live processes (including this one) are kept, so it
    is safe to call while other processes on this host checkpoint into the same directory.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _TMP_RE.match(name)
        if m and not pid_alive(int(m.group(1))):
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):  # a folder renamed away for deletion
                shutil.rmtree(path, ignore_errors=True)
            else:
                _unlink_quietly(path)
            if not os.path.lexists(path):
                removed.append(path)
    if removed:
        logger.info("lazyckpt: removed %d stale temporary file(s) in %s", len(removed), directory)
    return removed
