"""Folder checkpoints: several files that are complete together, or not at all.

Each writing process creates a durable hidden pending marker, commits its files after it, then
removes it (:class:`FolderSave`). A folder is complete (:func:`is_complete`) when it exists and holds
no marker. Markers name host and pid, so a dead process's marker is recognised (:func:`marker_is_stale`).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lazyckpt.errors import IncompleteCheckpointError, WriteError
from lazyckpt.storage import fs as _fs

if TYPE_CHECKING:
    from lazyckpt.core.handle import SaveHandle


class FileSaver(Protocol):
    """What a folder save needs of its checkpointer (``LazyCheckpointer``)."""

    def save(
        self,
        obj: Any,
        path: str | os.PathLike[str],
        format: Any = ...,
        metadata: Any = ...,
        before_commit: Callable[[], object] | None = ...,
    ) -> SaveHandle: ...


__all__ = [
    "MARKER_PREFIX",
    "FolderSave",
    "MarkerOwner",
    "is_complete",
    "live_markers",
    "marker_is_stale",
    "marker_owner",
    "pending_markers",
]

#: Prefix of the hidden marker files that flag a folder whose save is not durable yet.
MARKER_PREFIX = ".lazyckpt-pending-"

_seq = itertools.count()

Submit = Callable[[Callable[[], None]], object]


@dataclass(frozen=True)
class MarkerOwner:
    """Who created a marker: ``tag`` (e.g. the rank), ``host`` and ``pid``."""

    tag: str
    host: str
    pid: int


def marker_name(tag: str | int) -> str:
    """A fresh marker name for this process (unique within the process)."""
    tag = str(tag)
    if not tag or "-" in tag or os.sep in tag:
        raise ValueError(f"lazyckpt: a folder save tag must be non-empty, without '-' or {os.sep!r}: {tag!r}")
    return f"{MARKER_PREFIX}{tag}-{socket.gethostname()}-{os.getpid()}-{next(_seq)}"


def marker_owner(name: str) -> MarkerOwner | None:
    """Who created the marker called ``name``; None when the name is not a lazyckpt marker."""
    base = os.path.basename(name)
    if not base.startswith(MARKER_PREFIX):
        return None
    try:
        tag, rest = base[len(MARKER_PREFIX) :].split("-", 1)
        host, pid, _seq_no = rest.rsplit("-", 2)  # host names may contain '-'
        return MarkerOwner(tag, host, int(pid))
    except ValueError:
        return None


def marker_is_stale(name: str) -> bool:
    """True when the marker was left by a process of THIS host that no longer runs.

    A marker of another host, of a live process, or with an unreadable name is never stale.
    """
    owner = marker_owner(name)
    return owner is not None and owner.host == socket.gethostname() and not _fs.pid_alive(owner.pid)


def pending_markers(folder: str | os.PathLike[str]) -> list[str]:
    """Names of the pending markers in ``folder``, sorted (empty: complete, or not a lazyckpt folder)."""
    try:
        return sorted(n for n in os.listdir(folder) if n.startswith(MARKER_PREFIX))
    except (FileNotFoundError, NotADirectoryError):
        return []


def live_markers(folder: str | os.PathLike[str], *, others_only: bool = True) -> list[str]:
    """Markers in ``folder`` of saves that may still end: not stale, and (``others_only``) not this process's."""
    me = (socket.gethostname(), os.getpid())
    live = []
    for name in pending_markers(folder):
        owner = marker_owner(name)
        if owner is None or marker_is_stale(name) or (others_only and (owner.host, owner.pid) == me):
            continue
        live.append(name)
    return live


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """True when ``folder`` exists and no lazyckpt save into it is pending or was interrupted.

    A folder that lazyckpt never wrote into counts as complete.
    """
    return os.path.isdir(folder) and not pending_markers(folder)


class FolderSave:
    """One process's save into one folder. Call :meth:`save` / :meth:`end` from one thread at a time;
    :meth:`before_commit` may run on any thread. ``submit`` runs the marker's fsync (default: a daemon thread).
    """

    def __init__(self, folder: str | os.PathLike[str], *, tag: str | int = 0, submit: Submit | None = None) -> None:
        self.folder = os.path.realpath(os.path.abspath(os.fspath(folder)))
        os.makedirs(self.folder, exist_ok=True)
        self.marker = os.path.join(self.folder, marker_name(tag))
        self.handles: list[SaveHandle] = []
        #: Settles once the marker and the folder entry are durable (a WriteError when they cannot be).
        self.marker_durable: Future[None] = Future()
        self.ended = False
        with open(self.marker, "w") as fh:
            fh.write(
                f"lazyckpt: save into this folder started at {time.time():.3f}; "
                "this file is removed once every file of that save is durable\n"
            )
        # fsynced off the caller's thread: only this save's renames wait for it (before_commit)
        if submit is None:
            try:
                threading.Thread(target=self._sync_marker, name="lazyckpt-folder-marker", daemon=True).start()
            except RuntimeError:  # no new threads (e.g. at interpreter shutdown): never leave it unsettled
                self._sync_marker()
        else:
            submit(self._sync_marker)

    def _sync_marker(self) -> None:
        try:
            _fs.fsync_file(self.marker)
            _fs.fsync_dir(self.folder)
        except BaseException as exc:  # noqa: BLE001 - fails every file of this save, through before_commit
            err = WriteError(f"lazyckpt: could not make {self.marker} durable: {exc}", path=self.marker)
            err.__cause__ = exc
            self.marker_durable.set_exception(err)
        else:
            self.marker_durable.set_result(None)

    def before_commit(self) -> None:
        """Block until the marker is durable; raise its WriteError if it cannot be (the file then fails)."""
        self.marker_durable.result()

    def save(self, checkpointer: FileSaver, obj: Any, path: str | os.PathLike[str], **options: Any) -> SaveHandle:
        """``checkpointer.save(obj, path, **options)`` as a file of this folder save (recorded for :meth:`end`)."""
        if self.ended:
            raise RuntimeError(f"lazyckpt: the save into {self.folder} has ended; begin a new FolderSave")
        handle = checkpointer.save(obj, path, before_commit=self.before_commit, **options)
        self.handles.append(handle)
        return handle

    def end(self, fsync_files: Iterable[str | os.PathLike[str]] = ()) -> bool:
        """Mark the folder complete for this process: fsync ``fsync_files``, remove the marker, fsync the folder.

        Raises ``IncompleteCheckpointError`` (the marker stays) when a recorded file is pending or
        failed, or ``WriteError``. Returns True when the marker was removed, False when it is gone.
        """
        for h in self.handles:
            if not h.done():
                raise IncompleteCheckpointError(f"lazyckpt: end() of {self.folder} before {h.path} committed")
            exc = h.exception()
            if exc is not None:
                raise IncompleteCheckpointError(
                    f"lazyckpt: {h.path} failed; {self.folder} stays incomplete ({type(exc).__name__}: {exc})"
                ) from exc
        self.marker_durable.result()
        if not os.path.isdir(self.folder):
            return False
        seen: set[str] = set()
        for f in (os.fspath(p) for p in fsync_files):
            if f in seen:
                continue
            seen.add(f)
            try:
                _fs.fsync_file(f)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise WriteError(f"lazyckpt: could not fsync {f}: {exc}", path=f, errno=exc.errno) from exc
        try:
            _fs.unlink(self.marker)
            _fs.fsync_dir(self.folder)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise WriteError(
                f"lazyckpt: could not mark {self.folder} complete: {exc}", path=self.folder, errno=exc.errno
            ) from exc
        self.ended = True
        return True
