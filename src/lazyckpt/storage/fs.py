"""Every write, fsync, rename and unlink of a checkpoint goes through this module.

Atomic commit: write ``.<name>.lazyckpt-<host>-<pid>-<n>.tmp`` beside the target, fsync, rename,
fsync the directory. Callers look functions up on the module at call time (``_fs.commit(...)``),
never ``from ... import`` them, so that tests can replace them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import logging
import mmap
import os
import re
import shutil
import socket
import time
from typing import Any

from lazyckpt.errors import NotDurableError

logger = logging.getLogger(__name__)

# O_DIRECT unit: the page-cache page (a buffered head/tail must never share one with an O_DIRECT write).
PAGE = max(4096, mmap.PAGESIZE)

_TMP_RE = re.compile(r"^\..+\.lazyckpt-(?P<host>[A-Za-z0-9._]+(?:-[A-Za-z0-9._]+)*)-(?P<pid>\d+)-\d+\.tmp$")
_OLD_TMP_RE = re.compile(r"^\..+\.lazyckpt-(?P<pid>\d+)-\d+\.tmp$")  # names without a host
# A host-less name is removed only once its pid is dead here and it was not written for this long.
OLD_STYLE_QUIET_S = 3600.0
_counter = itertools.count()


def host_tag() -> str:
    """This host's name as it appears in temporary names (characters outside [A-Za-z0-9.-] -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


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
    return os.path.join(head, f".{tail}.lazyckpt-{host_tag()}-{os.getpid()}-{next(_counter)}.tmp")


def is_temporary(name: str) -> bool:
    base = os.path.basename(name)
    return _TMP_RE.match(base) is not None or _OLD_TMP_RE.match(base) is not None


def _leftover(directory: str | os.PathLike[str], name: str) -> bool:
    """Whether ``name`` is a temporary that its (dead) writer will never rename or delete."""
    old = _OLD_TMP_RE.match(name)
    if old is not None:
        if pid_alive(int(old.group("pid"))):
            return False
        try:
            return time.time() - os.lstat(os.path.join(directory, name)).st_mtime > OLD_STYLE_QUIET_S
        except OSError:
            return False
    m = _TMP_RE.match(name)
    return m is not None and m.group("host") == host_tag() and not pid_alive(int(m.group("pid")))


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """os.pwrite until every byte is written (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(5, f"short write at offset {offset}: wrote {n} of {len(view)} bytes")
        view = view[n:]
        offset += n


def fsync(fd: int) -> None:
    os.fsync(fd)


def close(fd: int) -> None:
    """Close a descriptor; a failed close can mean lost data (NFS), so it raises."""
    os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def open_temporary(tmp: str, size: int) -> int:
    """Create ``tmp`` and reserve ``size`` bytes, so a full disk fails here rather than mid-write."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        reserve(fd, size)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    return fd


_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
_memory_fs_of_dev: dict[int, bool] = {}


def is_memory_filesystem(directory: str) -> bool:
    """Whether ``directory`` is on tmpfs or ramfs (cached per device)."""
    try:
        dev = os.stat(directory or ".").st_dev
    except OSError:
        return False
    known = _memory_fs_of_dev.get(dev)
    if known is None:
        known = _memory_fs_of_dev[dev] = _fstype_of_dev(dev) in _MEMORY_FS
    return known


def _fstype_of_dev(dev: int) -> str | None:
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:  # "id parent maj:min root mountpoint options [optional...] - fstype source ..."
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


def open_direct(tmp: str) -> int:
    """A second, O_DIRECT descriptor for page-aligned bulk writes, or -1 where unsupported (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(tmp, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def reserve(fd: int, size: int, offset: int = 0) -> None:
    """Reserve ``size`` bytes from ``offset`` for ``fd``, so a full disk fails here rather than mid-write."""
    if size <= 0:
        return
    # The raw syscall, not posix_fallocate: glibc's fallback writes zeros, which would double the I/O.
    if _fallocate is not None and _fallocate(fd, 0, offset, size) == 0:
        return
    err = ctypes.get_errno() if _fallocate is not None else errno.EOPNOTSUPP
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(err, os.strerror(err))
    os.ftruncate(fd, offset + size)  # filesystems without fallocate: a sparse file of the final size


def commit(tmp: str, final: str, fsync: bool) -> None:
    """Rename ``tmp`` over ``final`` atomically and make the rename durable."""
    os.replace(tmp, final)
    if fsync:
        fsync_dir(os.path.dirname(final) or ".")


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (a rename, a create, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(fd)
    finally:
        os.close(fd)


def rename(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (not over a directory); raises ``OSError`` (``EXDEV`` across filesystems)."""
    os.rename(src, dst)


def unlink(path: str) -> None:
    os.unlink(path)


def _unlink_quietly(path: str) -> None:
    try:
        unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - logged, nothing else to do
        logger.warning("lazyckpt: could not remove temporary file %s: %s", path, exc)


def remove_quietly(path: str) -> None:
    """Delete a checkpoint retention dropped, here: a folder renamed away first (its name free at once), then
    deleted; a file unlinked. A failure is logged, never raised (retention is housekeeping)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            gone = temporary_path(path)
            os.rename(path, gone)
            shutil.rmtree(gone)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("lazyckpt: could not remove %s: %s", path, exc)


def discard(tmp: str) -> None:
    """Remove a failed save's temporary file; a missing one is fine, another error is logged."""
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
    """Remove lazyckpt temporary files left in ``directory`` by dead processes of this host; returns
    the removed paths. Safe while other processes, on any host, checkpoint into the directory.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if _leftover(directory, name):
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


def final_path(path: Any) -> str:
    """The absolute final path of a local save to ``path``, its folder created; ``SaveRefusedError``
    for a non-path, bytes, a URL path object, a directory, or a folder that cannot be created."""
    from lazyckpt.errors import SaveRefusedError

    if not isinstance(path, (str, os.PathLike)):
        raise SaveRefusedError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    raw = os.fspath(path)
    if isinstance(raw, bytes) or "://" in raw:
        raise SaveRefusedError(f"{raw!r}: a bytes path, or a URL given as a path object; pass URLs (s3://...) as str")
    final = os.path.abspath(raw)
    if os.path.isdir(final):
        raise SaveRefusedError(f"{final} is a directory; pass a file path")
    directory = os.path.dirname(final)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SaveRefusedError(f"cannot create directory {directory}: {exc}") from exc
    return final


def write_temporary(
    obj: Any, final: str, format: str, metadata: dict[str, str] | None, durable: bool
) -> tuple[str, int]:
    """A re-entered save's bytes (``torch.save`` or ``safetensors.torch.save``), written on this thread to a
    fresh temporary beside ``final`` and fsynced; returns (path, size) for the caller to rename. Takes no
    lazyckpt lock and calls the unpatched writers."""
    import torch.serialization

    tmp = temporary_path(final)
    try:
        if format == "safetensors":
            import safetensors.torch

            data = safetensors.torch.save(obj, metadata)
            with open(tmp, "wb") as fh:
                fh.write(data)
                if durable:
                    fh.flush()
                    fsync(fh.fileno())
        else:
            with open(tmp, "wb") as fh:
                torch.serialization.save(obj, fh)
                if durable:
                    fh.flush()
                    fsync(fh.fileno())
        return tmp, os.path.getsize(tmp)
    except BaseException:
        discard(tmp)
        raise


def write_bytes(final: str, data: bytes | memoryview, durable: bool) -> None:
    """``data`` at ``final`` whole or not at all: written to a temporary beside it, fsynced (``durable``),
    renamed over. Caller's thread."""
    tmp = temporary_path(final)
    try:
        fd = open_temporary(tmp, len(data))
        try:
            pwrite_all(fd, data, 0)
            if durable:
                fsync(fd)
        finally:
            close(fd)
        commit(tmp, final, durable)
    except BaseException:
        discard(tmp)
        raise


def publish_folder(staging: str, final: str, fsync: bool) -> None:
    """The one way a complete folder becomes visible at ``final``: its entries fsynced, then ``swap_in``
    (an existing ``final`` exchanged atomically where the kernel can). Caller's thread; raises as ``swap_in``."""
    if fsync:
        fsync_dir(staging)
    swap_in(staging, final, temporary_path(final), fsync)


def swap_in(staging: str, final: str, old: str, fsync: bool) -> None:
    """Make ``staging`` visible as ``final``; an existing ``final`` is swapped out atomically
    (``RENAME_EXCHANGE``, else two renames via ``old``) and deleted. Raises ``OSError`` with nothing
    changed at ``final``, or ``NotDurableError`` once the new checkpoint is visible there."""
    replaced = None
    if os.path.lexists(final):
        if _exchange(staging, final):
            replaced = staging
        else:
            rename(final, old)  # no exchange: a moment with nothing at ``final``
            try:
                rename(staging, final)
            except BaseException:
                rename(old, final)  # put the previous checkpoint back
                raise
            replaced = old
    else:
        rename(staging, final)
    try:
        if fsync:
            fsync_dir(os.path.dirname(final))
    except OSError as exc:
        raise NotDurableError(exc.errno, f"{final} is in place but fsync of its folder failed: {exc}") from exc
    finally:
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).renameat2
    except (OSError, AttributeError):  # pragma: no cover - old glibc, non-Linux
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # EPERM: a seccomp filter
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")
