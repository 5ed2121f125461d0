"""A distributed save as its rank sees it: the handle ``save()`` returns, the commit thread's
record of it (``Save``), and how it failed (``Outcome``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lazyckpt.core.handle import Completion, SaveHandle, SaveStats
from lazyckpt.core.handle import Outcome as HandleOutcome

from ._layout import RankFileLayout
from ._upload import RemoteFolder


class DistributedSaveHandle(SaveHandle):
    """A pending distributed save (``SaveHandle``'s methods). ``wait_staged()`` concerns this rank's
    tensors; ``wait()`` returns once the checkpoint is committed on every rank, and raises
    ``DistributedSaveError`` on every rank if any rank's part failed. Both first confirm this
    rank's file on the calling thread (see ``DistributedCheckpointer``: the commit waits for every
    rank's confirmation).

    A save to a URL has one stage more: ``local()`` / ``wait_local()`` once this rank's file is
    committed on its local disk; ``done()`` / ``wait()`` once the checkpoint is committed in the
    store (every rank's file uploaded, then ``.metadata``)."""

    def __init__(self, path: str, outcome: HandleOutcome | None = None, url: str | None = None) -> None:
        super().__init__(path, outcome)
        self.url = url  # a save to a URL (as ``RemoteSaveHandle.url``); None for a local folder
        self._local: SaveHandle | None = None

    def bind_local(self, local: SaveHandle) -> None:
        """Internal API (the distributed checkpointer): this rank's file's handle, once started."""
        self._local = local

    def local(self) -> bool:
        local = self._local
        if self.url is None or local is None:
            return self.done()
        return local.done()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        """This rank's file committed on local disk: its stats (for a local save: ``wait()``). If
        it failed, the distributed save's error, once every rank knows it."""
        local = self._local
        if self.url is None or local is None:
            return self.wait(timeout)
        if not local.wait_done(timeout):  # confirms this rank's file first
            raise TimeoutError(f"this rank's part of {self.path} not on local disk after {timeout} s")
        if local.exception() is not None or local.stats is None:
            return self.wait()
        return local.stats

    def staged(self) -> bool:
        local = self._local
        return super().staged() or (local is not None and local.staged())

    def wait_staged(self, timeout: float | None = None) -> None:
        local = self._local
        if local is not None:
            local.wait_staged(timeout)
        else:
            super().wait_staged(timeout)


@dataclass(eq=False)
class Save:
    n: int
    final: str
    staging: str
    handle: DistributedSaveHandle
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


@dataclass
class Outcome:
    """Why a save failed, as every rank learns it."""

    message: str
    ranks: tuple[int, ...]
    upload: bool = False  # a save to a URL failed because an upload failed
    undo: bool = True  # no .metadata is visible: the objects this rank uploaded may be deleted
    cause: BaseException | None = None  # the coordinator's own error when it failed the save itself
