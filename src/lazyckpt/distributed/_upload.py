"""One distributed save's prefix in an object store (``s3://bucket/run/step-100``), as one rank sees it.

Every rank writes its data file into a folder of its own on its node's local disk
(``<local_dir>/.uploads/<pid>-<n>/<name>/``, the remote tier's), then uploads it from the commit
thread through ``RemoteTier.transfer`` (the single-file path's PutObject / multipart upload,
retries, abort). Data files have names of their own per save (``__<rank>_0.<token>-<n>.distcp``),
so uploading them changes nothing a reader sees. The coordinator uploads the extra files and the
manifest, then ``.metadata`` last: a DCP reader (and ``verify``) sees a checkpoint only once
``.metadata`` exists, and one PUT of it replaces a previous checkpoint at the prefix; then the
previous checkpoint's data files are deleted. ``_checkpointer`` decides when each step runs; this
module only moves files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.storage import remote as _remote
from lazyckpt.storage.remote import RemoteTier

from ._commit import METADATA

_DATA_SUFFIX = ".distcp"

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
    shared: bool = False  # keys a previous checkpoint here also uses were touched (.metadata, manifest, extras)
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
        self.shared = self.shared or not name.endswith(_DATA_SUFFIX)
        self.tier.transfer(url, self.fs, key, path)
        self.upload_s += time.perf_counter() - t
        self.upload_bytes += os.path.getsize(path)

    def hide_previous(self) -> None:
        """Delete a previous checkpoint's ``.metadata`` at this prefix (what makes it a checkpoint),
        before keys it shares with the new one are replaced. ``UploadError`` on failure."""
        self.shared = True
        url, key = self._object(METADATA)
        self.tier.delete_object(url, self.fs, key)

    def remove_uploaded(self) -> None:
        """After a failed save: delete the keys this rank uploaded or tried to (best effort). Its own
        data files only, unless keys shared with a previous checkpoint here were touched: then that
        one is no longer whole: ``.metadata`` goes first (the failed PUT of it may have landed), and
        its data files last."""
        names = [n for n in self.uploaded if n != METADATA]
        if self.shared:
            names.insert(0, METADATA)
        for name in names:
            url, key = self._object(name)
            try:
                self.tier.delete_object(url, self.fs, key)
            except Exception as exc:  # noqa: BLE001 - the save's own error is the one to report
                logger.warning("lazyckpt: could not delete %s after a failed distributed save: %s", url, exc)
        if self.shared:  # the hidden previous checkpoint's data files too: nothing names them any more
            self.remove_stale(set())
        self.uploaded.clear()

    def remove_stale(self, keep: set[str]) -> None:
        """Coordinator, once the new ``.metadata`` is in place: delete the data files at this prefix
        that it does not name (a previous checkpoint's, any world size). Best effort: a reader that
        opened the previous ``.metadata`` just before may miss them."""
        try:
            self.fs.invalidate_cache(self.rpath)
            names = [os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.rpath, detail=False)]
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            logger.warning("lazyckpt: could not list %s to delete a previous checkpoint's files: %s", self.url, exc)
            return
        for name in names:
            if name.endswith(_DATA_SUFFIX) and name not in keep:
                url, key = self._object(name)
                try:
                    self.tier.delete_object(url, self.fs, key)
                except Exception as exc:  # noqa: BLE001 - housekeeping only
                    logger.warning("lazyckpt: could not delete %s (a previous checkpoint's file): %s", url, exc)

    def abort_unfinished(self) -> None:
        """Coordinator, while no rank of this checkpointer uploads to the prefix any more (before
        the outcome is published): abort every unfinished multipart upload of a data file directly
        under it (a killed rank's, of this save or an earlier one). S3 only; best effort."""
        if not _remote._is_s3(self.fs):
            return
        try:
            bucket, key, _ = self.fs.split_path(self.rpath)
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/")
            for up in listed.get("Uploads", []):
                name = up["Key"][len(key) + 1 :]
                if "/" not in name and name.endswith(_DATA_SUFFIX):
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                    logger.info("lazyckpt: aborted an unfinished multipart upload to %s/%s", self.url, name)
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            logger.debug("lazyckpt: listing unfinished uploads under %s failed: %s", self.url, exc)

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
        if self.tier.options.keep_local:
            self._drop_stale_mirrored()

    def _drop_stale_mirrored(self) -> None:
        """In the ``keep_local`` mirror: this rank's data files of earlier saves to this prefix."""
        mine = {n.split(".", 1)[0] for n in self.uploaded if n.endswith(_DATA_SUFFIX)}  # "__<rank>_0"
        mirror = os.path.join(self.tier.local_dir, self.url.split("://", 1)[0], self.rpath.lstrip("/"))
        with contextlib.suppress(OSError):
            for name in os.listdir(mirror):
                if name.endswith(_DATA_SUFFIX) and name.split(".", 1)[0] in mine and name not in self.uploaded:
                    os.unlink(os.path.join(mirror, name))
