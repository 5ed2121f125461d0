"""Page reuse on a memory filesystem: the file retention drops becomes the next save's file.

On tmpfs a new file's pages are allocated and zeroed as it is written, and an unlink frees them
again (``python -m benchmarks.probe_tmpfs``, 1.17 GB: fresh 0.46-0.75 CPU s plus 0.15-0.38 s for
the unlink; written over an existing file's pages 0.28-0.35 s). ``Spares`` keeps one dropped file
per folder under a temporary name and hands it to the next save there (docs/ARCHITECTURE.md,
"Page reuse on a memory level"):

- ``Spares.offer(path)``: the file, if nobody can be using it (a regular file with one link; an
  exclusive ``flock`` granted at once, so no lazyckpt reader holds it; not mapped by this
  process), renamed to a temporary name; its descriptor keeps the exclusive lock.
- ``Spares.take(tmp, size)``: the folder's spare renamed to ``tmp`` and resized; the caller owns
  the descriptor (and the lock, released when it closes it).
- ``share_lock(fd, path)``: a reader's side, on a memory filesystem: a shared ``flock`` on its
  descriptor, then a check that ``path`` still names it; ``FileNotFoundError`` otherwise (being
  reused, or renamed away for reuse between the reader's open and its lock).
- ``hold_while_mapped(fd)``: keep a duplicate of a reader's locked descriptor while this process
  maps the file (``lazyckpt.load``'s tensors are pages of it), released once it is no longer mapped.

Every call here is non-blocking (``LOCK_NB``): no one waits on a lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading

from lazyckpt.storage import fs as _fs

logger = logging.getLogger(__name__)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _folder_in_memory(path: str) -> str | None:
    """The folder of ``path`` when it is on a memory filesystem (tmpfs), else None."""
    folder = os.path.dirname(os.path.abspath(path))
    return folder if _fs.is_memory_filesystem(folder) else None


def mapped_here(dev: int, ino: int) -> bool:
    """Whether this process maps the file (device ``dev``, inode ``ino``): ``/proc/self/maps``.
    True when that cannot be read (then nothing is reused)."""
    major, minor = os.major(dev), os.minor(dev)
    want = str(ino)
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:  # "start-end perms offset maj:min inode [path]"
                fields = line.split(None, 5)
                if len(fields) >= 5 and fields[4] == want:
                    maj, _, mn = fields[3].partition(":")
                    if int(maj, 16) == major and int(mn, 16) == minor:
                        return True
    except (OSError, ValueError):
        return True
    return False


def share_lock(fd: int, path: str) -> None:
    """A reader's side of page reuse: on a memory filesystem, a shared lock on ``fd`` (so its pages
    are not reused while it is held), then ``path`` must still name that file. Raises
    ``FileNotFoundError`` when the file is being reused or was renamed away since the open."""
    if _folder_in_memory(path) is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FileNotFoundError(2, "removed since it was listed (its pages are being reused)", path) from None
    try:
        named = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, "removed since it was opened", path) from None
    if _identity(named) != _identity(os.fstat(fd)):
        raise FileNotFoundError(2, "removed since it was opened (the name holds another file now)", path)


_held_lock = threading.Lock()
_held: dict[tuple[int, int], int] = {}  # (dev, inode) -> a duplicate of a reader's locked descriptor


def hold_while_mapped(fd: int, path: str) -> None:
    """On a memory filesystem, keep a duplicate of ``fd`` (holding its shared lock) while this
    process maps that file; descriptors of files no longer mapped are closed here."""
    if _folder_in_memory(path) is None:
        return
    this = _identity(os.fstat(fd))
    with _held_lock:
        for key, held in list(_held.items()):
            if key != this and not mapped_here(*key):
                del _held[key]
                os.close(held)
        if this not in _held and mapped_here(*this):
            _held[this] = os.dup(fd)  # the duplicate shares the lock (one open file description)


class _Spare:
    __slots__ = ("path", "fd", "size")

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size


class Spares:
    """At most one spare file per folder, each under a temporary name with its descriptor open and
    exclusively locked. Thread-safe; every method returns at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spares: dict[str, _Spare] = {}  # folder -> its spare
        self.reused = 0  # files handed to a save (tests and benchmarks read it)

    def offer(self, path: str) -> bool:
        """Make the file at ``path`` (a memory filesystem's) its folder's spare; False when it may
        not be (the caller deletes it as before). The caller guarantees that no save to ``path`` is
        pending. Never raises."""
        folder = _folder_in_memory(path)
        if folder is None:
            return False
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise _Refused("not a regular file with one link")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _Refused("a reader holds it") from None
            if _identity(os.stat(path, follow_symlinks=False)) != _identity(st):
                raise _Refused("the name holds another file now")
            if mapped_here(st.st_dev, st.st_ino):
                raise _Refused("this process maps it")
            spare = _fs.temporary_path(path)
            _fs.rename(path, spare)
        except (OSError, _Refused) as exc:
            logger.debug("lazyckpt: %s is deleted, not reused: %s", path, exc)
            os.close(fd)
            return False
        with self._lock:
            old = self._spares.pop(folder, None)
            self._spares[folder] = _Spare(spare, fd, st.st_size)
        if old is not None:
            _drop(old)
        return True

    def take(self, tmp: str, size: int) -> int:
        """The descriptor of ``tmp``'s folder's spare, renamed to ``tmp`` and resized to ``size``
        bytes (grown by a reservation: a full filesystem raises ``OSError`` here); -1 when the
        folder has none. The caller owns the descriptor (and its exclusive lock)."""
        with self._lock:
            spare = self._spares.pop(os.path.dirname(os.path.abspath(tmp)), None)
        if spare is None:
            return -1
        try:
            _fs.rename(spare.path, tmp)
        except OSError as exc:
            logger.debug("lazyckpt: spare %s not reused: %s", spare.path, exc)
            _drop(spare)
            return -1
        try:
            if spare.size > size:
                os.ftruncate(spare.fd, size)
            elif spare.size < size:
                _fs.reserve(spare.fd, size - spare.size, offset=spare.size)
        except BaseException:
            os.close(spare.fd)
            _fs.discard(tmp)
            raise
        with self._lock:
            self.reused += 1
        return spare.fd

    def clear(self) -> None:
        """Delete every spare (``close()``)."""
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            _drop(spare)


class _Refused(Exception):
    pass


def _drop(spare: _Spare) -> None:
    os.close(spare.fd)
    _fs.discard(spare.path)
