"""Page reuse on tmpfs: a file that retention drops becomes the next save's file (``Spares``).

Spares are kept under temporary names, exclusively ``flock``ed; readers take a shared lock
(``share_lock``) so a file they read is never reused. Every lock is non-blocking (``LOCK_NB``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

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
    """Reader's side, on a memory filesystem: share-lock ``fd`` (its pages are then not reused) and
    check ``path`` still names it; ``FileNotFoundError`` when it is being reused or was renamed away."""
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


_held_lock = reentry.Lock()
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


#: a folder checkpoint's files of at least this size, at most this deep, are kept as spares
FOLDER_MIN_BYTES = 1 << 20
FOLDER_DEPTH = 2

Key = tuple[str, str]  # (folder, name): a file level's (<level>, ""), a folder level's (<level>, <name in the step>)


def keys_for(final: str) -> list[Key]:
    """The spares a save to ``final`` may take, in order: its folder's (a file level), then the same
    name in a sibling step folder, one and two folders up (a folder level)."""
    step, rel = os.path.split(os.path.abspath(final))
    keys = [(step, "")]
    for _ in range(FOLDER_DEPTH):
        root, name = os.path.split(step)
        if not name:
            break
        keys.append((root, rel))
        rel, step = os.path.join(name, rel), root
    return keys


class _Spare:
    __slots__ = ("path", "fd", "size")

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size


class Spares:
    """Spare files keyed by ``(folder, name)`` (``keys_for``), each under a temporary name with its
    descriptor open and exclusively locked. Thread-safe; every method returns at once."""

    def __init__(self) -> None:
        self._lock = reentry.Lock()
        self._spares: dict[Key, _Spare] = {}
        self.reused = 0  # files handed to a save

    def offer(self, path: str) -> bool:
        """Make the file at ``path`` its folder's spare; False when it may not be (the caller deletes
        it). Called with no save to ``path`` pending. Never raises."""
        folder = _folder_in_memory(path)
        if folder is None:
            return False
        spare = _claim(path, folder)
        if spare is None:
            return False
        with self._lock:
            old = self._spares.pop((folder, ""), None)
            self._spares[(folder, "")] = spare
        if old is not None:
            _drop(old)
        return True

    def offer_folder(self, taken: str, root: str) -> None:
        """Make the large files of a step folder of level ``root``, renamed away to ``taken`` by the
        caller, the spares of their names (replacing the previous folder's). What is not taken
        stays in ``taken`` for the caller to delete. Never raises."""
        if not _fs.is_memory_filesystem(root):
            return
        root = os.path.abspath(root)
        fresh: dict[Key, _Spare] = {}
        for rel in _files(taken, FOLDER_DEPTH):
            spare = _claim(os.path.join(taken, rel), root)
            if spare is not None:
                fresh[(root, rel)] = spare
        with self._lock:
            old = [self._spares.pop(k) for k in [k for k in self._spares if k[0] == root and k[1]]]
            self._spares.update(fresh)
        for spare in old:
            _drop(spare)

    def take(self, final: str, tmp: str, size: int) -> int:
        """The descriptor of the spare for a save to ``final``, renamed to ``tmp`` and resized to
        ``size`` (``OSError`` on a full filesystem); -1 when there is none. The caller owns the fd and lock."""
        with self._lock:
            for key in keys_for(final):
                spare = self._spares.pop(key, None)
                if spare is not None:
                    break
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


def _claim(path: str, park: str) -> _Spare | None:
    """The file at ``path`` renamed to a temporary name in ``park``, its fd keeping an exclusive lock,
    if nobody can be using it (one link, lock granted, not mapped here); else None. Never raises."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
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
        spare = _fs.temporary_path(os.path.join(park, os.path.basename(path)))
        _fs.rename(path, spare)
    except (OSError, _Refused) as exc:
        logger.debug("lazyckpt: %s is deleted, not reused: %s", path, exc)
        os.close(fd)
        return None
    return _Spare(spare, fd, st.st_size)


def _files(folder: str, depth: int) -> list[str]:
    """Relative paths of regular files of at least ``FOLDER_MIN_BYTES``, ``depth`` levels deep at most."""
    found: list[str] = []
    try:
        with os.scandir(folder) as it:
            entries = list(it)
    except OSError:
        return found
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size >= FOLDER_MIN_BYTES:
                found.append(entry.name)
            elif depth > 1 and entry.is_dir(follow_symlinks=False):
                found += [os.path.join(entry.name, rel) for rel in _files(entry.path, depth - 1)]
        except OSError:
            continue
    return found


def _drop(spare: _Spare) -> None:
    os.close(spare.fd)
    _fs.discard(spare.path)
