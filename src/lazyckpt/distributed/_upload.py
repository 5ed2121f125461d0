"""One distributed save's prefix in an object store (``s3://bucket/run/step-100``), as one rank sees it.

Every rank writes its ``__<rank>_0.distcp`` into a folder of its own on its node's local disk
(``<local_dir>/.uploads/<pid>-<n>/<name>/``, the remote tier's), then uploads it from the commit
thread through ``RemoteTier.transfer`` (the single-file path's PutObject / multipart upload,
retries, abort). The coordinator uploads the extra files and the manifest, then ``.metadata``
last: a DCP reader (and ``verify``) sees a checkpoint only once ``.metadata`` exists, and S3 has no
rename of a folder, so the data objects may be visible before it. ``_checkpointer`` decides when
each step runs; this module only moves files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from .._remote import RemoteTier
from ._commit import MANIFEST, METADATA

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RemoteFolder:
    """The objects of one save under ``url`` that this rank uploads, and its local folder."""

    url: str  # the checkpoint's URL, no trailing slash
    fs: Any
    rpath: str  # the prefix inside ``fs``
    tier: RemoteTier
    local: str  # this rank's local folder (its files, and the coordinator's metadata)
    uploaded: list[str] = field(default_factory=list)  # names this rank uploaded (or tried to), in order
    upload_s: float = 0.0
    upload_bytes: int = 0

    @classmethod
    def create(cls, tier: RemoteTier, url: str) -> RemoteFolder:
        """Resolve ``url`` (cached fsspec instance) and make this rank's local folder."""
        url = url.rstrip("/")
        fs, rpath = tier.resolve(url)
        local = tier.local_path(rpath)  # <local_dir>/.uploads/<pid>-<n>/<name>: its parent is new
        os.mkdir(local)
        return cls(url, fs, rpath.rstrip("/"), tier, local)

    def _object(self, name: str) -> tuple[str, str]:
        return f"{self.url}/{name}", f"{self.rpath}/{name}"

    def upload(self, name: str) -> None:
        """Upload the local file ``name`` to ``<url>/<name>``; ``UploadError`` on failure."""
        url, key = self._object(name)
        path = os.path.join(self.local, name)
        t = time.perf_counter()
        self.uploaded.append(name)  # before: a failed save deletes the key even if this attempt failed
        self.tier.transfer(url, self.fs, key, path)
        self.upload_s += time.perf_counter() - t
        self.upload_bytes += os.path.getsize(path)

    def hide_previous(self) -> None:
        """Coordinator, before any rank uploads: delete a previous checkpoint's ``.metadata`` (first:
        it is what makes the prefix a checkpoint) and manifest at this prefix, so that it never
        points at data objects of the new save. ``UploadError`` on failure."""
        for name in (METADATA, MANIFEST):
            url, key = self._object(name)
            self.tier.delete_object(url, self.fs, key)

    def remove_uploaded(self) -> None:
        """After a failed save: delete the keys this rank uploaded or tried to (an older object there
        belongs to the hidden previous checkpoint), ``.metadata`` first (best effort)."""
        names = sorted(self.uploaded, key=lambda n: n != METADATA)
        for name in names:
            url, key = self._object(name)
            try:
                self.tier.delete_object(url, self.fs, key)
            except Exception as exc:  # noqa: BLE001 - the save's own error is the one to report
                logger.warning("lazyckpt: could not delete %s after a failed distributed save: %s", url, exc)
        self.uploaded.clear()

    def finish_local(self, keep: bool) -> None:
        """The local folder once the save ended: kept as it is (``keep``: this rank's upload failed,
        the error names it); else every uploaded file goes to the tier's ``keep_local`` mirror
        (``<local_dir>/<protocol>/<key>``) or is deleted, and the folder is removed."""
        if keep:
            return
        for name in self.uploaded:
            url, key = self._object(name)
            self.tier.finish_local(url, key, os.path.join(self.local, name))
        with contextlib.suppress(OSError):
            shutil.rmtree(os.path.dirname(self.local))
