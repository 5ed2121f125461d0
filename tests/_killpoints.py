"""Forced kill points for the crash tests: SIGKILL this process the NTH time a save reaches a point.

A point is a function that a save calls at a known moment (looked up on its module at call time, as
lazyckpt's code does: ``_fs.commit(...)``), wrapped so that its NTH counted call first does what
the point says (half of a write, say), then calls ``on_kill`` (the test's record that the window was
reached), then SIGKILLs the process: the window is forced, not hoped for.

- ``create``: before a temporary file is created (``fs.open_temporary``);
- ``mid-write``: half of one write's bytes in the temporary file (``fs.pwrite_all``);
- ``before-fsync``: a file's data written, before its fsync (``fs.fsync`` of a regular file);
- ``before-rename``: a slower level's copy complete and fsynced, before its rename (``fs.commit`` into ``disk``);
- ``after-rename``: a file or folder renamed to its final name, before its folder's fsync (``fs.fsync_dir``);
- ``mid-copy``: half of a file copied to a slower level (``schedule._copy._copy_data``);
- ``retention``: before retention removes an older step's file (``fs.unlink`` under ``mem`` or ``disk``).
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Callable
from typing import Any


def _under(folder: str | None, path: str) -> bool:
    return folder is not None and os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep)


def _regular(fd: int, *_: Any) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _half_write(real: Callable[..., Any], fd: int, data: Any, offset: int) -> None:
    real(fd, memoryview(data)[: len(data) // 2], offset)


def _half_copy(real: Callable[..., Any], fd_in: int, fd_out: int, size: int, new: str, *crc: bool) -> None:
    real(fd_in, fd_out, size // 2, new, *crc)


def arm(point: str, nth: int, on_kill: Callable[[], None], mem: str | None = None, disk: str | None = None) -> None:
    """SIGKILL this process the ``nth`` time a save reaches ``point`` (``on_kill()`` just before)."""
    from lazyckpt.schedule import _copy
    from lazyckpt.storage import fs as _fs

    points: dict[str, tuple[Any, str, Callable[..., bool], Callable[..., None] | None]] = {
        "create": (_fs, "open_temporary", lambda *a: True, None),
        "mid-write": (_fs, "pwrite_all", lambda fd, data, off: len(data) > 1, _half_write),
        "before-fsync": (_fs, "fsync", _regular, None),
        "before-rename": (_fs, "commit", lambda tmp, final, fsync: _under(disk, final), None),
        "after-rename": (_fs, "fsync_dir", lambda path: True, None),
        "mid-copy": (_copy, "_copy_data", lambda *a: True, _half_copy),
        "retention": (_fs, "unlink", lambda path: _under(mem, path) or _under(disk, path), None),
    }
    module, name, counts, before = points[point]
    real = getattr(module, name)
    seen = [0]

    def wrapper(*args: Any) -> Any:
        if counts(*args):
            seen[0] += 1
            if seen[0] == nth:
                if before is not None:
                    before(real, *args)
                on_kill()
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)

    setattr(module, name, wrapper)
