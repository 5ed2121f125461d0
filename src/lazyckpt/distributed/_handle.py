"""A distributed save as its rank sees it: the handle ``save()`` returns, the commit thread's
record of it (``Save``), how it failed (``Failure``), and its path and extra files as given."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.core import remote as _remote
from lazyckpt.core.handle import Completion, SaveHandle, SaveStats
from lazyckpt.core.handle import Outcome as HandleOutcome

from ..errors import DistributedSaveError, DistributedUploadError, SaveRefusedError
from ._layout import RankFileLayout
from ._upload import RemoteFolder


class LocalPart:
    """This rank's file of a distributed save: its handle, set once the file's save started."""

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None


class DistributedSaveHandle(SaveHandle):
    """A pending distributed save (``SaveHandle``'s methods). ``wait_staged()`` concerns this rank's
    tensors; ``wait()`` returns once the checkpoint is committed on every rank, and raises
    ``DistributedSaveError`` on every rank if any rank's part failed. Both first confirm this rank's
    file on the calling thread.

    A save to a URL has one stage more: ``local()`` / ``wait_local()`` once this rank's file is on
    its local disk; ``done()`` / ``wait()`` once the checkpoint is committed in the store."""

    def __init__(
        self, path: str, outcome: HandleOutcome | None = None, url: str | None = None, part: LocalPart | None = None
    ) -> None:
        super().__init__(path, outcome)
        self.url = url  # a save to a URL (as ``RemoteSaveHandle.url``); None for a local folder
        self._part = part if part is not None else LocalPart()

    def local(self) -> bool:
        local = self._part.handle
        if self.url is None or local is None:
            return self.done()
        return local.done()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        """Wait until this rank's file is committed on local disk and return its stats (a local
        save: ``wait()``). If it failed, raises the distributed save's error."""
        local = self._part.handle
        if self.url is None or local is None:
            return self.wait(timeout)
        if not local.wait_done(timeout):  # confirms this rank's file first
            raise TimeoutError(f"this rank's part of {self.path} not on local disk after {timeout} s")
        if local.exception() is not None or local.stats is None:
            return self.wait()
        return local.stats

    def staged(self) -> bool:
        local = self._part.handle
        return super().staged() or (local is not None and local.staged())

    def wait_staged(self, timeout: float | None = None) -> None:
        local = self._part.handle
        if local is not None:
            local.wait_staged(timeout)
        else:
            super().wait_staged(timeout)


@dataclass(eq=False)
class Save:
    """One checkpoint folder a rank takes part in: a path save's, or one level's folder of a step
    (``n``: ``"<save>-<level>"``; no handle for a slower level's copy)."""

    n: int | str
    final: str
    staging: str
    handle: DistributedSaveHandle | None
    t0: float
    metadata: Any = None  # coordinator: DCP Metadata, storage data filled in at commit
    layout: RankFileLayout | None = None
    storage: dict[Any, Any] = field(default_factory=dict)
    file: str = ""
    local: SaveHandle | None = None
    error: BaseException | None = None  # this rank's part failed inside save()
    extra_files: dict[str, bytes] = field(default_factory=dict)  # coordinator: written beside .metadata
    remote: RemoteFolder | None = None  # a save to a URL: its objects and this rank's local folder
    completion: Completion | None = None  # of ``handle``: the commit thread finishes it
    part: LocalPart | None = None  # shared with ``handle``: ``local`` once started
    # Coordinator, a folder of plain rank files (no DCP metadata, e.g. DeepSpeed's): run right after the
    # folder is in place (DeepSpeed's ``latest``); raising fails the save with the folder already visible.
    after_publish: Callable[[], None] | None = None


@dataclass
class Failure:
    """Why a save failed, as every rank learns it."""

    message: str
    ranks: tuple[int, ...]
    upload: bool = False  # a save to a URL failed because an upload failed
    undo: bool = True  # no .metadata is visible: the objects this rank uploaded may be deleted
    cause: BaseException | None = None  # the coordinator's own error when it failed the save itself


def extra_name(name: str) -> str:
    if not name or os.path.basename(name) != name or name.startswith(".") or name.endswith(".distcp"):
        raise SaveRefusedError(f"extra file name {name!r}: a plain file name, not hidden, not .distcp")
    return name


def resolve_path(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise SaveRefusedError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    raw = os.fspath(path)
    if isinstance(raw, bytes):
        raise SaveRefusedError(f"{raw!r}: a str path or URL, not bytes")
    if _remote.is_url(raw):
        return raw.rstrip("/")
    return os.path.abspath(raw)


def save_error(
    final: str, message: str, cause: BaseException | None, ranks: tuple[int, ...] = (), upload: bool = False
) -> DistributedSaveError:
    """How a path save to ``final`` failed, typed as every rank raises it (``cause`` chained)."""
    message = f"distributed save to {final} failed: {message}"
    errno = getattr(cause, "errno", None)
    err: DistributedSaveError
    if upload:
        err = DistributedUploadError(
            message, final, ranks=ranks, attempts=getattr(cause, "attempts", 0),
            local_path=getattr(cause, "local_path", None), errno=errno,
        )  # fmt: skip
    else:
        err = DistributedSaveError(message, path=final, errno=errno, ranks=ranks)
    err.__cause__ = cause
    return err
