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

from lazyckpt.commit.prefix import Prefix
from lazyckpt.storage import remote as _remote
from lazyckpt.storage.remote import RemoteTier

from ._commit import METADATA

_DATA_SUFFIX = ".distcp"

logger = logging.getLogger(__name__)


class RemoteFolder(Prefix):
    """The objects of one save under ``url`` that this rank uploads, and its local folder: the
    prefix protocol (``commit/prefix.py``) with ``.metadata`` last, plus DCP's housekeeping (the
    previous checkpoint's data files, unfinished multipart uploads, the ``keep_local`` mirror)."""

    @classmethod
    def create(cls, tier: RemoteTier, url: str) -> RemoteFolder:
        """Resolve ``url`` (cached fsspec instance) and make this rank's local folder."""
        base = Prefix.at(tier, url, METADATA)
        return cls(base.url, base.fs, base.rpath, tier, base.local, METADATA)

    def upload(self, name: str) -> None:
        self.shared = self.shared or not name.endswith(_DATA_SUFFIX)  # extras, manifest, .metadata
        super().upload(name)

    def remove_uploaded(self) -> None:
        """After a failed save: the prefix protocol's cleanup; when keys shared with a previous
        checkpoint here were touched, that one is no longer whole: its data files go too."""
        shared = self.shared
        super().remove_uploaded()
        if shared:  # nothing names the hidden previous checkpoint's data files any more
            self.remove_stale(set())

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
                url, key = self.object(name)
                try:
                    self.tier.delete_object(url, self.fs, key)
                except Exception as exc:  # noqa: BLE001 - housekeeping only
                    logger.warning("lazyckpt: could not delete %s (a previous checkpoint's file): %s", url, exc)

    def abort_unfinished(self) -> None:
        """Coordinator, while no rank of this checkpointer uploads to the prefix any more (before
        the outcome is published): abort every unfinished multipart upload of a data file directly
        under it (a killed rank's, of this save or an earlier one). S3 only; best effort."""
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
        """The prefix protocol's local cleanup, then (``keep_local``) this rank's data files of
        earlier saves to this prefix leave the mirror."""
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
