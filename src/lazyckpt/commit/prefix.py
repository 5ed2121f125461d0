"""A multi-object checkpoint at a URL prefix: every file uploaded, then one ``last`` key.

Protocol (calling thread): ``hide_previous()`` before any shared key changes, ``upload(name)`` each
file, ``upload(last)``; on failure ``remove_uploaded()``; then ``finish_local()``. So a reader sees the
old checkpoint whole, or none, never a mix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.core.remote import RemoteTier

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
        """Resolve ``url``; ``local`` defaults to a fresh folder in the remote tier."""
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
        self.uploaded.append(name)  # first: a failed save deletes the key even if this attempt failed
        self.tier.transfer(url, self.fs, key, path)
        self.upload_s += time.perf_counter() - t
        self.upload_bytes += os.path.getsize(path)

    def remove_uploaded(self) -> None:
        """After a failed save: delete the last key first if it may exist, then every key uploaded or
        tried. Best effort; never raises on a failed delete."""
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
        """Once the save ended: unless ``keep``, move each uploaded file to the ``keep_local`` mirror or
        delete it, and remove ``folder`` (default: the local folder's parent)."""
        if keep:
            return
        for name in self.uploaded:
            url, key = self.object(name)
            self.tier.finish_local(url, key, os.path.join(self.local, name))
        with contextlib.suppress(OSError):
            shutil.rmtree(folder or os.path.dirname(self.local))
