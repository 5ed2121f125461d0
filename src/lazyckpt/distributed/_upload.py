"""One distributed save's prefix in an object store, as one rank sees it (``commit/prefix.py``'s
protocol). Data files are named per save, so uploading them changes nothing a reader sees; the
coordinator uploads ``.metadata`` last, then deletes the previous checkpoint's data files. This
module only moves files; ``_checkpointer.py`` and ``_decide.py`` decide when.
"""

from __future__ import annotations

import contextlib
import logging
import os

from lazyckpt.commit.prefix import Prefix
from lazyckpt.core import remote as _remote
from lazyckpt.core.remote import RemoteTier

from ._commit import METADATA

_DATA_SUFFIX = ".distcp"

logger = logging.getLogger(__name__)


class RemoteFolder(Prefix):
    """The objects of one save under ``url`` that this rank uploads, and its local folder, plus DCP's
    housekeeping (stale data files, unfinished multipart uploads, the ``keep_local`` mirror)."""

    @classmethod
    def create(cls, tier: RemoteTier, url: str) -> RemoteFolder:
        """Resolve ``url`` (cached fsspec instance) and make this rank's local folder."""
        base = Prefix.at(tier, url, METADATA)
        return cls(base.url, base.fs, base.rpath, tier, base.local, METADATA)

    def upload(self, name: str) -> None:
        self.shared = self.shared or not name.endswith(_DATA_SUFFIX)  # extras, manifest, .metadata
        super().upload(name)

    def remove_uploaded(self) -> None:
        """After a failed save: the prefix protocol's cleanup, and the previous checkpoint's data
        files too when shared keys were touched (it is no longer whole)."""
        shared = self.shared
        super().remove_uploaded()
        if shared:  # nothing names the hidden previous checkpoint's data files any more
            self.remove_stale(set())

    def remove_stale(self, keep: set[str]) -> None:
        """Coordinator, once the new ``.metadata`` is in place: delete the data files at this prefix
        not in ``keep``. Best effort."""
        try:
            self.fs.invalidate_cache(self.rpath)
            names = [os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.rpath, detail=False)]
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            logger.warning("lazyckpt: could not list %s to delete a previous checkpoint's files: %s", self.url, exc)
            return
        for name in names:
            if name.endswith(_DATA_SUFFIX) and name not in keep:
                url, key = self.object(name)
                try:
                    self.tier.delete_object(url, self.fs, key)
                except Exception as exc:  # noqa: BLE001 - housekeeping only
                    logger.warning("lazyckpt: could not delete %s (a previous checkpoint's file): %s", url, exc)

    def abort_unfinished(self) -> None:
        """Coordinator, once no rank uploads to the prefix (before the outcome is published): abort
        unfinished multipart uploads of data files under it. S3 only; best effort."""
        if not _remote.is_s3(self.fs):
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

    def finish_local(self, keep: bool = False, folder: str | None = None) -> None:
        """The prefix protocol's local cleanup (none with ``keep``), then prune the ``keep_local`` mirror."""
        if keep:
            return
        super().finish_local(keep, folder)
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
