"""A multi-object checkpoint at a URL prefix: every file uploaded, then one key LAST.

An object store has no folder rename: a checkpoint of several objects cannot appear at once. Each
object appears whole or not at all (``RemoteTier.transfer``), so a prefix counts as a checkpoint
only once its ``last`` key exists (``.lazyckpt-complete`` for folder checkpoints, ``.metadata``
for DCP's). The protocol, one place for both users (``commit/remote_folder.py``,
``distributed/_upload.py``):

1. ``hide_previous()``: delete a previous checkpoint's last key before any key it shares with the
   new one changes (a reader then sees the old checkpoint whole, or none, never a mix);
2. ``upload(name)`` each file (names the new checkpoint alone uses change nothing a reader sees);
3. ``upload(last)``: the checkpoint exists;
4. on failure, ``remove_uploaded()``: the last key first (its failed PUT may have landed), then
   what was uploaded; on success or failure, ``finish_local()`` for the local copies.

Runs on the calling thread (integrations and the distributed commit call it from theirs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.storage.remote import RemoteTier

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Prefix:
    """The objects under ``url`` that this process uploads from its ``local`` folder."""

    url: str  # no trailing slash
    fs: Any
    rpath: str  # the prefix inside ``fs``
    tier: RemoteTier
    local: str  # the local folder holding the files, named as under the prefix
    last: str  # the key whose presence makes the prefix a checkpoint
    uploaded: list[str] = field(default_factory=list)  # names uploaded (or tried), in order
    shared: bool = False  # a previous checkpoint's keys were touched (its last key hidden)
    upload_s: float = 0.0
    upload_bytes: int = 0

    @classmethod
    def at(cls, tier: RemoteTier, url: str, last: str, local: str | None = None) -> Prefix:
        """Resolve ``url`` (cached fsspec instance); ``local`` defaults to a fresh folder in the
        remote tier (``<local_dir>/.uploads/<pid>-<n>/<name>``)."""
        url = url.rstrip("/")
        fs, rpath = tier.resolve(url)
        if local is None:
            local = tier.local_path(rpath)  # its parent is fresh
            os.mkdir(local)
        return cls(url, fs, rpath.rstrip("/"), tier, local, last)

    def object(self, name: str) -> tuple[str, str]:
        """(URL, key in ``fs``) of ``name`` under the prefix."""
        return f"{self.url}/{name}", f"{self.rpath}/{name}"

    def hide_previous(self) -> None:
        """Delete a previous checkpoint's last key here; ``UploadError`` on failure."""
        self.shared = True
        url, key = self.object(self.last)
        self.tier.delete_object(url, self.fs, key)

    def upload(self, name: str) -> None:
        """Upload the local file ``name`` to ``<url>/<name>``; ``UploadError`` on failure."""
        self.upload_from(name, os.path.join(self.local, name))

    def upload_from(self, name: str, path: str) -> None:
        """Upload the local file ``path`` to ``<url>/<name>``; ``UploadError`` on failure."""
        url, key = self.object(name)
        t = time.perf_counter()
        self.uploaded.append(name)  # before: a failed save deletes the key even if this attempt failed
        self.tier.transfer(url, self.fs, key, path)
        self.upload_s += time.perf_counter() - t
        self.upload_bytes += os.path.getsize(path)

    def remove_uploaded(self) -> None:
        """After a failed save: delete the last key first when it may be there (it was tried, or a
        previous checkpoint's keys were touched), then every key uploaded or tried. Best effort:
        the save's own error is the one to report."""
        names = [n for n in self.uploaded if n != self.last]
        if self.shared or self.last in self.uploaded:
            names.insert(0, self.last)
        for name in names:
            url, key = self.object(name)
            try:
                self.tier.delete_object(url, self.fs, key)
            except Exception as exc:  # noqa: BLE001 - best effort
                logger.warning("lazyckpt: could not delete %s after a failed save: %s", url, exc)
        self.uploaded.clear()

    def finish_local(self, keep: bool = False, folder: str | None = None) -> None:
        """The local copies once the save ended: kept as they are (``keep``: the upload failed and
        the error names them); else each uploaded file goes to the tier's ``keep_local`` mirror or is
        deleted, and ``folder`` (default: the local folder's parent, the save's own) is removed."""
        if keep:
            return
        for name in self.uploaded:
            url, key = self.object(name)
            self.tier.finish_local(url, key, os.path.join(self.local, name))
        with contextlib.suppress(OSError):
            shutil.rmtree(folder or os.path.dirname(self.local))
